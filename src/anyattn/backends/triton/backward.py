"""The Triton backward's launches: the delta preprocess, then dK/dV and dQ (one fused
launch, two kernels, or the Hopper kernels where the call's route says so: route.py),
and dbias (full, owned by the dQ programs where broadcast over batch / heads, or a
separate reduction).

Shape legend: B batch, H = Hq query heads, Hkv kv heads, G = H / Hkv, Sq / Sk
queries / keys, D head dim of q and k, Dv of v, out and dout.  Layouts and the
per-signature preparation as in forward.py.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

from ...modifiers import ScoreMods
from ...rowstats import RowStats
from . import capture_grads, configs, kernels, operands, prepared, programs, tiles
from .device_ctx import on_device
from .operands import s3
from .tiles import cdiv

__all__ = ["backward", "stat_plane"]


def stat_plane(x, dev):
    """One row-statistics array as a contiguous fp32 [B, H, Sq] tensor on dev."""
    x = x if isinstance(x, torch.Tensor) else torch.as_tensor(x)
    return x.to(device=dev, dtype=torch.float32).contiguous()


def backward(p, q, k, v, dout, out, stats: RowStats, bias, plan: Optional[configs.Plan] = None,
             mods: Optional[ScoreMods] = None) -> Dict[str, Any]:
    """-> {'dq', 'dk', 'dv', 'dbias', 'dsinks', 'dcaptures'}: dq [B, H, Sq, D], dk [B, Hkv,
    Sk, D] and dv [B, Hkv, Sk, Dv] summed over each kv head's query group, dbias in
    p.bias_shape summed over broadcast dims, dsinks [H] in the sinks' dtype (when p.wrt
    names 'sinks'), dcaptures {name: gradient} of the score function's float captures
    that p.wrt names (capture_grads.py: slots written by the dK/dV launch, which runs for
    them even where dk and dv are not wanted).
    ``stats`` (RowStats of [B, H, Sq]) define P = exp((s - max) - log_norm); a plain lse
    tensor is taken as RowStats.from_lse(lse), its literal meaning P = exp(s - lse).  With
    sinks the statistics include the sink (as the forward returns them): the score
    kernels need nothing more, and the delta kernel writes each row's term of dsinks,
    summed here over batch and queries in a fixed order (no atomics)."""
    # the Hopper path (pr.hop) computes dk / dv, and dq where its config says so
    # (hopper/configs.py); the delta preprocess stays portable, and so does a dq-only call
    pr = prepared.prepare("backward", p, plan, mods, (("q", q), ("k", k), ("v", v), ("dout", dout)),
                  bias)
    plan = pr.plan
    q, k, v, dout, out = (operands.unit_last(x) for x in (q, k, v, dout, out))
    B, H, Hkv, Sq, Sk, D = p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_k, p.head_dim
    Dv = p.head_dim_v
    dev = q.device
    ma = pr.ma if pr.ma is not None else tiles.mask_args(p, q, bias)
    md = pr.md if pr.md is not None else operands.mod_args(p, mods, dev)
    want_ds, want_kv, want_q = pr.want_ds, pr.want_kv, pr.want_q
    full_bias, owner_db = pr.full_bias, pr.owner_db
    tlists = pr.tlists if pr.tlists is not None else tiles.lists_for(p, ma, plan, dev)
    fns = programs.of_problem(p, dev)
    fkw = {} if fns is None else dict(CAPS=fns.caps, SMOD=fns.score_grad, MMOD=fns.mask)
    cg = capture_grads.CaptureGrads(p, dev) if p.capture_wrt else None
    run_kv = want_kv or cg is not None          # capture gradients ride on dK/dV
    if not isinstance(stats, RowStats):
        stats = RowStats.from_lse(stats)
    mx, ln = stat_plane(stats.max, dev), stat_plane(stats.log_norm, dev)
    delta = torch.empty((B, H, Sq), dtype=torch.float32, device=dev)
    # per (b, h): max (+inf on empty rows) and log2(e) * log_norm side by side (kernels doc)
    l2 = torch.empty((B, H, 2, Sq), dtype=torch.float32, device=dev)
    ctx = on_device(dev)
    res: Dict[str, Any] = {"dq": None, "dk": None, "dv": None, "dbias": None, "dsinks": None}
    prec = pr.prec
    dsr = (torch.empty((B, H, Sq), dtype=torch.float32, device=dev) if want_ds
           else pr.sc)
    with ctx:
        prepared.site(pr, "pre", kernels.bwd_pre_kernel)(
            (cdiv(Sq, plan.pre_bm), B * H),
            (out, dout, mx, ln, delta, l2, md.sink_t, dsr, *s3(out), *s3(dout), H, Sq),
            dict(D=Dv, DP=pr.common["VDP"], BM=plan.pre_bm, HAS_SINKS=want_ds))
        if want_ds:   # torch's reduction: a fixed order, the same bits every run
            res["dsinks"] = dsr.sum(dim=(0, 2)).to(mods.sinks.dtype)
        if full_bias:
            dbias = torch.zeros((B, H, Sq, Sk), dtype=bias.dtype, device=dev)
            sdb = tuple(dbias.stride())
        else:
            dbias, sdb = pr.sc, (0, 0, 0, 0)
        dk = dv = dq = None
        if run_kv:
            dk = torch.empty((B, Hkv, Sk, D), dtype=q.dtype, device=dev)
            dv = torch.empty((B, Hkv, Sk, Dv), dtype=q.dtype, device=dev)
        if want_q:
            dq = torch.empty((B, H, Sq, D), dtype=q.dtype, device=dev)
        scalars = (H, Hkv, p.group, Sq, Sk, p.scale, ma.lo, ma.hi, *md.scalars)
        # the operands as the kernels read them (scaled fp16 parts for fp32 inputs);
        # sc: the scaled parts' factors (after delta: gamma needs it)
        if prec == operands.SCALED:
            sc, sig = operands.f16_scales(p, q, k, v, dout, delta)
            qo, ko, vo, doo = (operands.split_half(x, sig[n], g) for x, n, g in
                               ((q, "q", p.group), (k, "k", 1), (v, "v", 1),
                                (dout, "do", p.group)))
        else:
            sc = pr.sc
            qo, ko, vo, doo = q, k, v, dout
        if owner_db:
            if run_kv:
                _launch_dkdv(pr, p, plan, qo, ko, vo, doo, l2, delta, dk, dv, ma, md,
                             tlists, sc, scalars, fkw, cg, fns)
            res["dbias"] = _launch_dq_dbias(pr, p, plan, qo, ko, vo, doo, l2, delta, dq, bias,
                                            ma, md, tlists, sc, scalars, fkw)
        elif want_kv and want_q and plan.fused_bwd and not pr.hop and cg is None:
            _launch_fused_bwd(pr, p, plan, qo, ko, vo, doo, l2, delta, dk, dv, dq, dbias, sdb,
                              ma, md, tlists, sc, scalars, full_bias, fkw)
        else:
            if want_kv and pr.hop:
                from .hopper import launch as hopper_launch

                hcfg = pr.hcfg
                sites = pr.sites if pr.direct else None
                if hcfg.dq and want_q:   # dk, dv and dq in one kernel
                    hopper_launch.backward_fused(p, qo, ko, vo, doo, l2, delta, dq, dk, dv,
                                                 cfg=hcfg, sites=sites, mods=mods)
                    want_q = False
                else:                    # dk, dv; dq (if wanted) portable below
                    hopper_launch.dkdv(p, qo, ko, vo, doo, l2, delta, dk, dv, sites=sites,
                                       mods=mods)
            elif run_kv:
                _launch_dkdv(pr, p, plan, qo, ko, vo, doo, l2, delta, dk, dv, ma, md,
                             tlists, sc, scalars, fkw, cg, fns)
            if want_q:
                args = (qo, ko, vo, doo, l2, delta, dq, ma.bias, dbias, ma.qid, ma.kid, ma.km,
                        tlists.row_cnt, tlists.row_idx, tlists.row_fcnt, tlists.row_fidx, sc,
                        md.slopes, *s3(qo), *s3(ko), *s3(vo), *s3(doo), *s3(dq), *ma.sb,
                        *sdb, ma.sqid_b, ma.skid_b, *ma.skm, *tlists.row_strides(),
                        scalars[0], *scalars[2:])   # (no Hkv)

                def first():
                    kw = dict(SBQ=plan.sbq, SBK=plan.sbk, MODE=ma.mode, HAS_BIAS=ma.has_bias,
                              WRITE_DB=full_bias, **pr.common, **fkw)
                    return (lambda c: (cdiv(Sq, c.bm), B * H), plan.dq, kw,
                            prepared.tuning_key("dq", p), str(qo.dtype))

                prepared.run(pr, "dq", kernels.dq_kernel, args, first)
        if want_kv:
            res["dk"], res["dv"] = dk, dv
        if cg is not None:
            res["dcaptures"] = cg.finish()
        if "q" in p.wrt:
            res["dq"] = dq
        if full_bias:
            res["dbias"] = dbias
        elif pr.want_db and not owner_db:
            res["dbias"] = _dbias_broadcast(p, q, k, v, dout, l2, delta, bias, ma, md, plan)
    return res


def _launch_dkdv(pr, p, plan, q, k, v, dout, l2, delta, dk, dv, ma, md, tlists, sc, scalars,
                 fkw, cg=None, fns=None):
    """dk, dv through kernels.dkdv_kernel (one program per key tile and kv head); with
    ``cg`` (capture_grads.CaptureGrads) also the capture gradients (added to ``cg``)."""
    args = (q, k, v, dout, l2, delta, dk, dv, ma.bias, ma.qid, ma.kid, ma.km,
            tlists.col_cnt, tlists.col_idx, tlists.col_fcnt, tlists.col_fidx, sc, md.slopes,
            *s3(q), *s3(k), *s3(v), *s3(dout), *s3(dk), *s3(dv),
            *ma.sb, ma.sqid_b, ma.skid_b, *ma.skm, *tlists.col_strides(), *scalars)
    if cg is not None:
        _launch_dkdv_captures(p, plan, q, args, ma, pr.common, fkw, cg, fns)
        return

    def first():
        kw = dict(SBQ=plan.sbq, SBK=plan.sbk, MODE=ma.mode, HAS_BIAS=ma.has_bias, **pr.common,
                  **fkw)
        B, Hkv, Sk = p.batch, p.heads_kv, p.seq_k
        return (lambda c: (cdiv(Sk, c.bn), B * Hkv), plan.dkdv, kw,
                prepared.tuning_key("dkdv", p), str(q.dtype))

    prepared.run(pr, "dkdv", kernels.dkdv_kernel, args, first)


def _launch_dkdv_captures(p, plan, q, args, ma, common, fkw, cg, fns):
    """dkdv_kernel with the capture gradient function (fns.dcap), per batch chunk of
    ``cg.chunks``, each chunk's slots and column sums added to ``cg`` (shaped by the tile:
    allocated per config, so no prepared.resolve_launch; the config that fits is
    remembered per signature, as resolve_launch does)."""
    from triton.runtime.errors import OutOfResources

    B, Hkv, Sk = p.batch, p.heads_kv, p.seq_k
    kw = dict(SBQ=plan.sbq, SBK=plan.sbk, MODE=ma.mode, HAS_BIAS=ma.has_bias, **common,
              **fkw)
    sig = prepared.signature(dt=str(q.dtype), dcap=(fns.key, tuple(sorted(cg.wrt))), **{
        n: (tuple(t.dtype for t in x) if n == "CAPS" else x) for n, x in kw.items()})
    cfg = plan.dkdv_captures or plan.dkdv
    key = ("dkdv_kernel/captures", cfg, sig)
    first = prepared.FALLBACK_CACHE.get(key)
    err = None
    for c in ([first] if first is not None else list(prepared.fallbacks(cfg))):
        try:
            # per batch chunk where pair reads' slots would pass PAIR_SLOT_BYTES (a
            # config that does not fit raises at the first launch, before any add)
            for b0, nb in cg.chunks(c.bm, c.bn):
                dcs, dcs_g, dcol, ncp = cg.scratch(c.bm, c.bn, b0, nb)
                kernels.dkdv_kernel[(cdiv(Sk, c.bn), nb * Hkv)](
                    *args, BM=c.bm, BN=c.bn, num_warps=c.num_warps, num_stages=c.num_stages,
                    DCS=dcs, dcs_g=dcs_g, DCAP=fns.dcap, DCOL=dcol, NCP=ncp, B0=b0, **kw)
                cg.add(dcs, dcol)
            prepared.FALLBACK_CACHE[key] = c
            return
        except OutOfResources as e:
            err = e
    raise err


def _launch_dq_dbias(pr, p, plan, q, k, v, dout, l2, delta, dq, bias, ma, md, tlists, sc,
                     scalars, fkw):
    """dq (kept when asked for) and dbias for a bias [Bb, Hb, Sq, Sk] broadcast over batch
    and/or heads, through kernels.dq_dbias_kernel: the programs of one (bias batch, bias head)
    run the dq of every (b, h) mapped onto it in turn and sum dS in place; the dbias
    starts at zero, so tiles a mask skips stay exact zeros."""
    B, H, Sq = p.batch, p.heads_q, p.seq_q
    bb, hb = p.bias_shape[0], p.bias_shape[1]
    red_b, red_h = bb == 1 and B > 1, hb == 1 and H > 1
    dev = q.device
    dbias = torch.zeros(tuple(p.bias_shape), dtype=bias.dtype, device=dev)
    st = dbias.stride()
    sdb = (0 if red_b else st[0], 0 if red_h else st[1], st[2], st[3])
    args = (q, k, v, dout, l2, delta, dq, ma.bias, dbias, ma.qid, ma.kid, ma.km,
            tlists.row_cnt, tlists.row_idx, tlists.row_fcnt, tlists.row_fidx, sc, md.slopes,
            *s3(q), *s3(k), *s3(v), *s3(dout), *s3(dq), *ma.sb, *sdb,
            ma.sqid_b, ma.skid_b, *ma.skm, *tlists.row_strides(),
            B, H, *scalars[2:], hb)

    def first():
        kw = dict(SBQ=plan.sbq, SBK=plan.sbk, MODE=ma.mode, RED_B=red_b, RED_H=red_h,
                  **pr.common, **fkw)
        return (lambda c: (cdiv(Sq, c.bm), bb * hb), plan.dq, kw,
                prepared.tuning_key("dq", p),
                str(q.dtype))

    prepared.run(pr, "dq_dbias", kernels.dq_dbias_kernel, args, first)
    return dbias


def _fused_fallbacks(c1: configs.KernelConfig, c2: configs.KernelConfig):
    """(dK/dV config, dQ config) pairs for the fused launch, cheaper after the first;
    both halves share the first config's warps and stages."""
    for a in prepared.fallbacks(c1):
        yield a, configs.KernelConfig(c2.bm if a.bm == c1.bm else max(16, c2.bm // 2),
                                c2.bn if a.bn == c1.bn else max(16, c2.bn // 2),
                                a.num_warps, a.num_stages)


def _launch_fused_bwd(pr, p, plan, q, k, v, dout, l2, delta, dk, dv, dq, dbias, sdb, ma, md,
                      tlists, sc, scalars, full_bias, fkw):
    """dK/dV and dQ in one launch of kernels.bwd_kernel (plan.dkdv gives BM/BN, warps and
    stages; plan.dq gives BM2/BN2).  Falls back to cheaper configs on OutOfResources
    (remembered per signature); autotuned over config pairs with ANYATTN_TRITON_AUTOTUNE=1."""
    args = (q, k, v, dout, l2, delta, dk, dv, dq, ma.bias, dbias, ma.qid, ma.kid, ma.km,
            tlists.col_cnt, tlists.col_idx, tlists.col_fcnt, tlists.col_fidx,
            tlists.row_cnt, tlists.row_idx, tlists.row_fcnt, tlists.row_fidx, sc, md.slopes,
            *s3(q), *s3(k), *s3(v), *s3(dout), *s3(dk), *s3(dv), *s3(dq),
            *ma.sb, *sdb, ma.sqid_b, ma.skid_b, *ma.skm,
            *tlists.col_strides(), *tlists.row_strides(), *scalars)
    ready = pr.ready.get("bwd")
    if ready is None:     # launches once, with the first config pair that fits
        pr.ready["bwd"] = list(_resolve_fused_bwd(p, plan, q, args, ma, pr.common,
                                                  full_bias, fkw))
        return
    prepared.replay(pr, "bwd", ready, kernels.bwd_kernel, args)


def _resolve_fused_bwd(p, plan, q, args, ma, common, full_bias, fkw) -> tuple:
    """Launch kernels.bwd_kernel once with the first config pair that fits (autotuned with
    ANYATTN_TRITON_AUTOTUNE=1) -> (grid, positional tail, keywords) of that launch."""
    from triton.runtime.errors import OutOfResources

    B, Hkv, G, Sq, Sk = p.batch, p.heads_kv, p.group, p.seq_q, p.seq_k
    kw = dict(SBQ=plan.sbq, SBK=plan.sbk, MODE=ma.mode, HAS_BIAS=ma.has_bias,
              WRITE_DB=full_bias, **common, **fkw)

    def resolved(pair):
        c1, c2 = pair
        nkv, nq = cdiv(Sk, c1.bn), cdiv(Sq, c2.bm)
        return ((nkv + G * nq, B * Hkv), (nkv, nq),
                dict(kw, BM=c1.bm, BN=c1.bn, BM2=c2.bm, BN2=c2.bn,
                     num_warps=c1.num_warps, num_stages=c1.num_stages))

    def launch(pair):
        grid, tail, kws = resolved(pair)
        kernels.bwd_kernel[grid](*args, *tail, **kws)

    c1 = plan.dkdv
    c2 = configs.KernelConfig(plan.dq.bm, plan.dq.bn, c1.num_warps, c1.num_stages)
    # (score / mask functions' captures: tensors, keyed by dtype only)
    sig = prepared.signature(dt=str(q.dtype), **{
        n: (tuple(t.dtype for t in x) if n == "CAPS" else x) for n, x in kw.items()})
    if configs.autotune_enabled():
        dp = max(kw["DP"], kw["VDP"])        # the wider of q/k's and v's tiles
        cands = [(c1, c2)] + [pair for pair in configs.fused_candidates(dp, p.dtype)
                              if plan.sbq % pair[0].bm == 0 and plan.sbk % pair[0].bn == 0
                              and plan.sbq % pair[1].bm == 0 and plan.sbk % pair[1].bn == 0]
        c1, c2 = configs.tune(prepared.tuning_key("bwd", p) + (sig,), cands,
                        lambda pair: (lambda: launch(pair)))
    key = ("bwd_kernel", c1, c2, sig)
    first = prepared.FALLBACK_CACHE.get(key)
    tries = [first] if first is not None else list(_fused_fallbacks(c1, c2))
    err = None
    for pair in tries:
        try:
            launch(pair)
            prepared.FALLBACK_CACHE[key] = pair
            return resolved(pair)
        except OutOfResources as e:
            err = e
    raise err


def _dbias_broadcast(p, q, k, v, dout, l2, delta, bias, ma, md, plan):
    """dbias for a bias broadcast over some of [B, H, Sq, Sk]: one owner program per
    output tile sums dS over the broadcast dims (no atomics, no [B, H, Sq, Sk] scratch)."""
    from triton.runtime.errors import OutOfResources

    B, H, Sq, Sk = p.batch, p.heads_q, p.seq_q, p.seq_k
    bb, hb, mb, nb = p.bias_shape
    red_b, red_h = bb == 1 and B > 1, hb == 1 and H > 1
    red_m, red_n = mb == 1 and Sq > 1, nb == 1 and Sk > 1
    c = plan.dbias
    dbias = torch.empty((bb, hb, mb, nb), dtype=bias.dtype, device=q.device)
    sdb = tuple(dbias.stride())
    err = None
    # the grid and NJ_OUT depend on the tile: no prepared.resolve_launch here
    for cc in prepared.fallbacks(c):
        ni_o = 1 if red_m else cdiv(Sq, cc.bm)
        nj_o = 1 if red_n else cdiv(Sk, cc.bn)
        try:
            kernels.dbias_kernel[(ni_o * nj_o, bb * hb)](
                q, k, v, dout, l2, delta, ma.bias, dbias, ma.qid, ma.kid, ma.km, md.slopes,
                *s3(q), *s3(k), *s3(v), *s3(dout), *ma.sb, *sdb,
                ma.sqid_b, ma.skid_b, *ma.skm,
                B, H, p.group, Sq, Sk, p.scale, ma.lo, ma.hi, *md.scalars, nj_o, hb,
                D=p.head_dim, DP=configs.padded_dim(p.head_dim), VD=p.head_dim_v,
                VDP=configs.padded_dim(p.head_dim_v), BM=cc.bm, BN=cc.bn,
                RED_B=red_b, RED_H=red_h, RED_M=red_m, RED_N=red_n,
                HAS_BAND=ma.has_band, HAS_DOCS=ma.has_docs, HAS_KEEP=ma.has_keep,
                PREC=operands.register_prec(p), num_warps=cc.num_warps,
                num_stages=cc.num_stages,
                **md.flags)
            return dbias
        except OutOfResources as e:
            err = e
    raise err
