"""Warp-specialised Gluon forward for Hopper (sm_90a): one producer warp, two or three
consumer warpgroups that never meet at a CTA barrier.

Shape legend: B batch, H query heads, Hkv kv heads, G = H / Hkv, Sq / Sk queries / keys,
D head dim, BM = NC * RM the query tile of a program (NC = 2 or 3 consumers, RM = 64
rows per consumer warpgroup), BN the key tile, STAGES the depth of the K/V ring.

Partitions (``gl.warp_specialize``):
  consumer 0 (the default partition, 4 warps) and consumers 1 .. NC - 1 (4-warp
      workers): each owns RM query rows, loads its own Q [RM, D] by TMA, runs the key
      loop (one of the schedules below) and stores its own rows of out by TMA from its
      own Q buffer;
  producer (a 1-warp worker, few registers): per key tile waits for the stage's "k empty"
      barrier and TMA-loads K [BN, D] on "k ready", then the same for V ("v empty" /
      "v ready").  K and V are released apart (count NC: one arrive per consumer), K as
      soon as its S = Q.K^T is done, V after its P.V.
Key loop (FA3's intra-warpgroup overlap): per tile j issue S_j = Q.K_j^T and
  O += P_{j-1}.V_{j-1} back to back, wait for S_j only (``warpgroup_mma_wait(1)``), run
  the softmax of j while P_{j-1}.V_{j-1} runs, then wait for it and rescale O.  P_{j-1}
  stays in registers until its product is done.  Ping-pong (FA3's inter-warpgroup
  schedule): the consumers take turns to issue their pair of products, ordered by NC
  "turn" mbarriers (consumer w waits on turn[w], issues, arrives on turn[(w + 1) % NC]),
  so that one consumer's softmax runs while another's products hold the tensor cores.
No CTA-wide barrier in the loop.  K and V tiles come from the band range [t0, t1)
(tile_ranges.key_tile_range; no mask: all), masked at the edges [t0, f0) and [f1, t1)
only; rows past Sq / Sk are zero-filled by the copy engine (and masked) and clipped on
the TMA store of out.  Numerics are the portable forward's (kernels.py module doc, "Row
statistics"): the row max is kept in raw q.k units, ``p = exp2((x - m) * scale *
log2 e)``, the statistics ``max = m * scale`` and ``log_norm = ln(l)`` go to two fp32
planes [2, B * H * Sq]; empty rows: out 0, max -inf, log_norm 0.  Documents / KeepMask (ARRAY): the key range of a
program is read from a block-range table at its BM x BN tile instead of computed from the
band (the producer walks it by tile index as before); the consumers apply the id compare
/ keep bytes on the edge tiles only (fwd_masks), composed with the band there.  Score
modifiers (constexprs SOFTCAP / ALIBI / HAS_SINKS, no array mask): softcap and ALiBi on
every score tile before the masks (fwd_masks.mod_scores, the portable kernels' math;
softcap keeps the row max in natural units, max = m, and the exponent's factor is
log2 e), the sink folded into the statistics in the epilogue.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait)

from .tile_ranges import key_tile_range
from .fwd_masks import fwd_mods, softmax_tile_masked

__all__ = ["fwd_ws_kernel", "tile_keys", "epilogue", "ring", "produce"]


@gluon.jit
def produce(k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, k_empty, v_empty, b, hk, t0, n,
            c0, STAGES: gl.constexpr, BN: gl.constexpr):
    """Key tiles t0 .. t0 + n - 1 into the ring: K (then V) of tile it into stage
    g % STAGES, g = c0 + it (c0: ring slots used before, 0 but in a persistent program),
    once both consumers released that buffer's previous tile (the first pass waits on
    the phase before init: free)."""
    for it in range(0, n):
        g = c0 + it
        st = g % STAGES
        ph = ((g // STAGES) & 1) ^ 1
        row = (t0 + it) * BN
        mbarrier.wait(k_empty.index(st), ph)
        mbarrier.expect(k_bar.index(st), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [b, hk, row, 0], k_bar.index(st),
                                        k_smem.index(st))
        mbarrier.wait(v_empty.index(st), ph)
        mbarrier.expect(v_bar.index(st), v_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(v_desc, [b, hk, row, 0], v_bar.index(st),
                                        v_smem.index(st))


@gluon.constexpr_function
def consumer_layouts(BN, D):
    """A forward consumer warpgroup's layouts (4 warps, RM = 64 rows): the wgmma
    accumulators of the scores [RM, BN] and of the output [RM, D], and P [RM, BN] as the
    register A operand of P.V."""
    s_l = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                    instr_shape=[16, BN, 16])
    o_l = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                    instr_shape=[16, D, 16])
    return s_l, o_l, gl.DotOperandLayout(operand_index=0, parent=o_l, k_width=2)


@gluon.jit
def _turn_wait(turn, k, WG: gl.constexpr):
    """Ping-pong: the k-th turn of consumer WG.  The turns go round the consumers
    0, 1, .., NC - 1, 0, ..: consumer 0's first turn is free and its k-th waits for the
    (k - 1)-th completion of turn[0]; consumer w > 0 waits for the k-th of turn[w]."""
    if WG == 0:
        mbarrier.wait(turn.index(0), (k & 1) ^ 1)
    else:
        mbarrier.wait(turn.index(WG), k & 1)


@gluon.jit
def _turn_pass(turn, WG: gl.constexpr, NC: gl.constexpr):
    """Ping-pong: hand the tensor cores to the next consumer."""
    mbarrier.arrive(turn.index((WG + 1) % NC), count=1)


@gluon.jit
def _loop_overlap(q2, k_smem, v_smem, k_bar, v_bar, k_empty, v_empty, turn, acc, m_i, l_i,
                  zero_s, n, t0, f0, f1, r0, offs_mb, offs_nb, Sq, Sk, lo, hi, qk_scale, am, c0,
                  HAS_BAND: gl.constexpr, STAGES: gl.constexpr, BN: gl.constexpr,
                  D: gl.constexpr, dt: gl.constexpr, p_l: gl.constexpr, row_o: gl.constexpr,
                  WG: gl.constexpr, NC: gl.constexpr, ARRAY: gl.constexpr,
                  DOCS: gl.constexpr, HAS_KEEP: gl.constexpr, mods=None,
                  SOFTCAP: gl.constexpr = 0, ALIBI: gl.constexpr = False):
    """Per tile j: issue S_j = Q.K_j^T and O += P_{j-1}.V_{j-1} (one turn under
    ping-pong), wait for S_j, softmax of j while P.V runs, wait for P.V, rescale O.
    Tile 0's S before the loop, the last P.V after it.  c0: ring slots (and ping-pong
    turns) this consumer used before this key loop (0 but in a persistent program: its
    earlier query tiles').  SOFTCAP / ALIBI: the score modifiers (fwd_masks.mod_scores;
    mods and qk_scale from fwd_masks.fwd_mods).  -> acc [RM, D] (done), l_i, m_i."""
    RM: gl.constexpr = q2.shape[0]
    p16 = gl.zeros([RM, BN], dt, layout=p_l)
    if n > 0:
        st0 = c0 % STAGES
        mbarrier.wait(k_bar.index(st0), (c0 // STAGES) & 1)
        _turn_wait(turn, c0, WG)
        kT = k_smem.index(st0).reshape([BN, D]).permute((1, 0))                # [D, BN]
        s_tok = warpgroup_mma(q2, kT, zero_s, use_acc=False, is_async=True)
        _turn_pass(turn, WG, NC)
        s = warpgroup_mma_wait(0, deps=(s_tok,))                               # [RM, BN]
        mbarrier.arrive(k_empty.index(st0), count=1)
        p, alpha, l_i, m_i = softmax_tile_masked(s, m_i, l_i, t0, f0, f1, r0, offs_mb,
                                                 offs_nb, Sq, Sk, lo, hi, qk_scale, am,
                                                 HAS_BAND, BN, ARRAY, DOCS, HAS_KEEP, mods,
                                                 SOFTCAP, ALIBI)
        p16 = gl.convert_layout(p.to(dt), p_l)           # acc is 0: no rescale needed
    for it in range(1, n):
        g = c0 + it                                   # this consumer's ring slot count
        stg = g % STAGES
        ph = (g // STAGES) & 1
        pst = (g - 1) % STAGES
        mbarrier.wait(k_bar.index(stg), ph)
        mbarrier.wait(v_bar.index(pst), ((g - 1) // STAGES) & 1)
        _turn_wait(turn, g, WG)
        kT = k_smem.index(stg).reshape([BN, D]).permute((1, 0))                # [D, BN]
        s_tok = warpgroup_mma(q2, kT, zero_s, use_acc=False, is_async=True)
        acc = warpgroup_mma(p16, v_smem.index(pst).reshape([BN, D]), acc, is_async=True)
        _turn_pass(turn, WG, NC)
        s = warpgroup_mma_wait(1, deps=(s_tok,))          # S_it done; P.V(it - 1) may run
        mbarrier.arrive(k_empty.index(stg), count=1)
        p, alpha, l_i, m_i = softmax_tile_masked(s, m_i, l_i, t0 + it, f0, f1, r0, offs_mb,
                                                 offs_nb, Sq, Sk, lo, hi, qk_scale, am,
                                                 HAS_BAND, BN, ARRAY, DOCS, HAS_KEEP, mods,
                                                 SOFTCAP, ALIBI)
        acc, p16 = warpgroup_mma_wait(0, deps=(acc, p16))  # P.V(it - 1) done: V, p16 free
        mbarrier.arrive(v_empty.index(pst), count=1)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p16 = gl.convert_layout(p.to(dt), p_l)                                 # [RM, BN]
    if n > 0:
        lst = (c0 + n - 1) % STAGES
        mbarrier.wait(v_bar.index(lst), ((c0 + n - 1) // STAGES) & 1)
        acc = warpgroup_mma(p16, v_smem.index(lst).reshape([BN, D]), acc, is_async=True)
        acc, p16 = warpgroup_mma_wait(0, deps=(acc, p16))
    return acc, l_i, m_i


@gluon.jit
def _consumer(ca, HAS_BAND: gl.constexpr, STAGES: gl.constexpr, BN: gl.constexpr,
              WG: gl.constexpr, NC: gl.constexpr, ARRAY: gl.constexpr,
              DOCS: gl.constexpr, HAS_KEEP: gl.constexpr, SLOPES=None,
              sl_b=None, cap=None, adiag=None, SINKS=None, SOFTCAP: gl.constexpr = 0, ALIBI: gl.constexpr = False,
              HAS_SINKS: gl.constexpr = False):
    """Rows [i0 + WG * RM, i0 + (WG + 1) * RM) of the program's query tile: the whole key
    loop and the epilogue (out by TMA, max / log_norm to LSE [2, B * H * Sq]).  ``ca``:
    the arguments but the constexprs, as a tuple (unpacked below; one tuple for every
    consumer of fwd_ws_kernel's warp_specialize, where a tuple holds no constexpr).  ARRAY:
    the edge tiles' Documents (DOCS 1: q ids QIDb [Sq], k ids KIDb [Sk] of batch row b;
    DOCS 2: QIDb [2, Sq] the key interval of each row's document) and / or KeepMask (KMb
    bytes of (b, h), strides skm_q / skm_k) masks (fwd_masks).  SOFTCAP / ALIBI /
    HAS_SINKS: the score modifiers, SLOPES ... SINKS their arguments
    (fwd_masks.fwd_mods)."""
    (q_desc, o_desc, q_smem, q_bar, k_smem, v_smem, k_bar, v_bar, k_empty, v_empty, turn, LSE,
     b, h, bh, i0, Sq, Sk, t0, f0, f1, n, lo, hi, qk_scale, scale, QIDb, KIDb, KMb, skm_q,
     skm_k) = ca
    RM: gl.constexpr = q_desc.block_type.shape[2]
    D: gl.constexpr = q_desc.block_type.shape[3]
    dt: gl.constexpr = q_desc.dtype
    s_l: gl.constexpr = consumer_layouts(BN, D)[0]      # [RM, BN] scores
    o_l: gl.constexpr = consumer_layouts(BN, D)[1]      # [RM, D] output accumulator
    p_l: gl.constexpr = consumer_layouts(BN, D)[2]      # P as the register A operand
    row_s: gl.constexpr = gl.SliceLayout(1, s_l)
    col_s: gl.constexpr = gl.SliceLayout(0, s_l)
    row_o: gl.constexpr = gl.SliceLayout(1, o_l)

    r0 = i0 + WG * RM
    q_own = q_smem.index(WG)                                        # [1, 1, RM, D]
    qb = q_bar.index(WG)
    mbarrier.expect(qb, q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [b, h, r0, 0], qb, q_own)
    q2 = q_own.reshape([RM, D])

    offs_mb = gl.arange(0, RM, layout=row_s)
    offs_nb = gl.arange(0, BN, layout=col_s)
    m_i = gl.full([RM], float("-inf"), gl.float32, layout=row_s)
    l_i = gl.zeros([RM], gl.float32, layout=row_s)
    acc = gl.zeros([RM, D], gl.float32, layout=o_l)
    zero_s = gl.zeros([RM, BN], gl.float32, layout=s_l)
    offs_q = r0 + offs_mb
    if DOCS == 1:                    # the q ids of this consumer's rows [RM]
        qa = gl.load(QIDb + offs_q, mask=offs_q < Sq, other=-1)
        qe = qa
    elif DOCS == 2:                  # their documents as key intervals [qa, qe) [RM]
        qa = gl.load(QIDb + offs_q, mask=offs_q < Sq, other=0)
        qe = gl.load(QIDb + Sq + offs_q, mask=offs_q < Sq, other=0)
    else:
        qa = 0
        qe = 0
    am = (qa, qe, KIDb, KMb, skm_q, skm_k)
    if SOFTCAP or ALIBI or HAS_SINKS:
        mods, qk_scale = fwd_mods((SLOPES, sl_b, cap, adiag, SINKS), b, h, scale,
                                  qk_scale, SOFTCAP, ALIBI)
    else:
        mods = None
    mbarrier.wait(qb, 0)
    acc, l_i, m_i = _loop_overlap(q2, k_smem, v_smem, k_bar, v_bar, k_empty, v_empty,
                                  turn, acc, m_i, l_i, zero_s, n, t0, f0, f1, r0,
                                  offs_mb, offs_nb, Sq, Sk, lo, hi, qk_scale, am, 0,
                                  HAS_BAND, STAGES, BN, D, dt, p_l, row_o, WG, NC,
                                  ARRAY, DOCS, HAS_KEEP, mods, SOFTCAP, ALIBI)

    # this consumer's own Q buffer takes out: only its wgmmas read it
    epilogue(acc, l_i, m_i, q_own, o_desc, LSE, b, h, bh, r0, Sq, gl.num_programs(1),
             scale, offs_mb, row_o, SOFTCAP, SINKS, HAS_SINKS)
    tma.store_wait(pendings=0)


@gluon.jit
def epilogue(acc, l_i, m_i, o_buf, o_desc, LSE, b, h, bh, r0, Sq, BH, scale, offs_mb,
             row_o: gl.constexpr, NAT: gl.constexpr = False, SINKS=None,
             HAS_SINKS: gl.constexpr = False):
    """The epilogue for rows [r0, r0 + RM) of (b, h): out = acc / l (0 on empty
    rows) through o_buf [1, 1, RM, D] (shared, free) by TMA (not waited for); max -inf and
    log_norm 0 on empty rows, to LSE [2, BH * Sq] (bh = b * H + h).  NAT: m_i holds
    natural scores (softcap), else raw products (max = m_i * scale).  HAS_SINKS: the sink
    SINKS[h] (fp32 [H]) is one more term of the normaliser, as the portable forward folds it in
    (kernels.fwd_kernel): max2 = max(max, sink), l2 = l e^(max - max2) + e^(sink - max2),
    out = acc e^(max - max2) / l2; a row keeping no key: out 0, max = sink, l2 = 1."""
    dt: gl.constexpr = o_desc.dtype
    RM: gl.constexpr = o_desc.block_type.shape[2]
    D: gl.constexpr = o_desc.block_type.shape[3]
    empty_r = l_i == 0.0
    if HAS_SINKS:
        snk = gl.load(SINKS + h)
        if NAT:
            row_max = gl.where(empty_r, float("-inf"), m_i)
        else:
            row_max = gl.where(empty_r, float("-inf"), m_i * scale)
        mx2 = gl.maximum(row_max, snk)
        mx2s = gl.where(mx2 == float("-inf"), 0.0, mx2)
        alpha = gl.exp2((row_max - mx2s) * 1.4426950408889634)     # 0 on empty rows
        l_i = l_i * alpha + gl.exp2((snk - mx2s) * 1.4426950408889634)
        empty_r = l_i == 0.0
        l_safe = gl.where(empty_r, 1.0, l_i)
        row_max = gl.where(l_i == l_i, mx2, l_i)
        log_norm = gl.log2(l_safe) * 0.6931471805599453
        emp_o = gl.convert_layout(empty_r, row_o)
        l_o = gl.convert_layout(l_safe, row_o)
        a_o = gl.convert_layout(alpha, row_o)
        out = gl.where(emp_o[:, None], 0.0, (acc * a_o[:, None]) / l_o[:, None])  # [RM, D]
    else:
        l_safe = gl.where(empty_r, 1.0, l_i)
        if NAT:
            row_max = gl.where(empty_r, float("-inf"), m_i)
        else:
            row_max = gl.where(empty_r, float("-inf"), m_i * scale)
        row_max = gl.where(l_i == l_i, row_max, l_i)
        log_norm = gl.log2(l_safe) * 0.6931471805599453
        emp_o = gl.convert_layout(empty_r, row_o)
        l_o = gl.convert_layout(l_safe, row_o)
        out = gl.where(emp_o[:, None], 0.0, acc / l_o[:, None])                # [RM, D]
    o_buf.reshape([RM, D]).store(out.to(dt))
    fence_async_shared()
    gl.thread_barrier()           # the partition's 4 warps stored before the TMA reads
    tma.async_copy_shared_to_global(o_desc, [b, h, r0, 0], o_buf)
    offs_m = r0 + offs_mb
    inb = offs_m < Sq
    row = bh.to(gl.int64) * Sq + offs_m
    gl.store(LSE + row, row_max, mask=inb)
    gl.store(LSE + BH.to(gl.int64) * Sq + row, log_norm, mask=inb)


@gluon.jit
def tile_keys(pid_m, b, h, Sq, Sk, lo, hi, RT, rt_b, rt_h, HAS_BAND: gl.constexpr,
              ARRAY: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr):
    """Key tiles of query tile pid_m of (b, h): -> t0, f0, f1, n (tiles [t0, t0 + n),
    unmasked in [f0, f1)): the range table's entry (ARRAY), the band's range, or all."""
    i0 = pid_m * BM
    if ARRAY:
        rg = RT + 4 * (b * rt_b + h * rt_h + pid_m)
        t0 = gl.load(rg)
        f0 = gl.load(rg + 1)
        f1 = gl.load(rg + 2)
        t1 = gl.load(rg + 3)
    elif HAS_BAND:
        t0, f0, f1, t1 = key_tile_range(i0, Sq, Sk, lo, hi, BM, BN)
    else:
        t0 = 0
        f0 = 0
        f1 = Sk // BN
        f1 = gl.where(i0 + BM <= Sq, f1, 0)
        t1 = (Sk + BN - 1) // BN
    return t0, f0, f1, t1 - t0


@gluon.jit
def ring(k_desc, v_desc, NC: gl.constexpr, STAGES: gl.constexpr):
    """The forward's K / V ring [STAGES, 1, 1, BN, D] and its barriers, initialised (after
    the caller's Q buffers): per consumer Q ready and its ping-pong turn, per stage K / V
    ready and empty (one arrive per consumer) -> k_smem, v_smem, q_bar, turn, k_bar,
    v_bar, k_empty, v_empty."""
    dt: gl.constexpr = k_desc.dtype
    BN: gl.constexpr = k_desc.block_type.shape[2]
    D: gl.constexpr = k_desc.block_type.shape[3]
    k_smem = gl.allocate_shared_memory(dt, [STAGES, 1, 1, BN, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dt, [STAGES, 1, 1, BN, D], v_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [NC, 1], mbarrier.MBarrierLayout())
    turn = gl.allocate_shared_memory(gl.int64, [NC, 1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_bar = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for w in gl.static_range(NC):
        mbarrier.init(q_bar.index(w), count=1)
        mbarrier.init(turn.index(w), count=1)
    for st in gl.static_range(STAGES):
        mbarrier.init(k_bar.index(st), count=1)
        mbarrier.init(v_bar.index(st), count=1)
        mbarrier.init(k_empty.index(st), count=NC)       # one arrive per consumer
        mbarrier.init(v_empty.index(st), count=NC)
    fence_async_shared()
    return k_smem, v_smem, q_bar, turn, k_bar, v_bar, k_empty, v_empty


@gluon.jit
def fwd_ws_kernel(q_desc, k_desc, v_desc, o_desc, LSE, H, G, Sq, Sk, qk_scale, scale, lo, hi,
                  RT, rt_b, rt_h, QID, KID, sqid_b, skid_b, KM, skm_b, skm_h, skm_q, skm_k,
                  HAS_BAND: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                  num_warps: gl.constexpr,
                  NC: gl.constexpr = 2, ARRAY: gl.constexpr = False, DOCS: gl.constexpr = 0,
                  HAS_KEEP: gl.constexpr = False, SLOPES=None, sl_b=None, cap=None,
                  adiag=None, SINKS=None, SOFTCAP: gl.constexpr = 0,
                  ALIBI: gl.constexpr = False, HAS_SINKS: gl.constexpr = False):
    """Grid (cdiv(Sq, NC * RM), B * H), num_warps = 4 (consumer 0; the workers add
    4 * (NC - 1) + 1).  q/o_desc: [B, H, Sq, D] blocks [1, 1, RM, D]; k/v_desc:
    [B, Hkv, Sk, D] blocks [1, 1, BN, D]; LSE fp32 [2, B * H * Sq] (max, log_norm).
    qk_scale = scale * log2(e); band masks through lo / hi (open: +-2^30).  NC: consumer
    warpgroups (2 or 3), taking turns (module doc).  ARRAY (Documents / KeepMask, fwd_masks): the key tiles of
    query tile pid_m come from the range table RT int32 [Bm, Hm, nQ, 4] at this kernel's
    tile BM x BN (row b * rt_b + h * rt_h + pid_m; 0 strides where broadcast): (t0, f0,
    f1, t1), [f0, f1) unmasked; the band (HAS_BAND) is in the table and masked on the
    edge tiles as without ARRAY.  Documents (DOCS 1): QID int32 [Bd, Sq] / KID [Bd, Sk]
    ids with batch strides sqid_b / skid_b (0: one row); DOCS 2 (k ids sorted): QID int32
    [Bd, 2, Sq], per query the first and one past the last key of its document (an
    empty interval where none), KID unused; KeepMask: uint8 KM with element strides
    skm_b, skm_h, skm_q, skm_k (0 where broadcast).  Score modifiers (no array mask;
    off, the arguments stay None and the kernel is the plain one): SOFTCAP the cap
    ``cap`` (c tanh(s / c), fwd_masks.mod_scores), ALIBI the slopes SLOPES fp32 [Ba, H]
    (batch stride sl_b, 0: one row) at distance |i - j + adiag|, HAS_SINKS the sinks
    SINKS fp32 [H] folded into the statistics (epilogue); where one is on, all five
    arguments are passed (placeholders for the others)."""
    gl.static_assert(num_warps == 4, "consumer 0 is one warpgroup")
    gl.static_assert((NC == 2) or (NC == 3), "two or three consumer warpgroups")
    gl.static_assert(ARRAY or not (DOCS or HAS_KEEP), "array masks come with ARRAY")
    gl.static_assert(not (ARRAY and (SOFTCAP or ALIBI or HAS_SINKS)),
                     "score modifiers without array masks")
    RM: gl.constexpr = q_desc.block_type.shape[2]
    D: gl.constexpr = q_desc.block_type.shape[3]
    BN: gl.constexpr = k_desc.block_type.shape[2]
    BM: gl.constexpr = NC * RM
    dt: gl.constexpr = q_desc.dtype

    n_m = gl.num_programs(0)
    pid_m = gl.program_id(0)
    if HAS_BAND:                      # the longest rows of a causal band first
        pid_m = n_m - 1 - pid_m
    bh = gl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // G
    i0 = pid_m * BM

    q_smem = gl.allocate_shared_memory(dt, [NC, 1, 1, RM, D], q_desc.layout)
    k_smem, v_smem, q_bar, turn, k_bar, v_bar, k_empty, v_empty = ring(k_desc, v_desc, NC,
                                                                       STAGES)

    t0, f0, f1, n = tile_keys(pid_m, b, h, Sq, Sk, lo, hi, RT, rt_b, rt_h, HAS_BAND, ARRAY,
                              BM, BN)
    QIDb = QID + b * sqid_b
    KIDb = KID + b * skid_b
    KMb = KM + b.to(gl.int64) * skm_b + h.to(gl.int64) * skm_h

    # the consumers' arguments but their constexprs (_consumer's ``ca``)
    ca = (q_desc, o_desc, q_smem, q_bar, k_smem, v_smem, k_bar, v_bar, k_empty, v_empty, turn,
          LSE, b, h, bh, i0, Sq, Sk, t0, f0, f1, n, lo, hi, qk_scale, scale, QIDb, KIDb, KMb,
          skm_q, skm_k)
    if NC == 2:
        gl.warp_specialize(
            [(_consumer, (ca, HAS_BAND, STAGES, BN, 0, NC, ARRAY, DOCS, HAS_KEEP, SLOPES,
                          sl_b, cap, adiag, SINKS, SOFTCAP, ALIBI, HAS_SINKS)),
             (_consumer, (ca, HAS_BAND, STAGES, BN, 1, NC, ARRAY, DOCS, HAS_KEEP, SLOPES,
                          sl_b, cap, adiag, SINKS, SOFTCAP, ALIBI, HAS_SINKS)),
             (produce, (k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, k_empty, v_empty, b,
                        hk, t0, n, 0, STAGES, BN))],
            [4, 1], [CONSUMER_REGS, 24])
    else:
        gl.warp_specialize(
            [(_consumer, (ca, HAS_BAND, STAGES, BN, 0, NC, ARRAY, DOCS, HAS_KEEP, SLOPES,
                          sl_b, cap, adiag, SINKS, SOFTCAP, ALIBI, HAS_SINKS)),
             (_consumer, (ca, HAS_BAND, STAGES, BN, 1, NC, ARRAY, DOCS, HAS_KEEP, SLOPES,
                          sl_b, cap, adiag, SINKS, SOFTCAP, ALIBI, HAS_SINKS)),
             (_consumer, (ca, HAS_BAND, STAGES, BN, 2, NC, ARRAY, DOCS, HAS_KEEP, SLOPES,
                          sl_b, cap, adiag, SINKS, SOFTCAP, ALIBI, HAS_SINKS)),
             (produce, (k_desc, v_desc, k_smem, v_smem, k_bar, v_bar, k_empty, v_empty, b,
                        hk, t0, n, 0, STAGES, BN))],
            [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, 24])
