"""Decoding on the NumPy backend: a paged cache (attention(..., pages=)) vs the same keys
in a contiguous cache [B, Hkv, Sk, D], in one process (``--backend webgpu``: the webgpu
backend, NumPy arrays or, with ``--device-arrays``, anyattn.webgpu device arrays that
stay on the device; out read back on the host in both variants).  On the numpy backend
a third variant, ``contiguous_per_head``, runs the contiguous call with one unit per
query head (``NumpyConfig(stack_heads=False)``, the dense forward before it stacked a
group's query heads) for a paired before/after.

Shape legend: B batch, Hq/Hkv heads, Sq queries per sequence, D head dim, Sk keys per
sequence (the cache), P positions per page.

Both calls see the same keys: sequence b's pages are a shuffled set of
``Sk / P`` pages of one pool; the contiguous cache holds them in order.  The two
variants run interleaved, round after round, so load from other processes hits them
alike; it reports the median and min over the rounds and the median per-round ratio.
The outputs are compared (fp32, every element) before timing.

    PYTHONPATH=src python3 bench/numpy_paged_decode.py --reps 5
    PYTHONPATH=src python3 bench/numpy_paged_decode.py --backend webgpu --device-arrays \
        --batch 2 --heads-q 8 --heads-kv 2 --head-dim 64 --cache 1024 --reps 3
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import anyattn as aa  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads-q", type=int, default=32)
    ap.add_argument("--heads-kv", type=int, default=8)
    ap.add_argument("--seq-q", type=int, default=1)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--cache", type=int, default=8192)
    ap.add_argument("--page", type=int, default=16)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--layout", choices=("bhsd", "bshd"), default="bhsd",
                    help="the pages' layout: [N, Hkv, P, D] or FlashAttention's [N, P, Hkv, D]")
    ap.add_argument("--backend", choices=("numpy", "webgpu"), default="numpy")
    ap.add_argument("--device-arrays", action="store_true",
                    help="webgpu: q and both caches as anyattn.webgpu device arrays")
    ap.add_argument("--out", type=str, default=None, help="write the results as JSON here")
    a = ap.parse_args()
    B, Hq, Hkv, Sq, D, Sk, P = (a.batch, a.heads_q, a.heads_kv, a.seq_q, a.head_dim,
                                a.cache, a.page)
    rng = np.random.default_rng(0)
    n = Sk // P
    k_pages = rng.standard_normal((B * n, Hkv, P, D), dtype=np.float32)
    v_pages = rng.standard_normal((B * n, Hkv, P, D), dtype=np.float32)
    table = rng.permutation(B * n).reshape(B, n).astype(np.int32)
    lengths = np.full(B, Sk, np.int32)
    k = k_pages[table].transpose(0, 2, 1, 3, 4).reshape(B, Hkv, Sk, D).copy()
    v = v_pages[table].transpose(0, 2, 1, 3, 4).reshape(B, Hkv, Sk, D).copy()
    q = rng.standard_normal((B, Hq, Sq, D), dtype=np.float32)
    mask = aa.Causal(align="bottom_right")
    pages = aa.Pages(table, lengths)
    if a.layout == "bshd":
        qp, kp, vp = (np.ascontiguousarray(x.swapaxes(1, 2)) for x in (q, k_pages, v_pages))
    else:
        qp, kp, vp = q, k_pages, v_pages
    qc, kc, vc = q, k, v
    if a.device_arrays:
        if a.backend != "webgpu":
            ap.error("--device-arrays needs --backend webgpu")
        import anyattn.webgpu as webgpu

        qp, kp, vp, qc, kc, vc = (webgpu.asarray(x) for x in (qp, kp, vp, qc, kc, vc))

    def host(x):
        return x.numpy() if hasattr(x, "numpy") and not isinstance(x, np.ndarray) else x

    def paged():
        out = host(aa.attention(qp, kp, vp, pages=pages, mask=mask, backend=a.backend,
                                layout=a.layout))
        return out if a.layout == "bhsd" else out.swapaxes(1, 2)

    def contiguous():
        return host(aa.attention(qc, kc, vc, mask=mask, backend=a.backend))

    variants = [("paged", paged), ("contiguous", contiguous)]
    if a.backend == "numpy":
        from anyattn.backends.registry import get_backend

        be = get_backend("numpy")

        def contiguous_per_head():
            cfg = be.config
            be.config = dataclasses.replace(cfg, stack_heads=False)
            try:
                return aa.attention(qc, kc, vc, mask=mask, backend="numpy")
            finally:
                be.config = cfg

        variants.append(("contiguous_per_head", contiguous_per_head))
    diff = float(np.max(np.abs(paged() - contiguous())))
    diffs = {name: float(np.max(np.abs(fn() - contiguous()))) for name, fn in variants[2:]}
    times = {name: [] for name, _ in variants}
    for _ in range(a.reps):
        for name, fn in variants:
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    ratio = statistics.median(p / c for p, c in zip(times["paged"], times["contiguous"]))
    extra = {f"contiguous_over_{n}_median_ratio": statistics.median(
        c / x for c, x in zip(times["contiguous"], times[n])) for n, _ in variants[2:]}
    res = {"shape": dict(B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, D=D, Sk=Sk, page=P, dtype="float32",
                         pages_layout=a.layout),
           "backend": a.backend, "device_arrays": a.device_arrays,
           "max_abs_diff": diff,
           **{f"{k}_median_ms": 1e3 * statistics.median(t) for k, t in times.items()},
           **{f"{k}_min_ms": 1e3 * min(t) for k, t in times.items()},
           "paged_over_contiguous_median_ratio": ratio, **extra,
           **{f"max_abs_diff_{n}": d for n, d in diffs.items()},
           "cache_bytes": int(k.nbytes + v.nbytes)}
    print(json.dumps(res, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
