#!/bin/bash
# Session 11 (lead): the final H200 run, everything under $OUT, at most RUN_S (default
# 480) seconds:
#   1. the GPU tests (pytest -m gpu tests/triton tests/torch, xdist from .whl) -> $OUT/tests;
#   2. the standings in device time (bench/gpu_ab_trees.py without a base tree: the core
#      API's routed forward / backward, CUDA-graph replays, vs SDPA-cuDNN; D=128 S=2k / 8k
#      causal or not, D=64 S=4k causal or not) -> $OUT/st;
#   3. if time is left: the D=128 S=2k forward, the routed per-tile kernel vs the
#      scheduled persistent one ('ws128x128s2opfPg') vs cuDNN, 5 rotated passes -> $OUT/fwd.
DEFAULT_RUN_S=480; . bench/run_budget.sh   # PYTHONPATH, el / left / cap
mkdir -p $OUT/tests $OUT/st $OUT/fwd
nvidia-smi --query-gpu=name,clocks.sm,utilization.gpu,memory.used,temperature.gpu --format=csv | tee $OUT/smi.txt
python3 -m pip install -q --no-deps .whl/*.whl 2>&1 | tail -1
el "GPU tests"
timeout $(cap ${TESTS_S:-330}) python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider --timeout 200 \
  tests/triton tests/torch > $OUT/tests/gpu_tests.log 2>&1
echo "tests rc $?"; grep -E "passed|failed|FAILED|ERROR" $OUT/tests/gpu_tests.log | tail -25 | cut -c1-300
el "standings"
timeout $(cap 110) python3 bench/gpu_ab_trees.py --out $OUT/st --rounds 2 \
  --cases d128n2k,d128c2k,d128n8k,d128c8k,d64n4k,d64c4k > $OUT/st/st.log 2>&1
echo "standings rc $?"; grep -E "^ab|Error" $OUT/st/st.log | cut -c1-400
if [ $(left) -ge 30 ]; then
  el "forward D=128 S=2k"
  timeout $(left) python3 bench/gpu_hopper_bench.py --out $OUT/fwd --phases bench --dims 128 \
    --seqs 2048 --skip-bwd --no-flex --fwd-variants ws128x128s2opfPg --repeat 5 \
    --names hopper,hopper-ws128x128s2opfPg,sdpa-cudnn > $OUT/fwd/fwd.log 2>&1
  echo "fwd rc $?"; grep -E "^fwd|^B=|failed|TFLOP" $OUT/fwd/fwd.log | tail -8 | cut -c1-400
fi
el "done"
