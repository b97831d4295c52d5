"""Softmax row statistics, kept apart: the row maximum and the log-normaliser.

Shape legend: B batch, Hq query heads, Sq queries.

Every backend defines the softmax of a row by two numbers instead of one lse:

    P[i, j] = exp((s[i, j] - max[i]) - log_norm[i])      over the kept keys,
    lse[i]  = max[i] + log_norm[i]                       (what the public API returns).

Why two: a single rounded lse folded into the exponent (``exp(s - lse)``) loses
``|lse|·eps`` absolutely, so at logits of 1e3 gradients are off by 5e-5 (fp32), and a
uniform finite bias of -1e30 on a row absorbs ``log(Sk)`` entirely and makes every
gradient Sk× too large.  ``s - max`` is exact where it matters (Sterbenz) and
``log_norm`` is small, so P carries a relative error of a few ulps whatever |s| is.

``max`` is the row maximum of the kept scores, or (where a backend does not track it)
a value at most a few units above it, with ``log_norm`` the matching remainder; either
way the two define P exactly as above.  Conventions every backend follows: a row that
keeps no key has ``max = -inf`` and
``log_norm = 0`` (so lse = -inf and P = 0); NaN in a row makes both NaN.

A caller may still pass a plain lse to the backward (e.g. a row's global lse over more
keys, as ring attention does).  :meth:`RowStats.from_lse` gives it its literal meaning,
``P = exp(s - lse)``.  When such an lse is large enough that its own rounding matters,
:func:`refine` recomputes the local statistics and uses them wherever the given lse
agrees with them to within its rounding (:data:`REFINE_ABOVE`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .arrays import array_kind

__all__ = ["RowStats", "refine", "needs_refine", "REFINE_ABOVE"]

#: A given lse whose finite entries reach this magnitude is refined by recomputed
#: statistics: its fp32 rounding (|lse|·2⁻²⁴ in the exponent) then passes 4e-6.
REFINE_ABOVE = 64.0


def _xp(x):
    """The array namespace (numpy or torch) of ``x``."""
    if array_kind(x) == "torch":
        import torch

        return torch
    import numpy as np

    return np


@dataclass(frozen=True)
class RowStats:
    """Row statistics of a softmax (float32, float64 for float64 inputs).

    max [B, Hq, Sq]: the largest kept score of each row, or a bound a few units above
    it (-inf on a row keeping none);
    log_norm [B, Hq, Sq]: ``log Σ_kept exp(s - max)`` (0 on an empty row).
    """

    max: Any
    log_norm: Any

    @property
    def lse(self):
        """max + log_norm [B, Hq, Sq]: the log-sum-exp of each row (-inf if empty)."""
        return self.max + self.log_norm

    @property
    def shape(self):
        return tuple(self.max.shape)

    @classmethod
    def from_lse(cls, lse) -> "RowStats":
        """A plain lse as statistics with its literal meaning, P = exp(s - lse)."""
        xp = _xp(lse)
        return cls(max=lse, log_norm=xp.zeros_like(lse))

    def astype(self, dtype_name: str) -> "RowStats":
        """Both arrays in ``dtype_name`` ('float32' / 'float64')."""
        if array_kind(self.max) == "torch":
            import torch

            dt = getattr(torch, dtype_name)
            return RowStats(self.max.to(dt), self.log_norm.to(dt))
        return RowStats(self.max.astype(dtype_name, copy=False),
                        self.log_norm.astype(dtype_name, copy=False))

    def select(self, index) -> "RowStats":
        """The statistics of a sub-block of rows, ``x[index]`` on both arrays."""
        return RowStats(self.max[index], self.log_norm[index])


def needs_refine(lse) -> bool:
    """True when some finite entry of a given lse is at least :data:`REFINE_ABOVE`
    in magnitude (its rounding then shows in P)."""
    xp = _xp(lse)
    a = xp.abs(lse)
    big = (a >= REFINE_ABOVE) & xp.isfinite(a)
    return bool(big.any())


def refine(given_lse, local: RowStats) -> RowStats:
    """Statistics that honour a given lse at full precision.

    ``local`` are the statistics recomputed over the same keys.  Per row: where the
    given lse equals the local lse to within two units of its last place (the caller
    passed this call's own lse), the local pair is used; elsewhere (an lse over more
    keys, e.g. ring attention's global one) the literal meaning ``P = exp(s - lse)`` is
    kept, written as ``exp((s - max_local) - (lse - max_local))`` so that the large
    parts cancel exactly.  Rows the local statistics find empty, and rows whose given
    lse is not finite, keep the given lse as it is.
    """
    xp = _xp(given_lse)
    g = given_lse
    m, ln = local.max, local.log_norm
    finite_local = xp.isfinite(m)
    m_safe = xp.where(finite_local, m, xp.zeros_like(m))
    gap = g - m_safe                               # exact where g and m are close
    diff = gap - ln                                # given lse - local lse
    eps = 2.0 ** -52 if str(g.dtype).endswith("float64") else 2.0 ** -23
    tol = xp.abs(g) * eps + xp.abs(ln) * eps
    same = finite_local & xp.isfinite(g) & (xp.abs(diff) <= tol)
    use_local = finite_local & xp.isfinite(g)       # else the given value, literally
    new_max = xp.where(use_local, m, g)
    new_ln = xp.where(same, ln, xp.where(use_local, gap, xp.zeros_like(ln)))
    return RowStats(max=new_max, log_norm=new_ln)
