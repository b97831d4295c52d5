"""Score modifiers: logit soft-capping, ALiBi, learnable attention sinks.

Shape legend: B batch, Hq query heads, Sq/Sk queries/keys, D head dim.

The contract (every backend computes exactly this; DESIGN.md §1):

- ``softcap = c > 0``: the scaled score ``x = scale·<q_i, k_j>`` becomes
  ``c·tanh(x / c)`` (Gemma 2/3); then the bias, ALiBi and the masks apply.  The
  backward multiplies dS by ``1 − tanh²(x / c)`` before the dq/dk products; dbias
  stays dS.
- ``alibi_slopes`` [Hq] or [B, Hq] (not trainable): ``s −= slope·|i' − j'|`` with the
  positions of ``Causal(align="bottom_right")``: ``i' − j' = i − j + diag`` where
  ``diag = Sk − Sq + q_offset − k_offset`` (:func:`alibi_diag`).  Backends compute
  it from indices, never as a dense [.., Sq, Sk] tensor.
- ``sinks`` [Hq] (trainable, gpt-oss): every row's softmax denominator gains
  ``exp(sinks[h])``.  P covers the kept keys only; lse includes the sink; a row
  that keeps no key has out 0 and lse = sinks[h].  In row statistics (see
  :mod:`anyattn.rowstats`) the sink is one more term of the normaliser:
  ``max = max(max_kept, sink)``, ``log_norm = log(Σ_kept exp(s − max) + exp(sink − max))``,
  so every backward that forms ``P = exp((s − max) − log_norm)`` needs nothing more.
  ``dsinks[h] = −Σ_{b,i} exp(sink[h] − lse[b,h,i])·δ[b,h,i]`` with ``δ = <dout, out>``.
  A sink of −inf is no sink.

:func:`fold_sinks` and :func:`sinks_grad` are exact, backend-neutral forms of the two
sink steps (NumPy or torch arrays), for backends that do not fuse them into a kernel.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

from .arrays import array_kind

__all__ = ["ScoreMods", "NO_MODS", "alibi_diag", "fold_sinks", "sinks_grad",
           "sink_terms"]


@dataclass(frozen=True)
class ScoreMods:
    """The array-valued score modifiers of one call (the scalar ``softcap`` is
    ``Problem.softcap``).

    alibi_slopes [Ba, Hq] with Ba in {1, B} (a [Hq] argument arrives as [1, Hq]);
    sinks [Hq].  Both in the caller's array library, on q's device, in q's dtype or
    float32.
    """

    alibi_slopes: Any = None
    sinks: Any = None

    @property
    def empty(self) -> bool:
        return self.alibi_slopes is None and self.sinks is None


NO_MODS = ScoreMods()


def alibi_diag(p) -> int:
    """``i' − j' = (i − j) + diag``: the ALiBi distance of query i and key j is
    ``|i − j + diag|`` (bottom-right aligned positions, offsets included)."""
    return p.seq_k - p.seq_q + p.q_offset - p.k_offset


def _xp(x):
    if array_kind(x) == "torch":
        import torch

        return torch
    import numpy as np

    return np


def _sink_rows(sinks, like):
    """sinks [Hq] -> [1, Hq, 1] in ``like``'s dtype (and device)."""
    if array_kind(like) == "torch":
        return sinks.to(dtype=like.dtype, device=like.device).reshape(1, -1, 1)
    return sinks.astype(like.dtype, copy=False).reshape(1, -1, 1)


def _quiet(xp):
    """NumPy's errstate for NaN rows (they propagate by design); no-op for torch."""
    import contextlib

    import numpy as np

    return np.errstate(invalid="ignore") if xp is np else contextlib.nullcontext()


def sink_terms(stats, sinks) -> Tuple[Any, Any]:
    """(max, log_norm) of rows over the kept keys -> the sink folded in, and the
    factor ``exp(lse_without − lse_with)`` that rescales an output normalised
    without the sink.  Shapes [B, Hq, Sq]; exact up to a few ulps of the statistics.

    Per row, with m/ln the statistics without the sink and t the sink:
    ``m2 = max(m, t)``, ``a = (m − m2) + ln``, ``b = t − m2``,
    ``ln2 = logaddexp(a, b)``, factor ``= exp(a − ln2)``.  A row keeping no key
    (m = −inf) gets m2 = t, ln2 = 0, factor 0; a sink of −inf changes nothing.
    """
    from .rowstats import RowStats

    xp = _xp(stats.max)
    m, ln = stats.max, stats.log_norm
    t = _sink_rows(sinks, m)                       # [1, Hq, 1]
    with _quiet(xp):
        m2 = xp.maximum(m, t)                      # NaN propagates
        none = m2 == -float("inf")                 # an empty row and a -inf sink
        m2s = xp.where(none, xp.zeros_like(m2), m2)
        a = (m - m2s) + ln                         # -inf on an empty row
        b = t - m2s                                # -inf for a -inf sink
        ln2 = xp.where(none, xp.zeros_like(m2), xp.logaddexp(a, b))
        factor = xp.where(m == -float("inf"), xp.zeros_like(m2), xp.exp(a - ln2))
    return RowStats(m2, ln2), factor


def fold_sinks(out, stats, sinks):
    """(out normalised over the kept keys, its RowStats) -> the same with the sink in
    the denominator: out·factor and the folded statistics (see :func:`sink_terms`).

    ``out`` [B, Hq, Sq, D] should be the backend's wide accumulator (float32/64)
    where it has one, so that the rescale adds no rounding of its own."""
    new_stats, factor = sink_terms(stats, sinks)
    if array_kind(out) == "torch":
        return (out.to(factor.dtype) * factor[..., None]).to(out.dtype), new_stats
    return (out * factor[..., None]).astype(out.dtype, copy=False), new_stats


def sinks_grad(dout, out, stats, sinks, sinks_dtype: Optional[str] = None):
    """dsinks [Hq] = −Σ_{b,i} exp((sink − max) − log_norm)·δ, δ = <dout, out> per row.

    ``stats`` are the statistics with the sink folded in (what the forward returned),
    or a plain lse as ``RowStats.from_lse``.  Reductions run in the statistics' dtype
    (float32, float64 for float64 inputs); the result is in ``sinks``' dtype."""
    xp = _xp(stats.max)
    m, ln = stats.max, stats.log_norm
    t = _sink_rows(sinks, m)
    if xp.__name__ == "torch":
        delta = (dout.to(m.dtype) * out.to(m.dtype)).sum(dim=-1)          # [B, Hq, Sq]
    else:
        delta = (dout.astype(m.dtype) * out.astype(m.dtype)).sum(axis=-1)
    finite = (m != -float("inf")) & (t != -float("inf"))
    ms = xp.where(finite, m, xp.zeros_like(m))
    p_sink = xp.where(finite, xp.exp((t - ms) - ln), xp.zeros_like(m))
    contrib = p_sink * delta
    if xp.__name__ == "torch":
        return (-contrib.sum(dim=(0, 2))).to(sinks.dtype)
    return (-contrib.sum(axis=(0, 2))).astype(sinks.dtype)
