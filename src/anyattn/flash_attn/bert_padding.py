"""Padding helpers of FlashAttention's ``flash_attn.bert_padding``: move between padded
batches [B, S, ...] and packed tokens [T, ...] (the varlen functions' layout).

Every function is differentiable in its tensor input (plain torch indexing).
"""
from __future__ import annotations

import torch

__all__ = ["index_first_axis", "index_put_first_axis", "pad_input", "unpad_input"]


def _check_indices(indices) -> torch.Tensor:
    if not isinstance(indices, torch.Tensor):
        raise TypeError(f"indices: expected a 1-d integer torch.Tensor, got "
                        f"{type(indices).__name__}")
    if indices.ndim != 1 or indices.is_floating_point() or indices.dtype == torch.bool:
        raise ValueError(f"indices: expected a 1-d integer tensor, got shape "
                         f"{tuple(indices.shape)} dtype {indices.dtype}")
    return indices.long()


def index_first_axis(input: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """``input[indices]`` along the first axis: input [N, ...], indices [T] -> [T, ...]."""
    if not isinstance(input, torch.Tensor) or input.ndim < 1:
        raise TypeError("input: expected a torch.Tensor with at least one dim")
    return input[_check_indices(indices)]


def index_put_first_axis(values: torch.Tensor, indices: torch.Tensor,
                         first_axis_dim: int) -> torch.Tensor:
    """The inverse of :func:`index_first_axis`: a zero tensor [first_axis_dim, ...] with
    ``values`` [T, ...] written at rows ``indices`` [T]."""
    if not isinstance(values, torch.Tensor) or values.ndim < 1:
        raise TypeError("values: expected a torch.Tensor with at least one dim")
    idx = _check_indices(indices)
    if idx.shape[0] != values.shape[0]:
        raise ValueError(f"indices: holds {idx.shape[0]} rows but values has "
                         f"{values.shape[0]}; they must match")
    out = values.new_zeros((int(first_axis_dim),) + tuple(values.shape[1:]))
    return out.index_put((idx,), values)


def unpad_input(hidden_states: torch.Tensor, attention_mask: torch.Tensor,
                unused_mask=None):
    """Pack the tokens of a padded batch.

    hidden_states [B, S, ...]; attention_mask [B, S] (bool or int, nonzero = a token);
    ``unused_mask`` [B, S] (optional): positions that are allocated but unused, packed
    too.  Returns ``(tokens [T, ...], indices [T] int64 into the flattened B·S
    positions, cu_seqlens [B + 1] int32, max_seqlen int, seqused [B] int32)`` where the
    packed lengths count ``attention_mask | unused_mask`` and ``seqused`` counts
    ``attention_mask`` alone.
    """
    if not isinstance(hidden_states, torch.Tensor) or hidden_states.ndim < 2:
        raise TypeError("hidden_states: expected a torch.Tensor (batch, seqlen, ...)")
    b, s = hidden_states.shape[:2]
    for name, m in (("attention_mask", attention_mask), ("unused_mask", unused_mask)):
        if m is None:
            continue
        if not isinstance(m, torch.Tensor) or tuple(m.shape) != (b, s):
            got = tuple(m.shape) if isinstance(m, torch.Tensor) else type(m).__name__
            raise ValueError(f"{name}: expected a tensor of shape (batch, seqlen) = "
                             f"({b}, {s}), got {got}")
    used = attention_mask != 0
    every = used | (unused_mask != 0) if unused_mask is not None else used
    lengths = every.sum(dim=-1, dtype=torch.int32)
    seqused = used.sum(dim=-1, dtype=torch.int32)
    indices = torch.nonzero(every.flatten(), as_tuple=False).flatten()
    cu = torch.zeros(b + 1, dtype=torch.int32, device=lengths.device)
    cu[1:] = torch.cumsum(lengths, dim=0)
    max_seqlen = int(lengths.max()) if b else 0
    tokens = hidden_states.reshape((b * s,) + tuple(hidden_states.shape[2:]))[indices]
    return tokens, indices, cu, max_seqlen, seqused


def pad_input(hidden_states: torch.Tensor, indices: torch.Tensor, batch: int,
              seqlen: int) -> torch.Tensor:
    """The inverse of :func:`unpad_input`: tokens [T, ...] placed at ``indices`` of a zero
    batch -> [batch, seqlen, ...]."""
    out = index_put_first_axis(hidden_states, indices, int(batch) * int(seqlen))
    return out.reshape((int(batch), int(seqlen)) + tuple(hidden_states.shape[1:]))
