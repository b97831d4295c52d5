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
a float 4-D mask is added to the scores as a bias.  Results follow the
``"eager"`` implementation, also where a query keeps no key (a pad query under
left padding): eager's finite ``finfo.min`` mask makes that row attend to every
key uniformly, and so does this backend (``sdpa`` returns 0 there instead).

Every argument transformers passes is honoured or refused (transformers 5.x
calling convention: ``attention_interface(module, q, k, v, attention_mask,
dropout=, scaling=, [is_causal=, sliding_window=, softcap=, s_aux=,
position_bias=], **kwargs)`` with the model's ``TransformersKwargs``):

- honoured: ``attention_mask`` (bool or float), ``scaling``, ``is_causal``,
  ``sliding_window`` (the masks HF builds contain the window; without a mask it
  is applied where it can bind, see :func:`anyattn_attention_forward`),
  ``position_bias`` (added to the scores, with its gradient), ``cu_seq_lens_q`` /
  ``cu_seq_lens_k`` and ``seq_idx`` (packed sequences: a Documents mask),
  ``deterministic`` (anyattn's backward is always deterministic);
- accepted, without effect on attention: ``position_ids`` (rotary embeddings are
  applied before; packing reaches us through the mask built from them),
  ``max_length_q`` / ``max_length_k``, ``use_cache``, ``cache_position``,
  ``output_hidden_states``, ``output_router_logits``, ``num_items_in_batch``,
  ``return_dict``; ``dropout=0.0``; ``output_attentions=False``;
- refused with NotImplementedError naming the argument: ``dropout > 0``,
  ``output_attentions=True``, ``softcap`` (Gemma 2 logit soft-capping) and
  ``s_aux`` (gpt-oss attention sinks) until anyattn has score modifiers, and any
  other keyword argument that is not None.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..masks import Causal, Documents, KeepMask, Window
from .functional import attention

__all__ = ["anyattn_attention_forward", "register", "NAME", "IGNORED_KWARGS"]

NAME = "anyattn"

#: keyword arguments that reach the attention function but do not change attention.
IGNORED_KWARGS = frozenset({
    "position_ids", "max_length_q", "max_length_k", "use_cache", "cache_position",
    "output_hidden_states", "output_router_logits", "num_items_in_batch", "return_dict",
    "deterministic",
})


def _summary(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"<tensor {tuple(x.shape)} {str(x.dtype).replace('torch.', '')}>"
    return repr(x)


def _refuse(name: str, value, why: str) -> NotImplementedError:
    return NotImplementedError(f"{name}={_summary(value)}: {why}")


def _doc_ids(name: str, cu: torch.Tensor, n: int, batch: int) -> torch.Tensor:
    """cu_seq_lens [docs + 1] (cumulative, from 0 to n) -> document id per token [n]."""
    if batch != 1 or cu.ndim != 1 or cu.numel() < 2:
        raise _refuse(name, cu, "packed sequences need batch size 1 and cumulative lengths "
                      f"[documents + 1]; got batch {batch}")
    if not torch.compiler.is_compiling() and int(cu[-1]) != n:
        raise ValueError(f"{name}: the packed lengths end at {int(cu[-1])} but the sequence "
                         f"has {n} tokens")
    pos = torch.arange(n, device=cu.device, dtype=cu.dtype)
    return torch.bucketize(pos, cu[1:], right=True)


def _packed(query, key, cu_seq_lens_q, cu_seq_lens_k, seq_idx):
    """A Documents term from the packed-sequence arguments, or None."""
    B, Sq, Sk = query.shape[0], query.shape[2], key.shape[2]
    terms = []
    if cu_seq_lens_q is not None or cu_seq_lens_k is not None:
        cq = cu_seq_lens_q if cu_seq_lens_q is not None else cu_seq_lens_k
        ck = cu_seq_lens_k if cu_seq_lens_k is not None else cu_seq_lens_q
        terms.append(Documents(_doc_ids("cu_seq_lens_q", cq, Sq, B),
                               _doc_ids("cu_seq_lens_k", ck, Sk, B)))
    if seq_idx is not None:
        if (seq_idx.ndim != 2 or seq_idx.shape[0] not in (1, B) or seq_idx.shape[1] != Sq
                or Sq != Sk):
            raise _refuse("seq_idx", seq_idx, f"expected sequence ids [B, S] for {Sq} queries "
                          f"over as many keys (got {Sk} keys)")
        terms.append(Documents(seq_idx))
    out = None
    for t in terms:
        out = t if out is None else out & t
    return out


def _window_without_mask(sliding_window, causal: bool, Sq: int, Sk: int):
    """The Window term for ``sliding_window`` when no mask carries it (None: it cannot bind)."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) \
            or sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window!r}: expected a positive int or None")
    if causal:
        # HF: key j is kept iff j > i - sliding_window (top-left, as the Causal term)
        return Window(left=sliding_window - 1) if Sq > sliding_window else None
    if max(Sq, Sk) <= sliding_window:
        return None          # no query is sliding_window keys away from any key
    raise _refuse("sliding_window", sliding_window,
                  f"without an attention mask, for {Sq} queries over {Sk} keys in a "
                  "non-causal call, where the window's alignment would be a guess; pass "
                  "the mask transformers builds (attn_implementation='anyattn' does)")


def _empty_rows_like_eager(keep: torch.Tensor, dtype: torch.dtype):
    """A bias [B, 1, Sq, 1]: finfo.min on the rows of ``keep`` that keep no key, else 0.

    Eager adds finfo.min to every masked score, so a row masked everywhere attends to
    all keys uniformly; such rows then keep every key with that bias.  The bias is
    left out where no row is empty, checked only where that costs no device sync
    (CPU tensors outside torch.compile)."""
    empty = ~keep.any(dim=-1, keepdim=True)                       # [B, h, Sq, 1]
    if keep.device.type == "cpu" and not torch.compiler.is_compiling() \
            and not bool(empty.any()):
        return keep, None
    bias = torch.zeros(empty.shape, dtype=dtype, device=keep.device)
    bias = bias.masked_fill(empty, torch.finfo(dtype).min)
    return keep | empty, bias


def anyattn_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask: Optional[torch.Tensor],
                              dropout: float = 0.0, scaling: Optional[float] = None,
                              is_causal: Optional[bool] = None,
                              sliding_window: Optional[int] = None,
                              softcap: Optional[float] = None,
                              s_aux: Optional[torch.Tensor] = None,
                              position_bias: Optional[torch.Tensor] = None,
                              output_attentions: Optional[bool] = False,
                              cu_seq_lens_q: Optional[torch.Tensor] = None,
                              cu_seq_lens_k: Optional[torch.Tensor] = None,
                              seq_idx: Optional[torch.Tensor] = None,
                              **kwargs) -> Tuple[torch.Tensor, None]:
    """query [B, H, Sq, D], key/value [B, Hkv, Sk, D] -> (out [B, Sq, H, D], None).

    Which arguments are honoured, accepted or refused: see the module docstring.
    ``sliding_window`` without ``attention_mask``: in a causal call it is applied as
    ``Causal() & Window(left=sliding_window - 1)`` (HF's ``j > i - sliding_window``)
    where it can bind; a non-causal call where it could bind is refused.
    """
    if dropout and dropout > 0.0:
        raise _refuse("dropout", dropout, "anyattn has no attention dropout; set the config's "
                      "attention_dropout=0.0 (or call model.eval())")
    if output_attentions:
        raise _refuse("output_attentions", output_attentions, "anyattn never forms the "
                      "attention weights; use attn_implementation='eager' for them")
    if softcap is not None:
        raise _refuse("softcap", softcap, "attention logit soft-capping (Gemma 2) is not "
                      "implemented by the anyattn backend yet; use attn_implementation="
                      "'eager' for this model")
    if s_aux is not None:
        raise _refuse("s_aux", s_aux, "attention sinks (gpt-oss) are not implemented by the "
                      "anyattn backend yet; use attn_implementation='eager' for this model")
    for name, val in kwargs.items():
        if name not in IGNORED_KWARGS and val is not None:
            raise _refuse(name, val, "the anyattn backend does not implement this argument "
                          "of transformers' attention interface (use attn_implementation="
                          "'eager' or 'sdpa')")
    Sq, Sk = query.shape[2], key.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # As transformers' sdpa backend: no mask means the plain causal (or full) pattern.
    is_causal = Sq > 1 and attention_mask is None and is_causal
    mask = bias = None
    if attention_mask is not None:
        if attention_mask.dtype == torch.bool:
            keep, bias = _empty_rows_like_eager(attention_mask, torch.float32)
            mask = KeepMask(keep)
        else:
            bias = attention_mask
    else:
        window = _window_without_mask(sliding_window, is_causal, Sq, Sk)
        if is_causal:
            mask = Causal() if window is None else Causal() & window
    docs = _packed(query, key, cu_seq_lens_q, cu_seq_lens_k, seq_idx)
    if docs is not None:
        mask = docs if mask is None else mask & docs
    if position_bias is not None:
        bias = position_bias if bias is None else position_bias + bias
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
