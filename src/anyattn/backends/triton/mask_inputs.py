"""Mask and modifier arrays on their way to the kernels, without stalling the host.

A host-device synchronisation stops the host until the GPU has run everything queued
before it: once per training step, it takes away the host's lead over the GPU.  A new
``Documents`` / ``KeepMask`` mask (a packed-sequence loop builds one every step, shared
by all layers) reaches the kernels through this module:

- :func:`to_device`: a host array's copy to the GPU that does not wait for the GPU
  (staged in a private pinned buffer, then an asynchronous copy), kept per mask tensor so
  that the layers sharing a mask copy it once (up to :data:`KEPT_BYTES` of copies: a
  large host KeepMask is copied per call rather than held on the GPU);
- :func:`kernel_ids`: the document ids as the kernels read them (int32, renumbered in
  order where some id is beyond int32: a plain cast would merge documents) and whether
  each row is non-decreasing (the tile lists and the Hopper forward take a cheaper
  exact path then), worked out where the ids live: on the host for NumPy arrays and
  CPU tensors (no synchronisation), with one device read for both id arrays on a GPU;
  kept per id tensors.

Shape legend: Bd id rows (1 or B), Sq / Sk query / key positions.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

#: entries per cache below (each holds its source tensors: their memory stays theirs, so
#: an identity key cannot be reused by a new tensor while its entry lives)
CACHE_SIZE = 16

#: device memory the kept copies may hold together (document ids take S * 4 bytes a row)
KEPT_BYTES = 64 << 20

_copies: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()
_ids: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()


def clear() -> None:
    """Forget the kept copies and document ids."""
    _copies.clear()
    _ids.clear()


def tensor_key(x):
    """Identity of a torch tensor's contents for caching: storage pointer, layout and
    version counter (bumped by every in-place write).  () for None; None for NumPy arrays
    (they have no version counter: not cached)."""
    if x is None:
        return ()
    if not isinstance(x, torch.Tensor):
        return None
    return (x.data_ptr(), tuple(x.shape), tuple(x.stride()), x._version, str(x.device))


def _remember(cache, key, value, held) -> Any:
    cache[key] = (value, held)
    while len(cache) > CACHE_SIZE:
        cache.popitem(last=False)
    return value


def _copy(x, device, dtype: Optional[torch.dtype]):
    t = x if isinstance(x, torch.Tensor) else torch.from_numpy(np.ascontiguousarray(x))
    dtype = dtype if dtype is not None else t.dtype
    if t.device.type != "cpu" or device.type != "cuda":
        return t.to(device=device, dtype=dtype)
    # host -> GPU without waiting for the GPU: staged (converted) in a private pinned
    # buffer of torch's caching host allocator, which keeps the buffer from reuse until
    # the copy that reads it has run (a pageable source may make the driver synchronise
    # with the stream to stage it; the caller's own pinned buffer may be written again
    # while the copy is queued)
    staged = torch.empty(t.shape, dtype=dtype, pin_memory=True)
    staged.copy_(t)
    return staged.to(device=device, non_blocking=True)


def to_device(x, device, dtype: Optional[torch.dtype] = None, keep: bool = False):
    """``x`` (a NumPy array or torch tensor) on ``device`` in ``dtype``, copied from the
    host without a host-device synchronisation (``_copy``).  ``keep``: the
    copy of a torch tensor is kept per tensor identity and version (mask arrays, shared
    by the layers of a step); modifier arrays (learnable, small) are copied per call."""
    if isinstance(x, torch.Tensor) and x.device == device and (dtype is None
                                                               or x.dtype == dtype):
        return x
    key = tensor_key(x) if keep else None
    if key is None:
        return _copy(x, device, dtype)
    key = (key, str(device), dtype)
    hit = _copies.get(key)
    if hit is not None:
        _copies.move_to_end(key)
        return hit[0]
    out = _copy(x, device, dtype)
    size = out.numel() * out.element_size()
    if size > KEPT_BYTES:
        return out
    while _copies and size + sum(c.numel() * c.element_size()
                                 for c, _ in _copies.values()) > KEPT_BYTES:
        _copies.popitem(last=False)
    return _remember(_copies, key, out, x)


def on_host(ids) -> bool:
    """Whether ``ids`` can be read without the GPU: a NumPy array or a CPU tensor."""
    return not isinstance(ids, torch.Tensor) or ids.device.type == "cpu"


@dataclass(frozen=True)
class KernelIds:
    """Document ids as the kernels read them: q [Bd, Sq], k [Bd, Sk] int32 on the device,
    equal exactly where the given ids are equal (ids outside the int32 range are
    renumbered in order); q_sorted / k_sorted: every row of q / k is non-decreasing."""

    q: torch.Tensor
    k: torch.Tensor
    q_sorted: bool
    k_sorted: bool


#: torch dtypes whose every value is an int32 value (and that every torch op takes)
_NARROW = frozenset({torch.int8, torch.int16, torch.int32, torch.uint8})
_I32_LO, _I32_HI = -(1 << 31), (1 << 31) - 1


def _np_rows_sorted(a: np.ndarray) -> bool:
    return bool((a[..., 1:] >= a[..., :-1]).all())


def _np_fits_int32(a: np.ndarray) -> bool:
    if a.size == 0:
        return True
    lo, hi = a.min(), a.max()
    return (a.dtype.kind == "u" or int(lo) >= _I32_LO) and int(hi) <= _I32_HI


def _host_ids(q_ids, k_ids, device) -> KernelIds:
    """kernel_ids of host arrays: checked and converted on the host, then copied."""
    qa, ka = (x if isinstance(x, np.ndarray) else x.detach().numpy() for x in (q_ids, k_ids))
    if _np_fits_int32(qa) and _np_fits_int32(ka):
        q32, k32 = qa.astype(np.int32), ka.astype(np.int32)
    else:     # renumber in order: np.unique's inverse keeps <= and ==
        common = np.result_type(qa, ka)            # int64 with uint64: float64, inexact
        common = object if common.kind == "f" else common
        both = np.concatenate([qa.ravel().astype(common), ka.ravel().astype(common)])
        _, inv = np.unique(both, return_inverse=True)
        inv = inv.reshape(-1).astype(np.int32)
        q32, k32 = inv[:qa.size].reshape(qa.shape), inv[qa.size:].reshape(ka.shape)
    return KernelIds(_copy(torch.from_numpy(np.ascontiguousarray(q32)), device, None),
                     _copy(torch.from_numpy(np.ascontiguousarray(k32)), device, None),
                     _np_rows_sorted(q32), _np_rows_sorted(k32))


def _rows_sorted(x: torch.Tensor) -> torch.Tensor:
    return (x[..., 1:] >= x[..., :-1]).all()


def _device_ids(q_ids, k_ids, device) -> KernelIds:
    """kernel_ids of device tensors: one device read (the order facts, and whether every
    value is an int32 value where the dtype allows others)."""
    q, k = q_ids.to(device), k_ids.to(device)
    q32, k32 = q.to(torch.int32), k.to(torch.int32)
    flags = [_rows_sorted(q32), _rows_sorted(k32)]
    narrow = q.dtype in _NARROW and k.dtype in _NARROW
    if not narrow:
        flags += [((x >= _I32_LO) & (x <= _I32_HI)).all() for x in (q, k)]
        flags += [_rows_sorted(q), _rows_sorted(k)]
    got = [bool(f) for f in torch.stack(flags).tolist()]           # the one device read
    if narrow or (got[2] and got[3]):
        return KernelIds(q32, k32, got[0], got[1])
    # values beyond int32 (rare): renumbered in order (torch.unique: one more read)
    _, inv = torch.unique(torch.cat([q.reshape(-1), k.reshape(-1)]), return_inverse=True)
    inv = inv.to(torch.int32)
    return KernelIds(inv[:q.numel()].reshape(q.shape), inv[q.numel():].reshape(k.shape),
                     got[4], got[5])


def kernel_ids(q_ids, k_ids, device) -> KernelIds:
    """The document ids q_ids [Bd, Sq], k_ids [Bd, Sk] (a mask's arrays as given: NumPy
    or torch, any integer dtype) as the kernels read them on ``device``: KernelIds.
    Host arrays are checked and converted on the host and copied without a
    synchronisation; device tensors cost one device read; the result is kept per id
    tensors (identity and version)."""
    parts = (tensor_key(q_ids), tensor_key(k_ids))
    key = None if None in parts else parts + (str(device),)
    hit = _ids.get(key) if key is not None else None
    if hit is not None:
        _ids.move_to_end(key)
        return hit[0]
    # NumPy ids, and unsigned 16 / 32 / 64-bit tensors (which few torch ops take), are
    # worked out on the host (a GPU tensor among them is read back)
    host = any(not isinstance(x, torch.Tensor) or (x.dtype not in _NARROW
                                                   and x.dtype != torch.int64)
               for x in (q_ids, k_ids))
    if host or (on_host(q_ids) and on_host(k_ids)):
        res = _host_ids(*(x.cpu() if isinstance(x, torch.Tensor) else x
                          for x in (q_ids, k_ids)), device)
    else:
        res = _device_ids(torch.as_tensor(q_ids), torch.as_tensor(k_ids), device)
    if key is None:
        return res
    return _remember(_ids, key, res, (q_ids, k_ids))
