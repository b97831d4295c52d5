#!/bin/bash
# Session 13 (issue 15), run 1: direct launches on by default at every Hopper launch
# site.  At most RUN_S (default 570) seconds, everything under $OUT:
#   1. the direct-launch GPU tests (bitwise vs Triton's launches on every route) -> tests;
#   2. the host ablation (bench/torch_host_profile.py --ablate: module / kernel with and
#      without direct launches, on autograd's device thread or the calling thread;
#      B=4 H=16 S=2k D=128 bf16 and host per step at S=128) -> abl;
#   3. the whole GPU suite (pytest -m gpu tests/triton tests/torch) -> tests;
#   4. windows and documents vs FlexAttention with the host (eager, as shipped and with
#      the Hopper forward + backward on Documents) -> masks.
DEFAULT_RUN_S=570; . bench/run_budget.sh
mkdir -p $OUT/tests $OUT/abl $OUT/masks
nvidia-smi --query-gpu=name,clocks.sm,utilization.gpu,memory.used,temperature.gpu --format=csv | tee $OUT/smi.txt
python3 -m pip install -q --no-deps .whl/*.whl 2>&1 | tail -1
el "direct tests"
timeout $(cap 120) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider --timeout 100 \
  tests/triton/test_hopper_direct.py tests/triton/test_launch_cache.py > $OUT/tests/direct.log 2>&1
echo "direct tests rc $?"; grep -E "passed|failed|FAILED|Error" $OUT/tests/direct.log | tail -25 | cut -c1-400
el "host ablation"
timeout $(cap 110) python3 bench/torch_host_profile.py --out $OUT/abl --ablate --rounds 5 \
  > $OUT/abl/abl.log 2>&1
echo "ablation rc $?"; tail -6 $OUT/abl/abl.log | cut -c1-900
el "GPU tests"
timeout $(cap ${TESTS_S:-300}) python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider --timeout 200 \
  tests/triton tests/torch > $OUT/tests/gpu_tests.log 2>&1
echo "tests rc $?"; grep -E "passed|failed|FAILED|ERROR" $OUT/tests/gpu_tests.log | tail -25 | cut -c1-300
el "masks vs Flex"
timeout $(cap 150) python3 bench/gpu_masks_vs_flex.py --out $OUT/masks --budget 120 \
  --masks doc_eq512,doc_rand_causal,sliding:512 --shapes 4096x128 \
  --variants default,hopfwd+hopbwd --repeat 2 > $OUT/masks/masks.log 2>&1
echo "masks rc $?"; tail -20 $OUT/masks/masks.log | cut -c1-300
el "done"
