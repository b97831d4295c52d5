"""GPU benchmark of the triton backend (one command, one process), for the H200.

    PYTHONUNBUFFERED=1 python bench/gpu_bench.py --check --bench --out $OUT

Phases (any subset, in this order):
  --magnitudes  row statistics at any magnitude: P = 1 exactly on single-key rows at logits
           up to 1e6, uniform finite bias rows (-1e12, -1e30, finfo.min), bf16 and fp32
  --check  correctness sweep on the GPU at large sizes vs a float64 torch computation
           (every mask, bf16/fp16/fp32/tf32, GQA, bias+dbias, odd head dims, Sq != Sk)
  --tune   time candidate tile configs of each kernel on a few problem classes
  --ab     one-launch (fused) vs two-launch backward, plan variants and dbias configs,
           side by side with FlexAttention on the same shapes (bf16)
  --bench  anyattn-triton vs torch SDPA (flash, cuDNN, mem-efficient) and FlexAttention
           (torch.compile), same process: dense 16k tokens, hidden 2048, D in {64, 128},
           S in {512 .. 16k}, causal and not, bf16 / fp32 / tf32; masked B=4 H=16 S=4096
           D=128 (sliding-window causal 512, document-causal 8 docs, random 50 % block
           KeepMask, bias + dbias [1, H, S, S]), bf16 and fp32.
TFLOP/s by the FlashAttention convention (fwd 4*B*H*Sq*Sk*D, bwd 2.5x, causal 1/2);
masked cases also by kept pairs.  Writes JSON (and a log) under --out.
"""
from __future__ import annotations

import argparse
import json
import zlib
import math
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

import anyattn as aa  # noqa: E402
from anyattn.backends.triton import configs as C  # noqa: E402
from anyattn.backends.triton import launch as L  # noqa: E402
from anyattn.problem import describe  # noqa: E402

TOKENS, HIDDEN = 16384, 2048
TOL = {"bfloat16": 2e-2, "float16": 3e-3, "float32": 1e-5, "tf32": 3e-4}
ANCHOR_DIR = os.path.join(os.path.dirname(HERE), "..", "shared", "anchors")
DT = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}

RESULTS = {"meta": {}, "check": [], "tune": [], "bench": []}
SAVE = None   # set by main: writes the JSON after every row


def log(*a):
    print(*a, flush=True)


def bench_ms(fn, rep=50):
    return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def fa_flops(b, h, sq, sk, d, causal):
    f = 4.0 * b * h * sq * sk * d
    return f / 2 if causal else f


# ----------------------------------------------------------------------------- masks
def make_mask(kind, B, H, Sq, Sk, dev, gen):
    """-> (anyattn mask, dense keep bool broadcastable to [B,H,Sq,Sk] or None, flex mod or None)."""
    i = torch.arange(Sq, device=dev)[:, None]
    j = torch.arange(Sk, device=dev)[None, :]
    if kind == "none":
        return None, None, None
    if kind == "causal":
        return aa.Causal(), (j <= i), (lambda b, h, qi, ki: qi >= ki)
    if kind == "causal_br":
        return aa.Causal("bottom_right"), (j <= i + (Sk - Sq)), None
    if kind.startswith("sliding"):
        w = int(kind.split(":")[1]) if ":" in kind else 512
        keep = (j <= i) & (i - j <= w)
        return aa.Causal() & aa.Window(left=w), keep, (lambda b, h, qi, ki: (qi >= ki) & (qi - ki <= w))
    if kind.startswith("doc"):
        n = 8
        doc = torch.sort(torch.randint(0, n, (Sq,), device=dev, generator=gen)).values
        keep = (doc[:, None] == doc[None, :]) & (j <= i)
        return (aa.Causal() & aa.Documents(doc.to(torch.int32)), keep,
                (lambda b, h, qi, ki: (doc[qi] == doc[ki]) & (qi >= ki)))
    if kind.startswith("blocks"):
        blk = 128
        nq, nk = triton.cdiv(Sq, blk), triton.cdiv(Sk, blk)
        bm = torch.rand(nq, nk, device=dev, generator=gen) < 0.5
        keep = bm.repeat_interleave(blk, 0).repeat_interleave(blk, 1)[:Sq, :Sk].contiguous()
        return aa.KeepMask(keep), keep, (lambda b, h, qi, ki: bm[qi // blk, ki // blk])
    if kind == "keep_rand":
        keep = torch.rand(Sq, Sk, device=dev, generator=gen) < 0.5
        return aa.KeepMask(keep), keep, None
    raise ValueError(kind)


# ----------------------------------------------------------------------------- float64 oracle
def ref64(q, k, v, g, keep, bias, scale, bias_shape=None):
    """Dense float64 forward + backward on the GPU -> dict(out, lse, dq, dk, dv, dbias)."""
    B, H, Sq, D = q.shape
    Hkv = k.shape[1]
    G = H // Hkv
    qd, kd, vd, gd = (x.double() for x in (q, k, v, g))
    kx, vx = kd.repeat_interleave(G, 1), vd.repeat_interleave(G, 1)
    s = scale * qd @ kx.transpose(-1, -2)
    if bias is not None:
        s = s + bias.double()
    if keep is not None:
        s = s.masked_fill(~keep, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    e = torch.exp(s - m)
    del s
    tot = e.sum(-1, keepdim=True)
    p = torch.where(tot > 0, e / torch.where(tot > 0, tot, torch.ones_like(tot)), torch.zeros_like(e))
    del e
    lse = torch.where(tot[..., 0] > 0, torch.log(tot[..., 0].clamp_min(1e-300)) + m[..., 0],
                      torch.full_like(m[..., 0], float("-inf")))
    out = p @ vx
    dp = gd @ vx.transpose(-1, -2)
    ds = p * (dp - (gd * out).sum(-1, keepdim=True))
    del dp
    dq = scale * ds @ kx
    dk = (scale * ds.transpose(-1, -2) @ qd).reshape(B, Hkv, G, -1, D).sum(2)
    dv = (p.transpose(-1, -2) @ gd).reshape(B, Hkv, G, -1, D).sum(2)
    dbias = None
    if bias_shape is not None:
        dims = [a for a, n in enumerate(bias_shape) if n == 1 and ds.shape[a] != 1]
        dbias = ds.sum(dim=dims, keepdim=True) if dims else ds
    return dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv, dbias=dbias)


def rel_err(got, ref):
    got, ref = got.double(), ref.double()
    fin = torch.isfinite(ref)
    sc = ref[fin].abs().max().item() if fin.any() else 0.0
    if torch.isnan(got).any():
        return float("nan")
    d = (got - ref).abs()[fin].max().item() if fin.any() else 0.0
    return d / sc if sc > 0 else d


DEV = "cuda"


def check_case(name, B, Hq, Hkv, Sq, Sk, D, dt, prec, mask_kind, bias_shape=None, env=None):
    old = {k_: os.environ.get(k_) for k_ in (env or {})}
    os.environ.update(env or {})
    try:
        _check_case(name, B, Hq, Hkv, Sq, Sk, D, dt, prec, mask_kind, bias_shape, env)
    finally:
        for k_, v_ in old.items():
            if v_ is None:
                os.environ.pop(k_, None)
            else:
                os.environ[k_] = v_


def _check_case(name, B, Hq, Hkv, Sq, Sk, D, dt, prec, mask_kind, bias_shape, env):
    dev = DEV
    gen = torch.Generator(device=dev).manual_seed(zlib.crc32(name.encode()) % 2**31)
    dtype = DT[dt]
    q = torch.randn(B, Hq, Sq, D, device=dev, generator=gen).to(dtype)
    k = torch.randn(B, Hkv, Sk, D, device=dev, generator=gen).to(dtype)
    v = torch.randn(B, Hkv, Sk, D, device=dev, generator=gen).to(dtype)
    g = torch.randn(B, Hq, Sq, D, device=dev, generator=gen).to(dtype)
    mask, keep, _ = make_mask(mask_kind, B, Hq, Sq, Sk, dev, gen)
    bias = None
    wrt = ("q", "k", "v")
    if bias_shape is not None:
        bias = torch.randn(*bias_shape, device=dev, generator=gen).to(dtype)
        wrt = wrt + ("bias",)
    precision = "tf32" if prec == "tf32" else None
    t0 = time.time()
    out, lse = aa.attention(q, k, v, mask=mask, bias=bias, return_lse=True, backend="triton",
                            precision=precision)
    gr = aa.attention_backward(q, k, v, g, out=out, lse=lse, mask=mask, bias=bias, wrt=wrt,
                               backend="triton", precision=precision)
    gr2 = aa.attention_backward(q, k, v, g, out=out, lse=lse, mask=mask, bias=bias, wrt=wrt,
                                backend="triton", precision=precision)
    if dev == "cuda":
        torch.cuda.synchronize()
    t_run = time.time() - t0
    repeat = all(torch.equal(getattr(gr, n), getattr(gr2, n)) for n in ("dq", "dk", "dv"))
    r = ref64(q, k, v, g, keep, bias, 1.0 / math.sqrt(D), bias_shape)
    tolkey = "tf32" if prec == "tf32" else ("float32" if dt == "fp32" else
                                             {"bf16": "bfloat16", "fp16": "float16"}[dt])
    errs = {"out": rel_err(out, r["out"]), "dq": rel_err(gr.dq, r["dq"]),
            "dk": rel_err(gr.dk, r["dk"]), "dv": rel_err(gr.dv, r["dv"])}
    lfin = torch.isfinite(r["lse"])
    errs["lse_abs"] = (lse.double() - r["lse"])[lfin].abs().max().item() if lfin.any() else 0.0
    lse_inf_ok = bool(torch.equal(torch.isfinite(lse), lfin))
    if bias_shape is not None:
        errs["dbias"] = rel_err(gr.dbias, r["dbias"])
    ok = all(e <= TOL[tolkey] for n, e in errs.items() if n != "lse_abs") and repeat and lse_inf_ok
    row = dict(name=name, B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=Sk, D=D, dtype=dt, prec=prec,
               mask=mask_kind, bias=bias_shape, errs={k_: float(f"{v_:.3g}") for k_, v_ in errs.items()},
               env=env, tol=TOL[tolkey], bitwise_repeatable=repeat, lse_inf_ok=lse_inf_ok, ok=ok,
               first_run_s=round(t_run, 2))
    RESULTS["check"].append(row)
    log(("PASS " if ok else "FAIL ") + json.dumps(row))
    del r
    if dev == "cuda":
        torch.cuda.empty_cache()


NEW_CHECKS = [
    ("S4096_causal_bias_fp32", 1, 4, 4, 4096, 4096, 128, "fp32", "", "causal",
     (1, 4, 4096, 4096)),
    ("S4096_doc_tf32", 1, 4, 4, 4096, 4096, 128, "fp32", "tf32", "doc", None),
    ("D80_S3000_fp16", 1, 2, 1, 3000, 3000, 80, "fp16", "", "doc", None),
]


def phase_check_scaled():
    """The scaled fp16 schemes on inputs far from unit size: every (batch, head) of q, k,
    v, dout multiplied by its own power of ten (1e-6 .. 1e6, differing within a GQA group),
    plus rows of huge and tiny values, with a causal mask and a [1, H, S, S] bias; errors
    vs float64 for each precision."""
    dev = DEV
    gen = torch.Generator(device=dev).manual_seed(3)
    B, Hq, Hkv, S, D = 2, 4, 2, 2048, 128
    q, k, v, g = (torch.randn(B, h_, S, D, device=dev, generator=gen)
                  for h_ in (Hq, Hkv, Hkv, Hq))
    ex = lambda n: torch.randint(-6, 7, (B, n, 1, 1), device=dev, generator=gen).float()  # noqa: E731
    q = q * 10.0 ** (ex(Hq) / 4)       # scores stay O(10): softmax neither flat nor one-hot
    k = k * 10.0 ** (ex(Hkv) / 4)
    v = v * 10.0 ** ex(Hkv)
    g = g * 10.0 ** ex(Hq)
    v[0, 0, 5] *= 1e4                  # one huge value row, one tiny
    v[0, 0, 6] *= 1e-4
    bias = torch.randn(1, Hq, S, S, device=dev, generator=gen)
    keep = torch.ones(S, S, dtype=torch.bool, device=dev).tril()
    r = ref64(q, k, v, g, keep, bias, 1.0 / math.sqrt(D), (1, Hq, S, S))
    for scheme, precision in (("f16x3", "highest"), ("f16x3", "tf32")):
        try:
            out, lse = aa.attention(q, k, v, mask=aa.Causal(), bias=bias, return_lse=True,
                                    backend="triton", precision=precision)
            gr = aa.attention_backward(q, k, v, g, out=out, lse=lse, mask=aa.Causal(), bias=bias,
                                       wrt=("q", "k", "v", "bias"), backend="triton",
                                       precision=precision)
            errs = {n: float(f"{rel_err(x, r[n]):.3g}") for n, x in
                    (("out", out), ("dq", gr.dq), ("dk", gr.dk), ("dv", gr.dv),
                     ("dbias", gr.dbias))}
            tol = TOL["float32" if precision == "highest" else "tf32"]
            row = dict(name=f"scaled_inputs_{scheme}_{precision}", errs=errs, tol=tol,
                       ok=max(errs.values()) <= tol,
                       finite=all(bool(torch.isfinite(x).all()) for x in
                                  (out, gr.dq, gr.dk, gr.dv, gr.dbias)))
        except Exception as e:  # noqa: BLE001
            row = dict(name=f"scaled_inputs_{scheme}_{precision}", ok=False, error=repr(e)[:300])
        RESULTS["check"].append(row)
        log(("PASS " if row.get("ok") else "FAIL ") + json.dumps(row))
        if SAVE is not None:
            SAVE()
    del r
    torch.cuda.empty_cache()


def phase_check(which="full", names=()):
    if which == "new":
        for c in NEW_CHECKS:
            try:
                check_case(*c)
            except Exception as e:  # noqa: BLE001
                RESULTS["check"].append(dict(name=c[0], ok=False, error=repr(e)[:400]))
                log("ERROR", c[0], repr(e)[:400])
        return
    cases = [
        ("S8192_causal_bf16", 1, 2, 2, 8192, 8192, 128, "bf16", "", "causal", None),
        ("S8192_none_fp32", 1, 2, 2, 8192, 8192, 128, "fp32", "", "none", None),
        ("S8192_none_tf32", 1, 2, 2, 8192, 8192, 128, "fp32", "tf32", "none", None),
        ("S8192_causal_fp16", 1, 2, 2, 8192, 8192, 64, "fp16", "", "causal", None),
        ("S4096_sliding_bf16", 1, 4, 4, 4096, 4096, 128, "bf16", "", "sliding:512", None),
        ("S4096_doc_fp32", 1, 4, 4, 4096, 4096, 128, "fp32", "", "doc", None),
        ("S4096_blocks_bf16", 1, 4, 4, 4096, 4096, 128, "bf16", "", "blocks", None),
        ("S2048_keeprand_fp32", 1, 2, 2, 2048, 2048, 64, "fp32", "", "keep_rand", None),
        ("S4096_bias1H_bf16", 2, 4, 4, 4096, 4096, 128, "bf16", "", "none", (1, 4, 4096, 4096)),
        ("S2048_biasfull_fp32", 2, 2, 2, 2048, 2048, 128, "fp32", "", "causal", (2, 2, 2048, 2048)),
        ("S2048_biasB11S_fp32", 2, 4, 4, 2048, 2048, 64, "fp32", "", "none", (2, 1, 1, 2048)),
        ("gqa4_S4096_bf16", 1, 8, 2, 4096, 4096, 128, "bf16", "", "causal", None),
        ("gqa4_S2048_fp32", 1, 8, 2, 2048, 2048, 128, "fp32", "", "sliding:300", None),
        ("D256_S2048_bf16", 1, 2, 2, 2048, 2048, 256, "bf16", "", "causal", None),
        ("D256_S1024_fp32", 1, 2, 2, 1024, 1024, 256, "fp32", "", "none", None),
        ("D80_S3000_fp16", 1, 2, 1, 3000, 3000, 80, "fp16", "", "doc", None),
        ("D8_S1000_fp32", 1, 2, 2, 1000, 1000, 8, "fp32", "", "causal", None),
        ("SqneSk_br_bf16", 1, 2, 2, 1000, 3000, 128, "bf16", "", "causal_br", None),
        ("SqgtSk_br_fp32", 1, 2, 2, 3000, 1000, 64, "fp32", "", "causal_br", None),
    ]
    for c in cases:
        if names and c[0] not in names:
            continue
        try:
            check_case(*c)
        except Exception as e:  # noqa: BLE001
            RESULTS["check"].append(dict(name=c[0], ok=False, error=repr(e)[:400]))
            log("ERROR", c[0], repr(e)[:400])
            traceback.print_exc()


# ----------------------------------------------------------------------------- tuning
def _inputs(B, Hq, Hkv, S, D, dtype, gen=None):
    mk = lambda h: torch.randn(B, h, S, D, device="cuda", dtype=dtype)  # noqa: E731
    return mk(Hq), mk(Hkv), mk(Hkv), mk(Hq)


def phase_tune():
    KC = C.KernelConfig
    classes = [
        ("bf16", None, 128, 4, 16, 4096, [KC(128, 64, 8, 3), KC(128, 128, 8, 3), KC(128, 64, 4, 3),
                                         KC(128, 128, 8, 2), KC(64, 64, 4, 3), KC(128, 32, 4, 4)],
         [KC(64, 128, 8, 3), KC(32, 128, 4, 3), KC(64, 128, 8, 2), KC(32, 128, 8, 3),
          KC(64, 64, 4, 3), KC(128, 128, 8, 2), KC(64, 128, 4, 3)],
         [KC(128, 64, 8, 3), KC(128, 32, 4, 3), KC(64, 64, 4, 3), KC(128, 128, 8, 2),
          KC(128, 64, 8, 2), KC(128, 64, 4, 3)]),
        ("bf16", None, 64, 8, 32, 2048, [KC(128, 64, 4, 3), KC(128, 128, 8, 3), KC(128, 64, 8, 3),
                                        KC(64, 64, 4, 3)],
         [KC(64, 128, 8, 3), KC(32, 128, 4, 3), KC(64, 128, 4, 3), KC(128, 128, 8, 3)],
         [KC(128, 64, 8, 3), KC(128, 32, 4, 3), KC(128, 64, 4, 3), KC(128, 128, 8, 3)]),
        ("fp32", None, 128, 4, 16, 4096, [KC(64, 64, 4, 2), KC(128, 64, 8, 2), KC(64, 32, 4, 2),
                                         KC(128, 32, 4, 2)],
         [KC(32, 64, 4, 2), KC(64, 64, 8, 2), KC(32, 128, 8, 2), KC(16, 64, 4, 2)],
         [KC(64, 32, 4, 2), KC(64, 64, 8, 2), KC(128, 32, 8, 2), KC(32, 64, 4, 2)]),
        ("fp32", "tf32", 128, 4, 16, 4096, [KC(64, 64, 4, 2), KC(128, 64, 8, 2), KC(128, 32, 4, 2)],
         [KC(32, 64, 4, 2), KC(64, 64, 8, 2), KC(32, 128, 8, 2)],
         [KC(64, 32, 4, 2), KC(64, 64, 8, 2), KC(128, 32, 8, 2)]),
    ]
    for dt, prec, D, B, H, S, fwd_c, dkdv_c, dq_c in classes:
        dtype = DT[dt]
        q, k, v, g = _inputs(B, H, H, S, D, dtype)
        precision = prec or "highest"
        p = describe(q, k, v, dout=g, precision=prec, wrt=("q", "k", "v"))
        base = C.plan_for(C.padded_dim(D), p.dtype, precision, "none", False, S)
        ff = fa_flops(B, H, S, S, D, False)
        out, st = L.forward(p, q, k, v, None, base)     # st: RowStats(max, log_norm)
        for pr in (precision,):
            for kind, cands in (("fwd", fwd_c), ("dkdv", dkdv_c), ("dq", dq_c)):
                for c in cands:
                    plan = C.Plan(**{**{f: getattr(base, f) for f in ("fwd", "dkdv", "dq", "dbias",
                                                                      "pre_bm", "sbq", "sbk",
                                                                      "fused_bwd")},
                                     kind: c})
                    try:
                        if kind == "fwd":
                            fn = lambda: L.forward(p, q, k, v, None, plan)  # noqa: E731
                        else:
                            wrt = ("k", "v") if kind == "dkdv" else ("q",)
                            p2 = describe(q, k, v, dout=g, out=out, lse=st.lse, precision=prec,
                                          wrt=wrt)
                            fn = lambda: L.backward(p2, q, k, v, g, out, st, None, plan)  # noqa: E731
                        fn()
                        ms = bench_ms(fn, rep=30)
                        share = 1.0 if kind == "fwd" else (4 / 5 if kind == "dkdv" else 3 / 5)
                        tf = (ff if kind == "fwd" else ff * 2.5 * share) / ms / 1e9
                        row = dict(dtype=dt, prec=pr, D=D, B=B, H=H, S=S, kernel=kind,
                                   cfg=[c.bm, c.bn, c.num_warps, c.num_stages], ms=round(ms, 4),
                                   tflops_own=round(tf, 1))
                    except Exception as e:  # noqa: BLE001
                        row = dict(dtype=dt, prec=pr, D=D, kernel=kind,
                                   cfg=[c.bm, c.bn, c.num_warps, c.num_stages], error=repr(e)[:200])
                    RESULTS["tune"].append(row)
                    log("TUNE", json.dumps(row))
        del q, k, v, g, out, st
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- timing
def time_triton(q, k, v, g, mask, bias, precision, wrt):
    out, lse = aa.attention(q, k, v, mask=mask, bias=bias, return_lse=True, backend="triton",
                            precision=precision)
    fwd = bench_ms(lambda: aa.attention(q, k, v, mask=mask, bias=bias, backend="triton",
                                        precision=precision))
    bwd_fn = lambda: aa.attention_backward(q, k, v, g, out=out, lse=lse, mask=mask, bias=bias,  # noqa: E731
                                           wrt=wrt, backend="triton", precision=precision)
    bwd = bench_ms(bwd_fn)
    del out, lse
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    o2, l2 = aa.attention(q, k, v, mask=mask, bias=bias, return_lse=True, backend="triton",
                          precision=precision)
    gr = aa.attention_backward(q, k, v, g, out=o2, lse=l2, mask=mask, bias=bias, wrt=wrt,
                               backend="triton", precision=precision)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del o2, l2, gr
    return fwd, bwd, peak


def time_autograd(attn, q, k, v, g, params=()):
    qq, kk, vv = (x.detach().requires_grad_(True) for x in (q, k, v))
    fwd = bench_ms(lambda: attn(qq, kk, vv))
    o = attn(qq, kk, vv)
    bwd = bench_ms(lambda: torch.autograd.grad(o, (qq, kk, vv) + tuple(params), g, retain_graph=True))
    del o
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    o = attn(qq, kk, vv)
    torch.autograd.grad(o, (qq, kk, vv) + tuple(params), g)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    return fwd, bwd, peak


def record(impl, case, dt, prec, b, h, s, d, causal, fwd, bwd, peak, density=None, err=None):
    ff = fa_flops(b, h, s, s, d, causal)
    row = dict(impl=impl, case=case, dtype=dt, prec=prec, B=b, H=h, S=s, D=d, causal=causal)
    if err is not None:
        row["error"] = err[:200]
    else:
        row.update(fwd_ms=round(fwd, 4), bwd_ms=round(bwd, 4),
                   fwd_tflops=round(ff / fwd / 1e9, 1), bwd_tflops=round(2.5 * ff / bwd / 1e9, 1),
                   peak_mem_mib=round(peak / 2**20, 1))
        if density is not None:
            row["density"] = round(density, 4)
            row["fwd_tflops_kept"] = round(density * ff / fwd / 1e9, 1)
            row["bwd_tflops_kept"] = round(density * 2.5 * ff / bwd / 1e9, 1)
    RESULTS["bench"].append(row)
    log("BENCH", json.dumps(row))
    if SAVE is not None:
        SAVE()


def _try(impl, case, dt, prec, b, h, s, d, causal, fn, density=None):
    try:
        fwd, bwd, peak = fn()
        record(impl, case, dt, prec, b, h, s, d, causal, fwd, bwd, peak, density)
    except Exception as e:  # noqa: BLE001
        record(impl, case, dt, prec, b, h, s, d, causal, 0, 0, 0, density, err=repr(e))
    torch.cuda.empty_cache()


def sdpa_fn(backend, causal, mask=None):
    def f(q, k, v):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal, attn_mask=mask)
    return f


def _flex_compiled():
    """torch.compile(flex_attention) that time_autograd can time: its bwd column calls
    autograd.grad on a retained graph, which a compiled backward with donated buffers
    refuses (torch 2.11; donated buffers only save memory), so they are turned off."""
    from torch.nn.attention.flex_attention import flex_attention
    import torch._functorch.config as ftc

    ftc.donated_buffer = False
    return torch.compile(flex_attention, dynamic=False)


def phase_bench(plan_rows, flex_dense, with_sdpa=True):
    """plan_rows: [(precision key, head dims, sequence lengths)]."""
    from torch.nn.attention.flex_attention import create_block_mask

    torch._dynamo.config.recompile_limit = 10_000
    torch._dynamo.config.accumulated_recompile_limit = 10_000
    flex = _flex_compiled()
    for row_spec in plan_rows:
        pk, dims, seqs = row_spec[:3]
        env = row_spec[3] if len(row_spec) > 3 else {}
        causals = row_spec[4] if len(row_spec) > 4 else (False, True)
        os.environ.update(env)
        variant = "/".join(env.values())
        dt = "fp32" if pk == "tf32" else pk
        dtype = DT[dt]
        precision = "tf32" if pk == "tf32" else None
        for d in dims:
            h = HIDDEN // d
            for s in seqs:
                b = max(1, TOKENS // s)
                for causal in causals:
                    q, k, v, g = _inputs(b, h, h, s, d, dtype)
                    mask = aa.Causal() if causal else None
                    label = "anyattn-triton" + (f"[{variant}]" if variant else "")
                    _try(label, "dense", pk, precision or "highest", b, h, s, d, causal,
                         lambda: time_triton(q, k, v, g, mask, None, precision, ("q", "k", "v")))
                    if with_sdpa and pk != "tf32" and not variant:
                        backs = [("sdpa-flash", SDPBackend.FLASH_ATTENTION),
                                 ("sdpa-cudnn", SDPBackend.CUDNN_ATTENTION),
                                 ("sdpa-efficient", SDPBackend.EFFICIENT_ATTENTION)]
                        if dt == "fp32":
                            backs = backs[2:]
                        for name, be in backs:
                            _try(name, "dense", pk, "native", b, h, s, d, causal,
                                 lambda: time_autograd(sdpa_fn(be, causal), q, k, v, g))
                    if flex_dense and pk == "bf16" and d == 128 and s in flex_dense:
                        bm = (create_block_mask(lambda b_, h_, qi, ki: qi >= ki, None, None, s, s,
                                                device="cuda") if causal else None)
                        _try("flex", "dense", pk, "native", b, h, s, d, causal,
                             lambda: time_autograd(lambda q_, k_, v_: flex(q_, k_, v_, block_mask=bm),
                                                   q, k, v, g))
                    del q, k, v, g
                    torch.cuda.empty_cache()
        for name in env:
            os.environ.pop(name, None)


def phase_masked(precs=("bf16", "fp32"), with_flex=True, fp32_masks=False):
    from torch.nn.attention.flex_attention import create_block_mask

    flex = _flex_compiled()
    b, h, s, d = 4, 16, 4096, 128
    gen = torch.Generator(device="cuda").manual_seed(0)
    for pk in precs:
        dt = "fp32" if pk == "tf32" else pk
        dtype = DT[dt]
        precision = "tf32" if pk == "tf32" else None
        for kind in ("sliding:512", "doc", "blocks"):
            if dt == "fp32" and not fp32_masks:
                continue
            q, k, v, g = _inputs(b, h, h, s, d, dtype)
            mask, keep, mod = make_mask(kind, b, h, s, s, "cuda", gen)
            dens = keep.float().mean().item()
            _try("anyattn-triton", kind, pk, precision or "highest", b, h, s, d, False,
                 lambda: time_triton(q, k, v, g, mask, None, precision, ("q", "k", "v")), dens)
            if with_flex and pk == "bf16" and kind != "blocks":
                bm = create_block_mask(mod, None, None, s, s, device="cuda")
                _try("flex", kind, pk, "native", b, h, s, d, False,
                     lambda: time_autograd(lambda q_, k_, v_: flex(q_, k_, v_, block_mask=bm),
                                           q, k, v, g), dens)
            _try("sdpa-efficient-boolmask", kind, pk, "native", b, h, s, d, False,
                 lambda: time_autograd(sdpa_fn(SDPBackend.EFFICIENT_ATTENTION, False, keep),
                                       q, k, v, g), dens)
            del q, k, v, g, keep
            torch.cuda.empty_cache()
        # additive bias with its gradient, broadcast over batch
        q, k, v, g = _inputs(b, h, h, s, d, dtype)
        bias = torch.randn(1, h, s, s, device="cuda", dtype=dtype)
        _try("anyattn-triton", "bias_1HSS", pk, precision or "highest", b, h, s, d, False,
             lambda: time_triton(q, k, v, g, None, bias, precision, ("q", "k", "v", "bias")))
        bias_g = bias.clone().requires_grad_(True)
        _try("sdpa-efficient", "bias_1HSS", pk, "native", b, h, s, d, False,
             lambda: time_autograd(sdpa_fn(SDPBackend.EFFICIENT_ATTENTION, False, bias_g),
                                   q, k, v, g, params=(bias_g,)))
        if with_flex and pk == "bf16" and fp32_masks:
            bias2 = bias[0].clone().requires_grad_(True)
            _try("flex", "bias_1HSS", pk, "native", b, h, s, d, False,
                 lambda: time_autograd(lambda q_, k_, v_: flex(
                     q_, k_, v_, score_mod=lambda sc, b_, h_, qi, ki: sc + bias2[h_, qi, ki]),
                     q, k, v, g, params=(bias2,)))
        # determinism of the bias gradient on this shape
        gr1 = aa.attention_backward(q, k, v, g, bias=bias, wrt=("q", "k", "v", "bias"), backend="triton")
        gr2 = aa.attention_backward(q, k, v, g, bias=bias, wrt=("q", "k", "v", "bias"), backend="triton")
        RESULTS["meta"].setdefault("bias_bitwise_repeatable", {})[pk] = all(
            torch.equal(getattr(gr1, n), getattr(gr2, n)) for n in ("dq", "dk", "dv", "dbias"))
        del q, k, v, g, bias, bias_g, gr1, gr2
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- A/B
def _set_env(env):
    old = {k_: os.environ.get(k_) for k_ in env}
    for k_, v_ in env.items():
        if v_ is None:
            os.environ.pop(k_, None)
        else:
            os.environ[k_] = v_
    return old


def _bwd_ms(q, k, v, g, mask, bias, wrt, env, plan_fields=None):
    """Backward ms of anyattn-triton under env (and optional plan overrides)."""
    old = _set_env(env)
    dtn = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32"}[q.dtype]
    dp = C.padded_dim(q.shape[-1])
    if plan_fields:
        C.set_override(dp, dtn, "highest", **plan_fields)
    try:
        out, lse = aa.attention(q, k, v, mask=mask, bias=bias, return_lse=True, backend="triton")
        fn = lambda: aa.attention_backward(q, k, v, g, out=out, lse=lse, mask=mask, bias=bias,  # noqa: E731
                                           wrt=wrt, backend="triton")
        r = fn()
        ms = bench_ms(fn)
        return ms, r
    finally:
        C.set_override(dp, dtn, "highest")
        _set_env(old)


KC = C.KernelConfig
AB_PLANS_D128 = {   # fused, other tiles (bf16 D=128)
    "fused_s2": dict(dkdv=KC(64, 128, 8, 2), dq=KC(128, 64, 8, 2)),
    "fused_dq64x128": dict(dkdv=KC(64, 128, 8, 3), dq=KC(64, 128, 8, 3)),
    "fused_dkdv128x128_s2": dict(dkdv=KC(128, 128, 8, 2), dq=KC(128, 64, 8, 2)),
    "fused_dkdv32x128": dict(dkdv=KC(32, 128, 8, 3), dq=KC(128, 64, 8, 3)),
}
DBIAS_CFGS = [KC(64, 64, 4, 2), KC(128, 128, 8, 2), KC(128, 64, 8, 2), KC(64, 128, 8, 2),
              KC(64, 64, 4, 3), KC(128, 128, 8, 3)]


def _ab_row(case, b, h, s, d, kind, dtype, variants, with_flex, flex, gen, bias_shape=None):
    """Backward ms of each variant {name: (env, plan fields)} on one shape, side by side
    (and FlexAttention's when with_flex), with bitwise checks against the first."""
    from torch.nn.attention.flex_attention import create_block_mask

    q, k, v, g = _inputs(b, h, h, s, d, dtype)
    mask, keep, mod = make_mask(kind, b, h, s, s, "cuda", gen)
    causal = kind == "causal"
    bias = None if bias_shape is None else torch.randn(*bias_shape, device="cuda", dtype=dtype)
    wrt = ("q", "k", "v") + (("bias",) if bias is not None else ())
    dens = 1.0 if keep is None else keep.float().mean().item()
    ff = fa_flops(b, h, s, s, d, causal) * (1.0 if kind in ("none", "causal") else dens)
    dt = {torch.bfloat16: "bf16", torch.float32: "fp32"}[dtype]
    row = dict(case=case, dtype=dt, B=b, H=h, S=s, D=d, mask=kind, bias=bias_shape,
               density=round(dens, 4), ms={})
    first = None
    for name, (env, fields) in variants.items():
        try:
            ms, r = _bwd_ms(q, k, v, g, mask, bias, wrt, env, fields)
            row["ms"][name] = round(ms, 4)
            if first is None:
                first = r
            else:
                row.setdefault("equal_to_first", {})[name] = all(
                    torch.equal(getattr(first, "d" + n), getattr(r, "d" + n)) for n in wrt)
                if bias is not None:
                    row.setdefault("dbias_rel_diff", {})[name] = float(
                        (r.dbias.float() - first.dbias.float()).abs().max()
                        / first.dbias.float().abs().max())
            del r
        except Exception as e:  # noqa: BLE001
            row["ms"][name] = repr(e)[:200]
    del first
    if with_flex and kind != "blocks" and bias is None and dt == "bf16":
        try:
            bm = None if mod is None else create_block_mask(mod, None, None, s, s, device="cuda")
            _, fb, _ = time_autograd(lambda q_, k_, v_: flex(q_, k_, v_, block_mask=bm), q, k, v, g)
            row["ms"]["flex"] = round(fb, 4)
        except Exception as e:  # noqa: BLE001
            row["ms"]["flex"] = repr(e)[:200]
    row["bwd_tflops"] = {n: round(2.5 * ff / m / 1e9, 1) for n, m in row["ms"].items()
                         if isinstance(m, float)}
    RESULTS.setdefault("ab", []).append(row)
    log("AB", json.dumps(row))
    if SAVE is not None:
        SAVE()
    del q, k, v, g, bias
    torch.cuda.empty_cache()


def phase_ab(groups=("dense", "masked", "dbias"), with_flex=True):
    """A/B timings.  Groups: dense / masked (fused vs two launches, + Flex), dbias (dbias
    kernel configs, on a bias broadcast over queries), bias (dq configs of the in-place
    dbias sum), fp32, variants."""

    torch._dynamo.config.recompile_limit = 10_000
    torch._dynamo.config.accumulated_recompile_limit = 10_000
    flex = _flex_compiled()
    gen = torch.Generator(device="cuda").manual_seed(0)
    bf = torch.bfloat16
    two = {"fused": ({}, dict(fused_bwd=True)), "two_launch": ({}, dict(fused_bwd=False))}
    if "dense" in groups:
        for b, h, s, d, kind in ((16, 16, 1024, 128, "none"), (8, 16, 2048, 128, "none"),
                                 (4, 16, 4096, 128, "none"), (4, 16, 4096, 128, "causal"),
                                 (1, 16, 16384, 128, "none"), (4, 32, 4096, 64, "none")):
            var = dict(two)
            if d == 128 and s == 4096 and kind == "none":
                var.update({n: ({}, f) for n, f in AB_PLANS_D128.items()})
            _ab_row("dense", b, h, s, d, kind, bf, var, with_flex, flex, gen)
    if "masked" in groups:
        for kind in ("sliding:512", "doc", "blocks"):
            _ab_row(kind, 4, 16, 4096, 128, kind, bf, two, with_flex, flex, gen)
    if "dbias" in groups:
        var = {f"dbias{c.bm}x{c.bn}w{c.num_warps}s{c.num_stages}": ({}, dict(dbias=c))
               for c in DBIAS_CFGS}
        _ab_row("bias_11SS", 4, 16, 4096, 128, "none", bf, var, False, flex, gen, (1, 1, 1, 4096))
    if "bias" in groups:
        var = {"owner": ({}, None)}
        var.update({f"owner_dq{c.bm}x{c.bn}w{c.num_warps}s{c.num_stages}": ({}, dict(dq=c))
                    for c in (KC(64, 64, 4, 3), KC(128, 64, 8, 2), KC(64, 128, 8, 3),
                              KC(128, 128, 8, 2))})
        _ab_row("bias_1HSS", 4, 16, 4096, 128, "none", bf, var, False, flex, gen, (1, 16, 4096, 4096))
    if "variants" in groups:
        var = {"fused": ({}, None),
               "fused_s4": ({}, dict(dkdv=KC(64, 128, 8, 4), dq=KC(128, 64, 8, 4)))}
        _ab_row("dense", 4, 16, 4096, 128, "none", bf, var, False, flex, gen)
        var = {"two_launch": ({}, None),
               "fused_w4": ({}, dict(fused_bwd=True, dkdv=KC(64, 128, 4, 3),
                                     dq=KC(128, 64, 4, 3))),
               "fused_w8": ({}, dict(fused_bwd=True)),
               "two_launch_dq_w8": ({}, dict(dq=KC(128, 64, 8, 3)))}
        _ab_row("dense", 4, 32, 4096, 64, "none", bf, var, False, flex, gen)
    if "recheck" in groups:   # the default plan only, with Flex, after a kernel change
        one = {"default": ({}, None)}
        for kind in ("none", "causal", "sliding:512", "doc", "blocks"):
            _ab_row("dense" if kind in ("none", "causal") else kind, 4, 16, 4096, 128, kind, bf,
                    one, with_flex, flex, gen)
        _ab_row("bias_1HSS", 4, 16, 4096, 128, "none", bf, one, False, flex, gen,
                (1, 16, 4096, 4096))
    if "fp32" in groups:
        _ab_row("dense", 4, 16, 4096, 128, "none", torch.float32, two, False, flex, gen)
        _ab_row("bias_1HSS", 4, 16, 4096, 128, "none", torch.float32, {"owner": ({}, None)},
                False, flex, gen, (1, 16, 4096, 4096))


def _fp32_variant_ms(q, k, v, g, precision, fields):
    """(fwd ms, bwd ms, configs that ran) of anyattn-triton fp32 under plan overrides for
    ``precision`` ('highest' / 'tf32')."""
    dp = C.padded_dim(q.shape[-1])
    C.set_override(dp, "float32", precision, **fields)
    before = set(L.prepared.FALLBACK_CACHE)
    try:
        fwd = lambda: aa.attention(q, k, v, return_lse=True, backend="triton",  # noqa: E731
                                   precision=precision)
        out, lse = fwd()
        bwd = lambda: aa.attention_backward(q, k, v, g, out=out, lse=lse, backend="triton",  # noqa: E731
                                            precision=precision)
        bwd()
        ran = {k_[0]: str(v_) for k_, v_ in L.prepared.FALLBACK_CACHE.items() if k_ not in before}
        return bench_ms(fwd, rep=30), bench_ms(bwd, rep=30), ran
    finally:
        C.set_override(dp, "float32", precision)


#: tile variants of the fp32 scheme ('f16x3', both precisions), third round (D=128 and 64)
FP32_VARIANTS3 = [
    ("f16x3", "highest", {}),
    ("f16x3_fused", "highest", dict(fused_bwd=True)),
    ("f16x3_dq64x32w4", "highest", dict(dq=KC(64, 32, 4, 2))),
    ("f16x3_dq128x64w8", "highest", dict(dq=KC(128, 64, 8, 2))),
    ("f16x3_dkdv64x64w8", "highest", dict(dkdv=KC(64, 64, 8, 2))),
    ("f16x3_dkdv32x64w4", "highest", dict(dkdv=KC(32, 64, 4, 2))),
    ("f16x3_fwd128x64w8", "highest", dict(fwd=KC(128, 64, 8, 2))),
]
FP32_VARIANTS3_D64 = [
    ("f16x3", "highest", {}),
    ("f16x3_dkdv64x128w8", "highest", dict(dkdv=KC(64, 128, 8, 2))),
    ("f16x3_dkdv32x128w8", "highest", dict(dkdv=KC(32, 128, 8, 2))),
    ("f16x3_dq128x64w4", "highest", dict(dq=KC(128, 64, 4, 2))),
    ("f16x3_dq64x64w8", "highest", dict(dq=KC(64, 64, 8, 2))),
    ("f16x3_fwd128x64w8", "highest", dict(fwd=KC(128, 64, 8, 2))),
]


#: fourth round, around the f16x3 plan of round three (D=128: fwd 128x64 w8, dK/dV 32x128
#: w8, dQ 128x64 w8 s1; D=64: fwd 128x64 w8, dK/dV 64x128 w8, dQ 64x64 w4)
FP32_VARIANTS4 = [
    ("f16x3", "highest", {}),
    ("f16x3_dq128x32w8", "highest", dict(dq=KC(128, 32, 8, 2))),
    ("f16x3_dkdv32x128w8s1", "highest", dict(dkdv=KC(32, 128, 8, 1))),
    ("f16x3_dkdv64x128w8s1", "highest", dict(dkdv=KC(64, 128, 8, 1))),
    ("f16x3_fused", "highest", dict(fused_bwd=True)),
]
FP32_VARIANTS4_D64 = [
    ("f16x3", "highest", {}),
    ("f16x3_dkdv64x128w8s3", "highest", dict(dkdv=KC(64, 128, 8, 3))),
    ("f16x3_dq128x32w4", "highest", dict(dq=KC(128, 32, 4, 2))),
    ("f16x3_dq64x32w4", "highest", dict(dq=KC(64, 32, 4, 2))),
    ("f16x3_dq128x64w8", "highest", dict(dq=KC(128, 64, 8, 2))),
    ("f16x3_fused", "highest", dict(fused_bwd=True)),
]


def phase_naive_tf32(d=128, s=4096):
    """Error of a naive attention in fp32 with TF32 matmuls (torch autograd, allow_tf32)
    vs float64, on the inputs of phase_fp32_variants: the 'naive implementation in the
    same precision' that DESIGN.md section 4 measures tolerances against."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    qs, ks, vs, gs = (torch.randn(1, 2, s, d, device="cuda", generator=gen) for _ in range(4))
    r = ref64(qs, ks, vs, gs, None, None, 1.0 / math.sqrt(d))
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        q, k, v = (x.clone().requires_grad_(True) for x in (qs, ks, vs))
        p = torch.softmax((q @ k.transpose(-1, -2)) / math.sqrt(d), dim=-1)
        out = p @ v
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), gs)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    row = dict(case="naive_tf32", D=d, S=s, errs={n: float(f"{rel_err(x, r[n]):.3g}") for n, x in
                                                    (("out", out), ("dq", dq), ("dk", dk), ("dv", dv))})
    RESULTS.setdefault("fp32_variants", []).append(row)
    log("NAIVE", json.dumps(row))


def phase_fp32_variants(variants, only=(), d=128):
    """fp32 / tf32 variants at 16k tokens, S=4096 (B=4, H=2048/D): fwd and bwd TFLOP/s, and
    each variant's error vs float64 at B=1 H=2 S=4096 (same code paths, smaller batch)."""
    b, h, s = 4, 2048 // d, 4096
    q, k, v, g = _inputs(b, h, h, s, d, torch.float32)
    gen = torch.Generator(device="cuda").manual_seed(7)
    qs, ks, vs, gs = (torch.randn(1, 2, s, d, device="cuda", generator=gen) for _ in range(4))
    log(f"fp32 variants D={d}: {len(variants)}")
    r = ref64(qs, ks, vs, gs, None, None, 1.0 / math.sqrt(d))
    ff = fa_flops(b, h, s, s, d, False)
    for name, precision, fields in variants:
        if only and name not in only:
            continue
        row = dict(case="fp32_variant", variant=name, precision=precision, fields=str(fields),
                   B=b, H=h, S=s, D=d)
        try:
            t0 = time.time()
            fm, bm_, ran = _fp32_variant_ms(q, k, v, g, precision, fields)
            row.update(fwd_ms=round(fm, 3), bwd_ms=round(bm_, 3), ran=ran,
                       fwd_tflops=round(ff / fm / 1e9, 1), bwd_tflops=round(2.5 * ff / bm_ / 1e9, 1),
                       wall_s=round(time.time() - t0, 1))
            dp = C.padded_dim(d)
            C.set_override(dp, "float32", precision, **fields)
            try:
                out, lse = aa.attention(qs, ks, vs, return_lse=True, backend="triton",
                                        precision=precision)
                gr = aa.attention_backward(qs, ks, vs, gs, out=out, lse=lse, backend="triton",
                                           precision=precision)
            finally:
                C.set_override(dp, "float32", precision)
            row["errs"] = {n: float(f"{rel_err(x, r[n]):.3g}") for n, x in
                           (("out", out), ("dq", gr.dq), ("dk", gr.dk), ("dv", gr.dv))}
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:300]
        RESULTS.setdefault("fp32_variants", []).append(row)
        log("FP32", json.dumps(row))
        if SAVE is not None:
            SAVE()
    del q, k, v, g
    torch.cuda.empty_cache()


def phase_magnitudes(dims=(128, 64)):
    """Row statistics at any magnitude on the GPU (issue 12): a row that keeps one key
    (causal row 0, dout zero elsewhere) has P = 1 exactly at logits ~1, 1e3, 1e6 —
    out = v and dv = dout bit for bit in bf16, to the ~2^-22 of the split parts in fp32 —
    and a row whose finite
    bias is -1e12 / -1e30 / finfo.min on every key attends uniformly (out = mean of v,
    dv = dout / Sk, the dbias row sums to 0), in bf16 and fp32."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    for D in dims:
        for dt in ("bf16", "fp32"):
            for L in (1.0, 1e3, 1e6):
                B, H, S = 1, 2, 512
                q, k, v, g = (torch.randn(B, H, S, D, device="cuda", generator=gen)
                              for _ in range(4))
                q, k = q * L ** 0.5, k * L ** 0.5
                q, k, v, g = (x.to(DT[dt]) for x in (q, k, v, g))
                g[:, :, 1:] = 0
                out = aa.attention(q, k, v, mask=aa.Causal(), backend="triton")
                gr = aa.attention_backward(q, k, v, g, mask=aa.Causal(), backend="triton",
                                           wrt=("v",))
                e_out = (out[:, :, 0].float() - v[:, :, 0].float()).abs().max().item()
                e_dv = (gr.dv[:, :, 0].float() - g[:, :, 0].float()).abs().max().item()
                exact = dt == "bf16"
                tol = 0.0 if exact else 4e-7 * max(v.abs().max().item(), g.abs().max().item())
                row = dict(name=f"single_key_D{D}_{dt}_L{L:g}",
                           ok=e_out <= tol and e_dv <= tol, e_out=e_out, e_dv=e_dv)
                RESULTS["check"].append(row)
                log(("PASS " if row["ok"] else "FAIL ") + json.dumps(row))
    for dt in ("bf16", "fp32"):
        for c in (-1e12, -1e30, float(torch.finfo(DT[dt]).min)):
            B, H, S, D = 1, 2, 256, 128
            q, k, v, g = (torch.randn(B, H, S, D, device="cuda", generator=gen).to(DT[dt])
                          for _ in range(4))
            bias = torch.zeros(1, 1, S, S, device="cuda", dtype=DT[dt])
            bias[..., 5, :] = c
            g2 = torch.zeros_like(g)
            g2[:, :, 5] = g[:, :, 5]
            out, lse = aa.attention(q, k, v, bias=bias, backend="triton", return_lse=True)
            gr = aa.attention_backward(q, k, v, g2, bias=bias, backend="triton",
                                       wrt=("v", "bias"))
            e_out = (out[:, :, 5].float() - v.float().mean(2)).abs().max().item()
            e_dv = (gr.dv.float() - g2[:, :, 5:6].float() / S).abs().max().item()
            dbs = gr.dbias[0, 0, 5].float().sum().item()
            tol = 2e-2 if dt == "bf16" else 1e-6
            row = dict(name=f"uniform_bias_{dt}_{c:g}", e_out=e_out, e_dv=e_dv,
                       dbias_rowsum=dbs, lse_row=lse[0, 0, 5].item(),
                       ok=e_out <= tol and e_dv <= tol / 10 and abs(dbs) <= tol / 2
                       and bool(torch.isfinite(lse).all()))
            RESULTS["check"].append(row)
            log(("PASS " if row["ok"] else "FAIL ") + json.dumps(row))


def attach_anchors():
    """Ratio of each triton row to the anchors measured earlier on this GPU."""
    rows = []
    for fn in ("h200_sdpa_2026-12-02.json", "h200_flex_masks_2026-12-02.json"):
        path = os.path.join(ANCHOR_DIR, fn)
        if os.path.exists(path):
            rows += json.load(open(path))
    RESULTS["meta"]["anchors_found"] = len(rows)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--magnitudes", action="store_true",
                    help="row statistics at any magnitude: single-key rows, uniform bias rows")
    ap.add_argument("--tune", action="store_true")
    ap.add_argument("--ab", default="", help="A/B groups, comma-separated: dense,masked,dbias,bias,variants,recheck,fp32")
    ap.add_argument("--checks", default="", help="comma-separated names of --check cases (default all)")
    ap.add_argument("--bench", action="store_true")
    ap.add_argument("--quick", action="store_true", help="a few dense shapes only")
    ap.add_argument("--dims", default="64,128", help="--bench: head dims (comma-separated)")
    ap.add_argument("--seqs", default="512,1024,2048,4096,8192,16384",
                    help="--bench: sequence lengths (comma-separated; B = 16k tokens / S)")
    ap.add_argument("--masked", action="store_true")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--flex-seqs", default="4096", help="dense S values timed with FlexAttention")
    ap.add_argument("--fp32-masks", action="store_true", help="also time fp32 masked cases")
    ap.add_argument("--flex-masked", action="store_true", help="FlexAttention on masked cases")
    ap.add_argument("--fp32", action="store_true", help="fp32 / tf32 dense variants + fp32 bias")
    ap.add_argument("--check-new", action="store_true", help="correctness of the newer variants")
    ap.add_argument("--f16b", action="store_true",
                    help="scaled fp16, round 2: bf16 re-check, variants, naive tf32 error, "
                         "fp32 / tf32 bench vs SDPA, fp32 masks and bias")
    ap.add_argument("--f16c", action="store_true",
                    help="scaled fp16, confirmation: fp32 D=128 dense and bias vs SDPA")
    ap.add_argument("--f16", action="store_true",
                    help="scaled fp16 schemes: far-from-unit inputs, fp32 checks, variants "
                         "(D=128, 64), fp32 / tf32 bench vs SDPA, fp32 bias")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    RESULTS["meta"].update(torch=torch.__version__, triton=triton.__version__,
                           device=torch.cuda.get_device_name(), cuda=torch.version.cuda,
                           cudnn=torch.backends.cudnn.version(),
                           date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                           flops="FA convention: fwd 4*B*H*Sq*Sk*D, bwd 2.5x fwd, causal 1/2")
    log(json.dumps(RESULTS["meta"]))
    t0 = time.time()
    path = os.path.join(a.out, "triton_bench.json")

    def save():
        RESULTS["meta"]["elapsed_s"] = round(time.time() - t0, 1)
        with open(path, "w") as fh:
            json.dump(RESULTS, fh, indent=1)

    global SAVE
    SAVE = save

    try:
        if a.check:
            phase_check(names=[x for x in a.checks.split(",") if x])
            save()
            log(f"check done {time.time() - t0:.0f}s")
        if a.magnitudes:
            phase_magnitudes()
            save()
            log(f"magnitudes done {time.time() - t0:.0f}s")
        if a.ab:
            phase_ab(groups=a.ab.split(","), with_flex=not a.no_flex)
            save()
            log(f"ab done {time.time() - t0:.0f}s")
        if a.tune:
            phase_tune()
            save()
            log(f"tune done {time.time() - t0:.0f}s")
        if a.bench:
            allS = [int(x) for x in a.seqs.split(",")]
            dims = tuple(int(x) for x in a.dims.split(","))
            if a.quick:
                rows = [("bf16", (128,), [1024, 4096]), ("fp32", (128,), [4096]),
                        ("tf32", (128,), [4096])]
            else:
                rows = [("bf16", dims, allS)]
            phase_bench(rows, [] if a.no_flex else [int(x) for x in a.flex_seqs.split(",")])
            save()
            log(f"bench done {time.time() - t0:.0f}s")
        if a.masked:
            phase_masked(precs=("bf16",), with_flex=not a.no_flex and a.flex_masked,
                         fp32_masks=a.fp32_masks)
            save()
            log(f"masked done {time.time() - t0:.0f}s")
        if a.fp32:
            phase_bench([("fp32", (64, 128), [2048, 4096, 16384]),
                         ("tf32", (64, 128), [4096, 16384])],
                        [], with_sdpa=True)
            phase_masked(precs=("fp32",), with_flex=False, fp32_masks=a.fp32_masks)
            save()
            log(f"fp32 done {time.time() - t0:.0f}s")
        if a.f16:
            phase_check_scaled()
            phase_check(names=["S8192_none_fp32", "S8192_none_tf32", "S4096_doc_fp32",
                               "S2048_keeprand_fp32", "S2048_biasfull_fp32",
                               "S2048_biasB11S_fp32", "gqa4_S2048_fp32", "D256_S1024_fp32",
                               "D8_S1000_fp32", "SqgtSk_br_fp32"])
            save()
            log(f"f16 checks done {time.time() - t0:.0f}s")
            phase_fp32_variants(variants=FP32_VARIANTS3)
            phase_fp32_variants(variants=FP32_VARIANTS3_D64, d=64)
            save()
            log(f"f16 variants done {time.time() - t0:.0f}s")
            phase_bench([("fp32", (64, 128), [2048, 4096, 16384]),
                         ("tf32", (128,), [4096])], [], with_sdpa=True)
            phase_masked(precs=("fp32",), with_flex=False)
            save()
            log(f"f16 bench done {time.time() - t0:.0f}s")
        if a.f16b:
            phase_bench([("bf16", (128,), [4096])], [], with_sdpa=False)
            phase_naive_tf32()
            phase_fp32_variants(variants=FP32_VARIANTS4)
            phase_fp32_variants(variants=FP32_VARIANTS4_D64, d=64)
            save()
            log(f"f16b variants done {time.time() - t0:.0f}s")
            phase_bench([("fp32", (64, 128), [2048, 4096, 16384]),
                         ("tf32", (128,), [4096])], [], with_sdpa=True)
            phase_masked(precs=("fp32",), with_flex=False, fp32_masks=True)
            save()
            log(f"f16b bench done {time.time() - t0:.0f}s")
        if a.f16c:
            phase_bench([("fp32", (128,), [2048, 4096, 16384])], [], with_sdpa=True)
            phase_masked(precs=("fp32",), with_flex=False)
            save()
            log(f"f16c done {time.time() - t0:.0f}s")
        if a.check_new:
            phase_check("new")
            save()
            log(f"check-new done {time.time() - t0:.0f}s")
    finally:
        save()
    summary()


def summary():
    log("\n== check ==")
    for r in RESULTS["check"]:
        log(("ok  " if r.get("ok") else "BAD ") + r["name"] + " " + json.dumps(r.get("errs", r.get("error"))))
    log("\n== bench (fwd / bwd TFLOP/s) ==")
    for r in RESULTS["bench"]:
        if "error" in r:
            log(f"{r['impl']:24s} {r['case']:10s} {r['dtype']:5s} D={r['D']} S={r['S']} c={int(r['causal'])} ERROR {r['error'][:80]}")
        else:
            log(f"{r['impl']:24s} {r['case']:10s} {r['dtype']:5s} D={r['D']:3d} S={r['S']:5d} c={int(r['causal'])} "
                f"fwd {r['fwd_tflops']:6.1f} bwd {r['bwd_tflops']:6.1f}  ({r['fwd_ms']:.3f} / {r['bwd_ms']:.3f} ms) mem {r['peak_mem_mib']} MiB")


if __name__ == "__main__":
    main()
