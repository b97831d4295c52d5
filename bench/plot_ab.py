"""Bar chart of the A/B rows of gpu_bench.py results (``--ab``): backward TFLOP/s of each
variant per case (FA convention; masked cases by kept pairs), no GPU needed.

    python bench/plot_ab.py dev/perf/triton_h200_ab_2026-12-02.json [more.json ...] --png out.png
"""
from __future__ import annotations

import argparse
import json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("json", nargs="+")
    ap.add_argument("--png", required=True)
    a = ap.parse_args()
    rows = [r for fn in a.json for r in json.load(open(fn)).get("ab", [])]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(8, 1.3 * len(rows)), 5))
    x = 0.0
    ticks, labels, seen = [], [], set()
    colors = {}
    for r in rows:
        vals = r.get("bwd_tflops", {})
        if not vals:
            continue
        w = 0.8 / len(vals)
        for i, (name, tf) in enumerate(vals.items()):
            c = colors.setdefault(name, f"C{len(colors) % 10}")
            ax.bar(x + i * w, tf, w, color=c, label=None if name in seen else name)
            seen.add(name)
        ticks.append(x + 0.4 - w / 2)
        labels.append(f"{r['case']} {r.get('dtype', 'bf16')}\nS={r['S']} D={r['D']}"
                      + (" causal" if r.get("mask") == "causal" else ""))
        x += 1.0
    ax.set_xticks(ticks)
    ax.set_xticklabels(labels, fontsize=7)
    ax.set_ylabel("backward TFLOP/s (FA convention; masked: kept pairs)")
    ax.set_title("H200 anyattn-triton backward variants, same process (FlexAttention where timed)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(a.png, dpi=110)
    print("wrote", a.png)


if __name__ == "__main__":
    main()
