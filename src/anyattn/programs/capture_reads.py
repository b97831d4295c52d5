"""The reads of a score function's float captures, for the backends that compute capture
gradients as sums along the diagonals ``d = q_idx - kv_idx`` of the score matrix (the
portable Triton backward, the WebGPU backward).

A capture ``c`` gets ``dc[idx] = sum over (b, h, i, j) of dS'[b, h, i, j] * d s' / d g``
for each read ``g = c[idx]`` (DESIGN section 1).  Where every index of a read depends on
``b``, ``h`` and ``q_idx - kv_idx`` only (:func:`anyattn.programs.diagonal.diagonal_nodes`:
a relative position table ``table[h, q_idx - kv_idx + c]``, T5's
``table[h, bucket[kv_idx - q_idx + c]]``, learnable ALiBi slopes ``slopes[h]``, a
per-head temperature ``temp[h]``), the index takes one value per (b, h, d): the
gradient is a sum of the terms along each diagonal, scattered once per (b, h, d), at
the flat capture indices :func:`flat_index` evaluates on the host.  Other reads (an
index of ``q_idx`` or ``kv_idx`` alone, of the score) are what :func:`unsupported`
names.  Pure Python and NumPy: nothing here imports a device library.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import FrozenSet, List, Optional, Tuple

import numpy as np

from .diagonal import diagonal_nodes
from .graph import Node, ordered, render

__all__ = ["Read", "reads", "unsupported", "reads_diagonal", "flat_index"]

_INDEX = frozenset({"q_idx", "kv_idx", "score"})


@dataclass(frozen=True)
class Read:
    """One read (gather node) of a capture asked for: ``uses`` the axes its indices
    read, a subset of ('b', 'h', 'd') (``d``: q_idx - kv_idx); ``bad``: the first index
    that depends on q_idx / kv_idx otherwise (or on the score), None if supported."""

    node: Node
    name: str
    uses: FrozenSet[str]
    bad: Optional[Node]


def reads(program, wrt) -> List[Read]:
    """The reads of the captures ``wrt`` of a score program, in graph order (the order
    of ``program.grad_nodes(wrt)``'s gathers)."""
    order = ordered([program.out])
    diag = diagonal_nodes(order)
    out = []
    for g in program.gathers(frozenset(wrt)):
        uses, bad = set(), None
        for a in g.args:
            inputs = {n.attr for n in ordered([a]) if n.op == "input"}
            uses |= inputs & {"b", "h"}
            if a.uid in diag:
                uses.add("d")
            elif inputs & _INDEX and bad is None:
                bad = a
        out.append(Read(g, g.attr, frozenset(uses), bad))
    return out


def unsupported(program, wrt) -> Optional[str]:
    """Why a diagonal-sum backward cannot compute the gradients of the captures ``wrt``
    of a score program (None: it can), after the backward's name ("the Triton
    backward"); no remedy (the callers add theirs)."""
    for r in reads(program, wrt):
        if r.bad is not None:
            return (f"computes the gradient of a score_mod capture only where every read of "
                    f"it is indexed by b, h and q_idx - kv_idx: capture {r.name!r} is read "
                    f"at {render(r.node)}, whose index {render(r.bad)} depends on q_idx / "
                    "kv_idx otherwise")
    return None


def reads_diagonal(program, wrt) -> bool:
    """Does an index of the captures ``wrt`` read q_idx - kv_idx (slots of diagonal
    sums), or only b and h (one total per slot)?"""
    return any("d" in r.uses for r in reads(program, wrt))


def flat_index(bound, sizes: Tuple[int, int, int, int], r: Read, shape3,
               cap_shape) -> np.ndarray:
    """The flat capture index of read ``r`` of the bound score program ``bound`` at
    every (b, h, d) of its sums' shape [Bx, Hx, Ux] (an axis of 1 where the index does
    not read it; ``sizes`` = (B, H, Sq, Sk), u = d + Sk - 1): the index expressions
    evaluated once, q_idx = d and kv_idx = 0 (exact for expressions of q_idx - kv_idx,
    diagonal.py), integers in int64 and floats in fp32 as the kernels compute them
    (NumPy's fp32 functions may round an index computed through float arithmetic
    differently from a device's at a boundary)."""
    from .evaluate import evaluate

    _, _, Sq, Sk = sizes
    env = {"b": np.arange(shape3[0], dtype=np.int64)[:, None, None],
           "h": np.arange(shape3[1], dtype=np.int64)[None, :, None],
           "q_idx": (np.arange(-(Sk - 1), Sq, dtype=np.int64)[None, None, :]
                     if shape3[2] > 1 else np.int64(0)),
           "kv_idx": np.int64(0)}
    if not r.node.args:                                   # a capture of rank 0
        return np.zeros(int(np.prod(shape3)), dtype=np.int64)
    f32 = np.dtype(np.float32)          # float captures as the kernels store them
    idx = evaluate(list(r.node.args), env, bound.caps(f32), f32, idt=np.dtype(np.int64))
    idx = [np.broadcast_to(np.asarray(i, dtype=np.int64), shape3) for i in idx]
    return np.ravel_multi_index(idx, cap_shape).reshape(-1)
