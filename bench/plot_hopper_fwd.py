"""Bar chart of the forward timings in a gpu_hopper_bench.py result: TFLOP/s of each
Hopper variant beside the portable kernel and SDPA (cuDNN, flash) per shape (FA FLOP
convention, causal halved), no GPU needed.

    python bench/plot_hopper_fwd.py docs/perf/hopper-fwd-h200-2026-12-03.json --png out.png \
        --rename "hopper=hopper (default at run time: ws128x128s2)"
"""
from __future__ import annotations

import argparse
import json


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("--png", required=True)
    ap.add_argument("--rename", action="append", default=[],
                    help="OLD=NEW legend label (e.g. hopper='default at run time: ...')")
    a = ap.parse_args()
    label = dict(x.split("=", 1) for x in a.rename)
    res = json.load(open(a.json))
    rows = res["bench"]
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [k for k in rows[0]["tflops"] if not k.startswith("bwd") and not k.startswith("dkdv")
             and k != "anyattn.attention"]
    fig, ax = plt.subplots(figsize=(12, 5))
    w = 0.8 / len(names)
    for i, n in enumerate(names):
        ys = [r["tflops"].get(n, 0.0) for r in rows]
        ax.bar([j + i * w for j in range(len(rows))], ys, w, label=label.get(n, n))
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(rows))])
    ax.set_xticklabels([f"B={r['B']} H={r['H']} S={r['S']} D={r['D']}"
                        + (" causal" if r["causal"] else "") for r in rows])
    ax.set_ylabel("TFLOP/s (FA convention)")
    m = res.get("meta", {})
    ax.set_title(f"Hopper forward variants, {m.get('device', '')} {m.get('date', '')[:10]}, "
                 f"torch {m.get('torch', '')}, triton {m.get('triton', '')}, bf16")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(a.png, dpi=110)


if __name__ == "__main__":
    main()
