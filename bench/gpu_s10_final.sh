#!/bin/bash
# Session 10 (lead): the final H200 run, everything under $OUT, at most RUN_S (default
# 480) seconds:
#   1. the GPU tests (pytest -m gpu tests/triton tests/torch, xdist from .whl) -> $OUT/tests;
#   2. the standings in device time (bench/gpu_ab_trees.py without a base tree: this
#      tree's routed forward / backward through the core API, CUDA-graph replays, vs
#      SDPA-cuDNN; D=128 S=2k / 8k causal or not, D=64 S=4k causal or not) -> $OUT/st.
DEFAULT_RUN_S=480; . bench/run_budget.sh   # PYTHONPATH, el / left / cap
mkdir -p $OUT/tests $OUT/st
nvidia-smi --query-gpu=name,clocks.sm,utilization.gpu,memory.used,temperature.gpu --format=csv | tee $OUT/smi.txt
python3 -m pip install -q --no-deps .whl/*.whl 2>&1 | tail -1
el "GPU tests"
timeout $(cap ${TESTS_S:-340}) python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider --timeout 200 \
  tests/triton tests/torch > $OUT/tests/gpu_tests.log 2>&1
echo "tests rc $?"; grep -E "passed|failed|FAILED|ERROR" $OUT/tests/gpu_tests.log | tail -25 | cut -c1-300
el "standings"
timeout $(left) python3 bench/gpu_ab_trees.py --out $OUT/st --rounds 2 \
  --cases d128n2k,d128c2k,d128n8k,d128c8k,d64n4k,d64c4k > $OUT/st/st.log 2>&1
echo "standings rc $?"; grep -E "^ab|Error" $OUT/st/st.log | cut -c1-400
el "done"
