"""WebGPU device arrays: strided views over wgpu buffers (public as
``anyattn.webgpu.DeviceArray``; created by ``anyattn.webgpu.asarray`` / ``from_buffer``
and returned by the webgpu backend's device-resident calls).

Shape, strides and offset count elements; ``dtype`` is float32 or float16.  Nothing
here imports wgpu: a view only holds its buffer.  The one arithmetic operation, ``+``
(``RowStats.lse`` of device statistics), runs on the webgpu backend, reached through
the backend registry.
"""
from __future__ import annotations

from typing import Sequence, Tuple

import numpy as np

__all__ = ["DeviceArray", "DTYPES", "HOME", "contiguous_strides", "check_dtype"]

#: element types of device arrays (what the webgpu kernels read and write)
DTYPES = ("float32", "float16")
#: the device label of anyattn's own wgpu device (any other device is 'webgpu:N', N >= 1)
HOME = "webgpu:0"


def contiguous_strides(shape: Sequence[int]) -> Tuple[int, ...]:
    """Element strides of a C-contiguous array of ``shape``."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(out))


def check_dtype(dtype) -> np.dtype:
    """``dtype`` as a NumPy dtype of a device array (TypeError for any other)."""
    try:
        dt = np.dtype(dtype)
    except TypeError as e:
        raise TypeError(f"dtype: {dtype!r} is not a dtype ({e})") from None
    if dt.name not in DTYPES:
        raise TypeError(f"dtype: {dt.name} is not supported by WebGPU device arrays; expected "
                        f"one of {DTYPES} (convert on the host first, e.g. "
                        "x.astype(np.float32))")
    return dt


class DeviceArray:
    """A strided view over a wgpu buffer: ``buffer``, ``shape``, ``dtype``, element
    ``strides`` and element ``offset``; ``device`` is 'webgpu:N'.  Created by
    ``anyattn.webgpu.asarray`` and ``from_buffer`` (and returned by anyattn's calls)."""

    _anyattn_kind = "webgpu"       # anyattn.arrays.array_kind reads this
    __slots__ = ("buffer", "shape", "dtype", "strides", "offset", "device", "base",
                 "__weakref__")

    def __init__(self, buffer, shape, dtype, strides, offset, device_label, base=None):
        self.buffer = buffer
        self.shape = tuple(int(n) for n in shape)
        self.dtype = np.dtype(dtype)
        self.strides = tuple(int(s) for s in strides)
        self.offset = int(offset)
        self.device = device_label
        #: the array this one is a view of (None for an array that owns its view of the
        #: buffer); a view keeps its base alive, so a result buffer anyattn returned is
        #: reused only after the result and every view of it are gone
        self.base = base

    @classmethod
    def root(cls, buffer, shape, dtype, strides, offset, device_label) -> "DeviceArray":
        """A new root array from values already normalised (tuples of ints, np.dtype,
        int): the per-call result path, without the conversions of ``__init__``."""
        a = cls.__new__(cls)
        a.buffer, a.shape, a.dtype, a.strides = buffer, shape, dtype, strides
        a.offset, a.device, a.base = offset, device_label, None
        return a

    # ---- attributes ----------------------------------------------------------
    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def size(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def is_contiguous(self) -> bool:
        """C-contiguous (size-1 dims may have any stride)."""
        return all(n == 1 or s == c for n, s, c in
                   zip(self.shape, self.strides, contiguous_strides(self.shape)))

    def span(self) -> Tuple[int, int]:
        """(first, last + 1) element index the view touches ((offset, offset) if empty)."""
        if self.size == 0:
            return self.offset, self.offset
        return self.offset, self.offset + 1 + sum((n - 1) * s
                                                  for n, s in zip(self.shape, self.strides))

    def __repr__(self) -> str:
        return (f"DeviceArray(shape={self.shape}, dtype={self.dtype.name}, strides="
                f"{self.strides}, offset={self.offset}, device={self.device!r})")

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d device array")
        return self.shape[0]

    def __array__(self, *a, **k):
        raise TypeError("a DeviceArray lives on the GPU; read it back explicitly with "
                        ".numpy() (anyattn never copies device arrays to the host "
                        "implicitly)")

    # ---- views (no data moves) ------------------------------------------------
    def _view(self, shape, strides, offset=None) -> "DeviceArray":
        return DeviceArray(self.buffer, shape, self.dtype, strides,
                           self.offset if offset is None else offset, self.device,
                           self if self.base is None else self.base)

    def transpose(self, *axes) -> "DeviceArray":
        if len(axes) == 1 and isinstance(axes[0], (tuple, list)):
            axes = tuple(axes[0])
        if not axes:
            axes = tuple(reversed(range(self.ndim)))
        if sorted(int(a) % max(self.ndim, 1) for a in axes) != list(range(self.ndim)):
            raise ValueError(f"transpose: axes {axes} are no permutation of {self.ndim} dims")
        axes = [int(a) % self.ndim for a in axes]
        return self._view([self.shape[a] for a in axes], [self.strides[a] for a in axes])

    def swapaxes(self, a: int, b: int) -> "DeviceArray":
        ax = list(range(self.ndim))
        ax[a], ax[b] = ax[b], ax[a]
        return self.transpose(ax)

    def reshape(self, *shape) -> "DeviceArray":
        """A view with a new shape: any shape for a contiguous array; otherwise only
        adding or removing size-1 dims (never a copy: NotImplementedError instead)."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        shape = tuple(int(n) for n in shape)
        if -1 in shape:
            known = int(np.prod([n for n in shape if n != -1]))
            shape = tuple(self.size // max(known, 1) if n == -1 else n for n in shape)
        if int(np.prod(shape, dtype=np.int64)) != self.size:
            raise ValueError(f"reshape: cannot view {self.shape} as {shape}")
        if self.is_contiguous:
            return self._view(shape, contiguous_strides(shape))
        kept = [(n, s) for n, s in zip(self.shape, self.strides) if n != 1]
        if [n for n in shape if n != 1] == [n for n, _ in kept]:
            it = iter(kept)
            return self._view(shape, [next(it)[1] if n != 1 else 0 for n in shape])
        raise NotImplementedError(f"reshape: {self.shape} with strides {self.strides} -> "
                                  f"{shape} needs a copy; device arrays only take views")

    def __getitem__(self, idx) -> "DeviceArray":
        """Basic slicing with steps >= 1 along leading dims (a view, no copy)."""
        if not isinstance(idx, tuple):
            idx = (idx,)
        if len(idx) > self.ndim:
            raise IndexError(f"{len(idx)} indices for {self.ndim} dims")
        shape, strides, off = [], [], self.offset
        for d, (n, s) in enumerate(zip(self.shape, self.strides)):
            if d >= len(idx):
                shape.append(n)
                strides.append(s)
                continue
            ix = idx[d]
            if isinstance(ix, slice):
                a, b, st = ix.indices(n)
                if st < 1:
                    raise NotImplementedError("device arrays: negative slice steps")
                cnt = max(0, -(-(b - a) // st))
                off += a * s if cnt else 0
                shape.append(cnt)
                strides.append(s * st)
            else:
                i = int(ix)
                if not -n <= i < n:
                    raise IndexError(f"index {i} out of range for dim {d} of size {n}")
                off += (i % n) * s
        return self._view(shape, strides, off)

    # ---- arithmetic (only what anyattn needs: RowStats.lse) --------------------
    def __add__(self, other) -> "DeviceArray":
        """Element-wise sum of two float32 device arrays of one shape (on the GPU)."""
        from ..registry import get_backend

        if not isinstance(other, DeviceArray):
            raise TypeError(f"DeviceArray + {type(other).__name__}: only device arrays of "
                            "the same device, shape and dtype float32 add")
        return get_backend("webgpu").add_arrays(self, other)

    # ---- host transfer (explicit) -----------------------------------------------
    def numpy(self) -> np.ndarray:
        """Read the view back into a new NumPy array (the one host transfer)."""
        if self.size == 0:
            return np.zeros(self.shape, self.dtype)
        lo, hi = self.span()
        it = self.itemsize
        a = (lo * it) // 4 * 4
        b = -(-(hi * it) // 4) * 4
        mem = self.buffer._device.queue.read_buffer(self.buffer, a, b - a)
        flat = np.frombuffer(mem, np.uint8).view(self.dtype) if (b - a) % it == 0 else \
            np.frombuffer(mem, np.uint8)[:(b - a) // it * it].view(self.dtype)
        base = (lo * it - a) // it
        view = np.lib.stride_tricks.as_strided(flat[base:], shape=self.shape,
                                               strides=[s * it for s in self.strides])
        return np.array(view)
