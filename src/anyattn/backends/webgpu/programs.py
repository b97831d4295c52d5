"""WGSL of traced score and mask functions (anyattn.programs graphs).

A score function's graph becomes two WGSL functions of the scalars (score, b, h, i, j)
(local indices, u32 in the kernels; the generated code reads the batch index as
``U.drop_b0 + b``, the global one where the batch is split into chunks): ``smod_v``
(the modified score) and ``smod_vd`` (the modified score and d score_mod / d score, as
``vec2<f32>``, sharing their common subexpressions); the tiled kernels compiled with ``SCOREMOD`` call them after softcap,
before the bias and the mask terms.  A mask function's graph becomes ``mfn_<k>(b, h,
i, j) -> bool``, which ``keep_ij`` applies in partial tiles (``MASKFN``).  A backward
with capture gradients adds ``dcap_d`` / ``dcap_put`` (:func:`dcap_source`) to the text
of its dK/dV pass only (``DCAP``, capture_grads.py).

Float nodes compute in f32, integer nodes in i32 (the index analysis proves that every
integer expression fits, :func:`anyattn.programs.bounds.index_dtype`; a graph it does
not prove is refused), bools as bool.  Captures are read from one read-only storage
buffer of 32-bit words (``capb``, binding 10): float captures as f32 bits, integer ones
as i32, bools as 0 / 1; their word offsets and strides are constants of the generated
text (shapes are part of the graph's key), so a call with new captured values writes
new buffer contents and compiles nothing.  Python's semantics where WGSL's differ:
``//`` and ``%`` floor, ``where`` is ``select``, ±inf constants come from the uniform
``U.neg_inf`` (compilers may fold literal infinities) and ``tanh`` is an accurate
polynomial / exponential form (llvmpipe's tanh is off by several ulp).
"""
from __future__ import annotations

import hashlib
import math
from typing import TYPE_CHECKING, Dict, List, Sequence, Tuple

import numpy as np

from ...programs.graph import BOOL, FLOAT, INT, Node, ordered

if TYPE_CHECKING:
    from .capture_grads import SlotLayout

__all__ = ["Layout", "score_source", "dcap_source", "mask_source", "mask_words",
           "pack_captures", "TANH_HELPER"]

_I32_MIN, _I32_MAX = -(1 << 31), (1 << 31) - 1

#: an accurate f32 tanh: odd Taylor series below |y| = 0.55, (1 - e) / (1 + e) with
#: e = exp(-2|y|) above (no cancellation there); saturates to ±1, NaN only from NaN
TANH_HELPER = """fn am_tanh(y: f32) -> f32 {
  let a = abs(y);
  if (a < 0.55) {
    let z = a * a;
    var p = -0.00059002744094558598;
    p = p * z + 0.0014558343870513183;
    p = p * z - 0.0035921280365724810;
    p = p * z + 0.0088632355299021966;
    p = p * z - 0.021869488536155203;
    p = p * z + 0.053968253968253968;
    p = p * z - 0.13333333333333333;
    p = p * z + 0.33333333333333333;
    return y - y * z * p;
  }
  let e = exp(-2.0 * a);
  let u = (1.0 - e) / (1.0 + e);
  return select(-u, u, y >= 0.0);
}
fn am_floordiv(a: i32, b: i32) -> i32 {
  if (b == 0) { return 0; }
  let q = a / b;
  if ((a % b != 0) && ((a < 0) != (b < 0))) { return q - 1; }
  return q;
}
fn am_mod(a: i32, b: i32) -> i32 {
  if (b == 0) { return 0; }
  let r = a % b;
  if ((r != 0) && ((r < 0) != (b < 0))) { return r + b; }
  return r;
}
fn am_fmod(a: f32, b: f32) -> f32 { return a - b * floor(a / b); }
fn am_fpow(a: f32, b: f32) -> f32 {
  if (b == 0.0) { return 1.0; }
  if (a == 0.0) { return select(-U.neg_inf, 0.0, b > 0.0); }
  let m = exp2(b * log2(abs(a)));
  if (a > 0.0) { return m; }
  if (floor(b) != b) { return U.neg_inf - U.neg_inf; }
  return select(m, -m, floor(b * 0.5) * 2.0 != b);
}
"""


class Layout:
    """Word offsets and strides of the captures in ``capb`` (by name), in name order."""

    def __init__(self, specs):
        self.parts: Dict[str, Tuple[int, Tuple[int, ...], Tuple[int, ...], str]] = {}
        off = 0
        for name in sorted(specs):
            s = specs[name]
            shape = tuple(int(n) for n in s.shape)
            strides, acc = [], 1
            for n in reversed(shape):
                strides.append(acc)
                acc *= n
            self.parts[name] = (off, shape, tuple(reversed(strides)), s.dtype)
            off += max(acc, 1)
        self.words = off


def pack_captures(layout: Layout, arrays: Dict[str, np.ndarray], where: str) -> np.ndarray:
    """The captures as u32 words in ``layout``'s order (at least one word); a capture
    missing from ``arrays`` (a device array, copied in on the device) stays zero."""
    out = np.zeros(max(layout.words, 1), dtype=np.uint32)
    for name, (off, shape, _, dt) in layout.parts.items():
        if name not in arrays:
            continue
        a = np.asarray(arrays[name])
        n = int(np.prod(shape)) if shape else 1
        if dt == FLOAT:
            w = np.ascontiguousarray(a, dtype=np.float32).reshape(-1).view(np.uint32)
        elif dt == INT:
            if a.size and (int(a.min()) < _I32_MIN or int(a.max()) > _I32_MAX):
                raise ValueError(f"{where}: integer capture {name!r} holds values outside "
                                 "int32, the integers of the webgpu kernels; pass values "
                                 "that fit int32")
            w = np.ascontiguousarray(a, dtype=np.int32).reshape(-1).view(np.uint32)
        else:
            w = np.ascontiguousarray(a, dtype=bool).reshape(-1).astype(np.uint32)
        out[off:off + n] = w
    return out


def _float_lit(v: float) -> str:
    f = float(np.float32(v)) if math.isfinite(v) and abs(v) <= 3.4028234663852886e38 \
        else v
    if math.isnan(f):
        return "(U.neg_inf - U.neg_inf)"
    if math.isinf(f):
        return "U.neg_inf" if f < 0 else "(-U.neg_inf)"
    if f == 0.0:
        return "(-0.0)" if math.copysign(1.0, f) < 0 else "0.0"
    return f"f32({f!r})" if "e" in repr(f) else f"{f!r}"


_WTY = {FLOAT: "f32", INT: "i32", BOOL: "bool"}
_INFIX = {"add": "+", "sub": "-", "mul": "*", "div": "/", "lt": "<", "le": "<=",
          "gt": ">", "ge": ">=", "eq": "==", "ne": "!=", "and": "&&", "or": "||",
          "xor": "!=", "bitand": "&", "bitor": "|", "bitxor": "^"}
_FUN = {"exp": "exp", "exp2": "exp2", "log": "log", "log2": "log2", "sqrt": "sqrt",
        "sin": "sin", "cos": "cos", "floor": "floor", "ceil": "ceil", "abs": "abs",
        "sign": "sign", "tanh": "am_tanh"}
_IDX = {"b": "i32(U.drop_b0 + b)", "h": "i32(h)", "q_idx": "i32(i)", "kv_idx": "i32(j)"}


def _ipow(x: str, n: int, ty: str) -> str:
    if n == 0:
        return "1.0" if ty == "f32" else "1i"
    return "(" + " * ".join([x] * n) + ")"


def _body(outputs: Sequence[Node], layout: Layout, where: str) -> Tuple[List[str], Dict[int, str]]:
    """WGSL ``let`` statements of every node ``outputs`` depend on -> (lines, names)."""
    names: Dict[int, str] = {}
    lines: List[str] = []
    for n in ordered(outputs):
        op, a = n.op, [names[x.uid] for x in n.args]
        ty = _WTY[n.dtype]
        if op == "input":
            e = "x" if n.attr == "score" else _IDX[n.attr]
        elif op == "const":
            if n.dtype == FLOAT:
                e = _float_lit(n.attr)
            elif n.dtype == INT:
                if not _I32_MIN < n.attr <= _I32_MAX:
                    raise NotImplementedError(f"webgpu: {where}: the constant {n.attr} does "
                                              "not fit int32, the integers of the webgpu "
                                              "kernels")
                e = f"i32({n.attr})" if n.attr < 0 else f"{n.attr}i"
            else:
                e = "true" if n.attr else "false"
        elif op == "gather":
            off, shape, strides, dt = layout.parts[n.attr]
            terms = [str(off) + "u"] + [f"u32({x}) * {s}u" if s != 1 else f"u32({x})"
                                        for x, s in zip(a, strides)]
            w = f"capb[{' + '.join(terms)}]"
            e = {FLOAT: f"bitcast<f32>({w})", INT: f"bitcast<i32>({w})",
                 BOOL: f"({w} != 0u)"}[dt]
        elif op in _INFIX:
            e = f"({a[0]} {_INFIX[op]} {a[1]})"
        elif op == "neg":
            e = f"(-{a[0]})"
        elif op == "not":
            e = f"(!{a[0]})"
        elif op == "invert":
            e = f"(~{a[0]})"
        elif op in _FUN:
            e = f"{_FUN[op]}({a[0]})"
        elif op == "log1p":
            e = f"log(1.0 + {a[0]})"
        elif op == "expm1":
            e = f"(exp({a[0]}) - 1.0)"
        elif op == "square":
            e = f"({a[0]} * {a[0]})"
        elif op == "tofloat":
            e = f"f32({a[0]})"
        elif op == "toint":
            e = f"i32({a[0]})"
        elif op == "trunc_int":
            e = f"i32(trunc({a[0]}))"
        elif op == "floordiv":
            e = f"am_floordiv({a[0]}, {a[1]})" if n.dtype == INT else f"floor({a[0]} / {a[1]})"
        elif op == "mod":
            e = f"am_mod({a[0]}, {a[1]})" if n.dtype == INT else f"am_fmod({a[0]}, {a[1]})"
        elif op == "minimum":
            e = f"min({a[0]}, {a[1]})"
        elif op == "maximum":
            e = f"max({a[0]}, {a[1]})"
        elif op == "where":
            e = f"select({a[2]}, {a[1]}, {a[0]})"
        elif op == "pow":
            ex = n.args[1]
            if ex.op == "const" and float(ex.attr).is_integer() and 0 <= ex.attr <= 8:
                e = _ipow(a[0], int(ex.attr), ty)
            elif n.dtype == INT:
                raise NotImplementedError(f"webgpu: {where}: an integer power with a "
                                          "non-constant exponent")
            else:
                e = f"am_fpow({a[0]}, {a[1]})"   # np.power's rule (WGSL's pow wants a > 0)
        else:  # pragma: no cover - every graph operation is listed above
            raise NotImplementedError(f"webgpu: {where}: operation {op!r} has no WGSL form")
        name = f"t{len(lines)}"
        lines.append(f"  let {name}: {ty} = {e};")
        names[n.uid] = name
    return lines, names


def _fn(sig: str, ret: str, outputs, layout, where, result) -> str:
    lines, names = _body(outputs, layout, where)
    return "\n".join([f"fn {sig} -> {ret} {{"] + lines
                     + [f"  return {result([names[o.uid] for o in outputs])};", "}"])


def _check_idt(bound) -> None:
    if np.dtype(bound.idt) != np.dtype(np.int32):
        raise NotImplementedError(
            f"webgpu: {bound.program.where}: an integer expression may leave int32, the "
            "integers of the webgpu kernels, at these sizes; use backend='numpy'")


def score_source(bound) -> Tuple[str, str]:
    """(key, WGSL of smod_v and smod_vd) of a bound score program."""
    _check_idt(bound)
    prog = bound.program
    layout = Layout(prog.specs)
    dsc, _ = prog.grad_nodes(frozenset())
    sig = "(x: f32, b: u32, h: u32, i: u32, j: u32)"
    v = _fn("smod_v" + sig, "f32", [prog.out], layout, prog.where, lambda r: r[0])
    vd = _fn("smod_vd" + sig, "vec2<f32>", [prog.out, dsc], layout, prog.where,
             lambda r: f"vec2<f32>({r[0]}, {r[1]})")
    src = v + "\n" + vd + "\n"
    return hashlib.sha1(src.encode()).hexdigest(), src


def dcap_source(bound, wrt) -> Tuple[str, str, "SlotLayout"]:
    """(key, WGSL, layout) of the capture gradient functions of the dK/dV pass (DCAP)
    for the NG reads (gather nodes, graph order: anyattn.programs.capture_reads.reads)
    of the score function's float captures ``wrt``: ``dcap_d(x, b, h, i, j) ->
    array<f32, NG>`` (d s' / d g of every read, sharing their common subexpressions)
    and ``dcap_put(ii, jj, kept, ds, x, b, h, i, j)``, which stores ``ds * d s' / d g``
    of a pair (0 where not ``kept``) at row ``ii``, column ``jj`` of its read's block of
    the workgroup tile ``sdc`` [NG][BQ][BK] (bwd_dkdv.wgsl); the blocks follow
    ``layout`` (capture_grads.slot_layout: the diagonal and total reads, then the row
    reads, then the column reads).  With pair reads (DCPR) ``dcap_put`` takes ``own``
    (the workgroup's column slice 0) and stores a pair read's term itself at (b, h, i,
    j) of the read's region [B*HQ, SQ, SK] of ``dcs``, after the tile slots
    (``dcap_pairs_at``, the word where those regions start): one invocation writes each
    element of a tile it runs, skipped tiles stay cleared.  No text (NG = 0) where no
    read of those captures exists."""
    from .capture_grads import slot_layout

    _check_idt(bound)
    prog = bound.program
    lay = slot_layout(prog, wrt)
    _, grads = prog.grad_nodes(frozenset(wrt))
    ng = len(grads)
    if not ng:
        return "", "", lay
    layout = Layout(prog.specs)
    sig = "(x: f32, b: u32, h: u32, i: u32, j: u32)"
    arr = f"array<f32, {ng}>"
    d = _fn("dcap_d" + sig, arr, [g for _, g in grads], layout, prog.where,
            lambda r: f"{arr}({', '.join(r)})")
    tile = sum(lay.counts)
    own = ", own: bool" if lay.pairs else ""
    put = ["fn dcap_put(ii: u32, jj: u32, kept: bool, ds: f32, x: f32, b: u32, h: u32, "
           f"i: u32, j: u32{own}) {{", f"  var e = {arr}();", "  if (kept) {",
           "    let d = dcap_d(x, b, h, i, j);"]
    put += [f"    e[{k}] = ds * d[{k}];" for k in range(ng)]
    put += ["  }"]
    put += [f"  sdc[({pos}u * BQ + ii) * BK + jj] = e[{k}];"
            for k, pos in enumerate(lay.position) if pos < tile]
    if lay.pairs:       # pair reads: the term itself, at (b, h, i, j) of the read's region
        put += ["  if (own && i < U.SQ && j < U.SK) {",
                "    let n = U.B * U.HQ * U.SQ * U.SK;",
                "    let at = dcap_pairs_at() + ((b * U.HQ + h) * U.SQ + i) * U.SK + j;"]
        put += [f"    dcs[at + {pos - tile}u * n] = e[{k}];"
                for k, pos in enumerate(lay.position) if pos >= tile]
        put += ["  }"]
        put += ["}", "fn dcap_pairs_at() -> u32 {",
                "  let nslot = U.B * U.HQ * U.nkt * U.nqt;",
                "  return nslot * (DCND * (BQ + BK - 1u) + DCNR * BQ + DCNC * BK);"]
    put += ["}"]
    src = d + "\n" + "\n".join(put) + "\n"
    return hashlib.sha1(src.encode()).hexdigest(), src, lay


def mask_source(bounds: Sequence, layouts_from: int = 0) -> Tuple[str, str]:
    """(key, WGSL of ``mfn_all(b, h, i, j) -> bool``: the conjunction of the mask
    functions) of bound mask programs; their captures follow one another from word
    ``layouts_from`` on (names made unique by a ``m<k>_`` prefix, :func:`mask_words`)."""
    parts, calls = [], []
    for k, bp in enumerate(bounds):
        _check_idt(bp)
        lay = Layout({f"m{k}_{n}": s for n, s in bp.program.specs.items()})
        lay = _shifted(lay, layouts_from)
        layouts_from += lay.words
        renamed = {n: lay.parts[f"m{k}_{n}"] for n in bp.program.specs}
        view = Layout({})
        view.parts = renamed
        parts.append(_fn(f"mfn_{k}(b: u32, h: u32, i: u32, j: u32)", "bool",
                         [bp.program.out], view, bp.program.where, lambda r: r[0]))
        calls.append(f"mfn_{k}(b, h, i, j)")
    parts.append("fn mfn_all(b: u32, h: u32, i: u32, j: u32) -> bool {\n  return "
                 + (" && ".join(calls) or "true") + ";\n}")
    src = "\n".join(parts) + "\n"
    return hashlib.sha1(src.encode()).hexdigest(), src


def _shifted(lay: Layout, by: int) -> Layout:
    out = Layout({})
    out.parts = {n: (off + by, sh, st, dt) for n, (off, sh, st, dt) in lay.parts.items()}
    out.words = lay.words
    return out


def mask_words(bounds: Sequence, start: int = 0) -> List[np.ndarray]:
    """The captures of mask programs as u32 words, in :func:`mask_source`'s layout."""
    out = []
    for k, bp in enumerate(bounds):
        lay = Layout({f"m{k}_{n}": s for n, s in bp.program.specs.items()})
        arrays = {f"m{k}_{n}": a for n, a in bp.arrays.items()}
        w = pack_captures(lay, arrays, bp.program.where)
        out.append(w[:lay.words])
    return out
