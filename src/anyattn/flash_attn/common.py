"""Argument checks, masks, dropout seeds and the attention probabilities shared by the
FlashAttention-compatible entry points.

Shape legend: B batch, Sq/Sk queries/keys, Hq/Hk query/key-value heads (G = Hq / Hk),
D head dim.  FlashAttention's layout is [B, S, H, D] (``bshd``).
"""
from __future__ import annotations

import numbers
import operator
from typing import Optional, Tuple

import numpy as np
import torch

from .. import arguments
from ..dropout import check_dropout, col_words, mix32, row_words, threshold
from ..masks import Causal, Window

#: seeds drawn from torch's generator lie in [0, 2**63) (anyattn.torch carries int64)
_SEED_HIGH = 2 ** 63 - 1


def check_tensor(name: str, x, ndim: int, what: str, hint: str = "") -> None:
    """``x`` is a torch tensor of ``ndim`` dims (``what`` names them in the message)."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor {what}, got {type(x).__name__}")
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dims {what}, got shape {tuple(x.shape)}"
                         + (f"; {hint}" if hint else ""))


def same(name_a: str, a: int, name_b: str, b: int, what: str) -> None:
    if a != b:
        raise ValueError(f"{name_b}: its {what} is {b} but {name_a}'s is {a}; they must match")


def check_packed(name: str, x, ndim: int, axis: int, n: int, what: str) -> None:
    """A packed tensor (qkv: n = 3 at ``axis``, kv: n = 2)."""
    check_tensor(name, x, ndim, what)
    if x.shape[axis] != n:
        raise ValueError(f"{name}: expected {n} at dim {axis} {what}, got shape "
                         f"{tuple(x.shape)}")


def flag(name: str, val) -> bool:
    arguments.check_flag(name, val)
    return bool(val)


def window(window_size, causal: bool) -> Tuple[Optional[int], Optional[int]]:
    """FlashAttention's ``window_size=(left, right)`` (-1 = unbounded side) -> (left,
    right) with None for an unbounded side; ``causal`` sets right to 0."""
    try:
        left, right = window_size
    except (TypeError, ValueError):
        raise TypeError(f"window_size: expected a pair (left, right) of ints, -1 for an "
                        f"unbounded side, got {window_size!r}") from None
    sides = []
    for nm, val in (("left", left), ("right", right)):
        if isinstance(val, torch.Tensor) and val.ndim == 0 and not val.is_floating_point():
            val = int(val)
        if isinstance(val, (bool, np.bool_)) or not isinstance(val, numbers.Integral):
            raise TypeError(f"window_size: its {nm} side is {val!r}; expected an int "
                            "(-1 for an unbounded side)")
        val = int(val)
        if val < -1:
            raise ValueError(f"window_size: its {nm} side is {val}; a side is >= 0, or -1 "
                             "for unbounded (window_size=(-1, -1) is no window)")
        sides.append(None if val == -1 else val)
    left, right = sides
    if causal:
        right = 0
    return left, right


def band_mask(left: Optional[int], right: Optional[int]):
    """The bottom-right aligned band ``-left <= j - i' <= right`` (i' = i + Sk - Sq) as
    anyattn mask terms, or None for no band."""
    if left is None and right is None:
        return None
    if right == 0:
        causal = Causal(align="bottom_right")
        return causal if left is None else causal & Window(left=left, align="bottom_right")
    return Window(left=left, right=right, align="bottom_right")


def softcap_value(softcap) -> Optional[float]:
    """FlashAttention's ``softcap``: a float, > 0 caps, <= 0 (the default 0.0) is off."""
    if isinstance(softcap, (bool, np.bool_)) or not isinstance(softcap, numbers.Real):
        raise TypeError(f"softcap: expected a float (0.0 = off), got {type(softcap).__name__}")
    softcap = float(softcap)
    if softcap != softcap:
        raise ValueError("softcap: is NaN; expected a float, > 0 to cap the scores, 0.0 = off")
    return softcap if softcap > 0 else None


def alibi(alibi_slopes, heads: int, batch: int):
    """``alibi_slopes`` [Hq] or [B, Hq] (a tensor that does not require grad) or None."""
    if alibi_slopes is None:
        return None
    if not isinstance(alibi_slopes, torch.Tensor):
        raise TypeError(f"alibi_slopes: expected a torch.Tensor of shape (nheads,) or "
                        f"(batch_size, nheads), got {type(alibi_slopes).__name__}")
    if tuple(alibi_slopes.shape) not in ((heads,), (batch, heads)):
        raise ValueError(f"alibi_slopes: expected shape ({heads},) or ({batch}, {heads}) "
                         f"(nheads,) / (batch_size, nheads), got {tuple(alibi_slopes.shape)}")
    if alibi_slopes.requires_grad:
        raise ValueError("alibi_slopes: requires grad, but ALiBi slopes are not trainable "
                         "(FlashAttention computes no gradient for them either); pass "
                         "alibi_slopes.detach()")
    return alibi_slopes


def scale_value(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return head_dim ** -0.5
    if isinstance(softmax_scale, (bool, np.bool_)) or not isinstance(softmax_scale,
                                                                        numbers.Real):
        raise TypeError(f"softmax_scale: expected a float or None (1/sqrt(headdim)), got "
                        f"{type(softmax_scale).__name__}")
    return float(softmax_scale)


def dropout_seed(dropout_p) -> Tuple[float, Optional[int]]:
    """(p, seed): the seed drawn from torch's default CPU generator (as anyattn.torch
    draws it, so ``torch.manual_seed`` reproduces a run), None without dropout."""
    if isinstance(dropout_p, (bool, np.bool_)) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p: expected a float in [0, 1), got "
                        f"{type(dropout_p).__name__}")
    p, _ = check_dropout(float(dropout_p), None, need_seed=False)
    if p == 0.0:
        return 0.0, None
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise NotImplementedError(
            "dropout_p: > 0 under CUDA graph capture: the seed drawn now would be baked "
            "into the graph, so every replay would drop the same entries; call "
            "anyattn.torch.attention with dropout_seed=... instead")
    seed = int(torch.randint(0, _SEED_HIGH, (1,), dtype=torch.int64))
    return p, seed


def int_value(name: str, val) -> int:
    if isinstance(val, (bool, np.bool_)):
        raise TypeError(f"{name}: expected an int, got bool")
    try:
        return operator.index(val)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(val).__name__}") from None


def dropout_keep(seed: int, p: float, batch: int, heads: int, rows, cols) -> np.ndarray:
    """anyattn's dropout keep mask, bool [heads, len(rows), len(cols)], of batch entry
    ``batch`` at the given global query rows and key columns (anyattn.dropout_mask's
    generator)."""
    x = row_words(seed, [batch], range(heads), rows)[0][..., None] ^ col_words(seed, cols)
    return mix32(x) >= np.uint32(threshold(p))


def probabilities(q: torch.Tensor, k: torch.Tensor, lse: torch.Tensor, scale: float,
                  softcap: Optional[float], slopes: Optional[torch.Tensor],
                  left: Optional[int], right: Optional[int]) -> torch.Tensor:
    """The attention probabilities of one sequence, recomputed densely: q [Sq, Hq, D],
    k [Sk, Hk, D], lse [Hq, Sq] (the forward's), slopes [Hq] or None -> P [Hq, Sq, Sk]
    in float32 (float64 for float64 inputs), 0 where the band excludes a key.  A testing
    aid (FlashAttention's ``return_attn_probs``): O(Sq·Sk) memory."""
    dt = torch.float64 if q.dtype == torch.float64 else torch.float32
    sq, hq, _ = q.shape
    sk, hk, _ = k.shape
    qf = q.detach().to(dt).permute(1, 0, 2)                          # [Hq, Sq, D]
    kf = k.detach().to(dt).permute(1, 0, 2).repeat_interleave(hq // max(hk, 1), dim=0)
    s = scale * (qf @ kf.transpose(-1, -2))                         # [Hq, Sq, Sk]
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(sq, device=q.device)[:, None] + (sk - sq)      # i' (bottom-right)
    j = torch.arange(sk, device=q.device)[None, :]
    if slopes is not None:
        s = s - slopes.detach().to(dt)[:, None, None] * (i - j).abs().to(dt)
    keep = torch.ones(sq, sk, dtype=torch.bool, device=q.device)
    if left is not None:
        keep &= i - j <= left
    if right is not None:
        keep &= j - i <= right
    lse_f = lse.detach().to(dt)[:, :, None]
    p = torch.exp(s - torch.where(torch.isfinite(lse_f), lse_f, torch.zeros_like(lse_f)))
    return torch.where(keep & torch.isfinite(lse_f), p, torch.zeros_like(p))


def encode_dropout(p_block: torch.Tensor, keep: Optional[np.ndarray]) -> torch.Tensor:
    """FlashAttention's encoding of ``S_dmask``: the probabilities, negated where dropout
    dropped them (``keep`` bool [Hq, Sq, Sk] or None without dropout)."""
    if keep is None:
        return p_block
    kt = torch.from_numpy(keep).to(p_block.device)
    return torch.where(kt, p_block, -p_block)
