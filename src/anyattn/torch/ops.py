"""The two ``torch.library.custom_op``s behind ``anyattn.torch``: forward and backward.

Shape legend: B batch, Hq/Hkv query/key-value heads, Sq/Sk queries/keys,
D head dim of q and k, Dv of v and out.  Every tensor argument is in the logical
layout [B, H, S, D] (any strides); results come back contiguous.

A mask object (Causal, Window, Documents, KeepMask) is not a tensor, so it
crosses the op boundary already lowered to what every backend consumes
(``anyattn.masks.ResolvedMask``): two optional ints for the band
``band_lo <= j - i <= band_hi``, optional document ids ``q_ids [Bd, Sq]`` /
``k_ids [Bd, Sk]`` and an optional bool ``keep`` broadcastable to
[B, Hq, Sq, Sk].  Only tensors, ints, floats, bools and strings appear in the
schemas, so ``torch.compile(fullgraph=True)`` traces a call as one opaque node
and the fake implementations give its output shapes.

Inside the ops the work is done by the core API (``anyattn.attention`` /
``anyattn.attention_backward``), which validates and dispatches to a backend
(``numpy`` for CPU tensors, ``triton`` for CUDA tensors, or the one named).
The forward keeps only ``out`` and the row statistics (row max and log-normaliser, kept
apart: see ``anyattn.rowstats``) for the backward.  Autograd: registered on
the forward op (used by torch.compile, export and opcheck) and, for eager calls, the
same formulas through a small ``autograd.Function`` (``attention_with_grad``), which
is cheaper per call.  Double backward is not supported: the backward op's autograd
formula raises :data:`DOUBLE_BACKWARD` (so does :func:`first_order_only`, which the
eager path of :mod:`.eager` wraps its gradients in).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from .. import api
from ..masks import Mask
from ..rowstats import RowStats

__all__ = ["attention_fwd", "attention_bwd", "attention_with_grad", "LoweredMask",
           "first_order_only", "DOUBLE_BACKWARD", "seed_value"]

Tensor = torch.Tensor

#: what differentiating a gradient of anyattn (a second-order gradient) raises
DOUBLE_BACKWARD = (
    "double backward (second-order gradients) is not supported by anyattn: the gradients "
    "of anyattn.torch.attention and anyattn.torch.scaled_dot_product_attention are not "
    "differentiable themselves (torch.autograd.grad(..., create_graph=True) followed by a "
    "backward through those gradients, gradgradcheck, Hessian products); use "
    "torch.nn.functional.scaled_dot_product_attention where second-order gradients are "
    "needed, or .detach() the first-order gradients to use them as values")


class _FirstOrderOnly(torch.autograd.Function):
    """apply(n, g_1..g_n, *deps) -> (g_1..g_n) unchanged, on a node whose backward raises
    :data:`DOUBLE_BACKWARD`; ``deps`` (tensors that require grad: what the gradients
    depend on) make autograd record that node."""

    @staticmethod
    def forward(ctx, n, *tensors):
        return tensors[:n]

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(DOUBLE_BACKWARD)


def first_order_only(grads, *deps):
    """The gradients a backward computed (None where not asked for), as they are unless
    that backward records a graph (``create_graph=True``) and some of ``deps`` (the
    tensors they were computed from: dout, q, k, v, ...) require grad: then each one
    carries a node that raises :data:`DOUBLE_BACKWARD` when differentiated, instead of
    standing for a constant (a silently wrong second-order gradient)."""
    if not torch.is_grad_enabled():
        return grads
    deps = [x for x in deps if isinstance(x, Tensor) and x.requires_grad]
    at = [i for i, g in enumerate(grads) if g is not None]
    if not deps or not at:
        return grads
    wrapped = _FirstOrderOnly.apply(len(at), *(grads[i] for i in at), *deps)
    res = list(grads)
    for i, g in zip(at, wrapped):
        res[i] = g
    return tuple(res)


class LoweredMask(Mask):
    """An already lowered mask handed back to the core API (band, ids, keep)."""

    def __init__(self, band_lo, band_hi, q_ids, k_ids, keep):
        self.band_lo, self.band_hi = band_lo, band_hi
        self.q_ids, self.k_ids, self.keep = q_ids, k_ids, keep

    def _lower(self, acc) -> None:
        acc.band(self.band_lo, self.band_hi)
        if self.q_ids is not None:
            acc.documents(self.q_ids, self.k_ids)
        if self.keep is not None:
            acc.keep(self.keep)

    def __repr__(self) -> str:
        return (f"LoweredMask(band=[{self.band_lo}, {self.band_hi}], "
                f"documents={self.q_ids is not None}, keep={self.keep is not None})")


def _as_torch(x, like: Tensor) -> Tensor:
    """A backend result as a contiguous torch tensor on ``like``'s device."""
    if not isinstance(x, torch.Tensor):
        x = torch.from_numpy(x)
    return x.to(like.device).contiguous()


def _empty(like: Tensor) -> Tensor:
    """Placeholder for a gradient that was not asked for."""
    return like.new_empty((0,))


def _distinct(outputs, inputs):
    """The outputs with any that shares storage with an input or an earlier output
    cloned: a custom op's outputs may not alias (a backend may hand back views of one
    buffer, e.g. the row max and log-normaliser of the Triton kernels)."""
    seen = {x.untyped_storage().data_ptr() for x in inputs
            if isinstance(x, torch.Tensor) and x.numel()}
    res = []
    for x in outputs:
        ptr = x.untyped_storage().data_ptr() if x.numel() else None
        if ptr is not None and ptr in seen:
            x = x.clone()
            ptr = x.untyped_storage().data_ptr()
        if ptr is not None:
            seen.add(ptr)
        res.append(x)
    return tuple(res)


def seed_value(t: Optional[Tensor]) -> Optional[int]:
    """The dropout seed a one-element int64 tensor carries (None: no seed)."""
    return None if t is None else int(t.reshape(-1)[0].item())


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


# ----------------------------------------------------------------------- forward
@torch.library.custom_op("anyattn::attention_fwd", mutates_args=())
def attention_fwd(q: Tensor, k: Tensor, v: Tensor, bias: Optional[Tensor],
                  keep: Optional[Tensor], q_ids: Optional[Tensor], k_ids: Optional[Tensor],
                  band_lo: Optional[int], band_hi: Optional[int], scale: float,
                  backend: Optional[str], precision: Optional[str], q_offset: int = 0,
                  k_offset: int = 0, softcap: Optional[float] = None,
                  alibi_slopes: Optional[Tensor] = None,
                  sinks: Optional[Tensor] = None, dropout_p: float = 0.0,
                  dropout_seed: Optional[Tensor] = None) -> Tuple[Tensor, Tensor, Tensor]:
    """-> (out [B, Hq, Sq, Dv] in q's dtype, row_max, log_norm [B, Hq, Sq] float32
    (float64 for float64 q)); lse = row_max + log_norm (the sink included).

    The band is given before the offsets shift it (the core applies
    ``q_offset``/``k_offset`` to the band, ALiBi and dropout alike).  ``dropout_seed``:
    a one-element int64 CPU tensor (a tensor, so that a seed drawn inside a compiled
    graph reaches the op without a graph break)."""
    mask = LoweredMask(band_lo, band_hi, q_ids, k_ids, keep)
    out, st = api.forward_with_stats(q, k, v, mask=mask, bias=bias, scale=scale,
                                     backend=backend, precision=precision,
                                     q_offset=q_offset, k_offset=k_offset, softcap=softcap,
                                     alibi_slopes=alibi_slopes, sinks=sinks,
                                     dropout_p=dropout_p, dropout_seed=seed_value(dropout_seed))
    sdt = _lse_dtype(q)
    return _distinct((_as_torch(out, q), _as_torch(st.max, q).to(sdt),
                      _as_torch(st.log_norm, q).to(sdt)),
                     (q, k, v, bias, keep, q_ids, k_ids, alibi_slopes, sinks))


@attention_fwd.register_fake
def _attention_fwd_fake(q, k, v, bias, keep, q_ids, k_ids, band_lo, band_hi, scale, backend,
                        precision, q_offset=0, k_offset=0, softcap=None, alibi_slopes=None,
                        sinks=None, dropout_p=0.0, dropout_seed=None):
    B, Hq, Sq, _ = q.shape
    return (q.new_empty((B, Hq, Sq, v.shape[-1])),
            q.new_empty((B, Hq, Sq), dtype=_lse_dtype(q)),
            q.new_empty((B, Hq, Sq), dtype=_lse_dtype(q)))


# ---------------------------------------------------------------------- backward
@torch.library.custom_op("anyattn::attention_bwd", mutates_args=())
def attention_bwd(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor,
                  row_max: Tensor, log_norm: Tensor, bias: Optional[Tensor],
                  keep: Optional[Tensor], q_ids: Optional[Tensor],
                  k_ids: Optional[Tensor], band_lo: Optional[int], band_hi: Optional[int],
                  scale: float, backend: Optional[str], precision: Optional[str],
                  grad_q: bool, grad_k: bool, grad_v: bool,
                  grad_bias: bool, q_offset: int = 0, k_offset: int = 0,
                  softcap: Optional[float] = None, alibi_slopes: Optional[Tensor] = None,
                  sinks: Optional[Tensor] = None,
                  grad_sinks: bool = False, dropout_p: float = 0.0,
                  dropout_seed: Optional[Tensor] = None
                  ) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """-> (dq, dk, dv, dbias, dsinks); a gradient not asked for (``grad_*`` False) is an
    empty [0]."""
    wrt = [n for n, on in (("q", grad_q), ("k", grad_k), ("v", grad_v),
                           ("bias", grad_bias and bias is not None),
                           ("sinks", grad_sinks and sinks is not None)) if on]
    if not wrt:
        return _empty(q), _empty(k), _empty(v), _empty(q), _empty(q)
    mask = LoweredMask(band_lo, band_hi, q_ids, k_ids, keep)
    g = api.attention_backward(q, k, v, dout, out=out, lse=RowStats(row_max, log_norm),
                               mask=mask, bias=bias, scale=scale, wrt=wrt, backend=backend,
                               precision=precision, q_offset=q_offset, k_offset=k_offset,
                               softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                               dropout_p=dropout_p, dropout_seed=seed_value(dropout_seed))
    dq = _as_torch(g.dq, q) if grad_q else _empty(q)
    dk = _as_torch(g.dk, k) if grad_k else _empty(k)
    dv = _as_torch(g.dv, v) if grad_v else _empty(v)
    db = _as_torch(g.dbias, bias) if "bias" in wrt else _empty(q)
    ds = _as_torch(g.dsinks, sinks) if "sinks" in wrt else _empty(q)
    return _distinct((dq, dk, dv, db, ds), (dout, q, k, v, out, row_max, log_norm, bias, keep,
                                           q_ids, k_ids, alibi_slopes, sinks))


@attention_bwd.register_fake
def _attention_bwd_fake(dout, q, k, v, out, row_max, log_norm, bias, keep, q_ids, k_ids,
                        band_lo, band_hi, scale, backend, precision, grad_q, grad_k, grad_v,
                        grad_bias, q_offset=0, k_offset=0, softcap=None, alibi_slopes=None,
                        sinks=None, grad_sinks=False, dropout_p=0.0, dropout_seed=None):
    dq = q.new_empty(q.shape) if grad_q else _empty(q)
    dk = k.new_empty(k.shape) if grad_k else _empty(k)
    dv = v.new_empty(v.shape) if grad_v else _empty(v)
    db = bias.new_empty(bias.shape) if (grad_bias and bias is not None) else _empty(q)
    ds = sinks.new_empty(sinks.shape) if (grad_sinks and sinks is not None) else _empty(q)
    return dq, dk, dv, db, ds


def _attention_bwd_backward(ctx, *grads):
    raise RuntimeError(DOUBLE_BACKWARD)


# a backward run with create_graph=True records this node on the gradients it returns
attention_bwd.register_autograd(_attention_bwd_backward)


# ---------------------------------------------------------------------- autograd
#: positions of the differentiable inputs of attention_fwd
_Q, _K, _V, _BIAS, _SINKS = 0, 1, 2, 3, 16
_N_INPUTS = 19


def _full(inputs):
    """The forward's inputs with the defaulted trailing ones filled in."""
    defaults = (0, 0, None, None, None, 0.0, None)
    return tuple(inputs) + defaults[len(inputs) - 12:]


def _setup_context(ctx, inputs, output):
    (q, k, v, bias, keep, q_ids, k_ids, band_lo, band_hi, scale, backend, precision,
     q_offset, k_offset, softcap, alibi_slopes, sinks, dropout_p, dropout_seed) = _full(inputs)
    out, row_max, log_norm = output
    ctx.save_for_backward(q, k, v, bias, keep, q_ids, k_ids, out, row_max, log_norm,
                          alibi_slopes, sinks, dropout_seed)
    ctx.band = (band_lo, band_hi)
    ctx.opts = (scale, backend, precision)
    ctx.mods = (q_offset, k_offset, softcap)
    ctx.dropout_p = dropout_p
    ctx.mark_non_differentiable(row_max, log_norm)


def _backward(ctx, dout, dmax, dlog_norm):
    """dmax/dlog_norm are ignored: the statistics are marked non-differentiable."""
    (q, k, v, bias, keep, q_ids, k_ids, out, row_max, log_norm, alibi_slopes,
     sinks, dropout_seed) = ctx.saved_tensors
    need = tuple(ctx.needs_input_grad) + (False,) * _N_INPUTS
    gq, gk, gv = need[_Q], need[_K], need[_V]
    gb = bias is not None and need[_BIAS]
    gs = sinks is not None and need[_SINKS]
    dq = dk = dv = db = ds = None
    if gq or gk or gv or gb or gs:
        dq, dk, dv, db, ds = attention_bwd(dout, q, k, v, out, row_max, log_norm, bias, keep,
                                           q_ids, k_ids, ctx.band[0], ctx.band[1],
                                           *ctx.opts, gq, gk, gv, gb, *ctx.mods,
                                           alibi_slopes, sinks, gs, ctx.dropout_p,
                                           dropout_seed)
    grads = [None] * len(ctx.needs_input_grad)
    for pos, on, val in ((_Q, gq, dq), (_K, gk, dk), (_V, gv, dv), (_BIAS, gb, db),
                         (_SINKS, gs, ds)):
        if on:
            grads[pos] = val
    return tuple(grads)


attention_fwd.register_autograd(_backward, setup_context=_setup_context)


# ------------------------------------------------------------------ eager fast path
class _EagerAttention(torch.autograd.Function):
    """The same forward op and the same formulas as ``register_autograd`` above, for
    eager mode, minus torch's per-call custom-op autograd wrapper: its
    ``torch._library.utils.fill_defaults`` rebuilds the 19-argument schema list once
    per argument, ~30-60 us per call here, more than the rest of the wrapper.
    Inside ``forward`` grad mode is off, so the op takes its no-grad path."""

    @staticmethod
    def forward(ctx, *inputs):
        outputs = attention_fwd(*inputs)
        _setup_context(ctx, inputs, outputs)
        ctx.set_materialize_grads(False)   # no zero-filled gradients for the statistics
        return outputs

    @staticmethod
    def backward(ctx, dout, dmax, dlog_norm):
        if dout is None:                   # out took no part in what is differentiated
            return (None,) * len(ctx.needs_input_grad)
        return _backward(ctx, dout, dmax, dlog_norm)


def _functorch_active() -> bool:
    try:
        return torch._C._functorch.peek_interpreter_stack() is not None
    except AttributeError:
        return False


def attention_with_grad(*inputs) -> Tuple[Tensor, Tensor, Tensor]:
    """``attention_fwd(*inputs)`` with autograd: the registered autograd when tracing
    (torch.compile, export, opcheck), the fast path above in eager mode; the plain op
    when nothing needs a gradient (so ``torch.vmap`` of a forward works).  Gradients
    through torch.func transforms are refused: neither autograd formula here runs
    under them."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled() or not any(
            isinstance(x, Tensor) and x.requires_grad for x in inputs):
        return attention_fwd(*inputs)
    if _functorch_active():
        raise NotImplementedError(
            "anyattn.torch.attention: gradients through torch.func transforms (grad, "
            "vjp, jacrev, jvp, or vmap of a function whose inputs require grad) are not "
            "supported; use torch.autograd (loss.backward() or torch.autograd.grad), or "
            "torch.vmap under torch.no_grad() for the forward")
    return _EagerAttention.apply(*inputs)
