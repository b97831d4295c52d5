"""The NumPy backend: CPU attention, forward and backward, without an [Sq, Sk] matrix.

Shape legend: B batch, Hq/Hkv query/key-value heads (G = Hq/Hkv), Sq/Sk
queries/keys, D head dim of q and k, Dv head dim of v, out and dout.

This module is the launch side: dtype/array-library conversion, the tile plan,
the row statistics' units and a small thread schedule.  The tile math lives in
:mod:`anyattn.backends.numpy_tiles`.

Work is split into units: (batch, query head, query tiles) for the forward and
(batch, kv head, key tiles) for the backward (NumPy releases the GIL inside its
loops and BLAS calls).  A forward with few queries (:func:`_stack_reason`) runs one
unit per (batch, kv head) instead, the group's query heads stacked as G·Sq rows, so
each key tile is multiplied once per group (:func:`~.numpy_tiles.forward_group`; the
choice never depends on the thread count).  Results are bitwise the same whatever the
thread count, BLAS's thread split or which worker ran which unit: every forward unit writes its
own rows, computed tile by tile in a fixed order; the backward's units and their
reduction order depend on the problem only, never on the thread count (a kv
head's key tiles go to :data:`BWD_UNITS`-based chunks whose dq partials are added
in chunk order; a dbias that several units share is accumulated in at most
:data:`DBIAS_SLOTS` buffers, each filled by a fixed list of units in order, added in
slot order).  BLAS runs at one thread in the workers and with its own threads
where units run on the calling thread (one worker); OpenBLAS's threads split a
GEMM's output, never its sums, so that changes no bits either (other BLAS
libraries may not promise this).

The worker pool is shared by all calls and safe for any number of calling threads
(each call has its own queue; the pool is only ever replaced under a lock); its
default size is the number of CPUs this process may use (:func:`available_cpus`).
While the workers run, BLAS is held to one thread each
(:mod:`anyattn.backends.blas_threads`, via threadpoolctl: per thread where the
BLAS allows it, else process-wide for the duration of the call).  Where
threadpoolctl is missing or controls no BLAS, the default pool is one worker:
units run on the calling thread and BLAS keeps its threads
(``python -m anyattn info`` shows which mode applies).

Floating-point warnings: NaN/Inf inputs propagate as through a matmul; the
overflows and ``inf - inf`` they cause inside the kernels are not reported as
NumPy RuntimeWarnings (everything runs under ``np.errstate(all="ignore")``).

Knobs: ``NumpyBackend.config`` (a frozen :class:`NumpyConfig`), or the
environment variables ``ANYATTN_NUMPY_THREADS``, ``ANYATTN_NUMPY_BLOCK_Q``,
``ANYATTN_NUMPY_BLOCK_K``, ``ANYATTN_NUMPY_BLAS_LOCAL=0`` (leave BLAS threads alone).
"""
from __future__ import annotations

import contextlib
import functools
import math
import os
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ..features import INPUTS
from ..modifiers import NO_MODS, alibi_diag, fold_sinks
from ..rowstats import RowStats
from .. import settings
from . import blas_threads, numpy_paged
from .base import Backend, Capabilities
from ..programs.bound import ScoreTiles
from ..programs.builtin_forms import Scale, match_builtin
from .numpy_tiles import (BASE2_LIMIT, EXP_FLOOR2, LN2, LOG2E, TILE_TERMS, AlibiRows,
                          BackwardHeads,
                          DropoutDraw, TileCounts, TileMods, TilePlan, alibi_anchors,
                          backward_columns,
                          backward_keys, forward_group, forward_rows, forward_rows_bounded,
                          key_tile_norms,
                          saturating_cast, shift_stats, snap_plan, tile_blocks, two_sum,
                          with_ones_column)

__all__ = ["NumpyBackend", "NumpyConfig", "available_cpus", "cgroup_cpu_quota"]


#: automatic tiles (bq, bk) by pass and by what the mask is: GEMMs of 512 run faster
#: than 256 at one thread and need half the NumPy calls (two workers contend for the
#: GIL between calls); with a band term (causal, windows) the long side lies across the
#: band and a partial tile computes only the rows (forward) / keys (backward) the band
#: reaches (TilePlan.band_rows / band_keys), so the diagonal costs what a 256 grid's
#: does; other masks keep 256 x 256.
AUTO_TILES = {("fwd", "none"): (512, 512), ("bwd", "none"): (512, 512),
              ("fwd", "band"): (512, 256), ("bwd", "band"): (256, 512),
              ("fwd", "other"): (256, 256), ("bwd", "other"): (256, 256)}


def _mask_kind(mask) -> str:
    """'none' (no term), 'band' (a causal/window term, maybe with others), 'other'."""
    if mask.is_empty_mask:
        return "none"
    return "band" if mask.has_band else "other"


@dataclass(frozen=True)
class NumpyConfig:
    """Tile sizes and thread count of the NumPy backend.

    ``threads=None``: one worker per CPU this process may use
    (:func:`available_cpus`: affinity mask and cgroup quota).
    Forward tiles ``fwd_bq x fwd_bk``, backward tiles ``bwd_bq x bwd_bk``; a size left
    ``None`` is chosen per call from :data:`AUTO_TILES` by the mask.
    ``bounded``: use :func:`~anyattn.backends.numpy_tiles.forward_rows_bounded`
    (no running max where the logits are small) for bias-free forwards.
    ``stack_heads``: the forward of a problem with few queries runs one unit per
    (batch, key/value head) with the group's query heads stacked
    (:func:`~anyattn.backends.numpy_tiles.forward_group`) where :func:`_stack_reason`
    allows it; False keeps one unit per query head always.
    """

    fwd_bq: Optional[int] = None
    fwd_bk: Optional[int] = None
    bwd_bq: Optional[int] = None
    bwd_bk: Optional[int] = None
    threads: Optional[int] = None
    #: forward without a running max (a Cauchy-Schwarz bound per row) when there is no bias
    bounded: bool = True
    #: stack a group's query heads into one forward unit where few queries allow it
    stack_heads: bool = True

    def tiles(self, kind: str, mask) -> Tuple[int, int]:
        """(bq, bk) of the 'fwd' or 'bwd' pass for a ResolvedMask."""
        auto = AUTO_TILES[(kind, _mask_kind(mask))]
        bq, bk = (self.fwd_bq, self.fwd_bk) if kind == "fwd" else (self.bwd_bq, self.bwd_bk)
        return (auto[0] if bq is None else bq), (auto[1] if bk is None else bk)

    @classmethod
    def from_env(cls) -> "NumpyConfig":
        c = cls()
        env = settings.current()
        bq, bk = env.numpy_block_q, env.numpy_block_k
        if bq is not None:
            c = replace(c, fwd_bq=bq, bwd_bq=bq)
        if bk is not None:
            c = replace(c, fwd_bk=bk, bwd_bk=bk)
        return replace(c, threads=env.numpy_threads)

    def n_threads(self) -> int:
        return self.threads if self.threads is not None else _default_threads()


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


def _alloc(shape, dt: np.dtype) -> np.ndarray:
    """An uninitialised result array (every element is written by a unit)."""
    return np.empty(shape, dtype=dt)


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
def _read(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def cgroup_cpu_quota(root: str = "/sys/fs/cgroup",
                     self_cgroup: str = "/proc/self/cgroup") -> Optional[float]:
    """The CPU quota of this process's cgroup in CPUs (e.g. 1.5), or None if unlimited.

    cgroup v2: ``cpu.max`` ("QUOTA PERIOD" or "max PERIOD") of the process's own
    cgroup and each of its ancestors (the smallest applies); cgroup v1:
    ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` (-1: no quota) under ``cpu`` /
    ``cpu,cpuacct``.  Files that are missing or unreadable count as no quota.
    """
    limits: List[float] = []
    own = "/"
    text = _read(self_cgroup) or ""
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and parts[0] == "0" and parts[1] == "":
            own = parts[2] or "/"
    # v2: walk from the process's cgroup up to the root
    rel = own.strip("/")
    dirs = []
    while True:
        dirs.append(os.path.join(root, rel) if rel else root)
        if not rel:
            break
        rel = rel.rpartition("/")[0]
    for d in dirs:
        txt = _read(os.path.join(d, "cpu.max"))
        if not txt:
            continue
        fields = txt.split()
        try:
            if len(fields) >= 2 and fields[0] != "max":
                quota, period = float(fields[0]), float(fields[1])
                if quota > 0 and period > 0:
                    limits.append(quota / period)
        except ValueError:
            continue
    # v1
    for sub in ("cpu", "cpu,cpuacct", "cpuacct,cpu"):
        q = _read(os.path.join(root, sub, "cpu.cfs_quota_us"))
        per = _read(os.path.join(root, sub, "cpu.cfs_period_us"))
        if q is None or per is None:
            continue
        try:
            quota, period = float(q.strip()), float(per.strip())
        except ValueError:
            continue
        if quota > 0 and period > 0:
            limits.append(quota / period)
    return min(limits) if limits else None


def available_cpus(affinity: Optional[Callable[[], Any]] = None, **cgroup_paths) -> int:
    """How many CPUs this process may actually use (>= 1).

    The CPUs of its affinity mask (``os.sched_getaffinity(0)``; ``os.cpu_count()``
    where that does not exist), capped by the cgroup CPU quota rounded up
    (:func:`cgroup_cpu_quota`; a container limited to 1.5 CPUs gets 2 workers).
    ``affinity`` and ``cgroup_paths`` (``root``, ``self_cgroup``) are for tests.
    """
    get = affinity if affinity is not None else getattr(os, "sched_getaffinity", None)
    n = 0
    if get is not None:
        try:
            n = len(get(0))
        except OSError:
            n = 0
    if n <= 0:
        n = os.cpu_count() or 1
    quota = cgroup_cpu_quota(**cgroup_paths)
    if quota is not None:
        n = min(n, max(1, math.ceil(quota - 1e-9)))
    return max(1, n)


@functools.lru_cache(maxsize=1)
def _default_threads() -> int:
    """available_cpus(), or 1 where BLAS threads cannot be limited in workers
    (blas_threads mode "fallback", unless ANYATTN_NUMPY_BLAS_LOCAL=0 leaves them
    alone on purpose)."""
    if _limit_blas() and blas_threads.mode() == "fallback":
        n = available_cpus()
        if n > 1:
            warnings.warn(
                f"anyattn's numpy backend runs on 1 worker instead of {n}: "
                f"{blas_threads.unavailable_reason()}, so BLAS threads cannot be limited "
                "inside workers (a process-wide BLAS pool is slow under load). threadpoolctl "
                "is a required dependency of anyattn: reinstall it without --no-deps",
                RuntimeWarning, stacklevel=2)
        return 1
    return available_cpus()


_pool_lock = threading.Lock()
_pool: Optional[ThreadPoolExecutor] = None
_pool_size = 0


def _limit_blas() -> bool:
    """Hold BLAS to one thread inside the workers (ANYATTN_NUMPY_BLAS_LOCAL=0 turns it
    off)."""
    return settings.current().numpy_blas_local

#: the backward splits each (batch, kv head)'s key tiles into chunks until there are
#: at least this many units, keeping >= 2 key tiles per chunk where there are >= 4
#: (each chunk past the first costs a dq partial); fixed, not by thread count: the
#: chunks decide dq's summation order
BWD_UNITS = 16
#: most dbias accumulators when units share parts of dbias (fixed: they decide its
#: summation order); each costs one dbias of memory
DBIAS_SLOTS = 4


def _submit_all(fn: Callable[[int], TileCounts], n: int) -> List[Future]:
    """Submit ``fn(0) .. fn(n-1)`` to the shared pool, growing it first if needed.

    Everything happens under one lock, so no call ever submits to a pool that
    another call has just replaced: a replaced pool is shut down without waiting
    (the work already queued on it still runs) and receives nothing new.
    """
    global _pool, _pool_size
    with _pool_lock:
        if _pool is None or _pool_size < n:
            old = _pool
            _pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="anyattn-numpy")
            _pool_size = n
            if old is not None:
                old.shutdown(wait=False)
        return [_pool.submit(fn, w) for w in range(n)]


def _run_units(units: Sequence[Callable[[], TileCounts]], n_threads: int) -> TileCounts:
    """Run the callables on ``n_threads`` workers; sum their tile counts.

    Units write disjoint outputs, so workers pull the next unit from a queue of
    this call (balances load when another process shares a core) and the result
    does not depend on which worker ran what.  Any number of threads may call
    this at once: each call has its own queue and outputs, the pool threads are
    shared.  Units run under ``np.errstate(all="ignore")``.
    """
    total = TileCounts()
    nw = max(1, min(n_threads, len(units)))
    if nw == 1:
        with np.errstate(all="ignore"):
            for u in units:
                total.add(u())
        return total
    lock = threading.Lock()
    queue = iter(range(len(units)))
    per_thread_blas = _limit_blas() and blas_threads.per_thread_supported()

    def worker(w: int) -> TileCounts:
        if per_thread_blas:
            blas_threads.limit_this_thread(1)
        c = TileCounts()
        with np.errstate(all="ignore"):      # a worker thread starts with the defaults
            while True:
                with lock:
                    i = next(queue, None)
                if i is None:
                    return c
                c.add(units[i]())

    limit = (blas_threads.limited(1) if _limit_blas() and not per_thread_blas
             else contextlib.nullcontext())
    with limit:
        futures = _submit_all(worker, nw)
        wait(futures)                  # every worker done before results are read
    for f in futures:                  # re-raises a worker's exception
        total.add(f.result())
    return total


#: the forward stacks a group's query heads for at most this many queries per head ...
STACK_MAX_SQ = 64
#: ... and at most this many stacked rows (G·Sq) per unit
STACK_MAX_ROWS = 256


def _stack_reason(p, plan: TilePlan, cfg: "NumpyConfig") -> Optional[str]:
    """Why the forward of ``p`` keeps one unit per query head, or None: one unit per
    (batch, key/value head) with its G query heads stacked (every feature is applied
    per head inside the unit, so none needs a rule).  Never depends on the thread
    count (the two ways round differently)."""
    if not cfg.stack_heads:
        return "NumpyConfig.stack_heads is off"
    if p.group == 1:
        return "one query head per key/value head: no key tile to share"
    if p.seq_q > STACK_MAX_SQ:
        return "many queries: each key tile serves many rows per head already"
    if plan.nq > 1:
        return "more than one query tile (fwd_bq below Sq)"
    if p.group * p.seq_q > STACK_MAX_ROWS:
        return "the stacked rows would not fit one score tile well"
    return None


def _n_chunks(n_tiles: int, n_heads: int, n_units: int) -> int:
    """Split each head's tiles into chunks so that there are >= n_units units."""
    if n_units <= 1:
        return 1
    return max(1, min(n_tiles, -(-n_units // n_heads)))


def _in_order(units: Sequence[Callable[[], TileCounts]]) -> Callable[[], TileCounts]:
    """One unit that runs ``units`` one after the other, in this order."""
    def run() -> TileCounts:
        c = TileCounts()
        for u in units:
            c.add(u())
        return c
    return run


def _split(n: int, parts: int) -> List[List[int]]:
    """Tile indices 0..n-1 dealt round-robin into ``parts`` lists (balances causal work)."""
    parts = max(1, min(parts, n))
    return [list(range(w, n, parts)) for w in range(parts)]


# ------------------------------------------------------------------ modifiers
def _slopes64(p, mods) -> Optional[np.ndarray]:
    """ALiBi slopes as float64 [Ba, Hq] (Ba in {1, B}), or None."""
    if mods.alibi_slopes is None:
        return None
    return _as_np(mods.alibi_slopes).astype(np.float64).reshape(p.alibi_shape)


def _alibi_rows(p, slopes: np.ndarray, anchor: np.ndarray, b: int, h: int, u: float,
                dt: np.dtype) -> AlibiRows:
    """The ALiBi tile term of (batch b, query head h) in units u (log2 e or 1);
    anchor [Sq] from alibi_anchors."""
    slope = slopes[b if slopes.shape[0] > 1 else 0, h]
    return AlibiRows(slope * u, anchor, p.seq_k, dt)


class _Call:
    """What the launcher and the modifiers' hooks share in one call (forward or
    backward): the problem, its array modifiers, the tile plan, the compute dtype and the
    values the hooks set (defaults: no modifier)."""

    def __init__(self, p, mods, plan: TilePlan, dt: np.dtype):
        self.p, self.mods, self.plan, self.dt = p, mods, plan, dt
        # forward, set by the launcher before the hooks: query multipliers (base 2,
        # natural units) and the score bound's factor and cap (log2 units)
        self.q2mul = self.qsmul = self.bmul = self.bcap = None
        # backward, set by the launcher: the statistics as given (stats64) and as the
        # kernels see them (row_max, log_norm, float64); units, -max column, w, q factor
        self.stats64 = self.row_max = self.log_norm = None
        self.base2 = self.col = self.w = self.qmul = None
        self.slopes: Optional[np.ndarray] = None    # ALiBi: float64 [Ba, Hq]
        self.anchor: Optional[np.ndarray] = None    # ALiBi: anchors [Sq] (alibi_anchors)
        self.dmin: Optional[np.ndarray] = None      # ALiBi: row distances [Sq]
        self.draw: Optional[DropoutDraw] = None     # dropout
        self.capu: Optional[float] = None           # backward: softcap c·u
        self.floor: Optional[float] = None          # backward: EXP_FLOOR2 in kernel units
        self.wfold: Optional[np.ndarray] = None     # backward: softcap's w·2^-max_u
        self.natural = False                        # score_mod: natural units throughout
        self.score: Optional[ScoreTiles] = None     # score_mod on tiles


class _Modifier:
    """One modifier of the NumPy backend: the hooks the launcher calls for a problem
    that uses it, in :data:`MODIFIER_STEPS` order.  Their tile functions live in
    :mod:`.numpy_tiles` (``TileMods.cap_t``, ``AlibiRows.add_t``,
    ``DropoutTiles.keep_t``), which the kernels call at their stage of the pipeline
    (scores: softcap, bias, ALiBi; P after its row sum: dropout)."""

    name = "?"

    def forward_setup(self, c: _Call) -> None:
        """Before the units: query multipliers, per-call tables."""

    def forward_finish(self, c: _Call, out, rmax, rlog):
        """After the units: -> (out, rmax, rlog) with this modifier's part applied."""
        return out, rmax, rlog

    def backward_stats(self, c: _Call) -> None:
        """The given statistics (``c.row_max``, ``c.log_norm``, float64) in the terms the
        kernels compute (before the units' dtype and base are chosen)."""

    def backward_setup(self, c: _Call) -> None:
        """The kernels' operands, once ``c.base2``, ``c.col``, ``c.w`` are known."""


class _Softcap(_Modifier):
    """c·tanh(x / c): the queries carry scale / c, the kernels apply TileMods.cap_t (the
    backward: 1 - tanh² after dbias)."""

    name = "softcap"

    def forward_setup(self, c):
        cap, dt = c.p.softcap, c.dt                # x/c in natural units for tanh
        c.q2mul = c.qsmul = dt.type(c.p.scale / cap)
        c.bmul = c.bcap = cap * LOG2E              # |s| <= c·log2e (log2 units)

    def backward_setup(self, c):
        cap, dt, col = c.p.softcap, c.dt, c.col    # x/c in natural units for tanh
        c.qmul = dt.type(c.p.scale / cap)
        c.capu = cap * LOG2E if c.base2 else cap
        if c.base2 and c.plan.bias is None and c.slopes is None and c.capu <= 100:
            # exp2(c·u·t) stays in [2^-100, 2^100] and |max_u| <= 64: 2^-max_u joins w
            c64 = col.astype(np.float64)
            with np.errstate(invalid="ignore", over="ignore"):
                c.wfold = np.where(np.isfinite(c64), c.w * np.exp2(c64),
                                   np.where(np.isnan(c64), np.nan, 0.0)).astype(dt)


class _Alibi(_Modifier):
    """-slope·|i' - j'|, rebased per row (alibi_anchors): the row term joins the
    statistics here, the tile term is AlibiRows.add_t in the kernels."""

    name = "alibi"

    def _anchors(self, c):
        p = c.p
        c.slopes = _slopes64(p, c.mods)                                # [Ba, Hq]
        c.anchor, c.dmin = alibi_anchors(c.plan.mask, p.seq_q, p.seq_k, alibi_diag(p))

    def forward_setup(self, c):
        self._anchors(c)                           # ALiBi rebased per row: [Sq] each

    def forward_finish(self, c, out, rmax, rlog):
        if c.dmin.any():                           # ALiBi's row term -slope·dmin_i
            rmax, rlog = shift_stats(rmax, rlog, -c.slopes[:, :, None] * c.dmin)
        return out, rmax, rlog

    def backward_stats(self, c):
        self._anchors(c)                           # kernels see ALiBi rebased per row
        if c.dmin.any():
            row_max, log_norm = c.row_max, c.log_norm
            fin = np.isfinite(row_max)
            m, e = two_sum(np.where(fin, row_max, 0.0),
                           np.broadcast_to(c.slopes[:, :, None] * c.dmin, row_max.shape))
            c.row_max = np.where(fin, m, row_max)    # max + slope·dmin = m + e
            c.log_norm = np.where(fin & (log_norm != 0), log_norm + e, log_norm)

    def backward_setup(self, c):
        c.floor = _exp_floor(c.dt, c.base2)


class _Dropout(_Modifier):
    """P ∘ keep / (1 - p): column words once per call (DropoutDraw), keep tiles drawn in
    the kernels (DropoutTiles.keep_t)."""

    name = "dropout"

    def forward_setup(self, c):
        c.draw = _draw(c.p)

    def backward_setup(self, c):
        c.draw = _draw(c.p)


class _Sinks(_Modifier):
    """One more term exp(sink) in every denominator: folded into the wide accumulator and
    the statistics after the units (anyattn.modifiers.fold_sinks); dsinks from δ."""

    name = "sinks"

    def forward_finish(self, c, out, rmax, rlog):
        sinks = _as_np(c.mods.sinks).astype(c.dt)                     # [Hq]
        with np.errstate(invalid="ignore"):                           # NaN rows stay NaN
            out, st = fold_sinks(out, RowStats(rmax, rlog), sinks)
        no_sink = (sinks == -np.inf)[None, :, None]                    # keep ONE_KEY marks
        return out, st.max, np.where(no_sink, rlog, st.log_norm)


class _ScoreMod(_Modifier):
    """A user's score function (anyattn.programs), applied per tile after the cap
    (TileMods.score_t; backward: ScoreTiles.apply_grad_t).  Its values are unbounded,
    so the kernels run in natural units with a running max (as with a bias); capture
    gradients are scattered per unit into float64 buffers added in a fixed order."""

    name = "score_mod"

    def forward_setup(self, c):
        c.natural = True
        c.score = ScoreTiles(c.p.score_mod, c.dt)

    def backward_stats(self, c):
        c.natural = True

    def backward_setup(self, c):
        c.score = ScoreTiles(c.p.score_mod, c.dt, wrt=c.p.capture_wrt)


#: every modifier this backend implements, by feature name, in the order its hooks run
#: (ALiBi's statistics before softcap's operands, its row term before the sink's fold)
MODIFIER_STEPS: Dict[str, _Modifier] = {m.name: m for m in (_Alibi(), _Softcap(),
                                                            _ScoreMod(), _Dropout(),
                                                            _Sinks())}


def _modifiers_of(p) -> List[_Modifier]:
    """The table entries of the modifiers ``p`` uses, in table order."""
    used = p.features
    return [m for name, m in MODIFIER_STEPS.items() if name in used]


def _fold_scale_form(p) -> Optional[Scale]:
    """The score function is ``score * t[h]`` (a
    :class:`~anyattn.programs.builtin_forms.Scale`) and there is no softcap (a factor
    after a softcap would move inside tanh), so a forward may fold it into the queries
    (:func:`_fold_scale`); else None.  (The band, softcap and ALiBi forms were taken out
    by ``describe`` for every backend.)"""
    sm = p.score_mod
    if sm is None or p.softcap is not None:
        return None
    form = match_builtin(sm.program, sm.sizes)
    return form if isinstance(form, Scale) else None


def _fold_scale(p, q: np.ndarray, scale: Optional[Scale]):
    """A forward's (p, q) with a score function ``score * t[h]`` folded into the
    queries, ``q·t[h]`` in the compute dtype (the scores ``scale·(q·t)·k`` then need no
    function: base 2, bounded forward), where every factor is finite (an infinite one
    would meet a zero score as inf·0 in the function, inside the GEMM here)."""
    if scale is None:
        return p, q
    sm = p.score_mod
    f = scale.factors(sm.arrays, sm.sizes)                        # [B or 1, Hq]
    if not np.isfinite(f).all():
        return p, q
    return replace(p, score_mod=None), q * f[:, :, None, None].astype(q.dtype)


def _draw(p) -> DropoutDraw:
    """The call's dropout: column words and threshold."""
    return DropoutDraw(p.dropout_p, p.dropout_seed, p.q_offset, p.k_offset, p.seq_q, p.seq_k)


def _dsinks(mods, stats64: Tuple[np.ndarray, np.ndarray], delta: np.ndarray) -> np.ndarray:
    """dsinks [Hq] (float64) = -Σ_{b,i} exp((sink - max) - log_norm)·δ from the given
    statistics (float64 [B, Hq, Sq], sink included) and δ [B, Hq, Sq]; rows with an
    infinite max or sink contribute 0."""
    m, ln = stats64
    t = _as_np(mods.sinks).astype(np.float64)[None, :, None]          # [1, Hq, 1]
    fin = np.isfinite(m) & np.isfinite(t)
    with np.errstate(over="ignore", invalid="ignore"):
        p_sink = np.where(fin, np.exp((t - np.where(fin, m, 0.0)) - ln), 0.0)  # [B, Hq, Sq]
    return -(p_sink * delta.astype(np.float64)).sum(axis=(0, 2))


def _qk_bounds(qg: np.ndarray, kh: np.ndarray, mul: float, cap: Optional[float]
               ) -> List[float]:
    """Per query head of a group, a bound of |mul·<q_i, k_j>| over all i, j
    (Cauchy-Schwarz), capped at ``cap`` (softcap c·u) if given.  qg [G, Sq, D], kh [Sk, D].
    NaN/inf inputs give inf (no bound)."""
    kn = float(np.sqrt(np.max(np.einsum("jd,jd->j", kh, kh)))) if kh.size else 0.0
    out = []
    for qh in qg:
        qn = float(np.sqrt(np.max(np.einsum("id,id->i", qh, qh)))) if qh.size else 0.0
        qb = qn * kn * mul
        qb = qb if qb == qb else float("inf")
        out.append(min(qb, cap) if cap is not None else qb)
    return out


def _exp_floor(dt: np.dtype, base2: bool) -> float:
    """The lowest exponent the kernels feed to exp on ALiBi's far tiles, in the
    kernel's units (EXP_FLOOR2 is in log2 units)."""
    return EXP_FLOOR2[dt] * (1.0 if base2 else LN2)


def _tile_mods(p, slopes: Optional[np.ndarray], anchor: Optional[np.ndarray], b: int,
               h: int, dt: np.dtype, score: Optional[ScoreTiles] = None
               ) -> Callable[[bool], Optional[TileMods]]:
    """units -> the TileMods of (batch b, query head h) in base 2 (True) or natural
    units (False), None without softcap, ALiBi and score_mod; made on first use, one per unit of
    work (AlibiRows caches views: never shared between threads)."""
    made: Dict[bool, Optional[TileMods]] = {}

    def get(base2: bool) -> Optional[TileMods]:
        if base2 not in made:
            u = LOG2E if base2 else 1.0
            al = None if slopes is None else _alibi_rows(p, slopes, anchor, b, h, u, dt)
            cap = None if p.softcap is None else p.softcap * u
            made[base2] = None if cap is None and al is None and score is None else \
                TileMods(cap, al, None if al is None else _exp_floor(dt, base2),
                         score, (b, h))
        return made[base2]
    return get


# --------------------------------------------------------------------- backend
class NumpyBackend(Backend):
    """Blocked online-softmax attention on the CPU with NumPy (float32/float64)."""

    name = "numpy"
    capabilities = Capabilities(
        array_kinds=frozenset({"numpy", "torch"}), device_types=frozenset({"cpu"}),
        dtypes=frozenset({"float16", "bfloat16", "float32", "float64"}),
        precisions=frozenset({"highest"}), mask_terms=frozenset(TILE_TERMS),
        inputs=INPUTS, modifiers=frozenset(MODIFIER_STEPS))

    def __init__(self, config: Optional[NumpyConfig] = None):
        self.config = config if config is not None else NumpyConfig.from_env()
        #: tile counts of the last forward/backward call on this instance (debug aid).
        self.last_counts: Dict[str, TileCounts] = {}
        #: whether the last dense forward stacked each group's query heads (debug aid).
        self.last_stacked = False

    def describe_device(self) -> str:
        """One line for ``python -m anyattn info``: the BLAS (as threadpoolctl reports
        it: library, version, kernel family, path, threads now), the worker pool and
        how BLAS threads are limited inside the workers."""
        nt = self.config.n_threads()
        pool = f"pool {nt} worker{'s' if nt != 1 else ''}"
        if self.config.threads is not None:
            pool += " (set)"
        libs = blas_threads.blas_info()
        blas = "; ".join(
            f"BLAS {x['name']} {x['version'] or '?'}"
            + (f" ({x['core']}" + (f", {x['threading_layer']}" if x['threading_layer']
                                  else "") + ")" if x['core'] else "")
            + f" {x['threads']} thread{'s' if x['threads'] != 1 else ''} at {x['path']}"
            for x in libs)
        m = blas_threads.mode()
        if not _limit_blas():
            how = "BLAS threads in workers: left alone (ANYATTN_NUMPY_BLAS_LOCAL=0)"
        elif m == "per-thread":
            how = "BLAS threads in workers: 1, per thread"
        elif m == "process-wide":
            how = "BLAS threads in workers: 1, process-wide while a call runs workers"
        else:
            how = (f"BLAS threads in workers: fallback, {blas_threads.unavailable_reason()}:"
                   " units run on the calling thread, BLAS keeps its threads"
                   " (threadpoolctl is a required dependency of anyattn: reinstall it"
                   " without --no-deps)")
        return ", ".join(x for x in (blas, pool, how) if x)

    # ------------------------------------------------------------------ helpers
    def _plan(self, p, bq: int, bk: int, bias) -> TilePlan:
        bq, bk = min(bq, p.seq_q), min(bk, p.seq_k)
        m = p.mask
        codes = None if m.is_empty_mask else m.tile_map(bq, bk)
        # kernels that floor exponents (ALiBi's far tiles) re-zero a -inf bias's entries
        neginf = bias is not None and p.has_alibi and bool(np.isneginf(bias).any())
        return TilePlan(bq=bq, bk=bk, sq=p.seq_q, sk=p.seq_k, dtype=_compute_dtype(p.dtype),
                        mask=m, bias=bias, codes=codes, bias_neginf=neginf)

    # ------------------------------------------------------------------ forward
    def forward(self, p, q, k, v, bias, mods=NO_MODS) -> Tuple[Any, RowStats]:
        with np.errstate(all="ignore"):          # NaN/Inf propagate; no warnings
            out, rmax, rlog = self._forward_np(p, q, k, v, bias, mods)
        sdt = "float64" if p.dtype == "float64" else "float32"
        kind = p.array_kind
        return _to_caller(out, p.dtype, kind), RowStats(_to_caller(rmax, sdt, kind),
                                                        _to_caller(rlog, sdt, kind))

    def _forward_np(self, p, q, k, v, bias, mods=NO_MODS
                    ) -> Tuple[np.ndarray, np.ndarray, np.ndarray]:
        """-> (out [B, Hq, Sq, Dv], row max [B, Hq, Sq], log-normaliser [B, Hq, Sq]) in
        the compute dtype (statistics in natural-log units, see anyattn.rowstats).

        Without a bias: base-2 scores, the bounded forward where the logits are small
        and the running-max path where they are not (natural units past
        BASE2_LIMIT).  With a bias: natural units throughout (a finite bias, even
        finfo.min, is a number; only -inf excludes).

        Score modifiers (anyattn.modifiers): a softcap c scales the queries by
        ``scale / c`` so that tanh sees natural-unit x/c, the kernels multiply by
        ``c·u`` (u = log2 e in base 2); ALiBi's tile term is added per tile
        (:class:`~anyattn.backends.numpy_tiles.AlibiRows`) and its row term joins the
        statistics here (:func:`~anyattn.backends.numpy_tiles.shift_stats`); sinks are
        folded into the wide accumulator and the statistics at the end
        (:func:`anyattn.modifiers.fold_sinks`).

        Dropout (:class:`~anyattn.backends.numpy_tiles.DropoutDraw`): column words once
        per call, row words once per unit, keep tiles drawn per tile in the kernels;
        the statistics stay those of the undropped softmax."""
        scale = _fold_scale_form(p)
        cfg = self.config
        dt = _compute_dtype(p.dtype)
        q, k, v = _as_np(q, dt), _as_np(k, dt), _as_np(v, dt)
        p, q = _fold_scale(p, q, scale)
        bias = None if bias is None else saturating_cast(_as_np(bias), dt)
        plan = self._plan(p, *cfg.tiles("fwd", p.mask), bias)
        B, Hq, Sq, Dv, G = p.batch, p.heads_q, p.seq_q, p.head_dim_v, p.group
        out = _alloc((B, Hq, Sq, Dv), dt)
        rmax = _alloc((B, Hq, Sq), dt)
        rlog = _alloc((B, Hq, Sq), dt)
        used = _modifiers_of(p)
        c = _Call(p, mods, plan, dt)
        c.q2mul = dt.type(p.scale * LOG2E)         # base 2
        c.qsmul = dt.type(p.scale)                 # natural units
        c.bmul, c.bcap = 1.0, None                 # |q2|·|k| bounds |s| in log2 units
        for m in used:
            m.forward_setup(c)
        cap, slopes, anchor, draw = p.softcap, c.slopes, c.anchor, c.draw
        q2mul, qsmul, bmul, bcap = c.q2mul, c.qsmul, c.bmul, c.bcap
        nt = cfg.n_threads()
        # rows are independent: any split gives the same bits; >= 4 units per worker
        chunks = _split(plan.nq, _n_chunks(plan.nq, B * Hq, 4 * nt if nt > 1 else 1))

        def unit(b: int, h: int, tiles: List[int]) -> Callable[[], TileCounts]:
            def run() -> TileCounts:
                kh, vh = _blasable(k[b, h // G]), _blasable(v[b, h // G])
                o, mx, ln = out[b, h], rmax[b, h], rlog[b, h]
                tm = _tile_mods(p, slopes, anchor, b, h, dt, c.score)
                dkw = {} if draw is None else dict(drop=draw.tiles(plan.bq * plan.bk, dt),
                                                   drop_rows=draw.rows(b, h))
                if bias is not None or c.natural:
                    qs = np.multiply(q[b, h], qsmul)                   # [Sq, D]
                    return forward_rows(plan, b, h, qs, kh, vh, o, mx, ln,
                                        tile_blocks(plan, tiles), False, tm(False), **dkw)
                q2 = np.multiply(q[b, h], q2mul)                       # [Sq, D]

                def exact(blocks, cmax: float) -> TileCounts:
                    # cmax bounds |s| in log2 units (NaN: unknown)
                    qb = cmax if cmax == cmax else None
                    if cmax <= BASE2_LIMIT:
                        return forward_rows(plan, b, h, q2, kh, vh, o, mx, ln, blocks, True,
                                            tm(True), qb, **dkw)
                    qs = q2 if cap is not None else np.multiply(q[b, h], qsmul)
                    return forward_rows(plan, b, h, qs, kh, vh, o, mx, ln, blocks, False,
                                        tm(False), None if qb is None else qb * LN2, **dkw)

                if not cfg.bounded:
                    bound = float(np.sqrt(np.max(np.einsum("id,id->i", q2, q2))) *
                                  np.sqrt(np.max(np.einsum("jd,jd->j", kh, kh))) * bmul) \
                        if q2.size and kh.size else 0.0
                    if bcap is not None:
                        bound = float(np.minimum(bound, bcap))         # NaN stays NaN
                    return exact(tile_blocks(plan, tiles), bound)
                return forward_rows_bounded(plan, b, h, q2, kh, vh, key_tile_norms(plan, kh),
                                            o, mx, ln, tiles, exact, tm(True), bmul, bcap,
                                            **dkw)
            return run

        def group_unit(b: int, hk: int) -> Callable[[], TileCounts]:
            def run() -> TileCounts:
                hsl = slice(hk * G, (hk + 1) * G)
                heads = list(range(hk * G, (hk + 1) * G))
                qs = np.multiply(q[b, hsl], qsmul).reshape(G * Sq, -1)  # [G·Sq, D]
                tms = [_tile_mods(p, slopes, anchor, b, h, dt, c.score)(False)
                       for h in heads]
                dkw = {} if draw is None else dict(
                    drop=draw.tiles(plan.bk * G * Sq, dt),
                    drop_rows=np.concatenate([draw.rows(b, h) for h in heads]))
                return forward_group(plan, b, heads, qs, _blasable(k[b, hk]),
                                     _blasable(v[b, hk]), out[b, hsl], rmax[b, hsl],
                                     rlog[b, hsl], None if tms[0] is None else tms, **dkw)
            return run

        self.last_stacked = _stack_reason(p, plan, cfg) is None
        if self.last_stacked:
            units = [group_unit(b, hk) for b in range(B) for hk in range(p.heads_kv)]
        else:
            units = [unit(b, h, t) for b in range(B) for h in range(Hq) for t in chunks]
        self.last_counts = {"forward": _run_units(units, nt)}
        for m in used:
            out, rmax, rlog = m.forward_finish(c, out, rmax, rlog)
        return out, rmax, rlog

    def forward_paged(self, p, q, k_pages, v_pages, mods=NO_MODS) -> Tuple[Any, RowStats]:
        """The forward over a paged cache: key tiles read through the block table
        (:mod:`anyattn.backends.numpy_paged`)."""
        dt = _compute_dtype(p.dtype)
        with np.errstate(all="ignore"):
            out, rmax, rlog, counts = numpy_paged.forward_paged(
                p, _as_np(q, dt), k_pages, v_pages, mods, dt, _run_units,
                self.config.n_threads())
        self.last_counts = {"forward": counts}
        sdt = "float64" if p.dtype == "float64" else "float32"
        kind = p.array_kind
        return _to_caller(out, p.dtype, kind), RowStats(_to_caller(rmax, sdt, kind),
                                                        _to_caller(rlog, sdt, kind))

    # ----------------------------------------------------------------- backward
    def backward(self, p, q, k, v, dout, out, stats: RowStats, bias,
                 mods=NO_MODS) -> Dict[str, Any]:
        """Gradients (see Backend.backward and :meth:`_backward_np`)."""
        with np.errstate(all="ignore"):          # NaN/Inf propagate; no warnings
            return self._backward_np(p, q, k, v, dout, out, stats, bias, mods)

    def _backward_np(self, p, q, k, v, dout, out, stats: RowStats, bias,
                     mods=NO_MODS) -> Dict[str, Any]:
        """Gradients (see Backend.backward).  Score modifiers: a softcap makes the
        kernels recompute tanh and multiply dS by 1 - tanh² before dq/dk; ALiBi's row
        term moves from the given maxima into the kernels' rebased ones (exactly:
        TwoSum, the rounding joins log_norm); dsinks [Hq] =
        -Σ_{b,i} exp((sink - max) - log_norm)·δ with the δ = <dout, out> [B, Hq, Sq]
        that the units compute anyway, reduced in float64.  Dropout: the kernels redraw
        each tile's keep mask (:class:`~anyattn.backends.numpy_tiles.DropoutDraw`), the
        dout weights carry 1/(1 - p), δ = <dout, out> of the dropped out as given."""
        cfg = self.config
        dt = _compute_dtype(p.dtype)
        q, k, v, g = (_as_np(x, dt) for x in (q, k, v, dout))
        bias = None if bias is None else saturating_cast(_as_np(bias), dt)
        out = _as_np(out, dt)
        row_max = _as_np(stats.max).astype(np.float64)
        log_norm = _as_np(stats.log_norm).astype(np.float64)
        want_q, want_k, want_v = "q" in p.wrt, "k" in p.wrt, "v" in p.wrt
        want_b, want_s = "bias" in p.wrt, "sinks" in p.wrt
        want_c = p.capture_wrt                     # score_mod captures
        need_ds = want_q or want_k or want_b or bool(want_c)
        B, Hq, Hkv, Sq, Sk, D, Dv, G = (p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_k,
                                        p.head_dim, p.head_dim_v, p.group)
        plan = self._plan(p, *cfg.tiles("bwd", p.mask), bias)
        used = _modifiers_of(p)
        c = _Call(p, mods, plan, dt)
        c.stats64 = (row_max, log_norm)            # as given: the sink's P uses these
        c.row_max, c.log_norm = row_max, log_norm
        for m in used:                             # statistics in the kernels' terms
            m.backward_stats(c)
        row_max, log_norm = c.row_max, c.log_norm
        nt = cfg.n_threads()
        chunks = _split(plan.nk, min(_n_chunks(plan.nk, B * Hkv, BWD_UNITS),  # not by nt
                                     max(2, plan.nk // 2)))
        nc = len(chunks)

        # units: base 2 where there is no bias and the maxima are moderate
        fin = np.isfinite(row_max)
        base2 = bias is None and not c.natural and (not fin.any() or
                                  float(np.max(np.abs(row_max[fin]))) * LOG2E <= BASE2_LIMIT)
        col, w, unit_max, single = backward_columns(row_max, log_norm, dt, base2)
        c.base2, c.col, c.w = base2, col, w
        c.qmul = dt.type(p.scale * LOG2E) if base2 else dt.type(p.scale)
        for m in used:                             # operands of the kernels
            m.backward_setup(c)
        slopes, anchor, draw = c.slopes, c.anchor, c.draw
        qmul, capu, floor, wfold = c.qmul, c.capu, c.floor, c.wfold
        score_tiles = c.score
        gmul = None if draw is None else dt.type(draw.scale)   # dout weights · 1/(1 - p)

        dq = np.zeros((B, Hq, Sq, D), dtype=dt) if want_q else None
        dk = np.empty((B, Hkv, Sk, D), dtype=dt) if want_k else None
        dv = np.empty((B, Hkv, Sk, Dv), dtype=dt) if want_v else None
        # per-chunk dq partials when one kv head's key tiles are split over workers
        dq_parts = ({(b, hk, c): np.zeros((G, Sq, D), dtype=dt)
                     for b in range(B) for hk in range(Hkv) for c in range(1, nc)}
                    if want_q and nc > 1 else {})

        delta_all = np.empty((B, Hq, Sq), dtype=dt) if want_s else None   # δ for dsinks
        units_keys = [(b, hk, c) for b in range(B) for hk in range(Hkv) for c in range(nc)]
        dbias_bufs = self._dbias_buffers(p, bias, units_keys, dt) if want_b else None
        # capture gradients: float64 buffers per slot (units idx, idx + n, ... in order)
        n_slots = max(len(dbias_bufs) if dbias_bufs else 1,
                      min(len(units_keys), DBIAS_SLOTS) if want_c else 1)
        dcap_slots = [{n: np.zeros(p.score_mod.arrays[n].shape) for n in sorted(want_c)}
                      for _ in range(n_slots)] if want_c else None

        def unit(idx: int, b: int, hk: int, c: int) -> Callable[[], TileCounts]:
            def run() -> TileCounts:
                hsl = slice(hk * G, (hk + 1) * G)
                heads = list(range(hk * G, (hk + 1) * G))
                o = out[b, hsl]                                        # [G, Sq, Dv]
                gg = g[b, hsl]
                q2a = np.empty((G, Sq, D + 1), dtype=dt)               # [q·scale·u | -max_u]
                np.multiply(q[b, hsl], qmul, out=q2a[..., :D])
                q2a[..., D] = col[b, hsl]
                wr = w[b, hsl]                                         # [G, Sq]
                if floor is not None:       # empty rows' -inf column gets floored: ga = 0
                    wr = np.where(np.isneginf(col[b, hsl]), dt.type(0), wr)
                delta = None
                if need_ds or want_s:
                    delta = np.einsum("gid,gid->gi", gg, o)            # [G, Sq]
                    if want_s and c == 0:
                        delta_all[b, hsl] = delta

                def weighted(wr: np.ndarray) -> np.ndarray:
                    ga = np.empty((G, Sq, Dv + 1), dtype=dt)           # w·[dout | -delta]
                    wg = wr if gmul is None else wr * gmul             # dropout: w/(1 - p)
                    np.multiply(gg, wg[..., None], out=ga[..., :Dv])
                    if need_ds:
                        np.multiply(delta, -wr, out=ga[..., Dv])
                    else:
                        ga[..., Dv] = 0
                    return ga

                ga = weighted(wr)
                gaf = None if wfold is None else weighted(wfold[b, hsl])
                snap = None
                if single[b, hsl].any():
                    snap = [snap_plan(plan, single[b, h], unit_max[b, h]) for h in heads]
                if want_q:
                    dqa = dq[b, hsl] if c == 0 else dq_parts[(b, hk, c)]
                hs = BackwardHeads(
                    heads=heads, q2a=list(q2a), q=[_blasable(q[b, h]) for h in heads],
                    ga=list(ga), dq=[dqa[i] for i in range(G)] if want_q else None,
                    base2=base2, snap=snap, cap=capu, floor=floor,
                    cols=None if capu is None and score_tiles is None else
                    [col[b, h] for h in heads],
                    qk_bound=None if floor is None else
                    _qk_bounds(q[b, hsl], k[b, hk], p.scale * (LOG2E if base2 else 1.0),
                               capu),
                    gaf=None if gaf is None else list(gaf),
                    alibi=None if slopes is None else
                    [_alibi_rows(p, slopes, anchor, b, h, LOG2E if base2 else 1.0, dt)
                     for h in heads],
                    drop=None if draw is None else draw.tiles(plan.bq * plan.bk, dt),
                    drop_rows=None if draw is None else [draw.rows(b, h) for h in heads],
                    score=score_tiles,
                    dcap=None if dcap_slots is None else dcap_slots[idx % n_slots])
                db = dbias_bufs[idx % len(dbias_bufs)] if dbias_bufs is not None else None
                return backward_keys(plan, b, hs, with_ones_column(k[b, hk], dt),
                                     with_ones_column(v[b, hk], dt),
                                     dk[b, hk] if want_k else None,
                                     dv[b, hk] if want_v else None, db, chunks[c], p.scale)
            return run

        units = [unit(i, *key) for i, key in enumerate(units_keys)]
        if n_slots > 1:
            # shared dbias parts / capture gradients: slot s runs units s, s + n, ... in
            # this order
            units = [_in_order(units[s::n_slots]) for s in range(n_slots)]
        if want_q or want_k or want_v or want_b or want_c:
            self.last_counts = {"backward": _run_units(units, nt)}
        elif want_s:                               # dsinks alone: δ is all it needs
            delta_all = np.einsum("bhid,bhid->bhi", g, out)            # [B, Hq, Sq]

        res: Dict[str, Any] = {"dq": None, "dk": None, "dv": None, "dbias": None,
                               "dsinks": None}
        if want_c:                                 # slots added in slot order
            dc = dcap_slots[0]
            for extra in dcap_slots[1:]:
                for n in dc:
                    dc[n] += extra[n]
            res["dcaptures"] = {n: _to_caller(x, str(p.score_mod.arrays[n].dtype),
                                              p.array_kind) for n, x in dc.items()}
        if want_s:
            res["dsinks"] = _to_caller(_dsinks(mods, c.stats64, delta_all),
                                       p.sinks_dtype, p.array_kind)
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
    def _dbias_buffers(p, bias, units_keys, dt) -> List[np.ndarray]:
        """dbias accumulators [Bb, Hb, Sqb, Skb]: one shared buffer when the units
        write disjoint parts of it, else min(units, DBIAS_SLOTS), unit i adding into
        buffer i % n (added in buffer order): the same for every thread count."""
        shape = p.bias_shape

        def region(b, hk, c):
            return (b if shape[0] > 1 else 0, hk if shape[1] > 1 else 0,
                    c if shape[3] > 1 else 0)

        regions = [region(*u) for u in units_keys]
        disjoint = len(set(regions)) == len(regions)
        n = 1 if disjoint else min(len(units_keys), DBIAS_SLOTS)
        return [np.zeros(shape, dtype=dt) for _ in range(n)]
