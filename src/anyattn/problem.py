"""One validated description of an attention call.

Shape legend: B batch, Hq query heads, Hkv key/value heads (G = Hq / Hkv),
Sq queries, Sk keys, D head dim of q and k, Dv head dim of v (and of out / dout;
Dv may differ from D).  Logical layout [B, H, S, D]; any strides.

Validation happens here, once, at the API boundary: every error names the
argument, what was given, what was expected and the remedy.
"""
from __future__ import annotations

import functools
import math
import numbers
import operator
from dataclasses import dataclass
from typing import Any, FrozenSet, Iterable, Optional, Tuple

import numpy as np

from .arrays import array_kind, device_name, dtype_name
from .dropout import U32_LIMIT, check_dropout
from .features import features_of
from .masks import AndMask, Causal, Mask, ResolvedMask, Window, resolve

__all__ = ["Problem", "describe", "FLOAT_DTYPES", "PRECISIONS", "GRAD_NAMES"]

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
#: "highest": fp32 inputs computed to <= 1e-5 relative error (IEEE or 3xTF32);
#: "tf32": explicit opt-in to single-pass TF32 tensor cores for fp32 inputs.
PRECISIONS = ("highest", "tf32")
GRAD_NAMES = ("q", "k", "v", "bias", "sinks")


@dataclass(frozen=True, eq=False)
class Problem:
    """Sizes, dtype, device, mask and options of one call (no tensor data)."""

    batch: int
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_k: int
    head_dim: int           # D: q's and k's head dim (the default scale uses it)
    head_dim_v: int         # Dv: v's head dim, and out's / dout's
    dtype: str              # 'float32', 'bfloat16', ...
    array_kind: str         # 'numpy' | 'torch'
    device: str             # 'cpu', 'cuda:0', ...
    scale: float
    mask: ResolvedMask
    bias_shape: Optional[Tuple[int, int, int, int]]  # 4-D, broadcastable to [B,Hq,Sq,Sk]
    bias_dtype: Optional[str]
    precision: str
    wrt: FrozenSet[str]     # gradients asked for (backward); empty for forward
    q_offset: int = 0
    k_offset: int = 0
    softcap: Optional[float] = None                 # c > 0: s = c·tanh(scale·qk / c)
    alibi_shape: Optional[Tuple[int, int]] = None   # (Ba, Hq), Ba in {1, B}
    alibi_dtype: Optional[str] = None
    sinks_dtype: Optional[str] = None               # None: no sinks; else sinks [Hq]
    dropout_p: float = 0.0                          # keep = anyattn.dropout_mask(...)
    dropout_seed: Optional[int] = None              # an int in [0, 2**64) when p > 0
    score_mod: Any = None                           # a BoundProgram (anyattn.programs)
    pages: Any = None                               # a PagedKV (anyattn.paged): k/v are pages
    #: the slopes of a score function that spelled ALiBi (anyattn.programs.builtin_forms),
    #: in q's library and device: ``arguments.score_mods`` passes them as alibi_slopes
    matched_alibi: Any = None

    @property
    def capture_wrt(self) -> FrozenSet[str]:
        """The score_mod captures whose gradients ``wrt`` asks for."""
        return self.wrt - frozenset(GRAD_NAMES)

    @functools.cached_property
    def features(self) -> FrozenSet[str]:
        """The names of the features this problem uses (:data:`anyattn.features.FEATURES`:
        mask terms, inputs, gradients, modifiers)."""
        return features_of(self)

    @property
    def has_dropout(self) -> bool:
        return self.dropout_p > 0.0

    @property
    def has_alibi(self) -> bool:
        return self.alibi_shape is not None

    @property
    def has_sinks(self) -> bool:
        return self.sinks_dtype is not None

    @property
    def has_modifiers(self) -> bool:
        """softcap, ALiBi or sinks present."""
        return self.softcap is not None or self.has_alibi or self.has_sinks

    @property
    def group(self) -> int:
        """G = Hq / Hkv: query heads that share one key/value head."""
        return self.heads_q // self.heads_kv

    @property
    def has_bias(self) -> bool:
        return self.bias_shape is not None

    @property
    def is_empty(self) -> bool:
        """No output element to compute, or every row is empty (Sk == 0)."""
        return 0 in (self.batch, self.heads_q, self.seq_q, self.seq_k)

    @property
    def mask_class(self) -> str:
        """A coarse label for configs and benchmarks: none/band/documents/keep/mixed."""
        parts = self.mask.terms
        if not parts:
            return "none"
        return parts[0] if len(parts) == 1 else "+".join(parts)

    def flops(self, backward: bool = False) -> float:
        """FLOPs by the FlashAttention convention: fwd 2*B*Hq*Sq*Sk*(D + Dv) (q·kᵀ, P·v),
        bwd 2*B*Hq*Sq*Sk*(3*D + 2*Dv) (q·kᵀ, dout·vᵀ, dv, dq, dk; 2.5x the forward when
        Dv == D); one causal band halves it; other masks are not discounted."""
        d, dv = self.head_dim, self.head_dim_v
        f = 2.0 * self.batch * self.heads_q * self.seq_q * self.seq_k * \
            ((3 * d + 2 * dv) if backward else (d + dv))
        if self.mask.terms == ("band",) and self.mask.band_hi is not None \
                and self.mask.band_lo is None:
            f *= 0.5
        return f


def _fail(exc, msg):
    raise exc(msg)


def _describe_tensor(name: str, x: Any) -> str:
    return f"{name} (shape {tuple(x.shape)}, dtype {dtype_name(x)})"


#: the largest finite value of the dtype the scores are computed in (float32 for
#: fp16/bf16/fp32 inputs, float64 for float64).
_COMPUTE_MAX = {"float64": 1.7976931348623157e308}
_F32_MAX = 3.4028234663852886e38


def _check_plain(name: str, x: Any) -> None:
    """NumPy arrays whose values the backends would misread: masked arrays (the mask
    would be ignored) and non-native byte order (big-endian on this machine)."""
    import numpy as np

    if not isinstance(x, np.ndarray):
        return
    if isinstance(x, np.ma.MaskedArray):
        _fail(TypeError, f"{name}: is a NumPy masked array; its mask would be ignored. Pass "
                         f"a plain array ({name}.filled(value)) and express masked keys with "
                         "mask=KeepMask(...) or a -inf bias")
    if not x.dtype.isnative:
        _fail(TypeError, f"{name}: dtype {x.dtype.str} is {x.dtype.newbyteorder('=').name} in "
                         "non-native (big-endian) byte order; convert it with "
                         f"{name}.astype({name}.dtype.newbyteorder('='))")


def _check_tensor(name: str, x: Any, kind: Optional[str]) -> str:
    k = array_kind(x)
    if k is None:
        _fail(TypeError, f"{name}: expected a NumPy array or torch tensor, got "
                         f"{type(x).__name__}; convert it with np.asarray(...)")
    _check_plain(name, x)
    if kind is not None and k != kind:
        _fail(TypeError, f"{name}: is a {k} array but q is a {kind} array; pass all "
                         "inputs from the same library")
    if x.ndim != 4:
        _fail(ValueError, f"{name}: expected 4 dims [B, H, S, D] (or [B, S, H, D] with "
                          f"layout='bshd'), got shape {tuple(x.shape)}; add the missing "
                          "dims with x[None] / reshape")
    dt = dtype_name(x)
    if dt not in FLOAT_DTYPES:
        _fail(TypeError, f"{name}: dtype {dt} is not a floating type; expected one of "
                         f"{FLOAT_DTYPES}")
    return k


def _same(name: str, x: Any, ref_dtype: str, ref_device: str) -> None:
    if dtype_name(x) != ref_dtype:
        _fail(TypeError, f"{_describe_tensor(name, x)}: dtype differs from q's {ref_dtype}; "
                         "cast every input to one dtype")
    if device_name(x) != ref_device:
        _fail(ValueError, f"{name}: is on {device_name(x)} but q is on {ref_device}; move "
                          "every input to one device")


def _broadcast4(name: str, shape: Tuple[int, ...], target: Tuple[int, int, int, int]):
    if len(shape) > 4:
        _fail(ValueError, f"{name}: shape {shape} has more than 4 dims; expected a shape "
                          f"broadcastable to [B, Hq, Sq, Sk] = {list(target)}")
    s4 = (1,) * (4 - len(shape)) + tuple(shape)
    for ax, (have, want) in enumerate(zip(s4, target)):
        if have not in (1, want):
            want_s = "1" if want == 1 else f"1 or {want}"
            _fail(ValueError, f"{name}: shape {tuple(shape)} does not broadcast to "
                              f"[B, Hq, Sq, Sk] = {list(target)} (dim {ax - 4} is {have}, "
                              f"expected {want_s})")
    return s4


def _check_softcap(softcap) -> Optional[float]:
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not isinstance(softcap, numbers.Real):
        _fail(TypeError, f"softcap: expected a positive float or None, got "
                         f"{type(softcap).__name__}")
    c = float(softcap)
    if not math.isfinite(c) or c <= 0:
        _fail(ValueError, f"softcap: {c} is not a positive finite float; expected c > 0 "
                          "(scores become c·tanh(s / c)), or None for no capping")
    return c


def _check_mod_array(name: str, x, kind: str, dt: str, dev: str,
                     shapes: Tuple[Tuple[int, ...], ...], legend: str) -> Tuple[int, ...]:
    """alibi_slopes / sinks: the caller's library, q's device, q's dtype or float32,
    one of ``shapes``."""
    xk = array_kind(x)
    if xk is None:
        _fail(TypeError, f"{name}: expected a {kind} array {legend}, got {type(x).__name__}")
    if xk != kind:
        _fail(TypeError, f"{name}: is a {xk} array but q is a {kind} array; pass all "
                         "inputs from the same library")
    _check_plain(name, x)
    xdt = dtype_name(x)
    if xdt not in (dt, "float32"):
        want = "float32" if dt == "float32" else f"q's dtype {dt} or float32"
        _fail(TypeError, f"{name}: dtype {xdt}; expected {want}")
    if device_name(x) != dev:
        _fail(ValueError, f"{name}: is on {device_name(x)} but q is on {dev}; move it to "
                          "q's device")
    shape = tuple(int(n) for n in x.shape)
    if shape not in shapes:
        _fail(ValueError, f"{name}: shape {shape}; expected {legend} = "
                          + " or ".join(str(list(s)) for s in shapes))
    return shape


def _check_score_mod(score_mod, sizes, dev: str, alibi_slopes):
    """score_mod= -> a BoundProgram for these sizes (captures on q's device, every
    capture index in range), or None."""
    if score_mod is None:
        return None
    from .programs.mods import as_score_mod

    sm = as_score_mod(score_mod)
    for name, arr in sm.captures.items():
        # WebGPU device arrays take host (NumPy) captures: uploaded per call, as masks are
        if device_name(arr) != dev and not (dev.startswith("webgpu:")
                                            and device_name(arr) == "cpu"):
            _fail(ValueError, f"score_mod {sm.name!r}: capture {name!r} is on "
                              f"{device_name(arr)} but q is on {dev}; move it to q's device")
    if alibi_slopes is not None:
        _fail(NotImplementedError, "score_mod with alibi_slopes: not supported together; "
                                   "write the ALiBi term inside the score function "
                                   "(score - slopes[h] * abs(q_idx - kv_idx), slopes a "
                                   "capture)")
    return sm.bind(sizes)


#: signature -> Problem of the calls ``describe`` accepted whose Problem holds no array
#: (a mask of band terms only; see :func:`_signature`); cleared when full.
_PROBLEMS: dict = {}
_PROBLEMS_MAX = 256
#: mask types whose Problem part is a pure function of their (hashable, by-value) fields
_BAND_MASKS = (Causal, Window)
#: scalar argument types keyed by value (bool apart from int: describe refuses it where
#: it wants an int); anything else (np.int64, 0-d arrays, Fractions...) is not cached
_PLAIN = (type(None), int, float, str, bool)


def _arr_sig(x):
    """Everything ``describe`` reads of an array: its type (NumPy masked arrays, torch,
    device arrays), shape, dtype (byte order included) and device."""
    if x is None:
        return None
    t = type(x)
    if t is np.ndarray:
        return (x.shape, x.dtype)          # always 'cpu'
    return (t, tuple(x.shape), x.dtype, device_name(x))


def _scalar_sig(v):
    t = type(v)
    if t not in _PLAIN:
        raise _Uncached
    if t is float:
        return (t, v, math.copysign(1.0, v))      # -0.0 apart from 0.0
    return (t, v)


class _Uncached(Exception):
    """An argument the signature cannot hold: describe runs in full."""


def _mask_sig(mask):
    if mask is None:
        return None
    t = type(mask)
    if t in _BAND_MASKS:
        return mask
    if t is AndMask and all(type(m) in _BAND_MASKS for m in mask.terms):
        return mask
    raise _Uncached


def _signature(q, k, v, dout, out, lse, mask, bias, scale, precision, wrt, q_offset,
               k_offset, softcap, alibi_slopes, sinks, dropout_p, dropout_seed):
    """Every input ``describe`` reads, by value (arrays: type, shape, dtype, device;
    never their contents: a Problem cached here holds no array), or None when one of
    them cannot be keyed (a Documents / KeepMask mask, an iterator ``wrt``, a scalar of
    another type)."""
    try:
        if wrt is not None and type(wrt) is not str:
            if type(wrt) not in (tuple, list, frozenset):
                return None
            wrt = (type(wrt), tuple(wrt) if type(wrt) is not frozenset else wrt)
        return (_arr_sig(q), _arr_sig(k), _arr_sig(v), _arr_sig(dout), _arr_sig(out),
                _arr_sig(lse), _mask_sig(mask), _arr_sig(bias), _scalar_sig(scale),
                _scalar_sig(precision), wrt, _scalar_sig(q_offset), _scalar_sig(k_offset),
                _scalar_sig(softcap), _arr_sig(alibi_slopes), _arr_sig(sinks),
                _scalar_sig(dropout_p), _scalar_sig(dropout_seed))
    except (_Uncached, AttributeError, TypeError):   # not an array: describe says so
        return None


def clear_cache() -> None:
    """Forget the Problems kept per signature (tests)."""
    _PROBLEMS.clear()


def describe(q, k, v, *, dout=None, out=None, lse=None, mask: Optional[Mask] = None,
             bias=None, scale: Optional[float] = None, precision: Optional[str] = None,
             wrt: Optional[Iterable[str]] = None, q_offset: int = 0,
             k_offset: int = 0, softcap: Optional[float] = None, alibi_slopes=None,
             sinks=None, dropout_p: float = 0.0, dropout_seed: Optional[int] = None,
             score_mod=None) -> Problem:
    """Validate a call's inputs (already in [B, H, S, D] logical layout) -> Problem.

    A call equal to an accepted one in everything validation reads (array types, shapes,
    dtypes, devices; scalars by type and value; a mask of Causal / Window terms) gets
    that call's Problem back without the checks (frozen, it holds no array); a call
    with a Documents / KeepMask mask is validated in full every time.

    ``wrt``: the gradients a backward computes (a subset of :data:`GRAD_NAMES` and the
    names of ``score_mod``'s float captures); None describes a forward.
    ``score_mod``: a score function or ``anyattn.ScoreMod``, bound here to the problem's
    sizes (its capture indices checked); ``Problem.score_mod`` holds the bound program.  A backward (``dout`` given) with ``wrt=None`` is a
    TypeError: an explicit None would otherwise compute nothing without a word.
    ``q_offset``/``k_offset``: any integer (``operator.index``: int, np.int64, ...),
    not bool or float.  ``scale`` must be finite in the compute dtype (float32 for
    16/32-bit inputs, float64 for float64).  NumPy masked arrays and non-native byte
    orders are refused (the mask / the byte order would be misread).
    """
    key = None if score_mod is not None else \
        _signature(q, k, v, dout, out, lse, mask, bias, scale, precision, wrt, q_offset,
                   k_offset, softcap, alibi_slopes, sinks, dropout_p, dropout_seed)
    if key is not None:
        try:
            p = _PROBLEMS.get(key)
        except TypeError:       # an unhashable part (a shape or dtype of an odd array)
            key = p = None
        if p is not None:
            return p
    p = _describe(q, k, v, dout, out, lse, mask, bias, scale, precision, wrt, q_offset,
                  k_offset, softcap, alibi_slopes, sinks, dropout_p, dropout_seed, score_mod)
    if key is not None:
        if len(_PROBLEMS) >= _PROBLEMS_MAX:
            _PROBLEMS.clear()
        _PROBLEMS[key] = p
    return p


def _describe(q, k, v, dout, out, lse, mask, bias, scale, precision, wrt, q_offset,
              k_offset, softcap, alibi_slopes, sinks, dropout_p, dropout_seed,
              score_mod=None) -> Problem:
    """describe's checks, in full."""
    kind = _check_tensor("q", q, None)
    _check_tensor("k", k, kind)
    _check_tensor("v", v, kind)
    dt, dev = dtype_name(q), device_name(q)
    _same("k", k, dt, dev)
    _same("v", v, dt, dev)
    B, Hq, Sq, D = (int(s) for s in q.shape)
    Bk, Hkv, Sk, Dk = (int(s) for s in k.shape)
    Dv = int(v.shape[3])
    if Bk != B:
        _fail(ValueError, f"k: batch {Bk} differs from q's batch {B} (q {tuple(q.shape)}, "
                          f"k {tuple(k.shape)})")
    if Dk != D:
        _fail(ValueError, f"k: head_dim {Dk} differs from q's head_dim {D} (q "
                          f"{tuple(q.shape)}, k {tuple(k.shape)})")
    if tuple(v.shape[:3]) != (Bk, Hkv, Sk):
        _fail(ValueError, f"v: shape {tuple(v.shape)} does not match k's {tuple(k.shape)} in "
                          "[B, Hkv, Sk]; expected v [B, Hkv, Sk, Dv] = "
                          f"[{Bk}, {Hkv}, {Sk}, Dv] (Dv may differ from D)")
    if D < 1:
        _fail(ValueError, f"q: head_dim is {D}; expected at least 1")
    if Dv < 1:
        _fail(ValueError, f"v: head_dim is {Dv} (v {tuple(v.shape)}); expected at least 1")
    if Hkv == 0 or Hq % Hkv != 0:
        _fail(ValueError, f"k: {Hkv} key/value heads do not divide q's {Hq} query heads; "
                          "GQA/MQA needs Hq to be a multiple of Hkv")
    for name, x in (("dout", dout), ("out", out)):
        if x is None:
            continue
        _check_tensor(name, x, kind)
        _same(name, x, dt, dev)
        if tuple(x.shape) != (B, Hq, Sq, Dv):
            _fail(ValueError, f"{name}: shape {tuple(x.shape)}; expected [B, Hq, Sq, Dv] = "
                              f"{[B, Hq, Sq, Dv]} (q {tuple(q.shape)}, v {tuple(v.shape)})")
    if dout is not None and wrt is None:
        _fail(TypeError, "wrt=None: name the gradients to compute, e.g. wrt=('q', 'k', 'v') "
                         "(the default) or any subset of ('q', 'k', 'v', 'bias', 'sinks')")
    if lse is not None:
        if array_kind(lse) != kind:
            _fail(TypeError, f"lse: expected a {kind} array, got {type(lse).__name__}")
        _check_plain("lse", lse)
        if tuple(lse.shape) != (B, Hq, Sq):
            _fail(ValueError, f"lse: shape {tuple(lse.shape)}; expected [B, Hq, Sq] = "
                              f"{[B, Hq, Sq]}, as returned by attention(..., return_lse=True)")
        if dtype_name(lse) not in ("float32", "float64"):
            _fail(TypeError, f"lse: dtype {dtype_name(lse)}; expected float32 (or float64)")
        if device_name(lse) != dev:
            _fail(ValueError, f"lse: is on {device_name(lse)} but q is on {dev}")
    if (out is None) != (lse is None):
        _fail(ValueError, "out and lse: pass both (from attention(..., return_lse=True)) or "
                          "neither (the backward then recomputes them)")

    bias_shape = bias_dtype = None
    if bias is not None:
        bk = array_kind(bias)
        if bk != kind:
            _fail(TypeError, f"bias: expected a {kind} array like q, got {type(bias).__name__}")
        _check_plain("bias", bias)
        bias_dtype = dtype_name(bias)
        if bias_dtype not in (dt, "float32"):
            want = "float32" if dt == "float32" else f"q's dtype {dt} or float32"
            _fail(TypeError, f"bias: dtype {bias_dtype}; expected {want}")
        if device_name(bias) != dev:
            _fail(ValueError, f"bias: is on {device_name(bias)} but q is on {dev}")
        bias_shape = _broadcast4("bias", tuple(int(s) for s in bias.shape), (B, Hq, Sq, Sk))

    if scale is None:
        scale = 1.0 / math.sqrt(D)
    else:
        if isinstance(scale, (str, bytes, bool, np.bool_)):
            _fail(TypeError, f"scale: expected a float, got {type(scale).__name__}")
        try:
            scale = float(scale)
        except (TypeError, ValueError):
            _fail(TypeError, f"scale: expected a float, got {type(scale).__name__}")
        if not math.isfinite(scale):
            _fail(ValueError, f"scale: {scale} is not finite; expected a finite float "
                              "(default 1/sqrt(D))")
        limit = _COMPUTE_MAX.get(dt, _F32_MAX)
        if abs(scale) > limit:
            comp = "float64" if dt == "float64" else "float32"
            _fail(ValueError, f"scale: {scale:g} overflows the {comp} the scores of {dt} "
                              f"inputs are computed in (|scale| <= {limit:.6g}); expected a "
                              "finite float (default 1/sqrt(D))")

    softcap = _check_softcap(softcap)
    alibi_shape = alibi_dtype = sinks_dtype = None
    if alibi_slopes is not None:
        sh = _check_mod_array("alibi_slopes", alibi_slopes, kind, dt, dev,
                              ((Hq,), (B, Hq)), "[Hq] or [B, Hq]")
        alibi_shape = (1, Hq) if len(sh) == 1 else (B, Hq)
        alibi_dtype = dtype_name(alibi_slopes)
    if sinks is not None:
        _check_mod_array("sinks", sinks, kind, dt, dev, ((Hq,),), "[Hq]")
        sinks_dtype = dtype_name(sinks)

    smod = _check_score_mod(score_mod, (B, Hq, Sq, Sk), dev, alibi_slopes)

    if precision is None:
        precision = "highest"
    if precision not in PRECISIONS:
        _fail(ValueError, f"precision={precision!r} is unknown; expected one of {PRECISIONS} "
                          "or None (= 'highest')")

    wrt_set: FrozenSet[str] = frozenset()
    if wrt is not None:
        if isinstance(wrt, str):
            wrt = (wrt,)
        wrt_list = list(wrt)
        caps = () if smod is None else smod.program.float_captures()
        bad = [w for w in wrt_list if w not in GRAD_NAMES and w not in caps]
        if bad:
            other = [] if smod is None else [n for n in bad if n in smod.program.specs]
            if other:
                _fail(ValueError, f"wrt: score_mod capture(s) {other} are not float arrays; "
                                  "only float captures have gradients")
            _fail(ValueError, f"wrt: {bad} not understood; expected a subset of "
                              f"{GRAD_NAMES + tuple(caps)}"
                              + (" (the names after 'sinks' are score_mod captures)"
                                 if caps else ""))
        if not wrt_list:
            _fail(ValueError, "wrt: is empty; ask for at least one of "
                              f"{', '.join(repr(n) for n in GRAD_NAMES)}")
        if "bias" in wrt_list and bias is None:
            _fail(ValueError, "wrt: 'bias' was asked for but no bias was given")
        if "sinks" in wrt_list and sinks is None:
            _fail(ValueError, "wrt: 'sinks' was asked for but no sinks were given")
        wrt_set = frozenset(wrt_list)

    offsets = []
    for name, val in (("q_offset", q_offset), ("k_offset", k_offset)):
        if isinstance(val, bool):
            _fail(TypeError, f"{name}: expected an int, got bool")
        try:
            offsets.append(operator.index(val))     # int, np.int64, 0-d integer arrays...
        except TypeError:
            _fail(TypeError, f"{name}: expected an int, got {type(val).__name__}")
    q_offset, k_offset = offsets

    dropout_p, dropout_seed = check_dropout(dropout_p, dropout_seed)
    if dropout_p > 0:
        for name, off, n in (("q_offset", q_offset, Sq), ("k_offset", k_offset, Sk)):
            if off < 0 or off + n > U32_LIMIT:
                _fail(ValueError, f"{name}: positions {off}..{off + n - 1} leave [0, 2**32); "
                                  "dropout counts global positions as 32-bit unsigned ints")

    rmask = resolve(mask, B, Hq, Sq, Sk, q_offset=q_offset, k_offset=k_offset)
    if smod is not None:        # a function spelling a band mask or softcap runs as those
        from .programs.builtin_forms import lower_to_builtins

        smod, rmask, softcap = lower_to_builtins(smod, rmask, softcap)
    matched_alibi = None
    if smod is not None:
        smod, matched_alibi, alibi_shape, alibi_dtype = _match_alibi(
            smod, Sk - Sq + q_offset - k_offset, wrt_set, kind, dt, dev, alibi_shape,
            alibi_dtype)
    if rmask.keep is not None and array_kind(rmask.keep) == "torch" and kind == "torch":
        if str(rmask.keep.device) != dev:
            _fail(ValueError, f"mask: KeepMask is on {rmask.keep.device} but q is on {dev}")
    return Problem(batch=B, heads_q=Hq, heads_kv=Hkv, seq_q=Sq, seq_k=Sk, head_dim=D,
                   head_dim_v=Dv,
                   dtype=dt, array_kind=kind, device=dev, scale=scale, mask=rmask,
                   bias_shape=bias_shape, bias_dtype=bias_dtype, precision=precision,
                   wrt=wrt_set, q_offset=q_offset, k_offset=k_offset, softcap=softcap,
                   alibi_shape=alibi_shape, alibi_dtype=alibi_dtype, sinks_dtype=sinks_dtype,
                   dropout_p=dropout_p, dropout_seed=dropout_seed, score_mod=smod,
                   matched_alibi=matched_alibi)


def _match_alibi(smod, diag, wrt, kind, dt, dev, alibi_shape, alibi_dtype):
    """A score function that spells ALiBi exactly runs as ``alibi_slopes=`` on every
    backend: -> (score function or None, slopes in q's library / device / dtype rule
    or None, alibi_shape, alibi_dtype)."""
    from .programs.builtin_forms import alibi_slopes_of

    if kind == "webgpu":      # device arrays take device slopes only: the function runs
        return smod, None, alibi_shape, alibi_dtype
    hit = alibi_slopes_of(smod, diag, wrt)
    if hit is None:
        return smod, None, alibi_shape, alibi_dtype
    slopes, per_batch = hit
    slopes = slopes.astype(np.float64 if dt == "float64" else np.float32)
    B, Hq = smod.sizes[0], smod.sizes[1]
    shape = (B, Hq) if per_batch else (1, Hq)
    slopes = np.ascontiguousarray(slopes.reshape(shape))
    if kind == "torch":
        import torch

        slopes = torch.from_numpy(slopes).to(dev)
    return None, slopes, shape, dtype_name(slopes)


#: the per-array checks of :func:`describe` (library, plain array, 4 dims, float dtype;
#: q's dtype and device), for the other input forms that validate arrays of their own
#: (:mod:`anyattn.paged`)
check_array = _check_tensor
check_like_q = _same
