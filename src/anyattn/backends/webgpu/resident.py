"""Device-resident calls: anyattn.webgpu device arrays in, device arrays out.

Shape legend: B batch, HQ/HKV heads, SQ/SK queries/keys, D head dim of q and k, DV
head dim of v (and of out / dout), n = B*HQ*SQ.

Nothing crosses to the host: q, k, v, dout, out and a float32 bias are bound where
they lie (their buffer, element offset and b/h/s strides become the kernels'
operands; a D stride != 1 or an f16 bias is first gathered on the device by the
``ew`` kernel); sinks and ALiBi slopes are gathered into the ``aux`` table on the
device; the kernels write the results straight into buffers of the result pool
(pool.py), returned as DeviceArrays: a buffer is handed out again only after every
array over it is gone, so a later call never touches a returned array (f16 results
are cast on the device from f32 scratch).  A call's launch list is cached per
signature (templates.py, ``_key``): a repeat binds its buffers through cached bind
groups and submits, with no uniform write and no Python launch building.  The host
writes only uniforms and ``aux``'s mask tables (band, tile map, document ids, a
KeepMask: masks are host descriptions), the words of score / mask function captures
(NumPy arrays, host descriptions too: uploaded into a buffer of the call's template,
which is keyed by their content digest, ``_programs_key``), plus zeros where the device
fills in slopes/sinks and a score function's device-array captures (float arrays, never
read by the host: copied into the captures buffer by the ``ew`` kernel on every call).
dsinks is reduced on the device (``dsinks`` kernel).  Capture gradients: the only
read-back, the DCAP slot buffer once after the submission (``Template.dcap``), finished
on the host as for NumPy inputs (capture_grads.py).

A plain lse given as a device array cannot be inspected on the host, so it is always
refined (anyattn.rowstats.refine, on the device, one extra forward pass); pass the
RowStats of ``anyattn.api.forward_with_stats`` to skip that pass.
"""
from __future__ import annotations

import dataclasses
from typing import Dict, Tuple

import numpy as np

from ... import settings
from ...modifiers import ScoreMods, alibi_diag
from ...problem import Problem
from ...programs.capture_reads import reads as capture_reads
from ...rowstats import RowStats
from .capture_grads import tile_reads
from .clears import Clear
from .device_array import HOME, DeviceArray, contiguous_strides
from .elementwise import (Seq, buffer_bytes, ew, fresh_buffer, gather_contig, result_array,
                          shape4)
from .engine import ELEMENT_TYPES, LOG_NORM_ROW, STATS_ROWS, Operand
from .launch import DSQ_ROLE, Launch, split_range
from .uniforms import FLAGS

__all__ = ["forward", "backward", "stats_from_lse", "add_arrays", "zeros", "empty_stats",
           "device_reasons"]

_F32 = np.dtype(np.float32)
_I32 = (1 << 31) - 1


# ------------------------------------------------------------------ buffers, views
def _copyable(x) -> bool:
    """A contiguous float32 view of a buffer with COPY_SRC: copy_buffer_to_buffer moves
    it bit for bit (the ``ew`` gather otherwise)."""
    import wgpu

    return (x.dtype == np.float32 and x.is_contiguous and x.size > 0
            and bool(int(x.buffer.usage) & int(wgpu.BufferUsage.COPY_SRC)))


def zeros(shape, dtype):
    """A new zero device array (WebGPU zero-initialises buffers: no transfer)."""
    run = _backend().runner()
    n = int(np.prod(shape, dtype=np.int64))
    buf = fresh_buffer(run, buffer_bytes(n, dtype), "anyattn.zeros")
    return result_array(buf, tuple(shape), dtype)


def _backend():
    """The registry's webgpu backend instance (its runner and lock)."""
    from ..registry import get_backend

    return get_backend("webgpu")


def _check_binding(run, x, name: str) -> None:
    if x.buffer.size > run.max_binding:
        raise ValueError(f"{name}: its buffer has {x.buffer.size} bytes, past this adapter's max "
                         f"storage binding of {run.max_binding} bytes ({run.ctx.name}); the "
                         "webgpu kernels bind whole buffers: use a smaller buffer")


def _operand(seq, x, role: str) -> Operand:
    """A [B, H, S, D] device array as a kernel operand: bound where it lies when its
    D stride is 1 (any b/h/s strides), else gathered contiguous on the device."""
    _check_binding(seq.run, x, role)
    if not (x.shape[3] == 1 or x.strides[3] == 1):
        x = gather_contig(seq, x, f"dev_{role}")
    sb, sh, ss, _ = (0 if n == 1 else s for n, s in zip(x.shape, x.strides))
    return Operand(x.buffer, x.offset, sb, sh, ss)


# ------------------------------------------------------------------ setup of one call
def device_reasons(p: Problem, ctx) -> list:
    if p.array_kind == "webgpu" and p.device != HOME:
        return [f"the arrays live on {p.device}, another wgpu device; anyattn's kernels run "
                f"on its own device ({ctx.name}): create the buffers on "
                "anyattn.webgpu.device()"]
    return []


def _check_chunks(be, p: Problem, backward: bool, bias) -> None:
    chunks = be.batch_chunks(p, backward=backward, bias=None)
    if bias is not None:
        _check_binding(be.runner(), bias, "bias")
    if len(chunks) > 1:
        raise ValueError(f"webgpu: this problem needs {len(chunks)} batch chunks (a buffer past "
                         f"the adapter's max storage binding of {be.runner().max_binding} bytes); "
                         "device arrays run in one piece: split the batch")


def _prepare(be, p: Problem, q, k, v, dout, bias, mods: ScoreMods, backward: bool,
             dcap: int = 0):
    """The Call of one device-resident forward/backward: operands, masks, bias,
    modifiers and dropout; gathers appended to its launches.  ``dcap``: the capture
    reads of a backward with capture gradients (backend.new_call)."""
    call = be.new_call((p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_k), p.head_dim,
                    ELEMENT_TYPES[p.dtype], "dev_u", backward=backward,
                    dropout=p.has_dropout, Dv=p.head_dim_v, dcap=dcap)
    call.aux_role = None          # the mask tables stay with this call's launch template
    run = call.run
    call.set_scale(p.scale)
    call.q = _operand(call, q, "q")
    call.k = _operand(call, k, "k")
    call.v = _operand(call, v, "v")
    if dout is not None:
        call.g = _operand(call, dout, "dout")
    if p.pages is not None:
        call.set_pages(p)
    else:
        call.set_mask(p.mask)
    if bias is not None:
        if bias.dtype != np.float32:
            bias = gather_contig(call, bias, "dev_bias", np.float32)
        sh, st = shape4(bias)
        call.bias_buf = bias.buffer
        call.flags |= FLAGS["HAS_BIAS"]
        call.uni.update(bi_off=bias.offset, bi_sb=st[0], bi_sh=st[1], bi_si=st[2], bi_sj=st[3])
    call.set_mods(p.softcap, None, 0, None)
    call.set_programs(p.score_mod, p.mask.mask_fns or ())
    fills = []
    if mods.alibi_slopes is not None:
        sl = mods.alibi_slopes                           # [Ba, HQ]
        diag = int(alibi_diag(p))
        if abs(diag) + p.seq_q + p.seq_k >= _I32:
            raise ValueError(f"q_offset/k_offset: the ALiBi distance |i - j + {diag}| passes "
                             "the i32 range of the webgpu kernels; bring the offsets closer")
        off = call.aux_put(np.zeros(sl.size, np.uint32))
        call.uni.update(al_off=off, al_sb=p.heads_q if sl.shape[0] > 1 else 0,
                        alibi_diag=diag)
        call.mod_consts["ALIBI"] = 1
        fills.append((sl, off))
    if mods.sinks is not None:
        off = call.aux_put(np.zeros(p.heads_q, np.uint32))
        call.uni["snk_off"] = off
        call.mod_consts["SINKS"] = 1
        fills.append((mods.sinks, off))
    if fills:
        call.aux_upload()
        for x, off in fills:                 # f32 values into aux, on the device
            _check_binding(run, x, "alibi_slopes/sinks")
            ew(call, x, call.aux_buf, off)
    if p.has_dropout:
        call.set_dropout(p.dropout_p, p.dropout_seed, p.q_offset, p.k_offset, 0)
    return call


# ------------------------------------------------------------------ cached calls
class _Results:
    """The result buffers a build takes from the pool and the arrays returned over them."""

    def __init__(self, run):
        self.run, self.bufs, self.labels, self.specs = run, [], [], []

    def new(self, nbytes: int, label: str) -> Tuple[object, int]:
        nbytes = max(16, -(-int(nbytes) // 16) * 16)
        self.run.check_size(label, nbytes)
        self.bufs.append(self.run.results.acquire(nbytes, label))
        self.labels.append(label)
        return self.bufs[-1], len(self.bufs) - 1

    def add(self, name: str, index: int, shape, dtype, offset: int = 0) -> None:
        self.specs.append((name, index, tuple(shape), np.dtype(dtype), int(offset),
                           contiguous_strides(shape)))


_COPY_SRC = []        # int(wgpu.BufferUsage.COPY_SRC), set on first use (wgpu is lazy)


def _sig(x):
    """What of a device array a launch list depends on (not its buffer or data)."""
    if x is None:
        return None
    if not _COPY_SRC:
        import wgpu

        _COPY_SRC.append(int(wgpu.BufferUsage.COPY_SRC))
    return (x.dtype.char, x.shape, x.strides, x.offset,
            bool(int(x.buffer.usage) & _COPY_SRC[0]))


#: a keep mask / document ids of more elements than this make a call uncached (its
#: key would hold the mask's bytes); it is then built anew each time, as before
_MAX_MASK_KEY = 1 << 18


def _mask_key(m):
    from ...arrays import to_numpy

    parts = [m.sq, m.sk, m.band_lo, m.band_hi]
    for a in (m.q_ids, m.k_ids, m.keep):
        if a is None:
            parts.append(None)
            continue
        a = to_numpy(a)
        if a.size > _MAX_MASK_KEY:
            return None
        parts.append((a.dtype.str, a.shape, np.ascontiguousarray(a).tobytes()))
    return tuple(parts)


#: the Problem fields in a key: every one but the mask (``_mask_key``), the score
#: function (``_programs_key``) and the dropout seed (written per call into the
#: template's own uniform blocks: templates.py), taken from the dataclass so that a
#: field added later joins the key by itself
_PROBLEM_FIELDS = tuple(f.name for f in dataclasses.fields(Problem)
                        if f.name not in ("mask", "dropout_seed", "score_mod"))


def _device_captures(p: Problem) -> Dict[str, object]:
    """The score function's device-array captures as call inputs (``capture:<name>``):
    the template copies them into its captures buffer on every call, from the buffers
    this call passes, so a capture updated in place on the device is read as it is."""
    sm = p.score_mod
    if sm is None:
        return {}
    return {f"capture:{n}": x for n, x in sorted(sm.device.items())}


def _programs_key(p: Problem):
    """The score and mask functions of a call as a key part: each bound program's
    structural key, sizes and capture digest (content: a template owns a buffer of its
    captures' words, written when it is recorded, so new captured values make a new
    template over the same pipelines)."""
    progs = ((p.score_mod,) if p.score_mod is not None else ()) + tuple(p.mask.mask_fns or ())
    return tuple((bp.program.key, bp.sizes, bp.digest()) for bp in progs)


def _field_key(v):
    """A Problem field value as a key part: floats by their hex form (0.0 != -0.0),
    sets sorted."""
    if isinstance(v, float):
        return v.hex()
    if isinstance(v, (set, frozenset)):
        return tuple(sorted(v))
    return v


#: id(Problem) -> (the Problem, its fields as a key part): a Problem is frozen, and the
#: core hands the same object back for a repeated signature (problem.describe's memo),
#: so its part of the key is built once; the entry holds the Problem (its id stays its)
_FIELDS_MEMO: Dict[int, tuple] = {}
_FIELDS_MEMO_MAX = 256


def _fields_part(p: Problem):
    """(the Problem fields' key part, the mask's key or None when the mask holds arrays:
    then it is keyed anew per call, ``_mask_key``)."""
    hit = _FIELDS_MEMO.get(id(p))
    if hit is not None and hit[0] is p:
        return hit[1], hit[2]
    part = tuple(_field_key(getattr(p, n)) for n in _PROBLEM_FIELDS)
    m = p.mask
    mk = None
    if m.q_ids is None and m.k_ids is None and m.keep is None:    # band only: ints
        mk = _mask_key(m)
    if len(_FIELDS_MEMO) >= _FIELDS_MEMO_MAX:
        _FIELDS_MEMO.clear()
    _FIELDS_MEMO[id(p)] = (p, part, mk)
    return part, mk


def _key(what: str, be, p: Problem, inputs: Dict[str, object], extra=None):
    """The signature of a device-array call: everything its launch list depends on but
    the buffers (None: not cached, e.g. a large KeepMask or an unhashable field; a
    paged call's key holds its page geometry and per-sequence bands, not its tables:
    its templates are kept in its Pages, ``_template_store``);
    ``extra``: a hashable choice of the build that depends on the inputs (the
    backward's statistics bound in place, ``_stats_in_place``)."""
    if p.pages is not None:     # kept per Pages (``_template_store``): its tables aside
        fields, mk = _paged_fields_part(p), _mask_key(p.mask)
    else:
        fields, mk = _fields_part(p)
    if mk is None:
        mk = _mask_key(p.mask)
        if mk is None:
            return None
    ids = [id(x.buffer) for x in inputs.values() if x is not None]
    alias = tuple(ids.index(i) for i in ids)          # which inputs share a buffer
    key = (what, fields, mk, _programs_key(p),
           tuple((n, _sig(x)) for n, x in inputs.items()), alias, be.config_override,
           be.loop_limit_override, be.debug_trips, settings.current().webgpu_variant, extra)
    try:
        hash(key)
    except TypeError:
        return None
    return key


def _paged_fields_part(p: Problem) -> tuple:
    """The Problem fields' key part of a paged call: its ``pages`` (a PagedKV made anew
    per call) as the page geometry and each sequence's band (``paged.sequence_mask``,
    which depends on the caller's mask, not only on the resolved ``p.mask``).  The
    tables, counts and starts are those of the Pages that keeps the template."""
    from ...paged import sequence_mask

    pk = p.pages
    bands = tuple(sequence_mask(p, b) for b in range(p.batch))
    return tuple(("pages", pk.page_size, pk.num_blocks, bands) if n == "pages"
                 else _field_key(getattr(p, n)) for n in _PROBLEM_FIELDS)


#: the most launch templates one Pages keeps per runner (layers of a decoding step with
#: different windows, modifiers or head sizes)
_PAGED_TEMPLATES_MAX = 8


def _template_store(run, p: Problem):
    """Where the call's launch template is kept: the runner's cache, or for a paged call
    a small cache in its Pages (``Pages.device_cache``, per runner), so the template and
    its ``aux`` table (block table, per-sequence records, tile map) live as long as the
    Pages: a repeated call with the same Pages uploads no table and builds no launch,
    and a new Pages (new lengths or table) records its own.  The tables are those the
    Pages read when it was made (``Pages`` copies them to the host then), so a table
    changed in place after that is not seen by any backend.  ``Runner.clear_caches``
    drops these stores too (``Runner.cache_epoch``)."""
    if p.pages is None:
        return run.templates
    from .templates import TemplateCache

    cache = p.pages.device_cache
    slot = ("webgpu_templates", id(run))
    hit = cache.get(slot)
    if hit is None or hit[0] is not run or hit[1] != run.cache_epoch:
        store = TemplateCache()
        store.MAX = _PAGED_TEMPLATES_MAX
        cache[slot] = hit = (run, run.cache_epoch, store)
    return hit[2]


def _run_cached(be, what: str, p: Problem, inputs: Dict[str, object], build, extra=None):
    """Look the call's launch template up by signature (``build(results)`` records one on
    a miss), bind this call's buffers, submit -> {name: result DeviceArray}."""
    from .templates import Template

    key = _key(what, be, p, inputs, extra)
    run = be.runner()
    bufs = {n: x.buffer for n, x in inputs.items() if x is not None}
    store = _template_store(run, p)
    tpl = store.get(key)
    if tpl is None:
        res = _Results(run)
        try:
            call = build(res)
            tpl = Template.record(run, call, bufs, res.bufs, res.labels, res.specs)
        except BaseException:
            for b in res.bufs:
                run.results.release_unheld(b)
            raise
        store.put(key, tpl)
        rbufs = res.bufs
    else:
        lim = run.max_binding
        for name, x in inputs.items():
            if x is not None and x.buffer.size > lim:
                _check_binding(run, x, name)
        rbufs = tpl.acquire_results(run)
    try:
        tpl.submit(run, bufs, rbufs, seed=p.dropout_seed)
    except BaseException:
        for b in rbufs:
            run.results.release_unheld(b)
        raise
    be.last_pieces = dict(tpl.pieces)
    out = {}
    for name, i, shape, dt, off, strides in tpl.results:
        arr = DeviceArray.root(rbufs[i], shape, dt, strides, off, HOME)
        run.results.hold(rbufs[i], arr)
        out[name] = arr
    if tpl.dcap is not None:
        out["dcap_sums"] = _dcap_sums(run, p, tpl.dcap)
    return out


def _dcap_sums(run, p: Problem, dcap) -> list:
    """The capture gradient slots of a backward template (``Template.dcap``) read back
    once after its submission (one mapped copy of ``dcs``) and summed per diagonal, row
    or column in float64 (capture_grads.read_sums) -> each read's [B, HQ, X], graph
    order."""
    from .capture_grads import read_sums

    slot, floats, lay, BQ, BK = dcap
    buf = run.buffer(slot[1], slot[2]) if type(slot) is tuple else slot
    flat = run.read(buf, floats)
    return read_sums(flat, lay, p.batch, p.heads_q, p.seq_q, p.seq_k, BQ, BK)


# ------------------------------------------------------------------ forward
def forward(be, p: Problem, q, k, v, bias, mods: ScoreMods):
    """-> (out [B, HQ, SQ, DV] in q's dtype, RowStats of [B, HQ, SQ] float32 views).

    out and the statistics are written by the kernels into result buffers (pool.py);
    the row max and log-normaliser are rows 0 and 6 of one [7, n] buffer (the rows in
    between are the kernels' scratch)."""
    inputs = dict(q=q, k=k, v=v, bias=bias, slopes=mods.alibi_slopes, sinks=mods.sinks,
                  **_device_captures(p))

    def build(res):
        _check_chunks(be, p, False, bias)
        call = _prepare(be, p, q, k, v, None, bias, mods, backward=False)
        run = call.run
        n, D = call.n, p.head_dim_v          # out has v's head dim
        shape = (p.batch, p.heads_q, p.seq_q, D)
        rows = (p.batch, p.heads_q, p.seq_q)
        stats, ist = res.new(4 * STATS_ROWS * n, "anyattn.stats")
        if p.dtype == "float16":
            outb = run.buffer("dev_out32", 4 * n * D)
            call.forward(stats, outb)
            o16, iout = res.new(buffer_bytes(n * D, np.float16), "anyattn.out")
            ew(call, result_array(outb, shape, np.float32), o16, 0, dst16=True)
        else:
            outb, iout = res.new(4 * n * D, "anyattn.out")
            call.forward(stats, outb)
        res.add("out", iout, shape, p.dtype)
        res.add("max", ist, rows, np.float32, 0)
        res.add("log_norm", ist, rows, np.float32, LOG_NORM_ROW * n)
        return call

    with be.lock:
        r = _run_cached(be, "fwd", p, inputs, build)
    return r["out"], RowStats(r["max"], r["log_norm"])


def stats_from_lse(be, p: Problem, q, k, v, bias, mods: ScoreMods, lse) -> RowStats:
    """A plain lse device array -> statistics honouring it at full precision
    (anyattn.rowstats.refine against recomputed local statistics, on the device)."""
    _, local = forward(be, p, q, k, v, bias, mods)
    run = be.runner()
    n = p.batch * p.heads_q * p.seq_q
    out = fresh_buffer(run, 4 * STATS_ROWS * n, "anyattn.stats")
    with be.lock:
        seq = Seq(run)
        ew(seq, lse, out, 0, op="refine", src2=local.max.buffer,
            extra=dict(q_off=0, k_off=LOG_NORM_ROW * n, v_off=LOG_NORM_ROW * n))
        seq.submit()
    rows = (p.batch, p.heads_q, p.seq_q)
    return RowStats(result_array(out, rows, np.float32, 0),
                    result_array(out, rows, np.float32, LOG_NORM_ROW * n))


# ------------------------------------------------------------------ backward
def backward(be, p: Problem, q, k, v, dout, out, stats: RowStats, bias,
             mods: ScoreMods) -> Dict[str, object]:
    """-> {'dq', 'dk', 'dv', 'dbias', 'dsinks'}: device arrays (None where not asked),
    and 'dcaptures' where ``wrt`` names score_mod captures.

    Results in the input dtype are written by the kernels straight into result
    buffers (pool.py; dk and dv share one: dk [B, HKV, SK, D] then dv [B, HKV, SK, DV]);
    other dtypes go through f32 scratch and a cast on the device.  Capture gradients:
    the dK/dV pass compiled with DCAP writes its slots as for NumPy inputs; the slots
    are read back once after the submission and finished on the host (float64,
    capture_grads.finish); each gradient comes back as the kind its capture is: a
    DeviceArray in the capture's dtype for a device-array capture (uploaded), a NumPy
    array for a NumPy capture (a host description of the call, like its mask)."""
    B, HQ, HKV, SQ, SK, D, DV = (p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_k,
                                 p.head_dim, p.head_dim_v)
    want_q, want_k, want_v = "q" in p.wrt, "k" in p.wrt, "v" in p.wrt
    want_b, want_s = "bias" in p.wrt, "sinks" in p.wrt
    dt = np.dtype(p.dtype)
    inputs = dict(q=q, k=k, v=v, dout=dout, out=out, max=stats.max, log_norm=stats.log_norm,
                  bias=bias, slopes=mods.alibi_slopes, sinks=mods.sinks,
                  **_device_captures(p))
    in_place = _stats_in_place(be.runner(), p, inputs)
    wrt_c = p.capture_wrt if p.score_mod is not None else frozenset()
    ng = len(capture_reads(p.score_mod.program, wrt_c)) if wrt_c else 0
    tile = tile_reads(p.score_mod.program, wrt_c) if ng else 0   # pair reads: no tile

    def build(res):
        _check_chunks(be, p, True, bias)
        call = _prepare(be, p, q, k, v, dout, bias, mods, backward=True, dcap=tile)
        run = call.run
        n = call.n
        if ng:                       # capture gradients in the dK/dV pass (DCAP)
            call.set_capture_grads(p.score_mod, wrt_c)

        def dest(name, count, want_dt, role):
            """Where a kernel writes an f32 result: a result buffer when it is returned
            in f32, else f32 scratch (cast by ``emit``)."""
            if want_dt == np.float32:
                return res.new(4 * count, f"anyattn.{name}")
            return run.buffer(role, 4 * count), None

        def emit(name, buf, idx, shape, want_dt, off=0):
            if idx is not None:
                res.add(name, idx, shape, np.float32, off)
                return
            count = int(np.prod(shape))
            y, iy = res.new(buffer_bytes(count, want_dt), f"anyattn.{name}")
            ew(call, result_array(buf, shape, np.float32, off), y, 0, dst16=True)
            res.add(name, iy, shape, want_dt)

        if in_place:                 # the forward's own [7, n] buffer: delta into row 1
            st = stats.max.buffer
        else:
            st = run.buffer("dev_stats", 4 * STATS_ROWS * n)
            for src, row in ((stats.max, 0), (stats.log_norm, LOG_NORM_ROW)):
                if _copyable(src):       # a plain copy: no launch, no new bind group
                    call.copies_before.append((src.buffer, 4 * src.offset, st, 4 * row * n,
                                               4 * n))
                else:
                    ew(call, src, st, row * n)
        # an f16 out is read where it lies by the delta kernel (OUT16), widened exactly
        call.delta(st, _operand(call, out, "out"), out16=out.dtype == np.float16)
        nk, nv = B * HKV * SK * D, B * HKV * SK * DV      # dv from element nk on
        kshape, vshape = (B, HKV, SK, D), (B, HKV, SK, DV)
        if want_k and want_v and dt == np.float16 and not ng and call.out16_ok("bwd_dkdv"):
            # f16 dk, dv written by the dK/dV pass itself into one result buffer (not with
            # DCAP: that pass keeps the f32 output of the NumPy-array path's variant)
            y, iy = res.new(buffer_bytes(nk + nv, dt), "anyattn.dkdv")
            call.dkdv(st, y, True, True, out16=True, dq_next=want_q and not want_b)
            res.add("dk", iy, kshape, dt, 0)
            res.add("dv", iy, vshape, dt, nk)
        elif want_k or want_v:
            kv, ikv = dest("dkdv", nk + nv, dt, "dev_dkdv")
            call.dkdv(st, kv, want_k, want_v, dq_next=want_q and not want_b)
            if ikv is None and want_k and want_v and nk % 4 == 0:
                # f16: one cast for both into one result buffer (dk, dv two views of it, as
                # in f32; dv's offset a whole 8-byte group)
                y, iy = res.new(buffer_bytes(nk + nv, dt), "anyattn.dkdv")
                ew(call, result_array(kv, (nk + nv,), np.float32), y, 0, dst16=True)
                res.add("dk", iy, kshape, dt, 0)
                res.add("dv", iy, vshape, dt, nk)
            else:
                for name, want, off, shape in (("dk", want_k, 0, kshape),
                                               ("dv", want_v, nk, vshape)):
                    if want:
                        emit(name, kv, ikv, shape, dt, off)
        elif ng:                     # the pass for the capture gradients alone
            call.dkdv(st, run.buffer("dev_dkdv", 4 * (nk + nv)), False, False,
                      dq_next=want_q and not want_b)
        dsb = ids = None
        full = want_b and tuple(p.bias_shape) == (B, HQ, SQ, SK)
        bdt = np.dtype(p.bias_dtype) if want_b else None
        if want_b:                   # dS: the dbias result, or the shared dS scratch
            if full:
                dsb, ids = dest("dbias", B * HQ * SQ * SK, bdt, DSQ_ROLE)
            else:
                dsb = run.buffer(DSQ_ROLE, 4 * B * HQ * SQ * SK)
            call.clears.append(Clear(dsb, 4 * B * HQ * SQ * SK))
        if want_q and dt == np.float16 and call.out16_ok("bwd_dq"):
            # f16 dQ written by the dQ pass itself (no f32 scratch, no cast launch)
            y, iy = res.new(buffer_bytes(n * D, dt), "anyattn.dq")
            call.dq(st, y, dsb, out16=True)
            res.add("dq", iy, (B, HQ, SQ, D), dt)
        elif want_q or want_b:
            if want_q:
                dqb, idq = dest("dq", n * D, dt, "dev_dq")
            else:
                dqb, idq = run.buffer("dev_dq", 4 * n * D), None
            call.dq(st, dqb, dsb)
            if want_q:
                emit("dq", dqb, idq, (B, HQ, SQ, D), dt)
        if want_b:
            if full:
                emit("dbias", dsb, ids, p.bias_shape, bdt)
            else:
                numel = int(np.prod(p.bias_shape))
                dbb, idb = dest("dbias", numel, bdt, "dev_dbias")
                call.reduce_dbias(dsb, dbb, tuple(p.bias_shape))
                emit("dbias", dbb, idb, p.bias_shape, bdt)
        if want_s:
            sdt = np.dtype(p.sinks_dtype)
            dsk, isk = dest("dsinks", HQ, sdt, "dev_dsinks")
            _dsinks(call, st, dsk)
            emit("dsinks", dsk, isk, (HQ,), sdt)
        return call

    with be.lock:
        r = _run_cached(be, "bwd", p, inputs, build, extra=in_place)
    res = {name: r.get(name) for name in ("dq", "dk", "dv", "dbias", "dsinks")}
    if wrt_c:
        res["dcaptures"] = _dcaptures(p, r.get("dcap_sums"))
    return res


def _dcaptures(p: Problem, sums) -> Dict[str, object]:
    """{capture: gradient} from each read's sums (capture_grads.finish): a device-array
    capture's gradient uploaded as a DeviceArray in its dtype, a NumPy capture's NumPy."""
    from .capture_grads import finish
    from ...webgpu import asarray

    grads = finish(p.score_mod, p.capture_wrt, sums or [],
                   (p.batch, p.heads_q, p.seq_q, p.seq_k))
    dev = p.score_mod.device
    return {n: asarray(x) if n in dev else x for n, x in grads.items()}


def _stats_in_place(run, p: Problem, inputs: Dict[str, object]) -> bool:
    """Whether the backward binds the statistics' buffer itself as its [7, n] stats
    scratch (no copies): the RowStats of a device-array forward — max and log_norm rows 0
    and 6 of one result buffer of this runner's pool, contiguous — whose buffer no
    ``from_buffer`` claimed and no other input shares.  The backward then writes delta
    into row 1, which no array the pool handed out covers (rows 1-5 are the kernels'
    scratch); the results are bitwise those of the copying path."""
    mx, ln = inputs["max"], inputs["log_norm"]
    buf = mx.buffer
    rows = (p.batch, p.heads_q, p.seq_q)
    n = rows[0] * rows[1] * rows[2]
    if not (ln.buffer is buf and mx.offset == 0 and ln.offset == LOG_NORM_ROW * n
            and mx.shape == rows and ln.shape == rows
            and mx.dtype == _F32 and ln.dtype == _F32
            and (mx.strides == ln.strides == (rows[1] * rows[2], rows[2], 1)
                 or (mx.is_contiguous and ln.is_contiguous))
            and buf.size >= 4 * STATS_ROWS * n and run.results.owns(buf)):
        return False
    return not any(x is not None and x.buffer is buf for name, x in inputs.items()
                   if name not in ("max", "log_norm"))


def _dsinks(call, st, dst) -> None:
    """dsinks [HQ] from the row statistics and delta in ``st`` (after the delta pass)."""
    run = call.run
    rows = call.B * call.SQ
    pieces = split_range(rows, 1, call.limit, "webgpu kernel 'dsinks'")
    pipe = run.pipeline("dsinks", "dsinks", {}, "f32")
    for idx, (t0, t1) in enumerate(pieces):
        ubuf = call.uniform_buffer(dict(call.uni, t0=t0, t1=t1, flags=FLAGS["FIRST"] if idx == 0 else 0,
                            k_off=LOG_NORM_ROW * call.n, out2_off=0))
        call.launches.append(Launch("dsinks", pipe, "dsinks", [ubuf, st, call.aux_buf, dst],
                                    run.flat_grid(call.HQ)))


# ------------------------------------------------------------------ small helpers
def add_arrays(a, b):
    """a + b for float32 device arrays of one shape on anyattn's device (RowStats.lse)."""
    for name, x in (("left", a), ("right", b)):
        if x.dtype != np.float32:
            raise TypeError(f"DeviceArray +: the {name} operand is {x.dtype.name}; only "
                            "float32 device arrays add")
        if x.device != HOME:
            raise ValueError(f"DeviceArray +: the {name} operand lives on {x.device}, not "
                             "anyattn's device webgpu:0")
    if tuple(a.shape) != tuple(b.shape):
        raise ValueError(f"DeviceArray +: shapes {a.shape} and {b.shape} differ")
    be = _backend()
    with be.lock:
        run = be.runner()
        seq = Seq(run)
        if not b.is_contiguous:
            b = gather_contig(seq, b, "dev_add_b")
        out = fresh_buffer(run, 4 * a.size, "anyattn.add")
        ew(seq, a, out, 0, op="add", src2=b.buffer, extra=dict(q_off=b.offset))
        seq.submit()
    return result_array(out, a.shape, np.float32)


def empty_stats(p: Problem, sinks) -> RowStats:
    """Statistics of rows that keep no key (Sk = 0): max = -inf (the sink, with sinks),
    log_norm = 0."""
    be = _backend()
    run = be.runner()
    rows = (p.batch, p.heads_q, p.seq_q)
    n = int(np.prod(rows))
    mx = fresh_buffer(run, 4 * n, "anyattn.stats")
    ln = fresh_buffer(run, 4 * n, "anyattn.stats")
    seq = Seq(run)
    if sinks is not None:
        src = sinks if sinks.dtype == np.float32 else gather_contig(seq, sinks, "dev_snk",
                                                                    np.float32)
        ew(seq, src, mx, 0, shape=rows, strides=(0, src.strides[0], 0))
    else:
        ew(seq, _neg_inf(run), mx, 0, shape=rows, strides=(0, 0, 0))
    with be.lock:
        seq.submit()
    return RowStats(result_array(mx, rows, np.float32), result_array(ln, rows, np.float32))


def _neg_inf(run):
    """A one-element device array holding -inf (a constant written once per device)."""
    buf = run.role_buffers.get("_neg_inf")
    if buf is None:
        buf = run.buffer("_neg_inf", 16)
        run.device.queue.write_buffer(buf, 0, np.full(4, -np.inf, np.float32))
    return result_array(buf, (1,), np.float32)
