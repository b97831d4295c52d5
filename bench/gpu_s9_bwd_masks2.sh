#!/bin/bash
# Session 9 (helper "docs"), run 2: bench only, at most RUN_S (default 95) seconds.
# B=4 H=16 S=4096 D=128 bf16, 2 rounds in rotating order: random causal documents as a
# dense KeepMask (the KeepMask forward and backward were covered but never timed), then
# random causal documents and equal causal ones (Documents): the all-portable route, the
# Hopper forward + portable backward, + the Hopper backward (dQ inside, 'nh'), + the
# Hopper backward with 'h' (row statistics prefetched), FlexAttention -> $OUT/bench.
# Not run in session 9 (device budget); expected ~50 s of compiles (portable and Hopper
# KeepMask kernels, 'h' with arrays, Flex's document graphs) + ~15 s per case.
DEFAULT_RUN_S=95; . bench/run_budget.sh   # PYTHONPATH, el / left / cap
mkdir -p $OUT/bench
nvidia-smi --query-gpu=name,clocks.sm,utilization.gpu,memory.used,temperature.gpu \
  --format=csv | tee $OUT/smi.txt
timeout $(left) python3 bench/gpu_masks_vs_flex.py --out $OUT/bench \
  --masks keep_doc_rand_causal,doc_rand_causal,doc_eq512_causal --shapes 4096x128 \
  --variants portfwd+portbwd,hopfwd+portbwd,hopfwd+hopbwd,hopfwd+hopbwd+bwd=wdkdvq128x64s2h \
  --repeat 2 --no-cudnn --no-plot --budget $(( $(left) - 40 )) > $OUT/bench/bench.log 2>&1
echo "bench rc $? at $(( $(date +%s) - T0 )) s"
grep -E "^S=" $OUT/bench/bench.log | cut -c1-1200
grep -E "Error|error" $OUT/bench/bench.log | head -5 | cut -c1-300
