"""Rotary position embedding as FlashAttention's ``flash_attn.layers.rotary`` applies it.

The first ``rotary_dim = 2 * cos.shape[-1]`` channels of each head are rotated by the
angle of the token's position p: with c = cos[p], s = sin[p] (each [rotary_dim / 2]),
a pair (x1, x2) becomes (x1·c − x2·s, x1·s + x2·c).  The pairs are (x[i], x[i + r/2])
(GPT-NeoX, ``interleaved=False``) or (x[2i], x[2i + 1]) (GPT-J, ``interleaved=True``);
the remaining channels pass through.  The rotation runs in float32 (float64 for float64
inputs) and is differentiable in x.
"""
from __future__ import annotations

import numbers
from typing import Optional, Union

import torch

__all__ = ["apply_rotary_emb", "apply_rotary_emb_func", "positions", "rotate"]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           interleaved: bool) -> torch.Tensor:
    """Rotate the first 2·cos.shape[-1] channels of x [..., H, D]; cos / sin are
    [..., r/2] with x's leading dims (no head dim): they broadcast over the heads."""
    half = cos.shape[-1]
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    c = cos.to(dt).unsqueeze(-2)                                 # [..., 1, r/2]
    s = sin.to(dt).unsqueeze(-2)
    xr = x[..., :2 * half].to(dt)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
        rot = torch.stack((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1).flatten(-2)
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
        rot = torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)
    return torch.cat((rot.to(x.dtype), x[..., 2 * half:]), dim=-1)


def check_tables(cos, sin, head_dim: int, names=("cos", "sin")) -> None:
    """cos / sin: floating tensors of one shape [seqlen_ro, rotary_dim / 2] with
    rotary_dim <= head_dim."""
    for name, t in zip(names, (cos, sin)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: expected a torch.Tensor (seqlen_ro, rotary_dim / 2), got "
                            f"{type(t).__name__}")
        if t.ndim != 2 or not t.is_floating_point():
            raise ValueError(f"{name}: expected a floating tensor of shape (seqlen_ro, "
                             f"rotary_dim / 2), got shape {tuple(t.shape)} dtype {t.dtype}")
    if tuple(cos.shape) != tuple(sin.shape):
        raise ValueError(f"{names[1]}: has shape {tuple(sin.shape)} but {names[0]} has "
                         f"{tuple(cos.shape)}; they must match")
    if 2 * cos.shape[1] > head_dim:
        raise ValueError(f"{names[0]}: rotary_dim = 2 * {cos.shape[1]} = {2 * cos.shape[1]} "
                         f"exceeds the head dim {head_dim}; rotary_dim <= headdim")


def positions(offsets: torch.Tensor, count: int, seqlen_ro: int, what: str) -> torch.Tensor:
    """Positions offsets[b] + arange(count) -> [B, count] int64, each checked < seqlen_ro."""
    pos = offsets.long()[:, None] + torch.arange(count, device=offsets.device)[None, :]
    if pos.numel() and int(pos.max()) >= seqlen_ro:
        raise ValueError(f"{what}: position {int(pos.max())} needs row {int(pos.max())} of the "
                         f"rotary tables, which have {seqlen_ro} rows; pass longer cos / sin")
    return pos


def apply_rotary_emb(x, cos, sin, interleaved=False, inplace=False,
                     seqlen_offsets: Union[int, torch.Tensor] = 0,
                     cu_seqlens: Optional[torch.Tensor] = None,
                     max_seqlen: Optional[int] = None):
    """Rotate x [B, S, H, D] (or packed [T, H, D] with ``cu_seqlens`` [B + 1]) by the
    rotary tables cos / sin [seqlen_ro, rotary_dim / 2]: token s of sequence b sits at
    position ``s + seqlen_offsets`` (an int, or an int tensor [B]).  Positions beyond the
    tables raise ValueError (a GPU ``seqlen_offsets`` / ``cu_seqlens`` is read to the host
    for that check).  ``inplace`` writes the result into x and returns x.  ``max_seqlen``
    is accepted for FlashAttention's signature and checked against the lengths."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"x: expected a floating-point tensor, got dtype {x.dtype}")
    varlen = cu_seqlens is not None
    if x.ndim != (3 if varlen else 4):
        want = ("(total_seqlen, nheads, headdim) with cu_seqlens" if varlen
                else "(batch_size, seqlen, nheads, headdim)")
        raise ValueError(f"x: expected shape {want}, got {tuple(x.shape)}")
    check_tables(cos, sin, x.shape[-1])
    for name, flag in (("interleaved", interleaved), ("inplace", inplace)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}: expected a bool, got {type(flag).__name__}")
    if varlen:
        if (not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.ndim != 1
                or cu_seqlens.is_floating_point() or cu_seqlens.numel() < 1):
            raise ValueError("cu_seqlens: expected a 1-d int tensor (batch_size + 1,)")
        cu = cu_seqlens.detach().cpu().long()
        lengths = cu[1:] - cu[:-1]
        if int(cu[0]) != 0 or (lengths < 0).any() or int(cu[-1]) != x.shape[0]:
            raise ValueError(f"cu_seqlens: expected non-decreasing offsets from 0 to x's "
                             f"{x.shape[0]} tokens, got {cu.tolist()}")
        if max_seqlen is not None and lengths.numel() and int(lengths.max()) > int(max_seqlen):
            raise ValueError(f"max_seqlen: is {max_seqlen} but a sequence holds "
                             f"{int(lengths.max())} tokens")
        batch = lengths.numel()
    else:
        batch = x.shape[0]
    if isinstance(seqlen_offsets, torch.Tensor):
        if (seqlen_offsets.ndim != 1 or seqlen_offsets.shape[0] != batch
                or seqlen_offsets.is_floating_point()):
            raise ValueError(f"seqlen_offsets: expected an int or an int tensor of shape "
                             f"({batch},), got shape {tuple(seqlen_offsets.shape)} dtype "
                             f"{seqlen_offsets.dtype}")
        offsets = seqlen_offsets.detach().to(x.device).long()
    elif isinstance(seqlen_offsets, numbers.Integral) and not isinstance(seqlen_offsets, bool):
        offsets = torch.full((batch,), int(seqlen_offsets), dtype=torch.long, device=x.device)
    else:
        raise TypeError(f"seqlen_offsets: expected an int or an int tensor ({batch},), got "
                        f"{type(seqlen_offsets).__name__}")
    if offsets.numel() and int(offsets.min()) < 0:
        raise ValueError(f"seqlen_offsets: holds {int(offsets.min())}; offsets are >= 0")
    seqlen_ro = cos.shape[0]
    if varlen:
        seq = torch.repeat_interleave(torch.arange(batch), lengths).to(x.device)
        start = cu[:-1].to(x.device)
        pos = torch.arange(x.shape[0], device=x.device) - start[seq] + offsets[seq]
        if pos.numel() and int(pos.max()) >= seqlen_ro:
            raise ValueError(f"cos: has {seqlen_ro} rows but a token sits at position "
                             f"{int(pos.max())}; pass longer cos / sin")
    else:
        pos = positions(offsets, x.shape[1], seqlen_ro, "seqlen_offsets")
    out = rotate(x, cos.to(x.device)[pos], sin.to(x.device)[pos], interleaved)
    if inplace:
        x.copy_(out)
        return x
    return out


#: FlashAttention's older name
apply_rotary_emb_func = apply_rotary_emb
