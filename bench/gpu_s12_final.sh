#!/bin/bash
# Session 12 (lead): the final H200 run, everything under $OUT, at most RUN_S (default
# 460) seconds (the GPU tests ran in run 4 on the same code: bench/gpu_s12_run4.sh):
#   1. the standings in device time (bench/gpu_ab_trees.py without a base tree: the core
#      API's routed forward / backward, CUDA-graph replays, vs SDPA-cuDNN; D=128 S=2k / 8k
#      causal or not, D=64 S=4k causal or not) -> $OUT/st;
#   2. windows and documents vs FlexAttention (bench/gpu_masks_vs_flex.py, B=4 H=16
#      S=4k D=128 bf16; as shipped, and with Documents routed to the Hopper forward and
#      backward) -> $OUT/masks;
#   3. the user path (bench/torch_module_bench.py --graph, B=4 H=16 S=2k D=128 bf16: the
#      module's eager step vs its raw kernels) -> $OUT/user.
DEFAULT_RUN_S=460; . bench/run_budget.sh   # PYTHONPATH, el / left / cap
mkdir -p $OUT/st $OUT/masks $OUT/user
nvidia-smi --query-gpu=name,clocks.sm,utilization.gpu,memory.used,temperature.gpu --format=csv | tee $OUT/smi.txt
el "standings"
timeout $(cap 130) python3 bench/gpu_ab_trees.py --out $OUT/st --rounds 2 \
  --cases d128n2k,d128c2k,d128n8k,d128c8k,d64n4k,d64c4k > $OUT/st/st.log 2>&1
echo "standings rc $?"; grep -E "^ab|Error" $OUT/st/st.log | cut -c1-400
el "masks vs Flex"
timeout $(cap 170) python3 bench/gpu_masks_vs_flex.py --out $OUT/masks --budget 140 \
  --masks sliding:512,sliding:1024,doc_eq512,doc_rand_causal --shapes 4096x128 \
  --variants default,hopfwd+hopbwd --repeat 2 > $OUT/masks/masks.log 2>&1
echo "masks rc $?"; tail -30 $OUT/masks/masks.log | cut -c1-300
el "user path"
timeout $(cap 120) python3 bench/torch_module_bench.py --graph --dtypes bf16 --seqs 2048 \
  --batch 4 --heads 16 --head-dim 128 --out $OUT/user/user.json --png $OUT/user/user.png \
  > $OUT/user/user.log 2>&1
echo "user rc $?"; tail -15 $OUT/user/user.log | cut -c1-300
el "done"
