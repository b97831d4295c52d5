"""Warp-specialised Gluon backward for Hopper (sm_90a): dK / dV, and optionally dQ, in
one kernel.

Shape legend: B batch, H query heads, Hkv kv heads, G = H / Hkv, Sq / Sk queries / keys,
D head dim, DH = D / 2, RN = 64 key rows per consumer warpgroup, BN = 2 * RN the key tile
of a program, BM the query tile, nq = cdiv(Sq, BM), STAGES the depth of the Q / dO ring.

One program per (key tile, b * Hkv + hk); ``gl.warp_specialize`` partitions:
  producer (1 warp, few registers): K, V [RN, D] per consumer (and, with dQ, K's two
      column halves [BN, DH]) once by TMA, then for every (query head of the group, query
      tile) that sees the key tile (band ranges, the portable kernels' rule) Q and dO
      [BM, D] into a STAGES-deep ring on "q ready" / "do ready" mbarriers, each stage
      refilled once both consumers released it ("empty", count 2);
  consumer w (w = 0: the default partition, w = 1: a worker; 4 warps each) owns key rows
      [j0 + w * RN, j0 + (w + 1) * RN) and per tile computes (FA3's transposed form)
          S^T  = K_w . Q^T     [RN, BM]   wgmma, both operands from shared memory
          dP^T = V_w . dO^T    [RN, BM]   wgmma
          P^T  = exp2((fma(S^T, scale, 0) - max) * log2 e - log_norm2)   (0 where masked)
          dS^T = P^T * (dP^T - delta)
          dV_w += P^T . dO     [RN, D]    wgmma, P^T from registers
          dK_w += dS^T . Q     [RN, D]    wgmma, dS^T from registers
      with the backward preprocess's row statistics (L2 [B * H, 2, Sq]: max, +inf on
      empty rows, and log2(e) * log_norm; DELTA [B * H * Sq]), and with WITH_DQ:
          dS^T (bf16 / fp16) -> shared [BN, BM] (both consumers' rows; "ds ready", count 2)
          dQ_w = dS . K[:, w * DH : (w + 1) * DH]   [BM, DH]   wgmma, dS from shared
      added into the fp32 accumulator DQA [B * H, Sq, D] in a fixed order: per (b, h,
      query tile, half) a counter in SEM; the program of key tile j waits until it reads
      128 * rank (rank: j's place among the key tiles that see the query tile; ld.acquire),
      loads, adds, stores, and each of its 128 threads adds 1 (atom.release).  The last
      key tile of the query tile writes dq = (acc + dQ_w) * scale in q's dtype instead.
      A program only ever waits for programs of lower key tiles (launched before it), so
      the wait cannot deadlock, and every dq element is summed in key-tile order: bitwise
      repeatable, no float atomics.
dK is scaled by ``scale`` once at the end; dK / dV are stored by TMA per consumer (rows
past Sk clipped).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_init, warpgroup_mma_wait)

from .bwd_kernel import query_tile_range
from .fwd_kernel import _cdiv_pos, _div_pos

__all__ = ["dkdvq_ws_kernel", "CONSUMER_THREADS"]

LOG2E = gl.constexpr(1.4426950408889634)
#: threads of one consumer partition (4 warps): each adds 1 to a dQ counter per tile
CONSUMER_THREADS = gl.constexpr(128)


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
def _producer(q_desc, do_desc, k_desc, v_desc, kh_desc, q_smem, do_smem, k_smem, v_smem,
              kh_smem, kv_bar, q_bar, do_bar, empty, b, hk, G, j0, s0, n_div, n_tot,
              WITH_DQ: gl.constexpr, STAGES: gl.constexpr):
    """K / V (and K's column halves) once, then the ring of (head, query tile) pairs."""
    RN: gl.constexpr = k_desc.block_type.shape[2]
    BM: gl.constexpr = q_desc.block_type.shape[2]
    KV_BYTES: gl.constexpr = 4 * k_desc.block_type.nbytes
    KH_BYTES: gl.constexpr = 2 * kh_desc.block_type.nbytes if WITH_DQ else 0
    mbarrier.expect(kv_bar, KV_BYTES + KH_BYTES)
    for w in gl.static_range(2):
        tma.async_copy_global_to_shared(k_desc, [b, hk, j0 + w * RN, 0], kv_bar, k_smem.index(w))
        tma.async_copy_global_to_shared(v_desc, [b, hk, j0 + w * RN, 0], kv_bar, v_smem.index(w))
    if WITH_DQ:
        DH: gl.constexpr = kh_desc.block_type.shape[3]
        for w in gl.static_range(2):
            tma.async_copy_global_to_shared(kh_desc, [b, hk, j0, w * DH], kv_bar,
                                            kh_smem.index(w))
    for it in range(0, n_tot):
        st = it % STAGES
        mbarrier.wait(empty.index(st), ((it // STAGES) & 1) ^ 1)   # first pass: free
        h = hk * G + it // n_div
        t = s0 + it % n_div
        mbarrier.expect(q_bar.index(st), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, t * BM, 0], q_bar.index(st),
                                        q_smem.index(st))
        mbarrier.expect(do_bar.index(st), do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [b, h, t * BM, 0], do_bar.index(st),
                                        do_smem.index(st))


@gluon.jit
def _dq_add(dq_tok, DQ, DQA, SEM, bh, t, nq, rank, last, Sq, scale, w,
            q_l: gl.constexpr, D: gl.constexpr, BM: gl.constexpr):
    """Add this consumer's dQ partial [BM, DH] (the async wgmma dq_tok) to query tile t of
    head bh in key-tile order (module doc); the last key tile writes dq instead."""
    DH: gl.constexpr = D // 2
    c_l: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])        # one counter per thread
    sem = SEM + ((bh * nq + t) * 2 + w)
    one = gl.full([CONSUMER_THREADS], 0, gl.int32, layout=c_l)
    got = _spin_acquire(sem + one, one + rank * CONSUMER_THREADS)          # [128]
    offs_m = t * BM + gl.arange(0, BM, layout=gl.SliceLayout(1, q_l))      # [BM]
    offs_d = w * DH + gl.arange(0, DH, layout=gl.SliceLayout(0, q_l))      # [DH]
    row = (bh.to(gl.int64) * Sq + offs_m) * D
    msk = (offs_m < Sq)[:, None]
    ptr = DQA + row[:, None] + offs_d[None, :]                             # [BM, DH]
    acc = gl.load(ptr, mask=msk & (rank > 0), other=0.0, cache_modifier=".cg")
    dq = warpgroup_mma_wait(0, deps=(dq_tok,))
    acc = acc + dq                                                         # [BM, DH]
    if last:
        gl.store(DQ + row[:, None] + offs_d[None, :], (acc * scale).to(DQ.dtype.element_ty),
                 mask=msk)
    else:
        gl.store(ptr, acc, mask=msk, cache_modifier=".cg")
        _add_release(sem + got * 0)


@gluon.jit
def _consumer(q_desc, k_desc, dk_desc, dv_desc, q_smem, do_smem, k_smem, v_smem, kh_smem,
              p_smem, ds_smem, kv_bar, q_bar, do_bar, empty, ds_bar, L2, DELTA, DQ, DQA, SEM,
              b, hk, H, G, Sq, Sk, j0, s0, g0, g1, n_div, n_tot, scale, lo, hi,
              HAS_BAND: gl.constexpr, WITH_DQ: gl.constexpr, STAGES: gl.constexpr,
              W: gl.constexpr):
    """Key rows [j0 + W * RN, j0 + (W + 1) * RN): the loop over (head, query tile) pairs
    and the dK / dV epilogue."""
    BM: gl.constexpr = q_desc.block_type.shape[2]
    D: gl.constexpr = q_desc.block_type.shape[3]
    RN: gl.constexpr = k_desc.block_type.shape[2]
    BN: gl.constexpr = 2 * RN
    DH: gl.constexpr = D // 2
    dt: gl.constexpr = q_desc.dtype
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, RN, 16])      # [BM, RN]
    a_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, D, 16])       # [RN, D]
    q_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, DH, 16])      # [BM, DH]
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)                                 # [BM]
    col_s: gl.constexpr = gl.SliceLayout(0, s_l)                                 # [RN]

    nq = (Sq + BM - 1) // BM
    jt = j0 // BN                       # this program's key tile
    k2 = k_smem.index(W).reshape([RN, D])
    v2 = v_smem.index(W).reshape([RN, D])
    p_own = p_smem.index(W)                                                      # [BM, RN]
    offs_mb = gl.arange(0, BM, layout=row_s)
    offs_n = j0 + W * RN + gl.arange(0, RN, layout=col_s)
    zero_s = gl.zeros([BM, RN], gl.float32, layout=s_l)
    dk = warpgroup_mma_init(gl.zeros([RN, D], gl.float32, layout=a_l))
    dv = warpgroup_mma_init(gl.zeros([RN, D], gl.float32, layout=a_l))
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
        s = warpgroup_mma(q2, k2.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        mbarrier.wait(do_bar.index(stg), ph)
        dp = warpgroup_mma(do2, v2.permute((1, 0)), zero_s, use_acc=False, is_async=True)
        # S is done, and the previous tile's dV / dK (P, dS shared buffers free again)
        s, dk, dv = warpgroup_mma_wait(1, deps=(s, dk, dv))                    # [BM, RN]
        if not WITH_DQ:
            if it > 0:    # the previous tile's Q / dO are read: its stage may be refilled
                mbarrier.arrive(empty.index((it - 1) % STAGES), count=1)
        s = gl.fma(s, scale, 0.0)         # (an fma: never contracted into the next line)
        p = gl.exp2((s - mx[:, None]) * LOG2E - ln2[:, None])                   # [BM, RN]
        if (t < g0) | (t >= g1):          # edge tiles: bounds and the band
            keep = inb_m[:, None] & (offs_n < Sk)[None, :]
            if HAS_BAND:
                dd = offs_n[None, :] - offs_m[:, None]
                keep = keep & (dd >= lo) & (dd <= hi)
            p = gl.where(keep, p, 0.0)
        p_own.store(p.to(dt))
        fence_async_shared()
        gl.thread_barrier()               # the partition's 4 warps stored P
        dv = warpgroup_mma(p_own.permute((1, 0)), do2, dv, is_async=True)     # [RN, D]
        dp = warpgroup_mma_wait(1, deps=(dp,))                                  # [BM, RN]
        ds = (p * (dp - dlt[:, None])).to(dt)                                   # [BM, RN]
        buf = it % 2
        if WITH_DQ:
            ds_own = ds_smem.index(buf * 2 + W)                                 # [BM, RN]
        else:
            ds_own = ds_smem.index(W)
        ds_own.store(ds)
        fence_async_shared()
        gl.thread_barrier()               # the partition's 4 warps stored dS
        dk = warpgroup_mma(ds_own.permute((1, 0)), q2, dk, is_async=True)     # [RN, D]
        if WITH_DQ:
            mbarrier.arrive(ds_bar.index(buf), count=1)
            mbarrier.wait(ds_bar.index(buf), (it // 2) & 1)            # both halves of dS
            kh = kh_smem.index(W).reshape([BN, DH])        # K[j0 : j0 + BN, W * DH : +DH]
            dq_tok = warpgroup_mma(ds_smem.index(buf * 2), kh.slice(0, RN, 0),
                                   gl.zeros([BM, DH], gl.float32, layout=q_l),
                                   use_acc=False, is_async=True)                 # [BM, DH]
            dq_tok = warpgroup_mma(ds_smem.index(buf * 2 + 1), kh.slice(RN, RN, 0), dq_tok,
                                   is_async=True)
            # rank of this key tile among those that see query tile t, and whether last
            if HAS_BAND:
                jlo = _div_pos(t * BM + lo, BN)
                jhi = _cdiv_pos((t + 1) * BM + hi, BN) - 1
            else:
                jlo = 0
                jhi = (Sk + BN - 1) // BN - 1
            jhi = gl.minimum(jhi, (Sk + BN - 1) // BN - 1)
            _dq_add(dq_tok, DQ, DQA, SEM, bh, t, nq, jt - jlo, jt == jhi, Sq, scale, W,
                    q_l, D, BM)
            # (_dq_add's wait(0) completed dV / dK too: Q / dO of this stage are read)
            mbarrier.arrive(empty.index(stg), count=1)
    dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))

    # epilogue: this consumer's own K / V buffers stage its dK / dV rows for TMA
    k2.store((dk * scale).to(dt))
    v2.store(dv.to(dt))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(dk_desc, [b, hk, j0 + W * RN, 0], k_smem.index(W))
    tma.async_copy_shared_to_global(dv_desc, [b, hk, j0 + W * RN, 0], v_smem.index(W))
    tma.store_wait(pendings=0)


@gluon.jit
def dkdvq_ws_kernel(q_desc, k_desc, v_desc, do_desc, kh_desc, dk_desc, dv_desc, L2, DELTA,
                    DQ, DQA, SEM, H, G, Sq, Sk, scale, lo, hi, HAS_BAND: gl.constexpr,
                    WITH_DQ: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                    num_warps: gl.constexpr):
    """Grid (cdiv(Sk, 2 * RN), B * Hkv), num_warps = 4 (consumer 0; the workers add 4 + 1).
    q/do_desc: [B, H, Sq, D] blocks [1, 1, BM, D]; k/v/dk/dv_desc: [B, Hkv, Sk, D] blocks
    [1, 1, RN, D]; kh_desc: K with blocks [1, 1, 2 * RN, D / 2]; L2 fp32 [B * H, 2, Sq];
    DELTA fp32 [B * H * Sq]; with WITH_DQ: DQ [B, H, Sq, D] (q's dtype, contiguous), DQA
    fp32 [B * H, Sq, D] scratch, SEM int32 [B * H * nq * 2] zeros.  Band masks through
    lo / hi (open: +-2^30)."""
    gl.static_assert(num_warps == 4, "consumer 0 is one warpgroup")
    BM: gl.constexpr = q_desc.block_type.shape[2]
    D: gl.constexpr = q_desc.block_type.shape[3]
    RN: gl.constexpr = k_desc.block_type.shape[2]
    BN: gl.constexpr = 2 * RN
    dt: gl.constexpr = q_desc.dtype
    gl.static_assert(RN == 64, "one warpgroup of 64 key rows per consumer")

    pid_n = gl.program_id(0)
    bhk = gl.program_id(1)
    Hkv = H // G
    b = bhk // Hkv
    hk = bhk % Hkv
    j0 = pid_n * BN

    k_smem = gl.allocate_shared_memory(dt, [2, 1, 1, RN, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dt, [2, 1, 1, RN, D], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dt, [STAGES, 1, 1, BM, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dt, [STAGES, 1, 1, BM, D], do_desc.layout)
    pds_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, RN], dt)
    p_smem = gl.allocate_shared_memory(dt, [2, BM, RN], pds_l)         # P per consumer
    if WITH_DQ:
        kh_smem = gl.allocate_shared_memory(dt, [2, 1, 1, BN, D // 2], kh_desc.layout)
        ds_smem = gl.allocate_shared_memory(dt, [4, BM, RN], pds_l)    # [buffer * 2 + W]
    else:
        kh_smem = k_smem
        ds_smem = gl.allocate_shared_memory(dt, [2, BM, RN], pds_l)    # [W] (buffer 0)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    ds_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    for st in gl.static_range(STAGES):
        mbarrier.init(q_bar.index(st), count=1)
        mbarrier.init(do_bar.index(st), count=1)
        mbarrier.init(empty.index(st), count=2)          # one arrive per consumer
    for i in gl.static_range(2):
        mbarrier.init(ds_bar.index(i), count=2)
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

    gl.warp_specialize(
        [(_consumer, (q_desc, k_desc, dk_desc, dv_desc, q_smem, do_smem, k_smem, v_smem,
                      kh_smem, p_smem, ds_smem, kv_bar, q_bar, do_bar, empty, ds_bar, L2, DELTA, DQ,
                      DQA, SEM, b, hk, H, G, Sq, Sk, j0, s0, g0, g1, n_div, n_tot, scale,
                      lo, hi, HAS_BAND, WITH_DQ, STAGES, 0)),
         (_consumer, (q_desc, k_desc, dk_desc, dv_desc, q_smem, do_smem, k_smem, v_smem,
                      kh_smem, p_smem, ds_smem, kv_bar, q_bar, do_bar, empty, ds_bar, L2, DELTA, DQ,
                      DQA, SEM, b, hk, H, G, Sq, Sk, j0, s0, g0, g1, n_div, n_tot, scale,
                      lo, hi, HAS_BAND, WITH_DQ, STAGES, 1)),
         (_producer, (q_desc, do_desc, k_desc, v_desc, kh_desc, q_smem, do_smem, k_smem,
                      v_smem, kh_smem, kv_bar, q_bar, do_bar, empty, b, hk, G, j0, s0, n_div,
                      n_tot, WITH_DQ, STAGES))],
        [4, 1], [CONSUMER_REGS, 24])
