"""dq from the fp32 accumulator of the warp-specialised backward with dQ inside
(bwd_ws_dq_kernel): dq = accumulator * scale in q's dtype.

Shape legend: N = B * H * Sq * D elements of dq; ACC fp32 [B * H, SqA, D] (contiguous;
SqA: Sq rounded up to a multiple of 8, launch.dqa_desc's interleaved view);
VIS int8 [Bm, Hv, nq] (VISITS: whether some key tile visits query tile t of (b, kv head);
Bm / Hv 1 where broadcast, Hv = H / G otherwise).
"""
import triton
import triton.language as tl

__all__ = ["dq_convert_kernel"]


@triton.jit
def dq_convert_kernel(ACC, DQ, N, scale, SQD, SQD_ACC, PADDED: tl.constexpr,
                      BLOCK: tl.constexpr, VIS=None, vis_b=0, vis_h=0, H=1, G=1, D=1, BMQ=1,
                      VISITS: tl.constexpr = False):
    """Grid (cdiv(N, BLOCK),): DQ[i] = ACC[a(i)] * scale with a(i) = i, or with PADDED
    (SQD = Sq * D per head of dq, SQD_ACC = SqA * D of ACC) the same (head, row, column)
    in ACC's padded rows.  VISITS (Documents / KeepMask: the
    accumulator is not zeroed, and a query tile no key tile visits holds no partial):
    DQ[i] = 0 where VIS[b, h // G, row // BMQ] is 0 (strides vis_b, vis_h; 0 where
    broadcast)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)      # [BLOCK]
    m = offs < N
    if PADDED:
        acc_offs = (offs // SQD) * SQD_ACC + offs % SQD                     # [BLOCK]
    else:
        acc_offs = offs
    acc = tl.load(ACC + acc_offs, mask=m, other=0.0)
    if VISITS:
        bh = offs // SQD                                                    # [BLOCK]
        t = (offs % SQD) // D // BMQ
        seen = tl.load(VIS + (bh // H) * vis_b + ((bh % H) // G) * vis_h + t, mask=m,
                       other=0)
        acc = tl.where(seen != 0, acc, 0.0)      # never-stored rows: whatever was there
    tl.store(DQ + offs, (acc * scale).to(DQ.dtype.element_ty), mask=m)
