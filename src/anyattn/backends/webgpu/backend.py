"""The ``webgpu`` backend: tiled WGSL kernels through wgpu-py (Vulkan, Metal, DX12, lavapipe).

Shape legend: B batch, Hq/Hkv heads, Sq/Sk queries/keys, D head dim of q and k, Dv
head dim of v (and of out / dout; the opt-in input ``value_dim`` where it differs).
NumPy arrays in and out: float32, or float16 (f16 tiles and packed f16 products over
short runs, f32 accumulation: launch.half_config) where the adapter has
``shader-f16``.  Forward: one pass with the row statistics (row max and
log-normaliser, kept apart: anyattn.rowstats).  Backward: delta pass, dK/dV pass per
key tile (looping over the query tiles of every query head of the kv group), dQ pass
per query tile (which also writes dS for dbias), then a deterministic dbias
reduction.  No float atomics anywhere: repeated runs are bitwise equal.
Score modifiers (anyattn.modifiers) in the kernels: softcap (accurate tanh, dS times
1 - tanh² before dQ/dK) and ALiBi (from indices) in the score of every tiled kernel,
sinks in the forward's epilogue (the row statistics include them); dsinks on the host
from the row statistics (modifiers.sinks_grad, float64).
Dropout (anyattn.dropout) in the tiled kernels: they draw the shared keep mask
themselves (Philox4x32-10 row/column words from 16-bit partial products, the 32-bit
finaliser per pair), so the backward regenerates it; batch chunks pass their first
batch, so the draw never depends on the split.
Gradients of score-function captures read at indices of b, h and one of q_idx - kv_idx,
q_idx, kv_idx, or at one element per pair (t[h, q_idx, kv_idx]; capture_grads.py): the
dK/dV pass compiled with DCAP writes per-tile diagonal, row and column sums (a pair
read's terms themselves), the host sums them per diagonal, row and column (per capture
slice) and scatters them per capture element (NumPy inputs here, device arrays in
``resident``; other reads are refused by ``extra_reasons``).
``backward_arena`` is the seed's ABI on a wgpu storage buffer.
Device arrays (anyattn.webgpu: buffer, offset, strides) in and out without host
transfers: ``resident`` (automatic dispatch picks this backend for them).
Paged key/value caches (anyattn.paged, ``forward_paged``): the forward compiled with
PAGED reads each key row through the block table, with per-sequence key counts and
bands (engine.Call.set_pages); NumPy or device-array pages.
"""
from __future__ import annotations

import dataclasses
import threading
from typing import Dict, List, Optional

import numpy as np

from ...arrays import array_kind
from ...features import BUILTIN_MODIFIERS, DEFAULT_INPUTS, GRADIENTS
from ..base import Backend, Capabilities
from ...masks import ResolvedMask
from ...modifiers import NO_MODS, ScoreMods, alibi_diag, sinks_grad
from ...problem import Problem
from ...programs.capture_reads import reads as capture_reads
from ...rowstats import RowStats

__all__ = ["WebGPUBackend"]

_NP = {"float32": np.float32, "float16": np.float16}


_CAPS = Capabilities(
    array_kinds=frozenset({"numpy", "webgpu"}), device_types=frozenset({"cpu", "webgpu"}),
    dtypes=frozenset({"float32", "float16"}), precisions=frozenset({"highest"}),
    max_head_dim=None, mask_terms=frozenset({"band", "documents", "keep", "mask_mod"}),
    modifiers=BUILTIN_MODIFIERS | {"score_mod"},
    inputs=DEFAULT_INPUTS | {"value_dim", "paged_kv"},
    # capture gradients: for captures indexed by b, h and one of q_idx - kv_idx, q_idx,
    # kv_idx, or pair reads (capture_grads.py; the others are refused by extra_reasons)
    gradients=GRADIENTS)


@dataclasses.dataclass(frozen=True, eq=False)
class _ChunkMask(ResolvedMask):
    """The mask of batches [b0, b1) of ``whole``: its array terms sliced, its mask
    functions those of the whole problem (read at the global batch index), its tile map
    the whole one's rows b0..b1-1 (one map for every chunk, built once)."""

    whole: Optional[ResolvedMask] = None
    b0: int = 0
    b1: int = 0

    def tile_map(self, bq: int, bk: int) -> np.ndarray:
        tm = self.whole.tile_map(bq, bk)
        return tm if tm.shape[0] == 1 else tm[self.b0:self.b1]


class WebGPUBackend(Backend):
    name = "webgpu"

    @property
    def capabilities(self) -> Capabilities:
        """On a CPU adapter (lavapipe) auto-dispatch passes this backend over: it runs
        there at ~1-2 GFLOP/s, far behind the NumPy backend (backend='webgpu' still works)."""
        if self.availability() is None and self.context.is_cpu:
            return dataclasses.replace(_CAPS, auto=False)
        return _CAPS

    def auto_eligible(self) -> bool:
        """Automatic dispatch reaches this backend only with WebGPU device arrays
        (registry: host arrays go to it by name only); their data already lives on this
        device, so it takes them on any adapter, lavapipe included."""
        return True

    def __init__(self):
        self._runner = None
        #: serialises work on the runner (its buffers, uniforms and queue)
        self.lock = threading.Lock()
        #: for tests: override the per-invocation loop budget (None: the adapter's)
        self.loop_limit_override: Optional[int] = None
        #: for tests: compile kernels that record their loop trips into the dS buffer
        self.debug_trips = False
        #: for benchmarks: force a launch.TileConfig (None: chosen per adapter and D)
        self.config_override = None
        self.last_pieces: Dict[str, int] = {}

    # ------------------------------------------------------------ availability
    def availability(self) -> Optional[str]:
        from .device import unavailable_reason

        return unavailable_reason()

    @property
    def context(self):
        from .device import get_context

        return get_context()

    @property
    def device(self):
        """The wgpu device (create arenas for ``backward_arena`` on it)."""
        return self.context.device

    def is_cpu_adapter(self) -> bool:
        return self.availability() is None and self.context.is_cpu

    def extra_reasons(self, p: Problem) -> List[str]:
        why = []
        if self.availability() is None and p.array_kind == "webgpu":
            from .resident import device_reasons

            why += device_reasons(p, self.context)
        if p.capture_wrt and p.score_mod is not None:
            from ...programs.capture_reads import refusal

            from .capture_grads import device_index_reads

            bad = refusal(p.score_mod.program, p.capture_wrt)
            if bad:
                why.append(f"{bad}; index each read by one of those, or use backend='numpy'")
            elif self.availability() is None:
                why += self._pair_slot_reasons(p)
            dev = device_index_reads(p.score_mod, p.capture_wrt)
            if dev:
                why.append(f"computes the gradients of score_mod captures on the host at "
                           f"indices it evaluates there, but an index reads the device-array "
                           f"capture(s) {dev}; pass those as NumPy arrays")
        if self.availability() is None:
            if p.dtype == "float16" and not self.context.has_f16:
                why.append(f"float16 needs the adapter feature 'shader-f16', which "
                           f"{self.context.name} lacks; pass float32")
            if p.bias_dtype not in (None, "float32", "float16"):
                why.append(f"bias dtype {p.bias_dtype} is not supported")
        return why

    def _pair_slot_reasons(self, p: Problem) -> List[str]:
        """The refusal of pair reads whose slots (capture_grads.pair_slot_bytes: one f32
        per (b, h, q_idx, kv_idx) each, in one binding with the other slots) outgrow the
        adapter's storage binding: one batch's with NumPy arrays (the batch is split
        into chunks beyond), the whole call's with device arrays (one piece)."""
        from .capture_grads import pair_slot_bytes

        one = p.array_kind == "webgpu"
        rows = p.heads_q * (p.batch if one else 1)
        got, nbytes = pair_slot_bytes(p.score_mod.program, p.capture_wrt, rows, p.seq_q,
                                      p.seq_k)
        run = self.runner()
        lim = min(run.max_binding, run.max_buffer)
        if not got or nbytes <= lim:
            return []
        what = ("4·B·Hq·Sq·Sk bytes per read: device arrays run in one piece" if one
                else "4·Hq·Sq·Sk bytes per read for one batch")
        return [f"computes the gradient of a pair read (one element per (b, h, q_idx, "
                f"kv_idx)) through a slot per element, and the slots of the pair read(s) "
                f"{', '.join(got)} need {nbytes} bytes ({what}), past this adapter's max "
                f"storage binding of {lim} bytes ({run.ctx.name}); shorten the sequences "
                "or use backend='numpy'"]

    def runner(self):
        """The backend's launch.Runner (buffers, uniforms, dispatch), made on first use.
        Hold ``self.lock`` while building or submitting work on it."""
        from .launch import Runner

        if self._runner is None:
            self._runner = Runner(self.context)
        return self._runner

    def claim_buffer(self, buffer) -> None:
        """``buffer`` (one anyattn returned results in, or any other) is the caller's for
        good: the result pool never hands it out again (nothing to do before the first
        call has made a runner)."""
        if self._runner is not None:
            self._runner.results.claim(buffer)

    def new_call(self, p_sizes, D, elem, uprefix="u", backward=False, dropout=False, Dv=None,
                 dcap: int = 0):
        """A fresh engine.Call for sizes (B, HQ, HKV, SQ, SK), head dim ``D`` (``Dv``: v's,
        None = D) and kernel element type ``elem``, with this adapter's tile config (or
        ``config_override``; chosen for the larger of D and Dv; ``dcap``: the capture
        reads of a backward with capture gradients, whose dK/dV pass's workgroup tile
        the config must fit)."""
        from .engine import Call
        from .launch import choose_config

        run = self.runner()
        B, HQ, HKV, SQ, SK = p_sizes
        # rows: the variant table's grid fill (wide only where its dQ grid fills the GPU)
        # and the *-dsq variants' dS scratch (only where one chunk of it fits)
        Dv = D if Dv is None else Dv
        cfg = self.config_override or choose_config(run.ctx, max(D, Dv), elem, backward, dropout,
                                                    rows=(B * HQ, SQ, SK, HQ // max(HKV, 1)),
                                                    dcap=dcap)
        cfg.check()
        if cfg.half and elem != "f16":
            raise ValueError(f"webgpu: tile config {cfg} (f16 math) needs float16 inputs")
        call = Call(run, cfg, *p_sizes, D, elem=elem, debug=self.debug_trips, uprefix=uprefix,
                    DV=Dv)
        if self.loop_limit_override is not None:
            call.limit = self.loop_limit_override
        return call

    # ------------------------------------------------------------------ common
    def _setup(self, p: Problem, q, k, v, dout, bias, uprefix="u", mods=NO_MODS, b0=0,
               dcap: int = 0):
        """Uploads, masks, score modifiers and dropout of one call; a backward config
        when ``dout`` is given.  ``b0``: the global index of batch 0 (batch chunks);
        ``dcap``: the capture reads of a backward with capture gradients (``new_call``)."""
        from .engine import ELEMENT_TYPES, upload_view

        if p.dtype not in _NP:
            raise NotImplementedError(f"webgpu: dtype {p.dtype} is not supported")
        npdt = _NP[p.dtype]
        call = self.new_call((p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_k), p.head_dim,
                          ELEMENT_TYPES[p.dtype], uprefix, backward=dout is not None,
                          dropout=p.has_dropout, Dv=p.head_dim_v, dcap=dcap)
        run = call.run
        call.set_scale(p.scale)
        call.q = upload_view(run, "q", q, npdt)
        call.k = upload_view(run, "k", k, npdt)
        call.v = upload_view(run, "v", v, npdt)
        if dout is not None:
            call.g = upload_view(run, "dout", dout, npdt)
        if p.pages is not None:
            call.set_pages(p)
        else:
            call.set_mask(p.mask)
        if bias is not None:
            call.set_bias(bias)
        call.set_mods(p.softcap, mods.alibi_slopes, alibi_diag(p), mods.sinks)
        call.set_programs(p.score_mod, p.mask.mask_fns or (), b0)
        if p.has_dropout:
            call.set_dropout(p.dropout_p, p.dropout_seed, p.q_offset, p.k_offset, b0)
        return call

    def _stats(self, call):
        from .engine import STATS_ROWS

        return call.run.buffer("stats", 4 * STATS_ROWS * call.n)

    @staticmethod
    def _cast16(call, src, count: int, role: str, src_off: int = 0):
        """f32 results -> f16 on the device (the ``ew`` kernel), appended to the call's
        launches: the host then reads half the bytes and converts nothing (NumPy's
        float32 <-> float16 casts run at ~6-8 ns per element, which made the f16 host
        path slower than fp32)."""
        from .elementwise import buffer_bytes, ew, result_array

        dst = call.run.buffer(role, buffer_bytes(count, np.float16))
        ew(call, result_array(src, (count,), np.float32, src_off), dst, 0, dst16=True)
        return dst

    @staticmethod
    def _read16(run, buf, count: int) -> np.ndarray:
        """``count`` float16 values from the start of ``buf`` (read in whole 4-byte words)."""
        words = run.read(buf, (count + 1) // 2, dtype=np.uint32)
        return words.view(np.float16)[:count]

    @staticmethod
    def _read_stats(run, stats, n: int, shape) -> RowStats:
        from .engine import LOG_NORM_ROW

        return RowStats(run.read(stats, n).reshape(shape),
                        run.read(stats, n, LOG_NORM_ROW * n).reshape(shape))

    @staticmethod
    def _write_stats(run, stats, st: RowStats, n: int) -> None:
        from .engine import LOG_NORM_ROW

        for arr, row in ((st.max, 0), (st.log_norm, LOG_NORM_ROW)):
            a = np.ascontiguousarray(arr, dtype=np.float32).reshape(-1)
            if a.size != n:
                raise ValueError(f"lse: {a.size} row statistics for {n} rows")
            run.device.queue.write_buffer(stats, 4 * row * n, a)

    # ----------------------------------------------------------------- forward
    def _build_forward(self, p: Problem, q, k, v, bias, uprefix="u", mods=NO_MODS, b0=0):
        call = self._setup(p, q, k, v, None, bias, uprefix, mods, b0)
        run = call.run
        stats = self._stats(call)
        Dv = p.head_dim_v
        outb = run.buffer("out", 4 * call.n * Dv)
        call.forward(stats, outb)
        out16 = self._cast16(call, outb, call.n * Dv, "out16") \
            if p.dtype == "float16" else None

        def read():
            shape = (p.batch, p.heads_q, p.seq_q, Dv)
            if out16 is not None:
                out = self._read16(run, out16, call.n * Dv).reshape(shape)
            else:
                out = run.read(outb, call.n * Dv).reshape(shape)
            st = self._read_stats(run, stats, call.n, (p.batch, p.heads_q, p.seq_q))
            return out, st
        return call, read

    # ------------------------------------------------- batch chunks (binding limit)
    def batch_chunks(self, p: Problem, backward: bool, bias=None):
        """Batch ranges whose buffers all fit the adapter's storage-binding limit.

        Checked from shapes alone, before anything is copied or uploaded: the bias
        counts with its broadcast dims at size 1 (engine.compact_broadcast, what
        set_bias uploads), and a bias shared by every batch must fit whole."""
        from .engine import STATS_ROWS, compact_broadcast

        run = self.runner()
        lim = min(run.max_binding, run.max_buffer)
        it = np.dtype(_NP.get(p.dtype, np.float32)).itemsize
        Hq, Hk, Sq, Sk, D, Dv = (p.heads_q, p.heads_kv, p.seq_q, p.seq_k, p.head_dim,
                                 p.head_dim_v)
        per_b = {"q": Hq * Sq * max(D, Dv) * it, "k/v": Hk * Sk * max(D, Dv) * it,
                 "out": 4 * Hq * Sq * max(D, Dv), "stats": 4 * STATS_ROWS * Hq * Sq}
        pk = p.pages
        if pk is not None:              # the whole cache is bound, once for every batch
            del per_b["k/v"]
            cache = pk.num_blocks * Hk * pk.page_size * max(D, Dv) * it
            if cache > lim:
                raise ValueError(f"webgpu: the paged cache k_pages/v_pages needs {cache} bytes, "
                                 f"past this adapter's max storage binding of {lim} bytes "
                                 f"({run.ctx.name}); use a smaller cache or backend='numpy'")
        if bias is not None:
            b4 = np.asarray(bias)
            b4 = compact_broadcast(b4.reshape((1,) * (4 - b4.ndim) + b4.shape))
            nb = 4 * int(np.prod(b4.shape[1:]))
            if b4.shape[0] > 1:
                per_b["bias"] = nb
            elif nb > lim:
                raise ValueError(f"webgpu: the bias {tuple(np.shape(bias))} needs {nb} bytes "
                                 f"as float32 (its broadcast dims counted once), past this "
                                 f"adapter's max storage binding of {lim} bytes "
                                 f"({run.ctx.name}); shorten the sequence or use another "
                                 "backend")
        if backward:
            per_b["dkdv"] = 4 * Hk * Sk * (D + Dv)
            if "bias" in p.wrt:
                per_b["ds"] = 4 * Hq * Sq * Sk
            if p.capture_wrt and p.score_mod is not None:
                # the capture gradient slots (engine.Call.dcap_floats), bounded with the
                # smallest tiles of the configs (32 x 32) and the widest slot (a diagonal
                # read's BQ + BK - 1); a pair read's one f32 per (h, q_idx, kv_idx)
                from .capture_grads import pair_slot_bytes, tile_reads

                ng = tile_reads(p.score_mod.program, p.capture_wrt)
                _, pair_bytes = pair_slot_bytes(p.score_mod.program, p.capture_wrt, Hq, Sq,
                                                Sk)
                per_b["capture gradient slots"] = \
                    4 * ng * Hq * (-(-Sq // 32)) * (-(-Sk // 32)) * 63 + pair_bytes
        role, worst = max(per_b.items(), key=lambda kv: kv[1])
        if worst > lim:
            raise ValueError(f"webgpu: one batch of the {role} buffer needs {worst} bytes, past "
                             f"this adapter's max storage binding of {lim} bytes "
                             f"({run.ctx.name}); shorten the sequence or use another backend")
        nb = max(1, lim // worst)
        if nb < p.batch and pk is not None:
            raise ValueError(f"webgpu: a paged call runs in one piece, but one batch of the "
                             f"{role} buffer needs {worst} bytes and only {nb} of {p.batch} fit "
                             f"this adapter's max storage binding of {lim} bytes; split the "
                             "batch")
        return [(b0, min(p.batch, b0 + nb)) for b0 in range(0, p.batch, nb)]

    @staticmethod
    def _sub_mods(mods: ScoreMods, b0: int, b1: int) -> ScoreMods:
        """The modifiers of batches [b0, b1): per-batch ALiBi slopes sliced."""
        sl = mods.alibi_slopes
        if sl is None or sl.shape[0] == 1:
            return mods
        return dataclasses.replace(mods, alibi_slopes=sl[b0:b1])

    @staticmethod
    def _sub(p: Problem, b0: int, b1: int):
        """The problem restricted to batches [b0, b1) (mask and bias sliced where they
        vary).  Score and mask functions stay bound to the whole problem (the kernels
        add the chunk's first batch to ``b``: ``set_programs``), and the mask's tile map
        is the whole problem's, sliced (:class:`_ChunkMask`)."""
        def sl(x):
            return None if x is None else (x if x.shape[0] == 1 else x[b0:b1])
        m = p.mask
        sm = _ChunkMask(sq=m.sq, sk=m.sk, band_lo=m.band_lo, band_hi=m.band_hi,
                        q_ids=sl(m.q_ids), k_ids=sl(m.k_ids), keep=sl(m.keep),
                        mask_fns=m.mask_fns, whole=m, b0=b0, b1=b1)
        bs = p.bias_shape
        if bs is not None and bs[0] > 1:
            bs = (b1 - b0,) + tuple(bs[1:])
        als = p.alibi_shape
        if als is not None and als[0] > 1:
            als = (b1 - b0, als[1])
        return dataclasses.replace(p, batch=b1 - b0, mask=sm, bias_shape=bs,
                                   alibi_shape=als), sl

    def forward(self, p: Problem, q, k, v, bias, mods=NO_MODS):
        if p.array_kind == "webgpu":
            from . import resident

            return resident.forward(self, p, q, k, v, bias, mods)
        chunks = self.batch_chunks(p, backward=False, bias=bias)
        if len(chunks) > 1:
            parts = []
            for b0, b1 in chunks:
                sp, sl = self._sub(p, b0, b1)
                parts.append(self._forward_one(sp, q[b0:b1], k[b0:b1], v[b0:b1], sl(bias),
                                               self._sub_mods(mods, b0, b1), b0))
            self.last_pieces["batch_chunks"] = len(chunks)
            st = RowStats(np.concatenate([s.max for _, s in parts]),
                          np.concatenate([s.log_norm for _, s in parts]))
            return np.concatenate([o for o, _ in parts]), st
        return self._forward_one(p, q, k, v, bias, mods)

    def forward_paged(self, p: Problem, q, k_pages, v_pages, mods=NO_MODS):
        """The forward over a paged cache (``p.pages``, anyattn.paged): the PAGED kernel
        reads every key row through the block table where the pages lie (device arrays:
        bound in place; NumPy pages: uploaded as they are), never a gathered copy."""
        if p.array_kind == "webgpu":
            from . import resident

            return resident.forward(self, p, q, k_pages, v_pages, None, mods)
        self.batch_chunks(p, backward=False)
        return self._forward_one(p, q, k_pages, v_pages, None, mods)

    def _forward_one(self, p: Problem, q, k, v, bias, mods=NO_MODS, b0=0):
        with self.lock:
            call, read = self._build_forward(p, q, k, v, bias, mods=mods, b0=b0)
            call.submit()
            self.last_pieces = dict(call.pieces)
            return read()

    # ---------------------------------------------------------------- backward
    def _build_backward(self, p: Problem, q, k, v, dout, out, stats, bias, resident=None,
                        uprefix="u", mods=NO_MODS, b0=0):
        """Uploads and launches of one backward (dq, dk, dv, dbias; dsinks is the
        host's, see ``backward``); ``resident`` = (stats, out buffer) of a forward
        already on the device (benchmarks), else out and the RowStats ``stats`` are
        uploaded."""
        from .capture_grads import tile_reads
        from .engine import Operand
        from .clears import Clear
        from .launch import DSQ_ROLE

        B, HQ, HKV, SQ, SK, D, Dv = (p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_k,
                                     p.head_dim, p.head_dim_v)
        want_q, want_k, want_v = "q" in p.wrt, "k" in p.wrt, "v" in p.wrt
        want_b = "bias" in p.wrt
        wrt_c = p.capture_wrt if p.score_mod is not None else frozenset()
        ng = len(capture_reads(p.score_mod.program, wrt_c)) if wrt_c else 0
        tile = tile_reads(p.score_mod.program, wrt_c) if ng else 0
        call = self._setup(p, q, k, v, dout, bias, uprefix, mods, b0, dcap=tile)
        run = call.run
        if ng:                          # capture gradients in the dK/dV pass (DCAP)
            call.set_capture_grads(p.score_mod, wrt_c)
        if resident is None:
            st_in = stats
            stats = self._stats(call)
            self._write_stats(run, stats, st_in, call.n)
            # f16 out uploaded as it is (half the bytes), read as f16 by delta (OUT16)
            ob = run.upload("out_in16" if p.dtype == "float16" else "out_in",
                            np.ascontiguousarray(out, dtype=_NP[p.dtype]))
            out16 = p.dtype == "float16"
        else:
            (stats, ob), out16 = resident, False
        call.delta(stats, Operand(ob, 0, HQ * SQ * Dv, SQ * Dv, Dv), out16=out16)
        nk, nv = B * HKV * SK * D, B * HKV * SK * Dv      # dk, then dv from element nk on
        bufs = {}
        if want_k or want_v or ng:
            bufs["kv"] = run.buffer("dkdv", 4 * (nk + nv))
            call.dkdv(stats, bufs["kv"], want_k, want_v, dq_next=want_q and not want_b)
        dsb = None
        if want_b:                      # dS for dbias: the shared dS scratch (DSQ_ROLE)
            dsb = run.buffer(DSQ_ROLE, 4 * B * HQ * SQ * SK)
            call.clears.append(Clear(dsb, 4 * B * HQ * SQ * SK))
        if want_q or want_b:
            bufs["q"] = run.buffer("dq", 4 * call.n * D)
            call.dq(stats, bufs["q"], dsb)
        full = want_b and tuple(p.bias_shape) == (B, HQ, SQ, SK)
        if want_b and not full:
            bufs["b"] = run.buffer("dbias", 4 * int(np.prod(p.bias_shape)))
            call.reduce_dbias(dsb, bufs["b"], tuple(p.bias_shape))
        half = p.dtype == "float16"
        if half:                        # dq, dk, dv cast to f16 on the device
            for name, want, src, cnt, off in (("dk", want_k, "kv", nk, 0),
                                              ("dv", want_v, "kv", nv, nk),
                                              ("dq", want_q, "q", call.n * D, 0)):
                if want:
                    bufs[name + "16"] = self._cast16(call, bufs[src], cnt, name + "16", off)

        def read():
            res: Dict[str, object] = {"dq": None, "dk": None, "dv": None, "dbias": None}
            for name, want, src, cnt, off, shape in (
                    ("dk", want_k, "kv", nk, 0, (B, HKV, SK, D)),
                    ("dv", want_v, "kv", nv, nk, (B, HKV, SK, Dv)),
                    ("dq", want_q, "q", call.n * D, 0, (B, HQ, SQ, D))):
                if not want:
                    continue
                if half:
                    res[name] = self._read16(run, bufs[name + "16"], cnt).reshape(shape)
                else:
                    res[name] = run.read(bufs[src], cnt, off).reshape(shape)
            if want_b:
                n_b = int(np.prod(p.bias_shape))
                db = run.read(dsb, n_b) if full else run.read(bufs["b"], n_b)
                bdt = _NP.get(p.bias_dtype or "float32", np.float32)
                res["dbias"] = db.reshape(p.bias_shape).astype(bdt, copy=False)
            if wrt_c:                   # each read's sums [B, HQ, X] (float64)
                res["dcap_sums"] = self._dcap_sums(call)
            return res
        return call, read

    @staticmethod
    def _dcap_sums(call) -> List[np.ndarray]:
        """The capture gradient slots of a backward Call read back and summed per
        diagonal, row or column (capture_grads.read_sums) -> each read's [B, HQ, X]
        float64, graph order (none where the captures asked for are never read)."""
        from .capture_grads import read_sums

        if call.dcap is None:
            return []
        flat = call.run.read(call.dcs_buf, call.dcap_floats())
        return read_sums(flat, call.dcap[3], call.B, call.HQ, call.SQ, call.SK,
                         call.cfg.BQ, call.cfg.BK)

    def backward(self, p: Problem, q, k, v, dout, out, stats: RowStats, bias, mods=NO_MODS):
        if p.array_kind == "webgpu":
            from . import resident

            return resident.backward(self, p, q, k, v, dout, out, stats, bias, mods)
        res = self._backward_device(p, q, k, v, dout, out, stats, bias, mods)
        sums = res.pop("dcap_sums", None)
        if p.capture_wrt and p.score_mod is not None:
            from .capture_grads import finish

            res["dcaptures"] = finish(p.score_mod, p.capture_wrt, sums,
                                      (p.batch, p.heads_q, p.seq_q, p.seq_k))
        if "sinks" in p.wrt:
            res["dsinks"] = self._dsinks(p, dout, out, stats, mods.sinks)
        return res

    @staticmethod
    def _dsinks(p: Problem, dout, out, stats: RowStats, sinks):
        """dsinks [Hq] = −Σ_{b,i} exp((sink − max) − log_norm)·<dout, out>, from the row
        statistics the forward returned (they include the sink), reduced in float64
        (modifiers.sinks_grad; the δ of every row is computed there in float64 too),
        in the sinks' dtype."""
        st64 = RowStats(np.asarray(stats.max, np.float64), np.asarray(stats.log_norm,
                                                                       np.float64))
        return sinks_grad(np.asarray(dout), np.asarray(out), st64, np.asarray(sinks))

    def _backward_device(self, p: Problem, q, k, v, dout, out, stats: RowStats, bias,
                         mods: ScoreMods) -> Dict[str, object]:
        if not ({"q", "k", "v", "bias"} & set(p.wrt)) and not p.capture_wrt:
            return {"dq": None, "dk": None, "dv": None, "dbias": None}   # dsinks alone
        chunks = self.batch_chunks(p, backward=True, bias=bias)
        if len(chunks) == 1:
            return self._backward_one(p, q, k, v, dout, out, stats, bias, mods)
        parts = []
        for b0, b1 in chunks:
            sp, sl = self._sub(p, b0, b1)
            parts.append(self._backward_one(sp, q[b0:b1], k[b0:b1], v[b0:b1], dout[b0:b1],
                                            out[b0:b1], stats.select(slice(b0, b1)),
                                            sl(bias), self._sub_mods(mods, b0, b1), b0))
        res = {}
        for n in ("dq", "dk", "dv"):
            res[n] = None if parts[0][n] is None else np.concatenate([r[n] for r in parts])
        if "dcap_sums" in parts[0]:     # each read's sums: the chunks' along the batch
            res["dcap_sums"] = [np.concatenate(xs) for xs in
                                zip(*(r["dcap_sums"] for r in parts))]
        res["dbias"] = None
        if parts[0]["dbias"] is not None:
            if p.bias_shape[0] > 1:
                res["dbias"] = np.concatenate([r["dbias"] for r in parts])
            else:                       # broadcast over batch: sum the chunks in order
                acc = parts[0]["dbias"].astype(np.float32)
                for r in parts[1:]:
                    acc = acc + r["dbias"]
                res["dbias"] = acc.astype(parts[0]["dbias"].dtype, copy=False)
        self.last_pieces["batch_chunks"] = len(chunks)
        return res

    def _backward_one(self, p: Problem, q, k, v, dout, out, stats, bias, mods=NO_MODS, b0=0):
        with self.lock:
            call, read = self._build_backward(p, q, k, v, dout, out, stats, bias, mods=mods,
                                              b0=b0)
            call.submit()
            self.last_pieces = dict(call.pieces)
            return read()

    # ------------------------------------------- device arrays: no kernel of their own
    def stats_from_lse(self, p: Problem, q, k, v, bias, mods, lse) -> RowStats:
        """A plain lse device array: always refined on the device against recomputed
        statistics (its magnitude cannot be read on the host); a NumPy lse as on every
        backend (Backend.stats_from_lse)."""
        if array_kind(lse) != "webgpu":
            return super().stats_from_lse(p, q, k, v, bias, mods, lse)
        from . import resident

        return resident.stats_from_lse(self, p, q, k, v, bias, mods, lse)

    def zeros_like(self, x, shape=None):
        """A new zero device array for a device array ``x`` (WebGPU zero-initialises
        buffers: no transfer), of ``x``'s shape or ``shape``; a NumPy array for a NumPy
        ``x``."""
        if array_kind(x) != "webgpu":
            return super().zeros_like(x, shape)
        from . import resident

        return resident.zeros(tuple(x.shape) if shape is None else tuple(shape), x.dtype)

    def empty_stats(self, p: Problem, q, mods: ScoreMods) -> RowStats:
        """Statistics of rows that keep no key, as device arrays for device-array inputs
        (written on the device); NumPy arrays for NumPy inputs."""
        if array_kind(q) != "webgpu":
            return super().empty_stats(p, q, mods)
        from . import resident

        return resident.empty_stats(p, mods.sinks)

    def add_arrays(self, a, b):
        """a + b for float32 device arrays of one shape on anyattn's device (the
        ``+`` of DeviceArray, which RowStats.lse uses)."""
        from . import resident

        return resident.add_arrays(a, b)

    # -------------------------------------------------------------- benchmarks
    def plan(self, p: Problem, q, k, v, dout=None, bias=None, mods=NO_MODS):
        """Device-resident forward and backward plans over persistent buffers:
        -> (fwd_plan, bwd_plan, read_fwd, read_bwd); ``plan.submit(n)`` re-runs one
        without any host transfer (the backward reads the forward's out and row
        statistics)."""
        with self.lock:
            call, read_f = self._build_forward(p, q, k, v, bias, uprefix="plan_fu", mods=mods)
            fwd = call.freeze()
            run = call.run
            resident = (self._stats(call), run.buffer("out", 4 * call.n * p.head_dim_v))
            bwd, read_b = None, None
            if dout is not None:
                call, read_b = self._build_backward(p, q, k, v, dout, None, None, bias,
                                                    resident=resident, uprefix="plan_bu",
                                                    mods=mods)
                bwd = call.freeze()
        return fwd, bwd, read_f, read_b

    # --------------------------------------------------------------- seed ABI
    def backward_arena(self, buffer, params) -> None:
        """The seed's result (dQ, dK or dV per ``params.wrt``) into the wgpu ``buffer``.

        ``params``: anyattn.abi.Params, or a tuple of them sharing every input field
        (one plan: statistics and delta once, dK and dV from one pass), already
        validated against the arena by anyattn.abi.attention_backward_arena.  The
        arena is only read by the attention kernels; a last kernel per output writes
        exactly its elements.
        """
        from .abi_bridge import run_arena

        with self.lock:
            run_arena(self, buffer, params)
