#!/bin/bash
# Session 7 (issue 15 forward and masks): one H200 run.  Checks first (GPU tests of the
# Hopper forward with Documents / KeepMask, and the unchanged band / none cases at D=128),
# then forward / backward / step timings of documents and a sliding window through
# anyattn.torch with the Documents forward portable vs Hopper, beside compiled Flex,
# twice in rotating order.  Everything under $OUT.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,clocks.sm,utilization.gpu,memory.used --format=csv | tee $OUT/smi.txt
T0=$(date +%s)
timeout ${TEST_S:-100} python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider \
  tests/triton/test_hopper_fwd_masks.py tests/triton/test_hopper.py \
  -k "fwd_masks or (test_forward_matches_float64 and 128) or test_auto_routes" 2>&1 \
  | tee $OUT/tests.log | tail -25
echo "tests: $(( $(date +%s) - T0 )) s"
python3 bench/gpu_masks_vs_flex.py --out $OUT --budget ${BENCH_S:-100} --repeat 2 \
  --variants portfwd,hopfwd --shapes 4096x128 --no-cudnn \
  --masks ${MASKS:-doc_eq512,doc_rand_causal,doc_rand,doc_eq512_causal,sliding:512} 2>&1 \
  | tee $OUT/bench.log | grep -v "^\s*$" | tail -12
echo "total: $(( $(date +%s) - T0 )) s"
