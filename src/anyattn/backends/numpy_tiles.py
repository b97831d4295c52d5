"""Tile kernels of the NumPy backend: blocked softmax forward, one-pass backward.

Shape legend: Sq/Sk queries/keys of one head, D head dim of q and k, Dv of v (and out,
dout), ni/nj rows of one query/key tile (<= bq/bk), G query heads per key/value head.

Four choices run through the kernels here:

* Scores are kept **transposed**, ``sT [nj, ni]`` (keys x queries).  The
  softmax reductions over keys then run along axis 0, which NumPy vectorises
  across the query columns (several times faster than a reduction along the
  contiguous axis), and the backward needs Pᵀ and dSᵀ for dV and dK anyway.
* **Units.**  Without a bias, scores are in **base 2**: queries are
  pre-multiplied by ``scale * log2(e)``, so ``P = exp2(sT - m)``; ``exp2`` is
  ~1.6x faster than ``exp`` in NumPy's float32 SIMD loops.  With a bias, or
  where scores may pass :data:`BASE2_LIMIT`, they stay in **natural** units
  (queries times ``scale``, the bias added as it is, ``exp``): a bias times
  log2(e) would overflow at ``finfo.min`` and the row maximum could not go to
  natural units and back exactly at huge magnitudes.
* **Row statistics kept apart** (:mod:`anyattn.rowstats`): the forward returns
  the row maximum and the log-normaliser, never one rounded lse; base-2 maxima
  are converted to natural units rounded down with the rounding residual moved
  into the (small) log-normaliser, so ``exp((s - max) - log_norm)`` stays exact
  to a few ulps at any |s|.  The backward applies ``max`` in the score GEMM
  and ``log_norm`` as a factor ``w = exp(-log_norm)`` folded into ``[dout |
  -delta]`` (:class:`BackwardHeads`), i.e. after the bias, as the contract's
  order ``((s - max) + bias) - log_norm`` requires.
* **Extra GEMM columns** instead of elementwise passes: ``[k | 1]`` against
  ``[q2 | -max2]`` gives ``s - max`` and ``[v | 1]`` against ``w·[g | -delta]``
  gives ``w·(dP - delta)`` in the GEMMs themselves (the backward).  The
  bias-free forward with small logits (:func:`forward_rows_bounded`, a
  Cauchy-Schwarz bound of 64 in log2 units) subtracts nothing at all.

* **Score modifiers** (:class:`TileMods`, :mod:`anyattn.modifiers`): a softcap puts
  ``scale / c`` on the queries so the score GEMM gives x/c in natural units, tanh
  runs in place and ``c·u`` scales it (base 2 stays exact: the cap comes first);
  the backward recomputes tanh and multiplies dS by ``1 - tanh²`` after dbias.
  ALiBi is rebased per row at the band's nearest kept key (:func:`alibi_anchors`):
  the row term lives in the statistics, the tile term is read from a Toeplitz view
  of one ``[2Sk - 1]`` table (:class:`AlibiRows`), and far tiles floor their
  exponents (:data:`EXP_FLOOR2`) so that no exp or GEMM meets subnormals.  Sinks
  never reach the kernels (the launcher folds them into the statistics).
* **Dropout** (:class:`DropoutDraw`, :mod:`anyattn.dropout`): the keep mask is drawn
  per tile from a row word per query and a column word per key (computed once per
  call / per unit, O(Sq + Sk) Philox calls) with six in-place uint32 passes, a compare
  and a copy to 0/1 floats in per-unit buffers (:class:`DropoutTiles`), never stored
  whole.  P is multiplied by
  the 0/1 tile after its row sum (the statistics stay undropped) and ``1/(1 - p)``
  goes on the [ni, D] side: the forward's accumulator, the backward's dout weights.

Every function works on one (batch, head) slice of 2-D arrays (``forward_group``: the
G query heads of one key/value head), writes only its own output rows and uses
O(bq*bk + (Sq+Sk)*D) scratch.  Loop orders are fixed, so results are bitwise
repeatable.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..dropout import col_words, keep_scale, row_words, threshold
from ..arrays import to_numpy
from ..masks import TILE_EMPTY, TILE_FULL, TILE_PARTIAL, ResolvedMask
from ..programs.bound import ScoreTiles, scatter_add

__all__ = ["TilePlan", "TileCounts", "forward_rows", "forward_rows_bounded", "forward_group",
           "backward_keys",
           "BackwardHeads", "with_ones_column", "key_tile_norms", "export_base2",
           "backward_columns", "snap_plan", "saturating_cast", "tile_blocks",
           "AlibiRows", "TileMods", "alibi_anchors", "shift_stats", "two_sum",
           "DropoutDraw", "DropoutTiles", "TILE_TERMS",
           "LOG2E", "LN2", "BASE2_LIMIT", "BOUNDED_MAX_C", "ONE_KEY", "BOUNDED_MIN_SUM",
           "EXP_FLOOR2", "FAR_FRACTION"]

LOG2E = 1.4426950408889634  # log2(e)
LN2 = 0.6931471805599453    # ln(2)

#: base-2 scores stay below this magnitude (log2 units); beyond it (and with any bias)
#: the kernels work in natural units, where the row maximum needs no conversion.  The
#: statistics are stored in natural units, so a base-2 backward converts the row max
#: back (max·log2e), which rounds at |max|·2⁻²⁴: kept below 2⁶ that is < 4e-6 in P
#: (at 2²⁰ it was 6e-5 at logits of 1e3, 5x worse than one process in ring attention).
BASE2_LIMIT = 64.0

#: the bounded forward serves query tiles whose Cauchy-Schwarz bound c (log2 units) is at
#: most this: exp2(s) then stays within [2⁻⁶⁴, 2⁶⁴] (no max to subtract, no overflow or
#: underflow in float32); larger logits go to the running-max path.
BOUNDED_MAX_C = 64.0

#: with ALiBi the bounded forward's row sums may underflow (far keys only): a query tile
#: where a row that keeps keys sums to less than this (its largest term then may lie
#: below the normal range) is recomputed by the running-max path.
BOUNDED_MIN_SUM = 2.0 ** -70

#: lowest exponent (log2 units, by compute dtype) that the kernels feed to exp/exp2 on
#: tiles where ALiBi reaches below ``FAR_FRACTION·EXP_FLOOR2`` (its far keys): NumPy's
#: exp2 on results below the normal range runs ~500x slower (subnormals; ~50x for an
#: underflow to 0), as do GEMMs fed subnormal P.  A term of 2^-100 next to a row maximum
#: of 1 (or a bounded row sum >= 2^-64) is far below fp32 rounding; entries the masks or
#: a -inf bias drop are zeroed after the exp, never floored.
EXP_FLOOR2 = {np.dtype(np.float32): -100.0, np.dtype(np.float64): -1000.0}
FAR_FRACTION = 0.4

#: ``log_norm`` of a row that the forward found carried by one key (the other keys' weights
#: sum to less than the rounding of 1): zero with the sign bit set, so ``lse = max`` and
#: ``log_norm >= 0`` still hold, while the backward can tell it from a plain lse's +0.0.
ONE_KEY = -0.0

#: snapping tolerance for rows with ``log_norm == +0`` (a plain lse, another backend's
#: statistics): P within ``SNAP_ULPS·eps·(1 + |max|)`` of 1 (see :func:`snap_plan`).
SNAP_ULPS = 1.0


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
    #: the bias holds -inf somewhere (kernels that floor exponents re-zero those entries)
    bias_neginf: bool = False
    _band_cache: Dict[Tuple[int, int, int], np.ndarray] = field(default_factory=dict)

    @property
    def nq(self) -> int:
        return -(-self.sq // self.bq)

    @property
    def nk(self) -> int:
        return -(-self.sk // self.bk)

    @property
    def band_only(self) -> bool:
        return self.mask.terms == ("band",)

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

    def band_rows(self, i0: int, i1: int, j0: int, j1: int) -> Tuple[int, int]:
        """Rows [r0, r1) of the queries i0..i1-1 that the band lets see some key of
        j0..j1-1 (all of them without a band term): ``j0 - hi <= i <= j1 - 1 - lo``.
        Other mask terms only drop more pairs, so no row outside keeps a key here."""
        m = self.mask
        r0 = i0 if m.band_hi is None else max(i0, j0 - m.band_hi)
        r1 = i1 if m.band_lo is None else min(i1, j1 - m.band_lo)
        return r0, max(r0, r1)

    def band_keys(self, i0: int, i1: int, j0: int, j1: int) -> Tuple[int, int]:
        """Keys [c0, c1) of j0..j1-1 that the band lets some query of i0..i1-1 see:
        ``i0 + lo <= j <= i1 - 1 + hi``."""
        m = self.mask
        c0 = j0 if m.band_lo is None else max(j0, i0 + m.band_lo)
        c1 = j1 if m.band_hi is None else min(j1, i1 + m.band_hi)
        return c0, max(c0, c1)

    # ------------------------------------------------------------ per-tile terms
    def excluded_t(self, b: int, h: int, i0: int, i1: int, j0: int, j1: int) -> np.ndarray:
        """bool [nj, ni], True where the mask drops the pair (transposed tile): the OR of
        every present term's :data:`TILE_TERMS` function."""
        terms = self.mask.terms
        ex = TILE_TERMS[terms[0]](self, b, h, i0, i1, j0, j1)
        if len(terms) == 1 and ex.shape == (j1 - j0, i1 - i0):
            return ex
        out = np.zeros((j1 - j0, i1 - i0), dtype=bool)
        for name in terms:
            np.logical_or(out, ex if name == terms[0] else
                          TILE_TERMS[name](self, b, h, i0, i1, j0, j1), out=out)
        return out

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


# ------------------------------------------------------------------ mask terms
# One function per lowered term kind (anyattn.masks.TERM_KINDS), found by name through
# TILE_TERMS: (plan, b, h, i0, i1, j0, j1) -> bool [nj|1, ni|1], True where the term
# drops the pair of key j0 + r and query i0 + c (a transposed tile, broadcastable).
def _band_excluded_t(plan: TilePlan, b: int, h: int, i0: int, i1: int, j0: int,
                     j1: int) -> np.ndarray:
    """band_lo <= j - i <= band_hi; one array per (j0 - i0, nj, ni), shared read-only."""
    m = plan.mask
    key = (j0 - i0, j1 - j0, i1 - i0)  # a band tile depends on j0 - i0 only
    ex = plan._band_cache.get(key)
    if ex is None:
        d = np.arange(j0, j1)[:, None] - np.arange(i0, i1)[None, :]  # [nj, ni] j - i
        ex = np.zeros(d.shape, dtype=bool)
        if m.band_lo is not None:
            ex |= d < m.band_lo
        if m.band_hi is not None:
            ex |= d > m.band_hi
        plan._band_cache[key] = ex
    return ex


def _documents_excluded_t(plan: TilePlan, b: int, h: int, i0: int, i1: int, j0: int,
                          j1: int) -> np.ndarray:
    """q_ids[i] != k_ids[j]: [nj, ni]."""
    qd, kd = to_numpy(plan.mask.q_ids), to_numpy(plan.mask.k_ids)
    qrow = qd[b if qd.shape[0] > 1 else 0, i0:i1]
    krow = kd[b if kd.shape[0] > 1 else 0, j0:j1]
    return krow[:, None] != qrow[None, :]


def _keep_excluded_t(plan: TilePlan, b: int, h: int, i0: int, i1: int, j0: int,
                     j1: int) -> np.ndarray:
    """not keep[b, h, i, j]: [nj|1, ni|1] (the keep array's broadcast dims stay 1)."""
    km = to_numpy(plan.mask.keep)
    km = km[b if km.shape[0] > 1 else 0, h if km.shape[1] > 1 else 0]
    rows = slice(i0, i1) if km.shape[0] > 1 else slice(0, 1)
    cols = slice(j0, j1) if km.shape[1] > 1 else slice(0, 1)
    kt = km[rows, cols].T                                             # [nj|1, ni|1]
    return np.logical_not(kt, out=np.empty(kt.shape, dtype=bool))


def _function_excluded_t(plan: TilePlan, b: int, h: int, i0: int, i1: int, j0: int,
                         j1: int) -> np.ndarray:
    """not (every mask function keeps (b, h, i, j)): [nj, ni], the functions evaluated on
    the tile's index grids (only partial tiles get here: the tile map skips empty ones
    and full ones need no mask)."""
    keep = None
    for bp in plan.mask.mask_fns:
        k = bp.keep_t(b, h, i0, i1, j0, j1)
        keep = k if keep is None else keep & k
    return np.logical_not(keep)


#: the NumPy tile function of every mask term kind this backend implements
TILE_TERMS: Dict[str, Callable[..., np.ndarray]] = {
    "band": _band_excluded_t,
    "documents": _documents_excluded_t,
    "keep": _keep_excluded_t,
    "mask_mod": _function_excluded_t,
}


def _kept_tiles(codes_row: Optional[np.ndarray], n: int) -> List[Tuple[int, int]]:
    """[(tile index, code)] of the non-empty tiles along one row/column of a tile map."""
    if codes_row is None:
        return [(t, TILE_FULL) for t in range(n)]
    idx = np.flatnonzero(codes_row != TILE_EMPTY)
    return [(int(t), int(codes_row[t])) for t in idx]



# ----------------------------------------------------------------- row statistics
def _two_prod(a: np.ndarray, b: float) -> Tuple[np.ndarray, np.ndarray]:
    """float64 ``a * b = p + e`` exactly (Dekker's product; |a| < 1e290, finite)."""
    p = a * b
    split = 134217729.0                                   # 2**27 + 1
    t = split * a
    ah = t - (t - a)
    al = a - ah
    t = split * b
    bh = t - (t - b)
    bl = b - bh
    e = ((ah * bh - p) + ah * bl + al * bh) + al * bl
    return p, e


def export_base2(m2: np.ndarray, l2: np.ndarray, dt: np.dtype,
                 one_key: bool = True) -> Tuple[np.ndarray, np.ndarray]:
    """Base-2 row statistics -> natural (max, log_norm) in ``dt``.

    m2: float64 row maxima in log2 units (-inf on empty rows, NaN on NaN rows);
    l2: float64 ``log2 Σ exp2(s - m2)`` (>= 0).  The natural maximum is rounded
    *down* to ``dt`` and the residual (>= 0, below one ulp of it) is added to the
    log-normaliser, so ``max + log_norm`` and ``exp((s - max) - log_norm)`` keep full
    precision.  A row with ``l2 == 0`` (one key carries all the weight: the
    others add less than the rounding of 1) gets ``log_norm = -0.0``
    (:data:`ONE_KEY`); the backward reads that as "this row's top key has P = 1"
    (the residual it drops is below the rounding of the other keys' P).
    ``one_key=False``: never (``m2`` is then not a row maximum but the lse).
    """
    fin = np.isfinite(m2)
    all_fin = bool(fin.all())
    ms = m2 if all_fin else np.where(fin, m2, 0.0)
    if dt == np.float32:                      # float64 holds m2·ln2 to 2⁻⁵³: enough
        hi, lo = ms * LN2, 0.0
    else:
        hi, lo = _two_prod(ms, LN2)           # m2·ln2 = hi + lo exactly
    mx = hi.astype(dt)
    down = mx.astype(np.float64) > hi
    if dt != np.float32:
        down |= (mx == hi) & (lo < 0)
    if down.any():
        mx[down] = np.nextafter(mx[down], dt.type(-np.inf))
    r = (hi - mx) + lo                                        # >= 0, < ulp(max)
    ln = l2 * LN2 + r
    if one_key:
        ln[l2 == 0] = ONE_KEY
    if not all_fin:
        mx = np.where(fin, mx, m2.astype(dt))
        ln = np.where(fin, ln, np.where(np.isnan(m2), np.nan, 0.0))
    return mx, ln.astype(dt)


def backward_columns(row_max: np.ndarray, log_norm: np.ndarray, dt: np.dtype, base2: bool
                     ) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Row statistics -> what the backward GEMMs take, per row (all float64 in, ``dt`` out).

    Returns ``(col, w, unit_max, single)``: ``col`` = ``-max`` in the kernel's units
    (base 2 or natural; -inf on empty rows so that P = 0 there, NaN stays NaN),
    ``w = exp(-log_norm)`` (the backward multiplies [dout | -delta] by it), the
    maximum in the kernel's units (for :func:`snap_plan`) and ``single``, int8 per
    row: 2 where ``log_norm`` is :data:`ONE_KEY` (the forward found one key carrying
    the row), 1 where it is +0 (a plain lse: maybe so), else 0; w = 1 exactly there.

    In base 2, ``max·log2(e)`` is split into its ``dt`` rounding (the GEMM column)
    and a residual that joins ``log_norm``, so no precision is lost in the change
    of units.  In natural units a ``max`` wider than ``dt`` (float64 statistics for
    float32 inputs) is rounded and its residual joins ``log_norm`` the same way.
    """
    m = row_max
    fin = np.isfinite(m)
    ms = np.where(fin, m, 0.0)
    with np.errstate(invalid="ignore", over="ignore"):
        if base2:
            hi, lo = _two_prod(ms, LOG2E)
            unit = hi.astype(dt)
            corr = (hi - unit.astype(np.float64)) + lo
            ln_u = log_norm * LOG2E + corr
        else:
            unit = ms.astype(dt)
            res = ms - unit.astype(np.float64)
            ln_u = log_norm + np.where(np.abs(res) <= 1.0, res, 0.0)
        zero = fin & (log_norm == 0)
        single = np.where(zero, np.where(np.signbit(log_norm), 2, 1), 0).astype(np.int8)
        ln_u = np.where(zero, 0.0, ln_u)
        w = (np.exp2(-ln_u) if base2 else np.exp(-ln_u)).astype(dt)
        col = np.where(fin, -unit.astype(np.float64), np.where(np.isnan(m), np.nan, -np.inf))
    return col.astype(dt), w, np.where(fin, unit, 0).astype(np.float64), single


def snap_plan(plan: "TilePlan", single: np.ndarray, unit_max: np.ndarray
              ) -> Dict[int, Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
    """Per query tile, the rows whose top key gets P = 1 exactly in the backward.

    The top key's ``exp(s - max)`` is 1 only up to the rounding of two differently
    shaped score GEMMs (forward vs backward: ``eps·|q|·|k|``, 0.1 at logits of
    1e6).  ``single`` (from :func:`backward_columns`): rows marked :data:`ONE_KEY`
    by the forward have every other key's weight below 2⁻²⁴, so there any P >= 1/2
    is the top key: it is set to 1 and its dS to 0 (dP - delta of a row carried by
    one key is exactly 0, as torch's softmax backward computes it).  Rows with a
    plain ``log_norm = +0`` set P to 1 only within ``SNAP_ULPS·eps·(1 + |max|)`` of
    it and keep dS.  Either way a row attending to one key gives ``dv = dout``.
    Returns {tile: (local columns, low, high, zero dS)} over the marked rows.
    """
    if not single.any():
        return {}
    dt = plan.dtype
    eps = float(np.finfo(dt).eps)
    tau = SNAP_ULPS * eps * (1.0 + np.abs(unit_max))
    cert = single == 2
    lo = np.where(cert, 0.5, 1.0 - tau).astype(dt)
    hi = np.where(cert, np.inf, 1.0 + tau).astype(dt)
    out = {}
    for it in range(plan.nq):
        i0, i1 = plan.q_range(it)
        sel = np.flatnonzero(single[i0:i1])
        if sel.size:
            r = sel + i0
            out[it] = (sel, lo[r], hi[r], cert[r])
    return out


def _snap(st: np.ndarray, sel: np.ndarray, lo: np.ndarray, hi: np.ndarray,
          zero: np.ndarray, ones: np.ndarray) -> Optional[Tuple[np.ndarray, np.ndarray]]:
    """Set the P tile's entries in [lo, hi] to 1 on the columns ``sel`` (in place).

    ``ones``: float ones, at least [nj].  Returns (columns, hits) where dS must be 0,
    or None."""
    if sel.size * 4 > st.shape[1]:          # many columns: look only where a P may be near 1
        # P >= 0, so a column whose sum is below lo has no entry >= lo: a GEMV over the
        # tile [ni] (~5x cheaper than a max-reduce along axis 0 of [nj, ni])
        cs = np.matmul(ones[:st.shape[0]], st)                   # [ni] column sums
        near = (cs if sel.size == st.shape[1] else cs[sel]) >= lo  # sel = all columns?
        if not near.any():                    # the usual case: no call more (2 workers
            return None                       # contend for the GIL between calls)
        sel, lo, hi, zero = sel[near], lo[near], hi[near], zero[near]
    sub = st[:, sel]                                              # [nj, ns]
    hit = (sub >= lo) & (sub <= hi)
    if not hit.any():
        return None
    sub[hit] = 1
    st[:, sel] = sub
    if zero.any():
        hz = hit & zero
        if hz.any():
            return sel, hz
    return None


def saturating_cast(x: np.ndarray, dt: np.dtype) -> np.ndarray:
    """``x`` in ``dt`` with finite values kept finite (clamped to ±finfo(dt).max)."""
    if x.dtype == dt:
        return x
    with np.errstate(over="ignore", invalid="ignore"):
        y = x.astype(dt)
    bad = np.isinf(y) & np.isfinite(x)
    if bad.any():
        big = np.finfo(dt).max
        y[bad] = np.where(x[bad] > 0, big, -big)
    return y


def tile_blocks(plan: "TilePlan", q_tiles: Sequence[int]) -> List[Tuple[int, int, int]]:
    """Whole query tiles as row blocks ``(tile, i0, i1)``."""
    return [(it,) + plan.q_range(it) for it in q_tiles]


# ------------------------------------------------------------------ score modifiers
def alibi_anchors(mask: ResolvedMask, sq: int, sk: int, diag: int
                  ) -> Tuple[np.ndarray, np.ndarray]:
    """ALiBi rebased per row -> (anchor [Sq], dmin [Sq]), both int64.

    ``anchor_i`` is the key position nearest to i's ALiBi diagonal ``t_i = i + diag``
    that the band terms keep (``clip(t_i, L_i, R_i)`` with L_i/R_i the first/last key
    of row i's band, clipped to the keys 0..Sk-1) and ``dmin_i = |t_i - anchor_i|``.
    On every kept key j, ``|i - j + diag| = dmin_i + |anchor_i - j|``, so ALiBi splits
    into a row term ``-slope·dmin_i`` (kept in the row statistics by the launcher, in
    float64) and the tile term ``-slope·|anchor_i - j|`` (:class:`AlibiRows`), which is
    0 at the anchor: near each row's maximum the kernels' scores stay small whatever
    the offsets or how far the band sits from the diagonal, so they carry no
    |slope·dmin|·eps rounding.  Document and KeepMask terms are not consulted (a row
    whose kept keys lie far from its anchor only rounds like a plain fp32 score).
    """
    i = np.arange(sq, dtype=np.int64)
    lo = np.zeros(sq, np.int64) if mask.band_lo is None else np.maximum(0, i + mask.band_lo)
    hi = np.full(sq, sk - 1, np.int64) if mask.band_hi is None else \
        np.minimum(sk - 1, i + mask.band_hi)
    t = i + diag
    anchor = np.clip(np.minimum(np.maximum(t, lo), hi), 0, max(sk - 1, 0))
    return anchor, np.abs(t - anchor)


class AlibiRows:
    """The tile term of ALiBi for one (batch, query head) in a kernel's units.

    Adds ``-slope_u·|anchor_i - j|`` (see :func:`alibi_anchors`) to transposed score
    tiles [nj, ni] from one table ``f [2Sk - 1]``, ``f[u + Sk - 1] = -slope_u·|u|``
    (float64 product, one rounding).  The rows split into a few runs: where
    ``anchor_i - i`` is constant a run reads a Toeplitz view of f, where ``anchor_i``
    is constant one reversed slice of it [nj, 1]; no [Sq, Sk] or per-tile distance
    array is ever built.  Caches views: one instance per unit of work, never shared
    by threads.
    """

    def __init__(self, slope_u: float, anchor: np.ndarray, sk: int, dt: np.dtype):
        u = np.abs(np.arange(-(sk - 1), sk, dtype=np.float64))            # [2Sk-1] |u|
        self.f = (u * -float(slope_u)).astype(dt)                        # [2Sk-1]
        self.sk, self.slope, self.anchor = sk, abs(float(slope_u)), anchor
        self.runs: List[Tuple[int, int, bool, int]] = []   # (i0, i1, column?, anchor|offset)
        sq = len(anchor)
        off = anchor - np.arange(sq)
        i = 0
        while i < sq:
            column = i + 1 < sq and anchor[i + 1] == anchor[i]
            vals = anchor if column else off
            rest = vals[i + 1:] != vals[i]
            e = i + 1 + (int(np.argmax(rest)) if rest.any() else len(rest))
            self.runs.append((i, e, column, int(vals[i])))
            i = e
        self._win: Dict[int, np.ndarray] = {}
        self._lohi: Dict[Tuple[int, int], Tuple[int, int]] = {}   # rows -> anchor range

    def add_t(self, st: np.ndarray, i0: int, i1: int, j0: int, j1: int) -> float:
        """st [nj, ni] += the tile term of queries i0..i1-1 and keys j0..j1-1 (in place).

        Returns the term's largest magnitude on the tile, ``slope_u·max|anchor_i - j|``."""
        sk, f = self.sk, self.f
        nj = j1 - j0
        lohi = self._lohi.get((i0, i1))
        if lohi is None:                                              # anchors of the rows
            a = self.anchor[i0:i1]                                    # [ni]
            lohi = self._lohi[(i0, i1)] = (int(a.min()), int(a.max()))
        span = self.slope * max(lohi[1] - j0, j1 - 1 - lohi[0], 0)
        for r0, r1, column, val in self.runs:
            a, b = max(r0, i0), min(r1, i1)
            if a >= b:
                continue
            if column:                            # f[(anchor - j) + Sk - 1], [nj, 1]
                st[:, a - i0:b - i0] += f[val + sk - j0 - nj:val + sk - j0][::-1, None]
                continue
            w = b - a                             # anchor_i = i + val: Toeplitz
            win = self._win.get(w)
            if win is None:                       # win[r, x] = f[r + x], [2Sk - w, w]
                win = self._win[w] = np.lib.stride_tricks.sliding_window_view(f, w)
            r = a + val - j0 + sk - 1             # f index of (key j0, query a)
            st[:, a - i0:b - i0] += win[r - nj + 1:r + 1][::-1]      # [nj, w] f[r - jj + x]
        return span


@dataclass
class TileMods:
    """Score modifiers of one (batch, query head) in a kernel's units (u = log2(e) in
    base 2, else 1).

    ``cap`` = c·u or None: the kernel's query operand then carries ``scale / c``, so its
    score GEMM gives x/c in natural units (x = scale·qk) and :meth:`cap_t` turns that
    into ``c·u·tanh(x / c)``; ``alibi``: :class:`AlibiRows` or None; ``floor``: the
    lowest exponent fed to exp (:data:`EXP_FLOOR2` in these units) on tiles where the
    ALiBi term reaches below ``FAR_FRACTION·floor``, or None.
    """

    cap: Optional[float] = None
    alibi: Optional[AlibiRows] = None
    floor: Optional[float] = None
    #: a score function (natural units only) and the (batch, query head) it runs for
    score: Optional[ScoreTiles] = None
    bh: Tuple[int, int] = (0, 0)

    def score_t(self, st: np.ndarray, i0: int, i1: int, j0: int, j1: int) -> None:
        """st [nj, ni] = score_mod(st) for queries i0..i1-1, keys j0..j1-1 (in place)."""
        self.score.apply_t(st, self.bh[0], self.bh[1], i0, i1, j0, j1)

    def cap_t(self, st: np.ndarray, t: Optional[np.ndarray] = None) -> None:
        """st [nj, ni] = x/c -> c·u·tanh(x/c) in place; tanh(x/c) also into ``t`` if given."""
        if t is None:
            np.tanh(st, out=st)                                     # [nj, ni]
            st *= st.dtype.type(self.cap)
        else:
            np.tanh(st, out=t)                                      # [nj, ni]
            np.multiply(t, t.dtype.type(self.cap), out=st)


def two_sum(a: np.ndarray, b: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """float64 ``a + b = s + e`` exactly (Knuth's TwoSum; finite a, b)."""
    s = a + b
    bb = s - a
    e = (a - (s - bb)) + (b - bb)
    return s, e


def shift_stats(rmax: np.ndarray, rlog: np.ndarray, shift: np.ndarray
                ) -> Tuple[np.ndarray, np.ndarray]:
    """Natural row statistics [..] (``dt``) of scores s -> those of s + shift (float64
    shift, broadcastable to rmax).

    The new max is ``rmax + shift`` rounded *down* to ``dt`` and the residual (>= 0,
    below one ulp of it, including the float64 sum's own rounding) joins log_norm, so
    ``max + log_norm`` and ``exp((s - max) - log_norm)`` lose nothing to the shift.
    Rows marked :data:`ONE_KEY` keep the marker (their residual, under one ulp of
    max, is dropped); empty and NaN rows (max -inf / NaN) are unchanged."""
    dt = rmax.dtype
    r64 = rmax.astype(np.float64)
    fin = np.isfinite(r64)
    m64, err = two_sum(np.where(fin, r64, 0.0), np.broadcast_to(shift, r64.shape))
    mx = m64.astype(dt)
    res = (m64 - mx.astype(np.float64)) + err
    down = res < 0
    if down.any():
        mx[down] = np.nextafter(mx[down], dt.type(-np.inf))
        res = (m64 - mx.astype(np.float64)) + err                    # >= 0, < ulp(max)
    one = (rlog == 0) & np.signbit(rlog)
    ln = np.where(one, rlog, (rlog.astype(np.float64) + res).astype(dt))
    return np.where(fin, mx, rmax).astype(dt), np.where(fin, ln, rlog).astype(dt)


# ----------------------------------------------------------------------- dropout
_MIX1 = np.uint32(0x7FEB352D)      # anyattn.dropout.mix32's multipliers
_MIX2 = np.uint32(0x846CA68B)
_U15, _U16 = np.uint32(15), np.uint32(16)


def _xorshift16(w: np.ndarray) -> np.ndarray:
    """w ^ (w >> 16) (uint32): mix32's first step, which distributes over XOR, so
    ``mix32(r ^ c)`` starts from ``_xorshift16(r) ^ _xorshift16(c)``."""
    return w ^ (w >> _U16)


class DropoutDraw:
    """The dropout of one call, shared read-only by the workers.

    ``cols`` uint32 [Sk]: the column words of the global keys ``k_offset + j``
    (:func:`anyattn.dropout.col_words`), xorshifted by 16 (:func:`_xorshift16`);
    :meth:`rows` gives a (batch, head)'s row words likewise; ``t`` the threshold
    (keep iff ``mix32(row ^ col) >= t``), ``scale`` = 1/(1 - p).  ``keep_all``: t is 0
    (p below 2⁻³³): every element is kept, only ``scale`` applies.

    The generator's per-element steps, rewritten exactly: mix32's first xorshift
    distributes over XOR (done on the words, :func:`_xorshift16`); its last one,
    ``y = x ^ (x >> 16)``, keeps x's high half, so ``y >= t`` iff ``x ^ (t >> 16) >= t``
    (where x's high half equals t's, y's low half is ``x_lo ^ (t >> 16)``; elsewhere the
    high halves decide): one XOR with a constant instead of a shift and an XOR.
    """

    def __init__(self, p: float, seed: int, q_offset: int, k_offset: int, sq: int,
                 sk: int):
        self.seed, self.q_offset, self.sq = int(seed), int(q_offset), int(sq)
        self.t = np.uint32(threshold(p))
        self.t_hi = np.uint32(int(self.t) >> 16)                  # see the class docstring
        self.scale = keep_scale(p)
        self.keep_all = int(self.t) == 0
        self.cols = _xorshift16(col_words(self.seed, np.arange(k_offset, k_offset + sk,
                                                                dtype=np.uint64)))

    def rows(self, b: int, h: int) -> np.ndarray:
        """uint32 [Sq]: the xorshifted row words of (batch b, query head h) at the global
        queries ``q_offset + i`` (Sq Philox calls)."""
        i = np.arange(self.q_offset, self.q_offset + self.sq, dtype=np.uint64)
        return _xorshift16(row_words(self.seed, [b], [h], i)[0, 0])

    def tiles(self, n: int, dt: np.dtype) -> "DropoutTiles":
        """Scratch for tiles of up to ``n`` elements: one per unit of work."""
        return DropoutTiles(self, n, dt)

    def keep_pairs(self, rows: np.ndarray, cols: np.ndarray) -> np.ndarray:
        """bool [n]: keep of the pairs (row words ``rows`` [n], key indices ``cols`` [n])."""
        if self.keep_all:
            return np.ones(len(rows), dtype=bool)
        x = rows ^ self.cols[cols]
        x *= _MIX1
        x ^= x >> _U15
        x *= _MIX2
        x ^= self.t_hi                               # = (x ^ (x >> 16)) >= t, see above
        return x >= self.t


class DropoutTiles:
    """Per-unit scratch of :class:`DropoutDraw`: draws transposed keep tiles [nj, ni] as
    0/1 in the compute dtype (never shared by threads).  In float32 the 0/1 tile lives
    in the shift buffer (fewer bytes in cache next to the kernels' own tiles)."""

    def __init__(self, draw: DropoutDraw, n: int, dt: np.dtype):
        self.draw = draw
        self.scale = draw.scale
        self.x = np.empty(n, dtype=np.uint32)
        self.y = np.empty(n, dtype=np.uint32)
        self.keep = np.empty(n, dtype=bool)
        self.kf = self.y.view(dt) if dt == np.float32 else np.empty(n, dtype=dt)
        self._views: Dict[Tuple[int, int], Tuple[np.ndarray, ...]] = {}

    def keep_t(self, rows: np.ndarray, j0: int, j1: int) -> Optional[np.ndarray]:
        """The keep tile of queries with row words ``rows`` [ni] (from
        :meth:`DropoutDraw.rows`) and keys j0..j1-1: [nj, ni] 1 (kept) / 0 (dropped),
        or None where every element is kept.  Six uint32 passes, a compare and a copy,
        bit for bit :func:`anyattn.dropout.dropout_mask` (see :class:`DropoutDraw`)."""
        d = self.draw
        if d.keep_all:
            return None
        nj, ni = j1 - j0, len(rows)
        views = self._views.get((nj, ni))
        if views is None:
            n = nj * ni
            views = self._views[(nj, ni)] = tuple(
                a[:n].reshape(nj, ni) for a in (self.x, self.y, self.keep, self.kf))
        x, y, keep, kf = views
        np.bitwise_xor.outer(d.cols[j0:j1], rows, out=x)       # row ^ col, xorshifted
        np.multiply(x, _MIX1, out=x)
        np.right_shift(x, _U15, out=y)
        np.bitwise_xor(x, y, out=x)
        np.multiply(x, _MIX2, out=x)
        np.bitwise_xor(x, d.t_hi, out=x)                       # the last xorshift, folded
        np.greater_equal(x, d.t, out=keep)
        np.copyto(kf, keep)
        return kf


# ----------------------------------------------------------------------- forward
def forward_rows(plan: TilePlan, b: int, h: int, qop: np.ndarray, k: np.ndarray,
                 v: np.ndarray, out: np.ndarray, rmax: np.ndarray, rlog: np.ndarray,
                 blocks: Sequence[Tuple[int, int, int]], base2: bool,
                 mods: Optional[TileMods] = None, qk_bound: Optional[float] = None,
                 drop: Optional[DropoutTiles] = None, drop_rows: Optional[np.ndarray] = None
                 ) -> TileCounts:
    """Running-max forward of one (batch b, query head h) over row blocks.

    qop [Sq, D]: queries times ``scale·log2(e)`` (``base2``) or times ``scale``
    (natural units; required with a bias, which is added as it is), or times
    ``scale / c`` with a softcap (``mods.cap`` = c in the kernel's units); k [Sk, D], v
    [Sk, Dv] (any row stride, unit column stride); ``blocks``: ``(tile, i0, i1)`` row
    ranges inside query tiles; ``mods``: softcap and ALiBi (:class:`TileMods`) in the
    same units; ``qk_bound``: a bound of |scale·qk| (capped) in these units, if known
    (ALiBi's far tiles floor their exponents where ``2·qk_bound + span`` can pass the
    floor, else where the span passes ``FAR_FRACTION·floor``).  Writes out [Sq, Dv] and
    the natural row statistics rmax, rlog [Sq] on those rows only (of the scores
    without ALiBi's row term, see :func:`alibi_anchors`).  ``drop`` (dropout, with the
    row words ``drop_rows`` [Sq] of this head): P is multiplied by the keep tile after
    its row sum, the accumulator by 1/(1 - p) at the end.
    """
    dt = plan.dtype
    D = v.shape[1]
    counts = TileCounts()
    codes = plan.codes_bh(b, h)
    rows = max((i1 - i0 for _, i0, i1 in blocks), default=0)
    sbuf = np.empty(rows * plan.bk, dtype=dt)      # scores of one tile
    ones = np.ones(plan.bk, dtype=dt)              # row sums as a GEMV
    neg_inf = dt.type(-np.inf)
    expf = np.exp2 if base2 else np.exp
    cap = mods is not None and mods.cap is not None
    score = mods is not None and mods.score is not None
    alibi = None if mods is None else mods.alibi
    floor = None if mods is None or mods.floor is None else mods.floor
    if floor is not None:
        floor_row = np.full(rows, floor, dtype=dt)     # [ni] (maximum with a scalar is slow)
    far = False                                        # this tile's exponents get floored
    if floor is not None:                              # s - max >= -2·qk_bound - span
        far_at = FAR_FRACTION * -floor if qk_bound is None else -floor - 2 * qk_bound
    for it, i0, i1 in blocks:
        ni = i1 - i0
        qt = qop[i0:i1]                                        # [ni, D]
        m = np.full(ni, neg_inf, dtype=dt)                     # running max
        l = np.zeros(ni, dtype=dt)                             # running sum of exp(s - m)
        acc = np.zeros((ni, D), dtype=dt)                      # running P·V
        tiles = _kept_tiles(None if codes is None else codes[it], plan.nk)
        counts.skipped += plan.nk - len(tiles)
        for jt, code in tiles:
            j0, j1 = plan.k_range(jt)
            nj = j1 - j0
            # a partial tile: only the rows the band lets see these keys (nr <= ni)
            r0, r1 = plan.band_rows(i0, i1, j0, j1) if code == TILE_PARTIAL else (i0, i1)
            rs, nr = slice(r0 - i0, r1 - i0), r1 - r0
            if nr == 0:
                counts.skipped += 1
                continue
            st = sbuf[:nj * nr].reshape(nj, nr)
            np.matmul(k[j0:j1], qt[rs].T, out=st)              # sT [nj, nr] (x/c: cap)
            if cap:
                mods.cap_t(st)                                  # c·tanh(x/c) [nj, nr]
            if score:
                mods.score_t(st, r0, r1, j0, j1)                # score_mod(s) [nj, nr]
            if plan.bias is not None:
                st += plan.bias_t(b, h, r0, r1, j0, j1)
            if alibi is not None:                               # - slope·|anchor_i - j|
                far = alibi.add_t(st, r0, r1, j0, j1) > far_at
            ex = None
            if code == TILE_PARTIAL:
                ex = plan.excluded_t(b, h, r0, r1, j0, j1)
                np.copyto(st, neg_inf, where=ex)
                counts.partial += 1
            else:
                counts.full += 1
            mr = m[rs]                                          # [nr]
            m_new = np.maximum(mr, st.max(axis=0))              # [nr]
            # rows that have kept nothing yet: subtract 0, not -inf (no -inf - -inf)
            m_use = np.where(m_new == neg_inf, dt.type(0), m_new)
            st -= m_use                                         # [nj, nr], exact at the max
            if far:                                             # no subnormal P (slow)
                np.maximum(st, floor_row[:nr], out=st)          # -inf too: re-zeroed below
            expf(st, out=st)                                    # P~ [nj, nr]
            if far:
                if ex is not None:
                    np.copyto(st, dt.type(0), where=ex)
                if plan.bias_neginf:
                    np.copyto(st, dt.type(0),
                              where=np.isneginf(plan.bias_t(b, h, r0, r1, j0, j1)))
            corr = expf(mr - m_use)                             # [nr] rescale old terms
            lr = l[rs]
            lr *= corr
            lr += np.matmul(ones[:nj], st)                      # [nr] (undropped)
            if drop is not None:
                kf = drop.keep_t(drop_rows[r0:r1], j0, j1)      # [nj, nr] 0/1 or None
                if kf is not None:
                    st *= kf                                    # P~ ∘ keep
            ar = acc[rs]
            ar *= corr[:, None]
            ar += np.matmul(st.T, v[j0:j1])                     # [nr, D]
            m[rs] = m_new
        empty = l == 0                                          # no kept key (NaN stays)
        np.divide(acc, l[:, None], out=acc, where=~empty[:, None])
        acc[empty] = 0
        if drop is not None:
            acc *= dt.type(drop.scale)                          # keep / (1 - p)
        out[i0:i1] = acc
        m64 = np.where(empty, -np.inf, m.astype(np.float64))
        with np.errstate(divide="ignore"):
            if base2:
                mx, ln = export_base2(m64, np.where(empty, 0.0, np.log2(l.astype(np.float64))), dt)
            else:
                mx = m64.astype(dt)
                ln = np.where(empty, dt.type(0), np.where(l == 1, dt.type(ONE_KEY), np.log(l)))
        rmax[i0:i1] = mx
        rlog[i0:i1] = ln
    return counts


def forward_group(plan: TilePlan, b: int, heads: Sequence[int], qop: np.ndarray,
                  k: np.ndarray, v: np.ndarray, out: np.ndarray, rmax: np.ndarray,
                  rlog: np.ndarray, mods: Optional[Sequence[Optional[TileMods]]] = None,
                  drop: Optional[DropoutTiles] = None,
                  drop_rows: Optional[np.ndarray] = None) -> TileCounts:
    """Running-max forward (natural units) of the G query heads ``heads`` of one
    key/value head, stacked: every key tile is multiplied once for all of them.

    The plan has one query tile (``plan.nq == 1``).  qop [G·Sq, D]: row ``g·Sq + i`` is
    query i of ``heads[g]`` times ``scale`` (``scale / c`` with a softcap); k [Sk, D],
    v [Sk, Dv] (unit column stride).  Per key tile: one score GEMM [nj, G·Sq], then per
    head (a column block of Sq) what :func:`forward_rows` applies to its tile in
    natural units: softcap, score function, bias, ALiBi (``mods[g]``, natural units),
    the mask (each head's tile code; a mask that does not vary over heads is evaluated
    once), then one row max, exp, row-sum GEMV and P·V GEMM for all rows.  Dropout:
    ``drop_rows`` [G·Sq] are the heads' row words in the same order.  Writes out
    [G, Sq, Dv] and the natural statistics rmax, rlog [G, Sq] as :func:`forward_rows`
    does with ``base2=False`` (``log_norm`` :data:`ONE_KEY` where l is exactly 1).
    """
    dt = plan.dtype
    G, Sq = len(heads), plan.sq
    R, Dv = G * Sq, v.shape[1]
    counts = TileCounts()
    codes = [plan.codes_bh(b, h) for h in heads]                    # [1, nK] or None
    shared_mask = plan.codes is None or plan.codes.shape[1] == 1
    shared_bias = plan.bias is not None and plan.bias.shape[1] == 1
    sbuf = np.empty(plan.bk * R, dtype=dt)
    ones = np.ones(plan.bk, dtype=dt)
    neg_inf = dt.type(-np.inf)
    first = None if mods is None else mods[0]
    cap = first is not None and first.cap is not None                # one cap for all heads
    score = first is not None and first.score is not None
    alibi = first is not None and first.alibi is not None
    floor = None if first is None or first.floor is None else first.floor
    if floor is not None:
        floor_row = np.full(R, floor, dtype=dt)        # [R] (maximum with a scalar is slow)
        far_at = FAR_FRACTION * -floor
    m = np.full(R, neg_inf, dtype=dt)                  # running max
    l = np.zeros(R, dtype=dt)                          # running sum of exp(s - m)
    acc = np.zeros((R, Dv), dtype=dt)                  # running P·V
    for jt in range(plan.nk):
        cj = [TILE_FULL if c is None else int(c[0, jt]) for c in codes]
        n_empty = cj.count(TILE_EMPTY)
        counts.skipped += n_empty
        if n_empty == G:
            continue
        counts.partial += cj.count(TILE_PARTIAL)
        counts.full += cj.count(TILE_FULL)
        j0, j1 = plan.k_range(jt)
        nj = j1 - j0
        st = sbuf[:nj * R].reshape(nj, R)
        np.matmul(k[j0:j1], qop.T, out=st)                          # sT [nj, R] (x/c: cap)
        st3 = st.reshape(nj, G, Sq)                                 # head g: st3[:, g]
        if cap:
            first.cap_t(st)                                         # c·tanh(x/c)
        if score:                                                   # per head, in place
            for g in range(G):
                sg = np.ascontiguousarray(st3[:, g])
                mods[g].score_t(sg, 0, Sq, j0, j1)
                st3[:, g] = sg
        if plan.bias is not None:
            if shared_bias:
                st3 += plan.bias_t(b, heads[0], 0, Sq, j0, j1)[:, None, :]
            else:
                for g, h in enumerate(heads):
                    st3[:, g] += plan.bias_t(b, h, 0, Sq, j0, j1)
        far = False
        if alibi:                                                   # - slope·|anchor_i - j|
            for g in range(G):
                far |= mods[g].alibi.add_t(st3[:, g], 0, Sq, j0, j1) > far_at
        ex = None
        if n_empty or TILE_PARTIAL in cj:
            ex = np.zeros((nj, G, Sq), dtype=bool)
            if shared_mask:                                         # one code for all heads
                ex[:] = plan.excluded_t(b, heads[0], 0, Sq, j0, j1)[:, None, :]
            else:
                for g, h in enumerate(heads):
                    if cj[g] == TILE_EMPTY:
                        ex[:, g] = True
                    elif cj[g] == TILE_PARTIAL:
                        ex[:, g] = plan.excluded_t(b, h, 0, Sq, j0, j1)
            np.copyto(st3, neg_inf, where=ex)
        m_new = np.maximum(m, st.max(axis=0))                       # [R]
        # rows that have kept nothing yet: subtract 0, not -inf (no -inf - -inf)
        m_use = np.where(m_new == neg_inf, dt.type(0), m_new)
        st -= m_use                                                 # [nj, R], exact at the max
        if far:                                                     # no subnormal P (slow)
            np.maximum(st, floor_row, out=st)                       # -inf too: re-zeroed below
        np.exp(st, out=st)                                          # P~ [nj, R]
        if far:
            if ex is not None:
                np.copyto(st3, dt.type(0), where=ex)
            if plan.bias_neginf:
                for g, h in enumerate(heads):
                    np.copyto(st3[:, g], dt.type(0),
                              where=np.isneginf(plan.bias_t(b, h, 0, Sq, j0, j1)))
        corr = np.exp(m - m_use)                                    # [R] rescale old terms
        l *= corr
        l += np.matmul(ones[:nj], st)                               # [R] (undropped)
        if drop is not None:
            kf = drop.keep_t(drop_rows, j0, j1)                     # [nj, R] 0/1 or None
            if kf is not None:
                st *= kf                                            # P~ ∘ keep
        acc *= corr[:, None]
        acc += np.matmul(st.T, v[j0:j1])                            # [R, Dv]
        m = m_new
    empty = l == 0                                                  # no kept key (NaN stays)
    np.divide(acc, l[:, None], out=acc, where=~empty[:, None])
    acc[empty] = 0
    if drop is not None:
        acc *= dt.type(drop.scale)                                  # keep / (1 - p)
    out[...] = acc.reshape(G, Sq, Dv)
    with np.errstate(divide="ignore"):
        ln = np.where(empty, dt.type(0), np.where(l == 1, dt.type(ONE_KEY), np.log(l)))
    rmax[...] = np.where(empty, neg_inf, m).reshape(G, Sq)
    rlog[...] = ln.reshape(G, Sq)
    return counts


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


ExactRows = Callable[[Sequence[Tuple[int, int, int]], float], TileCounts]


def forward_rows_bounded(plan: TilePlan, b: int, h: int, q2: np.ndarray, k: np.ndarray,
                         v: np.ndarray, knorm: np.ndarray, out: np.ndarray, rmax: np.ndarray,
                         rlog: np.ndarray, q_tiles: Sequence[int], exact: ExactRows,
                         mods: Optional[TileMods] = None, bound_mul: float = 1.0,
                         bound_cap: Optional[float] = None,
                         drop: Optional[DropoutTiles] = None,
                         drop_rows: Optional[np.ndarray] = None) -> TileCounts:
    """Forward without a running max, for problems without a bias (base 2).

    Each query row i has a bound ``c_i = |q2_i| * max_{kept key tiles} |k_j| >= |s_ij|``
    (Cauchy-Schwarz).  Where every bound of a query tile is at most
    :data:`BOUNDED_MAX_C` (= 64), ``P~ = exp2(s)`` lies in [2⁻⁶⁴, 2⁶⁴] and its sums
    stay far inside the float range, so no maximum needs subtracting at all: per
    tile one GEMM gives ``s``, then exp2, a row-sum GEMV and the P·V GEMM.

    Statistics (:mod:`anyattn.rowstats`): these rows keep no maximum (a column max
    per tile would cost ~5-10 % of this path), so they are derived from the sum:
    ``max`` = the lse rounded down, ``log_norm`` = the rounding residual (>= 0,
    below one ulp of max).  ``P = exp((s - max) - log_norm)`` and ``lse = max +
    log_norm`` hold as for every row; ``max`` is an upper bound of the row's largest
    score (by at most log of its key count), not that score itself.

    The running-max path ``exact(blocks, c_max)`` takes over for query tiles whose
    bound passes :data:`BOUNDED_MAX_C` (large logits, or NaN).  A row that keeps
    exactly one key (counted on the mask's partial tiles, which also name the key)
    gets P = 1: out = v of that key, ``max`` = its score, ``log_norm`` =
    :data:`ONE_KEY`.

    Score modifiers (``mods``, base 2): with a softcap q2 carries ``scale / c`` (the
    GEMM gives x/c), ``bound_mul`` = c·log2(e) turns ``|q2_i|·|k_j|`` into a score bound
    and ``bound_cap`` = c·log2(e) caps it (|c·tanh| <= c).  ALiBi's tile term is <= 0
    (0 at each row's anchor, :func:`alibi_anchors`), so the bound holds; tiles where
    ``-cmax - span`` may pass ``mods.floor`` get their exponents floored (no
    subnormals); far keys may underflow, harmlessly unless a row's sum drops below
    :data:`BOUNDED_MIN_SUM` (its nearest key masked out): that query tile is then
    recomputed by ``exact``.

    Dropout (``drop``, row words ``drop_rows`` [Sq]): as in :func:`forward_rows`; a
    one-key row gets ``keep·v/(1 - p)`` of its key.

    q2 [Sq, D] scaled queries; k [Sk, D], v [Sk, Dv]; knorm [nK]; writes out [Sq, Dv], rmax,
    rlog [Sq] on the rows of ``q_tiles``.
    """
    dt = plan.dtype
    D = v.shape[1]
    counts = TileCounts()
    codes = plan.codes_bh(b, h)
    sbuf = np.empty(plan.bq * plan.bk, dtype=dt)
    ones = np.ones(plan.bk, dtype=dt)
    pvbuf = np.empty(plan.bq * D, dtype=dt)
    qnorm = np.sqrt(np.einsum("id,id->i", q2, q2))                  # [Sq]
    if bound_mul != 1.0:
        qnorm *= dt.type(bound_mul)
    cap = mods is not None and mods.cap is not None
    alibi = None if mods is None else mods.alibi
    floor = None if mods is None or mods.floor is None else mods.floor
    if floor is not None:
        floor_row = np.full(plan.bq, floor, dtype=dt)  # [ni] (maximum with a scalar is slow)
    far = False
    Sq = q2.shape[0]
    done = np.zeros(Sq, dtype=bool)                 # rows finished here (bulk statistics)
    bl = np.empty(Sq, dtype=dt)
    single = np.zeros(Sq, dtype=bool)               # rows keeping exactly one key
    for it in q_tiles:
        i0, i1 = plan.q_range(it)
        ni = i1 - i0
        tiles = _kept_tiles(None if codes is None else codes[it], plan.nk)
        kmax = np.fmax.reduce(knorm[[t for t, _ in tiles]]) if tiles else dt.type(0)
        c = np.multiply(qnorm[i0:i1], kmax)                            # [ni] bounds
        if bound_cap is not None:
            c = np.minimum(c, dt.type(bound_cap))                      # NaN stays NaN
        cmax = float(np.max(c))
        if not cmax <= BOUNDED_MAX_C:         # large logits (or NaN): the running-max path
            counts.add(exact([(it, i0, i1)], cmax))
            continue
        tc = TileCounts(skipped=plan.nk - len(tiles))
        qt = q2[i0:i1]                                                # [ni, D]
        l = np.zeros(ni, dtype=dt)                                    # sum of exp2(s)
        acc = np.zeros((ni, D), dtype=dt)                             # P~·V
        n_full = 0                                                    # keys of full tiles
        n_part = np.zeros(ni, dtype=np.int64)                         # kept in partial ones
        key_of = np.zeros(ni, dtype=np.int64)       # a row's key, where it keeps only one
        for jt, code in tiles:
            j0, j1 = plan.k_range(jt)
            nj = j1 - j0
            # a partial tile: only the rows the band lets see these keys (nr <= ni)
            r0, r1 = plan.band_rows(i0, i1, j0, j1) if code == TILE_PARTIAL else (i0, i1)
            ra, nr = r0 - i0, r1 - r0
            if nr == 0:
                tc.skipped += 1
                continue
            st = sbuf[:nj * nr].reshape(nj, nr)
            np.matmul(k[j0:j1], qt[ra:ra + nr].T, out=st)             # s, [nj, nr]
            if cap:
                mods.cap_t(st)                                        # c·tanh(x/c)
            if alibi is not None:                   # <= 0 [nj, nr]; s >= -cmax - span
                far = alibi.add_t(st, r0, r1, j0, j1) + cmax > -floor
            if far:                               # no subnormal P~ (masked: zeroed below)
                np.maximum(st, floor_row[:nr], out=st)
            np.exp2(st, out=st)                                       # P~ [nj, nr]
            if code == TILE_PARTIAL:
                # zero the dropped pairs after exp2: exp2(-inf) takes NumPy's slow
                # special-value path (~5x); |s| <= 64, so no overflow
                ex = plan.excluded_t(b, h, r0, r1, j0, j1)
                np.copyto(st, dt.type(0), where=ex)
                if n_full < 2:        # else every row keeps >= 2 keys: no count needed
                    # [nr] kept here (a uint8 sum: 4x faster than count_nonzero(axis=0))
                    cnt = nj - np.add.reduce(ex.view(np.uint8), axis=0,
                                             dtype=np.uint16 if nj < 65536 else np.int64)
                    n_part[ra:ra + nr] += cnt
                    sel = np.flatnonzero(cnt == 1)
                    if sel.size:
                        key_of[ra + sel] = j0 + np.argmin(ex[:, sel], axis=0)
                tc.partial += 1
            else:
                n_full += nj
                if nj == 1:
                    key_of[:] = j0
                tc.full += 1
            l[ra:ra + nr] += np.matmul(ones[:nj], st)                 # [nr] (undropped)
            if drop is not None:
                kf = drop.keep_t(drop_rows[r0:r1], j0, j1)            # [nj, nr] or None
                if kf is not None:
                    st *= kf                                          # P~ ∘ keep
            pv = pvbuf[:nr * D].reshape(nr, D)
            np.matmul(st.T, v[j0:j1], out=pv)                         # [nr, D]
            acc[ra:ra + nr] += pv
        if alibi is not None:                    # a kept row whose terms all underflowed?
            low = l < dt.type(BOUNDED_MIN_SUM)
            if n_full < 2:
                low &= (n_part + n_full) > 0
            if low.any():
                counts.add(exact([(it, i0, i1)], cmax))
                continue
        counts.add(tc)
        if n_full >= 2:                          # every row kept keys (>= 2)
            acc /= l[:, None]
            bl[i0:i1] = l
        else:
            kept = n_part + n_full
            empty = kept == 0
            np.divide(acc, l[:, None], out=acc, where=~empty[:, None])
            acc[empty] = 0
            one = (kept == 1) & np.isfinite(l)    # one key: P = 1, out = its v exactly
            if one.any():
                acc[one] = v[key_of[one]]
                if drop is not None:              # ... if that pair is kept, else 0
                    sel = np.flatnonzero(one)
                    acc[sel[~drop.draw.keep_pairs(drop_rows[i0 + sel], key_of[sel])]] = 0
                single[i0:i1] = one
            bl[i0:i1] = np.where(empty, 0, l)
        if drop is not None:
            acc *= dt.type(drop.scale)                                # keep / (1 - p)
        out[i0:i1] = acc
        done[i0:i1] = True
    if done.any():          # statistics of all bounded rows at once, from lse2 = log2 l
        rows = np.flatnonzero(done)
        with np.errstate(divide="ignore"):
            m2 = np.log2(bl[rows].astype(np.float64))               # -inf on empty rows
        mx, ln = export_base2(m2, np.zeros_like(m2), dt, one_key=False)
        ln[single[rows]] = ONE_KEY               # lse = max there: the key's own score
        rmax[rows] = mx
        rlog[rows] = ln
    return counts


@dataclass
class BackwardHeads:
    """Per-query-head inputs of one key/value head's backward (lists of length G).

    q2a [Sq, D+1] = [q·scale·u | -max_u] with u = log2(e) (``base2``) or 1
    (natural units), -inf in the last column on empty rows (P = 0 there); q
    [Sq, D] raw queries; ga [Sq, Dv+1] = w·[dout | -delta] with delta = rowsum(dout
    * out) and w = exp(-log_norm); dq [Sq, D] accumulators (unscaled: the caller
    multiplies by ``scale``) or None; heads: the query-head indices; snap: per
    head, :func:`snap_plan`'s rows whose top key gets P = 1 exactly.  The extra
    columns let one GEMM against ``[k | 1]`` / ``[v | 1]`` produce ``s - max`` and
    ``w·(dP - delta)`` directly; ``P = exp(s - max)·w`` never forms.

    Score modifiers: ``cap`` = c·u (softcap) or None; q2a then holds
    ``[q·scale/c | -max_u]`` and the kernel applies the max after the cap (GEMM
    against k alone, ``c·u·tanh``, then ``- max_u``).  ``alibi``: per head an
    :class:`AlibiRows` (the maxima in q2a are then those of the rebased scores) or None.
    ``gaf`` (softcap in base 2 without bias or ALiBi, where ``exp2(c·u·tanh)`` cannot
    leave the normal range): ga with ``2^-max_u`` folded into w, so that the kernel
    skips the ``- max_u`` pass (``P = exp2(c·u·t)·2^-max_u·w``) on tiles without
    :func:`snap_plan` rows.
    ``floor``: exponents are raised to it before the exp (:data:`EXP_FLOOR2`) on tiles
    where ALiBi reaches below ``FAR_FRACTION·floor``; ga must then be 0 on empty rows
    (their -inf column is floored too).
    ``score`` (score_mod, natural units): :class:`~anyattn.programs.bound.ScoreTiles`;
    q2a then holds ``[q·scale | -max]`` (or ``scale / c`` with a cap) and ``cols`` the
    -max column: the kernel applies the function to the score GEMM against k alone,
    then subtracts the max; dS' (of the function's output) goes to dbias and, times the
    function's derivatives, scatter-adds into ``dcap`` {capture: float64 gradient};
    dS = dS'·d s'/d s continues to dq and dk.
    ``drop`` (dropout): per-unit :class:`DropoutTiles` with ``drop_rows`` [Sq] per head;
    ga (and gaf) then hold ``[w·dout/(1 - p) | -w·delta]``: the kernel forms
    ``dSᵀ = P~ ∘ (keep ∘ (v·(w g/(1 - p))ᵀ) - w·delta)`` (GEMM against v alone) and
    ``dv += (P~ ∘ keep)·(w g/(1 - p))``.
    """

    heads: List[int]
    q2a: List[np.ndarray]
    q: List[np.ndarray]
    ga: List[np.ndarray]
    dq: Optional[List[np.ndarray]]
    base2: bool = True
    snap: Optional[List[Dict[int, Tuple[np.ndarray, np.ndarray]]]] = None
    cap: Optional[float] = None
    cols: Optional[List[np.ndarray]] = None  # with cap: -max_u [Sq] per head, contiguous
    gaf: Optional[List[np.ndarray]] = None   # with cap: w·2^-max_u·[dout | -delta] or None
    alibi: Optional[List[AlibiRows]] = None
    floor: Optional[float] = None          # lowest exponent fed to exp (EXP_FLOOR2)
    qk_bound: Optional[List[float]] = None  # per head: bound of |scale·qk| (kernel units)
    drop: Optional[DropoutTiles] = None     # dropout scratch of this unit
    drop_rows: Optional[List[np.ndarray]] = None   # per head: row words [Sq] (DropoutDraw)
    score: Optional[ScoreTiles] = None      # score_mod (natural units; cols given)
    dcap: Optional[Dict[str, np.ndarray]] = None   # float64 capture gradients of this unit


def backward_keys(plan: TilePlan, b: int, hs: BackwardHeads, ka: np.ndarray, va: np.ndarray,
                  dk: Optional[np.ndarray], dv: Optional[np.ndarray],
                  dbias: Optional[np.ndarray], k_tiles: Sequence[int],
                  scale: float) -> TileCounts:
    """Backward of one (batch b, kv head) over the key tiles ``k_tiles``.

    Loops key tiles x query heads of the group x query tiles, recomputing
    P~ = exp((s - max) + bias) per tile (P = w·P~, w folded into ``ga``):
    dv[j] += P~ᵀ (w g), dk[j] += scale·dSᵀ q (both
    finished per key tile, rows of ``k_tiles`` only), dq[h] += dS k (full
    accumulators, unscaled), dbias += dS (summed over its broadcast dims).  With a
    softcap dS is multiplied by ``1 - tanh²(x/c)`` after dbias, before dq and dk.  With
    dropout (``hs.drop``) dS is formed first, then P~ is multiplied by the keep tile
    for dv (see :class:`BackwardHeads`).
    ka [Sk, D+1] = [k | 1], va [Sk, Dv+1] = [v | 1]; dk [Sk, D], dv [Sk, Dv] outputs or
    None; dbias [Bb, Hb, Sqb, Skb] or None.
    """
    dt = plan.dtype
    D = ka.shape[1] - 1
    Dv = va.shape[1] - 1
    counts = TileCounts()
    need_ds = dk is not None or hs.dq is not None or dbias is not None or hs.dcap is not None
    smod = hs.score
    sbuf = np.empty(plan.bq * plan.bk, dtype=dt)   # P tile
    pbuf = np.empty(plan.bq * plan.bk, dtype=dt)   # dP / dS tile
    cap = hs.cap is not None
    tbuf = np.empty(plan.bq * plan.bk, dtype=dt) if cap else None   # tanh(x/c) tile
    capu = dt.type(hs.cap) if cap else None
    floor = hs.floor
    if floor is not None:
        floor_row = np.full(plan.bq, floor, dtype=dt)  # [ni] (maximum with a scalar is slow)
        # (s - max) + alibi >= -2·qk_bound - span: floor where that can pass the floor
        far_at = [FAR_FRACTION * -floor if hs.qk_bound is None else -floor - 2 * qb
                  for qb in (hs.qk_bound or hs.heads)]
    far = False
    codes = [plan.codes_bh(b, h) for h in hs.heads]
    expf = np.exp2 if hs.base2 else np.exp
    snaps = hs.snap if hs.snap and any(hs.snap) else None
    ones = np.ones(plan.bk, dtype=dt) if snaps is not None else None   # [bk] (_snap)
    drop = hs.drop
    vt = va[:, :Dv]                                 # [Sk, Dv] (dropout's dP GEMM)
    # dropped pairs may overflow in exp; an empty row's -inf column meets BLAS's zero
    # padding (0·inf) inside the GEMM: both harmless, silenced once for the whole loop
    with np.errstate(over="ignore", invalid="ignore"):
        for jt in k_tiles:
            j0, j1 = plan.k_range(jt)
            nj = j1 - j0
            kta, vta = ka[j0:j1], va[j0:j1]                        # [nj, D+1], [nj, Dv+1]
            kt = kta[:, :D]                                         # [nj, D]
            dk_acc = np.zeros((nj, D), dtype=dt) if dk is not None else None
            dv_acc = np.zeros((nj, Dv), dtype=dt) if dv is not None else None
            for gi, h in enumerate(hs.heads):
                c = codes[gi]
                tiles = _kept_tiles(None if c is None else c[:, jt], plan.nq)
                counts.skipped += plan.nq - len(tiles)
                for it, code in tiles:
                    i0, i1 = plan.q_range(it)
                    ni = i1 - i0
                    # a partial tile: only the keys the band lets these queries see
                    c0, c1 = (plan.band_keys(i0, i1, j0, j1) if code == TILE_PARTIAL
                              else (j0, j1))
                    ks, nc = slice(c0 - j0, c1 - j0), c1 - c0
                    if nc == 0:
                        counts.skipped += 1
                        continue
                    st = sbuf[:nc * ni].reshape(nc, ni)
                    qa = hs.q2a[gi][i0:i1]                          # [ni, D+1]
                    sn = None if snaps is None else snaps[gi].get(it)
                    fold = hs.gaf is not None and sn is None        # 2^-max_u inside gaf
                    if cap:
                        tt = tbuf[:nc * ni].reshape(nc, ni)
                        np.matmul(kt[ks], qa[:, :D].T, out=tt)      # x/c, [nc, ni]
                        np.tanh(tt, out=tt)                         # t = tanh(x/c)
                        np.multiply(tt, capu, out=st)               # c·t
                    elif smod is not None:
                        np.matmul(kt[ks], qa[:, :D].T, out=st)      # s, [nc, ni]
                    if smod is not None:                            # s' = score_mod(s)
                        st, dsc, gath = smod.apply_grad_t(st, b, h, i0, i1, c0, c1)
                    if cap or smod is not None:
                        if not fold:
                            st += hs.cols[gi][i0:i1]                # s' - max [nc, ni]
                    else:
                        np.matmul(kta[ks], qa.T, out=st)            # s - max, [nc, ni]
                    if plan.bias is not None:                       # natural units
                        st += plan.bias_t(b, h, i0, i1, c0, c1)     # (s - max) + bias
                    if hs.alibi is not None:                        # - slope·|anchor_i - j|
                        far = hs.alibi[gi].add_t(st, i0, i1, c0, c1) > far_at[gi]
                    if far:                                         # no subnormal P (slow)
                        np.maximum(st, floor_row[:ni], out=st)
                    expf(st, out=st)                                # P~ᵀ [nc, ni]
                    if far and plan.bias_neginf:                    # a -inf bias drops
                        np.copyto(st, dt.type(0),
                                  where=np.isneginf(plan.bias_t(b, h, i0, i1, c0, c1)))
                    ex = None
                    if code == TILE_PARTIAL:
                        # zeroed after exp: exp(-inf) is NumPy's slow special-value path
                        ex = plan.excluded_t(b, h, i0, i1, c0, c1)
                        np.copyto(st, dt.type(0), where=ex)
                        counts.partial += 1
                    else:
                        counts.full += 1
                    zero_ds = None
                    if sn is not None:                              # rows carried by one key
                        zero_ds = _snap(st, *sn, ones)
                    gta = (hs.gaf if fold else hs.ga)[gi][i0:i1]    # [ni, Dv+1]
                    kf = None
                    if drop is not None:                            # keep tile [nc, ni]
                        kf = drop.keep_t(hs.drop_rows[gi][i0:i1], c0, c1)
                    elif dv_acc is not None:
                        dv_acc[ks] += np.matmul(st, gta[:, :Dv])    # [nc, Dv]
                    if not need_ds:
                        if drop is not None and dv_acc is not None:
                            if kf is not None:
                                st *= kf                            # P~ ∘ keep
                            dv_acc[ks] += np.matmul(st, gta[:, :Dv])  # [nc, Dv]
                        continue
                    dst = pbuf[:nc * ni].reshape(nc, ni)
                    if drop is None:
                        np.matmul(vta[ks], gta.T, out=dst)          # w·(dPᵀ - delta), [nc, ni]
                    else:                                   # w·(keep∘dPᵀ/(1 - p) - delta)
                        np.matmul(vt[c0:c1], gta[:, :Dv].T, out=dst)
                        if kf is not None:
                            dst *= kf
                        dst += np.ascontiguousarray(gta[:, Dv])     # a strided row: 2x slower
                    if zero_ds is not None:                         # P = 1: dP - delta = 0
                        sub = dst[:, zero_ds[0]]
                        sub[zero_ds[1]] = 0
                        dst[:, zero_ds[0]] = sub
                    dst *= st                                       # dSᵀ [nc, ni]
                    if drop is not None and dv_acc is not None:     # dv from P~ ∘ keep
                        if kf is not None:
                            st *= kf
                        dv_acc[ks] += np.matmul(st, gta[:, :Dv])    # [nc, Dv]
                    if dbias is not None:
                        plan.add_dbias(dbias, dst, b, h, i0, i1, c0, c1)
                    if smod is not None:                            # through score_mod
                        for name, idx, dg in (gath if hs.dcap is not None else ()):
                            one = np.ndim(dg) == 0 and dg == 1
                            contrib = dst if one and ex is None else dst * dg   # [nc, ni]
                            if ex is not None:                      # dropped pairs: 0
                                np.copyto(contrib, dt.type(0), where=ex)
                            scatter_add(hs.dcap[name], idx, contrib)
                        if dsc is not None:
                            dst *= dsc                              # dS = dS'·d s'/d s
                            if ex is not None:
                                np.copyto(dst, dt.type(0), where=ex)
                    if cap and (dk_acc is not None or hs.dq is not None):
                        np.multiply(tt, tt, out=tt)                 # t²
                        np.subtract(dt.type(1), tt, out=tt)         # 1 - t² [nc, ni]
                        dst *= tt                                   # dS·(1 - t²)
                    if dk_acc is not None:
                        dk_acc[ks] += np.matmul(dst, hs.q[gi][i0:i1])   # [nc, D]
                    if hs.dq is not None:
                        hs.dq[gi][i0:i1] += np.matmul(dst.T, kt[ks])    # [ni, D]
            if dk is not None:
                dk_acc *= dt.type(scale)
                dk[j0:j1] = dk_acc
            if dv is not None:
                dv[j0:j1] = dv_acc
    return counts
