"""The Hopper forward's online softmax of one score tile (softmax_tile: bounds and band on
the edge tiles), the array masks (Documents / KeepMask) applied before it and the score
modifiers before those (mod_scores: softcap, ALiBi; the portable kernels' math,
kernels._mod_scores).

Shape legend: RM query rows of a consumer warpgroup, BN the key tile, Sq / Sk queries /
keys.  The warp-specialised forward (fwd_ws_kernel) walks a block-range table at its own
tile (tiles.py ``block_ranges``; per 128-row query tile (t0, f0, f1, t1): every kept
key tile in [t0, t1), [f0, f1) a run of fully kept tiles); the tiles outside [f0, f1)
are masked here before the online softmax (which adds the bounds and the band), those
inside run without mask code.  ``am`` is the tuple the kernel passes down:
(qa, qe [RM] int32 per row of the consumer: DOCS 1 the q id (-1 past Sq) and unused,
DOCS 2 the row's document as the key interval [qa, qe); KID: k ids of this batch row
(DOCS 1), KM: the keep bytes of this (b, h), skm_q, skm_k: their row / column strides).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl


__all__ = ["softmax_tile_masked", "pair_keep", "mod_scores", "alibi_dist", "tanh_fast",
           "fwd_mods", "LOG2E"]

LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def tanh_fast(y):
    """-> (tanh y, 1 - tanh^2 y) through the one-instruction tanh.approx.f32 (max relative
    error ~2^-11; saturates to +-1, NaN stays NaN): the portable kernels' softcap of
    16-bit inputs on CUDA (kernels._tanh_fast), so both paths form the same scores."""
    t = gl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [y], dtype=gl.float32,
                                  is_pure=True, pack=1)
    return t, 1.0 - t * t


@gluon.jit
def alibi_dist(ri, cj):
    """|ri - cj| [M, N] as fp32, exact for |ri - cj| < 2^22, from integer positions ri [M]
    / cj [N]: the int32 difference biased by 2^23 + 2^22 has the bits of that float
    (exponent 2^23: integers exact), so the conversion is one integer add (the column's
    part folds into an immediate: no per-column vector lives in registers) and one
    float subtraction, no int-to-float instruction.  The same value as the portable
    kernels' |fl(i) - fl(j)| (kernels._alibi_dist) wherever both are exact."""
    d = (ri[:, None] + 0x4B400000) - cj[None, :]                               # int32
    return gl.abs(d.to(gl.float32, bitcast=True) - 12582912.0)


@gluon.jit
def mod_scores(s, scale, inv_cap, cap, slope, ri, cj, SOFTCAP: gl.constexpr,
               ALIBI: gl.constexpr):
    """Raw products q.k s [M, N] -> the scores with the modifiers, in kernels._mod_scores'
    order and roundings: SOFTCAP the natural scores c * tanh(fma(s, scale, 0) * (1 / c))
    (inv_cap = 1 / c), then ALIBI - slope * |ri - cj| (ri [M] / cj [N] the rows' /
    columns' int32 positions, the bottom-right offset added to the query side, either of
    them; alibi_dist); ALIBI alone on the raw products with slope = slope / scale
    (kernels._raw_alibi: the scores stay in raw units).  -> (scores, 1 - tanh^2: the
    scores again without SOFTCAP, unused)."""
    if SOFTCAP:
        th, dth = tanh_fast(gl.fma(s, scale, 0.0) * inv_cap)
        s = gl.fma(th, cap, 0.0)
    else:
        dth = s
    if ALIBI:
        s = gl.fma(alibi_dist(ri, cj), -slope, s)
    return s, dth


@gluon.jit
def fwd_mods(MODS, b, h, scale, qk_scale, SOFTCAP: gl.constexpr, ALIBI: gl.constexpr):
    """A forward consumer's modifier values for (batch b, query head h) from MODS =
    (SLOPES fp32 [Ba, H], its batch stride sl_b, the cap c, the ALiBi offset adiag, SINKS
    fp32 [H]; placeholders where a modifier is off) -> (mods = (scale, c, slope, adiag)
    for softmax_tile_masked, the exponent's factor: log2(e) on the natural scores of
    SOFTCAP, else qk_scale on raw products).  The sink is the epilogue's to load (no
    register of it lives across the key loop)."""
    SLOPES, sl_b, cap, adiag, SINKS = MODS
    if ALIBI:
        slope = gl.load(SLOPES + b * sl_b + h)
        if not SOFTCAP:
            slope = slope / scale
    else:
        slope = 0.0
    if SOFTCAP:
        c_exp = LOG2E
    else:
        c_exp = qk_scale
    return (scale, cap, slope, adiag), c_exp


@gluon.jit
def softmax_tile(s, m_i, l_i, t, f0, f1, i0, offs_mb, offs_nb, Sq, Sk, lo, hi, qk_scale,
                  HAS_BAND: gl.constexpr, BN: gl.constexpr):
    """Online softmax of one score tile s [BM, BN] (raw q.k): -> p [BM, BN] fp32,
    alpha [BM] (the old accumulator's factor), l_i, m_i [BM].  Masks only the edge tiles
    (t outside [f0, f1), decided per tile at run time): bounds and the band
    lo <= j - i <= hi.  The exponent is one fma per element, s * c - m * c
    (c = qk_scale)."""
    masked = (t < f0) | (t >= f1)
    if masked:
        # per row the kept keys [j_lo, j_hi] (bounds, band): an element costs two
        # compares against its key index, not the [BM, BN] differences j - i and four
        offs_m = i0 + offs_mb                                                  # [BM]
        offs_n = t * BN + offs_nb                                              # [BN]
        if HAS_BAND:
            j_hi = gl.minimum(offs_m + hi, Sk - 1)
            j_lo = gl.maximum(offs_m + lo, 0)                                  # [BM]
            j_hi = gl.where(offs_m < Sq, j_hi, -1)
            keep = (offs_n[None, :] >= j_lo[:, None]) & (offs_n[None, :] <= j_hi[:, None])
        else:
            j_hi = gl.where(offs_m < Sq, Sk - 1, -1)
            keep = offs_n[None, :] <= j_hi[:, None]
        s = gl.where(keep, s, float("-inf"))                                   # [BM, BN]
        m_new = gl.maximum(m_i, gl.max(s, 1))                                  # [BM]
        m_use = gl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = gl.maximum(m_i, gl.max(s, 1))
        m_use = m_new
    p = gl.exp2(gl.fma(s, qk_scale, -(m_use * qk_scale)[:, None]))           # [BM, BN]
    alpha = gl.exp2((m_i - m_use) * qk_scale)                                      # [BM]
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, l_i, m_new


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
    (bounds and band are softmax_tile's; pair_keep)."""
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
                        ARRAY: gl.constexpr, DOCS: gl.constexpr, HAS_KEEP: gl.constexpr,
                        mods=None, SOFTCAP: gl.constexpr = 0, ALIBI: gl.constexpr = False):
    """softmax_tile with the score modifiers (SOFTCAP / ALIBI: mod_scores with mods =
    fwd_mods' tuple; qk_scale then fwd_mods' exponent factor) and the array mask applied
    first on masked tiles (t outside [f0, f1)).  -> p [RM, BN], alpha, l_i, m_i [RM]."""
    if SOFTCAP or ALIBI:
        scale, cap, slope, adiag = mods
        inv_cap = 1.0 / cap
        # ALiBi: the rows' positions + adiag - the tile's first key [RM], the columns'
        # within the tile [BN] (alibi_dist)
        s, _ = mod_scores(s, scale, inv_cap, cap, slope, r0 + offs_mb + adiag - t * BN,
                          offs_nb, SOFTCAP, ALIBI)
    if ARRAY:
        masked = (t < f0) | (t >= f1)
        if masked:
            s = _exclude(s, t, r0, offs_mb, offs_nb, Sq, Sk, am, BN, DOCS, HAS_KEEP)
    return softmax_tile(s, m_i, l_i, t, f0, f1, r0, offs_mb, offs_nb, Sq, Sk, lo, hi,
                         qk_scale, HAS_BAND, BN)
