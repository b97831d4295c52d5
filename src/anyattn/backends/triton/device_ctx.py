"""The CUDA device context around a launch, entered only where it changes something."""
from __future__ import annotations

import contextlib

import torch

__all__ = ["on_device"]

_NULL = contextlib.nullcontext()


def on_device(dev):
    """torch.cuda.device(dev) where ``dev`` is a CUDA device other than the current one,
    else a no-op context (launches already go to the current device; entering the
    context costs ~3 us of host per launch site)."""
    if dev.type != "cuda" or dev.index == torch.cuda.current_device():
        return _NULL
    return torch.cuda.device(dev)
