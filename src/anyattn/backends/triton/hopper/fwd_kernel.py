"""Gluon forward kernel for Hopper (sm_90a): TMA loads on mbarriers, warpgroup MMA.

Shape legend: B batch, H query heads, Hkv kv heads, G = H / Hkv, Sq / Sk queries / keys,
D head dim (64 or 128), BM / BN the query / key tile, STAGES the depth of the K/V ring.

One program per (query tile, b * H + h).  Q [BM, D] arrives once by TMA; K and V tiles
[BN, D] arrive by TMA into a STAGES-deep shared-memory ring, each buffer completing on
its own mbarrier (K and V apart, so that the score product starts before V lands).
Scores S = Q.K^T [BM, BN] and the output O += P.V [BM, D] are warpgroup MMAs (wgmma,
fp32 accumulators in registers, P from registers); P.V of one tile runs while the next
tile's K wait and Q.K^T are issued.  The tensor descriptors are 4-D [B, H, S, D] over the
callers' strides: rows past Sq / Sk are zero-filled by the copy engine (and masked) and
clipped on the TMA store of out.

Numerics are the portable forward's (kernels.py module doc, "Row statistics"): the row
max is kept in raw q.k units, ``p = exp2((x - m) * scale * log2 e)``, the statistics
``max = m * scale`` and ``log_norm = ln(l)`` go to two fp32 planes [2, B * H * Sq];
empty rows: out 0, max -inf, log_norm 0.  Key tiles come from the band range
[t0, t1) (no mask: all), masked at the edges [t0, f0) and [f1, t1) only.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)

__all__ = ["fwd_kernel"]


@gluon.jit
def _cdiv_pos(x, b):
    """ceil(x / b) for x of any sign, clamped at 0."""
    return (gl.maximum(x, 0) + b - 1) // b


@gluon.jit
def _div_pos(x, b):
    """floor(x / b) for x of any sign, clamped at 0."""
    return gl.maximum(x, 0) // b


@gluon.jit
def key_tile_range(i0, Sq, Sk, lo, hi, BM: gl.constexpr, BN: gl.constexpr):
    """Key tiles seen by queries [i0, i0 + BM) under lo <= j - i <= hi: all in [t0, t1),
    unmasked (fully kept, in bounds) in [f0, f1) (the portable kernels' rule)."""
    i1 = gl.minimum(i0 + BM, Sq)
    nk = (Sk + BN - 1) // BN
    t0 = _div_pos(i0 + lo, BN)
    t1 = gl.minimum(nk, _cdiv_pos(i1 + hi, BN))
    t1 = gl.maximum(t0, t1)
    f0 = _cdiv_pos(lo + i1 - 1, BN)
    f1 = gl.minimum(_div_pos(hi + i0 + 1, BN), Sk // BN)
    f1 = gl.where(i0 + BM <= Sq, f1, f0)
    f0 = gl.minimum(gl.maximum(f0, t0), t1)
    f1 = gl.minimum(gl.maximum(f1, f0), t1)
    return t0, f0, f1, t1


@gluon.jit
def _issue_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, b, hk, t, st,
              BN: gl.constexpr):
    """TMA of key tile t (K and V [BN, D]) into ring stage st."""
    mbarrier.expect(k_bar.index(st), k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, hk, t * BN, 0], k_bar.index(st), k_smem.index(st))
    mbarrier.expect(v_bar.index(st), v_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(v_desc, [b, hk, t * BN, 0], v_bar.index(st), v_smem.index(st))


@gluon.jit
def _softmax_tile(s, m_i, l_i, t, f0, f1, i0, offs_mb, offs_nb, Sq, Sk, lo, hi, qk_scale,
                  HAS_BAND: gl.constexpr, BN: gl.constexpr, EXP_FMA: gl.constexpr = False,
                  MASK: gl.constexpr = None):
    """Online softmax of one score tile s [BM, BN] (raw q.k): -> p [BM, BN] fp32,
    alpha [BM] (the old accumulator's factor), l_i, m_i [BM].  Masks only the edge tiles
    (t outside [f0, f1)): bounds and the band lo <= j - i <= hi.  EXP_FMA: the exponent
    as one fma per element, s * c - m * c (c = qk_scale), instead of (s - m) * c.
    MASK: None decides per tile at run time (a branch); True / False: the caller knows
    (True is right for any tile, False only inside [f0, f1))."""
    if MASK is None:
        masked = (t < f0) | (t >= f1)
    else:
        masked = MASK
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
    if EXP_FMA:
        p = gl.exp2(gl.fma(s, qk_scale, -(m_use * qk_scale)[:, None]))       # [BM, BN]
    else:
        p = gl.exp2((s - m_use[:, None]) * qk_scale)          # [BM, BN]; 1 at the row max
    alpha = gl.exp2((m_i - m_use) * qk_scale)                                      # [BM]
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, alpha, l_i, m_new


@gluon.jit
def _loop_simple(q2, k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, acc, m_i, l_i, zero_s,
                 n, t0, f0, f1, i0, b, hk, offs_mb, offs_nb, Sq, Sk, lo, hi, qk_scale,
                 HAS_BAND: gl.constexpr, STAGES: gl.constexpr, BN: gl.constexpr,
                 D: gl.constexpr, dt: gl.constexpr, p_l: gl.constexpr, row_o: gl.constexpr):
    """Key tiles one after another: Q.K^T(t) waits for P.V(t - 1), the softmax of t runs
    while no MMA of this warpgroup is in flight.  -> acc [BM, D], l_i, m_i [BM]."""
    for it in range(0, n):
        t = t0 + it
        stg = it % STAGES
        ph = (it // STAGES) & 1
        mbarrier.wait(k_bar.index(stg), ph)
        kT = k_smem.index(stg).reshape([BN, D]).permute((1, 0))                # [D, BN]
        s_tok = warpgroup_mma(q2, kT, zero_s, use_acc=False, is_async=True)
        # waits for this tile's scores and the previous tile's P.V (in issue order)
        s, acc = warpgroup_mma_wait(0, deps=(s_tok, acc))                     # s [BM, BN]
        gl.thread_barrier()   # every warpgroup is past tile it - 1: refill its stage
        nxt = it + STAGES - 1
        if nxt < n:
            _issue_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, b, hk, t0 + nxt,
                      nxt % STAGES, BN)
        p, alpha, l_i, m_i = _softmax_tile(s, m_i, l_i, t, f0, f1, i0, offs_mb, offs_nb,
                                           Sq, Sk, lo, hi, qk_scale, HAS_BAND, BN)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p16 = gl.convert_layout(p.to(dt), p_l)                                 # [BM, BN]
        mbarrier.wait(v_bar.index(stg), ph)
        acc = warpgroup_mma(p16, v_smem.index(stg).reshape([BN, D]), acc, is_async=True)
    acc = warpgroup_mma_wait(0, deps=(acc,))                                   # [BM, D]
    return acc, l_i, m_i


@gluon.jit
def _loop_overlap(q2, k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, acc, m_i, l_i, zero_s,
                  n, t0, f0, f1, i0, b, hk, offs_mb, offs_nb, Sq, Sk, lo, hi, qk_scale,
                  HAS_BAND: gl.constexpr, STAGES: gl.constexpr, BN: gl.constexpr,
                  D: gl.constexpr, dt: gl.constexpr, p_l: gl.constexpr, row_o: gl.constexpr):
    """FA3's intra-warpgroup overlap: Q.K^T(t + 1) is issued before the softmax of t and
    P.V(t) before waiting for it, so the tensor cores work while the softmax runs.  The
    ring refill of tile t + STAGES - 1 happens mid-tile t, hence STAGES >= 3."""
    gl.static_assert(STAGES >= 3, "the overlapped loop needs a ring of 3 or more stages")
    s = zero_s
    if n > 0:
        mbarrier.wait(k_bar.index(0), 0)
        kT = k_smem.index(0).reshape([BN, D]).permute((1, 0))
        s = warpgroup_mma(q2, kT, zero_s, use_acc=False)                      # [BM, BN]
    for it in range(0, n):
        t = t0 + it
        stg = it % STAGES
        ph = (it // STAGES) & 1
        # Q.K^T of the next tile (the last tile recomputes its own: a wasted product
        # rather than a branch around an asynchronous MMA)
        nx = gl.minimum(it + 1, n - 1)
        nst = nx % STAGES
        mbarrier.wait(k_bar.index(nst), (nx // STAGES) & 1)
        kT = k_smem.index(nst).reshape([BN, D]).permute((1, 0))                # [D, BN]
        s_tok = warpgroup_mma(q2, kT, zero_s, use_acc=False, is_async=True)
        p, alpha, l_i, m_i = _softmax_tile(s, m_i, l_i, t, f0, f1, i0, offs_mb, offs_nb,
                                           Sq, Sk, lo, hi, qk_scale, HAS_BAND, BN)
        p16 = gl.convert_layout(p.to(dt), p_l)                                 # [BM, BN]
        acc = warpgroup_mma_wait(1, deps=(acc,))           # P.V(t - 1) done, Q.K^T may run
        gl.thread_barrier()   # every warpgroup is past tile it - 1: refill its stage
        nxt = it + STAGES - 1
        if nxt < n:
            _issue_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, b, hk, t0 + nxt,
                      nxt % STAGES, BN)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        mbarrier.wait(v_bar.index(stg), ph)
        acc = warpgroup_mma(p16, v_smem.index(stg).reshape([BN, D]), acc, is_async=True)
        s = warpgroup_mma_wait(1, deps=(s_tok,))           # Q.K^T(t + 1) done, P.V may run
    acc = warpgroup_mma_wait(0, deps=(acc,))                                   # [BM, D]
    return acc, l_i, m_i


@gluon.jit
def fwd_kernel(q_desc, k_desc, v_desc, o_desc, LSE, H, G, Sq, Sk, qk_scale, scale, lo, hi,
               HAS_BAND: gl.constexpr, STAGES: gl.constexpr, OVERLAP: gl.constexpr,
               num_warps: gl.constexpr):
    """Grid (cdiv(Sq, BM), B * H).  q/o_desc: [B, H, Sq, D] blocks [1, 1, BM, D];
    k/v_desc: [B, Hkv, Sk, D] blocks [1, 1, BN, D]; LSE fp32 [2, B * H * Sq] (max,
    log_norm).  qk_scale = scale * log2(e).  Band masks through lo / hi (open: +-2^30)."""
    BM: gl.constexpr = q_desc.block_type.shape[2]
    D: gl.constexpr = q_desc.block_type.shape[3]
    BN: gl.constexpr = k_desc.block_type.shape[2]
    dt: gl.constexpr = q_desc.dtype
    # wgmma accumulators: num_warps warps stacked along the rows (16 rows each)
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BN, 16])
    o_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, D, 16])
    p_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)
    col_s: gl.constexpr = gl.SliceLayout(0, s_l)
    row_o: gl.constexpr = gl.SliceLayout(1, o_l)

    n_m = gl.num_programs(0)
    pid_m = gl.program_id(0)
    if HAS_BAND:                      # the longest rows of a causal band first
        pid_m = n_m - 1 - pid_m
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // G
    i0 = pid_m * BM

    q_smem = gl.allocate_shared_memory(dt, [1, 1, BM, D], q_desc.layout)
    k_smem = gl.allocate_shared_memory(dt, [STAGES, 1, 1, BN, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dt, [STAGES, 1, 1, BN, D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for st in gl.static_range(STAGES):
        mbarrier.init(k_bar.index(st), count=1)
        mbarrier.init(v_bar.index(st), count=1)
    fence_async_shared()

    if HAS_BAND:
        t0, f0, f1, t1 = key_tile_range(i0, Sq, Sk, lo, hi, BM, BN)
    else:
        t0 = 0
        f0 = 0
        f1 = Sk // BN
        f1 = gl.where(i0 + BM <= Sq, f1, 0)
        t1 = (Sk + BN - 1) // BN
    n = t1 - t0

    mbarrier.expect(q_bar, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [b, h, i0, 0], q_bar, q_smem)
    for st in gl.static_range(STAGES - 1):          # prologue: the ring's first tiles
        if st < n:
            _issue_kv(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, b, hk, t0 + st, st, BN)
    q2 = q_smem.reshape([BM, D])

    offs_mb = gl.arange(0, BM, layout=row_s)
    offs_nb = gl.arange(0, BN, layout=col_s)
    m_i = gl.full([BM], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([BM], gl.float32, layout=row_s)
    acc = warpgroup_mma_init(gl.zeros([BM, D], gl.float32, layout=o_l))
    zero_s = gl.zeros([BM, BN], gl.float32, layout=s_l)
    mbarrier.wait(q_bar, 0)

    if OVERLAP:
        acc, l_i, m_i = _loop_overlap(q2, k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, acc,
                                      m_i, l_i, zero_s, n, t0, f0, f1, i0, b, hk, offs_mb,
                                      offs_nb, Sq, Sk, lo, hi, qk_scale, HAS_BAND, STAGES,
                                      BN, D, dt, p_l, row_o)
    else:
        acc, l_i, m_i = _loop_simple(q2, k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, acc,
                                     m_i, l_i, zero_s, n, t0, f0, f1, i0, b, hk, offs_mb,
                                     offs_nb, Sq, Sk, lo, hi, qk_scale, HAS_BAND, STAGES,
                                     BN, D, dt, p_l, row_o)

    for st in gl.static_range(STAGES):
        mbarrier.invalidate(k_bar.index(st))
        mbarrier.invalidate(v_bar.index(st))
    mbarrier.invalidate(q_bar)

    # epilogue: empty rows (l == 0) give out 0, max -inf, log_norm 0; NaN rows stay NaN
    empty = l_i == 0.0
    l_safe = gl.where(empty, 1.0, l_i)
    row_max = gl.where(empty, float("-inf"), m_i * scale)
    row_max = gl.where(l_i == l_i, row_max, l_i)
    log_norm = gl.log2(l_safe) * 0.6931471805599453
    emp_o = gl.convert_layout(empty, row_o)
    l_o = gl.convert_layout(l_safe, row_o)
    out = gl.where(emp_o[:, None], 0.0, acc / l_o[:, None])
    gl.thread_barrier()               # every warpgroup's Q.K^T has read q_smem
    q_smem.reshape([BM, D]).store(out.to(dt))
    fence_async_shared()
    tma.async_copy_shared_to_global(o_desc, [b, h, i0, 0], q_smem)
    offs_m = i0 + offs_mb
    inb = offs_m < Sq
    row = bh.to(gl.int64) * Sq + offs_m
    gl.store(LSE + row, row_max, mask=inb)
    gl.store(LSE + gl.num_programs(1).to(gl.int64) * Sq + row, log_norm, mask=inb)
    tma.store_wait(pendings=0)
