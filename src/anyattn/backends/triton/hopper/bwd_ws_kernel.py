"""Warp-specialised Gluon dK/dV for Hopper (sm_90a): a TMA producer warp and two consumer
warpgroups that own disjoint key rows and never meet at a CTA barrier.

Shape legend: B batch, H query heads, Hkv kv heads, G = H / Hkv, Sq / Sk queries / keys,
D head dim, RN = 64 key rows per consumer, BN = 2 * RN the key tile of a program, BM = 64
the query tile, STAGES the depth of the Q / dO ring.

One program per (key tile, b * Hkv + hk); ``gl.warp_specialize`` partitions:
  producer (1 warp, few registers): for every (query head of the group, query tile) that
      sees the key tile (band ranges: bwd_kernel.query_tile_range, empty tiles skipped)
      Q and dO [BM, D] by TMA into ring stage it % STAGES on "q ready" / "do ready",
      once both consumers released the stage's previous tile ("empty", count 2);
  consumer w (w = 0 the default partition, w = 1 a worker; 4 warps, setmaxnreg
      CONSUMER_REGS) loads its own K_w, V_w [RN, D] (keys j0 + w * RN ...) once by TMA and
      per tile computes FA3's untransposed form
          S  = Q . K_w^T       [BM, RN]  wgmma, both operands from shared memory
          dP = dO . V_w^T      [BM, RN]  wgmma
          P  = exp2((fma(S, scale, 0) - max) * log2 e - log_norm2)   (0 where masked)
          dS = P * (dP - delta)
          P, dS -> its own shared [BM, RN] buffers (q's dtype)
          dV_w += P^T . dO     [RN, D]   wgmma, P^T from shared (transposed A)
          dK_w += dS^T . Q     [RN, D]   wgmma
      then waits for its products at the loop's back edge (no accumulator in flight
      across it: ptxas would serialise the wgmmas, C7515) and releases the stage.  The
      row statistics of the next tile (L2 [B * H, 2, Sq]: max, +inf on empty rows, and
      log2(e) * log_norm; DELTA [B * H * Sq]; kernels.py module doc) are loaded while
      the current tile's S / dP run.  At the end dK_w * scale and dV_w go through its own
      K_w / V_w buffers to global by TMA (rows past Sk clipped).
PINGPONG: the consumers take turns to issue their S / dP pair (consumer w waits on
turn[w], issues, arrives on turn[1 - w]), so that one's exponentials and dS run while
the other's products hold the tensor cores; without it the consumers drift apart only
as the shared ring lets them.

The numerics are the portable backward's (kernels.py) and bwd_fused_kernel's; every
dK / dV element has one owner and a fixed summation order: bitwise repeatable, no
atomics.  dQ stays with the portable kernel.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from .bwd_kernel import key_tile_program, key_tile_queries

__all__ = ["dkdv_ws_kernel"]

LOG2E = gl.constexpr(1.4426950408889634)


@gluon.jit
def _tile_of(it, hk, G, s0, n_div):
    """The it-th (query head, query tile) pair of the flattened loop: heads outer."""
    return hk * G + it // n_div, s0 + it % n_div


@gluon.jit
def _producer(q_desc, do_desc, q_smem, do_smem, q_bar, do_bar, empty, b, hk, G, s0, n_div,
              n_tot, STAGES: gl.constexpr, BM: gl.constexpr):
    """Q and dO of tile it into stage it % STAGES once both consumers released that
    stage's previous tile (the first pass waits on the phase before init: free)."""
    for it in range(0, n_tot):
        st = it % STAGES
        h, t = _tile_of(it, hk, G, s0, n_div)
        mbarrier.wait(empty.index(st), ((it // STAGES) & 1) ^ 1)
        mbarrier.expect(q_bar.index(st), q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [b, h, t * BM, 0], q_bar.index(st),
                                        q_smem.index(st))
        mbarrier.expect(do_bar.index(st), do_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(do_desc, [b, h, t * BM, 0], do_bar.index(st),
                                        do_smem.index(st))


@gluon.jit
def _turn_wait(turn, k, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: consumer WG's k-th turn (0, 1, 0, 1, ...: consumer 0's first is free)."""
    if PINGPONG:
        if WG == 0:
            mbarrier.wait(turn.index(0), (k & 1) ^ 1)
        else:
            mbarrier.wait(turn.index(1), k & 1)


@gluon.jit
def _turn_pass(turn, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Ping-pong: hand the tensor cores to the other consumer."""
    if PINGPONG:
        mbarrier.arrive(turn.index(1 - WG), count=1)


@gluon.jit
def _row_stats(L2, DELTA, bh, t, Sq, offs_mb, BM: gl.constexpr):
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
def _consumer(k_desc, v_desc, dk_desc, dv_desc, q_smem, do_smem, k_smem, v_smem, p_smem,
              ds_smem, kv_bar, q_bar, do_bar, empty, turn, L2, DELTA, b, hk, H, G, Sq, Sk,
              j0, s0, g0, g1, n_div, n_tot, scale, lo, hi, HAS_BAND: gl.constexpr,
              STAGES: gl.constexpr, WG: gl.constexpr, PINGPONG: gl.constexpr):
    """Key rows [j0 + WG * RN, j0 + (WG + 1) * RN): the whole query loop and the
    epilogue (module doc)."""
    BM: gl.constexpr = q_smem.shape[3]
    D: gl.constexpr = q_smem.shape[4]
    RN: gl.constexpr = k_smem.shape[3]
    dt: gl.constexpr = q_smem.dtype
    s_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, RN, 16])      # [BM, RN]
    a_l: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                  instr_shape=[16, D, 16])       # [RN, D]
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)                                 # [BM]
    col_s: gl.constexpr = gl.SliceLayout(0, s_l)                                 # [RN]

    r0 = j0 + WG * RN
    k_own = k_smem.index(WG)                                                     # [1, 1, RN, D]
    v_own = v_smem.index(WG)
    kb = kv_bar.index(WG)
    mbarrier.expect(kb, 2 * k_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(k_desc, [b, hk, r0, 0], kb, k_own)
    tma.async_copy_global_to_shared(v_desc, [b, hk, r0, 0], kb, v_own)
    kT = k_own.reshape([RN, D]).permute((1, 0))                                  # [D, RN]
    vT = v_own.reshape([RN, D]).permute((1, 0))                                  # [D, RN]
    p_own = p_smem.index(WG)                                                     # [BM, RN]
    ds_own = ds_smem.index(WG)

    offs_mb = gl.arange(0, BM, layout=row_s)
    zero_s = gl.zeros([BM, RN], gl.float32, layout=s_l)
    dk = gl.zeros([RN, D], gl.float32, layout=a_l)
    dv = gl.zeros([RN, D], gl.float32, layout=a_l)
    h, t = _tile_of(0, hk, G, s0, n_div)
    mx, ln2, dlt = _row_stats(L2, DELTA, b * H + h, t, Sq, offs_mb, BM)
    mbarrier.wait(kb, 0)
    for it in range(0, n_tot):
        stg = it % STAGES
        ph = (it // STAGES) & 1
        offs_m = t * BM + offs_mb
        q2 = q_smem.index(stg).reshape([BM, D])
        do2 = do_smem.index(stg).reshape([BM, D])
        mbarrier.wait(q_bar.index(stg), ph)
        _turn_wait(turn, it, WG, PINGPONG)
        s = warpgroup_mma(q2, kT, zero_s, use_acc=False, is_async=True)        # [BM, RN]
        mbarrier.wait(do_bar.index(stg), ph)
        dp = warpgroup_mma(do2, vT, zero_s, use_acc=False, is_async=True)      # [BM, RN]
        _turn_pass(turn, WG, PINGPONG)
        # the next tile's statistics (the last tile's again at the end), loaded while
        # S / dP run
        h_n, t_n = _tile_of(gl.minimum(it + 1, n_tot - 1), hk, G, s0, n_div)
        mx_n, ln2_n, dlt_n = _row_stats(L2, DELTA, b * H + h_n, t_n, Sq, offs_mb, BM)
        s = warpgroup_mma_wait(1, deps=(s,))                                   # [BM, RN]
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
        ds_own.store((p * (dp - dlt[:, None])).to(dt))
        fence_async_shared()
        gl.thread_barrier()               # ... and dS
        dk = warpgroup_mma(ds_own.permute((1, 0)), q2, dk, is_async=True)      # [RN, D]
        dk, dv = warpgroup_mma_wait(0, deps=(dk, dv))     # P / dS / the stage free
        mbarrier.arrive(empty.index(stg), count=1)
        mx, ln2, dlt = mx_n, ln2_n, dlt_n
        t = t_n

    # epilogue: through this consumer's own K / V buffers (only its wgmmas read them)
    k2 = k_own.reshape([RN, D])
    v2 = v_own.reshape([RN, D])
    k2.store((dk * scale).to(dt))
    v2.store(dv.to(dt))
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(dk_desc, [b, hk, r0, 0], k_own)
    tma.async_copy_shared_to_global(dv_desc, [b, hk, r0, 0], v_own)
    tma.store_wait(pendings=0)


@gluon.jit(do_not_specialize=["H", "G", "Sq", "Sk", "lo", "hi"])   # one compile per config
def dkdv_ws_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, L2, DELTA, H, G, Sq,
                   Sk, scale, lo, hi, HAS_BAND: gl.constexpr, STAGES: gl.constexpr,
                   CONSUMER_REGS: gl.constexpr, PINGPONG: gl.constexpr,
                   num_warps: gl.constexpr):
    """Grid (cdiv(Sk, 2 * RN), B * Hkv), num_warps = 4 (consumer 0; the workers add 4 + 1).
    q/do_desc: [B, H, Sq, D] blocks [1, 1, BM, D]; k/v/dk/dv_desc: [B, Hkv, Sk, D] blocks
    [1, 1, RN, D]; L2 fp32 [B * H, 2, Sq]; DELTA fp32 [B * H * Sq].  Band masks through
    lo / hi (open: +-2^30)."""
    gl.static_assert(num_warps == 4, "consumer 0 is one warpgroup")
    BM: gl.constexpr = q_desc.block_type.shape[2]
    D: gl.constexpr = q_desc.block_type.shape[3]
    RN: gl.constexpr = k_desc.block_type.shape[2]
    BN: gl.constexpr = 2 * RN
    dt: gl.constexpr = q_desc.dtype
    gl.static_assert(RN == 64, "64 key rows per consumer warpgroup")
    pds_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, RN], dt)

    pid_n, b, hk, j0 = key_tile_program(H, G, BN)   # key tile pid_n of kv head hk, batch b

    k_smem = gl.allocate_shared_memory(dt, [2, 1, 1, RN, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dt, [2, 1, 1, RN, D], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dt, [STAGES, 1, 1, BM, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dt, [STAGES, 1, 1, BM, D], do_desc.layout)
    p_smem = gl.allocate_shared_memory(dt, [2, BM, RN], pds_l)
    ds_smem = gl.allocate_shared_memory(dt, [2, BM, RN], pds_l)
    kv_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    q_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    do_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for w in gl.static_range(2):
        mbarrier.init(kv_bar.index(w), count=1)
        mbarrier.init(turn.index(w), count=1)
    for st in gl.static_range(STAGES):
        mbarrier.init(q_bar.index(st), count=1)
        mbarrier.init(do_bar.index(st), count=1)
        mbarrier.init(empty.index(st), count=2)          # one arrive per consumer
    fence_async_shared()

    # query tiles [s0, s1), unmasked in [g0, g1); n_tot (head of the group, query tile)
    # pairs, flattened
    s0, g0, g1, s1, n_tot, n_div = key_tile_queries(j0, G, Sq, Sk, lo, hi, BM, BN, HAS_BAND)

    gl.warp_specialize(
        [(_consumer, (k_desc, v_desc, dk_desc, dv_desc, q_smem, do_smem, k_smem, v_smem,
                      p_smem, ds_smem, kv_bar, q_bar, do_bar, empty, turn, L2, DELTA, b, hk, H,
                      G, Sq, Sk, j0, s0, g0, g1, n_div, n_tot, scale, lo, hi, HAS_BAND,
                      STAGES, 0, PINGPONG)),
         (_consumer, (k_desc, v_desc, dk_desc, dv_desc, q_smem, do_smem, k_smem, v_smem,
                      p_smem, ds_smem, kv_bar, q_bar, do_bar, empty, turn, L2, DELTA, b, hk, H,
                      G, Sq, Sk, j0, s0, g0, g1, n_div, n_tot, scale, lo, hi, HAS_BAND,
                      STAGES, 1, PINGPONG)),
         (_producer, (q_desc, do_desc, q_smem, do_smem, q_bar, do_bar, empty, b, hk, G, s0,
                      n_div, n_tot, STAGES, BM))],
        [4, 1], [CONSUMER_REGS, 24])
