"""Gluon backward for Hopper (sm_90a): dK / dV and, optionally, dQ in one kernel of two
warpgroups (8 warps; no warp specialisation: with Triton 3.6's partitions ptxas keeps
the consumers at the kernel's 168-register cap and spills, docs/perf/LOG.md issue 15
helper 3).

Shape legend: B batch, H query heads, Hkv kv heads, G = H / Hkv, Sq / Sk queries / keys,
D head dim, BN = 128 the key tile of a program (64 per warpgroup), BM the query tile,
nq = cdiv(Sq, BM), STAGES the depth of the Q / dO ring.

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
empty rows, and log2(e) * log_norm; DELTA [B * H * Sq]; kernels.py module doc, "Row
statistics") kept per query row (2 registers a thread, not 16 as in the transposed
form).  dQ_j is added into the fp32 accumulator DQA [B * H, Sq, D] in a fixed order:
per (b, h, query tile) a counter in SEM; the program of key tile j waits until it reads
256 * rank (rank: j's place among the key tiles that see the query tile; ld.acquire,
every thread), loads, adds, stores, and each of its 256 threads adds 1 (atom.release).
The first key tile stores without loading (DQA needs no init), the last writes
dq = (acc + dQ_j) * scale in q's dtype instead.  A program waits only for programs of
lower key tiles of its own (b, kv head), launched before it: no deadlock; each dq element
is summed in key-tile order: bitwise repeatable, no float atomics.  dK is scaled by
``scale`` once at the end; dK / dV are stored by TMA (rows past Sk clipped).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from .bwd_kernel import query_tile_range
from .fwd_kernel import _cdiv_pos, _div_pos

__all__ = ["dkdvq_kernel", "dq_rank"]

LOG2E = gl.constexpr(1.4426950408889634)
THREADS = gl.constexpr(256)       # 8 warps: each adds 1 to a dQ counter per tile


@gluon.jit
def _spin_acquire(ptrs, target):
    """Per thread: spin until *ptr == target (ld.acquire.gpu) -> the value read."""
    return gl.inline_asm_elementwise(
        "{\n.reg .pred %p;\nSPIN${:uid}:\nld.acquire.gpu.global.b32 $0, [$1];\n"
        "setp.ne.s32 %p, $0, $2;\n@%p bra SPIN${:uid};\n}",
        "=r,l,r", [ptrs, target], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _add_release(ptrs):
    """Per thread: *ptr += 1 with release semantics (gpu scope) -> the old value."""
    return gl.inline_asm_elementwise("atom.release.gpu.global.add.s32 $0, [$1], 1;",
                                     "=r,l", [ptrs], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def dq_rank(jt, t, Sk, lo, hi, HAS_BAND: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr):
    """(rank, last): key tile jt's place among the key tiles whose programs visit query
    tile t (query_tile_range's rule: a contiguous run [jlo, jhi]), and whether it is
    the run's last."""
    nkv = (Sk + BN - 1) // BN
    if HAS_BAND:
        jlo = _div_pos(t * BM + lo, BN)                  # first j with j1 - lo > t * BM
        jhi = _cdiv_pos((t + 1) * BM + hi, BN) - 1       # last j with j0 - hi < (t+1) * BM
    else:
        jlo = 0
        jhi = nkv - 1
    jhi = gl.minimum(jhi, nkv - 1)
    return jt - jlo, jt == jhi


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
def _dq_add(dq_tok, DQ, DQA, SEM, bh, t, nq, rank, last, Sq, scale,
            q_l: gl.constexpr, D: gl.constexpr, BM: gl.constexpr):
    """Add this program's dQ partial [BM, D] (the async wgmma dq_tok) to query tile t
    of head bh in key-tile order (module doc); the last key tile writes dq instead."""
    c_l: gl.constexpr = gl.BlockedLayout([1], [32], [8], [0])         # one counter per thread
    sem = SEM + (bh * nq + t)
    zero = gl.full([THREADS], 0, gl.int32, layout=c_l)
    got = _spin_acquire(sem + zero, zero + rank * THREADS)                 # [256]
    offs_mb = gl.arange(0, BM, layout=gl.SliceLayout(1, q_l))              # [BM]
    offs_d = gl.arange(0, D, layout=gl.SliceLayout(0, q_l))                # [D]
    base = (bh.to(gl.int64) * Sq + t * BM) * D                             # tile's first row
    offs = offs_mb[:, None] * D + offs_d[None, :]                          # [BM, D] int32
    msk = (t * BM + offs_mb < Sq)[:, None]
    acc = gl.load(DQA + base + offs, mask=msk & (rank > 0), other=0.0, cache_modifier=".cg")
    dq = warpgroup_mma_wait(0, deps=(dq_tok,))
    acc = acc + dq                                                         # [BM, D]
    if last:
        gl.store(DQ + base + offs, (acc * scale).to(DQ.dtype.element_ty), mask=msk)
    else:
        gl.store(DQA + base + offs, acc, mask=msk, cache_modifier=".cg")
        _add_release(sem + got * 0)


@gluon.jit(do_not_specialize=["H", "G", "Sq", "Sk", "lo", "hi"])   # one compile per config
def dkdvq_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, L2, DELTA, DQ, DQA, SEM,
                 H, G, Sq, Sk, scale, lo, hi, HAS_BAND: gl.constexpr, WITH_DQ: gl.constexpr,
                 STAGES: gl.constexpr, num_warps: gl.constexpr):
    """Grid (cdiv(Sk, BN), B * Hkv), num_warps = 8.  q/do_desc: [B, H, Sq, D] blocks
    [1, 1, BM, D]; k/v/dk/dv_desc: [B, Hkv, Sk, D] blocks [1, 1, BN, D]; L2 fp32
    [B * H, 2, Sq]; DELTA fp32 [B * H * Sq]; WITH_DQ: DQ [B, H, Sq, D] (q's dtype,
    contiguous), DQA fp32 [B * H, Sq, D] scratch, SEM int32 [B * H * nq] zeros.  Band
    masks through lo / hi (open: +-2^30)."""
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
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)                                  # [BM]
    col_s: gl.constexpr = gl.SliceLayout(0, s_l)                                  # [BN]
    pds_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], dt)

    pid_n = gl.program_id(0)
    bhk = gl.program_id(1)
    Hkv = H // G
    b = bhk // Hkv
    hk = bhk % Hkv
    j0 = pid_n * BN

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

    if HAS_BAND:
        s0, g0, g1, s1 = query_tile_range(j0, Sq, Sk, lo, hi, BM, BN)
    else:
        s0 = 0
        g0 = 0
        g1 = gl.where(j0 + BN <= Sk, Sq // BM, 0)
        s1 = (Sq + BM - 1) // BM
    n_t = s1 - s0
    n_tot = G * n_t                   # (head of the group, query tile) pairs, flattened
    n_div = gl.maximum(n_t, 1)
    nq = (Sq + BM - 1) // BM

    mbarrier.expect(kv_bar, 2 * k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, hk, j0, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(v_desc, [b, hk, j0, 0], kv_bar, v_smem)
    for st in gl.static_range(STAGES - 1):                  # prologue: the ring's first tiles
        if st < n_tot:
            _issue_qdo(q_desc, do_desc, q_smem, do_smem, q_bar, do_bar, b,
                       hk * G + st // n_div, s0 + st % n_div, st, BM)
    k2 = k_smem.reshape([BN, D])
    v2 = v_smem.reshape([BN, D])

    offs_mb = gl.arange(0, BM, layout=row_s)
    dk = gl.zeros([BN, D], gl.float32, layout=a_l)
    dv = gl.zeros([BN, D], gl.float32, layout=a_l)
    mbarrier.wait(kv_bar, 0)
    for it in range(0, n_tot):
        h = hk * G + it // n_div
        t = s0 + it % n_div
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
                       hk * G + nxt // n_div, s0 + nxt % n_div, nxt % STAGES, BM)
        dv = warpgroup_mma(p_smem.permute((1, 0)), do2, dv, is_async=True)     # [BN, D]
        dp = warpgroup_mma_wait(1, deps=(dp,))                                  # [BM, BN]
        ds_smem.store((p * (dp - dlt[:, None])).to(dt))
        fence_async_shared()
        gl.thread_barrier()                                                     # dS stored
        dk = warpgroup_mma(ds_smem.permute((1, 0)), q2, dk, is_async=True)     # [BN, D]
        if WITH_DQ:
            dq_tok = warpgroup_mma(ds_smem, k2, gl.zeros([BM, D], gl.float32, layout=q_l),
                                   use_acc=False, is_async=True)                 # [BM, D]
            rank, last = dq_rank(pid_n, t, Sk, lo, hi, HAS_BAND, BM, BN)
            _dq_add(dq_tok, DQ, DQA, SEM, bh, t, nq, rank, last, Sq, scale, q_l, D, BM)
        # every product of the tile done (no accumulator in flight across the loop's back
        # edge: ptxas would serialise the wgmmas, C7515): P / dS / the stage are free
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
