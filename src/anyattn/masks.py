"""Mask objects: which keys a query sees.

Shape legend: B batch, Hq query heads, Sq queries, Sk keys, i query index,
j key index.

Masks are small frozen objects composed with ``&``.  Index-based terms
(``Causal``, ``Window``) compare equal by value; array-holding terms
(``KeepMask``, ``Documents``) compare and hash by identity, so they can key a
cache of tile maps without hashing their contents.

Every term is lowered by :func:`resolve` to one :class:`ResolvedMask`, the form
backends consume:

* a *band* ``lo <= j - i <= hi`` (either side ``None`` = unbounded) that
  collects every causal and window term, alignment and position offsets
  already applied;
* at most one document-id pair (``q_ids [Bd, Sq]``, ``k_ids [Bd, Sk]``,
  ``Bd`` in {1, B});
* at most one boolean keep array, 4-D and broadcastable to [B, Hq, Sq, Sk].

Tile maps (which tiles a mask leaves empty, partial or full; :meth:`ResolvedMask.tile_map`)
are reused across calls: each call resolves the mask anew, so the parts that cost more
than O(nQ·nK) live in one bounded, thread-safe LRU cache (:data:`TILE_CACHE`) keyed on
*content*, never on an array that may have changed since: document ids by a digest of
their bytes (O(S) per call), keep arrays only when they cannot change (a NumPy array
whose flags and bases are all read-only, e.g. after ``mask.setflags(write=False)``;
the cache keeps a weak reference and checks it).  Band terms have a closed form and
are not cached; writable keep arrays and torch keep tensors are reduced on every call
(as fast as any content check of them would be).
"""
from __future__ import annotations

import hashlib
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Optional, Tuple

import numpy as np

from .arrays import array_kind, to_numpy

__all__ = [
    "Mask",
    "Causal",
    "Window",
    "KeepMask",
    "Documents",
    "AndMask",
    "ResolvedMask",
    "resolve",
    "TILE_EMPTY",
    "TILE_PARTIAL",
    "TILE_FULL",
    "TILE_CACHE",
    "TileMapCache",
]

ALIGNS = ("top_left", "bottom_right")

#: Tile-map codes: no kept pair, some kept pairs, every pair kept.
TILE_EMPTY, TILE_PARTIAL, TILE_FULL = 0, 1, 2


def _check_align(align: str) -> None:
    if align not in ALIGNS:
        raise ValueError(
            f"align={align!r} is not a known alignment; expected one of {ALIGNS} "
            "('top_left': query i is position i; 'bottom_right': the last query "
            "lines up with the last key, as when decoding with a KV cache)"
        )


def _diag_offset(align: str, sq: int, sk: int) -> int:
    """Shift that maps query index i to its aligned position i' = i + offset."""
    return 0 if align == "top_left" else sk - sq


class Mask:
    """Base of every mask term; ``a & b`` keeps a pair iff both keep it.

    A boolean NumPy array or torch tensor on either side of ``&`` is taken as
    ``KeepMask(array)`` (``Causal() & m`` is ``Causal() & KeepMask(m)``, ``m & Causal()``
    is ``KeepMask(m) & Causal()``); an array of another dtype is a TypeError.  ``|`` (or)
    is not implemented for mask terms: it raises NotImplementedError with the remedy.
    """

    #: makes NumPy hand ``array & mask`` / ``array | mask`` to the mask's reflected
    #: operator instead of applying ``&`` to every element of the array
    __array_ufunc__ = None

    def __and__(self, other: Any) -> "AndMask":
        other = _as_term(other)
        if other is None:
            return NotImplemented
        return AndMask(_terms(self) + _terms(other))

    def __rand__(self, other: Any) -> "AndMask":
        other = _as_term(other)
        if other is None:
            return NotImplemented
        return AndMask(_terms(other) + _terms(self))

    def __or__(self, other: Any):
        if isinstance(other, Mask) or array_kind(other) is not None:
            _refuse_or()
        return NotImplemented

    def __ror__(self, other: Any):
        if array_kind(other) is not None:
            _refuse_or()
        return NotImplemented

    # Each subclass lowers itself into a _Lowering accumulator.
    def _lower(self, acc: "_Lowering") -> None:  # pragma: no cover - abstract
        raise NotImplementedError


def _terms(m: Mask) -> Tuple[Mask, ...]:
    return m.terms if isinstance(m, AndMask) else (m,)


def _as_term(other: Any) -> Optional["Mask"]:
    """The mask term ``other`` stands for in ``mask & other``: itself for a mask,
    ``KeepMask(other)`` for a boolean array or tensor, None for anything else (the
    operator then answers NotImplemented).  An array of another dtype raises."""
    if isinstance(other, Mask):
        return other
    if array_kind(other) is None:
        return None
    if str(other.dtype) not in ("bool", "torch.bool"):
        raise TypeError(
            f"mask & array: the array has dtype {other.dtype}, but an array term of a "
            "mask must be boolean (True = attend); convert it with KeepMask(m.astype(bool)) "
            "(m.bool() for a torch tensor), or pass an additive float mask as bias=")
    return KeepMask(other)


def _refuse_or() -> None:
    raise NotImplementedError(
        "mask | mask: union (or) of mask terms is not implemented; compute the union as "
        "one boolean array and pass KeepMask(keep), or use & (and) of mask terms")


@dataclass(frozen=True)
class AndMask(Mask):
    """Conjunction of mask terms (built by ``&``)."""

    terms: Tuple[Mask, ...]

    def _lower(self, acc: "_Lowering") -> None:
        for t in self.terms:
            t._lower(acc)

    def __repr__(self) -> str:
        return " & ".join(repr(t) for t in self.terms)


@dataclass(frozen=True)
class Causal(Mask):
    """Query i sees key j iff ``j <= i'`` (``i' = i`` top-left, ``i + Sk - Sq`` bottom-right)."""

    align: str = "top_left"

    def __post_init__(self):
        _check_align(self.align)

    def _lower(self, acc: "_Lowering") -> None:
        acc.band(None, _diag_offset(self.align, acc.sq, acc.sk))


@dataclass(frozen=True)
class Window(Mask):
    """Keep ``i' - j <= left`` and ``j - i' <= right``; ``None`` leaves a side unbounded.

    ``Causal() & Window(left=w)`` keeps ``w + 1`` keys, the query's own included.
    """

    left: Optional[int] = None
    right: Optional[int] = None
    align: str = "top_left"

    def __post_init__(self):
        _check_align(self.align)
        for name in ("left", "right"):
            val = getattr(self, name)
            if val is None:
                continue
            if isinstance(val, bool) or not isinstance(val, (int, np.integer)):
                raise TypeError(
                    f"Window({name}={val!r}): expected a non-negative int or None, "
                    f"got {type(val).__name__}"
                )
            if val < 0:
                raise ValueError(
                    f"Window({name}={val}): a window side must be >= 0 "
                    "(use None for an unbounded side)"
                )
            object.__setattr__(self, name, int(val))

    def _lower(self, acc: "_Lowering") -> None:
        off = _diag_offset(self.align, acc.sq, acc.sk)
        lo = None if self.left is None else off - self.left
        hi = None if self.right is None else off + self.right
        acc.band(lo, hi)


@dataclass(frozen=True, eq=False)
class KeepMask(Mask):
    """Boolean keep-mask (True = attend), broadcastable to [B, Hq, Sq, Sk].

    Accepts a NumPy array or a torch tensor of dtype bool, with 1 to 4 dims
    (e.g. [Sq, Sk], [B, 1, Sq, Sk], [B, 1, 1, Sk]).
    """

    mask: Any

    def __post_init__(self):
        kind = array_kind(self.mask)
        if kind is None:
            raise TypeError(
                f"KeepMask(mask=...): expected a NumPy array or torch tensor, got "
                f"{type(self.mask).__name__}; wrap it with np.asarray(..., dtype=bool)"
            )
        if isinstance(self.mask, np.ma.MaskedArray):
            raise TypeError(
                "KeepMask(mask=...): is a NumPy masked array; its mask would be ignored. "
                "Pass a plain boolean array, e.g. mask.filled(False)"
            )
        if str(self.mask.dtype) not in ("bool", "torch.bool"):
            raise TypeError(
                f"KeepMask(mask=...): expected dtype bool (True = attend), got "
                f"{self.mask.dtype}; convert with mask.astype(bool) or mask.bool()"
            )
        if not 1 <= self.mask.ndim <= 4:
            raise ValueError(
                f"KeepMask(mask=...): expected 1 to 4 dims broadcastable to "
                f"[B, Hq, Sq, Sk], got shape {tuple(self.mask.shape)}"
            )

    def __repr__(self) -> str:
        return f"KeepMask(shape={tuple(self.mask.shape)})"

    def _lower(self, acc: "_Lowering") -> None:
        acc.keep(self.mask)


@dataclass(frozen=True, eq=False)
class Documents(Mask):
    """Packed sequences: query i sees key j iff ``q_ids[i] == k_ids[j]``.

    ``q_ids``: integer ids of shape [Sq] or [B, Sq]; ``k_ids``: [Sk] or [B, Sk]
    (defaults to ``q_ids``).
    """

    q_ids: Any
    k_ids: Any = None

    def __post_init__(self):
        if self.k_ids is None:
            object.__setattr__(self, "k_ids", self.q_ids)
        for name in ("q_ids", "k_ids"):
            ids = getattr(self, name)
            if array_kind(ids) is None:
                raise TypeError(
                    f"Documents({name}=...): expected an integer NumPy array or torch "
                    f"tensor, got {type(ids).__name__}"
                )
            if isinstance(ids, np.ndarray):
                if isinstance(ids, np.ma.MaskedArray):
                    raise TypeError(
                        f"Documents({name}=...): is a NumPy masked array; its mask would be "
                        "ignored. Pass plain integer ids (ids.filled(-1))"
                    )
                if not ids.dtype.isnative:    # '>i4' on this machine: native ids, same values
                    ids = ids.astype(ids.dtype.newbyteorder("="))
                    object.__setattr__(self, name, ids)
            dt = str(ids.dtype).replace("torch.", "")
            if not (dt.startswith("int") or dt.startswith("uint")):
                raise TypeError(
                    f"Documents({name}=...): expected an integer dtype, got {ids.dtype}; "
                    "document ids are integers (e.g. np.int32)"
                )
            if ids.ndim not in (1, 2):
                raise ValueError(
                    f"Documents({name}=...): expected shape [S] or [B, S], got "
                    f"{tuple(ids.shape)}"
                )

    def __repr__(self) -> str:
        return f"Documents(q_ids={tuple(self.q_ids.shape)}, k_ids={tuple(self.k_ids.shape)})"

    def _lower(self, acc: "_Lowering") -> None:
        acc.documents(self.q_ids, self.k_ids)


class _Lowering:
    """Accumulates mask terms for one problem size."""

    def __init__(self, b: int, hq: int, sq: int, sk: int):
        self.b, self.hq, self.sq, self.sk = b, hq, sq, sk
        self.lo: Optional[int] = None
        self.hi: Optional[int] = None
        self.docs: list = []
        self.keeps: list = []

    def band(self, lo: Optional[int], hi: Optional[int]) -> None:
        if lo is not None:
            self.lo = lo if self.lo is None else max(self.lo, lo)
        if hi is not None:
            self.hi = hi if self.hi is None else min(self.hi, hi)

    def keep(self, m) -> None:
        self.keeps.append(m)

    def documents(self, q_ids, k_ids) -> None:
        self.docs.append((q_ids, k_ids))


@dataclass(frozen=True, eq=False)
class ResolvedMask:
    """A mask lowered for one problem size; what backends consume.

    ``band_lo``/``band_hi``: keep iff ``band_lo <= j - i <= band_hi`` (None = open).
    ``q_ids [Bd, Sq]``, ``k_ids [Bd, Sk]``: document ids (same array library
    as given) or None.  ``keep``: bool, 4-D, broadcastable to [B, Hq, Sq, Sk], or None.
    """

    sq: int
    sk: int
    band_lo: Optional[int] = None
    band_hi: Optional[int] = None
    q_ids: Any = None
    k_ids: Any = None
    keep: Any = None
    #: identity tokens of the keep arrays when every one is immutable (see
    #: :func:`_frozen_token`), else None: the keep part of a tile map is then not cached
    keep_key: Any = field(default=None, repr=False, compare=False)
    #: memo for tile maps keyed by tile sizes (filled lazily by tile_map).
    _tile_maps: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def is_empty_mask(self) -> bool:
        """True when no term restricts anything (plain full attention)."""
        return (self.band_lo is None and self.band_hi is None and self.q_ids is None
                and self.keep is None)

    @property
    def has_band(self) -> bool:
        return self.band_lo is not None or self.band_hi is not None

    # ----------------------------------------------------------- dense rules
    def band_keep(self, i0: int, i1: int, j0: int, j1: int):
        """Band term on a tile: bool [i1-i0, j1-j0], or None if it keeps everything."""
        if not self.has_band:
            return None
        d = np.arange(j0, j1)[None, :] - np.arange(i0, i1)[:, None]  # [ti, tj]
        keep = np.ones(d.shape, dtype=bool)
        if self.band_lo is not None:
            keep &= d >= self.band_lo
        if self.band_hi is not None:
            keep &= d <= self.band_hi
        return keep

    def tile_keep(self, b: int, h: int, i0: int, i1: int, j0: int, j1: int):
        """Every term on one tile of one (b, h): NumPy bool [i1-i0, j1-j0] or None (all kept)."""
        keep = self.band_keep(i0, i1, j0, j1)
        if self.q_ids is not None:
            qd = to_numpy(self.q_ids)
            kd = to_numpy(self.k_ids)
            bq = b if qd.shape[0] > 1 else 0
            bk = b if kd.shape[0] > 1 else 0
            doc = qd[bq, i0:i1, None] == kd[bk, None, j0:j1]
            keep = doc if keep is None else keep & doc
        if self.keep is not None:
            km = to_numpy(self.keep)
            km = km[b if km.shape[0] > 1 else 0, h if km.shape[1] > 1 else 0]
            rows = slice(i0, i1) if km.shape[0] > 1 else slice(0, 1)  # broadcast dims: row 0
            cols = slice(j0, j1) if km.shape[1] > 1 else slice(0, 1)
            km = km[rows, cols]
            km = np.broadcast_to(km, (i1 - i0, j1 - j0))
            keep = km if keep is None else keep & km
        return keep

    def dense_keep(self, b_count: int, h_count: int) -> np.ndarray:
        """The whole keep pattern as NumPy bool [B or 1, Hq or 1, Sq, Sk] (reference use)."""
        out = np.ones((1, 1, self.sq, self.sk), dtype=bool)
        band = self.band_keep(0, self.sq, 0, self.sk)
        if band is not None:
            out = out & band
        if self.q_ids is not None:
            qd, kd = to_numpy(self.q_ids), to_numpy(self.k_ids)
            out = out & (qd[:, None, :, None] == kd[:, None, None, :])
        if self.keep is not None:
            out = out & to_numpy(self.keep)
        return out

    # -------------------------------------------------------------- tile maps
    def band_tile_range(self, i0: int, i1: int, bk: int) -> Tuple[int, int]:
        """Key-tile index range [t0, t1) that the band allows for queries [i0, i1)."""
        nk = -(-self.sk // bk)
        t0, t1 = 0, nk
        if self.band_lo is not None:  # j >= i + lo, smallest i is i0
            t0 = max(0, (i0 + self.band_lo) // bk)
        if self.band_hi is not None:  # j <= i + hi, largest i is i1 - 1
            jmax = i1 - 1 + self.band_hi
            t1 = min(nk, jmax // bk + 1) if jmax >= 0 else 0
        return t0, max(t0, t1)

    def tile_map(self, bq: int, bk: int) -> np.ndarray:
        """Per-tile codes (TILE_EMPTY / TILE_PARTIAL / TILE_FULL) as int8
        [Bm, Hm, nQ, nK], ``Bm``/``Hm`` 1 where no term varies over batch/heads.

        Memoised on this object per tile size; the document and (immutable) keep parts
        also across calls in :data:`TILE_CACHE` (see the module docstring).
        """
        key = (bq, bk)
        if key in self._tile_maps:
            return self._tile_maps[key]
        nq, nk = -(-self.sq // bq), -(-self.sk // bk)
        any_kept = np.ones((1, 1, nq, nk), dtype=bool)
        all_kept = np.ones((1, 1, nq, nk), dtype=bool)
        parts = []
        if self.has_band:
            parts.append(self._band_tiles(bq, bk))
        if self.q_ids is not None:
            parts.append(TILE_CACHE.get(("documents", _ids_digest(self.q_ids, self.k_ids),
                                         self.sq, self.sk, bq, bk),
                                        lambda: self._document_tiles(bq, bk)))
        if self.keep is not None:
            build = lambda: _tile_reduce(to_numpy(self.keep), bq, bk)  # noqa: E731
            parts.append(build() if self.keep_key is None else
                         TILE_CACHE.get(("keep", self.keep_key[0], self.sq, self.sk, bq, bk),
                                        build, self.keep_key[1]))   # [Bx, Hx, nQ, nK] each
        for a, l in parts:                    # each [Bx, Hx, nQ|1, nK|1]
            any_kept = any_kept & a
            all_kept = all_kept & l
        codes = np.where(all_kept, TILE_FULL, np.where(any_kept, TILE_PARTIAL, TILE_EMPTY))
        codes = codes.astype(np.int8)
        self._tile_maps[key] = codes
        return codes

    def _band_tiles(self, bq: int, bk: int) -> Tuple[np.ndarray, np.ndarray]:
        """Band term per tile: (any kept, all kept), bool [1, 1, nQ, nK], exact from the
        tiles' corner differences (j - i takes every integer in [dmin, dmax] on a tile)."""
        nq, nk = -(-self.sq // bq), -(-self.sk // bk)
        qi0 = np.arange(nq)[:, None] * bq
        qi1 = np.minimum(qi0 + bq, self.sq) - 1
        kj0 = np.arange(nk)[None, :] * bk
        kj1 = np.minimum(kj0 + bk, self.sk) - 1
        dmin, dmax = kj0 - qi1, kj1 - qi0  # range of j - i within the tile
        lo = -np.inf if self.band_lo is None else self.band_lo
        hi = np.inf if self.band_hi is None else self.band_hi
        return ((dmax >= lo) & (dmin <= hi))[None, None], \
            ((dmin >= lo) & (dmax <= hi))[None, None]

    def _document_tiles(self, bq: int, bk: int) -> Tuple[np.ndarray, np.ndarray]:
        """Document term per tile: (any kept, all kept), bool [Bd, 1, nQ, nK].

        A tile keeps some pair iff its query and key tiles share an id, and every pair
        iff both hold one and the same id.  Per batch row: ids numbered by np.unique,
        an incidence matrix tile x id for each side (bool [nQ, U], [nK, U]) and one
        product of the two counts the shared ids of every tile pair: O(S log S + nQ·nK·U)
        instead of one [bq, Sk] compare per query tile (54 ms -> ~2 ms at S = 8192 with
        16 documents)."""
        qd, kd = to_numpy(self.q_ids), to_numpy(self.k_ids)
        nq, nk = -(-self.sq // bq), -(-self.sk // bk)
        bd = max(qd.shape[0], kd.shape[0])
        a = np.zeros((bd, 1, nq, nk), dtype=bool)
        l = np.zeros((bd, 1, nq, nk), dtype=bool)
        for b in range(bd):
            qrow = qd[min(b, qd.shape[0] - 1)]
            krow = kd[min(b, kd.shape[0] - 1)]
            uniq, inv = np.unique(np.concatenate([qrow, krow]), return_inverse=True)
            inv = inv.reshape(-1)
            mq = np.zeros((nq, len(uniq)), dtype=np.float32)          # [nQ, U] incidence
            mk = np.zeros((nk, len(uniq)), dtype=np.float32)          # [nK, U]
            mq[np.arange(self.sq) // bq, inv[:self.sq]] = 1
            mk[np.arange(self.sk) // bk, inv[self.sq:]] = 1
            a[b, 0] = (mq @ mk.T) > 0                                  # [nQ, nK] shared ids
            one_q = mq.sum(axis=1) == 1                                # one id in the tile
            one_k = mk.sum(axis=1) == 1
            id_q, id_k = mq.argmax(axis=1), mk.argmax(axis=1)
            l[b, 0] = one_q[:, None] & one_k[None, :] & (id_q[:, None] == id_k[None, :])
        return a, l


class TileMapCache:
    """A bounded LRU of tile-map parts, safe for concurrent callers.

    ``get(key, build, ref=None)`` returns the cached value of ``key`` or stores
    ``build()``; ``ref`` (a ``weakref.ref``) ties an entry to an object: once that object
    is gone, or another object holds the same id, the entry is not served.  ``builds``
    and ``hits`` count what happened (tests, benchmarks); ``clear()`` empties it.
    """

    def __init__(self, maxsize: int = 64):
        self.maxsize = maxsize
        self._d: "OrderedDict[Hashable, Tuple[Any, Optional[weakref.ref]]]" = OrderedDict()
        self._lock = threading.Lock()
        self.builds = 0
        self.hits = 0

    def get(self, key: Hashable, build: Callable[[], Any],
            ref: Optional[weakref.ref] = None) -> Any:
        with self._lock:
            hit = self._d.get(key)
            if hit is not None and (hit[1] is None or (ref is not None and ref() is not None
                                                       and hit[1]() is ref())):
                self._d.move_to_end(key)
                self.hits += 1
                return hit[0]
        value = build()                       # outside the lock: builds may take ms
        with self._lock:
            self.builds += 1
            self._d[key] = (value, ref)
            self._d.move_to_end(key)
            while len(self._d) > self.maxsize:
                self._d.popitem(last=False)
        return value

    def clear(self) -> None:
        with self._lock:
            self._d.clear()
            self.builds = self.hits = 0

    def __len__(self) -> int:
        return len(self._d)


#: the process-wide cache of tile-map parts (document ids, immutable keep arrays)
TILE_CACHE = TileMapCache()


def _ids_digest(q_ids, k_ids) -> Tuple:
    """Content key of a document-id pair: shapes, dtypes and a digest of the bytes."""
    h = hashlib.blake2b(digest_size=16)
    shapes = []
    for x in (q_ids, k_ids):
        a = np.ascontiguousarray(to_numpy(x))
        shapes.append((a.shape, a.dtype.str))
        h.update(memoryview(a).cast("B"))
    return tuple(shapes) + (h.hexdigest(),)


def _frozen_token(arr) -> Optional[Tuple[int, weakref.ref]]:
    """(id, weak reference) of a NumPy array that cannot change: it and every NumPy
    base below it read-only, the innermost owner an ndarray or ``bytes``; else None
    (writable arrays, views of writable memory, torch tensors)."""
    if not isinstance(arr, np.ndarray):
        return None
    x: Any = arr
    while isinstance(x, np.ndarray):
        if x.flags.writeable:
            return None
        if x.base is None:
            break
        x = x.base
    if not (isinstance(x, (np.ndarray, bytes))):
        return None
    try:
        return id(arr), weakref.ref(arr)
    except TypeError:  # pragma: no cover - ndarray subclasses without weakref support
        return None


def _tile_reduce(keep4: np.ndarray, bq: int, bk: int):
    """Per-tile any/all of a 4-D bool array [Bx, Hx, Sq|1, Sk|1] -> two [Bx, Hx, nQ|1, nK|1]."""
    bx, hx, sq, sk = keep4.shape
    nq, nk = -(-sq // bq) if sq > 1 else 1, -(-sk // bk) if sk > 1 else 1
    tq, tk = (bq if sq > 1 else 1), (bk if sk > 1 else 1)
    pq, pk = nq * tq - sq, nk * tk - sk
    k_any = keep4
    if pq or pk:
        # pad with values neutral for each reduction
        pad = ((0, 0), (0, 0), (0, pq), (0, pk))
        k_any = np.pad(keep4, pad, constant_values=False)
        k_all = np.pad(keep4, pad, constant_values=True)
    else:
        k_all = keep4
    shape = (bx, hx, nq, tq, nk, tk)
    return (k_any.reshape(shape).any(axis=(3, 5)), k_all.reshape(shape).all(axis=(3, 5)))


def _expand4(arr):
    """Left-pad an array to 4 dims (NumPy broadcasting rules)."""
    while arr.ndim < 4:
        arr = arr[None]
    return arr


def resolve(mask: Optional[Mask], b: int, hq: int, sq: int, sk: int,
            q_offset: int = 0, k_offset: int = 0) -> ResolvedMask:
    """Lower ``mask`` for a problem of size (B, Hq, Sq, Sk).

    ``q_offset``/``k_offset`` are the global positions of query 0 and key 0
    (context parallelism); they shift the band terms only.  Array terms are
    indexed locally.  Shapes are checked here; errors name the term.
    """
    if isinstance(mask, type) and issubclass(mask, Mask):
        raise TypeError(
            f"mask: got the class {mask.__name__}, not a mask object; pass an instance, "
            f"e.g. mask={mask.__name__}()"
        )
    if mask is not None and not hasattr(mask, "_lower"):
        raise TypeError(
            f"mask: expected a mask object (Causal, Window, KeepMask, Documents or "
            f"their & composition), got {type(mask).__name__}; pass a boolean array "
            "as KeepMask(array)"
        )
    acc = _Lowering(b, hq, sq, sk)
    if mask is not None:
        mask._lower(acc)
    shift = q_offset - k_offset  # keep iff lo <= (j + ko) - (i + qo) <= hi
    lo = None if acc.lo is None else acc.lo + shift
    hi = None if acc.hi is None else acc.hi + shift

    q_ids = k_ids = None
    for qi, ki in acc.docs:
        qi2 = qi if qi.ndim == 2 else qi[None]
        ki2 = ki if ki.ndim == 2 else ki[None]
        for nm, ids, s in (("q_ids", qi2, sq), ("k_ids", ki2, sk)):
            if ids.shape[1] != s or ids.shape[0] not in (1, b):
                raise ValueError(
                    f"Documents({nm}=...): shape {tuple(ids.shape)} does not fit "
                    f"{'Sq' if nm == 'q_ids' else 'Sk'}={s}, B={b}; expected [{s}] or [{b}, {s}]"
                )
        if q_ids is None:
            q_ids, k_ids = qi2, ki2
        else:  # two document terms: keep iff both id pairs match -> combine ids
            q_ids, k_ids = _combine_ids(q_ids, k_ids, qi2, ki2)

    keep = None
    tokens = [_frozen_token(km) for km in acc.keeps]
    keep_key = None
    if len(tokens) == 1 and tokens[0] is not None:
        keep_key = tokens[0]   # one immutable array (several: their AND is new per call)
    for km in acc.keeps:
        k4 = _expand4(km)
        target = (b, hq, sq, sk)
        for ax, (have, want) in enumerate(zip(k4.shape, target)):
            if have not in (1, want):
                raise ValueError(
                    f"KeepMask(mask=...): shape {tuple(km.shape)} does not broadcast to "
                    f"[B, Hq, Sq, Sk] = {list(target)} (dim {ax - 4} is {have}, expected "
                    + ("1)" if want == 1 else f"1 or {want})")
                )
        if keep is None:
            keep = k4
        else:
            keep = _and_arrays(keep, k4)
    return ResolvedMask(sq=sq, sk=sk, band_lo=lo, band_hi=hi, q_ids=q_ids, k_ids=k_ids,
                        keep=keep, keep_key=keep_key)


def _and_arrays(a, b):
    if array_kind(a) == "torch" or array_kind(b) == "torch":
        import torch

        return torch.as_tensor(a) & torch.as_tensor(b)
    return np.logical_and(a, b)


def _combine_ids(q1, k1, q2, k2):
    """Ids whose equality means both original id pairs are equal."""
    qa, ka, qb, kb = (to_numpy(x).astype(np.int64) for x in (q1, k1, q2, k2))
    nb = max(qa.shape[0], qb.shape[0], ka.shape[0], kb.shape[0])
    qa, qb = np.broadcast_to(qa, (nb, qa.shape[1])), np.broadcast_to(qb, (nb, qb.shape[1]))
    ka, kb = np.broadcast_to(ka, (nb, ka.shape[1])), np.broadcast_to(kb, (nb, kb.shape[1]))
    pairs = np.concatenate([np.stack([qa, qb], -1).reshape(-1, 2),
                            np.stack([ka, kb], -1).reshape(-1, 2)])
    _, inv = np.unique(pairs, axis=0, return_inverse=True)
    inv = inv.reshape(-1)
    nq = qa.size
    return inv[:nq].reshape(qa.shape), inv[nq:].reshape(ka.shape)
