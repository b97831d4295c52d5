"""Score functions that spell a built-in modifier exactly, recognised on their graph.

A backend may run such a function as the built-in (its tile code, units and bounds)
instead of evaluating the graph per tile.  The match is structural and exact: only the
forms below, with nothing around them, are recognised; anything else (another
constant, an extra term, a different index expression) stays a function.

* **softcap** ``c * tanh(score / c)`` (either factor order of ``*``; ``np.tanh``,
  ``torch.tanh`` or ``anyattn.math.tanh``) with one float constant ``c``, finite and
  > 0: the built-in ``softcap=c``.
* **a per-head factor** ``score * t[h]`` (either order), ``t`` a float capture of shape
  [Hq] read at ``h`` or [B, Hq] read at ``(b, h)``, or ``score * c`` with a float
  constant ``c`` (:class:`Scale`): a forward may fold it into the queries, when every
  factor is finite (``scale·(q·t)·k`` for ``(scale·q·k)·t``; no built-in has it).
* **ALiBi** ``score - slopes[h] * abs(d)`` (either factor order) where ``slopes`` is a
  float capture of shape [Hq] read at ``h``, or [B, Hq] read at ``(b, h)``, and ``d``
  is ``q_idx - kv_idx + K`` or its negation, spelled with integer ``+``, ``-`` and
  constants in any grouping (``K`` an integer, 0 included): the built-in
  ``alibi_slopes=slopes``, whose distance is ``|i - j + diag|`` with
  ``diag = Sk - Sq + q_offset - k_offset``.  The function's indices are local, so the
  match holds only where ``K`` equals that ``diag`` (:meth:`Alibi.fits`).

The built-in computes the same values up to the rounding of its own operation order
(softcap: ``scale / c`` on the queries; ALiBi: the product in float64, rebased per row),
well inside the float64-oracle tolerance of the compute dtype.

A score function ``where(c, x, -inf)`` whose condition ``c`` is a band or a conjunction
of bands (``kv_idx <= q_idx + K``, ``abs(q_idx - kv_idx) <= w``, ...; see
:mod:`.bands`) is the band mask term and the score function ``x``
(:func:`band_where`): a score of -inf and an excluded pair both give P = 0 (a row with
none left is an empty row either way), and the derivatives of ``where`` are 0 on the
excluded pairs, where dS is 0 anyway.  As a mask term the band's empty tiles are
skipped; inside the function every tile is computed.
"""
from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple, Union

import numpy as np

from .bands import split_bands
from .bound import Program
from .graph import FLOAT, INT, Node
from .trace import Traced

__all__ = ["Softcap", "Alibi", "Scale", "match_builtin", "band_where", "lower_to_builtins",
           "alibi_slopes_of"]


@dataclass(frozen=True)
class Softcap:
    """The function is ``c * tanh(score / c)``."""

    cap: float


@dataclass(frozen=True)
class Alibi:
    """The function is ``score - slopes[(b,) h] * |q_idx - kv_idx + offset|``;
    ``capture``: the slopes' name, ``per_batch``: indexed by (b, h) (shape [B, Hq])."""

    capture: str
    offset: int
    per_batch: bool

    def fits(self, diag: int) -> bool:
        """The built-in's distance ``|i - j + diag|`` is this function's."""
        return self.offset == diag


@dataclass(frozen=True)
class Scale:
    """The function is ``score * t[(b,) h]`` (``capture`` t, ``per_batch``: read at
    (b, h)) or ``score * const`` (``capture`` None, ``const`` the factor)."""

    capture: Optional[str]
    per_batch: bool = False
    const: float = 1.0

    def factors(self, arrays, sizes: Tuple[int, int, int, int]):
        """The factor of every (b, h): float64 [B or 1, Hq] (NumPy)."""
        B, Hq = sizes[0], sizes[1]
        if self.capture is None:
            return np.full((1, Hq), self.const)
        t = np.asarray(arrays[self.capture], dtype=np.float64)
        return t.reshape((B, Hq) if self.per_batch else (1, Hq))


def _is_input(n: Node, name: str) -> bool:
    return n.op == "input" and n.attr == name


def _softcap(out: Node) -> Optional[Softcap]:
    if out.op != "mul":
        return None
    for c, t in (out.args, out.args[::-1]):
        if (c.op == "const" and c.dtype == FLOAT and t.op == "tanh"
                and t.args[0].op == "div" and _is_input(t.args[0].args[0], "score")
                and t.args[0].args[1] is c):
            cap = c.attr
            if math.isfinite(cap) and cap > 0:
                return Softcap(cap)
    return None


def _linear(n: Node, depth: int = 0) -> Optional[Dict[str, int]]:
    """An integer expression of q_idx, kv_idx and constants built with +, - and unary
    minus -> its coefficients {'q_idx': a, 'kv_idx': c, '1': k}; None otherwise."""
    if depth > 16 or n.dtype != INT:
        return None
    if n.op == "const":
        return {"1": int(n.attr)}
    if n.op == "input" and n.attr in ("q_idx", "kv_idx"):
        return {n.attr: 1}
    if n.op == "neg":
        a = _linear(n.args[0], depth + 1)
        return None if a is None else {k: -v for k, v in a.items()}
    if n.op in ("add", "sub"):
        a, b = (_linear(x, depth + 1) for x in n.args)
        if a is None or b is None:
            return None
        sign = 1 if n.op == "add" else -1
        out = dict(a)
        for k, v in b.items():
            out[k] = out.get(k, 0) + sign * v
        return out
    return None


def _alibi(out: Node, specs, sizes: Tuple[int, int, int, int]) -> Optional[Alibi]:
    if out.op != "sub" or not _is_input(out.args[0], "score") or out.args[1].op != "mul":
        return None
    B, Hq = sizes[0], sizes[1]
    for g, f in (out.args[1].args, out.args[1].args[::-1]):
        per_batch = _head_gather(g, specs, B, Hq)
        if per_batch is None or f.op != "tofloat":
            continue
        a = f.args[0]
        if a.op != "abs":
            continue
        lin = _linear(a.args[0])
        if lin is None:
            continue
        qc, kc, k = lin.get("q_idx", 0), lin.get("kv_idx", 0), lin.get("1", 0)
        if (qc, kc) == (1, -1):
            return Alibi(g.attr, k, per_batch)
        if (qc, kc) == (-1, 1):                        # |-(q - kv - k)| = |q - kv - k|
            return Alibi(g.attr, -k, per_batch)
    return None


def _head_gather(g: Node, specs, B: int, Hq: int) -> Optional[bool]:
    """``g`` reads a float capture of shape [Hq] at h (False) or [B, Hq] at (b, h)
    (True); None otherwise."""
    if g.op != "gather" or g.dtype != FLOAT or g.attr not in specs:
        return None
    shape = tuple(specs[g.attr].shape)
    if len(g.args) == 1 and _is_input(g.args[0], "h") and shape == (Hq,):
        return False
    if (len(g.args) == 2 and _is_input(g.args[0], "b") and _is_input(g.args[1], "h")
            and shape == (B, Hq)):
        return True
    return None


def _scale(out: Node, specs, sizes) -> Optional[Scale]:
    if out.op != "mul":
        return None
    for s, t in (out.args, out.args[::-1]):
        if not _is_input(s, "score"):
            continue
        if t.op == "const" and t.dtype == FLOAT:
            return Scale(None, False, t.attr)
        per_batch = _head_gather(t, specs, sizes[0], sizes[1])
        if per_batch is not None:
            return Scale(t.attr, per_batch)
    return None


def match_builtin(program, sizes: Tuple[int, int, int, int]
                  ) -> Union[Softcap, Alibi, Scale, None]:
    """The built-in modifier ``program`` (a score function's
    :class:`~anyattn.programs.bound.Program`) spells exactly for a problem of sizes
    (B, Hq, Sq, Sk), or None."""
    if program.kind != "score_mod":
        return None
    return (_softcap(program.out) or _alibi(program.out, program.specs, sizes)
            or _scale(program.out, program.specs, sizes))


Band = Tuple[Optional[int], Optional[int]]
_SPLITS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_SPLITS_LOCK = threading.Lock()


def band_where(program) -> Optional[Tuple[List[Band], object]]:
    """A score function ``where(c, x, -inf)`` with ``c`` a conjunction of bands ->
    (the bands ``lo <= kv_idx - q_idx <= hi`` on local indices, the
    :class:`~anyattn.programs.bound.Program` of ``x``); None for any other function.
    Made once per program."""
    if program.kind != "score_mod":
        return None
    with _SPLITS_LOCK:
        if program in _SPLITS:
            return _SPLITS[program]
    out, hit = program.out, None
    if (out.op == "where" and out.args[2].op == "const"
            and out.args[2].attr == -math.inf):
        bands, rest = split_bands(out.args[0])
        if bands and not rest:
            x = Program(Traced(program.kind, program.name, out.args[1], program.bld,
                               program.specs, {}))
            hit = (bands, x)
    with _SPLITS_LOCK:
        _SPLITS[program] = hit
    return hit


def lower_to_builtins(smod, rmask, softcap: Optional[float]):
    """The problem-level part of the matches, for every backend: ``(smod, rmask,
    softcap)`` of a call (its bound score function or None, its
    :class:`~anyattn.masks.ResolvedMask`, its softcap) with a ``where(band, x, -inf)``
    function's bands moved into the mask's band term (the function becomes ``x``, or
    none where ``x`` is the score itself) and a function that spells softcap exactly
    turned into ``softcap=c`` where no softcap is set (the function would apply after
    it).  ALiBi and per-head factors need the backend's modifier arrays or inputs and
    stay with the backend (the NumPy backend matches them)."""
    if smod is None:
        return smod, rmask, softcap
    split = band_where(smod.program)
    if split is not None:
        from dataclasses import replace

        bands, rest = split
        lo, hi = rmask.band_lo, rmask.band_hi
        for blo, bhi in bands:
            lo = blo if lo is None else (lo if blo is None else max(lo, blo))
            hi = bhi if hi is None else (hi if bhi is None else min(hi, bhi))
        rmask = replace(rmask, band_lo=lo, band_hi=hi, _tile_maps={})
        caps = dict(smod.arrays, **smod.device)
        smod = None if _is_input(rest.out, "score") else rest.bind(caps, smod.sizes)
    if smod is not None and softcap is None:
        form = match_builtin(smod.program, smod.sizes)
        if isinstance(form, Softcap):
            smod, softcap = None, form.cap
    return smod, rmask, softcap


def alibi_slopes_of(smod, diag: int, wrt) -> Optional[Tuple[np.ndarray, bool]]:
    """(slopes, per_batch) where the bound score function ``smod`` spells ALiBi exactly
    for the built-in's diagonal ``diag`` (``Sk - Sq + q_offset - k_offset``) and ``wrt``
    does not name the slopes (the built-in's slopes have no gradient); else None.
    ``slopes``: the capture as given (NumPy), [Hq] or [B, Hq]."""
    form = match_builtin(smod.program, smod.sizes)
    if not isinstance(form, Alibi) or not form.fits(diag) or form.capture in wrt \
            or form.capture in smod.device:       # device-array slopes: the function runs
        return None
    return np.asarray(smod.arrays[form.capture]), form.per_batch
