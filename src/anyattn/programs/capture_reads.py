"""The reads of a score function's float captures, for the backends that compute capture
gradients as sums of the score matrix's terms (the portable Triton backward, the WebGPU
backward).

A capture ``c`` gets ``dc[idx] = sum over (b, h, i, j) of dS'[b, h, i, j] * d s' / d g``
for each read ``g = c[idx]`` (DESIGN section 1).  Where every index of a read depends on
``b``, ``h`` and one position of the score matrix (:func:`classify`): ``q_idx - kv_idx``
(:func:`anyattn.programs.diagonal.diagonal_nodes`: a relative position table
``table[h, q_idx - kv_idx + c]``, T5's ``table[h, bucket[kv_idx - q_idx + c]]``), ``q_idx``
alone, ``kv_idx`` alone, or none (learnable ALiBi slopes ``slopes[h]``), the index takes
one value per (b, h, position): the gradient is a sum of the terms along each diagonal,
row or column, scattered once per (b, h, position) at the flat capture indices
:func:`flat_index` evaluates on the host.

A *pair* read (:data:`PAIR`) reads one element per score-matrix element: every index is
of ``b`` and ``h`` only, or exactly ``q_idx`` plus an integer constant, or exactly
``kv_idx`` plus one, q_idx and kv_idx each in one index (a learnable per-pair table
``t[h, q_idx, kv_idx]``, ``t[b, h, q_idx, kv_idx]``, ``t[q_idx + 2, kv_idx]``).  Within
one (b, h) the read is injective (each index lies in its axis for every q_idx < Sq,
kv_idx < Sk: the core's bounds check), so its gradient element at (b, h, i, j) is that
pair's term alone, and elements collide only across the (b, h) whose b / h indices
(:func:`pair_slices`) agree.  Other reads of both q_idx and kv_idx otherwise
than through their difference are refused (:func:`refusal`).  Pure Python and NumPy:
nothing here imports a device library.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Optional, Set, Tuple

import numpy as np

from .diagonal import affine_form, diagonal_nodes
from .graph import Node, ordered, render

__all__ = ["Read", "reads", "KINDS", "PAIR", "classify", "refusal", "flat_index", "PairIndex",
           "pair_index", "pair_slices", "pair_targets"]

_INDEX = frozenset({"q_idx", "kv_idx", "score"})


@dataclass(frozen=True)
class Read:
    """One read (gather node) of a capture asked for: ``uses`` the axes its indices
    read among ('b', 'h', 'd') (``d``: q_idx - kv_idx; :func:`classify` says which
    position a read indexes)."""

    node: Node
    name: str
    uses: FrozenSet[str]


def reads(program, wrt, diag: Optional[Set[int]] = None) -> List[Read]:
    """The reads of the captures ``wrt`` of a score program, in graph order (the order
    of ``program.grad_nodes(wrt)``'s gathers); ``diag``: the program's diagonal nodes
    where the caller has them."""
    if diag is None:
        diag = diagonal_nodes(ordered([program.out]))
    out = []
    for g in program.gathers(frozenset(wrt)):
        uses = set()
        for a in g.args:
            uses |= {n.attr for n in ordered([a]) if n.op == "input"} & {"b", "h"}
            if a.uid in diag:
                uses.add("d")
        out.append(Read(g, g.attr, frozenset(uses)))
    return out


#: the kinds of read a backward may differentiate: an index of q_idx - kv_idx (sums
#: along the tile diagonals), of q_idx alone (along each query row), of kv_idx alone
#: (down each key column), of b and h only (one total per tile)
KINDS = ("diag", "row", "col", "total")
#: the kind of a read of one element per (b, h, q_idx, kv_idx) (module doc)
PAIR = "pair"
_OTHERWISE = "q_idx and kv_idx otherwise than through q_idx - kv_idx"
_PAIR_FORM = ("or by b, h, q_idx and kv_idx with q_idx and kv_idx each an index of its "
              "own plus an integer constant (t[h, q_idx, kv_idx])")


@dataclass(frozen=True)
class PairIndex:
    """How a pair read indexes its capture: ``q_axis`` / ``kv_axis`` the axes read at
    ``q_idx + q_const`` / ``kv_idx + kv_const``, ``bh_axes`` the other axes (indices of b
    and h only, in axis order)."""

    q_axis: int
    q_const: int
    kv_axis: int
    kv_const: int
    bh_axes: Tuple[int, ...]


def pair_index(node: Node) -> Optional[PairIndex]:
    """The :class:`PairIndex` of a gather node whose indices read q_idx and kv_idx as a
    pair read does (module doc), else None."""
    memo: Dict[int, object] = {}
    q = kv = None
    bh = []
    for ax, a in enumerate(node.args):
        ins = {n.attr for n in ordered([a]) if n.op == "input"}
        if not ins & _INDEX:
            bh.append(ax)
            continue
        f = affine_form(a, memo)
        if f is None or f[:2] not in ((1, 0), (0, 1)):
            return None
        if f[:2] == (1, 0):
            if q is not None:
                return None
            q = (ax, f[2])
        else:
            if kv is not None:
                return None
            kv = (ax, f[2])
    if q is None or kv is None:
        return None
    return PairIndex(q[0], q[1], kv[0], kv[1], tuple(bh))


def classify(program, wrt) -> List[Tuple[Read, Optional[str], Optional[str]]]:
    """(read, kind, why) for the reads of the captures ``wrt`` (:func:`reads`' order):
    kind one of :data:`KINDS` (b and h may join any) or :data:`PAIR`, or None with
    ``why`` the reason the read is refused (an index of both q_idx and kv_idx other
    than their difference, indices of different kinds together other than a pair
    read's, an index of the score)."""
    diag = diagonal_nodes(ordered([program.out]))
    out = []
    for r in reads(program, wrt, diag):
        axes: Dict[str, Node] = {}
        why = None
        for a in r.node.args:
            ins = {n.attr for n in ordered([a]) if n.op == "input"} & _INDEX
            if a.uid in diag:
                axes.setdefault("diag", a)
            elif "score" in ins or ins == {"q_idx", "kv_idx"}:
                dep = "the score" if "score" in ins else _OTHERWISE
                why = f"whose index {render(a)} depends on {dep}"
                break
            elif ins:
                axes.setdefault("row" if ins == {"q_idx"} else "col", a)
        if why is None and len(axes) > 1:
            if set(axes) == {"row", "col"} and pair_index(r.node) is not None:
                out.append((r, PAIR, None))
                continue
            a, b = list(axes.values())[:2]
            why = f"whose indices {render(a)} and {render(b)} together depend on {_OTHERWISE}"
        kind = None if why is not None else (next(iter(axes)) if axes else "total")
        out.append((r, kind, why and f"capture {r.name!r} is read at {render(r.node)}, {why}"))
    return out


def refusal(program, wrt) -> Optional[str]:
    """Why a backward that sums along diagonals, rows and columns and sums pair reads (the
    portable Triton backward, the WebGPU backward) cannot compute the gradients of the
    captures ``wrt`` of a score program (None: it can), after the backward's name ("the
    Triton backward"); no remedy (the callers add theirs)."""
    head = ("computes the gradient of a score_mod capture only where each read of it is "
            "indexed by b, h and one of q_idx - kv_idx, q_idx or kv_idx, " + _PAIR_FORM)
    for _, kind, why in classify(program, wrt):
        if kind is None:
            return f"{head}: {why}"
    return None


def flat_index(bound, sizes: Tuple[int, int, int, int], r: Read, shape3, cap_shape,
               kind: str = "diag", b0: int = 0) -> np.ndarray:
    """The flat capture index of read ``r`` of the bound score program ``bound`` at every
    (b, h, x) of its sums' shape [Bx, Hx, X] (an axis of 1 where the index does not
    read it; ``sizes`` = (B, H, Sq, Sk)): the index expressions evaluated once, with
    q_idx = d and kv_idx = 0 for a diagonal read (x = d + Sk - 1; exact for expressions
    of q_idx - kv_idx, diagonal.py), q_idx = x for a row read, kv_idx = x for a column
    read (the other index 0: not read), integers in int64 and floats in fp32 as the
    kernels compute them (NumPy's fp32 functions may round an index computed through
    float arithmetic differently from a device's at a boundary).  ``b0``: the batch
    index of the first row (a batch chunk's)."""
    from .evaluate import evaluate

    _, _, Sq, Sk = sizes
    pos = {"diag": np.arange(-(Sk - 1), Sq, dtype=np.int64),
           "row": np.arange(Sq, dtype=np.int64),
           "col": np.arange(Sk, dtype=np.int64)}.get(kind)
    pos = np.int64(0) if pos is None or shape3[2] == 1 else pos[None, None, :]
    env = {"b": b0 + np.arange(shape3[0], dtype=np.int64)[:, None, None],
           "h": np.arange(shape3[1], dtype=np.int64)[None, :, None],
           "q_idx": pos if kind in ("diag", "row") else np.int64(0),
           "kv_idx": pos if kind == "col" else np.int64(0)}
    if not r.node.args:                                   # a capture of rank 0
        return np.zeros(int(np.prod(shape3)), dtype=np.int64)
    f32 = np.dtype(np.float32)          # float captures as the kernels store them
    idx = evaluate(list(r.node.args), env, bound.caps(f32), f32, idt=np.dtype(np.int64))
    idx = [np.broadcast_to(np.asarray(i, dtype=np.int64), shape3) for i in idx]
    return np.ravel_multi_index(idx, cap_shape).reshape(-1)


def pair_targets(bound, r: Read, sizes, b0: int = 0) -> List[Tuple[List[int], tuple, bool]]:
    """Where pair read ``r``'s terms go, per capture slice: (rows, index, transposed)
    with ``rows`` the flat b·H + h whose b / h indices select that slice, in order of b,
    then h (the order their terms are summed in), ``index`` the slice's [Sq, Sk] view of
    the capture (``capture[index]``; [Sk, Sq] where ``transposed``: kv_idx's axis
    first).  ``sizes`` = (B, H, Sq, Sk); ``b0``: the batch index of row 0 (a batch
    chunk of B batches from b0)."""
    B, H, Sq, Sk = sizes
    p = pair_index(r.node)
    slices = pair_slices(bound, r, (B, H), b0).reshape(B * H, -1)
    rows_of: Dict[tuple, List[int]] = {}
    for bh, key in enumerate(map(tuple, slices.tolist())):
        rows_of.setdefault(key, []).append(bh)
    out = []
    for key, rows in rows_of.items():
        at: List[object] = [None] * len(r.node.args)
        for ax, v in zip(p.bh_axes, key):
            at[ax] = v
        at[p.q_axis] = slice(p.q_const, p.q_const + Sq)
        at[p.kv_axis] = slice(p.kv_const, p.kv_const + Sk)
        out.append((rows, tuple(at), p.kv_axis < p.q_axis))
    return out


def pair_slices(bound, r: Read, shape2, b0: int = 0) -> np.ndarray:
    """The b / h indices of pair read ``r`` of the bound score program ``bound`` at every
    (b, h) of ``shape2`` = (Bx, Hx) (an axis of 1 where the read does not read it):
    int64 [Bx, Hx, len(bh_axes)] in :func:`pair_index`'s axis order, evaluated once as
    :func:`flat_index` evaluates indices (float captures in fp32); b from ``b0``."""
    from .evaluate import evaluate

    p = pair_index(r.node)
    out = np.zeros(tuple(shape2) + (len(p.bh_axes),), dtype=np.int64)
    if not p.bh_axes:
        return out
    env = {"b": b0 + np.arange(shape2[0], dtype=np.int64)[:, None],
           "h": np.arange(shape2[1], dtype=np.int64)[None, :],
           "q_idx": np.int64(0), "kv_idx": np.int64(0)}
    f32 = np.dtype(np.float32)
    idx = evaluate([r.node.args[ax] for ax in p.bh_axes], env, bound.caps(f32), f32,
                   idt=np.dtype(np.int64))
    for n, i in enumerate(idx):
        out[..., n] = np.broadcast_to(np.asarray(i, dtype=np.int64), tuple(shape2))
    return out
