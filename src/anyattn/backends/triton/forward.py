"""The portable Triton forward's launch (the Hopper forward where the call's route says
so: route.py, hopper/launch.py).

Shape legend: B batch, H = Hq query heads, Hkv kv heads, G = H / Hkv, Sq / Sk
queries / keys, D head dim of q and k, Dv of v and out.

Inputs may have any strides; a tensor whose last dim is not contiguous is copied once
(the kernels assume unit stride along D), every other layout (including strided float32
views into an ABI arena) is read in place.  Outputs are fresh contiguous [B, H, S, D]
tensors.  What a call derives from its shapes, layouts, options and settings is kept per
call signature (prepared.py), so a repeated call only allocates its outputs, builds the
argument tuple and launches.
"""
from __future__ import annotations

import collections
from typing import Optional

import torch

from ...modifiers import ScoreMods
from ...rowstats import RowStats
from . import configs, direct, kernels, operands, prepared, programs, route, tiles
from .device_ctx import on_device
from .operands import s3
from .tiles import cdiv

__all__ = ["forward", "forward_paged"]


def forward(p, q, k, v, bias, plan: Optional[configs.Plan] = None,
            mods: Optional[ScoreMods] = None):
    """-> out [B, H, Sq, Dv] (q's dtype), RowStats(max, log_norm) of [B, H, Sq] fp32
    (natural log; the kernel writes both planes of one [2, B, H, Sq] buffer).  ``mods``:
    the score modifiers (p.softcap, mods.alibi_slopes, mods.sinks), applied in the
    kernel; with sinks the statistics include the sink."""
    pr = prepared.prepare("forward", p, plan, mods, (("q", q), ("k", k), ("v", v)), bias)
    if pr.hop:
        from .hopper import launch as hopper_launch

        return hopper_launch.forward(p, q, k, v, prepared=pr.hfwd, mods=mods)
    if pr.route.split is not None:       # split-key decoding; head dims above 256
        return _forward_split(p, q, k, v, pr, mods)
    plan = pr.plan
    q, k, v = operands.unit_last(q), operands.unit_last(k), operands.unit_last(v)
    B, H, Sq, Sk, D, Dv = p.batch, p.heads_q, p.seq_q, p.seq_k, p.head_dim, p.head_dim_v
    dev = q.device
    ma = pr.ma if pr.ma is not None else tiles.mask_args(p, q, bias)
    md = pr.md if pr.md is not None else operands.mod_args(p, mods, dev)
    tlists = pr.tlists if pr.tlists is not None else tiles.lists_for(p, ma, plan, dev)
    fns = programs.of_problem(p, dev)
    out = torch.empty((B, H, Sq, Dv), dtype=q.dtype, device=dev)
    stats = torch.empty((2, B, H, Sq), dtype=torch.float32, device=dev)
    prec = pr.prec
    with on_device(dev):
        q, k, v, sc = operands.forward_operands(p, q, k, v, prec, pr.sc)
        args = (q, k, v, out, stats, ma.bias, ma.qid, ma.kid, ma.km,
                tlists.row_cnt, tlists.row_idx, tlists.row_fcnt, tlists.row_fidx, sc,
                md.slopes, md.sink_t,
                *s3(q), *s3(k), *s3(v), *s3(out),
                *ma.sb, ma.sqid_b, ma.skid_b, *ma.skm,
                *tlists.row_strides(),
                H, p.group, Sq, Sk, p.scale * kernels.LOG2E, p.scale, ma.lo, ma.hi, *md.scalars)

        def first():
            kw = dict(D=D, DP=configs.padded_dim(D), VD=Dv, VDP=configs.padded_dim(Dv),
                      SBQ=plan.sbq, SBK=plan.sbk, MODE=ma.mode,
                      HAS_BAND=ma.has_band, HAS_DOCS=ma.has_docs, HAS_KEEP=ma.has_keep,
                      HAS_BIAS=ma.has_bias, HAS_SINKS=md.sinks, PREC=prec, **md.flags)
            if fns is not None:
                kw.update(CAPS=fns.caps, SMOD=fns.score, MMOD=fns.mask)
            return (lambda c: (cdiv(Sq, c.bm), B * H), plan.fwd, kw,
                    prepared.tuning_key("fwd", p), str(args[0].dtype))

        prepared.run(pr, "fwd", kernels.fwd_kernel, args, first)
    return out, RowStats(stats[0], stats[1])


def _split_buffers(B, H, Sq, vdp, Dv, ns, dtype, dev):
    """The split-key forward's buffers: out [B, H, Sq, Dv], stats [2, B, H, Sq], the
    runs' fp32 partial outputs pacc [B*H, ns, Sq, vdp] and statistics pst [2, L], and
    that plane's length L = B*H*ns*Sq."""
    lplane = B * H * ns * Sq
    return (torch.empty((B, H, Sq, Dv), dtype=dtype, device=dev),
            torch.empty((2, B, H, Sq), dtype=torch.float32, device=dev),
            torch.empty((B * H, ns, Sq, vdp), dtype=torch.float32, device=dev),
            torch.empty((2, lplane), dtype=torch.float32, device=dev), lplane)


def _forward_split(p, q, k, v, pr, mods):
    """The split-key forward (route.decode_splits): kernels.fwd_split_kernel, HP = the
    route's pack query heads of a kv head per program, writes each of the route's NS
    key splits' partial out and statistics to a workspace (fp32
    [B * H, NS, Sq, VDP] and [2, B * H * NS * Sq]), kernels.fwd_combine_kernel merges
    them in a fixed order into out and the RowStats fwd_kernel would write (the
    backward reads them unchanged).  Band / no mask, softcap, ALiBi, sinks only."""
    q, k, v = operands.unit_last(q), operands.unit_last(k), operands.unit_last(v)
    B, H, Sq, Sk, D, Dv = p.batch, p.heads_q, p.seq_q, p.seq_k, p.head_dim, p.head_dim_v
    ns, cfg, hp = pr.route.splits, pr.route.split, pr.route.pack
    dev = q.device
    ma = pr.ma if pr.ma is not None else tiles.mask_args(p, q, None)
    md = pr.md if pr.md is not None else operands.mod_args(p, mods, dev)
    vdp = configs.padded_dim(Dv)
    out, stats, pacc, pst, lplane = _split_buffers(B, H, Sq, vdp, Dv, ns, q.dtype, dev)
    prec = pr.prec
    with on_device(dev):
        q, k, v, sc = operands.forward_operands(p, q, k, v, prec, pr.sc)
        args = (q, k, v, pacc, pst, sc, md.slopes, *s3(q), *s3(k), *s3(v),
                H, p.group, hp, Sq, Sk, p.scale * kernels.LOG2E, p.scale, ma.lo, ma.hi,
                md.sl_b, md.cap, md.adiag, lplane)

        # launched as routed (no fallback to smaller tiles: the packed rows need BM)
        prepared.site(pr, "fwd_split", kernels.fwd_split_kernel)(
            (B * p.heads_kv * (p.group // hp), ns) + configs.wide_grid(cfg, Dv), args,
            dict(D=D, DP=configs.padded_dim(D), VD=Dv, VDP=vdp, HAS_BAND=ma.has_band,
                 PREC=prec, SOFTCAP=md.flags["SOFTCAP"], ALIBI=md.alibi, BM=cfg.bm,
                 BN=cfg.bn, num_warps=cfg.num_warps, num_stages=cfg.num_stages,
                 **configs.wide_kw(cfg)))
        bm = configs.COMBINE_BM
        prepared.site(pr, "fwd_combine", kernels.fwd_combine_kernel)(
            (cdiv(Sq, bm), B * H),
            (pacc, pst, out, stats, md.sink_t, *s3(out), H, Sq, ns),
            dict(BM=bm, VD=Dv, VDP=vdp, HAS_SINKS=md.sinks))
    return out, RowStats(stats[0], stats[1])


#: the most device buffers one Pages keeps (one per band set and device: layers of
#: one step with different windows)
_PAGE_BUFFERS_MAX = 8


def _page_buffer(p, dev):
    """PG int32 [B * 4 + B * M] on ``dev``: per sequence b (its key count seqlens[b] -
    starts[b], band lo, band hi, offset of its table row in PG), then the block table
    (kernels.fwd_split_kernel, PAGE > 0); with starts (STARTS) each table row is
    preceded by its sequence's start ([B * 4 + B * (M + 1)]).  The band is sequence b's
    mask resolved for its key count (paged.sequence_mask), an open side as tiles.BIG.

    Uploaded once per Pages, band set and device and kept in the Pages
    (``Pages.device_cache``) as long as it lives: the layers of a decoding step share
    one upload, and a repeated call makes no host-to-device copy.  Tables that stay on
    the device (``Pages(on_device=True)``): :func:`_page_buffer_on_device`."""
    import numpy as np

    from ...paged import sequence_mask

    pk = p.pages
    if pk.on_device:
        return _page_buffer_on_device(p, dev)
    B, M = pk.table.shape
    bands = tuple(sequence_mask(p, b) for b in range(B))
    cache = pk.device_cache
    key = ("triton_pg", bands, str(dev))
    hit = cache.get(key)
    if hit is not None:
        return hit
    big = tiles.BIG
    rec = np.empty((B, 4), np.int64)
    rec[:, 0] = pk.counts
    rec[:, 1] = [-big if lo is None else max(lo, -big) for lo, _ in bands]
    rec[:, 2] = [big if hi is None else min(hi, big) for _, hi in bands]
    rows = pk.table
    if pk.has_starts:
        rows = np.concatenate([pk.firsts[:, None], pk.table], axis=1)       # [B, 1 + M]
    rec[:, 3] = B * 4 + rows.shape[1] * np.arange(B) + (rows.shape[1] - M)
    # entries outside a sequence's pages are never read (-1 and the like may stay)
    buf = np.concatenate([rec.reshape(-1), rows.reshape(-1)]).astype(np.int32)
    t = torch.from_numpy(buf).to(dev)
    if len(cache) >= _PAGE_BUFFERS_MAX:
        cache.clear()
    cache[key] = t
    return t


def _page_buffer_on_device(p, dev):
    """PG of ``_page_buffer``'s layout built on the device from tables that stay there
    (``Pages(on_device=True)``): one kernels.page_records_kernel launch per call, the
    bands from paged.sequence_band (each side affine in the key count), so nothing is
    read to the host, nothing is copied to the device, and the launch depends on the
    shapes only (a CUDA graph replays it over the tables' values then).  Built per call,
    not kept: a call reads the tensors as they are at that call."""
    from ...paged import sequence_band

    pk = p.pages
    src = pk.source
    table = src.block_table
    B, M = (int(n) for n in table.shape)
    starts = src.starts is not None
    width = M + (1 if starts else 0)
    pg = torch.empty(B * 4 + B * width, dtype=torch.int32, device=dev)
    lo, hi = sequence_band(p)
    lo0, lo_s = (0, 0) if lo is None else lo
    hi0, hi_s = (0, 0) if hi is None else hi
    with on_device(dev):
        _paged_launch(
            "page_records", kernels.page_records_kernel, (B,),
            (pg, table, src.seqlens, src.starts if starts else src.seqlens, *table.stride(),
             B, M, lo0, lo_s, hi0, hi_s),
            dict(HAS_LO=lo is not None, HAS_HI=hi is not None, STARTS_ON=starts,
                 BLOCK=min(max(16, 1 << max(M - 1, 0).bit_length()), 256)), dev)
    return pg


#: direct.Site per paged launch signature (launch name, grid, every non-tensor argument
#: and keyword, device), least recently used first: the layers of a decoding step repeat
#: one signature, so from its second launch on they skip Triton's binder (direct.py);
#: a site checks every fact of a call and takes Triton's path where one differs
_paged_sites: "collections.OrderedDict" = collections.OrderedDict()
_PAGED_SITES_MAX = 32


def _paged_launch(name: str, kernel, grid: tuple, args: tuple, kw: dict, dev) -> None:
    """``kernel[grid](*args, **kw)`` through the direct.Site of its signature."""
    key = (name, grid, tuple([a for a in args if not isinstance(a, torch.Tensor)]),
           tuple([(n, x) for n, x in kw.items() if not isinstance(x, torch.Tensor)]),
           str(dev))
    found = _paged_sites.get(key)
    if found is None:
        found = _paged_sites[key] = direct.Site(kernel, direct.enabled(dev))
        if len(_paged_sites) > _PAGED_SITES_MAX:
            _paged_sites.popitem(last=False)
    else:
        _paged_sites.move_to_end(key)
    found(grid, args, kw)


def forward_paged(p, q, k_pages, v_pages, mods: Optional[ScoreMods] = None):
    """The forward over a paged cache (``p.pages``, anyattn.paged): q [B, H, Sq, D],
    k_pages [N, Hkv, P, D], v_pages [N, Hkv, P, Dv] (any strides, unit stride along D
    or copied) -> as forward().  kernels.fwd_split_kernel with PAGE = P reads every key
    row through the block table (route.paged_splits: its splits, tile and head
    packing; one split is the unsplit forward), fwd_combine_kernel merges the splits.
    fp32: the scaled fp16 parts of the whole cache, one scale per kv head over every
    page (operands.f16_scales_paged).  Both launches go through direct.Site
    (``_paged_launch``): a repeat of a launch's signature on a CUDA device skips
    Triton's binder."""
    q = operands.unit_last(q)
    k_pages, v_pages = operands.unit_last(k_pages), operands.unit_last(v_pages)
    B, H, Sq, D, Dv = p.batch, p.heads_q, p.seq_q, p.head_dim, p.head_dim_v
    Hkv, G = p.heads_kv, p.group
    dev = q.device
    rt = route.paged_route(route.ProblemFacts.of(p), route.device_facts(dev))
    ns, cfg, hp = rt.splits, rt.split, rt.pack
    prec = operands.kernel_prec(p)
    ma = tiles.mask_args(p, q, None)
    md = operands.mod_args(p, mods, dev)
    pg = _page_buffer(p, dev)
    vdp = configs.padded_dim(Dv)
    out, stats, pacc, pst, lplane = _split_buffers(B, H, Sq, vdp, Dv, ns, q.dtype, dev)
    with on_device(dev):
        if prec == operands.SCALED:
            sc, (sq_sig, skv_sig) = operands.f16_scales_paged(p, q, k_pages, v_pages)
            q = operands.split_half(q, sq_sig, G)
            k_pages, v_pages = (operands.split_half(x, skv_sig[n], 1)
                                for x, n in ((k_pages, "k"), (v_pages, "v")))
        else:
            sc = tiles.dummy(dev, torch.float32)
        adiag = (md.adiag - p.seq_k) if md.alibi else 0    # a sequence of no keys
        _paged_launch(
            "fwd_split", kernels.fwd_split_kernel,
            (B * Hkv * (G // hp), ns) + configs.wide_grid(cfg, Dv),
            (q, k_pages, v_pages, pacc, pst, sc, md.slopes, *s3(q), *s3(k_pages),
             *s3(v_pages), H, G, hp, Sq, p.seq_k, p.scale * kernels.LOG2E, p.scale, ma.lo,
             ma.hi, md.sl_b, md.cap, adiag, lplane),
            dict(D=D, DP=configs.padded_dim(D), VD=Dv, VDP=vdp, HAS_BAND=ma.has_band,
                 PREC=prec, SOFTCAP=md.flags["SOFTCAP"], ALIBI=md.alibi, BM=cfg.bm,
                 BN=cfg.bn, num_warps=cfg.num_warps, num_stages=cfg.num_stages, PG=pg,
                 PAGE=p.pages.page_size, STARTS=p.pages.has_starts,
                 **configs.wide_kw(cfg)), dev)
        bm = configs.COMBINE_BM
        _paged_launch(
            "fwd_combine", kernels.fwd_combine_kernel, (cdiv(Sq, bm), B * H),
            (pacc, pst, out, stats, md.sink_t, *s3(out), H, Sq, ns),
            dict(BM=bm, VD=Dv, VDP=vdp, HAS_SINKS=md.sinks), dev)
    return out, RowStats(stats[0], stats[1])
