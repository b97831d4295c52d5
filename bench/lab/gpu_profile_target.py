"""One routed call of this tree (core API, Triton backend) or of SDPA-cuDNN inside an NVTX
range named ``P``, after a warm-up call outside it: the target of an Nsight Compute run
that profiles only the kernels of that one call (``ncu --nvtx --nvtx-include P``; a start / end range, not
push / pop, so that the kernels autograd launches from its device thread are inside).

Shape legend: B batch, H heads, S = Sq = Sk, D head dim (cases: bench/lab/gpu_ab_trees.py).

    ncu --nvtx --nvtx-include P ... python bench/lab/gpu_profile_target.py --case d128n8k --which ours-bwd
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gpu_ab_trees import CASES, mask_of  # noqa: E402

WHICH = ("ours-fwd", "ours-bwd", "cudnn-fwd", "cudnn-bwd")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--case", required=True, choices=sorted(CASES))
    ap.add_argument("--which", required=True, choices=WHICH)
    ap.add_argument("--dtype", default="bfloat16")
    a = ap.parse_args()
    import torch

    import anyattn

    B, H, S, D, kind, left = CASES[a.case]
    dt = getattr(torch, a.dtype)
    g = torch.Generator(device="cuda").manual_seed(7)
    q, k, v, do = (torch.randn(B, H, S, D, device="cuda", generator=g).to(dt) for _ in range(4))
    if a.which.startswith("ours"):
        m = mask_of(anyattn, kind, left)
        o, st = anyattn.forward_with_stats(q, k, v, mask=m, backend="triton")
        if a.which == "ours-fwd":
            def call():
                anyattn.forward_with_stats(q, k, v, mask=m, backend="triton")
        else:
            def call():
                anyattn.attention_backward(q, k, v, do, out=o, lse=st, mask=m, backend="triton")
    else:
        if kind not in ("none", "causal"):
            raise SystemExit(f"cuDNN through SDPA has no {kind} mask here")
        from torch.nn.attention import SDPBackend, sdpa_kernel
        qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))

        def fwd():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(
                    qg, kg, vg, is_causal=kind == "causal")

        og = fwd()
        if a.which == "cudnn-fwd":
            call = fwd
        else:
            def call():
                torch.autograd.grad(og, (qg, kg, vg), do, retain_graph=True)
    call()                                    # compile / plan outside the range
    torch.cuda.synchronize()
    rid = torch.cuda.nvtx.range_start("P")    # a start / end range: autograd's device thread too
    call()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_end(rid)
    torch.cuda.synchronize()
    print(f"profiled {a.case} {a.which}", flush=True)


if __name__ == "__main__":
    main()
