#!/bin/bash
# Session 11 (lead): Nsight Compute profiles of this tree's routed kernels beside
# SDPA-cuDNN's (clocks left alone), one ncu run per (case, call); at most RUN_S (default
# 420) seconds.  Everything under $OUT: ncu_csv.tgz (details / source pages as CSV),
# ncu_rep.tgz (the reports), ncu.log.  TARGETS: "case:which ..." (bench/gpu_profile_target.py).
DEFAULT_RUN_S=420; . bench/run_budget.sh
nvidia-smi --query-gpu=name,clocks.sm,utilization.gpu,memory.used,temperature.gpu --format=csv
mkdir -p /tmp/ncu/csv /tmp/ncu/rep
ncu --version | tail -1
ncu --list-sections > /tmp/ncu/csv/sections.txt 2>&1
want="SpeedOfLight ComputeWorkloadAnalysis MemoryWorkloadAnalysis MemoryWorkloadAnalysis_Tables SchedulerStats WarpStateStats SourceCounters LaunchStats Occupancy InstructionStats"
SECS=""
for s in $want; do grep -qw "$s" /tmp/ncu/csv/sections.txt && SECS="$SECS --section $s"; done
echo "sections:$SECS"
TARGETS=${TARGETS:-"d128n8k:ours-bwd d128n8k:cudnn-bwd d128c2k:ours-fwd d128c2k:cudnn-fwd d128n2k:ours-fwd d128n2k:cudnn-fwd d128c2k:ours-bwd d128c2k:cudnn-bwd"}
for t in $TARGETS; do
  c=${t%%:*}; w=${t##*:}; n=${c}_${w}
  if [ $(left) -lt 40 ]; then echo "skip $n: $(left) s left"; continue; fi
  el "$n"
  timeout $(cap 120) ncu --clock-control none --nvtx --nvtx-include "P" $SECS \
    --import-source no -f -o /tmp/ncu/rep/$n python3 bench/gpu_profile_target.py --case $c --which $w \
    > /tmp/ncu/csv/$n.run.log 2>&1
  echo "rc $? $(grep -c '==PROF== Profiling' /tmp/ncu/csv/$n.run.log) kernels"; tail -2 /tmp/ncu/csv/$n.run.log | cut -c1-300
  [ -f /tmp/ncu/rep/$n.ncu-rep ] || continue
  ncu -i /tmp/ncu/rep/$n.ncu-rep --page details --csv > /tmp/ncu/csv/$n.details.csv 2>&1
  ncu -i /tmp/ncu/rep/$n.ncu-rep --page source --csv --print-source sass > /tmp/ncu/csv/$n.source.csv 2>&1 \
    || echo "source page failed: $(head -c 300 /tmp/ncu/csv/$n.source.csv)"
  ncu -i /tmp/ncu/rep/$n.ncu-rep --page raw --csv > /tmp/ncu/csv/$n.raw.csv 2>&1
  ls -la /tmp/ncu/csv/$n.* | awk '{print $5, $9}'
done
el "pack"
(cd /tmp/ncu && tar -czf $OUT/ncu_csv.tgz csv && tar -czf $OUT/ncu_rep.tgz rep)
ls -la $OUT
el "done"
