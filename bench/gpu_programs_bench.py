"""Score and mask functions on the Triton backend: function vs built-in vs FlexAttention.

    python bench/gpu_programs_bench.py                 # B=4 H=16 S=4096 D=128 bf16 (GPU)
    TRITON_INTERPRET=1 python bench/gpu_programs_bench.py --tiny   # interpreter smoke run

Per pair, forward and fwd+bwd (attention_backward with wrt q, k, v, which runs the
forward too): the median time of the function and of its built-in spelling (anyattn),
FlexAttention's (torch.compile'd flex_attention with the same function, on CUDA only)
and, apart, Flex's create_block_mask (anyattn's block maps are cached per content, so
its timed calls exclude their build, as Flex's exclude create_block_mask).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import anyattn as aa  # noqa: E402


def _time(fn, reps, sync):
    fn()
    ts = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def pairs(S, H):
    slopes = (2.0 ** -torch.arange(1, H + 1, dtype=torch.float32))
    C = max(1, S // 8)

    def softcap_fn(s, b, h, i, j):
        return 30.0 * torch.tanh(s / 30.0)

    def alibi_fn(s, b, h, i, j, slopes):
        return s - slopes[h] * abs(i - j)

    return {
        "causal": (dict(mask=aa.MaskMod(lambda b, h, i, j: j <= i)), dict(mask=aa.Causal()),
                   None, lambda b, h, i, j: j <= i),
        "chunked": (dict(mask=aa.MaskMod(lambda b, h, i, j: (i // C == j // C) & (j <= i))),
                    dict(mask=aa.Causal() & aa.Documents(torch.arange(S) // C)), None,
                    lambda b, h, i, j: (i // C == j // C) & (j <= i)),
        "softcap": (dict(score_mod=softcap_fn, mask=aa.Causal()),
                    dict(softcap=30.0, mask=aa.Causal()), softcap_fn,
                    lambda b, h, i, j: j <= i),
        "alibi": (dict(score_mod=aa.ScoreMod(alibi_fn, slopes=slopes), mask=aa.Causal()),
                  dict(alibi_slopes=slopes, mask=aa.Causal()),
                  lambda s, b, h, i, j: s - slopes.to(s.device)[h] * (i - j).abs(),
                  lambda b, h, i, j: j <= i),
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true", help="B=1 H=2 S=64 D=16 (interpreter)")
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    B, H, S, D = (1, 2, 64, 16) if a.tiny else (4, 16, 4096, 128)
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    dt = getattr(torch, a.dtype) if cuda else torch.float32
    reps = 1 if a.tiny else 20
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, generator=g).to(dev, dt) for _ in range(3))
    flex = None
    if cuda:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        flex = torch.compile(flex_attention)
    print(f"B={B} H={H} S={S} D={D} {dt} on {dev}; ms (median of {reps})")
    for name, (fn_kw, bi_kw, smod, mmod) in pairs(S, H).items():
        fn_kw = {n: (x.to(dev) if isinstance(x, torch.Tensor) else x) for n, x in fn_kw.items()}
        bi_kw = {n: (x.to(dev) if isinstance(x, torch.Tensor) else x) for n, x in bi_kw.items()}
        do = torch.randn_like(q)

        def ours(kw, bwd):
            if bwd:
                return lambda: aa.attention_backward(q, k, v, do, wrt=("q", "k", "v"),
                                                     backend="triton", **kw)
            return lambda: aa.attention(q, k, v, backend="triton", **kw)

        line = f"{name:8s}"
        for bwd in (False, True):
            t_fn = _time(ours(fn_kw, bwd), reps, sync)
            t_bi = _time(ours(bi_kw, bwd), reps, sync)
            line += (f"  {'fwd+bwd' if bwd else 'fwd'}: function {t_fn:9.3f} built-in "
                     f"{t_bi:9.3f} ({t_fn / t_bi:4.2f}x)")
            if flex is not None:
                bm = create_block_mask(mmod, None, None, S, S, device=dev)
                qf, kf, vf = (x.detach().requires_grad_(bwd) for x in (q, k, v))

                def fx():
                    o = flex(qf, kf, vf, score_mod=smod, block_mask=bm)
                    if bwd:
                        o.backward(do)

                t_fx = _time(fx, reps, sync)
                line += f" flex {t_fx:9.3f} (function/flex {t_fn / t_fx:4.2f})"
        if flex is not None:
            t_bm = _time(lambda: create_block_mask(mmod, None, None, S, S, device=dev), reps,
                         sync)
            line += f"  create_block_mask {t_bm:7.3f}"
        print(line)


if __name__ == "__main__":
    main()
