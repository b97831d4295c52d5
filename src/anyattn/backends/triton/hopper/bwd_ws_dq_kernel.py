"""Warp-specialised Gluon backward for Hopper (sm_90a) with dQ inside: dK, dV and the
per-key-tile dQ partials in one kernel, the partials summed in a FIXED order by a
dQ-writer warp (no float atomics: bitwise repeatable).

Shape legend: B batch, H query heads, Hkv kv heads, G = H / Hkv, Sq / Sk queries / keys,
D head dim, RN = 64 key rows per consumer, BN = 2 * RN the key tile of a program, BM = 64
the query tile, nq = cdiv(Sq, BM), nkv = cdiv(Sk, BN), STAGES the depth of the Q / dO ring.

One program per (key tile, b * Hkv + hk); ``gl.warp_specialize`` partitions:
  producer (1 warp): Q and dO [BM, D] of every (query head of the group, query tile) that
      sees the key tile by TMA into the ring (bwd_ws_kernel's producer, in this kernel's
      visiting order);
  consumer w (2 x 4 warps, setmaxnreg CONSUMER_REGS): bwd_ws_kernel's loop over its own
      key rows K_w / V_w [RN, D] (S = Q.K_w^T, dP = dO.V_w^T, P, dS through its own shared
      [BM, RN] buffers, dV_w += P^T.dO, dK_w += dS^T.Q), and besides
          dQ_w = dS_w . K_w    [BM, D]   wgmma, both operands from shared memory
      issued after dK and waited at the loop's back edge with dK / dV; then dQ_w goes to
      its fp32 staging buffer DQS[w] [BM, D] (once the writer has read the previous one:
      "dq empty") and "dq full" is signalled;
  writer (1 warp, WRITER_REGS): per tile, per consumer w = 0, 1: waits "dq full", waits
      for the key tile's turn on the (b, h, query tile)'s counter in SEM (w = 0 only),
      adds the partial into the fp32 accumulator DQA [B * H, Sq, D] by a bulk tensor copy
      (rank 0, w = 0: a store) or a bulk tensor reduce-add, waits until it is complete
      (writes too: the next add of the same rows must come after it), signals "dq empty";
      after w = 1 it releases the counter (+1, red.release).  The consumers never wait
      for a turn; only the writer does.  CHAINS 2: two accumulators and counters, one
      per consumer (DQA [2 * B * H, Sq, D]), so the two adds of a tile go back to back
      and their completion is waited (and the counters released) a tile later;
      dq = (DQA_0 + DQA_1) * scale (bwd_dq_convert).
  SPLIT (one partial per key tile, FA3's layout): the consumers' dS halves meet in shared
      memory (double-buffered by tile parity, dS [2, 2, BM, RN]; an mbarrier "ds ready"
      that both consumers arrive on once their dS_w is stored), and consumer w computes
      the columns [w * DH, (w + 1) * DH) of the key tile's whole partial (DH = D / 2):
          dQ[:, cols_w] = dS_0 . K_0[:, cols_w] + dS_1 . K_1[:, cols_w]    [BM, DH]
      (two wgmmas in that order, both consumers alike), staged in DQS[w] [BM, DH]; the
      writer adds both halves (disjoint columns: no order between them) back to back after
      the key tile's turn, frees the staging buffers once read and releases the counter
      once both adds are complete.  "ds ready" of tile it + 1 also says the other
      consumer's wgmmas of tile it (which read this consumer's dS slot) are done; one
      more phase after the loop guards K_w (the other consumer's last dQ product reads
      it) before the epilogue overwrites it with dK_w.
  LAG (with SPLIT): the dQ products of tile it - 1 are issued in tile it (the last
      tile's after the loop), so a consumer waits for the other's dS of the previous
      tile, not of this one (a tile of slack instead of lockstep); dS gets three slots
      (it % 3), and the one wait, on tile it - 1's "ds ready" just before dS of tile it is
      stored, also says that slot's last readers (the dQ products of tile it - 3, issued
      in tile it - 2) are done.  Tile 0 issues a discarded product (nothing staged).

The order of the adds of query tile t: the key tiles in bwd_fused_kernel.dq_rank's order
(ORDER 1: rotated visits without a band, the diagonal first with one; ORDER 0:
ascending), consumer 0 before consumer 1 within a key tile.  A writer may wait for a
program launched after it (ORDER 1): deadlock-free when the nkv programs of a (b, kv
head) are co-resident (launch.dq_order), as in bwd_fused_kernel; a spin that lasts about
a second traps.  dq = DQA * scale in q's dtype is a separate elementwise pass
(launch.backward_ws_dq).  dK is scaled by ``scale`` once at the end; dK / dV are stored
by TMA through the consumer's own K_w / V_w buffers (rows past Sk clipped); the numerics
are the portable backward's (kernels.py).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from .bwd_fused_kernel import _spin_acquire, _tma_reduce_add, dq_rank, visit_offset
from .bwd_kernel import key_tile_program, key_tile_queries
from .bwd_ws_kernel import _row_stats

__all__ = ["dkdvq_ws_kernel"]

LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _tile_of(it, hk, G, s0, n_div, off):
    """The it-th (query head, query tile) pair of the flattened loop: heads outer, the
    query tiles of each head visited from index ``off`` on (rotated)."""
    return hk * G + it // n_div, s0 + (it % n_div + off) % n_div


@gluon.jit
def _bulk_wait_all(ptrs):
    """Per thread: wait until this thread's bulk copies are complete (writes included),
    then fence.proxy.async.global (what they wrote is seen by later acquires / copies)."""
    return gl.inline_asm_elementwise(
        "cp.async.bulk.wait_group 0;\nfence.proxy.async.global;\nmov.u32 $0, 0;",
        "=r,l", [ptrs], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _release_lane0(ptrs):
    """Lane 0 of the (writer) warp: *ptr += 1 (red.release.gpu); the others nothing."""
    return gl.inline_asm_elementwise(
        "{\n.reg .pred %p;\n.reg .u32 %t;\nmov.u32 %t, %laneid;\nsetp.eq.u32 %p, %t, 0;\n"
        "@%p red.release.gpu.global.add.s32 [$1], 1;\nmov.u32 $0, 0;\n}",
        "=r,l", [ptrs], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _producer(q_desc, do_desc, q_smem, do_smem, q_bar, do_bar, empty, b, hk, G, s0, n_div,
              off, n_tot, STAGES: gl.constexpr, BM: gl.constexpr):
    """Q and dO of tile it into stage it % STAGES once both consumers released that
    stage's previous tile (the first pass waits on the phase before init: free)."""
    for it in range(0, n_tot):
        st = it % STAGES
        h, t = _tile_of(it, hk, G, s0, n_div, off)
        mbarrier.wait(empty.index(st), ((it // STAGES) & 1) ^ 1)
        mbarrier.expect(q_bar.index(st), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, t * BM, 0], q_bar.index(st),
                                        q_smem.index(st))
        mbarrier.expect(do_bar.index(st), do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [b, h, t * BM, 0], do_bar.index(st),
                                        do_smem.index(st))


@gluon.jit
def _add_partial(dqa_desc, src, row, t, rank, BM: gl.constexpr, col: gl.constexpr = 0):
    """The bulk add of one staged partial into accumulator rows [row, t * BM ...] from
    column ``col`` on: a bulk tensor store for the first adder (rank 0), else a bulk
    tensor reduce-add."""
    if rank == 0:
        tma.async_copy_shared_to_global(dqa_desc, [row, t * BM, col], src)
    else:
        _tma_reduce_add(dqa_desc, [row, t * BM, col], src)


@gluon.jit
def _writer(dqa_desc, dqs, dq_full, dq_empty, SEM, NBH, b, hk, H, G, Sk, pid_n, s0, n_div,
            off, n_tot, nq, lo, hi, ORDER, HAS_BAND: gl.constexpr, BM: gl.constexpr,
            BN: gl.constexpr, CHAINS: gl.constexpr, DIAG: gl.constexpr,
            SPLIT: gl.constexpr):
    """The fixed-order adds of both consumers' staged partials (module doc).  CHAINS 1:
    one accumulator, consumer 1's add after consumer 0's is complete; CHAINS 2: consumer
    w's partials into accumulator w (rows w * NBH ...) with a counter of its own, both
    issued back to back, their completion waited (and the counters released) only at the
    next tile, after its partials are staged.  DIAG (timing only, dq left unwritten):
    no adds, the staging buffers freed as soon as they are full.  SPLIT: the two staged
    buffers are the column halves of one partial (adds back to back, freed once read,
    the counter released once both are complete)."""
    c_l: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])                   # [32]
    zero_c = gl.full([32], 0, gl.int32, layout=c_l)
    prev0 = SEM + zero_c                                                        # [32]
    prev1 = prev0
    for it in range(0, n_tot):
        h, t = _tile_of(it, hk, G, s0, n_div, off)
        bh = b * H + h
        rank, last = dq_rank(pid_n, t, Sk, nq, lo, hi, HAS_BAND, ORDER, BM, BN)
        sem = SEM + (bh * nq + t) + zero_c                                      # [32]
        ph = it & 1
        if DIAG:
            for w in gl.static_range(2):
                mbarrier.wait(dq_full.index(w), ph)
                mbarrier.arrive(dq_empty.index(w), count=1)
        elif SPLIT:
            DH: gl.constexpr = dqs.shape[3]
            mbarrier.wait(dq_full.index(0), ph)
            _spin_acquire(sem, zero_c + rank)          # this key tile's turn
            _add_partial(dqa_desc, dqs.index(0), bh, t, rank, BM, 0)
            mbarrier.wait(dq_full.index(1), ph)
            _add_partial(dqa_desc, dqs.index(1), bh, t, rank, BM, DH)
            tma.store_wait(pendings=0)   # both staging buffers read
            gl.thread_barrier()
            mbarrier.arrive(dq_empty.index(0), count=1)
            mbarrier.arrive(dq_empty.index(1), count=1)
            _bulk_wait_all(sem)          # both adds complete: the next adder may follow
            gl.thread_barrier()
            _release_lane0(sem)
        elif CHAINS == 1:
            for w in gl.static_range(2):
                mbarrier.wait(dq_full.index(w), ph)
                if w == 0:
                    _spin_acquire(sem, zero_c + rank)      # this key tile's turn
                    _add_partial(dqa_desc, dqs.index(w), bh, t, rank, BM)
                else:
                    _add_partial(dqa_desc, dqs.index(w), bh, t, 1, BM)
                _bulk_wait_all(sem)      # complete: the next add of these rows follows it
                gl.thread_barrier()      # (every lane past the issuing lane's wait)
                mbarrier.arrive(dq_empty.index(w), count=1)
            _release_lane0(sem)
        else:
            sem1 = sem + NBH * nq                                               # [32]
            mbarrier.wait(dq_full.index(0), ph)
            if it > 0:   # the previous tile's adds (a tile ago): complete -> released
                _bulk_wait_all(prev0)
                gl.thread_barrier()
                _release_lane0(prev0)
                _release_lane0(prev1)
            _spin_acquire(sem, zero_c + rank)
            _add_partial(dqa_desc, dqs.index(0), bh, t, rank, BM)
            mbarrier.wait(dq_full.index(1), ph)
            _spin_acquire(sem1, zero_c + rank)
            _add_partial(dqa_desc, dqs.index(1), NBH + bh, t, rank, BM)
            tma.store_wait(pendings=0)   # both staging buffers read
            gl.thread_barrier()
            mbarrier.arrive(dq_empty.index(0), count=1)
            mbarrier.arrive(dq_empty.index(1), count=1)
            prev0 = sem
            prev1 = sem1
    if (CHAINS == 2) & (not DIAG):
        if n_tot > 0:
            _bulk_wait_all(prev0)
            gl.thread_barrier()
            _release_lane0(prev0)
            _release_lane0(prev1)


@gluon.jit
def _consumer(k_desc, v_desc, dk_desc, dv_desc, q_smem, do_smem, k_smem, v_smem, p_smem,
              ds_smem, dqs, kv_bar, q_bar, do_bar, empty, dq_full, dq_empty, ds_bar, L2, DELTA,
              b, hk, H, G, Sq, Sk, j0, s0, g0, g1, n_div, off, n_tot, scale, lo, hi,
              HAS_BAND: gl.constexpr, STAGES: gl.constexpr, WG: gl.constexpr,
              PREFETCH: gl.constexpr, SPLIT: gl.constexpr, LAG: gl.constexpr):
    """Key rows [j0 + WG * RN, j0 + (WG + 1) * RN): the whole query loop, the staged dQ
    partials (SPLIT: the column half WG of the key tile's one partial) and the dK / dV
    epilogue (module doc)."""
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
    DQC: gl.constexpr = dqs.shape[3]                     # D, or DH = D / 2 with SPLIT
    dq_own = dqs.index(WG).reshape([BM, DQC])                                    # fp32 [BM, DQC]
    q_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, DQC, 16])     # [BM, DQC]
    if SPLIT:   # this consumer's column half of both key halves, [RN, DH] each
        k0c = k_smem.index(0).reshape([RN, D]).slice(WG * DQC, DQC, dim=1)
        k1c = k_smem.index(1).reshape([RN, D]).slice(WG * DQC, DQC, dim=1)

    offs_mb = gl.arange(0, BM, layout=row_s)
    zero_s = gl.zeros([BM, RN], gl.float32, layout=s_l)
    zero_q = gl.zeros([BM, DQC], gl.float32, layout=q_l)
    dk = gl.zeros([RN, D], gl.float32, layout=a_l)
    dv = gl.zeros([RN, D], gl.float32, layout=a_l)
    h, t = _tile_of(0, hk, G, s0, n_div, off)
    if PREFETCH:
        mx, ln2, dlt = _row_stats(L2, DELTA, b * H + h, t, Sq, offs_mb, BM)
    mbarrier.wait(kb, 0)
    if SPLIT:
        mbarrier.wait(kv_bar.index(1 - WG), 0)     # the other half's K (its dQ columns)
    for it in range(0, n_tot):
        stg = it % STAGES
        ph = (it // STAGES) & 1
        offs_m = t * BM + offs_mb
        q2 = q_smem.index(stg).reshape([BM, D])
        do2 = do_smem.index(stg).reshape([BM, D])
        mbarrier.wait(q_bar.index(stg), ph)
        s = warpgroup_mma(q2, kT, zero_s, use_acc=False, is_async=True)        # [BM, RN]
        mbarrier.wait(do_bar.index(stg), ph)
        dp = warpgroup_mma(do2, vT, zero_s, use_acc=False, is_async=True)      # [BM, RN]
        if PREFETCH:  # the next tile's statistics (the last tile's again at the end),
            # loaded while S / dP run
            h_n, t_n = _tile_of(gl.minimum(it + 1, n_tot - 1), hk, G, s0, n_div, off)
            mx_n, ln2_n, dlt_n = _row_stats(L2, DELTA, b * H + h_n, t_n, Sq, offs_mb, BM)
        s = warpgroup_mma_wait(1, deps=(s,))                                   # [BM, RN]
        if not PREFETCH:   # this tile's row statistics, loaded once S is done
            mx, ln2, dlt = _row_stats(L2, DELTA, b * H + h, t, Sq, offs_mb, BM)
        s = gl.fma(s, scale, 0.0)         # (an fma: never contracted into the next line)
        p = gl.exp2((s - mx[:, None]) * LOG2E - ln2[:, None])                   # [BM, RN]
        if (t < g0) | (t >= g1):          # edge tiles: bounds and the band
            offs_n = r0 + gl.arange(0, RN, layout=col_s)
            keep = (offs_m < Sq)[:, None] & (offs_n < Sk)[None, :]
            if HAS_BAND:
                dd = offs_n[None, :] - offs_m[:, None]
                keep = keep & (dd >= lo) & (dd <= hi)
            p = gl.where(keep, p, 0.0)
        p_own.store(p.to(dt))
        fence_async_shared()
        gl.thread_barrier()               # the partition's 4 warps stored P
        dv = warpgroup_mma(p_own.permute((1, 0)), do2, dv, is_async=True)      # [RN, D]
        dp = warpgroup_mma_wait(1, deps=(dp,))                                  # [BM, RN]
        if SPLIT:
            if LAG:
                sl = it % 3
                if it > 0:   # the other's dS of tile it - 1 stored: this slot is free
                    mbarrier.wait(ds_bar, (it - 1) & 1)
            else:
                sl = it & 1
            ds_w = ds_smem.index(2 * sl + WG)             # this tile's slot
        else:
            ds_w = ds_own
        ds_w.store((p * (dp - dlt[:, None])).to(dt))
        fence_async_shared()
        gl.thread_barrier()               # ... and dS
        if SPLIT:
            mbarrier.arrive(ds_bar, count=1)              # this half of dS is stored
        dk = warpgroup_mma(ds_w.permute((1, 0)), q2, dk, is_async=True)        # [RN, D]
        if SPLIT:
            if LAG:   # tile it - 1's partial (both halves stored: waited above)
                sp = (it + 2) % 3
            else:
                mbarrier.wait(ds_bar, it & 1)             # ... and the other half
                sp = sl
            ds0 = ds_smem.index(2 * sp)
            ds1 = ds_smem.index(2 * sp + 1)
            dq = warpgroup_mma(ds0, k0c, zero_q, use_acc=False, is_async=True)  # [BM, DH]
            dq = warpgroup_mma(ds1, k1c, dq, is_async=True)                    # [BM, DH]
        else:
            dq = warpgroup_mma(ds_w, k2, zero_q, use_acc=False, is_async=True)    # [BM, D]
        dk, dv, dq = warpgroup_mma_wait(0, deps=(dk, dv, dq))  # P / dS / the stage free
        mbarrier.arrive(empty.index(stg), count=1)
        if LAG:
            if it > 0:    # tile it - 1's column half
                mbarrier.wait(dq_empty.index(WG), ((it - 1) & 1) ^ 1)
                dq_own.store(dq)
                fence_async_shared()
                gl.thread_barrier()
                mbarrier.arrive(dq_full.index(WG), count=1)
        else:
            mbarrier.wait(dq_empty.index(WG), (it & 1) ^ 1)   # the writer read the last one
            dq_own.store(dq)
            fence_async_shared()
            gl.thread_barrier()               # the partition's 4 warps staged dQ_w
            mbarrier.arrive(dq_full.index(WG), count=1)
        if PREFETCH:
            mx, ln2, dlt = mx_n, ln2_n, dlt_n
            t = t_n
        else:
            h, t = _tile_of(it + 1, hk, G, s0, n_div, off)

    if LAG:
        if n_tot > 0:     # the last tile's column half
            mbarrier.wait(ds_bar, (n_tot - 1) & 1)
            sp = (n_tot - 1) % 3
            dq = warpgroup_mma(ds_smem.index(2 * sp), k0c, zero_q, use_acc=False,
                               is_async=True)                                    # [BM, DH]
            dq = warpgroup_mma(ds_smem.index(2 * sp + 1), k1c, dq, is_async=True)
            dq = warpgroup_mma_wait(0, deps=(dq,))
            mbarrier.wait(dq_empty.index(WG), ((n_tot - 1) & 1) ^ 1)
            dq_own.store(dq)
            fence_async_shared()
            gl.thread_barrier()
            mbarrier.arrive(dq_full.index(WG), count=1)
    if SPLIT:   # the other consumer's last dQ products (they read K_w) are done
        mbarrier.arrive(ds_bar, count=1)
        mbarrier.wait(ds_bar, n_tot & 1)
    # epilogue: through this consumer's own K / V buffers (SPLIT: no wgmma reads them now)
    k2.store((dk * scale).to(dt))
    v_own.reshape([RN, D]).store(dv.to(dt))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(dk_desc, [b, hk, r0, 0], k_own)
    tma.async_copy_shared_to_global(dv_desc, [b, hk, r0, 0], v_own)
    tma.store_wait(pendings=0)


@gluon.jit(do_not_specialize=["NBH", "H", "G", "Sq", "Sk", "lo", "hi", "ORDER"])  # one compile per config
def dkdvq_ws_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dqa_desc, L2, DELTA,
                    SEM, NBH, H, G, Sq, Sk, scale, lo, hi, ORDER, HAS_BAND: gl.constexpr,
                    STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                    WRITER_REGS: gl.constexpr, PREFETCH: gl.constexpr, CHAINS: gl.constexpr,
                    DIAG: gl.constexpr, SPLIT: gl.constexpr, LAG: gl.constexpr,
                    num_warps: gl.constexpr):
    """Grid (nkv, B * Hkv), num_warps = 4 (consumer 0; the workers add 4 + 1 + 1).
    q/do_desc: [B, H, Sq, D] blocks [1, 1, BM, D]; k/v/dk/dv_desc: [B, Hkv, Sk, D] blocks
    [1, 1, RN, D]; dqa_desc: fp32 DQA [CHAINS * B * H, Sq, D] (no init) blocks [1, BM, D]
    ([1, BM, D / 2] with SPLIT: one partial per key tile, CHAINS 1; LAG: SPLIT's products
    a tile late); L2 fp32 [B * H, 2, Sq]; DELTA fp32 [B * H * Sq]; SEM int32
    [CHAINS * B * H * nq] zeros; NBH = B * H; ORDER the dQ adds' order (module doc);
    CHAINS / DIAG: _writer's; PREFETCH: the next tile's row statistics loaded under the
    current S / dP (else each tile's own once S is done: fewer registers held).  Band
    masks through lo / hi (open: +-2^30)."""
    gl.static_assert(num_warps == 4, "consumer 0 is one warpgroup")
    BM: gl.constexpr = q_desc.block_type.shape[2]
    D: gl.constexpr = q_desc.block_type.shape[3]
    RN: gl.constexpr = k_desc.block_type.shape[2]
    BN: gl.constexpr = 2 * RN
    dt: gl.constexpr = q_desc.dtype
    gl.static_assert(RN == 64, "64 key rows per consumer warpgroup")
    gl.static_assert(BM == 64, "64 query rows per tile (one wgmma row block per warp)")
    DQC: gl.constexpr = dqa_desc.block_type.shape[2]
    if SPLIT:
        gl.static_assert(DQC * 2 == D, "SPLIT: dQ accumulator blocks of D / 2 columns")
        gl.static_assert(CHAINS == 1, "SPLIT: one accumulator")
    else:
        gl.static_assert(DQC == D, "dQ accumulator blocks of D columns")
    gl.static_assert(SPLIT or not LAG, "LAG is an option of SPLIT")
    pds_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, RN], dt)

    pid_n, b, hk, j0 = key_tile_program(H, G, BN)   # key tile pid_n of kv head hk, batch b

    k_smem = gl.allocate_shared_memory(dt, [2, 1, 1, RN, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dt, [2, 1, 1, RN, D], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dt, [STAGES, 1, 1, BM, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dt, [STAGES, 1, 1, BM, D], do_desc.layout)
    p_smem = gl.allocate_shared_memory(dt, [2, BM, RN], pds_l)
    NDS: gl.constexpr = (6 if LAG else 4) if SPLIT else 2    # SPLIT: 2 (LAG 3) slots
    ds_smem = gl.allocate_shared_memory(dt, [NDS, BM, RN], pds_l)
    dqs = gl.allocate_shared_memory(gl.float32, [2, 1, BM, DQC], dqa_desc.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    ds_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for w in gl.static_range(2):
        mbarrier.init(kv_bar.index(w), count=1)
        mbarrier.init(dq_full.index(w), count=1)
        mbarrier.init(dq_empty.index(w), count=1)
    for st in gl.static_range(STAGES):
        mbarrier.init(q_bar.index(st), count=1)
        mbarrier.init(do_bar.index(st), count=1)
        mbarrier.init(empty.index(st), count=2)          # one arrive per consumer
    if SPLIT:
        mbarrier.init(ds_bar, count=2)                   # one arrive per consumer
    fence_async_shared()

    # query tiles [s0, s1), unmasked in [g0, g1); n_tot (head of the group, query tile)
    # pairs, flattened; the query tiles of each head visited from index off on
    s0, g0, g1, s1, n_tot, n_div = key_tile_queries(j0, G, Sq, Sk, lo, hi, BM, BN, HAS_BAND)
    nq = (Sq + BM - 1) // BM
    nkv = (Sk + BN - 1) // BN
    off = visit_offset(pid_n, nq, nkv, HAS_BAND, ORDER)

    gl.warp_specialize(
        [(_consumer, (k_desc, v_desc, dk_desc, dv_desc, q_smem, do_smem, k_smem, v_smem,
                      p_smem, ds_smem, dqs, kv_bar, q_bar, do_bar, empty, dq_full, dq_empty,
                      ds_bar, L2, DELTA, b, hk, H, G, Sq, Sk, j0, s0, g0, g1, n_div, off,
                      n_tot, scale, lo, hi, HAS_BAND, STAGES, 0, PREFETCH, SPLIT, LAG)),
         (_consumer, (k_desc, v_desc, dk_desc, dv_desc, q_smem, do_smem, k_smem, v_smem,
                      p_smem, ds_smem, dqs, kv_bar, q_bar, do_bar, empty, dq_full, dq_empty,
                      ds_bar, L2, DELTA, b, hk, H, G, Sq, Sk, j0, s0, g0, g1, n_div, off,
                      n_tot, scale, lo, hi, HAS_BAND, STAGES, 1, PREFETCH, SPLIT, LAG)),
         (_producer, (q_desc, do_desc, q_smem, do_smem, q_bar, do_bar, empty, b, hk, G, s0,
                      n_div, off, n_tot, STAGES, BM)),
         (_writer, (dqa_desc, dqs, dq_full, dq_empty, SEM, NBH, b, hk, H, G, Sk, pid_n, s0,
                    n_div, off, n_tot, nq, lo, hi, ORDER, HAS_BAND, BM, BN, CHAINS, DIAG,
                    SPLIT))],
        [4, 1, 1], [CONSUMER_REGS, 24, WRITER_REGS])
