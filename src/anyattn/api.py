"""The public entry points: attention and attention_backward.

Shape legend: B batch, Hq/Hkv query/key-value heads, Sq/Sk queries/keys,
D head dim of q and k, Dv head dim of v (Dv may differ from D).
``layout="bhsd"`` (default) takes [B, H, S, D]; ``layout="bshd"``
takes [B, S, H, D] and returns results in that layout too.
"""
from __future__ import annotations

from typing import Iterable, Optional

import numpy as np

from .arguments import bias_4d, check_flag, check_layout, score_mods
from .arrays import array_kind, dtype_name
from .backends.registry import choose
from .masks import Mask
from .paged import Pages, describe_paged
from .problem import Problem, describe
from .reference import Gradients
from .rowstats import RowStats

__all__ = ["attention", "attention_backward", "Gradients", "RowStats"]


def _to_bhsd(x, layout):
    if x is None or layout == "bhsd":
        return x
    if array_kind(x) == "torch":
        return x.transpose(1, 2)
    return x.swapaxes(1, 2)


def _zeros_beside(x, arr):
    """Zeros of the host array ``arr``'s shape and dtype, where the inputs ``x`` live (a
    torch tensor on x's device for torch inputs), as a non-empty call returns them."""
    if array_kind(x) == "torch":
        import torch

        return torch.zeros(arr.shape, dtype=getattr(torch, str(arr.dtype)), device=x.device)
    return np.zeros(arr.shape, arr.dtype)


def _lse_out(stats: RowStats, p: Problem):
    """The public lse: max + log_norm in float32 (float64 for float64 inputs); a backend
    may keep its statistics wider than that (the float64 reference does)."""
    want = "float64" if p.dtype == "float64" else "float32"
    lse = stats.lse
    if dtype_name(lse) == want:
        return lse
    if array_kind(lse) == "torch":
        import torch

        return lse.to(getattr(torch, want))
    return lse.astype(want)


def forward_with_stats(q, k, v, *, mask: Optional[Mask] = None, bias=None,
                       scale: Optional[float] = None, backend: Optional[str] = None,
                       precision: Optional[str] = None, q_offset: int = 0,
                       k_offset: int = 0, softcap: Optional[float] = None,
                       alibi_slopes=None, sinks=None, dropout_p: float = 0.0,
                       dropout_seed: Optional[int] = None, score_mod=None):
    """[B, H, S, D] inputs -> (out, RowStats): the forward with its row statistics
    kept apart, for callers that pass them on to :func:`attention_backward` (the
    torch autograd and ring attention do).  With sinks the statistics include them."""
    out, stats, _ = _forward(q, k, v, mask, bias, scale, backend, precision, q_offset,
                             k_offset, softcap, alibi_slopes, sinks, dropout_p, dropout_seed,
                             score_mod)
    return out, stats


def _forward(q, k, v, mask, bias, scale, backend, precision, q_offset, k_offset,
             softcap=None, alibi_slopes=None, sinks=None, dropout_p=0.0, dropout_seed=None,
             score_mod=None):
    """Validate, dispatch, run -> (out, RowStats, Problem); inputs in [B, H, S, D]."""
    p = describe(q, k, v, mask=mask, bias=bias, scale=scale, precision=precision,
                 q_offset=q_offset, k_offset=k_offset, softcap=softcap,
                 alibi_slopes=alibi_slopes, sinks=sinks, dropout_p=dropout_p,
                 dropout_seed=dropout_seed, score_mod=score_mod)
    be = choose(p, backend)
    mods = score_mods(p, alibi_slopes, sinks)
    if p.is_empty:
        out = be.zeros_like(q, (p.batch, p.heads_q, p.seq_q, p.head_dim_v))
        return out, be.empty_stats(p, q, mods), p
    out, stats = be.forward(p, q, k, v, bias_4d(bias, p), mods)
    return out, stats, p


def _forward_paged(q, k_pages, v_pages, pages, mask, bias, scale, backend, precision,
                   q_offset, k_offset, softcap, alibi_slopes, sinks, dropout_p,
                   dropout_seed, score_mod):
    """The forward over a paged cache (anyattn.paged) -> (out, RowStats, Problem); q in
    [B, H, S, D], pages in [N, Hkv, P, D]."""
    p = describe_paged(q, k_pages, v_pages, pages, mask=mask, bias=bias, scale=scale,
                       precision=precision, q_offset=q_offset, k_offset=k_offset,
                       softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                       dropout_p=dropout_p, dropout_seed=dropout_seed, score_mod=score_mod)
    be = choose(p, backend)
    mods = score_mods(p, alibi_slopes, sinks)
    if p.is_empty:
        out = be.zeros_like(q, (p.batch, p.heads_q, p.seq_q, p.head_dim_v))
        return out, be.empty_stats(p, q, mods), p
    out, stats = be.forward_paged(p, q, k_pages, v_pages, mods)
    return out, stats, p


def attention(q, k, v, *, mask: Optional[Mask] = None, bias=None, scale: Optional[float] = None,
              return_lse: bool = False, backend: Optional[str] = None,
              precision: Optional[str] = None, layout: str = "bhsd",
              q_offset: int = 0, k_offset: int = 0, softcap: Optional[float] = None,
              alibi_slopes=None, sinks=None, dropout_p: float = 0.0,
              dropout_seed: Optional[int] = None, score_mod=None,
              pages: Optional[Pages] = None):
    """Scaled dot-product attention.

    q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv] -> out [B, Hq, Sq, Dv] (and lse
    [B, Hq, Sq], float32 natural log, with ``return_lse=True``).  ``mask``:
    Causal / Window / KeepMask / Documents, composed with ``&``; ``bias``:
    additive, broadcastable to [B, Hq, Sq, Sk].  A query that keeps no key
    gets out = 0 and lse = -inf.  ``q_offset``/``k_offset``: global positions
    of the first query/key for the Causal/Window terms and ALiBi.

    Score modifiers (:mod:`anyattn.modifiers`): ``softcap`` c > 0 caps the scaled
    score to ``c·tanh(s / c)`` before bias, ALiBi and masks; ``alibi_slopes`` [Hq] or
    [B, Hq] subtracts ``slope·|i' − j'|`` (bottom-right aligned positions);
    ``sinks`` [Hq] adds ``exp(sinks[h])`` to every row's softmax denominator (lse
    includes it; a row keeping no key then has lse = sinks[h]).

    Dropout (:mod:`anyattn.dropout`): ``dropout_p`` in [0, 1) with ``dropout_seed`` (an
    int in [0, 2**64)) gives ``out = (P ∘ keep / (1 − p))·v`` with
    ``keep = anyattn.dropout_mask((B, Hq, Sq, Sk), p, seed, q_offset=, k_offset=)``, the
    same bits on every backend; lse is that of the undropped softmax.

    ``score_mod`` (:doc:`programmable`): a function ``score_mod(score, b, h, q_idx,
    kv_idx) -> score`` or an ``anyattn.ScoreMod`` with captures, applied to every scaled
    score after softcap, before bias and masks.  ``mask`` may hold ``MaskMod`` terms
    (mask functions) and ``|`` compositions.

    ``pages`` (:doc:`semantics`, :mod:`anyattn.paged`): an ``anyattn.Pages(block_table,
    seqlens, starts=None)``; ``k`` and ``v`` are then a paged cache, [N, Hkv, P, D] /
    [N, Hkv, P, Dv] (``layout="bshd"``: [N, P, Hkv, D] / [N, P, Hkv, Dv]), sequence b's
    keys the positions [starts[b], seqlens[b]) of its pages ``block_table[b]`` (starts
    0 by default; FlashAttention's ``cache_leftpad``), each sequence attended as
    the dense call over its own keys (``Causal(align="bottom_right")`` puts the queries
    at the end).  Causal / Window masks, softcap, ALiBi, sinks and GQA compose; bias,
    dropout, score_mod and other mask terms raise NotImplementedError; no backward.
    """
    check_layout(layout)
    check_flag("return_lse", return_lse)
    qb, kb, vb = (_to_bhsd(x, layout) for x in (q, k, v))
    if pages is not None:
        out, stats, p = _forward_paged(qb, kb, vb, pages, mask, bias, scale, backend,
                                       precision, q_offset, k_offset, softcap, alibi_slopes,
                                       sinks, dropout_p, dropout_seed, score_mod)
    else:
        out, stats, p = _forward(qb, kb, vb, mask, bias, scale, backend, precision, q_offset,
                                 k_offset, softcap, alibi_slopes, sinks, dropout_p,
                                 dropout_seed, score_mod)
    out = _to_bhsd(out, layout)
    return (out, _lse_out(stats, p)) if return_lse else out


def _check_stats(st: RowStats) -> None:
    for name in ("max", "log_norm"):
        x = getattr(st, name)
        if array_kind(x) is None:
            raise TypeError(f"lse: RowStats.{name} is a {type(x).__name__}; expected an "
                            "array like q")
    if tuple(st.max.shape) != tuple(st.log_norm.shape) or \
            dtype_name(st.max) != dtype_name(st.log_norm) or \
            array_kind(st.max) != array_kind(st.log_norm):
        raise ValueError(f"lse: RowStats.max {tuple(st.max.shape)} {st.max.dtype} and "
                         f"log_norm {tuple(st.log_norm.shape)} {st.log_norm.dtype} differ; "
                         "pass the statistics a forward returned")


def attention_backward(q, k, v, dout, *, out=None, lse=None, mask: Optional[Mask] = None,
                       bias=None, scale: Optional[float] = None,
                       wrt: Iterable[str] = ("q", "k", "v"), backend: Optional[str] = None,
                       precision: Optional[str] = None, layout: str = "bhsd",
                       q_offset: int = 0, k_offset: int = 0,
                       softcap: Optional[float] = None, alibi_slopes=None,
                       sinks=None, dropout_p: float = 0.0,
                       dropout_seed: Optional[int] = None, score_mod=None) -> Gradients:
    """Gradients of ``sum(attention(q, k, v, ...) * dout)``.

    -> Gradients(dq [B, Hq, Sq, D], dk [B, Hkv, Sk, D], dv [B, Hkv, Sk, Dv],
    dbias in the bias's own shape, dsinks [Hq], dcaptures {name: gradient in the
    capture's shape}), None for what ``wrt`` (a subset of 'q', 'k', 'v', 'bias',
    'sinks' and the names of the score_mod's float captures; None is a TypeError)
    leaves out.  The score
    modifiers and dropout are those of :func:`attention` and must match the forward's
    (the backward regenerates the dropout mask from the seed).  ``out``/``lse`` from the
    forward may be passed; otherwise they are recomputed.  ``lse`` is a [B, Hq, Sq] array
    (it defines ``P = exp(s - lse)``; one whose magnitude reaches 64 is refined by
    recomputed row statistics, one extra forward pass, see :mod:`anyattn.rowstats`; on
    a CUDA tensor that magnitude check reads one flag back to the host, a device
    synchronisation per call that also rules out CUDA graph capture) or a
    :class:`RowStats` from :func:`forward_with_stats` (no check, no synchronisation).
    """
    check_layout(layout)
    if dout is None:
        raise TypeError("dout: the gradient of the output is required, shape [B, Hq, Sq, Dv]")
    qb, kb, vb, gb, ob = (_to_bhsd(x, layout) for x in (q, k, v, dout, out))
    given = lse if isinstance(lse, RowStats) else None
    if given is not None:
        _check_stats(given)
        lse = given.max
    p = describe(qb, kb, vb, dout=gb, out=ob, lse=lse, mask=mask, bias=bias, scale=scale,
                 precision=precision, wrt=wrt, q_offset=q_offset, k_offset=k_offset,
                 softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                 dropout_p=dropout_p, dropout_seed=dropout_seed, score_mod=score_mod)
    be = choose(p, backend)
    mods = score_mods(p, alibi_slopes, sinks)
    if p.is_empty:
        res = {"dq": be.zeros_like(qb), "dk": be.zeros_like(kb), "dv": be.zeros_like(vb),
               "dbias": None if bias is None else be.zeros_like(bias),
               "dsinks": None if sinks is None else be.zeros_like(sinks),
               "dcaptures": {n: be.zeros_like(p.score_mod.device[n])
                             if n in p.score_mod.device else
                             _zeros_beside(qb, p.score_mod.arrays[n])
                             for n in p.capture_wrt} or None}
    else:
        b4 = bias_4d(bias, p)
        if ob is None:
            ob, stats = be.forward(p, qb, kb, vb, b4, mods)
        elif given is not None:
            stats = given
        else:
            stats = be.stats_from_lse(p, qb, kb, vb, b4, mods, lse)
        res = be.backward(p, qb, kb, vb, gb, ob, stats, b4, mods)
    dq = res.get("dq") if "q" in p.wrt else None
    dk = res.get("dk") if "k" in p.wrt else None
    dv = res.get("dv") if "v" in p.wrt else None
    db = res.get("dbias") if "bias" in p.wrt else None
    if db is not None and tuple(db.shape) != tuple(bias.shape):
        db = db.reshape(bias.shape)
    ds = res.get("dsinks") if "sinks" in p.wrt else None
    dc = res.get("dcaptures") if p.capture_wrt else None
    return Gradients(dq=_to_bhsd(dq, layout), dk=_to_bhsd(dk, layout),
                     dv=_to_bhsd(dv, layout), dbias=db, dsinks=ds, dcaptures=dc)
