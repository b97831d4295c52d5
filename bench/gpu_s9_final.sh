#!/bin/bash
# Session 9 (lead): the final H200 run, everything under $OUT, at most RUN_S seconds.
#   1. autograd's hand-over pinned: bench/autograd_handover.py as is, on one core
#      (taskset -c 3) and on two (taskset -c 3,4) — is the device thread's slowdown the
#      threads' cores trading the Python objects' cache lines?
#   2. cProfile of the Hopper routes' raw launches (bench/hopper_launch_profile.py);
#   3. KeepMask and causal documents through the Hopper backward vs Flex
#      (bench/gpu_s9_bwd_masks2.sh, helper "docs"'s run 2, not run in its share);
#   4. the GPU tests (pytest -m gpu tests/triton tests/torch, xdist from .whl).
DEFAULT_RUN_S=580; . bench/run_budget.sh   # PYTHONPATH, el / left / cap
mkdir -p $OUT/agh $OUT/tests
nvidia-smi --query-gpu=name,clocks.sm,utilization.gpu,memory.used,temperature.gpu --format=csv | tee $OUT/smi.txt
nproc; python3 -m pip install -q --no-deps .whl/*.whl 2>&1 | tail -1
el "autograd hand-over, pinned"
timeout $(cap 30) python3 bench/autograd_handover.py --out $OUT/agh/free --steps 200 2>&1 | grep -v Warn | tail -8
timeout $(cap 30) taskset -c 3 python3 bench/autograd_handover.py --out $OUT/agh/core3 --steps 200 2>&1 | grep -v Warn | tail -8
timeout $(cap 30) taskset -c 3,4 python3 bench/autograd_handover.py --out $OUT/agh/core34 --steps 200 2>&1 | grep -v Warn | tail -8
el "launch profile"
timeout $(cap 70) python3 bench/hopper_launch_profile.py --out $OUT/prof 2>&1 | grep -v Warn | tail -6
el "masks run 2"
mkdir -p $OUT/m2; OUT=$OUT/m2 RUN_S=$(cap 100) timeout $(cap 105) bash bench/gpu_s9_bwd_masks2.sh 2>&1 | tail -12
el "GPU tests"
timeout $(cap ${TESTS_S:-300}) python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider --timeout 120 \
  tests/triton tests/torch > $OUT/tests/gpu_tests.log 2>&1
echo "tests rc $?"; grep -E "passed|failed|FAILED|ERROR" $OUT/tests/gpu_tests.log | tail -25 | cut -c1-300
el "done"
cd $OUT && tar -czf all.tgz agh prof m2 tests smi.txt && rm -rf agh prof m2 tests
