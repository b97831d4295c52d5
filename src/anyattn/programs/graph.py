"""The expression graph of a traced score or mask function.

A graph is a set of immutable :class:`Node` objects built by one :class:`Builder`,
which hash-conses them: two nodes with the same operation, attribute and arguments
are one node, so a common subexpression is computed once.  Node ids grow in creation
order, which is a topological order (arguments before users).

Every node has a dtype class: ``"f"`` (float: the compute dtype, float32 or float64),
``"i"`` (integer: int64) or ``"b"`` (bool).  Leaves are the inputs (``score`` float;
``b``, ``h``, ``q_idx``, ``kv_idx`` integer), constants and whole captures of rank 0;
``gather`` reads a capture at integer index expressions, one per axis.

:func:`structural_key` is the graph's identity for caches: the same function traced
twice (or two functions spelling the same expression) give the same key.
"""
from __future__ import annotations

import hashlib
from typing import Dict, Iterable, List, Sequence, Tuple

__all__ = ["Node", "Builder", "INPUTS", "INDEX_INPUTS", "FLOAT", "INT", "BOOL",
           "structural_key", "render", "ordered"]

FLOAT, INT, BOOL = "f", "i", "b"
#: the index inputs of every function, in signature order
INDEX_INPUTS = ("b", "h", "q_idx", "kv_idx")
INPUTS = ("score",) + INDEX_INPUTS

#: operations by arity; the tracer and the helpers of anyattn.math build only these
UNARY = ("neg", "abs", "not", "invert", "exp", "exp2", "log", "log2", "log1p", "expm1",
         "tanh", "sqrt", "square", "sin", "cos", "floor", "ceil", "sign", "tofloat", "toint",
         "trunc_int")
BINARY = ("add", "sub", "mul", "div", "floordiv", "mod", "pow", "lt", "le", "gt", "ge",
          "eq", "ne", "and", "or", "xor", "bitand", "bitor", "bitxor", "minimum",
          "maximum")
TERNARY = ("where",)
LEAVES = ("input", "const", "gather")


class Node:
    """One operation of a graph.  ``op``: its name; ``dtype``: ``"f"``, ``"i"`` or
    ``"b"``; ``args``: argument nodes; ``attr``: the input's name (``input``), the value
    (``const``), the capture's name (``gather``; its index nodes are ``args``) or None.
    Built only through :class:`Builder`; compare by identity."""

    __slots__ = ("op", "dtype", "args", "attr", "uid", "__weakref__")

    def __init__(self, op: str, dtype: str, args: Tuple["Node", ...], attr, uid: int):
        self.op, self.dtype, self.args, self.attr, self.uid = op, dtype, args, attr, uid

    def __repr__(self) -> str:
        return f"<Node {render(self)} : {self.dtype}>"


class Builder:
    """Creates hash-consed nodes; one per traced graph (and its derivatives)."""

    def __init__(self):
        self._nodes: Dict[tuple, Node] = {}
        self._count = 0

    def node(self, op: str, dtype: str, args: Sequence[Node] = (), attr=None) -> Node:
        key = (op, dtype, tuple(a.uid for a in args), _attr_key(attr))
        n = self._nodes.get(key)
        if n is None:
            n = Node(op, dtype, tuple(args), attr, self._count)
            self._count += 1
            self._nodes[key] = n
        return n

    def const(self, value, dtype: str) -> Node:
        if dtype == FLOAT:
            value = float(value)
        elif dtype == INT:
            value = int(value)
        else:
            value = bool(value)
        return self.node("const", dtype, (), value)

    def input(self, name: str) -> Node:
        return self.node("input", FLOAT if name == "score" else INT, (), name)


def _attr_key(attr):
    if isinstance(attr, float):
        return ("float", attr.hex())   # -0.0 apart from 0.0, NaN equal to itself
    return (type(attr).__name__, attr)


def ordered(outputs: Iterable[Node]) -> List[Node]:
    """Every node the outputs depend on, arguments first (by uid)."""
    seen: Dict[int, Node] = {}
    stack = list(outputs)
    while stack:
        n = stack.pop()
        if n.uid in seen:
            continue
        seen[n.uid] = n
        stack.extend(n.args)
    return [seen[u] for u in sorted(seen)]


def structural_key(outputs: Sequence[Node], extra=()) -> str:
    """A digest of the expressions ``outputs`` compute (not of how they were built):
    nodes numbered in dependency order, each written as its operation, dtype, attribute
    and argument numbers.  ``extra``: more hashable facts (capture shapes, dtypes)."""
    order = ordered(outputs)
    num = {n.uid: i for i, n in enumerate(order)}
    parts = [f"{n.op}:{n.dtype}:{_attr_key(n.attr)!r}:{[num[a.uid] for a in n.args]}"
             for n in order]
    parts.append(f"out:{[num[o.uid] for o in outputs]}")
    parts.append(repr(tuple(extra)))
    return hashlib.blake2b("\n".join(parts).encode(), digest_size=16).hexdigest()


_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/", "floordiv": "//", "mod": "%",
          "pow": "**", "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==",
          "ne": "!=", "and": "&", "or": "|", "xor": "^", "bitand": "&", "bitor": "|",
          "bitxor": "^"}


def render(n: Node, depth: int = 0) -> str:
    """A Python-like text of the expression (for error messages)."""
    if depth > 12:
        return "..."
    if n.op == "input":
        return n.attr
    if n.op == "const":
        return repr(n.attr)
    if n.op == "gather":
        return f"{n.attr}[{', '.join(render(a, depth + 1) for a in n.args)}]"
    if n.op in _INFIX:
        a, b = (render(x, depth + 1) for x in n.args)
        return f"({a} {_INFIX[n.op]} {b})"
    if n.op == "neg":
        return f"-{render(n.args[0], depth + 1)}"
    if n.op in ("not", "invert"):
        return f"~{render(n.args[0], depth + 1)}"
    return f"{n.op}({', '.join(render(a, depth + 1) for a in n.args)})"
