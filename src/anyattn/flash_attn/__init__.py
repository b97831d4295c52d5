"""FlashAttention 2's Python API on anyattn: ``import anyattn.flash_attn as flash_attn``.

``flash_attn_func``, ``flash_attn_kvpacked_func``, ``flash_attn_qkvpacked_func``,
``flash_attn_varlen_func`` (+ ``_kvpacked`` / ``_qkvpacked``) and
``flash_attn_with_kvcache`` take torch tensors in FlashAttention's [B, S, H, D] layout
(packed [T, H, D] for varlen) and run on CPU tensors (NumPy backend) and CUDA tensors
(Triton) through :func:`anyattn.torch.attention`.  :func:`install` makes
``import flash_attn`` / ``from flash_attn import ...`` find this module (and
``flash_attn.bert_padding`` / ``flash_attn.layers.rotary`` their helpers here), for code
that cannot be edited.  docs/flash_attn.md lists every difference from FlashAttention.

Importing it imports torch (``pip install "anyattn[torch]"``).
"""
from ..extras import require

require("torch", "torch", "anyattn.flash_attn")
del require

import sys  # noqa: E402

from . import bert_padding, flash_attn_interface, layers  # noqa: E402
from .layers import rotary  # noqa: E402
from .flash_attn_interface import (  # noqa: E402
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

__all__ = [
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "install",
]

#: the module names install() registers, and the modules they name
_ALIASES = ("flash_attn", "flash_attn.flash_attn_interface", "flash_attn.bert_padding",
            "flash_attn.layers", "flash_attn.layers.rotary")


def install() -> None:
    """Register this module as ``flash_attn`` (and its submodules
    ``flash_attn.flash_attn_interface``, ``flash_attn.bert_padding``,
    ``flash_attn.layers`` and ``flash_attn.layers.rotary``) in ``sys.modules``, so that
    later ``import flash_attn`` / ``from flash_attn import flash_attn_func`` statements
    get anyattn's functions.  Calling it again is a no-op.
    Raises ValueError where another ``flash_attn`` is already imported (its functions may
    already be bound elsewhere): call install() before importing the code that uses it."""
    mods = (sys.modules[__name__], flash_attn_interface, bert_padding, layers, rotary)
    for name, mod in zip(_ALIASES, mods):
        present = sys.modules.get(name)
        if present is not None and present is not mod:
            raise ValueError(f"install: a module {name!r} is already imported "
                             f"({getattr(present, '__file__', present)!r}); call "
                             "anyattn.flash_attn.install() before anything imports flash_attn")
    for name, mod in zip(_ALIASES, mods):
        sys.modules[name] = mod
