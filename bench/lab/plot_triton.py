"""Plot and tabulate the triton GPU benchmark (runs here, no GPU needed).

    python bench/lab/plot_triton.py dev/perf/triton_h200.json [--anchors ../shared/anchors]

Writes dev/perf/triton_h200.png and prints markdown tables with the ratio of each
anyattn-triton row to the same-process competitors and to the anchors
(DESIGN.md section 5, measured earlier on the same H200).
"""
from __future__ import annotations

import argparse
import json
import os
from collections import defaultdict

HERE = os.path.dirname(os.path.abspath(__file__))


def load_anchors(folder):
    rows = []
    for fn in ("h200_sdpa_2026-12-02.json", "h200_flex_masks_2026-12-02.json"):
        p = os.path.join(folder, fn)
        if os.path.exists(p):
            rows += json.load(open(p))
    idx = {}
    for r in rows:
        if "bwd_ms" not in r:
            continue
        dt = {"bfloat16": "bf16", "float32": "fp32"}.get(r["dtype"], r["dtype"])
        idx[(r["name"], dt, r["d"], r["s"], bool(r["causal"]))] = r
    return idx


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("json")
    ap.add_argument("--anchors", default=os.path.join(HERE, "..", "..", "..", "shared", "anchors"))
    ap.add_argument("--png", default=None)
    a = ap.parse_args()
    d = json.load(open(a.json))
    anchors = load_anchors(a.anchors)
    rows = [r for r in d["bench"] if "error" not in r]
    same = {(r["impl"], r["case"], r["dtype"], r["D"], r["S"], r["causal"]): r for r in rows}

    print("### dense (TFLOP/s fwd / bwd, FA convention)\n")
    print("| dtype | D | S | causal | triton fwd | triton bwd | bwd vs flash | vs cuDNN | vs mem-eff | vs Flex (same run) | vs Flex anchor | peak MiB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["case"] != "dense" or not r["impl"].startswith("anyattn-triton"):
            continue
        key = lambda impl: same.get((impl, "dense", r["dtype"] if r["dtype"] != "tf32" else "fp32",  # noqa: E731
                                     r["D"], r["S"], r["causal"]))

        def ratio(o):
            return f"{r['bwd_tflops'] / o['bwd_tflops']:.2f}" if o else ""

        dt_anchor = "fp32" if r["dtype"] in ("fp32", "tf32") else r["dtype"]
        fa = anchors.get(("flex", dt_anchor, r["D"], r["S"], r["causal"]))
        print(f"| {r['dtype']}{' ' + r['impl'][14:] if r['impl'] != 'anyattn-triton' else ''} | {r['D']} | {r['S']} | "
              f"{int(r['causal'])} | {r['fwd_tflops']} | {r['bwd_tflops']} | {ratio(key('sdpa-flash'))} | "
              f"{ratio(key('sdpa-cudnn'))} | {ratio(key('sdpa-efficient'))} | {ratio(key('flex'))} | "
              f"{ratio(fa)} | {r['peak_mem_mib']} |")
    print("\n### masked / bias, B=4 H=16 S=4096 D=128 (ms; TFLOP/s dense-equivalent and by kept pairs)\n")
    print("| impl | case | dtype | fwd ms | bwd ms | bwd TFLOP/s (dense eq.) | bwd TFLOP/s (kept) | peak MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r["case"] == "dense":
            continue
        print(f"| {r['impl']} | {r['case']} | {r['dtype']} | {r['fwd_ms']} | {r['bwd_ms']} | "
              f"{r['bwd_tflops']} | {r.get('bwd_tflops_kept', '')} | {r['peak_mem_mib']} |")

    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    panels = [(dt, D) for dt, D in (("bf16", 128), ("bf16", 64), ("fp32", 128))
              if any(r["case"] == "dense" and r["D"] == D and "bwd_tflops" in r
                     and (r["dtype"] == "bf16") == (dt == "bf16") for r in rows)]
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5.7 * len(panels), 5), squeeze=False)
    for ax, (dt, D) in zip(axes[0], panels):
        series = defaultdict(list)
        for r in rows:
            if r["case"] != "dense" or r["D"] != D:
                continue
            if dt == "fp32" and r["dtype"] not in ("fp32", "tf32"):
                continue
            if dt == "bf16" and r["dtype"] != "bf16":
                continue
            lab = f"{r['impl']}{' tf32' if r['dtype'] == 'tf32' else ''}{' causal' if r['causal'] else ''}"
            series[lab].append((r["S"], r["bwd_tflops"]))
        for lab, pts in sorted(series.items()):
            pts.sort()
            style = "-o" if lab.startswith("anyattn") else "--."
            ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=lab, lw=2 if lab.startswith("anyattn") else 1)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("S (B = 16384 / S, H = 2048 / D)")
        ax.set_ylabel("backward TFLOP/s (FA convention)")
        ax.set_title(f"H200 backward, {dt}, D={D}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout()
    png = a.png or os.path.splitext(a.json)[0] + ".png"
    fig.savefig(png, dpi=110)
    print(f"\nwrote {png}")


if __name__ == "__main__":
    main()
