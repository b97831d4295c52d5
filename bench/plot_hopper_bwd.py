"""Bar chart of a gpu_hopper_bwd.py result: backward TFLOP/s per shape of the routed
Hopper backward, the split route (fused dK/dV + portable dQ), each Hopper backward
config alone, the portable backward and SDPA (cuDNN, flash); FA FLOP convention (bwd 2.5x
the forward's 4*B*H*S*S*D, causal halved; dK/dV alone counted as 0.8 of it).  No GPU
needed.

    python bench/plot_hopper_bwd.py docs/perf/hopper-bwd-h200-2026-12-03.json --png out.png \
        --rename "bwd-hopper=bwd-hopper (route at run time: dK/dV kernel + portable dQ)"
"""
from __future__ import annotations

import argparse
import json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("--png", required=True)
    ap.add_argument("--rename", action="append", default=[],
                    help="OLD=NEW legend label (what a route was at run time)")
    a = ap.parse_args()
    label = dict(x.split("=", 1) for x in a.rename)
    res = json.load(open(a.json))
    rows = res["bench"]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = []
    for r in rows:
        names += [k for k in r["tflops"] if k not in names]
    fig, ax = plt.subplots(figsize=(max(10, 1.6 * len(rows)), 5.5))
    w = 0.8 / len(names)
    for i, n in enumerate(names):
        ys = [r["tflops"].get(n, 0.0) for r in rows]
        ax.bar([x + i * w for x in range(len(rows))], ys, w, label=label.get(n, n))
    ax.set_xticks([x + 0.4 - w / 2 for x in range(len(rows))])
    ax.set_xticklabels([f"B{r['B']} H{r['H']}\nS{r['S']} D{r['D']}\n"
                        f"{'causal' if r['causal'] else 'full'}" for r in rows], fontsize=8)
    ax.set_ylabel("TFLOP/s (FA convention)")
    m = res["meta"]
    ax.set_title(f"backward, {m.get('device')} {m.get('date')} (bf16 GEMM roof "
                 f"{m.get('bf16_gemm_tflops')} TFLOP/s)", fontsize=10)
    ax.legend(fontsize=7, ncol=3)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(a.png, dpi=110)


if __name__ == "__main__":
    main()
