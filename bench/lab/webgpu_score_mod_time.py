"""WebGPU time of score / mask functions vs the built-in they spell (generated WGSL).

    PYTHONPATH=src python3 bench/lab/webgpu_score_mod_time.py [--shape B H S D]
        [--repeat 5] [--json out.json]

Pairs (function / built-in): softcap ``c * tanh(score / c)`` / ``softcap=c``; ALiBi
``score - slopes[h] * |i - j|`` / ``alibi_slopes=`` (both causal); causal
``MaskMod(kv_idx <= q_idx)`` (lowered to the band term) / ``Causal()``; chunked
``MaskMod(q_idx // C == kv_idx // C) & Causal()`` / ``Causal() & Documents(i // C)``.
Host arrays through the public API (upload and read-back included), fp32, each case
warmed once (pipeline compiles, timed and printed), then ``--repeat`` rounds timing
each case once in turn; the median per case, forward and forward + backward.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import anyattn as aa


def _pairs(H, S, chunk=64):
    cap = 20.0
    slopes = (2.0 ** -np.arange(1, H + 1)).astype(np.float32)
    ids = np.arange(S) // chunk
    return {
        "softcap": (dict(score_mod=lambda s, b, h, i, j: cap * np.tanh(s / cap)),
                    dict(softcap=cap)),
        "alibi": (dict(score_mod=aa.ScoreMod(lambda s, b, h, i, j, sl: s - sl[h] * abs(i - j),
                                             sl=slopes), mask=aa.Causal()),
                  dict(alibi_slopes=slopes, mask=aa.Causal())),
        "causal": (dict(mask=aa.MaskMod(lambda b, h, i, j: j <= i)), dict(mask=aa.Causal())),
        "chunked": (dict(mask=aa.MaskMod(lambda b, h, i, j: i // chunk == j // chunk)
                         & aa.Causal()),
                    dict(mask=aa.Causal() & aa.Documents(ids))),
    }


def _time(kw, q, k, v, g, bwd):
    t = time.perf_counter()
    out, lse = aa.attention(q, k, v, return_lse=True, backend="webgpu", **kw)
    if bwd:
        aa.attention_backward(q, k, v, g, out=out, lse=lse, backend="webgpu", **kw)
    return time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", type=int, nargs=4, default=(1, 4, 512, 64))
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--pairs", nargs="*")
    ap.add_argument("--json")
    a = ap.parse_args()
    B, H, S, D = a.shape
    from anyattn.backends.registry import get_backend

    be = get_backend("webgpu")
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((B, H, S, D)).astype(np.float32) for _ in range(4))
    pairs = _pairs(H, S)
    if a.pairs:
        pairs = {n: pairs[n] for n in a.pairs}
    res = {"adapter": be.context.name, "shape": [B, H, S, D], "pairs": {}}
    for name, (fn, bi) in pairs.items():
        row = {}
        for bwd in (False, True):
            what = "fwd+bwd" if bwd else "fwd"
            warm = [_time(kw, q, k, v, g, bwd) for kw in (fn, bi)]
            ts = {"function": [], "builtin": []}
            for _ in range(a.repeat):
                for tag, kw in (("function", fn), ("builtin", bi)):
                    ts[tag].append(_time(kw, q, k, v, g, bwd))
            med = {t: statistics.median(x) for t, x in ts.items()}
            row[what] = dict(med, ratio=med["function"] / med["builtin"], warm=warm)
            print(f"{name:8s} {what:8s} function {med['function'] * 1e3:8.1f} ms  built-in "
                  f"{med['builtin'] * 1e3:8.1f} ms  ratio {row[what]['ratio']:.2f}  "
                  f"(first calls {warm[0]:.1f} s / {warm[1]:.1f} s)", flush=True)
        res["pairs"][name] = row
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
