"""Merging partial attention results through their row statistics.

Shape legend: B batch, H query heads, S queries, D head dim.

A partial result over a subset of the keys is ``(o, max, log_norm)``: ``o`` the
softmax-weighted value average over that subset, ``max`` its largest kept score and
``log_norm = log Σ exp(s - max)`` (>= 0), as :class:`anyattn.rowstats.RowStats`
keeps them.  Two partials over disjoint key sets combine exactly:

    m        = max(m_a, m_b)
    l_a      = (m_a - m) + log_norm_a          l_b = (m_b - m) + log_norm_b
    log_norm = log(exp(l_a) + exp(l_b))
    o        = (o_a·exp(l_a) + o_b·exp(l_b)) / (exp(l_a) + exp(l_b))

The large parts of the logits cancel in ``m_a - m`` (exact when the two maxima are
close, Sterbenz) and every other quantity is of the order of log(keys), so the
result carries a relative error of a few ulps whatever the logits' magnitude
(a merge through one rounded lse loses |lse|·eps: 6e-5 at logits of 1e3 in fp32).
The merged lse is ``max + log_norm``.

A row that kept no key in a partial has ``max = -inf`` and ``log_norm = 0`` (and
o = 0); a row with no key in either stays so (``o = 0``, never NaN).  NaN in an
input's statistics propagates.
"""
from __future__ import annotations

import torch

__all__ = ["merge_stats_into", "merge_into"]


def merge_stats_into(o_acc: torch.Tensor, m_acc: torch.Tensor, ln_acc: torch.Tensor,
                     o: torch.Tensor, m: torch.Tensor, ln: torch.Tensor) -> None:
    """In place: (o_acc [B,H,S,D], m_acc [B,H,S], ln_acc [B,H,S]) <- merge with (o, m, ln).

    The accumulators are float32 (float64 for float64 inputs); ``o``/``m``/``ln`` may be
    any float dtype and are promoted.
    """
    o = o.to(o_acc.dtype)
    m = m.to(m_acc.dtype)
    ln = ln.to(ln_acc.dtype)
    ninf = float("-inf")
    new_m = torch.maximum(m_acc, m)                                    # NaN propagates
    empty = new_m == ninf                                              # no key in either
    shift = torch.where(empty, torch.zeros_like(new_m), new_m)
    la = (m_acc - shift) + ln_acc                                      # -inf where empty
    lb = (m - shift) + ln
    top = torch.maximum(la, lb)                                        # one of them is <= 0 + ln
    top = torch.where(top == ninf, torch.zeros_like(top), top)
    wa = torch.exp(la - top)                                           # [B,H,S], in [0, 1]
    wb = torch.exp(lb - top)
    tot = wa + wb                                                      # >= 1 unless empty
    pos = tot > 0
    inv = torch.where(pos, 1.0 / torch.where(pos, tot, torch.ones_like(tot)),
                      torch.zeros_like(tot))
    inv = torch.where(torch.isnan(tot), tot, inv)
    o_acc.mul_((wa * inv).unsqueeze(-1)).add_(o * (wb * inv).unsqueeze(-1))
    new_ln = top + torch.log(tot)
    new_ln = torch.where(empty, torch.zeros_like(new_ln), new_ln)
    m_acc.copy_(new_m)
    ln_acc.copy_(new_ln)


def merge_into(o_acc: torch.Tensor, lse_acc: torch.Tensor, o: torch.Tensor,
               lse: torch.Tensor) -> None:
    """In place: (o_acc [B,H,S,D], lse_acc [B,H,S]) <- merge with (o, lse), for callers
    that hold plain lse values (each lse read as max = lse, log_norm = 0)."""
    m_acc = lse_acc.clone()
    ln_acc = torch.zeros_like(lse_acc)
    lse = lse.to(lse_acc.dtype)
    merge_stats_into(o_acc, m_acc, ln_acc, o, lse, torch.zeros_like(lse))
    lse_acc.copy_(m_acc + ln_acc)
