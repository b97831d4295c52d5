"""Gradients of a score function's float captures on the portable Triton backward:
deterministic (no atomics, bitwise repeatable), memory bounded by tiles.

Shape legend: B batch, H query heads, Sq / Sk queries / keys, BM / BN the dK/dV
kernel's query / key tile, nQ = cdiv(Sq, BM), nK = cdiv(Sk, BN), U = Sq + Sk - 1 the
diagonals ``d = q_idx - kv_idx`` (``u = d + Sk - 1``), NG the reads (``gather``
nodes) of the captures asked for.

A capture ``c`` gets ``dc[idx] = sum over (b, h, i, j) of dS'[b, h, i, j] * d s' / d g``
for each read ``g = c[idx]`` (DESIGN section 1).  Supported: captures every read of
which is of one of five kinds (:func:`classify`), its indices depending on ``b``,
``h`` and

* ``diag``: ``q_idx - kv_idx`` (:func:`anyattn.programs.diagonal.diagonal_nodes`: a
  relative position table ``table[h, q_idx - kv_idx + c]``, T5's
  ``table[h, bucket[kv_idx - q_idx + c]]``): one index per (b, h, d);
* ``row``: ``q_idx`` alone (a per-query bias or temperature ``t[b, q_idx]``,
  ``t[q_idx // 8]``): one index per (b, h, i);
* ``col``: ``kv_idx`` alone (a per-key bias ``kb[h, kv_idx]``, a bucketed table
  ``tab[h, kv_idx // 64]``): one index per (b, h, j);
* ``total``: nothing else (learnable ALiBi slopes ``slopes[h]``, a per-head
  temperature ``temp[h]``, a capture of rank 0): one index per (b, h);
* ``pair``: q_idx and kv_idx each in an index of its own, plus an integer constant (a
  learnable per-pair table ``t[h, q_idx, kv_idx]``, ``t[b, h, q_idx, kv_idx]``,
  ``t[q_idx, kv_idx] * w[h]``): one element per (b, h, i, j), injective within a
  (b, h) (:mod:`anyattn.programs.capture_reads`).

Reads of different kinds mix freely in one function, of one capture too.  The
gradient is a sum of the terms over the pairs sharing a (b, h, position), scattered
once per (b, h, position):

1. ``kernels.dkdv_kernel`` (one program per key tile and kv head, looping over the
   query heads of the group and over the query tiles) with the generated ``dcap``
   function (programs.py) sums each tile's terms of every read:
   - ``diag`` / ``row`` / ``total``: into the tile's own fp32 slot of the read's region
     of DCS (:func:`layout`: the diagonal reads' regions, then the rows', then the
     totals', then the pair reads'; a region is [B * H, nK, nQ, W] with W = BM + BN - 1
     sums along the tile's diagonals, BM sums along its query rows, or 1, its total);
   - ``pair``: the tile's terms themselves, W = BM * BN ([BN, BM], keys as rows:
     ``kernels._dcap_tile``), nothing summed: a per-(b, h) scratch of the read's
     terms, each written once;
   - ``col``: down the tile's key columns into the program's register accumulator
     [BN, NCP] (fp64; a column per column read, NCP a power of two), stored once per
     query head after the last query tile into DCOL [B * H, Sk, NCP]: each (b, h, j)
     has one writer, and its query tiles are summed in the program's fixed order.
   Scratch: DCS B·H·nK·nQ·(NG_diag·(BM + BN - 1) + NG_row·BM + NG_total + NG_pair·BM·BN)
   fp32 (about B·H·Sq·Sk·(NG_diag·(1/BM + 1/BN) + NG_row/BN + NG_pair)) and DCOL
   B·H·Sk·NCP fp64: no [B, H, Sq, Sk] buffer without pair reads, and one
   B·H·nQ·BM·nK·BN fp32 buffer (4·B·H·Sq·Sk bytes, rounded up to whole tiles) per pair
   read, whose gradient is O(Sq·Sk) per capture slice by nature.  Where the pair reads'
   slots pass PAIR_SLOT_BYTES, the launch runs per batch chunk (kernel argument B0, the
   chunk's first batch; :meth:`CaptureGrads.chunks`): the scratch is one chunk's (at
   least one batch's), and the chunks' gradients are added in order in fp64 (steps 2 to
   5 per chunk, the host's indices evaluated from the chunk's b0).  A row read's slots
   hold its partial row sums per key tile
   (the program owns a key tile, not a row; the sums over the key tiles are step 2's),
   so that the capture gradients stay on the one dK/dV launch, which runs for them
   even where dk and dv are not wanted, and no dQ program changes;
2. per (b, h, position) in fp64: ``kernels.dcap_diag_kernel`` sums the diagonal slots
   over the key tiles in order -> [B * H, U]; torch sums (a fixed order) fold a row
   region over the key tiles -> [B * H, Sq] and a total region over all tiles ->
   [B * H, 1]; DCOL's column is [B * H, Sk] already;
3. each read's sums are summed over the axes b, h its index does not read (torch
   sums: a fixed order);
4. the index of every (b, h, position) left is evaluated once on the host (NumPy), the
   terms are sorted by capture element (stable), and ``kernels.dcap_segment_kernel``
   sums each element's terms in that order (fp64).  The sort is cached by what the
   indices read (sizes, integer captures);
5. a pair read (:meth:`CaptureGrads._add_pairs`): the b / h indices of every (b, h)
   are evaluated once on the host (capture_reads.pair_targets); per capture slice (the
   (b, h) whose b / h indices agree, in order of b, then h) the slots of each (b, h)
   are laid out as [Sq, Sk] and added in that order (fp64, elementwise torch adds:
   one fixed order), and the slice's sum is added to the capture's gradient at
   [.., q_idx + c, .., kv_idx + c', ..] (a strided view) after step 4's sums and the
   pair reads before it (graph order).  Temporaries: three [Sq, Sk] at a time (one
   fp32 copy, two fp64).
   The gradient is cast to the capture's dtype at the end.

Other reads (an index of q_idx and kv_idx other than through their difference or a
pair read's, such as ``t[q_idx // 8 + kv_idx]`` or ``t[q_idx // 2, kv_idx]``; indices of
two kinds in one read, such as ``t[q_idx, q_idx - kv_idx]``; an index of the score) are
refused before any work (:func:`refusal`).  The read analysis and the
host's index evaluation live in :mod:`anyattn.programs.capture_reads`, shared with the
WebGPU backward.  Nothing here imports torch or Triton at module level: the capability
check runs it.
"""
from __future__ import annotations

import collections
import hashlib
import threading
from typing import Dict, List, Optional, Tuple

import numpy as np

from ...programs import capture_reads
from ...programs.capture_reads import (KINDS, PAIR, Read, classify, flat_index,
                                       pair_targets, reads)
from ...programs.graph import ordered

__all__ = ["Read", "reads", "KINDS", "PAIR", "classify", "refusal", "CaptureGrads"]

#: the kinds with slots, in the order of their regions in DCS
_SLOTTED = tuple(k for k in KINDS if k != "col") + (PAIR,)
#: a slotted read's slot width (per (b, h, key tile, query tile)) as the generated code
#: writes it (constexpr BM, BN) and as the host allocates it
SLOT_WIDTH = {"diag": "(BM + BN - 1)", "row": "BM", "total": "1", PAIR: "(BM * BN)"}


def refusal(program, wrt) -> Optional[str]:
    """Why this backward cannot compute the gradients of the captures ``wrt`` of a score
    program (None: it can): :func:`anyattn.programs.capture_reads.refusal`."""
    return capture_reads.refusal(program, wrt)


def _width(kind: str, bm: int, bn: int) -> int:
    return {"diag": bm + bn - 1, "row": bm, "total": 1, PAIR: bm * bn}[kind]


def layout(kinds) -> Tuple[List[int], List[int]]:
    """(the reads with slots in DCS's region order: the diagonal reads, then the row
    reads, then the totals, then the pair reads; the column reads in the accumulator's
    order), as indices into ``kinds`` (graph order)."""
    slotted = [i for want in _SLOTTED for i, k in enumerate(kinds) if k == want]
    return slotted, [i for i, k in enumerate(kinds) if k == "col"]


def col_width(n: int) -> int:
    """The accumulator's columns for n column reads (a power of two; 0 for none)."""
    return 0 if n == 0 else 1 << (n - 1).bit_length()


#: the most bytes of pair-read slots one dK/dV launch fills: a call whose pair slots
#: need more runs the dK/dV launch per batch chunk (``CaptureGrads.chunks``)
PAIR_SLOT_BYTES = 1 << 30

_MAP_CACHE_SIZE = 16
_map_cache: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()
_lock = threading.Lock()


class CaptureGrads:
    """The capture gradients of one backward call (module doc): per batch chunk
    (``chunks``) ``scratch`` for the chunk's dK/dV launch and ``add`` after it; then
    ``finish``."""

    def __init__(self, p, dev):
        self.bound = p.score_mod
        self.prog = self.bound.program
        self.wrt = frozenset(p.capture_wrt)
        cls = classify(self.prog, self.wrt)
        self.reads = [r for r, _, _ in cls]
        self.kinds = tuple(k for _, k, _ in cls)
        if None in self.kinds:        # the capability check refuses these first
            raise NotImplementedError(f"the Triton backward {refusal(self.prog, self.wrt)}")
        self.slotted, self.cols = layout(self.kinds)
        self.batch = p.batch
        #: the sizes of the current batch chunk (B its batches, from batch b0)
        self.sizes = (p.batch, p.heads_q, p.seq_q, p.seq_k)
        self.b0 = 0
        self.dev = dev
        self.tile: Optional[Tuple[int, int]] = None
        self._acc: Optional[Dict[str, object]] = None

    def chunks(self, bm: int, bn: int) -> List[Tuple[int, int]]:
        """(b0, batches) of the dK/dV launches for tiles bm x bn: one for the whole batch,
        or, where the pair reads' slots (4 bytes per (b, h, padded query, padded key) per
        pair read) pass PAIR_SLOT_BYTES, as many batches per launch as fit (at least 1)."""
        B, H, Sq, Sk = self.batch, *self.sizes[1:]
        pairs = sum(k == PAIR for k in self.kinds)
        per_batch = 4 * pairs * H * (-(-Sq // bm) * bm) * (-(-Sk // bn) * bn)
        nb = max(1, B if per_batch == 0 else min(B, PAIR_SLOT_BYTES // per_batch))
        return [(b0, min(nb, B - b0)) for b0 in range(0, B, nb)]

    def scratch(self, bm: int, bn: int, b0: int = 0, batches: Optional[int] = None):
        """(DCS, dcs_g, DCOL, NCP) for tiles bm x bn and the batch chunk of ``batches``
        batches from ``b0`` (default: the whole batch): DCS fp32 zeros, the slotted reads'
        regions one after another (module doc; dcs_g = B * H * nK * nQ, the slots of one
        width unit, B the chunk's), DCOL fp64 [B * H, Sk, NCP] (None without column
        reads)."""
        import torch

        nb = self.batch if batches is None else batches
        self.b0, self.sizes = b0, (nb,) + self.sizes[1:]
        B, H, Sq, Sk = self.sizes
        nq, nk = -(-Sq // bm), -(-Sk // bn)
        nslots = B * H * nk * nq
        units = sum(_width(self.kinds[i], bm, bn) for i in self.slotted)
        dcs = torch.zeros(max(1, nslots * units), dtype=torch.float32, device=self.dev)
        ncp = col_width(len(self.cols))
        dcol = (torch.zeros((B * H, Sk, ncp), dtype=torch.float64, device=self.dev)
                if ncp else None)
        self.tile = (bm, bn)
        return dcs, nslots, dcol, ncp

    def _sums(self, dcs, dcol) -> list:
        """Each read's terms summed per (b, h, position): [B * H, X] fp64 with X = Sq + Sk
        - 1 (diagonal reads), Sq (row), Sk (column) or 1 (total); a pair read's region as
        the kernel wrote it, fp32 [B * H, nK, nQ, BN, BM] (:meth:`_add_pairs`)."""
        import torch

        from . import kernels

        B, H, Sq, Sk = self.sizes
        bm, bn = self.tile
        bh, nq, nk = B * H, -(-Sq // bm), -(-Sk // bn)
        nslots = bh * nk * nq
        out: list = [None] * len(self.kinds)
        start = 0
        for kind in _SLOTTED:
            idx = [i for i in self.slotted if self.kinds[i] == kind]
            if not idx:
                continue
            w = _width(kind, bm, bn)
            region = dcs[start:start + len(idx) * nslots * w]
            start += region.numel()
            if kind == "diag":
                U = Sq + Sk - 1
                sums = torch.empty((len(idx) * bh, U), dtype=torch.float64, device=self.dev)
                block = 128
                kernels.dcap_diag_kernel[(-(-U // block), len(idx) * bh)](
                    region, sums, Sq, Sk, nk, nq, BM=bm, BN=bn, NM=-(-w // bm), BLOCK=block)
                sums = sums.reshape(len(idx), bh, U)
            elif kind == PAIR:         # the terms themselves, summed in _add_pairs
                sums = region.reshape(len(idx), bh, nk, nq, bn, bm)
            elif kind == "row":        # over the key tiles in order (torch: a fixed order)
                sums = torch.sum(region.reshape(len(idx), bh, nk, nq * bm), dim=2,
                                 dtype=torch.float64)[:, :, :Sq]
            else:
                sums = torch.sum(region.reshape(len(idx), bh, nk * nq), dim=2,
                                 dtype=torch.float64, keepdim=True)
            for n, i in enumerate(idx):
                out[i] = sums[n]
        for n, i in enumerate(self.cols):
            out[i] = dcol[:, :, n]
        return out

    def add(self, dcs, dcol) -> None:
        """Add the current batch chunk's gradients (from the slots and column sums its
        dK/dV launch wrote) to the call's, in fp64 (chunks in order: a fixed order)."""
        part = self._chunk_grads(dcs, dcol)
        if self._acc is None:
            self._acc = part
        else:
            for name, g in part.items():
                self._acc[name] += g

    def finish(self) -> Dict[str, object]:
        """{capture: gradient} (torch, the capture's shape and dtype, on the device) of
        the chunks added."""
        import torch

        out = {}
        for name in sorted(self.wrt):
            arr = self.bound.arrays[name]
            g = (self._acc or {}).get(name)
            if g is None:                        # no chunk ran (an empty batch)
                g = torch.zeros(arr.shape, dtype=torch.float64, device=self.dev)
            out[name] = g.to(getattr(torch, str(arr.dtype)))
        return out

    def _chunk_grads(self, dcs, dcol) -> Dict[str, object]:
        """{capture: the current batch chunk's gradient} (fp64, the capture's shape)."""
        import torch

        from . import kernels

        B, H, _, _ = self.sizes
        parts: Dict[str, List[Tuple[Read, str, object]]] = {n: [] for n in sorted(self.wrt)}
        pairs: Dict[str, List[Tuple[Read, object]]] = {n: [] for n in sorted(self.wrt)}
        for r, kind, x in zip(self.reads, self.kinds, self._sums(dcs, dcol)):
            if kind == PAIR:
                pairs[r.name].append((r, x))
                continue
            x = x.reshape(B, H, -1)                                  # [B, H, X]
            for axis, use in ((0, "b"), (1, "h")):
                if use not in r.uses and x.shape[axis] > 1:
                    x = x.sum(dim=axis, keepdim=True)
            parts[r.name].append((r, kind, x))
        out = {}
        for name, got in parts.items():
            arr = self.bound.arrays[name]
            n = int(np.prod(arr.shape, dtype=np.int64))
            if not got:                       # no read summed per position: zeros
                res = torch.zeros(n, dtype=torch.float64, device=self.dev)
            else:
                perm, offs, longest = self._order(name, [(r, k, tuple(x.shape))
                                                         for r, k, x in got])
                vals = torch.cat([x.reshape(-1) for _, _, x in got])
                res = torch.empty(n, dtype=torch.float64, device=self.dev)
                if n:
                    eb = 32
                    kernels.dcap_segment_kernel[(-(-n // eb),)](vals, perm, offs, res, n,
                                                                longest, EB=eb, KB=32)
            res = res.reshape(arr.shape)
            for r, x in pairs[name]:
                self._add_pairs(res, r, x)
            out[name] = res
        return out

    def _add_pairs(self, res, r: Read, x) -> None:
        """Add pair read ``r``'s terms (its DCS region, fp32 [B * H, nK, nQ, BN, BM]) to
        ``res`` (fp64, the capture's shape) in place: per capture slice
        (capture_reads.pair_targets), the (b, h) mapped onto it laid out as [Sq, Sk] and
        added in order of b, then h (fp64), then added to the slice's view of ``res``."""
        import torch

        _, _, Sq, Sk = self.sizes
        nk, nq, bn, bm = x.shape[1:]
        for rows, at, transposed in pair_targets(self.bound, r, self.sizes, self.b0):
            acc = None
            for bh in rows:                       # [nK, nQ, BN, BM] -> [Sq, Sk]
                t = x[bh].permute(1, 3, 0, 2).reshape(nq * bm, nk * bn)[:Sq, :Sk]
                t = t.to(torch.float64)
                acc = t if acc is None else acc + t
            res[at] += acc.t() if transposed else acc

    def _order(self, name: str, shaped) -> tuple:
        """(perm, offs, longest): the terms of capture ``name`` (the reads' sums
        concatenated, each (read, kind, its shape [Bx, Hx, X])) sorted by capture element, where
        each element's terms start (offs [n + 1]; both on the device) and the most terms
        of one element.  Cached by the graph, the reads, their shapes, the sizes and the
        captures the indices read."""
        import torch

        read_caps = sorted({n.attr for r, _, _ in shaped for a in r.node.args
                            for n in ordered([a]) if n.op == "gather"})
        h = hashlib.blake2b(digest_size=16)
        for c in read_caps:
            a = np.ascontiguousarray(self.bound.arrays[c])
            h.update(f"{c}:{a.shape}:{a.dtype.str};".encode())
            h.update(memoryview(a).cast("B") if a.size else b"")
        key = (self.prog.key, name, tuple((tuple(sorted(r.uses)), k, s) for r, k, s in shaped),
               self.sizes, self.b0, h.hexdigest(), str(self.dev))
        with _lock:
            hit = _map_cache.get(key)
            if hit is not None:
                _map_cache.move_to_end(key)
                return hit
        shape = tuple(self.bound.arrays[name].shape)
        flat = np.concatenate([self._flat_index(r, k, s, shape) for r, k, s in shaped])
        perm = np.argsort(flat, kind="stable")
        offs = np.zeros(int(np.prod(shape, dtype=np.int64)) + 1, dtype=np.int64)
        counts = np.bincount(flat, minlength=offs.size - 1)
        np.cumsum(counts, out=offs[1:])
        res = (torch.from_numpy(perm.astype(np.int64)).to(self.dev),
               torch.from_numpy(offs).to(self.dev), int(counts.max(initial=0)))
        with _lock:
            _map_cache[key] = res
            while len(_map_cache) > _MAP_CACHE_SIZE:
                _map_cache.popitem(last=False)
        return res

    def _flat_index(self, r: Read, kind: str, shape3, cap_shape) -> np.ndarray:
        """The flat capture index of read ``r`` (of ``kind``) at every (b, h, x) of its
        sums' shape (:func:`anyattn.programs.capture_reads.flat_index`)."""
        return flat_index(self.bound, self.sizes, r, shape3, cap_shape, kind, self.b0)
