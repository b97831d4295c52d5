"""Value head dim != query/key head dim (MLA) and D = 256 on CUDA: anyattn.torch beside SDPA.

    python bench/gpu_value_dim_bench.py --out OUT_DIR        # GPU
    TRITON_INTERPRET=1 python bench/gpu_value_dim_bench.py --tiny --out /tmp/vd   # interpreter

Per (Dqk, Dv), causal and not, bf16: first a float64 check of out, dq, dk, dv on a small
problem, then the forward and the backward (torch autograd, `do_bench` medians) of
``anyattn.torch.attention`` and of every SDPA backend that accepts the shape (cuDNN,
flash, memory-efficient; a refusal is recorded with its message) at B*S = 16k tokens,
H = 16.  FLOPs: forward 2*B*H*S*S*(Dqk + Dv), backward 2.5x, causal 1/2.  Writes
value_dim.json under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import anyattn  # noqa: E402
import anyattn.torch as aat  # noqa: E402
from gpu_harness import Harness, log, rel  # noqa: E402

DIMS = [(192, 128), (256, 256), (128, 64), (64, 128)]


def flops(b, h, s, dqk, dv, causal):
    f = 2.0 * b * h * s * s * (dqk + dv)
    return f / 2 if causal else f


def sdpa_backends():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    def make(backend):
        def call(q, k, v, causal):
            with sdpa_kernel([backend]):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        return call

    return {"sdpa-cudnn": make(SDPBackend.CUDNN_ATTENTION),
            "sdpa-flash": make(SDPBackend.FLASH_ATTENTION),
            "sdpa-efficient": make(SDPBackend.EFFICIENT_ATTENTION)}


def check(h: Harness, dqk, dv, causal, dev):
    b, heads, s = (1, 2, 64) if h.tiny else (1, 4, 384)
    gen = torch.Generator(device=dev).manual_seed(dqk * 1000 + dv + causal)
    q = torch.randn(b, heads, s, dqk, device=dev, generator=gen, dtype=torch.float32).bfloat16()
    k = torch.randn(b, heads, s, dqk, device=dev, generator=gen, dtype=torch.float32).bfloat16()
    v = torch.randn(b, heads, s, dv, device=dev, generator=gen, dtype=torch.float32).bfloat16()
    g = torch.randn(b, heads, s, dv, device=dev, generator=gen, dtype=torch.float32).bfloat16()
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]
    out = aat.attention(*leaves, mask=anyattn.Causal() if causal else None)
    grads = torch.autograd.grad(out, leaves, g)
    ref_leaves = [x.detach().double().requires_grad_(True) for x in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(*ref_leaves, is_causal=causal)
    ref_grads = torch.autograd.grad(ref, ref_leaves, g.double())
    errs = {"out": rel(out, ref)}
    errs.update({n: rel(a, r) for n, a, r in zip(("dq", "dk", "dv"), grads, ref_grads)})
    row = dict(Dqk=dqk, Dv=dv, causal=causal, shape=[b, heads, s], **errs,
               ok=all(e <= 2e-2 for e in errs.values()))
    h.results["check"].append(row)
    log("CHECK", json.dumps(row))


def bench(h: Harness, dqk, dv, causal, s, dev):
    b, heads = (1, 2) if h.tiny else (max(1, 16384 // s), 16)
    gen = torch.Generator(device=dev).manual_seed(7)
    q = torch.randn(b, heads, s, dqk, device=dev, generator=gen, dtype=torch.float32).bfloat16()
    k = torch.randn(b, heads, s, dqk, device=dev, generator=gen, dtype=torch.float32).bfloat16()
    v = torch.randn(b, heads, s, dv, device=dev, generator=gen, dtype=torch.float32).bfloat16()
    g = torch.randn(b, heads, s, dv, device=dev, generator=gen, dtype=torch.float32).bfloat16()
    impls = {"anyattn": lambda q, k, v, c: aat.attention(q, k, v, mask=anyattn.Causal() if c else None)}
    if not h.tiny:
        impls.update(sdpa_backends())
    ff = flops(b, heads, s, dqk, dv, causal)
    for name, fn in impls.items():
        row = dict(impl=name, Dqk=dqk, Dv=dv, causal=causal, B=b, H=heads, S=s)
        try:
            fwd, bwd = h.time_autograd(lambda q, k, v: fn(q, k, v, causal), q, k, v, g)
            row.update(fwd_ms=round(fwd, 4), bwd_ms=round(bwd, 4),
                       fwd_tflops=round(ff / fwd / 1e9, 1), bwd_tflops=round(2.5 * ff / bwd / 1e9, 1))
        except Exception as exc:  # a backend that refuses the shape is a result
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        h.results["bench"].append(row)
        log("BENCH", json.dumps(row))
        h.save_now()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="interpreter smoke run (CPU)")
    ap.add_argument("--seqs", default="2048,4096")
    ap.add_argument("--out", default=".")
    a = ap.parse_args()
    results = {"meta": {}, "check": [], "bench": []}
    h = Harness(results)
    h.tiny = a.tiny
    h.dev = dev = "cpu" if a.tiny else "cuda"
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, "value_dim.json")

    def save():
        with open(path, "w") as f:
            json.dump(results, f, indent=1)

    h._save = save
    if not a.tiny:
        h.meta(flops_value_dim="fwd 2*B*H*S*S*(Dqk+Dv), bwd 2.5x, causal 1/2")
    t0 = time.time()
    for dqk, dv in DIMS:
        for causal in (False, True):
            check(h, dqk, dv, causal, dev)
            for s in ([64] if a.tiny else [int(x) for x in a.seqs.split(",")]):
                bench(h, dqk, dv, causal, s, dev)
    results["meta"]["elapsed_s"] = round(time.time() - t0, 1)
    save()


if __name__ == "__main__":
    main()
