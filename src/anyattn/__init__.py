"""anyattn: scaled dot-product attention, forward and backward, for every mask,
layout and precision, on CPU (NumPy), CUDA GPUs (Triton) and any GPU (WebGPU).

The public surface is exactly ``__all__``.
"""
from .api import Gradients, attention, attention_backward, forward_with_stats
from .rowstats import RowStats
from .backends.base import BackendUnavailable
from .backends.registry import available_backends, describe_backends
from .dropout import dropout_mask
from .masks import Causal, Documents, KeepMask, Mask, Window
from .paged import Pages
from .programs.mods import MaskMod, ScoreMod
from . import math

__version__ = "0.1.0"

__all__ = [
    "attention",
    "attention_backward",
    "forward_with_stats",
    "Gradients",
    "RowStats",
    "Mask",
    "Causal",
    "Window",
    "KeepMask",
    "Documents",
    "Pages",
    "MaskMod",
    "ScoreMod",
    "math",
    "dropout_mask",
    "BackendUnavailable",
    "available_backends",
    "describe_backends",
    "__version__",
]
