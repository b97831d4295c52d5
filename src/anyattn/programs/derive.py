"""Symbolic reverse-mode differentiation of a score function's graph.

:func:`derivatives` returns, as nodes of the same graph, d out / d score and
d out / d g for every float ``gather`` node g of the captures asked for; the backward
multiplies them by dS (the gradient of the loss with respect to the modified score)
and scatter-adds the latter into the captures' shapes.  Integer and bool nodes carry
no gradient; ``floor``, ``ceil``, ``sign`` and comparisons have derivative 0, ``where``
/ ``minimum`` / ``maximum`` route the gradient to the branch they chose (ties to the
first argument), ``abs`` uses sign(x) (0 at 0).
"""
from __future__ import annotations

from typing import Dict, Iterable, List, Tuple

from . import ops
from .graph import FLOAT, Builder, Node, ordered

__all__ = ["derivatives"]

_LN2 = 0.6931471805599453


class _D:
    """Node constructors that fold constants 0 and 1 (derivative graphs only: the
    user's own expression keeps IEEE semantics)."""

    def __init__(self, bld: Builder):
        self.bld = bld
        self.zero, self.one = bld.const(0.0, FLOAT), bld.const(1.0, FLOAT)

    def c(self, v: float) -> Node:
        return self.bld.const(v, FLOAT)

    def add(self, a: Node, b: Node) -> Node:
        if a is self.zero:
            return b
        if b is self.zero:
            return a
        return self.bld.node("add", FLOAT, (a, b))

    def mul(self, a: Node, b: Node) -> Node:
        if a is self.zero or b is self.zero:
            return self.zero
        if a is self.one:
            return b
        if b is self.one:
            return a
        return self.bld.node("mul", FLOAT, (a, b))

    def div(self, a: Node, b: Node) -> Node:
        if a is self.zero:
            return self.zero
        return self.bld.node("div", FLOAT, (a, b))

    def neg(self, a: Node) -> Node:
        if a is self.zero:
            return a
        if a.op == "const":
            return self.c(-a.attr)
        return self.bld.node("neg", FLOAT, (a,))

    def sub(self, a: Node, b: Node) -> Node:
        return self.add(a, self.neg(b))

    def un(self, op: str, a: Node) -> Node:
        return ops.unary(self.bld, op, a)

    def where(self, c: Node, x: Node, y: Node) -> Node:
        if x is self.zero and y is self.zero:
            return self.zero
        return self.bld.node("where", FLOAT, (c, x, y))


def derivatives(out: Node, bld: Builder, leaves: Iterable[Node]
                ) -> Dict[int, Node]:
    """{uid of leaf: d out / d leaf} for the float ``leaves`` (the score input, gather
    nodes); a leaf ``out`` does not depend on gets the constant 0."""
    d = _D(bld)
    leaves = list(leaves)
    order = ordered([out])
    leaf_ids = {n.uid for n in leaves}
    active = set()
    for n in order:
        if n.dtype != FLOAT:
            continue
        if n.uid in leaf_ids or any(a.uid in active for a in n.args):
            active.add(n.uid)
    adj: Dict[int, Node] = {}
    if out.uid in active:
        adj[out.uid] = d.one

    def acc(a: Node, g: Node) -> None:
        if a.uid in active and g is not d.zero:
            adj[a.uid] = d.add(adj.get(a.uid, d.zero), g)

    for n in reversed(order):
        g = adj.get(n.uid)
        if g is None or n.uid in leaf_ids or g is d.zero:
            continue
        op, a = n.op, n.args
        if op == "add":
            acc(a[0], g), acc(a[1], g)
        elif op == "sub":
            acc(a[0], g), acc(a[1], d.neg(g))
        elif op == "mul":
            acc(a[0], d.mul(g, a[1])), acc(a[1], d.mul(g, a[0]))
        elif op == "div":
            acc(a[0], d.div(g, a[1]))
            if a[1].uid in active:
                acc(a[1], d.neg(d.div(d.mul(g, n), a[1])))
        elif op == "pow":
            if a[0].uid in active:
                em1 = bld.node("pow", FLOAT, (a[0], d.sub(a[1], d.one)))
                acc(a[0], d.mul(g, d.mul(a[1], em1)))
            if a[1].uid in active:
                acc(a[1], d.mul(g, d.mul(n, d.un("log", a[0]))))
        elif op == "neg":
            acc(a[0], d.neg(g))
        elif op == "abs":
            acc(a[0], d.mul(g, d.un("sign", a[0])))
        elif op == "where":
            acc(a[1], d.where(a[0], g, d.zero)), acc(a[2], d.where(a[0], d.zero, g))
        elif op in ("minimum", "maximum"):
            first = bld.node("le" if op == "minimum" else "ge", "b", (a[0], a[1]))
            acc(a[0], d.where(first, g, d.zero)), acc(a[1], d.where(first, d.zero, g))
        elif op == "exp":
            acc(a[0], d.mul(g, n))
        elif op == "exp2":
            acc(a[0], d.mul(g, d.mul(n, d.c(_LN2))))
        elif op == "log":
            acc(a[0], d.div(g, a[0]))
        elif op == "log2":
            acc(a[0], d.div(g, d.mul(a[0], d.c(_LN2))))
        elif op == "log1p":
            acc(a[0], d.div(g, d.add(d.one, a[0])))
        elif op == "expm1":
            acc(a[0], d.mul(g, d.add(n, d.one)))
        elif op == "tanh":
            acc(a[0], d.mul(g, d.sub(d.one, d.mul(n, n))))
        elif op == "sqrt":
            acc(a[0], d.div(d.mul(g, d.c(0.5)), n))
        elif op == "square":
            acc(a[0], d.mul(g, d.mul(d.c(2.0), a[0])))
        elif op == "sin":
            acc(a[0], d.mul(g, d.un("cos", a[0])))
        elif op == "cos":
            acc(a[0], d.neg(d.mul(g, d.un("sin", a[0]))))
        # floor, ceil, sign: derivative 0; tofloat: from integers, no gradient
    return {u: adj.get(u, d.zero) for u in leaf_ids}
