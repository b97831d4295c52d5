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
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Tuple

import numpy as np

from .arrays import array_kind, device_name, dtype_name
from .masks import resolve
from .problem import check_array, check_like_q, describe

__all__ = ["Pages", "PagedKV", "describe_paged", "sequence_mask", "gather_sequence"]


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


@dataclass(frozen=True, eq=False)
class Pages:
    """The page table of a paged key/value cache (see :mod:`anyattn.paged`).

    ``block_table`` [B, M] int32/int64 (NumPy or torch): the pages of sequence b in order;
    ``seqlens`` [B] int32/int64: where sequence b's keys end (position ``seqlens[b]`` is
    past them); ``starts`` [B] int32/int64 or None (all 0): where they begin
    (FlashAttention's ``cache_leftpad``), ``0 <= starts[b] <= seqlens[b]``.  All are read
    to the host once, here; ``table``, ``lengths`` and ``firsts`` hold those int64
    copies and ``counts`` the key count per sequence, ``lengths - firsts``.
    """

    block_table: Any
    seqlens: Any
    starts: Any = None
    table: np.ndarray = dataclasses.field(init=False, repr=False)
    lengths: np.ndarray = dataclasses.field(init=False, repr=False)
    firsts: np.ndarray = dataclasses.field(init=False, repr=False)
    counts: np.ndarray = dataclasses.field(init=False, repr=False)
    #: what a backend derives from these tables once and keeps as long as this Pages
    #: lives (the Triton backend: its device buffer of records and table per band set;
    #: the webgpu backend: the launch templates of device-array calls, with their tables)
    device_cache: dict = dataclasses.field(init=False, repr=False, default_factory=dict)

    def __post_init__(self):
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
        object.__setattr__(self, "table", table)
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "firsts", firsts)
        object.__setattr__(self, "counts", lengths - firsts)


@dataclass(frozen=True, eq=False)
class PagedKV:
    """A validated paged cache as :class:`~anyattn.problem.Problem` holds it
    (``Problem.pages``): the host tables, the page geometry and the mask as given
    (each sequence resolves it for its own key count, :func:`sequence_mask`)."""

    table: np.ndarray        # [B, M] int64
    lengths: np.ndarray      # [B] int64: where each sequence's keys end
    firsts: np.ndarray       # [B] int64: where they start (Pages.firsts)
    counts: np.ndarray       # [B] int64: keys per sequence, lengths - firsts
    page_size: int           # P
    num_blocks: int          # N
    mask: Any                # the caller's Mask (Causal / Window terms) or None
    device_cache: dict = dataclasses.field(default_factory=dict, repr=False)
    #: ^ the Pages' own (Pages.device_cache): per-Pages buffers of the backends

    @property
    def has_starts(self) -> bool:
        """Whether some sequence's keys start past position 0 (``Pages(starts=)``)."""
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
    rm = resolve(pk.mask, 1, p.heads_q, p.seq_q, int(pk.counts[b]), p.q_offset, p.k_offset)
    return rm.band_lo, rm.band_hi


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
    ``pages`` set and ``seq_k`` = max(seqlens - starts).  Every check runs before any
    work."""

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
    table, lengths = pages.table, pages.lengths
    if table.shape[0] != B:
        raise ValueError(f"pages: block_table has {table.shape[0]} rows but q has batch "
                         f"{B}; expected block_table [B, max_blocks] = [{B}, M]")
    cap = table.shape[1] * P
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
    smax = int(counts.max()) if counts.size else 0
    p = describe(q, _stand_in(k_pages, (B, Hkv, smax, D)),
                 _stand_in(v_pages, (B, Hkv, smax, int(v_pages.shape[3]))),
                 mask=mask, scale=scale, precision=precision, q_offset=q_offset,
                 k_offset=k_offset, softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks)
    other = [t for t in p.mask.terms if t != "band"]
    if other:
        raise NotImplementedError(f"mask: terms {other} are not supported with a paged cache "
                                  "(pages=); only Causal and Window terms (composed with &)")
    pk = PagedKV(table=table, lengths=lengths, firsts=firsts, counts=counts, page_size=P,
                 num_blocks=N, mask=mask, device_cache=pages.device_cache)
    return dataclasses.replace(p, pages=pk)
