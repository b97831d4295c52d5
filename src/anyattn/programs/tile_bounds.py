"""Interval bounds of a mask function over whole tiles, for every tile at once.

A tile of queries ``[i0, i1)`` and keys ``[j0, j1)`` of one (b, h) is a box of index
values; each integer or bool node of the graph gets, per tile, an interval ``[lo, hi]``
that holds every value the node takes on the box (a sound bound, not always the tightest:
correlations between arguments are ignored).  A mask whose interval is ``[1, 1]`` on a
tile keeps every pair of it (the tile is full), ``[0, 0]`` none (empty); anything else
leaves the tile undecided, and the caller evaluates it pair by pair.  So the bounds
decide most tiles of banded, chunked, document and prefix masks in O(nQ·nK) work and the
classification stays exact.

Intervals are float64 arrays broadcastable to [Bx, Hx, nQ, nK] (inf for an unknown
side).  Integers are exact in float64 below 2**53; a bound that reaches 2**53 widens to
infinity, so rounding never narrows an interval.  Float nodes have no interval (None):
a comparison of floats is undecided.  Integer gathers read the capture's min / max over
the index intervals: exactly where one axis spans a range and the others are single
values on each tile (a sparse table of minima and maxima along that axis), else the
capture's global min / max.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Tuple

import numpy as np

from .graph import BOOL, FLOAT, Node

__all__ = ["tile_intervals", "SparseRange"]

_BIG = float(2 ** 53)
Interval = Optional[Tuple[np.ndarray, np.ndarray]]
_UNKNOWN_INT = (-np.inf, np.inf)

#: a sparse table holds at most this many elements (levels × capture size); larger
#: captures bound their gathers by their global min / max
SPARSE_LIMIT = 1 << 24


def _widen(lo, hi) -> Tuple[np.ndarray, np.ndarray]:
    lo = np.where(np.abs(lo) >= _BIG, -np.inf, lo)
    hi = np.where(np.abs(hi) >= _BIG, np.inf, hi)
    return lo, hi


def _finite(*xs):
    out = True
    for x in xs:
        out = out & np.isfinite(x)
    return out


def _mul(a, b):
    with np.errstate(invalid="ignore"):
        p = a * b
    return np.where((a == 0) | (b == 0), 0.0, p)          # 0 · inf = 0 here


class SparseRange:
    """Range minima and maxima of an integer / bool array along one axis: after
    O(n log n) preparation, ``query(idx, lo, hi)`` answers min and max of
    ``c[idx..., lo:hi + 1, ...]`` for arrays of single indices and bounds at once."""

    def __init__(self, c: np.ndarray, axis: int):
        a = np.moveaxis(c, axis, -1)                        # [..., n]
        n = a.shape[-1]
        self.axis, self.n = axis, n
        levels = self.levels(n)
        self.mins = np.empty((levels,) + a.shape, np.float64)   # [L, ..., n]
        self.maxs = np.empty((levels,) + a.shape, np.float64)
        self.mins[0] = a
        self.maxs[0] = a
        step = 1
        for lv in range(1, levels):
            # level lv: over [i, i + 2**lv); entries past n - 2**lv are never read
            np.minimum(self.mins[lv - 1, ..., :n - step], self.mins[lv - 1, ..., step:],
                       out=self.mins[lv, ..., :n - step])
            np.maximum(self.maxs[lv - 1, ..., :n - step], self.maxs[lv - 1, ..., step:],
                       out=self.maxs[lv, ..., :n - step])
            step *= 2
        #: floor(log2(w)) of every width w in [1, n]
        self.log2 = np.maximum(np.frexp(np.arange(n + 1, dtype=np.float64))[1] - 1,
                               0).astype(np.intp)

    @staticmethod
    def levels(n: int) -> int:
        """Levels a table of n entries needs: 2**(L-1) <= n."""
        return max(1, int(n).bit_length())

    def query(self, others: Sequence[np.ndarray], lo, hi):
        """(min, max) over [lo, hi] (int arrays, lo <= hi) along the axis; ``others``:
        the single index of every other axis, in order."""
        k = self.log2[hi - lo + 1]                            # 2**k <= width < 2**(k+1)
        right = hi - (np.intp(1) << k) + 1
        idx = tuple(others)
        mn = np.minimum(self.mins[(k,) + idx + (lo,)], self.mins[(k,) + idx + (right,)])
        mx = np.maximum(self.maxs[(k,) + idx + (lo,)], self.maxs[(k,) + idx + (right,)])
        return mn, mx


def _gather(n: Node, args, caps: Dict[str, np.ndarray], specs, tables: dict) -> Interval:
    c = caps[n.attr]
    if specs[n.attr].dtype == FLOAT:
        return None
    if c.size == 0:
        return _UNKNOWN_INT if n.dtype != BOOL else (0.0, 1.0)
    if not n.args:
        v = float(c[()])
        return v, v
    ranges = []
    for ax, a in enumerate(args):
        lo, hi = a if a is not None else _UNKNOWN_INT
        top = c.shape[ax] - 1
        # every real index lies in [0, top] (checked when the program was bound)
        lo = np.clip(np.where(np.isfinite(lo), lo, 0), 0, top)
        hi = np.clip(np.where(np.isfinite(hi), hi, top), 0, top)
        ranges.append((lo, hi))
    spans = [ax for ax, (lo, hi) in enumerate(ranges) if np.any(lo != hi)]
    if not spans:
        v = c[tuple(lo.astype(np.intp) for lo, _ in ranges)].astype(np.float64)
        return v, v
    if len(spans) == 1:
        ax = spans[0]
        key = (n.attr, ax)
        if key not in tables:
            levels = SparseRange.levels(c.shape[ax])
            tables[key] = SparseRange(c, ax) if levels * c.size <= SPARSE_LIMIT else None
        table = tables[key]
        if table is not None:
            others = [lo.astype(np.intp) for a, (lo, _) in enumerate(ranges) if a != ax]
            lo, hi = ranges[ax]
            shape = np.broadcast_shapes(lo.shape, hi.shape, *(o.shape for o in others))
            lo = np.broadcast_to(lo, shape).astype(np.intp)
            hi = np.broadcast_to(hi, shape).astype(np.intp)
            return table.query([np.broadcast_to(o, shape) for o in others], lo, hi)
    key = (n.attr, None)
    if key not in tables:
        tables[key] = (float(c.min()), float(c.max()))
    return tables[key]


def _cmp(op: str, a: Interval, b: Interval) -> Interval:
    if a is None or b is None:
        return 0.0, 1.0
    (alo, ahi), (blo, bhi) = a, b
    if op == "lt":
        t, f = ahi < blo, alo >= bhi
    elif op == "le":
        t, f = ahi <= blo, alo > bhi
    elif op == "gt":
        t, f = alo > bhi, ahi <= blo
    elif op == "ge":
        t, f = alo >= bhi, ahi < blo
    else:
        same = (alo == ahi) & (blo == bhi) & (alo == blo)
        apart = (ahi < blo) | (bhi < alo)
        t, f = (same, apart) if op == "eq" else (apart, same)
    return np.where(t, 1.0, 0.0), np.where(f, 0.0, 1.0)


def _floordiv(a, b) -> Tuple[np.ndarray, np.ndarray]:
    (alo, ahi), (blo, bhi) = a, b
    ok = ((blo > 0) | (bhi < 0)) & _finite(alo, ahi, blo, bhi)
    one = lambda x, y: np.floor_divide(x, np.where(ok, y, 1.0))  # noqa: E731
    vals = [one(x, y) for x in (alo, ahi) for y in (blo, bhi)]
    lo = np.minimum(np.minimum(vals[0], vals[1]), np.minimum(vals[2], vals[3]))
    hi = np.maximum(np.maximum(vals[0], vals[1]), np.maximum(vals[2], vals[3]))
    return np.where(ok, lo, -np.inf), np.where(ok, hi, np.inf)


def _mod(a, b) -> Tuple[np.ndarray, np.ndarray]:
    (alo, ahi), (blo, bhi) = a, b
    fin = _finite(alo, ahi)
    pos, neg = blo > 0, bhi < 0
    # a divisor of one positive value m with a range inside one period: [lo % m, hi % m]
    m = np.where(pos & (blo == bhi), blo, 1.0)
    one = fin & pos & (blo == bhi) & (np.floor_divide(np.where(fin, alo, 0), m)
                                      == np.floor_divide(np.where(fin, ahi, 0), m))
    lo = np.where(pos, 0.0, np.where(neg, blo + 1, -np.inf))
    hi = np.where(pos, bhi - 1, np.where(neg, 0.0, np.inf))
    inside = fin & pos & (alo >= 0) & (ahi < blo)            # 0 <= a < every divisor
    lo, hi = np.where(inside, alo, lo), np.where(inside, ahi, hi)
    lo = np.where(one, np.mod(np.where(fin, alo, 0), m), lo)
    hi = np.where(one, np.mod(np.where(fin, ahi, 0), m), hi)
    return lo, hi


def tile_intervals(out: Node, order: Sequence[Node], caps: Dict[str, np.ndarray], specs,
                   boxes: Dict[str, Tuple[np.ndarray, np.ndarray]],
                   tables: Optional[dict] = None) -> Interval:
    """The interval of ``out`` (a bool or integer node) over every tile box.

    ``order``: ``ordered([out])``; ``caps``: the captures (NumPy, by name); ``boxes``:
    for each index input (``b``, ``h``, ``q_idx``, ``kv_idx``) the (lo, hi) arrays of its
    values on each tile, broadcastable to one another.  Returns (lo, hi) arrays (or
    scalars) broadcastable to the tiles' shape, or None (a float output).  ``tables``:
    a dict that keeps the captures' range tables from call to call (same ``caps``)."""
    iv: Dict[int, Interval] = {}
    tables = {} if tables is None else tables
    for n in order:
        op = n.op
        if n.dtype == FLOAT:
            iv[n.uid] = None
            continue
        a = [iv[x.uid] for x in n.args]
        if op == "input":
            r = boxes[n.attr]
        elif op == "const":
            v = float(n.attr)
            r = (v, v)
        elif op == "gather":
            r = _gather(n, a, caps, specs, tables)
        elif op in ("lt", "le", "gt", "ge", "eq", "ne"):
            r = _cmp(op, a[0], a[1])
        elif op == "not":
            r = (1.0 - a[0][1], 1.0 - a[0][0])
        elif op == "and":
            r = (np.minimum(a[0][0], a[1][0]), np.minimum(a[0][1], a[1][1]))
        elif op == "or":
            r = (np.maximum(a[0][0], a[1][0]), np.maximum(a[0][1], a[1][1]))
        elif op == "xor":
            (xl, xh), (yl, yh) = a
            known = (xl == xh) & (yl == yh)
            v = np.where(xl != yl, 1.0, 0.0)
            r = (np.where(known, v, 0.0), np.where(known, v, 1.0))
        elif op == "where":
            (cl, ch) = a[0]
            x, y = a[1], a[2]
            if x is None or y is None:
                r = None
            else:
                lo = np.where(cl == 1, x[0], np.where(ch == 0, y[0], np.minimum(x[0], y[0])))
                hi = np.where(cl == 1, x[1], np.where(ch == 0, y[1], np.maximum(x[1], y[1])))
                r = (lo, hi)
        elif n.dtype == BOOL:                                 # pragma: no cover - internal
            r = (0.0, 1.0)
        elif any(x is None for x in a):
            r = _UNKNOWN_INT
        elif op == "toint":
            r = a[0]
        elif op == "add":
            r = _widen(a[0][0] + a[1][0], a[0][1] + a[1][1])
        elif op == "sub":
            r = _widen(a[0][0] - a[1][1], a[0][1] - a[1][0])
        elif op == "neg":
            r = (-a[0][1], -a[0][0])
        elif op == "mul":
            v = [_mul(x, y) for x in a[0] for y in a[1]]
            r = _widen(np.minimum(np.minimum(v[0], v[1]), np.minimum(v[2], v[3])),
                       np.maximum(np.maximum(v[0], v[1]), np.maximum(v[2], v[3])))
        elif op == "abs":
            lo, hi = a[0]
            r = (np.where(lo >= 0, lo, np.where(hi <= 0, -hi, 0.0)),
                 np.maximum(np.abs(lo), np.abs(hi)))
        elif op == "sign":
            r = (np.sign(a[0][0]), np.sign(a[0][1]))
        elif op == "minimum":
            r = (np.minimum(a[0][0], a[1][0]), np.minimum(a[0][1], a[1][1]))
        elif op == "maximum":
            r = (np.maximum(a[0][0], a[1][0]), np.maximum(a[0][1], a[1][1]))
        elif op == "invert":
            r = (-a[0][1] - 1, -a[0][0] - 1)
        elif op == "floordiv":
            r = _floordiv(a[0], a[1])
        elif op == "mod":
            r = _mod(a[0], a[1])
        elif op == "bitand":
            nonneg = (a[0][0] >= 0) & (a[1][0] >= 0)
            r = (np.where(nonneg, 0.0, -np.inf),
                 np.where(nonneg, np.minimum(a[0][1], a[1][1]), np.inf))
        else:                     # pow, bitor, bitxor, trunc_int: no bound kept
            r = _UNKNOWN_INT
        iv[n.uid] = r
    return iv[out.uid]
