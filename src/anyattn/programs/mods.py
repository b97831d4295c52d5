"""The public objects of programmable attention: ``ScoreMod`` and ``MaskMod``.

``ScoreMod(fn, **captures)``: ``fn(score, b, h, q_idx, kv_idx, *captures) -> score``,
applied to every scaled score (FlexAttention's ``score_mod``).  ``MaskMod(fn,
**captures)``: ``fn(b, h, q_idx, kv_idx, *captures) -> bool`` (True = attend), a mask
term that composes with ``&`` and ``|`` with the built-in ones.  Both trace ``fn`` once,
when built (see :mod:`anyattn.programs.trace`); a bad function is refused here, a
capture index out of range when a call's sizes are known.
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

import numpy as np

from ..arrays import array_kind
from ..masks import Mask
from .bound import BoundProgram, Program
from .compose import FunctionContext
from .bands import DocumentIds, document_conjunct, split_bands
from .graph import BOOL
from .trace import Sym, Traced, call_traced, fn_name, trace

__all__ = ["ScoreMod", "MaskMod", "as_score_mod", "RESERVED"]

#: names a capture may not take: wrt= names gradients by them
RESERVED = ("q", "k", "v", "bias", "sinks")


class ScoreMod:
    """A score function and its captures: ``ScoreMod(fn, table=t)`` with
    ``fn(score, b, h, q_idx, kv_idx, table)``.  A plain function passed as ``score_mod=``
    becomes ``ScoreMod(fn)`` (arrays it closes over are captures, named after their
    variable).  ``captures``: the arrays by name; float ones can be named in ``wrt``."""

    def __init__(self, fn, **captures):
        traced = trace(fn, "score_mod", captures)
        bad = [n for n in traced.specs if n in RESERVED]
        if bad:
            raise ValueError(f"score_mod {traced.name!r}: capture name(s) {bad} are reserved "
                             f"for the gradients {RESERVED} of wrt=; rename the capture")
        self.fn = fn
        self.program = Program(traced)
        self.captures: Dict[str, Any] = dict(traced.arrays)

    @property
    def name(self) -> str:
        return self.program.name

    def bind(self, sizes: Tuple[int, int, int, int]) -> BoundProgram:
        return self.program.bind(self.captures, sizes)

    def __repr__(self) -> str:
        caps = ", ".join(f"{n}={tuple(a.shape)}" for n, a in self.captures.items())
        return f"ScoreMod({self.name}{', ' + caps if caps else ''})"


def as_score_mod(x) -> ScoreMod:
    """``score_mod=`` argument -> ScoreMod (a plain function is traced here)."""
    if isinstance(x, ScoreMod):
        return x
    if isinstance(x, Mask) or isinstance(x, type) or not callable(x):
        raise TypeError(f"score_mod: expected a function score_mod(score, b, h, q_idx, "
                        f"kv_idx) or anyattn.ScoreMod, got {type(x).__name__}"
                        + ("; a MaskMod goes in mask=" if isinstance(x, Mask) else ""))
    return ScoreMod(x)


class MaskMod(Mask):
    """A mask function and its captures: ``MaskMod(fn, prefix=lengths)`` with
    ``fn(b, h, q_idx, kv_idx, prefix) -> bool`` (True = attend).  Indices are local
    (``q_offset`` / ``k_offset`` shift only the band terms, as for array masks).
    Tiles are classified full / partial / empty by evaluating ``fn`` once per pair
    (cached by content), so empty tiles cost nothing and full ones skip ``fn``.
    Top-level conjuncts that are bands (``kv_idx <= q_idx``, ``abs(q_idx - kv_idx) <= w``)
    lower to the band term instead (:mod:`anyattn.programs.bands`)."""

    def __init__(self, fn, **captures):
        traced = trace(fn, "mask_mod", captures)
        self.fn = fn
        self.program = Program(traced)
        self.captures: Dict[str, Any] = dict(traced.arrays)
        self._explicit = dict(captures)
        # band-shaped conjuncts lower to the band term, ids[q_idx] == ids[kv_idx] and
        # q_idx // C == kv_idx // C to the Documents term (where the ids fit the problem:
        # _documents), the rest stays a function
        self.bands, rest = split_bands(traced.out)
        docs = [document_conjunct(c) for c in rest]
        self.documents: Tuple[DocumentIds, ...] = tuple(d for d in docs if d is not None)
        self.residual = self._program(traced, rest, whole=not self.bands)
        self._residual_without_documents = self._program(
            traced, [c for c, d in zip(rest, docs) if d is None],
            whole=not self.bands and not self.documents)

    def _program(self, traced, conjuncts, whole: bool) -> Optional[Program]:
        """The conjunction of ``conjuncts`` as a program (None for none; the traced
        program itself where it is ``whole``: nothing was taken out)."""
        if not conjuncts:
            return None
        if whole:
            return self.program
        out = conjuncts[0]
        for c in conjuncts[1:]:
            out = traced.bld.node("and", BOOL, (out, c))
        return Program(Traced("mask_mod", traced.name, out, traced.bld, traced.specs,
                              traced.arrays))

    def _documents(self, b: int, sq: int, sk: int):
        """The (q_ids, k_ids) pairs of the Documents conjuncts for a problem of batch
        ``b`` and sizes ``sq`` / ``sk``, or None where some conjunct's ids do not fit it
        (not an integer NumPy array or torch tensor, too short: the function then runs,
        and checks its reads).  Chunk ids ``pos // C`` are made here (O(Sq + Sk))."""
        if not self.documents:
            return None
        pairs = []
        for d in self.documents:
            if d.chunk:
                ids = np.arange(max(sq, sk), dtype=np.int64) // d.chunk
                pairs.append((ids[:sq], ids[:sk]))
                continue
            ids = self.captures.get(d.capture)
            kind = array_kind(ids)
            dt = str(getattr(ids, "dtype", "")).replace("torch.", "")
            if kind not in ("numpy", "torch") or not dt.startswith(("int", "uint")):
                return None             # (device arrays: the function reads them in place)
            if ids.ndim != (2 if d.batched else 1) or ids.shape[-1] < max(sq, sk) \
                    or (d.batched and ids.shape[0] < b):
                return None
            rows = ids[:b] if d.batched else ids
            pairs.append((rows[..., :sq], rows[..., :sk]))
        return pairs

    @property
    def name(self) -> str:
        return self.program.name

    def _lower(self, acc) -> None:
        for lo, hi in self.bands:
            acc.add("band", (lo, hi, "local"))
        docs = self._documents(acc.b, acc.sq, acc.sk)
        for pair in docs or ():
            acc.add("documents", pair)
        if (self.residual if docs is None else self._residual_without_documents) is not None:
            acc.add("mask_mod", self)

    def _bound_function(self, b, hq, sq, sk, q_offset, k_offset) -> BoundProgram:
        prog = (self.residual if self._documents(b, sq, sk) is None
                else self._residual_without_documents)
        return prog.bind(self.captures, (b, hq, sq, sk))

    def _fn(self, fx: FunctionContext):
        node = call_traced(self.fn, "mask_mod", self._explicit, fx.ctx,
                           [fx.b, fx.h, fx.q_idx, fx.kv_idx],
                           lambda name, arr: fx.capture(name, arr))
        return Sym(node, fx.ctx)

    def __repr__(self) -> str:
        return f"MaskMod({fn_name(self.fn)})"
