"""Compile, offline for sm_90a (no GPU needed), every launch of one call with a score
function and a mask function (forward, the device block classification, the backward's
delta, dK/dV with the gradient of the score function's table, dQ, and the two
reductions of the capture gradient) and print each kernel's SASS size: the generated
device functions go through Triton's real compiler, not only its interpreter.

    PYTHONPATH=src python3 bench/lab/programs_compile.py

Must run without TRITON_INTERPRET.  Uses portable_hashes.py's recorder and compiler.
"""
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import portable_hashes as ph  # noqa: E402


def record():
    """The launches of a T5-style score function with a union mask, bf16, D=128."""
    import torch

    import anyattn as aa
    from anyattn.backends.triton import launch as L
    from anyattn.modifiers import ScoreMods
    from anyattn.problem import describe
    from anyattn.rowstats import RowStats

    B, H, Hkv, S, D = 2, 4, 2, 1024, 128
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(B, n, S, D, generator=g).to(torch.bfloat16)
                     for n in (H, Hkv, Hkv, H))
    table = torch.randn(H, 16)
    bucket = torch.randint(0, 16, (2 * S - 1,))
    prefix = torch.tensor([100, 300])

    def t5(s, b, h, i, j, table, bucket):
        return aa.math.where(j <= i, 30.0 * aa.math.tanh(s / 30.0)
                             + table[h, bucket[j - i + S - 1]] - (i - j) // 3 % 5 / 2.0,
                             float("-inf"))

    kw = dict(score_mod=aa.ScoreMod(t5, table=table, bucket=bucket),
              mask=aa.Causal() | aa.MaskMod(lambda b, h, i, j, n: (j < n[b]) & ~(i % 7 == 3),
                                            n=prefix))
    with ph.recording(ph.KERNEL_NAMES + ("mask_blocks_kernel", "dcap_diag_kernel",
                                         "dcap_segment_kernel")) as log:
        L.forward(describe(q, k, v, **kw), q, k, v, None, mods=ScoreMods())
        out, st = torch.zeros_like(q), torch.zeros(B, H, S)
        pb = describe(q, k, v, dout=dout, out=out, lse=st, wrt=("q", "k", "v", "table"), **kw)
        L.backward(pb, q, k, v, dout, out, RowStats(st, st), None, mods=ScoreMods())
    return log


def main():
    from anyattn.backends.triton import kernels as K
    from sass_hashes import sass_of

    for name, args, kw in record():
        t = time.time()
        ck = ph._compile(getattr(K, name), args, kw)
        print(f"{name:20s} {len(sass_of(ck.asm['cubin']).splitlines()):7d} SASS lines "
              f"{time.time() - t:6.1f} s")


if __name__ == "__main__":
    main()
