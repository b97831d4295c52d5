"""The partitions of the warp-specialised Gluon backward kernels for Hopper (sm_90a):
the TMA producer warp and the consumer warpgroup, shared by bwd_ws_kernel (dK / dV) and
bwd_ws_dq_kernel (dK / dV and the staged dQ partials, WITH_DQ); the module docs of those
two kernels describe the schedules.

Shape legend: G = H / Hkv, Sq / Sk queries / keys, D head dim, RN = 64 key rows per
consumer, BM = 64 the query tile, STAGES the depth of the Q / dO ring, DQC = D / 2 the
columns of a staged dQ half.

Documents / KeepMask (ARRAY): the kernels read each key tile's query tiles from a column
range table (launch.bwd_mask_tables); the consumer masks the edge tiles (outside
[g0, g1)) by array_keep besides the bounds and the band.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from .fwd_masks import mod_scores, pair_keep

__all__ = ["tile_of", "row_stats", "producer", "consumer", "ws_barriers"]

LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def tile_of(it, hk, G, s0, n_div, off):
    """The it-th (query head, query tile) pair of the flattened loop: heads outer, the
    query tiles of each head visited from index ``off`` on (rotated; 0: in order)."""
    return hk * G + it // n_div, s0 + (it % n_div + off) % n_div


@gluon.jit
def row_stats(L2, DELTA, bh, t, Sq, offs_mb, BM: gl.constexpr):
    """Rows of query tile t of head bh: max (+inf past Sq), log2(e) * log_norm, delta
    -> three [BM]."""
    bh64 = bh.to(gl.int64)
    offs_m = t * BM + offs_mb
    inb = offs_m < Sq
    mx = gl.load(L2 + bh64 * (2 * Sq) + offs_m, mask=inb, other=float("inf"))
    ln2 = gl.load(L2 + bh64 * (2 * Sq) + Sq + offs_m, mask=inb, other=0.0)
    dlt = gl.load(DELTA + bh64 * Sq + offs_m, mask=inb, other=0.0)
    return mx, ln2, dlt


@gluon.jit
def producer(q_desc, do_desc, q_smem, do_smem, q_bar, do_bar, empty, b, hk, G, s0, n_div,
             off, n_tot, STAGES: gl.constexpr, BM: gl.constexpr, st_smem=None, L2=None,
             DELTA=None, H=0, Sq=0, STATS: gl.constexpr = False, FOLD: gl.constexpr = False):
    """Q and dO of tile it into stage it % STAGES once both consumers released that
    stage's previous tile (the first pass waits on the phase before init: free).
    STATS: the tile's row statistics too (max, log2(e) * log_norm, delta: row_stats'
    values, padding included) into rows 4 * stage + 0, 1, 2 of st_smem [4 * STAGES, BM]
    fp32, stored before the stage's Q barrier is armed (its arrive releases them); each
    tile's loads are issued a tile ahead, so their latency hides behind the wait for the
    stage.  FOLD (the transposed
    consumers' 128-row tiles): row 0 holds the one exponent offset max * log2(e) +
    log2(e) * log_norm, row 1 is not written."""
    if STATS:
        st_l: gl.constexpr = gl.BlockedLayout([BM // 32], [32], [1], [0])       # [BM], 1 warp
        offs = gl.arange(0, BM, layout=st_l)
        h, t = tile_of(0, hk, G, s0, n_div, off)
        mx, ln2, dlt = row_stats(L2, DELTA, b * H + h, t, Sq, offs, BM)
    for it in range(0, n_tot):
        st = it % STAGES
        h, t = tile_of(it, hk, G, s0, n_div, off)
        mbarrier.wait(empty.index(st), ((it // STAGES) & 1) ^ 1)
        if STATS:
            if FOLD:
                st_smem.index(4 * st).store(mx * LOG2E + ln2)                    # [BM]
            else:
                st_smem.index(4 * st).store(mx)                                  # [BM]
                st_smem.index(4 * st + 1).store(ln2)
            st_smem.index(4 * st + 2).store(dlt)
            gl.thread_barrier()           # the warp's stores before the arrive below
            h_n, t_n = tile_of(gl.minimum(it + 1, n_tot - 1), hk, G, s0, n_div, off)
            mx, ln2, dlt = row_stats(L2, DELTA, b * H + h_n, t_n, Sq, offs, BM)
        mbarrier.expect(q_bar.index(st), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, t * BM, 0], q_bar.index(st),
                                        q_smem.index(st))
        mbarrier.expect(do_bar.index(st), do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [b, h, t * BM, 0], do_bar.index(st),
                                        do_smem.index(st))


@gluon.jit
def array_keep(offs_m, offs_n, h, Sq, Sk, IVb, KIDb, KMb, skm_h, skm_q, skm_k,
               DOCS: gl.constexpr, HAS_KEEP: gl.constexpr):
    """bool [BM, RN]: the pairs (queries offs_m [BM], keys offs_n [RN]) of query head h
    that the documents / keep mask keep (fwd_masks.pair_keep).  IVb: this batch row's
    q ids [Sq] (DOCS 1; KIDb its k ids [Sk]) or the key intervals [2, Sq] of the queries'
    documents (DOCS 2); KMb the keep bytes of batch row b (head stride skm_h)."""
    inb_m = offs_m < Sq
    if DOCS == 1:
        qa = gl.load(IVb + offs_m, mask=inb_m, other=-1)                       # [BM]
        qe = qa
        kd = gl.load(KIDb + offs_n, mask=offs_n < Sk, other=-2)                # [RN]
    elif DOCS == 2:
        qa = gl.load(IVb + offs_m, mask=inb_m, other=0)                        # [BM]
        qe = gl.load(IVb + Sq + offs_m, mask=inb_m, other=0)
        kd = 0
    else:
        qa = 0
        qe = 0
        kd = 0
    return pair_keep(offs_m, offs_n, Sq, Sk, qa, qe, kd, KMb + h.to(gl.int64) * skm_h,
                     skm_q, skm_k, DOCS, HAS_KEEP)


@gluon.jit
def consumer(k_desc, v_desc, dk_desc, dv_desc, q_smem, do_smem, k_smem, v_smem, p_smem,
             ds_smem, dqs, kv_bar, q_bar, do_bar, empty, dq_full, dq_empty, ds_bar, L2,
             DELTA, b, hk, H, G, Sq, Sk, j0, s0, g0, g1, n_div, off, n_tot, scale, lo, hi,
             HAS_BAND: gl.constexpr, STAGES: gl.constexpr, WG: gl.constexpr,
             WITH_DQ: gl.constexpr, IVb=None, KIDb=None, KMb=None,
             skm_h=0, skm_q=0, skm_k=0, ARRAY: gl.constexpr = False,
             DOCS: gl.constexpr = 0, HAS_KEEP: gl.constexpr = False, st_smem=None,
             SLOPES=None, sl_b=0, cap=1.0, adiag=0, SOFTCAP: gl.constexpr = 0,
             ALIBI: gl.constexpr = False):
    """Key rows [j0 + WG * RN, j0 + (WG + 1) * RN): the whole query loop, with WITH_DQ
    the staged column half WG of the key tile's dQ partial, and the dK / dV epilogue
    (bwd_ws_kernel / bwd_ws_dq_kernel module docs).  Without WITH_DQ dqs / dq_full /
    dq_empty / ds_bar / st_smem are None and each tile's row statistics are loaded from
    global memory under the previous tile's S / dP; with it they come from the stage's
    rows 4 * stage + 0, 1, 2 of st_smem [4 * STAGES, BM], stored there by the producer
    (no global load on the tile's path), and dqs is [2, 1, BM / 8, 4, 2, DH], its rows
    interleaved within each group of 8 (launch.dqa_desc).  ARRAY: the edge tiles' Documents / KeepMask pairs too (array_keep's
    IVb ... HAS_KEEP).  SOFTCAP / ALIBI: the score modifiers as the forward applies them
    (fwd_masks.mod_scores: the cap ``cap``, the slopes SLOPES fp32 [Ba, H] of batch
    stride sl_b at distance |i - j + adiag|, each tile's head's slope); with SOFTCAP
    P (1 - tanh^2) is formed as soon as P is, P kept in 16 bits for dV from there, and
    dS = (P (1 - tanh^2)) (dP - delta) feeds dK and dQ."""
    BM: gl.constexpr = q_smem.shape[3]
    D: gl.constexpr = q_smem.shape[4]
    RN: gl.constexpr = k_smem.shape[3]
    dt: gl.constexpr = q_smem.dtype
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, RN, 16])      # [BM, RN]
    a_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, D, 16])       # [RN|BM, D]
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)                                 # [BM]
    col_s: gl.constexpr = gl.SliceLayout(0, s_l)                                 # [RN]

    r0 = j0 + WG * RN
    k_own = k_smem.index(WG)                                                     # [1, 1, RN, D]
    v_own = v_smem.index(WG)
    kb = kv_bar.index(WG)
    mbarrier.expect(kb, 2 * k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, hk, r0, 0], kb, k_own)
    tma.async_copy_global_to_shared(v_desc, [b, hk, r0, 0], kb, v_own)
    k2 = k_own.reshape([RN, D])                                                  # [RN, D]
    kT = k2.permute((1, 0))                                                      # [D, RN]
    vT = v_own.reshape([RN, D]).permute((1, 0))                                  # [D, RN]
    p_own = p_smem.index(WG)                                                     # [BM, RN]
    ds_own = ds_smem.index(WG)
    if WITH_DQ:
        DQC: gl.constexpr = dqs.shape[len(dqs.shape) - 1]   # DH = D / 2
        # shared row 8 g + 2 b0 + b1 holds row 8 g + 4 b1 + b0: a half-warp's 4 rows (b1
        # fixed) then sit 2 apart, in 4 distinct 32-byte bank groups
        dq_own = dqs.index(WG).reshape([BM // 8, 4, 2, DQC])         # fp32 [g, b0, b1, DQC]
        q_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                      instr_shape=[16, DQC, 16])  # [BM, DQC]
        # this consumer's column half of both key halves, [RN, DH] each
        k0c = k_smem.index(0).reshape([RN, D]).slice(WG * DQC, DQC, dim=1)
        k1c = k_smem.index(1).reshape([RN, D]).slice(WG * DQC, DQC, dim=1)

    offs_mb = gl.arange(0, BM, layout=row_s)
    zero_s = gl.zeros([BM, RN], gl.float32, layout=s_l)
    if WITH_DQ:
        zero_q = gl.zeros([BM, DQC], gl.float32, layout=q_l)
    dk = gl.zeros([RN, D], gl.float32, layout=a_l)
    dv = gl.zeros([RN, D], gl.float32, layout=a_l)
    h, t = tile_of(0, hk, G, s0, n_div, off)
    if not WITH_DQ:
        mx, ln2, dlt = row_stats(L2, DELTA, b * H + h, t, Sq, offs_mb, BM)
    if SOFTCAP or ALIBI:
        inv_cap = 1.0 / cap
        if ALIBI:        # the keys' positions [RN]
            kj = r0 + gl.arange(0, RN, layout=col_s)
    mbarrier.wait(kb, 0)
    if WITH_DQ:
        mbarrier.wait(kv_bar.index(1 - WG), 0)     # the other half's K (its dQ columns)
    for it in range(0, n_tot):
        stg = it % STAGES
        ph = (it // STAGES) & 1
        offs_m = t * BM + offs_mb
        q2 = q_smem.index(stg).reshape([BM, D])
        do2 = do_smem.index(stg).reshape([BM, D])
        if ALIBI:         # this tile's head's slope (raw units without softcap)
            slope = gl.load(SLOPES + b * sl_b + h)
            if not SOFTCAP:
                slope = slope / scale
        mbarrier.wait(q_bar.index(stg), ph)
        s = warpgroup_mma(q2, kT, zero_s, use_acc=False, is_async=True)        # [BM, RN]
        mbarrier.wait(do_bar.index(stg), ph)
        dp = warpgroup_mma(do2, vT, zero_s, use_acc=False, is_async=True)      # [BM, RN]
        if not WITH_DQ:  # the next tile's statistics (the last tile's again at the end),
            # loaded while S / dP run
            h_n, t_n = tile_of(gl.minimum(it + 1, n_tot - 1), hk, G, s0, n_div, off)
            mx_n, ln2_n, dlt_n = row_stats(L2, DELTA, b * H + h_n, t_n, Sq, offs_mb, BM)
        s = warpgroup_mma_wait(1, deps=(s,))                                   # [BM, RN]
        if WITH_DQ:        # this tile's row statistics, staged by the producer
            mx = st_smem.index(4 * stg).load(row_s)                              # [BM]
            ln2 = st_smem.index(4 * stg + 1).load(row_s)
        if SOFTCAP:       # natural scores c tanh(..) (- ALiBi), and 1 - tanh^2
            if not ALIBI:
                kj = 0
                slope = 0.0
            s, dth = mod_scores(s, scale, inv_cap, cap, slope, offs_m + adiag, kj, SOFTCAP,
                                ALIBI)
        else:
            if ALIBI:     # on the raw products (kernels._raw_alibi), then scaled
                s, _ = mod_scores(s, scale, 0.0, 0.0, slope, offs_m + adiag, kj, 0, ALIBI)
            s = gl.fma(s, scale, 0.0)     # (an fma: never contracted into the next line)
        p = gl.exp2((s - mx[:, None]) * LOG2E - ln2[:, None])                   # [BM, RN]
        if SOFTCAP:       # through c tanh(x / c): dS = (P (1 - tanh^2)) (dP - delta); P
            pd = p * dth  # for dV in 16 bits from here (1 - tanh^2 dies now, and no
            p = p.to(dt)  # second fp32 tile lives across the edge tiles' branch)
        if (t < g0) | (t >= g1):          # edge tiles: bounds and the band
            offs_n = r0 + gl.arange(0, RN, layout=col_s)                       # [RN]
            # with a band, per query the kept keys [j_lo, j_hi] (bounds, band): two compares an
            # element against its key index (fwd_masks.softmax_tile's form); without a
            # band the bounds' two compares as before (the D=128 loops spill more with
            # the other form there)
            if HAS_BAND:
                j_hi = gl.where(offs_m < Sq, gl.minimum(offs_m + hi, Sk - 1), -1)  # [BM]
                j_lo = gl.maximum(offs_m + lo, 0)
                keep = (offs_n[None, :] >= j_lo[:, None]) & (offs_n[None, :] <= j_hi[:, None])
            else:
                keep = (offs_m < Sq)[:, None] & (offs_n < Sk)[None, :]
            if ARRAY:
                keep = keep & array_keep(offs_m, offs_n, h, Sq, Sk, IVb, KIDb, KMb, skm_h,
                                         skm_q, skm_k, DOCS, HAS_KEEP)
            if SOFTCAP:
                p = gl.where(keep, p, gl.zeros_like(p))
                pd = gl.where(keep, pd, 0.0)
            else:
                p = gl.where(keep, p, 0.0)
        p_own.store(p.to(dt))
        if SOFTCAP:
            p = pd
        fence_async_shared()
        gl.thread_barrier()               # the partition's 4 warps stored P
        dv = warpgroup_mma(p_own.permute((1, 0)), do2, dv, is_async=True)      # [RN, D]
        dp = warpgroup_mma_wait(1, deps=(dp,))                                  # [BM, RN]
        if WITH_DQ:
            sl = it & 1
            ds_w = ds_smem.index(2 * sl + WG)             # this tile's slot
        else:
            ds_w = ds_own
        if WITH_DQ:
            dlt = st_smem.index(4 * stg + 2).load(row_s)
        ds_w.store((p * (dp - dlt[:, None])).to(dt))
        fence_async_shared()
        gl.thread_barrier()               # ... and dS
        if WITH_DQ:
            mbarrier.arrive(ds_bar, count=1)              # this half of dS is stored
        dk = warpgroup_mma(ds_w.permute((1, 0)), q2, dk, is_async=True)        # [RN, D]
        if WITH_DQ:
            mbarrier.wait(ds_bar, it & 1)                 # ... and the other half
            sp = sl
            ds0 = ds_smem.index(2 * sp)
            ds1 = ds_smem.index(2 * sp + 1)
            dq = warpgroup_mma(ds0, k0c, zero_q, use_acc=False, is_async=True)  # [BM, DH]
            dq = warpgroup_mma(ds1, k1c, dq, is_async=True)                    # [BM, DH]
            dk, dv, dq = warpgroup_mma_wait(0, deps=(dk, dv, dq))  # P / dS / the stage free
        else:
            dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))          # P / dS / the stage free
        mbarrier.arrive(empty.index(stg), count=1)
        if WITH_DQ:
            # the staged partial once the writer has read the previous one ("dq empty"),
            # then "dq full" (no helper function: its inlined scope's line-table labels
            # split ptxas's scheduling regions)
            mbarrier.wait(dq_empty.index(WG), (it & 1) ^ 1)
            # [BM, DQC] -> [g, b1, b0, DQC] -> [g, b0, b1, DQC]
            dq_own.store(dq.reshape([BM // 8, 2, 4, DQC]).permute((0, 2, 1, 3)))
            fence_async_shared()
            gl.thread_barrier()       # the partition's 4 warps staged dQ_w
            mbarrier.arrive(dq_full.index(WG), count=1)
        if not WITH_DQ:
            mx, ln2, dlt = mx_n, ln2_n, dlt_n
            t = t_n
            if ARRAY or ALIBI:     # the keep mask's / the slope's head
                h = h_n
        else:
            h, t = tile_of(it + 1, hk, G, s0, n_div, off)

    if WITH_DQ:   # the other consumer's last dQ products (they read K_w) are done
        mbarrier.arrive(ds_bar, count=1)
        mbarrier.wait(ds_bar, n_tot & 1)
    # epilogue: through this consumer's own K / V buffers (only its wgmmas read them;
    # with dq the other's too, done now)
    k2.store((dk * scale).to(dt))
    v_own.reshape([RN, D]).store(dv.to(dt))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(dk_desc, [b, hk, r0, 0], k_own)
    tma.async_copy_shared_to_global(dv_desc, [b, hk, r0, 0], v_own)
    tma.store_wait(pendings=0)


@gluon.jit
def ws_barriers(STAGES: gl.constexpr, WITH_DQ: gl.constexpr):
    """The backward kernels' barriers, initialised (after their buffers): per consumer its
    K / V ready and (WITH_DQ) its dQ staged ("dq full") and read ("dq empty"); WITH_DQ
    "ds ready" (one arrive per consumer); per ring stage Q ready, dO ready and empty (one
    arrive per consumer) -> kv_bar, dq_full, dq_empty, ds_bar, q_bar, do_bar, empty.
    Without WITH_DQ, dq_full is two barriers no partition waits on (bwd_ws_kernel) and
    dq_empty / ds_bar are placeholders (0)."""
    kv_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    if WITH_DQ:
        dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        ds_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    else:
        dq_empty = 0
        ds_bar = 0
    q_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for w in gl.static_range(2):
        mbarrier.init(kv_bar.index(w), count=1)
        mbarrier.init(dq_full.index(w), count=1)
        if WITH_DQ:
            mbarrier.init(dq_empty.index(w), count=1)
    for st in gl.static_range(STAGES):
        mbarrier.init(q_bar.index(st), count=1)
        mbarrier.init(do_bar.index(st), count=1)
        mbarrier.init(empty.index(st), count=2)          # one arrive per consumer
    if WITH_DQ:
        mbarrier.init(ds_bar, count=2)                   # one arrive per consumer
    fence_async_shared()
    return kv_bar, dq_full, dq_empty, ds_bar, q_bar, do_bar, empty
