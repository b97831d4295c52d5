"""Math helpers for score and mask functions (``anyattn.ScoreMod`` / ``MaskMod``).

Each takes traced values (inside a traced function) or plain numbers and NumPy arrays
(anywhere else, computed with NumPy), so one function serves both.  Inside a traced
function NumPy's ufuncs (``np.tanh``, ``np.minimum``, ...) and ``np.where`` /
``np.clip`` work too; these names also cover what Python's ``math`` module cannot
take (it converts its argument to a float, which a traced value refuses).
"""
from __future__ import annotations

import numpy as np

from .programs import ops
from .programs.trace import Sym, clamp_sym, lift

__all__ = ["where", "exp", "exp2", "log", "log2", "log1p", "expm1", "tanh", "sqrt",
           "square", "sin", "cos", "minimum", "maximum", "clamp", "floor", "ceil", "sign",
           "abs", "to_int"]


def _sym_of(*args):
    for a in args:
        if isinstance(a, Sym):
            return a
    return None


def _unary(name: str, np_fn):
    def f(x):
        s = _sym_of(x)
        if s is None:
            return np_fn(x)
        try:
            return Sym(ops.unary(s.ctx.bld, name, s.node), s.ctx)
        except ops.OpError as e:
            s.ctx.fail(TypeError, f"anyattn.math.{f.__name__}: {e}")
    f.__name__ = f.__qualname__ = name if name != "abs" else "abs"
    f.__doc__ = f"Elementwise {name} of a traced value or a NumPy array / number."
    return f


exp = _unary("exp", np.exp)
exp2 = _unary("exp2", np.exp2)
log = _unary("log", np.log)
log2 = _unary("log2", np.log2)
log1p = _unary("log1p", np.log1p)
expm1 = _unary("expm1", np.expm1)
tanh = _unary("tanh", np.tanh)
sqrt = _unary("sqrt", np.sqrt)
square = _unary("square", np.square)
sin = _unary("sin", np.sin)
cos = _unary("cos", np.cos)
floor = _unary("floor", np.floor)
ceil = _unary("ceil", np.ceil)
sign = _unary("sign", np.sign)
abs = _unary("abs", np.abs)  # noqa: A001 - the name users expect


def _binary(name: str, np_fn):
    def f(x, y):
        s = _sym_of(x, y)
        if s is None:
            return np_fn(x, y)
        return Sym(ops.binary(s.ctx.bld, name, lift(x, s.ctx), lift(y, s.ctx)), s.ctx)
    f.__name__ = f.__qualname__ = name
    f.__doc__ = f"Elementwise {name} of traced values or NumPy arrays / numbers."
    return f


minimum = _binary("minimum", np.minimum)
maximum = _binary("maximum", np.maximum)


def to_int(x):
    """``x`` as an integer, truncated toward zero like ``int()`` (and torch's ``.long()``):
    for computed indices such as T5's log buckets; clamp the result before indexing a
    capture (a float has no bound the index check could use)."""
    s = _sym_of(x)
    if s is None:
        return np.trunc(x).astype(np.int64)
    return Sym(ops.unary(s.ctx.bld, "trunc_int", s.node), s.ctx)


def where(cond, x, y):
    """``x`` where ``cond`` holds, else ``y`` (``cond`` a bool expression or array)."""
    s = _sym_of(cond, x, y)
    if s is None:
        return np.where(cond, x, y)
    try:
        return Sym(ops.where(s.ctx.bld, lift(cond, s.ctx), lift(x, s.ctx), lift(y, s.ctx)),
                   s.ctx)
    except ops.OpError as e:
        s.ctx.fail(TypeError, f"anyattn.math.where: {e}")


def clamp(x, lo=None, hi=None):
    """``x`` limited to [lo, hi] (either bound None: open), ``minimum(maximum(x, lo), hi)``;
    an integer index clamped to [0, n - 1] never leaves its capture."""
    s = _sym_of(x, lo, hi)
    if s is None:
        return np.clip(x, lo, hi)
    return clamp_sym(s.ctx, x, lo, hi)
