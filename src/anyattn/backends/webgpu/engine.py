"""Host side of one attention call on the GPU: uploads, uniforms, launch plans.

Shape legend: B batch, HQ/HKV heads (G = HQ/HKV), SQ/SK queries/keys, D head dim of
q and k, DV head dim of v (and of out / dout; DV = D unless v's differs), n = B*HQ*SQ
rows.  Scratch layout of ``stats`` (f32, STATS_ROWS * n): [0, n) row max,
[n, 2n) delta, [2n, 4n) and [4n, 6n) two (m, l) sets for split forward launches,
[6n, 7n) log-normaliser.  The row max and the log-normaliser stay apart (DESIGN.md §1):
the backward forms P = exp((s - max) - log_norm), never exp(s - lse).
Sentinels: an excluded score and the max of an empty row are -inf (the ``neg_inf``
uniform, tested on its bits in the kernels); a finite bias, even finfo(float32).min,
is a score.
Outputs are f32 scratch: out [B, HQ, SQ, DV], dq [B, HQ, SQ, D]; dk [B, HKV, SK, D]
then dv [B, HKV, SK, DV] (from ``out2_off`` = B*HKV*SK*D on);
dS [B, HQ, SQ, SK] for dbias.
Score modifiers (``Call.set_mods``): ALiBi slopes [Ba, HQ] and sinks [HQ] as f32 words
of ``aux`` next to the mask data; the kernels that use them are compiled with the
SOFTCAP / ALIBI / SINKS defines (``Call.mod_consts``), the others stay the plain ones.
Dropout (``Call.set_dropout``): the Philox key, threshold, 1/(1 − p) and the global
positions of local query 0, key 0, batch 0 as uniforms; the tiled kernels compiled
with DROPOUT draw anyattn.dropout's mask themselves (Philox row/column words and the
per-pair finaliser in WGSL).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

from . import launch as _launch
from .clears import Clear, clear_map
from .launch import (DSQ_ROLE, Launch, LoopLimitError, Runner, TileConfig, ceil_div,
                     dsq_bytes, dsq_chunks, dsq_limit, split_range)
from .uniforms import FLAGS

__all__ = ["Operand", "Call", "upload_view", "compact_broadcast", "NEG_INF", "ELEMENT_TYPES",
           "STATS_ROWS", "LOG_NORM_ROW", "f32_scalar"]

NEG_INF = float("-inf")
#: a problem's dtype -> the element type of the kernels that run it
ELEMENT_TYPES = {"float32": "f32", "float16": "f16"}
#: f32 values per softmax row in the ``stats`` scratch buffer (see the module doc)
STATS_ROWS = 7
#: the log-normaliser's block of ``stats``: [LOG_NORM_ROW * n, (LOG_NORM_ROW + 1) * n)
LOG_NORM_ROW = 6
#: lanes per row of the delta pass in the subgroups variant (<= 4: WebGPU's smallest
#: subgroup size, so every adapter with the feature can run it)
DELTA_LANES = 4
_F32_MAX = float(np.finfo(np.float32).max)


def f32_scalar(name: str, value: float) -> float:
    """``value`` rounded to float32; ValueError naming ``name`` when it is not finite
    there (e.g. a scale of 1e39, finite in float64, overflows float32)."""
    try:
        v = float(value)
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"{name}: {value!r} is not a float ({e})") from None
    with np.errstate(over="ignore"):
        f = np.float32(v)
    if not np.isfinite(v):
        raise ValueError(f"{name}: {v!r} is not finite; pass a finite float32 value")
    if not np.isfinite(f):
        raise ValueError(f"{name}: {v!r} overflows float32 (largest finite {_F32_MAX:.8g}), "
                         "the precision the webgpu kernels compute in; pass a smaller value")
    return float(f)


def compact_broadcast(x: np.ndarray) -> np.ndarray:
    """A view of ``x`` with every stride-0 (broadcast) dim cut to size 1: the data a
    broadcast array really holds, without materialising the broadcast."""
    idx = tuple(slice(0, 1) if (n > 1 and s == 0) else slice(None)
                for n, s in zip(x.shape, x.strides))
    return x[idx]
_I32 = (1 << 31) - 1


@dataclass
class Operand:
    """A [B, H, S, D] tensor in a buffer: element offset and b/h/s strides (d stride 1)."""

    buf: object
    off: int
    sb: int
    sh: int
    ss: int

    def fields(self, prefix: str) -> Dict[str, int]:
        return {f"{prefix}_off": self.off, f"{prefix}_sb": self.sb, f"{prefix}_sh": self.sh,
                f"{prefix}_ss": self.ss}


def upload_view(run: Runner, role: str, x: np.ndarray, np_dtype) -> Operand:
    """Upload a 4-D array with its strides where that is cheap (a strided view with unit
    D stride and a compact span), else a contiguous copy."""
    if x.dtype != np_dtype:
        x = x.astype(np_dtype)
    it = x.itemsize
    st = [s if n > 1 else 0 for n, s in zip(x.shape, x.strides)]
    if x.size and (st[3] == it or x.shape[3] == 1) and all(s >= 0 and s % it == 0 for s in st):
        span = 1 + sum((n - 1) * (s // it) for n, s in zip(x.shape, st))
        if span <= 2 * x.size + 4096:
            flat = np.lib.stride_tricks.as_strided(x, shape=(span,), strides=(it,))
            buf = run.upload(role, flat)
            return Operand(buf, 0, st[0] // it, st[1] // it, st[2] // it)
    c = np.ascontiguousarray(x)
    buf = run.upload(role, c)
    s = [v // it for v in c.strides]
    return Operand(buf, 0, s[0], s[1], s[2])


def _bcast_strides(shape: Sequence[int]) -> Tuple[int, int, int, int]:
    """Element strides of a C-contiguous array, 0 on size-1 dims."""
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc if n > 1 else 0)
        acc *= n
    return tuple(reversed(out))


@dataclass
class Call:
    """Everything one forward/backward needs on the device, built once per call."""

    run: Runner
    cfg: TileConfig
    B: int
    HQ: int
    HKV: int
    SQ: int
    SK: int
    D: int
    elem: str = "f32"
    uni: Dict[str, object] = field(default_factory=dict)
    flags: int = 0
    bias_buf: object = None
    aux_buf: object = None
    q: Optional[Operand] = None
    k: Optional[Operand] = None
    v: Optional[Operand] = None
    g: Optional[Operand] = None
    debug: bool = False
    uprefix: str = "u"          # role prefix of this call's uniform buffers
    #: v's head dim (and out's / dout's); None: D.  Where it differs from D the tiled
    #: kernels are compiled with VDIM and read it from the uniform DV (pipelines.py)
    DV: Optional[int] = None
    #: the pooled role of the ``aux`` table; None: a buffer of this call's own (a cached
    #: launch template keeps it, so no later call can overwrite its mask data)
    aux_role: Optional[str] = "aux"
    _n_uni: int = 0

    def __post_init__(self):
        c = self.cfg
        if self.DV is None:
            self.DV = self.D
        self.n = self.B * self.HQ * self.SQ
        self.nqt = ceil_div(self.SQ, c.BQ)
        self.nkt = ceil_div(self.SK, c.BK)
        self.uni.update(B=self.B, HQ=self.HQ, HKV=self.HKV, G=self.HQ // self.HKV, SQ=self.SQ,
                        SK=self.SK, D=self.D, neg_inf=NEG_INF, inv_sk=1.0 / max(self.SK, 1),
                        nqt=self.nqt, nkt=self.nkt, stat_n=self.n)
        if self.DV != self.D:
            self.uni["DV"] = self.DV
        self.bias_buf = self.aux_buf = self.run.dummy
        self._aux_parts: List[np.ndarray] = []   # u32 words of aux (masks, modifiers)
        self._aux_pos = 0
        #: score-modifier constants (anyattn.modifiers): SOFTCAP, ALIBI, DROPOUT for
        #: every tiled kernel, SINKS for the forward only; empty = the plain kernels
        self.mod_consts: Dict[str, int] = {}
        #: generated score / mask functions of the tiled kernels: (key, WGSL) and the
        #: buffer of their captures (``set_programs``); None: the plain kernels
        self.progs: Optional[Tuple[str, str]] = None
        self.cap_buf = None
        #: capture gradients (``set_capture_grads``): (key, WGSL, NG, slot layout) of the
        #: DCAP dK/dV pass's generated functions, and the buffer of its slots; None: none
        #: asked
        self.dcap: Optional[Tuple[str, str, int, object]] = None
        self.dcs_buf = None
        self.limit = self.run.ctx.loop_limit
        self.launches: List[Launch] = []
        self.clears: List[object] = []
        #: device copies after the launches: (src, src byte off, dst, dst byte off, bytes)
        self.copies: List[tuple] = []
        self.copies_before: List[tuple] = []     # the same, before the launches
        self.pieces: Dict[str, int] = {}     # kernel -> launches it was split into
        #: id(uniform buffer) -> its values, for the launches that read the dropout seed
        #: (the DROPOUT tiled kernels): a launch template owns copies of these and
        #: writes a new seed into them per call (templates.py), so the seed is no
        #: field of its key
        self.seeded: Dict[int, Dict[str, object]] = {}
        #: the 5-product backward (variants *-dsq): the dS scratch the dK/dV pass filled
        #: for the dQ pass (``dkdv(dq_next=True)``), else None; the chunks it ran over:
        #: [(first, end) (batch, KV head) row, index in ``launches`` after its dK/dV launches]
        self.dsq_buf = None
        self.dsq_marks: List[Tuple[int, int, int]] = []

    # ------------------------------------------------------------------ setup
    def set_scale(self, scale: float) -> None:
        self.uni["scale"] = f32_scalar("scale", scale)

    def set_mask(self, rmask, use_tilemap: bool = True) -> None:
        """Band, documents, keep mask and tile map of an anyattn ResolvedMask -> aux buffer."""
        from ...arrays import to_numpy

        F = FLAGS
        put = self.aux_put
        n_parts = len(self._aux_parts)
        lo_clip = -(self.SQ + 2)
        hi_clip = self.SK + 2
        if rmask.band_lo is not None:
            self.flags |= F["HAS_LO"]
            self.uni["band_lo"] = int(min(max(rmask.band_lo, lo_clip), hi_clip))
        if rmask.band_hi is not None:
            self.flags |= F["HAS_HI"]
            self.uni["band_hi"] = int(min(max(rmask.band_hi, lo_clip), hi_clip))
        if rmask.q_ids is not None:
            qd = to_numpy(rmask.q_ids).astype(np.int64)
            kd = to_numpy(rmask.k_ids).astype(np.int64)
            _, inv = np.unique(np.concatenate([qd.ravel(), kd.ravel()]), return_inverse=True)
            inv = inv.astype(np.int32)
            qn, kn = inv[:qd.size].reshape(qd.shape), inv[qd.size:].reshape(kd.shape)
            self.flags |= F["HAS_DOCS"]
            self.uni["qid_off"] = put(qn)
            self.uni["qid_sb"] = self.SQ if qn.shape[0] > 1 else 0
            self.uni["kid_off"] = put(kn)
            self.uni["kid_sb"] = self.SK if kn.shape[0] > 1 else 0
        if rmask.keep is not None:
            km = to_numpy(rmask.keep)
            km = compact_broadcast(km.reshape((1,) * (4 - km.ndim) + tuple(km.shape)))
            self.run.check_size("keep mask", 4 * km.size)
            kf = np.ascontiguousarray(km, dtype=np.float32)
            sb, sh, si, sj = _bcast_strides(kf.shape)
            self.flags |= F["HAS_KEEP"]
            self.uni.update(kp_off=put(kf), kp_sb=sb, kp_sh=sh, kp_si=si, kp_sj=sj)
        if use_tilemap and not rmask.is_empty_mask:
            tm = np.asarray(rmask.tile_map(self.cfg.BQ, self.cfg.BK))
            Bm, Hm, nq, nk = tm.shape
            if (nq, nk) != (self.nqt, self.nkt):
                raise RuntimeError(f"tile map {tm.shape} does not match the {self.nqt}x{self.nkt} "
                                   "tiles of this launch")
            self.flags |= F["TILEMAP"]
            self.uni.update(tm_off=put(tm.astype(np.uint32)), tm_sb=(Hm * nq * nk) if Bm > 1 else 0,
                            tm_sh=(nq * nk) if Hm > 1 else 0)
        if len(self._aux_parts) > n_parts:
            self.aux_upload()

    def set_pages(self, p) -> None:
        """A paged key/value cache (``p.pages``, anyattn.paged) -> the PAGED forward.

        aux gets the block table (u32 words; entries outside a sequence's pages are
        never read) and one record per sequence b: its key count ``seqlens[b] -
        starts[b]``, its band (lo, hi) (``paged.sequence_mask``: its mask resolved for
        that count, clipped like ``set_mask``'s; an open side as the clip value) and the
        aux index of its table row; a tile map per sequence: tiles at or past its key
        count are empty (never read), the others coded by its band.  With starts
        (``Pages(starts=)``, some nonzero) the kernels are compiled with PGSTART and each
        table row is preceded by its sequence's start (key j is position start + j).
        The k / v operands' batch stride must be their page stride (the kernel adds no
        batch term).

        These words are uploaded once per Pages, runner and launch shape (page size,
        batch, Sq, Sk, tile sizes, the bands) into a buffer of their own, kept in the Pages
        (``Pages.device_cache``, at most ``PAGE_TABLES_MAX`` entries): a repeated call
        with the same Pages neither builds nor uploads them (score modifiers added to
        aux afterwards, ``set_mods``, upload the whole table again, with them)."""
        from ...paged import sequence_mask

        pk = p.pages
        bands = tuple(sequence_mask(p, b) for b in range(self.B))
        run = self.run
        key = ("webgpu_pages", id(run), pk.page_size, self.B, self.SQ, self.SK, self.cfg.BQ,
               self.cfg.BK, bands)
        cache = pk.device_cache
        hit = cache.get(key)
        if self._aux_pos:                    # the words' offsets count from aux word 0
            raise RuntimeError("set_pages: the page table must be the first aux data")
        if hit is None or hit[0] is not run or hit[1] != run.cache_epoch:
            words, uni, flags, consts = self._page_words(pk, bands)
            buf = run.device.create_buffer(label="aux",
                                           size=max(16, -(-words.nbytes // 16) * 16),
                                           usage=run.usage)
            run.device.queue.write_buffer(buf, 0, words)
            stale = [k for k in cache if k[0] == "webgpu_pages"]
            if len(stale) >= self.PAGE_TABLES_MAX:
                for k in stale:
                    del cache[k]
            hit = cache[key] = (run, run.cache_epoch, words, uni, flags, consts, buf)
        words, uni, flags, consts, buf = hit[2:]
        self._aux_parts.append(words)
        self._aux_pos = words.size
        self.uni.update(uni)
        self.flags |= flags
        self.mod_consts.update(consts)
        self.aux_buf = buf

    #: the most page-table buffers one Pages keeps (``set_pages``: layers of a step with
    #: different windows or query counts)
    PAGE_TABLES_MAX = 8

    def _page_words(self, pk, bands):
        """``set_pages``' aux words from word 0 -> (u32 words, uniforms, flags, kernel
        defines)."""
        B, BQ, BK = self.B, self.cfg.BQ, self.cfg.BK
        lo_clip, hi_clip = -(self.SQ + 2), self.SK + 2
        lens = pk.counts.astype(np.int64)
        band = np.empty((B, 2), np.int64)
        has_lo = has_hi = False
        for b, (lo, hi) in enumerate(bands):
            has_lo |= lo is not None
            has_hi |= hi is not None
            band[b, 0] = lo_clip if lo is None else min(max(lo, lo_clip), hi_clip)
            band[b, 1] = hi_clip if hi is None else min(max(hi, lo_clip), hi_clip)
        M = pk.table.shape[1]
        rec = np.empty((B, 4), np.int64)
        rec[:, 0] = lens
        rec[:, 1:3] = band
        parts, consts, flags = [], {"PAGED": 1}, FLAGS["TILEMAP"]
        if pk.has_starts:           # rows [start, table row] (PGSTART)
            rows = np.concatenate([pk.firsts[:, None], pk.table], axis=1)
            parts.append(rows.astype(np.uint32).reshape(-1))
            rec[:, 3] = (M + 1) * np.arange(B) + 1
            consts["PGSTART"] = 1
        else:
            parts.append(pk.table.astype(np.uint32).reshape(-1))
            rec[:, 3] = M * np.arange(B)
        pg_off = parts[0].size
        parts.append(rec.astype(np.int32).reshape(-1).view(np.uint32))
        if has_lo:
            flags |= FLAGS["HAS_LO"]
        if has_hi:
            flags |= FLAGS["HAS_HI"]
        # tile codes [B, nqt, nkt]: keys j - i of a tile span [dmin, dmax] (every value)
        i0 = np.arange(self.nqt) * BQ
        i1 = np.minimum(i0 + BQ, self.SQ)
        j0 = np.arange(self.nkt) * BK
        j1 = np.minimum(j0[None, :] + BK, lens[:, None])                     # [B, nkt]
        dmin = j0[None, None, :] - (i1[None, :, None] - 1)                  # [1, nqt, nkt]
        dmax = (j1[:, None, :] - 1) - i0[None, :, None]                     # [B, nqt, nkt]
        lo, hi = band[:, 0, None, None], band[:, 1, None, None]
        any_kept = (dmax >= lo) & (dmin <= hi) & (j0[None, None, :] < lens[:, None, None])
        all_kept = any_kept & (dmin >= lo) & (dmax <= hi)
        codes = np.where(all_kept, 2, np.where(any_kept, 1, 0)).astype(np.uint32)
        tm_off = pg_off + parts[1].size
        parts.append(codes.reshape(-1))
        words = np.concatenate(parts)
        words.setflags(write=False)
        uni = dict(pg_off=pg_off, pg_p=pk.page_size, tm_off=tm_off,
                   tm_sb=self.nqt * self.nkt, tm_sh=0)
        return words, uni, flags, consts

    def aux_put(self, a: np.ndarray) -> int:
        """Append 4-byte words to the aux buffer's contents -> their u32 offset."""
        a = np.ascontiguousarray(a).reshape(-1).view(np.uint32)
        self._aux_parts.append(a)
        off = self._aux_pos
        self._aux_pos += a.size
        return off

    def aux_upload(self) -> None:
        data = np.concatenate(self._aux_parts)
        if self.aux_role is not None:
            self.aux_buf = self.run.upload(self.aux_role, data)
            return
        self.aux_buf = self.run.device.create_buffer(
            label="aux", size=max(16, -(-data.nbytes // 16) * 16), usage=self.run.usage)
        self.run.device.queue.write_buffer(self.aux_buf, 0, data)

    def set_mods(self, softcap: Optional[float], alibi_slopes, alibi_diag: int,
                 sinks) -> None:
        """Score modifiers (anyattn.modifiers) -> uniforms, aux words, kernel defines.

        softcap c (f32); alibi_slopes [Ba, HQ] (Ba in {1, B}) with the signed diagonal
        ``i' - j' = i - j + alibi_diag``; sinks [HQ].  Slopes and sinks go into aux as
        f32 bits (exact for f16 and f32 arrays)."""
        if softcap is not None:
            self.uni["softcap"] = f32_scalar("softcap", softcap)
            self.mod_consts["SOFTCAP"] = 1
        if alibi_slopes is not None:
            sl = np.asarray(alibi_slopes)
            if sl.ndim != 2 or sl.shape[1] != self.HQ or sl.shape[0] not in (1, self.B):
                raise ValueError(f"alibi_slopes: shape {sl.shape}, expected [1 or {self.B}, "
                                 f"{self.HQ}]")
            # i - j + diag in i32 for every pair: |diag| + SQ + SK must stay below 2**31
            if abs(int(alibi_diag)) + self.SQ + self.SK >= _I32:
                raise ValueError(f"q_offset/k_offset: the ALiBi distance |i - j + {alibi_diag}| "
                                 "passes the i32 range of the webgpu kernels; bring the "
                                 "offsets closer together")
            self.uni.update(al_off=self.aux_put(sl.astype(np.float32)),
                            al_sb=self.HQ if sl.shape[0] > 1 else 0,
                            alibi_diag=int(alibi_diag))
            self.mod_consts["ALIBI"] = 1
        if sinks is not None:
            t = np.asarray(sinks).astype(np.float32).reshape(-1)
            if t.size != self.HQ:
                raise ValueError(f"sinks: {t.size} values, expected [{self.HQ}]")
            self.uni["snk_off"] = self.aux_put(t)
            self.mod_consts["SINKS"] = 1
        if alibi_slopes is not None or sinks is not None:
            self.aux_upload()

    def set_programs(self, score=None, mask_fns=(), b0: int = 0) -> None:
        """A score function (a BoundProgram: SCOREMOD) and mask functions (MASKFN, applied
        in partial tiles) -> generated WGSL and one buffer of their captures (u32 words,
        score captures first).  The pipelines are keyed by the generated text, so new
        captured values only rewrite the buffer.  ``b0``: the global index of local batch
        0 (a batch chunk), the uniform ``drop_b0`` the generated code adds to ``b`` (the
        programs were bound to the whole problem, so captures indexed by ``b`` stay
        whole).  With ``aux_role`` None (a cached launch template) the captures get a
        buffer of this call's own, as the aux table does."""
        from .elementwise import ew
        from .programs import TANH_HELPER, Layout, mask_source, mask_words, pack_captures, \
            score_source

        if score is None and not mask_fns:
            return
        parts, words, start = [TANH_HELPER], [], 0
        fills = []                  # device-array captures: (array, word offset)
        if score is not None:
            _, src = score_source(score)
            parts.append(src)
            lay = Layout(score.program.specs)
            for name, x in sorted(score.device.items()):
                if x.ndim > 4:
                    raise NotImplementedError(
                        f"webgpu: {score.program.where}: device-array capture {name!r} has "
                        f"{x.ndim} dims; the device copy takes at most 4: pass it reshaped "
                        "or as a NumPy array")
                fills.append((name, x, lay.parts[name][0]))
            words.append(pack_captures(lay, score.arrays, score.program.where)[:lay.words])
            start = lay.words
            self.mod_consts["SCOREMOD"] = 1
        if mask_fns:
            _, src = mask_source(mask_fns, start)
            parts.append(src)
            words += mask_words(mask_fns)
            self.mod_consts["MASKFN"] = 1
        text = "".join(parts)
        data = np.concatenate(words + [np.zeros(1, np.uint32)])
        self.run.check_size("score / mask function captures", 4 * data.size)
        if b0 < 0 or b0 + self.B > 1 << 31:
            raise ValueError(f"webgpu: batch offset {b0} of a chunk of {self.B} leaves the "
                             "int32 batch index of the generated functions")
        self.uni["drop_b0"] = int(b0)
        self.progs = (hashlib.sha1(text.encode()).hexdigest(), text)
        if self.aux_role is not None:
            self.cap_buf = self.run.upload("captures", data)
        else:
            self.cap_buf = self.run.device.create_buffer(
                label="captures", size=max(16, -(-data.nbytes // 16) * 16),
                usage=self.run.usage)
            self.run.device.queue.write_buffer(self.cap_buf, 0, data)
        for name, x, off in fills:      # as f32 words, by the ``ew`` kernel, every call
            if x.buffer.size > self.run.max_binding:
                raise ValueError(f"score_mod capture {name!r}: its buffer has "
                                 f"{x.buffer.size} bytes, past this "
                                 f"adapter's max storage binding of {self.run.max_binding} "
                                 "bytes; the webgpu kernels bind whole buffers: use a "
                                 "smaller buffer")
            ew(self, x, self.cap_buf, off)

    def set_capture_grads(self, score, wrt) -> int:
        """The gradients of the score function's float captures ``wrt`` (``score``: the
        BoundProgram ``set_programs`` was given) in the dK/dV pass (DCAP): generated
        ``dcap_d`` / ``dcap_put`` (programs.dcap_source) and a slot buffer ``dcs``
        (f32, cleared before the launches; ``dcap_floats``): per read, in the slot
        layout's order (capture_grads.slot_layout), a region [B*HQ, nkt, nqt, W] with
        W = BQ + BK - 1 (diagonal and total reads), BQ (row reads) or BK (column
        reads), then per pair read a region [B*HQ, SQ, SK] (its terms themselves).
        Returns NG, the capture reads (0: none is read, nothing to compute)."""
        from .programs import dcap_source

        if self.progs is None or "SCOREMOD" not in self.mod_consts:
            raise RuntimeError("set_capture_grads: set_programs(score) comes first")
        key, text, lay = dcap_source(score, wrt)
        ng = len(lay.order)
        if not ng:
            return 0
        if "tile_dcap" not in self.run.pipes.layouts:
            most = self.run.ctx.limits.get("max-storage-buffers-per-shader-stage")
            raise NotImplementedError(
                f"webgpu: score_mod capture gradients bind 11 storage buffers in the dK/dV "
                f"pass, past this adapter's {most} ({self.run.ctx.name}); use "
                "backend='numpy'")
        limit = self.run.ctx.limits.get("max-compute-workgroup-storage-size", 16384)
        tile = sum(lay.counts)           # the pair reads have no block in the tile
        need = self.cfg.smem_bytes("bwd_dkdv", "DROPOUT" in self.mod_consts, tile)
        if need > limit:
            raise NotImplementedError(
                f"webgpu: {self.cfg} with the gradients of {tile} score_mod capture reads "
                f"needs {need} bytes of workgroup memory in 'bwd_dkdv', past this "
                f"adapter's {limit}; pass another config_override (or none: the chosen "
                "config counts them)")
        self.dcap = (key, text, ng, lay)
        nbytes = 4 * self.dcap_floats()
        self.dcs_buf = self.run.buffer("dcaps", nbytes)
        self.clears.append(Clear(self.dcs_buf, nbytes))
        return ng

    def dcap_floats(self) -> int:
        """The f32 words of the DCAP dK/dV pass's slot buffer (capture_grads.slot_floats,
        then the pair reads' regions: pair_floats)."""
        from .capture_grads import pair_floats, slot_floats

        lay = self.dcap[3]
        return (slot_floats(lay.counts, self.B * self.HQ, self.nkt, self.nqt,
                            self.cfg.BQ, self.cfg.BK)
                + pair_floats(lay.pairs, self.B * self.HQ, self.SQ, self.SK))

    def set_dropout(self, p: float, seed: int, q_offset: int, k_offset: int,
                    b0: int = 0) -> None:
        """anyattn.dropout's mask in the tiled kernels (DROPOUT): keep[b, h, i, j] at the
        global positions b0 + b, q_offset + i, k_offset + j (b0: the first batch of a
        batch chunk).  p in (0, 1), seed in [0, 2**64)."""
        from ...dropout import U32_LIMIT, check_dropout, keep_scale, threshold

        p, seed = check_dropout(p, seed)
        if p == 0.0:
            return
        for name, off, n in (("q_offset", q_offset, self.SQ), ("k_offset", k_offset, self.SK),
                             ("batch", b0, self.B)):
            if off < 0 or off + n > U32_LIMIT:
                raise ValueError(f"{name}: positions {off}..{off + n - 1} leave [0, 2**32); "
                                 "dropout counts positions as 32-bit unsigned ints")
        c = self.cfg
        if c.NT < max(c.BQ, c.BK):   # one invocation per row / column word
            raise ValueError(f"webgpu: dropout needs a tile config with TX, TY >= 4, got {c}")
        limit = self.run.ctx.limits.get("max-compute-workgroup-storage-size", 16384)
        for k in ("forward", "bwd_dq", "bwd_dkdv"):
            if c.smem_bytes(k, dropout=True) > limit:
                raise NotImplementedError(
                    f"webgpu: {c} with dropout needs {c.smem_bytes(k, dropout=True)} bytes of "
                    f"workgroup memory in {k!r}, past this adapter's {limit}; pass another "
                    "config_override (or none: the chosen config counts dropout)")
        self.uni.update(drop_k0=seed & 0xFFFFFFFF, drop_k1=seed >> 32, drop_t=threshold(p),
                        drop_rs=f32_scalar("dropout_p", keep_scale(p)), drop_qo=int(q_offset),
                        drop_ko=int(k_offset), drop_b0=int(b0))
        self.mod_consts["DROPOUT"] = 1

    def set_bias(self, bias: np.ndarray) -> None:
        """Upload the bias as float32 with its broadcast dims kept at size 1 (stride 0
        in the kernels): a broadcast view is never materialised, and the size is
        checked against the adapter's limit before anything is copied.  -inf stays
        -inf (it excludes the key); every finite value is a score."""
        b4 = np.asarray(bias)
        b4 = compact_broadcast(b4.reshape((1,) * (4 - b4.ndim) + b4.shape))
        self.run.check_size("bias", 4 * b4.size)
        b4 = np.ascontiguousarray(b4, dtype=np.float32)
        sb, sh, si, sj = _bcast_strides(b4.shape)
        self.bias_buf = self.run.upload("bias", b4)
        self.flags |= FLAGS["HAS_BIAS"]
        self.uni.update(bi_off=0, bi_sb=sb, bi_sh=sh, bi_si=si, bi_sj=sj)

    # ---------------------------------------------------------------- launches
    def uniform_buffer(self, extra: Dict[str, object]):
        vals = dict(self.uni)
        vals.update(extra)
        buf = self.run.uniform(f"{self.uprefix}{self._n_uni}", vals)
        self._n_uni += 1
        return buf

    def _operands(self) -> Dict[str, int]:
        out: Dict[str, int] = {}
        for name in ("q", "k", "v", "g"):
            op = getattr(self, name)
            if op is not None:
                out.update(op.fields(name))
        return out

    def _tile_buffers(self, ubuf, stats, outb, dsb):
        d = self.run.dummy
        bufs = [ubuf] + [getattr(self, n).buf if getattr(self, n) is not None else d
                         for n in ("q", "k", "v", "g")]
        return bufs + [self.bias_buf, self.aux_buf, stats, outb, dsb if dsb is not None else self.run.dummy_w]

    def _tile(self, kernel: str, n_units: int, grid_x: int, n_bh: int, stats, outb, dsb=None,
              flags: int = 0, extra: Optional[Dict[str, object]] = None, dk=True, dv=True,
              ml=False, defines: Optional[Dict[str, int]] = None,
              trips: Optional[str] = None, bh_range: Optional[Tuple[int, int]] = None) -> None:
        """``trips``: the trip model's kernel name when it differs from ``kernel``;
        ``bh_range``: only grid rows [first, end) of the ``n_bh`` (default all)."""
        cfg = self.cfg
        pieces = self._pieces(trips or kernel, n_units, dk, dv)
        consts = cfg.consts()
        consts.update(defines or {})
        if self.DV != self.D:
            consts["VDIM"] = 1
        slices = cfg.slices(self.out_dim(kernel))
        consts.update({k: v for k, v in self.mod_consts.items()
                       if k != "SINKS" or kernel == "forward"})   # the sink: forward only
        layout = "tile" if self.progs is None else "tile_prog"
        progs = self.progs
        dcap = kernel == "bwd_dkdv" and self.dcap is not None
        if dcap:      # the capture gradients' functions and slots (DCAP)
            dkey, dtext, _, lay = self.dcap
            consts.update(cfg.dcap_consts(lay.counts, lay.pairs))
            progs = (f"{progs[0]}+{dkey}", progs[1] + dtext)
            layout = "tile_dcap"
        pipe = self.run.pipeline(kernel, layout, consts, self.elem, self.debug, progs)
        if self.debug and dsb is None:   # debug builds write each invocation's loop trips here
            n_inv = grid_x * n_bh * slices * cfg.NT
            dsb = self.trip_buf = self.run.buffer(f"trips_{kernel}", 4 * n_inv)
            self.clears.append(dsb)
            self.trip_count = n_inv
        base = dict(self._operands())
        base.update(extra or {})
        self.pieces[kernel] = len(pieces)
        lo, hi = bh_range or (0, n_bh)
        for a, b_ in [(lo + a, lo + b_) for a, b_ in self.run.bh_chunks(hi - lo)]:
            for idx, (t0, t1) in enumerate(pieces):
                fl = self.flags | flags
                fl |= FLAGS["FIRST"] if idx == 0 else 0
                fl |= FLAGS["LAST"] if idx == len(pieces) - 1 else 0
                vals = dict(base, t0=t0, t1=t1, bh0=a, flags=fl)
                if ml:
                    vals["ml_rd"] = 2 * self.n + 2 * self.n * ((idx + 1) % 2)
                    vals["ml_wr"] = 2 * self.n + 2 * self.n * (idx % 2)
                ubuf = self.uniform_buffer(vals)
                if "DROPOUT" in self.mod_consts:
                    self.seeded[id(ubuf)] = dict(self.uni, **vals)
                bufs = self._tile_buffers(ubuf, stats, outb, dsb)
                if self.progs is not None:
                    bufs.append(self.cap_buf)
                if dcap:
                    bufs.append(self.dcs_buf)
                self.launches.append(Launch(kernel, pipe, layout, bufs,
                                            (grid_x, b_ - a, slices)))

    def out_dim(self, kernel: str) -> int:
        """The output columns a tiled kernel's column slices cover: DV (forward: out), D
        (dQ), the larger of the two (dK/dV: a slice past one of them skips its update)."""
        if kernel == "forward":
            return self.DV
        if kernel == "bwd_dkdv":
            return max(self.D, self.DV)
        return self.D

    def sdp_dim(self, kernel: str) -> int:
        """The head dim a kernel's S (and dP) loop runs over (the trip model's): D in the
        forward, the larger of D and DV where dP = dO.V^T shares it (a chunk past one of
        them takes only the other's products)."""
        return self.D if kernel == "forward" else max(self.D, self.DV)

    def forward(self, stats, outb) -> None:
        """out [B, HQ, SQ, DV] (f32) into outb; row max into stats[0:n], log-normaliser
        into stats[6n:7n]."""
        self._tile("forward", self.nkt, self.nqt, self.B * self.HQ, stats, outb, ml=True)

    def delta(self, stats, out_op: Operand, vmean=None, out16: bool = False) -> None:
        """delta = <dout, out> (rows of DV) into stats[n:2n]; ``out16``: ``out_op`` is f16
        (f16 inputs only), widened exactly in the kernel (OUT16), else f32."""
        if self.limit is not None and self.DV + TileConfig.FIXED_TRIPS > self.limit:
            raise LoopLimitError(f"webgpu kernel 'delta': Dv={self.DV} loop trips > {self.limit}")
        if out16 and self.elem != "f16":
            raise ValueError(f"webgpu kernel 'delta': an f16 out needs f16 inputs, got {self.elem}")
        # the subgroups variant: RL lanes per row (a subgroup butterfly), RL x the invocations
        rl = DELTA_LANES if self.cfg.subgroups else 1
        consts = {"SUBGROUPS": 1, "RL": rl} if self.cfg.subgroups else {}
        if out16:
            consts["OUT16"] = 1
        pipe = self.run.pipeline("delta", "delta", consts, self.elem)
        vals = dict(self._operands(), **out_op.fields("o"), flags=self.flags)
        if self.DV != self.D:     # delta's rows (dout, out, vmean) have DV elements
            vals["D"] = self.DV
        ubuf = self.uniform_buffer(vals)
        self.launches.append(Launch("delta", pipe, "delta",
                                    [ubuf, self.g.buf, out_op.buf, stats,
                                     vmean if vmean is not None else self.run.dummy],
                                    self.run.flat_grid(self.n * rl)))

    def dkdv(self, stats, outb, want_dk: bool, want_dv: bool, out16: bool = False,
             dq_next: bool = False, ds_role: str = DSQ_ROLE) -> None:
        """dK [B, HKV, SK, D] then dV [B, HKV, SK, DV] into outb (f32; ``out16``: f16,
        converted in the epilogue as ``dq``'s, both wanted, see ``out16_ok``).
        ``dq_next``: a ``dq`` without dbias follows; with a ``*-dsq`` variant (``dq_from_ds``) this pass also
        stores dS into the pooled scratch ``ds_role`` (one per Runner) and that ``dq``
        only reads it.  Past the scratch cap (``dsq_chunks``) the pass runs over chunks
        of (batch, KV head) rows, each chunk's dQ launches placed right after its dK/dV
        launches by ``dq``, one chunk's dS in the scratch at a time: every workgroup
        does what it does unchunked (same bits), the dK/dV sums never cross a chunk."""
        fl = (FLAGS["WANT_DK"] if want_dk else 0) | (FLAGS["WANT_DV"] if want_dv else 0)
        G = self.HQ // self.HKV
        if out16 and not (want_dk and want_dv and self.out16_ok("bwd_dkdv")):
            raise ValueError("webgpu kernel 'bwd_dkdv': an f16 dK/dV in the epilogue needs "
                             "both, f16 inputs, D % 4 == 0 and one piece (Call.out16_ok)")
        defines = {"OUTB16": 1} if out16 else {}
        extra = {"out2_off": self.B * self.HKV * self.SK * self.D}
        self.dsq_buf, self.dsq_marks = None, []
        if not (dq_next and self.dq_from_ds()):
            self._tile("bwd_dkdv", G * self.nqt, self.nkt, self.B * self.HKV, stats, outb,
                       flags=fl, extra=extra, dk=want_dk, dv=want_dv, defines=defines)
            return
        chunks = self.dsq_chunks()
        rows = max(b_ - a for a, b_ in chunks)
        dsb = self.run.buffer(ds_role, dsq_bytes(rows * G, self.SQ, self.SK, self.cfg.BK))
        defines["DSQ_OUT"] = 1
        for a, b_ in chunks:
            self._tile("bwd_dkdv", G * self.nqt, self.nkt, self.B * self.HKV, stats, outb, dsb,
                       flags=fl, extra=dict(extra, ds_bh0=a * G), dk=want_dk, dv=want_dv,
                       defines=defines, bh_range=(a, b_))
            self.dsq_marks.append((a, b_, len(self.launches)))
        self.dsq_buf = dsb

    def dsq_chunks(self) -> List[Tuple[int, int]]:
        """The (batch, KV head) row chunks of the 5-product backward (``dsq_chunks``)."""
        lim = dsq_limit(self.run.max_binding, self.run.max_buffer)
        chunks = dsq_chunks(self.B * self.HKV, self.HQ // self.HKV, self.SQ, self.SK,
                            self.cfg.BK, lim)
        assert chunks is not None, "dq_from_ds() checks that one row fits"
        return chunks

    def dq_from_ds(self) -> bool:
        """Whether this call's backward is the 5-product one (``*-dsq`` variants): the
        dK/dV pass stores dS, the dQ pass reads it.  Not in debug builds (their trip
        buffer is ``dsb``).  A dS scratch past DSQ_MAX_BYTES or the adapter's binding
        limit is a ``ValueError`` (the variant table routes such sizes elsewhere; a
        forced variant gets the reason)."""
        if not self.cfg.dsq or self.debug:
            return False
        G = self.HQ // self.HKV
        lim = dsq_limit(self.run.max_binding, self.run.max_buffer)
        if dsq_chunks(self.B * self.HKV, G, self.SQ, self.SK, self.cfg.BK, lim) is None:
            need = dsq_bytes(G, self.SQ, self.SK, self.cfg.BK)
            raise ValueError(f"webgpu kernel variant {self.cfg.variant!r}: its dS scratch "
                             f"needs {need} bytes for one (batch, KV head) row (4*G*SQ*SK, "
                             f"SK padded to whole key tiles; the smallest chunk), past "
                             f"{lim} (DSQ_MAX_BYTES or the adapter's storage binding "
                             f"limit); use {self.cfg.base!r} or a shorter sequence")
        return True

    def _pieces(self, kernel: str, n_units: int, dk=True, dv=True) -> List[Tuple[int, int]]:
        counts = (0, 0, 0)
        if self.dcap is not None and kernel == "bwd_dkdv":
            counts = self.dcap[3].counts
        per = self.cfg.trips_per_unit(kernel, self.sdp_dim(kernel), dk, dv, *counts)
        return split_range(n_units, per, self.limit, f"webgpu kernel {kernel!r}")

    def out16_ok(self, kernel: str) -> bool:
        """Whether the dQ (``bwd_dq``) or dK/dV (``bwd_dkdv``, both wanted) pass can write
        its f16 result itself (``out16=True``): f16 inputs, D a multiple of 4 (whole
        vec4<f16> stores; dV's offset B*HKV*SK*D then one too), one piece (a split
        launch carries its partial sums in f32 between pieces), no debug trip buffer; for
        dK/dV DV a multiple of 4 too."""
        units = self.nkt if kernel == "bwd_dq" else self.HQ // self.HKV * self.nqt
        dims_ok = self.D % 4 == 0 and (kernel == "bwd_dq" or self.DV % 4 == 0)
        return (self.elem == "f16" and dims_ok and not self.debug
                and len(self._pieces(kernel, units)) == 1)

    def dq(self, stats, outb, dsb=None, out16: bool = False) -> None:
        """dQ [B, HQ, SQ, D] into outb: f32, or with ``out16`` f16 converted in the
        epilogue (OUTB16: the f32 accumulators scaled, then one vec4<f16> store; the
        same conversion as the ``ew`` cast it replaces, so the same bits)."""
        fl = FLAGS["WRITE_DS"] if dsb is not None else 0
        if out16 and not self.out16_ok("bwd_dq"):
            raise ValueError("webgpu kernel 'bwd_dq': an f16 dQ in the epilogue needs f16 "
                             "inputs, D % 4 == 0 and one piece (Call.out16_ok)")
        defines = {"OUTB16": 1} if out16 else {}
        if dsb is None and self.dsq_buf is not None:   # 5-product: dQ = dS.K from the scratch
            defines["DSQ_IN"] = 1
            if self.cfg.prefetch and _launch.DSQ_PREFETCH:
                defines["DSQ_PF"] = 1
            G = self.HQ // self.HKV
            # each chunk's dQ launches right after its dK/dV launches (later chunks first,
            # so the earlier insertion points stay valid)
            for a, b_, at in reversed(self.dsq_marks):
                kept, self.launches = self.launches, []
                self._tile("bwd_dq", self.nkt, self.nqt, self.B * self.HQ, stats, outb,
                           self.dsq_buf, defines=defines, trips="bwd_dq_ds",
                           extra={"ds_bh0": a * G}, bh_range=(a * G, b_ * G))
                kept[at:at] = self.launches
                self.launches = kept
            return
        self._tile("bwd_dq", self.nkt, self.nqt, self.B * self.HQ, stats, outb, dsb, flags=fl,
                   defines=defines)

    def reduce_dbias(self, dsb, outb, bias_shape: Tuple[int, int, int, int]) -> int:
        """dbias = dS summed over the broadcast dims -> outb[:numel]; returns numel."""
        full = (self.B, self.HQ, self.SQ, self.SK)
        red = [f if s == 1 and f > 1 else 1 for s, f in zip(bias_shape, full)]
        nred = int(np.prod(red))
        numel = int(np.prod(bias_shape))
        pieces = split_range(nred, 1, self.limit, "webgpu kernel 'reduce_dbias'")
        pipe = self.run.pipeline("reduce_dbias", "reduce", {}, "f32")
        for idx, (t0, t1) in enumerate(pieces):
            fl = (FLAGS["FIRST"] if idx == 0 else 0)
            vals = dict(self.uni, t0=t0, t1=t1, flags=fl, n_out=numel,
                        red_b=red[0], red_h=red[1], red_i=red[2], red_j=red[3],
                        db_nb=bias_shape[0], db_nh=bias_shape[1], db_ni=bias_shape[2],
                        db_nj=bias_shape[3])
            ubuf = self.uniform_buffer(vals)
            self.launches.append(Launch("reduce_dbias", pipe, "reduce", [ubuf, dsb, outb],
                                        self.run.flat_grid(numel)))
        return numel

    def vmean(self, outb) -> None:
        numel = self.B * self.HKV * self.DV
        pieces = split_range(self.SK, 1, self.limit, "webgpu kernel 'vmean'")
        pipe = self.run.pipeline("vmean", "vmean", {}, self.elem)
        for idx, (t0, t1) in enumerate(pieces):
            fl = (FLAGS["FIRST"] if idx == 0 else 0) | (FLAGS["LAST"] if idx == len(pieces) - 1 else 0)
            ubuf = self.uniform_buffer(dict(self.uni, **self.v.fields("v"), t0=t0, t1=t1, flags=fl,
                                n_out=numel, D=self.DV))
            self.launches.append(Launch("vmean", pipe, "vmean", [ubuf, self.v.buf, outb],
                                        self.run.flat_grid(numel)))

    def scatter(self, src, src_off: int, arena, rows: int, o: Operand) -> None:
        numel = self.B * self.HQ * rows * self.D
        pipe = self.run.pipeline("scatter", "scatter", {}, "f32")
        ubuf = self.uniform_buffer(dict(self.uni, SQ=rows, n_out=numel, q_off=src_off, **o.fields("o")))
        self.launches.append(Launch("scatter", pipe, "scatter", [ubuf, src, arena],
                                    self.run.flat_grid(numel)))

    def submit(self) -> None:
        self.run.run(self.launches, self.clears, self.copies, self.copies_before)
        self.launches, self.clears, self.copies, self.copies_before = [], [], [], []

    def freeze(self) -> "Plan":
        """The launches built so far as a re-submittable plan (benchmarks, the ABI's plan
        cache); the pooled buffers it binds are re-resolved at each submit (``Plan``)."""
        plan = Plan(self.run, self.run.encode(self.launches), list(self.clears),
                    list(self.copies), list(self.copies_before), list(self.launches))
        self.launches, self.clears, self.copies, self.copies_before = [], [], [], []
        return plan


@dataclass
class Plan:
    """Encoded launches over persistent buffers; ``submit(repeat)`` runs them again.

    ``launches`` (the unencoded list, when given): the pooled buffers (``Runner.buffer``
    roles, e.g. the shared dS scratch ``DSQ_ROLE``) among the bound ones are resolved again
    at each submit; a role another call grew (its old buffer destroyed) or released is
    taken anew (grown to this plan's size where smaller) and the launches re-encoded, so
    no bind group of a destroyed buffer is ever submitted."""

    run: Runner
    encoded: list
    clears: list
    copies: list = field(default_factory=list)
    copies_before: list = field(default_factory=list)
    launches: Optional[list] = None
    #: role -> (bytes this plan needs, the buffer its launches were encoded with)
    roles: Dict[str, tuple] = field(default_factory=dict)
    #: times a grown / released role made this plan re-encode (tests)
    rebinds: int = 0

    def __post_init__(self):
        if self.launches is None:
            return
        used = {id(b) for l in self.launches for b in l.buffers}
        used |= {id(c.buf if isinstance(c, Clear) else c) for c in self.clears}
        used |= {id(x) for c in self.copies + self.copies_before for x in (c[0], c[2])}
        for role, buf in self.run.role_buffers.items():
            if id(buf) in used and not role.startswith("_"):
                self.roles[role] = (int(buf.size), buf)

    def _resolve(self) -> None:
        """Re-bind the roles whose pooled buffer is no longer the one encoded with."""
        new = {}
        for role, (nbytes, buf) in self.roles.items():
            if self.run.role_buffers.get(role) is not buf:
                new[id(buf)] = self.run.buffer(role, nbytes)
                self.roles[role] = (nbytes, new[id(buf)])
        if not new:
            return

        def sub(b):
            return new.get(id(b), b)
        for l in self.launches:
            l.buffers = [sub(b) for b in l.buffers]
        self.clears = [clear_map(c, sub) for c in self.clears]
        self.copies = [(sub(a), o, sub(d), p, n) for a, o, d, p, n in self.copies]
        self.copies_before = [(sub(a), o, sub(d), p, n) for a, o, d, p, n in self.copies_before]
        self.encoded = self.run.encode(self.launches)
        self.rebinds += 1

    def submit(self, repeat: int = 1) -> None:
        if self.roles:
            self._resolve()
        self.run.submit(self.encoded, self.clears, repeat, self.copies, self.copies_before)

    def wait(self) -> None:
        """Block until the queue is idle (read a few bytes back: DESIGN.md §6)."""
        self.run.read(self.run.dummy, 1)
