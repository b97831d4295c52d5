"""The Hopper path (backends/triton/hopper) on an sm_90 GPU: correctness vs float64 and
vs the portable kernels, bitwise repeatability, SASS evidence, and forward timings side
by side with the portable kernels, SDPA-cuDNN, SDPA-flash and FlexAttention, in one
process.  FLOP convention: FlashAttention's (fwd 4*B*H*Sq*Sk*D, bwd 2.5x, causal half).
Backward: the routed triton backward (portable delta + the Hopper backward config of
configs.bwd_config) beside the portable one, each Hopper backward config alone
("bwdk-*": the fused kernel with dQ, or dK/dV alone), SDPA cuDNN / flash and Flex
through autograd.

    PYTHONPATH=src python3 bench/gpu_hopper_bench.py [--out DIR] [--quick]

Shape legend: B batch, H / Hkv heads, Sq / Sk queries / keys, D head dim.
Writes hopper.json (and prints a table last).
"""
from __future__ import annotations

import argparse
import json
import zlib
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.testing  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import anyattn as aa  # noqa: E402
from anyattn.problem import describe  # noqa: E402
from anyattn.backends.triton import launch as TL  # noqa: E402
from anyattn.backends.triton.hopper import coverage as HCOV  # noqa: E402
from anyattn.backends.triton.hopper import launch as HL  # noqa: E402
from anyattn.backends.triton.hopper import offline as OFF  # noqa: E402
from anyattn.backends.triton.hopper import configs as HCF  # noqa: E402


def vname(cfg):
    return f"hopper-{cfg.name}"

TOL = {"float16": 3e-3, "bfloat16": 2e-2}
RES = {"meta": {}, "sass": [], "check": [], "bench": []}
OPT = {"ws": True, "bwd": True, "flex": True, "fwd_variants": "", "dims": "64,128",
       "dtypes": "bfloat16", "warm": False, "repeat": 1, "names": "", "seqs": ""}


def fwd_variants(D, dt="bfloat16"):
    """The forward variants this run checks / times (--skip-ws drops the warp-specialised
    ones, --fwd-variants keeps only the named ones; fp16 checks the warp-specialised
    ones only, to bound compile time)."""
    keep = [w for w in OPT["fwd_variants"].split(",") if w]
    extra = [c for c in HCF.FWD_PERSIST_VARIANTS.get(D, [])
             if c.name in keep]                       # named only: not in FWD_VARIANTS
    return [c for c in HCF.FWD_VARIANTS[D] + extra if (OPT["ws"] or not c.ws)
            and (not keep or c.name in keep) and (dt == "bfloat16" or c.ws)]


def bwd_configs(D, dt="bfloat16"):
    return [HCF.bwd_config(D)] + (HCF.BWD_VARIANTS[D] if dt == "bfloat16" else [])


def run_bwd_cfg(p, q, k, v, dout, l2, delta, cfg, bufs=None):
    """(dq or None, dk, dv) of one backward config: the fused kernel (dq too when
    cfg.dq) or the dK/dV kernel; ``bufs``: poisoned (dq, dk, dv) to write."""
    dq, dk, dv = bufs if bufs is not None else (None, None, None)
    if cfg.fused:
        return HL.backward_fused(p, q, k, v, dout, l2, delta, dq, dk, dv, cfg=cfg,
                                 want_dq=cfg.dq)
    return (None,) + tuple(HL.dkdv(p, q, k, v, dout, l2, delta, dk, dv, cfg=cfg))


def log(*a):
    print(*a, flush=True)


def bench_ms(fn, rep=60):
    return triton.testing.do_bench(fn, warmup=15, rep=rep, return_mode="median")


def mask_of(kind, Sq, Sk):
    if kind == "none":
        return None
    if kind == "causal":
        return aa.Causal()
    if kind == "causal_br":
        return aa.Causal(align="bottom_right")
    if kind == "window":
        return aa.Causal() & aa.Window(left=100)
    if kind == "window2":
        return aa.Window(left=64, right=37)
    raise ValueError(kind)


def keep_dense(kind, Sq, Sk, dev):
    i = torch.arange(Sq, device=dev)[:, None]
    j = torch.arange(Sk, device=dev)[None, :]
    if kind == "none":
        return torch.ones(Sq, Sk, dtype=torch.bool, device=dev)
    if kind == "causal":
        return j <= i
    if kind == "causal_br":
        return j <= i + (Sk - Sq)
    if kind == "window":
        return (j <= i) & (i - j <= 100)
    if kind == "window2":
        return (i - j <= 64) & (j - i <= 37)
    raise ValueError(kind)


def ref64(q, k, v, keep, scale):
    """float64 out [B, H, Sq, D] and lse [B, H, Sq] (-inf on empty rows)."""
    G = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(G, 1)
    vv = v.double().repeat_interleave(G, 1)
    s = torch.einsum("bhid,bhjd->bhij", q.double(), kk) * scale
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None])
    p = torch.where(keep, p, 0.0)
    return torch.einsum("bhij,bhjd->bhid", p, vv), lse


def rel(a, b):
    a, b = a.double(), b.double()
    fin = torch.isfinite(b)
    if not fin.any():
        return 0.0
    den = b[fin].abs().max().item()
    return (a[fin] - b[fin]).abs().max().item() / (den if den > 0 else 1.0)


def run_path(path, p, q, k, v, poison=True, cfg=None):
    """(out, max, log_norm) of one path; hopper writes into NaN-poisoned buffers."""
    if path == "hopper":
        B, H, Sq, D = p.batch, p.heads_q, p.seq_q, p.head_dim
        out = torch.full((B, H, Sq, D), float("nan"), dtype=q.dtype, device=q.device)
        st = torch.full((2, B, H, Sq), float("nan"), dtype=torch.float32, device=q.device)
        o, rs = HL.forward(p, q, k, v, out=out if poison else None, stats=st if poison else None,
                           cfg=cfg)
    else:
        os.environ["ANYATTN_TRITON_PATH"] = "portable"
        try:
            o, rs = TL.forward(p, q, k, v, None)
        finally:
            os.environ.pop("ANYATTN_TRITON_PATH", None)
    return o, rs.max, rs.log_norm


def grads64(q, k, v, keep, scale, dout):
    """float64 dq, dk, dv by the explicit formulas (empty rows: P = 0, zero gradients):
    dV = P^T dO, dS = P o (dO V^T - rowsum(P o dO V^T)), dQ = dS K s, dK = dS^T Q s,
    dk / dv summed over each kv head's query group."""
    G = q.shape[1] // k.shape[1]
    qd, do = q.double(), dout.double()
    kd, vd = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    s = torch.einsum("bhid,bhjd->bhij", qd, kd) * scale
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1)
    pr = torch.where(keep, torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None]), 0.0)
    dp = torch.einsum("bhid,bhjd->bhij", do, vd)
    ds = pr * (dp - (pr * dp).sum(-1, keepdim=True))
    dq = torch.einsum("bhij,bhjd->bhid", ds, kd) * scale
    dk = torch.einsum("bhij,bhid->bhjd", ds, qd) * scale
    dv = torch.einsum("bhij,bhid->bhjd", pr, do)
    B, Hkv, Sk, D = k.shape
    return dq, dk.view(B, Hkv, G, Sk, D).sum(2), dv.view(B, Hkv, G, Sk, D).sum(2)


def l2_delta(out, dout, mx, ln):
    """The backward preprocess's l2 [B, H, 2, Sq] and delta [B, H, Sq] (kernels.py doc), in torch."""
    delta = (out.float() * dout.float()).sum(-1).contiguous()
    m = torch.where(mx == float("-inf"), float("inf"), mx)
    return torch.stack([m, ln * 1.4426950408889634], 2).contiguous(), delta


def check_bwd(p, q, k, v, keep, dt, mask):
    """dq, dk, dv of the routed backward (ANYATTN_TRITON_PATH=hopper: Hopper dk / dv,
    portable dq) and of each dK/dV variant (poisoned buffers) vs float64 and portable."""
    why = HCOV.supports(p, "backward", (("q", q), ("k", k), ("v", v)))
    if not OPT["bwd"]:
        why = "skipped (--skip-bwd)"
    res = dict(covered=why is None, why=why)
    if why is not None:
        return res
    out, rs = TL.forward(p, q, k, v, None)
    dout = torch.randn_like(out)
    p = describe(q, k, v, mask=mask, dout=dout, wrt=("q", "k", "v"))
    rq, rk, rv = grads64(q, k, v, keep, p.scale, dout)
    outs = {}
    for path in ("hopper", "portable"):
        os.environ["ANYATTN_TRITON_PATH"] = path
        try:
            outs[path] = TL.backward(p, q, k, v, dout, out, rs, None)
            outs[path + "2"] = TL.backward(p, q, k, v, dout, out, rs, None)
        finally:
            os.environ.pop("ANYATTN_TRITON_PATH", None)
    for path in ("hopper", "portable"):
        g = outs[path]
        for n, r in (("dq", rq), ("dk", rk), ("dv", rv)):
            res[f"err_{n}" + ("" if path == "hopper" else "_portable")] = rel(g[n], r)
    g, g2 = outs["hopper"], outs["hopper2"]
    res["bitwise_repeat"] = all(torch.equal(g[n], g2[n]) for n in ("dq", "dk", "dv"))
    res["nan"] = any(bool(torch.isnan(g[n]).any()) for n in ("dq", "dk", "dv"))
    l2, delta = l2_delta(out, dout, rs.max, rs.log_norm)
    res["variants"] = {}
    for cfg in bwd_configs(p.head_dim, dt):
        shp = (p.batch, p.heads_kv, p.seq_k, p.head_dim)
        nan = lambda shape: torch.full(shape, float("nan"), dtype=q.dtype, device=q.device)  # noqa: E731
        dq, dk, dv = run_bwd_cfg(p, q, k, v, dout, l2, delta, cfg,
                                 (nan(tuple(q.shape)), nan(shp), nan(shp)))
        dq2, dk2, dv2 = run_bwd_cfg(p, q, k, v, dout, l2, delta, cfg)
        ek, ev = rel(dk, rk), rel(dv, rv)
        ok = (not torch.isnan(dk).any() and not torch.isnan(dv).any() and ek <= TOL[dt]
              and ev <= TOL[dt] and torch.equal(dk, dk2) and torch.equal(dv, dv2))
        vr = dict(err_dk=ek, err_dv=ev)
        if dq is not None:
            vr["err_dq"] = eq = rel(dq, rq)
            ok = ok and not torch.isnan(dq).any() and eq <= TOL[dt] and torch.equal(dq, dq2)
        vr["ok"] = bool(ok)
        res["variants"][cfg.name] = vr
    res["ok"] = (not res["nan"] and res["bitwise_repeat"]
                 and all(res[f"err_{n}"] <= TOL[dt] for n in ("dq", "dk", "dv")))
    log(f"   bwd: ok={res['ok']} dq {res['err_dq']:.2e} ({res['err_dq_portable']:.2e}) "
        f"dk {res['err_dk']:.2e} ({res['err_dk_portable']:.2e}) dv {res['err_dv']:.2e} "
        f"({res['err_dv_portable']:.2e}) repeat={res['bitwise_repeat']} variants: "
        + str({k_: (v_['ok'], round(v_['err_dk'], 5)) for k_, v_ in res['variants'].items()}))
    return res


def check_case(name, B, H, Hkv, Sq, Sk, D, dt, kind, layout="bhsd"):
    dev = "cuda"
    tdt = getattr(torch, dt)
    g = torch.Generator(device=dev).manual_seed(zlib.crc32(name.encode()) % 2**31)
    if layout == "bshd":   # [B, S, H, D] memory viewed as [B, H, S, D]
        q = torch.randn(B, Sq, H, D, device=dev, generator=g).to(tdt).transpose(1, 2)
        k = torch.randn(B, Sk, Hkv, D, device=dev, generator=g).to(tdt).transpose(1, 2)
        v = torch.randn(B, Sk, Hkv, D, device=dev, generator=g).to(tdt).transpose(1, 2)
    else:
        q = torch.randn(B, H, Sq, D, device=dev, generator=g).to(tdt)
        k = torch.randn(B, Hkv, Sk, D, device=dev, generator=g).to(tdt)
        v = torch.randn(B, Hkv, Sk, D, device=dev, generator=g).to(tdt)
    mask = mask_of(kind, Sq, Sk)
    p = describe(q, k, v, mask=mask)
    why = HCOV.supports(p, "forward", (("q", q), ("k", k), ("v", v)))
    row = dict(name=name, B=B, H=H, Hkv=Hkv, Sq=Sq, Sk=Sk, D=D, dtype=dt, mask=kind,
               layout=layout, covered=why is None, why=why)
    if why is not None and not why.startswith("head_dim"):
        RES["check"].append(row)
        log(f"check {name}: not covered: {why}")
        return
    keep = keep_dense(kind, Sq, Sk, dev)
    ro, rl = ref64(q, k, v, keep, p.scale)
    if why is not None:   # a head dim the table leaves portable: check the variants only
        row["variants"] = check_variants(p, q, k, v, ro, rl, D, dt)
        row["ok"] = all(v_["ok"] for v_ in row["variants"].values())
        RES["check"].append(row)
        log(f"check {name}: ({why}) variants ok: "
            + str({k_: (v_['ok'], f"{v_['err_out']:.2e}") for k_, v_ in row['variants'].items()}))
        return
    ho, hm, hn = run_path("hopper", p, q, k, v)
    ho2, hm2, hn2 = run_path("hopper", p, q, k, v)
    po, pm, pn = run_path("portable", p, q, k, v)
    torch.cuda.synchronize()
    hl = hm + hn
    pl = pm + pn
    empty = ~torch.isfinite(rl)
    row.update(
        nan_out=bool(torch.isnan(ho).any()), nan_stats=bool(torch.isnan(hm).any() or torch.isnan(hn).any()),
        err_out=rel(ho, ro), err_out_portable=rel(po, ro),
        err_lse=rel(hl, rl), err_lse_portable=rel(pl, rl),
        empty_rows=int(empty.sum()),
        empty_ok=bool(torch.equal(torch.isfinite(hl), torch.isfinite(rl))
                      and (ho.double()[empty.unsqueeze(-1).expand_as(ho)] == 0).all()),
        bitwise_repeat=bool(torch.equal(ho, ho2) and torch.equal(hm, hm2) and torch.equal(hn, hn2)),
        stats_vs_portable_max=float((hm - pm)[torch.isfinite(pm)].abs().max().item()) if torch.isfinite(pm).any() else 0.0)
    row["variants"] = check_variants(p, q, k, v, ro, rl, D, dt)
    row["bwd"] = check_bwd(p, q, k, v, keep, dt, mask)
    row["ok"] = (row["bwd"].get("ok", True) and not row["nan_out"] and not row["nan_stats"] and row["empty_ok"]
                 and row["bitwise_repeat"] and row["err_out"] <= TOL[dt]
                 and row["err_lse"] <= 10 * TOL[dt])
    RES["check"].append(row)
    log(f"check {name}: ok={row['ok']} out {row['err_out']:.2e} (portable {row['err_out_portable']:.2e}) "
        f"lse {row['err_lse']:.2e} (portable {row['err_lse_portable']:.2e}) empty={row['empty_rows']} "
        f"repeat={row['bitwise_repeat']} variants ok: "
        + str({k_: v_['ok'] for k_, v_ in row['variants'].items()}))


def check_variants(p, q, k, v, ro, rl, D, dt):
    """Each forward variant (poisoned buffers, twice) vs float64 out / lse and itself."""
    res = {}
    for cfg in fwd_variants(D, dt):
        vo, vm, vn = run_path("hopper", p, q, k, v, cfg=cfg)
        vo2, vm2, vn2 = run_path("hopper", p, q, k, v, cfg=cfg)
        vl = vm + vn
        res[vname(cfg)] = dict(
            err_out=rel(vo, ro), err_lse=rel(vl, rl),
            ok=bool(not torch.isnan(vo).any() and not torch.isnan(vn).any()
                    and rel(vo, ro) <= TOL[dt] and rel(vl, rl) <= 10 * TOL[dt]
                    and torch.equal(torch.isfinite(vl), torch.isfinite(rl))
                    and torch.equal(vo, vo2) and torch.equal(vm, vm2)
                    and torch.equal(vn, vn2)))
    return res


def phase_check(quick):
    cases = []
    for dt in ("bfloat16", "float16"):
        for D in (64, 128):
            for kind in ("none", "causal", "causal_br", "window", "window2"):
                cases.append((f"{dt[:4]}-D{D}-{kind}-gqa-odd", 2, 4, 2, 257, 383, D, dt, kind))
            cases.append((f"{dt[:4]}-D{D}-causalbr-emptyrows", 1, 2, 1, 300, 200, D, dt, "causal_br"))
            cases.append((f"{dt[:4]}-D{D}-bshd", 2, 4, 4, 512, 512, D, dt, "causal", "bshd"))
    cases.append(("bf16-D128-one-row", 1, 1, 1, 1, 1, 128, "bfloat16", "none"))
    cases.append(("bf16-D64-big", 1, 8, 8, 2048, 2048, 64, "bfloat16", "causal"))
    if quick:
        cases = cases[:4]
    if OPT.get("cases"):
        cases = [c for c in cases if any(w in c[0] for w in OPT["cases"].split(","))]
    for c in cases:
        try:
            check_case(*c)
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            RES["check"].append(dict(name=c[0], error=repr(e)[:400], ok=False))
            log(f"check {c[0]}: ERROR {e!r}"[:400])
        dump()          # a run cut short by its timeout keeps the cases done so far


def fa_flops(b, h, s, d, causal):
    f = 4.0 * b * h * s * s * d
    return f / 2 if causal else f


def phase_bench(quick):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    shapes = [(8, 16, 2048, 128), (2, 16, 8192, 128), (8, 16, 2048, 64), (4, 16, 4096, 64),
              (2, 16, 8192, 64)]
    shapes = [sh for sh in shapes if str(sh[3]) in OPT["dims"].split(",")]
    if OPT["seqs"]:
        shapes = [sh for sh in shapes if str(sh[2]) in OPT["seqs"].split(",")]
    if quick:
        shapes = shapes[:1]
    shapes = [sh + (dt,) for dt in OPT["dtypes"].split(",") for sh in shapes
              if dt == "bfloat16" or sh[3] == 128 or sh[2] == 4096]   # fp16: D=128, 4k
    for (b, h, s, d, dt) in shapes:
        for causal in (False, True):
            tdt = getattr(torch, dt)
            q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=tdt) for _ in range(3))
            mask = aa.Causal() if causal else None
            p = describe(q, k, v, mask=mask)
            row = dict(B=b, H=h, S=s, D=d, dtype=dt, causal=causal, ms={}, tflops={})
            fl = fa_flops(b, h, s, d, causal)

            impls = []

            def put(name, fn):      # timed below, --repeat passes in rotating order
                names = [x for x in OPT["names"].split(",") if x]
                if not names or name in names:
                    impls.append((name, fn))

            if HCOV.supports(p, "forward", (("q", q), ("k", k), ("v", v))) is None:
                put("hopper", lambda: HL.forward(p, q, k, v))
            for cfg in fwd_variants(d, dt):
                put(vname(cfg), lambda cfg=cfg: HL.forward(p, q, k, v, cfg=cfg))
            put("portable", lambda: run_path("portable", p, q, k, v))
            os.environ["ANYATTN_TRITON_PATH"] = "auto"
            put("anyattn.attention", lambda: aa.attention(q, k, v, mask=mask, backend="triton"))
            os.environ.pop("ANYATTN_TRITON_PATH", None)
            for nm, be in (("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                           ("sdpa-flash", SDPBackend.FLASH_ATTENTION)):
                def f(be=be):
                    with sdpa_kernel([be]):
                        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
                put(nm, f)
            bm = create_block_mask((lambda b_, h_, i, j: j <= i) if causal else (lambda b_, h_, i, j: i >= 0),
                                   None, None, s, s, device="cuda")
            if OPT["flex"]:
                put("flex", lambda: flex(q, k, v, block_mask=bm))
            time_rotating(row, impls, fl)
            hp, cd = row["ms"].get("hopper"), row["ms"].get("sdpa-cudnn")
            if isinstance(hp, float) and isinstance(cd, float):
                row["hopper_vs_cudnn"] = round(cd / hp, 3)
            if OPT["bwd"]:
                bench_bwd(row, p, q, k, v, causal, fl * 2.5, flex, bm, mask)
            RES["bench"].append(row)
            log(f"bench B={b} H={h} S={s} D={d} {dt} causal={causal}: " +
                " ".join(f"{k_}={v_}" for k_, v_ in row["tflops"].items()))


def time_rotating(row, impls, fl):
    """Each (name, fn) run once, then timed OPT["repeat"] times, pass r starting at impl
    r (rotating order): row["ms"] / row["tflops"] the medians, row["ms_reps"] each pass;
    an exception is recorded in row["ms"][name] instead."""
    import statistics

    ok = []
    for name, fn in impls:
        try:
            fn()
            torch.cuda.synchronize()
            ok.append((name, fn))
        except Exception as e:  # noqa: BLE001
            row["ms"][name] = repr(e)[:300]
    if OPT["warm"] or not ok:       # --warm-only: compile, no timing
        return
    reps = {name: [] for name, _ in ok}
    for r in range(max(1, OPT["repeat"])):
        for name, fn in ok[r % len(ok):] + ok[:r % len(ok)]:
            reps[name].append(round(bench_ms(fn), 4))
    for name, ms_ in reps.items():
        ms = statistics.median(ms_)
        row["ms"][name] = round(ms, 4)
        row["tflops"][name] = round(fl / ms / 1e9, 1)
    if OPT["repeat"] > 1:
        row["ms_reps"] = reps


def time_into(row, name, fn, flops):
    """Run fn once, then time it into row["ms"][name] / row["tflops"][name]; an exception
    is recorded in row["ms"][name] instead."""
    try:
        fn()
        torch.cuda.synchronize()
        ms = bench_ms(fn)
        row["ms"][name] = round(ms, 4)
        row["tflops"][name] = round(flops / ms / 1e9, 1)
    except Exception as e:  # noqa: BLE001
        row["ms"][name] = repr(e)[:300]


def backward_on_path(path, p, q, k, v, dout, out, rs):
    """The triton backward with ANYATTN_TRITON_PATH set to path for the call."""
    os.environ["ANYATTN_TRITON_PATH"] = path
    try:
        return TL.backward(p, q, k, v, dout, out, rs, None)
    finally:
        os.environ.pop("ANYATTN_TRITON_PATH", None)


def bwd_configs_and_sdpa(put, row, p, q, k, v, dout, l2, delta, cfgs, causal, fl):
    """Time each Hopper backward config alone from the same preprocess terms (with dQ the
    backward's FLOPs fl; dK/dV alone 4 of its 5 products, so 0.8 fl), then SDPA-cuDNN and
    SDPA-flash through autograd.  -> the leaf copies (qg, kg, vg) SDPA used."""
    for cfg in cfgs:
        put(f"bwdk-{cfg.name}", lambda cfg=cfg: run_bwd_cfg(p, q, k, v, dout, l2, delta, cfg),
            fl if cfg.dq else 0.8 * fl)
    qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
    for nm, be in (("bwd-sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                   ("bwd-sdpa-flash", SDPBackend.FLASH_ATTENTION)):
        try:
            with sdpa_kernel([be]):
                o = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg, is_causal=causal)
            put(nm, lambda o=o: torch.autograd.grad(o, (qg, kg, vg), dout, retain_graph=True))
            del o
        except Exception as e:  # noqa: BLE001
            row["ms"][nm] = repr(e)[:300]
    return qg, kg, vg


def bench_bwd(row, p, q, k, v, causal, fl, flex, bm, mask):
    """Backward timings (FLOPs 2.5x the forward's): the triton backward on each path, the
    Hopper dK/dV kernel alone per config, SDPA cuDNN / flash and Flex through autograd."""
    out, rs = TL.forward(p, q, k, v, None)
    dout = torch.randn_like(out)
    p = describe(q, k, v, mask=mask, dout=dout, wrt=("q", "k", "v"))

    def put(name, fn, flops=fl):
        time_into(row, name, fn, flops)

    def tl_bwd(path):
        return backward_on_path(path, p, q, k, v, dout, out, rs)

    put("bwd-hopper", lambda: tl_bwd("hopper"))
    put("bwd-portable", lambda: tl_bwd("portable"))
    l2, delta = l2_delta(out, dout, rs.max, rs.log_norm)
    qg, kg, vg = bwd_configs_and_sdpa(put, row, p, q, k, v, dout, l2, delta,
                                      bwd_configs(p.head_dim), causal, fl)
    try:
        if not OPT["flex"]:
            raise RuntimeError("skipped (--no-flex)")
        o = flex(qg, kg, vg, block_mask=bm)
        put("bwd-flex", lambda: torch.autograd.grad(o, (qg, kg, vg), dout, retain_graph=True))
    except Exception as e:  # noqa: BLE001
        row["ms"]["bwd-flex"] = repr(e)[:300]
    hb, cb = row["ms"].get("bwd-hopper"), row["ms"].get("bwd-sdpa-cudnn")
    if isinstance(hb, float) and isinstance(cb, float):
        row["bwd_hopper_vs_cudnn"] = round(cb / hb, 3)


def phase_sass():
    for D in (64, 128):
        for band, cfg in [(False, None), (True, None)] + [(True, c_) for c_ in HCF.FWD_VARIANTS[D]]:
            t = time.time()
            c = OFF.compile_fwd("bfloat16", D, band, cfg)
            cnt = OFF.instruction_counts(c)
            # cfg None: compile_fwd's default, the route of the mask class
            dflt = HCF.fwd_config(D, "bfloat16", "band" if band else "none")
            cnt.update(D=D, band=band, kernel="fwd", cfg=vname(cfg or dflt),
                       compile_s=round(time.time() - t, 1))
            RES["sass"].append(cnt)
            log(f"sass D={D} band={band}: {cnt}")
        for band, cfg in [(False, None), (True, None)] + [(True, c_) for c_ in HCF.BWD_VARIANTS[D]]:
            t = time.time()
            from anyattn.backends.triton.hopper.bwd_offline import compile_any
            c = compile_any(cfg or HCF.bwd_config(D), "bfloat16", D, band)
            cnt = OFF.instruction_counts(c)
            cnt["sass_DEPBAR"] = OFF.sass_of(c.asm["cubin"]).count("WARPGROUP.DEPBAR")
            cnt.update(D=D, band=band, kernel="dkdv", cfg=(cfg or HCF.bwd_config(D)).name,
                       compile_s=round(time.time() - t, 1))
            RES["sass"].append(cnt)
            log(f"sass D={D} band={band}: {cnt}")


def phase_smoke():
    """One small case per new kernel (the warp-specialised forward, dK/dV): run it in its
    own process under a timeout first, so that a hang costs seconds, not the run.  Each
    forward variant runs alone first (causal, then no mask: both compiles land in the
    cache) and prints 'SMOKE-OK <name>' when done, in FWD_VARIANTS order: a hang names
    the variant, and the variants before it can go on to the full run (--fwd-variants)."""
    dev = "cuda"
    for cfg in fwd_variants(128):
        good = True
        for kind in ("causal", "none"):
            q, k, v = (torch.randn(1, 2, s_, 128, device=dev, dtype=torch.bfloat16)
                       for s_ in (300, 260, 260))
            mask = mask_of(kind, 300, 260)
            p = describe(q, k, v, mask=mask)
            o, m, n = run_path("hopper", p, q, k, v, cfg=cfg)
            ro, rl = ref64(q, k, v, keep_dense(kind, 300, 260, dev), p.scale)
            good = good and rel(o, ro) <= TOL["bfloat16"] and not torch.isnan(o).any()
        log(f"SMOKE-{'OK' if good else 'BAD'} {cfg.name}")
    check_case("smoke-ws-bwd", 1, 2, 1, 300, 260, 128, "bfloat16", "causal")
    r = RES["check"][-1]
    log(f"SMOKE ws={all(v['ok'] for v in r.get('variants', {}).values())} "
        f"bwd={r.get('bwd', {}).get('ok')}")


def bf16_gemm_roof():
    """TFLOP/s of torch's bf16 8192^3 GEMM: the roof the attention kernels are read against."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b)
    return round(2 * 8192**3 / ms / 1e9, 1)


def phase_roof():
    RES["meta"]["bf16_gemm_tflops"] = bf16_gemm_roof()
    log(f"roof: torch bf16 GEMM 8192^3 {RES['meta']['bf16_gemm_tflops']} TFLOP/s")


def dump():
    os.makedirs(RES["meta"]["out"], exist_ok=True)
    with open(os.path.join(RES["meta"]["out"], "hopper.json"), "w") as f:
        json.dump(RES, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--phases", default="sass,check,roof,bench")
    ap.add_argument("--skip-ws", action="store_true", help="no warp-specialised forward")
    ap.add_argument("--skip-bwd", action="store_true", help="no Hopper dK/dV")
    ap.add_argument("--no-flex", action="store_true", help="no FlexAttention timings")
    ap.add_argument("--fwd-variants", default="", help="time / check only the forward "
                    "variants of these comma-separated names (HopperConfig.name)")
    ap.add_argument("--dims", default="64,128", help="head dims of the timed shapes")
    ap.add_argument("--dtypes", default="bfloat16", help="dtypes of the timed shapes "
                    "(float16 rows: the D=128 shapes and D=64 S=4k)")
    ap.add_argument("--warm-only", action="store_true", help="bench phase: call each "
                    "timed function once (compiles into Triton's cache), time nothing")
    ap.add_argument("--cases", default="", help="check only cases whose name holds one of "
                    "these comma-separated words")
    ap.add_argument("--repeat", type=int, default=1, help="bench phase: time each forward "
                    "this many times, in rotating order (medians; each pass in ms_reps)")
    ap.add_argument("--names", default="", help="bench phase: time only the forwards of "
                    "these comma-separated names (hopper, hopper-<variant>, sdpa-cudnn, ..)")
    ap.add_argument("--seqs", default="", help="bench phase: only shapes of these S")
    a = ap.parse_args()
    OPT.update(ws=not a.skip_ws, bwd=not a.skip_bwd, flex=not a.no_flex, cases=a.cases,
               fwd_variants=a.fwd_variants, dims=a.dims, dtypes=a.dtypes, warm=a.warm_only,
               repeat=a.repeat, names=a.names, seqs=a.seqs)
    RES["meta"]["out"] = a.out
    RES["meta"]["options"] = dict(OPT)
    RES["meta"].update(date=time.strftime("%Y-%m-%d %H:%M"), device=torch.cuda.get_device_name(),
                       torch=torch.__version__, triton=triton.__version__,
                       cudnn=torch.backends.cudnn.version(),
                       flops="FlashAttention convention: fwd 4*B*H*S*S*D, causal /2")
    log(RES["meta"])
    for ph in a.phases.split(","):
        t = time.time()
        try:
            {"sass": phase_sass, "check": lambda: phase_check(a.quick), "roof": phase_roof,
             "bench": lambda: phase_bench(a.quick), "smoke": phase_smoke}[ph]()
        except Exception as e:  # noqa: BLE001
            RES["meta"][f"{ph}_error"] = repr(e)[:500]
            log(f"phase {ph} failed: {e!r}")
        log(f"phase {ph}: {time.time() - t:.1f} s")
        dump()
    bad = [r["name"] for r in RES["check"] if not r.get("ok", True) and r.get("covered", True)]
    badv = sorted({f"{r['name']}:{k}" for r in RES["check"] for k, v in
                   list(r.get("variants", {}).items()) + list(r.get("bwd", {}).get("variants", {}).items())
                   if not v["ok"]})
    log(f"failing variants: {badv}")
    log(f"checks: {len(RES['check'])} cases, failing: {bad}")
    for r in RES["bench"]:
        log(f"B={r['B']} H={r['H']} S={r['S']} D={r['D']} {r.get('dtype')} causal={r['causal']} TFLOP/s " +
            " ".join(f"{k}={v}" for k, v in r["tflops"].items()) + f"  vs cuDNN fwd {r.get('hopper_vs_cudnn')}"
            f" bwd {r.get('bwd_hopper_vs_cudnn')}")


if __name__ == "__main__":
    main()
