"""A drop-in for ``torch.nn.functional.scaled_dot_product_attention``.

Shape legend (torch's): query [*, L, E], key [*, S, E], value [*, S, Ev] (Ev may
differ from E, as in torch); the dim before L/S is the head dim (H for query, Hkv for
key/value), the dims before it are batch dims that broadcast.  Output [*, L, Ev].

Semantics follow torch: a boolean ``attn_mask`` keeps True entries, a float
mask is added to the scores, ``is_causal`` is top-left (``j <= i``), GQA
only with ``enable_gqa=True`` (a key/value head dim of 1 broadcasts, as in
torch); ``scale`` and ``enable_gqa`` are keyword-only.  ``attn_mask`` together with
``is_causal=True`` raises, as torch documents (its math kernel and every kernel for
inputs of 2 or 3 dims raise; its 4-D CPU kernel alone accepts the pair).

Every argument is honoured or refused, none is ignored.  Errors are raised
where torch raises, with an exception that is an instance
of torch's class (RuntimeError) *and* of anyattn's (TypeError / ValueError),
naming the argument.  ``dropout_p > 0`` drops with ``anyattn.dropout_mask`` (a seed
drawn from torch's default CPU generator per call, so ``torch.manual_seed`` reproduces
it; the mask differs from torch's own, which depends on its kernel and device).
Differences: ``dropout_p`` must be below 1; a query row that keeps no key returns 0.
"""
from __future__ import annotations

import numbers
from typing import Optional

import torch

from ..masks import Causal, KeepMask
from .functional import attention

__all__ = ["scaled_dot_product_attention", "SDPAValueError", "SDPATypeError"]


class SDPAValueError(ValueError, RuntimeError):
    """Bad shape/device for the SDPA drop-in (a RuntimeError in torch)."""


class SDPATypeError(TypeError, RuntimeError):
    """Bad dtype for the SDPA drop-in (a RuntimeError in torch)."""


def _real(x) -> bool:
    """A real number other than a bool (Python and NumPy ints and floats, as torch takes)."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _check_args(query, key, value, attn_mask, dropout_p, scale, is_causal, enable_gqa):
    for name, flag in (("is_causal", is_causal), ("enable_gqa", enable_gqa)):
        if not isinstance(flag, bool):
            raise TypeError(f"scaled_dot_product_attention(): argument '{name}' must be "
                            f"bool, not {type(flag).__name__}")
    if attn_mask is not None and is_causal:
        raise SDPAValueError(
            "attn_mask: must be None when is_causal=True (torch raises 'Explicit attn_mask "
            "should not be set when is_causal=True'); fold the causal pattern into the mask "
            "(a boolean mask: attn_mask & torch.ones(L, S, dtype=torch.bool).tril()), or "
            "use anyattn.torch.attention(q, k, v, mask=Causal() & KeepMask(attn_mask))")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"scaled_dot_product_attention(): argument '{name}' must be "
                            f"Tensor, not {type(x).__name__}")
        if x.ndim < 2:
            raise SDPAValueError(f"{name}: expected at least 2 dims [*, S, E], got shape "
                                 f"{tuple(x.shape)}")
    if not _real(dropout_p):
        raise TypeError(f"dropout_p: expected a float, got {type(dropout_p).__name__}")
    if dropout_p != dropout_p:
        raise SDPAValueError("dropout_p=nan: expected a probability in [0, 1)")
    if not 0.0 <= dropout_p < 1.0:
        raise SDPAValueError(f"dropout_p={dropout_p}: expected a probability in [0, 1)")
    if scale is not None and not _real(scale):
        raise TypeError(f"scaled_dot_product_attention(): argument 'scale' must be float, "
                        f"not {type(scale).__name__}")
    if not (query.dtype == key.dtype == value.dtype):
        raise SDPATypeError(
            f"query, key, value: expected one dtype, got query.dtype {query.dtype}, key.dtype "
            f"{key.dtype}, value.dtype {value.dtype}; cast them to one dtype")
    if not query.dtype.is_floating_point:
        raise SDPATypeError(f"query: dtype {query.dtype} is not a floating type; expected "
                            "float16, bfloat16, float32 or float64")
    if not (query.device == key.device == value.device):
        raise SDPAValueError(
            f"query, key, value: expected one device, got query on {query.device}, key on "
            f"{key.device}, value on {value.device}")
    if key.shape[-1] != query.shape[-1]:
        raise SDPAValueError(f"key: head dim {key.shape[-1]} differs from query's "
                             f"{query.shape[-1]} (query {tuple(query.shape)}, key "
                             f"{tuple(key.shape)})")
    if value.shape[-2] != key.shape[-2]:
        raise SDPAValueError(f"value: {value.shape[-2]} keys but key has {key.shape[-2]} "
                             f"(key {tuple(key.shape)}, value {tuple(value.shape)})")
    if attn_mask is not None:
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError(f"attn_mask: expected a Tensor or None, got "
                            f"{type(attn_mask).__name__}")
        if attn_mask.dtype != torch.bool and attn_mask.dtype not in (torch.float32,
                                                                      query.dtype):
            raise SDPATypeError(
                f"attn_mask: dtype {attn_mask.dtype}; expected bool (True = attend), "
                f"float32 or query's dtype {query.dtype} (added to the scores)")
        if attn_mask.device != query.device:
            raise SDPAValueError(f"attn_mask: is on {attn_mask.device} but query is on "
                                 f"{query.device}")


def _heads(query, key, value, enable_gqa):
    hq, hkv = (query.shape[-3] if query.ndim >= 3 else 1), (key.shape[-3] if key.ndim >= 3
                                                            else 1)
    if value.ndim >= 3 and key.ndim >= 3 and value.shape[-3] != hkv:
        raise SDPAValueError(f"value: {value.shape[-3]} heads but key has {hkv}")
    if hkv in (hq, 1):
        return
    if not enable_gqa:
        raise SDPAValueError(
            f"key: {hkv} heads do not match query's {hq}; pass enable_gqa=True for grouped "
            "query attention (query heads a multiple of key/value heads)")
    if hq % hkv:
        raise SDPAValueError(f"key: {hkv} key/value heads do not divide query's {hq} heads "
                             "(enable_gqa=True needs a multiple)")


def _to4(x: torch.Tensor, batch) -> torch.Tensor:
    """[*, H, S, E] (or [S, E]) -> [B, H, S, E] with the batch dims broadcast to ``batch``."""
    if x.ndim == 2:
        x = x[None]
    x = x.expand(*batch, *x.shape[-3:]) if tuple(x.shape[:-3]) != tuple(batch) else x
    if len(batch) == 1:
        return x
    return x.reshape(-1, *x.shape[-3:]) if batch else x[None]


def _batch_dims(*xs):
    try:
        return tuple(torch.broadcast_shapes(*[tuple(x.shape[:-3]) for x in xs]))
    except RuntimeError as e:
        raise SDPAValueError(f"query, key, value: batch dims {[tuple(x.shape[:-3]) for x in xs]}"
                             f" do not broadcast ({e})") from None


def _mask4(attn_mask, out_lead, L, S):
    """attn_mask broadcastable to [*out_lead, L, S] -> a 4-D broadcastable view/copy."""
    full = (*out_lead, L, S)
    if attn_mask.ndim > len(full):
        raise SDPAValueError(f"attn_mask: shape {tuple(attn_mask.shape)} has more dims than "
                             f"the attention weights {list(full)}")
    for have, want in zip(reversed(attn_mask.shape), reversed(full)):
        if have not in (1, want):
            raise SDPAValueError(f"attn_mask: shape {tuple(attn_mask.shape)} does not "
                                 f"broadcast to the attention weights {list(full)}")
    if len(full) <= 4:
        return attn_mask
    return attn_mask.expand(full).reshape(-1, *full[-3:])


def scaled_dot_product_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                                 attn_mask: Optional[torch.Tensor] = None,
                                 dropout_p: float = 0.0, is_causal: bool = False, *,
                                 scale: Optional[float] = None,
                                 enable_gqa: bool = False) -> torch.Tensor:
    """``torch.nn.functional.scaled_dot_product_attention`` computed by anyattn (module doc)."""
    _check_args(query, key, value, attn_mask, dropout_p, scale, is_causal, enable_gqa)
    _heads(query, key, value, enable_gqa)
    L, S, Ev = query.shape[-2], key.shape[-2], value.shape[-1]
    batch = _batch_dims(*(x for x in (query, key, value) if x.ndim > 3))
    q4, k4, v4 = (_to4(x, batch) for x in (query, key, value))
    hq = q4.shape[1]
    if attn_mask is not None:
        attn_mask = _mask4(attn_mask, (*batch, hq) if query.ndim > 2 else (), L, S)
    mask = Causal() if is_causal else None      # is_causal excludes attn_mask (_check_args)
    bias = None
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        mask = KeepMask(attn_mask)
    elif attn_mask is not None:
        bias = attn_mask
    out = attention(q4, k4, v4, mask=mask, bias=bias,
                    scale=None if scale is None else float(scale), dropout_p=float(dropout_p))
    return out.reshape(*batch, hq, L, Ev) if query.ndim > 2 else out.reshape(L, Ev)
