"""Index geometry of strided regions in a flat arena: bounds, duplicates, overlaps.

A :class:`Region` is the set of arena indices ``off + sum_k i_k * strides[k]``
for ``0 <= i_k < shape[k]`` (offsets and strides in elements, all >= 0).  The
checks here are exact: a fast sufficient test first, then (only when it cannot
decide) an enumeration of the indices, O(elements) time and memory.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Optional, Tuple

import numpy as np

__all__ = ["Region", "first_duplicate", "first_common"]

#: indices enumerated per step when walking a region (bounds memory).
_CHUNK = 1 << 20


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

    def indices(self, chunk: int = _CHUNK) -> Iterator[np.ndarray]:
        """The region's indices (int64, row-major order), in chunks of <= ``chunk``."""
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


def _sorted_dims(r: Region):
    """Dims of size > 1 as (stride, size), by increasing stride."""
    return sorted((s, n) for n, s in zip(r.shape, r.strides) if n > 1)


def first_duplicate(r: Region) -> Optional[int]:
    """An index that ``r`` touches more than once, or None if every index is distinct."""
    if r.is_empty:
        return None
    dims = _sorted_dims(r)
    if any(s == 0 for s, _ in dims):
        return r.off
    span = 0  # largest offset reachable with the dims seen so far
    nested = True
    for s, n in dims:
        if s <= span:
            nested = False
            break
        span += (n - 1) * s
    if nested:  # each stride exceeds the span of all smaller ones: injective
        return None
    idx = np.sort(np.concatenate(list(r.indices())))
    dup = np.nonzero(idx[1:] == idx[:-1])[0]
    return int(idx[dup[0]]) if dup.size else None


def first_common(a: Region, b: Region) -> Optional[int]:
    """An index touched by both regions, or None if they are disjoint."""
    ea, eb = a.extent(), b.extent()
    if ea is None or eb is None:
        return None
    lo, hi = max(ea[0], eb[0]), min(ea[1], eb[1])
    if lo > hi:
        return None
    # exact: mark a's indices inside [lo, hi], then probe b's
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
