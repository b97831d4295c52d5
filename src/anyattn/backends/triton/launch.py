"""The Triton backend's launch entry points and its caches' controls.

forward.py   the portable forward's launch (the Hopper forward where routed)
backward.py  the backward's launches (the Hopper dK/dV (+ dQ) kernels where routed)
route.py     which path and config a call runs, as one function over plain data
prepared.py  the per-signature prepared launches and the tiled launches' resolution
tiles.py     mask arguments and the tile lists of Documents / KeepMask masks
operands.py  layouts, the fp32 product schemes' operands, the score modifiers' arguments
"""
from __future__ import annotations

from typing import Optional

from . import mask_inputs, prepared, tiles
from .backward import backward
from .forward import forward
from .tiles import TileLists, tile_lists

__all__ = ["forward", "backward", "tile_lists", "TileLists", "clear_caches",
           "clear_prepared", "set_mask_lowering"]


def clear_caches() -> None:
    """Forget the tile lists, the mask arrays' kept copies and facts, and the prepared
    launches."""
    tiles.clear()
    mask_inputs.clear()
    prepared.clear_prepared()


def clear_prepared() -> None:
    """Forget every prepared launch (tests; a changed kernel module)."""
    prepared.clear_prepared()


def set_mask_lowering(name: Optional[str]) -> None:
    """Choose how Documents / KeepMask masks reach the portable kernels, process-wide:
    ``"lists"`` (None: the default) -- per block row / column the sorted indices of its
    partial and of its full blocks; ``"ranges"`` -- per block row / column one range of
    blocks holding every kept block, with the run of full blocks inside it unmasked
    (exact for sorted document ids, where the kept blocks of a row are contiguous; a
    range over a scattered KeepMask also visits the empty blocks between, masked).
    Forgets the tile lists and prepared launches built under the other choice."""
    if tiles.set_lowering(name):
        clear_caches()
