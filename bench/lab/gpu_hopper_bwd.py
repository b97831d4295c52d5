"""The Hopper backward (backends/triton/hopper: bwd_ws_dq_kernel, bwd_ws_kernel) on an
sm_90 GPU, lean enough for a short lease: warm-up compiles in parallel processes, float64
checks of every config (poisoned buffers, bitwise repeat; the dq configs with both add
orders; the routed path with each config), then timings in one process: the routes end
to end (the default: portable delta, ws dK/dV, portable dQ; session 8's ws configs with
dq: portable delta, the kernel, the dq conversion), the portable backward and SDPA-cuDNN
in ROUNDS rounds of rotating order (each entry's median per round, and the median over
rounds), then each config alone and SDPA-cuDNN / SDPA-flash again.  Session 7's other
variants (ws ping-pong / 3 stages, the fused kernel) keep their measured numbers and are
not rerun.  Run the check and bench phases as two processes (--phases compile,check then
roof,bench, each with its own --out) so that a trap cannot stop the timings.
FLOP convention: FlashAttention's (bwd 2.5 x the forward's 4*B*H*Sq*Sk*D, causal half).
The forward's out and row statistics come from torch (no forward kernel is compiled).

    PYTHONPATH=src python3 bench/lab/gpu_hopper_bwd.py [--out DIR] [--phases compile,check,bench]

Shape legend: B batch, H / Hkv heads, Sq / Sk queries / keys, D head dim.
Writes hopper_bwd.json under --out and prints a table last.
"""
from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing as mp
import os
import subprocess
import sys
import time
import zlib

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # bench/: gpu_hopper_bench

import torch  # noqa: E402
import triton.testing  # noqa: E402

from anyattn.problem import describe  # noqa: E402
from anyattn.backends.triton import launch as TL  # noqa: E402
from anyattn.backends.triton.hopper import configs as HCF  # noqa: E402
from torch.nn.attention import SDPBackend, sdpa_kernel  # noqa: E402

from anyattn.backends.triton.hopper import launch as HL  # noqa: E402
from gpu_hopper_bench import (TOL, backward_on_path, bf16_gemm_roof,  # noqa: E402
                              bwd_configs_and_sdpa, grads64, keep_dense, l2_delta, mask_of,
                              rel, run_bwd_cfg, time_into)

RES = {"meta": {}, "compile": [], "check": [], "bench": []}
OPT = {"dims": (64, 128), "dtypes": ("bfloat16", "float16"),   # --dims / --dtypes
       "configs": None, "diag": None}                           # --configs / --diag
SHAPES = [(8, 16, 2048, 128), (2, 16, 8192, 128), (4, 32, 4096, 64)]


def log(*a):
    print(*a, flush=True)


ROUNDS = 3


def _pool(D):
    """Every config this bench can run: the default, the ws configs with dq (session 8:
    configs.WS_DQ_BWD_VARIANTS), those with one partial per key tile
    (WS_DQS_BWD_VARIANTS), the transposed consumers (session 9: WS_DQT_BWD_VARIANTS),
    the staged statistics (session 11: WS_DQR), the interleaved staging rows (session
    12: WS_DQI) and the ws dK/dV config (dQ portable: the route where the dQ-inside one is not)."""
    out = []
    for c in ([HCF.bwd_config(D)] + HCF.WS_DQ_BWD_VARIANTS[D] + HCF.WS_DQS_BWD_VARIANTS[D]
              + HCF.WS_DQT_BWD_VARIANTS[D] + HCF.WS_DQR_BWD_VARIANTS[D]
              + HCF.WS_DQI_BWD_VARIANTS[D] + [HCF.bwd_config_dkdv_only(D)]):
        if c not in out:
            out.append(c)
    return out


def _by_names(D, names):
    """The pool's configs named in ``names`` ('default': configs.bwd_config(D)), in the
    pool's order; a name of another head dim's pool is skipped here, an unknown name
    raises."""
    pool = _pool(D)
    known = {c.name for d in (64, 128) for c in _pool(d)} | {"default"}
    bad = [n for n in names if n not in known]
    if bad:
        raise ValueError(f"unknown config names {bad}; known: {sorted(known)}")
    return [c for c in pool if c.name in names or ("default" in names
                                                   and c == HCF.bwd_config(D))]


def configs(D, dt="bfloat16"):
    """The configs checked / timed: --configs (names; 'default' the default), else the
    default and (session 8) the warp-specialised kernel with dq inside
    (configs.WS_DQ_BWD_VARIANTS; both dtypes: any of them may become the default).
    Session 7's other variants (its ping-pong / 3-stage ws and the fused kernel) keep
    their measured numbers and are not rerun."""
    if OPT["configs"] is not None:
        return _by_names(D, OPT["configs"])
    return [c for c in _pool(D)
            if c not in HCF.WS_DQS_BWD_VARIANTS[D] + HCF.WS_DQT_BWD_VARIANTS[D]
            + HCF.WS_DQR_BWD_VARIANTS[D] + HCF.WS_DQI_BWD_VARIANTS[D]
            + [HCF.bwd_config_dkdv_only(D)]]


def diag_configs(D):
    """The configs timed with the no-add diagnostic (--diag names; default: the ws dq
    configs but the first, as session 8's run 2)."""
    if OPT["diag"] is not None:
        return _by_names(D, OPT["diag"]) if OPT["diag"] else []
    return HCF.WS_DQ_BWD_VARIANTS[D][1:]


def route_configs(D):
    """The configs whose routes are timed end to end: the default (portable delta + ws
    dK/dV + portable dQ), then each ws config with dq (portable delta + the kernel + the
    dq conversion)."""
    return configs(D)


def run_cfg(p, q, k, v, dout, l2, delta, cfg, bufs=None, order=None):
    """(dq or None, dk, dv) of one backward config (launch.backward_fused for configs
    with dq, launch.dkdv for the dK/dV ones); ``bufs``: poisoned (dq, dk, dv) to write;
    ``order``: the dq add order (default launch.dq_order)."""
    if not cfg.dq:
        return run_bwd_cfg(p, q, k, v, dout, l2, delta, cfg, bufs)
    dq, dk, dv = bufs if bufs is not None else (None, None, None)
    return HL.backward_fused(p, q, k, v, dout, l2, delta, dq, dk, dv, cfg=cfg, order=order)


def fwd_torch(q, k, v, keep, scale, acc_dt):
    """out [B, H, Sq, D] (q's dtype), max, log_norm [B, H, Sq] fp32 of the masked softmax
    (max -inf and log_norm 0 on empty rows), computed in acc_dt one batch at a time."""
    G = q.shape[1] // k.shape[1]
    outs, mxs, lns = [], [], []
    for b in range(q.shape[0]):
        qq = q[b:b + 1].to(acc_dt)
        kk = k[b:b + 1].to(acc_dt).repeat_interleave(G, 1)
        vv = v[b:b + 1].to(acc_dt).repeat_interleave(G, 1)
        s = qq @ kk.transpose(-1, -2) * scale
        if keep is not None:
            s = s.masked_fill(~keep, float("-inf"))
        mx = s.amax(-1)
        fin = torch.isfinite(mx)
        e = torch.exp(s - torch.where(fin, mx, 0.0)[..., None])
        del s
        l_ = e.sum(-1)
        ln = torch.where(fin, torch.log(torch.where(fin, l_, 1.0)), 0.0)
        outs.append((e / torch.where(fin, l_, 1.0)[..., None]) @ vv)
        mxs.append(mx)
        lns.append(ln)
        del e
    return (torch.cat(outs).to(q.dtype), torch.cat(mxs).float().contiguous(),
            torch.cat(lns).float().contiguous())


def inputs(B, H, Hkv, Sq, Sk, D, dt, layout="bhsd", seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    tdt = getattr(torch, dt)
    if layout == "bshd":   # [B, S, H, D] memory viewed as [B, H, S, D]
        mk = lambda h, s: torch.randn(B, s, h, D, device="cuda", generator=g).to(tdt).transpose(1, 2)  # noqa: E731
    else:
        mk = lambda h, s: torch.randn(B, h, s, D, device="cuda", generator=g).to(tdt)  # noqa: E731
    return mk(H, Sq), mk(Hkv, Sk), mk(Hkv, Sk)


# ----------------------------------------------------------------------------- compile
class routed:
    """Within the block, the routed Hopper backward of head dim D uses ``cfg`` whatever
    the mask class (configs._BWD and its (D, mask class) exceptions _BWD_BY_MASK)."""

    def __init__(self, cfg, D):
        self.cfg, self.D = cfg, D

    def __enter__(self):
        self.old = HCF._BWD[self.D]
        self.old_by_mask = dict(HCF._BWD_BY_MASK)
        HCF._BWD[self.D] = self.cfg
        for key in self.old_by_mask:
            if key[0] == self.D:
                HCF._BWD_BY_MASK[key] = self.cfg

    def __exit__(self, *a):
        HCF._BWD[self.D] = self.old
        HCF._BWD_BY_MASK.clear()
        HCF._BWD_BY_MASK.update(self.old_by_mask)
        return False


def _warm(job):
    """One worker's warm-up launch (fills the shared Triton cache): a small problem of
    the job's dtype / D / mask through one config, or the portable backward."""
    kind, dt, D, causal, name = job
    t = time.time()
    B, H, S = (1, 16, 256) if kind == "portable" else (1, 2, 256)
    q, k, v = inputs(B, H, H, S, S, D, dt)
    mask = mask_of("causal" if causal else "none", S, S)
    p = describe(q, k, v, mask=mask)
    out, mx, ln = fwd_torch(q, k, v, keep_dense("causal" if causal else "none", S, S, "cuda"),
                            p.scale, torch.float32)
    dout = torch.randn_like(out)
    p = describe(q, k, v, mask=mask, dout=dout, wrt=("q", "k", "v"))
    if kind == "portable":
        from anyattn.rowstats import RowStats

        os.environ["ANYATTN_TRITON_PATH"] = "portable"
        TL.backward(p, q, k, v, dout, out, RowStats(mx, ln), None)
        os.environ["ANYATTN_TRITON_PATH"] = "hopper"
        with routed(HCF.bwd_config(D), D):    # the route's portable dQ
            TL.backward(p, q, k, v, dout, out, RowStats(mx, ln), None)
    else:
        cfg = next(c for c in _pool(D) if c.name == name)   # (OPT is not set here)
        l2, delta = l2_delta(out, dout, mx, ln)
        run_cfg(p, q, k, v, dout, l2, delta, cfg)
    torch.cuda.synchronize()
    return dict(job=list(job), s=round(time.time() - t, 1))


def phase_compile():
    jobs = []
    for dt in OPT["dtypes"]:
        for D in OPT["dims"]:
            for causal in (False, True):
                jobs += [("cfg", dt, D, causal, c.name) for c in configs(D, dt)]
    jobs += [("portable", "bfloat16", D, c, "") for D in OPT["dims"] for c in (False, True)]
    ctx = mp.get_context("spawn")
    with cf.ProcessPoolExecutor(max_workers=min(12, os.cpu_count() or 4), mp_context=ctx) as ex:
        futs = {ex.submit(_warm, j): j for j in jobs}
        for f in cf.as_completed(futs, timeout=150):
            try:
                r = f.result()
            except Exception as e:  # noqa: BLE001 - recorded; the check phase will fail it
                r = dict(job=list(futs[f]), error=repr(e)[:400])
            RES["compile"].append(r)
            log("compile", r)
            dump()


# ----------------------------------------------------------------------------- check
CASES = [  # name, B, H, Hkv, Sq, Sk, D, dtype, mask, layout
    ("bf16-D128-causal-gqa-odd", 2, 4, 2, 257, 383, 128, "bfloat16", "causal", "bhsd"),
    ("bf16-D128-none-gqa-odd", 2, 4, 2, 257, 383, 128, "bfloat16", "none", "bhsd"),
    ("bf16-D128-window2-gqa-odd", 2, 4, 2, 257, 383, 128, "bfloat16", "window2", "bhsd"),
    ("bf16-D128-window", 1, 2, 1, 700, 700, 128, "bfloat16", "window", "bhsd"),
    ("bf16-D128-causalbr-emptyrows", 1, 2, 1, 300, 200, 128, "bfloat16", "causal_br", "bhsd"),
    ("bf16-D128-bshd-causal", 2, 4, 4, 512, 512, 128, "bfloat16", "causal", "bshd"),
    ("bf16-D128-none-long-chain", 1, 4, 2, 1000, 1500, 128, "bfloat16", "none", "bhsd"),
    ("bf16-D128-one-row", 1, 1, 1, 1, 1, 128, "bfloat16", "none", "bhsd"),
    ("bf16-D64-causal-gqa-odd", 2, 4, 2, 257, 383, 64, "bfloat16", "causal", "bhsd"),
    ("bf16-D64-none-gqa-odd", 2, 4, 2, 257, 383, 64, "bfloat16", "none", "bhsd"),
    ("bf16-D64-causalbr-emptyrows", 1, 2, 1, 300, 200, 64, "bfloat16", "causal_br", "bhsd"),
    ("fp16-D128-causal-gqa-odd", 2, 4, 2, 257, 383, 128, "float16", "causal", "bhsd"),
    ("fp16-D128-window2", 2, 4, 2, 257, 383, 128, "float16", "window2", "bhsd"),
    ("fp16-D64-none-gqa-odd", 2, 4, 2, 257, 383, 64, "float16", "none", "bhsd"),
]


def check_case(name, B, H, Hkv, Sq, Sk, D, dt, kind, layout):
    q, k, v = inputs(B, H, Hkv, Sq, Sk, D, dt, layout, seed=zlib.crc32(name.encode()) % 2**31)
    mask = mask_of(kind, Sq, Sk)
    keep = keep_dense(kind, Sq, Sk, "cuda")
    p = describe(q, k, v, mask=mask)
    out, mx, ln = fwd_torch(q, k, v, keep, p.scale, torch.float64)
    dout = torch.randn_like(out)
    p = describe(q, k, v, mask=mask, dout=dout, wrt=("q", "k", "v"))
    rq, rk, rv = grads64(q, k, v, keep, p.scale, dout)
    l2, delta = l2_delta(out, dout, mx, ln)
    row = dict(name=name, B=B, H=H, Hkv=Hkv, Sq=Sq, Sk=Sk, D=D, dtype=dt, mask=kind,
               layout=layout, tol=TOL[dt], cfgs={})
    shp_k = (B, Hkv, Sk, D)
    nan = lambda shape: torch.full(shape, float("nan"), dtype=q.dtype, device="cuda")  # noqa: E731
    runs = [(cfg.name, cfg, None) for cfg in configs(D, dt)]
    runs += [(f"{c.name}-order0", c, 0) for c in configs(D, dt) if c.dq]
    for name_c, cfg, order in runs:
        g1 = run_cfg(p, q, k, v, dout, l2, delta, cfg,
                     (nan((B, H, Sq, D)), nan(shp_k), nan(shp_k)), order)
        g2 = run_cfg(p, q, k, v, dout, l2, delta, cfg, None, order)
        torch.cuda.synchronize()
        r = {}
        ok = True
        for n, a, a2, ref in (("dq", g1[0], g2[0], rq), ("dk", g1[1], g2[1], rk),
                              ("dv", g1[2], g2[2], rv)):
            if a is None:
                continue
            r[f"err_{n}"] = e = rel(a, ref)
            r[f"nan_{n}"] = bool(torch.isnan(a).any())
            r[f"repeat_{n}"] = bool(torch.equal(a, a2))
            ok = ok and e <= TOL[dt] and not r[f"nan_{n}"] and r[f"repeat_{n}"]
        r["ok"] = bool(ok)
        row["cfgs"][name_c] = r
    # the routed path (ANYATTN_TRITON_PATH=hopper: portable preprocess + the default
    # config + portable dq), then with each other config routed
    from anyattn.rowstats import RowStats

    row["routed_cfgs"] = {}
    os.environ["ANYATTN_TRITON_PATH"] = "hopper"
    try:
        for cfg in route_configs(D):
            with routed(cfg, D):
                g = TL.backward(p, q, k, v, dout, out, RowStats(mx, ln), None)
                g2 = TL.backward(p, q, k, v, dout, out, RowStats(mx, ln), None)
            errs = {n: rel(g[n], r_) for n, r_ in (("dq", rq), ("dk", rk), ("dv", rv))}
            same = all(torch.equal(g[n], g2[n]) for n in ("dq", "dk", "dv"))
            row["routed_cfgs"][cfg.name] = dict(errs, repeat=same, ok=same and all(
                e <= TOL[dt] for e in errs.values()))
            if cfg == HCF.bwd_config(D):
                row["routed"] = errs
    finally:
        os.environ.pop("ANYATTN_TRITON_PATH", None)
    row["routed_ok"] = all(r_["ok"] for r_ in row["routed_cfgs"].values())
    row["ok"] = row["routed_ok"] and all(c["ok"] for c in row["cfgs"].values())
    RES["check"].append(row)
    log(f"check {name}: ok={row['ok']} routed " +
        " ".join(f"{n}={e:.2e}" for n, e in row["routed"].items()) + " | " +
        " ".join(f"{c}:{'ok' if r['ok'] else 'FAIL'}(" +
                 ",".join(f"{k_[4:]}={v_:.1e}" for k_, v_ in r.items() if k_.startswith("err"))
                 + ")" for c, r in row["cfgs"].items()))


def phase_check():
    for c in CASES:
        if c[6] not in OPT["dims"] or c[7] not in OPT["dtypes"]:
            continue
        try:
            check_case(*c)
        except Exception as e:  # noqa: BLE001 - recorded, the run goes on
            RES["check"].append(dict(name=c[0], error=repr(e)[:400], ok=False))
            log(f"check {c[0]}: ERROR {e!r}"[:400])
        dump()


# ----------------------------------------------------------------------------- bench
def phase_bench():
    from anyattn.rowstats import RowStats

    for (b, h, s, d) in OPT.get("shapes") or SHAPES:
        if d not in OPT["dims"]:
            continue
        for causal in (False, True):
            q, k, v = inputs(b, h, h, s, s, d, "bfloat16", seed=11)
            kind = "causal" if causal else "none"
            mask = mask_of(kind, s, s)
            p = describe(q, k, v, mask=mask)
            keep = keep_dense(kind, s, s, "cuda") if causal else None
            out, mx, ln = fwd_torch(q, k, v, keep, p.scale, torch.float32)
            del keep
            dout = torch.randn_like(out)
            p = describe(q, k, v, mask=mask, dout=dout, wrt=("q", "k", "v"))
            l2, delta = l2_delta(out, dout, mx, ln)
            fl = 2.5 * 4.0 * b * h * s * s * d / (2 if causal else 1)
            row = dict(B=b, H=h, S=s, D=d, causal=causal, ms={}, tflops={})

            def put(name, fn, flops=fl):
                time_into(row, name, fn, flops)

            def tl_bwd(path):
                return backward_on_path(path, p, q, k, v, dout, out, RowStats(mx, ln))

            # the routes, the portable backward and SDPA-cuDNN, ROUNDS rounds in rotating
            # order
            entries = [("bwd-portable", None)] + [
                ("bwd-hopper" if c == HCF.bwd_config(d) else f"bwd-hopper-{c.name}", c)
                for c in route_configs(d)] + [("bwd-sdpa-cudnn-rounds", "cudnn")]
            rounds = {n: [] for n, _ in entries}
            qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                o_cd = torch.nn.functional.scaled_dot_product_attention(qg, kg, vg,
                                                                        is_causal=causal)
            for r_ in range(ROUNDS):
                for n, cfg in entries[r_ % len(entries):] + entries[:r_ % len(entries)]:
                    one = dict(ms={}, tflops={})
                    if cfg is None:
                        time_into(one, n, lambda: tl_bwd("portable"), fl)
                    elif cfg == "cudnn":
                        time_into(one, n, lambda: torch.autograd.grad(
                            o_cd, (qg, kg, vg), dout, retain_graph=True), fl)
                    else:
                        with routed(cfg, d):
                            time_into(one, n, lambda: tl_bwd("hopper"), fl)
                    rounds[n].append(one["ms"][n])
            row["rounds_ms"] = rounds
            for n, ms in rounds.items():
                good = sorted(m for m in ms if isinstance(m, float))
                if good:
                    row["ms"][n] = med = good[len(good) // 2]
                    row["tflops"][n] = round(fl / med / 1e9, 1)
                else:
                    row["ms"][n] = ms[0]
            for cfg in configs(d):     # each config alone (dK/dV alone: 0.8 of the FLOPs)
                if cfg.dq:
                    put(f"bwdk-{cfg.name}", lambda cfg=cfg: run_cfg(p, q, k, v, dout, l2,
                                                                    delta, cfg))
            for cfg in diag_configs(d):   # diagnostics: the writer makes no adds; (split
                # configs) its adds in no order, no turns waited (session 12)
                put(f"bwdk-diag-noadd-{cfg.name}", lambda cfg=cfg: HL._backward_ws_dq(
                    p, q, k, v, dout, l2, delta, None, None, None, cfg, None, _diag=1))
                if cfg.split:
                    put(f"bwdk-diag-unordered-{cfg.name}", lambda cfg=cfg: HL._backward_ws_dq(
                        p, q, k, v, dout, l2, delta, None, None, None, cfg, None, _diag=2))
            bwd_configs_and_sdpa(put, row, p, q, k, v, dout, l2, delta,
                                 [c for c in configs(d) if not c.dq], causal, fl)
            pb, cb = (row["ms"].get(n) for n in ("bwd-portable", "bwd-sdpa-cudnn-rounds"))
            for n, _ in entries[1:-1]:
                hb = row["ms"].get(n)
                if isinstance(hb, float) and isinstance(cb, float):
                    row[f"{n}_vs_cudnn"] = round(cb / hb, 3)
                if isinstance(hb, float) and isinstance(pb, float):
                    row[f"{n}_vs_portable"] = round(pb / hb, 3)
            RES["bench"].append(row)
            log(f"bench B={b} H={h} S={s} D={d} causal={causal}: " +
                " ".join(f"{k_}={v_}" for k_, v_ in row["tflops"].items()))
            torch.cuda.empty_cache()
            dump()


def phase_roof():
    RES["meta"]["bf16_gemm_tflops"] = bf16_gemm_roof()
    log(f"roof: torch bf16 GEMM 8192^3 {RES['meta']['bf16_gemm_tflops']} TFLOP/s")


def dump():
    with open(os.path.join(RES["meta"]["out"], "hopper_bwd.json"), "w") as f:
        json.dump(RES, f, indent=1)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--phases", default="compile,check,roof,bench")
    ap.add_argument("--dims", default="64,128", help="head dims checked / timed")
    ap.add_argument("--dtypes", default="bfloat16,float16", help="dtypes checked")
    ap.add_argument("--configs", default=None,
                    help="config names checked / timed ('default' = configs.bwd_config); "
                         "default: the default + configs.WS_DQ_BWD_VARIANTS")
    ap.add_argument("--diag", default=None,
                    help="config names timed with the no-add diagnostic ('' none)")
    ap.add_argument("--shapes", default=None,
                    help="'B,H,S,D;...' timed instead of SHAPES (session 10: D=64 at 2k / 8k)")
    a = ap.parse_args()
    if a.shapes:
        OPT["shapes"] = [tuple(int(x) for x in sh.split(",")) for sh in a.shapes.split(";")]
    OPT.update(dims=tuple(int(x) for x in a.dims.split(",")), dtypes=tuple(a.dtypes.split(",")),
               configs=None if a.configs is None else a.configs.split(","),
               diag=None if a.diag is None else [x for x in a.diag.split(",") if x])
    RES["meta"].update(out=a.out, date=time.strftime("%Y-%m-%d %H:%M"),
                       device=torch.cuda.get_device_name(), torch=torch.__version__,
                       triton=triton.__version__, cudnn=torch.backends.cudnn.version(),
                       flops="FlashAttention convention: bwd 2.5 * 4*B*H*S*S*D, causal /2")
    try:
        RES["meta"]["gpu_state"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,utilization.gpu,memory.used,temperature.gpu",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout.strip()
    except Exception as e:  # noqa: BLE001
        RES["meta"]["gpu_state"] = repr(e)
    log(RES["meta"])
    for ph in a.phases.split(","):
        t = time.time()
        try:
            {"compile": phase_compile, "check": phase_check, "roof": phase_roof,
             "bench": phase_bench}[ph]()
        except Exception as e:  # noqa: BLE001
            RES["meta"][f"{ph}_error"] = repr(e)[:500]
            log(f"phase {ph} failed: {e!r}")
        RES["meta"][f"{ph}_s"] = round(time.time() - t, 1)
        log(f"phase {ph}: {time.time() - t:.1f} s")
        dump()
    bad = [r["name"] for r in RES["check"] if not r.get("ok")]
    log(f"checks: {len(RES['check'])} cases, failing: {bad}")
    for r in RES["bench"]:
        log(f"B={r['B']} H={r['H']} S={r['S']} D={r['D']} causal={r['causal']} TFLOP/s " +
            " ".join(f"{k}={v}" for k, v in r["tflops"].items()) + "  " +
            " ".join(f"{k}={v}" for k, v in r.items() if k.endswith(("_vs_portable",
                                                                       "_vs_cudnn"))))


if __name__ == "__main__":
    main()
