"""Interval analysis of integer expressions: every capture index in range, checked
once per call before any work.

The inputs range over ``b`` in [0, B), ``h`` in [0, Hq), ``q_idx`` in [0, Sq) and
``kv_idx`` in [0, Sk); an integer capture read by ``gather`` ranges over its values'
[min, max].  Each integer node gets an interval that holds every value it can take
(exact for sums, products, min / max, abs, clamps, ``%`` and ``//`` by constants;
``where`` takes the union of its branches); a gather whose index interval leaves
[0, n) of its axis is refused, naming the capture, the axis, the expression and the
range.  Intervals ignore correlations (``x - x`` spans twice x's width), so a refusal
can be conservative: clamping the index (``anyattn.math.clamp``) always passes.
"""
from __future__ import annotations

import math
from typing import Dict, Optional, Tuple

import numpy as np

from .graph import BOOL, FLOAT, Node, ordered, render

__all__ = ["check_gathers", "intervals", "index_dtype"]

INF = math.inf
Interval = Tuple[float, float]


def _mul(a: float, b: float) -> float:
    if a == 0 or b == 0:
        return 0
    return a * b


def _corners(f, a: Interval, b: Interval) -> Interval:
    vals = [f(x, y) for x in a for y in b]
    return min(vals), max(vals)


def _fdiv(x, y):
    if math.isinf(x) or math.isinf(y):
        return x / y if not (math.isinf(x) and math.isinf(y)) else INF
    return x // y


def intervals(outputs, sizes: Tuple[int, int, int, int],
              arrays: Dict[str, np.ndarray]) -> Dict[int, Optional[Interval]]:
    """{uid: (lo, hi)} for the integer and bool nodes ``outputs`` depend on (None for
    float nodes)."""
    B, H, Sq, Sk = sizes
    span = {"b": (0, B - 1), "h": (0, H - 1), "q_idx": (0, Sq - 1), "kv_idx": (0, Sk - 1)}
    iv: Dict[int, Optional[Interval]] = {}
    for n in ordered(outputs):
        if n.dtype == FLOAT:
            iv[n.uid] = None
            continue
        if n.dtype == BOOL and n.op not in ("const", "gather", "where"):
            iv[n.uid] = (0, 1)
            continue
        a = [iv.get(x.uid) for x in n.args]
        op = n.op
        if op == "input":
            r = span[n.attr]
        elif op == "const":
            r = (int(n.attr), int(n.attr))
        elif op == "gather":
            arr = arrays[n.attr]
            r = (int(arr.min()), int(arr.max())) if arr.size else (0, 0)
        elif op == "toint":
            r = a[0]
        elif op == "trunc_int":                  # from a float: no bound known
            r = (-INF, INF)
        elif op == "add":
            r = (a[0][0] + a[1][0], a[0][1] + a[1][1])
        elif op == "sub":
            r = (a[0][0] - a[1][1], a[0][1] - a[1][0])
        elif op == "mul":
            r = _corners(_mul, a[0], a[1])
        elif op == "neg":
            r = (-a[0][1], -a[0][0])
        elif op == "abs":
            lo, hi = a[0]
            r = (lo, hi) if lo >= 0 else ((-hi, -lo) if hi <= 0 else (0, max(-lo, hi)))
        elif op == "sign":
            r = (int(np.sign(a[0][0])), int(np.sign(a[0][1])))
        elif op == "minimum":
            r = (min(a[0][0], a[1][0]), min(a[0][1], a[1][1]))
        elif op == "maximum":
            r = (max(a[0][0], a[1][0]), max(a[0][1], a[1][1]))
        elif op == "where":
            r = (min(a[1][0], a[2][0]), max(a[1][1], a[2][1]))
        elif op == "floordiv":
            r = _corners(_fdiv, a[0], a[1]) if a[1][0] > 0 or a[1][1] < 0 else (-INF, INF)
        elif op == "mod":
            lo, hi = a[1]
            if lo > 0:
                r = a[0] if (a[0][0] >= 0 and a[0][1] < lo) else (0, hi - 1)
            elif hi < 0:
                r = (lo + 1, 0)
            else:
                r = (-INF, INF)
        elif op == "pow":
            e = a[1]
            if e[0] != e[1] or math.isinf(e[0]):
                r = (-INF, INF)
            else:
                lo, hi = a[0]
                vals = [lo ** int(e[0]), hi ** int(e[0])]
                if lo < 0 < hi:
                    vals.append(0)
                r = (min(vals), max(vals))
        elif op == "invert":
            r = (-a[0][1] - 1, -a[0][0] - 1)
        elif op == "bitand":
            r = (0, min(a[0][1], a[1][1])) if a[0][0] >= 0 and a[1][0] >= 0 else (-INF, INF)
        elif op in ("bitor", "bitxor"):
            hi = max(a[0][1], a[1][1])
            r = ((0, 2 ** int(hi).bit_length() - 1) if a[0][0] >= 0 and a[1][0] >= 0
                 and not math.isinf(hi) else (-INF, INF))
        else:                                            # pragma: no cover - internal
            r = (-INF, INF)
        iv[n.uid] = r
    return iv


def check_gathers(outputs, sizes, arrays, specs, where_: str):
    """Refuse (ValueError) a gather whose index can leave its capture's axis -> the
    intervals of :func:`intervals` (None for an empty problem: nothing is evaluated)."""
    if 0 in sizes:
        return None
    iv = intervals(outputs, sizes, arrays)
    B, H, Sq, Sk = sizes
    for n in ordered(outputs):
        if n.op != "gather" or not n.args:
            continue
        shape = specs[n.attr].shape
        for ax, idx in enumerate(n.args):
            lo, hi = iv[idx.uid]
            if lo < 0 or hi > shape[ax] - 1:
                rng = f"[{_fmt(lo)}, {_fmt(hi)}]"
                raise ValueError(
                    f"{where_}: capture {n.attr!r} (shape {shape}) axis {ax} is indexed by "
                    f"{render(idx)}, which takes values in {rng} over b < {B}, h < {H}, "
                    f"q_idx < {Sq}, kv_idx < {Sk}, outside [0, {shape[ax] - 1}]; enlarge "
                    f"the capture or clamp the index (anyattn.math.clamp(i, 0, "
                    f"{shape[ax] - 1}))")
    return iv


def index_dtype(iv) -> np.dtype:
    """int32 where every integer node's interval fits it (half the memory traffic of
    int64 in the index arithmetic), else int64."""
    lim = 2 ** 31 - 1
    if iv is not None and all(r is None or (-lim <= r[0] and r[1] <= lim)
                              for r in iv.values()):
        return np.dtype(np.int32)
    return np.dtype(np.int64)


def _fmt(x) -> str:
    return str(int(x)) if not math.isinf(x) else ("-inf" if x < 0 else "inf")
