#!/bin/bash
# Session 10 (lead, issue 15): one H200 run, everything under $OUT, at most RUN_S
# (default 480) seconds:
#   1. A/B of the edge-tile masks as per-row key limits (forward: every Hopper kernel;
#      backward: the ws consumers with a band) against the tree before them (fa68aa4,
#      .runs/lead/base.tar imported as anyattn_base): bitwise equality of out / stats /
#      dq / dk / dv, and the routed forward and backward TFLOP/s of both trees beside
#      SDPA-cuDNN, 3 rotated rounds, D=64 causal S=2k / 4k / 8k, D=128 causal S=2k / 8k,
#      D=128 window 512 S=4k, D=64 / D=128 without a mask (controls) -> $OUT/ab;
#   2. the GPU tests (pytest -m gpu tests/triton tests/torch, xdist) -> $OUT/tests.
DEFAULT_RUN_S=480; . bench/run_budget.sh   # PYTHONPATH, el / left / cap
mkdir -p $OUT/ab $OUT/tests /tmp/base
nvidia-smi --query-gpu=name,clocks.sm,utilization.gpu,memory.used,temperature.gpu --format=csv | tee $OUT/smi.txt
python3 -m pip install -q --no-deps .whl/*.whl 2>&1 | tail -1
tar -xf .runs/lead/base.tar -C /tmp/base && mv /tmp/base/src/anyattn /tmp/base/anyattn_base
el "A/B"
timeout $(cap ${AB_S:-220}) python3 bench/gpu_ab_trees.py --base-dir /tmp/base --out $OUT/ab \
  --cases d64c2k,d64c4k,d64c8k,d128c2k,d128c8k,d128w4k,d64n4k,d128n2k > $OUT/ab/ab.log 2>&1
echo "ab rc $?"; grep -E "^ab|Error" $OUT/ab/ab.log | cut -c1-400
el "GPU tests"
timeout $(cap ${TESTS_S:-250}) python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider --timeout 150 \
  tests/triton tests/torch > $OUT/tests/gpu_tests.log 2>&1
echo "tests rc $?"; grep -E "passed|failed|FAILED|ERROR" $OUT/tests/gpu_tests.log | tail -25 | cut -c1-300
el "done"
