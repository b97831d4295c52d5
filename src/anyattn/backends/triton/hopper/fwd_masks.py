"""Array masks (Documents / KeepMask) of the Hopper forward's edge tiles.

Shape legend: RM query rows of a consumer warpgroup, BN the key tile, Sq / Sk queries /
keys.  The warp-specialised forward (fwd_ws_kernel) walks a block-range table at its own
tile (launch.py ``_block_ranges``; per 128-row query tile (t0, f0, f1, t1): every kept
key tile in [t0, t1), [f0, f1) a run of fully kept tiles); the tiles outside [f0, f1)
are masked here before the online softmax (which adds the bounds and the band), those
inside run without mask code.  ``am`` is the tuple the kernel passes down:
(qa, qe [RM] int32 per row of the consumer: DOCS 1 the q id (-1 past Sq) and unused,
DOCS 2 the row's document as the key interval [qa, qe); KID: k ids of this batch row
(DOCS 1), KM: the keep bytes of this (b, h), skm_q, skm_k: their row / column strides).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .fwd_kernel import _softmax_tile

__all__ = ["softmax_tile_masked", "pair_keep"]


@gluon.jit
def pair_keep(offs_m, offs_n, Sq, Sk, qa, qe, kd, KM, skm_q, skm_k, DOCS: gl.constexpr,
              HAS_KEEP: gl.constexpr):
    """bool [M, N]: whether the documents / keep mask keep the pairs (query offs_m [M],
    key offs_n [N]); shared by the forward (here) and the backward (bwd_ws_parts).
    DOCS 1: qa [M] the rows' q ids (-1 past Sq), kd [N] the keys' ids (-2 past Sk);
    DOCS 2: each row's document as the key interval [qa, qe) (k ids sorted); 0: in bounds.
    HAS_KEEP: the keep bytes KM (this (b, h)) at strides skm_q / skm_k, in place of the
    above where it keeps the pair (0 past the bounds)."""
    inb_n = offs_n < Sk
    if DOCS == 2:
        keep = (offs_n[None, :] >= qa[:, None]) & (offs_n[None, :] < qe[:, None])  # [M, N]
    elif DOCS == 1:
        keep = qa[:, None] == kd[None, :]                                      # [M, N]
    else:
        keep = (offs_m < Sq)[:, None] & inb_n[None, :]
    if HAS_KEEP:
        inb = keep & (offs_m < Sq)[:, None] & inb_n[None, :]
        km = gl.load(KM + offs_m.to(gl.int64)[:, None] * skm_q
                     + offs_n.to(gl.int64)[None, :] * skm_k, mask=inb, other=0)  # [M, N]
        keep = km != 0
    return keep


@gluon.jit
def _exclude(s, t, r0, offs_mb, offs_nb, Sq, Sk, am, BN: gl.constexpr,
             DOCS: gl.constexpr, HAS_KEEP: gl.constexpr):
    """s [RM, BN] with -inf where key tile t's documents / keep mask exclude the pair
    (bounds and band are _softmax_tile's; pair_keep)."""
    qa, qe, KID, KM, skm_q, skm_k = am
    offs_n = t * BN + offs_nb                                                  # [BN]
    offs_m = r0 + offs_mb                                                      # [RM]
    if DOCS == 1:
        kd = gl.load(KID + offs_n, mask=offs_n < Sk, other=-2)                 # [BN]
    else:
        kd = 0
    keep = pair_keep(offs_m, offs_n, Sq, Sk, qa, qe, kd, KM, skm_q, skm_k, DOCS, HAS_KEEP)
    return gl.where(keep, s, float("-inf"))


@gluon.jit
def softmax_tile_masked(s, m_i, l_i, t, f0, f1, r0, offs_mb, offs_nb, Sq, Sk, lo, hi,
                        qk_scale, am, HAS_BAND: gl.constexpr, BN: gl.constexpr,
                        EXP_FMA: gl.constexpr, MASK: gl.constexpr, ARRAY: gl.constexpr,
                        DOCS: gl.constexpr, HAS_KEEP: gl.constexpr):
    """fwd_kernel._softmax_tile with the array mask applied first on masked tiles
    (MASK: None decides per tile, t outside [f0, f1); True / False: the caller knows).
    -> p [RM, BN], alpha, l_i, m_i [RM]."""
    if ARRAY:
        if MASK is None:
            masked = (t < f0) | (t >= f1)
        else:
            masked = MASK
        if masked:
            s = _exclude(s, t, r0, offs_mb, offs_nb, Sq, Sk, am, BN, DOCS, HAS_KEEP)
    return _softmax_tile(s, m_i, l_i, t, f0, f1, r0, offs_mb, offs_nb, Sq, Sk, lo, hi,
                         qk_scale, HAS_BAND, BN, EXP_FMA, MASK)
