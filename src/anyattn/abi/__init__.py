"""The seed kernel's arena ABI (DESIGN.md §2): ``Params`` and the arena entry point.

* :mod:`anyattn.abi.params`: :class:`Params` (the seed's 38 u32), its constants,
  packing and validation: the ABI's data, imported by the entry point and by the
  WebGPU bridge alike;
* :mod:`anyattn.abi.regions`: index geometry of strided regions (bounds,
  duplicate writes, overlaps) behind ``Params.validate``;
* :mod:`anyattn.abi.entry`: :func:`attention_backward_arena` and the conveniences
  (:func:`arena_views`, :func:`seed_mask`, :func:`pack_arena`, :func:`read_output`).

Every public name is importable from ``anyattn.abi``.
"""
from .entry import (ArenaViews, arena_views, attention_backward_arena, pack_arena, read_output,
                    seed_mask)
from .params import (FIELD_NAMES, MASK_BIAS, MASK_CAUSAL, MASK_CAUSAL_WINDOW, MASK_KEEP,
                     MASK_KINDS, MASK_NONE, PARAMS_NBYTES, WRT_K, WRT_NAMES, WRT_Q, WRT_V,
                     Params, bits_f32, f32_bits, layout_strides)

__all__ = [
    "Params", "FIELD_NAMES", "PARAMS_NBYTES",
    "MASK_NONE", "MASK_CAUSAL", "MASK_KEEP", "MASK_CAUSAL_WINDOW", "MASK_BIAS", "MASK_KINDS",
    "WRT_Q", "WRT_K", "WRT_V", "WRT_NAMES",
    "f32_bits", "bits_f32", "layout_strides", "seed_mask",
    "ArenaViews", "arena_views", "attention_backward_arena", "pack_arena", "read_output",
]
