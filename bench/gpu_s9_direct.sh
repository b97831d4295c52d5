#!/bin/bash
# Session 9 (lead), run against commit cb36fcf (reverted after this run: see LOG
# "session 9, lead"): direct launches on the Hopper routes — the GPU tests with
# ANYATTN_TRITON_DIRECT_LAUNCH=1 (every launch after a site's first through
# direct.Direct), then host µs per raw fwd+bwd step with and without.
DEFAULT_RUN_S=300; . bench/run_budget.sh   # PYTHONPATH, el / left / cap
mkdir -p $OUT/d
python3 -m pip install -q --no-deps .whl/*.whl 2>&1 | tail -1
el "GPU tests, direct launches"
ANYATTN_TRITON_DIRECT_LAUNCH=1 timeout $(cap 220) python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider \
  --timeout 120 tests/triton > $OUT/d/gpu_tests_direct.log 2>&1
echo "tests rc $?"; grep -E "passed|failed|FAILED|ERROR" $OUT/d/gpu_tests_direct.log | tail -15 | cut -c1-300
el "launch profile"
timeout $(cap 45) python3 bench/hopper_launch_profile.py --out $OUT/d/prof --steps 200 2>&1 | grep -v Warn | tail -5
el "done"
cd $OUT && tar -czf all.tgz d && rm -rf d
