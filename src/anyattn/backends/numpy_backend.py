"""The NumPy backend: CPU attention, forward and backward, without an [Sq, Sk] matrix.

Shape legend: B batch, Hq/Hkv query/key-value heads (G = Hq/Hkv), Sq/Sk
queries/keys, D head dim.

This module is the launch side: dtype/array-library conversion, the tile plan
and a small thread schedule.  The tile math lives in
:mod:`anyattn.backends.numpy_tiles`.

Work is split into units: (batch, query head, query tiles) for the forward and
(batch, kv head, key tiles) for the backward, at least 4 per worker thread
(NumPy releases the GIL inside its loops and BLAS calls).  Every unit writes
its own outputs (split key ranges get their own dq partials, added in unit
order), so results are bitwise repeatable for a given thread count, whichever
worker ran which unit.  While the workers run,
OpenBLAS is held to one thread each (:mod:`anyattn.backends.blas_threads`).

Knobs: ``NumpyBackend.config`` (a frozen :class:`NumpyConfig`), or the
environment variables ``ANYATTN_NUMPY_THREADS``, ``ANYATTN_NUMPY_BLOCK_Q``,
``ANYATTN_NUMPY_BLOCK_K``.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .base import Backend, Capabilities
from .blas_threads import limit_this_thread
from .numpy_tiles import (LOG2E, BackwardHeads, TileCounts, TilePlan, backward_keys, forward_rows,
                          forward_rows_bounded, key_tile_norms, with_ones_column)

__all__ = ["NumpyBackend", "NumpyConfig"]


def _env_int(name: str, default: Optional[int]) -> Optional[int]:
    val = os.environ.get(name)
    if val is None or val == "":
        return default
    try:
        n = int(val)
    except ValueError:
        raise ValueError(f"{name}={val!r}: expected a positive integer") from None
    if n < 1:
        raise ValueError(f"{name}={val!r}: expected a positive integer")
    return n


@dataclass(frozen=True)
class NumpyConfig:
    """Tile sizes and thread count of the NumPy backend.

    ``threads=None``: one worker per CPU core (``os.cpu_count()``).
    Forward tiles ``fwd_bq x fwd_bk``, backward tiles ``bwd_bq x bwd_bk``.
    ``bounded``: use :func:`~anyattn.backends.numpy_tiles.forward_rows_bounded`
    (no running max; exact fallback on underflow) for bias-free forwards.
    """

    fwd_bq: int = 256
    fwd_bk: int = 256
    bwd_bq: int = 256
    bwd_bk: int = 256
    threads: Optional[int] = None
    #: forward without a running max (a Cauchy-Schwarz bound per row) when there is no bias
    bounded: bool = True

    @classmethod
    def from_env(cls) -> "NumpyConfig":
        c = cls()
        bq = _env_int("ANYATTN_NUMPY_BLOCK_Q", None)
        bk = _env_int("ANYATTN_NUMPY_BLOCK_K", None)
        if bq is not None:
            c = replace(c, fwd_bq=bq, bwd_bq=bq)
        if bk is not None:
            c = replace(c, fwd_bk=bk, bwd_bk=bk)
        return replace(c, threads=_env_int("ANYATTN_NUMPY_THREADS", None))

    def n_threads(self) -> int:
        return self.threads if self.threads is not None else max(1, os.cpu_count() or 1)


# --------------------------------------------------------------------- arrays
def _compute_dtype(dtype: str) -> np.dtype:
    """float64 stays float64; float32/float16/bfloat16 compute in float32 tiles."""
    return np.dtype(np.float64 if dtype == "float64" else np.float32)


def _as_np(x, dt: Optional[np.dtype] = None) -> Optional[np.ndarray]:
    """A NumPy view of a NumPy array / CPU torch tensor, cast to ``dt`` if given.

    float32/float64 torch tensors are viewed zero-copy (strides kept).
    """
    if x is None:
        return None
    if not isinstance(x, np.ndarray):  # torch CPU tensor (checked by the capabilities)
        x = x.detach()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        x = x.numpy()
    if dt is not None and x.dtype != dt:
        x = x.astype(dt)
    return x


def _blasable(x: np.ndarray) -> np.ndarray:
    """A 2-D [S, D] slice that BLAS reads in place (unit column stride), else a copy."""
    s0, s1 = x.strides
    item = x.itemsize
    if s1 == item and s0 >= x.shape[1] * item and s0 % item == 0:
        return x
    return np.ascontiguousarray(x)


def _to_caller(x: np.ndarray, dtype: str, kind: str):
    """A float result in the caller's dtype and array library."""
    if kind == "torch":
        import torch

        t = torch.from_numpy(np.ascontiguousarray(x))
        want = getattr(torch, dtype)
        return t if t.dtype == want else t.to(want)
    return x if x.dtype == np.dtype(dtype) else x.astype(dtype)


# ------------------------------------------------------------------ scheduling
_pool_lock = threading.Lock()
_pool: Optional[ThreadPoolExecutor] = None
_pool_size = 0
#: hold OpenBLAS to one thread inside the workers (ANYATTN_NUMPY_BLAS_LOCAL=0 turns it off)
_limit_blas = os.environ.get("ANYATTN_NUMPY_BLAS_LOCAL", "1") != "0"


def _executor(n: int) -> ThreadPoolExecutor:
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < n:
            if _pool is not None:
                _pool.shutdown(wait=False)
            _pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="anyattn-numpy")
            _pool_size = n
        return _pool


def _run_units(units: Sequence[Callable[[], TileCounts]], n_threads: int,
               static: bool = False) -> TileCounts:
    """Run the callables on ``n_threads`` workers; sum their tile counts.

    Units write disjoint outputs, so by default workers pull the next unit
    from a shared queue (balances load when another process shares a core)
    and the result does not depend on which worker ran what.  ``static=True``
    deals unit i to worker i % n instead, for per-worker accumulators.
    """
    total = TileCounts()
    nw = max(1, min(n_threads, len(units)))
    if nw == 1:
        for u in units:
            total.add(u())
        return total
    lock = threading.Lock()
    queue = iter(range(len(units)))

    def worker(w: int) -> TileCounts:
        if _limit_blas:
            limit_this_thread(1)
        c = TileCounts()
        if static:
            for u in units[w::nw]:
                c.add(u())
            return c
        while True:
            with lock:
                i = next(queue, None)
            if i is None:
                return c
            c.add(units[i]())

    futures = [_executor(nw).submit(worker, w) for w in range(nw)]
    for f in futures:  # re-raises a worker's exception
        total.add(f.result())
    return total


def _n_chunks(n_tiles: int, n_heads: int, n_threads: int) -> int:
    """Split each head's tiles into chunks so that there are >= 4 units per worker."""
    if n_threads <= 1:
        return 1
    return max(1, min(n_tiles, -(-4 * n_threads // n_heads)))


def _split(n: int, parts: int) -> List[List[int]]:
    """Tile indices 0..n-1 dealt round-robin into ``parts`` lists (balances causal work)."""
    parts = max(1, min(parts, n))
    return [list(range(w, n, parts)) for w in range(parts)]


# --------------------------------------------------------------------- backend
class NumpyBackend(Backend):
    """Blocked online-softmax attention on the CPU with NumPy (float32/float64)."""

    name = "numpy"
    capabilities = Capabilities(
        array_kinds=frozenset({"numpy", "torch"}), device_types=frozenset({"cpu"}),
        dtypes=frozenset({"float16", "bfloat16", "float32", "float64"}),
        precisions=frozenset({"highest"}))

    def __init__(self, config: Optional[NumpyConfig] = None):
        self.config = config if config is not None else NumpyConfig.from_env()
        #: tile counts of the last forward/backward call on this instance (debug aid).
        self.last_counts: Dict[str, TileCounts] = {}

    # ------------------------------------------------------------------ helpers
    def _plan(self, p, bq: int, bk: int, bias) -> TilePlan:
        bq, bk = min(bq, p.seq_q), min(bk, p.seq_k)
        m = p.mask
        codes = None if m.is_empty_mask else m.tile_map(bq, bk)
        return TilePlan(bq=bq, bk=bk, sq=p.seq_q, sk=p.seq_k, dtype=_compute_dtype(p.dtype),
                        mask=m, bias=bias, codes=codes)

    # ------------------------------------------------------------------ forward
    def forward(self, p, q, k, v, bias) -> Tuple[Any, Any]:
        out, lse = self._forward_np(p, q, k, v, bias)
        lse_dtype = "float64" if p.dtype == "float64" else "float32"
        return _to_caller(out, p.dtype, p.array_kind), _to_caller(lse, lse_dtype, p.array_kind)

    def _forward_np(self, p, q, k, v, bias) -> Tuple[np.ndarray, np.ndarray]:
        """-> (out [B, Hq, Sq, D], lse [B, Hq, Sq]) in the compute dtype."""
        cfg = self.config
        dt = _compute_dtype(p.dtype)
        q, k, v, bias = _as_np(q, dt), _as_np(k, dt), _as_np(v, dt), _as_np(bias)
        plan = self._plan(p, cfg.fwd_bq, cfg.fwd_bk, bias)
        B, Hq, Sq, D, G = p.batch, p.heads_q, p.seq_q, p.head_dim, p.group
        out = np.empty((B, Hq, Sq, D), dtype=dt)
        lse = np.empty((B, Hq, Sq), dtype=dt)
        qmul = dt.type(p.scale * LOG2E)
        nt = cfg.n_threads()
        chunks = _split(plan.nq, _n_chunks(plan.nq, B * Hq, nt))

        def unit(b: int, h: int, tiles: List[int]) -> Callable[[], TileCounts]:
            def run() -> TileCounts:
                q2 = np.multiply(q[b, h], qmul)                        # [Sq, D]
                kh, vh = _blasable(k[b, h // G]), _blasable(v[b, h // G])
                if bias is not None or not cfg.bounded:
                    return forward_rows(plan, b, h, q2, kh, vh, out[b, h], lse[b, h], tiles)
                return forward_rows_bounded(plan, b, h, q2, with_ones_column(kh, dt), vh,
                                            key_tile_norms(plan, kh), out[b, h], lse[b, h],
                                            tiles, kh)
            return run

        units = [unit(b, h, t) for b in range(B) for h in range(Hq) for t in chunks]
        self.last_counts = {"forward": _run_units(units, nt)}
        return out, lse

    # ----------------------------------------------------------------- backward
    def backward(self, p, q, k, v, dout, out, lse, bias) -> Dict[str, Any]:
        cfg = self.config
        dt = _compute_dtype(p.dtype)
        q, k, v, g = (_as_np(x, dt) for x in (q, k, v, dout))
        bias = _as_np(bias)
        out = _as_np(out, dt)
        lse = _as_np(lse, dt)
        want_q, want_k, want_v = "q" in p.wrt, "k" in p.wrt, "v" in p.wrt
        want_b = "bias" in p.wrt
        need_ds = want_q or want_k or want_b

        B, Hq, Hkv, Sq, Sk, D, G = (p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_k,
                                    p.head_dim, p.group)
        plan = self._plan(p, cfg.bwd_bq, cfg.bwd_bk, bias)
        nt = cfg.n_threads()
        chunks = _split(plan.nk, _n_chunks(plan.nk, B * Hkv, nt))
        nc = len(chunks)

        dq = np.zeros((B, Hq, Sq, D), dtype=dt) if want_q else None
        dk = np.empty((B, Hkv, Sk, D), dtype=dt) if want_k else None
        dv = np.empty((B, Hkv, Sk, D), dtype=dt) if want_v else None
        # per-chunk dq partials when one kv head's key tiles are split over workers
        dq_parts = ({(b, hk, c): np.zeros((G, Sq, D), dtype=dt)
                     for b in range(B) for hk in range(Hkv) for c in range(1, nc)}
                    if want_q and nc > 1 else {})

        units_keys = [(b, hk, c) for b in range(B) for hk in range(Hkv) for c in range(nc)]
        nw = max(1, min(nt, len(units_keys)))
        dbias_bufs = self._dbias_buffers(p, bias, units_keys, nw, dt) if want_b else None
        qmul = dt.type(p.scale * LOG2E)

        def unit(idx: int, b: int, hk: int, c: int) -> Callable[[], TileCounts]:
            def run() -> TileCounts:
                heads = list(range(hk * G, (hk + 1) * G))
                o = out[b, hk * G:(hk + 1) * G]                        # [G, Sq, D]
                gg = g[b, hk * G:(hk + 1) * G]
                q2a = np.empty((G, Sq, D + 1), dtype=dt)               # [q·scale·log2e | -lse2]
                np.multiply(q[b, hk * G:(hk + 1) * G], qmul, out=q2a[..., :D])
                np.multiply(lse[b, hk * G:(hk + 1) * G], -LOG2E, out=q2a[..., D])
                q2a[..., D][q2a[..., D] == np.inf] = -np.inf           # empty rows -> P = 0
                ga = np.empty((G, Sq, D + 1), dtype=dt)                # [dout | -delta]
                ga[..., :D] = gg
                if need_ds:
                    np.negative(np.einsum("gid,gid->gi", gg, o), out=ga[..., D])
                else:
                    ga[..., D] = 0
                if want_q:
                    dqa = dq[b, hk * G:(hk + 1) * G] if c == 0 else dq_parts[(b, hk, c)]
                hs = BackwardHeads(
                    heads=heads, q2a=list(q2a), q=[_blasable(q[b, h]) for h in heads],
                    ga=list(ga), dq=[dqa[i] for i in range(G)] if want_q else None)
                db = dbias_bufs[idx % len(dbias_bufs)] if dbias_bufs is not None else None
                return backward_keys(plan, b, hs, with_ones_column(k[b, hk], dt),
                                     with_ones_column(v[b, hk], dt),
                                     dk[b, hk] if want_k else None,
                                     dv[b, hk] if want_v else None, db, chunks[c], p.scale)
            return run

        units = [unit(i, *key) for i, key in enumerate(units_keys)]
        per_worker = dbias_bufs is not None and len(dbias_bufs) > 1
        self.last_counts = {"backward": _run_units(units, nt, static=per_worker)}

        res: Dict[str, Any] = {"dq": None, "dk": None, "dv": None, "dbias": None}
        if want_q:
            for (b, hk, c) in sorted(dq_parts):  # fixed order: chunk 1, 2, ...
                dq[b, hk * G:(hk + 1) * G] += dq_parts[(b, hk, c)]
            dq *= dt.type(p.scale)
            res["dq"] = _to_caller(dq, p.dtype, p.array_kind)
        if want_k:
            res["dk"] = _to_caller(dk, p.dtype, p.array_kind)
        if want_v:
            res["dv"] = _to_caller(dv, p.dtype, p.array_kind)
        if want_b:
            db = dbias_bufs[0]
            for extra in dbias_bufs[1:]:
                db += extra
            res["dbias"] = _to_caller(db, p.bias_dtype, p.array_kind)
        return res

    @staticmethod
    def _dbias_buffers(p, bias, units_keys, nw: int, dt) -> List[np.ndarray]:
        """dbias accumulators [Bb, Hb, Sqb, Skb]: one shared buffer when the units
        write disjoint parts of it, else one per worker (added in worker order)."""
        shape = p.bias_shape

        def region(b, hk, c):
            return (b if shape[0] > 1 else 0, hk if shape[1] > 1 else 0,
                    c if shape[3] > 1 else 0)

        regions = [region(*u) for u in units_keys]
        disjoint = len(set(regions)) == len(regions)
        n = 1 if disjoint or nw == 1 else nw
        return [np.zeros(shape, dtype=dt) for _ in range(n)]
