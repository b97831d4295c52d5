"""Gradients of a score function's float captures on the WebGPU backward: deterministic
(no atomics, bitwise repeatable), memory bounded by tiles.

Shape legend: B batch, H query heads, Sq / Sk queries / keys, BQ / BK the dK/dV
kernel's query / key tile, nQ = cdiv(Sq, BQ), nK = cdiv(Sk, BK), W = BQ + BK - 1 the
diagonals of a tile, U = Sq + Sk - 1 the diagonals ``d = q_idx - kv_idx`` of the score
matrix (``u = d + Sk - 1``), NG the reads (``gather`` nodes) of the captures asked for,
ND / NR / NC those summed along the tile diagonals / query rows / key columns.

Supported: captures every read of which is indexed by ``b``, ``h`` and one of
``q_idx - kv_idx``, ``q_idx`` alone, ``kv_idx`` alone, or none of them, or is a pair
read (``t[h, q_idx, kv_idx]``: one element per (b, h, q_idx, kv_idx), see below)
(:func:`anyattn.programs.capture_reads.classify`, shared with the portable Triton
backward; the others are refused by the backend's ``extra_reasons`` before any work,
with :func:`~anyattn.programs.capture_reads.refusal`'s reason).  Reads of different
kinds mix in one function, of one capture too.  A read's index takes one value per
(b, h, position) and its gradient is a sum of the terms ``dS' * d s' / d g`` along each
diagonal (``diag``; and ``total``, summed over the diagonals on the host), query row
(``row``) or key column (``col``):

1. the dK/dV pass compiled with DCAP (shaders/bwd_dkdv.wgsl, pds.wgsl; the generated
   ``dcap_d`` / ``dcap_put``, programs.dcap_source) stores, per unit (query head, query
   tile) of a workgroup (key tile, batch, KV head), the tile's terms of every read in a
   workgroup tile (the reads in :func:`slot_layout`'s order: diagonal and total reads,
   then row reads, then column reads) and sums them, f32, in one fixed order, into the
   unit's own slot of each read's region of ``dcs`` (``engine.Call.set_capture_grads``:
   cleared first, so a skipped tile's slot is 0): a diagonal read's region is
   [B*H, nK, nQ, W] (the tile's W diagonals), a row read's [B*H, nK, nQ, BQ] (its
   query rows), a column read's [B*H, nK, nQ, BK] (its key columns).  At most
   B*H*Sq*Sk*(ND*(1/BQ + 1/BK) + NR/BK + NC/BQ) floats (plus the edge tiles' padding),
   never a [B, H, Sq, Sk] buffer, and no slot is written twice;
2. the host reads the slots back and sums them per (b, h, position) over the tiles in
   float64 in the slots' order (:func:`diagonal_sums`, :func:`row_sums`,
   :func:`column_sums`): WGSL has no f64, and these sums are the longest of the
   computation (up to nK*nQ slots per diagonal, nK per row, nQ per column), so they
   run where f64 is; the slots are a small fraction of the backward's inputs' bytes at
   the tile sizes the kernels use;
3. :func:`finish`: each read's sums summed over the axes its index does not read
   (b, h; a total read's diagonals; NumPy float64 sums of fixed shapes), the index of
   every (b, h, position) left evaluated once on the host (capture_reads.flat_index:
   floats in fp32, as the kernels compute them), and one ``np.bincount`` per capture
   over the reads' terms in order (a sequential, ordered segment sum in float64), cast
   to the capture's dtype.

A pair read has no block in the workgroup tile: the generated ``dcap_put`` (DCPR)
stores each pair's term itself at (b, h, i, j) of the read's region [B*H, Sq, Sk] of
``dcs``, after the tile slots (:func:`pair_floats`; the column slice 0 only, so each
element of a tile that runs has one writer; skipped tiles and masked pairs leave the
cleared 0); :func:`read_sums` hands the region on as it is, and :func:`finish` adds,
per capture slice, the (b, h) whose b / h indices map onto it (capture_reads.pair_targets)
in order of b, then h, in float64, into the slice's view of the gradient, after the
other reads' sums (:func:`_add_pairs`).  A pair read's region is 4*B*H*Sq*Sk bytes by
nature (its gradient is O(Sq*Sk) per slice); the backend refuses, before any work, pair
reads whose regions pass the storage binding limit (:func:`pair_slot_bytes`).

Batch chunks (the adapter's binding limit) each return their batches' sums; the
caller concatenates them along the batch before :func:`finish`.  Device-array calls
(resident.py) run the same launches from their cached launch template and read ``dcs``
back once after its submission; a device-array capture's values never reach the host
(:func:`finish` takes its shape and dtype; an index that reads one is refused,
:func:`device_index_reads`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

import numpy as np

from ...programs.capture_reads import (PAIR, classify, flat_index, pair_targets,
                                       reads, refusal)
from ...programs.evaluate import cast_captures
from ...programs.graph import ordered

__all__ = ["SLOT_KINDS", "SlotLayout", "slot_layout", "slot_floats", "pair_floats",
           "split_slots", "diagonal_sums", "row_sums", "column_sums", "read_sums", "finish",
           "device_index_reads", "tile_reads", "pair_slot_bytes"]

#: the kinds of slot of the DCAP pass, in their order in the workgroup tile and in
#: ``dcs``: sums along the tile's diagonals (classify's ``diag`` and ``total`` reads),
#: along its query rows (``row``), down its key columns (``col``)
SLOT_KINDS = ("diag", "row", "col")


def _slot_kind(kind: str) -> str:
    return "diag" if kind == "total" else kind


@dataclass(frozen=True)
class SlotLayout:
    """The reads of the captures asked for (graph order, capture_reads.reads):
    ``kinds`` classify's kind of each; ``order`` the read at each position of the
    workgroup tile and of ``dcs`` (the diagonal and total reads, then the row reads,
    then the column reads, each in graph order; then the pair reads, in graph order,
    which have no block in the workgroup tile); ``counts`` (ND, NR, NC); ``pairs`` NP,
    the pair reads."""

    kinds: Tuple[str, ...]
    order: Tuple[int, ...]
    counts: Tuple[int, int, int]
    pairs: int = 0

    @property
    def position(self) -> Tuple[int, ...]:
        """The position of each read (graph order) in the tile and in ``dcs``."""
        pos = [0] * len(self.order)
        for n, i in enumerate(self.order):
            pos[i] = n
        return tuple(pos)


def slot_layout(program, wrt) -> SlotLayout:
    """The :class:`SlotLayout` of the reads of the captures ``wrt`` of a score program;
    ``NotImplementedError`` for a read no slot kind sums (the backend refuses those
    before any work)."""
    cls = classify(program, frozenset(wrt))
    kinds = tuple(k for _, k, _ in cls)
    if None in kinds:
        raise NotImplementedError(
            f"the WebGPU backward {refusal(program, frozenset(wrt))}")
    order = tuple(i for want in SLOT_KINDS + (PAIR,) for i, k in enumerate(kinds)
                  if _slot_kind(k) == want)
    counts = tuple(sum(1 for k in kinds if _slot_kind(k) == want) for want in SLOT_KINDS)
    return SlotLayout(kinds, order, counts, kinds.count(PAIR))


def tile_reads(program, wrt) -> int:
    """The reads of the captures ``wrt`` with a block in the DCAP pass's workgroup tile
    (all but the pair reads; the config choice counts them)."""
    return sum(1 for _, k, _ in classify(program, frozenset(wrt)) if k != PAIR)


def pair_slot_bytes(program, wrt, rows: int, Sq: int, Sk: int) -> Tuple[List[str], int]:
    """(the pair reads of the captures ``wrt``, rendered, and the bytes of their slots in
    ``dcs``: 4 * rows * Sq * Sk each, ``rows`` (batch, head) rows)."""
    from ...programs.graph import render

    got = [render(r.node) for r, k, _ in classify(program, frozenset(wrt)) if k == PAIR]
    return got, 4 * len(got) * rows * Sq * Sk


def _widths(BQ: int, BK: int) -> Tuple[int, int, int]:
    return BQ + BK - 1, BQ, BK


def slot_floats(counts: Sequence[int], rows: int, nK: int, nQ: int, BQ: int, BK: int) -> int:
    """The f32 words of ``dcs`` for ``counts`` = (ND, NR, NC) reads and ``rows`` (batch,
    head) rows of nK x nQ tiles."""
    return rows * nK * nQ * sum(n * w for n, w in zip(counts, _widths(BQ, BK)))


def pair_floats(pairs: int, rows: int, Sq: int, Sk: int) -> int:
    """The f32 words of ``dcs`` after the tile slots: ``pairs`` regions [rows, Sq, Sk],
    one word per (b, h, q_idx, kv_idx) of each pair read."""
    return pairs * rows * Sq * Sk


def split_slots(flat: np.ndarray, counts: Sequence[int], rows: int, nK: int, nQ: int,
                BQ: int, BK: int) -> List[np.ndarray]:
    """``dcs`` (flat f32) -> its regions [ND, rows, nK, nQ, W], [NR, .., BQ],
    [NC, .., BK] (views)."""
    out, start = [], 0
    for n, w in zip(counts, _widths(BQ, BK)):
        size = n * rows * nK * nQ * w
        out.append(flat[start:start + size].reshape(n, rows, nK, nQ, w))
        start += size
    return out


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


def row_sums(slots: np.ndarray, Sq: int) -> np.ndarray:
    """The row slots [NR, R, nK, nQ, BQ] (f32; slot (n, m, t) holds query row
    m*BQ + t of key tile n) summed over the key tiles in order -> [NR, R, Sq]
    float64."""
    nr, rows, nk, nq, bq = slots.shape
    acc = np.zeros((nr, rows, nq * bq))
    for n in range(nk):
        acc += slots[:, :, n].reshape(nr, rows, nq * bq)
    return acc[:, :, :Sq]


def column_sums(slots: np.ndarray, Sk: int) -> np.ndarray:
    """The column slots [NC, R, nK, nQ, BK] (f32; slot (n, m, t) holds key column
    n*BK + t of query tile m) summed over the query tiles in order -> [NC, R, Sk]
    float64."""
    nc, rows, nk, nq, bk = slots.shape
    acc = np.zeros((nc, rows, nk, bk))
    for m in range(nq):
        acc += slots[:, :, :, m]
    return acc.reshape(nc, rows, nk * bk)[:, :, :Sk]


def read_sums(flat: np.ndarray, lay: SlotLayout, B: int, H: int, Sq: int, Sk: int,
              BQ: int, BK: int) -> List[np.ndarray]:
    """``dcs`` (flat f32, read back) -> each read's sums per (b, h, position), graph
    order: [B, H, X] float64, X = U (diagonal and total reads), Sq (row), Sk (column);
    a pair read's terms themselves, [B, H, Sq, Sk] f32 (a view of ``flat``)."""
    nK, nQ = -(-Sk // BK), -(-Sq // BQ)
    diag, rows, cols = split_slots(flat, lay.counts, B * H, nK, nQ, BQ, BK)
    by_pos: List[np.ndarray] = []
    if lay.counts[0]:
        by_pos += list(diagonal_sums(diag, BQ, BK, Sq, Sk))
    by_pos += list(row_sums(rows, Sq)) + list(column_sums(cols, Sk))
    start = slot_floats(lay.counts, B * H, nK, nQ, BQ, BK)
    n = B * H * Sq * Sk
    for k in range(lay.pairs):
        by_pos.append(flat[start + k * n:start + (k + 1) * n].reshape(B, H, Sq, Sk))
    out: List[np.ndarray] = [None] * len(lay.order)
    for n, i in enumerate(lay.order):
        out[i] = by_pos[n] if lay.kinds[i] == PAIR else by_pos[n].reshape(B, H, -1)
    return out


class _HostCaptures:
    """The host captures of a bound score program that also has device-array captures,
    as :func:`~anyattn.programs.capture_reads.flat_index` reads them (``caps``): the
    indices of the reads differentiated read host captures only
    (:func:`device_index_reads` refuses the others before any work)."""

    def __init__(self, bound):
        self._bound = bound

    def caps(self, dt) -> Dict[str, np.ndarray]:
        b = self._bound
        return cast_captures(b.arrays, b.program.specs, np.dtype(dt), b.idt)


def device_index_reads(bound, wrt) -> List[str]:
    """The device-array captures of the bound score program ``bound`` that an index of a
    read of the captures ``wrt`` reads (the host evaluates those indices, and a device
    array's values never reach the host): sorted names, empty where there are none."""
    if not bound.device:
        return []
    names = set()
    for r in reads(bound.program, frozenset(wrt)):
        for a in r.node.args:
            names |= {n.attr for n in ordered([a]) if n.op == "gather"} & set(bound.device)
    return sorted(names)


def finish(bound, wrt, sums: Sequence[np.ndarray], sizes: Tuple[int, int, int, int]
           ) -> Dict[str, np.ndarray]:
    """{capture: gradient} (NumPy, the capture's shape and dtype; a device-array
    capture's too: the caller uploads it) of the float captures
    ``wrt`` of the bound score program ``bound`` from each read's sums ``sums``
    (:func:`read_sums`, reads in graph order; empty where no read of ``wrt`` exists) of
    a problem of ``sizes`` = (B, H, Sq, Sk).  The pair reads' terms are added after the
    other reads' sums, in graph order (:func:`_add_pairs`)."""
    cls = classify(bound.program, frozenset(wrt))
    parts = {name: [] for name in sorted(wrt)}
    pairs = {name: [] for name in sorted(wrt)}
    for (r, kind, _), x in zip(cls, sums):
        if kind == PAIR:
            pairs[r.name].append((r, x))
            continue
        for axis, use in ((0, "b"), (1, "h")):
            if use not in r.uses and x.shape[axis] > 1:
                x = x.sum(axis=axis, keepdims=True)
        if kind == "total" and x.shape[2] > 1:     # its diagonals' sums: one total
            x = x.sum(axis=2, keepdims=True)
        parts[r.name].append((r, kind, x))
    host = _HostCaptures(bound) if bound.device else bound
    out = {}
    for name, got in parts.items():
        arr = bound.device[name] if name in bound.device else np.asarray(bound.arrays[name])
        n = int(np.prod(arr.shape, dtype=np.int64))
        if not got and not pairs[name]:      # never read: a zero gradient
            out[name] = np.zeros(arr.shape, dtype=arr.dtype)
            continue
        if got:
            flat = np.concatenate([flat_index(host, sizes, r, x.shape, arr.shape, kind)
                                   for r, kind, x in got])
            vals = np.concatenate([x.reshape(-1) for _, _, x in got])
            res = np.bincount(flat, weights=vals, minlength=n).reshape(arr.shape)
        else:
            res = np.zeros(arr.shape, dtype=np.float64)
        for r, x in pairs[name]:
            _add_pairs(host, res, r, x)
        out[name] = res.astype(arr.dtype)
    return out


def _add_pairs(host, res: np.ndarray, r, x: np.ndarray) -> None:
    """Add pair read ``r``'s terms ``x`` ([B, H, Sq, Sk] f32, each (b, h, q_idx, kv_idx)
    written by one invocation) to ``res`` (float64, the capture's shape) in place: per
    capture slice (capture_reads.pair_targets), the (b, h) mapped onto it summed in order
    of b, then h in float64, then added to the slice's view."""
    B, H, Sq, Sk = x.shape
    terms = x.reshape(B * H, Sq, Sk)
    for rows, at, transposed in pair_targets(host, r, (B, H, Sq, Sk)):
        acc = terms[rows[0]].astype(np.float64)
        for bh in rows[1:]:
            acc += terms[bh]
        res[at] += acc.T if transposed else acc
