"""Paged key/value caches as an input form of :func:`anyattn.attention`.

Shape legend: B batch, Hq/Hkv query/key-value heads, Sq queries, D head dim of q and k,
Dv head dim of v, N the number of cache blocks (pages), P positions per page, M pages
per sequence in the block table.

A decoding runtime keeps its keys and values in fixed-size pages and a table per
sequence naming its pages in order.  ``attention(q, k_pages, v_pages, pages=Pages(
block_table, seqlens))`` attends over such a cache in place:

- ``k_pages`` [N, Hkv, P, D] and ``v_pages`` [N, Hkv, P, Dv] with ``layout="bhsd"``
  (a page is a small [H, S, D] block, the core's layout: each head's rows of a page are
  contiguous); with ``layout="bshd"`` they are [N, P, Hkv, D] / [N, P, Hkv, Dv]
  (FlashAttention's and vLLM's page layout), as q is [B, Sq, Hq, D] then.
- ``block_table`` [B, M] integers: the pages of sequence b in order; logical position t
  of sequence b is row ``t % P`` of page ``block_table[b, t // P]``.
- ``seqlens`` [B] integers: sequence b's keys end before position ``seqlens[b]``.
- ``starts`` [B] integers (optional, 0 by default): sequence b's keys start at position
  ``starts[b]`` (FlashAttention's ``cache_leftpad``: a left-padded cache whose first
  ``starts[b]`` positions hold no key).

Sequence b's keys are the positions [starts[b], seqlens[b]) of its pages, and each
sequence is then exactly the dense problem with ``k``/``v`` = those keys (Sk =
seqlens[b] − starts[b] for that sequence; key index j is position starts[b] + j):
``Causal(align="bottom_right")`` puts the queries at the end of each sequence's keys
(decoding: query i sees keys j <= i + Sk − Sq, whatever the start), ``Causal()`` with
``q_offset`` places them explicitly against key indices counted from the start, and
Window, ALiBi (positions ``i + Sk − Sq`` and j per sequence), softcap, sinks and GQA
compose as in the dense call.  This is FlashAttention's ``cache_leftpad`` semantic:
its reference shifts every key column by the left padding and aligns causal masks,
windows and ALiBi to the bottom right of the keys that remain.  A sequence with no keys
gets out = 0 and lse = -inf (the sink with ``sinks``).

Checked before any work: ``block_table``, ``seqlens`` and ``starts`` shapes and integer
dtypes, ``0 <= starts[b] <= seqlens[b] <= M·P``, every table entry in use (those
covering a sequence's positions [starts[b], seqlens[b])) in ``[0, N)`` (entries before
or past them are never read and may hold anything, e.g. -1), and a page size of at
least 1.  Not supported with pages (``NotImplementedError``): mask terms other than
Causal / Window, ``bias``, ``dropout_p > 0``, ``score_mod``, and the backward.  The
tables are read to the host once, when the :class:`Pages` is made (a GPU tensor is
copied then): one ``Pages`` serves every layer of a decoding step.

``Pages(..., on_device=True)`` keeps the tables where they are instead (torch tensors on
q's device): nothing is read to the host, so a CUDA call makes no synchronisation and a
CUDA graph can capture it, replaying with whatever the tensors hold then.  The problem is
then sized from the shapes alone: ``seq_k`` is the capacity M·P, and the Triton backend
sizes its grid from it, each sequence's programs covering only its own keys.  Shapes,
dtypes and devices are checked as always; the value checks above run only with
``ANYATTN_CHECK_DEVICE_INPUTS=1`` (a read to the host per call, anyattn.settings), and an
unchecked out-of-range value is undefined behaviour.  The band of every sequence must
follow its key count with slope 0 or 1 on each side (Causal / Window terms of one
alignment, or of top-left alignment on one side and bottom-right on the other; a side
mixing both raises NotImplementedError).  Only the Triton backend reads such tables on
the device; the others (NumPy, reference) read them to the host at the call.
"""
from __future__ import annotations

import dataclasses
import threading
from dataclasses import dataclass
from typing import Any, Tuple

import numpy as np

from . import settings
from .arrays import array_kind, device_name, dtype_name
from .masks import resolve
from .problem import check_array, check_like_q, describe

__all__ = ["Pages", "PagedKV", "describe_paged", "sequence_mask", "sequence_band",
           "gather_sequence"]


def _host_ints(name: str, x: Any, ndim: int, legend: str) -> np.ndarray:
    """An integer NumPy array or torch tensor of ``ndim`` dims -> int64 NumPy (host)."""
    kind = array_kind(x)
    if kind is None:
        raise TypeError(f"{name}: expected an integer NumPy array or torch tensor {legend}, "
                        f"got {type(x).__name__}; convert it with np.asarray(..., np.int32)")
    dt = dtype_name(x)
    if not (dt.startswith("int") or dt.startswith("uint")):
        raise TypeError(f"{name}: dtype {dt} is not an integer type; expected int32 (or "
                        f"int64) {legend}")
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dim{'s' if ndim > 1 else ''} {legend}, got "
                         f"shape {tuple(x.shape)}")
    if kind == "torch":
        return x.detach().cpu().numpy().astype(np.int64)
    return np.asarray(x).astype(np.int64)


def _device_ints(name: str, x: Any, ndim: int, legend: str):
    """An integer torch tensor of ``ndim`` dims, left where it is (Pages(on_device=True));
    only its type, dtype and shape are read."""
    if array_kind(x) != "torch":
        raise TypeError(f"{name}: Pages(on_device=True) takes torch tensors {legend} on q's "
                        f"device, got {type(x).__name__}; pass on_device=False for NumPy "
                        "arrays")
    dt = dtype_name(x)
    if not (dt.startswith("int") or dt.startswith("uint")):
        raise TypeError(f"{name}: dtype {dt} is not an integer type; expected int32 (or "
                        f"int64) {legend}")
    if x.ndim != ndim:
        raise ValueError(f"{name}: expected {ndim} dim{'s' if ndim > 1 else ''} {legend}, got "
                         f"shape {tuple(x.shape)}")
    return x


@dataclass(frozen=True, eq=False)
class Pages:
    """The page table of a paged key/value cache (see :mod:`anyattn.paged`).

    ``block_table`` [B, M] int32/int64 (NumPy or torch): the pages of sequence b in order;
    ``seqlens`` [B] int32/int64: where sequence b's keys end (position ``seqlens[b]`` is
    past them); ``starts`` [B] int32/int64 or None (all 0): where they begin
    (FlashAttention's ``cache_leftpad``), ``0 <= starts[b] <= seqlens[b]``.  All are read
    to the host once, here; ``table``, ``lengths`` and ``firsts`` hold those int64
    copies and ``counts`` the key count per sequence, ``lengths - firsts``.

    ``on_device=True``: torch tensors on q's device, never read to the host by the Triton
    backend (module doc); their values are checked here only with
    ``ANYATTN_CHECK_DEVICE_INPUTS=1``, and ``table`` / ``lengths`` / ``firsts`` /
    ``counts`` are then read to the host where they are first used (a backend other
    than Triton, or the checks).
    """

    block_table: Any
    seqlens: Any
    starts: Any = None
    on_device: bool = dataclasses.field(default=False, kw_only=True)
    #: what a backend derives from these tables once and keeps as long as this Pages
    #: lives (the Triton backend: its device buffer of records and table per band set;
    #: the webgpu backend: the launch templates of device-array calls, with their tables)
    device_cache: dict = dataclasses.field(init=False, repr=False, default_factory=dict)
    _host: dict = dataclasses.field(init=False, repr=False, default_factory=dict)
    _lock: Any = dataclasses.field(init=False, repr=False, default_factory=threading.Lock)

    def __post_init__(self):
        if not isinstance(self.on_device, bool):
            raise TypeError(f"on_device: expected a bool, got {type(self.on_device).__name__}")
        if not self.on_device:
            self._read()
            return
        table = _device_ints("block_table", self.block_table, 2, "[B, max_blocks]")
        lengths = _device_ints("seqlens", self.seqlens, 1, "[B]")
        if lengths.shape[0] != table.shape[0]:
            raise ValueError(f"seqlens: shape {tuple(lengths.shape)} does not match "
                             f"block_table's {table.shape[0]} rows; expected [B] = "
                             f"[{table.shape[0]}]")
        named = [("seqlens", lengths)]
        if self.starts is not None:
            firsts = _device_ints("starts", self.starts, 1, "[B]")
            if tuple(firsts.shape) != tuple(lengths.shape):
                raise ValueError(f"starts: shape {tuple(firsts.shape)} does not match "
                                 f"seqlens' {tuple(lengths.shape)}; expected [B] = "
                                 f"[{lengths.shape[0]}]")
            named.append(("starts", firsts))
        for name, x in named:
            if x.device != table.device:
                raise ValueError(f"{name}: is on {x.device} but block_table is on "
                                 f"{table.device}; with on_device=True the tables share "
                                 "q's device")
        if settings.current().check_device_inputs:
            self._read()

    def _read(self) -> None:
        """Read the tables to the host (int64) and check their values."""
        table = _host_ints("block_table", self.block_table, 2, "[B, max_blocks]")
        lengths = _host_ints("seqlens", self.seqlens, 1, "[B]")
        if lengths.shape[0] != table.shape[0]:
            raise ValueError(f"seqlens: shape {tuple(self.seqlens.shape)} does not match "
                             f"block_table's {table.shape[0]} rows; expected [B] = "
                             f"[{table.shape[0]}]")
        if lengths.size and lengths.min() < 0:
            b = int(np.argmax(lengths < 0))
            raise ValueError(f"seqlens: entry {b} is {int(lengths[b])}; expected a key count "
                             ">= 0")
        if self.starts is None:
            firsts = np.zeros_like(lengths)
        else:
            firsts = _host_ints("starts", self.starts, 1, "[B]")
            if firsts.shape != lengths.shape:
                raise ValueError(f"starts: shape {tuple(self.starts.shape)} does not match "
                                 f"seqlens' {tuple(lengths.shape)}; expected [B] = "
                                 f"[{lengths.shape[0]}]")
            bad = (firsts < 0) | (firsts > lengths)
            if bad.any():
                b = int(np.argmax(bad))
                raise ValueError(f"starts: entry {b} is {int(firsts[b])}, outside [0, "
                                 f"seqlens[{b}] = {int(lengths[b])}]; a sequence's keys "
                                 "start at or before their end")
        self._host.update(table=table, lengths=lengths, firsts=firsts,
                          counts=lengths - firsts)

    def _host_array(self, name: str) -> np.ndarray:
        if not self._host:
            with self._lock:            # a backend's worker threads may ask at once
                if not self._host:
                    self._read()
        return self._host[name]

    @property
    def table(self) -> np.ndarray:
        """block_table as int64 NumPy [B, M] (on_device: read at first use)."""
        return self._host_array("table")

    @property
    def lengths(self) -> np.ndarray:
        """seqlens as int64 NumPy [B] (on_device: read at first use)."""
        return self._host_array("lengths")

    @property
    def firsts(self) -> np.ndarray:
        """starts as int64 NumPy [B], zeros without starts (on_device: read at first use)."""
        return self._host_array("firsts")

    @property
    def counts(self) -> np.ndarray:
        """Keys per sequence, lengths - firsts (on_device: read at first use)."""
        return self._host_array("counts")

    @property
    def batch(self) -> int:
        return int(self.block_table.shape[0])

    @property
    def width(self) -> int:
        """M: the block table's pages per sequence."""
        return int(self.block_table.shape[1])


@dataclass(frozen=True, eq=False)
class PagedKV:
    """A validated paged cache as :class:`~anyattn.problem.Problem` holds it
    (``Problem.pages``): its :class:`Pages`, the page geometry and the mask as given
    (each sequence resolves it for its own key count, :func:`sequence_mask`).  ``table``,
    ``lengths``, ``firsts`` and ``counts`` are the Pages' host tables (read at first use
    where the Pages is ``on_device``)."""

    source: Pages
    page_size: int           # P
    num_blocks: int          # N
    mask: Any                # the caller's Mask (Causal / Window terms) or None

    @property
    def on_device(self) -> bool:
        """Whether the tables stay on the device (``Pages(on_device=True)``)."""
        return self.source.on_device

    @property
    def table(self) -> np.ndarray:          # [B, M] int64
        return self.source.table

    @property
    def lengths(self) -> np.ndarray:        # [B] int64: where each sequence's keys end
        return self.source.lengths

    @property
    def firsts(self) -> np.ndarray:         # [B] int64: where they start (Pages.firsts)
        return self.source.firsts

    @property
    def counts(self) -> np.ndarray:         # [B] int64: keys per sequence
        return self.source.counts

    @property
    def device_cache(self) -> dict:
        """The Pages' own (Pages.device_cache): per-Pages buffers of the backends."""
        return self.source.device_cache

    @property
    def has_starts(self) -> bool:
        """Whether some sequence's keys start past position 0 (``Pages(starts=)``); for
        tables on the device, whether ``starts`` was given."""
        if self.on_device:
            return self.source.starts is not None
        return bool(self.firsts.any())

    def pages_of(self, b: int) -> np.ndarray:
        """The block ids sequence b reads, in order: those holding its positions
        [starts[b], seqlens[b]) (none for a sequence of no keys)."""
        if int(self.counts[b]) == 0:
            return self.table[b, :0]
        P = self.page_size
        return self.table[b, int(self.firsts[b]) // P:-(-int(self.lengths[b]) // P)]


def sequence_mask(p, b: int):
    """The band (lo, hi) of sequence b: key j (its key index, position starts[b] + j) is
    kept for query i iff ``lo <= j - i <= hi`` (None: open), its mask resolved for
    Sk = seqlens[b] - starts[b]."""
    pk = p.pages
    return _band_at(p, int(pk.counts[b]))


def _band_at(p, sk: int):
    rm = resolve(p.pages.mask, 1, p.heads_q, p.seq_q, sk, p.q_offset, p.k_offset)
    return rm.band_lo, rm.band_hi


def sequence_band(p):
    """Every sequence's band as a function of its key count n, without the counts:
    ((lo0, lo_slope), (hi0, hi_slope)) with lo = lo0 + lo_slope * n (likewise hi), each
    slope 0 (top-left aligned terms) or 1 (bottom-right), a side None where it is open.
    What :func:`sequence_mask` gives for every n in [0, seq_k] (``Pages(on_device=True)``:
    the counts stay on the device).  A side whose terms mix both alignments (a max or
    min of both slopes) raises NotImplementedError."""
    cap = max(int(p.seq_k), 2)
    at = [_band_at(p, n) for n in (0, 1, cap)]
    sides = []
    for side, name in ((0, "lower"), (1, "upper")):
        v0, v1, vc = (a[side] for a in at)
        if v0 is None:
            sides.append(None)
            continue
        slope = v1 - v0
        if slope not in (0, 1) or vc != v0 + slope * cap:
            raise NotImplementedError(
                f"mask: its {name} band side mixes top-left and bottom-right aligned terms; "
                "with Pages(on_device=True) each side follows the key count with one "
                "alignment (read the tables to the host: Pages(on_device=False))")
        sides.append((int(v0), int(slope)))
    return tuple(sides)


def gather_sequence(x, pk: PagedKV, b: int):
    """Pages [N, Hkv, P, Dx] -> sequence b's keys [1, Hkv, seqlens[b] - starts[b], Dx]
    (a copy; the float64 reference's view of the cache)."""
    ids = pk.pages_of(b)
    n, P = len(ids), pk.page_size
    lo = int(pk.firsts[b]) % P if n else 0
    L = lo + int(pk.counts[b])
    if array_kind(x) == "torch":
        import torch

        g = x[torch.from_numpy(ids).to(x.device)]                     # [n, Hkv, P, Dx]
        return g.permute(1, 0, 2, 3).reshape(1, x.shape[1], n * P,
                                             x.shape[3])[:, :, lo:L]
    g = x[ids]                                                        # [n, Hkv, P, Dx]
    return g.transpose(1, 0, 2, 3).reshape(1, x.shape[1], n * P, x.shape[3])[:, :, lo:L]


def _stand_in(x, shape: Tuple[int, ...]):
    """A broadcast (zero-stride) array of ``shape`` with x's library, dtype and device:
    what the dense validation reads of the logical k / v (no data)."""
    kind = array_kind(x)
    if kind == "torch":
        import torch

        return torch.zeros((), dtype=x.dtype, device=x.device).expand(shape)
    if kind == "webgpu":            # a zero-stride view of the pages' buffer
        return type(x).root(x.buffer, tuple(shape), x.dtype, (0,) * len(shape), x.offset,
                            x.device)
    return np.broadcast_to(np.zeros((), dtype=x.dtype), shape)


def describe_paged(q, k_pages, v_pages, pages, *, mask=None, bias=None, scale=None,
                   precision=None, q_offset=0, k_offset=0, softcap=None,
                   alibi_slopes=None, sinks=None, dropout_p=0.0, dropout_seed=None,
                   score_mod=None):
    """Validate a paged call (q [B, Hq, Sq, D], pages [N, Hkv, P, D/Dv]) -> Problem with
    ``pages`` set and ``seq_k`` = max(seqlens - starts) (``Pages(on_device=True)``: the
    capacity M·P, and the value checks only under ANYATTN_CHECK_DEVICE_INPUTS=1).  Every
    check runs before any work."""

    if not isinstance(pages, Pages):
        raise TypeError(f"pages: expected anyattn.Pages(block_table, seqlens, starts), got "
                        f"{type(pages).__name__}")
    for name, val, why in (("bias", bias is not None, "an additive bias"),
                           ("dropout_p", dropout_p not in (0, 0.0), "dropout"),
                           ("score_mod", score_mod is not None, "a score function")):
        if val:
            raise NotImplementedError(f"{name}: {why} is not supported with a paged cache "
                                      "(pages=); gather the pages into k/v [B, Hkv, Sk, D] "
                                      "and call attention without pages")
    kind = check_array("q", q, None)
    check_array("k_pages", k_pages, kind)
    check_array("v_pages", v_pages, kind)
    if kind not in ("numpy", "torch", "webgpu"):
        raise NotImplementedError(f"pages: the caches are {kind} arrays; no backend reads "
                                  f"paged key/value caches of {kind} arrays yet (NumPy "
                                  "arrays, torch tensors and anyattn.webgpu device arrays "
                                  "are read); gather the pages into k/v [B, Hkv, Sk, D] and "
                                  "call attention without pages")
    dt, dev = dtype_name(q), device_name(q)
    check_like_q("k_pages", k_pages, dt, dev)
    check_like_q("v_pages", v_pages, dt, dev)
    N, Hkv, P, D = (int(s) for s in k_pages.shape)
    if tuple(int(s) for s in v_pages.shape[:3]) != (N, Hkv, P):
        raise ValueError(f"v_pages: shape {tuple(v_pages.shape)} does not match k_pages' "
                         f"{tuple(k_pages.shape)} in [num_blocks, Hkv, page_size]; expected "
                         f"v_pages [{N}, {Hkv}, {P}, Dv] (bhsd; bshd: [N, P, Hkv, Dv])")
    if P < 1:
        raise ValueError(f"k_pages: page_size is {P} (k_pages {tuple(k_pages.shape)}); "
                         "expected pages of at least 1 position")
    B = int(q.shape[0])
    if pages.batch != B:
        raise ValueError(f"pages: block_table has {pages.batch} rows but q has batch "
                         f"{B}; expected block_table [B, max_blocks] = [{B}, M]")
    cap = pages.width * P
    if pages.on_device:
        if kind != "torch":
            raise NotImplementedError(f"pages: Pages(on_device=True) is read by the Triton "
                                      f"backend on torch tensors, but the caches are {kind} "
                                      "arrays; pass on_device=False")
        if pages.block_table.device != q.device:
            raise ValueError(f"pages: the tables are on {pages.block_table.device} but q is "
                             f"on {q.device}; with on_device=True they share q's device")
    if not pages.on_device or settings.current().check_device_inputs:
        _check_values(pages, N, P, cap)
    # tables on the device: sized from the shapes alone (no sequence holds more than the
    # capacity), so nothing depends on the values
    smax = cap if pages.on_device else (int(pages.counts.max()) if B else 0)
    p = describe(q, _stand_in(k_pages, (B, Hkv, smax, D)),
                 _stand_in(v_pages, (B, Hkv, smax, int(v_pages.shape[3]))),
                 mask=mask, scale=scale, precision=precision, q_offset=q_offset,
                 k_offset=k_offset, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
    other = [t for t in p.mask.terms if t != "band"]
    if other:
        raise NotImplementedError(f"mask: terms {other} are not supported with a paged cache "
                                  "(pages=); only Causal and Window terms (composed with &)")
    p = dataclasses.replace(p, pages=PagedKV(source=pages, page_size=P, num_blocks=N,
                                             mask=mask))
    if pages.on_device:
        sequence_band(p)        # a band the kernels can follow from the counts, or raise
    return p


def _check_values(pages: Pages, N: int, P: int, cap: int) -> None:
    """The checks of the tables' values (read to the host): every seqlens within the
    capacity, every table entry in use within the cache's N pages."""
    table, lengths = pages.table, pages.lengths
    if lengths.size and lengths.max() > cap:
        b = int(np.argmax(lengths > cap))
        raise ValueError(f"pages: seqlens[{b}] = {int(lengths[b])} exceeds the "
                         f"{table.shape[1]} pages x {P} positions = {cap} that block_table "
                         "maps per sequence; give block_table more pages")
    firsts, counts = pages.firsts, pages.counts
    cols = np.arange(table.shape[1])[None, :]
    used = ((cols < -(-lengths[:, None] // P)) & (cols >= firsts[:, None] // P)
            & (counts[:, None] > 0))                                          # [B, M]
    bad = used & ((table < 0) | (table >= N))
    if bad.any():
        b, j = (int(i) for i in np.argwhere(bad)[0])
        t0, t1 = max(j * P, int(firsts[b])), min((j + 1) * P, int(lengths[b])) - 1
        raise ValueError(f"pages: block_table[{b}, {j}] = {int(table[b, j])} is outside the "
                         f"cache's {N} pages [0, {N}) (sequence {b} reads it for positions "
                         f"{t0}..{t1})")
