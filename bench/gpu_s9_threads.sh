#!/bin/bash
# Session 9 (lead): why a host-bound anyattn.torch step runs 2x faster pinned to one core
# (gpu_s9_final.sh: ~500 vs ~940 us at B=1 H=2 S=128 D=64, calling thread or not).
# bench/autograd_handover.py under: no pinning (control), OMP_NUM_THREADS=1 (torch's CPU
# pool), one core, two cores that share a physical core (SMT siblings, if any) and two
# that do not; the process's threads are listed.  Everything under $OUT.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
mkdir -p $OUT/t
lscpu | grep -E "^CPU\(s\)|Thread|Core|Socket|NUMA|Model name" | tee $OUT/t/lscpu.txt
cat /sys/devices/system/cpu/cpu3/topology/thread_siblings_list | tee -a $OUT/t/lscpu.txt
SIB=$(cat /sys/devices/system/cpu/cpu3/topology/thread_siblings_list)
run() { echo "=== $1"; shift; timeout 40 "$@" 2>&1 | grep -v Warn | grep -E "^module|^trivial|^threads" | tail -9; }
run control python3 bench/autograd_handover.py --out $OUT/t/control --steps 200
run omp1 env OMP_NUM_THREADS=1 python3 bench/autograd_handover.py --out $OUT/t/omp1 --steps 200
run core3 taskset -c 3 python3 bench/autograd_handover.py --out $OUT/t/core3 --steps 200
run sib taskset -c $SIB python3 bench/autograd_handover.py --out $OUT/t/sib --steps 200
run far taskset -c 3,9 python3 bench/autograd_handover.py --out $OUT/t/far --steps 200
cd $OUT && tar -czf all.tgz t && rm -rf t
