#!/bin/bash
# Session 9 (lead), follow-up of gpu_s9_threads.sh (OMP_NUM_THREADS=1 made the calling-thread
# step 670 -> 437 us): which pool is it — OpenBLAS's (numpy; OPENBLAS_NUM_THREADS=1) or
# torch's intra-op pool (torch.set_num_threads(1))?  Thread lists before the first call too.
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
mkdir -p $OUT/t
python3 - <<'PY' | tee $OUT/t/threads_at_import.txt
from pathlib import Path
def names():
    d = {}
    for t in Path("/proc/self/task").glob("*"):
        n = (t / "comm").read_text().strip(); d[n] = d.get(n, 0) + 1
    return d
print("bare", names())
import numpy; print("numpy", names())
import torch; print("torch", names())
import anyattn.torch; print("anyattn.torch", names())
x = torch.randn(4, device="cuda"); torch.cuda.synchronize(); print("cuda init", names())
PY
run() { echo "=== $1"; shift; timeout 40 "$@" 2>&1 | grep -v Warn | grep -E "^module|^threads" | tail -5; }
run control python3 bench/autograd_handover.py --out $OUT/t/control --steps 200
run openblas1 env OPENBLAS_NUM_THREADS=1 python3 bench/autograd_handover.py --out $OUT/t/openblas1 --steps 200
run torch1 python3 bench/autograd_handover.py --out $OUT/t/torch1 --steps 200 --torch-threads 1
cd $OUT && tar -czf all.tgz t && rm -rf t
