"""Score and mask functions under ``anyattn.torch.attention``: CPU tensors through the
core's backends (NumPy, or the reference when named), differentiable by autograd in q,
k, v, bias, sinks and the score function's float captures that require grad.

Shape legend: B batch, Hq/Hkv heads, Sq/Sk queries/keys, D head dim.

Not under ``torch.compile`` (the function is traced by anyattn, not by Dynamo); on CUDA
tensors the Triton kernels run forward and backward, the gradients of captures included
where the Triton backward computes them (captures read at indices of b, h and one of
q_idx - kv_idx, q_idx or kv_idx: anyattn.backends.triton.capture_grads); a captured
tensor that requires grad and is read otherwise raises NotImplementedError in the
forward, before any work.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, Optional, Tuple

import torch

from .. import api
from ..masks import AndMask, Mask, OrMask
from ..programs.mods import MaskMod, ScoreMod, as_score_mod

__all__ = ["uses_functions", "attention"]


def uses_functions(mask: Optional[Mask], score_mod) -> bool:
    """Does the call use a score function, a MaskMod or a | of mask terms?"""
    if score_mod is not None:
        return True
    terms = mask.terms if isinstance(mask, AndMask) else (mask,)
    return any(isinstance(t, (MaskMod, OrMask)) for t in terms)


def _detached(sm: ScoreMod, caps: Tuple[torch.Tensor, ...], names) -> ScoreMod:
    """The same traced function reading the detached captures."""
    out = copy.copy(sm)
    out.captures = dict(sm.captures)
    for n, t in zip(names, caps):
        out.captures[n] = t.detach()
    return out


class _ProgramAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, bias, sinks, spec: Dict[str, Any], *caps):
        sm = spec["score_mod"]
        if sm is not None:
            sm = _detached(sm, caps, spec["names"])
        kw = dict(spec["kw"], score_mod=sm)
        det = [None if x is None else x.detach() for x in (q, k, v, bias, sinks)]
        out, stats = api.forward_with_stats(det[0], det[1], det[2], bias=det[3],
                                            sinks=det[4], **kw)
        ctx.save_for_backward(*(x for x in det if x is not None))
        ctx.present = [x is not None for x in det]
        ctx.kw, ctx.names, ctx.out, ctx.stats = kw, spec["names"], out, stats
        return out, stats.max, stats.log_norm

    @staticmethod
    def backward(ctx, dout, _dmax, _dlog):
        it = iter(ctx.saved_tensors)
        q, k, v, bias, sinks = (next(it) if p else None for p in ctx.present)
        need = ctx.needs_input_grad
        wrt = tuple(n for n, i in (("q", 0), ("k", 1), ("v", 2), ("bias", 3), ("sinks", 4))
                    if need[i])
        wrt += tuple(n for i, n in enumerate(ctx.names) if need[6 + i])
        if not wrt:
            return (None,) * (6 + len(ctx.names))
        g = api.attention_backward(q, k, v, dout.contiguous(), out=ctx.out, lse=ctx.stats,
                                   bias=bias, sinks=sinks, wrt=wrt, **ctx.kw)
        dc = g.dcaptures or {}
        return (g.dq, g.dk, g.dv, g.dbias, g.dsinks, None) + tuple(
            dc.get(n) for n in ctx.names)


def attention(q, k, v, *, mask, bias, scale, backend, precision, layout, q_offset, k_offset,
              return_lse, softcap, alibi_slopes, sinks, dropout_p, dropout_seed, score_mod):
    """anyattn.torch.attention's arguments (validated there) with a score or mask
    function: see the module docstring."""
    if torch.compiler.is_compiling():
        raise NotImplementedError(
            "anyattn.torch.attention: score_mod / MaskMod / | of mask terms are not "
            "supported under torch.compile yet; call it outside the compiled region "
            "(torch.compiler.disable) or use the built-in masks and modifiers")
    sm = None if score_mod is None else as_score_mod(score_mod)
    names = () if sm is None else tuple(
        n for n, t in sm.captures.items()
        if isinstance(t, torch.Tensor) and t.requires_grad)
    if names and torch.is_grad_enabled() and (q.device.type != "cpu" or backend == "triton"):
        from ..backends.triton.capture_grads import refusal

        why = refusal(sm.program, names)
        if why:
            raise NotImplementedError(
                f"anyattn.torch.attention: score_mod captures {list(names)} require grad on "
                f"{q.device}, and the Triton backward {why}; detach them (or call under "
                "torch.no_grad()), or compute on CPU tensors with the NumPy backend")
    qb, kb, vb = ((x if layout == "bhsd" else x.transpose(1, 2)) for x in (q, k, v))
    kw = dict(mask=mask, scale=scale, backend=backend, precision=precision,
              q_offset=q_offset, k_offset=k_offset, softcap=softcap,
              alibi_slopes=alibi_slopes, dropout_p=dropout_p, dropout_seed=dropout_seed)
    spec = dict(score_mod=sm, names=names, kw=kw)
    caps = tuple(sm.captures[n] for n in names)
    out, row_max, log_norm = _ProgramAttention.apply(qb, kb, vb, bias, sinks, spec, *caps)
    if layout != "bhsd":
        out = out.transpose(1, 2)
    return (out, (row_max + log_norm).float()) if return_lse else out
