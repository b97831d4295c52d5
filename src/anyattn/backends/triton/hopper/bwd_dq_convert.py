"""dq from the fp32 accumulator(s) of the warp-specialised backward with dQ inside
(bwd_ws_dq_kernel): dq = (sum of the CHAINS accumulators) * scale in q's dtype.

Shape legend: N = B * H * Sq * D elements of dq; ACC fp32 [CHAINS, N] (contiguous).
"""
import triton
import triton.language as tl

__all__ = ["dq_convert_kernel"]


@triton.jit
def dq_convert_kernel(ACC, DQ, N, scale, CHAINS: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (cdiv(N, BLOCK),): DQ[i] = (ACC[0, i] (+ ACC[1, i])) * scale."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)      # [BLOCK]
    m = offs < N
    acc = tl.load(ACC + offs, mask=m, other=0.0)
    if CHAINS == 2:
        acc = acc + tl.load(ACC + N + offs, mask=m, other=0.0)
    tl.store(DQ + offs, (acc * scale).to(DQ.dtype.element_ty), mask=m)
