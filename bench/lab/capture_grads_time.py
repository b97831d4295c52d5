"""CUDA time of the Triton backward with and without the gradients of score-function
captures, their error against the float64 reference at a small size, and repeatability.

    PYTHONPATH=src python3 bench/lab/capture_grads_time.py [--shape B H S D]
        [--dtype bfloat16] [--repeat 20] [--json out.json]

Cases (causal, learnable tables from examples/gallery.py's spellings): ``rel`` a
relative-position table ``table[h, q_idx - kv_idx + S - 1]``, ``t5`` T5 buckets
``table[h, bucket[kv_idx - q_idx + S - 1]]``, ``slopes`` learnable ALiBi slopes
``slopes[h]``, ``qtemp`` a per-query temperature ``temp[h, q_idx]`` (a row read),
``kbias`` a per-key bias ``kb[h, kv_idx]`` (a column read), ``pair`` a per-pair table
``pt[h, q_idx, kv_idx]`` (a pair read: H·S² floats, and as much fp32 scratch per
batch).  Per case: the backward
with wrt=(q, k, v) and with wrt=(q, k, v, <capture>) (out and the row statistics
from one forward, given), the median of
``--repeat`` timed runs after two warm-ups (torch.cuda.Event), the ratio; then two
runs' capture gradients compared bit for bit, and at B=1, H=2, S=256 the capture
gradient's relative error against the float64 reference (on the CPU).  ``--device cpu``
with TRITON_INTERPRET=1 and a tiny shape is a smoke run of the script (S=32 there).
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import time

import numpy as np
import torch

import anyattn as aa


def _cases(H, S):
    rng = np.random.default_rng(0)
    rel = torch.from_numpy((0.5 * rng.standard_normal((H, 2 * S - 1))).astype(np.float32))
    n = np.abs(np.arange(-(S - 1), S))
    big = 8 + (np.log(np.maximum(n, 1) / 8) / math.log(128 / 8) * 8).astype(np.int64)
    bucket = (np.where(n < 8, n, np.minimum(big, 15))
              + np.where(np.arange(-(S - 1), S) > 0, 16, 0)).astype(np.int32)
    t5 = torch.from_numpy((0.5 * rng.standard_normal((H, 32))).astype(np.float32))
    slopes = torch.from_numpy((2.0 ** -np.arange(1, H + 1)).astype(np.float32))
    temp = torch.from_numpy((1 + 0.1 * rng.standard_normal((H, S))).astype(np.float32))
    kb = torch.from_numpy((0.5 * rng.standard_normal((H, S))).astype(np.float32))
    pt = torch.from_numpy((0.5 * rng.standard_normal((H, S, S))).astype(np.float32))
    return {
        "rel": (aa.ScoreMod(lambda s, b, h, i, j, table: s + table[h, i - j + S - 1],
                            table=rel), "table"),
        "t5": (aa.ScoreMod(lambda s, b, h, i, j, bucket, table:
                           s + table[h, bucket[j - i + S - 1]],
                           bucket=torch.from_numpy(bucket), table=t5), "table"),
        "slopes": (aa.ScoreMod(lambda s, b, h, i, j, slopes: s - slopes[h] * abs(i - j),
                               slopes=slopes), "slopes"),
        "qtemp": (aa.ScoreMod(lambda s, b, h, i, j, temp: s * temp[h, i], temp=temp), "temp"),
        "kbias": (aa.ScoreMod(lambda s, b, h, i, j, kb: s + kb[h, j], kb=kb), "kb"),
        "pair": (aa.ScoreMod(lambda s, b, h, i, j, pt: s + pt[h, i, j], pt=pt), "pt"),
    }


def _time(fn, repeat, dev):
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeat):
        if dev == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:                         # a smoke run under TRITON_INTERPRET=1
            t = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t))
    return statistics.median(times)


def _on(sm, dev):
    """The score function with its captures on ``dev``."""
    return aa.ScoreMod(sm.fn, **{n: t.to(dev) for n, t in sm.captures.items()})


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=int, nargs=4, default=(1, 16, 2048, 128),
                    metavar=("B", "H", "S", "D"))
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--json")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run (TRITON_INTERPRET=1)")
    a = ap.parse_args()
    B, H, S, D = a.shape
    dt = getattr(torch, a.dtype)
    dev = a.device
    g = torch.Generator(device=dev).manual_seed(1)
    q, k, v, dout = (torch.randn(B, H, S, D, device=dev, generator=g, dtype=dt)
                     for _ in range(4))
    res = {"shape": [B, H, S, D], "dtype": a.dtype,
           "device": torch.cuda.get_device_name() if dev == "cuda" else dev, "cases": {}}
    for name, (sm, cap) in _cases(H, S).items():
        sm = _on(sm, dev)
        kw = dict(score_mod=sm, mask=aa.Causal(), backend="triton")
        out, st = aa.forward_with_stats(q, k, v, **kw)

        def bwd(wrt):
            return aa.attention_backward(q, k, v, dout, out=out, lse=st, wrt=wrt, **kw)

        base = _time(lambda: bwd(("q", "k", "v")), a.repeat, dev)
        with_c = _time(lambda: bwd(("q", "k", "v", cap)), a.repeat, dev)
        r1, r2 = (bwd(("q", "k", "v", cap)).dcaptures[cap] for _ in range(2))
        # error at a small size against the float64 reference
        n = 256 if dev == "cuda" else 32
        small = _cases(2, n)[name][0]
        xs = [torch.randn(1, 2, n, 64, generator=torch.Generator().manual_seed(i))
              for i in range(4)]
        got = aa.attention_backward(*(x.to(dev, dt) for x in xs), wrt=(cap,),
                                    score_mod=_on(small, dev), mask=aa.Causal(),
                                    backend="triton").dcaptures[cap].double().cpu().numpy()
        xr = [x.to(dt).double().numpy() for x in xs]
        ref = aa.attention_backward(*xr, wrt=(cap,), score_mod=small, mask=aa.Causal(),
                                    backend="reference").dcaptures[cap]
        err = float(np.abs(got - ref).max() / np.abs(ref).max())
        res["cases"][name] = dict(bwd_ms=base, bwd_with_capture_ms=with_c,
                                  ratio=with_c / base, bitwise_repeat=bool(torch.equal(r1, r2)),
                                  rel_err_small=err)
        print(f"{name:7s} bwd {base:8.3f} ms  + d{cap} {with_c:8.3f} ms  x{with_c / base:5.2f}"
              f"  repeat {'equal' if torch.equal(r1, r2) else 'DIFFERS'}  err {err:.1e}",
              flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
