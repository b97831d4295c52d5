"""The Hopper path (backends/triton/hopper) on an sm_90 GPU: correctness vs float64 and
vs the portable kernels, bitwise repeatability, SASS evidence, and forward timings side
by side with the portable kernels, SDPA-cuDNN, SDPA-flash and FlexAttention, in one
process.  FLOP convention: FlashAttention's (fwd 4*B*H*Sq*Sk*D, causal half).

    PYTHONPATH=src python3 bench/gpu_hopper_bench.py [--out DIR] [--quick]

Shape legend: B batch, H / Hkv heads, Sq / Sk queries / keys, D head dim.
Writes hopper.json (and prints a table last).
"""
from __future__ import annotations

import argparse
import json
import math
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
    return f"hopper-{cfg.bm}x{cfg.bn}s{cfg.stages}{'o' if cfg.overlap else ''}"

TOL = {"float16": 3e-3, "bfloat16": 2e-2}
RES = {"meta": {}, "sass": [], "check": [], "bench": []}


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


def check_case(name, B, H, Hkv, Sq, Sk, D, dt, kind, layout="bhsd"):
    dev = "cuda"
    tdt = getattr(torch, dt)
    g = torch.Generator(device=dev).manual_seed(hash(name) % 2**31)
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
    if why is not None:
        RES["check"].append(row)
        log(f"check {name}: not covered: {why}")
        return
    keep = keep_dense(kind, Sq, Sk, dev)
    ro, rl = ref64(q, k, v, keep, p.scale)
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
    row["variants"] = {}
    for cfg in HCF.FWD_VARIANTS[D]:
        vo, vm, vn = run_path("hopper", p, q, k, v, cfg=cfg)
        vo2, vm2, vn2 = run_path("hopper", p, q, k, v, cfg=cfg)
        vl = vm + vn
        row["variants"][vname(cfg)] = dict(
            err_out=rel(vo, ro), err_lse=rel(vl, rl),
            ok=bool(not torch.isnan(vo).any() and not torch.isnan(vn).any()
                    and rel(vo, ro) <= TOL[dt] and rel(vl, rl) <= 10 * TOL[dt]
                    and torch.equal(torch.isfinite(vl), torch.isfinite(rl))
                    and torch.equal(vo, vo2) and torch.equal(vm, vm2)))
    row["ok"] = (not row["nan_out"] and not row["nan_stats"] and row["empty_ok"]
                 and row["bitwise_repeat"] and row["err_out"] <= TOL[dt]
                 and row["err_lse"] <= 10 * TOL[dt])
    RES["check"].append(row)
    log(f"check {name}: ok={row['ok']} out {row['err_out']:.2e} (portable {row['err_out_portable']:.2e}) "
        f"lse {row['err_lse']:.2e} (portable {row['err_lse_portable']:.2e}) empty={row['empty_rows']} "
        f"repeat={row['bitwise_repeat']} variants ok: "
        + str({k_: v_['ok'] for k_, v_ in row['variants'].items()}))


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
    for c in cases:
        try:
            check_case(*c)
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            RES["check"].append(dict(name=c[0], error=repr(e)[:400], ok=False))
            log(f"check {c[0]}: ERROR {e!r}"[:400])


def fa_flops(b, h, s, d, causal):
    f = 4.0 * b * h * s * s * d
    return f / 2 if causal else f


def phase_bench(quick):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    shapes = [(8, 16, 2048, 128), (2, 16, 8192, 128), (4, 32, 4096, 64)]
    if quick:
        shapes = shapes[:1]
    for (b, h, s, d) in shapes:
        for causal in (False, True):
            q, k, v = (torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
            mask = aa.Causal() if causal else None
            p = describe(q, k, v, mask=mask)
            row = dict(B=b, H=h, S=s, D=d, causal=causal, ms={}, tflops={})
            fl = fa_flops(b, h, s, d, causal)

            def put(name, fn):
                try:
                    fn()
                    torch.cuda.synchronize()
                    ms = bench_ms(fn)
                    row["ms"][name] = round(ms, 4)
                    row["tflops"][name] = round(fl / ms / 1e9, 1)
                except Exception as e:  # noqa: BLE001
                    row["ms"][name] = repr(e)[:300]

            put("hopper", lambda: HL.forward(p, q, k, v))
            for cfg in HCF.FWD_VARIANTS[d]:
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
            put("flex", lambda: flex(q, k, v, block_mask=bm))
            hp, cd = row["ms"].get("hopper"), row["ms"].get("sdpa-cudnn")
            if isinstance(hp, float) and isinstance(cd, float):
                row["hopper_vs_cudnn"] = round(cd / hp, 3)
            RES["bench"].append(row)
            log(f"bench B={b} H={h} S={s} D={d} causal={causal}: " +
                " ".join(f"{k_}={v_}" for k_, v_ in row["tflops"].items()))


def phase_sass():
    for D in (64, 128):
        for band, cfg in [(False, None), (True, None)] + [(True, c_) for c_ in HCF.FWD_VARIANTS[D]]:
            t = time.time()
            c = OFF.compile_fwd("bfloat16", D, band, cfg)
            cnt = OFF.instruction_counts(c)
            cnt.update(D=D, band=band, cfg=vname(cfg or HCF.fwd_config(D)),
                       compile_s=round(time.time() - t, 1))
            RES["sass"].append(cnt)
            log(f"sass D={D} band={band}: {cnt}")


def phase_roof():
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ b)
    RES["meta"]["bf16_gemm_tflops"] = round(2 * 8192**3 / ms / 1e9, 1)
    log(f"roof: torch bf16 GEMM 8192^3 {RES['meta']['bf16_gemm_tflops']} TFLOP/s")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--phases", default="sass,check,roof,bench")
    a = ap.parse_args()
    RES["meta"].update(date=time.strftime("%Y-%m-%d %H:%M"), device=torch.cuda.get_device_name(),
                       torch=torch.__version__, triton=triton.__version__,
                       cudnn=torch.backends.cudnn.version(),
                       flops="FlashAttention convention: fwd 4*B*H*S*S*D, causal /2")
    log(RES["meta"])
    for ph in a.phases.split(","):
        t = time.time()
        try:
            {"sass": phase_sass, "check": lambda: phase_check(a.quick), "roof": phase_roof,
             "bench": lambda: phase_bench(a.quick)}[ph]()
        except Exception as e:  # noqa: BLE001
            RES["meta"][f"{ph}_error"] = repr(e)[:500]
            log(f"phase {ph} failed: {e!r}")
        log(f"phase {ph}: {time.time() - t:.1f} s")
        with open(os.path.join(a.out, "hopper.json"), "w") as f:
            json.dump(RES, f, indent=1)
    bad = [r["name"] for r in RES["check"] if not r.get("ok", True) and r.get("covered", True)]
    badv = sorted({f"{r['name']}:{k}" for r in RES["check"] for k, v in r.get("variants", {}).items()
                   if not v["ok"]})
    log(f"failing variants: {badv}")
    log(f"checks: {len(RES['check'])} cases, failing: {bad}")
    for r in RES["bench"]:
        log(f"B={r['B']} H={r['H']} S={r['S']} D={r['D']} causal={r['causal']} TFLOP/s " +
            " ".join(f"{k}={v}" for k, v in r["tflops"].items()) + f"  vs cuDNN {r.get('hopper_vs_cudnn')}")


if __name__ == "__main__":
    main()
