"""Gradients of a score function's float captures on the portable Triton backward:
deterministic (no atomics, bitwise repeatable), memory bounded by tiles.

Shape legend: B batch, H query heads, Sq / Sk queries / keys, BM / BN the dK/dV
kernel's query / key tile, nQ = cdiv(Sq, BM), nK = cdiv(Sk, BN), U = Sq + Sk - 1 the
diagonals ``d = q_idx - kv_idx`` (``u = d + Sk - 1``), NG the reads (``gather``
nodes) of the captures asked for.

A capture ``c`` gets ``dc[idx] = sum over (b, h, i, j) of dS'[b, h, i, j] * d s' / d g``
for each read ``g = c[idx]`` (DESIGN section 1).  Supported: captures every read of
which has indices that depend on ``b``, ``h`` and ``q_idx - kv_idx`` only
(:func:`anyattn.programs.diagonal.diagonal_nodes`: a relative position table
``table[h, q_idx - kv_idx + c]``, T5's ``table[h, bucket[kv_idx - q_idx + c]]``,
learnable ALiBi slopes ``slopes[h]``, a per-head temperature ``temp[h]``).  Then the
index takes one value per (b, h, d), and the gradient is a sum of the terms along
each diagonal, scattered once per (b, h, d):

1. ``kernels.dkdv_kernel`` with the generated ``dcap`` function (programs.py) writes,
   per (read, b, h, key tile, query tile), the tile's terms summed along its
   BM + BN - 1 diagonals into its own fp32 slot of DCS [NG, B * H, nK, nQ, W]
   (W = BM + BN - 1, or W = 1, the tile's total, where no index reads the diagonal):
   NG·B·H·Sq·Sk·(1/BM + 1/BN) floats at most, never a [B, H, Sq, Sk] buffer;
2. ``kernels.dcap_diag_kernel`` sums the slots of each diagonal over the key tiles in
   order (fp64) -> [NG, B, H, U] (a torch sum of each slot where W = 1);
3. each read's sums are summed over the axes its index does not read (b, h, d; torch
   sums: a fixed order);
4. the index of every (b, h, d) left is evaluated once on the host (NumPy), the terms
   are sorted by capture element (stable), and ``kernels.dcap_segment_kernel`` sums
   each element's terms in that order (fp64), cast to the capture's dtype at the end.
   The sort is cached by what the indices read (sizes, integer captures).

Other reads (an index of ``q_idx`` or ``kv_idx`` alone, of the score) are refused
before any work (:func:`unsupported`).  The read analysis (:class:`Read`,
:func:`reads`, :func:`unsupported`, :func:`reads_diagonal`, the host's index
evaluation) lives in :mod:`anyattn.programs.capture_reads`, shared with the WebGPU
backward.  Nothing here imports torch or Triton at module level: the capability check
runs it.
"""
from __future__ import annotations

import collections
import hashlib
import threading
from typing import Dict, List, Optional, Tuple

import numpy as np

from ...programs.capture_reads import Read, flat_index, reads, reads_diagonal, unsupported
from ...programs.graph import ordered

__all__ = ["Read", "reads", "unsupported", "reads_diagonal", "CaptureGrads"]


_MAP_CACHE_SIZE = 16
_map_cache: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()
_lock = threading.Lock()


class CaptureGrads:
    """The capture gradients of one backward call (module doc): ``scratch`` for the
    dK/dV launch, ``finish`` after it."""

    def __init__(self, p, dev):
        self.bound = p.score_mod
        self.prog = self.bound.program
        self.wrt = frozenset(p.capture_wrt)
        self.reads = reads(self.prog, self.wrt)
        self.diag = any("d" in r.uses for r in self.reads)
        self.sizes = (p.batch, p.heads_q, p.seq_q, p.seq_k)
        self.dev = dev
        self.tile: Optional[Tuple[int, int]] = None

    def scratch(self, bm: int, bn: int):
        """(DCS zeros [NG, B * H, nK, nQ, W] fp32, the stride of NG) for tiles bm x bn."""
        import torch

        B, H, Sq, Sk = self.sizes
        nq, nk = -(-Sq // bm), -(-Sk // bn)
        w = bm + bn - 1 if self.diag else 1
        ng = max(1, len(self.reads))
        dcs = torch.zeros((ng, B * H, nk, nq, w), dtype=torch.float32, device=self.dev)
        self.tile = (bm, bn)
        return dcs, B * H * nk * nq * w

    def finish(self, dcs) -> Dict[str, object]:
        """{capture: gradient} (torch, the capture's shape and dtype, on the device) from
        the slots the dK/dV launch wrote."""
        import torch

        from . import kernels

        B, H, Sq, Sk = self.sizes
        bm, bn = self.tile
        ng, bh, nk, nq, w = dcs.shape
        if self.diag:
            U = Sq + Sk - 1
            sums = torch.empty((ng, bh, U), dtype=torch.float64, device=self.dev)
            block = 128
            kernels.dcap_diag_kernel[(-(-U // block), ng * bh)](
                dcs, sums, Sq, Sk, nk, nq, BM=bm, BN=bn, NM=-(-(bm + bn - 1) // bm),
                BLOCK=block)
        else:
            sums = dcs.to(torch.float64).sum(dim=(2, 3, 4)).unsqueeze(-1)
        sums = sums.reshape(ng, B, H, -1)                      # [NG, B, H, U or 1]
        parts: Dict[str, List[Tuple[Read, object]]] = {n: [] for n in sorted(self.wrt)}
        for i, r in enumerate(self.reads):
            x = sums[i]
            for axis, use in ((0, "b"), (1, "h"), (2, "d")):
                if use not in r.uses and x.shape[axis] > 1:
                    x = x.sum(dim=axis, keepdim=True)
            parts[r.name].append((r, x))
        out = {}
        for name, got in parts.items():
            arr = self.bound.arrays[name]
            want = getattr(torch, str(arr.dtype))
            if not got:                       # never read: a zero gradient
                out[name] = torch.zeros(arr.shape, dtype=want, device=self.dev)
                continue
            perm, offs, longest = self._order(name, [(r, tuple(x.shape)) for r, x in got])
            vals = torch.cat([x.reshape(-1) for _, x in got])
            n = int(np.prod(arr.shape, dtype=np.int64))
            res = torch.empty(n, dtype=torch.float64, device=self.dev)
            if n:
                eb = 32
                kernels.dcap_segment_kernel[(-(-n // eb),)](vals, perm, offs, res, n, longest,
                                                            EB=eb, KB=32)
            out[name] = res.reshape(arr.shape).to(want)
        return out

    def _order(self, name: str, shaped) -> tuple:
        """(perm, offs, longest): the terms of capture ``name`` (the reads' sums
        concatenated, each of its shape [Bx, Hx, Ux]) sorted by capture element, where
        each element's terms start (offs [n + 1]; both on the device) and the most terms
        of one element.  Cached by the graph, the reads, their shapes, the sizes and the
        captures the indices read."""
        import torch

        read_caps = sorted({n.attr for r, _ in shaped for a in r.node.args
                            for n in ordered([a]) if n.op == "gather"})
        h = hashlib.blake2b(digest_size=16)
        for c in read_caps:
            a = np.ascontiguousarray(self.bound.arrays[c])
            h.update(f"{c}:{a.shape}:{a.dtype.str};".encode())
            h.update(memoryview(a).cast("B") if a.size else b"")
        key = (self.prog.key, name, tuple((tuple(sorted(r.uses)), s) for r, s in shaped),
               self.sizes, h.hexdigest(), str(self.dev))
        with _lock:
            hit = _map_cache.get(key)
            if hit is not None:
                _map_cache.move_to_end(key)
                return hit
        shape = tuple(self.bound.arrays[name].shape)
        flat = np.concatenate([self._flat_index(r, s, shape) for r, s in shaped])
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

    def _flat_index(self, r: Read, shape3, cap_shape) -> np.ndarray:
        """The flat capture index of read ``r`` at every (b, h, d) of its sums' shape
        (:func:`anyattn.programs.capture_reads.flat_index`)."""
        return flat_index(self.bound, self.sizes, r, shape3, cap_shape)
