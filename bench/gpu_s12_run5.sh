#!/bin/bash
# Session 12 (issue 15), run 5: at most RUN_S (default 300) seconds, everything under $OUT:
#   1. the GPU tests of tests/triton/test_hopper_bwd_dq.py (the 64-row transposed
#      consumers at D=128 with 'i' / 'i' + 'e', bitwise their base) and of
#      test_hopper_fwd_masks.py (its capture helper) -> $OUT/tests;
#   2. D=128 backward timings, 3 rotated rounds: the routes ('nhri' with a band, 'nhrie'
#      without) vs 'nhtri' / 'nhtrie' -> $OUT/bench.
DEFAULT_RUN_S=300; . bench/run_budget.sh
mkdir -p $OUT/tests $OUT/bench
nvidia-smi --query-gpu=name,clocks.sm,utilization.gpu,memory.used,temperature.gpu --format=csv
python3 -m pip install -q --no-deps .whl/*.whl 2>&1 | tail -1
el "GPU tests"
timeout $(cap 120) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider --timeout 110 \
  tests/triton/test_hopper_bwd_dq.py tests/triton/test_hopper_fwd_masks.py \
  > $OUT/tests/gpu_tests.log 2>&1
echo "tests rc $?"; grep -E "passed|failed|FAILED|ERROR|Error" $OUT/tests/gpu_tests.log | tail -8 | cut -c1-300
el "D=128 timings"
timeout $(cap 100) python3 bench/gpu_hopper_bwd.py --out $OUT/bench --phases bench \
  --dims 128 --configs default,wdkdvq128x64s2nhrie,wdkdvq128x64s2nhtri,wdkdvq128x64s2nhtrie \
  --diag '' > $OUT/bench/bench.log 2>&1
echo "bench rc $?"
grep -E "^B=|failed" $OUT/bench/bench.log | sed -E 's/_vs_[a-z]*=[0-9.]*//g' | cut -c1-700
el "done"
