"""Tracing: call a user's score or mask function on symbolic values, record a graph.

``score_mod(score, b, h, q_idx, kv_idx, *captures) -> score`` and
``mask_mod(b, h, q_idx, kv_idx, *captures) -> bool`` (FlexAttention's signatures) are
called once with :class:`Sym` arguments; every operation on them (Python operators,
``abs``, ``anyattn.math`` helpers, NumPy ufuncs, ``np.where`` / ``np.clip``, indexing a
capture) adds a node to the graph instead of computing.  What cannot be traced is
refused with a message naming the function and the construct: Python control flow on
a traced value (``if``, ``while``, ``and`` / ``or``, ``bool()``, ``min()`` / ``max()``),
conversion to a Python number, an unknown call, a float index, a wrong return value.

Captures are arrays the function reads: parameters after the indices (bound by name,
``ScoreMod(fn, table=t)``), parameters whose default is an array, and arrays the
function closes over or reads as a global (the function is rebuilt with those replaced
by :class:`CaptureProxy` objects, each named after its variable).  Python functions it
closes over (helpers built by a factory, e.g. ``and_masks(f, g)``-style wrappers calling
``f``) are rebuilt the same way, recursively: their arrays become captures too, named
after their variable (``_1``, ``_2``, ... appended where a name is taken; one array
reached twice is one capture).
"""
from __future__ import annotations

import inspect
import numbers
import types
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import numpy as np

from ..arrays import array_kind
from . import ops
from .graph import BOOL, FLOAT, INDEX_INPUTS, INT, Builder, Node

__all__ = ["Sym", "CaptureProxy", "CaptureSpec", "Traced", "trace", "capture_spec",
           "TRACING_ERRORS", "TraceError", "clamp_sym", "lift", "new_context", "index_syms",
           "call_traced", "proxy_of", "fn_name", "check_result"]

#: the kinds of function, their index arguments and what they must return
KINDS = {"score_mod": (("score",) + INDEX_INPUTS, FLOAT),
         "mask_mod": (INDEX_INPUTS, BOOL)}


@dataclass(frozen=True)
class CaptureSpec:
    """What a trace knows of a capture: its shape and dtype class (``"f"``, ``"i"``,
    ``"b"``), never its values."""

    name: str
    shape: Tuple[int, ...]
    dtype: str


class TraceError(TypeError):
    """A construct the tracer refuses; the message names the function."""


class _Context:
    def __init__(self, kind: str, fname: str, bld: Builder):
        self.kind, self.fname, self.bld = kind, fname, bld

    def where_(self) -> str:
        return f"{self.kind} {self.fname!r}"

    def fail(self, exc, msg: str):
        raise (TraceError if exc is TypeError else exc)(f"{self.where_()}: {msg}")


_CONTROL = ("data-dependent Python control flow on a traced value (if / while / and / or "
            "/ not / bool() / min() / max() / a comparison chain a < b < c); the function "
            "runs once on symbols, so use anyattn.math.where(cond, x, y), "
            "anyattn.math.minimum / maximum and & | ~ instead")


class Sym:
    """A traced value: one node of the graph being built."""

    __slots__ = ("node", "ctx")
    #: NumPy hands ufuncs and array functions on a Sym to the methods below
    __array_priority__ = 1000

    def __init__(self, node: Node, ctx: _Context):
        self.node, self.ctx = node, ctx

    # --------------------------------------------------------------- helpers
    def _lift(self, x) -> Node:
        return lift(x, self.ctx)

    def _bin(self, op: str, other, reflected: bool = False) -> "Sym":
        a, b = self.node, self._lift(other)
        if reflected:
            a, b = b, a
        try:
            return Sym(ops.binary(self.ctx.bld, op, a, b), self.ctx)
        except ops.OpError as e:
            self.ctx.fail(TypeError, str(e))

    def _un(self, op: str) -> "Sym":
        try:
            return Sym(ops.unary(self.ctx.bld, op, self.node), self.ctx)
        except ops.OpError as e:
            self.ctx.fail(TypeError, str(e))

    @property
    def dtype(self) -> str:
        """'f' (float), 'i' (integer) or 'b' (bool)."""
        return self.node.dtype

    # ------------------------------------------------------------- operators
    def __add__(self, o): return self._bin("add", o)
    def __radd__(self, o): return self._bin("add", o, True)
    def __sub__(self, o): return self._bin("sub", o)
    def __rsub__(self, o): return self._bin("sub", o, True)
    def __mul__(self, o): return self._bin("mul", o)
    def __rmul__(self, o): return self._bin("mul", o, True)
    def __truediv__(self, o): return self._bin("div", o)
    def __rtruediv__(self, o): return self._bin("div", o, True)
    def __floordiv__(self, o): return self._bin("floordiv", o)
    def __rfloordiv__(self, o): return self._bin("floordiv", o, True)
    def __mod__(self, o): return self._bin("mod", o)
    def __rmod__(self, o): return self._bin("mod", o, True)
    def __pow__(self, o): return self._bin("pow", o)
    def __rpow__(self, o): return self._bin("pow", o, True)
    def __lt__(self, o): return self._bin("lt", o)
    def __le__(self, o): return self._bin("le", o)
    def __gt__(self, o): return self._bin("gt", o)
    def __ge__(self, o): return self._bin("ge", o)
    def __eq__(self, o): return self._bin("eq", o)   # noqa: E704
    def __ne__(self, o): return self._bin("ne", o)
    def __and__(self, o): return self._bin("and", o)
    def __rand__(self, o): return self._bin("and", o, True)
    def __or__(self, o): return self._bin("or", o)
    def __ror__(self, o): return self._bin("or", o, True)
    def __xor__(self, o): return self._bin("xor", o)
    def __rxor__(self, o): return self._bin("xor", o, True)
    def __neg__(self): return self._un("neg")
    def __pos__(self): return self
    def __abs__(self): return self._un("abs")
    def __invert__(self): return self._un("invert")
    def __floor__(self): return self._un("floor")
    def __ceil__(self): return self._un("ceil")

    __hash__ = None  # type: ignore[assignment]  # == builds a node: not a dict key

    def __bool__(self):
        self.ctx.fail(TypeError, _CONTROL)

    def __float__(self):
        self.ctx.fail(TypeError, "float() of a traced value (or a math-module function "
                                 "such as math.exp, which converts its argument); use "
                                 "x * 1.0 to make a float, anyattn.math or NumPy functions")

    def __int__(self):
        self.ctx.fail(TypeError, "int() of a traced value; use x // 1 or "
                                 "anyattn.math.floor for rounding")

    def __index__(self):
        self.ctx.fail(TypeError, "a traced value used as an index of a Python object or "
                                 "an array that is not a capture; pass the array as a "
                                 "capture (ScoreMod(fn, name=array)) so the index is traced")

    def __iter__(self):
        self.ctx.fail(TypeError, "iteration over a traced value (it is one number per "
                                 "(b, h, q_idx, kv_idx), not an array)")

    def __len__(self):
        self.ctx.fail(TypeError, "len() of a traced value (it is one number per "
                                 "(b, h, q_idx, kv_idx), not an array)")

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        self.ctx.fail(TypeError, f"attribute .{name} of a traced value; only operators, "
                                 "anyattn.math helpers and NumPy ufuncs are traced")

    def __repr__(self) -> str:
        from .graph import render
        return f"Sym({render(self.node)})"

    # ----------------------------------------------------------------- NumPy
    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        return numpy_ufunc(self.ctx, ufunc, method, inputs, kwargs)

    def __array_function__(self, func, types_, args, kwargs):
        return numpy_function(self.ctx, func, args, kwargs)

    @classmethod
    def __torch_function__(cls, func, types_, args=(), kwargs=None):
        def syms(xs):
            for a in xs:
                if isinstance(a, Sym):
                    yield a
                elif isinstance(a, (tuple, list)):
                    yield from syms(a)
        ctx = next(syms(list(args) + list((kwargs or {}).values()))).ctx
        return torch_function(ctx, func, args, kwargs or {})

    def __array__(self, *a, **k):
        self.ctx.fail(TypeError, "a traced value converted to a NumPy array (np.asarray, "
                                 "or an operation with a non-capture array); pass arrays "
                                 "as captures and use operators, ufuncs or anyattn.math")


class CaptureProxy:
    """A captured array of rank >= 1 during tracing: index it on every axis with
    integer expressions (``table[h, q_idx - kv_idx + n]``); ``.shape`` and ``.ndim`` are
    the array's."""

    __array_priority__ = 1000

    def __init__(self, spec: CaptureSpec, ctx: _Context):
        self.spec, self.ctx = spec, ctx

    @property
    def shape(self) -> Tuple[int, ...]:
        return self.spec.shape

    @property
    def ndim(self) -> int:
        return len(self.spec.shape)

    def __getitem__(self, key):
        ctx, spec = self.ctx, self.spec
        key = key if isinstance(key, tuple) else (key,)
        if len(key) != len(spec.shape) or any(k is Ellipsis or k is None or
                                                isinstance(k, slice) for k in key):
            ctx.fail(TypeError, f"capture {spec.name!r} of shape {spec.shape} indexed with "
                                f"{len(key)} item(s); index all {len(spec.shape)} axes, each "
                                "with one integer expression (no slices, ..., None)")
        idx = []
        for ax, k in enumerate(key):
            if isinstance(k, CaptureProxy):
                ctx.fail(TypeError, f"capture {spec.name!r} axis {ax}: indexed by the "
                                    f"capture {k.spec.name!r} itself; index that one first")
            if isinstance(k, (bool, np.bool_)) or (isinstance(k, numbers.Real) and
                                                    not isinstance(k, numbers.Integral)):
                ctx.fail(TypeError, f"capture {spec.name!r} axis {ax}: float or bool index "
                                    f"{k!r}; indices are integer expressions")
            if isinstance(k, numbers.Integral):
                k = int(k) + (spec.shape[ax] if int(k) < 0 else 0)
            n = lift(k, ctx)
            if n.dtype == FLOAT:
                ctx.fail(TypeError, f"capture {spec.name!r} axis {ax}: float index "
                                    f"expression; indices must be integers (use // for "
                                    "integer division, anyattn.math.floor does not make ints)")
            idx.append(ops.to_int(ctx.bld, n))
        return Sym(ctx.bld.node("gather", spec.dtype, idx, spec.name), ctx)

    def _as_value(self, *a, **k):
        self.ctx.fail(TypeError, f"capture {self.spec.name!r} of shape {self.spec.shape} "
                                 "used as a value; index it, e.g. "
                                 f"{self.spec.name}[{', '.join(['h'] * self.ndim)}]")

    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = _as_value
    __truediv__ = __rtruediv__ = __pow__ = __rpow__ = __neg__ = __abs__ = _as_value
    __lt__ = __le__ = __gt__ = __ge__ = __and__ = __or__ = __invert__ = _as_value
    __bool__ = __float__ = __int__ = __index__ = __iter__ = __array__ = _as_value

    def __array_ufunc__(self, *a, **k):
        self._as_value()

    def __array_function__(self, *a, **k):
        self._as_value()


def lift(x, ctx: _Context) -> Node:
    """A traced value, capture of rank 0 or Python / NumPy scalar -> its node."""
    if isinstance(x, Sym):
        return x.node
    if isinstance(x, CaptureProxy):
        x._as_value()
    if isinstance(x, (bool, np.bool_)):
        return ctx.bld.const(bool(x), BOOL)
    if isinstance(x, numbers.Integral):
        return ctx.bld.const(int(x), INT)
    if isinstance(x, numbers.Real):
        return ctx.bld.const(float(x), FLOAT)
    if isinstance(x, np.ndarray) and x.ndim == 0:
        return lift(x.item(), ctx)
    if array_kind(x) is not None:
        ctx.fail(TypeError, f"an array of shape {tuple(x.shape)} that is not a capture "
                            "meets a traced value; pass it as a capture (ScoreMod(fn, "
                            "name=array) or a parameter / closure variable) and index it")
    ctx.fail(TypeError, f"a {type(x).__name__} meets a traced value; only numbers, "
                        "traced values and indexed captures can")


# ----------------------------------------------------------------- NumPy hooks
_UFUNC_UNARY = {"negative": "neg", "absolute": "abs", "fabs": "abs", "sign": "sign",
                "floor": "floor", "ceil": "ceil", "invert": "invert",
                "logical_not": "not", **{n: n for n in ops.MATH_UNARY}}
_UFUNC_BINARY = {"add": "add", "subtract": "sub", "multiply": "mul", "true_divide": "div",
                 "divide": "div", "floor_divide": "floordiv", "remainder": "mod",
                 "mod": "mod", "power": "pow", "float_power": "pow", "less": "lt",
                 "less_equal": "le", "greater": "gt", "greater_equal": "ge", "equal": "eq",
                 "not_equal": "ne", "bitwise_and": "and", "bitwise_or": "or",
                 "bitwise_xor": "xor", "logical_and": "logical_and",
                 "logical_or": "logical_or", "logical_xor": "logical_xor",
                 "minimum": "minimum", "maximum": "maximum", "fmin": "minimum",
                 "fmax": "maximum"}


def numpy_ufunc(ctx: _Context, ufunc, method, inputs, kwargs):
    name = getattr(ufunc, "__name__", str(ufunc))
    if method != "__call__" or kwargs:
        ctx.fail(TypeError, f"np.{name}.{method}(...)"
                 + (f" with {sorted(kwargs)}" if kwargs else "")
                 + " is not traced; call the ufunc on traced values without out= / where= "
                 "/ dtype= (reductions do not apply: a traced value is one number)")
    args = [lift(x, ctx) for x in inputs]
    try:
        if name == "positive" and len(args) == 1:
            return Sym(args[0], ctx)
        if name in _UFUNC_UNARY and len(args) == 1:
            return Sym(ops.unary(ctx.bld, _UFUNC_UNARY[name], args[0]), ctx)
        if name in _UFUNC_BINARY and len(args) == 2:
            return Sym(ops.binary(ctx.bld, _UFUNC_BINARY[name], *args), ctx)
    except ops.OpError as e:
        ctx.fail(TypeError, f"np.{name}: {e}")
    ctx.fail(TypeError, f"np.{name} is not supported in a traced function; supported "
                        f"ufuncs: {', '.join(sorted(set(_UFUNC_UNARY) | set(_UFUNC_BINARY)))}")


def numpy_function(ctx: _Context, func, args, kwargs):
    name = getattr(func, "__name__", str(func))
    if name == "where" and len(args) == 3 and not kwargs:
        return Sym(_where(ctx, *args), ctx)
    if name == "clip" and not kwargs and len(args) == 3:
        return clamp_sym(ctx, *args)
    ctx.fail(TypeError, f"np.{name} is not supported in a traced function; use np.where(c, "
                        "x, y), np.clip(x, lo, hi), NumPy ufuncs or anyattn.math")


_TORCH_UNARY = {"neg": "neg", "negative": "neg", "abs": "abs", "sign": "sign",
                "floor": "floor", "ceil": "ceil", "logical_not": "not",
                "bitwise_not": "invert", **{n: n for n in ops.MATH_UNARY}}
_TORCH_BINARY = {"add": "add", "sub": "sub", "subtract": "sub", "mul": "mul",
                 "multiply": "mul", "div": "div", "true_divide": "div",
                 "floor_divide": "floordiv", "remainder": "mod", "pow": "pow",
                 "lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "eq": "eq", "ne": "ne",
                 "minimum": "minimum", "maximum": "maximum", "fmin": "minimum",
                 "fmax": "maximum", "logical_and": "logical_and",
                 "logical_or": "logical_or", "logical_xor": "logical_xor",
                 "bitwise_and": "and", "bitwise_or": "or", "bitwise_xor": "xor"}


def torch_function(ctx: _Context, func, args, kwargs):
    """torch.where / torch.tanh / torch.clamp / ... on traced values (torch hands them to
    ``Sym.__torch_function__``)."""
    name = getattr(func, "__name__", str(func))
    if name == "__getitem__":
        ctx.fail(TypeError, "a torch tensor that is not a capture indexed by a traced "
                            "value; pass it as a capture (a parameter or a variable the "
                            "function or a function it calls closes over) and index it")
    try:
        if name == "where" and len(args) == 3 and not kwargs:
            return Sym(_where(ctx, *args), ctx)
        if name in ("div", "divide") and len(args) == 2 and set(kwargs) == {"rounding_mode"}:
            return _div_rounded(ctx, args[0], args[1], kwargs["rounding_mode"])
        if name in ("clamp", "clip") and len(args) >= 1:
            rest = list(args[1:]) + [None] * (3 - len(args))
            lo = kwargs.pop("min", rest[0])
            hi = kwargs.pop("max", rest[1])
            if not kwargs:
                return clamp_sym(ctx, args[0], lo, hi)
        if not kwargs and name in _TORCH_UNARY and len(args) == 1:
            return Sym(ops.unary(ctx.bld, _TORCH_UNARY[name], lift(args[0], ctx)), ctx)
        if not kwargs and name in _TORCH_BINARY and len(args) == 2:
            return Sym(ops.binary(ctx.bld, _TORCH_BINARY[name], lift(args[0], ctx),
                                  lift(args[1], ctx)), ctx)
    except ops.OpError as e:
        ctx.fail(TypeError, f"torch.{name}: {e}")
    ctx.fail(TypeError, f"torch.{name}"
             + (f" with {sorted(kwargs)}" if kwargs else "")
             + " is not supported in a traced function; use torch.where(c, x, y), "
             "torch.clamp(x, min, max), elementwise torch functions, NumPy ufuncs or "
             "anyattn.math")


def _div_rounded(ctx: _Context, x, y, mode) -> "Sym":
    """torch.div(x, y, rounding_mode=mode): None divides, 'floor' is ``//``, 'trunc'
    rounds toward zero (``//`` plus one where the quotient is negative and inexact)."""
    a, b = lift(x, ctx), lift(y, ctx)
    if mode is None:
        return Sym(ops.binary(ctx.bld, "div", a, b), ctx)
    if mode not in ("floor", "trunc"):
        ctx.fail(TypeError, f"torch.div(rounding_mode={mode!r}): expected None, 'floor' "
                            "or 'trunc'")
    q = ops.binary(ctx.bld, "floordiv", a, b)
    if mode == "floor":
        return Sym(q, ctx)
    bld = ctx.bld
    inexact = ops.binary(bld, "ne", ops.binary(bld, "mul", q, b), a)
    negative = ops.binary(bld, "lt", q, bld.const(0, INT))
    up = ops.binary(bld, "add", q, bld.const(1, INT))
    return Sym(ops.where(bld, ops.binary(bld, "and", negative, inexact), up, q), ctx)


def _where(ctx: _Context, c, x, y) -> Node:
    try:
        return ops.where(ctx.bld, lift(c, ctx), lift(x, ctx), lift(y, ctx))
    except ops.OpError as e:
        ctx.fail(TypeError, str(e))


def clamp_sym(ctx: _Context, x, lo, hi) -> "Sym":
    y = Sym(lift(x, ctx), ctx)
    if lo is not None:
        y = Sym(ops.binary(ctx.bld, "maximum", y.node, lift(lo, ctx)), ctx)
    if hi is not None:
        y = Sym(ops.binary(ctx.bld, "minimum", y.node, lift(hi, ctx)), ctx)
    return y


# ---------------------------------------------------------------------- tracing
def capture_spec(name: str, arr, where_: str) -> CaptureSpec:
    """The spec of a captured array (NumPy or torch); refuses other dtypes."""
    dt = str(arr.dtype).replace("torch.", "")
    if dt.startswith("float") or dt == "bfloat16":
        cls = FLOAT
    elif dt.startswith("int") or dt.startswith("uint"):
        cls = INT
    elif dt == "bool":
        cls = BOOL
    else:
        raise TypeError(f"{where_}: capture {name!r} has dtype {arr.dtype}; captures are "
                        "float, integer or bool arrays")
    return CaptureSpec(name, tuple(int(n) for n in arr.shape), cls)


@dataclass(frozen=True)
class Traced:
    """One traced function: its output node, the builder holding its graph, the
    captures it reads (specs by name, arrays by name) and its kind and name."""

    kind: str
    name: str
    out: Node
    bld: Builder
    specs: Dict[str, CaptureSpec]
    arrays: Dict[str, Any]


def fn_name(fn) -> str:
    return getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)


def _rebuilt(fn, index_names, explicit: Dict[str, Any], where_: str):
    """(function to call, capture arrays by name, names of its capture parameters).

    Parameters after the index arguments are captures: bound from ``explicit`` by name,
    else from an array default.  Arrays in the closure cells or globals the code reads
    become captures named after their variable."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        raise TypeError(f"{where_}: cannot read the signature of {fn!r}; pass a Python "
                        "function or lambda") from None
    params = list(sig.parameters.values())
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if any(p.kind == p.VAR_POSITIONAL for p in params):
        raise TypeError(f"{where_}: *args is not supported; name the {len(index_names)} "
                        f"arguments {', '.join(index_names)} and one parameter per capture")
    n = len(index_names)
    if len(positional) < n:
        raise TypeError(f"{where_}: takes {len(positional)} positional argument(s); "
                        f"expected {n}: ({', '.join(index_names)}) then the captures")
    arrays: Dict[str, Any] = {}
    cap_params = []
    for p in positional[n:]:
        if p.name in explicit:
            arrays[p.name] = explicit[p.name]
        elif p.default is not p.empty and array_kind(p.default) is not None:
            arrays[p.name] = p.default
        elif p.default is p.empty:
            raise TypeError(f"{where_}: parameter {p.name!r} has no capture; pass it as "
                            f"a keyword: ScoreMod/MaskMod(fn, {p.name}=array)")
        else:
            continue                    # a non-array default keeps its value
        cap_params.append(p.name)
    unknown = sorted(set(explicit) - set(cap_params))
    if unknown:
        raise TypeError(f"{where_}: captures {unknown} are not parameters of the function "
                        f"after ({', '.join(index_names)}); add them to its signature")
    code = getattr(fn, "__code__", None)
    if code is None:
        return fn, arrays, cap_params, {}
    closure_arrays: Dict[str, Any] = {}
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        try:
            val = cell.cell_contents
        except ValueError:
            continue
        if array_kind(val) is not None:
            closure_arrays[name] = val
    for name in code.co_names:
        val = fn.__globals__.get(name)
        if val is not None and array_kind(val) is not None and name not in closure_arrays:
            closure_arrays[name] = val
    for name in closure_arrays:
        if name in arrays:
            raise TypeError(f"{where_}: {name!r} is both a capture parameter and a closure "
                            "variable; rename one")
    return fn, arrays, cap_params, closure_arrays


def new_context(kind: str, fname: str, bld: Builder = None) -> _Context:
    """A tracing context (its builder and the name errors give)."""
    return _Context(kind, fname, bld if bld is not None else Builder())


def index_syms(ctx: _Context, kind: str):
    """The symbolic arguments of a ``kind`` function (score first for score_mod)."""
    return [Sym(ctx.bld.input(n), ctx) for n in KINDS[kind][0]]


def call_traced(fn, kind: str, captures: Optional[Dict[str, Any]], ctx: _Context, args,
                register) -> Node:
    """Call ``fn`` on the symbolic ``args`` -> its output node (checked for ``kind``).

    ``register(name, array)`` -> the proxy of a capture (a :class:`CaptureProxy`, or a
    :class:`Sym` for rank 0); it decides the capture's name in the graph."""
    index_names, want = KINDS[kind]
    where_ = ctx.where_()
    if not callable(fn):
        raise TypeError(f"{kind}: expected a function, got {type(fn).__name__}")
    fn, arrays, cap_params, closure_arrays = _rebuilt(fn, index_names, dict(captures or {}),
                                                      where_)
    proxies: Dict[str, Any] = {}
    by_id: Dict[int, Any] = {}
    for name, arr in list(arrays.items()) + list(closure_arrays.items()):
        if array_kind(arr) is None:
            raise TypeError(f"{where_}: capture {name!r} is a {type(arr).__name__}; "
                            "expected a NumPy array or torch tensor")
        proxies[name] = register(name, arr)
        by_id.setdefault(id(arr), proxies[name])

    def nested_proxy(name: str, arr):
        """The proxy of an array a nested function reads (one per array object)."""
        if id(arr) not in by_id:
            unique, n = name, 1
            while unique in proxies:
                unique, n = f"{name}_{n}", n + 1
            proxies[unique] = by_id[id(arr)] = register(unique, arr)
        return by_id[id(arr)]

    if getattr(fn, "__code__", None) is not None:
        fn = _with_proxies(fn, {n: proxies[n] for n in closure_arrays}, nested_proxy, 0)
    kw = {n: proxies[n] for n in cap_params}
    try:
        res = fn(*args, **kw)
    except TRACING_ERRORS:
        raise
    except Exception as e:        # anything else the function did with a symbol
        raise TypeError(f"{where_}: could not be traced: {type(e).__name__}: {e}") from e
    return check_result(res, ctx, want)


#: how deep closures of closures are rebuilt (deeper functions are called as they are)
_NESTING = 8


def _with_proxies(fn, own: Dict[str, Any], nested_proxy, depth: int):
    """``fn`` rebuilt to read proxies: ``own`` maps its closure / global array names to
    theirs; arrays in the closures of Python functions it closes over (recursively, up
    to :data:`_NESTING` levels) get theirs from ``nested_proxy(name, array)``.  ``fn``
    itself where nothing changes."""
    code = fn.__code__
    cells, changed = [], False
    for name, cell in zip(code.co_freevars, fn.__closure__ or ()):
        new = None
        if name in own:
            new = own[name]
        else:
            try:
                val = cell.cell_contents
            except ValueError:           # a cell not filled yet
                val = None
            if depth > 0 and val is not None and array_kind(val) is not None:
                new = nested_proxy(name, val)
            elif (isinstance(val, types.FunctionType) and val is not fn
                  and depth < _NESTING):
                inner = _with_proxies(val, {}, nested_proxy, depth + 1)
                new = inner if inner is not val else None
        changed = changed or new is not None
        cells.append(cell if new is None else types.CellType(new))
    glob = fn.__globals__
    globs = {n: own[n] for n in code.co_names if n in own and n not in code.co_freevars}
    for n in code.co_names:
        if n in globs or n in code.co_freevars:
            continue
        val = glob.get(n)
        if depth > 0 and val is not None and array_kind(val) is not None:
            globs[n] = nested_proxy(n, val)
        elif (isinstance(val, types.FunctionType) and val.__closure__ and val is not fn
              and depth < _NESTING):
            inner = _with_proxies(val, {}, nested_proxy, depth + 1)
            if inner is not val:
                globs[n] = inner
    if not changed and not globs:
        return fn
    if globs:
        glob = dict(glob)
        glob.update(globs)
    out = types.FunctionType(code, glob, fn.__name__, fn.__defaults__,
                             tuple(cells) if fn.__closure__ else None)
    out.__kwdefaults__ = fn.__kwdefaults__
    return out


def trace(fn, kind: str, captures: Optional[Dict[str, Any]] = None) -> Traced:
    """Trace ``fn`` as a ``kind`` ('score_mod' or 'mask_mod') function with the named
    ``captures`` (arrays) -> :class:`Traced` (captures named after their parameter or
    variable)."""
    ctx = new_context(kind, fn_name(fn))
    specs: Dict[str, CaptureSpec] = {}
    arrays: Dict[str, Any] = {}

    def register(name, arr):
        spec = specs[name] = capture_spec(name, arr, ctx.where_())
        arrays[name] = arr
        return proxy_of(spec, ctx)

    out = call_traced(fn, kind, captures, ctx, index_syms(ctx, kind), register)
    return Traced(kind, ctx.fname, out, ctx.bld, specs, arrays)


def proxy_of(spec: CaptureSpec, ctx: _Context):
    """What a function sees of a capture: a Sym for rank 0, else a CaptureProxy."""
    if not spec.shape:
        return Sym(ctx.bld.node("gather", spec.dtype, (), spec.name), ctx)
    return CaptureProxy(spec, ctx)


#: errors the tracer raises itself (with the function's name already in them)
TRACING_ERRORS = (TraceError,)


def check_result(res, ctx: _Context, want: str) -> Node:
    kind, what = ctx.kind, ("a float" if want == FLOAT else "a bool")
    if isinstance(res, CaptureProxy):
        res._as_value()
    if array_kind(res) is not None and getattr(res, "ndim", None) == 0:
        # a 0-d array computed without the indices (``torch.tensor(True)``): a constant
        # (a capture of rank 0 is a traced value, not an array, here)
        res = res.item()
    if array_kind(res) is not None or isinstance(res, (tuple, list, dict)):
        shape = getattr(res, "shape", None)
        ctx.fail(TypeError, f"returned a {type(res).__name__}"
                 + (f" of shape {tuple(shape)}" if shape is not None else "")
                 + f"; a {kind} returns {what} expression: one value per (b, h, q_idx, "
                 "kv_idx)")
    if not isinstance(res, (Sym, numbers.Real, np.bool_)):
        ctx.fail(TypeError, f"returned {type(res).__name__}; a {kind} returns {what} "
                            "expression built from its arguments")
    node = lift(res, ctx)
    if node.dtype != want:
        got = {FLOAT: "a float", INT: "an integer", BOOL: "a bool"}[node.dtype]
        hint = ("(e.g. score + bias, or anyattn.math.where(keep, score, -inf))"
                if want == FLOAT else "(a comparison such as q_idx >= kv_idx, or & | ~ of "
                "comparisons)")
        ctx.fail(TypeError, f"returned {got} expression; a {kind} returns {what} "
                            f"expression {hint}")
    return node
