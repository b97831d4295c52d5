#!/bin/bash
# Session 12 (issue 15), run 7: at most RUN_S (default 120) seconds: cProfile of one-thread
# module / raw steps, no mask and causal, S=128 D=128 bf16 (bench/gpu_host_causal_profile.py)
# -> $OUT/prof.
DEFAULT_RUN_S=120; . bench/run_budget.sh
mkdir -p $OUT/prof
el "profile"
timeout $(cap 100) python3 bench/gpu_host_causal_profile.py --out $OUT/prof > $OUT/prof/prof.log 2>&1
echo "prof rc $?"; tail -8 $OUT/prof/prof.log | cut -c1-300
el "done"
