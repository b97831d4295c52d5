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

``--gallery`` times every entry of examples/gallery.py instead, against the nearest
built-in spelling: the entry's own ``builtin`` where it has one; else, for a score
function that adds a term to the score, that term as a dense bias (its gradient asked
for where the function's captures' are); for a mask function, the same pattern as a
dense ``KeepMask``; for the per-head temperature, the queries scaled per head under
``Causal("bottom_right")``.  ``--runs`` repeats the whole paired measurement (runs
apart show the noise of the machine's load); ``--json`` writes every run's medians.

    PYTHONPATH=src python3 bench/numpy_programs_bench.py --gallery --B 1 --H 4 \
        --S 1024 --D 64 --reps 5 --runs 2 --json out.json

``--backend webgpu`` times the same pairs on the WebGPU backend (host arrays through
the public API, upload and read-back included; wall time on a GPU).  On lavapipe (a
CPU standing in for a GPU's shader cost) run it with ``LP_NUM_THREADS=1``: the clock is
then process CPU time, which other processes' load moves far less than wall time.

    LP_NUM_THREADS=1 PYTHONPATH=src python3 bench/numpy_programs_bench.py --gallery \
        --backend webgpu --B 1 --H 4 --S 512 --D 64 --reps 5 --runs 2
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
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


#: the backend ``step`` runs on and the clock it reads (``--backend``): wall time, but
#: process CPU time for webgpu on lavapipe (LP_NUM_THREADS=1: the CPU time of its one
#: shader thread plus the host work, which other processes' load moves far less)
BACKEND = "numpy"
CLOCK = time.perf_counter


def step(q, k, v, g, kw, wrt, base=("q", "k", "v")):
    t0 = CLOCK()
    out, st = aa.forward_with_stats(q, k, v, backend=BACKEND, **kw)
    t1 = CLOCK()
    aa.attention_backward(q, k, v, g, out=out, lse=st, wrt=base + wrt,
                          backend=BACKEND, **kw)
    return t1 - t0, CLOCK() - t0


def check(H: int) -> None:
    """Every pair agrees on a small problem (the relpos pair through its dense bias)."""
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, H, 96, 16)).astype(np.float32) for _ in range(3))
    for name, (bi, fn, _) in pairs(H, 96, rng).items():
        a, b = aa.attention(q, k, v, **bi), aa.attention(q, k, v, **fn)
        err = float(np.abs(a - b).max() / np.abs(b).max())
        assert err < 1e-5, (name, err)


def _gallery():
    path = Path(__file__).resolve().parents[1] / "examples" / "gallery.py"
    spec = importlib.util.spec_from_file_location("anyattn_gallery", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("anyattn_gallery", mod)
    spec.loader.exec_module(mod)
    return mod


def nearest(e, q, B: int, H: int, S: int):
    """An entry's nearest built-in spelling -> (kwargs, extra wrt, queries, what it is);
    see the module docstring."""
    if e.builtin is not None:
        wrt = ("bias",) if e.wrt and "bias" in e.builtin else ()
        return e.builtin, wrt, q, "built-in"
    sm = e.kwargs.get("score_mod")
    if sm is None:                                     # mask functions: a dense pattern
        from anyattn.masks import resolve
        keep = resolve(e.kwargs["mask"], B, H, S, S).dense_keep(B, H)
        return dict(mask=aa.KeepMask(np.ascontiguousarray(keep))), (), q, "dense KeepMask"
    if e.name == "per-head temperature":               # score·temp[h]: queries · temp[h]
        temp = sm.captures["temp"]
        return (dict(mask=aa.Causal("bottom_right")), (),
                (q * temp[None, :, None, None]).astype(q.dtype), "q·temp, causal")
    bound = sm.program.bind(sm.captures, (B, H, S, S))
    zero = bound.score_dense(np.zeros((B, H, S, S)))
    one = bound.score_dense(np.ones((B, H, S, S)))
    if not np.array_equal(one - zero, np.ones_like(zero)):   # pragma: no cover
        raise SystemExit(f"{e.name}: not an additive score function, no dense bias")
    bias = np.ascontiguousarray(zero[:1] if (zero == zero[:1]).all() else zero,
                                dtype=q.dtype)
    kw = {n: x for n, x in e.kwargs.items() if n != "score_mod"}
    return dict(bias=bias, **kw), ("bias",) if e.wrt else (), q, "dense bias"


def paired(q, k, v, g, bi, fn, reps: int):
    """Interleaved rounds of (built-in, function) -> medians and paired ratios (ms)."""
    (bkw, bwrt, bq), (fkw, fwrt) = bi, fn
    step(bq, k, v, g, bkw, bwrt)
    step(q, k, v, g, fkw, fwrt)                                   # warm-up
    tb, tf = [], []
    for r in range(reps):
        for which in ((0, 1) if r % 2 == 0 else (1, 0)):
            if which == 0:
                tb.append(step(bq, k, v, g, bkw, bwrt))
            else:
                tf.append(step(q, k, v, g, fkw, fwrt))
    med = lambda xs, i: statistics.median(x[i] for x in xs)  # noqa: E731
    return dict(builtin_fwd_ms=1e3 * med(tb, 0), builtin_step_ms=1e3 * med(tb, 1),
                fn_fwd_ms=1e3 * med(tf, 0), fn_step_ms=1e3 * med(tf, 1),
                ratio_fwd=statistics.median(f[0] / b[0] for f, b in zip(tf, tb)),
                ratio_step=statistics.median(f[1] / b[1] for f, b in zip(tf, tb)))


def gallery_main(a) -> None:
    global BACKEND, CLOCK
    BACKEND = a.backend
    adapter = None
    if a.backend == "webgpu":
        from anyattn.backends.registry import get_backend
        adapter = get_backend("webgpu").context.name
        if "llvmpipe" in adapter.lower():
            if os.environ.get("LP_NUM_THREADS") != "1":
                raise SystemExit("--backend webgpu on lavapipe: run with LP_NUM_THREADS=1 "
                                 "(one shader thread; the clock is process CPU time)")
            CLOCK = time.process_time
    gal = _gallery()
    B, H, S, D = a.B, a.H, a.S, a.D
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((B, H, S, D)).astype(np.float32) for _ in range(4))
    entries = {}
    for key, (make, _) in gal.GALLERY.items():
        if a.only and key not in a.only.split(","):
            continue
        e = make(B, H, S, S, np.random.default_rng(1))
        bkw, bwrt, bq, what = nearest(e, q, B, H, S)
        entries[key] = (e, (bkw, bwrt, bq), (e.kwargs, e.wrt), what)
    res = dict(shape=dict(B=B, H=H, S=S, D=D), dtype="float32", reps=a.reps,
               backend=a.backend, clock=CLOCK.__name__,
               machine=f"{platform.node()} {os.cpu_count()} CPUs", runs=[])
    if adapter is not None:
        res.update(adapter=adapter, LP_NUM_THREADS=os.environ.get("LP_NUM_THREADS"))
    for run in range(a.runs):
        rows = {}
        load0 = os.getloadavg()[0]
        for key, (e, bi, fn, what) in entries.items():
            r = paired(q, k, v, g, bi, fn, a.reps)
            r.update(name=e.name, versus=what, wrt=list(e.wrt))
            rows[key] = r
            print(f"run {run} {e.name:32s} vs {what:16s} built-in fwd {r['builtin_fwd_ms']:7.1f}"
                  f" step {r['builtin_step_ms']:7.1f} | fn fwd {r['fn_fwd_ms']:7.1f} step "
                  f"{r['fn_step_ms']:7.1f} ms | x{r['ratio_fwd']:.2f} / x{r['ratio_step']:.2f}",
                  flush=True)
        res["runs"].append(dict(load_before=load0, load_after=os.getloadavg()[0],
                                entries=rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--S", type=int, default=2048)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--only", default="", help="comma-separated pair (or entry) names")
    ap.add_argument("--gallery", action="store_true", help="every gallery entry instead")
    ap.add_argument("--runs", type=int, default=1, help="--gallery: whole measurements")
    ap.add_argument("--json", default="", help="--gallery: write the results here")
    ap.add_argument("--backend", choices=("numpy", "webgpu"), default="numpy",
                    help="--gallery: the backend of both spellings (webgpu: process CPU "
                         "time, LP_NUM_THREADS=1)")
    a = ap.parse_args()
    if a.backend != "numpy" and not a.gallery:
        ap.error("--backend webgpu times the gallery only: add --gallery")
    if a.gallery:
        return gallery_main(a)
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
