#!/bin/bash
# Session 10 (issue 15 backward, helper "bm"): one H200 run of the transposed-consumer ws
# backward with query tiles of 128 rows at D=64 ('wdkdvq128x128s2nht', configs.
# WS_DQT_BWD_VARIANTS[64][1]) beside 'nht' (BM=64), the D=64 routes ('nh': causal / band;
# the ws dK/dV + portable dQ 'wdkdv128x64s2': no mask) and SDPA-cuDNN, from the
# repository root, everything under $OUT, at most RUN_S (default 400) seconds:
#   1. compile + float64 checks of the new config (bench/gpu_hopper_bwd.py's D=64 cases:
#      bf16 + fp16, causal / none / window / GQA / odd sizes / empty rows / strides, NaN-
#      poisoned outputs, bitwise repeat, both dQ add orders, routed) -> $OUT/chk;
#   2. the GPU tests of the ws dq configs at D=64 (tests/triton/test_hopper_bwd_dq.py:
#      every ws dq config incl. the new one, long chains, GQA, the band with empty rows)
#      -> $OUT/tests.log;
#   3. D=64 S=4k timings (B=4 H=32), causal or not, 3 rotated rounds of the routes ->
#      $OUT/bench64; then S=2k (B=8) and 8k (B=2) if time is left -> $OUT/bench64b.
DEFAULT_RUN_S=400; . bench/run_budget.sh   # PYTHONPATH, el / left / cap
NH=wdkdvq128x64s2nh
T=wdkdvq128x64s2nht
T2=wdkdvq128x128s2nht
W=wdkdv128x64s2
mkdir -p $OUT/chk $OUT/bench64 $OUT/bench64b
nvidia-smi --query-gpu=name,clocks.sm,utilization.gpu,memory.used,temperature.gpu \
  --format=csv | tee $OUT/smi.txt
el "compile + check"
timeout $(cap ${CHECK_S:-90}) python3 bench/gpu_hopper_bwd.py --out $OUT/chk \
  --phases compile,check --dims 64 --configs default,$T2 > $OUT/chk/check.log 2>&1
echo "check rc $?"
grep -E "^check|error|Error" $OUT/chk/check.log | cut -c1-300
el "GPU tests (D=64)"
timeout $(cap ${TEST_S:-110}) python3 -m pytest -q -m gpu -p no:cacheprovider \
  tests/triton/test_hopper_bwd_dq.py -k "64" > $OUT/tests.log 2>&1
echo "tests rc $?"
tail -5 $OUT/tests.log | cut -c1-300
el "D=64 S=4k timings"
timeout $(cap ${BENCH_S:-90}) python3 bench/gpu_hopper_bwd.py --out $OUT/bench64 \
  --phases bench --dims 64 --configs default,$T,$T2,$W --diag '' \
  > $OUT/bench64/bench.log 2>&1
echo "bench64 rc $?"
grep -E "^B=|failed" $OUT/bench64/bench.log | sed -E 's/_vs_[a-z]*=[0-9.]*//g' | cut -c1-900
if [ $(left) -ge 40 ]; then
  el "D=64 S=2k / 8k timings"
  timeout $(( $(left) - 5 )) python3 bench/gpu_hopper_bwd.py --out $OUT/bench64b \
    --phases bench --dims 64 --configs default,$T,$T2,$W --diag '' \
    --shapes "8,32,2048,64;2,32,8192,64" > $OUT/bench64b/bench.log 2>&1
  echo "bench64b rc $?"
  grep -E "^B=|failed" $OUT/bench64b/bench.log | sed -E 's/_vs_[a-z]*=[0-9.]*//g' | cut -c1-900
fi
el "done"
