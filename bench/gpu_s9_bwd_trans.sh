#!/bin/bash
# Session 9 (issue 15 backward): one H200 run of the transposed-consumer ws backward
# ('wdkdvq128x64s2nht', configs.WS_DQT_BWD_VARIANTS: bwd_ws_t_kernel, S^T / dP^T with the
# keys as wgmma rows, P^T and dS^T from registers into dV / dK) beside the default
# ('wdkdvq128x64s2nh' at D=128 and D=64 with a band) and SDPA-cuDNN, from the repository
# root, everything under $OUT, at most RUN_S (default 230) seconds:
#   1. compile + float64 checks (bench/gpu_hopper_bwd.py's 14 cases: bf16 + fp16, D=64 /
#      128, causal / none / window / GQA / odd sizes / empty rows / [B, S, H, D] strides /
#      1 x 1, NaN-poisoned outputs, two runs bitwise equal, both dQ add orders, the routed
#      path with each config) of the default and 'nht' -> $OUT/chk (cap CHECK_S 75);
#   2. D=128 bf16 timings, S=2k / 8k causal or not, 3 rotated rounds of: the default route
#      ('nh': portable delta + the kernel + the dq conversion), 'nht' routed the same way,
#      the portable backward, SDPA-cuDNN; then each kernel alone, 'nht' with no
#      adds (diagnostic: what the consumers alone cost), SDPA -> $OUT/bench (cap BENCH_S 70);
#   3. D=64 S=4k causal or not: 'nh', 'nht' and the ws dK/dV route ('wdkdv128x64s2' +
#      portable dQ: D=64's route without a band) -> $OUT/bench64 (the time left).
# JSON: hopper_bwd.json in each folder; logs beside it.  Not routed by default.
DEFAULT_RUN_S=230; . bench/run_budget.sh   # PYTHONPATH, el / left / cap
NH=wdkdvq128x64s2nh
T=wdkdvq128x64s2nht
W=wdkdv128x64s2
mkdir -p $OUT/chk $OUT/bench $OUT/bench64
nvidia-smi --query-gpu=name,clocks.sm,utilization.gpu,memory.used,temperature.gpu \
  --format=csv | tee $OUT/smi.txt
el "compile + check"
timeout $(cap ${CHECK_S:-75}) python3 bench/gpu_hopper_bwd.py --out $OUT/chk \
  --phases compile,check --configs default,$T > $OUT/chk/check.log 2>&1
echo "check rc $?"
grep -E "^check|error|Error" $OUT/chk/check.log | cut -c1-400
el "D=128 timings"
timeout $(cap ${BENCH_S:-70}) python3 bench/gpu_hopper_bwd.py --out $OUT/bench \
  --phases roof,bench --dims 128 --configs default,$T --diag $T \
  > $OUT/bench/bench.log 2>&1
echo "bench rc $?"
grep -E "^B=|^roof|failed" $OUT/bench/bench.log | sed -E 's/_vs_[a-z]*=[0-9.]*//g' | cut -c1-900
if [ $(left) -ge 20 ]; then
  el "D=64 timings"
  timeout $(left) python3 bench/gpu_hopper_bwd.py --out $OUT/bench64 --phases bench \
    --dims 64 --configs default,$T,$W --diag '' > $OUT/bench64/bench.log 2>&1
  echo "bench64 rc $?"
  grep -E "^B=|failed" $OUT/bench64/bench.log | sed -E 's/_vs_[a-z]*=[0-9.]*//g' | cut -c1-900
fi
el "done"
