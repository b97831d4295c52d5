#!/bin/bash
# Session 8 (issue 15 backward, round 2): one H200 run of the ws backward with ONE dQ
# partial per key tile (configs.WS_DQS_BWD_VARIANTS: 'wdkdvq128x64s2nh', '…s2h' (row
# statistics prefetched), '…s2nhl' (the dQ products a tile late): bwd_ws_dq_kernel's
# SPLIT / LAG), from the repository root, everything under $OUT, at most RUN_S (default
# 98) seconds:
#   1. compile + float64 checks (bench/gpu_hopper_bwd.py's 14 cases: bf16 + fp16, D=64 /
#      128, causal / none / window / GQA / odd sizes / empty rows / [B, S, H, D] strides /
#      1 x 1, NaN-poisoned outputs, two runs bitwise equal, both dQ add orders, the routed
#      path with each config) of the default, 'nh', 'nhl' and round 1's 'n' (compiled
#      here in parallel for the timings; 'h' is left to the GPU tests) -> $OUT/chk;
#   2. D=128 bf16 timings, S=2k / 8k causal or not, 3 rotated rounds of: the current route
#      (portable delta + ws dK/dV + portable dQ), 'nh' and 'nhl' end to end, round 1's
#      'n' ('wdkdvq128x64s2n', two partials a key tile), SDPA-cuDNN; then each kernel
#      alone, 'nh' with no adds (diagnostic), the dK/dV-only kernel, SDPA -> $OUT/bench;
#   3. if time is left, D=64 S=4k (default, 'n', 'nh', 'nhl') -> $OUT/bench64.
# JSON: hopper_bwd.json in each folder; logs beside it.  Not routed by default.
# Expected: check ~45-52 s (its cap CHECK_S 52), D=128 timings ~30-36 s (BENCH_S 36), D=64
# only if >= 14 s are left.
DEFAULT_RUN_S=98; . bench/run_budget.sh   # PYTHONPATH, el / left / cap
NH=wdkdvq128x64s2nh
L=wdkdvq128x64s2nhl
N=wdkdvq128x64s2n
mkdir -p $OUT/chk $OUT/bench $OUT/bench64
nvidia-smi --query-gpu=name,clocks.sm,utilization.gpu,memory.used,temperature.gpu \
  --format=csv | tee $OUT/smi.txt
el "compile + check"
timeout $(cap ${CHECK_S:-52}) python3 bench/gpu_hopper_bwd.py --out $OUT/chk \
  --phases compile,check --configs default,$N,$NH,$L > $OUT/chk/check.log 2>&1
echo "check rc $?"
grep -E "^check|error" $OUT/chk/check.log | sed -E 's/wdkdv128x64s2:ok\([^)]*\) //' | cut -c1-330
el "D=128 timings"
timeout $(cap ${BENCH_S:-36}) python3 bench/gpu_hopper_bwd.py --out $OUT/bench \
  --phases roof,bench --dims 128 --configs default,$N,$NH,$L --diag $NH \
  > $OUT/bench/bench.log 2>&1
echo "bench rc $?"
grep -E "^B=|^roof" $OUT/bench/bench.log | sed -E 's/_vs_[a-z]*=[0-9.]*//g' | cut -c1-700
if [ $(left) -ge 14 ]; then
  el "D=64 timings"
  timeout $(left) python3 bench/gpu_hopper_bwd.py --out $OUT/bench64 --phases bench \
    --dims 64 --configs default,$N,$NH,$L --diag '' > $OUT/bench64/bench.log 2>&1
  echo "bench64 rc $?"
  grep -E "^B=" $OUT/bench64/bench.log | sed -E 's/_vs_[a-z]*=[0-9.]*//g' | cut -c1-700
fi
el "done"
