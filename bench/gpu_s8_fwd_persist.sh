#!/bin/bash
# Session 8 (issue 15 forward): one H200 run.  1. the persistent forward alone on dense /
# band / GQA shapes with several tiles per program, under a hard timeout (a hang costs
# SMOKE_S); 2. dense forward TFLOP/s (bf16, S=2k / 8k, causal and not, 3 passes in
# rotating order): D=128 default vs persistent vs portable vs cuDNN (the persistent one
# only if 1 passed), D=64 portable vs the 'opf' variants vs session 6's best vs cuDNN;
# 3. the D=64 variants vs float64; 4. the persistent forward's GPU tests.  Each step
# starts only while the run is inside RUN_S.  Everything under $OUT.
# Session 8's run (04:25 UTC): the persistent check finished 4 of its 6 cases (all right,
# bitwise equal to the default) before SMOKE_S=45 cut it (≈ 8-10 s a case: compiles and
# the float64 reference), so the gate left the persistent kernel out of the timing (a
# second, warm call timed it) and the tests did not run; the D=64 check was cut too.
# A re-run wants SMOKE_S >= 70 and RUN_S >= 240.
DEFAULT_RUN_S=185; . bench/run_budget.sh   # PYTHONPATH, el / left / cap
nvidia-smi --query-gpu=name,clocks.sm,utilization.gpu,memory.used --format=csv | tee $OUT/smi.txt
el "persist check"
timeout ${SMOKE_S:-50} python3 bench/gpu_s8_fwd_check.py persist --out $OUT 2>&1 \
  | tee $OUT/check-persist.log | grep -v Warning | cut -c1-330
PRC=${PIPESTATUS[0]}
echo "persist check rc $PRC"
NAMES=hopper,portable,sdpa-cudnn,hopper-ws128x128s3opf,hopper-ws192x128s3opf,hopper-ws192x128s3opfem
FV=ws128x128s3opf,ws192x128s3opf,ws192x128s3opfem
[ "$PRC" = 0 ] && NAMES=$NAMES,hopper-ws128x128s2opfP,hopper-ws128x128s2opfPg && FV=$FV,ws128x128s2opfP,ws128x128s2opfPg
el "dense timing"
timeout $(( $(left) > ${BENCH_S:-95} ? ${BENCH_S:-95} : $(left) )) python3 bench/gpu_hopper_bench.py \
  --out $OUT --phases bench --dims 64,128 --seqs 2048,8192 --dtypes bfloat16 --skip-bwd \
  --no-flex --repeat 3 --fwd-variants $FV --names $NAMES 2>&1 | grep "^bench" | cut -c1-400
el "d64 check"
[ $(left) -gt 15 ] && timeout $(left) python3 bench/gpu_s8_fwd_check.py d64 --out $OUT 2>&1 \
  | tee $OUT/check-d64.log | grep -v Warning | grep "ok=False\|PHASE" | cut -c1-330
el "persistent tests"
[ "$PRC" = 0 ] && [ $(left) -gt 15 ] && ANYATTN_TEST_PERSIST=1 timeout $(left) python3 -m pytest -q \
  -m gpu -n 8 -p no:cacheprovider --timeout 40 --timeout-method thread \
  tests/triton/test_hopper_fwd_masks.py -k "persistent or True" 2>&1 | tee $OUT/tests.log \
  | grep -v Warning | tail -6 | cut -c1-300
el "done"
