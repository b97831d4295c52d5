#!/bin/bash
# Session 11 (issue 15 backward), run 3: 'q' (a tile's dQ products before its dK product,
# dQ staged while dK runs) on top of the new routes ('nhr' at D=128, 'nhr' s3 at D=64
# with a band); at most RUN_S (default 260) seconds, everything under $OUT:
#   1. the GPU tests of tests/triton/test_hopper_bwd_dq.py (every variant: float64, both
#      add orders, bitwise repeat; 'r' / 'z' / 'q' bitwise equal to 'nh') -> $OUT/tests;
#   2. float64 checks (bench/gpu_hopper_bwd.py's cases, bf16) of the default and 'q' at
#      D=128 and D=64 -> $OUT/chk;
#   3. timings, 3 rotated rounds: D=128 S=2k / 8k causal or not ('nhr', 'nhrq', 'nh',
#      SDPA-cuDNN) -> $OUT/bench; D=64 S=4k ('nhr' s3, 'nhrq' s3, 'nht' 128-row) ->
#      $OUT/bench64.
DEFAULT_RUN_S=260; . bench/run_budget.sh
NH=wdkdvq128x64s2nh
Q=wdkdvq128x64s2nhrq
Q3=wdkdvq128x64s3nhrq
T128=wdkdvq128x128s2nht
mkdir -p $OUT/tests $OUT/chk $OUT/bench $OUT/bench64
nvidia-smi --query-gpu=name,clocks.sm,utilization.gpu,memory.used,temperature.gpu --format=csv
python3 -m pip install -q --no-deps .whl/*.whl 2>&1 | tail -1
el "GPU tests"
timeout $(cap 100) python3 -m pytest -q -m gpu -n 6 -p no:cacheprovider --timeout 90 \
  tests/triton/test_hopper_bwd_dq.py > $OUT/tests/gpu_tests.log 2>&1
echo "tests rc $?"; grep -E "passed|failed|FAILED|ERROR" $OUT/tests/gpu_tests.log | tail -8 | cut -c1-300
el "check"
timeout $(cap 60) python3 bench/gpu_hopper_bwd.py --out $OUT/chk --phases compile,check \
  --dtypes bfloat16 --configs default,$Q,$Q3 > $OUT/chk/check.log 2>&1
echo "check rc $?"; grep -E "^checks|error|Error" $OUT/chk/check.log | cut -c1-250
el "D=128 timings"
timeout $(cap 70) python3 bench/gpu_hopper_bwd.py --out $OUT/bench --phases bench \
  --dims 128 --configs default,$Q,$NH --diag '' > $OUT/bench/bench.log 2>&1
echo "bench rc $?"
grep -E "^B=|failed" $OUT/bench/bench.log | sed -E 's/_vs_[a-z]*=[0-9.]*//g' | cut -c1-700
if [ $(left) -ge 20 ]; then
  el "D=64 timings"
  timeout $(left) python3 bench/gpu_hopper_bwd.py --out $OUT/bench64 --phases bench \
    --dims 64 --configs default,$Q3,$T128 --diag '' > $OUT/bench64/bench.log 2>&1
  echo "bench64 rc $?"
  grep -E "^B=|failed" $OUT/bench64/bench.log | sed -E 's/_vs_[a-z]*=[0-9.]*//g' | cut -c1-700
fi
el "done"
