"""Gradients of a score function's float captures on the WebGPU backward: deterministic
(no atomics, bitwise repeatable), memory bounded by tiles.

Shape legend: B batch, H query heads, Sq / Sk queries / keys, BQ / BK the dK/dV
kernel's query / key tile, nQ = cdiv(Sq, BQ), nK = cdiv(Sk, BK), W = BQ + BK - 1 the
diagonals of a tile, U = Sq + Sk - 1 the diagonals ``d = q_idx - kv_idx`` of the score
matrix (``u = d + Sk - 1``), NG the reads (``gather`` nodes) of the captures asked for.

Supported: captures every read of which is indexed by ``b``, ``h`` and
``q_idx - kv_idx`` only (:mod:`anyattn.programs.capture_reads`, shared with the
portable Triton backward; the others are refused by the backend's ``extra_reasons``
before any work).  Then a read's index takes one value per (b, h, d) and its gradient
is a sum of the terms ``dS' * d s' / d g`` along each diagonal:

1. the dK/dV pass compiled with DCAP (shaders/bwd_dkdv.wgsl, pds.wgsl; the generated
   ``dcap_d`` / ``dcap_put``, programs.dcap_source) stores, per unit (query head, query
   tile) of a workgroup (key tile, batch, KV head), the tile's terms in a workgroup
   tile and sums each of its W diagonals (f32, one fixed order) into the unit's own
   slot of ``dcs`` [NG, B*H, nK, nQ, W] (``engine.Call.set_capture_grads``: cleared
   first, so a skipped tile's slot is 0): NG*B*H*Sq*Sk*(1/BQ + 1/BK) floats at most,
   never a [B, H, Sq, Sk] buffer, and no slot is written twice;
2. the host reads the slots back and sums those of each diagonal over the tiles
   (:func:`diagonal_sums`: one ``np.bincount`` per call, float64, the slots' order):
   WGSL has no f64, and these sums are the longest of the computation (up to nK*nQ
   slots per diagonal), so they run where f64 is; the slots are a small fraction of
   the backward's inputs' bytes at the tile sizes the kernels use;
3. :func:`finish`: each read's sums summed over the axes its index does not read
   (b, h, d; NumPy float64 sums of fixed shapes), the index of every (b, h, d) left
   evaluated once on the host (capture_reads.flat_index: floats in fp32, as the
   kernels compute them), and one ``np.bincount`` per capture over the reads' terms in
   order (a sequential, ordered segment sum in float64), cast to the capture's dtype.

Batch chunks (the adapter's binding limit) each return their batches' diagonal sums;
the caller concatenates them along the batch before :func:`finish`.
"""
from __future__ import annotations

from typing import Dict, Tuple

import numpy as np

from ...programs.capture_reads import flat_index, reads

__all__ = ["diagonal_sums", "finish"]


def diagonal_sums(slots: np.ndarray, BQ: int, BK: int, Sq: int, Sk: int) -> np.ndarray:
    """The slots ``slots`` [NG, R, nK, nQ, W] (f32, R rows of (batch, head)) summed per
    diagonal over the tiles -> [NG, R, U] float64.  Slot (n, m, t) holds diagonal
    u = m*BQ - n*BK + t - (BK - 1) + (Sk - 1); the sums run in the slots' order."""
    ng, rows, nk, nq, w = slots.shape
    U = Sq + Sk - 1
    n = np.arange(nk)[:, None, None]
    m = np.arange(nq)[None, :, None]
    t = np.arange(w)[None, None, :]
    u = (m * BQ - n * BK + t - (BK - 1) + (Sk - 1)).reshape(-1)          # [nK*nQ*W]
    live = (u >= 0) & (u < U)
    flat = slots.reshape(ng * rows, -1)[:, live].astype(np.float64)
    idx = (np.arange(ng * rows)[:, None] * U + u[live][None, :]).reshape(-1)
    out = np.bincount(idx, weights=flat.reshape(-1), minlength=ng * rows * U)
    return out.reshape(ng, rows, U)


def finish(bound, wrt, sums: np.ndarray, sizes: Tuple[int, int, int, int]
           ) -> Dict[str, np.ndarray]:
    """{capture: gradient} (NumPy, the capture's shape and dtype) of the float captures
    ``wrt`` of the bound score program ``bound`` from the diagonal sums ``sums``
    [NG, B, H, U] (float64, reads in capture_reads.reads' order; NG may be 0 where no
    read of ``wrt`` exists) of a problem of ``sizes`` = (B, H, Sq, Sk)."""
    rds = reads(bound.program, wrt)
    parts = {name: [] for name in sorted(wrt)}
    for i, r in enumerate(rds):
        x = sums[i]
        for axis, use in ((0, "b"), (1, "h"), (2, "d")):
            if use not in r.uses and x.shape[axis] > 1:
                x = x.sum(axis=axis, keepdims=True)
        parts[r.name].append((r, x))
    out = {}
    for name, got in parts.items():
        arr = np.asarray(bound.arrays[name])
        n = int(np.prod(arr.shape, dtype=np.int64))
        if not got:                          # never read: a zero gradient
            out[name] = np.zeros(arr.shape, dtype=arr.dtype)
            continue
        flat = np.concatenate([flat_index(bound, sizes, r, x.shape, arr.shape)
                               for r, x in got])
        vals = np.concatenate([x.reshape(-1) for _, x in got])
        res = np.bincount(flat, weights=vals, minlength=n)
        out[name] = res.reshape(arr.shape).astype(arr.dtype)
    return out
