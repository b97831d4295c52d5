#!/bin/bash
# Session 7 (issue 15 forward), run 2: the persistent Hopper forward.  GPU tests first
# (array masks through both kernels; the persistent kernel walking several tiles per
# program, bitwise vs the per-tile default and vs float64), then dense D=128 forward
# TFLOP/s default vs persistent vs cuDNN (S=2k, 8k; bf16, fp16; causal and not; three
# passes in rotating order), then documents through both.  Everything under $OUT.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1 ANYATTN_TEST_PERSIST=1
nvidia-smi --query-gpu=name,clocks.sm,utilization.gpu,memory.used --format=csv | tee $OUT/smi.txt
T0=$(date +%s)
timeout ${TEST_S:-90} python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider \
  tests/triton/test_hopper_fwd_masks.py -k "${TEST_K:-gpu}" 2>&1 | tee $OUT/tests.log \
  | grep -v Warning | tail -15
echo "tests: $(( $(date +%s) - T0 )) s"
timeout ${DENSE_S:-70} python3 bench/gpu_hopper_bench.py --out $OUT --phases bench --dims 128 \
  --seqs 2048,8192 --dtypes ${DTYPES:-bfloat16,float16} --skip-bwd --no-flex --repeat 3 \
  --fwd-variants ws128x128s2opfP --names hopper,hopper-ws128x128s2opfP,sdpa-cudnn 2>&1 \
  | tee $OUT/dense.log | grep "TFLOP/s"
echo "dense: $(( $(date +%s) - T0 )) s"
[ -n "$NO_MASKS" ] && exit 0
python3 bench/gpu_masks_vs_flex.py --out $OUT --budget ${BENCH_S:-40} --repeat 2 \
  --variants default,persist --shapes 4096x128 --no-cudnn --no-plot \
  --masks ${MASKS:-doc_eq512,doc_rand_causal} 2>&1 | tee $OUT/bench.log | grep "^S=" | cut -c1-400
echo "total: $(( $(date +%s) - T0 )) s"
