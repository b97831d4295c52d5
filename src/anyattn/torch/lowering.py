"""Mask objects -> the tensor and int arguments of the custom ops.

Shape legend: B batch, Hq query heads, Sq/Sk queries/keys, Bd 1 or B.

``lower`` folds a mask (Causal, Window, Documents, KeepMask and their ``&``)
into ``(band_lo, band_hi, q_ids [Bd, Sq] | None, k_ids [Bd, Sk] | None,
keep [.., .., .., ..] bool | None)``, the same pieces as
``anyattn.masks.resolve`` but with torch operations only, so that Dynamo
traces it without a graph break.  Shapes are checked by the core inside the op.

Document ids may stay on the host when q is on a GPU (CPU tensors as given, NumPy
arrays as CPU tensors): the Triton backend works out what its kernels need from them
on the host and copies them without a host-device synchronisation (a packed-sequence
loop's ids come from its data loader, new every step).  A second Documents term is
folded into ``keep`` on q's device.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..masks import _Lowering

__all__ = ["lower"]


def _tensor(x, device) -> torch.Tensor:
    """A NumPy array as a tensor on ``device``; a tensor as it is (one on another device
    than q is refused by the core inside the op, naming the mask term)."""
    if isinstance(x, torch.Tensor):
        return x
    return torch.as_tensor(x, device=device)


def _ids2(x, device) -> torch.Tensor:
    """Document ids [S] or [Bd, S] -> [Bd, S]: a tensor as it is, a NumPy array as a tensor
    on ``device``, or a CPU tensor (a copy: no view of an array that can change without
    a version counter) where ``device`` is a GPU."""
    if not isinstance(x, torch.Tensor) and device is not None and \
            torch.device(device).type != "cpu":
        t = torch.tensor(x)
    else:
        t = _tensor(x, device)
    return t if t.ndim == 2 else t[None]


def _keep4(x, device) -> torch.Tensor:
    t = _tensor(x, device)
    while t.ndim < 4:
        t = t[None]
    return t


def lower(mask, b: int, hq: int, sq: int, sk: int, q_offset: int = 0, k_offset: int = 0,
          device: Optional[torch.device] = None) -> Tuple:
    """-> (band_lo, band_hi, q_ids, k_ids, keep) for the op schema (see module doc)."""
    if mask is None:
        return None, None, None, None, None
    if not hasattr(mask, "_lower"):
        raise TypeError(
            f"mask: expected a mask object (Causal, Window, KeepMask, Documents or their & "
            f"composition), got {type(mask).__name__}; pass a boolean tensor as "
            "anyattn.KeepMask(tensor)")
    acc = _Lowering(b, hq, sq, sk)
    mask._lower(acc)
    shift = q_offset - k_offset  # keep iff lo <= (j + ko) - (i + qo) <= hi
    lo = None if acc.lo is None else acc.lo + shift
    hi = None if acc.hi is None else acc.hi + shift

    q_ids = k_ids = keep = None
    for n, (qi, ki) in enumerate(acc.docs):
        qi, ki = _ids2(qi, device), _ids2(ki, device)
        if n == 0:
            q_ids, k_ids = qi, ki
        else:  # a second Documents term: fold it into the keep mask [Bd, 1, Sq, Sk]
            qi, ki = (x.to(device) if device is not None else x for x in (qi, ki))
            doc = qi[:, None, :, None] == ki[:, None, None, :]
            keep = doc if keep is None else keep & doc
    for km in acc.keeps:
        km = _keep4(km, device)
        keep = km if keep is None else keep & km
    return lo, hi, q_ids, k_ids, keep
