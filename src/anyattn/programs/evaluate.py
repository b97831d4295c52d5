"""Evaluate graph nodes with NumPy on index grids (vectorised, any broadcast shape).

``env`` holds the inputs (``score`` float array in the compute dtype; ``b``, ``h``,
``q_idx``, ``kv_idx`` int64 arrays or scalars, broadcastable to each other) and the
captures by name (float captures already in the compute dtype, integer ones int64).
Float nodes compute in the compute dtype ``dt``, integer ones in int64, bools as bool.
"""
from __future__ import annotations

from typing import Dict, List, Sequence

import numpy as np

from .graph import BOOL, FLOAT, Node, ordered

__all__ = ["evaluate", "cast_captures", "use_counts"]

_LN2 = 0.6931471805599453

_UNARY = {"neg": np.negative, "abs": np.abs, "not": np.logical_not, "invert": np.invert,
          "exp": np.exp, "exp2": np.exp2, "log": np.log, "log2": np.log2,
          "log1p": np.log1p, "expm1": np.expm1, "tanh": np.tanh, "sqrt": np.sqrt,
          "square": np.square, "sin": np.sin, "cos": np.cos, "floor": np.floor,
          "ceil": np.ceil, "sign": np.sign}
_BINARY = {"add": np.add, "sub": np.subtract, "mul": np.multiply, "div": np.true_divide,
           "floordiv": np.floor_divide, "mod": np.remainder, "pow": np.power,
           "lt": np.less, "le": np.less_equal, "gt": np.greater, "ge": np.greater_equal,
           "eq": np.equal, "ne": np.not_equal, "and": np.logical_and, "or": np.logical_or,
           "xor": np.logical_xor, "bitand": np.bitwise_and, "bitor": np.bitwise_or,
           "bitxor": np.bitwise_xor, "minimum": np.minimum, "maximum": np.maximum}


def cast_captures(arrays: Dict[str, np.ndarray], specs, dt: np.dtype,
                  idt: np.dtype = np.dtype(np.int64)) -> Dict[str, np.ndarray]:
    """Captures as the evaluator reads them: float -> ``dt``, integer -> ``idt``
    (int64, or int32 where the index analysis proved their values fit), bool."""
    want = {FLOAT: dt, BOOL: np.dtype(bool)}
    out = {}
    for name, arr in arrays.items():
        t = want.get(specs[name].dtype, np.dtype(idt))
        out[name] = arr if arr.dtype == t else arr.astype(t)
    return out


def _gather(c: np.ndarray, idx: list):
    """c[idx...] (one index per axis, broadcast); where all but one index are scalars,
    those select a view and np.take reads the rest (faster than fancy indexing)."""
    if not idx:
        return c[()]
    arrays = [ax for ax, i in enumerate(idx) if np.ndim(i) > 0]
    if len(arrays) == 1:
        ax = arrays[0]
        view = c[tuple(slice(None) if a == ax else i for a, i in enumerate(idx))]
        i = idx[ax]
        return np.take(view, i if i.dtype == np.intp else i.astype(np.intp))
    return c[tuple(idx)]


def use_counts(order: Sequence[Node]) -> Dict[int, int]:
    """How many argument slots of the nodes ``order`` read each node (for
    :func:`evaluate`'s in-place reuse)."""
    c: Dict[int, int] = {}
    for n in order:
        for a in n.args:
            c[a.uid] = c.get(a.uid, 0) + 1
    return c


def evaluate(outputs: Sequence[Node], env: Dict[str, object], caps: Dict[str, np.ndarray],
             dt: np.dtype, memo: Dict[int, object] = None,
             order: Sequence[Node] = None, uses: Dict[int, int] = None,
             reuse: Sequence[str] = (), idt: np.dtype = np.dtype(np.int64)) -> List[object]:
    """The values of ``outputs`` (arrays or scalars, broadcast as their inputs are).

    ``order``: ``ordered(outputs)`` if the caller keeps it (per-tile callers do).
    ``uses`` (``use_counts(order)``): float elementwise operations then write into an
    argument's array where that argument is a temporary of this evaluation read for the
    last time (same shape and dtype), never into an output or an input, except the inputs
    named in ``reuse`` (the caller gives those up).  ``idt``: the integer dtype of the
    index inputs and captures (int32 only where no integer node can leave it); integer
    constants stay Python ints, which take the dtype of the array they meet."""
    val: Dict[int, object] = {} if memo is None else memo
    f = dt.type
    inplace = uses is not None
    if inplace:
        left = dict(uses)
        order = ordered(outputs) if order is None else order
        # outputs, and gather indices (callers read those back to scatter gradients)
        keep = {o.uid for o in outputs} | {a.uid for n in order if n.op == "gather"
                                           for a in n.args}
        owned = set()
    for n in (ordered(outputs) if order is None else order):
        if n.uid in val:
            continue
        op = n.op
        fresh = True                                 # r is an array made here
        if op == "input":
            r = env[n.attr]
            fresh = n.attr in reuse
        elif op == "const":
            r = f(n.attr) if n.dtype == FLOAT else (np.bool_(n.attr) if n.dtype == BOOL
                                                    else int(n.attr))
        elif op == "gather":
            r = _gather(caps[n.attr], [val[a.uid] for a in n.args])
        elif op == "tofloat":
            r = np.asarray(val[n.args[0].uid]).astype(dt)
        elif op == "toint":
            r = np.asarray(val[n.args[0].uid]).astype(idt)
        elif op == "trunc_int":                   # NaN / inf: unspecified, clamp after
            with np.errstate(invalid="ignore"):
                r = np.trunc(val[n.args[0].uid]).astype(np.int64)
        elif op == "where":
            c, x, y = (val[a.uid] for a in n.args)
            r = np.where(c, x, y)
        else:
            fn = _UNARY[op] if op in _UNARY else _BINARY[op]
            args = [val[a.uid] for a in n.args]
            out = None
            want = dt if n.dtype == FLOAT else idt
            if inplace and n.dtype != BOOL and all(
                    not isinstance(x, np.ndarray) or x.dtype == want for x in args):
                shape = None
                for a, x in zip(n.args, args):
                    if (a.uid in owned and left.get(a.uid) == 1 and a.uid not in keep
                            and isinstance(x, np.ndarray)):
                        if shape is None:
                            shape = np.broadcast_shapes(*(np.shape(y) for y in args))
                        if x.shape == shape:
                            out = x
                            break
            r = fn(*args) if out is None else fn(*args, out=out)
        if n.dtype == FLOAT and getattr(r, "dtype", dt) != dt:
            r = np.asarray(r).astype(dt)         # a 0-d result NumPy widened
        val[n.uid] = r
        if inplace:
            for a in n.args:
                left[a.uid] -= 1
            if fresh and isinstance(r, np.ndarray):
                owned.add(n.uid)
    return [val[o.uid] for o in outputs]
