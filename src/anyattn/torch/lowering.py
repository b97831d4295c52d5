"""Mask objects -> the tensor and int arguments of the custom ops.

Shape legend: B batch, Hq query heads, Sq/Sk queries/keys, Bd 1 or B.

``lower`` folds a mask (Causal, Window, Documents, KeepMask and their ``&``)
into ``(band_lo, band_hi, q_ids [Bd, Sq] | None, k_ids [Bd, Sk] | None,
keep [.., .., .., ..] bool | None)`` with the core's lowering
(:func:`anyattn.masks.lower`, every term kind's fold) over :class:`TorchOps`: torch
operations only, so that Dynamo traces it without a graph break.  This module only
converts inputs; shapes are checked by the core inside the op.

Document ids may stay on the host when q is on a GPU (CPU tensors as given, NumPy
arrays as CPU tensors): the Triton backend works out what its kernels need from them
on the host and copies them without a host-device synchronisation (a packed-sequence
loop's ids come from its data loader, new every step).  A second Documents term is
folded into ``keep`` on q's device (combining two id pairs needs a data-dependent
``unique``).
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ..masks import ArrayOps
from ..masks import lower as lower_terms

__all__ = ["lower", "TorchOps"]


def _tensor(x, device) -> torch.Tensor:
    """A NumPy array as a tensor on ``device``; a tensor as it is (one on another device
    than q is refused by the core inside the op, naming the mask term)."""
    if isinstance(x, torch.Tensor):
        return x
    return torch.as_tensor(x, device=device)


class TorchOps(ArrayOps):
    """The core lowering's array operations as traceable torch ops on ``device``."""

    check = False           # the core checks shapes inside the op

    def __init__(self, device: Optional[torch.device]):
        self.device = device

    def ids2(self, ids) -> torch.Tensor:
        """Document ids [S] or [Bd, S] -> [Bd, S]: a tensor as it is, a NumPy array as a
        tensor on the device, or a CPU tensor (a copy: no view of an array that can
        change without a version counter) where the device is a GPU."""
        device = self.device
        if not isinstance(ids, torch.Tensor) and device is not None and \
                torch.device(device).type != "cpu":
            t = torch.tensor(ids)
        else:
            t = _tensor(ids, device)
        return super().ids2(t)

    def keep4(self, keep) -> torch.Tensor:
        return super().keep4(_tensor(keep, self.device))

    def logical_and(self, a, b) -> torch.Tensor:
        return a & b

    def combine_ids(self, q1, k1, q2, k2):
        return None                       # data-dependent shapes: fold into keep instead

    def doc_keep(self, q_ids, k_ids) -> torch.Tensor:
        if self.device is not None:
            q_ids, k_ids = q_ids.to(self.device), k_ids.to(self.device)
        return super().doc_keep(q_ids, k_ids)


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
    f = lower_terms(mask, b, hq, sq, sk, q_offset, k_offset, ops=TorchOps(device))
    other = sorted(k for k, v in f.items() if v is not None and k not in _OP_FIELDS)
    if other:
        raise NotImplementedError(
            f"mask: the lowered fields {other} have no argument in the anyattn torch ops "
            "(band, document ids, keep); call anyattn.attention with the tensors, or lower "
            "that term to a KeepMask")
    return f["band_lo"], f["band_hi"], f["q_ids"], f["k_ids"], f["keep"]


#: the ResolvedMask fields the custom ops carry (keep_key: NumPy arrays only)
_OP_FIELDS = ("band_lo", "band_hi", "q_ids", "k_ids", "keep", "keep_key")
