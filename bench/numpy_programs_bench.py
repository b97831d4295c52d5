"""Score and mask functions on the NumPy backend against the nearest built-in, in one
process: causal as a MaskMod vs Causal(), softcap as a score function vs softcap=, a
relative-position table as a ScoreMod vs the same dense bias, ALiBi as a ScoreMod vs
alibi_slopes=, a sliding window as a MaskMod vs Causal() & Window(), chunked attention
as a MaskMod vs Causal() & Documents(chunk ids); and the first call's trace time.

Shape legend: B batch, H heads, S = Sq = Sk tokens, D head dim.

Each pair runs interleaved, round after round (the order alternating), so that load
from other processes hits both alike; it reports the medians over the rounds of the
forward (``forward_with_stats``) and of forward + backward (wrt q, k, v; the table's
gradient too where the function has one), and the median over rounds of the paired
ratio function / built-in.  Every pair is first checked to agree on a small problem.

    PYTHONPATH=src python3 bench/numpy_programs_bench.py --reps 5
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import anyattn as aa  # noqa: E402


def pairs(H: int, S: int, rng):
    """name -> (built-in kwargs, function kwargs, extra wrt of the function)."""
    tab = (0.5 * rng.standard_normal((H, 2 * S - 1))).astype(np.float32)
    i, j = np.arange(S)[:, None], np.arange(S)[None, :]
    bias = np.ascontiguousarray(tab[:, i - j + S - 1][None])              # [1, H, S, S]
    chunk = 256
    slopes = (2.0 ** (-8.0 * np.arange(1, H + 1) / H)).astype(np.float32)
    return {
        "causal": (dict(mask=aa.Causal()),
                   dict(mask=aa.MaskMod(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx)), ()),
        "softcap": (dict(softcap=30.0),
                    dict(score_mod=lambda s, b, h, q_idx, kv_idx: 30.0 * np.tanh(s / 30.0)),
                    ()),
        "relpos": (dict(bias=bias, mask=aa.Causal()),
                   dict(score_mod=aa.ScoreMod(lambda s, b, h, q_idx, kv_idx, tab:
                                              s + tab[h, q_idx - kv_idx + (S - 1)], tab=tab),
                        mask=aa.Causal()), ("tab",)),
        "alibi": (dict(alibi_slopes=slopes, mask=aa.Causal()),
                  dict(score_mod=aa.ScoreMod(lambda s, b, h, q_idx, kv_idx, slopes:
                                             s - slopes[h] * abs(q_idx - kv_idx),
                                             slopes=slopes), mask=aa.Causal()), ()),
        "window": (dict(mask=aa.Causal() & aa.Window(left=255)),
                   dict(mask=aa.MaskMod(lambda b, h, q_idx, kv_idx:
                                        (kv_idx <= q_idx) & (q_idx - kv_idx <= 255))), ()),
        "chunked": (dict(mask=aa.Causal() & aa.Documents(np.arange(S) // chunk)),
                    dict(mask=aa.MaskMod(lambda b, h, q_idx, kv_idx:
                                         (q_idx // chunk == kv_idx // chunk)
                                         & (kv_idx <= q_idx))), ()),
    }


def step(q, k, v, g, kw, wrt):
    t0 = time.perf_counter()
    out, st = aa.forward_with_stats(q, k, v, backend="numpy", **kw)
    t1 = time.perf_counter()
    aa.attention_backward(q, k, v, g, out=out, lse=st, wrt=("q", "k", "v") + wrt,
                          backend="numpy", **kw)
    return t1 - t0, time.perf_counter() - t0


def check(H: int) -> None:
    """Every pair agrees on a small problem (the relpos pair through its dense bias)."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, H, 96, 16)).astype(np.float32) for _ in range(3))
    for name, (bi, fn, _) in pairs(H, 96, rng).items():
        a, b = aa.attention(q, k, v, **bi), aa.attention(q, k, v, **fn)
        err = float(np.abs(a - b).max() / np.abs(b).max())
        assert err < 1e-5, (name, err)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--S", type=int, default=2048)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", default="", help="comma-separated pair names")
    a = ap.parse_args()
    t0 = time.perf_counter()
    aa.ScoreMod(lambda s, b, h, q_idx, kv_idx: 30.0 * np.tanh(s / 30.0))
    t1 = time.perf_counter()
    aa.MaskMod(lambda b, h, q_idx, kv_idx: (q_idx // 256 == kv_idx // 256) & (kv_idx <= q_idx))
    t2 = time.perf_counter()
    print(f"trace: a softcap ScoreMod {1e3 * (t1 - t0):.2f} ms, a chunked MaskMod "
          f"{1e3 * (t2 - t1):.2f} ms")
    check(4)
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((a.B, a.H, a.S, a.D)).astype(np.float32)
                  for _ in range(4))
    for name, (bi, fn, wrt) in pairs(a.H, a.S, rng).items():
        if a.only and name not in a.only.split(","):
            continue
        step(q, k, v, g, bi, ())
        t_first = time.perf_counter()
        step(q, k, v, g, fn, wrt)                                  # first call (warm-up)
        t_first = time.perf_counter() - t_first
        tb, tf = [], []
        for r in range(a.reps):
            for which in ((0, 1) if r % 2 == 0 else (1, 0)):
                (tb if which == 0 else tf).append(
                    step(q, k, v, g, bi, ()) if which == 0 else step(q, k, v, g, fn, wrt))
        med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
        rf = statistics.median(f[0] / b[0] for f, b in zip(tf, tb))
        rs = statistics.median(f[1] / b[1] for f, b in zip(tf, tb))
        print(f"{name:8s} built-in fwd {med(tb, 0) * 1e3:7.1f} ms step {med(tb, 1) * 1e3:7.1f} ms"
              f" | function fwd {med(tf, 0) * 1e3:7.1f} ms step {med(tf, 1) * 1e3:7.1f} ms"
              f" (first {t_first * 1e3:.0f} ms) | ratio fwd x{rf:.2f} step x{rs:.2f}",
              flush=True)


if __name__ == "__main__":
    main()
