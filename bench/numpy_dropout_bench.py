"""Cost of attention dropout on the NumPy backend: plain vs dropout_p = 0.1, forward +
backward, in one process.

Shape legend: B batch, H heads, S = Sq = Sk tokens, D head dim.

Per mask (none, causal) and worker count it times ``anyattn.forward_with_stats`` then
``anyattn.attention_backward(out=, lse=stats)`` (a training step's two calls; wrt q,
k, v) with and without dropout.  The variants run interleaved, round after round, so
that load from other processes on a shared machine hits them alike; the ratio is the
median over rounds of (dropout step / plain step in the same round), as in
``bench/numpy_modifiers_bench.py``; medians of the forward, the backward and their sum
are reported too.  The issue's target: dropout with p = 0.1 <= 1.3x plain (forward +
backward).  The outputs are checked against the float64 reference (the same mask)
on a small problem before timing.

    PYTHONPATH=src python3 bench/numpy_dropout_bench.py --threads 2,1 --reps 25 \\
        --out dev/perf/numpy-dropout-cpu-2026-12-03.json \\
        --png dev/perf/numpy-dropout-cpu-2026-12-03.png
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import anyattn as aa  # noqa: E402
from anyattn import reference as R  # noqa: E402
from numpy_paired import machine, paired_rounds  # noqa: E402

VARIANTS = ("plain", "dropout")


def options(variant: str, p: float) -> dict:
    return {} if variant == "plain" else {"dropout_p": p, "dropout_seed": 2 ** 63 + 12345}


def check_small(dtype, p: float) -> float:
    """Max relative error (out, dq, dk, dv) vs the float64 reference with the same
    dropout, causal, on a small problem: the benchmark times correct code."""
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((1, 4, 300, 32)).astype(dtype) for _ in range(4))
    kw = dict(options("dropout", p), mask=aa.Causal())
    out = aa.attention(q, k, v, backend="numpy", **kw)
    gr = aa.attention_backward(q, k, v, g, backend="numpy", **kw)
    ro, _ = R.forward(q, k, v, **kw)
    rg = R.backward(q, k, v, g, **kw)
    return max(float(np.max(np.abs(a - b)) / np.max(np.abs(b)))
               for a, b in ((out, ro), (gr.dq, rg.dq), (gr.dk, rg.dk), (gr.dv, rg.dv)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--S", type=int, default=1024)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--p", type=float, default=0.1)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--reps", type=int, default=9, help="rounds (each runs every variant)")
    ap.add_argument("--masks", default="none,causal")
    ap.add_argument("--threads", default="2,1",
                    help="NumPy backend worker counts to run (one group of bars each)")
    ap.add_argument("--out", default=None, help="JSON path")
    ap.add_argument("--png", default=None, help="bar chart path")
    ap.add_argument("--replot", default=None, metavar="JSON",
                    help="only draw --png from a JSON this script wrote")
    args = ap.parse_args()
    if args.replot:
        plot(json.loads(Path(args.replot).read_text()), args.png)
        return

    dtype = np.dtype(args.dtype)
    B, H, S, D = args.B, args.H, args.S, args.D
    err = check_small(dtype, args.p)
    if err > (1e-5 if dtype == np.float32 else 1e-12):
        raise SystemExit(f"numpy backend with dropout off by {err:.3g} vs the reference")
    rng = np.random.default_rng(1)
    q, k, v, g = (rng.standard_normal((B, H, S, D)).astype(dtype) for _ in range(4))
    load0 = os.getloadavg()
    results = []
    groups = [(int(t), m) for t in args.threads.split(",") for m in args.masks.split(",")]
    kws = {vn: options(vn, args.p) for vn in VARIANTS}
    for threads, mask_name in groups:
        results += paired_rounds((q, k, v, g), VARIANTS, kws, threads=threads,
                                 mask_name=mask_name, reps=args.reps)
    doc = {
        "what": "NumPy backend: forward_with_stats + attention_backward(out=, lse=stats), "
                f"plain vs dropout_p={args.p}; interleaved rounds; ratio_step = median over "
                "rounds of dropout step / plain step of the same round (ratio_fwd, "
                "ratio_bwd likewise); times are medians",
        "target": "dropout p = 0.1 <= 1.3x plain (forward + backward)",
        "shape": {"B": B, "H": H, "S": S, "D": D, "dtype": str(dtype)}, "p": args.p,
        "reps": args.reps, "check_max_rel_err": err,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "loadavg_start": load0, "loadavg_end": os.getloadavg(),
        "results": results,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    if args.png:
        plot(doc, args.png)

def plot(doc: dict, path: str) -> None:
    """Bar chart of the dropout/plain ratios (forward, backward, their sum with IQR)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = [r for r in doc["results"] if r["variant"] == "dropout"]
    sh = doc["shape"]
    labels = [f"{r['mask']}\n{r['threads']} thread{'s' if r['threads'] > 1 else ''}"
              for r in rs]
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    x = np.arange(len(rs))
    w = 0.27
    for off, key, name in ((-w, "ratio_fwd", "forward"), (0, "ratio_bwd", "backward"),
                           (w, "ratio_step", "fwd + bwd (IQR)")):
        ys = [r[key] for r in rs]
        yerr = None
        if key == "ratio_step":
            yerr = [[y - r["ratio_step_q1_q3"][0] for y, r in zip(ys, rs)],
                    [r["ratio_step_q1_q3"][1] - y for y, r in zip(ys, rs)]]
        bars = ax.bar(x + off, ys, w, label=name, yerr=yerr, capsize=2)
        for b_, y in zip(bars, ys):
            ax.text(b_.get_x() + b_.get_width() / 2, y + 0.02, f"{y:.2f}", ha="center",
                    fontsize=7)
    ax.axhline(1.3, color="red", ls="--", lw=1, label="target 1.3 (fwd + bwd)")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(x, labels)
    top = max(max(r["ratio_fwd"], r["ratio_bwd"], r["ratio_step_q1_q3"][1]) for r in rs)
    ax.set_ylim(0.6, max(1.5, top) + 0.12)
    ax.set_ylabel(f"time with dropout p={doc['p']} / plain\n(median of paired rounds)")
    m = doc["machine"]
    ax.set_title(f"NumPy backend dropout, B={sh['B']} H={sh['H']} S={sh['S']} D={sh['D']} "
                 f"{sh['dtype']}, {m['usable_cpus']} cores (shared, load "
                 f"{doc['loadavg_start'][0]:.1f}-{doc['loadavg_end'][0]:.1f}), "
                 f"{doc['reps']} rounds\n{m.get('cpu', 'CPU')}", fontsize=9)
    ax.legend(fontsize=7, loc="lower center", ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
