"""Band-shaped parts of a mask function, lowered to the band term.

A mask function's top-level conjuncts (``a & b & ...``) that compare ``kv_idx - q_idx``
with a constant (``kv_idx <= q_idx``, ``q_idx - kv_idx <= w``, ``abs(q_idx - kv_idx) <= w``,
``kv_idx == q_idx + 3``, ...) are exactly a band ``lo <= kv_idx - q_idx <= hi``: they
lower to the band term (closed-form tile ranges, partial tiles trimmed to the rows and
keys the band reaches), and only the other conjuncts stay a function.  A function that
is a band and nothing else (causal, a sliding window) then runs as the built-in terms do.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from .diagonal import affine_form
from .graph import BOOL, INT, Node

__all__ = ["split_bands", "conjuncts", "document_conjunct", "DocumentIds"]


def conjuncts(n: Node) -> List[Node]:
    """The operands of a top-level chain of logical ``and``."""
    if n.op == "and" and n.dtype == BOOL:
        return conjuncts(n.args[0]) + conjuncts(n.args[1])
    return [n]


def _band_of(n: Node) -> Optional[Tuple[Optional[int], Optional[int]]]:
    """The band ``lo <= kv_idx - q_idx <= hi`` that the comparison ``n`` is, or None."""
    if n.op not in ("lt", "le", "gt", "ge", "eq"):
        return None
    left, right = n.args
    if left.op == "abs" and n.op in ("lt", "le"):       # abs(x) <= c: -c <= x <= c
        x, c = affine_form(left.args[0]), affine_form(right)
        if x is None or c is None or c[:2] != (0, 0) or x[0] != -x[1] or abs(x[1]) != 1:
            return None
        s, c0 = x[1], x[2]                              # x = s·d + c0, d = kv - q
        w = c[2] - (1 if n.op == "lt" else 0)
        # -w <= s·d + c0 <= w  ->  d in [(-w - c0)/s, (w - c0)/s] (s = ±1)
        lo, hi = (-w - c0, w - c0) if s == 1 else (c0 - w, c0 + w)
        return lo, hi
    x, y = affine_form(left), affine_form(right)
    if x is None or y is None:
        return None
    a, b, c = x[0] - y[0], x[1] - y[1], x[2] - y[2]     # left - right = a·q + b·kv + c
    if a != -b or abs(b) != 1:
        return None
    # left - right = s·d + c with d = kv - q, s = ±1; normalise to "s·d + c <op> 0"
    s = b
    if n.op == "eq":
        return (-c * s, -c * s)
    strict = n.op in ("lt", "gt")
    if n.op in ("gt", "ge"):                            # s·d + c >= 0 -> -s·d - c <= 0
        s, c = -s, -c
    if strict:
        c += 1                                          # s·d + c < 0 -> s·d + c + 1 <= 0
    return (None, -c) if s == 1 else (c, None)          # s·d <= -c


def split_bands(out: Node) -> Tuple[List[Tuple[Optional[int], Optional[int]]], List[Node]]:
    """(bands of the band-shaped conjuncts of ``out``, the other conjuncts)."""
    bands, rest = [], []
    for c in conjuncts(out):
        band = _band_of(c)
        if band is None:
            rest.append(c)
        else:
            bands.append(band)
    return bands, rest


def _ids_read(g: Node, pos: str) -> Optional[Tuple[str, bool]]:
    """(capture, batched) if ``g`` reads a capture at ``[pos]`` or ``[b, pos]``."""
    if g.op != "gather" or g.dtype != INT:
        return None
    names = [a.attr if a.op == "input" else None for a in g.args]
    if names == [pos]:
        return g.attr, False
    if names == ["b", pos]:
        return g.attr, True
    return None


def _chunk_of(g: Node, pos: str) -> Optional[int]:
    """C if ``g`` is ``pos // C`` for an integer constant C > 0."""
    if g.op != "floordiv" or g.dtype != INT:
        return None
    x, c = g.args
    if x.op != "input" or x.attr != pos or c.op != "const" or c.dtype != INT:
        return None
    return int(c.attr) if int(c.attr) > 0 else None


@dataclass(frozen=True)
class DocumentIds:
    """The document ids of a Documents conjunct: an integer capture read at ``[pos]``
    (``batched``: at ``[b, pos]``), or, with ``chunk`` > 0, ``pos // chunk`` (Llama 4's
    chunks)."""

    capture: Optional[str] = None
    batched: bool = False
    chunk: int = 0


def document_conjunct(n: Node) -> Optional[DocumentIds]:
    """The ids of the conjunct ``n`` if it is ``ids[q_idx] == ids[kv_idx]`` (or
    ``ids[b, q_idx] == ids[b, kv_idx]``) for one integer capture ``ids``, or
    ``q_idx // C == kv_idx // C`` for one integer constant C > 0 (either side first):
    the Documents term of those ids, else None."""
    if n.op != "eq" or len(n.args) != 2:
        return None
    for a, b in (n.args, n.args[::-1]):
        qa, kb = _ids_read(a, "q_idx"), _ids_read(b, "kv_idx")
        if qa is not None and qa == kb:
            return DocumentIds(capture=qa[0], batched=qa[1])
        qc, kc = _chunk_of(a, "q_idx"), _chunk_of(b, "kv_idx")
        if qc is not None and qc == kc:
            return DocumentIds(chunk=qc)
    return None
