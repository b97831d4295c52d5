"""The Triton backend's launch entry points and its caches' controls.

forward.py   the portable forward's launch (the Hopper forward where routed)
backward.py  the backward's launches (the Hopper dK/dV (+ dQ) kernels where routed)
route.py     which path and config a call runs, as one function over plain data
prepared.py  the per-signature prepared launches and the tiled launches' resolution
tiles.py     mask arguments and the tile lists of Documents / KeepMask masks
operands.py  layouts, the fp32 product schemes' operands, the score modifiers' arguments
"""
from __future__ import annotations

from . import mask_inputs, prepared, tiles
from .backward import backward
from .forward import forward
from .tiles import TileLists, tile_lists

__all__ = ["forward", "backward", "tile_lists", "TileLists", "clear_caches",
           "clear_prepared"]


def clear_caches() -> None:
    """Forget the tile lists, the mask arrays' kept copies and facts, and the prepared
    launches."""
    tiles.clear()
    mask_inputs.clear()
    prepared.clear_prepared()


def clear_prepared() -> None:
    """Forget every prepared launch (tests; a changed kernel module)."""
    prepared.clear_prepared()
