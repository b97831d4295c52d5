"""Programs: traced functions ready to run, and bound to one call's captures and sizes.

A :class:`Program` is what a trace produced (capture-independent: shapes and dtype
classes only), with its structural key and, on demand, its derivatives.  Binding it
(:meth:`Program.bind`) to arrays and the problem's sizes checks every capture index
(:func:`.bounds.check_gathers`) and gives a :class:`BoundProgram`, which the reference
evaluates densely and the NumPy backend per tile:

* :class:`ScoreTiles` applies a score function to transposed score tiles [nj, ni] and,
  in the backward, returns its derivatives and scatters capture gradients;
* :meth:`BoundProgram.keep_t` evaluates a mask function on a tile; :func:`mask_tile_parts`
  classifies every tile (any / all kept), chunked and cached by content.

On tiles, the subexpressions that read the indices through ``q_idx - kv_idx`` only
(a relative position, ALiBi's distance, a dilated mask) are evaluated once per tile
diagonal and read as Toeplitz views (:mod:`.diagonal`): the same values, computed on
``ni + nj - 1`` points instead of ``ni·nj``.
"""
from __future__ import annotations

import hashlib
import threading
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

import numpy as np

from ..arrays import array_kind, to_numpy
from .bounds import check_gathers, index_dtype
from .derive import derivatives
from .diagonal import diagonal_nodes, diagonal_values
from .evaluate import cast_captures, evaluate, use_counts
from .graph import FLOAT, Node, ordered, structural_key
from .tile_bounds import tile_intervals
from .trace import CaptureSpec, Traced

__all__ = ["Program", "BoundProgram", "ScoreTiles", "mask_tile_parts", "dense_grids"]


class Program:
    """A traced score or mask function (no capture values).

    ``kind`` 'score_mod' / 'mask_mod'; ``name`` the function's; ``out`` its output node;
    ``specs`` the captures it reads; ``key`` its structural hash (graph and capture
    shapes / dtypes: two traces of one function share it); ``uses`` the index inputs
    it reads (a mask that never reads ``h`` is classified once for all heads)."""

    def __init__(self, traced: Traced):
        self.kind, self.name, self.out = traced.kind, traced.name, traced.out
        self.bld, self.specs = traced.bld, dict(traced.specs)
        self.key = structural_key([self.out], (self.kind,) + tuple(
            (n, s.shape, s.dtype) for n, s in sorted(self.specs.items())))
        self.uses = frozenset(n.attr for n in ordered([self.out]) if n.op == "input")
        self._grads: Dict[FrozenSet[str], Tuple[Node, List[Node]]] = {}
        self._lock = threading.Lock()           # derivatives add nodes to the builder

    @property
    def where(self) -> str:
        return f"{self.kind} {self.name!r}"

    def float_captures(self) -> Tuple[str, ...]:
        return tuple(n for n, s in self.specs.items() if s.dtype == FLOAT)

    def gathers(self, names) -> List[Node]:
        """The gather nodes of the captures ``names``, in graph order."""
        return [n for n in ordered([self.out]) if n.op == "gather" and n.attr in names]

    def grad_nodes(self, wrt: FrozenSet[str]) -> Tuple[Node, List[Tuple[Node, Node]]]:
        """(d out / d score, [(gather node, d out / d gather)] for the captures ``wrt``)."""
        with self._lock:
            hit = self._grads.get(wrt)
            if hit is None:
                gs = self.gathers(wrt)
                leaves = [self.bld.input("score")] + gs
                d = derivatives(self.out, self.bld, leaves)
                hit = self._grads[wrt] = (d[leaves[0].uid], [(g, d[g.uid]) for g in gs])
            return hit

    def bind(self, arrays: Dict[str, Any], sizes: Tuple[int, int, int, int]
             ) -> "BoundProgram":
        device = {n: a for n, a in arrays.items() if array_kind(a) == "webgpu"}
        for name in device:
            if self.kind != "score_mod":
                raise NotImplementedError(
                    f"{self.where}: capture {name!r} is an anyattn.webgpu device array; a "
                    "mask function's captures are read on the host (its tiles are "
                    "classified there): pass a NumPy array (uploaded per call)")
        return BoundProgram(self, {n: to_numpy(a) for n, a in arrays.items()
                                   if n not in device}, sizes, device)


class BoundProgram:
    """A program with one call's captures (NumPy arrays) and sizes (B, Hq, Sq, Sk);
    every capture index was checked to lie in range.

    ``device``: float captures of a score function given as anyattn.webgpu device
    arrays (name -> array), read where they lie by the webgpu kernels and never by the
    host: the index analysis needs no float values, and a float capture that becomes an
    index (``trunc_int``) is unbounded there, so it is refused unless clamped.  A bound
    program with device captures has no host values: :meth:`caps` refuses it."""

    def __init__(self, program: Program, arrays: Dict[str, np.ndarray],
                 sizes: Tuple[int, int, int, int], device: Optional[Dict[str, Any]] = None):
        self.program, self.arrays, self.sizes = program, arrays, tuple(sizes)
        self.device: Dict[str, Any] = dict(device or {})
        every = dict(arrays, **self.device)
        for name, spec in program.specs.items():
            if tuple(every[name].shape) != spec.shape:  # pragma: no cover - internal
                raise ValueError(f"{program.where}: capture {name!r} changed shape")
            if name in self.device and spec.dtype != FLOAT:
                raise TypeError(f"{program.where}: device-array capture {name!r} must be a "
                                "float array; pass integer and bool captures as NumPy arrays")
        iv = check_gathers([program.out], self.sizes, every, program.specs, program.where)
        #: the integer dtype of index arithmetic (int32 where no integer node leaves it)
        self.idt = index_dtype(iv)
        self._caps: Dict[np.dtype, Dict[str, np.ndarray]] = {}
        self._digest: Optional[str] = None
        self._order = ordered([program.out])
        #: range tables of the captures (:mod:`.tile_bounds`), built when tiles are bounded
        self._ranges: Dict[Any, Any] = {}
        #: the output depends on the indices through q_idx - kv_idx only: tiles are
        #: evaluated once per diagonal (:mod:`.diagonal`)
        self._diagonal = program.out.uid in diagonal_nodes(self._order)

    def caps(self, dt: np.dtype) -> Dict[str, np.ndarray]:
        if self.device:
            raise NotImplementedError(
                f"{self.program.where}: captures {sorted(self.device)} are anyattn.webgpu "
                "device arrays, which only the webgpu backend reads; pass NumPy arrays")
        dt = np.dtype(dt)
        if dt not in self._caps:
            self._caps[dt] = cast_captures(self.arrays, self.program.specs, dt, self.idt)
        return self._caps[dt]

    def digest(self) -> str:
        """Content key of the host captures (shapes, dtypes, bytes); device-array
        captures count by name only (their buffers are the call's inputs)."""
        if self._digest is None:
            h = hashlib.blake2b(digest_size=16)
            h.update(repr(sorted(self.device)).encode())
            for name in sorted(self.arrays):
                a = np.ascontiguousarray(self.arrays[name])
                h.update(f"{name}:{a.shape}:{a.dtype.str};".encode())
                h.update(memoryview(a).cast("B") if a.size else b"")
            self._digest = h.hexdigest()
        return self._digest

    # ------------------------------------------------------------------ masks
    def keep_t(self, b: int, h: int, i0: int, i1: int, j0: int, j1: int) -> np.ndarray:
        """A mask function on a transposed tile: bool [nj, ni] (evaluated in float64,
        as the reference does)."""
        if self._diagonal:
            out = self.program.out
            return diagonal_values([out], b, h, self.caps(np.float64), np.dtype(np.float64),
                                   i0, i1, j0, j1, self._order)[out.uid]
        it = self.idt.type
        env = {"b": it(b), "h": it(h), "q_idx": np.arange(i0, i1, dtype=self.idt)[None, :],
               "kv_idx": np.arange(j0, j1, dtype=self.idt)[:, None]}
        k, = evaluate([self.program.out], env, self.caps(np.float64), np.dtype(np.float64),
                      order=self._order, idt=self.idt)
        return np.broadcast_to(k, (j1 - j0, i1 - i0))

    def keep_dense(self, i0: int, i1: int, j0: int, j1: int) -> np.ndarray:
        """A mask function on rows i0..i1-1, keys j0..j1-1 of every (b, h) it reads:
        bool [Bx, Hx, ni, nj] (Bx = B where it reads b, else 1; Hx likewise)."""
        env = dense_grids(self.sizes, self.program.uses, i0, i1, j0, j1)
        k, = evaluate([self.program.out], env, self.caps(np.float64), np.dtype(np.float64),
                      idt=self.idt)
        B, H = _bh(self.sizes, self.program.uses)
        return np.broadcast_to(k, (B, H, i1 - i0, j1 - j0))

    # ------------------------------------------------------------- dense score
    def score_dense(self, s: np.ndarray, wrt: FrozenSet[str] = frozenset(),
                    grads: bool = False):
        """The score function on dense float64 scores s [B, Hq, Sq, Sk] -> s' (and, with
        ``grads``, d s'/d s and [(capture, index arrays, d s'/d gather)])."""
        B, H, Sq, Sk = s.shape
        env = dense_grids((B, H, Sq, Sk), frozenset({"b", "h"}), 0, Sq, 0, Sk)
        env["score"] = s
        dt = np.dtype(np.float64)
        if not grads:
            return np.broadcast_to(evaluate([self.program.out], env, self.caps(dt), dt,
                                            idt=self.idt)[0], s.shape)
        dsc, gl = self.program.grad_nodes(frozenset(wrt))
        outs = [self.program.out, dsc] + [d for _, d in gl]
        memo: Dict[int, Any] = {}
        vals = evaluate(outs, env, self.caps(dt), dt, memo, idt=self.idt)
        gathers = [(g.attr, [memo[a.uid] for a in g.args], vals[2 + i])
                   for i, (g, _) in enumerate(gl)]
        return np.broadcast_to(vals[0], s.shape), vals[1], gathers


def _bh(sizes, uses) -> Tuple[int, int]:
    B, H = sizes[0], sizes[1]
    return (B if "b" in uses else 1), (H if "h" in uses else 1)


def dense_grids(sizes, uses, i0, i1, j0, j1) -> Dict[str, np.ndarray]:
    """Index grids [Bx, Hx, ni, nj] (broadcast shapes) of rows i0..i1-1, keys j0..j1-1."""
    B, H = _bh(sizes, uses)
    return {"b": np.arange(B, dtype=np.int64)[:, None, None, None],
            "h": np.arange(H, dtype=np.int64)[None, :, None, None],
            "q_idx": np.arange(i0, i1, dtype=np.int64)[None, None, :, None],
            "kv_idx": np.arange(j0, j1, dtype=np.int64)[None, None, None, :]}


def scatter_add(dst: np.ndarray, idx: Sequence[np.ndarray], vals: np.ndarray) -> None:
    """dst (float64, a capture's shape) += vals summed at the indices ``idx`` (one
    array per axis, broadcast with vals): np.bincount over the span of flat indices the
    tile reaches, a fixed sequential order; where every index is a scalar, one float64
    sum of vals (NumPy's pairwise order, fixed by the tile's shape)."""
    vals = np.asarray(vals)
    if dst.ndim == 0:
        dst[()] += float(np.sum(vals, dtype=np.float64))
        return
    shape = np.broadcast_shapes(vals.shape, *(np.shape(i) for i in idx))
    if 0 in shape:
        return
    arrays = [ax for ax, i in enumerate(idx) if np.ndim(i) > 0]
    if not arrays:                    # one element of dst (a capture read at b, h)
        dst[tuple(int(i) for i in idx)] += float(np.sum(np.broadcast_to(vals, shape),
                                                        dtype=np.float64))
        return
    if len(arrays) == 1:              # the other axes fixed: a 1-D view of dst
        ax = arrays[0]
        out = dst[tuple(slice(None) if a == ax else int(i) for a, i in enumerate(idx))]
        flat = np.broadcast_to(idx[ax], shape).reshape(-1)
    else:
        out = dst.reshape(-1)
        flat = np.ravel_multi_index(tuple(np.broadcast_to(i, shape) for i in idx),
                                    dst.shape).reshape(-1)
    lo, hi = int(flat.min()), int(flat.max())
    if lo:
        flat = flat - lo
    out[lo:hi + 1] += np.bincount(flat, weights=np.broadcast_to(vals, shape).reshape(-1),
                                  minlength=hi - lo + 1)


class ScoreTiles:
    """A score function on transposed score tiles st [nj, ni] (queries i0..i1-1 along
    axis 1, keys j0..j1-1 along axis 0) of one call, in the compute dtype ``dt``;
    shared read-only by the workers.  ``wrt``: the captures whose gradients the
    backward wants (None: a forward)."""

    def __init__(self, bound: BoundProgram, dt: np.dtype,
                 wrt: Optional[FrozenSet[str]] = None):
        self.bound, self.dt = bound, np.dtype(dt)
        self.prog = bound.program
        self.caps = bound.caps(self.dt)
        self.idt = bound.idt
        self.out = self.prog.out
        self.wrt = wrt
        self.diag, self.order = self._split([self.out], ())
        self.diag_order = ordered(self.diag)
        self.uses = use_counts(self.order)
        if wrt is not None:
            self.dscore, self.dgathers = self.prog.grad_nodes(frozenset(wrt))
            self.unit_dscore = self.dscore.op == "const" and self.dscore.attr == 1.0
            self.outs = [self.out, self.dscore] + [d for _, d in self.dgathers]
            self.grad_diag, self.grad_order = self._split(
                self.outs, [a for g, _ in self.dgathers for a in g.args])
            self.grad_diag_order = ordered(self.grad_diag)
            self.grad_uses = use_counts(self.grad_order)

    @staticmethod
    def _split(outs, read_back) -> Tuple[List[Node], List[Node]]:
        """(the diagonal nodes (:mod:`.diagonal`) the tile evaluation takes as Toeplitz
        views: those a non-diagonal node, an output or a read-back gather index reads;
        the nodes left to evaluate per pair, arguments first)."""
        order = ordered(outs)
        diag = diagonal_nodes(order)
        views = {u for n in order if n.uid not in diag for a in n.args
                 if (u := a.uid) in diag}
        views |= {n.uid for n in list(outs) + list(read_back) if n.uid in diag}
        need, stack = set(), list(outs) + list(read_back)
        while stack:                          # what the pairs need, views as leaves
            n = stack.pop()
            if n.uid in need:
                continue
            need.add(n.uid)
            if n.uid not in views:
                stack.extend(n.args)
        return ([n for n in order if n.uid in views],
                [n for n in order if n.uid in need])

    def _memo(self, nodes, order, b, h, i0, i1, j0, j1) -> Dict[int, Any]:
        """Toeplitz views of the diagonal ``nodes`` on this tile (:mod:`.diagonal`)."""
        if not nodes:
            return {}
        return diagonal_values(nodes, b, h, self.caps, self.dt, i0, i1, j0, j1, order)

    def _env(self, st, b, h, i0, i1, j0, j1):
        it = self.idt.type
        return {"score": st, "b": it(b), "h": it(h),
                "q_idx": np.arange(i0, i1, dtype=self.idt)[None, :],
                "kv_idx": np.arange(j0, j1, dtype=self.idt)[:, None]}

    def apply_t(self, st: np.ndarray, b: int, h: int, i0: int, i1: int, j0: int,
                j1: int) -> None:
        """st = score_mod(st) in place."""
        memo = self._memo(self.diag, self.diag_order, b, h, i0, i1, j0, j1)
        r, = evaluate([self.out], self._env(st, b, h, i0, i1, j0, j1), self.caps, self.dt,
                      memo, order=self.order, uses=self.uses, reuse=("score",), idt=self.idt)
        if r is not st:
            np.copyto(st, r)

    def apply_grad_t(self, st: np.ndarray, b: int, h: int, i0: int, i1: int, j0: int,
                     j1: int):
        """s' = score_mod(st) -> (s', d s'/d s or None where it is 1,
        [(capture, index arrays, d s'/d gather)]), arrays broadcastable to st.  s' is st
        itself, overwritten, unless a derivative is the score (d(s·t)/dt = s): then st
        keeps the score and s' is a new array of st's shape, dtype and layout."""
        memo = self._memo(self.grad_diag, self.grad_diag_order, b, h, i0, i1, j0, j1)
        vals = evaluate(self.outs, self._env(st, b, h, i0, i1, j0, j1), self.caps, self.dt,
                        memo, order=self.grad_order, uses=self.grad_uses, reuse=("score",),
                        idt=self.idt)
        out = vals[0]
        if (any(v is st for v in vals[1:]) and isinstance(out, np.ndarray)
                and out is not st and out.shape == st.shape and out.dtype == st.dtype
                and out.flags.c_contiguous and out.flags.writeable
                and not any(v is out for v in vals[1:])):
            new = out                                   # st stays the score
        else:
            vals = [v.copy() if v is st else v for v in vals]
            np.copyto(st, out)
            new = st
        gath = [(g.attr, [memo[a.uid] for a in g.args], vals[2 + i])
                for i, (g, _) in enumerate(self.dgathers)]
        dsc = None if self.unit_dscore else vals[1]
        return new, dsc, gath


def mask_tile_parts(bound: BoundProgram, bq: int, bk: int,
                    band: Optional[Tuple[Optional[int], Optional[int]]] = None,
                    chunk: int = 1 << 20, split: int = 8) -> Tuple[np.ndarray, np.ndarray]:
    """A mask function per tile: (any kept, all kept), bool [Bx, Hx, nQ, nK], exact.

    ``band``: ``(lo, hi)`` of the mask's band term (``lo <= kv_idx - q_idx <= hi``, None
    = open) or None; the pairs classified are then those the function and the band both
    keep (the band's empty tiles cost nothing, its partial ones count exactly).

    First the interval of the function over each whole tile (:mod:`.tile_bounds`, every
    tile of every (b, h) it reads at once) decides the tiles kept entirely or not at all.
    Each undecided tile is cut into ``split`` x ``split`` boxes and bounded again: a tile
    with a box kept entirely and one dropped entirely is partial; in the others only the
    undecided boxes are evaluated pair by pair, about ``chunk`` pairs per vectorised
    evaluation.  Work O(Bx·Hx·nQ·nK) plus the undecided boxes' pairs; memory O(chunk)
    beyond the maps (tiles are refined ``chunk / (16·split²)`` at a time)."""
    B, H, Sq, Sk = bound.sizes
    Bx, Hx = _bh(bound.sizes, bound.program.uses)
    nq, nk = -(-Sq // bq), -(-Sk // bk)
    shape = (Bx, Hx, nq, nk)
    if 0 in shape:
        return np.zeros(shape, bool), np.zeros(shape, bool)
    caps = bound.caps(np.float64)
    f = np.float64
    q0 = np.arange(nq, dtype=f) * bq
    k0 = np.arange(nk, dtype=f) * bk
    lo, hi = _box_bounds(bound, caps, band, np.arange(Bx, dtype=f)[:, None, None, None],
                         np.arange(Hx, dtype=f)[None, :, None, None],
                         (q0[None, None, :, None],
                          np.minimum(q0 + bq, Sq)[None, None, :, None] - 1),
                         (k0[None, None, None, :],
                          np.minimum(k0 + bk, Sk)[None, None, None, :] - 1))
    lo, hi = np.broadcast_to(lo, shape), np.broadcast_to(hi, shape)
    all_k = lo == 1
    any_k = hi == 1
    todo = np.nonzero(any_k & ~all_k)                           # undecided tiles
    per = max(1, chunk // (split * split * 16))                 # tiles per refinement
    for s0 in range(0, todo[0].size, per):
        part = tuple(t[s0:s0 + per] for t in todo)
        any_k[part], all_k[part] = _refine(bound, caps, band, part, bq, bk, chunk, split)
    return any_k, all_k


def _box_bounds(bound: BoundProgram, caps, band, b, h, q, k):
    """(lo, hi) of the mask (and the band) over boxes: ``b``, ``h`` single values,
    ``q``, ``k`` (first, last) index arrays, all broadcastable."""
    lo, hi = tile_intervals(bound.program.out, bound._order, caps, bound.program.specs,
                            {"b": (b, b), "h": (h, h), "q_idx": q, "kv_idx": k},
                            bound._ranges)
    if band is not None:
        dmin, dmax = k[0] - q[1], k[1] - q[0]                   # kv_idx - q_idx on the box
        blo = -np.inf if band[0] is None else band[0]
        bhi = np.inf if band[1] is None else band[1]
        lo = np.minimum(lo, np.where((dmin >= blo) & (dmax <= bhi), 1.0, 0.0))
        hi = np.minimum(hi, np.where((dmax < blo) | (dmin > bhi), 0.0, 1.0))
    return lo, hi


def _keep_at(bound: BoundProgram, caps, band, b, h, qi, ki) -> np.ndarray:
    """The mask (and the band) at index arrays (broadcastable) -> bool array."""
    keep, = evaluate([bound.program.out], {"b": b, "h": h, "q_idx": qi, "kv_idx": ki}, caps,
                     np.dtype(np.float64), order=bound._order, idt=bound.idt)
    if band is not None:
        d = ki - qi
        if band[0] is not None:
            keep = keep & (d >= band[0])
        if band[1] is not None:
            keep = keep & (d <= band[1])
    return np.broadcast_to(keep, np.broadcast_shapes(np.shape(keep), qi.shape, ki.shape))


def _refine(bound: BoundProgram, caps, band, todo, bq: int, bk: int, chunk: int,
            split: int):
    """(any kept, all kept) of the tiles ``todo`` (arrays b, h, query tile, key tile).

    Each tile's boxes are bounded; a tile with a box kept entirely and one dropped
    entirely is partial.  For the others, five pairs of every undecided box (its corners
    and centre) are evaluated: a kept pair and a dropped one (from a box or a pair)
    decide the tile partial too.  Only the undecided boxes of tiles still undecided are
    evaluated pair by pair.  Boxes that would reach past a ragged tile's end repeat its
    last row / key (the same pairs again: any and all unchanged)."""
    _, _, Sq, Sk = bound.sizes
    f = np.float64
    n = todo[0].size
    tb, th, tq, tk = (t.astype(f) for t in todo)
    sq, sk = -(-bq // split), -(-bk // split)                  # box sizes
    nsq, nsk = -(-bq // sq), -(-bk // sk)                      # boxes per tile side
    qe = np.minimum((tq + 1) * bq, Sq)[:, None, None] - 1      # last row of the tile
    ke = np.minimum((tk + 1) * bk, Sk)[:, None, None] - 1
    qs = tq[:, None, None] * bq + np.arange(nsq, dtype=f)[None, :, None] * sq
    ks = tk[:, None, None] * bk + np.arange(nsk, dtype=f)[None, None, :] * sk
    q = (np.minimum(qs, qe), np.minimum(qs + sq - 1, qe))
    k = (np.minimum(ks, ke), np.minimum(ks + sk - 1, ke))
    lo, hi = _box_bounds(bound, caps, band, tb[:, None, None], th[:, None, None], q, k)
    shape = (n, nsq, nsk)
    lo, hi = np.broadcast_to(lo, shape), np.broadcast_to(hi, shape)
    some = (lo == 1).any(axis=(1, 2))                           # a box kept entirely
    not_all = (hi == 0).any(axis=(1, 2))                        # a box dropped entirely
    t, a, c = np.nonzero((lo != hi) & ~(some & not_all)[:, None, None])
    if not t.size:
        return some, ~not_all
    idt = bound.idt
    bi, hb = tb[t].astype(idt)[:, None], th[t].astype(idt)[:, None]
    q_lo, q_hi = (np.broadcast_to(x, shape)[t, a, c].astype(idt)[:, None] for x in q)
    k_lo, k_hi = (np.broadcast_to(x, shape)[t, a, c].astype(idt)[:, None] for x in k)
    # corners and centre of every undecided box: [N, 5]
    qm, km = (q_lo + q_hi) // 2, (k_lo + k_hi) // 2
    qi = np.concatenate([q_lo, q_lo, q_hi, q_hi, qm], axis=1)
    ki = np.concatenate([k_lo, k_hi, k_lo, k_hi, km], axis=1)
    keep = _keep_at(bound, caps, band, bi, hb, qi, ki)
    some = some | (np.bincount(t, weights=keep.any(axis=1), minlength=n) > 0)
    not_all = not_all | (np.bincount(t, weights=~keep.all(axis=1), minlength=n) > 0)
    rest = np.nonzero(~(some & not_all)[t])[0]                  # boxes still to evaluate
    if not rest.size:
        return some, ~not_all
    t = t[rest]
    bi, hb, q_lo, q_hi, k_lo, k_hi = (x[rest, :, None] for x in (bi, hb, q_lo, q_hi,
                                                                  k_lo, k_hi))
    box_any = np.empty(t.size, bool)
    box_all = np.empty(t.size, bool)
    per = max(1, chunk // (sq * sk))
    rq = np.arange(sq, dtype=idt)[None, :, None]
    rk = np.arange(sk, dtype=idt)[None, None, :]
    for s0 in range(0, t.size, per):
        s1 = min(t.size, s0 + per)
        keep = _keep_at(bound, caps, band, bi[s0:s1], hb[s0:s1],
                        np.minimum(q_lo[s0:s1] + rq, q_hi[s0:s1]),
                        np.minimum(k_lo[s0:s1] + rk, k_hi[s0:s1]))
        box_any[s0:s1] = keep.any(axis=(1, 2))
        box_all[s0:s1] = keep.all(axis=(1, 2))
    some = some | (np.bincount(t, weights=box_any, minlength=n) > 0)
    not_all = not_all | (np.bincount(t, weights=~box_all, minlength=n) > 0)
    return some, ~not_all
