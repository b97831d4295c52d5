"""Merging partial attention results through their log-sum-exp.

Shape legend: B batch, H query heads, S queries, D head dim.

A partial result over a subset of the keys is ``(o, lse)`` with ``o`` the
softmax-weighted value average over that subset and ``lse`` its log-sum-exp.
Two partials over disjoint key sets combine exactly:

    lse = log(exp(lse_a) + exp(lse_b))
    o   = o_a * exp(lse_a - lse) + o_b * exp(lse_b - lse)

A row that kept no key in a partial has ``lse = -inf`` (and o = 0); a row with
no key in either stays ``lse = -inf``, ``o = 0`` (never NaN).  NaN in an
input's lse propagates.
"""
from __future__ import annotations

import torch

__all__ = ["merge_into"]


def merge_into(o_acc: torch.Tensor, lse_acc: torch.Tensor, o: torch.Tensor,
               lse: torch.Tensor) -> None:
    """In place: (o_acc [B,H,S,D], lse_acc [B,H,S]) <- merge with (o, lse).

    ``o_acc``/``lse_acc`` are accumulators in float32 (float64 for float64
    inputs); ``o``/``lse`` may be any float dtype and are promoted.
    """
    o = o.to(o_acc.dtype)
    lse = lse.to(lse_acc.dtype)
    m = torch.maximum(lse_acc, lse)                                    # [B,H,S], NaN propagates
    m = torch.where(m == float("-inf"), torch.zeros_like(m), m)        # both empty: shift by 0
    w_acc = torch.exp(lse_acc - m)                                     # exp(-inf) = 0
    w_new = torch.exp(lse - m)
    tot = w_acc + w_new                                                # [B,H,S]
    pos = tot > 0
    inv = torch.where(pos, 1.0 / torch.where(pos, tot, torch.ones_like(tot)),
                      torch.zeros_like(tot))
    inv = torch.where(torch.isnan(tot), tot, inv)
    o_acc.mul_((w_acc * inv).unsqueeze(-1)).add_(o * (w_new * inv).unsqueeze(-1))
    lse_acc.copy_(m + torch.log(tot))                                  # log 0 = -inf
