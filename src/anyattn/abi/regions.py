"""Index geometry of strided regions in a flat arena: bounds, duplicates, overlaps.

A :class:`Region` is the set of arena indices ``off + sum_k i_k * strides[k]``
for ``0 <= i_k < shape[k]`` (offsets and strides in elements, all >= 0).

The checks never enumerate elements, so they take the same time for 10 elements
as for 2**40.  Both questions are one bounded linear Diophantine equation:

* a duplicate in ``r``: ``sum_k d_k * s_k = 0`` with ``d != 0``, ``|d_k| < n_k``;
* a common index of ``a`` and ``b``: ``sum_k i_k a_k - sum_k j_k b_k = off_b - off_a``
  with ``0 <= i_k < n_k``, ``0 <= j_k < m_k``.

:func:`_solve` decides such an equation exactly (and returns a solution) for the
handful of variables a region has:

1. interval arithmetic: the reachable sums lie in ``[sum c*lo, sum c*hi]``;
2. structure: variables with equal strides, or a stride that is a multiple ``k``
   of a smaller one whose range covers ``k`` consecutive values (contiguous rows,
   overlapping rows, ``[B, S, H, D]`` views...), merge into one variable with one
   interval, exactly;
3. number theory: the sums of the other variables are multiples of their gcd ``g``,
   so a branching variable ``x`` must satisfy ``c*x = t (mod g)``; two variables
   are solved in closed form with the extended Euclidean algorithm;
4. what is left branches on the variable with the fewest candidates, memoised.

Step 4 is bounded by :data:`BUDGET` nodes; layouts that would need more (strides
chosen so that several dims interleave without structure) are refused by the caller
as undecidable, unless the regions are small (<= :data:`ENUMERATE_UP_TO` elements),
where an exact enumeration is cheap.
"""
from __future__ import annotations

from dataclasses import dataclass
from math import gcd
from typing import Dict, Iterator, List, Optional, Tuple

import numpy as np

__all__ = ["Region", "Undecided", "first_duplicate", "first_common", "BUDGET",
           "ENUMERATE_UP_TO"]

#: indices enumerated per step when walking a region (bounds memory).
_CHUNK = 1 << 20
#: search nodes the exact solver may visit before it gives up (about 0.1 s).
BUDGET = 20000
#: regions at most this large are enumerated when the solver gives up.
ENUMERATE_UP_TO = 1 << 22


class Undecided(Exception):
    """The exact solver ran out of its budget (a layout without exploitable structure)."""


@dataclass(frozen=True)
class Region:
    """One tensor's place in the arena.

    ``name``: what it is ('q', 'dy', 'mask', 'out', ...); ``fields``: the
    Params fields that place it (named in error messages).
    """

    name: str
    off: int
    shape: Tuple[int, ...]
    strides: Tuple[int, ...]
    fields: Tuple[str, ...]

    @property
    def size(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def is_empty(self) -> bool:
        return self.size == 0

    def extent(self) -> Optional[Tuple[int, int]]:
        """(first, last) index touched, or None for an empty region (exact Python ints)."""
        if self.is_empty:
            return None
        last = self.off + sum((n - 1) * s for n, s in zip(self.shape, self.strides))
        return self.off, last

    def distinct(self) -> "Region":
        """The same index set with stride-0 dims collapsed to size 1."""
        shape = tuple(1 if s == 0 else n for n, s in zip(self.shape, self.strides))
        return Region(self.name, self.off, shape, self.strides, self.fields)

    def index_of(self, pos) -> int:
        """The arena index of the element at multi-index ``pos``."""
        return self.off + sum(int(i) * s for i, s in zip(pos, self.strides))

    def indices(self, chunk: int = _CHUNK) -> Iterator[np.ndarray]:
        """The region's indices (int64, row-major order), in chunks of <= ``chunk``.
        O(elements): for tests and small regions only."""
        shape, strides = self.shape, self.strides
        total = self.size
        inner = [1] * len(shape)          # elements spanned by one step of dim k
        acc = 1
        for k in range(len(shape) - 1, -1, -1):
            inner[k] = acc
            acc *= shape[k]
        for start in range(0, total, chunk):
            pos = np.arange(start, min(total, start + chunk), dtype=np.int64)
            idx = np.full(pos.shape, self.off, dtype=np.int64)
            for n, st, inn in zip(shape, strides, inner):
                if n > 1 and st:
                    idx += ((pos // inn) % n) * st
            yield idx


# ------------------------------------------------------------------ the solver
def _cdiv(a: int, b: int) -> int:
    return -((-a) // b)


def _egcd(a: int, b: int) -> Tuple[int, int, int]:
    """(g, x, y) with a*x + b*y = g = gcd(a, b) >= 0."""
    x0, y0, x1, y1 = 1, 0, 0, 1
    while b:
        q, a, b = a // b, b, a % b
        x0, x1 = x1, x0 - q * x1
        y0, y1 = y1, y0 - q * y1
    return a, x0, y0


class _Var:
    """An unknown ``x`` in ``[lo, hi]`` with coefficient ``c > 0``.

    A merged variable stands for ``fine + k * coarse`` (both _Var of coefficient 1
    relative to it); ``leaf`` is the caller's variable number for a plain one.
    """

    __slots__ = ("c", "lo", "hi", "leaf", "fine", "coarse", "k")

    def __init__(self, c, lo, hi, leaf=None, fine=None, coarse=None, k=1):
        self.c, self.lo, self.hi = c, lo, hi
        self.leaf, self.fine, self.coarse, self.k = leaf, fine, coarse, k

    def assign(self, z: int, out: Dict[int, int]) -> None:
        """Spread the value ``z`` of this variable over the caller's variables."""
        if self.leaf is not None:
            out[self.leaf] = z
            return
        f, g, k = self.fine, self.coarse, self.k
        # z = x + k*y with x in [f.lo, f.hi], y in [g.lo, g.hi]: such a y exists
        y = max(g.lo, _cdiv(z - f.hi, k))
        f.assign(z - k * y, out)
        g.assign(y, out)


def _merge(vs: List[_Var]) -> List[_Var]:
    """Merge variables whose combined values form one interval (exact)."""
    vs = sorted(vs, key=lambda v: v.c)
    changed = True
    while changed:
        changed = False
        for i in range(len(vs)):
            a = vs[i]
            for j in range(i + 1, len(vs)):
                b = vs[j]
                if b.c % a.c:
                    continue
                k = b.c // a.c
                if a.hi - a.lo + 1 < k:
                    continue
                m = _Var(a.c, a.lo + k * b.lo, a.hi + k * b.hi, fine=a, coarse=b, k=k)
                vs = sorted([v for n, v in enumerate(vs) if n not in (i, j)] + [m],
                            key=lambda v: v.c)
                changed = True
                break
            if changed:
                break
    return vs


class _Search:
    def __init__(self, budget: int):
        self.budget = budget
        self.memo: Dict[Tuple[Tuple[int, ...], int], bool] = {}

    def solve(self, vs: List[_Var], t: int) -> Optional[Dict[int, int]]:
        sol: Dict[int, int] = {}
        return sol if self._go(tuple(vs), t, sol) else None

    def _go(self, vs: Tuple[_Var, ...], t: int, sol: Dict[int, int]) -> bool:
        self.budget -= 1
        if self.budget < 0:
            raise Undecided
        if not vs:
            return t == 0
        lo_sum = sum(v.c * v.lo for v in vs)
        hi_sum = sum(v.c * v.hi for v in vs)
        if not lo_sum <= t <= hi_sum:
            return False
        g = 0
        for v in vs:
            g = gcd(g, v.c)
        if t % g:
            return False
        if len(vs) == 1:
            v = vs[0]
            v.assign(t // v.c, sol)
            return True
        if len(vs) == 2:
            return self._two(vs[0], vs[1], t, sol)
        key = (tuple(id(v) for v in vs), t)
        if self.memo.get(key) is False:
            return False
        # branch on the variable with the fewest candidate values
        best = None
        for i, v in enumerate(vs):
            rest = vs[:i] + vs[i + 1:]
            lo_r = lo_sum - v.c * v.lo
            hi_r = hi_sum - v.c * v.hi
            gr = 0
            for w in rest:
                gr = gcd(gr, w.c)
            lo = max(v.lo, _cdiv(t - hi_r, v.c))
            hi = min(v.hi, (t - lo_r) // v.c)
            # c*x = t (mod gr): x = x0 (mod step)
            d, inv, _ = _egcd(v.c % gr, gr)
            if t % d:
                return self._fail(key)
            step = gr // d
            x0 = ((t // d) * inv) % step if step > 1 else 0
            first = lo + ((x0 - lo) % step)
            count = 0 if first > hi else (hi - first) // step + 1
            if best is None or count < best[0]:
                best = (count, v, rest, first, step)
            if count == 0:
                return self._fail(key)
        count, v, rest, first, step = best
        for x in range(first, first + count * step, step):
            if self._go(rest, t - v.c * x, sol):
                v.assign(x, sol)
                return True
        return self._fail(key)

    def _fail(self, key) -> bool:
        self.memo[key] = False
        return False

    @staticmethod
    def _two(a: _Var, b: _Var, t: int, sol: Dict[int, int]) -> bool:
        """a.c*x + b.c*y = t, x in [a.lo, a.hi], y in [b.lo, b.hi], in closed form."""
        g, u, _ = _egcd(a.c, b.c)
        if t % g:
            return False
        ca, cb, tt = a.c // g, b.c // g, t // g
        x0 = (tt * u) % cb                 # x = x0 + cb*s, y = (tt - ca*x) / cb
        # x >= a.lo, x <= a.hi
        s_lo = _cdiv(a.lo - x0, cb)
        s_hi = (a.hi - x0) // cb
        # y = (tt - ca*x0)/cb - ca*s in [b.lo, b.hi]
        y0 = (tt - ca * x0) // cb
        s_lo = max(s_lo, _cdiv(y0 - b.hi, ca))
        s_hi = min(s_hi, (y0 - b.lo) // ca)
        if s_lo > s_hi:
            return False
        a.assign(x0 + cb * s_lo, sol)
        b.assign(y0 - ca * s_lo, sol)
        return True


def _solve(terms: List[Tuple[int, int, int]], t: int,
           budget: Optional[int] = None) -> Optional[List[int]]:
    """A solution x of ``sum c_i x_i = t`` with ``lo_i <= x_i <= hi_i`` (``terms`` =
    [(c_i, lo_i, hi_i)], c_i >= 0), or None if there is none.  Raises :class:`Undecided`
    past ``budget`` search nodes."""
    x = [lo for _, lo, _ in terms]
    vs = []
    for i, (c, lo, hi) in enumerate(terms):
        if lo > hi:
            return None
        if c == 0:
            x[i] = 0 if lo <= 0 <= hi else lo
        elif lo == hi:
            t -= c * lo
        else:
            vs.append(_Var(c, lo, hi, leaf=i))
    sol = _Search(BUDGET if budget is None else budget).solve(_merge(vs), t)
    if sol is None:
        return None
    for i, val in sol.items():
        x[i] = val
    return x


# ------------------------------------------------------------------ the checks
def _dims(r: Region):
    """Dims of size > 1 as (stride, size, axis)."""
    return [(s, n, ax) for ax, (n, s) in enumerate(zip(r.shape, r.strides)) if n > 1]


def first_duplicate(r: Region) -> Optional[int]:
    """An index that ``r`` touches more than once, or None if every index is distinct.

    Exact, in time independent of the element count (see the module doc); raises
    :class:`Undecided` only for a large region whose strides defeat the solver."""
    if r.is_empty:
        return None
    dims = sorted(_dims(r), reverse=True)              # by decreasing stride
    for s, n, ax in dims:
        if s == 0:
            return r.off
    span, nested = 0, True                             # each stride beyond all smaller spans
    for s, n, _ in reversed(dims):
        if s <= span:
            nested = False
            break
        span += (n - 1) * s
    if nested:
        return None
    try:
        # d != 0: the first nonzero d (by decreasing stride) is positive
        for lead in range(len(dims)):
            terms = [(s, 1, n - 1) if i == lead else (s, -(n - 1), n - 1)
                     for i, (s, n, _) in enumerate(dims) if i >= lead]
            d = _solve(terms, 0)
            if d is not None:
                pos = [0] * len(r.shape)
                for (s, n, ax), di in zip(dims[lead:], d):
                    pos[ax] = max(0, -di)              # pos and pos + d both inside
                return r.index_of(pos)
        return None
    except Undecided:
        if r.size > ENUMERATE_UP_TO:
            raise
    idx = np.sort(np.concatenate(list(r.indices())))
    dup = np.nonzero(idx[1:] == idx[:-1])[0]
    return int(idx[dup[0]]) if dup.size else None


def first_common(a: Region, b: Region) -> Optional[int]:
    """An index touched by both regions, or None if they are disjoint.

    Exact, in time independent of the element count (see the module doc); raises
    :class:`Undecided` only for large regions whose strides defeat the solver."""
    ea, eb = a.extent(), b.extent()
    if ea is None or eb is None:
        return None
    if max(ea[0], eb[0]) > min(ea[1], eb[1]):          # the intervals are apart
        return None
    da, db = _dims(a), _dims(b)
    terms = [(s, 0, n - 1) for s, n, _ in da] + [(s, -(n - 1), 0) for s, n, _ in db]
    try:
        x = _solve(terms, b.off - a.off)
    except Undecided:
        if a.size + b.size > ENUMERATE_UP_TO:
            raise
        return _common_by_enumeration(a, b)
    if x is None:
        return None
    pos = [0] * len(a.shape)
    for (s, n, ax), xi in zip(da, x):
        pos[ax] = xi
    return a.index_of(pos)


def _common_by_enumeration(a: Region, b: Region) -> Optional[int]:
    ea, eb = a.extent(), b.extent()
    lo, hi = max(ea[0], eb[0]), min(ea[1], eb[1])
    hit = np.zeros(hi - lo + 1, dtype=bool)
    for idx in a.distinct().indices():
        sel = idx[(idx >= lo) & (idx <= hi)]
        hit[sel - lo] = True
    for idx in b.distinct().indices():
        sel = idx[(idx >= lo) & (idx <= hi)]
        common = sel[hit[sel - lo]]
        if common.size:
            return int(common[0])
    return None
