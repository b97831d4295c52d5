"""WebGPU device arrays: tensors that stay on the GPU between anyattn calls.

Shape legend: B batch, Hq/Hkv heads, Sq/Sk queries/keys, D head dim.

A :class:`DeviceArray` is a strided view over a wgpu ``GPUBuffer``: ``shape``,
``dtype`` (float32 or float16), ``strides`` and ``offset`` counted in elements.
:func:`asarray` uploads a NumPy array once; :func:`from_buffer` wraps a buffer a
runtime already owns (e.g. q, k, v as views into its arena, any layout) without a
copy.  ``anyattn.attention`` / ``attention_backward`` / ``forward_with_stats`` take
device arrays for every tensor argument, pick the ``webgpu`` backend automatically,
and return device arrays: no tensor data crosses to the host (masks, being host
descriptions, are uploaded as small tables).  ``.numpy()`` reads an array back.

Rules: every tensor argument of one call lives on anyattn's wgpu device (the
one ``device()`` returns); mixing device arrays with NumPy arrays, or with
arrays of another wgpu device, is refused with a ``TypeError`` / ``ValueError``.
wgpu is imported only when an array is created or read; without it, that raises
ImportError naming the extra (``pip install "anyattn[webgpu]"``).
"""
from __future__ import annotations

import itertools
from typing import Dict, Optional, Sequence

import numpy as np

from .backends.webgpu.device_array import (DTYPES, HOME, DeviceArray, check_dtype,
                                           contiguous_strides)

__all__ = ["DeviceArray", "asarray", "from_buffer", "device", "DTYPES"]

_U32 = 1 << 32
_dev_ids: Dict[int, int] = {}
_dev_counter = itertools.count()


def device():
    """anyattn's wgpu device (created on first use): allocate buffers for
    :func:`from_buffer` on it, with ``BufferUsage.STORAGE``."""
    from .backends.webgpu.device import get_context

    return get_context().device


def _device_label(dev) -> str:
    """'webgpu:0' for anyattn's device, 'webgpu:N' (N >= 1) for any other wgpu device."""
    from .backends.webgpu.device import get_context

    if dev is get_context().device:
        return HOME
    key = id(dev)
    if key not in _dev_ids:
        _dev_ids[key] = 1 + next(_dev_counter)
    return f"webgpu:{_dev_ids[key]}"


def from_buffer(buffer, shape, dtype, *, offset: int = 0,
                strides: Optional[Sequence[int]] = None) -> DeviceArray:
    """A zero-copy view of an existing wgpu buffer (it needs ``BufferUsage.STORAGE``).

    ``shape``: the logical shape; ``dtype``: float32 or float16; ``offset`` and
    ``strides``: in elements (default C-contiguous), >= 0 (a stride of 0 broadcasts).
    Every element of the view must lie in the buffer: a view past its end is a
    ``ValueError`` (float16 views: within the buffer's whole 8-byte groups, as the
    kernels read f16 four at a time)."""
    dt = check_dtype(dtype)
    for attr in ("size", "usage"):
        if not hasattr(buffer, attr):
            raise TypeError(f"buffer: expected a wgpu GPUBuffer, got {type(buffer).__name__}")
    from .extras import require

    wgpu = require("wgpu", "webgpu", "anyattn.webgpu.from_buffer")

    if not int(buffer.usage) & int(wgpu.BufferUsage.STORAGE):
        raise ValueError(f"buffer {buffer.label!r}: lacks BufferUsage.STORAGE (the kernels bind "
                         "it as a storage buffer); create it with STORAGE | COPY_SRC | COPY_DST")
    try:
        shape = tuple(int(n) for n in shape)
    except TypeError:
        raise TypeError(f"shape: expected a sequence of ints, got {shape!r}") from None
    if any(n < 0 for n in shape):
        raise ValueError(f"shape: {shape} has a negative size")
    if strides is None:
        strides = contiguous_strides(shape)
    strides = tuple(int(s) for s in strides)
    if len(strides) != len(shape):
        raise ValueError(f"strides: {strides} has {len(strides)} entries for the "
                         f"{len(shape)} dims of shape {shape}")
    if any(s < 0 for s in strides):
        raise ValueError(f"strides: {strides} has a negative stride; device arrays take "
                         "strides >= 0 (in elements)")
    offset = int(offset)
    if offset < 0:
        raise ValueError(f"offset: {offset} is negative; expected an element offset >= 0")
    arr = DeviceArray(buffer, shape, dt, strides, offset,
                      _device_label(getattr(buffer, "_device", None)))
    _claim(buffer)
    lo, hi = arr.span()
    # f16 is read as 8-byte vec4<f16>: only whole vec4s of the buffer are addressable
    cap = int(buffer.size) // 8 * 4 if dt == np.float16 else int(buffer.size) // 4
    if arr.size and hi > cap:
        raise ValueError(f"view past the end of buffer {buffer.label!r}: shape {shape}, strides "
                         f"{strides}, offset {offset} reach element {hi - 1}, the buffer "
                         f"holds {cap} {dt.name} elements ({buffer.size} bytes)")
    if hi >= _U32:
        raise ValueError(f"view reaches element {hi - 1}; the kernels address at most 2**32 "
                         "elements per buffer")
    return arr


def _claim(buffer) -> None:
    """A buffer anyattn returned a result in (its result pool's) becomes the caller's for
    good: the pool never hands it out again, whatever happens to the result arrays."""
    from .backends.registry import get_backend

    get_backend("webgpu").claim_buffer(buffer)


def asarray(x, dtype=None) -> DeviceArray:
    """A NumPy array (float32 / float16) uploaded once into a new buffer on anyattn's
    device -> a C-contiguous DeviceArray; a DeviceArray is returned as it is."""
    if isinstance(x, DeviceArray):
        if dtype is not None and np.dtype(dtype) != x.dtype:
            raise TypeError(f"asarray: the device array is {x.dtype.name}, dtype={dtype} asked "
                            "for; anyattn does not convert device arrays")
        return x
    a = np.asarray(x)
    if dtype is not None:
        a = a.astype(check_dtype(dtype))
    check_dtype(a.dtype)
    a = np.ascontiguousarray(a)
    from .extras import require

    wgpu = require("wgpu", "webgpu", "anyattn.webgpu.asarray")

    dev = device()
    nbytes = max(16, -(-a.nbytes // 16) * 16)
    buf = dev.create_buffer(label="anyattn.asarray", size=nbytes,
                            usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC
                            | wgpu.BufferUsage.COPY_DST)
    data = a.reshape(-1).view(np.uint8)
    if data.nbytes % 4:
        data = np.concatenate([data, np.zeros(4 - data.nbytes % 4, np.uint8)])
    if data.nbytes:
        dev.queue.write_buffer(buf, 0, data)
    return DeviceArray(buf, a.shape, a.dtype, contiguous_strides(a.shape), 0, HOME)
