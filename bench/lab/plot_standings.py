"""Bar chart of a standings JSON (bench/lab/gpu_ab_trees.py without a base tree): per case
this tree's forward and backward TFLOP/s beside SDPA-cuDNN's, the ratio on top.

    python bench/lab/plot_standings.py dev/perf/standings-....json OUT.png
"""
from __future__ import annotations

import json
import sys


def main(src: str, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.load(open(src))
    rows = doc["rows"]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), sharey=True)
    for ax, part in zip(axes, ("fwd", "bwd")):
        xs = range(len(rows))
        ours = [r["tflops"][f"new-{part}"] for r in rows]
        ref = [r["tflops"].get(f"cudnn-{part}", 0.0) for r in rows]
        ax.bar([x - 0.2 for x in xs], ours, width=0.4, label="anyattn (routed)")
        ax.bar([x + 0.2 for x in xs], ref, width=0.4, label="SDPA-cuDNN")
        for x, a, b in zip(xs, ours, ref):
            if b:
                ax.text(x, max(a, b) + 8, f"{a / b:.2f}x", ha="center", fontsize=8)
        ax.set_xticks(list(xs), [r["case"] for r in rows], rotation=30, fontsize=8)
        ax.set_title(f"{'forward' if part == 'fwd' else 'backward'} (bf16)", fontsize=10)
        ax.set_ylabel("TFLOP/s (FlashAttention convention)")
    axes[0].legend(fontsize=8, loc="lower left")
    fig.suptitle(f"{doc['meta']['gpu']}, {doc['meta']['date']}: device time (CUDA-graph "
                 "replays; cuDNN backward eager)", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=110)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
