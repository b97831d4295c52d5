"""Cost of the score modifiers on the NumPy backend: plain vs softcap vs ALiBi vs sinks
vs all three, forward + backward, in one process.

Shape legend: B batch, H heads, S = Sq = Sk tokens, D head dim.

Per mask (none, causal) it times ``anyattn.forward_with_stats`` then
``anyattn.attention_backward(out=, lse=stats)`` (a training step's two calls; wrt
q, k, v, and sinks where there are sinks) for each variant.  The variants are run
interleaved, round after round, so that load from other processes on a shared
machine hits them alike; it reports the median (and min) over the rounds of the
forward, the backward and their sum; the ratio to plain is the median over rounds of
(variant step / plain step in the same round), which drifting load from other
processes cancels better than a ratio of medians (also reported); likewise for the
forward and the backward alone.  The issue's
target: each modifier <= 1.15x plain (forward + backward).

Modifiers: softcap c = 50 (Gemma 2), ALiBi slopes 2^(-8(h+1)/H) (the ALiBi paper's),
sinks ~ N(0, 1) per head.  The outputs are checked against the float64 reference on a
small problem before timing.

    PYTHONPATH=src python3 bench/numpy_modifiers_bench.py --threads 2,1 --reps 25 \\
        --out dev/perf/numpy-modifiers-cpu-2026-12-03.json \\
        --png dev/perf/numpy-modifiers-cpu-2026-12-03.png
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

VARIANTS = ("plain", "softcap", "alibi", "sinks", "all")


def modifiers(variant: str, H: int, dtype) -> dict:
    """The keyword arguments of one variant."""
    kw = {}
    if variant in ("softcap", "all"):
        kw["softcap"] = 50.0
    if variant in ("alibi", "all"):
        kw["alibi_slopes"] = (2.0 ** (-8.0 * np.arange(1, H + 1) / H)).astype(dtype)
    if variant in ("sinks", "all"):
        kw["sinks"] = np.random.default_rng(7).standard_normal(H).astype(dtype)
    return kw


def check_small(dtype) -> float:
    """Max relative error (out, dq, dk, dv, dsinks) vs the float64 reference, all
    modifiers, causal, on a small problem: the benchmark times correct code."""
    rng = np.random.default_rng(0)
    q, k, v, g = (rng.standard_normal((1, 4, 200, 32)).astype(dtype) for _ in range(4))
    kw = modifiers("all", 4, dtype)
    worst = 0.0
    out = aa.attention(q, k, v, mask=aa.Causal(), backend="numpy", **kw)
    gr = aa.attention_backward(q, k, v, g, mask=aa.Causal(), backend="numpy",
                               wrt=("q", "k", "v", "sinks"), **kw)
    ro, _ = R.forward(q, k, v, mask=aa.Causal(), **kw)
    rg = R.backward(q, k, v, g, mask=aa.Causal(), wrt=("q", "k", "v", "sinks"), **kw)
    for a, b in ((out, ro), (gr.dq, rg.dq), (gr.dk, rg.dk), (gr.dv, rg.dv),
                 (gr.dsinks, rg.dsinks)):
        worst = max(worst, float(np.max(np.abs(a - b)) / np.max(np.abs(b))))
    return worst


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--S", type=int, default=1024)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    ap.add_argument("--reps", type=int, default=9, help="rounds (each runs every variant)")
    ap.add_argument("--masks", default="none,causal")
    ap.add_argument("--threads", default="2,1",
                    help="NumPy backend worker counts to run (one group of bars each)")
    ap.add_argument("--out", default=None, help="JSON path")
    ap.add_argument("--png", default=None, help="bar chart path")
    args = ap.parse_args()

    dtype = np.dtype(args.dtype)
    B, H, S, D = args.B, args.H, args.S, args.D
    err = check_small(dtype)
    if err > (1e-5 if dtype == np.float32 else 1e-12):
        raise SystemExit(f"numpy backend with modifiers off by {err:.3g} vs the reference")
    rng = np.random.default_rng(1)
    q, k, v, g = (rng.standard_normal((B, H, S, D)).astype(dtype) for _ in range(4))
    load0 = os.getloadavg()
    results = []
    groups = [(int(t), m) for t in args.threads.split(",") for m in args.masks.split(",")]
    kws = {vn: modifiers(vn, H, dtype) for vn in VARIANTS}
    for threads, mask_name in groups:
        flops = 3.5 * 4 * B * H * S * S * D * (0.5 if mask_name == "causal" else 1.0)
        results += paired_rounds((q, k, v, g), VARIANTS, kws, threads=threads,
                                 mask_name=mask_name, reps=args.reps, flops=flops)
    doc = {
        "what": "NumPy backend: forward_with_stats + attention_backward(out=, lse=stats), "
                "plain vs softcap (c=50) vs ALiBi (slopes 2^(-8(h+1)/H)) vs sinks vs all; "
                "interleaved rounds; ratio_step = median over rounds of variant step / "
                "plain step of the same round; times are medians",
        "target": "each modifier <= 1.15x plain (forward + backward)",
        "shape": {"B": B, "H": H, "S": S, "D": D, "dtype": str(dtype)},
        "reps": args.reps, "check_max_rel_err": err,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
        "loadavg_start": load0, "loadavg_end": os.getloadavg(),
        "results": results,
    }
    if args.out:
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    if args.png:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(9, 4.2))
        width = 0.8 / len(groups)
        x = np.arange(len(VARIANTS))
        for mi, (threads, mname) in enumerate(groups):
            rs = [r for r in results if r["mask"] == mname and r["threads"] == threads]
            ys = [r["ratio_step"] for r in rs]
            err = [[y - r["ratio_step_q1_q3"][0] for y, r in zip(ys, rs)],
                   [r["ratio_step_q1_q3"][1] - y for y, r in zip(ys, rs)]]
            bars = ax.bar(x + (mi - (len(groups) - 1) / 2) * width, ys, width,
                          label=f"{mname}, {threads} thread{'s' if threads > 1 else ''}",
                          yerr=err, capsize=2)
            for b_, y, r in zip(bars, ys, rs):
                ax.text(b_.get_x() + b_.get_width() / 2, r["ratio_step_q1_q3"][1] + 0.01,
                        f"{y:.2f}", ha="center", fontsize=6.5)
        ax.axhline(1.15, color="red", ls="--", lw=1, label="target 1.15")
        ax.axhline(1.0, color="gray", lw=0.8)
        ax.set_xticks(x, VARIANTS)
        ax.set_ylabel("fwd+bwd time / plain\n(median of paired rounds, IQR)")
        ax.set_ylim(0.8, max(1.3, max(r["ratio_step_q1_q3"][1] for r in results) + 0.08))
        cpu = doc["machine"].get("cpu", "CPU")
        ax.set_title(f"NumPy backend, B={B} H={H} S={S} D={D} {dtype}, machine of "
                     f"{doc['machine']['usable_cpus']} cores (shared, load "
                     f"{doc['loadavg_start'][0]:.1f}-{doc['loadavg_end'][0]:.1f}), "
                     f"{args.reps} rounds\n{cpu}", fontsize=9)
        ax.legend(fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(args.png, dpi=110)


if __name__ == "__main__":
    main()
