"""Persistent warp-specialised Gluon forward for Hopper (sm_90a): fwd_ws_kernel's
partitions and overlapped, ping-pong key loop, with one program per SM walking query
tiles instead of one program per tile.

Shape legend: B batch, H query heads, Hkv kv heads, G = H / Hkv, Sq / Sk queries / keys,
D head dim, BM = NC * RM the query tile (NC = 2 consumer warpgroups of RM = 64 rows), BN
the key tile, BH = B * H, n_m = cdiv(Sq, BM), T = n_m * BH query tiles.

Without a band every tile's key loop is as long: program p takes tiles p, p + P,
p + 2P, .. (P programs, at most one per SM) in head-major order (idx -> head idx // n_m,
query tile idx % n_m: neighbouring programs share K / V in L2).  With a band (HAS_BAND:
a host-built schedule, launch.persist_schedule): program p walks the tiles
SCH[P + 1 + k], k in [SCH[p], SCH[p + 1]), each idx = bh * n_m + pid_m: the per-tile grid's launch order dealt out
greedily by key-loop length, so that the live programs share heads (L2) as the per-tile
kernel's do while the work stays balanced (walking across heads would keep more K / V
live than L2 holds).

What persistence buys: the producer runs ahead into the next tile's K / V while the
consumers finish a tile (its last P.V, the epilogue); each consumer loads the next
tile's Q into its own Q buffer as soon as its key loop is done (every Q.K^T of the tile
waited for) and stores out from a buffer of its own (O [NC, RM, D], 32 KiB) while the
load flies; no program launch or prologue per tile.  The ring slots and the ping-pong
turns are counted across tiles (fwd_ws_kernel._loop_overlap's c0); Q arrives on one
barrier per consumer, phase = tiles done & 1.  _loop_overlap releases every V stage but
its tile's last (a one-tile program never refills it); here the consumer releases that
one after the loop, else the producer waits forever for it from the next tile's second
key tile on.  Numerics and the band: those of fwd_ws_kernel (its module doc), the same
functions; no array masks (Documents / KeepMask run on fwd_ws_kernel).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from .fwd_masks import fwd_mods
from .fwd_ws_kernel import (_loop_overlap, consumer_layouts, epilogue, produce, ring,
                            tile_keys)

__all__ = ["fwd_persist_kernel"]

#: consumer warpgroups of 64 query rows (BM = 128)
NC = gl.constexpr(2)


@gluon.jit
def _tile_of(idx, n_m, H):
    """Tile idx of the walk -> (query tile, b * H + h, b, h), head-major (module doc)."""
    bh = idx // n_m
    pid_m = idx % n_m
    return pid_m, bh, bh // H, bh % H


@gluon.jit
def _walk(SCH, total, HAS_BAND: gl.constexpr):
    """This program's walk positions: range(start, end, step) (module doc)."""
    if HAS_BAND:
        start = gl.load(SCH + gl.program_id(0))
        end = gl.load(SCH + gl.program_id(0) + 1)
        step = 1
    else:
        start = gl.program_id(0)
        end = total
        step = gl.num_programs(0)
    return start, end, step


@gluon.jit
def _tile_at(k, SCH, n_m, H, HAS_BAND: gl.constexpr):
    """Walk position k -> (query tile, b * H + h, b, h): the schedule's entry (a band,
    idx = bh * n_m + pid_m) or _tile_of's order."""
    if HAS_BAND:
        idx = gl.load(SCH + gl.num_programs(0) + 1 + k)
        bh = idx // n_m
        pid_m = idx % n_m
        res = (pid_m, bh, bh // H, bh % H)
    else:
        res = _tile_of(k, n_m, H)
    return res


@gluon.jit
def _producer(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, k_empty, v_empty, H, G, Sq, Sk,
              lo, hi, BH, SCH, HAS_BAND: gl.constexpr, STAGES: gl.constexpr,
              BN: gl.constexpr, BM: gl.constexpr):
    """Every key tile of this program's query tiles, in walk order, into the ring (slot c
    of the whole walk into stage c % STAGES once both consumers released it)."""
    n_m = (Sq + BM - 1) // BM
    start, end, step = _walk(SCH, n_m * BH, HAS_BAND)
    c = 0
    for k in range(start, end, step):
        pid_m, bh, b, h = _tile_at(k, SCH, n_m, H, HAS_BAND)
        t0, f0, f1, n = tile_keys(pid_m, b, h, Sq, Sk, lo, hi, None, None, None, HAS_BAND,
                                  False, BM, BN)
        produce(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, k_empty, v_empty, b, h // G, t0,
                n, c, STAGES, BN)
        c += n


@gluon.jit
def _load_q(q_desc, q_own, qb, k, SCH, n_m, H, WG: gl.constexpr, HAS_BAND: gl.constexpr,
            BM: gl.constexpr, RM: gl.constexpr):
    """TMA of this consumer's RM rows of Q of the tile at walk position k into q_own,
    completing on qb."""
    pid_m, bh, b, h = _tile_at(k, SCH, n_m, H, HAS_BAND)
    mbarrier.expect(qb, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [b, h, pid_m * BM + WG * RM, 0], qb, q_own)


@gluon.jit
def _consumer(q_desc, o_desc, q_smem, o_smem, q_bar, k_smem, v_smem, k_bar, v_bar, k_empty,
              v_empty, turn, LSE, H, Sq, Sk, lo, hi, qk_scale, scale, BH, SCH,
              HAS_BAND: gl.constexpr, STAGES: gl.constexpr, BN: gl.constexpr,
              WG: gl.constexpr, SLOPES=None, sl_b=None, cap=None, adiag=None,
              SINKS=None, SOFTCAP: gl.constexpr = 0,
              ALIBI: gl.constexpr = False, HAS_SINKS: gl.constexpr = False):
    """Rows [WG * RM, (WG + 1) * RM) of each of this program's query tiles: Q (the next
    tile's loaded when this one's key loop is done), the overlapped key loop, the
    epilogue through o_smem[WG].  SOFTCAP / ALIBI / HAS_SINKS: the score modifiers,
    SLOPES ... SINKS their arguments (fwd_masks.fwd_mods, per tile: its head's slope; the
    epilogue loads the sink)."""
    RM: gl.constexpr = q_desc.block_type.shape[2]
    D: gl.constexpr = q_desc.block_type.shape[3]
    BM: gl.constexpr = NC * RM
    dt: gl.constexpr = q_desc.dtype
    s_l: gl.constexpr = consumer_layouts(BN, D)[0]      # [RM, BN] scores
    o_l: gl.constexpr = consumer_layouts(BN, D)[1]      # [RM, D] output accumulator
    p_l: gl.constexpr = consumer_layouts(BN, D)[2]      # P as the register A operand
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)
    col_s: gl.constexpr = gl.SliceLayout(0, s_l)
    row_o: gl.constexpr = gl.SliceLayout(1, o_l)

    q_own = q_smem.index(WG)                                        # [1, 1, RM, D]
    o_own = o_smem.index(WG)                                        # [1, 1, RM, D]
    qb = q_bar.index(WG)
    q2 = q_own.reshape([RM, D])
    offs_mb = gl.arange(0, RM, layout=row_s)
    offs_nb = gl.arange(0, BN, layout=col_s)
    zero_s = gl.zeros([RM, BN], gl.float32, layout=s_l)
    n_m = (Sq + BM - 1) // BM
    start, end, step = _walk(SCH, n_m * BH, HAS_BAND)
    if start < end:
        _load_q(q_desc, q_own, qb, start, SCH, n_m, H, WG, HAS_BAND, BM, RM)
    c = 0
    j = 0
    for k in range(start, end, step):
        pid_m, bh, b, h = _tile_at(k, SCH, n_m, H, HAS_BAND)
        t0, f0, f1, n = tile_keys(pid_m, b, h, Sq, Sk, lo, hi, None, None, None, HAS_BAND,
                                  False, BM, BN)
        r0 = pid_m * BM + WG * RM
        m_i = gl.full([RM], float("-inf"), gl.float32, layout=row_s)
        l_i = gl.zeros([RM], gl.float32, layout=row_s)
        acc = gl.zeros([RM, D], gl.float32, layout=o_l)
        if SOFTCAP or ALIBI or HAS_SINKS:
            mods, c_exp = fwd_mods((SLOPES, sl_b, cap, adiag, SINKS), b, h, scale,
                                   qk_scale, SOFTCAP, ALIBI)
        else:
            mods = None
            c_exp = qk_scale
        mbarrier.wait(qb, j & 1)
        acc, l_i, m_i = _loop_overlap(q2, k_smem, v_smem, k_bar, v_bar, k_empty, v_empty,
                                      turn, acc, m_i, l_i, zero_s, n, t0, f0, f1, r0,
                                      offs_mb, offs_nb, Sq, Sk, lo, hi, c_exp, None, c,
                                      HAS_BAND, STAGES, BN, D, dt, p_l, row_o, WG, NC,
                                      False, 0, False, mods, SOFTCAP, ALIBI)
        if n > 0:     # the tile's last V (its P.V waited for in the loop): free its stage
            mbarrier.arrive(v_empty.index((c + n - 1) % STAGES), count=1)
        # every wgmma reading Q is done: the next tile's Q flies during the epilogue
        if k + step < end:
            _load_q(q_desc, q_own, qb, k + step, SCH, n_m, H, WG, HAS_BAND, BM, RM)
        tma.store_wait(pendings=0)       # the previous tile's out left o_own
        epilogue(acc, l_i, m_i, o_own, o_desc, LSE, b, h, bh, r0, Sq, BH, scale, offs_mb,
                 row_o, SOFTCAP, SINKS, HAS_SINKS)
        c += n
        j += 1
    tma.store_wait(pendings=0)


@gluon.jit(do_not_specialize=["BH"])   # BH = 1 (one head) stays a tensor: epilogue's .to
def fwd_persist_kernel(q_desc, k_desc, v_desc, o_desc, LSE, H, G, Sq, Sk, qk_scale, scale,
                       lo, hi, RT, rt_b, rt_h, QID, KID, sqid_b, skid_b, KM, skm_b, skm_h,
                       skm_q, skm_k, BH, SCH, HAS_BAND: gl.constexpr, STAGES: gl.constexpr,
                       CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr, SLOPES=None,
                       sl_b=None, cap=None, adiag=None, SINKS=None,
                       SOFTCAP: gl.constexpr = 0, ALIBI: gl.constexpr = False,
                       HAS_SINKS: gl.constexpr = False):
    """Grid (P,) with P <= the SM count (module doc); num_warps = 4 (consumer 0; the
    workers add 4 + 1).  Arguments as fwd_ws_kernel's (NC = 2 consumers, no array masks:
    RT ... skm_k are placeholders, not read, kept where they sit in the parameter
    block), plus BH = B * H and SCH: int32 [P + 1 + T]
    the schedule (HAS_BAND: offsets of each program's walk, then the tiles; not read
    without a band).  SLOPES ... HAS_SINKS: the score modifiers, as fwd_ws_kernel's."""
    gl.static_assert(num_warps == 4, "consumer 0 is one warpgroup")
    RM: gl.constexpr = q_desc.block_type.shape[2]
    D: gl.constexpr = q_desc.block_type.shape[3]
    BN: gl.constexpr = k_desc.block_type.shape[2]
    BM: gl.constexpr = NC * RM
    dt: gl.constexpr = q_desc.dtype
    # the producer walks tiles too (index arithmetic): 32 registers, not fwd_ws_kernel's
    # 24 (which spill here); 2 * 128 * CONSUMER_REGS + 128 * 32 <= 64 K at 240
    PRODUCER_REGS: gl.constexpr = 32

    q_smem = gl.allocate_shared_memory(dt, [NC, 1, 1, RM, D], q_desc.layout)
    o_smem = gl.allocate_shared_memory(dt, [NC, 1, 1, RM, D], o_desc.layout)
    k_smem, v_smem, q_bar, turn, k_bar, v_bar, k_empty, v_empty = ring(k_desc, v_desc, NC,
                                                                       STAGES)

    gl.warp_specialize(
        [(_consumer, (q_desc, o_desc, q_smem, o_smem, q_bar, k_smem, v_smem, k_bar, v_bar,
                      k_empty, v_empty, turn, LSE, H, Sq, Sk, lo, hi, qk_scale, scale,
                      BH, SCH, HAS_BAND, STAGES, BN, 0, SLOPES, sl_b, cap, adiag, SINKS,
                      SOFTCAP, ALIBI, HAS_SINKS)),
         (_consumer, (q_desc, o_desc, q_smem, o_smem, q_bar, k_smem, v_smem, k_bar, v_bar,
                      k_empty, v_empty, turn, LSE, H, Sq, Sk, lo, hi, qk_scale, scale,
                      BH, SCH, HAS_BAND, STAGES, BN, 1, SLOPES, sl_b, cap, adiag, SINKS,
                      SOFTCAP, ALIBI, HAS_SINKS)),
         (_producer, (k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, k_empty, v_empty, H, G,
                      Sq, Sk, lo, hi, BH, SCH, HAS_BAND, STAGES, BN, BM))],
        [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
