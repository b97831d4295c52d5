"""Mask and modifier arrays on their way to the kernels, without stalling the host.

A host-device synchronisation stops the host until the GPU has run everything queued
before it: once per training step, it takes away the host's lead over the GPU.  A new
``Documents`` / ``KeepMask`` mask (a packed-sequence loop builds one every step, shared
by all layers) reaches the kernels through this module:

- :func:`to_device`: a host array's copy to the GPU that does not synchronise (a pageable
  source is staged by the copy call itself; a pinned one is copied blocking, since its
  DMA would read it after the call returns), kept per mask tensor so that the layers
  sharing a mask copy it once (up to :data:`KEPT_BYTES` of copies: a large host
  KeepMask is copied per call rather than held on the GPU);
- :func:`ids_sorted`: whether each row of the document ids is non-decreasing (the tile
  lists and the Hopper forward take a cheaper exact path then), read where the ids
  live: on the host for NumPy arrays and CPU tensors (no synchronisation), with one
  device read for both id arrays on a GPU; kept per id tensors.

Shape legend: Bd id rows (1 or B), Sq / Sk query / key positions.
"""
from __future__ import annotations

import collections
from typing import Any, Optional

import numpy as np
import torch

#: entries per cache below (each holds its source tensors: their memory stays theirs, so
#: an identity key cannot be reused by a new tensor while its entry lives)
CACHE_SIZE = 16

#: device memory the kept copies may hold together (document ids take S * 4 bytes a row)
KEPT_BYTES = 64 << 20

_copies: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()
_sorted: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()


def clear() -> None:
    """Forget the kept copies and sortedness facts."""
    _copies.clear()
    _sorted.clear()


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
    # cudaMemcpyAsync stages a pageable host buffer before it returns (no device
    # synchronisation; a copy larger than the driver's staging memory may still wait for
    # its first chunks' DMA, which document ids never are); a pinned buffer is read later
    # by the DMA, when the caller may already have written it again: that copy blocks
    nb = t.device.type == "cpu" and device.type == "cuda" and not t.is_pinned()
    return t.to(device=device, dtype=dtype if dtype is not None else t.dtype, non_blocking=nb)


def to_device(x, device, dtype: Optional[torch.dtype] = None, keep: bool = False):
    """``x`` (a NumPy array or torch tensor) on ``device`` in ``dtype``, copied without a
    host-device synchronisation where the source is pageable host memory.  ``keep``: the
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


def _host_rows_sorted(ids) -> bool:
    a = ids if isinstance(ids, np.ndarray) else ids.detach().numpy()
    a = a.reshape(-1, a.shape[-1])
    return bool((a[:, 1:] >= a[:, :-1]).all())


def on_host(ids) -> bool:
    """Whether ``ids`` can be read without the GPU: a NumPy array or a CPU tensor."""
    return not isinstance(ids, torch.Tensor) or ids.device.type == "cpu"


def ids_sorted(q_ids, k_ids) -> tuple:
    """(q rows sorted, k rows sorted): whether every row of q_ids [Bd, Sq] / k_ids [Bd, Sk]
    (the mask's arrays as the user gave them) is non-decreasing.  Host-resident ids are
    checked on the host; device-resident ones with one device read for both; the
    answer is kept per id tensors (identity and version)."""
    parts = (tensor_key(q_ids), tensor_key(k_ids))
    key = None if None in parts else parts
    hit = _sorted.get(key) if key is not None else None
    if hit is not None:
        _sorted.move_to_end(key)
        return hit[0]
    if on_host(q_ids) and on_host(k_ids):
        res = (_host_rows_sorted(q_ids), _host_rows_sorted(k_ids))
    else:
        flags = [(x[..., 1:] >= x[..., :-1]).all() for x in
                 (torch.as_tensor(q_ids), torch.as_tensor(k_ids))]
        q_s, k_s = torch.stack(flags).tolist()           # the one device read
        res = (bool(q_s), bool(k_s))
    if key is None:
        return res
    return _remember(_sorted, key, res, (q_ids, k_ids))
