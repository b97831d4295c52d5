#!/bin/bash
# Session 13 (issue 15), run 3: the whole GPU suite with direct launches on by default
# (every launch site, portable and Hopper), then where the module step's host time goes
# at S=2k (bench/torch_host_profile.py without --ablate: host per step at S=128,
# cProfile of module / kernel steps, the GPU's idle gaps in module / kernel steps at
# B=4 H=16 S=2k D=128 bf16).  At most RUN_S (default 540) seconds, under $OUT.
DEFAULT_RUN_S=540; . bench/run_budget.sh
mkdir -p $OUT/tests $OUT/prof
nvidia-smi --query-gpu=name,clocks.sm,utilization.gpu,memory.used,temperature.gpu --format=csv | tee $OUT/smi.txt
python3 -m pip install -q --no-deps .whl/*.whl 2>&1 | tail -1
el "GPU tests"
timeout $(cap ${TESTS_S:-400}) python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider --timeout 200 \
  -rfE tests/triton tests/torch > $OUT/tests/gpu_tests.log 2>&1
echo "tests rc $?"; grep -E "passed|failed|FAILED|ERROR" $OUT/tests/gpu_tests.log | tail -25 | cut -c1-300
el "host profile"
timeout $(cap 120) python3 bench/torch_host_profile.py --out $OUT/prof --n 100 --rounds 3 \
  > $OUT/prof/prof.log 2>&1
echo "profile rc $?"; tail -12 $OUT/prof/prof.log | cut -c1-600
el "done"
