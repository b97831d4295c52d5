"""Array-library helpers: tell NumPy arrays, torch tensors and WebGPU device arrays
(anyattn.webgpu.DeviceArray) apart without importing torch or wgpu."""
from __future__ import annotations

from typing import Any, Optional

import numpy as np

__all__ = ["array_kind", "to_numpy", "dtype_name", "device_name"]


def array_kind(x: Any) -> Optional[str]:
    """'numpy', 'torch', 'webgpu' (anyattn.webgpu.DeviceArray), or None for anything
    else (torch and wgpu are never imported here)."""
    if isinstance(x, np.ndarray):
        return "numpy"
    if getattr(type(x), "_anyattn_kind", None) == "webgpu":
        return "webgpu"
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


#: dtype object -> its name; only plain names (``str(dt)`` an identifier such as
#: 'float32' or 'torch.bfloat16'): a structured or non-native NumPy dtype is named anew
#: each time.  ``str(np.dtype)`` costs ~2 us, and one call names 8-13 arrays.
_DTYPE_NAMES: dict = {}


def dtype_name(x: Any) -> str:
    """'float32', 'bfloat16', ... for NumPy and torch alike."""
    dt = x.dtype
    try:
        return _DTYPE_NAMES[dt]
    except (KeyError, TypeError):       # not seen yet / not hashable
        pass
    name = str(dt).replace("torch.", "")
    if name.isidentifier() and len(_DTYPE_NAMES) < 64:
        try:
            _DTYPE_NAMES[dt] = name
        except TypeError:
            pass
    return name


def device_name(x: Any) -> str:
    """'cpu' for NumPy arrays; the torch device string ('cpu', 'cuda:0') for tensors;
    'webgpu:N' for device arrays (0: anyattn's wgpu device)."""
    kind = array_kind(x)
    if kind == "torch":
        return str(x.device)
    if kind == "webgpu":
        return x.device
    return "cpu"
