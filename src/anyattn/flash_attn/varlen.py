"""Packed variable-length batches (``cu_seqlens``) as one anyattn problem.

Shape legend: N sequences, Tq/Tk packed query/key tokens (``q [Tq, Hq, D]``), lq[d] /
lk[d] the lengths of sequence d.

FlashAttention aligns causal masks, windows and ALiBi at the bottom right of *each*
sequence: query i of sequence d sits at key position ``i + lk[d] - lq[d]``.  On the
packed axes that shift differs per sequence, so one band term cannot express it.  The
lowering lays the tokens out so that every sequence's shift is the same, then uses the
core's ``Documents`` mask with one bottom-right band:

- ``packed``: the tokens as they are, one row (``Documents`` ids = sequence index).
  Exact whenever no band and no ALiBi is asked for, or every sequence has lq == lk.
- ``slots``: sequence d gets a slot of max(lq[d], lk[d]) positions on a common axis of
  T = Σ max(lq, lk) for queries and keys alike, its queries and keys right-aligned in
  it: then i' - j is the same on the common axis as within the sequence, for every d.
  The unused positions hold zeros and ids that match nothing.
- ``padded``: one batch row per sequence, queries and keys right-aligned in rows of
  max(lq) / max(lk) (bottom-right alignment of the padded rows is each sequence's);
  used where ALiBi slopes vary per sequence ([N, Hq]), as those index the batch.

Ids are non-decreasing along every row (the fast case of the GPU kernels): per sequence
d, a query slot left empty holds 4d, a key slot left empty 4d + 1, a token 4d + 2.
"""
from __future__ import annotations

import collections
import threading
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from .common import int_value

__all__ = ["Layout", "check_cu_seqlens", "layout"]


def _host(name: str, cu, device) -> np.ndarray:
    """``cu`` as int64 NumPy (one device read for a GPU tensor)."""
    if not isinstance(cu, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor of shape (batch_size + 1,), dtype "
                        f"torch.int32, got {type(cu).__name__}")
    if cu.ndim != 1 or cu.numel() < 1:
        raise ValueError(f"{name}: expected shape (batch_size + 1,), the cumulative sequence "
                         f"lengths starting at 0, got shape {tuple(cu.shape)}")
    if cu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: expected dtype torch.int32 (or int64), got {cu.dtype}; "
                        "build it with torch.nn.functional.pad(lengths.cumsum(0), (1, 0))"
                        ".to(torch.int32)")
    if cu.device.type != "cpu" and cu.device != device:
        raise ValueError(f"{name}: is on {cu.device} but q is on {device}; move it with "
                         ".to(q.device) (or keep it on the CPU)")
    return cu.detach().cpu().numpy().astype(np.int64)


def check_cu_seqlens(name: str, cu, total: int, total_name: str, max_name: str, max_seqlen,
                     device) -> np.ndarray:
    """Validate cumulative lengths against the packed length and ``max_seqlen`` ->
    the lengths of the sequences, int64 [N]."""
    max_seqlen = int_value(max_name, max_seqlen)
    if max_seqlen < 0:
        raise ValueError(f"{max_name}: is {max_seqlen}; expected the largest sequence "
                         "length, >= 0")
    c = _host(name, cu, device)
    if c[0] != 0:
        raise ValueError(f"{name}: must start at 0, got {name}[0] = {c[0]}")
    steps = np.diff(c)
    if (steps < 0).any():
        d = int(np.flatnonzero(steps < 0)[0])
        raise ValueError(f"{name}: must be non-decreasing (cumulative lengths), but "
                         f"{name}[{d + 1}] = {c[d + 1]} < {name}[{d}] = {c[d]}")
    if c[-1] != total:
        raise ValueError(f"{name}: its last entry is {c[-1]} but {total_name} holds {total} "
                         f"tokens; the last entry is the packed length")
    if steps.size and steps.max() > max_seqlen:
        d = int(np.argmax(steps))
        raise ValueError(f"{max_name}: is {max_seqlen} but sequence {d} has {steps[d]} tokens "
                         f"({name}[{d + 1}] - {name}[{d}]); pass the largest length")
    return steps


@dataclass
class Layout:
    """Where the packed tokens go: rows of ``nb`` batch entries of ``tq`` query / ``tk``
    key positions.  ``q_rows`` / ``k_rows``: int64 [Tq] / [Tk] flat indices (batch row
    · tq + position) on q's device, None where the layout is the packing itself.
    ``q_ids`` [nb, tq] / ``k_ids`` [nb, tk]: document ids (CPU int32 tensors).
    ``q_first`` / ``k_first`` [N]: flat index of each sequence's first token."""

    kind: str
    nb: int
    tq: int
    tk: int
    q_rows: Optional[torch.Tensor]
    k_rows: Optional[torch.Tensor]
    q_ids: torch.Tensor
    k_ids: torch.Tensor
    q_first: np.ndarray
    k_first: np.ndarray

    def scatter(self, x: torch.Tensor, rows: Optional[torch.Tensor], t: int) -> torch.Tensor:
        """[T, H, D] packed -> [nb, t, H, D] laid out (zeros where no token sits)."""
        if rows is None:
            return x.unsqueeze(0)
        out = x.new_zeros((self.nb * t,) + tuple(x.shape[1:]))
        return out.index_copy(0, rows, x).view((self.nb, t) + tuple(x.shape[1:]))

    def gather_out(self, out: torch.Tensor) -> torch.Tensor:
        """[nb, tq, H, Dv] -> [Tq, H, Dv]."""
        if self.q_rows is None:
            return out[0]
        return out.reshape((self.nb * self.tq,) + tuple(out.shape[2:])).index_select(
            0, self.q_rows)

    def gather_lse(self, lse: torch.Tensor) -> torch.Tensor:
        """[nb, H, tq] -> FlashAttention's varlen lse [H, Tq]."""
        if self.q_rows is None:
            return lse[0]
        flat = lse.transpose(0, 1).reshape(lse.shape[1], self.nb * self.tq)
        return flat.index_select(1, self.q_rows)


def _rows(index: np.ndarray, device) -> torch.Tensor:
    return torch.from_numpy(index).to(device)


#: the layouts of recent calls by their lengths (LRU): the layers of a training step share
#: one cu_seqlens, so they share one layout, its id tensors, and the tile lists the
#: backends keep per id tensor (never written after they are built)
_LAYOUTS: "collections.OrderedDict[tuple, Layout]" = collections.OrderedDict()
_LAYOUTS_SIZE = 8
_LAYOUTS_LOCK = threading.Lock()


def layout(lq: np.ndarray, lk: np.ndarray, aligned: bool, per_sequence_slopes: bool,
           device) -> Layout:
    """The layout of N sequences (see the module docstring).  ``aligned``: a band or
    ALiBi needs each sequence's bottom-right alignment; ``per_sequence_slopes``: ALiBi
    slopes of shape [N, Hq].  The same lengths give the same Layout object."""
    lq, lk = np.asarray(lq, np.int64), np.asarray(lk, np.int64)
    key = (lq.tobytes(), lk.tobytes(), bool(aligned), bool(per_sequence_slopes), str(device))
    with _LAYOUTS_LOCK:
        hit = _LAYOUTS.get(key)
        if hit is not None:
            _LAYOUTS.move_to_end(key)
            return hit
    lay = _build(lq, lk, aligned, per_sequence_slopes, device)
    with _LAYOUTS_LOCK:
        _LAYOUTS[key] = lay
        while len(_LAYOUTS) > _LAYOUTS_SIZE:
            _LAYOUTS.popitem(last=False)
    return lay


def _build(lq: np.ndarray, lk: np.ndarray, aligned: bool, per_sequence_slopes: bool,
           device) -> Layout:
    n = lq.size
    seq = np.arange(n, dtype=np.int64)
    if per_sequence_slopes and n > 0:
        kind = "padded"
        tq = int(lq.max()) if n else 0
        tk = int(lk.max()) if n else 0
        q_first = seq * tq + (tq - lq)
        k_first = seq * tk + (tk - lk)
        q_ids = np.repeat(4 * seq, tq)                     # empty query positions
        k_ids = np.repeat(4 * seq + 1, tk)                 # empty key positions
        nb = n
    elif not aligned or np.array_equal(lq, lk):
        kind = "packed"
        nb, tq, tk = 1, int(lq.sum()), int(lk.sum())
        q_first = np.cumsum(lq) - lq                       # exclusive running sums
        k_first = np.cumsum(lk) - lk
        q_ids = np.repeat(4 * seq + 2, lq)[None]
        k_ids = np.repeat(4 * seq + 2, lk)[None]
    else:
        kind = "slots"
        slot = np.maximum(lq, lk)
        start = np.cumsum(slot) - slot
        nb = 1
        tq = tk = int(slot.sum())
        q_first = start + slot - lq
        k_first = start + slot - lk
        q_ids = np.repeat(4 * seq, slot)[None]             # empty query slots
        k_ids = np.repeat(4 * seq + 1, slot)[None]         # empty key slots
    q_index = (q_first.repeat(lq) + _within(lq)).astype(np.int64)
    k_index = (k_first.repeat(lk) + _within(lk)).astype(np.int64)
    if kind != "packed":
        q_ids = q_ids.reshape(-1).copy()
        k_ids = k_ids.reshape(-1).copy()
        q_ids[q_index] = 4 * np.repeat(seq, lq) + 2
        k_ids[k_index] = 4 * np.repeat(seq, lk) + 2
        q_ids, k_ids = q_ids.reshape(nb, tq), k_ids.reshape(nb, tk)
    packed = kind == "packed"
    # a side whose tokens already sit where the layout puts them is not copied (slots
    # where every sequence has at least as many keys as queries: the keys)
    q_same = packed or (nb == 1 and tq == q_index.size and
                        np.array_equal(q_index, np.arange(tq)))
    k_same = packed or (nb == 1 and tk == k_index.size and
                        np.array_equal(k_index, np.arange(tk)))
    return Layout(
        kind=kind, nb=nb, tq=tq, tk=tk,
        q_rows=None if q_same else _rows(q_index, device),
        k_rows=None if k_same else _rows(k_index, device),
        q_ids=torch.from_numpy(np.ascontiguousarray(q_ids, dtype=np.int32)),
        k_ids=torch.from_numpy(np.ascontiguousarray(k_ids, dtype=np.int32)),
        q_first=q_first, k_first=k_first)


def _within(lengths: np.ndarray) -> np.ndarray:
    """0, 1, ..., lengths[d] - 1 for each d, concatenated."""
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    return np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(lengths) - lengths, lengths)
