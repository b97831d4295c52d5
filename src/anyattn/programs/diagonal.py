"""Subexpressions of a graph that depend on the indices through ``q_idx - kv_idx`` only,
evaluated once per tile diagonal instead of once per pair.

On a transposed tile [nj, ni] (queries i0..i1-1 along axis 1, keys j0..j1-1 along
axis 0) such a node takes one value per diagonal: its ``ni + nj - 1`` values come from
one evaluation on the 1-D range of ``u = q_idx - kv_idx``, and a Toeplitz view of them
(no copy) stands for the tile.  ALiBi's ``slopes[h] * abs(q_idx - kv_idx)``, a relative
position table ``table[h, q_idx - kv_idx + c]``, a dilated mask's ``(q_idx - kv_idx) % 3
== 0`` are such nodes.

A node is *diagonal* (:func:`diagonal_nodes`) when the substitution ``q_idx = u``,
``kv_idx = 0`` gives its value exactly:

* an integer affine form ``a·q_idx + b·kv_idx + c`` with ``a = -b != 0`` (``+``, ``-``,
  unary minus, products with constants);
* a comparison of two affine forms whose difference is one (comparisons are invariant
  under the shift by ``kv_idx``);
* any other operation (a gather included) whose arguments are diagonal or constant
  (``b``, ``h``, constants and what depends on nothing else), one diagonal at least.

Integer arithmetic of the 1-D evaluation is int64 (``u`` reaches ``-(Sk - 1)``, below
the query range the index analysis saw); the values are the same integers.
"""
from __future__ import annotations

from typing import Dict, Optional, Sequence, Set, Tuple

import numpy as np

from .graph import INT, Node

__all__ = ["affine_form", "diagonal_nodes", "diagonal_values"]

_CMP = ("lt", "le", "gt", "ge", "eq", "ne")
Affine = Tuple[int, int, int]


def affine_form(n: Node, memo: Optional[Dict[int, Optional[Affine]]] = None
                ) -> Optional[Affine]:
    """``n`` as a·q_idx + b·kv_idx + c with integer (a, b, c), or None (``memo``: results
    by node uid, shared across calls over one graph)."""
    if memo is None:
        memo = {}
    if n.uid in memo:
        return memo[n.uid]
    r: Optional[Affine] = None
    if n.dtype == INT:
        if n.op == "input":
            r = {"q_idx": (1, 0, 0), "kv_idx": (0, 1, 0)}.get(n.attr)
        elif n.op == "const":
            r = (0, 0, int(n.attr))
        elif n.op in ("add", "sub"):
            x, y = affine_form(n.args[0], memo), affine_form(n.args[1], memo)
            if x is not None and y is not None:
                s = 1 if n.op == "add" else -1
                r = (x[0] + s * y[0], x[1] + s * y[1], x[2] + s * y[2])
        elif n.op == "neg":
            x = affine_form(n.args[0], memo)
            r = None if x is None else (-x[0], -x[1], -x[2])
        elif n.op == "mul":
            x, y = affine_form(n.args[0], memo), affine_form(n.args[1], memo)
            if x is not None and y is not None:
                if x[:2] == (0, 0):
                    x, y = y, x
                if y[:2] == (0, 0):
                    r = (y[2] * x[0], y[2] * x[1], y[2] * x[2])
    memo[n.uid] = r
    return r


def _diagonal_form(f: Optional[Affine]) -> bool:
    return f is not None and f[0] == -f[1] and f[0] != 0


def diagonal_nodes(order: Sequence[Node]) -> Set[int]:
    """The uids of the diagonal nodes of ``order`` (arguments first, see
    :func:`~anyattn.programs.graph.ordered`)."""
    aff: Dict[int, Optional[Affine]] = {}
    const: Set[int] = set()
    diag: Set[int] = set()
    for n in order:
        if n.op == "input":
            if n.attr in ("b", "h"):
                const.add(n.uid)
            continue
        if n.op == "const":
            const.add(n.uid)
            continue
        f = affine_form(n, aff)
        if f is not None:
            if _diagonal_form(f):
                diag.add(n.uid)
            elif f[:2] == (0, 0):
                const.add(n.uid)
            continue
        if n.op in _CMP:
            x, y = (affine_form(a, aff) for a in n.args)
            if x is not None and y is not None and _diagonal_form(
                    (x[0] - y[0], x[1] - y[1], x[2] - y[2])):
                diag.add(n.uid)
                continue
        ids = [a.uid for a in n.args]
        if ids and all(u in const or u in diag for u in ids):
            (diag if any(u in diag for u in ids) else const).add(n.uid)
    return diag


def diagonal_values(nodes: Sequence[Node], b, h, caps: Dict[str, np.ndarray],
                    dt: np.dtype, i0: int, i1: int, j0: int, j1: int,
                    order: Optional[Sequence[Node]] = None) -> Dict[int, np.ndarray]:
    """{uid: [nj, ni] read-only Toeplitz view} of the diagonal ``nodes`` on the
    transposed tile of queries i0..i1-1 and keys j0..j1-1: one evaluation on
    ``u = q_idx - kv_idx`` from ``i0 - (j1 - 1)`` to ``i1 - 1 - j0``.  ``order``:
    ``ordered(nodes)`` if the caller keeps it."""
    from .evaluate import evaluate                      # evaluate imports this module

    ni, nj = i1 - i0, j1 - j0
    env = {"b": np.int64(b), "h": np.int64(h), "kv_idx": np.int64(0),
           "q_idx": np.arange(i0 - j1 + 1, i1 - j0, dtype=np.int64)}
    vals = evaluate(list(nodes), env, caps, dt, order=order, idt=np.dtype(np.int64))
    out = {}
    for n, f in zip(nodes, vals):
        f = np.ascontiguousarray(f)                     # [ni + nj - 1]
        s = f.strides[0]
        # [jj, ii] = f[ii + nj - 1 - jj]: u = (i0 + ii) - (j0 + jj)
        v = np.ndarray((nj, ni), f.dtype, buffer=f, offset=(nj - 1) * s, strides=(-s, s))
        v.flags.writeable = False
        out[n.uid] = v
    return out
