#!/bin/bash
# Session 10 (lead, issue 15): one H200 run of the persistent forward with three consumer
# warpgroups at D=64 (configs.FWD_PERSIST_D64_NC3, 'ws192x128s3opfPg'), everything under
# $OUT, at most RUN_S (default 200) seconds:
#   1. float64 checks of the new config (gpu_hopper_bench.py's D=64 cases: bf16 + fp16,
#      causal both alignments, windows, empty rows, [B, S, H, D] strides) -> $OUT/chk;
#   2. its GPU test (bitwise the per-tile 192-row loop, poisoned, GQA, Sq != Sk) -> $OUT/t;
#   3. D=64 bf16 forward TFLOP/s at S=2k / 4k / 8k, causal or not, 3 rotated passes: the
#      routed path ('hopper': ws192x128s3opf per tile without a mask, ws128x128s3opfPg
#      with a band), the new config, both current configs named, portable, SDPA-cuDNN
#      -> $OUT/fwd.
DEFAULT_RUN_S=200; . bench/run_budget.sh   # PYTHONPATH, el / left / cap
mkdir -p $OUT/chk $OUT/t $OUT/fwd
nvidia-smi --query-gpu=name,clocks.sm,utilization.gpu,memory.used,temperature.gpu --format=csv | tee $OUT/smi.txt
NEW=ws192x128s3opfPg
el "check"
timeout $(cap 60) python3 bench/gpu_hopper_bench.py --out $OUT/chk --phases check --skip-bwd --no-flex \
  --fwd-variants $NEW --cases D64 > $OUT/chk/check.log 2>&1
echo "check rc $?"; grep -E "^check" $OUT/chk/check.log | cut -c1-300
el "GPU test"
timeout $(cap 50) python3 -m pytest -q -m gpu -p no:cacheprovider -k three_consumer \
  tests/triton/test_hopper_fwd_masks.py > $OUT/t/test.log 2>&1
echo "test rc $?"; tail -3 $OUT/t/test.log
el "forward timings"
timeout $(cap 120) python3 bench/gpu_hopper_bench.py --out $OUT/fwd --phases bench --dims 64 \
  --seqs 2048,4096,8192 --dtypes bfloat16 --skip-bwd --no-flex --repeat 3 \
  --fwd-variants $NEW,ws128x128s3opfPg,ws192x128s3opf \
  --names hopper,portable,sdpa-cudnn,hopper-$NEW,hopper-ws128x128s3opfPg,hopper-ws192x128s3opf \
  > $OUT/fwd/bench.log 2>&1
echo "bench rc $?"; grep -E "^bench" $OUT/fwd/bench.log | cut -c1-500
el "done"
