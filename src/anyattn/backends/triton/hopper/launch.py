"""Launch code of the Hopper path: TMA descriptors over the callers' strides, grids.

Shape legend: B batch, H query heads, Hkv kv heads, G = H / Hkv, Sq / Sk queries / keys,
D head dim.  Only problems that coverage.uncovered() accepts arrive here (the route,
backends/triton/route.py, decides first); the checks below are the descriptors' own.

Host cost: a TMA descriptor is a small host object (the tensor, its shape and strides,
the block and the shared-memory layout); Triton's launcher encodes the CUDA tensor map
from it at every launch (``fill_tma_descriptor`` of ``base.data_ptr()``), so nothing
about an address outlives a launch.  Building one through ``TensorDescriptor`` is slow
on the host (the layout's constexpr functions and the validation), four per forward;
``make_desc`` keeps what a descriptor holds besides its tensor per (shape, strides,
dtype, block rows, 16-byte alignment) -- every input of that validation and layout --
and attaches the call's tensor to it.  ``prepare_forward`` keeps the
rest of a forward launch (config, grid, scalars, constexprs) for prepared.py's prepared
launches (one per call signature).
"""
from __future__ import annotations

import collections
import dataclasses
import types
from typing import Optional

import torch

from ....rowstats import RowStats
from ..device_ctx import on_device
from .. import mask_inputs as MI
from .. import tiles
from ..route import sm_count
from . import configs as HC

__all__ = ["make_desc", "forward", "prepare_forward", "FwdLaunch", "mask_arrays", "mod_kw",
           "persist_schedule", "dkdv", "bwd_mask_tables", "BwdMaskTables",
           "backward_fused", "dqa_desc", "dq_order"]

_BIG = 1 << 30
LOG2E = 1.4426950408889634


def _cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints (host code: triton.cdiv is a constexpr function, many times
    slower per call)."""
    return -(-a // b)


def _band(rm) -> tuple:
    """The band of mask rm as the kernels' (lo, hi): clipped to +-2^30, open sides
    +-2^30."""
    return (-_BIG if rm.band_lo is None else max(int(rm.band_lo), -_BIG),
            _BIG if rm.band_hi is None else min(int(rm.band_hi), _BIG))


def _gl_dtype(dt):
    from triton.experimental.gluon import language as gl

    return {torch.bfloat16: gl.bfloat16, torch.float16: gl.float16}[dt]


def _tma_strides(x):
    """x's strides with those of size-1 dims replaced by a valid TMA stride (unused:
    the copy engine wants every stride but the last a positive multiple of 16 bytes)."""
    st = list(x.stride())
    for i in range(len(st) - 2, -1, -1):
        if x.shape[i] == 1:
            st[i] = st[i + 1] * max(1, x.shape[i + 1]) if i + 1 < len(st) - 1 else 16
            st[i] = max(st[i], 16 // x.element_size())
    return st


def _new_desc(x, rows: int):
    """A 4-D TMA descriptor over x [B, H, S, D] with blocks [1, 1, rows, D], built and
    validated by TensorDescriptor itself."""
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    block = [1, 1, rows, x.shape[3]]
    layout = gl.NVMMASharedLayout.get_default_for(block, _gl_dtype(x.dtype))
    return TensorDescriptor(x, list(x.shape), _tma_strides(x), block, layout)


#: (shape, strides, dtype, rows, 16-byte aligned) -> (TensorDescriptor class, its fields
#: but the tensor): every input of the descriptor's validation and layout, none of them
#: a tensor or an address (the base is the call's own, attached in make_desc)
_desc_parts: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()
_DESC_PARTS = 256


def desc_key(x, rows: int) -> tuple:
    """What a descriptor over x with ``rows``-row blocks depends on besides x's address
    (of which only the 16-byte alignment matters)."""
    return (x.shape, x.stride(), x.dtype, rows, x.data_ptr() % 16 == 0)


def make_desc(x, rows: int):
    """A 4-D TMA descriptor over x [B, H, S, D] with blocks [1, 1, rows, D]: the one
    ``TensorDescriptor(x, ...)`` builds (validated there on a key's first call), its
    non-tensor fields reused per ``desc_key``, the tensor always x itself."""
    return _cached_desc(desc_key(x, rows), x, rows, _new_desc)


def _cached_desc(key, x, rows: int, build):
    """build(x, rows) on a key's first call; later the same fields over x (see
    make_desc)."""
    hit = _desc_parts.get(key)
    if hit is None:
        d = build(x, rows)
        fields = dict(d.__dict__)
        del fields["base"]
        _desc_parts[key] = hit = (type(d), fields)
        try:                     # oldest out; another thread may pop meanwhile
            while len(_desc_parts) > _DESC_PARTS:
                _desc_parts.popitem(last=False)
        except KeyError:
            pass
        return d
    cls, fields = hit
    d = cls.__new__(cls)        # a plain dataclass: the same fields, no re-validation
    d.__dict__.update(fields)
    d.base = x
    return d


#: (tensor keys of q_ids / k_ids, Sq, Sk, device) -> (interval table or None, mask
#: tensors) of Documents masks (mask_arrays, _by_mask)
_doc_cache: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()
_DOC_CACHE = 16
_dummies: dict = {}


def _dummy(dev, dtype):
    """A one-element placeholder tensor (pointer arguments the kernel does not read)."""
    key = (str(dev), dtype)
    t = _dummies.get(key)
    if t is None:
        t = _dummies[key] = torch.zeros(1, dtype=dtype, device=dev)
    return t


def _doc_intervals(qid, kid, k_sorted: bool):
    """Documents with k ids sorted along each batch row (k_sorted: mask_inputs.kernel_ids):
    per query its document as the key interval [first, one past the last) -> int32
    [Bd, 2, Sq] (an empty interval where no key shares its id); None where some row's
    k ids are not sorted.  qid [Bq, Sq], kid [Bk, Sk] int32 on the device, Bq / Bk 1 or
    Bd."""
    if not k_sorted:
        return None
    bd = max(qid.shape[0], kid.shape[0])
    ks = kid.expand(bd, -1).contiguous()
    qs = qid.expand(bd, -1).contiguous()
    first = torch.searchsorted(ks, qs, right=False)                   # [Bd, Sq]
    last = torch.searchsorted(ks, qs, right=True)
    return torch.stack([first, last], 1).to(torch.int32).contiguous()


def mask_arrays(p, q, cfg) -> tuple:
    """The Documents / KeepMask arguments of the warp-specialised forward for Problem p
    (its call's mask contents): (RT, rt_b, rt_h, QID, KID, sqid_b, skid_b, KM, skm_b,
    skm_h, skm_q, skm_k, DOCS).  RT: the block-range table at the kernel's tile
    (cfg.bm x cfg.bn; tiles.block_ranges, cached with the portable tile lists);
    DOCS 2 (k ids sorted in every row: each query's document as a key interval,
    [Bd, 2, Sq]) or 1 (ids compared per edge tile), 0 without documents.  Cached per
    mask tensors (identity and version counter: an in-place write is a new mask) where
    every mask array is a torch tensor."""
    return _by_mask(_marr_cache, _mask_key(p, q, cfg.bm, cfg.bn), p.mask,
                    lambda: _mask_arrays(p, q, cfg))


def _mask_key(p, q, *extra):
    """The cache key of p's mask arrays: their tensor keys (identity and version counter:
    an in-place write is a new mask), the band, the shape, the device and ``extra``; None
    where some mask array is not a torch tensor (not cached)."""
    rm = p.mask
    parts = (MI.tensor_key(rm.keep), MI.tensor_key(rm.q_ids), MI.tensor_key(rm.k_ids))
    if None in parts:
        return None
    return (parts, rm.band_lo, rm.band_hi, p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_k,
            str(q.device)) + extra


def _by_mask(cache, key, rm, build):
    """build() once per key while it is among the newest _DOC_CACHE of ``cache`` (key
    None: every call), the mask tensors of rm held beside the result so that the memory
    the key names stays theirs."""
    hit = cache.get(key) if key is not None else None
    if hit is None:
        hit = (build(), (rm.keep, rm.q_ids, rm.k_ids))
        if key is not None:
            cache[key] = hit
            while len(cache) > _DOC_CACHE:
                cache.popitem(last=False)
    return hit[0]


#: mask_arrays' results per (mask tensors' identity and version, band, shape, device,
#: tile): a repeated call with the same mask tensors costs one lookup
_marr_cache: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()


def _mask_arrays(p, q, cfg) -> tuple:
    """mask_arrays without its cache."""
    dev = q.device
    ma = tiles.mask_args(p, q, None)
    ma = dataclasses.replace(ma, mode=2)
    tl = tiles.lists_for(p, ma, types.SimpleNamespace(sbq=cfg.bm, sbk=cfg.bn), dev)
    rt_b, rt_h = tl.row_strides()[:2]
    docs, qid, kid, sqid_b, skid_b = 0, _dummy(dev, torch.int32), ma.kid, 0, 0
    if ma.has_docs:
        rm = p.mask
        parts = (MI.tensor_key(rm.q_ids), MI.tensor_key(rm.k_ids))
        key = None if None in parts else (parts, p.seq_q, p.seq_k, str(dev))
        iv = _by_mask(_doc_cache, key, rm,
                      lambda: _doc_intervals(ma.qid, ma.kid, ma.ids_sorted[1]))
        if iv is not None:
            docs, qid, sqid_b = 2, iv, (2 * p.seq_q if iv.shape[0] > 1 else 0)
        else:
            docs, qid, kid, sqid_b, skid_b = 1, ma.qid, ma.kid, ma.sqid_b, ma.skid_b
    return (tl.row_cnt, rt_b, rt_h, qid, kid, sqid_b, skid_b, ma.km, *ma.skm, docs)


#: ALiBi distances |i - j + adiag| the kernels compute exactly (fwd_masks.alibi_dist), the
#: tiles' padding rows / keys included (the 256 of mod_kw's check)
ALIBI_MAX_DIST = 1 << 22


def _mod_flags(p) -> dict:
    """The score modifiers' constexprs of Problem p for the Hopper kernels (forward:
    SOFTCAP, ALIBI, HAS_SINKS; empty where p has none)."""
    on = dict(SOFTCAP=p.softcap is not None, ALIBI=bool(p.has_alibi),
              HAS_SINKS=bool(p.has_sinks))
    return on if any(on.values()) else {}


def mod_kw(p, mods, dev, sinks: bool = True) -> dict:
    """The keyword arguments of p's score modifiers for a Hopper kernel: the constexprs
    and SLOPES fp32 [Ba, H], sl_b, cap, adiag (``sinks``: SINKS fp32 [H] and HAS_SINKS,
    the forward's) from the call's ScoreMods ``mods`` (operands.mod_args: placeholders
    for the ones off); {} where p has none.  NotImplementedError for an array mask
    (Documents / KeepMask: the modifiers run on the no-mask / band kernels only)."""
    flags = _mod_flags(p)
    if not sinks:
        flags.pop("HAS_SINKS", None)
    if not any(flags.values()):
        return {}
    if _is_array(p):
        raise NotImplementedError("the Hopper kernels take score modifiers with no mask or "
                                  f"a band only, got mask class {p.mask_class}")
    from .. import operands

    for on, name, field in ((flags.get("ALIBI"), "ALiBi slopes", "alibi_slopes"),
                            (flags.get("HAS_SINKS"), "sinks", "sinks")):
        if on and getattr(mods, field, None) is None:
            raise ValueError(f"mods: the problem has {name} but the ScoreMods passed carry "
                             f"no {field}; pass the call's ScoreMods")
    md = operands.mod_args(p, mods, dev, draw=False)
    if flags.get("ALIBI") and max(p.seq_q, p.seq_k) + abs(md.adiag) + 256 > ALIBI_MAX_DIST:
        raise NotImplementedError(
            f"the Hopper kernels' ALiBi distances are exact below 2^22 "
            f"(fwd_masks.alibi_dist), got Sq {p.seq_q}, Sk {p.seq_k}, offset {md.adiag}; "
            "use ANYATTN_TRITON_PATH=portable")
    kw = dict(flags, SLOPES=md.slopes, sl_b=md.sl_b, cap=md.cap, adiag=md.adiag)
    if sinks:
        kw["SINKS"] = md.sink_t
    return kw


class FwdLaunch:
    """One forward launch of a call signature (prepare_forward): config, grid, scalars,
    constexprs and output shapes; called with the call's q, k, v [B, H(kv), S, D] it
    allocates out [B, H, Sq, D] and stats [2, B, H, Sq] and launches.  Holds no
    tensor.  ``direct``: repeats replay the compiled kernel (direct.Site).  Score
    modifiers (p.softcap, ALiBi slopes, sinks): their arguments come with each call
    (``mods``; mod_kw)."""

    def __init__(self, p, cfg, direct: bool = False):
        from .. import direct as DL

        B, H, Sq, Sk, D = p.batch, p.heads_q, p.seq_q, p.seq_k, p.head_dim
        rm_ = p.mask
        lo, hi = _band(rm_)
        self.cfg = cfg
        #: Documents / KeepMask: their arrays per call (mask_arrays)
        self.array = _is_array(p)
        self.out_shape, self.stats_shape = (B, H, Sq, D), (2, B, H, Sq)
        self.grid = (-(-Sq // cfg.bm), B * H)
        self.args = (H, p.group, Sq, Sk, p.scale * LOG2E, p.scale, lo, hi)
        self.sched = None     # persist + sched: persist_schedule's key (no tensor held)
        if cfg.persist:   # one program per SM walking the cdiv(Sq, bm) * B * H tiles
            from .fwd_persist_kernel import fwd_persist_kernel

            self.kernel, self.q_rows = fwd_persist_kernel, cfg.bm // cfg.consumers
            self.grid = (min(sm_count(str(p.device)), self.grid[0] * self.grid[1]),)
            if self.array:
                raise NotImplementedError(
                    f"{cfg.name}: the host-built schedule takes band masks only (Documents / "
                    "KeepMask key ranges are per call); use the per-tile config")
            # without a band every tile's loop is as long: the greedy schedule is the
            # kernel's own head-major round robin (same walk): no schedule there
            if rm_.has_band:
                self.sched = (Sq, Sk, lo, hi, cfg.bm, cfg.bn, B * H, self.grid[0])
                # under CUDA graph capture a schedule not built yet cannot be copied to
                # the device (a host copy): that call runs the per-tile kernel of the
                # same loop instead, whose results are bitwise the same
                self.per_tile = FwdLaunch(p, cfg.per_tile(), direct)
            self.kw = dict(HAS_BAND=bool(rm_.has_band), STAGES=cfg.stages,
                           CONSUMER_REGS=cfg.consumer_regs, num_warps=4)
        else:    # 2 or 3 consumer warpgroups of 64 rows each, one producer warp
            from .fwd_ws_kernel import fwd_ws_kernel

            self.kernel, self.q_rows = fwd_ws_kernel, cfg.bm // cfg.consumers
            self.kw = dict(HAS_BAND=bool(rm_.has_band), STAGES=cfg.stages,
                           CONSUMER_REGS=cfg.consumer_regs, NC=cfg.consumers, num_warps=4,
                           ARRAY=self.array,
                           HAS_KEEP=rm_.keep is not None)
        #: the score modifiers (the call's ScoreMods carry their tensors): any on
        self.mods = bool(_mod_flags(p))
        if self.mods and self.array:
            raise NotImplementedError("the Hopper forward takes score modifiers with no "
                                      f"mask or a band only, got mask class {p.mask_class}")
        #: the launch (Triton's path, or with ``direct`` the resolved kernel's replays)
        self.site = DL.Site(self.kernel, direct)

    def _tail(self, dev) -> tuple:
        """The persistent kernel's arguments after the mask arrays: (B * H, SCH) (SCH the
        schedule, or a placeholder where it walks its own order); () otherwise."""
        if not self.cfg.persist:
            return ()
        sch = (persist_schedule(*self.sched, device=dev) if self.sched is not None
               else _dummy(dev, torch.int32))
        if self.sched is not None and dev.type == "cuda" \
                and torch.cuda.is_current_stream_capturing():
            _sched_pinned[tuple(self.sched) + (str(dev),)] = sch   # the graph reads it
        return (self.out_shape[0] * self.out_shape[1], sch)

    def mask_args(self, q, p=None):
        """-> (the kernel's mask-array arguments after the scalars, its keywords) for
        this call: mask_arrays() of p's Documents / KeepMask, else placeholders (not
        read), then the persistent kernel's (B * H, SCH)."""
        if self.array:
            if p is None:
                raise ValueError("a Documents / KeepMask forward needs the call's Problem "
                                 "(p=) for its mask arrays")
            *marr, docs = mask_arrays(p, q, self.cfg)
            return tuple(marr) + self._tail(q.device), dict(self.kw, DOCS=docs)
        i32, u8 = _dummy(q.device, torch.int32), _dummy(q.device, torch.uint8)
        return (i32, 0, 0, i32, i32, 0, 0, u8, 0, 0, 0, 0) + self._tail(q.device), self.kw

    def __call__(self, q, k, v, out=None, stats=None, p=None, mods=None):
        """-> out, RowStats(max, log_norm) (see forward).  ``p``: the call's Problem,
        needed where its mask is Documents / KeepMask (their contents are per call) or it
        has score modifiers, whose tensors come in ``mods`` (ScoreMods)."""
        dev = q.device
        if self.sched is not None and not schedule_ready(*self.sched, device=dev) \
                and torch.cuda.is_current_stream_capturing():
            return self.per_tile(q, k, v, out, stats, p, mods)
        if out is None:
            out = torch.empty(self.out_shape, dtype=q.dtype, device=dev)
        if stats is None:
            stats = torch.empty(self.stats_shape, dtype=torch.float32, device=dev)
        rq, rk = self.q_rows, self.cfg.bn
        marr, kw = self.mask_args(q, p)
        if self.mods:
            if p is None:
                raise ValueError("a forward with score modifiers needs the call's Problem "
                                 "(p=) and ScoreMods (mods=)")
            kw = dict(kw, **mod_kw(p, mods, dev))
        with on_device(dev):
            self.site(self.grid, (make_desc(q, rq), make_desc(k, rk), make_desc(v, rk),
                                  make_desc(out, rq), stats, *self.args, *marr), kw)
        return out, RowStats(stats[0], stats[1])


def _band_key_tiles(Sq, Sk, lo, hi, bm, bn):
    """Key tiles per query tile of bm rows under lo <= j - i <= hi (bn-key tiles; the
    kernel's key_tile_range, t1 - t0) -> int64 [cdiv(Sq, bm)]."""
    import numpy as np

    i0 = np.arange(-(-Sq // bm), dtype=np.int64) * bm
    i1 = np.minimum(i0 + bm, Sq)
    t0 = np.maximum(i0 + lo, 0) // bn
    t1 = np.minimum(-(-Sk // bn), (np.maximum(i1 + hi, 0) + bn - 1) // bn)
    return np.maximum(t0, t1) - t0


#: persist_schedule's tensors per (its arguments, device)
_sched_cache: "collections.OrderedDict[tuple, torch.Tensor]" = collections.OrderedDict()
_SCHED_CACHE = 32
#: the schedules a CUDA-graph capture has launched with, never evicted: a captured graph
#: reads its schedule's memory at every replay, after _sched_cache may have dropped it
_sched_pinned: "dict[tuple, torch.Tensor]" = {}


def schedule_ready(Sq, Sk, lo, hi, bm, bn, BH, P, device="cpu", tile_cost=1) -> bool:
    """Whether persist_schedule's tensor for these arguments is built (cached)."""
    return (Sq, Sk, lo, hi, bm, bn, BH, P, str(device), tile_cost) in _sched_cache


def persist_schedule(Sq, Sk, lo, hi, bm, bn, BH, P, device="cpu", tile_cost=1):
    """The persistent forward's walk (fwd_persist_kernel, HAS_BAND) for a band lo <= j - i
    <= hi: the per-tile grid's launch order (head by head, each head's query tiles
    longest first) dealt out greedily, each tile to the program that is free first
    (ties: the lowest), a tile costing its key tiles + ``tile_cost`` (Q load, epilogue)
    -- the hardware's dispatch of the per-tile grid, so the live programs share heads in
    L2 as its blocks do.  -> int32 [P + 1 + T] on ``device``: program p walks entries
    [P + 1 + s[p], P + 1 + s[p + 1]) of tile ids bh * n_m + pid_m.  Cached."""
    import heapq

    import numpy as np

    key = (Sq, Sk, lo, hi, bm, bn, BH, P, str(device), tile_cost)
    hit = _sched_cache.get(key)
    if hit is not None:
        return hit
    n = _band_key_tiles(Sq, Sk, lo, hi, bm, bn)
    n_m = len(n)
    order = [(bh, n_m - 1 - x) for bh in range(BH) for x in range(n_m)]
    free = [(0, w) for w in range(P)]
    walks = [[] for _ in range(P)]
    for bh, m in order:
        t, w = heapq.heappop(free)
        walks[w].append(bh * n_m + m)
        heapq.heappush(free, (t + int(n[m]) + tile_cost, w))
    offs = np.cumsum([0] + [len(x) for x in walks])
    flat = np.concatenate([offs, np.fromiter((i for x in walks for i in x), np.int64,
                                             count=int(offs[-1]))]).astype(np.int32)
    out = torch.from_numpy(flat).to(device)
    _sched_cache[key] = out
    while len(_sched_cache) > _SCHED_CACHE:
        _sched_cache.popitem(last=False)
    return out


def prepare_forward(p, cfg=None, direct: bool = False) -> FwdLaunch:
    """The forward launch of Problem p (configs.fwd_config(D, mask class) unless
    ``cfg``); ``direct``: its repeats replay the compiled kernel (direct.Site)."""
    return FwdLaunch(p, HC.fwd_config(p.head_dim, p.mask_class) if cfg is None else cfg,
                     direct)


def forward(p, q, k, v, out=None, stats=None, cfg=None, prepared: Optional[FwdLaunch] = None,
            mods=None):
    """-> out [B, H, Sq, D] (q's dtype, contiguous), RowStats(max, log_norm) [B, H, Sq]
    fp32, as launch.forward returns them.  ``out`` / ``stats`` ([2, B, H, Sq] fp32):
    preallocated buffers to write (tests poison them); fresh ones when None.  ``cfg``: a
    HopperConfig other than configs.fwd_config(D) (a test / bench hook: the route never
    passes one).
    ``prepared``: ``prepare_forward(p, cfg)`` kept by the caller for p's call signature
    (prepared.py's prepared launches), else built here.  ``mods``: the call's ScoreMods
    (ALiBi slopes, sinks; p.softcap is the cap)."""
    if prepared is not None:
        if cfg is not None and cfg != prepared.cfg:
            raise ValueError(f"cfg {cfg.name} differs from the prepared launch's "
                             f"{prepared.cfg.name}")
        if out is None and stats is None:
            return prepared(q, k, v, p=p, mods=mods)
    B, H, Sq, D = p.batch, p.heads_q, p.seq_q, p.head_dim
    for x, name, shape, dt in ((out, "out", (B, H, Sq, D), q.dtype),
                               (stats, "stats", (2, B, H, Sq), torch.float32)):
        if x is not None and (tuple(x.shape) != shape or not x.is_contiguous()
                              or x.dtype != dt):
            raise ValueError(f"{name} {tuple(x.shape)} {x.dtype}: expected contiguous "
                             f"{list(shape)} {dt}")
    return (prepared or prepare_forward(p, cfg))(q, k, v, out, stats, p=p, mods=mods)


class BwdMaskTables:
    """The Documents / KeepMask arguments of the warp-specialised backward kernels
    (bwd_mask_tables), per (b, kv head) of the mask's batch / head broadcast (Bm, Hm:
    1 where it does not vary; Hm = Hkv where a KeepMask varies over heads: the tables
    of a kv head cover its query-head group).

    ct int32 [Bm, Hm, nkv, 8]: per key tile (s0, g0, g1, s1, off, 0, 0, 0): every
    query tile that a query of some head of the group keeps with a key of the tile lies
    in [s0, s1); those in [g0, g1) are fully kept by every head of the group (no mask
    code); the key tile visits its range from index off on (the diagonal first, as the
    dense kernels' rotated order does).  rk int32 [Bm, Hm, nq, nkv]: the rank of key
    tile j among the key tiles whose range holds query tile t, ordered by (the step at
    which j visits t, j): the dQ adds' order (bwd_ws_dq_kernel, ARRAY).  kw_visits:
    dq_convert_kernel's keywords for the visits table int8 [Bm, Hm, nq] (whether some
    key tile's range holds query tile t: the accumulator is not zeroed, the conversion
    writes 0 where none does; a device table, so a new mask costs no host read).  kw:
    bwd_ws_kernel's keyword arguments (the range table, the mask arrays and their
    strides, ARRAY / DOCS / HAS_KEEP); kw_dq: bwd_ws_dq_kernel's (kw and the rank
    table)."""

    def __init__(self, ct, rk, kw_visits: dict, kw: dict, kw_dq: dict):
        self.ct, self.rk, self.kw_visits, self.kw, self.kw_dq = ct, rk, kw_visits, kw, kw_dq


#: bwd_mask_tables' results per (mask tensors' identity and version, band, shape,
#: device, tile)
_bwd_tab_cache: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()


def bwd_mask_tables(p, q, bm: int = 64, bn: int = 128) -> BwdMaskTables:
    """The column range table, the dQ rank table and the mask arrays of p's Documents /
    KeepMask for the warp-specialised backward at its tile (bn keys per program, bm
    queries per step): BwdMaskTables.  Built from the tile occupancy that the portable
    kernels' and the forward's tables come from (triton/tiles.py tile_lists at bm x bn,
    range mode: its column table), reduced over each kv head's query-head group; cached
    per mask tensors as mask_arrays is."""
    return _by_mask(_bwd_tab_cache, _mask_key(p, q, bm, bn), p.mask,
                    lambda: _bwd_mask_tables(p, q, bm, bn))


def _group_columns(cr, G: int):
    """Column range tables int32 [Bm, H, nkv, 4] (t0, f0, f1, t1 per query head; all 0
    where a column keeps nothing) -> [Bm, H / G, nkv, 4] of each group of G heads: the
    union of the ranges, the intersection of the full runs (empty: at s0)."""
    bm_, hm, nkv, _ = cr.shape
    x = cr.reshape(bm_, hm // G, G, nkv, 4)
    t0, f0, f1, t1 = x.unbind(-1)                                     # [Bm, Hkv, G, nkv]
    nonempty = t1 > 0
    big = torch.iinfo(torch.int32).max
    s0 = torch.where(nonempty, t0, big).amin(2)                        # [Bm, Hkv, nkv]
    s1 = t1.amax(2)
    s0 = torch.where(s1 > 0, s0, 0)
    g0, g1 = f0.amax(2), f1.amin(2)
    ok = nonempty.all(2) & (g1 > g0)
    g0, g1 = torch.where(ok, g0, s0), torch.where(ok, g1, s0)
    return torch.stack([s0, g0, g1, s1], -1)


def _bwd_mask_tables(p, q, bm: int, bn: int) -> BwdMaskTables:
    """bwd_mask_tables without its cache."""

    dev = q.device
    # the mask arrays (and the tile lists at bm x bn behind them, cached there)
    (_, _, _, iv, kid, siv_b, skid_b, km, skm_b, skm_h, skm_q, skm_k,
     docs) = mask_arrays(p, q, types.SimpleNamespace(bm=bm, bn=bn))
    ma = dataclasses.replace(tiles.mask_args(p, q, None), mode=2)
    tl = tiles.lists_for(p, ma, types.SimpleNamespace(sbq=bm, sbk=bn), dev)
    cr = tl.col_cnt.to(torch.int32)                                   # [Bm, Hm, nkv, 4]
    if cr.shape[1] > 1 and p.group > 1:
        cr = _group_columns(cr, p.group)
    bm_, hm, nkv, _ = cr.shape
    nq = -(-p.seq_q // bm)
    s0, g0, g1, s1 = (c.to(torch.int64) for c in cr.unbind(-1))       # [Bm, Hm, nkv]
    n = s1 - s0
    j = torch.arange(nkv, device=dev)
    diag = (j * nq) // nkv                                            # [nkv]
    off = torch.where(n > 0, torch.minimum(torch.maximum(diag, s0), s1 - 1) - s0, 0)
    z = torch.zeros_like(s0)
    ct = torch.stack([s0, g0, g1, s1, off, z, z, z], -1).to(torch.int32).contiguous()
    # step of key tile j at query tile t: (t - s0 - off) mod n inside [s0, s1)
    t = torch.arange(nq, device=dev)[:, None]                         # [nq, 1]
    vis = (t >= s0[..., None, :]) & (t < s1[..., None, :])            # [Bm, Hm, nq, nkv]
    step = torch.remainder(t - s0[..., None, :] - off[..., None, :],
                           torch.clamp(n, min=1)[..., None, :])
    order_key = torch.where(vis, step * nkv + j, (nq + 1) * nkv)      # [Bm, Hm, nq, nkv]
    rk = torch.argsort(torch.argsort(order_key, dim=-1), dim=-1).to(torch.int32)
    visits = vis.any(-1).to(torch.int8).contiguous()                  # [Bm, Hm, nq]
    kw_visits = dict(VIS=visits, vis_b=hm * nq if bm_ > 1 else 0, vis_h=nq if hm > 1 else 0,
                     G=p.group if hm > 1 else 1, BMQ=bm, VISITS=True)
    rs = lambda: (hm * nkv if bm_ > 1 else 0, nkv if hm > 1 else 0)   # noqa: E731
    ct_b, ct_h = rs()
    rk = rk.contiguous()
    rk_b, rk_h = (hm * nq * nkv if bm_ > 1 else 0, nq * nkv if hm > 1 else 0)
    kw = dict(CT=ct, ct_b=ct_b, ct_h=ct_h, IV=iv, KID=kid, siv_b=siv_b, skid_b=skid_b,
              KM=km, skm_b=skm_b, skm_h=skm_h, skm_q=skm_q, skm_k=skm_k, ARRAY=True,
              DOCS=docs, HAS_KEEP=p.mask.keep is not None)
    return BwdMaskTables(ct, rk, kw_visits, kw, dict(kw, RK=rk, rk_b=rk_b, rk_h=rk_h))


def _is_array(p) -> bool:
    """Whether p's mask has Documents or a KeepMask (per-call arrays)."""
    return p.mask.q_ids is not None or p.mask.keep is not None


def _bwd_checks(p, q, l2, delta, dk, dv, dq=None, with_dq: bool = False) -> tuple:
    """The backward launchers' shared part -> (lo, hi, dk, dv, dq): the band of p.mask
    clipped to +-2^30 (open sides: +-2^30); dk / dv [B, Hkv, Sk, D] and, when with_dq,
    dq [B, H, Sq, D] (else dq comes back as given) in q's dtype, allocated where None,
    else checked (shape, dtype, contiguous); l2 [B, H, 2, Sq] and delta [B, H, Sq]
    checked (fp32, contiguous).  ValueError on a mismatch."""
    lo, hi = _band(p.mask)
    B, H, Hkv, Sq, Sk, D = p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_k, p.head_dim
    dev, dt = q.device, q.dtype
    kshape, qshape = (B, Hkv, Sk, D), (B, H, Sq, D)
    dk = torch.empty(kshape, dtype=dt, device=dev) if dk is None else dk
    dv = torch.empty(kshape, dtype=dt, device=dev) if dv is None else dv
    bufs = [("dk", dk, kshape), ("dv", dv, kshape)]
    if with_dq:
        dq = torch.empty(qshape, dtype=dt, device=dev) if dq is None else dq
        bufs.append(("dq", dq, qshape))
    for name, x, shape in bufs:
        if tuple(x.shape) != shape or not x.is_contiguous() or x.dtype != dt:
            raise ValueError(f"{name} {tuple(x.shape)} {x.dtype}: expected contiguous "
                             f"{list(shape)} {dt}")
    for name, x, want in (("l2", l2, (B, H, 2, Sq)), ("delta", delta, (B, H, Sq))):
        if tuple(x.shape) != want or not x.is_contiguous() or x.dtype != torch.float32:
            raise ValueError(f"{name} {tuple(x.shape)} {x.dtype}: expected contiguous "
                             f"{list(want)} float32")
    return lo, hi, dk, dv, dq


def _launcher(sites, name: str, kernel):
    """kernel[grid](*args, **kw) as ``launch(grid, args, kw)``: through the prepared
    signature's direct.Site of that name where the caller keeps ``sites`` (prepared.py's
    prepared launches), else Triton's path."""
    if sites is None:
        return lambda grid, args, kw: kernel[grid](*args, **kw)
    site = sites.get((name, kernel))
    if site is None:
        from .. import direct as DL

        site = sites[(name, kernel)] = DL.Site(kernel, True)
    return site


def dkdv(p, q, k, v, dout, l2, delta, dk=None, dv=None, sites=None, mods=None):
    """dk, dv [B, Hkv, Sk, D] (q's dtype, contiguous) through bwd_ws_kernel.dkdv_ws_kernel
    (configs.bwd_config_dkdv_only) from the backward preprocess's l2 [B, H, 2, Sq] and
    delta [B, H, Sq] (fp32, contiguous; kernels.py module doc).  ``dk`` / ``dv``:
    preallocated buffers to write (tests poison them); ``sites``: the prepared
    signature's launch sites (direct.Site by name), None for Triton's path; ``mods``: the
    call's ScoreMods (softcap and ALiBi enter the kernel, mod_kw; sinks only the
    statistics and the preprocess)."""
    from .bwd_ws_kernel import dkdv_ws_kernel

    B, Hkv, Sk, D = p.batch, p.heads_kv, p.seq_k, p.head_dim
    cfg = HC.bwd_config_dkdv_only(D)
    rm_ = p.mask
    lo, hi, dk, dv, _ = _bwd_checks(p, q, l2, delta, dk, dv)
    grid = (_cdiv(Sk, cfg.bn), B * Hkv)
    rn = cfg.bn // 2      # two consumer warpgroups of bn / 2 key rows, one producer warp
    # Documents / KeepMask: the column range table and the mask arrays (keywords;
    # absent, the kernel's defaults None compile the dense code)
    akw = bwd_mask_tables(p, q, cfg.bm, cfg.bn).kw if _is_array(p) else {}
    akw = dict(akw, **mod_kw(p, mods, q.device, sinks=False))
    with on_device(q.device):
        _launcher(sites, "dkdv", dkdv_ws_kernel)(
            grid, (make_desc(q, cfg.bm), make_desc(k, rn), make_desc(v, rn),
                   make_desc(dout, cfg.bm), make_desc(dk, rn), make_desc(dv, rn),
                   l2, delta, p.heads_q, p.group, p.seq_q, Sk, p.scale, lo, hi),
            dict(HAS_BAND=bool(rm_.has_band), STAGES=cfg.stages,
                 CONSUMER_REGS=cfg.consumer_regs, num_warps=4, **akw))
    return dk, dv


def dqa_desc(dqa, rows: int, cols: int):
    """A TMA descriptor over the fp32 dQ accumulator dqa [B * H, SqA, D] (SqA a multiple
    of 8) for bulk copies / reduce-adds of [rows, cols] blocks, its non-tensor fields
    cached as make_desc's are.  5-D: dqa viewed as [B * H, SqA / 8, 4, 2, D] with the two
    middle dimensions swapped (row 8 g + 4 b1 + b0 at (g, b0, b1)), blocks
    [1, rows / 8, 4, 2, cols]: a box's shared row 8 g + 2 b0 + b1 holds the
    accumulator's row 8 g + 4 b1 + b0 (the staging rows' interleave)."""
    return _cached_desc(("dqa", cols) + desc_key(dqa, rows), dqa, rows,
                        lambda x, r: _new_dqa_desc(x, r, cols))


def _new_dqa_desc(dqa, rows: int, cols: int):
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    n, sq, d = dqa.shape
    if sq % 8 or rows % 8:
        raise ValueError(f"dqa_desc: rows ({rows}) and the accumulator's Sq ({sq}) must be "
                         "multiples of 8")
    s0, s1, _ = dqa.stride()
    shape, strides = [n, sq // 8, 4, 2, d], [s0, 8 * s1, s1, 4 * s1, 1]
    block = [1, rows // 8, 4, 2, cols]
    layout = gl.NVMMASharedLayout.get_default_for(block, gl.float32)
    return TensorDescriptor(dqa, shape, strides, block, layout)


def _order_of(p, cfg, order) -> int:
    """The dQ add order of backward_fused: ``order`` (0 ascending, 1 rotated; ValueError
    otherwise) or, when None, dq_order()'s default."""
    order = dq_order(p, cfg.bn, cfg.bm) if order is None else int(order)
    if order not in (0, 1):
        raise ValueError(f"order {order}: expected 0 (ascending) or 1 (rotated)")
    return order


def dq_order(p, bn: int, bm: int) -> int:
    """The dQ add order (dq_turns module doc): 1 (rotated / diagonal first: no waiting in
    steady state, but a program may wait for one launched after it) when all
    cdiv(Sk, bn) key-tile programs of one (b, kv head) fit on the SMs at once (one
    program per SM), else 0 (ascending: waits only on earlier launches)."""
    sms = sm_count(str(p.device))
    return 1 if _cdiv(p.seq_k, bn) <= sms else 0


def _dq_tiles_all_visited(Sq, Sk, lo, hi, bm, bn) -> bool:
    """Whether every query tile of bm rows is visited by some key tile of bn keys under
    lo <= j - i <= hi (tile_ranges.query_tile_range's rule; the tiles without keys form a
    prefix and / or a suffix, so the first and the last tile decide)."""
    nq, nkv = _cdiv(Sq, bm), _cdiv(Sk, bn)
    for t in {0, nq - 1}:
        jlo = max(t * bm + lo, 0) // bn
        jhi = min(-(-max((t + 1) * bm + hi, 0) // bn) - 1, nkv - 1)
        if jlo > jhi or t * bm + lo >= Sk:
            return False
    return True


def _ws_dq_kernel(cfg):
    """The dQ-inside kernel of config cfg: bwd_ws_t_kernel's transposed consumers
    (cfg.trans) or bwd_ws_dq_kernel's; both take the same arguments but the array
    masks' (bwd_ws_dq_kernel only)."""
    if cfg.trans:
        from .bwd_ws_t_kernel import dkdvq_ws_t_kernel

        return dkdvq_ws_t_kernel
    from .bwd_ws_dq_kernel import dkdvq_ws_kernel

    return dkdvq_ws_kernel


#: registers of the dQ-writer warp (setmaxnreg)
WS_DQ_WRITER_REGS = 24


def backward_fused(p, q, k, v, dout, l2, delta, dq=None, dk=None, dv=None, cfg=None,
                   order=None, sites=None, mods=None):
    """-> (dq [B, H, Sq, D], dk, dv [B, Hkv, Sk, D]) in q's dtype, contiguous, from the
    backward preprocess's l2 [B, H, 2, Sq] and delta [B, H, Sq] (fp32, contiguous),
    through the dQ-inside kernel of ``cfg`` (default configs.bwd_config(D, mask class);
    it must have dq): dq's fp32 partials added in a fixed order into a scratch
    accumulator (bitwise repeatable), then dq = its rows * scale in q's dtype
    (bwd_dq_convert, one elementwise pass).  ``dq`` / ``dk`` / ``dv``: preallocated
    buffers to write (tests poison them); ``order``: the dQ add order, default
    dq_order() (a test hook: the GPU tests check both orders; the route passes None);
    ``sites``: the prepared signature's launch sites (direct.Site by name),
    None for Triton's path; ``mods``: the call's ScoreMods (as dkdv's)."""
    from .bwd_dq_convert import dq_convert_kernel

    B, H, Hkv, Sq, Sk, D = p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_k, p.head_dim
    cfg = HC.bwd_config(D, p.mask_class) if cfg is None else cfg
    if not cfg.dq:
        raise ValueError(f"backward_fused runs the dQ-inside kernels; {cfg.name} computes "
                         "dk / dv only (dkdv())")
    rm_ = p.mask
    lo, hi, dk, dv, dq = _bwd_checks(p, q, l2, delta, dk, dv, dq, True)
    dev = q.device
    akw, ckw = {}, {}
    if _is_array(p):   # the tables' order (bwd_mask_tables), not order 0 / 1
        if order is not None:
            raise ValueError("order: a Documents / KeepMask backward adds dQ in its rank "
                             "table's order (bwd_mask_tables); pass order=None")
        if cfg.trans:
            raise NotImplementedError(f"{cfg.name}: Documents / KeepMask run on "
                                      "bwd_ws_dq_kernel's consumers (trans=False) only")
        tabs = bwd_mask_tables(p, q, cfg.bm, cfg.bn)
        akw, order, unvisited = tabs.kw_dq, 0, False
        ckw = dict(tabs.kw_visits, H=H, D=D)     # unvisited query tiles: 0 in the conversion
    else:
        order = _order_of(p, cfg, order)
        unvisited = rm_.has_band and not _dq_tiles_all_visited(Sq, Sk, lo, hi, cfg.bm,
                                                               cfg.bn)
    akw = dict(akw, **mod_kw(p, mods, dev, sinks=False))
    if cfg.bm != 64 and D != 64:
        raise NotImplementedError(f"{cfg.name}: query tiles of {cfg.bm} rows are built "
                                  f"for D=64 only (bwd_ws_t_kernel), got D={D}")
    nq = _cdiv(Sq, cfg.bm)
    # fp32 partial sums (the first adder of a query tile stores: no init, except where a
    # band leaves query tiles without keys: their dq is 0; an array mask's such tiles are
    # written 0 by the conversion, VISITS), a counter per (b, h, query tile) at zero;
    # the 5-D view (dqa_desc) needs whole groups of 8 rows per head
    sq_acc = _cdiv(Sq, 8) * 8
    dqa = torch.empty((B * H, sq_acc, D), dtype=torch.float32, device=dev)
    if unvisited:
        dqa.zero_()
    sem = torch.zeros((B * H * nq,), dtype=torch.int32, device=dev)
    rn = cfg.bn // 2
    grid = (_cdiv(Sk, cfg.bn), B * Hkv)
    with on_device(dev):
        _launcher(sites, "dkdvq", _ws_dq_kernel(cfg))(
            grid, (make_desc(q, cfg.bm), make_desc(k, rn), make_desc(v, rn),
                   make_desc(dout, cfg.bm), make_desc(dk, rn), make_desc(dv, rn),
                   dqa_desc(dqa, cfg.bm, D // 2), l2, delta,
                   sem, B * H, H, p.group, Sq, Sk, p.scale, lo, hi, order),
            dict(HAS_BAND=bool(rm_.has_band), STAGES=cfg.stages,
                 CONSUMER_REGS=cfg.consumer_regs, WRITER_REGS=WS_DQ_WRITER_REGS,
                 num_warps=4, **akw, **({"LATE": True} if cfg.late_release else {})))
        n = B * H * Sq * D
        _launcher(sites, "dq_convert", dq_convert_kernel)(
            (_cdiv(n, 4096),), (dqa, dq, n, p.scale, Sq * D, sq_acc * D),
            dict(PADDED=sq_acc != Sq, BLOCK=4096, num_warps=8, **ckw))
    return dq, dk, dv
