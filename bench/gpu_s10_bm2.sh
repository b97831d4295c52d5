#!/bin/bash
# Session 10 (helper "bm"), run 2: the GPU tests run 1 ran out of time for, with D=64
# without a mask routed to 'wdkdvq128x128s2nht': test_hopper_bwd_dq.py's ws-dq float64
# tests (D=64 and 128: every ws dq config incl. the new one; long chains, GQA, the band
# with empty rows) and test_hopper.py's routed backward at D=64 without a mask
# (float64, bf16 + fp16, 3 shapes); pytest-xdist from .whl -> $OUT/tests.log.
DEFAULT_RUN_S=240; . bench/run_budget.sh
pip install -q --no-index --find-links .whl pytest-xdist pytest-timeout > /dev/null 2>&1
el "GPU tests"
timeout $(( $(left) - 5 )) python3 -m pytest -q -m gpu -p no:cacheprovider -n 6 \
  tests/triton/test_hopper_bwd_dq.py tests/triton/test_hopper.py \
  -k "ws_dq_against or (backward_matches and none-64)" > $OUT/tests.log 2>&1
echo "tests rc $?"
tail -8 $OUT/tests.log | cut -c1-300
el "done"
