"""Typed node constructors: the dtype rules of traced expressions, in one place.

Python's rules, with NumPy's names: arithmetic on a float is float, on integers and
bools integer (``True + 1 == 2``); ``/`` is float; ``//`` and ``%`` floor as in Python;
comparisons give bools; ``&``, ``|``, ``^``, ``~`` are logical on bools and bitwise on
integers (a float operand is refused).  Arguments are cast explicitly (``tofloat``,
``toint``) so that evaluation never depends on NumPy's promotion rules.
"""
from __future__ import annotations

from .graph import BOOL, FLOAT, INT, Builder, Node

__all__ = ["OpError", "unary", "binary", "where", "to_float", "to_int", "to_bool",
           "MATH_UNARY"]

#: unary float functions (the argument is cast to float)
MATH_UNARY = ("exp", "exp2", "log", "log2", "log1p", "expm1", "tanh", "sqrt", "square",
              "sin", "cos")


class OpError(TypeError):
    """An operation the dtype rules refuse (the tracer adds the function's name)."""


def to_float(bld: Builder, a: Node) -> Node:
    if a.dtype == FLOAT:
        return a
    if a.op == "const":
        return bld.const(float(a.attr), FLOAT)
    return bld.node("tofloat", FLOAT, (a,))


def to_int(bld: Builder, a: Node) -> Node:
    if a.dtype == INT:
        return a
    if a.dtype == FLOAT:
        raise OpError("a float expression where an integer is needed")
    if a.op == "const":
        return bld.const(int(a.attr), INT)
    return bld.node("toint", INT, (a,))


def to_bool(bld: Builder, a: Node) -> Node:
    """Truth of a value as NumPy's logical functions take it (x != 0)."""
    if a.dtype == BOOL:
        return a
    return bld.node("ne", BOOL, (a, bld.const(0, a.dtype)))


def _promote(bld: Builder, a: Node, b: Node):
    if FLOAT in (a.dtype, b.dtype):
        return FLOAT, to_float(bld, a), to_float(bld, b)
    return INT, to_int(bld, a), to_int(bld, b)


def unary(bld: Builder, op: str, a: Node) -> Node:
    if op in MATH_UNARY:
        return bld.node(op, FLOAT, (to_float(bld, a),))
    if op in ("neg", "abs", "sign"):
        a = a if a.dtype != BOOL else to_int(bld, a)
        return bld.node(op, a.dtype, (a,))
    if op in ("floor", "ceil"):
        if a.dtype != FLOAT:
            return to_int(bld, a)                 # integers are their own floor
        return bld.node(op, FLOAT, (a,))
    if op == "invert":
        if a.dtype == BOOL:
            return bld.node("not", BOOL, (a,))
        if a.dtype == FLOAT:
            raise OpError("~ (invert) of a float expression; ~ takes bools or integers")
        return bld.node("invert", INT, (a,))
    if op == "not":
        return bld.node("not", BOOL, (to_bool(bld, a),))
    if op == "trunc_int":                             # int(x): toward zero
        if a.dtype != FLOAT:
            return to_int(bld, a)
        return bld.node("trunc_int", INT, (a,))
    raise OpError(f"unknown unary operation {op!r}")  # pragma: no cover - internal


_COMPARE = ("lt", "le", "gt", "ge", "eq", "ne")


def binary(bld: Builder, op: str, a: Node, b: Node) -> Node:
    if op in ("add", "sub", "mul", "floordiv", "mod", "minimum", "maximum"):
        dt, a, b = _promote(bld, a, b)
        return bld.node(op, dt, (a, b))
    if op == "div":
        return bld.node("div", FLOAT, (to_float(bld, a), to_float(bld, b)))
    if op == "pow":
        if FLOAT not in (a.dtype, b.dtype) and b.op == "const" and int(b.attr) >= 0:
            return bld.node("pow", INT, (to_int(bld, a), to_int(bld, b)))
        return bld.node("pow", FLOAT, (to_float(bld, a), to_float(bld, b)))
    if op in _COMPARE:
        if a.dtype == BOOL and b.dtype == BOOL and op in ("eq", "ne"):
            return bld.node(op, BOOL, (a, b))
        _, a, b = _promote(bld, a, b)
        return bld.node(op, BOOL, (a, b))
    if op in ("and", "or", "xor"):
        if FLOAT in (a.dtype, b.dtype):
            sym = {"and": "&", "or": "|", "xor": "^"}[op]
            raise OpError(f"{sym} of a float expression; {sym} takes bools (logical) or "
                          "integers (bitwise)")
        if a.dtype == BOOL and b.dtype == BOOL:
            return bld.node(op, BOOL, (a, b))
        return bld.node("bit" + op, INT, (to_int(bld, a), to_int(bld, b)))
    if op in ("logical_and", "logical_or", "logical_xor"):
        return bld.node(op.split("_")[1], BOOL, (to_bool(bld, a), to_bool(bld, b)))
    raise OpError(f"unknown binary operation {op!r}")  # pragma: no cover - internal


def where(bld: Builder, c: Node, x: Node, y: Node) -> Node:
    if c.dtype != BOOL:
        raise OpError("where(cond, x, y): cond must be a bool expression (a comparison "
                      "or & | ~ of comparisons)")
    dt, x, y = _promote(bld, x, y) if BOOL not in (x.dtype, y.dtype) or \
        x.dtype != y.dtype else (BOOL, x, y)
    return bld.node("where", dt, (c, x, y))
