"""Warp-specialised Gluon backward for Hopper (sm_90a) with dQ inside and TRANSPOSED
consumers (configs 'wdkdvq…ht', HopperBwdConfig.trans): bwd_ws_dq_kernel's kernel
(one dQ partial per key tile, its column halves staged by the two consumers and added in
a fixed order by the dQ-writer warp: bitwise repeatable) whose consumers compute S^T and
dP^T with their keys as the wgmma rows, so that P^T and dS^T feed the dV / dK products
from registers (bwd_ws_t_parts.consumer_t); dS^T still meets the other consumer's in
shared memory for the dQ products.

Shape legend: B batch, H query heads, Hkv kv heads, G = H / Hkv, Sq / Sk queries / keys,
D head dim, RN = 64 key rows per consumer, BN = 2 * RN the key tile of a program, BM = 64
the query tile (128 at D=64), DH = D / 2, STAGES the depth of the Q / dO ring.

One program per (key tile, b * Hkv + hk); ``gl.warp_specialize`` partitions: consumer 0
and 1 (4 warps each, setmaxnreg CONSUMER_REGS; bwd_ws_t_parts.consumer_t), the TMA
producer warp (bwd_ws_parts.producer) and the dQ writer warp (bwd_ws_dq_kernel._writer),
with bwd_ws_dq_kernel's barriers, add order, counters and "ds ready" mbarrier;
the module doc of bwd_ws_dq_kernel describes them.  Shared memory: K, V [2, RN, D], the
Q / dO ring and its row statistics, dS^T [2 parities x 2 consumers, RN, BM], the staged
fp32 [2, BM, DH] (no P buffers).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .bwd_ws_dq_kernel import _writer
from .bwd_ws_parts import ws_barriers, producer
from .bwd_ws_t_parts import consumer_t
from .dq_turns import visit_offset
from .tile_ranges import key_tile_program, key_tile_queries

__all__ = ["dkdvq_ws_t_kernel"]


@gluon.jit(do_not_specialize=["NBH", "H", "G", "Sq", "Sk", "lo", "hi", "ORDER", "sl_b",
                               "adiag"])  # one compile per config
def dkdvq_ws_t_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dqa_desc, L2,
                      DELTA, SEM, NBH, H, G, Sq, Sk, scale, lo, hi, ORDER,
                      HAS_BAND: gl.constexpr, STAGES: gl.constexpr,
                      CONSUMER_REGS: gl.constexpr, WRITER_REGS: gl.constexpr,
                      num_warps: gl.constexpr, LATE: gl.constexpr = False, SLOPES=None,
                      sl_b=None, cap=None, adiag=None, SOFTCAP: gl.constexpr = 0,
                      ALIBI: gl.constexpr = False):
    """bwd_ws_dq_kernel.dkdvq_ws_kernel's arguments and grid (nkv, B * Hkv), without
    array masks (Documents / KeepMask run on dkdvq_ws_kernel).  The producer stages the
    queries' statistics (bwd_ws_t_parts.consumer_t reads them there).  LATE: the
    writer's late counter release (HopperBwdConfig.late_release).  SLOPES ... ALIBI: the
    score modifiers, as bwd_ws_kernel's."""
    gl.static_assert(num_warps == 4, "consumer 0 is one warpgroup")
    BM: gl.constexpr = q_desc.block_type.shape[2]
    D: gl.constexpr = q_desc.block_type.shape[3]
    RN: gl.constexpr = k_desc.block_type.shape[2]
    BN: gl.constexpr = 2 * RN
    DH: gl.constexpr = dqa_desc.block_type.shape[4]
    dt: gl.constexpr = q_desc.dtype
    gl.static_assert(RN == 64, "64 key rows per consumer warpgroup")
    gl.static_assert((BM == 64) | ((BM == 128) & (D == 64)),
                     "64 query rows per tile (128 at D=64)")
    gl.static_assert(DH * 2 == D, "dQ accumulator blocks of D / 2 columns")
    ds_l: gl.constexpr = gl.NVMMASharedLayout.get_default_for([RN, BM], dt)

    pid_n, b, hk, j0 = key_tile_program(H, G, BN)   # key tile pid_n of kv head hk, batch b

    k_smem = gl.allocate_shared_memory(dt, [2, 1, 1, RN, D], k_desc.layout)
    v_smem = gl.allocate_shared_memory(dt, [2, 1, 1, RN, D], v_desc.layout)
    q_smem = gl.allocate_shared_memory(dt, [STAGES, 1, 1, BM, D], q_desc.layout)
    do_smem = gl.allocate_shared_memory(dt, [STAGES, 1, 1, BM, D], do_desc.layout)
    ds_smem = gl.allocate_shared_memory(dt, [4, RN, BM], ds_l)      # dS^T, 2 x 2 slots
    # [consumer, 1, row group g, b0, b1, DH]: row 8 g + 4 b1 + b0
    dqs = gl.allocate_shared_memory(gl.float32, [2, 1, BM // 8, 4, 2, DH], dqa_desc.layout)
    # the queries' statistics, staged by the producer: rows 4 * stage + (0 max, 1 log2(e)
    # * log_norm, 2 delta), [BM] each
    st_sl: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, order=[0])
    st_smem = gl.allocate_shared_memory(gl.float32, [4 * STAGES, BM], st_sl)
    kv_bar, dq_full, dq_empty, ds_bar, q_bar, do_bar, empty = ws_barriers(STAGES, True)

    # query tiles [s0, s1), unmasked in [g0, g1); n_tot (head of the group, query tile)
    # pairs, flattened; the query tiles of each head visited from index off on
    s0, g0, g1, s1, n_tot, n_div = key_tile_queries(j0, G, Sq, Sk, lo, hi, BM, BN, HAS_BAND)
    nq = (Sq + BM - 1) // BM
    nkv = (Sk + BN - 1) // BN
    off = visit_offset(pid_n, nq, nkv, HAS_BAND, ORDER)

    gl.warp_specialize(   # the transposed consumers, the producer, the dQ writer
        [(consumer_t, (k_desc, v_desc, dk_desc, dv_desc, q_smem, do_smem, k_smem, v_smem,
                       ds_smem, dqs, kv_bar, q_bar, do_bar, empty, dq_full, dq_empty,
                       ds_bar, L2, DELTA, b, hk, H, G, Sq, Sk, j0, s0, g0, g1, n_div, off,
                       n_tot, scale, lo, hi, HAS_BAND, STAGES, 0, st_smem, SLOPES, sl_b,
                       cap, adiag, SOFTCAP, ALIBI)),
         (consumer_t, (k_desc, v_desc, dk_desc, dv_desc, q_smem, do_smem, k_smem, v_smem,
                       ds_smem, dqs, kv_bar, q_bar, do_bar, empty, dq_full, dq_empty,
                       ds_bar, L2, DELTA, b, hk, H, G, Sq, Sk, j0, s0, g0, g1, n_div, off,
                       n_tot, scale, lo, hi, HAS_BAND, STAGES, 1, st_smem, SLOPES, sl_b,
                       cap, adiag, SOFTCAP, ALIBI)),
         (producer, (q_desc, do_desc, q_smem, do_smem, q_bar, do_bar, empty, b, hk, G, s0,
                     n_div, off, n_tot, STAGES, BM, st_smem, L2, DELTA, H, Sq, True,
                     BM > 64)),
         (_writer, (dqa_desc, dqs, dq_full, dq_empty, SEM, NBH, b, hk, H, G, Sk, pid_n, s0,
                    n_div, off, n_tot, nq, lo, hi, ORDER, HAS_BAND, BM, BN, None, 0, False,
                    LATE))],
        [4, 1, 1], [CONSUMER_REGS, 24, WRITER_REGS])
