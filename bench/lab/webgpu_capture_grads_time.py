"""WebGPU time of the backward with and without the gradients of score-function captures.

    PYTHONPATH=src python3 bench/lab/webgpu_capture_grads_time.py [--shape B H S D]
        [--repeat 5] [--cases rel qtemp ...] [--json out.json]

Cases (causal, fp32): ``rel`` a relative-position table ``table[h, q_idx - kv_idx + S - 1]``
(a diagonal read), ``qtemp`` a per-query temperature ``temp[h, q_idx]`` (a row read),
``kbias`` a per-key bias ``kb[h, kv_idx]`` (a column read), ``mix`` all three in one
function, ``pair`` a per-head pair table ``pt[h, q_idx, kv_idx]`` (a pair read).  Per case: out and the row statistics from one WebGPU forward, then the
backward with wrt=(q, k, v) and with the captures added (host arrays through the public
API, read-back included), each warmed once (pipeline compiles, timed and printed), then
``--repeat`` rounds timing both in turn; the median of each and the ratio, and whether two
runs' capture gradients are bitwise equal.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

import anyattn as aa


def _cases(H, S):
    rng = np.random.default_rng(0)
    rel = (0.5 * rng.standard_normal((H, 2 * S - 1))).astype(np.float32)
    temp = (1 + 0.1 * rng.standard_normal((H, S))).astype(np.float32)
    kb = (0.5 * rng.standard_normal((H, S))).astype(np.float32)
    pt = (0.5 * rng.standard_normal((H, S, S))).astype(np.float32)
    return {
        "rel": aa.ScoreMod(lambda s, b, h, i, j, table: s + table[h, i - j + S - 1],
                           table=rel),
        "qtemp": aa.ScoreMod(lambda s, b, h, i, j, temp: s * temp[h, i], temp=temp),
        "kbias": aa.ScoreMod(lambda s, b, h, i, j, kb: s + kb[h, j], kb=kb),
        "mix": aa.ScoreMod(lambda s, b, h, i, j, table, temp, kb:
                           s * temp[h, i] + table[h, i - j + S - 1] + kb[h, j],
                           table=rel, temp=temp, kb=kb),
        "pair": aa.ScoreMod(lambda s, b, h, i, j, pt: s + pt[h, i, j], pt=pt),
    }


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", type=int, nargs=4, default=(1, 4, 256, 32),
                    metavar=("B", "H", "S", "D"))
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--cases", nargs="*")
    ap.add_argument("--json")
    a = ap.parse_args()
    B, H, S, D = a.shape
    from anyattn.backends.registry import get_backend

    be = get_backend("webgpu")
    rng = np.random.default_rng(1)
    q, k, v, g = (rng.standard_normal((B, H, S, D)).astype(np.float32) for _ in range(4))
    cases = _cases(H, S)
    if a.cases:
        cases = {n: cases[n] for n in a.cases}
    res = {"adapter": be.context.name, "shape": [B, H, S, D], "cases": {}}
    for name, sm in cases.items():
        kw = dict(score_mod=sm, mask=aa.Causal(), backend="webgpu")
        out, lse = aa.attention(q, k, v, return_lse=True, **kw)
        plain, full = ("q", "k", "v"), ("q", "k", "v") + tuple(sorted(sm.captures))

        def bwd(wrt):
            t = time.perf_counter()
            r = aa.attention_backward(q, k, v, g, out=out, lse=lse, wrt=wrt, **kw)
            return time.perf_counter() - t, r

        warm = [bwd(w)[0] for w in (plain, full)]
        ts = {"without": [], "with": []}
        for _ in range(a.repeat):
            for tag, w in (("without", plain), ("with", full)):
                ts[tag].append(bwd(w)[0])
        med = {t: statistics.median(x) for t, x in ts.items()}
        r1, r2 = (bwd(full)[1].dcaptures for _ in range(2))
        same = all(np.array_equal(r1[n], r2[n]) for n in r1)
        res["cases"][name] = dict(med, ratio=med["with"] / med["without"], warm=warm,
                                  bitwise_repeat=same)
        print(f"{name:6s} bwd {med['without'] * 1e3:8.1f} ms  + captures "
              f"{med['with'] * 1e3:8.1f} ms  x{med['with'] / med['without']:5.2f}  repeat "
              f"{'equal' if same else 'DIFFERS'}  (first calls {warm[0]:.1f} s / "
              f"{warm[1]:.1f} s)", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
