"""Mask objects: which keys a query sees.

Shape legend: B batch, Hq query heads, Sq queries, Sk keys, i query index,
j key index.

Masks are small frozen objects composed with ``&``.  Index-based terms
(``Causal``, ``Window``) compare equal by value; array-holding terms
(``KeepMask``, ``Documents``) compare and hash by identity, so they can key a
cache of tile maps without hashing their contents.

Every term is lowered by :func:`resolve` to one :class:`ResolvedMask`, the form
backends consume.  Each kind of lowered term is one :class:`TermKind` in
:data:`TERM_KINDS` (its fold, its float64 rule, its tile classification), found by
name by the reference, the tile maps, :mod:`anyattn.features` and the backends:

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
from typing import Any, Callable, Dict, Hashable, Optional, Tuple

import numpy as np

from .arrays import array_kind, to_numpy

__all__ = [
    "Mask",
    "Causal",
    "Window",
    "KeepMask",
    "Documents",
    "AndMask",
    "OrMask",
    "ResolvedMask",
    "resolve",
    "lower",
    "TermKind",
    "TERM_KINDS",
    "ArrayOps",
    "CORE_OPS",
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
    is ``KeepMask(m) & Causal()``); an array of another dtype is a TypeError.  ``a | b``
    keeps a pair iff either keeps it: it lowers to one mask function (every term has a
    function form, ``_fn``), classified per tile like a ``MaskMod``.
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

    def __or__(self, other: Any) -> "OrMask":
        other = _as_term(other)
        if other is None:
            return NotImplemented
        return OrMask(_or_terms(self) + _or_terms(other))

    def __ror__(self, other: Any) -> "OrMask":
        other = _as_term(other)
        if other is None:
            return NotImplemented
        return OrMask(_or_terms(other) + _or_terms(self))

    def _fn(self, fx) -> Any:  # pragma: no cover - abstract
        """This term as a traced bool expression of ``fx``'s indices (see
        :mod:`anyattn.programs.compose`)."""
        raise NotImplementedError

    def _bound_function(self, b: int, hq: int, sq: int, sk: int, q_offset: int,
                        k_offset: int):
        """This term's function form, bound for a problem (the ``mask_mod`` term kind's
        item)."""
        from .programs.compose import mask_program

        return mask_program(self, (b, hq, sq, sk), q_offset, k_offset)

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


def _or_terms(m: Mask) -> Tuple[Mask, ...]:
    return m.terms if isinstance(m, OrMask) else (m,)


@dataclass(frozen=True)
class AndMask(Mask):
    """Conjunction of mask terms (built by ``&``)."""

    terms: Tuple[Mask, ...]

    def _lower(self, acc: "_Lowering") -> None:
        for t in self.terms:
            t._lower(acc)

    def _fn(self, fx):
        out = self.terms[0]._fn(fx)
        for t in self.terms[1:]:
            out = out & t._fn(fx)
        return out

    def __repr__(self) -> str:
        return " & ".join(repr(t) for t in self.terms)


@dataclass(frozen=True, eq=False)
class OrMask(Mask):
    """Disjunction of mask terms (built by ``|``): lowered to one mask function
    (the ``mask_mod`` term kind) from the terms' function forms."""

    terms: Tuple[Mask, ...]

    def _lower(self, acc: "_Lowering") -> None:
        acc.add("mask_mod", self)

    def _fn(self, fx):
        out = self.terms[0]._fn(fx)
        for t in self.terms[1:]:
            out = out | t._fn(fx)
        return out

    def __repr__(self) -> str:
        return "(" + " | ".join(repr(t) for t in self.terms) + ")"


@dataclass(frozen=True)
class Causal(Mask):
    """Query i sees key j iff ``j <= i'`` (``i' = i`` top-left, ``i + Sk - Sq`` bottom-right)."""

    align: str = "top_left"

    def __post_init__(self):
        _check_align(self.align)

    def _lower(self, acc: "_Lowering") -> None:
        acc.add("band", (None, _diag_offset(self.align, acc.sq, acc.sk)))

    def _fn(self, fx):
        _, _, sq, sk = fx.sizes
        return _band_fn(fx, None, _diag_offset(self.align, sq, sk))


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
        acc.add("band", (lo, hi))

    def _fn(self, fx):
        off = _diag_offset(self.align, fx.sizes[2], fx.sizes[3])
        return _band_fn(fx, None if self.left is None else off - self.left,
                        None if self.right is None else off + self.right)


def _band_fn(fx, lo: Optional[int], hi: Optional[int]):
    """``lo <= kv_idx - q_idx <= hi`` with the position offsets applied (as the band
    term's fold applies them)."""
    shift = fx.q_offset - fx.k_offset
    d = fx.kv_idx - fx.q_idx
    out = fx.const(True)
    if lo is not None:
        out = out & (d >= lo + shift)
    if hi is not None:
        out = out & (d <= hi + shift)
    return out


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
        acc.add("keep", self.mask)

    def _fn(self, fx):
        k4 = CORE_OPS.keep4(self.mask)
        _check_keep_shape(self.mask, k4, fx.sizes)
        keep = fx.capture("keep", k4)
        idx = [i if n > 1 else 0 for i, n in zip((fx.b, fx.h, fx.q_idx, fx.kv_idx),
                                                   k4.shape)]
        return keep[tuple(idx)]


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

    @classmethod
    def from_lengths(cls, q_lengths, k_lengths=None) -> "Documents":
        """Packed sequences given by their lengths: sequence d holds the next
        ``q_lengths[d]`` queries and ``k_lengths[d]`` keys (default: ``q_lengths``), as
        FlashAttention's ``cu_seqlens`` = 0 followed by the running sums.  Lengths: a
        1-D sequence of ints >= 0 (a list, NumPy array or CPU tensor); an empty
        sequence is allowed.  Band terms (Causal, Window) stay on the packed axes: with
        equal query and key lengths for every sequence, ``Causal()`` is each sequence's
        causal mask; otherwise see ``anyattn.flash_attn`` (bottom-right per sequence)."""
        ids, counts = [], []
        for name, lengths in (("q_lengths", q_lengths),
                              ("k_lengths", q_lengths if k_lengths is None else k_lengths)):
            a = np.asarray(to_numpy(lengths) if array_kind(lengths) else lengths)
            if a.ndim != 1 or not (a.size == 0 or np.issubdtype(a.dtype, np.integer)):
                raise TypeError(f"Documents.from_lengths({name}=...): expected a 1-D sequence "
                                f"of ints, got shape {a.shape}, dtype {a.dtype}")
            if (a < 0).any():
                raise ValueError(f"Documents.from_lengths({name}=...): holds "
                                 f"{int(a.min())}; lengths are >= 0")
            ids.append(np.repeat(np.arange(a.size, dtype=np.int32), a.astype(np.int64)))
            counts.append(a.size)
        if counts[0] != counts[1]:
            raise ValueError(f"Documents.from_lengths: {counts[0]} query lengths but "
                             f"{counts[1]} key lengths; give one of each per sequence")
        return cls(ids[0], ids[1])

    def _lower(self, acc: "_Lowering") -> None:
        acc.add("documents", (self.q_ids, self.k_ids))

    def _fn(self, fx):
        b, _, sq, sk = fx.sizes
        sides = []
        for nm, ids, s, pos in (("q_ids", self.q_ids, sq, fx.q_idx),
                                ("k_ids", self.k_ids, sk, fx.kv_idx)):
            ids2 = CORE_OPS.ids2(ids)
            _check_ids_shape(nm, ids2, s, b)
            cap = fx.capture(nm, ids2)
            sides.append(cap[fx.b if ids2.shape[0] > 1 else 0, pos])
        return sides[0] == sides[1]


class _Lowering:
    """Accumulates the lowered items of a mask's terms for one problem size: one list
    per term kind of :data:`TERM_KINDS`, in the order the terms appear."""

    def __init__(self, b: int, hq: int, sq: int, sk: int):
        self.b, self.hq, self.sq, self.sk = b, hq, sq, sk
        self.items: Dict[str, list] = {name: [] for name in TERM_KINDS}

    def add(self, kind: str, item: Any) -> None:
        """One item for the term kind ``kind`` (its TermKind.fold says what an item is)."""
        self.items[kind].append(item)

    # the built-in kinds by name (mask objects outside this module use these)
    def band(self, lo: Optional[int], hi: Optional[int]) -> None:
        self.add("band", (lo, hi))

    def documents(self, q_ids, k_ids) -> None:
        self.add("documents", (q_ids, k_ids))

    def keep(self, m) -> None:
        self.add("keep", m)


class ArrayOps:
    """The array operations the lowering folds terms with; this one keeps every array
    in its own library (NumPy arrays and torch tensors alike) and checks shapes.

    A caller that must trace the lowering (``anyattn.torch.lowering``: Dynamo) passes a
    subclass: its ``combine_ids`` returns None (no data-dependent shapes), so a second
    Documents term becomes a keep array (``doc_keep``), and its ``ids2`` / ``keep4``
    convert inputs to its library and device.
    """

    #: shapes are checked here (errors name the term); False where a later step checks
    check = True

    def ids2(self, ids):
        """Document ids [S] or [Bd, S] -> [Bd, S]."""
        return ids if ids.ndim == 2 else ids[None]

    def keep4(self, keep):
        """A keep array of 1..4 dims -> 4 dims (NumPy broadcasting rules)."""
        while keep.ndim < 4:
            keep = keep[None]
        return keep

    def logical_and(self, a, b):
        if array_kind(a) == "torch" or array_kind(b) == "torch":
            import torch

            return torch.as_tensor(a) & torch.as_tensor(b)
        return np.logical_and(a, b)

    def combine_ids(self, q1, k1, q2, k2):
        """Ids whose equality means both id pairs are equal (NumPy int64), or None when
        this library cannot (the term then folds into keep through :meth:`doc_keep`)."""
        return _combine_ids(q1, k1, q2, k2)

    def doc_keep(self, q_ids, k_ids):
        """A Documents pair [Bd, Sq], [Bd, Sk] as a keep array [Bd, 1, Sq, Sk]."""
        return q_ids[:, None, :, None] == k_ids[:, None, None, :]


#: the operations :func:`resolve` folds with
CORE_OPS = ArrayOps()


class TermKind:
    """One kind of lowered mask term, defined once: every backend finds it here.

    ``name`` is its feature name (:mod:`anyattn.features`), ``refusal`` the words of a
    backend that lacks it, ``fields`` the :class:`ResolvedMask` attributes it fills.
    Subclasses define:

    * ``fold(items, acc, ops, q_offset, k_offset)`` -> {field: value}: the items that
      mask objects added (:class:`_Lowering`), checked (when ``ops.check``) and folded
      into the ResolvedMask fields with ``ops`` (:class:`ArrayOps`: NumPy or torch);
    * ``present(rm)``: does the resolved mask hold this term?
    * ``keep_block(rm, i0, i1, j0, j1)``: the float64 reference's rule, NumPy bool
      broadcastable to [B, Hq, i1 - i0, j1 - j0] (True = keep);
    * ``tile_parts(rm, bq, bk)``: tile classification, (any kept, all kept) per tile,
      bool [Bx, Hx, nQ|1, nK|1] (exact: a tile is empty / full iff the rule says so).
    """

    name: str = "?"
    refusal: str = "?"
    fields: Tuple[str, ...] = ()

    def fold(self, items: list, acc: _Lowering, ops: ArrayOps, q_offset: int,
             k_offset: int) -> Dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def present(self, rm: "ResolvedMask") -> bool:
        return any(getattr(rm, f) is not None for f in self.fields)

    def keep_block(self, rm: "ResolvedMask", i0: int, i1: int, j0: int,
                   j1: int) -> np.ndarray:  # pragma: no cover - abstract
        raise NotImplementedError

    def tile_parts(self, rm: "ResolvedMask", bq: int,
                   bk: int) -> Tuple[np.ndarray, np.ndarray]:  # pragma: no cover - abstract
        raise NotImplementedError


class _BandTerm(TermKind):
    """``band_lo <= j - i <= band_hi`` (either side None = open): every Causal and
    Window term, alignment and the offsets ``q_offset - k_offset`` applied, and the
    band-shaped conjuncts of mask functions (items ``(lo, hi, "local")``: on local
    indices, the offsets not applied)."""

    name = "band"
    refusal = "does not support Causal/Window masks"
    fields = ("band_lo", "band_hi")

    def fold(self, items, acc, ops, q_offset, k_offset):
        lo = hi = None
        shift = q_offset - k_offset  # keep iff lo <= (j + ko) - (i + qo) <= hi
        for item in items:
            l, h = item[:2]
            if len(item) > 2:        # (lo, hi, "local"): on local indices, no offsets
                l = None if l is None else l - shift
                h = None if h is None else h - shift
            if l is not None:
                lo = l if lo is None else max(lo, l)
            if h is not None:
                hi = h if hi is None else min(hi, h)
        return {"band_lo": None if lo is None else lo + shift,
                "band_hi": None if hi is None else hi + shift}

    def keep_block(self, rm, i0, i1, j0, j1):
        d = np.arange(j0, j1)[None, :] - np.arange(i0, i1)[:, None]  # [ni, nj]
        keep = np.ones(d.shape, dtype=bool)
        if rm.band_lo is not None:
            keep &= d >= rm.band_lo
        if rm.band_hi is not None:
            keep &= d <= rm.band_hi
        return keep

    def tile_parts(self, rm, bq, bk):
        """Exact from the tiles' corner differences (j - i takes every integer in
        [dmin, dmax] on a tile): bool [1, 1, nQ, nK] each."""
        nq, nk = -(-rm.sq // bq), -(-rm.sk // bk)
        qi0 = np.arange(nq)[:, None] * bq
        qi1 = np.minimum(qi0 + bq, rm.sq) - 1
        kj0 = np.arange(nk)[None, :] * bk
        kj1 = np.minimum(kj0 + bk, rm.sk) - 1
        dmin, dmax = kj0 - qi1, kj1 - qi0  # range of j - i within the tile
        lo = -np.inf if rm.band_lo is None else rm.band_lo
        hi = np.inf if rm.band_hi is None else rm.band_hi
        return ((dmax >= lo) & (dmin <= hi))[None, None], \
            ((dmin >= lo) & (dmax <= hi))[None, None]


def _check_ids_shape(nm: str, ids, s: int, b: int) -> None:
    if ids.shape[1] != s or ids.shape[0] not in (1, b):
        raise ValueError(
            f"Documents({nm}=...): shape {tuple(ids.shape)} does not fit "
            f"{'Sq' if nm == 'q_ids' else 'Sk'}={s}, B={b}; expected "
            f"[{s}] or [{b}, {s}]")


def _check_keep_shape(km, k4, target) -> None:
    for ax, (have, want) in enumerate(zip(k4.shape, target)):
        if have not in (1, want):
            raise ValueError(
                f"KeepMask(mask=...): shape {tuple(km.shape)} does not broadcast "
                f"to [B, Hq, Sq, Sk] = {list(target)} (dim {ax - 4} is {have}, "
                "expected " + ("1)" if want == 1 else f"1 or {want})"))


class _DocumentsTerm(TermKind):
    """``q_ids[i] == k_ids[j]`` with ``q_ids [Bd, Sq]``, ``k_ids [Bd, Sk]`` (Bd in {1, B});
    two Documents terms combine into one id pair (or, where the array library cannot,
    the second becomes a keep array)."""

    name = "documents"
    refusal = "does not support Documents masks"
    fields = ("q_ids", "k_ids")

    def fold(self, items, acc, ops, q_offset, k_offset):
        q_ids = k_ids = None
        for qi, ki in items:
            qi2, ki2 = ops.ids2(qi), ops.ids2(ki)
            if ops.check:
                for nm, ids, s in (("q_ids", qi2, acc.sq), ("k_ids", ki2, acc.sk)):
                    _check_ids_shape(nm, ids, s, acc.b)
            if q_ids is None:
                q_ids, k_ids = qi2, ki2
                continue
            both = ops.combine_ids(q_ids, k_ids, qi2, ki2)
            if both is not None:     # keep iff both id pairs match -> combined ids
                q_ids, k_ids = both
            else:
                acc.add("keep", ops.doc_keep(qi2, ki2))
        return {"q_ids": q_ids, "k_ids": k_ids}

    def keep_block(self, rm, i0, i1, j0, j1):
        qd, kd = to_numpy(rm.q_ids), to_numpy(rm.k_ids)
        return qd[:, None, i0:i1, None] == kd[:, None, None, j0:j1]   # [Bd, 1, ni, nj]

    def tile_parts(self, rm, bq, bk):
        return TILE_CACHE.get(("documents", _ids_digest(rm.q_ids, rm.k_ids),
                               rm.sq, rm.sk, bq, bk),
                              lambda: _document_tiles(rm, bq, bk))


class _KeepTerm(TermKind):
    """A boolean array, 4-D, broadcastable to [B, Hq, Sq, Sk] (the AND of every KeepMask)."""

    name = "keep"
    refusal = "does not support KeepMask"
    fields = ("keep",)

    def fold(self, items, acc, ops, q_offset, k_offset):
        keep = None
        tokens = [_frozen_token(km) for km in items]
        keep_key = None
        if len(tokens) == 1 and tokens[0] is not None:
            keep_key = tokens[0]   # one immutable array (several: their AND is new per call)
        target = (acc.b, acc.hq, acc.sq, acc.sk)
        for km in items:
            k4 = ops.keep4(km)
            if ops.check:
                _check_keep_shape(km, k4, target)
            keep = k4 if keep is None else ops.logical_and(keep, k4)
        return {"keep": keep, "keep_key": keep_key}

    def keep_block(self, rm, i0, i1, j0, j1):
        km = to_numpy(rm.keep)                                         # [Bx, Hx, Sq|1, Sk|1]
        rows = slice(i0, i1) if km.shape[2] > 1 else slice(0, 1)   # broadcast dims: row 0
        cols = slice(j0, j1) if km.shape[3] > 1 else slice(0, 1)
        return km[:, :, rows, cols]

    def tile_parts(self, rm, bq, bk):
        build = lambda: _tile_reduce(to_numpy(rm.keep), bq, bk)  # noqa: E731
        if rm.keep_key is None:
            return build()
        return TILE_CACHE.get(("keep", rm.keep_key[0], rm.sq, rm.sk, bq, bk), build,
                              rm.keep_key[1])


class _FunctionTerm(TermKind):
    """Mask functions: every ``MaskMod`` and every ``|`` of terms, each a bound program
    (:class:`anyattn.programs.bound.BoundProgram`; a pair is kept iff every one keeps it).
    Tiles are classified by evaluating the functions on every pair once, chunked, and
    cached in :data:`TILE_CACHE` by the graph's structural key, a digest of the
    captures' contents and the sizes."""

    name = "mask_mod"
    refusal = "does not support mask functions (MaskMod, or | of mask terms)"
    fields = ("mask_fns",)

    def fold(self, items, acc, ops, q_offset, k_offset):
        if not items:
            return {"mask_fns": None}
        return {"mask_fns": tuple(m._bound_function(acc.b, acc.hq, acc.sq, acc.sk,
                                                    q_offset, k_offset) for m in items)}

    def keep_block(self, rm, i0, i1, j0, j1):
        keep = None
        for bp in rm.mask_fns:
            k = bp.keep_dense(i0, i1, j0, j1)                  # [Bx, Hx, ni, nj]
            keep = k if keep is None else keep & k
        return keep

    def tile_parts(self, rm, bq, bk):
        from .programs.bound import mask_tile_parts

        any_k = all_k = None
        band = (rm.band_lo, rm.band_hi) if rm.has_band else None
        for bp in rm.mask_fns:
            a, l = TILE_CACHE.get(("mask_mod", bp.program.key, bp.digest(), bp.sizes, band,
                                   bq, bk),
                                  lambda bp=bp: mask_tile_parts(bp, bq, bk, band))
            any_k = a if any_k is None else any_k & a
            all_k = l if all_k is None else all_k & l
        return any_k, all_k


#: every lowered term kind by feature name, in folding order (a kind may add items to
#: a later one: a second Documents term becomes a keep array where ids cannot combine)
TERM_KINDS: Dict[str, TermKind] = {t.name: t for t in (_BandTerm(), _DocumentsTerm(),
                                                        _KeepTerm(), _FunctionTerm())}


@dataclass(frozen=True, eq=False)
class ResolvedMask:
    """A mask lowered for one problem size; what backends consume.

    One group of fields per term kind of :data:`TERM_KINDS`:
    ``band_lo``/``band_hi``: keep iff ``band_lo <= j - i <= band_hi`` (None = open).
    ``q_ids [Bd, Sq]``, ``k_ids [Bd, Sk]``: document ids (same array library
    as given) or None.  ``keep``: bool, 4-D, broadcastable to [B, Hq, Sq, Sk], or None.
    ``mask_fns``: mask functions (bound programs) or None.
    A pair is kept iff every present term keeps it.
    """

    sq: int
    sk: int
    band_lo: Optional[int] = None
    band_hi: Optional[int] = None
    q_ids: Any = None
    k_ids: Any = None
    keep: Any = None
    #: mask functions (MaskMod, ``|`` of terms): bound programs, or None
    mask_fns: Any = None
    #: identity tokens of the keep arrays when every one is immutable (see
    #: :func:`_frozen_token`), else None: the keep part of a tile map is then not cached
    keep_key: Any = field(default=None, repr=False, compare=False)
    #: memo for tile maps keyed by tile sizes (filled lazily by tile_map).
    _tile_maps: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def terms(self) -> Tuple[str, ...]:
        """The names of the term kinds present, in :data:`TERM_KINDS` order."""
        return tuple(n for n, t in TERM_KINDS.items() if t.present(self))

    @property
    def is_empty_mask(self) -> bool:
        """True when no term restricts anything (plain full attention)."""
        return not self.terms

    @property
    def has_band(self) -> bool:
        return TERM_KINDS["band"].present(self)

    # ----------------------------------------------------------- dense rules
    def band_keep(self, i0: int, i1: int, j0: int, j1: int):
        """Band term on a tile: bool [i1-i0, j1-j0], or None if it keeps everything."""
        if not self.has_band:
            return None
        return TERM_KINDS["band"].keep_block(self, i0, i1, j0, j1)

    def tile_keep(self, b: int, h: int, i0: int, i1: int, j0: int, j1: int):
        """Every term on one tile of one (b, h): NumPy bool [i1-i0, j1-j0] or None (all kept)."""
        keep = None
        for name in self.terms:
            blk = TERM_KINDS[name].keep_block(self, i0, i1, j0, j1)
            while blk.ndim < 4:
                blk = blk[None]
            blk = np.broadcast_to(blk[b if blk.shape[0] > 1 else 0, h if blk.shape[1] > 1 else 0],
                                  (i1 - i0, j1 - j0))
            keep = blk if keep is None else keep & blk
        return keep

    def dense_keep(self, b_count: int, h_count: int) -> np.ndarray:
        """The whole keep pattern as NumPy bool [B or 1, Hq or 1, Sq, Sk]: the float64
        reference's mask, the AND of every term's rule."""
        out = np.ones((1, 1, self.sq, self.sk), dtype=bool)
        for name in self.terms:
            out = out & TERM_KINDS[name].keep_block(self, 0, self.sq, 0, self.sk)
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

        The AND of every term's ``tile_parts``; memoised on this object per tile size,
        the document and (immutable) keep parts also across calls in
        :data:`TILE_CACHE` (see the module docstring).
        """
        key = (bq, bk)
        if key in self._tile_maps:
            return self._tile_maps[key]
        nq, nk = -(-self.sq // bq), -(-self.sk // bk)
        any_kept = np.ones((1, 1, nq, nk), dtype=bool)
        all_kept = np.ones((1, 1, nq, nk), dtype=bool)
        for name in self.terms:                # each [Bx, Hx, nQ|1, nK|1]
            a, l = TERM_KINDS[name].tile_parts(self, bq, bk)
            any_kept = any_kept & a
            all_kept = all_kept & l
        codes = np.where(all_kept, TILE_FULL, np.where(any_kept, TILE_PARTIAL, TILE_EMPTY))
        codes = codes.astype(np.int8)
        self._tile_maps[key] = codes
        return codes


def _document_tiles(rm: ResolvedMask, bq: int, bk: int) -> Tuple[np.ndarray, np.ndarray]:
    """Document term per tile: (any kept, all kept), bool [Bd, 1, nQ, nK].

    A tile keeps some pair iff its query and key tiles share an id, and every pair
    iff both hold one and the same id.  Per batch row: ids numbered by np.unique,
    an incidence matrix tile x id for each side (bool [nQ, U], [nK, U]) and one
    product of the two counts the shared ids of every tile pair: O(S log S + nQ·nK·U)
    instead of one [bq, Sk] compare per query tile."""
    qd, kd = to_numpy(rm.q_ids), to_numpy(rm.k_ids)
    nq, nk = -(-rm.sq // bq), -(-rm.sk // bk)
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
        mq[np.arange(rm.sq) // bq, inv[:rm.sq]] = 1
        mk[np.arange(rm.sk) // bk, inv[rm.sq:]] = 1
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


def lower(mask: Optional[Mask], b: int, hq: int, sq: int, sk: int, q_offset: int = 0,
          k_offset: int = 0, ops: ArrayOps = CORE_OPS) -> Dict[str, Any]:
    """Fold ``mask``'s terms for a problem of size (B, Hq, Sq, Sk) -> the
    :class:`ResolvedMask` fields, {} for no mask: every term kind's ``fold`` in
    :data:`TERM_KINDS` order, with the array operations ``ops`` (NumPy arrays and torch
    tensors alike; ``anyattn.torch.lowering`` passes traceable torch ones)."""
    if mask is None:
        return {}
    acc = _Lowering(b, hq, sq, sk)
    mask._lower(acc)
    fields: Dict[str, Any] = {}
    for name, kind in TERM_KINDS.items():
        fields.update(kind.fold(acc.items[name], acc, ops, q_offset, k_offset))
    return fields


def resolve(mask: Optional[Mask], b: int, hq: int, sq: int, sk: int,
            q_offset: int = 0, k_offset: int = 0) -> ResolvedMask:
    """Lower ``mask`` for a problem of size (B, Hq, Sq, Sk).

    ``q_offset``/``k_offset`` are the global positions of query 0 and key 0
    (context parallelism); they shift the band terms only.  Array terms are
    indexed locally.  Shapes are checked here; errors name the term.  A
    :class:`ResolvedMask` (already lowered, offsets applied) is returned as it is.
    """
    if isinstance(mask, ResolvedMask):
        if (mask.sq, mask.sk) != (sq, sk):
            raise ValueError(f"mask: a ResolvedMask for Sq={mask.sq}, Sk={mask.sk} does not "
                             f"fit Sq={sq}, Sk={sk}; resolve the mask for this problem")
        return mask
    if isinstance(mask, type) and issubclass(mask, Mask):
        raise TypeError(
            f"mask: got the class {mask.__name__}, not a mask object; pass an instance, "
            f"e.g. mask={mask.__name__}()"
        )
    if mask is not None and not hasattr(mask, "_lower"):
        raise TypeError(
            f"mask: expected a mask object (Causal, Window, KeepMask, Documents, MaskMod "
            f"or their & / | composition), got {type(mask).__name__}; pass a boolean array "
            "as KeepMask(array)"
        )
    return ResolvedMask(sq=sq, sk=sk, **lower(mask, b, hq, sq, sk, q_offset, k_offset))


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
