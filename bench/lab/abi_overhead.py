"""What the seed ABI entry adds on top of the gradient itself (CPU, NumPy backend).

Times, side by side in one run, (a) validate + build the views, (b) anyattn's
attention_backward on those views, (c) attention_backward_arena end to end, for
fp32 (B, H, S, D) = (1, 8, 2048, 64), every mask kind, wrt = dQ/dK/dV.
Writes dev/perf/abi_overhead.json.  Run: PYTHONPATH=src python bench/lab/abi_overhead.py
"""
from __future__ import annotations

import json
import os
import platform
import time

import numpy as np

import anyattn as aa
from anyattn import abi


def best(fn, reps=3):
    ts = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return min(ts)


def main(B=1, H=8, S=2048, D=64, backend="numpy"):
    rng = np.random.default_rng(0)
    q, k, v, dy = (rng.standard_normal((B, H, S, D), dtype=np.float32) for _ in range(4))
    keep = (rng.random((S, S)) > 0.3).astype(np.float32)
    keep[5] = 0.0                                     # one uniform (quirk) row
    bias = rng.standard_normal((S, S)).astype(np.float32)
    masks = {0: None, 1: None, 2: keep, 3: None, 4: bias}
    rows = []
    for kind, m in masks.items():
        for wrt in (0, 1, 2):
            arena, p = abi.pack_arena(q, k, v, dy, wrt=wrt, mask_kind=kind, mask=m,
                                      window=256, layout="bshd")
            vw = abi.arena_views(arena, p)
            t_views = best(lambda: abi.arena_views(arena, p))
            t_grad = best(lambda: aa.attention_backward(
                vw.q, vw.k, vw.v, vw.dy, mask=vw.mask, bias=vw.bias, scale=vw.scale,
                wrt=(vw.wrt,), backend=backend))
            t_arena = best(lambda: abi.attention_backward_arena(arena, p, backend=backend))
            rows.append(dict(mask_kind=kind, wrt=wrt, validate_views_s=t_views,
                             grad_s=t_grad, arena_s=t_arena))
            print(f"kind {kind} wrt {wrt}: views {t_views*1e3:7.2f} ms  grad "
                  f"{t_grad*1e3:8.1f} ms  arena {t_arena*1e3:8.1f} ms")
    out = dict(shape=dict(B=B, H=H, S=S, D=D), dtype="float32", backend=backend,
               machine=f"{platform.node()} {os.cpu_count()} cores", date=time.strftime(
                   "%Y-%m-%d", time.gmtime()), timing="best of 3, seconds", rows=rows)
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.path.join(here, "..", "..", "dev", "perf", "abi_overhead.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(out, f, indent=1)
    print("wrote", os.path.normpath(path))


if __name__ == "__main__":
    main()
