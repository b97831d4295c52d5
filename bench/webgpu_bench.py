"""webgpu backend: correctness at large sizes and side-by-side timings, one process.

python bench/webgpu_bench.py [--out DIR] [--small] [--quick] [--f16] [--resident [--variants]]
                             [--plot JSON]
--resident [--skip-variants] [--skip-seed] [--resident-sizes 512x64,4096x128]
           [--abi-sizes 512,4096]: the issue-17 table (plan, device arrays with host ms/call,
           host arrays, triton; the seed ABI as three calls and as one grouped call vs the
           plan) without / with the variant axis and the seed kernel.

On the H200 (Vulkan): checks anyattn-webgpu against a float64 torch reference
(up to S=8192), then times the backward (dQ+dK+dV; delta + dK/dV + dQ passes,
device-resident, from the forward's out/lse) of anyattn-webgpu (fp32, f16), the
seed kernel (same Params, S=128..512; WGSL carried in .seed/), anyattn's seed-ABI
path on a wgpu arena, anyattn-triton when importable and torch SDPA mem-efficient
fp32.  On lavapipe (--small / no CUDA): anyattn-webgpu against the NumPy backend.
--f16: only the float16 study at S=4096 (D=64, 128): errors of the f16 default and of
other f16 run lengths vs float64 and vs a naive fp16 torch implementation, fp32 and
f16 fwd/bwd timings side by side, f16 checks with masks/GQA/D=256 at size;
webgpu_bench_f16.{json,png} under --out (small sizes and the NumPy reference on a CPU).
--resident first runs the kernel-variant axis (launch.VARIANTS: portable, prefetch, staged,
subgroups where the adapter has 'subgroup', wide; fp32/f16, S = 512/4096, D = 64/128), each
variant's plans checked vs float64 before they are timed; --variants: that axis alone;
--variant-names / --variant-sizes restrict it (e.g. portable,staged,wide and 4096x128).
FLOP convention (FlashAttention): fwd 4*B*H*Sq*Sk*D, bwd 2.5x that, causal 1/2.
wgpu timing: N submissions of the encoded plan, then a read-back; wall / N.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))

import anyattn as aa  # noqa: E402
from anyattn import abi  # noqa: E402
from anyattn.problem import describe  # noqa: E402
from anyattn.backends.registry import get_backend, unavailable_reason  # noqa: E402

RESULTS = {"checks": [], "timings": [], "errors": []}
PARTIAL = []   # a path to write RESULTS to after each step of a long study (if set)


def save_partial():
    if PARTIAL:
        Path(PARTIAL[0]).write_text(json.dumps(RESULTS, indent=1))


def log(*a):
    print(*a, flush=True)


def flops_bwd(B, H, Sq, Sk, D, causal=False):
    f = 2.5 * 4.0 * B * H * Sq * Sk * D
    return f / 2 if causal else f


def rel(got, ref):
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    return float(np.max(np.abs(got - ref)) / max(np.max(np.abs(ref)), 1e-300))


# ---------------------------------------------------------------- references
def torch_ref(q, k, v, g, causal=False, bias=None):
    """float64 dense reference on the GPU (torch autograd) -> dict of numpy arrays."""
    import torch

    dev = "cuda"
    G = q.shape[1] // k.shape[1]
    t = [torch.from_numpy(np.ascontiguousarray(x)).to(dev, torch.float64).requires_grad_(True)
         for x in (q, k, v)]
    qq, kk, vv = t
    ke, ve = kk.repeat_interleave(G, 1), vv.repeat_interleave(G, 1)
    s = qq @ ke.transpose(-1, -2) / math.sqrt(q.shape[-1])
    bt = None
    if bias is not None:
        bt = torch.from_numpy(bias).to(dev, torch.float64).requires_grad_(True)
        s = s + bt
    if causal:
        Sq, Sk = s.shape[-2:]
        m = torch.ones(Sq, Sk, dtype=torch.bool, device=dev).tril()
        s = s.masked_fill(~m, float("-inf"))
    lse = torch.logsumexp(s, -1)
    o = torch.softmax(s, -1) @ ve
    gg = torch.from_numpy(np.ascontiguousarray(g)).to(dev, torch.float64)
    o.backward(gg)
    out = {"out": o, "lse": lse, "dq": qq.grad, "dk": kk.grad, "dv": vv.grad}
    if bt is not None:
        out["dbias"] = bt.grad
    res = {k_: x.detach().cpu().numpy() for k_, x in out.items()}
    del t, qq, kk, vv, ke, ve, s, o, out
    torch.cuda.empty_cache()
    return res


def np_ref(q, k, v, g, causal=False, bias=None):
    from anyattn import reference as R

    mask = aa.Causal() if causal else None
    o, l = R.forward(q, k, v, mask=mask, bias=bias)
    gr = R.backward(q, k, v, g, mask=mask, bias=bias,
                    wrt=("q", "k", "v") + (("bias",) if bias is not None else ()))
    out = {"out": o, "lse": l, "dq": gr.dq, "dk": gr.dk, "dv": gr.dv}
    if bias is not None:
        out["dbias"] = gr.dbias
    return out


# ------------------------------------------------------------------ anyattn webgpu
def wgpu_plan(be, q, k, v, g, mask=None, bias=None):
    wrt = ("q", "k", "v") + (("bias",) if bias is not None else ())
    p = describe(q, k, v, dout=g, mask=mask, bias=bias, wrt=wrt)
    return be.plan(p, q, k, v, g, bias)


def one_submission_s(plan):
    """Wall seconds of one submission of an encoded plan (waited), after an untimed one."""
    plan.submit(1)
    plan.wait()
    t = time.perf_counter()
    plan.submit(1)
    plan.wait()
    return time.perf_counter() - t


def time_plan(plan, min_s=0.3, max_n=200):
    """(seconds per submission, n): n submissions back to back (enough for min_s), one wait."""
    one = one_submission_s(plan)
    n = int(max(3, min(max_n, min_s / max(one, 1e-6))))
    t = time.perf_counter()
    for _ in range(n):
        plan.submit(1)
    plan.wait()
    return (time.perf_counter() - t) / n, n


def check_case(be, name, B, Hq, Hkv, S, Sk, D, causal=False, bias_shape=None, gpu=True, rng=None):
    rng = rng or np.random.default_rng(0)
    q = rng.standard_normal((B, Hq, S, D)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, Sk, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, Sk, D)).astype(np.float32)
    g = rng.standard_normal((B, Hq, S, D)).astype(np.float32)
    bias = None if bias_shape is None else rng.standard_normal(bias_shape).astype(np.float32)
    mask = aa.Causal() if causal else None
    t = time.perf_counter()
    o, l = aa.attention(q, k, v, mask=mask, bias=bias, return_lse=True, backend="webgpu")
    gr = aa.attention_backward(q, k, v, g, out=o, lse=l, mask=mask, bias=bias,
                               wrt=("q", "k", "v") + (("bias",) if bias is not None else ()),
                               backend="webgpu")
    dt = time.perf_counter() - t
    ref = (torch_ref if gpu else np_ref)(q, k, v, g, causal, bias)
    errs = {"out": rel(o, ref["out"]), "dq": rel(gr.dq, ref["dq"]), "dk": rel(gr.dk, ref["dk"]),
            "dv": rel(gr.dv, ref["dv"])}
    fin = np.isfinite(ref["lse"])
    errs["lse_abs"] = float(np.max(np.abs(l[fin] - ref["lse"][fin])))
    if bias is not None:
        errs["dbias"] = rel(gr.dbias, ref["dbias"])
    worst = max(v_ for k_, v_ in errs.items() if k_ != "lse_abs")
    rec = dict(name=name, B=B, Hq=Hq, Hkv=Hkv, Sq=S, Sk=Sk, D=D, causal=causal,
               bias=bias_shape, errors=errs, worst_rel=worst, ok=worst <= 1e-5,
               api_seconds=dt, pieces=dict(be.last_pieces))
    RESULTS["checks"].append(rec)
    log(f"check {name}: worst rel {worst:.2e} ok={worst <= 1e-5} ({dt:.2f}s) {errs}")


def bench_webgpu(be, B, H, S, D, dtype="float32", causal=False, cfg=None, tag=""):
    rng = np.random.default_rng(1)
    q, k, v, g = (rng.standard_normal((B, H, S, D)).astype(dtype) for _ in range(4))
    be.config_override = cfg
    try:
        fwd, bwd, _, _ = wgpu_plan(be, q, k, v, g, mask=aa.Causal() if causal else None)
        tf, nf = time_plan(fwd)
        tb, nb = time_plan(bwd)
    finally:
        be.config_override = None
    fl = flops_bwd(B, H, S, S, D, causal)
    rec = dict(impl="anyattn-webgpu" + tag, dtype=dtype, B=B, H=H, S=S, D=D, causal=causal,
               bwd_ms=tb * 1e3, fwd_ms=tf * 1e3, bwd_tflops=fl / tb / 1e12,
               fwd_tflops=fl / 2.5 / tf / 1e12, n=nb, config=str(cfg) if cfg else "auto")
    RESULTS["timings"].append(rec)
    log(f"webgpu{tag} {dtype} B={B} H={H} S={S} D={D} causal={causal}: bwd {tb*1e3:.3f} ms "
        f"({rec['bwd_tflops']:.2f} TFLOP/s), fwd {tf*1e3:.3f} ms ({rec['fwd_tflops']:.2f})")
    return rec


def bench_api(B, H, S, D):
    """The public API with NumPy arrays in and out (uploads and read-backs included)."""
    rng = np.random.default_rng(4)
    q, k, v, g = (rng.standard_normal((B, H, S, D)).astype(np.float32) for _ in range(4))
    o, l = aa.attention(q, k, v, return_lse=True, backend="webgpu")
    aa.attention_backward(q, k, v, g, out=o, lse=l, backend="webgpu")
    n = 20
    t = time.perf_counter()
    for _ in range(n):
        aa.attention_backward(q, k, v, g, out=o, lse=l, backend="webgpu")
    tb = (time.perf_counter() - t) / n
    rec = dict(impl="anyattn-webgpu-numpy-api", dtype="float32", B=B, H=H, S=S, D=D,
               bwd_ms=tb * 1e3, bwd_tflops=flops_bwd(B, H, S, S, D) / tb / 1e12, n=n)
    RESULTS["timings"].append(rec)
    log(f"numpy API bwd S={S}: {tb*1e3:.3f} ms (host transfers included)")


# ------------------------------------------------------------------ f16 study
def torch_naive16(q, k, v, g, causal=False):
    """A naive float16 implementation (torch math attention in fp16 on the GPU: fp16
    matmuls with fp32 accumulation, S/P/dS rounded to fp16) -> numpy float64 dict."""
    import torch

    G = q.shape[1] // k.shape[1]
    t = [torch.from_numpy(np.ascontiguousarray(x)).cuda().half().requires_grad_(True)
         for x in (q, k, v)]
    qq, kk, vv = t
    ke, ve = kk.repeat_interleave(G, 1), vv.repeat_interleave(G, 1)
    s = (qq @ ke.transpose(-1, -2)) * (1 / math.sqrt(q.shape[-1]))
    if causal:
        Sq, Sk = s.shape[-2:]
        m = torch.ones(Sq, Sk, dtype=torch.bool, device="cuda").tril()
        s = s.masked_fill(~m, float("-inf"))
    o = torch.softmax(s, -1) @ ve
    o.backward(torch.from_numpy(np.ascontiguousarray(g)).cuda().half())
    res = {"out": o, "dq": qq.grad, "dk": kk.grad, "dv": vv.grad}
    res = {k_: x.detach().double().cpu().numpy() for k_, x in res.items()}
    del t, qq, kk, vv, ke, ve, s, o
    torch.cuda.empty_cache()
    return res


def f16_errors(be, q, k, v, g, ref, causal=False, cfg=None):
    mask = aa.Causal() if causal else None
    be.config_override = cfg
    try:
        o, l = aa.attention(q, k, v, mask=mask, return_lse=True, backend="webgpu")
        gr = aa.attention_backward(q, k, v, g, out=o, lse=l, mask=mask, backend="webgpu")
    finally:
        be.config_override = None
    errs = {"out": rel(o, ref["out"]), "dq": rel(gr.dq, ref["dq"]), "dk": rel(gr.dk, ref["dk"]),
            "dv": rel(gr.dv, ref["dv"])}
    if "lse" in ref:
        fin = np.isfinite(ref["lse"])
        errs["lse_abs"] = float(np.max(np.abs(l[fin] - ref["lse"][fin])))
    return errs


def f16_study(be, gpu=True):
    """f16 vs fp32 at S=4096 (B=1, H=8; D=64, 128): errors of every f16 config against
    float64 (and of a naive fp16 torch implementation), fwd/bwd timings side by side;
    then f16 checks with masks/GQA/Sq != Sk/D=256 at size (default config)."""
    import dataclasses

    from anyattn.backends.webgpu.launch import choose_config, half_config

    TOL16 = 3e-3
    B, H, S = (1, 8, 4096) if gpu else (1, 2, 128)
    rows = []
    for D in (64, 128):
        base = choose_config(be.context, D)          # the fp32 config
        dflt = choose_config(be.context, D, "f16")   # the f16 default
        hc = half_config(base)
        variants = [("f16-storage-only", base), ("f16-default", dflt)]
        for DC, HC, IC, UC in ((32, 2, 16, 0), (32, 2, 8, 0), (32, 8, 16, 0), (64, 2, 16, 0),
                               (64, 2, 32, 16), (64, 2, 64, 16), (64, 4, 32, 16)):
            c = dataclasses.replace(hc, DC=DC, HC=HC, IC=IC, UC=UC)
            if c != dflt:
                try:
                    c.check()
                except ValueError:
                    continue
                lim = be.context.limits.get("max-compute-workgroup-storage-size", 16384)
                if any(c.smem_bytes(k_) > lim for k_ in ("forward", "bwd_dq", "bwd_dkdv")):
                    continue
                variants.append((f"f16-DC{DC}-HC{HC}-IC{IC}-UC{UC or IC}", c))
        rng = np.random.default_rng(7)
        x16 = [rng.standard_normal((B, H, S, D)).astype(np.float16) for _ in range(4)]
        q, k, v, g = x16
        ref = (torch_ref if gpu else np_ref)(q, k, v, g)
        naive = {}
        if gpu:
            nv = torch_naive16(q, k, v, g)
            naive = {n: rel(nv[n], ref[n]) for n in ("out", "dq", "dk", "dv")}
        log(f"f16 study D={D}: naive fp16 torch errors {naive}")
        t32 = bench_webgpu(be, B, H, S, D, "float32", tag="-f16study")
        for name, cfg in variants:
            try:
                errs = f16_errors(be, q, k, v, g, ref, cfg=cfg)
                t = bench_webgpu(be, B, H, S, D, "float16", cfg=cfg, tag="-" + name)
            except Exception as e:  # keep the other variants
                RESULTS["errors"].append(f"f16 study {name} D={D}: {type(e).__name__}: {e}"[:2000])
                log("ERROR", name, e)
                continue
            worst = max(v_ for k_, v_ in errs.items() if k_ != "lse_abs")
            ratio = {n: errs[n] / naive[n] for n in naive if naive[n] > 0}
            rec = dict(variant=name, config=str(cfg), D=D, S=S, B=B, H=H, errors=errs,
                       worst_rel=worst, ok=worst <= TOL16, naive_errors=naive,
                       err_vs_naive=ratio, worst_vs_naive=max(ratio.values()) if ratio else None,
                       fwd_tflops=t["fwd_tflops"], bwd_tflops=t["bwd_tflops"],
                       fp32_fwd_tflops=t32["fwd_tflops"], fp32_bwd_tflops=t32["bwd_tflops"],
                       fwd_speedup=t["fwd_tflops"] / t32["fwd_tflops"],
                       bwd_speedup=t["bwd_tflops"] / t32["bwd_tflops"])
            rows.append(rec)
            RESULTS["f16_study"] = rows
            save_partial()
            log(f"  {name}: bwd {rec['bwd_speedup']:.2f}x fwd {rec['fwd_speedup']:.2f}x fp32; "
                f"worst rel {worst:.2e} (naive x{rec['worst_vs_naive'] or 0:.2f}) {errs}")
    RESULTS["f16_study"] = rows
    # f16 correctness at size with masks, GQA, Sq != Sk, D up to 256 (default config)
    cases = [("f16-S4096-D128-gqa-causal", 1, 4, 2, 4096, 4096, 128, True),
             ("f16-S2048-D256-causal", 1, 2, 1, 2048, 2048, 256, True),
             ("f16-S1000x3001-D160", 2, 2, 2, 1000, 3001, 160, False)] if gpu else \
        [("f16-small-gqa-causal", 1, 4, 2, 70, 90, 40, True)]
    for name, B_, Hq, Hkv, Sq, Sk, D, causal in cases:
        rng = np.random.default_rng(8)
        q = rng.standard_normal((B_, Hq, Sq, D)).astype(np.float16)
        k = rng.standard_normal((B_, Hkv, Sk, D)).astype(np.float16)
        v = rng.standard_normal((B_, Hkv, Sk, D)).astype(np.float16)
        g = rng.standard_normal((B_, Hq, Sq, D)).astype(np.float16)
        ref = (torch_ref if gpu else np_ref)(q, k, v, g, causal)
        errs = f16_errors(be, q, k, v, g, ref, causal)
        naive = {}
        if gpu:
            nv = torch_naive16(q, k, v, g, causal)
            naive = {n: rel(nv[n], ref[n]) for n in ("out", "dq", "dk", "dv")}
        worst = max(v_ for k_, v_ in errs.items() if k_ != "lse_abs")
        RESULTS["checks"].append(dict(name=name, dtype="float16", B=B_, Hq=Hq, Hkv=Hkv, Sq=Sq,
                                      Sk=Sk, D=D, causal=causal, errors=errs, worst_rel=worst,
                                      ok=worst <= TOL16, naive_errors=naive))
        log(f"check {name}: worst rel {worst:.2e} ok={worst <= TOL16} {errs} naive {naive}")
        save_partial()


def plot_f16(json_path, png_path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.loads(Path(json_path).read_text())
    rows = res.get("f16_study", [])
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    for ax, what in zip(axes, ("bwd", "fwd")):
        labels, vals, cols = [], [], []
        for D in (64, 128):
            rr = [r for r in rows if r["D"] == D]
            if not rr:
                continue
            labels.append(f"fp32 D={D}")
            vals.append(rr[0][f"fp32_{what}_tflops"])
            cols.append("gray")
            for r in rr:
                labels.append(f"{r['variant']} D={D}\nerr {r['worst_rel']:.1e}")
                vals.append(r[f"{what}_tflops"])
                cols.append("tab:blue" if r["ok"] else "tab:red")
        ax.bar(range(len(vals)), vals, color=cols)
        ax.set_xticks(range(len(vals)))
        ax.set_xticklabels(labels, fontsize=6, rotation=60, ha="right")
        ax.set_ylabel(f"{what} TFLOP/s (FA convention)")
        ax.set_title(f"webgpu {what}, S=4096 B=1 H=8 (red: error over 3e-3)")
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)


# ------------------------------------------------------------------ seed kernel + ABI
def seed_trips_lower_bound(S, D, wrt):
    """A lower bound on the seed kernel's loop trips per invocation (Sq = Sk = S; the
    trips of the loops its WGSL runs for one output row: scores S * (D + 1), the softmax's
    three passes 3 * S, for dQ dP S * (D + 1), its sum S and the output D * (S + 1); a dK /
    dV row does a score row (and for dK a dP row) for each of the S query rows)."""
    score_row = S * (D + 1) + 3 * S
    if wrt == 0:
        return score_row + S * (D + 1) + S + D * (S + 1)
    per_query = score_row + D + (S * (D + 1) + S if wrt == 1 else 0)
    return D + S * (1 + per_query)


class Seed:
    def __init__(self, device, src):
        import wgpu

        self.wgpu, self.device = wgpu, device
        mod = device.create_shader_module(code=src)
        self.pipe = device.create_compute_pipeline(
            layout="auto", compute={"module": mod, "entry_point": "attention_bwd"})

    def encode(self, arena_buf, params_list):
        out = []
        for p in params_list:
            ub = self.device.create_buffer_with_data(data=p.pack() + b"\0" * 8,
                                                     usage=self.wgpu.BufferUsage.UNIFORM)
            bg = self.device.create_bind_group(layout=self.pipe.get_bind_group_layout(0), entries=[
                {"binding": 0, "resource": {"buffer": arena_buf, "offset": 0, "size": arena_buf.size}},
                {"binding": 1, "resource": {"buffer": ub, "offset": 0, "size": ub.size}}])
            rows = p.batch * p.heads * p.out_rows
            out.append((bg, (math.ceil(rows / 64), 1, 1), ub))
        return out

    def run(self, enc_list):
        enc = self.device.create_command_encoder()
        for bg, grid, _ in enc_list:
            cp = enc.begin_compute_pass()
            cp.set_pipeline(self.pipe)
            cp.set_bind_group(0, bg)
            cp.dispatch_workgroups(*grid)
            cp.end()
        self.device.queue.submit([enc.finish()])


def arena_setup(device, B, H, S, D, rng, inputs=None):
    import wgpu

    q, k, v, dy = inputs or (rng.standard_normal((B, H, S, D)).astype(np.float32)
                             for _ in range(4))
    arenas = []
    for wrt in range(3):
        arena, p = abi.pack_arena(q, k, v, dy, wrt=wrt)
        arenas.append((arena, p))
    # one arena with three output regions is what a runtime would plan; keep it simple:
    # three arenas of identical inputs, one per wrt
    bufs = []
    for arena, p in arenas:
        buf = device.create_buffer_with_data(
            data=arena, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC
            | wgpu.BufferUsage.COPY_DST)
        bufs.append((buf, p, arena))
    return (q, k, v, dy), bufs


def one_arena(device, q, k, v, dy):
    """One wgpu arena with q, k, v, dy and three output regions (dQ, dK, dV) -> (buffer,
    [p_dq, p_dk, p_dv]): what a runtime plans for one backward step."""
    import dataclasses

    import wgpu

    arena, p0 = abi.pack_arena(q, k, v, dy, wrt=0)
    n_kv = k.size
    full = np.full(arena.size + 2 * n_kv, np.nan, np.float32)
    full[:arena.size] = arena
    group = [p0] + [dataclasses.replace(p0, wrt=w, out_off=arena.size + i * n_kv)
                    for i, w in enumerate((1, 2))]
    buf = device.create_buffer_with_data(
        data=full, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC
        | wgpu.BufferUsage.COPY_DST)
    return buf, group


def bench_seed_and_abi(be, seed_src, sizes, seed_max_s=512):
    """The seed ABI on one wgpu arena (B=1 H=8 D=64 fp32) side by side with the
    device-resident plan of the same backward: three ABI calls (dQ, dK, dV: each runs
    the forward statistics and delta again) and one grouped call (statistics, delta
    and the dK/dV pass once); both checked against float64 first; host ms per call (the
    GPU waited for outside it).  Then the seed kernel itself (S <= seed_max_s)."""
    from anyattn import reference as R

    dev = be.device
    rng = np.random.default_rng(2)
    seed = Seed(dev, seed_src) if seed_src else None
    for S in sizes:
        B, H, D = 1, 8, 64
        q, k, v, dy = (rng.standard_normal((B, H, S, D)).astype(np.float32) for _ in range(4))
        fl = flops_bwd(B, H, S, S, D)
        buf, group = one_arena(dev, q, k, v, dy)
        try:
            import torch

            gpu = torch.cuda.is_available()
        except ImportError:
            gpu = False
        refs = None
        if gpu:                              # no mask: the seed's semantics are SDPA's
            r = torch_ref(q, k, v, dy)
            refs = [r["dq"], r["dk"], r["dv"]]
        elif S <= 2048:
            refs = [R.seed_backward(q, k, v, dy, mask_kind=0, scale=1 / math.sqrt(D), wrt=w)
                    for w in range(3)]
        three = lambda: [abi.attention_backward_arena(buf, p) for p in group]  # noqa: E731
        grouped = lambda: abi.attention_backward_arena(buf, group)             # noqa: E731
        _, plan, _, _ = wgpu_plan(be, q, k, v, dy)
        tp, _ = time_plan(plan)
        plan_host = _host_time(be, lambda: plan.submit(1))
        recs = {}
        for impl, fn in (("anyattn-webgpu-abi", three), ("anyattn-webgpu-abi-grouped", grouped)):
            errs = []
            if refs is not None:
                fn()
                arena = np.frombuffer(dev.queue.read_buffer(buf), np.float32).copy()
                errs = [rel(abi.read_output(arena, p), r) for p, r in zip(group, refs)]
            ta, n = _time_calls(be, fn, max_n=50)
            rec = dict(impl=impl, dtype="float32", B=B, H=H, S=S, D=D, bwd_ms=ta * 1e3,
                       bwd_tflops=fl / ta / 1e12, max_rel_err=max(errs) if errs else None,
                       n=n, host_ms=1e3 * _host_time(be, fn), plan_ms=tp * 1e3,
                       plan_host_ms=plan_host * 1e3, vs_plan=ta / tp)
            RESULTS["timings"].append(rec)
            recs[impl] = rec
            log(f"{impl} S={S}: {ta*1e3:.3f} ms dQ+dK+dV ({rec['bwd_tflops']:.3f} TFLOP/s), "
                f"{rec['vs_plan']:.2f}x the plan ({tp*1e3:.3f} ms), host {rec['host_ms']:.3f} "
                f"ms/call (plan {plan_host*1e3:.3f}), err {rec['max_rel_err']}")
        RESULTS.setdefault("ratios", []).append(dict(
            abi3_vs_plan=recs["anyattn-webgpu-abi"]["vs_plan"],
            abi_grouped_vs_plan=recs["anyattn-webgpu-abi-grouped"]["vs_plan"],
            dtype="float32", B=B, H=H, S=S, D=D))
        if seed is None or S > seed_max_s:
            continue
        ta = recs["anyattn-webgpu-abi"]["bwd_ms"] / 1e3
        # the seed kernel, same Params (fresh arenas: it writes the outputs in place)
        _, bufs = arena_setup(dev, B, H, S, D, rng, (q, k, v, dy))
        wait = lambda: dev.queue.read_buffer(bufs[0][0], 0, 4)  # noqa: E731
        enc = [seed.encode(buf, [p])[0] for buf, p, _ in bufs]
        if S <= 256:
            seed.run(enc)
            wait()
        reps = 3 if S <= 256 else 1
        t = time.perf_counter()
        for _ in range(reps):
            seed.run(enc)
        wait()
        ts = (time.perf_counter() - t) / reps
        serr = []
        limit = be.context.loop_limit        # llvmpipe stops loops past it, silently
        over = [w for w in range(3) if limit and seed_trips_lower_bound(S, D, w) > limit]
        for wrt, (buf, p, arena) in enumerate(bufs):
            got = abi.read_output(np.frombuffer(dev.queue.read_buffer(buf), np.float32).copy(), p)
            ref = R.seed_backward(q, k, v, dy, mask_kind=0, scale=1 / math.sqrt(D), wrt=wrt)
            serr.append(rel(got, ref))
        rec = dict(impl="seed", dtype="float32", B=B, H=H, S=S, D=D, bwd_ms=ts * 1e3,
                   bwd_tflops=fl / ts / 1e12, max_rel_err=max(serr), n=reps,
                   rel_err_by_wrt=serr)
        if over:     # the adapter cut the seed's loops short: its outputs are not valid
            rec["invalid_on_adapter"] = (
                f"wrt {over}: the seed kernel takes >= {seed_trips_lower_bound(S, D, over[0])} "
                f"loop trips per invocation, past this adapter's limit of {limit} "
                "(llvmpipe stops the loops there); its error here says nothing of the kernel")
            log(f"seed S={S}: {rec['invalid_on_adapter']}")
        RESULTS["timings"].append(rec)
        log(f"seed S={S}: {ts*1e3:.1f} ms ({rec['bwd_tflops']:.5f} TFLOP/s) err {max(serr):.2e}; "
            f"anyattn ABI (3 calls) speedup {ts / ta:.0f}x")


# ------------------------------------------------------------------ torch side
def cuda_time(fn, n=None, min_s=0.3):
    import torch

    fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    torch.cuda.synchronize()
    one = s.elapsed_time(e) / 1e3
    n = n or int(max(3, min(100, min_s / max(one, 1e-6))))
    s.record()
    for _ in range(n):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / 1e3 / n


def bench_sdpa(B, H, S, D, causal=False):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v, g = (torch.randn(B, H, S, D, device="cuda") for _ in range(4))
    for x in (q, k, v):
        x.requires_grad_(True)
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        tb = cuda_time(lambda: torch.autograd.grad(o, (q, k, v), g, retain_graph=True))
    fl = flops_bwd(B, H, S, S, D, causal)
    rec = dict(impl="torch-sdpa-memeff", dtype="float32", B=B, H=H, S=S, D=D, causal=causal,
               bwd_ms=tb * 1e3, bwd_tflops=fl / tb / 1e12)
    RESULTS["timings"].append(rec)
    log(f"sdpa mem-eff fp32 S={S} D={D}: bwd {tb*1e3:.3f} ms ({rec['bwd_tflops']:.2f} TFLOP/s)")


def bench_triton(B, H, S, D, causal=False):
    import torch

    q, k, v, g = (torch.randn(B, H, S, D, device="cuda") for _ in range(4))
    mask = aa.Causal() if causal else None
    o, l = aa.attention(q, k, v, mask=mask, return_lse=True, backend="triton")
    tb = cuda_time(lambda: aa.attention_backward(q, k, v, g, out=o, lse=l, mask=mask,
                                                 backend="triton"))
    fl = flops_bwd(B, H, S, S, D, causal)
    rec = dict(impl="anyattn-triton", dtype="float32", B=B, H=H, S=S, D=D, causal=causal,
               bwd_ms=tb * 1e3, bwd_tflops=fl / tb / 1e12)
    RESULTS["timings"].append(rec)
    log(f"triton fp32 S={S} D={D}: bwd {tb*1e3:.3f} ms ({rec['bwd_tflops']:.2f} TFLOP/s)")


def guarded(what, fn, *a, **kw):
    try:
        return fn(*a, **kw)
    except Exception as e:  # keep going: one failure must not lose the other numbers
        msg = f"{what}: {type(e).__name__}: {e}"
        log("ERROR", msg)
        traceback.print_exc()
        RESULTS["errors"].append(msg[:2000])


# ------------------------------------------------------------------ device arrays (issue 17)
def _wait(be):
    """Block until the queue is idle (read a few bytes back: DESIGN.md section 6)."""
    be.runner().read(be.runner().dummy, 1)


def _time_calls(be, fn, min_s=0.3, max_n=100):
    """Mean wall time of fn() (which submits GPU work) over n calls, waited at the end."""
    fn()
    _wait(be)
    t = time.perf_counter()
    fn()
    _wait(be)
    one = time.perf_counter() - t
    n = int(max(3, min(max_n, min_s / max(one, 1e-6))))
    t = time.perf_counter()
    for _ in range(n):
        fn()
    _wait(be)
    return (time.perf_counter() - t) / n, n


def _host_time(be, fn, n=10):
    """Median host time of fn() (until it returns: Python, encoding, submit), the GPU
    waited for outside the timed region after each call."""
    fn()
    _wait(be)
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
        _wait(be)
    return float(np.median(ts))


#: --timestamps: GPU timestamps of every timed submission of resident_case
#: (anyattn.backends.webgpu.timestamps; "refused" holds the adapter's refusal)
TIMESTAMPS = {"on": False, "rec": None, "refused": None}
#: a round is "slow" when its median device time per submission is past this many
#: times the fastest round's of the same implementation and size (the H200's slow
#: phases ran kernels up to 4.5x slower for seconds, dev/perf/LOG.md session 6)
SLOW_FACTOR = 1.3


def _with_timestamps(be, fn):
    """fn() with a GPU timestamp pair on each of its submissions -> (fn's result, device
    ms per submission in order, or None without --timestamps / where refused)."""
    if not TIMESTAMPS["on"] or TIMESTAMPS["refused"]:
        return fn(), None
    run = be.runner()
    if TIMESTAMPS["rec"] is None:
        from anyattn.backends.webgpu.timestamps import Timestamps

        try:
            TIMESTAMPS["rec"] = Timestamps(run, 2048)
        except NotImplementedError as e:
            TIMESTAMPS["refused"] = str(e)
            RESULTS["errors"].append(f"timestamps: {e}")
            log("timestamps refused:", e)
            return fn(), None
    with timestamps_on(run, TIMESTAMPS["rec"]) as ts:
        r = fn()
    return r, (ts.read() / 1e6).tolist()


@contextlib.contextmanager
def timestamps_on(run, ts):
    """Within: every submission of the runner ``run`` records a GPU timestamp pair into
    ``ts`` (a webgpu.timestamps.Timestamps, reset on entry; ``ts.read() / 1e6``: device
    ms per submission)."""
    ts.reset()
    run.timestamps = ts
    try:
        yield ts
    finally:
        run.timestamps = None


def _phase_summary(device):
    """Per implementation: per round the median / min / max device ms per submission and
    whether the round was slow (``SLOW_FACTOR`` x the fastest round's median)."""
    out = {}
    for impl, rounds in device.items():
        if not rounds or any(r is None for r in rounds):
            out[impl] = None
            continue
        med = [float(np.median(r[2:] or r)) for r in rounds]     # the 2 warm-up calls out
        best = min(med)
        out[impl] = dict(median_ms=med, min_ms=[float(min(r)) for r in rounds],
                         max_ms=[float(max(r)) for r in rounds], n=[len(r) for r in rounds],
                         slow=[m > SLOW_FACTOR * best for m in med],
                         slow_calls=[int(sum(x > SLOW_FACTOR * best for x in r)) for r in rounds])
    return out


def resident_case(be, B, H, S, D, dtype, gpu, host=True):
    """One size, side by side in this process: the raw encoded backward plan, the public
    API on device arrays (anyattn.webgpu; out + RowStats from forward_with_stats), the
    public API on host arrays (uploads + read-backs), anyattn-triton on torch CUDA
    tensors; the device-array results checked against float64 first."""
    from anyattn import webgpu as wg
    from anyattn.api import forward_with_stats

    rng = np.random.default_rng(11)
    q, k, v, g = (rng.standard_normal((B, H, S, D)).astype(dtype) for _ in range(4))
    fl = flops_bwd(B, H, S, S, D)
    base = dict(dtype=dtype, B=B, H=H, S=S, D=D)
    dq, dk, dv, dg = (wg.asarray(x) for x in (q, k, v, g))
    out, st = forward_with_stats(dq, dk, dv)
    gr = aa.attention_backward(dq, dk, dv, dg, out=out, lse=st)
    ref = (torch_ref if gpu else np_ref)(*(x.astype(np.float64) for x in (q, k, v, g)))
    errs = {"out": rel(out.numpy(), ref["out"]), "dq": rel(gr.dq.numpy(), ref["dq"]),
            "dk": rel(gr.dk.numpy(), ref["dk"]), "dv": rel(gr.dv.numpy(), ref["dv"])}
    RESULTS["checks"].append(dict(name=f"device-arrays S={S} D={D} {dtype}", errors=errs,
                                  worst_rel=max(errs.values()), **base))
    log(f"check device arrays {dtype} S={S} D={D}: {errs}")
    recs = {}
    # raw encoded plan (device-resident, no Python per call)
    _, bwd, _, _ = wgpu_plan(be, q, k, v, g)
    # public API on device arrays
    bwd_call = lambda: aa.attention_backward(dq, dk, dv, dg, out=out, lse=st)  # noqa: E731
    fwd_call = lambda: forward_with_stats(dq, dk, dv)                         # noqa: E731
    # plan and device arrays alternately, ROUNDS rounds, medians: the H200 had phases of
    # seconds in which the same kernels ran up to 4.5x slower (dev/perf/LOG.md, session
    # 6, issue 17); one timing of each, taken apart, made their ratio depend on them
    samples = {"plan": [], "device-arrays": []}
    device = {"plan": [], "device-arrays": []}      # GPU ms per submission, per round
    for _ in range(ROUNDS):
        for impl, fn in (("plan", lambda: time_plan(bwd)),
                         ("device-arrays", lambda: _time_calls(be, bwd_call))):
            r, dev = _with_timestamps(be, fn)
            samples[impl].append(r)
            device[impl].append(dev)
    for impl, xs in samples.items():
        recs[impl] = (float(np.median([t for t, _ in xs])), sum(n for _, n in xs))
    RESULTS.setdefault("rounds", []).append(dict(
        base, **{impl: [1e3 * t for t, _ in xs] for impl, xs in samples.items()},
        device=_phase_summary(device)))
    tb, n = _time_calls(be, fwd_call)
    recs["device-arrays-fwd"] = (tb, n)
    # host time per call (issue 17: per-call encoding), the GPU waited for outside it
    host_ms = {"device-arrays": 1e3 * _host_time(be, bwd_call),
               "device-arrays-fwd": 1e3 * _host_time(be, fwd_call),
               "plan": 1e3 * _host_time(be, lambda: bwd.submit(1))}
    if host:
        o, l = aa.attention(q, k, v, return_lse=True, backend="webgpu")
        tb, n = _time_calls(be, lambda: aa.attention_backward(q, k, v, g, out=o, lse=l,
                                                              backend="webgpu"), max_n=20)
        recs["host-arrays"] = (tb, n)
    ph = RESULTS["rounds"][-1]["device"]
    for impl, (tb, n) in recs.items():
        f = fl / 2.5 if impl.endswith("fwd") else fl
        rec = dict(impl="anyattn-webgpu-" + impl, bwd_ms=tb * 1e3, bwd_tflops=f / tb / 1e12,
                   n=n, host_ms=host_ms.get(impl), **base)
        if ph.get(impl):
            dms = float(np.median(ph[impl]["median_ms"]))
            rec.update(device_ms=dms, device_tflops=f / (dms / 1e3) / 1e12,
                       slow_rounds=sum(ph[impl]["slow"]))
            log(f"{impl:18s} device (timestamps) {dms:.3f} ms per call, rounds "
                f"{[round(x, 3) for x in ph[impl]['median_ms']]}, slow {ph[impl]['slow']}")
        RESULTS["timings"].append(rec)
        hs = f", host {host_ms[impl]:.3f} ms/call" if impl in host_ms else ""
        log(f"{impl:18s} {dtype} S={S} D={D}: {tb*1e3:.3f} ms ({rec['bwd_tflops']:.2f} "
            f"TFLOP/s){hs}")
    dev_ms, plan_ms = recs["device-arrays"][0], recs["plan"][0]
    per_round = [a / b for a, b in zip(RESULTS["rounds"][-1]["device-arrays"],
                                       RESULTS["rounds"][-1]["plan"])]
    RESULTS.setdefault("ratios", []).append(dict(
        device_vs_plan=dev_ms / plan_ms, device_vs_plan_rounds=per_round,
        host_vs_device=(recs["host-arrays"][0] / dev_ms) if host else None, **base))
    if gpu:
        import torch

        tq, tk, tv, tg = (torch.from_numpy(x).cuda() for x in (q, k, v, g))
        o, l = aa.attention(tq, tk, tv, return_lse=True, backend="triton")
        tb = cuda_time(lambda: aa.attention_backward(tq, tk, tv, tg, out=o, lse=l,
                                                     backend="triton"))
        RESULTS["timings"].append(dict(impl="anyattn-triton", bwd_ms=tb * 1e3,
                                       bwd_tflops=fl / tb / 1e12, **base))
        log(f"triton {dtype} S={S} D={D}: {tb*1e3:.3f} ms ({fl / tb / 1e12:.2f} TFLOP/s)")


BUDGET = {"t0": time.time(), "seconds": None}   # --budget: skip steps past it (logged)
#: rounds of the alternating plan / device-array timings of resident_case (medians)
ROUNDS = 3
#: --resident-sizes / --abi-sizes / --skip-variants / --skip-seed: what --resident runs
RESIDENT_SEL = {"sizes": [(512, 64), (4096, 128), (4096, 64)], "abi_sizes": [512, 4096],
                "variants": True, "seed": True}
#: --variant-names / --variant-sizes: the variant axis restricted (names: launch.VARIANTS
#: and the extra shape points, e.g. staged-8x8-NV4, staged-DC32; "all" = every one)
VARIANT_SEL = {"names": {"all"}, "sizes": None, "dtypes": ("float32", "float16")}


def over_budget(what):
    """True (and the step recorded as skipped) once the run is past --budget seconds."""
    s = BUDGET["seconds"]
    if s is None or time.time() - BUDGET["t0"] < s:
        return False
    RESULTS["errors"].append(f"{what}: skipped, past the --budget of {s} s")
    log("SKIPPED (budget):", what)
    return True


def with_timeout(seconds, what, fn, *a, **kw):
    """guarded(), and a SIGALRM after ``seconds`` so one slow step cannot eat the run."""
    import signal

    def alarm(*_):
        raise TimeoutError(f"{what}: past {seconds} s")
    old = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(int(seconds))
    try:
        return guarded(what, fn, *a, **kw)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def kernel_times(plan, min_s=0.15):
    """ms per kernel of an encoded plan, each kernel's launches submitted alone (the
    backward's passes read only what the forward left: re-running one is valid)."""
    from anyattn.backends.webgpu.engine import Plan

    out = {}
    for name in dict.fromkeys(e[3] for e in plan.encoded):
        part = Plan(plan.run, [e for e in plan.encoded if e[3] == name], [])
        out[name] = time_plan(part, min_s=min_s)[0] * 1e3
    return out


class _configs_forced:
    """Within: the webgpu backend's calls take ``fwd`` for forwards and ``bwd`` for
    backwards (launch.choose_config replaced; the backend imports it per call) - a shape
    point whose backward tile differs from its forward's (RM = 8 is backward-only)."""

    def __init__(self, fwd, bwd):
        self.cfgs = fwd, bwd

    def __enter__(self):
        from anyattn.backends.webgpu import launch

        self.old = launch.choose_config
        fwd, bwd = self.cfgs
        launch.choose_config = lambda ctx, D, elem="f32", backward=False, *a, **kw: \
            bwd if backward else fwd

    def __exit__(self, *exc):
        from anyattn.backends.webgpu import launch

        launch.choose_config = self.old


def variant_case(be, B, H, S, D, dtype, gpu, variants):
    """Kernel variants side by side (launch.VARIANTS, forced by ANYATTN_WEBGPU_VARIANT as
    a user would): per variant the configs choose_config picks, the device-resident
    forward and backward plans checked against float64 (one reference per size), then
    timed (N submissions, then a read-back) in this process."""
    import dataclasses

    from anyattn.backends.webgpu.launch import ENV_VARIANT, TileConfig, choose_config

    rng = np.random.default_rng(12)
    q, k, v, g = (rng.standard_normal((B, H, S, D)).astype(dtype) for _ in range(4))
    ref = (torch_ref if gpu else np_ref)(*(x.astype(np.float64) for x in (q, k, v, g)))
    tol = 1e-5 if dtype == "float32" else 3e-3
    elem = "f32" if dtype == "float32" else "f16"
    fl = flops_bwd(B, H, S, S, D)
    base = None
    old = os.environ.get(ENV_VARIANT)
    runs = [(var, None) for var in variants if var != "rows8" or elem == "f16"]  # rows8: f16
    if S >= 4096 and dtype == "float32" and not be.context.is_cpu:
        # one more shape point: 8x8 threads, 4 x 4*NV outputs per invocation covering D
        # (more update work per staged row, 64 invocations: more workgroups per SM)
        cfg = TileConfig(8, 8, 16, 8, max(1, D // 32), variant="staged")
        runs.append((f"staged-8x8-NV{cfg.NV}", cfg))
    if dtype == "float16" and not be.context.is_cpu:
        # f16 staged with D chunks of 32 (the f16 forward's; the wide backward's): are the
        # f16 variants' losses the prefetch registers of DC = 64 chunks?
        st = choose_config(be.context, D, "f16", backward=True, variant="staged")
        runs.append(("staged-DC32", (choose_config(be.context, D, "f16", variant="staged"),
                                     dataclasses.replace(st, DC=32, IC=min(st.IC, 32)))))
        # wide f16 with runs of one vec4 column (HC = 1: no f16 partial array live across
        # the columns, 2 x 32 fewer packed registers at RM = 8)
        wd = choose_config(be.context, D, "f16", backward=True, variant="wide")
        runs.append(("wide-HC1", (choose_config(be.context, D, "f16", variant="wide"),
                                  dataclasses.replace(wd, HC=1))))
    runs.append(("auto", None))          # no variant forced: the table's choice at this size
    sel = VARIANT_SEL["names"]
    runs = [(n, c) for n, c in runs if "all" in sel or n in sel or f"{n}@{elem}" in sel]
    for var, cfg in runs:
        pair = isinstance(cfg, tuple)      # (forward config, backward config)
        if pair:
            cfg_f, cfg = cfg
        if var == "auto":
            os.environ.pop(ENV_VARIANT, None)
        else:
            os.environ[ENV_VARIANT] = cfg.variant if cfg is not None else var
        be.config_override = None if pair else cfg
        try:
            cfg_b = cfg or choose_config(be.context, D, elem, backward=True, rows=(B * H, S, S, 1))
            if pair:         # the backend's forward and backward calls choose these two
                with _configs_forced(cfg_f, cfg):
                    fwd, bwd, read_f, read_b = wgpu_plan(be, q, k, v, g)
            else:
                fwd, bwd, read_f, read_b = wgpu_plan(be, q, k, v, g)
            fwd.submit(1)
            bwd.submit(1)
            out, _ = read_f()
            gr = read_b()
            errs = {"out": rel(out, ref["out"]), "dq": rel(gr["dq"], ref["dq"]),
                    "dk": rel(gr["dk"], ref["dk"]), "dv": rel(gr["dv"], ref["dv"])}
            worst = max(errs.values())
            rec = dict(impl="anyattn-webgpu-variant", variant=var, dtype=dtype, B=B, H=H, S=S,
                       D=D, config_bwd=str(cfg_b), errors=errs, worst_rel=worst,
                       ok=worst <= tol)
            if worst > tol:     # a wrong variant is reported, never timed as if it counted
                RESULTS["errors"].append(f"variant {var} {dtype} S={S} D={D}: worst rel "
                                         f"{worst:.2e} > {tol}")
                RESULTS["timings"].append(rec)
                log(f"variant {var:9s} {dtype} S={S} D={D}: WRONG {errs}")
                continue
            tf, _ = time_plan(fwd)
            tb, n = time_plan(bwd)
            rec["kernels_ms"] = kernel_times(bwd)
            del fwd, bwd
        except Exception as e:   # one variant failing (compile, device) must not lose the rest
            if isinstance(e, TimeoutError):
                raise
            msg = f"variant {var} {dtype} S={S} D={D}: {type(e).__name__}: {e}"
            RESULTS["errors"].append(msg[:2000])
            log("ERROR", msg[:500])
            continue
        finally:
            be.config_override = None
            if old is None:
                os.environ.pop(ENV_VARIANT, None)
            else:
                os.environ[ENV_VARIANT] = old
        rec.update(bwd_ms=tb * 1e3, bwd_tflops=fl / tb / 1e12, fwd_ms=tf * 1e3,
                   fwd_tflops=fl / 2.5 / tf / 1e12, n=n)
        if var == "portable":
            base = rec
        if base is not None:
            rec["bwd_vs_portable"] = base["bwd_ms"] / rec["bwd_ms"]
            rec["fwd_vs_portable"] = base["fwd_ms"] / rec["fwd_ms"]
        RESULTS["timings"].append(rec)
        log(f"variant {var:9s} {dtype} S={S} D={D}: bwd {tb*1e3:.3f} ms "
            f"({rec['bwd_tflops']:.2f} TFLOP/s, x{rec.get('bwd_vs_portable', 1):.2f}), fwd "
            f"{tf*1e3:.3f} ms ({rec['fwd_tflops']:.2f}), worst rel {worst:.1e} [{cfg_b}] "
            + " ".join(f"{k}={x:.3f}" for k, x in rec["kernels_ms"].items()))


def variant_study(be, gpu, small):
    """portable vs every kernel variant this adapter runs (fp32 and f16; S = 512, 4096;
    D = 64, 128 on a GPU), each checked against float64 before it is timed."""
    from anyattn.backends.webgpu.launch import VARIANTS

    ctx = be.context
    variants = [v for v in VARIANTS if v != "subgroups" or ctx.has_subgroups]
    RESULTS["variants"] = variants
    dtypes = tuple(d for d in VARIANT_SEL["dtypes"] if d != "float16" or ctx.has_f16)
    sizes = ((64, 32),) if small else ((512, 64), (512, 128), (4096, 64), (4096, 128))
    if VARIANT_SEL["sizes"] and not small:
        sizes = VARIANT_SEL["sizes"]
    RESULTS["variant_selection"] = dict(names=sorted(VARIANT_SEL["names"]),
                                        sizes=[list(s) for s in sizes])
    for S, D in sizes:
        for dt in dtypes:
            if over_budget(f"variants {dt} S={S} D={D}"):
                continue
            with_timeout(100, f"variants {dt} S={S} D={D}", variant_case, be, 1, 2 if small else 8,
                         S, D, dt, gpu, variants)
            save_partial()


def resident_study(be, seed_src, gpu, small, variants_only=False):
    """Issue 17 side by side: seed kernel, ABI, device arrays, raw plan, host arrays,
    triton; fp32 and f16 (adapter features recorded); then the kernel variants
    (``variant_study``; ``variants_only``: that alone)."""
    ctx = be.context
    RESULTS["features"] = sorted(str(f) for f in ctx.adapter.features)
    RESULTS["device_features"] = sorted(str(f) for f in ctx.features)
    RESULTS["resident_selection"] = dict(RESIDENT_SEL)
    if RESIDENT_SEL["variants"] or variants_only:
        variant_study(be, gpu, small)       # first: the kernel comparison (issue 17)
    if variants_only:
        return
    seed_src = seed_src if RESIDENT_SEL["seed"] else None
    if small:
        with_timeout(120, "abi+seed", bench_seed_and_abi, be, seed_src, (32,), seed_max_s=32)
        for dt in ("float32", "float16"):
            with_timeout(120, f"resident {dt}", resident_case, be, 1, 2, 64, 32, dt, gpu)
        return
    for S, D in RESIDENT_SEL["sizes"]:
        for dt in ("float32", "float16"):
            if over_budget(f"resident {dt} S={S} D={D}"):
                continue
            with_timeout(90, f"resident {dt} S={S} D={D}", resident_case, be, 1, 8, S, D, dt,
                         gpu)
            save_partial()
    if not over_budget("abi+seed"):
        with_timeout(120, "abi+seed", bench_seed_and_abi, be, seed_src, RESIDENT_SEL["abi_sizes"],
                     seed_max_s=512)
        save_partial()


# ------------------------------------------------------------------ lavapipe
def bench_cpu(be):
    """lavapipe vs the NumPy backend, B=1 H=8 S=256 D=64 fp32 (API calls, host arrays)."""
    B, H, S, D = 1, 8, 256, 64
    rng = np.random.default_rng(3)
    q, k, v, g = (rng.standard_normal((B, H, S, D)).astype(np.float32) for _ in range(4))
    fl = flops_bwd(B, H, S, S, D)
    for name in ("webgpu", "numpy"):
        if unavailable_reason(name):
            continue
        run = lambda: aa.attention_backward(q, k, v, g, backend=name)  # noqa: E731
        runf = lambda: aa.attention(q, k, v, backend=name)  # noqa: E731
        run()
        n = 5
        t = time.perf_counter()
        for _ in range(n):
            run()
        tb = (time.perf_counter() - t) / n
        t = time.perf_counter()
        for _ in range(n):
            runf()
        tf = (time.perf_counter() - t) / n
        rec = dict(impl=f"anyattn-{name}", device="cpu", dtype="float32", B=B, H=H, S=S, D=D,
                   fwdbwd_ms=tb * 1e3, fwd_ms=tf * 1e3,
                   fwdbwd_gflops=(fl + fl / 2.5) / tb / 1e9)
        RESULTS["timings"].append(rec)
        log(f"cpu {name}: fwd+bwd {tb*1e3:.1f} ms ({rec['fwdbwd_gflops']:.2f} GFLOP/s), fwd {tf*1e3:.1f} ms")


_PROBE = """
@group(0) @binding(0) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> k: array<vec4<f32>>;
@group(0) @binding(2) var<storage, read_write> o: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let i = gid.x;
  var qr: array<vec4<f32>, 16>;
  for (var d = 0u; d < 16u; d++) { qr[d] = q[i * 16u + d]; }
  var acc = 0.0;
  for (var j = 0u; j < 256u; j++) {
    var s = vec4<f32>(0.0);
    for (var d = 0u; d < 16u; d++) { s += qr[d] * k[j * 16u + d]; }
    acc += exp(dot(s, vec4<f32>(1.0)) * 0.01);
  }
  o[i] = acc;
}"""


def probe_ceiling(be):
    """The simplest attention-like inner loop (one row per invocation, q in registers,
    k addresses uniform across lanes, no barriers): what this adapter gives at best."""
    import wgpu

    dev = be.device
    mod = dev.create_shader_module(code=_PROBE)
    pipe = dev.create_compute_pipeline(layout="auto", compute={"module": mod, "entry_point": "main"})
    N = 2048
    rng = np.random.default_rng(5)
    qb = dev.create_buffer_with_data(data=rng.random(N * 64, dtype=np.float32),
                                     usage=wgpu.BufferUsage.STORAGE)
    kb = dev.create_buffer_with_data(data=rng.random(256 * 64, dtype=np.float32),
                                     usage=wgpu.BufferUsage.STORAGE)
    ob = dev.create_buffer(size=N * 4, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
    bg = dev.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=[
        {"binding": i, "resource": {"buffer": b}} for i, b in enumerate((qb, kb, ob))])

    def run():
        enc = dev.create_command_encoder()
        cp = enc.begin_compute_pass()
        cp.set_pipeline(pipe)
        cp.set_bind_group(0, bg)
        cp.dispatch_workgroups(N // 64)
        cp.end()
        dev.queue.submit([enc.finish()])
        dev.queue.read_buffer(ob, 0, 4)

    run()
    t = time.perf_counter()
    for _ in range(5):
        run()
    dt = (time.perf_counter() - t) / 5
    gf = 2 * N * 256 * 64 / dt / 1e9
    RESULTS["timings"].append(dict(impl="probe-gemv-uniform-k", device=be.context.name,
                                   ms=dt * 1e3, gflops=gf))
    log(f"probe (register-resident row dot products, no barriers): {gf:.2f} GFLOP/s")


# ------------------------------------------------------------------ plot
def plot(json_path, png_path):
    """Issue 17's view of a --resident run: (left) each call's time over the raw encoded
    plan's, device arrays and the seed ABI (three calls / one grouped call), with the
    targets 1.2x and 1.5x; (right) device-resident backward TFLOP/s at the largest S
    per dtype and D (plan, device arrays, host arrays), with the fp32 target 20."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.loads(Path(json_path).read_text())
    tim = [r for r in res["timings"] if "bwd_ms" in r and r.get("config", "auto") == "auto"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    ax = axes[0]
    plan = {(r["dtype"], r["S"], r["D"]): r["bwd_ms"] for r in tim
            if r["impl"] == "anyattn-webgpu-plan"}
    series = {"device arrays": [], "ABI, 3 calls": [], "ABI, grouped": []}
    for r in tim:
        key = (r["dtype"], r["S"], r["D"])
        name = {"anyattn-webgpu-device-arrays": "device arrays",
                "anyattn-webgpu-abi": "ABI, 3 calls",
                "anyattn-webgpu-abi-grouped": "ABI, grouped"}.get(r["impl"])
        if name is None:
            continue
        base = plan.get(key) or next((v for (dt, s_, _), v in plan.items()
                                      if dt == r["dtype"] and s_ == r["S"]), None)
        if base:
            series[name].append((f"{r['dtype'].replace('float', 'f')} S={r['S']} "
                                 f"D={r['D']}", r["bwd_ms"] / base))
    labels = sorted({lab for pts in series.values() for lab, _ in pts},
                    key=lambda t: (int(t.split("S=")[1].split()[0]), t))
    w = 0.8 / max(1, len(series))
    for si, (name, pts) in enumerate(series.items()):
        d = dict(pts)
        xs = [i for i, lab in enumerate(labels) if lab in d]
        ys = [d[labels[i]] for i in xs]
        bars = ax.bar([x + (si - 1) * w for x in xs], ys, w, label=name)
        for b_, y in zip(bars, ys):
            ax.text(b_.get_x() + b_.get_width() / 2, y, f"{y:.2f}", ha="center",
                    va="bottom", fontsize=6)
    ax.axhline(1.2, color="r", ls="--", lw=1, label="target: API 1.2x")
    ax.axhline(1.5, color="m", ls=":", lw=1, label="target: ABI 1.5x (S=512)")
    ax.axhline(1.0, color="gray", lw=0.8)
    ax.set_xticks(range(len(labels)))
    ax.set_xticklabels(labels, fontsize=7, rotation=30, ha="right")
    ax.set_ylabel("backward time / raw encoded plan")
    ax.set_title("call overhead over the raw plan (B=1, H=8)")
    ax.legend(fontsize=7)
    ax = axes[1]
    top = max((r["S"] for r in tim), default=0)
    groups = sorted({(r["dtype"], r["D"]) for r in tim if r["S"] == top})
    impls = [("anyattn-webgpu-plan", "plan"), ("anyattn-webgpu-device-arrays", "device arrays"),
             ("anyattn-webgpu-host-arrays", "host (NumPy) arrays")]
    w = 0.8 / len(impls)
    for ii, (impl, name) in enumerate(impls):
        ys = [next((r["bwd_tflops"] for r in tim if r["impl"] == impl and r["S"] == top
                    and (r["dtype"], r["D"]) == g), 0.0) for g in groups]
        bars = ax.bar([x + (ii - 1) * w for x in range(len(groups))], ys, w, label=name)
        for b_, y in zip(bars, ys):
            ax.text(b_.get_x() + b_.get_width() / 2, y, f"{y:.1f}", ha="center",
                    va="bottom", fontsize=6)
    ax.axhline(20, color="r", ls="--", lw=1, label="target: fp32 20 TFLOP/s")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([f"{dt} D={d}" for dt, d in groups], fontsize=8)
    ax.set_ylabel("backward TFLOP/s (FA convention)")
    dev = res.get("machine", {}).get("adapter", "") if isinstance(res.get("machine"), dict) else ""
    ax.set_title(f"S={top}, B=1, H=8 {dev}".strip())
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)


def plot_variants(json_path, png_path):
    """Backward TFLOP/s per kernel variant, one group per (dtype, S, D), portable first."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    res = json.loads(Path(json_path).read_text())
    rows = [r for r in res["timings"] if r.get("impl") == "anyattn-webgpu-variant"
            and "bwd_tflops" in r]
    if not rows:
        return
    groups = sorted({(r["dtype"], r["S"], r["D"]) for r in rows})
    names = list(dict.fromkeys(r["variant"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(8, 1.6 * len(groups)), 4.8))
    w = 0.8 / len(names)
    for n_i, name in enumerate(names):
        ys = [next((r["bwd_tflops"] for r in rows if (r["dtype"], r["S"], r["D"]) == gk
                    and r["variant"] == name), 0.0) for gk in groups]
        ax.bar([g_i + n_i * w for g_i in range(len(groups))], ys, w, label=name)
    ax.set_xticks([g_i + 0.4 - w / 2 for g_i in range(len(groups))])
    ax.set_xticklabels([f"{d}\nS={s} D={dd}" for d, s, dd in groups], fontsize=8)
    ax.axhline(20, color="r", ls="--", lw=1, label="fp32 target 20 TFLOP/s")
    ax.set_ylabel("backward TFLOP/s (FA convention)")
    ax.set_title(f"WebGPU kernel variants, {res.get('machine', {}).get('adapter', '?')}")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png_path, dpi=120)


# ------------------------------------------------------------------ main
def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", str(ROOT / "docs" / "perf")))
    ap.add_argument("--small", action="store_true", help="tiny sizes (a smoke test on lavapipe)")
    ap.add_argument("--plot", help="only render the PNG from a results JSON")
    ap.add_argument("--quick", action="store_true",
                    help="GPU: two large checks, no triton, fewer sizes (a re-run after a change)")
    ap.add_argument("--f16", action="store_true",
                    help="only the f16 study (errors vs float64, f16 vs fp32 timings) + PNG")
    ap.add_argument("--resident", action="store_true",
                    help="issue 17: seed, ABI, device arrays, raw plan, host arrays, triton "
                         "side by side (fp32, f16); JSON webgpu_resident*.json")
    ap.add_argument("--variants", action="store_true",
                    help="with --resident: only the kernel-variant axis (portable vs prefetch, "
                         "staged, subgroups; checked vs float64, then timed)")
    ap.add_argument("--budget", type=float, default=None,
                    help="--resident: seconds after which the remaining steps are skipped "
                         "(recorded in the JSON's errors), e.g. 500 under a 600 s limit")
    ap.add_argument("--variant-names", default="all",
                    help="comma list: the variant axis's variants and extra shape points "
                         "(e.g. portable,staged,wide,staged-DC32; 'auto' = no variant "
                         "forced: the table's choice at the size; NAME@f32 / NAME@f16: "
                         "that element type only); default all")
    ap.add_argument("--variant-sizes", default="",
                    help="comma list of SxD for the variant axis on a GPU, e.g. 512x128,4096x128")
    ap.add_argument("--variant-dtypes", default="float32,float16",
                    help="comma list: the variant axis's dtypes (float16 only where the "
                         "adapter has shader-f16)")
    ap.add_argument("--seed", default=str(ROOT / ".seed" / "attention_bwd.wgsl"))
    ap.add_argument("--resident-sizes", default="512x64,4096x128,4096x64",
                    help="--resident: SxD points of the plan / device arrays / host arrays / "
                         "triton cases (fp32 and f16 each), e.g. 512x64,512x128,4096x64,4096x128")
    ap.add_argument("--abi-sizes", default="512,4096",
                    help="--resident: S of the seed-ABI cases (three calls vs one grouped "
                         "call vs the plan; B=1 H=8 D=64 fp32)")
    ap.add_argument("--skip-variants", action="store_true",
                    help="--resident without the kernel-variant axis")
    ap.add_argument("--timestamps", action="store_true",
                    help="--resident: GPU timestamps on every timed plan / device-array "
                         "submission (device ms next to wall ms, slow rounds flagged); "
                         "an adapter without 'timestamp-query' is refused and recorded")
    ap.add_argument("--rounds", type=int, default=3,
                    help="--resident: alternating plan / device-array rounds per size")
    ap.add_argument("--skip-seed", action="store_true",
                    help="--resident without the seed kernel (3.8 s per run at S=512)")
    a = ap.parse_args()
    BUDGET.update(t0=time.time(), seconds=a.budget)
    TIMESTAMPS["on"] = a.timestamps
    globals()["ROUNDS"] = a.rounds
    RESIDENT_SEL.update(sizes=[tuple(int(x) for x in t.split("x"))
                               for t in a.resident_sizes.split(",") if t],
                        abi_sizes=[int(x) for x in a.abi_sizes.split(",") if x],
                        variants=not a.skip_variants, seed=not a.skip_seed)
    names = {n.strip() for n in a.variant_names.split(",") if n.strip()}
    if "all" not in names and not names & {"portable", "portable@f32", "portable@f16"}:
        names.add("portable")    # portable is the baseline of every ratio
    VARIANT_SEL.update(dtypes=tuple(d.strip() for d in a.variant_dtypes.split(",") if d.strip()),
                       names=names, sizes=[tuple(int(x) for x in s.split("x"))
                                            for s in a.variant_sizes.split(",") if s.strip()])
    if a.plot:
        js = json.loads(Path(a.plot).read_text())
        if "f16_study" in js:
            plot_f16(a.plot, Path(a.plot).with_suffix(".png"))
        elif "variants" in js:
            plot_variants(a.plot, Path(a.plot).with_suffix(".png"))
        else:
            plot(a.plot, Path(a.plot).with_suffix(".png"))
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    why = unavailable_reason("webgpu")
    if why:
        log("webgpu unavailable:", why)
        return
    be = get_backend("webgpu")
    ctx = be.context
    try:
        import torch

        gpu = torch.cuda.is_available()
    except ImportError:
        gpu = False
    RESULTS["machine"] = dict(adapter=ctx.name, info={k: str(v) for k, v in ctx.info.items()},
                              limits={k: int(v) for k, v in ctx.limits.items()
                                      if "compute" in k or "storage" in k or "buffer" in k},
                              host=platform.node(), python=sys.version.split()[0],
                              date=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                              torch_cuda=gpu)
    log("adapter:", ctx.name, "f16:", ctx.has_f16)
    seed_src = Path(a.seed).read_text() if Path(a.seed).exists() else None
    t0 = time.time()
    if a.resident:
        name = "webgpu_resident.json" if gpu and not a.small else "webgpu_resident_small.json"
        if a.variants:
            name = name.replace("resident", "variants")
        PARTIAL.append(out / name)
        resident_study(be, seed_src, gpu, a.small or not gpu, a.variants)
        RESULTS["total_seconds"] = time.time() - t0
        (out / name).write_text(json.dumps(RESULTS, indent=1))
        guarded("plot", plot_variants, out / name, (out / name).with_suffix(".png"))
        log("wrote", out / name, f"in {RESULTS['total_seconds']:.1f}s")
        return
    if a.f16:
        if not ctx.has_f16:
            log("the adapter has no shader-f16: no f16 study")
            return
        name = "webgpu_bench_f16.json" if gpu and not a.small else "webgpu_bench_f16_small.json"
        PARTIAL.append(out / name)
        guarded("f16 study", f16_study, be, gpu and not a.small)
        RESULTS["total_seconds"] = time.time() - t0
        (out / name).write_text(json.dumps(RESULTS, indent=1))
        guarded("plot", plot_f16, out / name, (out / name).with_suffix(".png"))
        log("wrote", out / name, f"in {RESULTS['total_seconds']:.1f}s")
        return
    if a.small or not gpu:
        guarded("check small", check_case, be, "small-causal-gqa", 1, 4, 2, 70, 70, 64,
                causal=True, gpu=False)
        guarded("check small bias", check_case, be, "small-bias", 1, 2, 2, 40, 50, 32,
                bias_shape=(1, 2, 40, 50), gpu=False)
        guarded("abi", bench_seed_and_abi, be, seed_src, (32,) if a.small else (128, 256),
                seed_max_s=128)
        guarded("webgpu small", bench_webgpu, be, 1, 2, 128, 64)
        if ctx.has_f16:
            guarded("webgpu small f16", bench_webgpu, be, 1, 2, 128, 64, "float16")
        guarded("cpu", bench_cpu, be)
        guarded("probe", probe_ceiling, be)
    else:
        # correctness at large sizes
        cases = [
            (("S8192-D64-causal", 1, 2, 2, 8192, 8192, 64), dict(causal=True)),
            (("S8192-D64", 1, 1, 1, 8192, 8192, 64), {}),
            (("S4096-D128-gqa", 1, 4, 2, 4096, 4096, 128), {}),
            (("S2048-D256-causal", 1, 2, 1, 2048, 2048, 256), dict(causal=True)),
            (("S1000x3001-D160", 2, 2, 2, 1000, 3001, 160), {}),
            (("S1024-bias-1hqk", 2, 4, 4, 1024, 1024, 64), dict(bias_shape=(1, 4, 1024, 1024))),
        ]
        for args, kw in (cases[:2] + cases[-1:] if a.quick else cases):
            guarded("check " + args[0], check_case, be, *args, **kw)
        log(f"checks done at {time.time() - t0:.1f}s")
        guarded("abi+seed", bench_seed_and_abi, be, seed_src, (128, 256, 512, 2048))
        sizes = (512, 4096) if a.quick else (512, 1024, 4096)
        log(f"seed done at {time.time() - t0:.1f}s")
        for S in sizes:
            for D in (64, 128):
                guarded("webgpu", bench_webgpu, be, 1, 8, S, D)
                if ctx.has_f16:
                    guarded("webgpu f16", bench_webgpu, be, 1, 8, S, D, "float16")
        guarded("webgpu causal", bench_webgpu, be, 1, 8, 4096, 128, causal=True)
        guarded("webgpu S8192", bench_webgpu, be, 1, 8, 8192, 64)
        from anyattn.backends.webgpu.launch import TileConfig

        for D, cfgs in ((64, (TileConfig(16, 16, 16, 8, 1), TileConfig(8, 8, 16, 16, 1))),
                        (128, (TileConfig(8, 8, 16, 8, 2),))):
            for cfg in cfgs:
                guarded("webgpu cfg", bench_webgpu, be, 1, 8, 4096, D, cfg=cfg, tag="-cfg")
        guarded("api", bench_api, 1, 8, 512, 64)
        log(f"webgpu timings done at {time.time() - t0:.1f}s")
        for S in sizes:
            for D in (64, 128):
                guarded("sdpa", bench_sdpa, 1, 8, S, D)
        tri = unavailable_reason("triton")
        if a.quick:
            RESULTS["errors"].append("--quick: anyattn-triton not timed in this run")
        elif tri is None:
            for S in (512, 4096):
                for D in (64, 128):
                    guarded("triton", bench_triton, 1, 8, S, D)
        else:
            RESULTS["errors"].append(f"anyattn-triton not timed: {tri}")
    RESULTS["total_seconds"] = time.time() - t0
    name = "webgpu_bench_small.json" if (a.small or not gpu) else \
        ("webgpu_bench_h200_quick.json" if a.quick else "webgpu_bench_h200.json")
    (out / name).write_text(json.dumps(RESULTS, indent=1))
    log("wrote", out / name, f"in {RESULTS['total_seconds']:.1f}s")


if __name__ == "__main__":
    main()
