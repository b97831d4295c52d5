"""The transposed consumer warpgroup of the warp-specialised Hopper backward with dQ inside
(bwd_ws_t_kernel; sm_90a): bwd_ws_parts.consumer's dQ schedule with the consumer's
keys as the wgmma rows, so that P^T and dS^T stay in registers as the A operand of the
dV / dK products (FA3's layout for the hdim-128 backward).

Per query tile, consumer w (key rows K_w, V_w [RN, D] in its own shared buffers):
    S^T  = K_w . Q^T                       [RN, BM]   A = K_w smem, B = Q^T (permuted view)
    dP^T = V_w . dO^T                      [RN, BM]
    P^T  = exp2((S^T * scale - m[q]) * log2 e - ln2[q])   the row statistics of the
           queries are per COLUMN now ([BM] vectors in SliceLayout(0, acc))
    dS^T = P^T * (dP^T - delta[q])         [RN, BM]
    dV_w += P^T . dO                       [RN, D]    A = P^T in registers (bf16 / fp16)
    dK_w += dS^T . Q                       [RN, D]    A = dS^T in registers
    dS^T -> shared (slot 2 * (it & 1) + w, [RN, BM]), "ds ready", then the column half w
    of the key tile's dQ partial from both consumers' dS (read permuted: [BM, RN]):
    dQ[:, cols_w] = dS_0 . K_0[:, cols_w] + dS_1 . K_1[:, cols_w]     [BM, DH]
staged in fp32 for the dQ writer (bwd_ws_dq_kernel._writer) as bwd_ws_parts.consumer
does.  Against that consumer: no P store (nor its fence and barrier) and no shared reads
of P / dS for dV / dK; dS is still stored once (the dQ products need both halves).  The
price: the queries' statistics are per column (16 of the BM columns a thread, 48
registers for max, log_norm and delta), so they are read from the producer's staged copy
where used (consumer_t's doc).

BM = 128 (D=64 only; FA3's hdim-64 tile): S^T / dP^T [64, 128] a consumer,
the dV / dK products of K-dim 128, dQ[:, cols_w] [128, DH] (two wgmma row blocks).  Two
changes keep its consumer loop near spill-free (1-3 STL / 11-16 LDL a tile, 237
registers): one staged exponent offset per query, c = log2(e) *
(max + log_norm) (P^T = exp2(S^T * scale * log2 e - c[q]): 32 registers, not 64), and
dP^T's accumulator starting at -delta[q] (dS^T = P^T * dP^T: no [BM] vector live beside
P^T, dP^T and P^T's 16-bit copy).  BM = 64 keeps the form above.

Shape legend: RN = 64 key rows per consumer, BM = 64 (or 128 at D=64) the query tile, D
head dim, DH = D / 2 the staged dQ columns, STAGES the depth of the Q / dO ring.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from .bwd_ws_parts import LOG2E, tile_of
from .fwd_masks import mod_scores

__all__ = ["consumer_t"]


@gluon.jit
def consumer_t(k_desc, v_desc, dk_desc, dv_desc, q_smem, do_smem, k_smem, v_smem, ds_smem,
               dqs, kv_bar, q_bar, do_bar, empty, dq_full, dq_empty, ds_bar, L2, DELTA, b,
               hk, H, G, Sq, Sk, j0, s0, g0, g1, n_div, off, n_tot, scale, lo, hi,
               HAS_BAND: gl.constexpr, STAGES: gl.constexpr, WG: gl.constexpr, st_smem,
               SLOPES=None, sl_b=0, cap=1.0, adiag=0, SOFTCAP: gl.constexpr = 0,
               ALIBI: gl.constexpr = False):
    """Key rows [j0 + WG * RN, j0 + (WG + 1) * RN): the whole query loop (module doc),
    the staged column half WG of each key tile's dQ partial, and the dK / dV epilogue
    through this consumer's own K / V buffers.  ds_smem [4, RN, BM] (dS^T, slot
    2 * parity + consumer); dqs [2, 1, BM / 8, 4, 2, DH] fp32, its rows interleaved
    within each group of 8 (launch.dqa_desc).  The queries' statistics are per column
    here (each thread holds 16 of the BM columns): the producer stages them, one copy
    for both consumers, in rows 4 * stage + (0, 1, 2) of st_smem [4 * STAGES, BM]
    (bwd_ws_parts.producer with FOLD = BM > 64), read where used (max / log_norm before
    the exponentials, delta before dS^T), so that no global load is on a tile's path.
    SOFTCAP / ALIBI: the score modifiers (bwd_ws_parts.consumer's: the keys are the rows
    of |i - j + adiag| here); with SOFTCAP P^T (1 - tanh^2) is formed as soon as P^T
    is, P^T kept in 16 bits for dV from there, and dS^T = (P^T (1 - tanh^2))
    (dP^T - delta)."""
    BM: gl.constexpr = q_smem.shape[3]
    D: gl.constexpr = q_smem.shape[4]
    RN: gl.constexpr = k_smem.shape[3]
    DH: gl.constexpr = dqs.shape[len(dqs.shape) - 1]
    dt: gl.constexpr = q_smem.dtype
    st_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                   instr_shape=[16, BM, 16])     # [RN, BM]
    a_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, D, 16])       # [RN, D]
    op_l: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=a_l, k_width=2)
    q_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, DH, 16])      # [BM, DH]
    key_s: gl.constexpr = gl.SliceLayout(1, st_l)                                # [RN]
    qry_s: gl.constexpr = gl.SliceLayout(0, st_l)                                # [BM]
    # BM 128 (32 of the columns a thread): one exponent offset per query, log2(e) * max +
    # log2(e) * log_norm, staged instead of the two (32 registers fewer where the
    # exponentials are; P = exp2(S^T * scale * log2 e - c[q]))
    FOLD: gl.constexpr = BM > 64

    r0 = j0 + WG * RN
    k_own = k_smem.index(WG)                                                     # [1, 1, RN, D]
    v_own = v_smem.index(WG)
    kb = kv_bar.index(WG)
    mbarrier.expect(kb, 2 * k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, hk, r0, 0], kb, k_own)
    tma.async_copy_global_to_shared(v_desc, [b, hk, r0, 0], kb, v_own)
    k2 = k_own.reshape([RN, D])                                                  # [RN, D]
    v2 = v_own.reshape([RN, D])                                                  # [RN, D]
    # shared row 8 g + 2 b0 + b1 holds row 8 g + 4 b1 + b0 (bwd_ws_parts)
    dq_own = dqs.index(WG).reshape([BM // 8, 4, 2, DH])              # fp32 [g, b0, b1, DH]
    # this consumer's column half of both key halves (B of the dQ products), [RN, DH]
    k0c = k_smem.index(0).reshape([RN, D]).slice(WG * DH, DH, dim=1)
    k1c = k_smem.index(1).reshape([RN, D]).slice(WG * DH, DH, dim=1)

    offs_mb = gl.arange(0, BM, layout=qry_s)
    zero_s = gl.zeros([RN, BM], gl.float32, layout=st_l)
    zero_q = gl.zeros([BM, DH], gl.float32, layout=q_l)
    dk = gl.zeros([RN, D], gl.float32, layout=a_l)
    dv = gl.zeros([RN, D], gl.float32, layout=a_l)
    h, t = tile_of(0, hk, G, s0, n_div, off)
    if SOFTCAP or ALIBI:
        inv_cap = 1.0 / cap
        if ALIBI:        # the keys' positions [RN]
            kj = r0 + gl.arange(0, RN, layout=key_s)
    mbarrier.wait(kb, 0)
    mbarrier.wait(kv_bar.index(1 - WG), 0)     # the other half's K (its dQ columns)
    for it in range(0, n_tot):
        stg = it % STAGES
        ph = (it // STAGES) & 1
        offs_m = t * BM + offs_mb                                                # [BM]
        sl = it & 1
        h_n, t_n = tile_of(gl.minimum(it + 1, n_tot - 1), hk, G, s0, n_div, off)
        if ALIBI:         # this tile's head's slope (raw units without softcap)
            slope = gl.load(SLOPES + b * sl_b + h)
            if not SOFTCAP:
                slope = slope / scale
        smx = st_smem.index(4 * stg)      # this tile's rows of the producer's copy
        sln = st_smem.index(4 * stg + 1)
        sdl = st_smem.index(4 * stg + 2)
        q2 = q_smem.index(stg).reshape([BM, D])                                  # [BM, D]
        do2 = do_smem.index(stg).reshape([BM, D])
        mbarrier.wait(q_bar.index(stg), ph)
        st = warpgroup_mma(k2, q2.permute((1, 0)), zero_s, use_acc=False,
                           is_async=True)                                        # [RN, BM]
        mbarrier.wait(do_bar.index(stg), ph)
        if FOLD:   # dP^T - delta[q]: the accumulator starts at -delta (no [BM] vector
            # live beside P^T, dP^T and P^T's bf16 / fp16 copy)
            ndl = zero_s - sdl.load(qry_s)[None, :]                              # [RN, BM]
            dpt = warpgroup_mma(v2, do2.permute((1, 0)), ndl, is_async=True)   # [RN, BM]
        else:
            dpt = warpgroup_mma(v2, do2.permute((1, 0)), zero_s, use_acc=False,
                                is_async=True)                                   # [RN, BM]
        st = warpgroup_mma_wait(1, deps=(st,))                                   # [RN, BM]
        if SOFTCAP:       # natural scores c tanh(..) (- ALiBi), and 1 - tanh^2
            if not ALIBI:
                kj = 0
                slope = 0.0
            st, dth = mod_scores(st, scale, inv_cap, cap, slope, kj, offs_m + adiag,
                                 SOFTCAP, ALIBI)
        elif ALIBI:       # on the raw products (kernels._raw_alibi), scaled below
            st, _ = mod_scores(st, scale, 0.0, 0.0, slope, kj, offs_m + adiag, 0, ALIBI)
        if FOLD:           # this tile's exponent offsets from shared memory
            cq = smx.load(qry_s)                                                 # [BM]
            if not SOFTCAP:
                st = gl.fma(st, scale, 0.0)   # S^T * scale, as below (then one fma)
            pt = gl.exp2(st * LOG2E - cq[None, :])                               # [RN, BM]
        else:
            mx = smx.load(qry_s)          # this tile's max and log_norm      [BM]
            ln2 = sln.load(qry_s)
            if not SOFTCAP:
                st = gl.fma(st, scale, 0.0)   # (an fma: never contracted into the next line)
            pt = gl.exp2((st - mx[None, :]) * LOG2E - ln2[None, :])              # [RN, BM]
        if SOFTCAP:       # through c tanh(x / c): dS^T = (P^T (1 - tanh^2)) (dP^T - delta);
            ptd = pt * dth    # P^T for dV in 16 bits from here (1 - tanh^2 dies now, and
            pt = pt.to(dt)    # no second fp32 tile lives across the edge tiles' branch)
        if (t < g0) | (t >= g1):          # edge tiles: bounds and the band
            offs_n = r0 + gl.arange(0, RN, layout=key_s)                         # [RN]
            keep = (offs_n < Sk)[:, None] & (offs_m < Sq)[None, :]
            if HAS_BAND:
                dd = offs_n[:, None] - offs_m[None, :]
                keep = keep & (dd >= lo) & (dd <= hi)
            if SOFTCAP:
                pt = gl.where(keep, pt, gl.zeros_like(pt))
                ptd = gl.where(keep, ptd, 0.0)
            else:
                pt = gl.where(keep, pt, 0.0)
        pt16 = gl.convert_layout(pt.to(dt), op_l)                                # [RN, BM]
        if SOFTCAP:
            pt = ptd
        dv = warpgroup_mma(pt16, do2, dv, is_async=True)                         # [RN, D]
        if not FOLD:      # ... and delta, once the max and log_norm are dead
            dlt = sdl.load(qry_s)                                                # [BM]
        dpt = warpgroup_mma_wait(1, deps=(dpt,))                                 # [RN, BM]
        if FOLD:
            dst = (pt * dpt).to(dt)                                              # [RN, BM]
        else:
            dst = (pt * (dpt - dlt[None, :])).to(dt)                             # [RN, BM]
        dst16 = gl.convert_layout(dst, op_l)                                     # [RN, BM]
        dk = warpgroup_mma(dst16, q2, dk, is_async=True)                         # [RN, D]
        ds_w = ds_smem.index(2 * sl + WG)                 # this tile's slot, [RN, BM]
        ds_w.store(dst)
        fence_async_shared()
        gl.thread_barrier()               # the partition's 4 warps stored dS^T
        mbarrier.arrive(ds_bar, count=1)                  # this half of dS is stored
        mbarrier.wait(ds_bar, it & 1)                     # ... and the other half
        ds0 = ds_smem.index(2 * sl).permute((1, 0))                              # [BM, RN]
        ds1 = ds_smem.index(2 * sl + 1).permute((1, 0))
        dq = warpgroup_mma(ds0, k0c, zero_q, use_acc=False, is_async=True)       # [BM, DH]
        dq = warpgroup_mma(ds1, k1c, dq, is_async=True)                          # [BM, DH]
        dk, dv, dq, pt16, dst16 = warpgroup_mma_wait(
            0, deps=(dk, dv, dq, pt16, dst16))            # the stage and dS^T free
        mbarrier.arrive(empty.index(stg), count=1)
        # the staged column half once the writer has read the previous one ("dq
        # empty"), then "dq full" (inline: a helper's scope splits ptxas's regions)
        mbarrier.wait(dq_empty.index(WG), (it & 1) ^ 1)
        # [BM, DH] -> [g, b1, b0, DH] -> [g, b0, b1, DH]
        dq_own.store(dq.reshape([BM // 8, 2, 4, DH]).permute((0, 2, 1, 3)))
        fence_async_shared()
        gl.thread_barrier()               # the partition's 4 warps staged dQ[:, cols_w]
        mbarrier.arrive(dq_full.index(WG), count=1)
        t = t_n
        if ALIBI:
            h = h_n

    # the other consumer's last dQ products (they read K_w) are done
    mbarrier.arrive(ds_bar, count=1)
    mbarrier.wait(ds_bar, n_tot & 1)
    # epilogue: through this consumer's own K / V buffers
    k2.store((dk * scale).to(dt))
    v2.store(dv.to(dt))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(dk_desc, [b, hk, r0, 0], k_own)
    tma.async_copy_shared_to_global(dv_desc, [b, hk, r0, 0], v_own)
    tma.store_wait(pendings=0)
