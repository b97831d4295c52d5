#!/bin/bash
# Session 9 (lead, issue 15): one H200 run, everything under $OUT, at most RUN_S seconds.
#   1. autograd's hand-over to its device thread, stamped (bench/autograd_handover.py) at
#      a host-bound shape and at B=4 H=16 S=2k D=128;
#   2. the persistent scheduled forward at D=64 (new, ws128x128s3opfPg) vs float64;
#   3. forward TFLOP/s, 3 rotated passes: D=128 bf16 + fp16 S=2k / 8k causal or not, the
#      default vs the scheduled persistent 'ws128x128s2opfPg' vs cuDNN; D=64 bf16 S=2k /
#      4k / 8k the routed path vs 'ws128x128s3opf' (the band default, not routed) vs its
#      scheduled persistent form vs portable vs cuDNN.
DEFAULT_RUN_S=330; . bench/run_budget.sh   # PYTHONPATH, el / left / cap
mkdir -p $OUT/agh $OUT/chk $OUT/fwd
nvidia-smi --query-gpu=name,clocks.sm,utilization.gpu,memory.used,temperature.gpu --format=csv | tee $OUT/smi.txt
el "autograd hand-over"
timeout $(cap 45) python3 bench/autograd_handover.py --out $OUT/agh/small --steps 300 2>&1 | grep -v Warn | tail -8
timeout $(cap 40) python3 bench/autograd_handover.py --out $OUT/agh/big --shape 4,16,2048,128 --steps 60 2>&1 | grep -v Warn | tail -8
el "D=64 persistent check"
timeout $(cap 75) python3 bench/gpu_hopper_bench.py --out $OUT/chk --phases check --skip-bwd --no-flex \
  --fwd-variants ws128x128s3opfPg --cases D64 > $OUT/chk/check.log 2>&1
echo "check rc $?"; grep -E "^check" $OUT/chk/check.log | cut -c1-300
PRC=$(grep -c "ok=False\|ERROR" $OUT/chk/check.log)
N=hopper,portable,sdpa-cudnn,hopper-ws128x128s2opfPg,hopper-ws128x128s3opf
FV=ws128x128s2opfPg,ws128x128s3opf
[ "$PRC" = 0 ] && N=$N,hopper-ws128x128s3opfPg && FV=$FV,ws128x128s3opfPg
el "forward timings"
timeout $(cap 170) python3 bench/gpu_hopper_bench.py --out $OUT/fwd --phases bench --dims 128,64 \
  --seqs 2048,4096,8192 --dtypes bfloat16,float16 --skip-bwd --no-flex --repeat 3 \
  --fwd-variants $FV --names $N > $OUT/fwd/bench.log 2>&1
echo "bench rc $?"; grep -E "^bench" $OUT/fwd/bench.log | cut -c1-400
el "done"
cd $OUT && tar -czf all.tgz agh chk fwd smi.txt && rm -rf agh chk fwd
