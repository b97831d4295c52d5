"""Gluon dK/dV kernel for Hopper (sm_90a): TMA ring of query-side tiles, warpgroup MMA.

Shape legend: B batch, H query heads, Hkv kv heads, G = H / Hkv, Sq / Sk queries / keys,
D head dim, BN the key tile of a program (num_warps / 4 warpgroups of 64 key rows), BM
the query tile, STAGES the depth of the Q / dO ring.

One program per (key tile, b * Hkv + hk).  K and V [BN, D] arrive once by TMA; for each
query head of the group and each query tile that sees this key tile (band ranges, the
portable kernels' rule), Q and dO [BM, D] arrive by TMA into a STAGES-deep ring and

    S^T  = K . Q^T      [BN, BM]   wgmma, both operands from shared memory
    dP^T = V . dO^T     [BN, BM]   wgmma
    P^T  = exp2((fma(S^T, scale, 0) - max) * log2 e - log_norm2)    (0 where masked)
    dS^T = P^T * (dP^T - delta)
    dV  += P^T . dO     [BN, D]    wgmma, P^T from registers
    dK  += dS^T . Q     [BN, D]    wgmma, dS^T from registers

with the row statistics of the backward preprocess (L2 [B * H, 2, Sq]: max, +inf on
empty rows, and log2(e) * log_norm) and delta [B * H * Sq] (kernels.py module doc,
"Row statistics").  dK is scaled by ``scale`` once at the end; both are stored by TMA
(rows past Sk clipped).  Every dK / dV element has one owner program and a fixed
summation order: bitwise repeatable, no atomics.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)

from .fwd_kernel import _cdiv_pos, _div_pos

__all__ = ["dkdv_kernel", "query_tile_range", "key_tile_queries", "key_tile_program",
           "key_tile_table"]

LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def query_tile_range(j0, Sq, Sk, lo, hi, BM: gl.constexpr, BN: gl.constexpr):
    """Query tiles of BM rows that see keys [j0, j0 + BN) under lo <= j - i <= hi: all in
    [s0, s1), unmasked (fully kept, in bounds) in [g0, g1)."""
    j1 = gl.minimum(j0 + BN, Sk)
    nq = (Sq + BM - 1) // BM
    s0 = _div_pos(j0 - hi, BM)
    s1 = gl.minimum(nq, _cdiv_pos(j1 - lo, BM))             # last query j1 - 1 - lo
    s1 = gl.maximum(s0, s1)
    g0 = _cdiv_pos(j1 - 1 - hi, BM)
    g1 = gl.minimum(_div_pos(j0 - lo + 1, BM), Sq // BM)
    g1 = gl.where(j0 + BN <= Sk, g1, g0)
    g0 = gl.minimum(gl.maximum(g0, s0), s1)
    g1 = gl.minimum(gl.maximum(g1, g0), s1)
    return s0, g0, g1, s1


@gluon.jit
def key_tile_program(H, G, BN: gl.constexpr):
    """This program's key tile -> (pid_n, b, hk, j0): grid (key tiles, B * Hkv), the
    tile's first key j0 = pid_n * BN, kv head hk of batch b (Hkv = H // G)."""
    pid_n = gl.program_id(0)
    bhk = gl.program_id(1)
    Hkv = H // G
    return pid_n, bhk // Hkv, bhk % Hkv, pid_n * BN


@gluon.jit
def key_tile_queries(j0, G, Sq, Sk, lo, hi, BM: gl.constexpr, BN: gl.constexpr,
                     HAS_BAND: gl.constexpr):
    """What the key tile [j0, j0 + BN) visits -> (s0, g0, g1, s1, n_tot, n_div): query
    tiles [s0, s1), unmasked in [g0, g1) (query_tile_range under a band; without one
    every tile, unmasked when the key tile lies in bounds), n_tot = G * (s1 - s0) pairs
    (head of the group, query tile) and n_div = max(s1 - s0, 1)."""
    if HAS_BAND:
        s0, g0, g1, s1 = query_tile_range(j0, Sq, Sk, lo, hi, BM, BN)
    else:
        s0 = 0
        g0 = 0
        g1 = gl.where(j0 + BN <= Sk, Sq // BM, 0)
        s1 = (Sq + BM - 1) // BM
    n_t = s1 - s0
    return s0, g0, g1, s1, G * n_t, gl.maximum(n_t, 1)


@gluon.jit
def key_tile_table(CT, b, hk, pid_n, ct_b, ct_h, G):
    """key_tile_queries of a Documents / KeepMask key tile, from the column range table
    CT int32 [Bm, Hm, nkv, 8] (launch.bwd_mask_tables: s0, g0, g1, s1, off, 0, 0, 0 per
    key tile of (b, kv head hk); 0 strides where broadcast) -> (s0, g0, g1, s1, n_tot,
    n_div, off): query tiles [s0, s1) (every kept one of the kv head's group), fully kept
    in [g0, g1), visited from index off of the range on (the dQ add order's rotation)."""
    rg = CT + 8 * (b * ct_b + hk * ct_h + pid_n)
    s0 = gl.load(rg)
    g0 = gl.load(rg + 1)
    g1 = gl.load(rg + 2)
    s1 = gl.load(rg + 3)
    off = gl.load(rg + 4)
    n_t = s1 - s0
    return s0, g0, g1, s1, G * n_t, gl.maximum(n_t, 1), off


@gluon.jit
def _issue_qdo(q_desc, do_desc, q_smem, do_smem, q_bar, do_bar, b, h, t, st,
               BM: gl.constexpr):
    """TMA of query tile t of head h (Q and dO [BM, D]) into ring stage st."""
    mbarrier.expect(q_bar.index(st), q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [b, h, t * BM, 0], q_bar.index(st), q_smem.index(st))
    mbarrier.expect(do_bar.index(st), do_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(do_desc, [b, h, t * BM, 0], do_bar.index(st),
                                    do_smem.index(st))


@gluon.jit(do_not_specialize=["H", "G", "Sq", "Sk", "lo", "hi"])   # one compile per config
def dkdv_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, L2, DELTA, H, G, Sq, Sk,
                scale, lo, hi, HAS_BAND: gl.constexpr, STAGES: gl.constexpr,
                num_warps: gl.constexpr):
    """Grid (cdiv(Sk, BN), B * Hkv).  q/do_desc: [B, H, Sq, D] blocks [1, 1, BM, D];
    k/v/dk/dv_desc: [B, Hkv, Sk, D] blocks [1, 1, BN, D]; L2 fp32 [B * H, 2, Sq]; DELTA
    fp32 [B * H * Sq].  Band masks through lo / hi (open: +-2^30)."""
    BM: gl.constexpr = q_desc.block_type.shape[2]
    D: gl.constexpr = q_desc.block_type.shape[3]
    BN: gl.constexpr = k_desc.block_type.shape[2]
    dt: gl.constexpr = q_desc.dtype
    gl.static_assert(BN == 16 * num_warps, "one wgmma row block of 16 per warp")
    t_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, BM, 16])      # [BN, BM]
    a_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[num_warps, 1],
                                                  instr_shape=[16, D, 16])       # [BN, D]
    pa_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_l, k_width=2)
    col_t: gl.constexpr = gl.SliceLayout(0, t_l)                                 # [BM]
    row_t: gl.constexpr = gl.SliceLayout(1, t_l)                                 # [BN]

    pid_n, b, hk, j0 = key_tile_program(H, G, BN)   # key tile pid_n of kv head hk, batch b

    k_smem = gl.allocate_shared_memory(dt, [1, 1, BN, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dt, [1, 1, BN, D], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dt, [STAGES, 1, 1, BM, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dt, [STAGES, 1, 1, BM, D], do_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for st in gl.static_range(STAGES):
        mbarrier.init(q_bar.index(st), count=1)
        mbarrier.init(do_bar.index(st), count=1)
    fence_async_shared()

    # query tiles [s0, s1), unmasked in [g0, g1); n_tot (head of the group, query tile)
    # pairs, flattened
    s0, g0, g1, s1, n_tot, n_div = key_tile_queries(j0, G, Sq, Sk, lo, hi, BM, BN, HAS_BAND)

    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, hk, j0, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [b, hk, j0, 0], kv_bar, v_smem)
    for st in gl.static_range(STAGES - 1):                  # prologue: the ring's first tiles
        if st < n_tot:
            _issue_qdo(q_desc, do_desc, q_smem, do_smem, q_bar, do_bar, b,
                       hk * G + st // n_div, s0 + st % n_div, st, BM)
    k2 = k_smem.reshape([BN, D])
    v2 = v_smem.reshape([BN, D])

    offs_mb = gl.arange(0, BM, layout=col_t)
    offs_n = j0 + gl.arange(0, BN, layout=row_t)
    zero_t = gl.zeros([BN, BM], gl.float32, layout=t_l)
    dk = warpgroup_mma_init(gl.zeros([BN, D], gl.float32, layout=a_l))
    dv = warpgroup_mma_init(gl.zeros([BN, D], gl.float32, layout=a_l))
    mbarrier.wait(kv_bar, 0)
    for it in range(0, n_tot):
        h = hk * G + it // n_div
        t = s0 + it % n_div
        stg = it % STAGES
        ph = (it // STAGES) & 1
        bh = (b * H + h).to(gl.int64)
        offs_m = t * BM + offs_mb
        inb_m = offs_m < Sq
        mx = gl.load(L2 + bh * (2 * Sq) + offs_m, mask=inb_m, other=float("inf"))    # [BM]
        ln2 = gl.load(L2 + bh * (2 * Sq) + Sq + offs_m, mask=inb_m, other=0.0)       # [BM]
        q2 = q_smem.index(stg).reshape([BM, D])
        do2 = do_smem.index(stg).reshape([BM, D])
        mbarrier.wait(q_bar.index(stg), ph)
        sT = warpgroup_mma(k2, q2.permute((1, 0)), zero_t, use_acc=False, is_async=True)
        mbarrier.wait(do_bar.index(stg), ph)
        dpT = warpgroup_mma(v2, do2.permute((1, 0)), zero_t, use_acc=False, is_async=True)
        # S^T and the previous tile's dV / dK products are done, dP^T may still run
        sT, dk, dv = warpgroup_mma_wait(1, deps=(sT, dk, dv))                  # [BN, BM]
        gl.thread_barrier()   # every warpgroup is past tile it - 1: refill its stage
        nxt = it + STAGES - 1
        if nxt < n_tot:
            _issue_qdo(q_desc, do_desc, q_smem, do_smem, q_bar, do_bar, b,
                       hk * G + nxt // n_div, s0 + nxt % n_div, nxt % STAGES, BM)
        # (loaded after the barrier: not held in registers across the products)
        dlt = gl.load(DELTA + bh * Sq + offs_m, mask=inb_m, other=0.0)               # [BM]
        sT = gl.fma(sT, scale, 0.0)       # (an fma: never contracted into the next line)
        pT = gl.exp2((sT - mx[None, :]) * LOG2E - ln2[None, :])                 # [BN, BM]
        if (t < g0) | (t >= g1):          # edge tiles: bounds and the band
            keep = (offs_n < Sk)[:, None] & inb_m[None, :]
            if HAS_BAND:
                dd = offs_n[:, None] - offs_m[None, :]
                keep = keep & (dd >= lo) & (dd <= hi)
            pT = gl.where(keep, pT, 0.0)
        p16 = gl.convert_layout(pT.to(dt), pa_l)
        dpT = warpgroup_mma_wait(0, deps=(dpT,))                                # [BN, BM]
        dsT = pT * (dpT - dlt[None, :])                                         # [BN, BM]
        ds16 = gl.convert_layout(dsT.to(dt), pa_l)
        dv = warpgroup_mma(p16, do2, dv, is_async=True)                          # [BN, D]
        dk = warpgroup_mma(ds16, q2, dk, is_async=True)                          # [BN, D]
    dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))

    for st in gl.static_range(STAGES):
        mbarrier.invalidate(q_bar.index(st))
        mbarrier.invalidate(do_bar.index(st))
    mbarrier.invalidate(kv_bar)
    gl.thread_barrier()               # every warpgroup's products have read K and V
    k2.store((dk * scale).to(dt))
    v2.store(dv.to(dt))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(dk_desc, [b, hk, j0, 0], k_smem)
    tma.async_copy_shared_to_global(dv_desc, [b, hk, j0, 0], v_smem)
    tma.store_wait(pendings=0)
