#!/bin/bash
# Session 12 (issue 15), run 1: at most RUN_S (default 300) seconds, everything under $OUT:
#   1. the GPU tests of tests/triton/test_hopper_bwd_dq.py (every variant; 'i', the
#      interleaved dQ staging rows, bitwise equal to its base config) -> $OUT/tests;
#   2. backward timings, 3 rotated rounds: D=128 (the route 'nhr' vs 'nhri') -> $OUT/bench;
#      D=64 S=4k (the route 'nhtr' 128-row vs 'nhtri') -> $OUT/bench64.
DEFAULT_RUN_S=300; . bench/run_budget.sh
mkdir -p $OUT/tests $OUT/bench $OUT/bench64
nvidia-smi --query-gpu=name,clocks.sm,utilization.gpu,memory.used,temperature.gpu --format=csv
python3 -m pip install -q --no-deps .whl/*.whl 2>&1 | tail -1
el "GPU tests"
timeout $(cap 100) python3 -m pytest -q -m gpu -n 6 -p no:cacheprovider --timeout 90 \
  tests/triton/test_hopper_bwd_dq.py > $OUT/tests/gpu_tests.log 2>&1
echo "tests rc $?"; grep -E "passed|failed|FAILED|ERROR|Error" $OUT/tests/gpu_tests.log | tail -8 | cut -c1-300
el "D=128 timings"
timeout $(cap 80) python3 bench/gpu_hopper_bwd.py --out $OUT/bench --phases bench \
  --dims 128 --configs default,wdkdvq128x64s2nhri --diag '' > $OUT/bench/bench.log 2>&1
echo "bench rc $?"
grep -E "^B=|failed" $OUT/bench/bench.log | sed -E 's/_vs_[a-z]*=[0-9.]*//g' | cut -c1-600
el "D=64 timings"
timeout $(cap 60) python3 bench/gpu_hopper_bwd.py --out $OUT/bench64 --phases bench \
  --dims 64 --configs default,wdkdvq128x128s2nhtri --diag '' > $OUT/bench64/bench.log 2>&1
echo "bench64 rc $?"
grep -E "^B=|failed" $OUT/bench64/bench.log | sed -E 's/_vs_[a-z]*=[0-9.]*//g' | cut -c1-600
el "done"
