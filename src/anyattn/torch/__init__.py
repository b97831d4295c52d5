"""anyattn for PyTorch: differentiable, ``torch.compile``-safe attention on torch tensors.

- ``attention(q, k, v, *, mask=None, bias=None, scale=None, ...)``: anyattn's own
  call (mask objects, bias, GQA, layouts), with gradients for q, k, v and bias.
- ``scaled_dot_product_attention(...)``: a drop-in for
  ``torch.nn.functional.scaled_dot_product_attention``.
- ``anyattn.torch.transformers_backend.register()``: ``attn_implementation="anyattn"``
  for Hugging Face transformers models.
- ``use_backend(name)``: a context manager that sets the backend of calls that name
  none (the SDPA drop-in, the transformers backend).

Importing ``anyattn`` never imports torch; importing ``anyattn.torch`` does.
The work runs in two ``torch.library`` custom ops, ``torch.ops.anyattn.attention_fwd``
and ``torch.ops.anyattn.attention_bwd`` (see ``anyattn.torch.ops``).
Without torch, importing it raises ImportError naming the extra to install
(``pip install "anyattn[torch]"``).
"""
from ..extras import require

require("torch", "torch", "anyattn.torch")
del require

from .functional import attention, use_backend  # noqa: E402
from .sdpa import scaled_dot_product_attention  # noqa: E402

__all__ = ["attention", "scaled_dot_product_attention", "use_backend"]
