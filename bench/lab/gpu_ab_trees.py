"""A/B of two source trees of anyattn in ONE process on a GPU: the routed Triton forward
and backward of each tree (the public core API: forward_with_stats, attention_backward)
beside SDPA-cuDNN, in rotated rounds (device time: CUDA-graph replays, the cuDNN
backward eagerly; --eager times everything with the host in the loop), and whether the
two trees' outputs are bitwise equal (a change that must not alter results: masks,
schedules).

The base tree is imported under another package name: copy its ``src/anyattn`` to
``<dir>/anyattn_base`` (every import inside the package is relative), e.g.
``git archive <rev> src/anyattn | tar -x -C /tmp/b && mv /tmp/b/src/anyattn
/tmp/b/anyattn_base``, then ``--base-dir /tmp/b``.

Shape legend: B batch, H heads, S = Sq = Sk, D head dim.  FLOPs: FlashAttention's
convention (fwd 4*B*H*S*S*D, bwd 2.5x, causal 1/2; windows counted as their kept pairs).

    python bench/lab/gpu_ab_trees.py [--base-dir /tmp/b] --out OUT [--cases d64c2k,...] [--rounds 3]

Without --base-dir: this tree and cuDNN only (the standings, device time).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

#: name -> (B, H, S, D, mask kind, window left)
CASES = {"d64n2k": (8, 16, 2048, 64, "none", 0), "d64n4k": (4, 16, 4096, 64, "none", 0),
         "d64n8k": (2, 16, 8192, 64, "none", 0), "d64c2k": (8, 16, 2048, 64, "causal", 0),
         "d64c4k": (4, 16, 4096, 64, "causal", 0), "d64c8k": (2, 16, 8192, 64, "causal", 0),
         "d128n2k": (8, 16, 2048, 128, "none", 0), "d128n8k": (2, 16, 8192, 128, "none", 0),
         "d128c2k": (8, 16, 2048, 128, "causal", 0), "d128c8k": (2, 16, 8192, 128, "causal", 0),
         "d128w4k": (4, 16, 4096, 128, "window", 512)}


def log(*a):
    print(*a, flush=True)


def kept_fraction(S, kind, left):
    if kind == "none":
        return 1.0
    if kind == "causal":
        return 0.5
    return min(1.0, (left + 1) / S)       # a causal window of left keys: ~(left + 1) / S


def time_ms(fn, graph, how, name):
    """Median ms of fn: replays of a CUDA graph of it (device time only; ``graph``),
    else eager do_bench (host included).  Records which in how[name]."""
    import triton

    if graph:
        try:
            ms = triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")
            how[name] = "cuda-graph"
            return ms
        except Exception as e:       # a call that cannot be captured: timed eagerly
            how[name] = f"eager ({type(e).__name__}: {str(e)[:80]})"
    else:
        how.setdefault(name, "eager")
    return triton.testing.do_bench(fn, warmup=15, rep=80, return_mode="median")


def mask_of(pkg, kind, left):
    if kind == "none":
        return None
    if kind == "causal":
        return pkg.Causal()
    return pkg.Window(left=left, right=0)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-dir", help="the base tree's parent folder (none: this tree "
                                       "and cuDNN only, the standings)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--eager", dest="graph", action="store_false",
                    help="time eagerly (host in the loop) instead of CUDA-graph replays")
    a = ap.parse_args()
    import torch
    import triton

    import anyattn as new
    trees = {"new": new}
    if a.base_dir:
        sys.path.insert(0, a.base_dir)
        trees["base"] = importlib.import_module("anyattn_base")
        # the backend registry names its classes by absolute module path: point the
        # base's entries at its own package, else its calls would run this tree's backends
        reg = importlib.import_module("anyattn_base.backends.registry")
        for key, e in list(reg.ENTRIES.items()):
            reg.ENTRIES[key] = dataclasses.replace(e, target=e.target.replace(
                "anyattn.", "anyattn_base.", 1))
    os.makedirs(a.out, exist_ok=True)
    res = dict(meta=dict(date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                         gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                         triton=triton.__version__, base_dir=a.base_dir,
                         flops="FlashAttention convention; windows: kept pairs"),
               rows=[])
    dt = getattr(torch, a.dtype)
    for name in a.cases.split(","):
        B, H, S, D, kind, left = CASES[name]
        g = torch.Generator(device="cuda").manual_seed(7)
        q, k, v, do = (torch.randn(B, H, S, D, device="cuda", generator=g).to(dt)
                       for _ in range(4))
        fl = 4.0 * B * H * S * S * D * kept_fraction(S, kind, left)
        row = dict(case=name, B=B, H=H, S=S, D=D, mask=kind, left=left, ms={}, tflops={},
                   rounds={})
        fns, outs = {}, {}
        for tag, pkg in trees.items():
            m = mask_of(pkg, kind, left)
            o, st = pkg.forward_with_stats(q, k, v, mask=m, backend="triton")
            gr = pkg.attention_backward(q, k, v, do, out=o, lse=st, mask=m, backend="triton")
            outs[tag] = (o, st.max, st.log_norm, gr.dq, gr.dk, gr.dv)
            fns[f"{tag}-fwd"] = (lambda pkg=pkg, m=m: pkg.forward_with_stats(
                q, k, v, mask=m, backend="triton"), fl)
            fns[f"{tag}-bwd"] = (lambda pkg=pkg, m=m, o=o, st=st: pkg.attention_backward(
                q, k, v, do, out=o, lse=st, mask=m, backend="triton"), 2.5 * fl)
        if "base" in outs:
            row["bitwise_equal"] = all(torch.equal(x, y)
                                       for x, y in zip(outs["new"], outs["base"]))
        if kind in ("none", "causal"):
            c = kind == "causal"
            from torch.nn.attention import SDPBackend, sdpa_kernel
            qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))

            def sdpa_f():
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(
                        qg, kg, vg, is_causal=c)

            og = sdpa_f()

            def sdpa_b():
                torch.autograd.grad(og, (qg, kg, vg), do, retain_graph=True)

            fns["cudnn-fwd"] = (sdpa_f, fl)
            fns["cudnn-bwd"] = (sdpa_b, 2.5 * fl)
        names = list(fns)
        per = {n: [] for n in names}
        row["timing"] = {}
        for r in range(a.rounds):
            order = names[r % len(names):] + names[:r % len(names)]
            for n in order:
                per[n].append(time_ms(fns[n][0], a.graph and n != "cudnn-bwd", row["timing"], n))
        for n in names:
            ms = sorted(per[n])[len(per[n]) // 2]
            row["ms"][n] = ms
            row["rounds"][n] = per[n]
            row["tflops"][n] = round(fns[n][1] / ms / 1e9, 1)
        res["rows"].append(row)
        log(f"ab {name} B={B} H={H} S={S} D={D} {kind}{left or ''} bitwise={row.get('bitwise_equal')}: "
            + " ".join(f"{n}={row['tflops'][n]}" for n in names))
        Path(a.out, "ab_trees.json").write_text(json.dumps(res, indent=1))
        fns.clear()
        outs.clear()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
