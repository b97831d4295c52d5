"""Bar chart of torch_host_profile --ablate runs: each setting with direct launches (the
default) beside the same setting with ANYATTN_TRITON_DIRECT_LAUNCH=0, host µs per step at
the small shape and ms per step at the big one, per mask.

    python bench/lab/plot_direct_ab.py OUT.png ABLATION.json [ABLATION.json ...]
"""
from __future__ import annotations

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SETTINGS = ("module", "module_one_thread", "kernel")


def main(out, paths):
    runs = [json.load(open(p)) for p in paths]
    fig, axes = plt.subplots(len(runs), 2, figsize=(12, 3.6 * len(runs)), squeeze=False)
    for r, res in enumerate(runs):
        for c, (part, unit, key) in enumerate((("host_per_step_small", "µs", "median_us"),
                                               ("ms_per_step_big", "ms", "median_ms"))):
            ax = axes[r][c]
            labels, on, off = [], [], []
            for tag in ("none", "causal"):
                d = res["ablation"][tag][part]
                for s in SETTINGS:
                    labels.append(f"{tag}\n{s.replace('_one_thread', ' 1 thr')}")
                    on.append(d[s][key])
                    off.append(d[s + "_no_direct"][key])
            x = range(len(labels))
            ax.bar([i - 0.2 for i in x], off, 0.4, label="Triton's launch path", color="#bbb")
            ax.bar([i + 0.2 for i in x], on, 0.4, label="direct launches", color="#3a7")
            for i, (a, b) in enumerate(zip(off, on)):
                ax.text(i + 0.2, b, f"{b / a - 1:+.0%}", ha="center", va="bottom", fontsize=7)
            ax.set_xticks(list(x), labels, fontsize=7)
            shape = res["small"] if c == 0 else res["big"]
            ax.set_title(f"{res['date'][:16]} UTC — {unit} per fwd+bwd step, "
                         f"B,H,S,D={','.join(map(str, shape))}", fontsize=9)
            ax.set_ylabel(unit)
            if r == 0 and c == 0:
                ax.legend(fontsize=7)
    fig.suptitle("H200 host: anyattn.torch step with / without direct launches "
                 "(bf16, settings interleaved in one process)", fontsize=10)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print("wrote", out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
