#!/bin/bash
# Session 13 (issue 15), run 4 (final): direct launches on by default at every launch site, after the
# driver and knobs lookups were hoisted out of the per-launch path.  At most RUN_S
# (default 420) seconds, everything under $OUT:
#   1. the direct-launch GPU tests (bitwise vs Triton's launches on every route) -> tests;
#   2. the host ablation (bench/torch_host_profile.py --ablate) -> abl;
#   3. windows and documents vs FlexAttention with the host (eager; as shipped and with
#      the Hopper forward + backward on Documents) -> masks;
#   4. the user path (bench/torch_module_bench.py --graph, B=4 H=16 S=2k D=128 bf16) -> user.
DEFAULT_RUN_S=420; . bench/run_budget.sh
mkdir -p $OUT/tests $OUT/abl $OUT/masks $OUT/user
nvidia-smi --query-gpu=name,clocks.sm,utilization.gpu,memory.used,temperature.gpu --format=csv | tee $OUT/smi.txt
python3 -m pip install -q --no-deps .whl/*.whl 2>&1 | tail -1
el "direct tests"
timeout $(cap 120) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider --timeout 100 \
  tests/triton/test_hopper_direct.py tests/triton/test_launch_cache.py > $OUT/tests/direct.log 2>&1
echo "direct tests rc $?"; grep -E "passed|failed|FAILED|Error" $OUT/tests/direct.log | tail -25 | cut -c1-400
el "host ablation"
timeout $(cap 100) python3 bench/torch_host_profile.py --out $OUT/abl --ablate --rounds 5 \
  > $OUT/abl/abl.log 2>&1
echo "ablation rc $?"; tail -6 $OUT/abl/abl.log | cut -c1-900
el "masks vs Flex"
timeout $(cap 150) python3 bench/gpu_masks_vs_flex.py --out $OUT/masks --budget 120 \
  --masks doc_eq512,doc_rand_causal,sliding:512,sliding:1024 --shapes 4096x128 \
  --variants default,hopfwd+hopbwd --repeat 2 > $OUT/masks/masks.log 2>&1
echo "masks rc $?"; grep -E "^S=" $OUT/masks/masks.log | cut -c1-600
el "user path"
timeout $(cap 110) python3 bench/torch_module_bench.py --graph --dtypes bf16 --seqs 2048 \
  --batch 4 --heads 16 --head-dim 128 --out $OUT/user/user.json --png $OUT/user/user.png \
  > $OUT/user/user.log 2>&1
echo "user rc $?"; tail -15 $OUT/user/user.log | cut -c1-300
tar -czf $OUT/all.tgz -C $OUT abl user masks tests 2>/dev/null
el "done"
