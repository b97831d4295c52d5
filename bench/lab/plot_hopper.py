"""Bar charts of the Hopper benches' results, no GPU needed: TFLOP/s per shape (FA FLOP
convention: forward 4*B*H*S*S*D, backward 2.5x, causal halved; dK/dV alone counted as
0.8 of the backward).

  --part fwd   a gpu_hopper_bench.py result: each Hopper forward variant beside the
               portable kernel and SDPA (cuDNN, flash)
  --part bwd   a gpu_hopper_bwd.py result: the routed Hopper backward, each Hopper backward
               config alone, the portable backward and SDPA (cuDNN, flash)

    python bench/lab/plot_hopper.py --part fwd dev/perf/hopper-fwd-h200-2026-12-03.json \\
        --png out.png --rename "hopper=hopper (default at run time: ws128x128s2)"
    python bench/lab/plot_hopper.py --part bwd dev/perf/hopper-bwd-h200-2026-12-03.json \\
        --png out.png --rename "bwd-hopper=bwd-hopper (route at run time: ...)"
"""
from __future__ import annotations

import argparse
import json


def series(rows, part):
    """The bar names, in first-seen order: forward columns or every backward column."""
    names = []
    for r in rows:
        names += [k for k in r["tflops"] if k not in names]
    if part == "fwd":
        names = [k for k in names if not k.startswith(("bwd", "dkdv"))
                 and k != "anyattn.attention"]
    return names


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("--part", choices=("fwd", "bwd"), required=True)
    ap.add_argument("--png", required=True)
    ap.add_argument("--rename", action="append", default=[],
                    help="OLD=NEW legend label (what a default or route was at run time)")
    a = ap.parse_args()
    label = dict(x.split("=", 1) for x in a.rename)
    res = json.load(open(a.json))
    rows = res["bench"]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = series(rows, a.part)
    fig, ax = plt.subplots(figsize=(max(10, 1.6 * len(rows)), 5.5))
    w = 0.8 / len(names)
    for i, n in enumerate(names):
        ys = [r["tflops"].get(n, 0.0) for r in rows]
        ax.bar([x + i * w for x in range(len(rows))], ys, w, label=label.get(n, n))
    ax.set_xticks([x + 0.4 - w / 2 for x in range(len(rows))])
    m = res.get("meta", {})
    # the dtype where the JSON records one (per row, else for the run); older files don't
    ax.set_xticklabels([f"B{r['B']} H{r['H']}\nS{r['S']} D{r['D']}\n"
                        f"{'causal' if r['causal'] else 'full'} {r.get('dtype') or m.get('dtype') or ''}"
                        .rstrip() for r in rows], fontsize=8)
    ax.set_ylabel("TFLOP/s (FA convention)")
    roof = m.get("bf16_gemm_tflops")
    ax.set_title(f"Hopper {'forward' if a.part == 'fwd' else 'backward'}, {m.get('device', '')} "
                 f"{m.get('date', '')}, torch {m.get('torch', '')}, triton {m.get('triton', '')}"
                 + (f" (bf16 GEMM roof {roof} TFLOP/s)" if roof else ""), fontsize=10)
    ax.legend(fontsize=7, ncol=3)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(a.png, dpi=110)


if __name__ == "__main__":
    main()
