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
from typing import Dict, Optional, Sequence, Tuple

import numpy as np

__all__ = ["DeviceArray", "asarray", "from_buffer", "device", "DTYPES"]

#: element types of device arrays (what the webgpu kernels read and write)
DTYPES = ("float32", "float16")
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
        return "webgpu:0"
    key = id(dev)
    if key not in _dev_ids:
        _dev_ids[key] = 1 + next(_dev_counter)
    return f"webgpu:{_dev_ids[key]}"


def _contiguous_strides(shape: Sequence[int]) -> Tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(out))


def _check_dtype(dtype) -> np.dtype:
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
    :func:`asarray` and :func:`from_buffer` (and returned by anyattn's calls)."""

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
    def _result(cls, buffer, shape, dtype, strides, offset, device_label) -> "DeviceArray":
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
                   zip(self.shape, self.strides, _contiguous_strides(self.shape)))

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
            return self._view(shape, _contiguous_strides(shape))
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
        from .backends.webgpu.resident import add_arrays

        if not isinstance(other, DeviceArray):
            raise TypeError(f"DeviceArray + {type(other).__name__}: only device arrays of "
                            "the same device, shape and dtype float32 add")
        return add_arrays(self, other)

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


def from_buffer(buffer, shape, dtype, *, offset: int = 0,
                strides: Optional[Sequence[int]] = None) -> DeviceArray:
    """A zero-copy view of an existing wgpu buffer (it needs ``BufferUsage.STORAGE``).

    ``shape``: the logical shape; ``dtype``: float32 or float16; ``offset`` and
    ``strides``: in elements (default C-contiguous), >= 0 (a stride of 0 broadcasts).
    Every element of the view must lie in the buffer: a view past its end is a
    ``ValueError`` (float16 views: within the buffer's whole 8-byte groups, as the
    kernels read f16 four at a time)."""
    dt = _check_dtype(dtype)
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
        strides = _contiguous_strides(shape)
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

    run = get_backend("webgpu")._runner
    if run is not None:
        run.results.claim(buffer)


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
        a = a.astype(_check_dtype(dtype))
    _check_dtype(a.dtype)
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
    return DeviceArray(buf, a.shape, a.dtype, _contiguous_strides(a.shape), 0, "webgpu:0")
