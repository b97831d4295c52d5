"""Launch code: tile configs, loop-trip budgets, persistent buffers, uniforms, dispatch.

Shape legend: B batch, HQ/HKV heads, SQ/SK queries/keys, D head dim.
Every tiled kernel loops over "units" (key tiles for forward/dq; (query head of
the group, query tile) pairs for dkdv).  ``Runner.tile_launches`` splits that
range into pieces whose per-invocation loop trips stay under the device's
budget (llvmpipe: 65,535, see device.py); a piece continues from the partial
results of the one before (stored in f32), so a split launch computes exactly
what one launch would, in the same order.
"""
from __future__ import annotations

import dataclasses
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from ... import settings
from . import uniforms
from .clears import Clear
from .device import Context
from .pipelines import KernelError, PipelineCache

__all__ = ["TileConfig", "choose_config", "half_config", "LoopLimitError", "Runner", "Launch",
           "ceil_div", "VARIANTS", "RM8_VARIANTS", "VARIANT_TABLE", "WIDE_MIN_GROUPS",
           "ENV_VARIANT", "pick_variant", "dq_groups", "DSQ_MAX_BYTES", "dsq_bytes",
           "DSQ_ROLE", "DSQ_PREFETCH", "dsq_limit", "dsq_chunks"]

#: kernel variants of the tiled kernels (forward, dQ, dK/dV) and the delta pass:
#: ``portable`` the original kernels; ``prefetch`` the next staged chunk (S/dP's Q/K/dO/V
#: chunk, the updates' row chunk) read into registers before the current chunk's
#: products (global-load latency behind arithmetic; same barriers, same arithmetic
#: and order: bitwise the portable results); ``staged`` prefetch plus one workgroup
#: array for the staged tiles, so an update stages twice the rows per chunk (IC x 2:
#: half the update barriers; bitwise portable's results in f32, the f16 flush period UC
#: unchanged); ``subgroups`` staged plus subgroup row reductions (forward row max / sum
#: by shuffle-xor butterflies instead of a workgroup round trip and a serial loop;
#: delta rows by 4 subgroup lanes), for adapters with the ``subgroup`` feature;
#: ``wide`` staged with RM = 8 query rows per invocation in the backward passes (an
#: 8 x 4 score micro-tile, query tiles BQ = 8*TY: more products per workgroup load and
#: per barrier, twice the work per unit), its P^T / dS tiles over the idle S/dP staging
#: tiles (ALIAS) to stay in 48 KiB; its forward is staged's kernel (RM = 4).
#: ``rows8`` (f16 only) portable's kernels with RM = 8 in the backward passes: no
#: register prefetch, no staging array, no aliasing (f16 tiles of 128 rows fit 48 KiB
#: at D chunks of 32; f32 ones do not: f32 takes ``wide``); its forward is portable's.
#: ``<base>-dsq`` (portable-dsq, staged-dsq, wide-dsq): the base variant's kernels in a
#: 5-product backward (FA's count; the others execute 7): the dK/dV pass also stores
#: dS [B, HQ, SQ, SK] in f32 into a scratch buffer (DSQ_OUT), and the dQ pass reads it
#: back and computes only dQ = scale * dS.K (DSQ_IN) instead of recomputing S and dP.
#: Bitwise the base variant's results (the same dS bits, summed in the same order).
#: Scratch 4*B*HQ*SQ*SK bytes: 512 MiB at B=1 H=8 S=4096; within DSQ_MAX_BYTES and the
#: adapter's storage-binding limit only (``Call.dq_from_ds``); where the dK/dV pass
#: does not run (dq alone), a dbias is wanted (the dQ pass writes its own dS there) or
#: in debug builds (the trip buffer takes ``dsb``), the dQ pass recomputes as its base.
VARIANTS = ("portable", "prefetch", "staged", "subgroups", "wide", "rows8",
            "portable-dsq", "staged-dsq", "wide-dsq")
#: variants with RM = 8 query rows per invocation in the backward passes
RM8_VARIANTS = ("wide", "rows8", "wide-dsq")
#: the largest dS scratch of a ``*-dsq`` variant (bytes): past it the 5-product backward
#: runs over chunks of (batch, KV head) rows (``dsq_chunks``); where one such row's
#: scratch is past it, the table's next entry
DSQ_MAX_BYTES = 1 << 30
#: the pooled role (``Runner.buffer``) of the dS scratch: one buffer per Runner (device),
#: shared by every call, launch template and plan, grown when too small; templates and
#: plans resolve it at submit (a grown buffer is re-bound).  Its users, one at a time
#: within a call: the 5-product backward (one chunk's dS in tile order, <= DSQ_MAX_BYTES)
#: and the dbias path (dS [B, HQ, SQ, SK] row-major, written by the dQ pass and read by
#: the reduction / the read-back of the same call; within the binding limit: the batch
#: is chunked to fit), cleared only as far as that call needs (``Clear``)
DSQ_ROLE = "dsq"
#: the dQ pass of a ``*-dsq`` variant whose base prefetches (staged-dsq, wide-dsq) loads
#: the next key tile's dS rows into registers before the current tile's update (DSQ_PF;
#: the same values stored to the same tile: the same bits).  False: the loads at the
#: tile's start (kept for A/B comparison)
DSQ_PREFETCH = True


def dsq_bytes(bh: int, sq: int, sk: int, bk: int = 64) -> int:
    """Bytes of the ``*-dsq`` variants' f32 dS scratch for B*HQ = ``bh``, SQ, SK, key
    tiles of ``bk`` (rows padded to whole tiles; 64: the largest tile, an upper bound)."""
    return 4 * bh * sq * ceil_div(sk, bk) * bk


def dsq_limit(max_binding: int, max_buffer: int) -> int:
    """The largest dS scratch (bytes): DSQ_MAX_BYTES within the adapter's storage-binding
    and buffer limits."""
    return min(DSQ_MAX_BYTES, int(max_binding), int(max_buffer))


def dsq_chunks(n_kv: int, g: int, sq: int, sk: int, bk: int,
               limit: int) -> Optional[List[Tuple[int, int]]]:
    """(batch, KV head) rows [0, n_kv) (B*HKV) in the fewest chunks of equal size (the last
    one shorter) whose dS scratch (``g`` query heads per row, SQ x SK padded to key tiles
    of ``bk``) fits ``limit`` bytes; None where one row alone does not fit.  A chunk's dK/dV
    sums run over all its query heads, so no result is summed across chunks."""
    per = dsq_bytes(g, sq, sk, bk)
    if per > limit:
        return None
    if n_kv <= 0 or per == 0:
        return [(0, max(n_kv, 0))]
    n = ceil_div(n_kv, limit // per)
    rows = ceil_div(n_kv, n)
    return [(a, min(n_kv, a + rows)) for a in range(0, n_kv, rows)]
#: forces a variant (A/B); one the adapter cannot run raises with the reason
ENV_VARIANT = "ANYATTN_WEBGPU_VARIANT"
#: the default variant per (adapter class, element type, grid fill); first match wins;
#: change an entry here (data, not code) after a measurement (bench/webgpu_bench.py
#: --resident --variants).  The fourth column: the fewest workgroups the variant's dQ
#: pass must have for the entry to apply, when the problem's size is known
#: (``choose_config(rows=...)``; 0: any size).  Why these entries, in order:
#: - the 5-product backward (``*-dsq``: the dQ pass reads dS back instead of recomputing
#:   S and dP) before its base, which it outruns; taken only where the problem's dS
#:   scratch is known to fit (``_dsq_fits``); bitwise the base's results;
#: - ``wide`` (128-row query tiles) only where its dQ grid has enough workgroups to fill
#:   a large GPU (``WIDE_MIN_GROUPS``, about one per multiprocessor); with fewer, most
#:   of the GPU idles and ``staged`` is faster (bitwise the same results);
#: - ``staged`` rather than ``subgroups``: bitwise portable's results and no assumption
#:   on subgroup lane order, which WebGPU does not promise;
#: - f16 takes portable(-dsq): every prefetching variant is slower in f16;
#: - CPU adapters take portable.
WIDE_MIN_GROUPS = 128
VARIANT_TABLE = (
    # (cpu adapter?, needs 'subgroup', elem or None = any, min dQ workgroups) -> variant
    ((False, False, "f32", WIDE_MIN_GROUPS), "wide-dsq"),
    ((False, False, "f32", 0), "staged-dsq"),
    ((False, False, "f32", WIDE_MIN_GROUPS), "wide"),
    ((False, False, "f32", 0), "staged"),
    ((False, False, "f16", 0), "portable-dsq"),
    ((False, False, None, 0), "portable"),
    ((True, False, None, 0), "portable"),
)


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


class LoopLimitError(NotImplementedError):
    """A launch would pass the adapter's per-invocation loop-trip limit and cannot be split."""


@dataclass(frozen=True)
class TileConfig:
    """Workgroup TY x TX threads; tiles BQ = RM*TY queries x BK = 4*TX keys; D in
    chunks of DC; output columns per workgroup DS = 4*TX*NV; update row chunks IC.
    RM: query rows of an invocation's score micro-tile (4; 8 in the wide variant's
    backward passes, whose forward keeps 4).

    ``half`` (f16 inputs only): workgroup tiles in f16 and packed f16 products, summed
    in f16 over short runs (HC vec4 columns = 2*HC products per lane for S and dP; IC
    rows, UC (default IC) per f16 flush as two chains of UC/2, for the updates), each
    run's partial added into the f32 accumulators.
    Softmax, row statistics, delta and every longer sum stay f32."""

    TX: int = 16
    TY: int = 16
    DC: int = 16
    IC: int = 8
    NV: int = 2
    half: bool = False
    HC: int = 4
    UC: int = 0        # f16 flush period of the updates in rows (0: IC)
    variant: str = "portable"   # kernel variant (VARIANTS)
    RM: int = 4        # query rows per invocation (8: the wide / rows8 backward)

    @property
    def BQ(self) -> int:
        return self.RM * self.TY

    @property
    def BK(self) -> int:
        return 4 * self.TX

    @property
    def NT(self) -> int:
        return self.TX * self.TY

    @property
    def uc(self) -> int:
        return self.UC or self.IC

    @property
    def DS(self) -> int:
        return 4 * self.TX * self.NV

    def consts(self) -> Dict[str, int]:
        c = dict(TX=self.TX, TY=self.TY, NT=self.NT, BQ=self.BQ, BK=self.BK, DC=self.DC,
                 DC4=self.DC // 4, RSQ=self.DC // 4 + 1, NV=self.NV, DS=self.DS,
                 DS4=self.DS // 4, IC=self.IC, IC4=self.IC // 4, RSP=self.BQ // 4 + 1,
                 RSP2=self.BK // 4 + 1, NACC=self.RM * self.NV, NACK=4 * self.NV,
                 UC4=self.uc // 4, NUC=self.IC // self.uc, RM=self.RM, RM4=self.RM // 4)
        if self.half:
            c.update(HALF=1, HC=self.HC, NHC=self.DC // 4 // self.HC)
        if self.prefetch:
            c.update(PREFETCH=1, NEQ=ceil_div(self.BQ * self.DC // 4, self.NT),
                     NEK=ceil_div(self.BK * self.DC // 4, self.NT),
                     NEU=ceil_div(self.IC * self.DS // 4, self.NT))
        if self.stage:
            c.update(STAGE=1, STG=self._stg_elems(c))
        if self.alias:
            c["ALIAS"] = 1
        if self.subgroups:
            c["SUBGROUPS"] = 1
        return c

    @property
    def base(self) -> str:
        """The variant's kernels: ``wide`` for ``wide-dsq`` (the 5-product backward's
        kernels are its base's with DSQ_OUT / DSQ_IN)."""
        return self.variant[:-4] if self.variant.endswith("-dsq") else self.variant

    @property
    def dsq(self) -> bool:
        """The 5-product backward (variants ``*-dsq``)."""
        return self.variant.endswith("-dsq")

    @property
    def prefetch(self) -> bool:
        """Register prefetch of the next staged chunk (every variant but portable)."""
        return self.base in ("prefetch", "staged", "subgroups", "wide")

    @property
    def stage(self) -> bool:
        """One workgroup array for the staged tiles (variants staged, subgroups, wide)."""
        return self.base in ("staged", "subgroups", "wide")

    @property
    def alias(self) -> bool:
        """The backward's P^T / dS tiles and the updates' staged rows inside the staging
        array (variant wide with RM = 8: the backward config)."""
        return self.base == "wide" and self.RM > 4

    def _stg_elems(self, c: Dict[str, int]) -> int:
        """SV elements of the STAGE array: the S/dP staging tiles; with ALIAS at least
        the updates' IC staged rows plus the larger of dK/dV's st and dQ's sp."""
        n = 2 * (c["BQ"] + c["BK"]) * c["RSQ"]
        if self.alias:
            n = max(n, self.IC * c["DS4"] + max(c["BK"] * c["RSP"], c["BQ"] * c["RSP2"]))
        return n

    @property
    def subgroups(self) -> bool:
        """Subgroup row reductions (variant subgroups; needs the adapter's 'subgroup')."""
        return self.base == "subgroups"

    def smem_bytes(self, kernel: str, dropout: bool = False, dcap: int = 0) -> int:
        """Workgroup bytes of a tiled kernel; ``dropout``: with the DROPOUT kernels'
        row / column words (u32 [BQ] and [BK]); ``dcap``: with the dK/dV pass's tile of
        capture gradient terms of ``dcap`` reads (DCAP: f32 [dcap][BQ][BK])."""
        if dcap and kernel == "bwd_dkdv":
            return self.smem_bytes(kernel, dropout) + 4 * dcap * self.BQ * self.BK
        if dropout:
            return self.smem_bytes(kernel) + 4 * (self.BQ + self.BK)
        c = self.consts()
        sv = 8 if self.half else 16          # bytes of one tile element (4 values)
        stage = c["BQ"] * c["RSQ"], c["BK"] * c["RSQ"]
        if self.alias:                       # one array (ALIAS); the forward is RM = 4's
            if kernel == "forward":
                return dataclasses.replace(self, RM=4).smem_bytes(kernel)
            return sv * self._stg_elems(c) + 4
        if kernel == "forward":
            return sv * (sum(stage) + c["BQ"] * c["RSP2"]) + 4 * (self.BQ * self.TX + 3 * self.BQ + 1)
        if kernel == "bwd_dq":
            return sv * (2 * sum(stage) + c["BQ"] * c["RSP2"]) + 4
        return sv * (2 * sum(stage) + c["BK"] * c["RSP"]) + 4

    def check(self) -> None:
        c = self.consts()
        # TX == TY: the dK/dV pass maps the BK key rows onto the 4*TY thread rows
        ok = (self.TX == self.TY and self.DC % 4 == 0 and self.IC % 4 == 0
              and self.BQ % self.IC == 0
              and self.BK % self.IC == 0
              # an update stages IC rows in one tile (STAGE: across two)
              and (self.alias or
                   self.IC * c["DS4"] <= (1 + self.stage) * min(self.BQ, self.BK) * c["RSQ"])
              # RM = 8 query rows: the wide / rows8 variants' backward only
              and (self.RM == 4 or (self.RM == 8 and self.variant in RM8_VARIANTS))
              and self.uc % 4 == 0 and self.IC % self.uc == 0
              and (not self.half or (self.HC >= 1 and (self.DC // 4) % self.HC == 0))
              and self.variant in VARIANTS
              # the forward's butterflies: TX a power of two within one subgroup
              and (not self.subgroups or self.TX in (1, 2, 4, 8, 16, 32)))
        if not ok:
            raise ValueError(f"inconsistent tile config {self}")

    def slices(self, D: int) -> int:
        return ceil_div(D, self.DS)

    # ---- loop trips per invocation (mirrors the loops of the kernels) ----------
    # llvmpipe counts every loop *test*: a loop entered once that runs n times costs
    # n + 1 (pinned by tests/webgpu/test_webgpu_limits.py::test_llvmpipe_counting_rule).
    @staticmethod
    def _loop(n: int) -> int:
        return n + 1

    def _sdp(self, D: int) -> int:
        d4 = self.DC // 4
        chunks = ceil_div(D, self.DC)
        if self.prefetch:          # staging unrolled (sdp_ld / sdp_st): the d0 loop only
            return chunks + 1
        per_chunk = (self._loop(ceil_div(self.BQ * d4, self.NT))
                     + self._loop(ceil_div(self.BK * d4, self.NT)))
        return chunks + 1 + chunks * per_chunk

    def _upd(self, rows: int) -> int:
        n = rows // self.IC
        if self.prefetch:          # staging unrolled (upd_*_ld): the chunk loop only
            return n + 1
        return n + 1 + n * self._loop(ceil_div(self.IC * self.DS // 4, self.NT))

    def trips_per_unit(self, kernel: str, D: int, dk: bool = True, dv: bool = True,
                       dcap: int = 0, dcap_rows: int = 0, dcap_cols: int = 0) -> int:
        """Loop tests per invocation for one unit of the kernel's outer loop; ``dcap``,
        ``dcap_rows``, ``dcap_cols``: the capture reads of the dK/dV pass's diagonal,
        row and column sums (DCAP, ``dcap_consts``: per read and diagonal / row /
        column an invocation owns, one loop over at most min(BQ, BK) pairs / the BK
        pairs of a row / the BQ pairs of a column)."""
        if kernel == "forward":
            return 1 + self._sdp(D) + 2 * self._loop(self.TX) + self._upd(self.BK)
        if kernel == "bwd_dq":
            return 1 + self._sdp(D) + self._upd(self.BK)
        if kernel == "bwd_dq_ds":        # DSQ_IN: dS read back (unrolled), no S / dP
            return 1 + self._upd(self.BK)
        if kernel == "bwd_dkdv":
            sums = (dcap * ceil_div(self.BQ + self.BK - 1, self.NT)
                    * self._loop(min(self.BQ, self.BK))
                    + dcap_rows * ceil_div(self.BQ, self.NT) * self._loop(self.BK)
                    + dcap_cols * ceil_div(self.BK, self.NT) * self._loop(self.BQ))
            return 1 + self._sdp(D) + self._upd(self.BQ) * (int(dk) + int(dv)) + sums
        raise KeyError(kernel)

    def dcap_consts(self, counts: Tuple[int, int, int], pairs: int = 0) -> Dict[str, int]:
        """The constants of the dK/dV pass with capture gradients (DCAP) for ``counts`` =
        (ND, NR, NC) reads summed along the tile diagonals, query rows, key columns:
        DCNG reads in all, DCM unrolled passes of the diagonal sums; with row or column
        reads also DCRC and per kind the reads (DCND, DCNR, DCNC) and the unrolled
        passes (DCM, DCMR, DCMC: 0 where the kind has no read).  ``pairs``: the pair
        reads (stored by ``dcap_put`` itself, no block in the tile): DCPR and the DCRC
        constants too; DCPO where they are the only reads (no tile, no sums)."""
        nd, nr, nc = counts
        diag = ceil_div(self.BQ + self.BK - 1, self.NT)
        out = dict(DCAP=1, DCNG=nd + nr + nc, DCM=diag)
        if pairs:
            out["DCPR"] = 1
            if not nd + nr + nc:
                out["DCPO"] = 1
        if nr or nc or pairs:
            out.update(DCRC=1, DCND=nd, DCNR=nr, DCNC=nc, DCM=diag if nd else 0,
                       DCMR=ceil_div(self.BQ, self.NT) if nr else 0,
                       DCMC=ceil_div(self.BK, self.NT) if nc else 0)
        return out

    #: loop tests outside the units (the outer loop's exit test, a margin)
    FIXED_TRIPS = 4


GPU_CONFIGS = (TileConfig(16, 16, 16, 8, 2), TileConfig(8, 8, 16, 8, 2))
CPU_CONFIGS = (TileConfig(8, 8, 16, 8, 2),)


def half_config(cfg: TileConfig, backward: bool = False, smem_limit: int = 0,
                dropout: bool = False, dcap: int = 0) -> TileConfig:
    """The f16-math variant of an f32 config: S/dP in f16 runs of 4 products per lane
    (HC = 2), updates flushed every 16 rows as two f16 chains of 8 (errors at the level
    of a naive fp16 implementation).  Forward: D chunks of 32 (same workgroup bytes
    per row as f32), IC = 16.  Backward on a GPU (``smem_limit`` > 0): D chunks of 64
    and the longest staged row chunk IC in (64, 32) that fits (fewer barriers: faster
    than the forward's chunks).
    ``dropout``: count the DROPOUT kernels' workgroup words; ``dcap``: the DCAP
    dK/dV pass's (``TileConfig.smem_bytes``)."""
    h = dataclasses.replace(cfg, DC=32, IC=16, UC=16, half=True, HC=2)
    if backward and smem_limit:
        # DC = 32 only where 64 fits nowhere (the wide variant's 128-row query tiles)
        for dc, ic in ((64, 64), (64, 32), (32, 64), (32, 32)):
            c = dataclasses.replace(h, DC=dc, IC=ic)
            try:
                c.check()
            except ValueError:
                continue
            if all(c.smem_bytes(k, dropout, dcap) <= smem_limit
                   for k in ("bwd_dq", "bwd_dkdv")):
                return c
    return h


def _forced_variant(ctx: Context, elem: str, variant: Optional[str]) -> Optional[str]:
    """``variant`` or ``$ANYATTN_WEBGPU_VARIANT`` when given (an unknown name is a
    ``ValueError``, one this adapter or element type cannot run a
    ``NotImplementedError`` with the reason), else None."""
    want = variant or settings.current().webgpu_variant
    if not want:
        return None
    if want not in VARIANTS:
        raise ValueError(f"{ENV_VARIANT}={want!r}: unknown webgpu kernel variant "
                         f"(one of {', '.join(VARIANTS)})")
    if want == "subgroups" and not ctx.has_subgroups:
        raise NotImplementedError(
            f"webgpu kernel variant 'subgroups' needs the adapter feature 'subgroup', "
            f"which {ctx.name} does not offer; use portable, prefetch or staged")
    if want == "rows8" and elem != "f16":
        raise NotImplementedError(
            "webgpu kernel variant 'rows8' is for float16 inputs (f32 tiles of 128 query "
            "rows need the wide variant's aliasing to fit 48 KiB); use wide for float32")
    return want


def _table(ctx: Context, elem: str):
    """The VARIANT_TABLE entries that match this adapter and element type, in order:
    [(variant, min dQ workgroups)]."""
    return [(name, groups) for (cpu, needs_sg, el, groups), name in VARIANT_TABLE
            if cpu == ctx.is_cpu and (not needs_sg or getattr(ctx, "has_subgroups", False))
            and el in (None, elem)]


def pick_variant(ctx: Context, elem: str = "f32", variant: Optional[str] = None) -> str:
    """The kernel variant: ``variant`` or ``$ANYATTN_WEBGPU_VARIANT`` when given (an unknown
    name is a ``ValueError``, one this adapter cannot run a ``NotImplementedError`` with
    the reason), else the first ``VARIANT_TABLE`` entry that matches the adapter (its
    grid-fill column unchecked: the size is not known here; ``choose_config(rows=...)``
    checks it)."""
    forced = _forced_variant(ctx, elem, variant)
    if forced:
        return forced
    table = _table(ctx, elem)
    return table[0][0] if table else "portable"


def dq_groups(cfg: TileConfig, D: int, rows: Tuple[int, int]) -> int:
    """Workgroups of the dQ pass of backward config ``cfg`` for ``rows`` = (B*HQ, SQ)."""
    bh, sq = rows
    return ceil_div(sq, cfg.BQ) * bh * cfg.slices(D)


def choose_config(ctx: Context, D: int, elem: str = "f32", backward: bool = False,
                  dropout: bool = False, variant: Optional[str] = None,
                  rows: Optional[Tuple[int, int]] = None, dcap: int = 0) -> TileConfig:
    """The first config whose workgroup memory fits the adapter; NV = 1 for small D;
    the f16-math variant (``half_config``, its backward variant on GPUs) for f16.
    ``dropout``: the DROPOUT kernels' workgroup memory (without it the choice is the
    one of the plain kernels).  ``variant``: forced by name (or by
    ``$ANYATTN_WEBGPU_VARIANT``), else the first ``VARIANT_TABLE`` entry for this
    adapter whose grid fill holds: ``rows`` = (B*HQ, SQ) of the problem (forward and
    backward alike, so both passes of a problem take one variant); its backward dQ
    pass must have at least the entry's workgroups (rows None: the size is unknown,
    the fill is not checked).  ``rows`` may carry SK as a third element and G = HQ/HKV
    as a fourth: a ``*-dsq`` entry applies only where its dS scratch (with G, one
    chunk's) is known to fit (``_dsq_fits``).  ``dcap``: the capture reads of a
    backward with capture gradients (the DCAP dK/dV pass's workgroup tile counts)."""
    forced = _forced_variant(ctx, elem, variant)
    if forced:
        return _config(ctx, D, elem, backward, dropout, forced, dcap)
    table = _table(ctx, elem) or [("portable", 0)]
    for i, (name, groups) in enumerate(table):
        if i + 1 < len(table) and name.endswith("-dsq") and not _dsq_fits(ctx, rows):
            continue
        if groups and rows is not None and i + 1 < len(table):
            if dq_groups(_config(ctx, D, elem, True, dropout, name, dcap), D,
                         rows[:2]) < groups:
                continue
        return _config(ctx, D, elem, backward, dropout, name, dcap)
    raise AssertionError("unreachable: the last entry has no grid-fill condition")


def _dsq_fits(ctx: Context, rows: Optional[Tuple[int, ...]]) -> bool:
    """Whether a ``*-dsq`` variant's dS scratch is known to fit: ``rows`` = (B*HQ, SQ, SK,
    G) within DSQ_MAX_BYTES and the adapter's storage-binding / buffer limits, the scratch
    of one chunk (``dsq_chunks``: G query heads) where G is given, else of all B*HQ."""
    if rows is None or len(rows) < 3:
        return False
    lim = dsq_limit(ctx.limits.get("max-storage-buffer-binding-size", 0),
                    ctx.limits.get("max-buffer-size", DSQ_MAX_BYTES))
    heads = rows[3] if len(rows) > 3 else rows[0]
    return dsq_bytes(heads, rows[1], rows[2]) <= lim


def _config(ctx: Context, D: int, elem: str, backward: bool, dropout: bool,
            var: str, dcap: int = 0) -> TileConfig:
    """The first GPU / CPU config of variant ``var`` that fits the adapter (``dcap``:
    with the DCAP dK/dV pass's workgroup tile of that many capture reads)."""
    limit = ctx.limits.get("max-compute-workgroup-storage-size", 16384)
    inv = ctx.limits.get("max-compute-invocations-per-workgroup", 256)

    def fits(c: TileConfig) -> bool:
        return c.NT <= inv and all(c.smem_bytes(k, dropout, dcap) <= limit
                                   for k in ("forward", "bwd_dq", "bwd_dkdv"))
    # the wide / rows8 variants: 8 query rows per invocation in the backward passes
    rm = 8 if (var in RM8_VARIANTS and backward) else 4
    for cfg in (CPU_CONFIGS if ctx.is_cpu else GPU_CONFIGS):
        if D <= 4 * cfg.TX:       # one vec4 column group per thread; longer update chunks
            cfg = TileConfig(cfg.TX, cfg.TY, cfg.DC, 2 * cfg.IC, 1)
        cfg = dataclasses.replace(cfg, variant=var, RM=rm)
        if elem == "f16":
            cfg = half_config(cfg, backward, 0 if ctx.is_cpu else limit, dropout, dcap)
        if cfg.stage:            # twice the staged rows per update chunk where they fit
            wide = dataclasses.replace(cfg, IC=2 * cfg.IC, UC=cfg.UC or cfg.IC)
            try:
                wide.check()
                if fits(wide) or not fits(cfg):
                    cfg = wide
            except ValueError:
                pass
        if fits(cfg):
            cfg.check()
            return cfg
    if dcap:
        raise NotImplementedError(
            f"webgpu: no tile config fits this adapter's workgroup memory ({limit} bytes) "
            f"with the gradients of {dcap} score_mod capture reads (the dK/dV pass holds "
            "a tile of terms per read); ask for the gradients of fewer captures per call "
            "or use backend='numpy'")
    raise NotImplementedError(f"no tile config fits this adapter's workgroup memory "
                              f"({limit} bytes) and {inv} invocations per workgroup")


def split_range(n: int, per_unit: int, limit: Optional[int], what: str) -> List[Tuple[int, int]]:
    """[0, n) in pieces of at most limit // per_unit units."""
    if n <= 0:
        return [(0, 0)]
    if limit is None:
        return [(0, n)]
    m = (limit - TileConfig.FIXED_TRIPS) // per_unit
    if m < 1:
        raise LoopLimitError(f"{what}: one unit takes {per_unit} loop trips per invocation, "
                             f"past this adapter's limit of {limit} (llvmpipe stops loops "
                             "there and returns wrong numbers); use a GPU adapter")
    return [(a, min(n, a + m)) for a in range(0, n, m)]


def _values_key(values: Dict[str, object]) -> tuple:
    """A hashable key of uniform values that tells every packed bit pattern apart
    (floats by their hex form: 0.0 and -0.0 differ, NaN equals itself)."""
    return tuple((k, float(v).hex() if isinstance(v, (float, np.floating)) else v)
                 for k, v in sorted(values.items()))


def _put(cache: "OrderedDict", key, value, bound: int) -> None:
    """Insert into an LRU dict, dropping the oldest entries past ``bound``."""
    cache[key] = value
    while len(cache) > bound:
        cache.popitem(last=False)


@dataclass
class Launch:
    kernel: str            # shader name (for messages)
    pipeline: object
    layout: str
    buffers: Sequence[object]  # bind-group resources in binding order (0 = uniform)
    grid: Tuple[int, int, int]


class Runner:
    """Persistent buffers (by role name, grown when too small), uniforms, dispatch, read-back."""

    def __init__(self, ctx: Context):
        import wgpu

        self.wgpu = wgpu
        self.ctx = ctx
        self.device = ctx.device
        self.pipes = PipelineCache(ctx.device)
        self.role_buffers: Dict[str, object] = {}
        self.usage = (wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST
                      | wgpu.BufferUsage.COPY_SRC)
        self.max_binding = int(ctx.limits["max-storage-buffer-binding-size"])
        self.max_buffer = int(ctx.limits.get("max-buffer-size", self.max_binding))
        self.max_groups = int(ctx.limits.get("max-compute-workgroups-per-dimension", 65535))
        self.dummy = self.buffer("_dummy", 16)       # read-only slots
        self.dummy_w = self.buffer("_dummy_w", 16)   # read-write slots (exclusive use)
        # per-call host work: uniform blocks by content, written once and
        # never again (so any launch, plan or cached bind group may share one), and
        # bind groups by (layout, ids of the bound buffers).  Both LRU-bounded.  A bind
        # group entry holds its buffers only weakly: when one of them dies the entry
        # goes (a weakref callback, before the id can be reused), so the cache never
        # keeps a caller's buffer, or its device memory, alive.
        self._packed: "OrderedDict[tuple, bytes]" = OrderedDict()
        self._uniforms: "OrderedDict[bytes, object]" = OrderedDict()
        self._groups: "OrderedDict[tuple, object]" = OrderedDict()
        self.cache_stats = {"uniform_hits": 0, "uniform_misses": 0, "group_hits": 0,
                            "group_misses": 0, "bound_hits": 0, "bound_misses": 0}
        #: GPU timestamps of each submission while set (timestamps.Timestamps: benches)
        self.timestamps = None
        # device-array calls: result buffers reused once no returned array holds them,
        # and their launch lists cached per signature (pool.py, templates.py)
        from .pool import ResultPool
        from .templates import TemplateCache

        self.results = ResultPool(ctx.device, self.usage)
        self.templates = TemplateCache()
        #: counts ``clear_caches`` calls: the launch templates kept elsewhere (a paged
        #: call's, in its Pages: resident._template_store) are dropped when it moved
        self.cache_epoch = 0

    # ---- buffers -------------------------------------------------------------
    def check_size(self, role: str, nbytes: int) -> None:
        lim = min(self.max_binding, self.max_buffer)
        if nbytes > lim:
            raise ValueError(f"webgpu: the {role} buffer needs {nbytes} bytes, past this "
                             f"adapter's max storage binding of {lim} bytes "
                             f"({self.ctx.name}); use a smaller batch/sequence or another backend")

    def buffer(self, role: str, nbytes: int, uniform: bool = False):
        if not uniform:
            self.check_size(role, int(nbytes))
        nbytes = max(16, (int(nbytes) + 15) // 16 * 16)
        buf = self.role_buffers.get(role)
        if buf is not None and buf.size >= nbytes:
            return buf
        usage = (self.wgpu.BufferUsage.UNIFORM | self.wgpu.BufferUsage.COPY_DST) if uniform \
            else self.usage
        if buf is not None:
            buf.destroy()
        buf = self.device.create_buffer(label=role, size=nbytes, usage=usage)
        self.role_buffers[role] = buf
        return buf

    def release(self, prefix: str) -> None:
        """Destroy the pooled buffers whose role starts with ``prefix``."""
        for role in [r for r in self.role_buffers if r.startswith(prefix)]:
            self.role_buffers.pop(role).destroy()

    def poison(self) -> None:
        """Fill every pooled storage buffer with NaN (tests: every output element must be
        written by the next call)."""
        for role, buf in self.role_buffers.items():
            if role.startswith("_") or not (buf.usage & self.wgpu.BufferUsage.STORAGE):
                continue
            self.device.queue.write_buffer(buf, 0, np.full(buf.size // 4, np.nan, np.float32))
        for buf in self.results.free_buffers():
            self.device.queue.write_buffer(buf, 0, np.full(buf.size // 4, np.nan, np.float32))

    def upload(self, role: str, arr: np.ndarray):
        data = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
        buf = self.buffer(role, data.nbytes)
        if data.nbytes % 4:
            data = np.concatenate([data, np.zeros(4 - data.nbytes % 4, np.uint8)])
        if data.nbytes:
            self.device.queue.write_buffer(buf, 0, data)
        return buf

    #: bounds of the per-runner caches (entries): packed uniform blocks, uniform
    #: buffers, bind groups.  A backward at small sizes uses ~10 of each per signature.
    MAX_PACKED = 1024
    MAX_UNIFORMS = 1024
    MAX_GROUPS = 512

    def uniform(self, label: str, values: Dict[str, object]):
        """The uniform buffer holding ``values`` (uniforms.pack): one buffer per distinct
        content, written once when created (``label`` names it) and never rewritten, so
        a repeated call reuses it (and the bind groups that bind it) with no write."""
        key = _values_key(values)
        data = self._packed.get(key)
        if data is None:
            data = uniforms.pack(values)
            _put(self._packed, key, data, self.MAX_PACKED)
        buf = self._uniforms.get(data)
        if buf is not None:
            self._uniforms.move_to_end(data)
            self.cache_stats["uniform_hits"] += 1
            return buf
        self.cache_stats["uniform_misses"] += 1
        buf = self.device.create_buffer(
            label=label, size=len(data),
            usage=self.wgpu.BufferUsage.UNIFORM | self.wgpu.BufferUsage.COPY_DST)
        self.device.queue.write_buffer(buf, 0, data)
        _put(self._uniforms, data, buf, self.MAX_UNIFORMS)
        return buf

    def bind_group(self, layout: str, buffers: Sequence[object], kernel: str = "?"):
        """The bind group of ``buffers`` (whole buffers, binding order) in ``layout``,
        created once per distinct (layout, live buffer objects) and reused after."""
        key = (layout, *map(id, buffers))
        hit = self._groups.get(key)
        if hit is not None:
            self._groups.move_to_end(key)
            self.cache_stats["group_hits"] += 1
            return hit[0]
        self.cache_stats["group_misses"] += 1
        entries = [{"binding": i, "resource": {"buffer": b, "offset": 0, "size": b.size}}
                   for i, b in enumerate(buffers)]
        try:
            bg = self.device.create_bind_group(layout=self.pipes.layouts[layout][0],
                                               entries=entries)
        except Exception as e:
            raise KernelError(f"webgpu kernel {kernel!r}: bind group rejected: {e}") from e
        groups = self._groups

        def drop(_ref, key=key):          # a bound buffer died: its id may be reused
            groups.pop(key, None)
        refs = [weakref.ref(b, drop) for b in buffers]
        _put(groups, key, (bg, refs), self.MAX_GROUPS)
        return bg

    def clear_caches(self) -> None:
        """Drop the cached uniform blocks, bind groups and launch templates, those kept in
        Pages objects included (they are rebuilt on demand)."""
        self._packed.clear()
        self._uniforms.clear()
        self._groups.clear()
        self.templates.clear()
        self.cache_epoch += 1

    def read(self, buf, count: int, offset_elems: int = 0, dtype=np.float32) -> np.ndarray:
        nbytes = int(count) * np.dtype(dtype).itemsize
        if nbytes == 0:
            return np.zeros(0, dtype)
        off = int(offset_elems) * np.dtype(dtype).itemsize
        try:
            mem = self.device.queue.read_buffer(buf, off, nbytes)
        except Exception as e:
            raise KernelError(f"webgpu: reading back {buf.label!r} failed (device lost?): {e}") from e
        return np.frombuffer(mem, dtype=dtype).copy()

    # ---- dispatch -------------------------------------------------------------
    def pipeline(self, kernel: str, layout: str, consts: Dict[str, int], elem: str = "f32",
                 debug: bool = False, progs=None):
        return self.pipes.get(kernel, layout, consts, elem, debug, progs)

    def encode(self, launches: Sequence[Launch]) -> List[tuple]:
        """Launches -> [(pipeline, bind group, grid, kernel)] ready to submit (and re-submit)."""
        out = []
        for l in launches:
            if 0 in l.grid:
                continue
            for n, what in zip(l.grid, "xyz"):
                if n > self.max_groups:
                    raise ValueError(f"webgpu kernel {l.kernel!r}: {n} workgroups along {what} "
                                     f"> this adapter's limit {self.max_groups}")
            out.append((l.pipeline, self.bind_group(l.layout, l.buffers, l.kernel), l.grid,
                        l.kernel))
        return out

    def submit(self, encoded: Sequence[tuple], clears: Sequence[object] = (),
               repeat: int = 1, copies: Sequence[tuple] = (),
               copies_before: Sequence[tuple] = ()) -> None:
        """``copies_before``, clears (``Clear`` or whole buffers), then every encoded launch
        in order (one compute pass), ``repeat`` times; then ``copies``.  A copy is (src,
        src byte offset, dst, dst byte offset, bytes)."""
        try:
            enc = self.device.create_command_encoder()
            for src, so, dst, do, nbytes in copies_before:
                enc.copy_buffer_to_buffer(src, so, dst, do, nbytes)
            ts = self.timestamps
            marks = ts.marks(repeat) if ts is not None else [None] * repeat
            for mark in marks:
                for c in clears:
                    if isinstance(c, Clear):
                        enc.clear_buffer(c.buf, 0, c.nbytes)
                    else:
                        enc.clear_buffer(c)
                cp = enc.begin_compute_pass() if mark is None else \
                    enc.begin_compute_pass(timestamp_writes=mark)
                for pipe, bg, grid, _ in encoded:
                    cp.set_pipeline(pipe)
                    cp.set_bind_group(0, bg)
                    cp.dispatch_workgroups(*grid)
                cp.end()
            if ts is not None:
                ts.resolve(enc)
            for src, so, dst, do, nbytes in copies:
                enc.copy_buffer_to_buffer(src, so, dst, do, nbytes)
            self.device.queue.submit([enc.finish()])
        except Exception as e:
            names = sorted({e_[3] for e_ in encoded})
            raise KernelError(f"webgpu kernels {names} failed to launch: {e}") from e

    def run(self, launches: Sequence[Launch], clears: Sequence[object] = (),
            copies: Sequence[tuple] = (), copies_before: Sequence[tuple] = ()) -> None:
        self.submit(self.encode(launches), clears, copies=copies, copies_before=copies_before)

    def bh_chunks(self, n: int) -> List[Tuple[int, int]]:
        """Split the batch*heads grid dim at the adapter's workgroup-count limit."""
        m = self.max_groups
        return [(a, min(n, a + m)) for a in range(0, max(n, 1), m)]

    def flat_grid(self, n_items: int, per_group: int = 64) -> Tuple[int, int, int]:
        g = ceil_div(n_items, per_group)
        gx = min(g, self.max_groups)
        gy = ceil_div(g, gx) if g else 0
        if gy > self.max_groups:
            raise ValueError(f"webgpu: {n_items} items exceed the dispatch limits")
        return (gx, gy, 1)
