#!/bin/bash
# Session 9 (issue 15, helper "docs"): Documents / KeepMask through the Hopper
# warp-specialised backward (bwd_ws_kernel / bwd_ws_dq_kernel with ARRAY,
# launch.bwd_mask_tables).  One H200 run from the repository root, everything under $OUT,
# at most RUN_S (default 330) seconds:
#   1. GPU tests, 4 pytest processes side by side (one Triton cache): the new
#      tests/triton/test_hopper_bwd_masks.py (8 mask cases x bf16 / fp16 x D=128 / 64:
#      the ws dK/dV kernel, dQ inside 'nh' and 'n', NaN-poisoned buffers, float64,
#      bitwise repeatable; the routed path) and the forward's array-mask tests
#      (fwd_masks._exclude now calls the shared pair_keep) -> $OUT/tests;
#   2. bench/gpu_masks_vs_flex.py, B=4 H=16 S=4096 D=128 bf16, the four document masks,
#      3 rounds in rotating order of: the Hopper forward + the portable backward (the
#      route of session 7), + the ws dK/dV kernel and the portable dQ ('hopbwdkv'),
#      + dQ inside ('hopbwd'), FlexAttention; S=8192 cases while the budget lasts
#      -> $OUT/bench (masks-flex.json / .png).
# Expected: tests ~60-120 s (compiles: 6 array-mask variants x 2 dtypes x 2 D x 3
# configs), bench ~100-150 s.
DEFAULT_RUN_S=330; . bench/run_budget.sh   # PYTHONPATH, el / left / cap
mkdir -p $OUT/tests $OUT/bench
nvidia-smi --query-gpu=name,clocks.sm,utilization.gpu,memory.used,temperature.gpu \
  --format=csv | tee $OUT/smi.txt
el "GPU tests"
python3 -m pytest --collect-only -q -p no:cacheprovider -m gpu \
  tests/triton/test_hopper_bwd_masks.py \
  "tests/triton/test_hopper_fwd_masks.py::test_gpu_forward_array_masks_match_float64" \
  2>/dev/null | grep '::' > $OUT/tests/ids.txt
echo "$(wc -l < $OUT/tests/ids.txt) GPU tests"
TC=$(cap ${TEST_S:-150})
for i in 0 1 2 3; do
  awk -v i=$i 'NR % 4 == i' $OUT/tests/ids.txt > $OUT/tests/ids$i.txt
  timeout $TC python3 -m pytest -q -p no:cacheprovider -x -m gpu \
    $(cat $OUT/tests/ids$i.txt) > $OUT/tests/part$i.log 2>&1 &
done
wait
for i in 0 1 2 3; do tail -1 $OUT/tests/part$i.log; done
grep -h -E "^(FAILED|ERROR)|Error|assert" $OUT/tests/part*.log | head -20 | cut -c1-400
el "bench"
timeout $(cap ${BENCH_S:-170}) python3 bench/gpu_masks_vs_flex.py --out $OUT/bench \
  --masks doc_eq512,doc_rand_causal,doc_eq512_causal,doc_rand --shapes 4096x128,8192x128 \
  --variants hopfwd+portbwd,hopfwd+hopbwdkv,hopfwd+hopbwd --repeat 3 --no-cudnn \
  --budget $(( $(left) - 60 )) > $OUT/bench/bench.log 2>&1
echo "bench rc $?"
grep -E "^S=" $OUT/bench/bench.log | cut -c1-900
tail -3 $OUT/bench/bench.log | cut -c1-300
el "done"
