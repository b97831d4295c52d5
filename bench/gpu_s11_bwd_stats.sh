#!/bin/bash
# Session 11 (issue 15 backward): one H200 run of 'nh' with the row statistics staged by
# the producer ('r') and / or the dQ staging buffers swizzled at 32 bytes ('z')
# (configs.WS_DQR_BWD_VARIANTS) beside the default and SDPA-cuDNN, from the repository
# root, everything under $OUT, at most RUN_S (default 330) seconds:
#   1. the GPU tests of tests/triton/test_hopper_bwd_dq.py (the new configs: float64,
#      both add orders, bitwise repeat, bitwise equal to 'nh') -> $OUT/tests (cap 110);
#   2. compile + float64 checks (bench/gpu_hopper_bwd.py's cases, bf16) of the default
#      and the three variants -> $OUT/chk (cap CHECK_S 70);
#   3. D=128 bf16 timings, S=2k / 8k causal or not, 3 rotated rounds of the routes
#      (portable delta + the kernel + the dq conversion), SDPA-cuDNN -> $OUT/bench
#      (cap BENCH_S 90);
#   4. D=64 S=4k (the band's route is 'nh') -> $OUT/bench64 (the time left).
DEFAULT_RUN_S=330; . bench/run_budget.sh   # PYTHONPATH, el / left / cap
R=wdkdvq128x64s2nhr
Z=wdkdvq128x64s2nhz
RZ=wdkdvq128x64s2nhrz
mkdir -p $OUT/tests $OUT/chk $OUT/bench $OUT/bench64
nvidia-smi --query-gpu=name,clocks.sm,utilization.gpu,memory.used,temperature.gpu \
  --format=csv | tee $OUT/smi.txt
python3 -m pip install -q --no-deps .whl/*.whl 2>&1 | tail -1
el "GPU tests"
timeout $(cap 110) python3 -m pytest -q -m gpu -n 6 -p no:cacheprovider --timeout 100 \
  tests/triton/test_hopper_bwd_dq.py > $OUT/tests/gpu_tests.log 2>&1
echo "tests rc $?"; grep -E "passed|failed|FAILED|ERROR" $OUT/tests/gpu_tests.log | tail -12 | cut -c1-300
el "compile + check"
timeout $(cap ${CHECK_S:-70}) python3 bench/gpu_hopper_bwd.py --out $OUT/chk \
  --phases compile,check --dtypes bfloat16 --configs default,$R,$Z,$RZ > $OUT/chk/check.log 2>&1
echo "check rc $?"
grep -E "^check|error|Error" $OUT/chk/check.log | cut -c1-300
el "D=128 timings"
timeout $(cap ${BENCH_S:-90}) python3 bench/gpu_hopper_bwd.py --out $OUT/bench \
  --phases roof,bench --dims 128 --configs default,$R,$Z,$RZ --diag '' \
  > $OUT/bench/bench.log 2>&1
echo "bench rc $?"
grep -E "^B=|^roof|failed" $OUT/bench/bench.log | sed -E 's/_vs_[a-z]*=[0-9.]*//g' | cut -c1-900
if [ $(left) -ge 20 ]; then
  el "D=64 timings"
  timeout $(left) python3 bench/gpu_hopper_bwd.py --out $OUT/bench64 --phases bench \
    --dims 64 --configs default,$R,$RZ --diag '' > $OUT/bench64/bench.log 2>&1
  echo "bench64 rc $?"
  grep -E "^B=|failed" $OUT/bench64/bench.log | sed -E 's/_vs_[a-z]*=[0-9.]*//g' | cut -c1-900
fi
el "done"
