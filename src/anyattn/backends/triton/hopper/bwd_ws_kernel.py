"""Warp-specialised Gluon dK/dV for Hopper (sm_90a): a TMA producer warp and two consumer
warpgroups that own disjoint key rows and never meet at a CTA barrier.

Shape legend: B batch, H query heads, Hkv kv heads, G = H / Hkv, Sq / Sk queries / keys,
D head dim, RN = 64 key rows per consumer, BN = 2 * RN the key tile of a program, BM = 64
the query tile, STAGES the depth of the Q / dO ring.

One program per (key tile, b * Hkv + hk); ``gl.warp_specialize`` partitions (bwd_ws_parts,
shared with bwd_ws_dq_kernel: the consumer without WITH_DQ):
  producer (1 warp, few registers): for every (query head of the group, query tile) that
      sees the key tile (band ranges: tile_ranges.query_tile_range, empty tiles skipped)
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
The consumers do not take turns: they drift apart only as the shared ring lets them.

The numerics are the portable backward's (kernels.py); every
dK / dV element has one owner and a fixed summation order: bitwise repeatable, no
atomics.  dQ stays with the portable kernel.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from .tile_ranges import key_tile_program, key_tile_queries, key_tile_table
from .bwd_ws_parts import consumer, producer, ws_barriers

__all__ = ["dkdv_ws_kernel"]


@gluon.jit(do_not_specialize=["H", "G", "Sq", "Sk", "lo", "hi", "ct_b", "ct_h", "siv_b",
                               "skid_b", "skm_b", "skm_h", "skm_q", "skm_k", "sl_b",
                               "adiag"])
def dkdv_ws_kernel(q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, L2, DELTA, H, G, Sq,
                   Sk, scale, lo, hi, HAS_BAND: gl.constexpr, STAGES: gl.constexpr,
                   CONSUMER_REGS: gl.constexpr, num_warps: gl.constexpr, CT=None,
                   ct_b=None, ct_h=None, IV=None, KID=None, siv_b=None, skid_b=None,
                   KM=None, skm_b=None, skm_h=None, skm_q=None, skm_k=None,
                   ARRAY: gl.constexpr = False,
                   DOCS: gl.constexpr = 0, HAS_KEEP: gl.constexpr = False, SLOPES=None,
                   sl_b=None, cap=None, adiag=None, SOFTCAP: gl.constexpr = 0,
                   ALIBI: gl.constexpr = False):
    """Grid (cdiv(Sk, 2 * RN), B * Hkv), num_warps = 4 (consumer 0; the workers add 4 + 1).
    q/do_desc: [B, H, Sq, D] blocks [1, 1, BM, D]; k/v/dk/dv_desc: [B, Hkv, Sk, D] blocks
    [1, 1, RN, D]; L2 fp32 [B * H, 2, Sq]; DELTA fp32 [B * H * Sq].  Band masks through
    lo / hi (open: +-2^30), one compile per config.  ARRAY (Documents / KeepMask): the
    query tiles of each key tile from the column range table CT (tile_ranges.
    key_tile_table; ct_b / ct_h its (b, kv head) strides), the edge tiles masked by
    bwd_ws_parts.array_keep: DOCS 1 q ids IV [Bd, Sq] and k ids KID [Bd, Sk] (batch
    strides siv_b / skid_b, 0: one row), DOCS 2 IV [Bd, 2, Sq] the key interval of each
    query's document; HAS_KEEP the keep bytes KM at element strides skm_b, skm_h,
    skm_q, skm_k (0 where broadcast).  Without ARRAY those stay None (the dense
    configs compile as before).  Score modifiers (no array mask; off, their arguments
    stay None): SOFTCAP the cap ``cap``, ALIBI the slopes SLOPES fp32 [Ba, H] (batch
    stride sl_b) at distance |i - j + adiag| (bwd_ws_parts.consumer); where one is on,
    all four arguments are passed.  Sinks need nothing here: the row statistics include
    them and the portable preprocess writes dsinks."""
    gl.static_assert(not (ARRAY and (SOFTCAP or ALIBI)), "score modifiers without array masks")
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
    # (and two barriers no partition waits on: they keep the shared-memory layout, and
    # with it ptxas's schedule of the kernel, the routed one)
    kv_bar, _, _, _, q_bar, do_bar, empty = ws_barriers(STAGES, False)

    # query tiles [s0, s1), unmasked in [g0, g1); n_tot (head of the group, query tile)
    # pairs, flattened
    if ARRAY:     # (the table's rotation is the dQ adds' business: tiles in order here)
        s0, g0, g1, s1, n_tot, n_div, _ = key_tile_table(CT, b, hk, pid_n, ct_b, ct_h, G)
        IVb = IV + b * siv_b
        KIDb = KID + b * skid_b
        KMb = KM + b.to(gl.int64) * skm_b
    else:
        s0, g0, g1, s1, n_tot, n_div = key_tile_queries(j0, G, Sq, Sk, lo, hi, BM, BN,
                                                        HAS_BAND)
        IVb, KIDb, KMb, skm_h, skm_q, skm_k = 0, 0, 0, 0, 0, 0    # (not read)
    gl.warp_specialize(   # bwd_ws_parts' partitions without dq (off 0: tiles in order)
        [(consumer, (k_desc, v_desc, dk_desc, dv_desc, q_smem, do_smem, k_smem, v_smem,
                     p_smem, ds_smem, None, kv_bar, q_bar, do_bar, empty, None, None, None,
                     L2, DELTA, b, hk, H, G, Sq, Sk, j0, s0, g0, g1, n_div, 0, n_tot, scale,
                     lo, hi, HAS_BAND, STAGES, 0, False, IVb, KIDb, KMb, skm_h, skm_q,
                     skm_k, ARRAY, DOCS, HAS_KEEP, None, SLOPES, sl_b, cap, adiag, SOFTCAP,
                     ALIBI)),
         (consumer, (k_desc, v_desc, dk_desc, dv_desc, q_smem, do_smem, k_smem, v_smem,
                     p_smem, ds_smem, None, kv_bar, q_bar, do_bar, empty, None, None, None,
                     L2, DELTA, b, hk, H, G, Sq, Sk, j0, s0, g0, g1, n_div, 0, n_tot, scale,
                     lo, hi, HAS_BAND, STAGES, 1, False, IVb, KIDb, KMb, skm_h, skm_q,
                     skm_k, ARRAY, DOCS, HAS_KEEP, None, SLOPES, sl_b, cap, adiag, SOFTCAP,
                     ALIBI)),
         (producer, (q_desc, do_desc, q_smem, do_smem, q_bar, do_bar, empty, b, hk, G, s0,
                     n_div, 0, n_tot, STAGES, BM))],
        [4, 1], [CONSUMER_REGS, 24])
