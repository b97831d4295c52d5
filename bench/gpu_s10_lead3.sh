#!/bin/bash
# Session 10 (lead, issue 15): one H200 run of the persistent forward with its query
# tiles' boundaries overlapped at D=64 (configs.FWD_PERSIST_D64_X, 'ws128x128s3opfPgx': a
# tile's last P.V issued with the next tile's first S), everything under $OUT, at most
# RUN_S (default 200) seconds:
#   1. float64 checks of the new config (gpu_hopper_bench.py's D=64 cases) -> $OUT/chk;
#   2. its GPU tests (bitwise the per-tile loop, poisoned, GQA, Sq != Sk, keyless query
#      tiles) -> $OUT/t;
#   3. D=64 bf16 forward TFLOP/s at S=2k / 4k / 8k, causal or not, 3 rotated passes: the
#      routed path, the new config, the routed band config named ('ws128x128s3opfPg'),
#      portable, SDPA-cuDNN -> $OUT/fwd.
DEFAULT_RUN_S=200; . bench/run_budget.sh   # PYTHONPATH, el / left / cap
mkdir -p $OUT/chk $OUT/t $OUT/fwd
nvidia-smi --query-gpu=name,clocks.sm,utilization.gpu,memory.used,temperature.gpu --format=csv | tee $OUT/smi.txt
NEW=ws128x128s3opfPgx
el "check"
timeout $(cap 60) python3 bench/gpu_hopper_bench.py --out $OUT/chk --phases check --skip-bwd --no-flex \
  --fwd-variants $NEW --cases D64 > $OUT/chk/check.log 2>&1
echo "check rc $?"; grep -E "^check" $OUT/chk/check.log | cut -c1-300
el "GPU test"
python3 -m pip install -q --no-deps .whl/*.whl 2>&1 | tail -1
timeout $(cap 70) python3 -m pytest -q -m gpu -n 5 -p no:cacheprovider -k "persistent_variants and FWD_PERSIST_D64_X" \
  tests/triton/test_hopper_fwd_masks.py > $OUT/t/test.log 2>&1
echo "test rc $?"; tail -3 $OUT/t/test.log
el "forward timings"
timeout $(cap 120) python3 bench/gpu_hopper_bench.py --out $OUT/fwd --phases bench --dims 64 \
  --seqs 2048,4096,8192 --dtypes bfloat16 --skip-bwd --no-flex --repeat 3 \
  --fwd-variants $NEW,ws128x128s3opfPg \
  --names hopper,portable,sdpa-cudnn,hopper-$NEW,hopper-ws128x128s3opfPg \
  > $OUT/fwd/bench.log 2>&1
echo "bench rc $?"; grep -E "^bench" $OUT/fwd/bench.log | cut -c1-500
el "done"
