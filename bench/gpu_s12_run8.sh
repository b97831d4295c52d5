#!/bin/bash
# Session 12 (issue 15), run 8: at most RUN_S (default 150) seconds: the GPU tests of the
# routed paths on the final tree (tests/torch, tests/triton/test_hopper.py) after the
# host-side launch changes (integer cdiv, the backward config kept with the prepared
# launch) -> $OUT/tests.
DEFAULT_RUN_S=150; . bench/run_budget.sh
mkdir -p $OUT/tests
python3 -m pip install -q --no-deps .whl/*.whl 2>&1 | tail -1
el "GPU tests"
timeout $(cap 135) python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider --timeout 120 \
  tests/torch tests/triton/test_hopper.py > $OUT/tests/gpu_tests.log 2>&1
echo "tests rc $?"; grep -E "passed|failed|FAILED|ERROR|Error" $OUT/tests/gpu_tests.log | tail -8 | cut -c1-300
el "done"
