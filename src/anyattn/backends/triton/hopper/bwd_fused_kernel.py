"""Gluon backward for Hopper (sm_90a): dK / dV and, optionally, dQ in one kernel of two
warpgroups (8 warps; no warp specialisation: with Triton 3.6's partitions ptxas keeps
the consumers at the kernel's 168-register cap and spills, docs/perf/LOG.md issue 15
helper 3).

Shape legend: B batch, H query heads, Hkv kv heads, G = H / Hkv, Sq / Sk queries / keys,
D head dim, BN = 128 the key tile of a program (64 per warpgroup), BM the query tile,
nq = cdiv(Sq, BM), nkv = cdiv(Sk, BN), STAGES the depth of the Q / dO ring.

One program per (key tile, b * Hkv + hk).  K and V [BN, D] arrive once by TMA; for each
query head of the group and each query tile that sees this key tile (band ranges, the
portable kernels' rule) Q and dO [BM, D] arrive by TMA into a STAGES-deep ring, and

    S  = Q . K^T        [BM, BN]  wgmma (warpgroup w: key columns w * 64 ...)
    dP = dO . V^T       [BM, BN]  wgmma
    P  = exp2((fma(S, scale, 0) - max) * log2 e - log_norm2)     (0 where masked)
    dS = P * (dP - delta)
    P, dS -> shared [BM, BN] (q's dtype)
    dV += P^T . dO      [BN, D]   wgmma, P^T from shared (transposed A)
    dK += dS^T . Q      [BN, D]   wgmma
    dQ_j = dS . K       [BM, D]   wgmma (WITH_DQ; warpgroup w: columns w * D / 2 ...)

with the row statistics of the backward preprocess (L2 [B * H, 2, Sq]: max, +inf on
empty rows, and log2(e) * log_norm2; DELTA [B * H * Sq]; kernels.py module doc, "Row
statistics") kept per query row (2 registers a thread, not 16 as in the transposed
form).

dQ (WITH_DQ) is summed over the key tiles in a FIXED order per (b, h, query tile), not
with float atomics: the fp32 accumulator DQA [B * H, Sq, D] and a counter per (b, h,
query tile) in SEM.  The adder of rank r waits until the counter reads r (ld.acquire,
every thread), then one thread issues a bulk tensor copy (rank 0) or a bulk tensor
reduce-add (cp.reduce.async.bulk.tensor, rank > 0) of the partial staged in shared
memory; the counter is released (+1, red.release) only once that copy is complete, one
tile later, so the add is off the tensor cores' path.  The last adder instead loads DQA,
adds its partial in registers and writes dq = acc * scale in q's dtype.  The order
(dq_rank, ORDER):

    ORDER 1, no band: key tile j visits its query tiles rotated, starting at
      o_j = j * nq // nkv; at tile t the adders come in the order of their step
      (t - o_j) mod nq (ties: higher j first).  In steady state the previous adder of
      a tile got there nq / nkv steps earlier: no waiting.
    ORDER 1, a band: natural order; the adders of tile t come nearest the diagonal
      first (descending j: their steps t - s0_j ascend).
    ORDER 0: ascending j (a program waits only for programs launched before it).

With ORDER 1 a program may wait for a program of its (b, kv head) launched after it:
deadlock-free when all cdiv(Sk, BN) programs of one (b, kv head) are co-resident (CTAs
are dispatched in launch order; the launcher takes ORDER 0 when cdiv(Sk, BN) exceeds
the SMs).  Each dq element is summed in a fixed order: bitwise repeatable.  A spin that
lasts about a second traps (a launch error instead of a hang).  dK is scaled by
``scale`` once at the end; dK / dV are stored by TMA (rows past Sk clipped).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from .bwd_kernel import key_tile_program, key_tile_queries
from .fwd_kernel import _cdiv_pos, _div_pos

__all__ = ["dkdvq_kernel", "dq_rank", "visit_offset"]

LOG2E = gl.constexpr(1.4426950408889634)
THREADS = gl.constexpr(256)       # 8 warps
SPIN_LIMIT = 1 << 22              # polls (~1 s) before a wait for a dQ turn traps
_SPIN_ASM = gl.constexpr(
    "{\n.reg .pred %p;\n.reg .u32 %n;\nmov.u32 %n, 0;\nSPIN${:uid}:\n"
    "ld.acquire.gpu.global.b32 $0, [$1];\nsetp.ne.s32 %p, $0, $2;\n"
    "@!%p bra DONE${:uid};\nadd.u32 %n, %n, 1;\n"
    f"setp.lt.u32 %p, %n, {SPIN_LIMIT};\n"
    "@%p bra SPIN${:uid};\ntrap;\nDONE${:uid}:\nfence.proxy.async.global;\n}")


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """cp.reduce.async.bulk.tensor .add of shared ``src`` into the block of
    ``tensor_desc`` at ``coord`` (one thread issues it; a bulk group like a TMA store:
    tma.store_wait waits for its reads, _bulk_wait_all for its writes)."""
    from triton._C.libtriton import ir

    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD,
                                              tensor_desc.handle, coord, src.handle)


@gluon.jit
def _spin_acquire(ptrs, target):
    """Per thread: spin until *ptr == target (ld.acquire.gpu; traps after SPIN_LIMIT
    polls), then fence.proxy.async (the bulk copies that follow see what was acquired)
    -> the value read."""
    return gl.inline_asm_elementwise(_SPIN_ASM, "=r,l,r", [ptrs, target], dtype=gl.int32,
                                     is_pure=False, pack=1)


@gluon.jit
def _bulk_wait_all(ptrs):
    """Per thread: wait until this thread's bulk copies are complete (writes included:
    cp.async.bulk.wait_group 0), then fence.proxy.async.global (what they wrote is seen by
    later acquires / copies).  One thread then adds 1 to *ptr with release semantics
    (after a CTA / warp barrier: _release)."""
    return gl.inline_asm_elementwise(
        "cp.async.bulk.wait_group 0;\nfence.proxy.async.global;\nmov.u32 $0, 0;",
        "=r,l", [ptrs], dtype=gl.int32, is_pure=False, pack=1)


def _release_asm(who: str) -> str:
    """PTX: the thread whose ``who`` reads 0 adds 1 to *$1 (red.release.gpu); $0 = 0."""
    return ("{\n.reg .pred %p;\n.reg .u32 %t;\n"
            f"mov.u32 %t, {who};\nsetp.eq.u32 %p, %t, 0;\n"
            "@%p red.release.gpu.global.add.s32 [$1], 1;\nmov.u32 $0, 0;\n}")


RELEASE_CTA = gl.constexpr(_release_asm("%tid.x"))     # thread 0 of the CTA
RELEASE_WARP = gl.constexpr(_release_asm("%laneid"))   # lane 0 of each warp


@gluon.jit
def _release(ptrs, WHO: gl.constexpr):
    """*ptr += 1 (red.release.gpu) by thread 0 of the CTA (WHO = RELEASE_CTA) or lane 0 of
    each warp (RELEASE_WARP: the one-warp dQ writer of bwd_ws_dq_kernel); the others
    nothing."""
    return gl.inline_asm_elementwise(WHO, "=r,l", [ptrs], dtype=gl.int32, is_pure=False,
                                     pack=1)


@gluon.jit
def _add_partial(dqa_desc, src, row, t, rank, BM: gl.constexpr, col: gl.constexpr = 0,
                 IL: gl.constexpr = False):
    """The bulk add of one staged partial into accumulator rows [row, t * BM ...] from
    column ``col`` on: a bulk tensor store for the first adder (rank 0), else a bulk
    tensor reduce-add.  IL: dqa_desc is launch.dqa_desc's interleaved 5-D view (rows in
    groups of 8)."""
    if IL:
        if rank == 0:
            tma.async_copy_shared_to_global(dqa_desc, [row, t * (BM // 8), 0, 0, col], src)
        else:
            _tma_reduce_add(dqa_desc, [row, t * (BM // 8), 0, 0, col], src)
    else:
        if rank == 0:
            tma.async_copy_shared_to_global(dqa_desc, [row, t * BM, col], src)
        else:
            _tma_reduce_add(dqa_desc, [row, t * BM, col], src)


@gluon.jit
def visit_offset(jt, nq, nkv, HAS_BAND: gl.constexpr, ORDER):
    """Where key tile jt's program starts its loop over its query tiles (an index into
    its range): ORDER 1 without a band rotates by jt * nq // nkv, else 0."""
    if HAS_BAND:
        off = 0
    else:
        off = gl.where(ORDER == 1, (jt * nq) // nkv, 0)
    return off


@gluon.jit
def dq_rank(jt, t, Sk, nq, lo, hi, HAS_BAND: gl.constexpr, ORDER, BM: gl.constexpr,
            BN: gl.constexpr):
    """(rank, last): key tile jt's place in the order in which the key tiles whose
    programs visit query tile t (query_tile_range's rule: a contiguous run [jlo, jhi])
    add their dQ partials (module doc), and whether it is the last."""
    nkv = (Sk + BN - 1) // BN
    if HAS_BAND:
        jlo = _div_pos(t * BM + lo, BN)                  # first j with j1 - lo > t * BM
        jhi = _cdiv_pos((t + 1) * BM + hi, BN) - 1       # last j with j0 - hi < (t+1) * BM
        jhi = gl.minimum(jhi, nkv - 1)
        rank = gl.where(ORDER == 1, jhi - jt, jt - jlo)  # steps t - s0_j ascend as j falls
        last = gl.where(ORDER == 1, jt == jlo, jt == jhi)
    else:
        # rotated: j <= J(t) got there at step t - o_j, the others at t - o_j + nq
        big_j = gl.minimum(((t + 1) * nkv - 1) // nq, nkv - 1)
        rot = gl.where(jt <= big_j, big_j - jt, big_j + nkv - jt)
        rank = gl.where(ORDER == 1, rot, jt)
        last = rank == nkv - 1
    return rank, last


@gluon.jit
def _issue_qdo(q_desc, do_desc, q_smem, do_smem, q_bar, do_bar, b, h, t, st,
               BM: gl.constexpr):
    """TMA of query tile t of head h (Q and dO [BM, D]) into ring stage st."""
    mbarrier.expect(q_bar.index(st), q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [b, h, t * BM, 0], q_bar.index(st), q_smem.index(st))
    mbarrier.expect(do_bar.index(st), do_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(do_desc, [b, h, t * BM, 0], do_bar.index(st),
                                    do_smem.index(st))


@gluon.jit
def _dq_last(dq_smem, DQ, DQA, bh, t, rank, Sq, scale, D: gl.constexpr, BM: gl.constexpr):
    """The last adder of query tile t of head bh: dq = (DQA + staged partial) * scale in
    q's dtype, half the rows at a time (few registers: dK / dV stay live); DQA is not
    read when rank is 0 (the only adder)."""
    RB: gl.constexpr = BM // 2
    TC: gl.constexpr = D // 4                                              # threads along D
    f_l: gl.constexpr = gl.BlockedLayout([1, 4], [32 // TC, TC], [8, 1], [1, 0])  # [RB, D]
    offs_r = gl.arange(0, RB, layout=gl.SliceLayout(1, f_l))               # [RB]
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, f_l))                # [D]
    base = (bh.to(gl.int64) * Sq + t * BM) * D                             # tile's first row
    for half in gl.static_range(2):
        rows = t * BM + half * RB + offs_r                                 # [RB]
        offs = (half * RB + offs_r)[:, None] * D + offs_d[None, :]         # [RB, D] int32
        msk = (rows < Sq)[:, None]
        acc = gl.load(DQA + base + offs, mask=msk & (rank > 0), other=0.0,
                      cache_modifier=".cg")
        acc = acc + dq_smem.slice(half * RB, RB, 0).load(f_l)              # [RB, D]
        gl.store(DQ + base + offs, (acc * scale).to(DQ.dtype.element_ty), mask=msk)


@gluon.jit(do_not_specialize=["H", "G", "Sq", "Sk", "lo", "hi", "ORDER"])  # one compile per config
def dkdvq_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dqa_desc, L2, DELTA, DQ,
                 DQA, SEM, H, G, Sq, Sk, scale, lo, hi, ORDER, HAS_BAND: gl.constexpr,
                 WITH_DQ: gl.constexpr, STAGES: gl.constexpr, DEFER: gl.constexpr,
                 num_warps: gl.constexpr):
    """Grid (cdiv(Sk, BN), B * Hkv), num_warps = 8.  q/do_desc: [B, H, Sq, D] blocks
    [1, 1, BM, D]; k/v/dk/dv_desc: [B, Hkv, Sk, D] blocks [1, 1, BN, D]; L2 fp32
    [B * H, 2, Sq]; DELTA fp32 [B * H * Sq]; WITH_DQ: DQ [B, H, Sq, D] (q's dtype,
    contiguous), DQA fp32 [B * H, Sq, D] scratch (no init) and dqa_desc over it (blocks
    [1, BM, D]), SEM int32 [B * H * nq] zeros, ORDER the adds' order, DEFER the turn
    wait and the bulk add issued at the next tile's start (module doc).  Band masks
    through lo / hi (open: +-2^30)."""
    gl.static_assert(num_warps == 8, "two warpgroups")
    BM: gl.constexpr = q_desc.block_type.shape[2]
    D: gl.constexpr = q_desc.block_type.shape[3]
    BN: gl.constexpr = k_desc.block_type.shape[2]
    dt: gl.constexpr = q_desc.dtype
    gl.static_assert(BN == 128, "64 key rows per warpgroup")
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, BN // 2, 16])  # [BM, BN]
    a_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[8, 1],
                                                  instr_shape=[16, D, 16])        # [BN, D]
    q_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2],
                                                  instr_shape=[16, D // 2, 16])   # [BM, D]
    c_l: gl.constexpr = gl.BlockedLayout([1], [32], [8], [0])     # [THREADS]: one a thread
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)                                  # [BM]
    col_s: gl.constexpr = gl.SliceLayout(0, s_l)                                  # [BN]
    pds_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], dt)

    pid_n, b, hk, j0 = key_tile_program(H, G, BN)   # key tile pid_n of kv head hk, batch b

    k_smem = gl.allocate_shared_memory(dt, [1, 1, BN, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dt, [1, 1, BN, D], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dt, [STAGES, 1, 1, BM, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dt, [STAGES, 1, 1, BM, D], do_desc.layout)
    p_smem = gl.allocate_shared_memory(dt, [BM, BN], pds_l)
    ds_smem = gl.allocate_shared_memory(dt, [BM, BN], pds_l)
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
    nq = (Sq + BM - 1) // BM
    nkv = (Sk + BN - 1) // BN
    off = visit_offset(pid_n, nq, nkv, HAS_BAND, ORDER)      # rotation of the tile loop

    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, hk, j0, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [b, hk, j0, 0], kv_bar, v_smem)
    for st in gl.static_range(STAGES - 1):                  # prologue: the ring's first tiles
        if st < n_tot:
            _issue_qdo(q_desc, do_desc, q_smem, do_smem, q_bar, do_bar, b,
                       hk * G + st // n_div, s0 + (st % n_div + off) % n_div, st, BM)
    k2 = k_smem.reshape([BN, D])
    v2 = v_smem.reshape([BN, D])
    if WITH_DQ:   # the staged dQ partial, read by the bulk copy / reduce-add
        dq_smem = gl.allocate_shared_memory(gl.float32, [1, BM, D], dqa_desc.layout)
        dq2 = dq_smem.reshape([BM, D])
    zero_c = gl.full([THREADS], 0, gl.int32, layout=c_l)
    pend = SEM + zero_c               # [THREADS]: the counter of the copy in flight
    pending = False
    stg_sem = pend                    # DEFER: the staged partial's counter, rank, place
    stg_rank = 0
    stg_bh = 0
    stg_t = 0
    staged = False

    offs_mb = gl.arange(0, BM, layout=row_s)
    dk = gl.zeros([BN, D], gl.float32, layout=a_l)
    dv = gl.zeros([BN, D], gl.float32, layout=a_l)
    mbarrier.wait(kv_bar, 0)
    for it in range(0, n_tot):
        h = hk * G + it // n_div
        t = s0 + (it % n_div + off) % n_div
        stg = it % STAGES
        ph = (it // STAGES) & 1
        bh = b * H + h
        bh64 = bh.to(gl.int64)
        offs_m = t * BM + offs_mb
        inb_m = offs_m < Sq
        mx = gl.load(L2 + bh64 * (2 * Sq) + offs_m, mask=inb_m, other=float("inf"))  # [BM]
        ln2 = gl.load(L2 + bh64 * (2 * Sq) + Sq + offs_m, mask=inb_m, other=0.0)     # [BM]
        dlt = gl.load(DELTA + bh64 * Sq + offs_m, mask=inb_m, other=0.0)             # [BM]
        q2 = q_smem.index(stg).reshape([BM, D])
        do2 = do_smem.index(stg).reshape([BM, D])
        mbarrier.wait(q_bar.index(stg), ph)
        s = warpgroup_mma(q2, k2.permute((1, 0)), gl.zeros([BM, BN], gl.float32, layout=s_l),
                          use_acc=False, is_async=True)
        mbarrier.wait(do_bar.index(stg), ph)
        dp = warpgroup_mma(do2, v2.permute((1, 0)), gl.zeros([BM, BN], gl.float32, layout=s_l),
                           use_acc=False, is_async=True)
        if WITH_DQ and DEFER:
            if staged:    # the previous tile's partial: its turn, its bulk add (S, dP run)
                _spin_acquire(stg_sem, zero_c + stg_rank)
                _add_partial(dqa_desc, dq_smem, stg_bh, stg_t, stg_rank, BM)
                pend = stg_sem
                pending = True
                staged = False
        s = warpgroup_mma_wait(1, deps=(s,))                                   # [BM, BN]
        s = gl.fma(s, scale, 0.0)         # (an fma: never contracted into the next line)
        p = gl.exp2((s - mx[:, None]) * LOG2E - ln2[:, None])                   # [BM, BN]
        if (t < g0) | (t >= g1):          # edge tiles: bounds and the band
            offs_n = j0 + gl.arange(0, BN, layout=col_s)
            keep = inb_m[:, None] & (offs_n < Sk)[None, :]
            if HAS_BAND:
                dd = offs_n[None, :] - offs_m[:, None]
                keep = keep & (dd >= lo) & (dd <= hi)
            p = gl.where(keep, p, 0.0)
        p_smem.store(p.to(dt))
        fence_async_shared()
        gl.thread_barrier()   # P stored; every warp is past tile it - 1: refill its stage
        nxt = it + STAGES - 1
        if nxt < n_tot:
            _issue_qdo(q_desc, do_desc, q_smem, do_smem, q_bar, do_bar, b,
                       hk * G + nxt // n_div, s0 + (nxt % n_div + off) % n_div,
                       nxt % STAGES, BM)
        dv = warpgroup_mma(p_smem.permute((1, 0)), do2, dv, is_async=True)     # [BN, D]
        dp = warpgroup_mma_wait(1, deps=(dp,))                                  # [BM, BN]
        ds_smem.store((p * (dp - dlt[:, None])).to(dt))
        fence_async_shared()
        if WITH_DQ and DEFER:
            if pending:   # this tile's bulk add complete (dq_smem free after the barrier)
                _bulk_wait_all(pend)
        gl.thread_barrier()                                                     # dS stored
        dk = warpgroup_mma(ds_smem.permute((1, 0)), q2, dk, is_async=True)     # [BN, D]
        if WITH_DQ and DEFER:
            dq_tok = warpgroup_mma(ds_smem, k2, gl.zeros([BM, D], gl.float32, layout=q_l),
                                   use_acc=False, is_async=True)                 # [BM, D]
            if pending:   # ... and released (thread 0, after the barrier)
                _release(pend, RELEASE_CTA)
                pending = False
            rank, last = dq_rank(pid_n, t, Sk, nq, lo, hi, HAS_BAND, ORDER, BM, BN)
            sem = SEM + (bh * nq + t) + zero_c                                   # [THREADS]
            dq = warpgroup_mma_wait(0, deps=(dq_tok,))                           # [BM, D]
            dq2.store(dq)
            fence_async_shared()
            gl.thread_barrier()                                                  # staged
            if last:
                _spin_acquire(sem, zero_c + rank)
                _dq_last(dq2, DQ, DQA, bh, t, rank, Sq, scale, D, BM)
            else:         # added at the next tile's start
                stg_sem = sem
                stg_rank = rank
                stg_bh = bh
                stg_t = t
                staged = True
        if WITH_DQ and not DEFER:
            dq_tok = warpgroup_mma(ds_smem, k2, gl.zeros([BM, D], gl.float32, layout=q_l),
                                   use_acc=False, is_async=True)                 # [BM, D]
            rank, last = dq_rank(pid_n, t, Sk, nq, lo, hi, HAS_BAND, ORDER, BM, BN)
            sem = SEM + (bh * nq + t) + zero_c                                   # [THREADS]
            # the previous tile's copy: complete -> its counter released, dq_smem free
            if pending:
                _bulk_wait_all(pend)
                gl.thread_barrier()
                _release(pend, RELEASE_CTA)
            dq = warpgroup_mma_wait(0, deps=(dq_tok,))                           # [BM, D]
            dq2.store(dq)
            fence_async_shared()
            gl.thread_barrier()                                                  # staged
            _spin_acquire(sem, zero_c + rank)
            if last:
                _dq_last(dq2, DQ, DQA, bh, t, rank, Sq, scale, D, BM)
                pending = False
            else:
                _add_partial(dqa_desc, dq_smem, bh, t, rank, BM)
                pend = sem
                pending = True
        # every product of the tile done (no accumulator in flight across the loop's back
        # edge: ptxas would serialise the wgmmas, C7515): P / dS / the stage are free
        dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))
    if WITH_DQ:
        if staged:
            _spin_acquire(stg_sem, zero_c + stg_rank)
            _add_partial(dqa_desc, dq_smem, stg_bh, stg_t, stg_rank, BM)
            pend = stg_sem
            pending = True
        if pending:
            _bulk_wait_all(pend)
            gl.thread_barrier()
            _release(pend, RELEASE_CTA)

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
