#!/bin/bash
# Session 12 (issue 15), run 6: at most RUN_S (default 240) seconds, everything under $OUT:
# where the host time of a training step goes on the H200 machine with this session's
# routes (the persistent D=128 forward, the dQ-inside backward 'nhrie' / 'nhri'):
# bench/torch_host_profile.py --ablate (host µs per step at S=128, cProfile of module
# steps, GPU gaps and the ablation at B=4 H=16 S=2k D=128 bf16) -> $OUT/host.  First
# (run 6b) the GPU test of the persistent routes at B = H = 1, which run 6's first try
# found failing to compile (BH = 1 specialised) -> $OUT/tests.
DEFAULT_RUN_S=240; . bench/run_budget.sh
mkdir -p $OUT/host $OUT/tests
python3 -m pip install -q --no-deps .whl/*.whl 2>&1 | tail -1
el "GPU test: one head"
timeout $(cap 90) python3 -m pytest -q -m gpu -n 6 -p no:cacheprovider --timeout 80 \
  tests/triton/test_hopper_fwd_masks.py -k one_head > $OUT/tests/gpu_tests.log 2>&1
echo "tests rc $?"; grep -E "passed|failed|FAILED|ERROR|Error" $OUT/tests/gpu_tests.log | tail -8 | cut -c1-300
nvidia-smi --query-gpu=name,clocks.sm,utilization.gpu,memory.used,temperature.gpu --format=csv
el "host profile"
timeout $(cap 220) python3 bench/torch_host_profile.py --out $OUT/host --ablate \
  > $OUT/host/host.log 2>&1
echo "host rc $?"; tail -40 $OUT/host/host.log | cut -c1-300
el "done"
