"""The NumPy backend's forward over a paged key/value cache (:mod:`anyattn.paged`).

Shape legend: B batch, Hq/Hkv query/key-value heads (G = Hq/Hkv), Sq queries, D head dim
of q and k, Dv of v, N pages, P positions per page, T keys of one tile (a whole number
of pages, or a part of one page), R = G·Sq rows of one unit (the G query heads of a
key/value head, stacked).

One unit of work is (sequence b, key/value head): its G query heads share every key
tile, so a tile is read once for all of them.  A tile is ``T // P`` consecutive pages of
the sequence's block table (P <= TILE_KEYS; a longer page, e.g. a contiguous cache row
taken as one page, is read in parts of TILE_KEYS keys, views of its rows): the unit
gathers exactly those pages' rows of its head (``k_pages[ids, h]``), never the whole
cache, and positions before ``starts[b]`` in the first page and past ``seqlens[b]`` in
the last are cut off.  Key j of sequence b is
position ``starts[b] + j``; masks and ALiBi see j.  Key tiles the band (Causal /
Window) cannot reach are not read.

Softmax: an online softmax in natural units with a running row maximum, float32 for
16/32-bit inputs (float64 for float64), the statistics returned apart
(:mod:`anyattn.rowstats`).  Softcap, ALiBi (distance ``|i − j + diag|`` with ``diag =
seqlens[b] − starts[b] − Sq + q_offset − k_offset``) and the band apply per tile; sinks
are folded in at the end (:func:`anyattn.modifiers.fold_sinks`).  Units write disjoint
rows in a fixed tile order: the result does not depend on the thread count.
"""
from __future__ import annotations

from typing import Callable, Tuple

import numpy as np

from ..arrays import array_kind
from ..modifiers import fold_sinks
from ..paged import sequence_mask
from ..rowstats import RowStats
from .numpy_tiles import TileCounts

__all__ = ["forward_paged", "TILE_KEYS"]

#: keys per tile (rounded down to whole pages, at least one page)
TILE_KEYS = 256


def _alloc(shape, dt: np.dtype) -> np.ndarray:
    """An uninitialised result array (every element is written by a unit)."""
    return np.empty(shape, dtype=dt)


def _reader(x, dt: np.dtype) -> Callable[[np.ndarray, int, int, int], np.ndarray]:
    """pages [N, Hkv, P, Dx] (NumPy or CPU torch, any strides) -> ``read(ids, h, r0,
    r1)``: rows [r0, r1) of head h in the pages ``ids`` laid end to end, as [r1 - r0, Dx]
    in ``dt`` (one page: a view of its rows where the dtype is ``dt``; several: a copy
    of those pages' rows of head h only)."""
    Dx = x.shape[3]
    if array_kind(x) == "torch":
        import torch

        x = x.detach()
        if x.dtype == torch.bfloat16:           # NumPy has no bfloat16: gather in torch
            def read_torch(ids: np.ndarray, h: int, r0: int, r1: int) -> np.ndarray:
                if len(ids) == 1:
                    t = x[int(ids[0]), h, r0:r1]                        # [r1 - r0, Dx]
                else:
                    t = x[torch.from_numpy(ids), h].reshape(-1, Dx)[r0:r1]
                return t.to(torch.float32).numpy().astype(dt, copy=False)
            return read_torch
        x = x.numpy()

    def read(ids: np.ndarray, h: int, r0: int, r1: int) -> np.ndarray:
        if len(ids) == 1:
            return x[int(ids[0]), h, r0:r1].astype(dt, copy=False)     # [r1 - r0, Dx]
        return x[ids, h].reshape(-1, Dx)[r0:r1].astype(dt, copy=False)
    return read


def forward_paged(p, q: np.ndarray, k_pages, v_pages, mods, dt: np.dtype,
                  run_units: Callable, n_threads: int
                  ) -> Tuple[np.ndarray, np.ndarray, np.ndarray, TileCounts]:
    """q [B, Hq, Sq, D] (NumPy, ``dt``), pages [N, Hkv, P, D/Dv] -> (out [B, Hq, Sq, Dv],
    row max [B, Hq, Sq], log-normaliser [B, Hq, Sq]) in ``dt``, and the tile counts.

    ``run_units(units, n_threads)`` runs the units (the NumPy backend's scheduler)."""
    pk = p.pages
    B, Hq, Hkv, Sq, G = p.batch, p.heads_q, p.heads_kv, p.seq_q, p.group
    Dv, P, R = p.head_dim_v, pk.page_size, p.group * p.seq_q
    # keys per tile: whole pages up to TILE_KEYS; a longer page in TILE_KEYS-key parts
    whole = P <= TILE_KEYS
    T = (TILE_KEYS // P) * P if whole else TILE_KEYS
    read_k, read_v = _reader(k_pages, dt), _reader(v_pages, dt)
    out = _alloc((B, Hq, Sq, Dv), dt)
    rmax = _alloc((B, Hq, Sq), dt)
    rlog = _alloc((B, Hq, Sq), dt)
    cap = p.softcap
    slopes = None
    if mods.alibi_slopes is not None:
        sl = mods.alibi_slopes
        sl = sl.detach().cpu().numpy() if array_kind(sl) == "torch" else np.asarray(sl)
        slopes = sl.astype(np.float64).reshape(-1, Hq)                     # [Ba, Hq]
    rows_i = np.tile(np.arange(Sq), G)                                      # [R]: query i
    qs = np.multiply(q, dt.type(p.scale))                                   # [B, Hq, Sq, D]

    def unit(b: int, h: int) -> Callable[[], TileCounts]:
        def run() -> TileCounts:
            counts = TileCounts()
            L, st = int(pk.counts[b]), int(pk.firsts[b])     # keys at positions st + [0, L)
            lo, hi = sequence_mask(p, b)
            # keys some row can keep: lo <= j - i <= hi for some i in [0, Sq)
            j_lo = 0 if lo is None else max(0, lo)
            j_hi = L if hi is None else min(L, Sq - 1 + hi + 1)
            qg = qs[b, h * G:(h + 1) * G].reshape(R, -1)                    # [R, D]
            m = np.full(R, -np.inf, dtype=dt)
            ln = np.zeros(R, dtype=dt)
            acc = np.zeros((R, Dv), dtype=dt)
            slope = None
            if slopes is not None:
                srow = slopes[b if slopes.shape[0] > 1 else 0, h * G:(h + 1) * G]
                slope = np.repeat(srow, Sq).astype(dt)[:, None]             # [R, 1]
                diag = L - Sq + p.q_offset - p.k_offset
            table = pk.table[b]
            # tiles over the positions st + [j_lo, j_hi) of those keys: whole pages
            # (P <= TILE_KEYS), else parts of one page
            g_lo, g_hi = st + j_lo, st + j_hi
            a0 = (g_lo // P) * P if whole else g_lo
            while j_lo < j_hi and a0 < g_hi:
                if whole:
                    a1 = min(a0 + T, -(-g_hi // P) * P)                      # page-aligned
                else:
                    a1 = min(a0 + T, (a0 // P + 1) * P, g_hi)                # in one page
                p0 = a0 // P
                ids = table[p0:-(-a1 // P)]
                g0, g1 = max(a0, g_lo), min(a1, g_hi)                        # positions used
                kt = read_k(ids, h, g0 - p0 * P, g1 - p0 * P)                # [t, D]
                vt = read_v(ids, h, g0 - p0 * P, g1 - p0 * P)                # [t, Dv]
                j0, j1 = g0 - st, g1 - st                                    # their key indices
                a0 = a1
                s = qg @ kt.T                                                # [R, t]
                if cap is not None:
                    s = dt.type(cap) * np.tanh(s / dt.type(cap))
                d = None
                if slope is not None:
                    d = np.arange(j0, j1)[None, :] - rows_i[:, None]         # [R, t]: j - i
                    s = s - slope * np.abs(diag - d).astype(dt)
                full = (lo is None or j0 - (Sq - 1) >= lo) and (hi is None or j1 - 1 <= hi)
                if not full:
                    if d is None:
                        d = np.arange(j0, j1)[None, :] - rows_i[:, None]
                    keep = np.ones(d.shape, dtype=bool)
                    if lo is not None:
                        keep &= d >= lo
                    if hi is not None:
                        keep &= d <= hi
                    s = np.where(keep, s, dt.type(-np.inf))
                    counts.partial += 1
                else:
                    counts.full += 1
                m_new = np.maximum(m, s.max(axis=1))                         # [R]
                shift = np.where(m_new == -np.inf, dt.type(0), m_new)
                e = np.exp(s - shift[:, None])                               # [R, t]
                alpha = np.exp(m - shift)                                    # [R]
                ln = ln * alpha + e.sum(axis=1)
                acc = acc * alpha[:, None] + e @ vt                          # [R, Dv]
                m = m_new
            empty = ln == 0
            o = np.where(empty[:, None], dt.type(0), acc / np.where(empty, 1, ln)[:, None])
            out[b, h * G:(h + 1) * G] = o.reshape(G, Sq, Dv)
            rmax[b, h * G:(h + 1) * G] = np.where(empty, -np.inf, m).reshape(G, Sq)
            rlog[b, h * G:(h + 1) * G] = np.where(empty, 0,
                                                  np.log(np.where(empty, 1, ln))).reshape(G, Sq)
            return counts
        return run

    counts = run_units([unit(b, h) for b in range(B) for h in range(Hkv)], n_threads)
    if mods.sinks is not None:
        sinks = mods.sinks
        sinks = sinks.detach().cpu().numpy() if array_kind(sinks) == "torch" else sinks
        out, st = fold_sinks(out, RowStats(rmax, rlog), np.asarray(sinks))
        rmax, rlog = st.max, st.log_norm
    return out, rmax, rlog, counts

