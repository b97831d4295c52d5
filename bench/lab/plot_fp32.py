"""Plot the fp32 / tf32 results of bench/gpu_bench.py: the product-scheme and tile
variants (``--ab fp32split`` / ``fp32split2``) and the dense bench rows (``--fp32``)
against torch SDPA mem-efficient fp32, backward TFLOP/s (FA convention).

    python bench/lab/plot_fp32.py VARIANTS.json [VARIANTS2.json ...] --bench BENCH.json --out F.png
"""
from __future__ import annotations

import argparse
import json


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="*", help="JSON files with 'fp32_variants' rows")
    ap.add_argument("--bench", default="", help="JSON file with fp32 / tf32 'bench' rows")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(15, 6))
    ax = axes[0]
    names, vals, cols = [], [], []
    for i, path in enumerate(a.variants):
        for r in json.load(open(path)).get("fp32_variants", []):
            if "bwd_tflops" not in r:
                continue
            names.append(f"run {i + 1}: D={r.get('D', 128)} {r['variant']}")
            vals.append(r["bwd_tflops"])
            cols.append("tab:blue" if r["precision"] == "highest" else "tab:orange")
    ax.barh(range(len(vals)), vals, color=cols)
    ax.set_yticks(range(len(vals)), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("backward TFLOP/s (16k tokens, hidden 2048, S=4096)")
    ax.set_title("fp32 variants: blue = precision 'highest', orange = 'tf32'")
    for y, v in enumerate(vals):
        ax.text(v, y, f" {v:.1f}", va="center", fontsize=7)
    ax = axes[1]
    if a.bench:
        rows = [r for r in json.load(open(a.bench))["bench"] if "bwd_tflops" in r
                and r["case"] == "dense"]
        series = {}
        for r in rows:
            key = (r["impl"], r["dtype"], r["D"], r["causal"])
            series.setdefault(key, []).append((r["S"], r["bwd_tflops"]))
        for (impl, dt, d, c), pts in sorted(series.items()):
            if len(pts) < 2:
                continue
            pts.sort()
            ls = "--" if c else "-"
            mk = "o" if d == 128 else "s"
            ax.plot([p[0] for p in pts], [p[1] for p in pts], ls, marker=mk,
                    label=f"{impl} {dt} D={d}{' causal' if c else ''}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length (16k tokens, hidden 2048)")
        ax.set_ylabel("backward TFLOP/s")
        ax.axhline(70, color="grey", lw=0.8, ls=":")
        ax.text(2048, 71, "fp32 target 70", fontsize=7, color="grey")
        ax.set_title("fp32 / tf32 dense backward vs SDPA mem-efficient fp32")
        ax.legend(fontsize=6, ncol=2)
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print("wrote", a.out)


if __name__ == "__main__":
    main()
