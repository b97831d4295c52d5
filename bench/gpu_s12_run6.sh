#!/bin/bash
# Session 12 (issue 15), run 6: at most RUN_S (default 240) seconds, everything under $OUT:
# where the host time of a training step goes on the H200 machine with this session's
# routes (the persistent D=128 forward, the dQ-inside backward 'nhrie' / 'nhri'):
# bench/torch_host_profile.py --ablate (host µs per step at S=128, cProfile of module
# steps, GPU gaps and the ablation at B=4 H=16 S=2k D=128 bf16) -> $OUT/host.
DEFAULT_RUN_S=240; . bench/run_budget.sh
mkdir -p $OUT/host
nvidia-smi --query-gpu=name,clocks.sm,utilization.gpu,memory.used,temperature.gpu --format=csv
el "host profile"
timeout $(cap 220) python3 bench/torch_host_profile.py --out $OUT/host --ablate \
  > $OUT/host/host.log 2>&1
echo "host rc $?"; tail -40 $OUT/host/host.log | cut -c1-300
el "done"
