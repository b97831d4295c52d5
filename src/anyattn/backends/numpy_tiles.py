"""Tile kernels of the NumPy backend: blocked softmax forward, one-pass backward.

Shape legend: Sq/Sk queries/keys of one head, D head dim, ni/nj rows of one
query/key tile (<= bq/bk), G query heads per key/value head.

Three choices run through the kernels here:

* Scores are kept **transposed**, ``sT [nj, ni]`` (keys x queries).  The
  softmax reductions over keys then run along axis 0, which NumPy vectorises
  across the query columns (several times faster than a reduction along the
  contiguous axis), and the backward needs Pᵀ and dSᵀ for dV and dK anyway.
* Scores are in **base 2**: queries are pre-multiplied by ``scale * log2(e)``
  (and a bias by ``log2(e)``), so ``P = exp2(sT - m)``; ``exp2`` is ~1.6x
  faster than ``exp`` in NumPy's float32 SIMD loops.  ``lse`` is converted
  back to the natural log at the edges.
* **Extra GEMM columns** instead of elementwise passes: ``[k | 1]`` against
  ``[q2 | -lse2]`` gives ``s - lse`` and ``[v | 1]`` against ``[g | -delta]``
  gives ``dP - delta`` in the GEMMs themselves (the backward), and the
  bias-free forward (:func:`forward_rows_bounded`) subtracts a fixed per-row
  Cauchy-Schwarz bound the same way, so it needs no running max at all.

Every function works on one (batch, head) slice of 2-D arrays, writes only its
own output rows and uses O(bq*bk + (Sq+Sk)*D) scratch.  Loop orders are fixed,
so results are bitwise repeatable.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..masks import TILE_EMPTY, TILE_FULL, TILE_PARTIAL, ResolvedMask

__all__ = ["TilePlan", "TileCounts", "forward_rows", "forward_rows_bounded", "backward_keys",
           "BackwardHeads", "with_ones_column", "key_tile_norms", "LOG2E", "LN2"]

LOG2E = 1.4426950408889634  # log2(e)
LN2 = 0.6931471805599453    # ln(2)


@dataclass
class TileCounts:
    """How many score tiles a unit of work computed (for tests and benchmarks)."""

    full: int = 0       # tiles computed without any mask work
    partial: int = 0    # tiles that needed a keep-array
    skipped: int = 0    # TILE_EMPTY tiles never touched

    def add(self, other: "TileCounts") -> None:
        self.full += other.full
        self.partial += other.partial
        self.skipped += other.skipped

    @property
    def computed(self) -> int:
        return self.full + self.partial


@dataclass
class TilePlan:
    """What every tile of one call needs to know; shared read-only by the workers.

    ``bias``: the 4-D bias view [Bb, Hb, Sqb, Skb] (each 1 or full) or None.
    ``codes``: tile map int8 [Bm, Hm, nQ, nK] from ``mask.tile_map`` or None
    (no mask: every tile full).
    """

    bq: int
    bk: int
    sq: int
    sk: int
    dtype: np.dtype
    mask: ResolvedMask
    bias: Optional[np.ndarray]
    codes: Optional[np.ndarray]
    _band_cache: Dict[Tuple[int, int, int], np.ndarray] = field(default_factory=dict)

    @property
    def nq(self) -> int:
        return -(-self.sq // self.bq)

    @property
    def nk(self) -> int:
        return -(-self.sk // self.bk)

    @property
    def band_only(self) -> bool:
        m = self.mask
        return m.q_ids is None and m.keep is None

    def codes_bh(self, b: int, h: int) -> Optional[np.ndarray]:
        """Tile codes [nQ, nK] of one (batch, query head), or None (all full)."""
        if self.codes is None:
            return None
        c = self.codes
        return c[b if c.shape[0] > 1 else 0, h if c.shape[1] > 1 else 0]

    def q_range(self, it: int) -> Tuple[int, int]:
        i0 = it * self.bq
        return i0, min(i0 + self.bq, self.sq)

    def k_range(self, jt: int) -> Tuple[int, int]:
        j0 = jt * self.bk
        return j0, min(j0 + self.bk, self.sk)

    # ------------------------------------------------------------ per-tile terms
    def excluded_t(self, b: int, h: int, i0: int, i1: int, j0: int, j1: int) -> np.ndarray:
        """bool [nj, ni], True where the mask drops the pair (transposed tile)."""
        m = self.mask
        if self.band_only:
            key = (j0 - i0, j1 - j0, i1 - i0)  # a band tile depends on j0 - i0 only
            ex = self._band_cache.get(key)
            if ex is None:
                d = np.arange(j0, j1)[:, None] - np.arange(i0, i1)[None, :]  # [nj, ni] j - i
                ex = np.zeros(d.shape, dtype=bool)
                if m.band_lo is not None:
                    ex |= d < m.band_lo
                if m.band_hi is not None:
                    ex |= d > m.band_hi
                self._band_cache[key] = ex
            return ex
        keep = m.tile_keep(b, h, i0, i1, j0, j1)            # [ni, nj]
        out = np.empty((j1 - j0, i1 - i0), dtype=bool)
        return np.logical_not(keep.T, out=out)              # [nj, ni]

    def bias_t(self, b: int, h: int, i0: int, i1: int, j0: int, j1: int) -> np.ndarray:
        """The bias on one tile, transposed: [nj|1, ni|1] (broadcast dims stay 1)."""
        x = self.bias
        bb = b if x.shape[0] > 1 else 0
        hb = h if x.shape[1] > 1 else 0
        rows = slice(i0, i1) if x.shape[2] > 1 else slice(0, 1)
        cols = slice(j0, j1) if x.shape[3] > 1 else slice(0, 1)
        return x[bb, hb, rows, cols].T

    def add_dbias(self, dbias: np.ndarray, dst_t: np.ndarray, b: int, h: int,
                  i0: int, i1: int, j0: int, j1: int) -> None:
        """dbias[bias slice of this tile] += dSᵀ summed over the bias's broadcast dims."""
        shape = dbias.shape
        t = dst_t                                            # [nj, ni]
        if shape[3] == 1:
            t = t.sum(axis=0, keepdims=True)                 # [1, ni]
        if shape[2] == 1:
            t = t.sum(axis=1, keepdims=True)                 # [nj|1, 1]
        bb = b if shape[0] > 1 else 0
        hb = h if shape[1] > 1 else 0
        rows = slice(i0, i1) if shape[2] > 1 else slice(0, 1)
        cols = slice(j0, j1) if shape[3] > 1 else slice(0, 1)
        dbias[bb, hb, rows, cols] += t.T


def _kept_tiles(codes_row: Optional[np.ndarray], n: int) -> List[Tuple[int, int]]:
    """[(tile index, code)] of the non-empty tiles along one row/column of a tile map."""
    if codes_row is None:
        return [(t, TILE_FULL) for t in range(n)]
    idx = np.flatnonzero(codes_row != TILE_EMPTY)
    return [(int(t), int(codes_row[t])) for t in idx]


def forward_rows(plan: TilePlan, b: int, h: int, q2: np.ndarray, k: np.ndarray,
                 v: np.ndarray, out: np.ndarray, lse: np.ndarray,
                 q_tiles: Sequence[int]) -> TileCounts:
    """Forward of one (batch b, query head h) over the query tiles ``q_tiles``.

    q2 [Sq, D]: queries already scaled by ``scale * log2(e)``; k, v [Sk, D]
    (any row stride, unit column stride); writes out [Sq, D] and lse [Sq]
    (natural log) on the rows of ``q_tiles`` only.
    """
    dt = plan.dtype
    D = v.shape[1]
    counts = TileCounts()
    codes = plan.codes_bh(b, h)
    sbuf = np.empty(plan.bq * plan.bk, dtype=dt)   # scores of one tile
    ones = np.ones(plan.bk, dtype=dt)              # row sums as a GEMV
    neg_inf = dt.type(-np.inf)
    for it in q_tiles:
        i0, i1 = plan.q_range(it)
        ni = i1 - i0
        qt = q2[i0:i1]                                         # [ni, D]
        m = np.full(ni, neg_inf, dtype=dt)                     # running max (log2 units)
        l = np.zeros(ni, dtype=dt)                             # running sum of exp2
        acc = np.zeros((ni, D), dtype=dt)                      # running P·V
        tiles = _kept_tiles(None if codes is None else codes[it], plan.nk)
        counts.skipped += plan.nk - len(tiles)
        for jt, code in tiles:
            j0, j1 = plan.k_range(jt)
            nj = j1 - j0
            st = sbuf[:nj * ni].reshape(nj, ni)
            np.matmul(k[j0:j1], qt.T, out=st)                  # sT [nj, ni]
            if plan.bias is not None:
                st += np.multiply(plan.bias_t(b, h, i0, i1, j0, j1), LOG2E, dtype=dt)
            if code == TILE_PARTIAL:
                np.copyto(st, neg_inf, where=plan.excluded_t(b, h, i0, i1, j0, j1))
                counts.partial += 1
            else:
                counts.full += 1
            m_new = np.maximum(m, st.max(axis=0))              # [ni]
            # rows that have kept nothing yet: subtract 0, not -inf (no -inf - -inf)
            m_use = np.where(m_new == neg_inf, dt.type(0), m_new)
            st -= m_use                                         # [nj, ni]
            np.exp2(st, out=st)                                 # P~ [nj, ni]
            corr = np.exp2(m - m_use)                           # [ni] rescale old terms
            l *= corr
            l += np.matmul(ones[:nj], st)                       # [ni]
            acc *= corr[:, None]
            acc += np.matmul(st.T, v[j0:j1])                    # [ni, D]
            m = m_new
        empty = l == 0                                          # no kept key (NaN stays)
        np.divide(acc, l[:, None], out=acc, where=~empty[:, None])
        acc[empty] = 0
        out[i0:i1] = acc
        with np.errstate(divide="ignore"):
            lrow = (m + np.log2(l)) * dt.type(LN2)
        lrow[empty] = -np.inf
        lse[i0:i1] = lrow
    return counts


#: a row whose bounded-softmax sum falls below this may have lost precision to
#: underflow (its true max lies far below the bound): it is recomputed exactly.
UNDERFLOW_SUM = {np.dtype(np.float32): 2.0 ** -80, np.dtype(np.float64): 2.0 ** -800}


def with_ones_column(x: np.ndarray, dt: np.dtype) -> np.ndarray:
    """[S, D] -> [S, D+1] = [x | 1] (contiguous): one GEMM then also adds a per-row term."""
    out = np.empty((x.shape[0], x.shape[1] + 1), dtype=dt)
    out[:, :-1] = x
    out[:, -1] = 1
    return out


def key_tile_norms(plan: TilePlan, k: np.ndarray) -> np.ndarray:
    """max_j |k_j| per key tile, [nK] (NaN keys ignored: they propagate through the GEMM)."""
    norms = np.sqrt(np.einsum("jd,jd->j", k, k))                    # [Sk]
    pad = plan.nk * plan.bk - plan.sk
    if pad:
        norms = np.concatenate([norms, np.zeros(pad, dtype=norms.dtype)])
    return np.fmax.reduce(norms.reshape(plan.nk, plan.bk), axis=1)  # [nK]


def forward_rows_bounded(plan: TilePlan, b: int, h: int, q2: np.ndarray, ka: np.ndarray,
                         v: np.ndarray, knorm: np.ndarray, out: np.ndarray, lse: np.ndarray,
                         q_tiles: Sequence[int], k: np.ndarray) -> TileCounts:
    """Forward without a running max, for problems without a bias.

    Each query row i uses a fixed bound instead of the running max:
    ``c_i = |q2_i| * max_{kept key tiles} |k_j| >= s_ij`` (Cauchy-Schwarz), so
    ``P~ = exp2(s - c) <= 1`` never overflows and no rescaling is needed: per
    tile one GEMM gives ``s - c`` (``ka = [k | 1]`` against ``[q2 | -c]``), then
    exp2, a row-sum GEMV and the P·V GEMM.  Rows whose sum ends below
    :data:`UNDERFLOW_SUM` (bound far above the true max) are recomputed with
    the exact running-max path, :func:`forward_rows`.

    q2 [Sq, D] scaled queries; ka [Sk, D+1]; v [Sk, D]; knorm [nK]; k [Sk, D]
    (for the fallback); writes out [Sq, D], lse [Sq] on the rows of ``q_tiles``.
    """
    dt = plan.dtype
    D = v.shape[1]
    counts = TileCounts()
    codes = plan.codes_bh(b, h)
    sbuf = np.empty(plan.bq * plan.bk, dtype=dt)
    ones = np.ones(plan.bk, dtype=dt)
    tiny = UNDERFLOW_SUM[dt]
    qnorm = np.sqrt(np.einsum("id,id->i", q2, q2))                  # [Sq]
    for it in q_tiles:
        i0, i1 = plan.q_range(it)
        ni = i1 - i0
        tiles = _kept_tiles(None if codes is None else codes[it], plan.nk)
        counts.skipped += plan.nk - len(tiles)
        qa = np.empty((ni, D + 1), dtype=dt)                          # [q2 | -c]
        qa[:, :D] = q2[i0:i1]
        kmax = np.fmax.reduce(knorm[[t for t, _ in tiles]]) if tiles else dt.type(0)
        np.multiply(qnorm[i0:i1], -kmax, out=qa[:, D])
        l = np.zeros(ni, dtype=dt)                                    # sum of exp2(s - c)
        acc = np.zeros((ni, D), dtype=dt)                             # P~·V
        seen = np.zeros(ni, dtype=bool)                               # row kept some key
        for jt, code in tiles:
            j0, j1 = plan.k_range(jt)
            nj = j1 - j0
            st = sbuf[:nj * ni].reshape(nj, ni)
            np.matmul(ka[j0:j1], qa.T, out=st)                        # s - c, [nj, ni]
            np.exp2(st, out=st)                                       # P~ [nj, ni]
            if code == TILE_PARTIAL:
                # zero the dropped pairs after exp2: exp2(-inf) takes NumPy's slow
                # special-value path (~5x); c bounds every score, so no overflow
                ex = plan.excluded_t(b, h, i0, i1, j0, j1)
                np.copyto(st, dt.type(0), where=ex)
                seen |= ~np.logical_and.reduce(ex, axis=0)
                counts.partial += 1
            else:
                seen[:] = True
                counts.full += 1
            l += np.matmul(ones[:nj], st)                             # [ni]
            acc += np.matmul(st.T, v[j0:j1])                          # [ni, D]
        if np.any(seen & (l < tiny)):   # underflow risk (or a row of -inf/NaN bound)
            counts.add(forward_rows(plan, b, h, q2, k, v, out, lse, [it]))
            continue
        empty = ~seen
        np.divide(acc, l[:, None], out=acc, where=~empty[:, None])
        acc[empty] = 0
        out[i0:i1] = acc
        with np.errstate(divide="ignore"):
            lrow = (np.log2(l) - qa[:, D]) * dt.type(LN2)
        lrow[empty] = -np.inf
        lse[i0:i1] = lrow
    return counts


@dataclass
class BackwardHeads:
    """Per-query-head inputs of one key/value head's backward (lists of length G).

    q2a [Sq, D+1] = [q·scale·log2(e) | -lse2] (lse2: lse in log2 units, -inf
    replaced by +inf so that empty rows get P = 0); q [Sq, D] raw queries;
    ga [Sq, D+1] = [dout | -delta] with delta = rowsum(dout * out); dq [Sq, D]
    accumulators (unscaled: the caller multiplies by ``scale``) or None; heads:
    the query-head indices.  The extra columns let one GEMM against
    ``[k | 1]`` / ``[v | 1]`` produce ``s - lse`` and ``dP - delta`` directly.
    """

    heads: List[int]
    q2a: List[np.ndarray]
    q: List[np.ndarray]
    ga: List[np.ndarray]
    dq: Optional[List[np.ndarray]]


def backward_keys(plan: TilePlan, b: int, hs: BackwardHeads, ka: np.ndarray, va: np.ndarray,
                  dk: Optional[np.ndarray], dv: Optional[np.ndarray],
                  dbias: Optional[np.ndarray], k_tiles: Sequence[int],
                  scale: float) -> TileCounts:
    """Backward of one (batch b, kv head) over the key tiles ``k_tiles``.

    Loops key tiles x query heads of the group x query tiles, recomputing
    P = exp2(s - lse) per tile: dv[j] += Pᵀ g, dk[j] += scale·dSᵀ q (both
    finished per key tile, rows of ``k_tiles`` only), dq[h] += dS k (full
    accumulators, unscaled), dbias += dS (summed over its broadcast dims).
    ka, va [Sk, D+1] = [k | 1], [v | 1]; dk, dv [Sk, D] outputs or None;
    dbias [Bb, Hb, Sqb, Skb] or None.
    """
    dt = plan.dtype
    D = va.shape[1] - 1
    counts = TileCounts()
    need_ds = dk is not None or hs.dq is not None or dbias is not None
    sbuf = np.empty(plan.bq * plan.bk, dtype=dt)   # P tile
    pbuf = np.empty(plan.bq * plan.bk, dtype=dt)   # dP / dS tile
    codes = [plan.codes_bh(b, h) for h in hs.heads]
    for jt in k_tiles:
        j0, j1 = plan.k_range(jt)
        nj = j1 - j0
        kta, vta = ka[j0:j1], va[j0:j1]                        # [nj, D+1]
        kt = kta[:, :D]                                         # [nj, D]
        dk_acc = np.zeros((nj, D), dtype=dt) if dk is not None else None
        dv_acc = np.zeros((nj, D), dtype=dt) if dv is not None else None
        for gi, h in enumerate(hs.heads):
            c = codes[gi]
            tiles = _kept_tiles(None if c is None else c[:, jt], plan.nq)
            counts.skipped += plan.nq - len(tiles)
            for it, code in tiles:
                i0, i1 = plan.q_range(it)
                ni = i1 - i0
                st = sbuf[:nj * ni].reshape(nj, ni)
                np.matmul(kta, hs.q2a[gi][i0:i1].T, out=st)    # s - lse, [nj, ni]
                if plan.bias is not None:
                    st += np.multiply(plan.bias_t(b, h, i0, i1, j0, j1), LOG2E, dtype=dt)
                with np.errstate(over="ignore"):                # dropped pairs may overflow
                    np.exp2(st, out=st)                         # Pᵀ [nj, ni]
                if code == TILE_PARTIAL:
                    # zeroed after exp2: exp2(-inf) is NumPy's slow special-value path
                    np.copyto(st, dt.type(0), where=plan.excluded_t(b, h, i0, i1, j0, j1))
                    counts.partial += 1
                else:
                    counts.full += 1
                gta = hs.ga[gi][i0:i1]                          # [ni, D+1]
                if dv_acc is not None:
                    dv_acc += np.matmul(st, gta[:, :D])         # [nj, D]
                if not need_ds:
                    continue
                dst = pbuf[:nj * ni].reshape(nj, ni)
                np.matmul(vta, gta.T, out=dst)                  # dPᵀ - delta, [nj, ni]
                dst *= st                                       # dSᵀ [nj, ni]
                if dbias is not None:
                    plan.add_dbias(dbias, dst, b, h, i0, i1, j0, j1)
                if dk_acc is not None:
                    dk_acc += np.matmul(dst, hs.q[gi][i0:i1])   # [nj, D]
                if hs.dq is not None:
                    hs.dq[gi][i0:i1] += np.matmul(dst.T, kt)    # [ni, D]
        if dk is not None:
            dk_acc *= dt.type(scale)
            dk[j0:j1] = dk_acc
        if dv is not None:
            dv[j0:j1] = dv_acc
    return counts
