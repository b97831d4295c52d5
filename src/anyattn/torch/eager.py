"""The eager path of ``anyattn.torch.attention``: the core called directly.

Shape legend: B batch, Hq/Hkv query/key-value heads, Sq/Sk queries/keys, D head dim;
tensors in the logical layout [B, H, S, D] (any strides).

Outside tracing (torch.compile, export, functorch transforms, dispatch or function
modes, tensor subclasses) there is nothing the custom ops of :mod:`.ops` add to a
call but their per-call dispatch: schema checks, the ``_dynamo``-disabled wrappers and
the no-alias copies, ~0.3 ms of host time per training step on this 2-core CPU
(bench/host_overhead.py).  Here one ``autograd.Function`` validates the call once
(``describe`` with the gradients the backward will need, so a backend that cannot
produce them refuses at the forward), keeps the ``Problem`` and the backend it chose,
and its backward runs that backend on the same Problem with ``wrt`` narrowed to what
autograd asks for: no second validation, the same kernels and formulas as the ops
(tests/torch/test_eager.py holds the two paths to the same bits).

A repeated call with the same shapes, dtypes, devices and options and no dropout skips
the validation too: its Problem is kept per signature (``_problems``, an LRU of
``_PROBLEMS`` entries; the key holds every input ``describe`` reads from such a call),
since ``describe`` of equal inputs gives an equal Problem and raises for none of them.
A Documents / KeepMask mask enters the key by its tensors' shapes, dtypes and devices
only (all ``describe`` reads of them); the kept Problem is then re-masked with this
call's tensors (:func:`_remask`, a fresh ``ResolvedMask``, so nothing derived from the
ids' or keep mask's contents, e.g. a tile map, outlives the call that made it).
"""
from __future__ import annotations

import collections
import copy
import dataclasses
from typing import Optional, Tuple

import torch

from .. import arguments, settings
from ..backends.registry import choose
from ..masks import ResolvedMask
from ..modifiers import NO_MODS
from ..problem import describe
from ..rowstats import RowStats
from .ops import LoweredMask, first_order_only

__all__ = ["eligible", "attention", "clear_caches"]

Tensor = torch.Tensor


def eligible(*tensors: Optional[Tensor]) -> bool:
    """True when no tracer, transform, mode or tensor subclass could see the call, so
    that calling the core directly is indistinguishable from calling the ops."""
    if torch.compiler.is_compiling():
        return False
    try:       # private probes (torch 2.11-2.13); without them, the ops are always right
        if torch._C._len_torch_dispatch_stack() or torch._C._is_torch_function_mode_enabled():
            return False
        if torch._C._functorch.peek_interpreter_stack() is not None:
            return False
    except AttributeError:
        return False
    return all(x is None or type(x) is torch.Tensor for x in tensors)


def _as_torch(x, like: Tensor) -> Tensor:
    """A backend result as a torch tensor on ``like``'s device (NumPy results wrap
    without a copy on the CPU)."""
    if not isinstance(x, torch.Tensor):
        x = torch.from_numpy(x)
    return x if x.device == like.device else x.to(like.device)


def _with_wrt(p, wrt: frozenset):
    """p with another ``wrt`` (a shallow copy: ``dataclasses.replace`` re-runs the
    constructor over all 24 fields, ~10x slower, and nothing else changes)."""
    c = copy.copy(p)
    object.__setattr__(c, "wrt", wrt)
    return c


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


@dataclasses.dataclass
class _Call:
    """The non-tensor part of one call (a plain object: autograd passes it through)."""

    mask: LoweredMask
    scale: float
    backend: Optional[str]
    precision: Optional[str]
    q_offset: int
    k_offset: int
    softcap: Optional[float]
    alibi_slopes: Optional[Tensor]
    dropout_p: float
    dropout_seed: Optional[int]


#: (signature -> (Problem, its forward Problem)) of the calls whose Problem holds no tensor
_problems: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()
_PROBLEMS = 64


def _sig(x):
    return None if x is None else (x.shape, x.dtype, x.device)


def _mask_sig(m: LoweredMask):
    """What ``describe`` reads of the mask's tensors (shapes; keep's device), as a key
    part; None for none; False when :func:`_remask` could not rebuild what ``resolve``
    makes of them (ids not 2-D, keep not 4-D: ``resolve`` would reshape them)."""
    if m.q_ids is None and m.keep is None:
        return None
    if (m.q_ids is not None and (m.q_ids.ndim != 2 or m.k_ids.ndim != 2)) or \
            (m.keep is not None and m.keep.ndim != 4):
        return False
    return (_sig(m.q_ids), _sig(m.k_ids), _sig(m.keep))


def _signature(call: _Call, q, k, v, bias, sinks, wrt):
    """Every input ``describe`` reads from this call, or None when its Problem would hold
    a per-call value (a dropout seed) or a mask ``_remask`` cannot rebuild."""
    m = call.mask
    ms = _mask_sig(m)
    if ms is False or call.dropout_p:
        return None
    return (_sig(q), _sig(k), _sig(v), _sig(bias), _sig(sinks), _sig(call.alibi_slopes),
            m.band_lo, m.band_hi, ms, call.scale, call.precision, call.q_offset,
            call.k_offset, call.softcap, wrt)


#: where _mask_sig's part sits in a signature
_MASK_AT = 8


def _remask(res, q_ids, k_ids, keep):
    """A kept (Problem, forward Problem) with these mask tensors: a fresh
    ``ResolvedMask`` equal to what ``resolve`` gives for them (one 2-D ids pair, one 4-D
    keep, band already shifted by the offsets in the key; no keep_key for torch
    tensors), with an empty tile-map memo."""
    p, pf = res
    old = p.mask
    rm = ResolvedMask(sq=old.sq, sk=old.sk, band_lo=old.band_lo, band_hi=old.band_hi,
                      q_ids=q_ids, k_ids=k_ids, keep=keep)
    p2 = copy.copy(p)
    object.__setattr__(p2, "mask", rm)
    if pf is p:
        return p2, p2
    pf2 = copy.copy(pf)
    object.__setattr__(pf2, "mask", rm)
    return p2, pf2


def _describe(key, call: _Call, q, k, v, bias, sinks, wrt):
    """-> (Problem with ``wrt``, the same with no ``wrt``): every check of the core, once
    per signature (``key``: _signature's, None: not cached)."""
    if key is not None:
        hit = _problems.get(key)
        if hit is not None:
            try:
                _problems.move_to_end(key)
            except KeyError:     # dropped by another thread meanwhile: still valid
                pass
            if key[_MASK_AT] is None:
                return hit
            m = call.mask
            return _remask(hit, m.q_ids, m.k_ids, m.keep)
    p = describe(q, k, v, mask=call.mask, bias=bias, scale=call.scale,
                 precision=call.precision, wrt=wrt or None, q_offset=call.q_offset,
                 k_offset=call.k_offset, softcap=call.softcap,
                 alibi_slopes=call.alibi_slopes, sinks=sinks, dropout_p=call.dropout_p,
                 dropout_seed=call.dropout_seed)
    res = (p, _with_wrt(p, frozenset()) if p.wrt else p)
    if key is not None:
        # kept without the mask's tensors (a keep mask may be large; nothing of this
        # call's contents is kept): _remask puts the next call's in
        _problems[key] = res if key[_MASK_AT] is None else _remask(res, None, None, None)
        try:
            while len(_problems) > _PROBLEMS:
                _problems.popitem(last=False)
        except KeyError:         # emptied by another thread meanwhile
            pass
    return res


#: (signature, backend name, TRITON_INTERPRET) -> the backend ``choose`` gave: what it
#: reads besides the Problem is the name, that variable (the Triton backend's CPU
#: devices, auto-eligibility) and the loaded backends (clear_caches forgets them)
_chosen: dict = {}


def _choose(key, p, name: Optional[str]):
    """choose(p, name), memoised per cached signature (~6-15 us per call saved)."""
    if key is None:
        return choose(p, name)
    ck = (key, name, settings.current().triton_interpret)
    be = _chosen.get(ck)
    if be is None:
        be = choose(p, name)
        if len(_chosen) >= 4 * _PROBLEMS:
            _chosen.clear()
        _chosen[ck] = be
    return be


def clear_caches() -> None:
    """Forget the Problems and backend choices kept per signature (tests; a backend
    registry changed at run time)."""
    _problems.clear()
    _chosen.clear()


def _prepare(call: _Call, q, k, v, bias, sinks, wrt):
    """-> (Problem with ``wrt``, forward Problem, backend, ScoreMods)."""
    key = _signature(call, q, k, v, bias, sinks, wrt)
    p, pf = _describe(key, call, q, k, v, bias, sinks, wrt)
    be = _choose(key, p, call.backend)
    mods = NO_MODS if call.alibi_slopes is None and sinks is None else \
        arguments.score_mods(p, call.alibi_slopes, sinks)
    return p, pf, be, mods


def _run_forward(pf, be, mods, q, k, v, bias) -> Tuple[Tensor, Tensor, Tensor]:
    """pf: the forward Problem (no ``wrt``) -> (out [B, Hq, Sq, Dv], row_max, log_norm
    [B, Hq, Sq]) as torch tensors."""
    if pf.is_empty:
        out = be.zeros_like(q, (pf.batch, pf.heads_q, pf.seq_q, pf.head_dim_v))
        stats = be.empty_stats(pf, q, mods)
    else:
        out, stats = be.forward(pf, q, k, v, arguments.bias_4d(bias, pf), mods)
    sdt = _lse_dtype(q)
    mx, ln = _as_torch(stats.max, q), _as_torch(stats.log_norm, q)
    return (_as_torch(out, q), mx if mx.dtype == sdt else mx.to(sdt),
            ln if ln.dtype == sdt else ln.to(sdt))


class _Attention(torch.autograd.Function):
    """forward(q, k, v, bias, sinks, call, wrt) -> (out, row_max, log_norm); the
    statistics are not differentiable."""

    @staticmethod
    def forward(ctx, q, k, v, bias, sinks, call: _Call, wrt: Tuple[str, ...]):
        p, pf, be, mods = _prepare(call, q, k, v, bias, sinks, wrt)
        out, row_max, log_norm = _run_forward(pf, be, mods, q, k, v, bias)
        ctx.save_for_backward(q, k, v, bias, sinks, out, row_max, log_norm)
        ctx.problem, ctx.backend, ctx.alibi_slopes = p, be, call.alibi_slopes
        ctx.mark_non_differentiable(row_max, log_norm)
        # the statistics never get a gradient: without this autograd would hand the
        # backward two zero-filled [B, Hq, Sq] tensors (2 allocations + 2 fill launches)
        ctx.set_materialize_grads(False)
        return out, row_max, log_norm

    @staticmethod
    def backward(ctx, dout, _dmax, _dlog_norm):
        if dout is None:          # out took no part in what is differentiated
            return (None,) * 7
        q, k, v, bias, sinks, out, row_max, log_norm = ctx.saved_tensors
        with torch.no_grad():
            grads = _backward_grads(ctx, dout, q, k, v, bias, sinks, out, row_max,
                                    log_norm)
        # no double backward: under create_graph=True the gradients raise when
        # differentiated (they are not constants in q, k, v, dout)
        return first_order_only(grads, dout, q, k, v, bias, sinks)


def _backward_grads(ctx, dout, q, k, v, bias, sinks, out, row_max, log_norm):
    """_Attention's gradients (None where autograd asks for none), as plain tensors."""
    wrt = frozenset(n for n, on in zip(("q", "k", "v", "bias", "sinks"),
                                       ctx.needs_input_grad[:5]) if on)
    grads = [None] * 7
    if not wrt:
        return tuple(grads)
    p = ctx.problem if wrt == ctx.problem.wrt else _with_wrt(ctx.problem, wrt)
    mods = NO_MODS if ctx.alibi_slopes is None and sinks is None else \
        arguments.score_mods(p, ctx.alibi_slopes, sinks)
    if p.is_empty:
        res = {"dq": torch.zeros_like(q), "dk": torch.zeros_like(k),
               "dv": torch.zeros_like(v),
               "dbias": None if bias is None else torch.zeros_like(bias),
               "dsinks": None if sinks is None else torch.zeros_like(sinks)}
    else:
        res = ctx.backend.backward(p, q, k, v, dout, out, RowStats(row_max, log_norm),
                                   arguments.bias_4d(bias, p), mods)
    for i, (name, key, like) in enumerate((("q", "dq", q), ("k", "dk", k), ("v", "dv", v),
                                           ("bias", "dbias", bias),
                                           ("sinks", "dsinks", sinks))):
        if name in wrt:
            g = _as_torch(res[key], like)
            grads[i] = g.reshape(like.shape) if tuple(g.shape) != tuple(like.shape) else g
    return tuple(grads)


def attention(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor], keep, q_ids, k_ids,
              band_lo, band_hi, scale: float, backend: Optional[str],
              precision: Optional[str], q_offset: int = 0, k_offset: int = 0,
              softcap: Optional[float] = None, alibi_slopes: Optional[Tensor] = None,
              sinks: Optional[Tensor] = None, dropout_p: float = 0.0,
              dropout_seed: Optional[int] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """The arguments of ``ops.attention_fwd`` (dropout_seed as an int) -> (out, row_max,
    log_norm), differentiable in q, k, v, bias and sinks when grad mode is on."""
    call = _Call(LoweredMask(band_lo, band_hi, q_ids, k_ids, keep), scale, backend,
                 precision, q_offset, k_offset, softcap, alibi_slopes, dropout_p, dropout_seed)
    wrt: Tuple[str, ...] = ()
    if torch.is_grad_enabled():
        wrt = tuple(n for n, x in (("q", q), ("k", k), ("v", v), ("bias", bias),
                                   ("sinks", sinks)) if x is not None and x.requires_grad)
    if not wrt:
        _, pf, be, mods = _prepare(call, q, k, v, bias, sinks, ())
        return _run_forward(pf, be, mods, q, k, v, bias)
    return _Attention.apply(q, k, v, bias, sinks, call, wrt)
