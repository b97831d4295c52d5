"""Max error of the NumPy backend (fp32) against float64, before/after a change.

Cases: plain, causal, large logits (q x 30), a bias with finfo(float32).min rows,
at sizes that cover several tiles of both the masked (256) and unmasked (512) grids.
Error = max |x - x64| / max |x64| per output (out, dq, dk, dv).  ``--before REV``
also runs the package as of a git revision (bench/numpy_vs_torch.py's export_revision).

    python bench/numpy_accuracy.py --before HEAD --json x.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np


def cases(rng):
    B, H, S, D = 1, 2, 1100, 64
    q, k, v, g = (rng.standard_normal((B, H, S, D)) for _ in range(4))
    bias = rng.standard_normal((1, 1, S, S)) * 0.5
    bias[0, 0, 5] = np.finfo(np.float32).min        # rows that attend uniformly
    bias[0, 0, 700:720] = np.finfo(np.float32).min
    yield "plain", (q, k, v, g), {}
    yield "causal", (q, k, v, g), {"mask": "causal"}
    yield "large logits (q x 30)", (q * 30, k, v, g), {}
    yield "causal, large logits", (q * 30, k, v, g), {"mask": "causal"}
    yield "bias with finfo.min rows", (q, k, v, g), {"bias": bias}


def run(mod, name, arrays, kw):
    q, k, v, g = arrays
    mask = mod.Causal() if kw.get("mask") == "causal" else None
    bias = kw.get("bias")
    res = {}
    for be, dt in (("reference", np.float64), ("numpy", np.float32)):
        a = [x.astype(dt) for x in (q, k, v, g)]
        b = None if bias is None else bias.astype(dt)
        out, lse = mod.attention(*a[:3], mask=mask, bias=b, return_lse=True, backend=be)
        gr = mod.attention_backward(*a, out=out, lse=lse, mask=mask, bias=b, backend=be)
        res[be] = {"out": out, "dq": gr.dq, "dk": gr.dk, "dv": gr.dv}
    return {n: float(np.max(np.abs(res["numpy"][n] - res["reference"][n]))) /
            float(np.max(np.abs(res["reference"][n]))) for n in ("out", "dq", "dk", "dv")}


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", default=None, metavar="REV")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    import anyattn

    mods = {"after": anyattn}
    if a.before:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from numpy_vs_torch import export_revision

        mods = {"before": export_revision(a.before), **mods}
    report = {}
    for label, arrays, kw in cases(np.random.default_rng(0)):
        for mname, mod in mods.items():
            err = run(mod, label, arrays, kw)
            report.setdefault(label, {})[mname] = err
            print(f"{label:28s} {mname:6s} " + "  ".join(f"{n} {e:.2e}" for n, e in err.items()),
                  flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
