"""Warp-specialised Gluon backward for Hopper (sm_90a) with dQ inside: dK, dV and one dQ
partial per key tile in one kernel, the partials summed in a FIXED order by a dQ-writer
warp (no float atomics: bitwise repeatable).

Shape legend: B batch, H query heads, Hkv kv heads, G = H / Hkv, Sq / Sk queries / keys,
D head dim, RN = 64 key rows per consumer, BN = 2 * RN the key tile of a program, BM = 64
the query tile, DH = D / 2, nq = cdiv(Sq, BM), nkv = cdiv(Sk, BN), STAGES the depth of
the Q / dO ring.

One program per (key tile, b * Hkv + hk); ``gl.warp_specialize`` partitions:
  producer (1 warp): Q and dO [BM, D] of every (query head of the group, query tile) that
      sees the key tile by TMA into the ring, and each tile's row statistics (max,
      log2(e) * log_norm, delta) into shared memory beside them (bwd_ws_parts.producer);
  consumer w (2 x 4 warps, setmaxnreg CONSUMER_REGS; bwd_ws_parts.consumer with WITH_DQ):
      bwd_ws_kernel's loop over its own key rows K_w / V_w [RN, D] (S = Q.K_w^T,
      dP = dO.V_w^T, P, dS through shared [BM, RN] buffers, dV_w += P^T.dO,
      dK_w += dS^T.Q).  The consumers' dS halves meet in shared memory (double-buffered
      by tile parity, dS [2, 2, BM, RN]; an mbarrier "ds ready" that both consumers
      arrive on once their dS_w is stored), and consumer w computes the columns
      [w * DH, (w + 1) * DH) of the key tile's whole partial:
          dQ[:, cols_w] = dS_0 . K_0[:, cols_w] + dS_1 . K_1[:, cols_w]    [BM, DH]
      (two wgmmas in that order, both consumers alike), staged in its fp32 buffer DQS[w]
      (rows interleaved in groups of 8 as launch.dqa_desc's 5-D view orders them) once
      the writer has read the previous one ("dq empty"), then "dq full".  "ds ready" of
      tile it + 1 also says the other consumer's wgmmas of tile it (which read this
      consumer's dS slot) are done; one more phase after the loop guards K_w (the other
      consumer's last dQ product reads it) before the epilogue overwrites it with dK_w;
  writer (1 warp, WRITER_REGS): per tile waits "dq full", waits for the key tile's turn
      on the (b, h, query tile)'s counter in SEM, adds both halves into the fp32
      accumulator DQA by bulk tensor copies (rank 0: a store) or bulk tensor reduce-adds
      (disjoint columns: no order between them), frees the staging buffers once read and
      releases the counter (+1, red.release) once both adds are complete (LATE: a tile
      later).  The consumers never wait for a turn; only the writer does.

The order of the adds of query tile t: the key tiles in dq_turns.dq_rank's order (ORDER
1: rotated visits without a band, the diagonal first with one; ORDER 0: ascending).  A
writer may wait for a program launched after it (ORDER 1): deadlock-free when the nkv
programs of a (b, kv head) are co-resident (launch.dq_order); a spin that lasts about a
second traps.  dq = DQA * scale in q's dtype is a separate elementwise pass
(bwd_dq_convert).  dK is scaled by ``scale`` once at the end; dK / dV are stored by TMA
through the consumer's own K_w / V_w buffers (rows past Sk clipped); the numerics are
the portable backward's (kernels.py).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from .bwd_ws_parts import consumer, ws_barriers, producer, tile_of
from .dq_turns import (RELEASE_WARP, add_partial, bulk_wait_all, dq_rank, release,
                       spin_acquire, visit_offset)
from .tile_ranges import key_tile_program, key_tile_queries, key_tile_table

__all__ = ["dkdvq_ws_kernel"]


@gluon.jit
def _writer(dqa_desc, dqs, dq_full, dq_empty, SEM, NBH, b, hk, H, G, Sk, pid_n, s0, n_div,
            off, n_tot, nq, lo, hi, ORDER, HAS_BAND: gl.constexpr, BM: gl.constexpr,
            BN: gl.constexpr, RKc=None, nkv=0, ARRAY: gl.constexpr = False,
            LATE: gl.constexpr = False):
    """The fixed-order adds of the key tile's staged partial (module doc): its two
    staged buffers are the column halves of one partial (adds back to back after the
    key tile's turn, freed once read, the counter released once both are complete).
    ARRAY: the rank of this key tile in query tile t's order from the rank table (RKc:
    its column, row stride nkv).  dqa_desc / dqs are the interleaved 5-D forms
    (launch.dqa_desc).  LATE: a tile's adds are waited for (and its counter released)
    at the next tile, once that tile's first half is staged, not before the writer
    takes the next tile (HopperBwdConfig.late_release)."""
    c_l: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])                   # [32]
    zero_c = gl.full([32], 0, gl.int32, layout=c_l)
    prev0 = SEM + zero_c                                                        # [32]
    for it in range(0, n_tot):
        h, t = tile_of(it, hk, G, s0, n_div, off)
        bh = b * H + h
        if ARRAY:
            rank = gl.load(RKc + t * nkv)
        else:
            rank, last = dq_rank(pid_n, t, Sk, nq, lo, hi, HAS_BAND, ORDER, BM, BN)
        sem = SEM + (bh * nq + t) + zero_c                                      # [32]
        ph = it & 1
        DH: gl.constexpr = dqs.shape[len(dqs.shape) - 1]
        mbarrier.wait(dq_full.index(0), ph)
        if LATE:
            if it > 0:   # the previous tile's adds (issued a tile ago; the only ones
                # outstanding): complete -> its counter released
                bulk_wait_all(prev0)
                gl.thread_barrier()
                release(prev0, RELEASE_WARP)
        spin_acquire(sem, zero_c + rank)          # this key tile's turn
        add_partial(dqa_desc, dqs.index(0), bh, t, rank, BM, 0)
        mbarrier.wait(dq_full.index(1), ph)
        add_partial(dqa_desc, dqs.index(1), bh, t, rank, BM, DH)
        tma.store_wait(pendings=0)   # both staging buffers read
        gl.thread_barrier()
        mbarrier.arrive(dq_empty.index(0), count=1)
        mbarrier.arrive(dq_empty.index(1), count=1)
        if LATE:
            prev0 = sem
        else:
            bulk_wait_all(sem)      # both adds complete: the next adder may follow
            gl.thread_barrier()
            release(sem, RELEASE_WARP)
    if LATE:
        if n_tot > 0:     # the last tile's adds
            bulk_wait_all(prev0)
            gl.thread_barrier()
            release(prev0, RELEASE_WARP)


@gluon.jit(do_not_specialize=["NBH", "H", "G", "Sq", "Sk", "lo", "hi", "ORDER", "ct_b",
                               "ct_h", "rk_b", "rk_h", "siv_b", "skid_b", "skm_b", "skm_h",
                               "skm_q", "skm_k", "sl_b", "adiag"])  # one compile per config
def dkdvq_ws_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dqa_desc, L2, DELTA,
                    SEM, NBH, H, G, Sq, Sk, scale, lo, hi, ORDER, HAS_BAND: gl.constexpr,
                    STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                    WRITER_REGS: gl.constexpr, num_warps: gl.constexpr, CT=None, ct_b=None, ct_h=None, RK=None,
                    rk_b=None, rk_h=None, IV=None, KID=None, siv_b=None, skid_b=None,
                    KM=None, skm_b=None, skm_h=None, skm_q=None, skm_k=None,
                    ARRAY: gl.constexpr = False, DOCS: gl.constexpr = 0,
                    HAS_KEEP: gl.constexpr = False, LATE: gl.constexpr = False,
                    SLOPES=None, sl_b=None, cap=None, adiag=None, SOFTCAP: gl.constexpr = 0,
                    ALIBI: gl.constexpr = False):
    """Grid (nkv, B * Hkv), num_warps = 4 (consumer 0; the workers add 4 + 1 + 1).
    q/do_desc: [B, H, Sq, D] blocks [1, 1, BM, D]; k/v/dk/dv_desc: [B, Hkv, Sk, D] blocks
    [1, 1, RN, D]; dqa_desc: launch.dqa_desc's interleaved 5-D view of the fp32
    accumulator DQA [B * H, SqA, D] (no init), blocks [1, BM / 8, 4, 2, D / 2] (one
    partial per key tile, a column half per consumer); the staging buffers take its rows'
    order; L2 fp32 [B * H, 2, Sq]; DELTA fp32 [B * H * Sq]; SEM int32 [B * H * nq]
    zeros; NBH = B * H; ORDER the dQ adds' order (dq_turns module doc).  The producer
    stages each tile's row statistics in shared memory beside its Q / dO
    (bwd_ws_parts.producer), so no consumer waits on a global load.  Band masks through
    lo / hi (open: +-2^30).  ARRAY (Documents / KeepMask): the query tiles of each key
    tile and their visiting rotation from the column range table CT
    (tile_ranges.key_tile_table), the rank of key tile j in query tile t's add order from
    RK int32 [Bm, Hm, nq, nkv] ((b, kv head) strides rk_b / rk_h; launch.bwd_mask_tables:
    ordered by (visiting step, j), ORDER unused), the edge tiles masked as in
    bwd_ws_kernel (IV ... skm_k: its arguments; None without ARRAY).  LATE: the writer
    waits for a tile's adds and releases its counter a tile later (_writer).  SLOPES ...
    ALIBI: the score modifiers, as bwd_ws_kernel's."""
    gl.static_assert(not (ARRAY and (SOFTCAP or ALIBI)), "score modifiers without array masks")
    gl.static_assert(num_warps == 4, "consumer 0 is one warpgroup")
    BM: gl.constexpr = q_desc.block_type.shape[2]
    D: gl.constexpr = q_desc.block_type.shape[3]
    RN: gl.constexpr = k_desc.block_type.shape[2]
    BN: gl.constexpr = 2 * RN
    dt: gl.constexpr = q_desc.dtype
    gl.static_assert(RN == 64, "64 key rows per consumer warpgroup")
    gl.static_assert(BM == 64, "64 query rows per tile (one wgmma row block per warp)")
    DQC: gl.constexpr = dqa_desc.block_type.shape[4]
    gl.static_assert(DQC * 2 == D, "dQ accumulator blocks of D / 2 columns")
    pds_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, RN], dt)

    pid_n, b, hk, j0 = key_tile_program(H, G, BN)   # key tile pid_n of kv head hk, batch b

    k_smem = gl.allocate_shared_memory(dt, [2, 1, 1, RN, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dt, [2, 1, 1, RN, D], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dt, [STAGES, 1, 1, BM, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dt, [STAGES, 1, 1, BM, D], do_desc.layout)
    p_smem = gl.allocate_shared_memory(dt, [2, BM, RN], pds_l)
    ds_smem = gl.allocate_shared_memory(dt, [4, BM, RN], pds_l)   # 2 slots, both halves
    # [consumer, 1, row group g, b0, b1, DQC]: row 8 g + 4 b1 + b0
    dqs = gl.allocate_shared_memory(gl.float32, [2, 1, BM // 8, 4, 2, DQC], dqa_desc.layout)
    # row 4 * stage + (0 max, 1 log2(e) * log_norm, 2 delta; 3 unused: shapes are powers
    # of 2) [BM]
    st_smem = gl.allocate_shared_memory(
        gl.float32, [4 * STAGES, BM],
        gl.SwizzledSharedLayout(1, 1, 1, order=[0]))   # (rank 1: rows indexed to [BM])
    kv_bar, dq_full, dq_empty, ds_bar, q_bar, do_bar, empty = ws_barriers(STAGES, True)

    # query tiles [s0, s1), unmasked in [g0, g1); n_tot (head of the group, query tile)
    # pairs, flattened; the query tiles of each head visited from index off on
    if ARRAY:     # the table's ranges and order
        s0, g0, g1, s1, n_tot, n_div, off = key_tile_table(CT, b, hk, pid_n, ct_b, ct_h, G)
    else:
        s0, g0, g1, s1, n_tot, n_div = key_tile_queries(j0, G, Sq, Sk, lo, hi, BM, BN,
                                                        HAS_BAND)
    nq = (Sq + BM - 1) // BM
    nkv = (Sk + BN - 1) // BN
    if ARRAY:     # the rank table, the array masks
        RKc = RK + b * rk_b + hk * rk_h + pid_n       # this key tile's column of ranks
        IVb = IV + b * siv_b
        KIDb = KID + b * skid_b
        KMb = KM + b.to(gl.int64) * skm_b
        nkv_rk = nkv
    else:
        off = visit_offset(pid_n, nq, nkv, HAS_BAND, ORDER)
        RKc, IVb, KIDb, KMb, skm_h, skm_q, skm_k, nkv_rk = 0, 0, 0, 0, 0, 0, 0, 0  # (not read)
    gl.warp_specialize(   # bwd_ws_parts' partitions with dq, the writer
        [(consumer, (k_desc, v_desc, dk_desc, dv_desc, q_smem, do_smem, k_smem, v_smem,
                     p_smem, ds_smem, dqs, kv_bar, q_bar, do_bar, empty, dq_full, dq_empty,
                     ds_bar, L2, DELTA, b, hk, H, G, Sq, Sk, j0, s0, g0, g1, n_div, off,
                     n_tot, scale, lo, hi, HAS_BAND, STAGES, 0, True, IVb, KIDb, KMb, skm_h,
                     skm_q, skm_k, ARRAY, DOCS, HAS_KEEP, st_smem, SLOPES, sl_b, cap, adiag,
                     SOFTCAP, ALIBI)),
         (consumer, (k_desc, v_desc, dk_desc, dv_desc, q_smem, do_smem, k_smem, v_smem,
                     p_smem, ds_smem, dqs, kv_bar, q_bar, do_bar, empty, dq_full, dq_empty,
                     ds_bar, L2, DELTA, b, hk, H, G, Sq, Sk, j0, s0, g0, g1, n_div, off,
                     n_tot, scale, lo, hi, HAS_BAND, STAGES, 1, True, IVb, KIDb, KMb, skm_h,
                     skm_q, skm_k, ARRAY, DOCS, HAS_KEEP, st_smem, SLOPES, sl_b, cap, adiag,
                     SOFTCAP, ALIBI)),
         (producer, (q_desc, do_desc, q_smem, do_smem, q_bar, do_bar, empty, b, hk, G, s0,
                     n_div, off, n_tot, STAGES, BM, st_smem, L2, DELTA, H, Sq, True)),
         (_writer, (dqa_desc, dqs, dq_full, dq_empty, SEM, NBH, b, hk, H, G, Sk, pid_n, s0,
                    n_div, off, n_tot, nq, lo, hi, ORDER, HAS_BAND, BM, BN, RKc, nkv_rk,
                    ARRAY, LATE))],
        [4, 1, 1], [CONSUMER_REGS, 24, WRITER_REGS])
