"""Float64 dense attention, forward and backward: the oracle of every test.

Shape legend: B batch, Hq/Hkv query/key-value heads (G = Hq/Hkv), Sq/Sk
queries/keys, D head dim of q and k, Dv of v.  Inputs in [B, H, S, D] (NumPy or torch, any dtype);
results are float64 NumPy arrays.  Written for clarity, not speed: it builds
the full [B, Hq, Sq, Sk] score tensor.

``seed_backward`` reproduces the seed kernel's own semantics (DESIGN.md §2),
sentinel scores and all.
"""
from __future__ import annotations

from typing import NamedTuple, Optional, Sequence

import numpy as np

from .arrays import to_numpy
from .dropout import dropout_mask
from .rowstats import RowStats
from .masks import Mask, resolve
from .programs.bound import scatter_add

__all__ = ["Gradients", "forward", "backward", "seed_backward", "reduce_to_shape"]


class Gradients(NamedTuple):
    """Result of a backward: None for what was not requested."""

    dq: Optional[object] = None
    dk: Optional[object] = None
    dv: Optional[object] = None
    dbias: Optional[object] = None
    dsinks: Optional[object] = None
    #: score_mod capture gradients by capture name (those ``wrt`` named), or None
    dcaptures: Optional[dict] = None


def _f64(x):
    return None if x is None else to_numpy(x).astype(np.float64)


def reduce_to_shape(x: np.ndarray, shape) -> np.ndarray:
    """Sum a [B, Hq, Sq, Sk] array over the dims that ``shape`` broadcasts."""
    shape = tuple(shape)
    lead = x.ndim - len(shape)
    x = x.sum(axis=tuple(range(lead))) if lead else x
    axes = tuple(a for a, n in enumerate(shape) if n == 1 and x.shape[a] != 1)
    return x.sum(axis=axes, keepdims=True) if axes else x


def _scores(q, k, v, mask, bias, scale, q_offset, k_offset, softcap=None, alibi_slopes=None):
    """-> (s [B,Hq,Sq,Sk] with -inf where excluded, keep [..] bool, kexp, vexp, th)
    without a score function (see :func:`_scores_mod`)."""
    return _scores_mod(q, k, v, mask, bias, scale, q_offset, k_offset, softcap,
                       alibi_slopes)[:5]


def _scores_mod(q, k, v, mask, bias, scale, q_offset, k_offset, softcap=None,
                alibi_slopes=None, score_mod=None, mod_wrt=None):
    """-> (s [B,Hq,Sq,Sk] with -inf where excluded, keep [..] bool, kexp, vexp, th, smd).

    ``th`` = tanh(scale·qk / softcap) [B,Hq,Sq,Sk] (None without softcap): the backward
    needs 1 − th².  ``score_mod`` (a bound program, :mod:`anyattn.programs`) applies
    after softcap, before bias, ALiBi and masks; with ``mod_wrt`` (capture names, maybe
    empty) ``smd`` = (d s'/d s, [(capture, index arrays, d s'/d gather)]), else None."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    kexp = np.repeat(k, G, axis=1)  # [B, Hq, Sk, D] (the oracle may expand)
    vexp = np.repeat(v, G, axis=1)
    s = scale * np.einsum("bhid,bhjd->bhij", q, kexp)
    th = None
    if softcap is not None:
        th = np.tanh(s / softcap)
        s = softcap * th
    smd = None
    if score_mod is not None:
        if mod_wrt is None:
            s = np.array(score_mod.score_dense(s))
        else:
            s, dsc, gath = score_mod.score_dense(s, frozenset(mod_wrt), grads=True)
            s, smd = np.array(s), (dsc, gath)
    if bias is not None:
        s = s + bias
    if alibi_slopes is not None:
        slopes = _f64(alibi_slopes)
        slopes = slopes.reshape((-1, Hq, 1, 1))                  # [1 or B, Hq, 1, 1]
        diag = Sk - Sq + q_offset - k_offset                    # i' - j' = i - j + diag
        dist = np.abs(np.arange(Sq)[:, None] - np.arange(Sk)[None, :] + diag)
        s = s - slopes * dist
    keep = resolve(mask, B, Hq, Sq, Sk, q_offset, k_offset).dense_keep(B, Hq)
    keep = np.broadcast_to(keep, s.shape)
    s = np.where(keep, s, -np.inf)
    return s, keep, kexp, vexp, th, smd


def _softmax_stats(s, sinks=None):
    """Row softmax -> (P, max, log_norm): P = 0, max = -inf, log_norm = 0 on rows with
    no finite score; NaN rows give NaN.  P = exp((s - max) - log_norm), float64.
    ``sinks`` [Hq]: one more term exp(sinks[h]) in each row's denominator (a column
    of its own, left out of P)."""
    if sinks is not None:
        B, Hq, Sq, _ = s.shape
        col = np.broadcast_to(_f64(sinks).reshape(1, Hq, 1, 1), (B, Hq, Sq, 1))
        p, row_max, log_norm = _softmax_stats(np.concatenate([s, col], axis=-1))
        return p[..., :-1], row_max, log_norm
    m = s.max(axis=-1, keepdims=True)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(invalid="ignore"):
        e = np.exp(s - m_safe)
    tot = e.sum(axis=-1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        p = np.where(tot > 0, e / np.where(tot > 0, tot, 1.0), 0.0)
        log_norm = np.where(tot > 0, np.log(np.where(tot > 0, tot, 1.0)), 0.0)[..., 0]
    row_max = np.where(tot[..., 0] > 0, m_safe[..., 0], -np.inf)
    # NaN in the inputs must propagate, not vanish into the 0 branch
    nan_rows = np.isnan(s).any(axis=-1)
    if nan_rows.any():
        p = np.where(nan_rows[..., None], np.nan, p)
        row_max = np.where(nan_rows, np.nan, row_max)
        log_norm = np.where(nan_rows, np.nan, log_norm)
    return p, row_max, log_norm


def _softmax(s):
    """Row softmax that gives P = 0 and lse = -inf on rows with no finite score."""
    p, row_max, log_norm = _softmax_stats(s)
    return p, row_max + log_norm


def forward(q, k, v, *, mask: Optional[Mask] = None, bias=None, scale: Optional[float] = None,
            q_offset: int = 0, k_offset: int = 0, softcap: Optional[float] = None,
            alibi_slopes=None, sinks=None, dropout_p: float = 0.0,
            dropout_seed: Optional[int] = None, score_mod=None):
    """-> (out [B, Hq, Sq, Dv], lse [B, Hq, Sq]) in float64."""
    out, st = forward_stats(q, k, v, mask=mask, bias=bias, scale=scale, q_offset=q_offset,
                            k_offset=k_offset, softcap=softcap, alibi_slopes=alibi_slopes,
                            sinks=sinks, dropout_p=dropout_p, dropout_seed=dropout_seed,
                            score_mod=score_mod)
    return out, st.max + st.log_norm


def _dropped(p, dropout_p, dropout_seed, q_offset, k_offset):
    """P ∘ keep / (1 − p) with keep = anyattn.dropout_mask at the global positions."""
    if not dropout_p:
        return p
    keep = dropout_mask(p.shape, dropout_p, dropout_seed, q_offset=q_offset,
                        k_offset=k_offset)
    return np.where(keep, p / (1.0 - dropout_p), 0.0)


def forward_stats(q, k, v, *, mask: Optional[Mask] = None, bias=None,
                  scale: Optional[float] = None, q_offset: int = 0, k_offset: int = 0,
                  softcap: Optional[float] = None, alibi_slopes=None, sinks=None,
                  dropout_p: float = 0.0, dropout_seed: Optional[int] = None,
                  score_mod=None):
    """-> (out [B, Hq, Sq, Dv], RowStats(max, log_norm) [B, Hq, Sq]) in float64.

    Score modifiers (see :mod:`anyattn.modifiers`): ``softcap`` c, ``alibi_slopes``
    [Hq] or [B, Hq], ``sinks`` [Hq] (in the statistics: lse includes the sink).
    ``dropout_p``/``dropout_seed``: out = (P ∘ keep / (1 − p))·v (see
    :mod:`anyattn.dropout`); the statistics are those of the undropped softmax."""
    q, k, v, bias = _f64(q), _f64(k), _f64(v), _f64(bias)
    if scale is None:
        scale = 1.0 / np.sqrt(q.shape[-1])
    s, _, _, vexp, _, _ = _scores_mod(q, k, v, mask, bias, scale, q_offset, k_offset, softcap,
                                  alibi_slopes, _bound(score_mod, q, k, mask, q_offset,
                                                       k_offset))
    p, row_max, log_norm = _softmax_stats(s, sinks)
    pd = _dropped(p, dropout_p, dropout_seed, q_offset, k_offset)
    return np.einsum("bhij,bhjd->bhid", pd, vexp), RowStats(row_max, log_norm)


def backward(q, k, v, dout, *, mask: Optional[Mask] = None, bias=None,
             scale: Optional[float] = None, wrt: Sequence[str] = ("q", "k", "v"),
             q_offset: int = 0, k_offset: int = 0, out=None, lse=None,
             stats: Optional[RowStats] = None, softcap: Optional[float] = None,
             alibi_slopes=None, sinks=None, dropout_p: float = 0.0,
             dropout_seed: Optional[int] = None, score_mod=None) -> Gradients:
    """Gradients of sum(out * dout), float64; dk/dv summed over each query group;
    dsinks [Hq] (``wrt`` names 'sinks') summed over batch and queries; ``dcaptures``
    {name: array in the capture's shape} for the score_mod captures ``wrt`` names.

    With ``out`` and ``lse`` or ``stats`` given (from a forward, possibly over more
    keys than these, as in ring attention) they define P = exp(s - lse) (with stats:
    exp((s - max) - log_norm)) and δ = <dout, out>; otherwise both are computed here.
    With sinks, a given lse / stats must include the sink (as a forward returns them).
    """
    q, k, v, g, bias0 = _f64(q), _f64(k), _f64(v), _f64(dout), _f64(bias)
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    if scale is None:
        scale = 1.0 / np.sqrt(D)
    smod = _bound(score_mod, q, k, mask, q_offset, k_offset)
    mod_wrt = None if smod is None else \
        tuple(w for w in wrt if w not in ("q", "k", "v", "bias", "sinks"))
    s, keep, kexp, vexp, th, smd = _scores_mod(q, k, v, mask, bias0, scale, q_offset, k_offset,
                                           softcap, alibi_slopes, smod, mod_wrt)
    if lse is not None and stats is not None:
        raise ValueError("lse and stats: pass one of them, not both")
    if lse is None and stats is None:
        p, row_max, log_norm = _softmax_stats(s, sinks)          # [B, Hq, Sq, Sk]
        stats = RowStats(row_max, log_norm)
        out = np.einsum("bhij,bhjd->bhid",
                        _dropped(p, dropout_p, dropout_seed, q_offset, k_offset), vexp)
    else:
        if stats is None:
            stats = RowStats(_f64(lse), np.zeros(np.shape(lse)))
        m = _f64(stats.max)[..., None]
        ln = _f64(stats.log_norm)[..., None]
        with np.errstate(invalid="ignore", over="ignore"):
            p = np.where(np.isfinite(m) & (s > -np.inf), np.exp((s - m) - ln), 0.0)
        p = np.where(np.isnan(s) | np.isnan(m) | np.isnan(ln), np.nan, p)
        out = _f64(out)
    pd = _dropped(p, dropout_p, dropout_seed, q_offset, k_offset)   # P ∘ keep / (1 − p)
    dp = np.einsum("bhid,bhjd->bhij", g, vexp)           # dP = g vᵀ
    delta = np.sum(g * out, axis=-1, keepdims=True)      # δ = <g, out>
    ds = pd * dp - p * delta                             # dS = P ∘ (dP ∘ keep/(1−p) − δ)
    res = {}
    dx = ds
    if smd is not None:                                  # through score_mod
        dsc, gath = smd
        if mod_wrt:
            dcap = {n: np.zeros(smod.arrays[n].shape) for n in mod_wrt}
            for name, idx, dg in gath:                   # d s'/d gather, scattered
                scatter_add(dcap[name], idx, np.where(keep, ds * dg, 0.0))
            res["dcaptures"] = dcap
        dx = np.where(keep, ds * dsc, 0.0)
    dx = dx if th is None else dx * (1.0 - th * th)     # through c·tanh(x / c)
    if "q" in wrt:
        res["dq"] = scale * np.einsum("bhij,bhjd->bhid", dx, kexp)
    if "k" in wrt:
        dk = scale * np.einsum("bhij,bhid->bhjd", dx, q)
        res["dk"] = dk.reshape(B, Hkv, G, Sk, D).sum(axis=2)
    if "v" in wrt:
        dv = np.einsum("bhij,bhid->bhjd", pd, g)
        res["dv"] = dv.reshape(B, Hkv, G, Sk, v.shape[-1]).sum(axis=2)
    if "bias" in wrt:
        res["dbias"] = reduce_to_shape(ds, np.shape(bias0))
    if "sinks" in wrt:
        t = _f64(sinks).reshape(1, Hq, 1)
        m = _f64(stats.max)
        ln = _f64(stats.log_norm)
        with np.errstate(invalid="ignore", over="ignore"):
            p_sink = np.where(np.isfinite(m) & np.isfinite(t), np.exp((t - m) - ln), 0.0)
        res["dsinks"] = -(p_sink * delta[..., 0]).sum(axis=(0, 2))
    return Gradients(**res)


def _bound(score_mod, q, k, mask, q_offset, k_offset):
    """A score_mod argument (ScoreMod, function or bound program) bound for these sizes."""
    if score_mod is None:
        return None
    from .programs.bound import BoundProgram
    from .programs.mods import as_score_mod

    if isinstance(score_mod, BoundProgram):
        return score_mod
    B, Hq, Sq, _ = q.shape
    return as_score_mod(score_mod).bind((B, Hq, Sq, k.shape[2]))


# ----------------------------------------------------------------------------- seed
SEED_NONE, SEED_CAUSAL, SEED_KEEP, SEED_CAUSAL_WINDOW, SEED_BIAS = 0, 1, 2, 3, 4


def seed_backward(q, k, v, dy, *, mask_kind: int, scale: float, mask=None, window: int = 0,
                  wrt: int = 0) -> np.ndarray:
    """The seed kernel's result in float64: dQ (wrt 0), dK (1) or dV (2), per head.

    q, k, v, dy: [B, H, S, D] (one head count: the seed has no GQA);
    ``mask``: [B, H, Sq, Sk]-broadcastable float array (kind 2: keep where
    value >= 0.5 or NaN; kind 4: additive).  Excluded scores take the seed's
    sentinels (-3.4e38 for kinds 1 and 3, -1e9 for kind 2) and the softmax
    starts its running max at -3.4e38, so a row with no kept key attends
    uniformly to every key, and under kind 4 a row of -inf gives zeros.
    """
    q, k, v, dy = _f64(q), _f64(k), _f64(v), _f64(dy)
    s = scale * np.einsum("bhid,bhjd->bhij", q, k)
    sq, sk = s.shape[-2:]
    qi = np.arange(sq)[:, None]
    kj = np.arange(sk)[None, :]
    if mask_kind == SEED_CAUSAL:
        s = np.where(kj > qi, -3.4e38, s)
    elif mask_kind == SEED_KEEP:
        m = _f64(mask)
        s = np.where(m < 0.5, -1e9, s)   # NaN compares False: kept
    elif mask_kind == SEED_CAUSAL_WINDOW:
        s = np.where((kj > qi) | (qi - kj > window), -3.4e38, s)
    elif mask_kind == SEED_BIAS:
        s = s + _f64(mask)
    elif mask_kind != SEED_NONE:
        raise ValueError(f"mask_kind={mask_kind}: expected 0..4")
    m = np.maximum(s.max(axis=-1, keepdims=True), -3.4e38)
    with np.errstate(invalid="ignore", over="ignore"):
        e = np.exp(s - m)
    p = e / np.maximum(e.sum(axis=-1, keepdims=True), 1e-30)
    dp = np.einsum("bhid,bhjd->bhij", dy, v)
    ds = p * (dp - (p * dp).sum(axis=-1, keepdims=True))
    if wrt == 0:
        return scale * np.einsum("bhij,bhjd->bhid", ds, k)
    if wrt == 1:
        return scale * np.einsum("bhij,bhid->bhjd", ds, q)
    if wrt == 2:
        return np.einsum("bhij,bhid->bhjd", p, dy)
    raise ValueError(f"wrt={wrt}: expected 0 (dQ), 1 (dK) or 2 (dV)")
