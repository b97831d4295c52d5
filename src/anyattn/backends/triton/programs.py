"""Score and mask functions on the portable kernels: Triton source generated from the
traced expression graph (anyattn.programs), loaded as ``@triton.jit`` device functions
and passed to the kernels as constexpr arguments.

Shape legend: B batch, H query heads, Sq / Sk queries / keys; a tile is [BM, BN]
(queries as rows) or, transposed, [BN, BM]: the generated functions take the index
vectors already shaped (``q_idx`` [BM, 1] or [1, BM], ``kv_idx`` [1, BN] or [BN, 1]),
so one source serves both orientations.

One generated module per call's set of functions (:func:`functions`), keyed by the
graphs' structural keys, the index dtype and the captures' storage layouts (never
their values): it defines

* ``score(s, b, h, q_idx, kv_idx, valid, CAPS) -> s'`` (the score function on natural
  scores, fp32),
* ``score_grad(...) -> (s', d s' / d s)``,
* ``mask(b, h, q_idx, kv_idx, valid, CAPS) -> keep`` (bool tile, False outside
  ``valid``: every mask function of the call and-ed),

and, for a backward that wants the gradients of float captures (:mod:`.capture_grads`),
a second module with

* ``dcap(ds, s, b, h, q_idx, kv_idx, valid, CAPS, DCS, slot, dcs_g, cacc, BN, BM,
  NCP) -> cacc``: on a transposed tile, ``ds`` (the gradient of the function's output)
  times d s' / d g for every read g of those captures (graph order), zero outside
  ``valid``, summed as the read's kind asks (capture_grads.py): along the tile's
  diagonals, along its query rows or to its total into slot ``slot`` of the read's
  region of ``DCS`` (regions of ``dcs_g`` slots times the slot width;
  kernels._dcap_store / _dcap_rows), the tile's terms themselves for a pair read
  (kernels._dcap_tile), or down its key columns into the read's column of the
  accumulator ``cacc`` [BN, NCP] (kernels._dcap_cols),

where ``CAPS`` is a tuple of at most :data:`MAX_CAPTURES` capture pointers (contiguous
device copies: float captures fp32, integer ones int32 or int64 as the index analysis
allows, bool ones uint8).  Gathers read ``CAPS[slot] + flat index`` with the graph's
index expressions (proven in range by the core's interval analysis for every in-bounds
pair) under the tile's ``valid`` mask.  Modules are written into a cache directory
keyed by their hash and imported (Triton's JIT reads the functions' source with
inspect), so a second call with the same functions and new captured values compiles
nothing.
"""
from __future__ import annotations

import collections
import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence

import numpy as np

from ...programs.graph import BOOL, FLOAT, INT, Node, ordered

__all__ = ["MAX_CAPTURES", "Functions", "functions", "of_problem", "mask_blocks", "source_of",
           "dcap_source", "cache_dir"]

#: capture pointer slots of the kernels (every score and mask function of a call together)
MAX_CAPTURES = 4

_lock = threading.Lock()
_modules: Dict[str, object] = {}


def cache_dir() -> str:
    """Where the generated modules are written (per user; ANYATTN_TRITON_FN_CACHE
    overrides)."""
    from ...settings import current

    d = current().triton_fn_cache or os.path.join(
        tempfile.gettempdir(), f"anyattn-triton-fns-{os.getuid() if hasattr(os, 'getuid') else 0}")
    os.makedirs(d, exist_ok=True)
    return d


# ----------------------------------------------------------------------------- codegen
_CMP = {"lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}
_ARITH = {"add": "+", "sub": "-", "mul": "*"}
_LOGIC = {"and": "&", "or": "|", "xor": "^", "bitand": "&", "bitor": "|", "bitxor": "^"}
_UNARY_CALL = {"exp": "tl.exp", "exp2": "tl.exp2", "log": "tl.log", "log2": "tl.log2",
               "sin": "tl.sin", "cos": "tl.cos", "floor": "tl.floor", "ceil": "tl.ceil",
               "sqrt": "tl.sqrt_rn"}


def _float_lit(v: float) -> str:
    if v != v:
        return 'float("nan")'
    if v in (float("inf"), float("-inf")):
        return 'float("inf")' if v > 0 else 'float("-inf")'
    return repr(float(v))


class _Gen:
    """Lines of one generated function body; node values in locals ``v<uid>``."""

    def __init__(self, itype: str, slots: Dict[str, int], layouts: Dict[str, tuple],
                 prefix: str = ""):
        self.itype, self.slots, self.layouts, self.prefix = itype, slots, layouts, prefix
        self.lines: List[str] = []
        self.names: Dict[int, str] = {}

    def ref(self, n: Node) -> str:
        return self.names[n.uid]

    def emit(self, n: Node, expr: str) -> None:
        name = f"{self.prefix}v{n.uid}"
        self.lines.append(f"    {name} = {expr}")
        self.names[n.uid] = name

    def node(self, n: Node) -> None:
        op, a = n.op, [self.ref(x) for x in n.args] if n.op not in ("const", "input") else []
        it = self.itype
        if op == "input":
            self.names[n.uid] = {"score": "s", "b": "bb", "h": "hh", "q_idx": "qi",
                                 "kv_idx": "kj"}[n.attr]
            return
        if op == "const":
            if n.dtype == FLOAT:
                self.names[n.uid] = _float_lit(n.attr)
            elif n.dtype == INT:
                self.names[n.uid] = f"({int(n.attr)})"
            else:
                self.names[n.uid] = "True" if n.attr else "False"
            return
        if op == "gather":
            shape = self.layouts[n.attr]
            strides = [int(np.prod(shape[i + 1:])) for i in range(len(shape))]
            # a constant index is a Python int in the generated code (no .to); an index
            # that varies per query, key or score (other than through a read, whose
            # values the host checked as indices) is clamped to its axis: in range where
            # the host checked it (every position below Sq / Sk), and at the tiles'
            # padding too, whose results the kernels discard, so that no read is masked
            idx = []
            for x, arg, size in zip(a, n.args, shape):
                if arg.op == "const":
                    idx.append(x)
                elif self._direct_inputs(arg) & {"q_idx", "kv_idx", "score"}:
                    idx.append(f"tl.minimum(tl.maximum(({x}).to({it}), 0), {size - 1})")
                else:
                    idx.append(f"({x}).to({it})")
            parts = [f"{x} * {st}" if st != 1 else x for x, st in zip(idx, strides)]
            off = " + ".join(parts) if parts else "0"
            ptr = f"CAPS[{self.slots[n.attr]}]"
            tile = self._is_tile(n)
            # unmasked: a read of q_idx or kv_idx alone stays a vector, and a tile of 32 /
            # 64-bit values is kept out of the software pipeliner (kernels.gather_tile)
            if tile and n.dtype != BOOL:
                ld = f"gather_tile({ptr} + ({off}))"
            else:
                ld = f"tl.load({ptr} + ({off}))"
            if n.dtype == BOOL:
                ld = f"({ld} != 0)"
            elif n.dtype == INT:
                ld = f"{ld}.to({it})"
            self.emit(n, ld)
            return
        if op == "tofloat":
            self.emit(n, f"({a[0]}).to(tl.float32)")
        elif op == "toint":
            self.emit(n, f"({a[0]}).to({it})")
        elif op == "trunc_int":
            self.emit(n, f"({a[0]}).to({it})")
        elif op in _ARITH:
            self.emit(n, f"{a[0]} {_ARITH[op]} {a[1]}")
        elif op == "div":
            self.emit(n, f"tl.math.div_rn({a[0]}, {a[1]})")
        elif op == "floordiv":
            if n.dtype == FLOAT:
                self.emit(n, f"tl.floor(tl.math.div_rn({a[0]}, {a[1]}))")
            else:   # Python's floor: C's truncation moved down where the signs differ
                self.emit(n, f"_ifloordiv({a[0]}, {a[1]})")
        elif op == "mod":
            if n.dtype == FLOAT:
                self.emit(n, f"_fmod_py({a[0]}, {a[1]})")
            else:
                self.emit(n, f"_imod_py({a[0]}, {a[1]})")
        elif op == "pow":
            e = n.args[1]
            if e.op == "const" and float(e.attr) == int(e.attr) and 0 <= int(e.attr) <= 8:
                k = int(e.attr)
                one = "1.0" if n.dtype == FLOAT else "1"
                expr = " * ".join([f"({a[0]})"] * k) if k else f"({a[0]}) * 0 + {one}"
                self.emit(n, expr)
            elif n.dtype == FLOAT:
                self.emit(n, f"_fpow({a[0]}, {a[1]})")
            else:
                raise NotImplementedError(
                    "integer ** with an exponent other than a constant 0..8 on Triton")
        elif op in _CMP:
            self.emit(n, f"{a[0]} {_CMP[op]} {a[1]}")
        elif op in _LOGIC:
            self.emit(n, f"({a[0]}) {_LOGIC[op]} ({a[1]})")
        elif op in ("minimum", "maximum"):
            fn = "tl.minimum" if op == "minimum" else "tl.maximum"
            if n.dtype == FLOAT:
                self.emit(n, f"{fn}({a[0]}, {a[1]}, propagate_nan=tl.PropagateNan.ALL)")
            else:
                self.emit(n, f"{fn}({a[0]}, {a[1]})")
        elif op == "where":
            self.emit(n, f"tl.where({a[0]}, {a[1]}, {a[2]})")
        elif op == "neg":
            self.emit(n, f"-({a[0]})")
        elif op == "abs":
            self.emit(n, f"tl.abs({a[0]})")
        elif op == "not":
            self.emit(n, f"({a[0]}) == 0")
        elif op == "invert":
            self.emit(n, f"~({a[0]})")
        elif op == "square":
            self.emit(n, f"({a[0]}) * ({a[0]})")
        elif op == "tanh":
            self.emit(n, f"_tanh({a[0]})")
        elif op == "log1p":
            self.emit(n, f"_log1p({a[0]})")
        elif op == "expm1":
            self.emit(n, f"_expm1({a[0]})")
        elif op == "sign":
            if n.dtype == FLOAT:
                self.emit(n, f"tl.where({a[0]} > 0, 1.0, tl.where({a[0]} < 0, -1.0, {a[0]}))")
            else:
                self.emit(n, f"({a[0]} > 0).to({it}) - ({a[0]} < 0).to({it})")
        elif op in _UNARY_CALL:
            self.emit(n, f"{_UNARY_CALL[op]}({a[0]})")
        else:  # pragma: no cover - every graph op is handled above
            raise NotImplementedError(f"graph operation {op!r} on Triton")

    @staticmethod
    def _inputs(n: Node) -> set:
        """The inputs (score, b, h, q_idx, kv_idx) that ``n`` depends on."""
        return {x.attr for x in ordered([n]) if x.op == "input"}

    @staticmethod
    def _direct_inputs(n: Node) -> set:
        """The inputs that ``n`` depends on other than through a gather's value."""
        seen, out, todo = set(), set(), [n]
        while todo:
            x = todo.pop()
            if x.uid in seen:
                continue
            seen.add(x.uid)
            if x.op == "input":
                out.add(x.attr)
            elif x.op != "gather":
                todo.extend(x.args)
        return out

    @staticmethod
    def _is_tile(n: Node) -> bool:
        """Whether ``n`` is a full tile: it reads the scores, or both index vectors."""
        inputs = _Gen._inputs(n)
        return "score" in inputs or {"q_idx", "kv_idx"} <= inputs

    def body(self, outputs: Sequence[Node]) -> None:
        for n in ordered(outputs):
            self.node(n)


_HELPERS = '''
@triton.jit
def _ifloordiv(a, b):
    """Python's a // b of integers; 0 where b == 0 (NumPy's integer result)."""
    d = tl.where(b == 0, 1, b)
    q = a // d
    r = a - q * d
    q = q - ((r != 0) & ((r < 0) != (d < 0))).to(q.dtype)
    return tl.where(b == 0, 0, q)


@triton.jit
def _imod_py(a, b):
    """Python's a % b of integers; 0 where b == 0 (NumPy's integer result)."""
    d = tl.where(b == 0, 1, b)
    r = a % d
    r = r + tl.where((r != 0) & ((r < 0) != (d < 0)), d, 0)
    return tl.where(b == 0, 0, r)


@triton.jit
def _fmod_py(a, b):
    r = a - b * tl.floor(tl.math.div_rn(a, b))
    return r


@triton.jit
def _fpow(a, b):
    """a ** b as np.power computes it: a negative base takes an integer exponent's sign
    (NaN for another exponent), and b == 0 gives 1 whatever a is."""
    mag = tl.exp2(b * tl.log2(tl.abs(a)))
    whole = tl.floor(b) == b
    odd = whole & (tl.floor(b * 0.5) * 2.0 != b)
    signed = tl.where(odd, -mag, mag)
    r = tl.where(a < 0, tl.where(whole, signed, mag * float("nan")), mag)
    return tl.where(b == 0, 1.0, r)


@triton.jit
def _tanh(x):
    t, _ = _tanh_d(x)
    return t


@triton.jit
def _log1p(x):
    u = 1.0 + x
    d = u - 1.0
    return tl.where(d == 0.0, x, tl.log(u) * tl.math.div_rn(x, tl.where(d == 0.0, 1.0, d)))


@triton.jit
def _expm1(x):
    u = tl.exp(x)
    d = u - 1.0
    lu = tl.log(u)
    small = (u == 1.0) | (lu == 0.0)
    r = tl.where(small, x, d * tl.math.div_rn(x, tl.where(small, 1.0, lu)))
    return tl.where(d == -1.0, -1.0, tl.where(u == float("inf"), u, r))
'''

_PROLOGUE = '''    bb = b.to({it})
    hh = h.to({it})
    qi = q_idx.to({it})
    kj = kv_idx.to({it})
'''


def _full_tile(expr: str, like: str) -> str:
    """expr as a full tile shaped like ``like`` (a constant or a broadcast value)."""
    return f"({expr}) + tl.zeros_like({like})"


def _returned(n: Node, ref: str) -> str:
    """The returned value of float node ``n`` (local ``ref``) as a full fp32 tile: as it is
    where it already is one (it reads the score tile, or both index vectors: elementwise
    ops broadcast them to the tile), else broadcast.  The broadcast adds +0.0, an add per
    element that the compiler must keep (it turns -0.0 into +0.0)."""
    if n.dtype == FLOAT and _Gen._is_tile(n):
        return ref
    return _full_tile(ref, "s")


@dataclass
class Functions:
    """The generated functions of one call and its capture tensors: ``score``,
    ``score_grad`` and ``mask`` (JITFunctions or None), ``caps`` (the tuple of capture
    tensors in slot order; one fp32 placeholder where no function reads a capture),
    ``key`` (the module's hash) and ``dcap`` (the capture gradient function, None unless
    asked for)."""

    score: object
    score_grad: object
    mask: object
    caps: Optional[tuple]
    key: str
    dcap: object = None


def source_of(score_prog, mask_progs: Sequence, itype: str, layouts: Dict[str, tuple],
              slots: Dict[str, Dict[str, int]]) -> str:
    """The module source of a score program (or None) and mask programs."""
    lines = ["import triton", "import triton.language as tl",
             "from anyattn.backends.triton.kernels import _tanh_d, gather_tile", "", _HELPERS]
    pro = _PROLOGUE.format(it=itype)
    if score_prog is not None:
        sl = slots["score"]
        lay = layouts["score"]
        g = _Gen(itype, sl, lay)
        g.body([score_prog.out])
        out = g.ref(score_prog.out)
        lines += ["@triton.jit", "def score(s, b, h, q_idx, kv_idx, valid, CAPS):", pro]
        lines += g.lines
        lines += [f"    return {_returned(score_prog.out, out)}", "", ""]
        dsc, _ = score_prog.grad_nodes(frozenset())
        g2 = _Gen(itype, sl, lay)
        g2.body([score_prog.out, dsc])
        lines += ["@triton.jit", "def score_grad(s, b, h, q_idx, kv_idx, valid, CAPS):", pro]
        lines += g2.lines
        lines += [f"    return ({_returned(score_prog.out, g2.ref(score_prog.out))}, "
                  f"{_returned(dsc, g2.ref(dsc))})", "", ""]
    if mask_progs:
        lines += ["@triton.jit", "def mask(b, h, q_idx, kv_idx, valid, CAPS):", pro]
        keep = "valid"
        for i, mp in enumerate(mask_progs):
            g = _Gen(itype, slots[f"mask{i}"], layouts[f"mask{i}"], prefix=f"m{i}_")
            g.body([mp.out])
            lines += g.lines
            keep = f"({keep}) & ({g.ref(mp.out)})"
        lines += [f"    return {keep}", "", ""]
    return "\n".join(lines) + "\n"


def dcap_source(score_prog, wrt, kinds: Sequence[str], itype: str,
                layouts: Dict[str, tuple], slots: Dict[str, int]) -> str:
    """The module source of ``dcap`` (module doc) for the reads of the captures ``wrt``
    of a score program, of the kinds ``kinds`` (capture_grads.classify, graph order):
    slotted reads store into their region of DCS (capture_grads.layout), column reads
    add to the accumulator ``cacc``, which the function returns."""
    from .capture_grads import PAIR, SLOT_WIDTH, layout, refusal

    if None in kinds:     # (the capability check refuses these before any work)
        raise NotImplementedError(f"the Triton backward {refusal(score_prog, frozenset(wrt))}")
    _, grads = score_prog.grad_nodes(frozenset(wrt))
    g = _Gen(itype, slots, layouts)
    g.body([d for _, d in grads])
    slotted, cols = layout(kinds)
    helpers = "_tanh_d, gather_tile, _dcap_store, _dcap_rows, _dcap_cols" + \
        (", _dcap_tile" if PAIR in kinds else "")
    lines = ["import triton", "import triton.language as tl",
             f"from anyattn.backends.triton.kernels import {helpers}", "", _HELPERS,
             "@triton.jit",
             "def dcap(ds, s, b, h, q_idx, kv_idx, valid, CAPS, DCS, slot, dcs_g, cacc,",
             "         BN: tl.constexpr, BM: tl.constexpr, NCP: tl.constexpr):",
             _PROLOGUE.format(it=itype),
             "    unit = tl.cast(dcs_g, tl.int64)"]
    lines += g.lines
    for i, (_, d) in enumerate(grads):
        term = f"tl.where(valid, ds * ({g.ref(d)}), 0.0)"
        kind = kinds[i]
        if kind == "col":
            lines.append(f"    cacc = _dcap_cols(cacc, {term}, {cols.index(i)}, NCP)")
            continue
        at = slotted.index(i)
        start = " + ".join(SLOT_WIDTH[kinds[k]] for k in slotted[:at]) or "0"
        ptr = f"DCS + unit * ({start}) + slot * {SLOT_WIDTH[kind]}"
        if kind == "row":
            lines.append(f"    _dcap_rows({ptr}, {term}, BM)")
        elif kind == PAIR:
            lines.append(f"    _dcap_tile({ptr}, {term}, BN, BM)")
        else:
            lines.append(f"    _dcap_store({ptr}, {term}, BN, BM, {kind == 'diag'})")
    lines.append("    return cacc")
    return "\n".join(lines) + "\n"


def _load(key: str, src: str):
    """The module of ``src``, kept under ``key`` in this process.  Its file is named
    after the text itself, so a file left by another version of the generator (other
    helpers, other code for the same graph) is never read for this text."""
    with _lock:
        mod = _modules.get(key)
        if mod is not None:
            return mod
        digest = hashlib.blake2b(src.encode(), digest_size=12).hexdigest()
        path = os.path.join(cache_dir(), f"anyattn_fn_{digest}.py")
        if not os.path.exists(path):
            tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
            with open(tmp, "w") as f:
                f.write(src)
            os.replace(tmp, path)
        name = f"anyattn_fn_{digest}"
        spec = importlib.util.spec_from_file_location(name, path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
        _modules[key] = mod
        return mod


def _storage(bp, name: str, torch, dev):
    """A capture as the kernels read it: contiguous, fp32 / int32|int64 / uint8."""
    arr = bp.arrays[name]
    kind = bp.program.specs[name].dtype
    if kind == FLOAT:
        dt = torch.float32
    elif kind == BOOL:
        dt = torch.uint8
    else:
        dt = torch.int32 if bp.idt == np.dtype(np.int32) else torch.int64
    a = np.ascontiguousarray(arr)
    if kind == BOOL:
        a = a.astype(np.uint8)
    t = torch.from_numpy(np.array(a, copy=True)).to(device=dev, dtype=dt)
    return t.reshape(-1).contiguous()


def functions(score_bp, mask_bps: Sequence, dev, wrt=frozenset()) -> Functions:
    """The generated functions of a call's score function (BoundProgram or None) and
    mask functions (BoundPrograms) with their capture tensors on ``dev``; ``wrt``: the
    score function's float captures whose gradients the backward wants (``dcap``).
    Raises NotImplementedError where the functions read more than MAX_CAPTURES captures."""
    import torch

    mask_bps = tuple(mask_bps or ())
    progs = ([("score", score_bp)] if score_bp is not None else []) + \
        [(f"mask{i}", bp) for i, bp in enumerate(mask_bps)]
    wide = any(bp.idt != np.dtype(np.int32) for _, bp in progs)
    itype = "tl.int64" if wide else "tl.int32"
    slots: Dict[str, Dict[str, int]] = {}
    layouts: Dict[str, Dict[str, tuple]] = {}
    caps = []
    for tag, bp in progs:
        slots[tag], layouts[tag] = {}, {}
        for name in sorted(bp.program.specs):
            if name not in {n.attr for n in ordered([bp.program.out]) if n.op == "gather"}:
                continue
            slots[tag][name] = len(caps)
            layouts[tag][name] = tuple(bp.program.specs[name].shape)
            caps.append((bp, name))
    if len(caps) > MAX_CAPTURES:
        names = [n for _, n in caps]
        raise NotImplementedError(
            f"score / mask functions reading {len(caps)} captures {names}: the Triton "
            f"kernels take at most {MAX_CAPTURES}; combine captures into one array (stack "
            "tables along a new axis) or use backend='numpy'")
    ident = repr((score_bp.program.key if score_bp is not None else None,
                  tuple(bp.program.key for bp in mask_bps), itype,
                  sorted((t, sorted(s.items())) for t, s in slots.items()),
                  sorted((t, sorted(s.items())) for t, s in layouts.items())))
    key = hashlib.blake2b(ident.encode(), digest_size=12).hexdigest()
    with _lock:
        mod = _modules.get(key)
    if mod is None:
        src = source_of(score_bp.program if score_bp is not None else None,
                        [bp.program for bp in mask_bps], itype, layouts, slots)
        mod = _load(key, src)
    dcap = None
    if wrt and score_bp is not None:
        from .capture_grads import classify

        kinds = tuple(k for _, k, _ in classify(score_bp.program, wrt))
        dkey = hashlib.blake2b(repr((key, sorted(wrt), kinds)).encode(),
                               digest_size=12).hexdigest()
        with _lock:
            dmod = _modules.get(dkey)
        if dmod is None:
            dmod = _load(dkey, dcap_source(score_bp.program, wrt, kinds, itype,
                                           layouts["score"], slots["score"]))
        dcap = dmod.dcap
    # variable state flows in through the capture tensors only
    tensors = tuple(_storage(bp, name, torch, dev) for bp, name in caps)
    if not tensors:
        tensors = (torch.zeros(1, dtype=torch.float32, device=dev),)
    return Functions(score=getattr(mod, "score", None),
                     score_grad=getattr(mod, "score_grad", None),
                     mask=getattr(mod, "mask", None), caps=tensors, key=key, dcap=dcap)


def of_problem(p, dev) -> Optional[Functions]:
    """The generated functions of problem ``p`` (its score function and mask
    functions, and the capture gradient function where ``p.wrt`` names captures), None
    where it uses neither (the built-in kernels)."""
    mask_fns = p.mask.mask_fns
    if p.score_mod is None and not mask_fns:
        return None
    return functions(p.score_mod, mask_fns or (), dev, p.capture_wrt)


_BLOCK_CACHE_SIZE = 16
_block_cache: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()


def mask_blocks(mask_bps: Sequence, sizes, sb_q: int, sb_k: int, dev):
    """A call's mask functions per mask block: (any kept, all kept), bool
    [Bx, Hx, nQ, nK] on ``dev`` (Bx = B where a function reads b, else 1; Hx likewise),
    evaluated on the device by kernels.mask_blocks_kernel with the generated mask
    function (the function the kernels call on partial blocks).  Cached by the graphs'
    keys, the captures' digests, the sizes and the block size."""
    import torch

    from . import kernels

    B, H, Sq, Sk = sizes
    key = (tuple(bp.program.key for bp in mask_bps), tuple(bp.digest() for bp in mask_bps),
           tuple(sizes), sb_q, sb_k, str(dev))
    with _lock:
        hit = _block_cache.get(key)
        if hit is not None:
            _block_cache.move_to_end(key)
            return hit
    uses = frozenset().union(*(bp.program.uses for bp in mask_bps))
    bx, hx = (B if "b" in uses else 1), (H if "h" in uses else 1)
    nq, nk = -(-Sq // sb_q), -(-Sk // sb_k)
    fns = functions(None, mask_bps, dev)
    any_k = torch.empty((bx, hx, nq, nk), dtype=torch.int8, device=dev)
    all_k = torch.empty((bx, hx, nq, nk), dtype=torch.int8, device=dev)
    if any_k.numel():
        kernels.mask_blocks_kernel[(nq, nk, bx * hx)](any_k, all_k, fns.caps, Sq, Sk, nq, nk,
                                                      hx, SBQ=sb_q, SBK=sb_k, MMOD=fns.mask)
    res = (any_k.bool(), all_k.bool())
    with _lock:
        _block_cache[key] = res
        while len(_block_cache) > _BLOCK_CACHE_SIZE:
            _block_cache.popitem(last=False)
    return res
