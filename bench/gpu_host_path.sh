#!/bin/bash
# The host path on the H200 in one device run (session 13's runs 1-4 were this script's
# phases): everything under $OUT, at most RUN_S (default 540) seconds; PHASES picks and
# orders them (default "direct abl masks user"):
#   direct  the direct-launch GPU tests (bitwise vs Triton's launches on every route)
#   abl     bench/torch_host_profile.py --ablate (module / kernel with and without direct
#           launches, on autograd's device thread or the calling thread; B=4 H=16 S=2k
#           D=128 bf16, host per step at S=128)
#   masks   windows and documents vs FlexAttention with the host (eager; as shipped and
#           with the Hopper forward + backward on Documents), B=4 H=16 S=4k D=128
#   fresh   documents vs FlexAttention as a packed-sequence loop has them: a new mask on new
#           ids every call (ids on the host, then on the GPU; Flex: a new block mask), as
#           shipped and with the Hopper backward on Documents (its eager size rule)
#   syncs   the GPU tests of session 14's mask inputs: a fresh Documents mask's
#           synchronisations (tests/triton/test_mask_inputs.py), host ids' bits
#           (tests/torch/test_cuda.py), the array-mask Hopper backward's dq conversion
#   fixed   bench/gpu_bwd_overhead.py: the Hopper backward's fixed cost per program (line
#           fit over Sq at Sk = 2k and 8k), what a persistent backward could hide
#   user    bench/torch_module_bench.py --graph, B=4 H=16 S=2k D=128 bf16
#   suite   the whole GPU suite (pytest -m gpu tests/triton tests/torch)
#   prof    bench/torch_host_profile.py without --ablate (cProfile, the GPU's idle gaps)
# Then $OUT/all.tgz holds every phase's folder (the device tool returns few files).
DEFAULT_RUN_S=540; . bench/run_budget.sh
PHASES=${PHASES:-direct abl masks user}
nvidia-smi --query-gpu=name,clocks.sm,utilization.gpu,memory.used,temperature.gpu --format=csv | tee $OUT/smi.txt
python3 -m pip install -q --no-deps .whl/*.whl 2>&1 | tail -1
for ph in $PHASES; do
  mkdir -p $OUT/$ph; el "$ph"
  case $ph in
    direct) timeout $(cap 120) python3 -m pytest -q -m gpu -n 8 -p no:cacheprovider --timeout 100 \
              tests/triton/test_hopper_direct.py tests/triton/test_launch_cache.py > $OUT/$ph/log 2>&1 ;;
    abl)    timeout $(cap 110) python3 bench/torch_host_profile.py --out $OUT/$ph --ablate --rounds 5 \
              > $OUT/$ph/log 2>&1 ;;
    masks)  timeout $(cap 150) python3 bench/gpu_masks_vs_flex.py --out $OUT/$ph --budget 120 \
              --masks doc_eq512,doc_rand_causal,sliding:512,sliding:1024 --shapes 4096x128 \
              --variants default,hopfwd+hopbwd --repeat 2 > $OUT/$ph/log 2>&1 ;;
    fresh)  for w in host device; do
              timeout $(cap 100) python3 bench/gpu_masks_vs_flex.py --out $OUT/$ph/$w --budget 80 \
                --masks doc_eq512,doc_rand_causal --shapes 4096x128,8192x128 --fresh $w \
                --variants default,hopbwd --repeat 2 > $OUT/$ph/log.$w 2>&1
            done; cat $OUT/$ph/log.* > $OUT/$ph/log ;;
    syncs)  timeout $(cap 90) python3 -m pytest -q -m gpu -p no:cacheprovider --timeout 80 -rfE \
              tests/triton/test_mask_inputs.py tests/torch/test_cuda.py \
              tests/triton/test_hopper_bwd_masks.py > $OUT/$ph/log 2>&1 ;;
    fixed)  for sk in 2048 8192; do
              timeout $(cap 60) python3 bench/gpu_bwd_overhead.py --out $OUT/$ph/sk$sk --sk $sk \
                > $OUT/$ph/log.sk$sk 2>&1
            done; cat $OUT/$ph/log.* > $OUT/$ph/log ;;
    user)   timeout $(cap 110) python3 bench/torch_module_bench.py --graph --dtypes bf16 --seqs 2048 \
              --batch 4 --heads 16 --head-dim 128 --out $OUT/$ph/user.json --png $OUT/$ph/user.png \
              > $OUT/$ph/log 2>&1 ;;
    suite)  timeout $(cap ${TESTS_S:-400}) python3 -m pytest -q -m gpu -n 12 -p no:cacheprovider \
              --timeout 200 -rfE tests/triton tests/torch > $OUT/$ph/log 2>&1 ;;
    prof)   timeout $(cap 120) python3 bench/torch_host_profile.py --out $OUT/$ph --n 100 --rounds 3 \
              > $OUT/$ph/log 2>&1 ;;
    *)      echo "unknown phase $ph"; continue ;;
  esac
  echo "$ph rc $?"
  grep -E "passed|failed|FAILED|^S=|host us|big ms|overhead|Error" $OUT/$ph/log | tail -12 | cut -c1-600
done
tar -czf $OUT/all.tgz -C $OUT $PHASES 2>/dev/null
el "done"
