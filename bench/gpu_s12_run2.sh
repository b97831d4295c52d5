#!/bin/bash
# Session 12 (issue 15), run 2: at most RUN_S (default 200) seconds, everything under $OUT:
# does a (batch, kv head) whose key-tile programs straddle two waves cost the D=128
# backward its dQ turn waits?  The routed 'nhri' and its no-add diagnostic (no turn waits,
# no adds) at B=2 H=16 S=8k (64 programs a head, 132 SMs: a head split at most wave
# boundaries) vs B=1 H=2 / B=1 H=4 S=8k (128 / 256 programs: one / two waves of whole heads,
# 4 SMs idle), and at S=2k B=8 H=16 vs B=1 H=8 (128 programs) -> $OUT/bench.
DEFAULT_RUN_S=200; . bench/run_budget.sh
mkdir -p $OUT/bench
nvidia-smi --query-gpu=name,clocks.sm,utilization.gpu,memory.used,temperature.gpu --format=csv
el "D=128 timings"
timeout $(cap 150) python3 bench/gpu_hopper_bwd.py --out $OUT/bench --phases bench \
  --dims 128 --configs default --diag default \
  --shapes "2,16,8192,128;1,2,8192,128;1,4,8192,128;8,16,2048,128;1,8,2048,128" \
  > $OUT/bench/bench.log 2>&1
echo "bench rc $?"
grep -E "^B=|failed" $OUT/bench/bench.log | sed -E 's/_vs_[a-z]*=[0-9.]*//g' | cut -c1-600
el "done"
