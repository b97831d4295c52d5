"""Array-library helpers: tell NumPy arrays from torch tensors without importing torch."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

__all__ = ["array_kind", "to_numpy", "dtype_name", "device_name"]


def array_kind(x: Any) -> Optional[str]:
    """'numpy', 'torch', or None for anything else (torch is never imported here)."""
    if isinstance(x, np.ndarray):
        return "numpy"
    mod = type(x).__module__
    if mod.startswith("torch") and hasattr(x, "dtype") and hasattr(x, "shape"):
        return "torch"
    return None


def to_numpy(x: Any) -> np.ndarray:
    """A NumPy view/copy of an array or (CPU or GPU) torch tensor."""
    if isinstance(x, np.ndarray):
        return x
    if array_kind(x) == "torch":
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":  # NumPy has no bfloat16
            x = x.float()
        return x.numpy()
    return np.asarray(x)


def dtype_name(x: Any) -> str:
    """'float32', 'bfloat16', ... for NumPy and torch alike."""
    return str(x.dtype).replace("torch.", "")


def device_name(x: Any) -> str:
    """'cpu' for NumPy arrays; the torch device string ('cpu', 'cuda:0') for tensors."""
    if array_kind(x) == "torch":
        return str(x.device)
    return "cpu"
