"""Bar chart of bench/lab/autograd_handover.py results: µs per module step (median of each
round), autograd's device thread vs the calling thread, one group per JSON file.

    python bench/lab/plot_handover.py OUT.png LABEL=FILE.json [LABEL=FILE.json ...]
"""
from __future__ import annotations

import json
import sys


def main():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    png, pairs = sys.argv[1], [a.rsplit("=", 1) for a in sys.argv[2:]]
    fig, ax = plt.subplots(figsize=(1.6 * len(pairs) + 2, 4))
    w = 0.38
    for i, (label, path) in enumerate(pairs):
        runs = json.load(open(path))["runs"]
        for j, (mode, color) in enumerate((("threads", "tab:red"), ("calling", "tab:blue"))):
            vals = [r["median_us"]["step"] for k, r in runs.items()
                    if k.startswith(f"module-{mode}")]
            x = i + (j - 0.5) * w
            ax.bar(x, sum(vals) / len(vals), w, color=color,
                   label=("device thread (default)" if mode == "threads" else
                          "calling thread") if i == 0 else None)
            ax.plot([x] * len(vals), vals, "k.", ms=4)
    ax.set_xticks(range(len(pairs)))
    ax.set_xticklabels([p[0] for p in pairs], fontsize=8)
    ax.set_ylabel("host µs per fwd+bwd step (anyattn.torch)")
    ax.set_title("autograd's device thread vs the calling thread, H200 host, B=1 H=2 S=128 D=64",
                 fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=130)


if __name__ == "__main__":
    main()
