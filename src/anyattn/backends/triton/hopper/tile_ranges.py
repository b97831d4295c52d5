"""Which tiles a Hopper program visits: the key tiles of a query tile (forward) and the
query tiles of a key tile (backward) under a band lo <= j - i <= hi, the portable
kernels' rule, and the backward's program-to-key-tile mapping.

Shape legend: Sq / Sk queries / keys, BM / BN the query / key tile, H query heads,
G = H / Hkv.  A range [t0, t1) holds every visited tile; its sub-range [f0, f1) the
tiles that need no mask (fully kept and in bounds).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

__all__ = ["cdiv_pos", "div_pos", "key_tile_range", "query_tile_range", "key_tile_program",
           "key_tile_queries", "key_tile_table"]


@gluon.jit
def cdiv_pos(x, b):
    """ceil(x / b) for x of any sign, clamped at 0."""
    return (gl.maximum(x, 0) + b - 1) // b


@gluon.jit
def div_pos(x, b):
    """floor(x / b) for x of any sign, clamped at 0."""
    return gl.maximum(x, 0) // b


@gluon.jit
def key_tile_range(i0, Sq, Sk, lo, hi, BM: gl.constexpr, BN: gl.constexpr):
    """Key tiles seen by queries [i0, i0 + BM) under lo <= j - i <= hi: all in [t0, t1),
    unmasked (fully kept, in bounds) in [f0, f1) (the portable kernels' rule)."""
    i1 = gl.minimum(i0 + BM, Sq)
    nk = (Sk + BN - 1) // BN
    t0 = div_pos(i0 + lo, BN)
    t1 = gl.minimum(nk, cdiv_pos(i1 + hi, BN))
    t1 = gl.maximum(t0, t1)
    f0 = cdiv_pos(lo + i1 - 1, BN)
    f1 = gl.minimum(div_pos(hi + i0 + 1, BN), Sk // BN)
    f1 = gl.where(i0 + BM <= Sq, f1, f0)
    f0 = gl.minimum(gl.maximum(f0, t0), t1)
    f1 = gl.minimum(gl.maximum(f1, f0), t1)
    return t0, f0, f1, t1


@gluon.jit
def query_tile_range(j0, Sq, Sk, lo, hi, BM: gl.constexpr, BN: gl.constexpr):
    """Query tiles of BM rows that see keys [j0, j0 + BN) under lo <= j - i <= hi: all in
    [s0, s1), unmasked (fully kept, in bounds) in [g0, g1)."""
    j1 = gl.minimum(j0 + BN, Sk)
    nq = (Sq + BM - 1) // BM
    s0 = div_pos(j0 - hi, BM)
    s1 = gl.minimum(nq, cdiv_pos(j1 - lo, BM))             # last query j1 - 1 - lo
    s1 = gl.maximum(s0, s1)
    g0 = cdiv_pos(j1 - 1 - hi, BM)
    g1 = gl.minimum(div_pos(j0 - lo + 1, BM), Sq // BM)
    g1 = gl.where(j0 + BN <= Sk, g1, g0)
    g0 = gl.minimum(gl.maximum(g0, s0), s1)
    g1 = gl.minimum(gl.maximum(g1, g0), s1)
    return s0, g0, g1, s1


@gluon.jit
def key_tile_program(H, G, BN: gl.constexpr):
    """This program's key tile -> (pid_n, b, hk, j0): grid (key tiles, B * Hkv), the
    tile's first key j0 = pid_n * BN, kv head hk of batch b (Hkv = H // G)."""
    pid_n = gl.program_id(0)
    bhk = gl.program_id(1)
    Hkv = H // G
    return pid_n, bhk // Hkv, bhk % Hkv, pid_n * BN


@gluon.jit
def key_tile_queries(j0, G, Sq, Sk, lo, hi, BM: gl.constexpr, BN: gl.constexpr,
                     HAS_BAND: gl.constexpr):
    """What the key tile [j0, j0 + BN) visits -> (s0, g0, g1, s1, n_tot, n_div): query
    tiles [s0, s1), unmasked in [g0, g1) (query_tile_range under a band; without one
    every tile, unmasked when the key tile lies in bounds), n_tot = G * (s1 - s0) pairs
    (head of the group, query tile) and n_div = max(s1 - s0, 1)."""
    if HAS_BAND:
        s0, g0, g1, s1 = query_tile_range(j0, Sq, Sk, lo, hi, BM, BN)
    else:
        s0 = 0
        g0 = 0
        g1 = gl.where(j0 + BN <= Sk, Sq // BM, 0)
        s1 = (Sq + BM - 1) // BM
    n_t = s1 - s0
    return s0, g0, g1, s1, G * n_t, gl.maximum(n_t, 1)


@gluon.jit
def key_tile_table(CT, b, hk, pid_n, ct_b, ct_h, G):
    """key_tile_queries of a Documents / KeepMask key tile, from the column range table
    CT int32 [Bm, Hm, nkv, 8] (launch.bwd_mask_tables: s0, g0, g1, s1, off, 0, 0, 0 per
    key tile of (b, kv head hk); 0 strides where broadcast) -> (s0, g0, g1, s1, n_tot,
    n_div, off): query tiles [s0, s1) (every kept one of the kv head's group), fully kept
    in [g0, g1), visited from index off of the range on (the dQ add order's rotation)."""
    rg = CT + 8 * (b * ct_b + hk * ct_h + pid_n)
    s0 = gl.load(rg)
    g0 = gl.load(rg + 1)
    g1 = gl.load(rg + 2)
    s1 = gl.load(rg + 3)
    off = gl.load(rg + 4)
    n_t = s1 - s0
    return s0, g0, g1, s1, G * n_t, gl.maximum(n_t, 1), off
