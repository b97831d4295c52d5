"""``attn_implementation="anyattn"`` for Hugging Face transformers models.

Shape legend: B batch, H/Hkv query/key-value heads, Sq/Sk queries/keys, D head dim.

Importing this module registers two things under the name ``"anyattn"``:
the attention function with ``transformers.AttentionInterface`` and the mask
builder with ``transformers.masking_utils.AttentionMaskInterface`` (the
boolean ``sdpa_mask``: True = attend, [B, 1, Sq, Sk], or None when the pattern
is plain causal, which then runs as anyattn's ``Causal()`` without a dense
mask).  Then::

    import anyattn.torch.transformers_backend  # noqa: F401
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="anyattn")

GQA runs natively (K/V are never repeated); padding masks become a KeepMask;
a float 4-D mask is added to the scores as a bias.  Attention dropout > 0
raises NotImplementedError (set ``attention_dropout=0.0``).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..masks import Causal, KeepMask
from .functional import attention

__all__ = ["anyattn_attention_forward", "register", "NAME"]

NAME = "anyattn"


def anyattn_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                              dropout: float = 0.0, scaling: Optional[float] = None,
                              is_causal: Optional[bool] = None,
                              **kwargs) -> Tuple[torch.Tensor, None]:
    """query [B, H, Sq, D], key/value [B, Hkv, Sk, D] -> (out [B, Sq, H, D], None)."""
    if dropout and dropout > 0.0:
        raise NotImplementedError(
            f"dropout={dropout}: anyattn has no attention dropout; set the config's "
            "attention_dropout=0.0 (or call model.eval())")
    if kwargs.get("output_attentions", False):
        raise NotImplementedError("output_attentions=True: anyattn never forms the attention "
                                  "weights; use attn_implementation='eager' for them")
    if kwargs.get("position_bias") is not None:
        raise NotImplementedError("position_bias: not supported by the anyattn backend yet")
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # As transformers' sdpa backend: no mask means the plain causal (or full) pattern.
    is_causal = query.shape[2] > 1 and attention_mask is None and is_causal
    mask = bias = None
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            mask = KeepMask(attention_mask)
        else:
            bias = attention_mask
    elif is_causal:
        mask = Causal()
    if bias is not None and bias.dtype not in (query.dtype, torch.float32):
        bias = bias.to(query.dtype)
    out = attention(query, key, value, mask=mask, bias=bias, scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``"anyattn"`` with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(NAME, anyattn_attention_forward)
    AttentionMaskInterface.register(NAME, sdpa_mask)


register()
