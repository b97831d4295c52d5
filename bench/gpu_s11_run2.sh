#!/bin/bash
# Session 11 (issue 15 backward), run 2: at most RUN_S (default 300) seconds, everything
# under $OUT:
#   1. Nsight Compute profiles of the routed backward after the 'nhr' route (D=128 S=8k)
#      and of D=64 S=4k causal (ours 'nh', cuDNN) -> $OUT/ncu_csv.tgz (bench/gpu_s11_ncu.sh);
#   2. D=64: float64 checks (bf16) of 'nhr' with three stages -> $OUT/chk;
#   3. D=64 S=4k timings, 3 rotated rounds: 'nh' (the band's route), 'nhr', 'nhr' s3,
#      'nht' 128-row (the route without a mask), SDPA-cuDNN -> $OUT/bench64.
DEFAULT_RUN_S=300; . bench/run_budget.sh
S3=wdkdvq128x64s3nhr
R=wdkdvq128x64s2nhr
T128=wdkdvq128x128s2nht
mkdir -p $OUT/chk $OUT/bench64 $OUT/ncu
el "ncu"
OUT=$OUT/ncu RUN_S=$(cap 110) TARGETS="d128n8k:ours-bwd d64c4k:ours-bwd d64c4k:cudnn-bwd" \
  bash bench/gpu_s11_ncu.sh > $OUT/ncu.log 2>&1
echo "ncu rc $?"; grep -E "^rc|^===" $OUT/ncu.log | head -12
mv $OUT/ncu/ncu_csv.tgz $OUT/ncu_csv.tgz 2>/dev/null; rm -rf $OUT/ncu
el "check"
timeout $(cap 60) python3 bench/gpu_hopper_bwd.py --out $OUT/chk --phases compile,check \
  --dims 64 --dtypes bfloat16 --configs default,$S3 > $OUT/chk/check.log 2>&1
echo "check rc $?"; grep -E "^check|error|Error" $OUT/chk/check.log | cut -c1-250
el "D=64 timings"
timeout $(left) python3 bench/gpu_hopper_bwd.py --out $OUT/bench64 --phases bench \
  --dims 64 --configs default,$R,$S3,$T128 --diag '' > $OUT/bench64/bench.log 2>&1
echo "bench64 rc $?"
grep -E "^B=|failed" $OUT/bench64/bench.log | sed -E 's/_vs_[a-z]*=[0-9.]*//g' | cut -c1-900
el "done"
