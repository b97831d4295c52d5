#!/bin/bash
# Session 12 (issue 15), run 4: at most RUN_S (default 480) seconds, everything under $OUT:
#   1. the GPU tests (pytest -m gpu tests/triton tests/torch, xdist from .whl): the D=128
#      persistent forward route and the backward routes 'nhri' / 'nhrie' / 'nhtri' /
#      'nhtrie' -> $OUT/tests;
#   2. where the D=128 backward's dQ adds cost: the routes' kernels beside their no-add
#      and unordered-add diagnostics ('nhri' with a band, 'nhrie' without), 3 rotated
#      rounds -> $OUT/bench.
DEFAULT_RUN_S=480; . bench/run_budget.sh
mkdir -p $OUT/tests $OUT/bench
nvidia-smi --query-gpu=name,clocks.sm,utilization.gpu,memory.used,temperature.gpu --format=csv | tee $OUT/smi.txt
python3 -m pip install -q --no-deps .whl/*.whl 2>&1 | tail -1
el "GPU tests"
timeout $(cap ${TESTS_S:-330}) python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider --timeout 200 \
  tests/triton tests/torch > $OUT/tests/gpu_tests.log 2>&1
echo "tests rc $?"; grep -E "passed|failed|FAILED|ERROR" $OUT/tests/gpu_tests.log | tail -25 | cut -c1-300
el "D=128 diagnostics"
timeout $(cap 110) python3 bench/gpu_hopper_bwd.py --out $OUT/bench --phases bench \
  --dims 128 --configs default,wdkdvq128x64s2nhrie \
  --diag wdkdvq128x64s2nhri,wdkdvq128x64s2nhrie > $OUT/bench/bench.log 2>&1
echo "bench rc $?"
grep -E "^B=|failed" $OUT/bench/bench.log | sed -E 's/_vs_[a-z]*=[0-9.]*//g' | cut -c1-700
el "done"
