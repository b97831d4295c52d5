"""WebGPU fp32 forward + backward time with a value head dim of its own vs Dv = D.

    PYTHONPATH=src python3 bench/lab/webgpu_value_dim_time.py [--shape B H S D] [--dv 128]
        [--repeat 3] [--json out.json]

Host arrays through the public API (upload and read-back included), no mask, each
case warmed once (pipeline compiles), then ``--repeat`` rounds timing each case once in
turn (a drifting machine load hits both alike); the median per case.  Prints (and with
--json writes) the adapter, the cases and the medians.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import anyattn as aa


def _once(q, k, v, g):
    t = time.perf_counter()
    out, lse = aa.attention(q, k, v, return_lse=True, backend="webgpu")
    aa.attention_backward(q, k, v, g, out=out, lse=lse, backend="webgpu")
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", type=int, nargs=4, default=(1, 8, 1024, 192))
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json")
    a = ap.parse_args()
    B, H, S, D = a.shape
    from anyattn.backends.registry import get_backend

    be = get_backend("webgpu")
    rng = np.random.default_rng(0)
    res = {"adapter": be.context.name, "shape": [B, H, S, D], "repeat": a.repeat, "cases": []}
    cases = []
    for dv in (a.dv, D):
        q = rng.standard_normal((B, H, S, D), dtype=np.float32)
        k = rng.standard_normal((B, H, S, D), dtype=np.float32)
        v = rng.standard_normal((B, H, S, dv), dtype=np.float32)
        g = rng.standard_normal((B, H, S, dv), dtype=np.float32)
        _once(q, k, v, g)                       # warm: compiles, buffers
        cases.append(((q, k, v, g), {"D": D, "Dv": dv, "times_s": []}))
    for _ in range(a.repeat):                   # interleaved: drifting load hits both
        for args, rec in cases:
            rec["times_s"].append(_once(*args))
    for _, rec in cases:
        rec["median_s"] = statistics.median(rec["times_s"])
        res["cases"].append(rec)
        print(f"D={D} Dv={rec['Dv']}: median {rec['median_s']:.2f} s of "
              f"{['%.2f' % t for t in rec['times_s']]}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
