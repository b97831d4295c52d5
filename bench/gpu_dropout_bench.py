"""GPU check + benchmark of attention dropout and of the fast softcap (16-bit inputs) in
the triton backend.

    PYTHONUNBUFFERED=1 python bench/gpu_dropout_bench.py --out $OUT
    python bench/gpu_dropout_bench.py --plot dev/perf/dropout-triton-h200-2026-12-03.json
    python bench/gpu_dropout_bench.py --tiny --out /tmp/x     # plumbing dry run on CPU

One process, the JSON rewritten after every row:
  check  correctness on the GPU against float64 torch with autograd (independent of
         anyattn.reference; the keep mask from anyattn.dropout_mask):
         dropout bf16 / fp32, no mask and causal, GQA, Sq != Sk with offsets, seeds >= 2^63
         and a seed whose low word is 1 (an int argument of 1 is specialised by Triton);
         the mask bit for bit (q = 0, v = identity: out != 0 exactly where kept);
         bitwise repeatability; the fast softcap (tanh.approx.f32, SOFTCAP == 2) in bf16
         and fp16 vs float64, alone and with dropout; out, lse, dq, dk, dv
  time   B=4 H=16 S=4096 D=128 bf16, causal and not: plain, dropout p=0.1, softcap 50 (the fast
         tanh for 16-bit inputs); fwd and bwd
         medians (triton.testing.do_bench), registers / spills of the kernels each compiled
  flex   FlexAttention (torch.compile'd) plain and tanh softcap on the same shapes
  fa2    flash-attn 2's dropout overhead, if flash_attn is importable
TFLOP/s by the FlashAttention convention (fwd 4*B*H*Sq*Sk*D, bwd 2.5x, causal 1/2).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

from gpu_harness import Harness, log, rel  # noqa: E402

TOL = {"bf16": 2e-2, "fp16": 3e-3, "fp32": 1e-5}
RESULTS = {"meta": {}, "check": [], "bench": [], "kernels": [], "summary": {}}
CAP = 50.0
P_DROP = 0.1
SEED = (1 << 64) - 987654321          # >= 2^63
TINY = False
DEV = "cuda"
H = Harness(RESULTS)
bench_ms, record, inputs, time_autograd, save_now = (H.bench_ms, H.record, H.inputs,
                                                     H.time_autograd, H.save_now)
SHAPE = (4, 16, 4096, 128)
CASES = ""
TIMED = ()


def dt_of(name):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


# ----------------------------------------------------------------------------- reference
def ref64(q, k, v, g, *, causal=None, window=None, q_offset=0, k_offset=0, softcap=None,
          p=0.0, seed=None):
    """float64 torch with autograd -> (out, lse, {dq, dk, dv}); the mask's dense keep pattern
    from anyattn.masks.resolve, dropout's keep from anyattn.dropout_mask at the global
    positions, everything else written out here."""
    import numpy as np
    import torch

    import anyattn as aa
    from anyattn.masks import resolve

    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    qq, kk, vv = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    ke, ve = kk.repeat_interleave(G, 1), vv.repeat_interleave(G, 1)
    s = (qq @ ke.transpose(-1, -2)) / math.sqrt(D)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    keep = torch.from_numpy(resolve(mask_of(causal, window), B, Hq, Sq, Sk, q_offset, k_offset)
                            .dense_keep(B, Hq)).to(q.device)
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    pr = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    if p > 0:
        dm = aa.dropout_mask((B, Hq, Sq, Sk), p, seed, q_offset=q_offset, k_offset=k_offset)
        pr = pr * torch.from_numpy(np.ascontiguousarray(dm)).to(q.device) / (1.0 - p)
    out = pr @ ve
    grads = torch.autograd.grad((out * g.double()).sum(), [qq, kk, vv])
    return out.detach(), lse.detach(), dict(dq=grads[0], dk=grads[1], dv=grads[2])


def mask_of(causal, window):
    import anyattn as aa

    m = None
    if causal == "top_left":
        m = aa.Causal()
    elif causal == "bottom_right":
        m = aa.Causal("bottom_right")
    if window is not None:
        w = aa.Window(left=window, align="bottom_right")
        m = w if m is None else m & w
    return m


def phase_check():
    import numpy as np
    import torch

    import anyattn as aa
    from anyattn.api import forward_with_stats
    from anyattn.backends.triton import configs as C

    gen = torch.Generator(device=DEV).manual_seed(0)
    RESULTS["meta"]["softcap_mode_bf16"] = C.softcap_mode("bfloat16", torch.device(DEV))
    RESULTS["meta"]["softcap_mode_fp32"] = C.softcap_mode("float32", torch.device(DEV))
    # (dtype, name, B, Hq, Hkv, Sq, Sk, D, causal, window, q_off, k_off, softcap, p, seed)
    cases = [
        ("bf16", "drop_none", 1, 4, 2, 1024, 1024, 128, None, None, 0, 0, None, P_DROP, SEED),
        ("bf16", "drop_causal", 1, 4, 2, 1024, 1024, 128, "top_left", None, 0, 0, None, 0.3,
         SEED),
        ("bf16", "drop_seedlow1_br_window_offsets", 1, 4, 4, 768, 1000, 128, "bottom_right",
         300, 16, 3, None, 0.2, (5 << 32) | 1),
        ("fp32", "drop_causal", 1, 4, 2, 1024, 1024, 128, "top_left", None, 0, 0, None, 0.2,
         SEED),
        ("bf16", "fastcap_causal", 1, 4, 2, 1024, 1024, 128, "top_left", None, 0, 0, 4.0, 0.0,
         None),
        ("fp16", "fastcap_causal", 1, 4, 2, 1024, 1024, 128, "top_left", None, 0, 0, 4.0, 0.0,
         None),
        ("bf16", "fastcap_none_drop", 1, 4, 2, 1024, 1024, 128, None, None, 0, 0, 4.0, P_DROP,
         SEED),
    ]
    if TINY:
        cases = [c[:2] + (1, 2, 1, 40 if c[5] == c[6] else 24, 40, 16) + c[8:9]
                 + ((None if c[9] is None else 9),) + c[10:] for c in cases]
    for (dn, name, B, Hq, Hkv, Sq, Sk, D, causal, window, qo, ko, cap, p, seed) in cases:
        if not name.startswith(CASES):
            continue
        dt = dt_of(dn)
        t0 = time.time()
        row = dict(case=name, dtype=dn, B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=Sk, D=D, p=p,
                   seed=None if seed is None else str(seed), softcap=cap)
        try:
            q = (2.0 * torch.randn(B, Hq, Sq, D, generator=gen, device=DEV)).to(dt)
            k = torch.randn(B, Hkv, Sk, D, generator=gen, device=DEV).to(dt)
            v = torch.randn(B, Hkv, Sk, D, generator=gen, device=DEV).to(dt)
            g = torch.randn(B, Hq, Sq, D, generator=gen, device=DEV).to(dt)
            mask = mask_of(causal, window)
            kw = dict(mask=mask, backend="triton", q_offset=qo, k_offset=ko)
            if cap is not None:
                kw["softcap"] = cap
            if p > 0:
                kw.update(dropout_p=p, dropout_seed=seed)
            out, st = forward_with_stats(q, k, v, **kw)
            gr = aa.attention_backward(q, k, v, g, out=out, lse=st, **kw)
            ro, rl, rg = ref64(q, k, v, g, causal=causal, window=window, q_offset=qo,
                               k_offset=ko, softcap=cap, p=p, seed=seed)
            errs = dict(out=rel(out, ro), dq=rel(gr.dq, rg["dq"]), dk=rel(gr.dk, rg["dk"]),
                        dv=rel(gr.dv, rg["dv"]))
            lse = st.lse
            fin = torch.isfinite(rl)
            errs["lse_abs"] = float((lse.double()[fin] - rl[fin]).abs().max())
            tol = TOL[dn]
            ok = bool(torch.equal(torch.isfinite(lse), fin)) and \
                all(e <= tol for n, e in errs.items() if n != "lse_abs") and \
                errs["lse_abs"] <= 1e-4 * max(1.0, float(rl[fin].abs().max()))
            if p > 0:   # bitwise repeatable
                out2 = aa.attention(q, k, v, **kw)
                gr2 = aa.attention_backward(q, k, v, g, out=out, lse=st, **kw)
                rep = bool(torch.equal(out, out2)) and all(
                    bool(torch.equal(getattr(gr, n), getattr(gr2, n))) for n in ("dq", "dk", "dv"))
                row["repeatable"] = rep
                ok = ok and rep
            row.update(errs={n: float(f"{e:.3g}") for n, e in errs.items()}, tol=tol, ok=ok,
                       seconds=round(time.time() - t0, 1))
        except Exception as e:  # noqa: BLE001
            row.update(ok=False, error=repr(e)[:300])
            traceback.print_exc()
        RESULTS["check"].append(row)
        log("CHECK", json.dumps(row))
        save_now()
        torch.cuda.empty_cache()
    # the mask bit for bit: q = 0 (P uniform), v = identity (Sk = D): out != 0 iff kept;
    # dout = identity (Sq = D): dv^T != 0 iff kept (the dK/dV programs' own draw)
    for dn, seed, qo, ko in (("bf16", SEED, 12345, (1 << 31) + 3),
                             ("bf16", (9 << 32) | 1, (1 << 32) - 200, 77)):
        row = dict(case="mask_bit_for_bit", dtype=dn, seed=str(seed), q_offset=qo, k_offset=ko)
        try:
            dt = dt_of(dn)
            B, H, S = 2, 4, (16 if TINY else 128)
            q = torch.zeros(B, H, S, S, device=DEV, dtype=dt)
            k = torch.randn(B, H, S, S, generator=gen, device=DEV).to(dt)
            eye = torch.eye(S, device=DEV, dtype=dt).expand(B, H, S, S).contiguous()
            kw = dict(backend="triton", dropout_p=0.3, dropout_seed=seed, q_offset=qo,
                      k_offset=ko)
            want = aa.dropout_mask((B, H, S, S), 0.3, seed, q_offset=qo, k_offset=ko)
            out = aa.attention(q, k, eye, **kw)
            gr = aa.attention_backward(q, k, eye, eye, wrt=("v",), **kw)
            f_ok = np.array_equal((out != 0).cpu().numpy(), want)
            b_ok = np.array_equal((gr.dv.transpose(-1, -2) != 0).cpu().numpy(), want)
            row.update(ok=bool(f_ok and b_ok), fwd_equal=bool(f_ok), bwd_equal=bool(b_ok),
                       dropped=round(1 - float(want.mean()), 4))
        except Exception as e:  # noqa: BLE001
            row.update(ok=False, error=repr(e)[:300])
            traceback.print_exc()
        RESULTS["check"].append(row)
        log("CHECK", json.dumps(row))
        save_now()


# ----------------------------------------------------------------------------- kernels
def compiled_kernels():
    """{(name, id): CompiledKernel} of every triton kernel compiled so far (best effort)."""
    from anyattn.backends.triton import kernels as K

    found = {}
    for name in ("fwd_kernel", "bwd_kernel", "dkdv_kernel", "dq_kernel"):
        fn = getattr(K, name)
        try:
            for caches in fn.device_caches.values():
                for ck in caches[0].values():
                    found[(name, id(ck))] = ck
        except Exception:  # noqa: BLE001
            pass
    return found


def note_kernels(label, before):
    for key, ck in compiled_kernels().items():
        if key in before:
            continue
        row = dict(variant=label, kernel=key[0])
        try:
            row.update(n_regs=int(ck.n_regs), n_spills=int(ck.n_spills))
        except Exception as e:  # noqa: BLE001
            row["error"] = repr(e)[:100]
        try:
            row["tanh_approx_in_ptx"] = "tanh.approx.f32" in ck.asm["ptx"]
        except Exception:  # noqa: BLE001
            pass
        RESULTS["kernels"].append(row)
        log("KERNEL", json.dumps(row))


# ----------------------------------------------------------------------------- timing
VARIANTS = {"plain": {}, "dropout": {"dropout_p": P_DROP, "dropout_seed": SEED},
            "softcap": {"softcap": CAP}}


def phase_time():
    import torch

    import anyattn as aa
    from anyattn.api import forward_with_stats

    gen = torch.Generator(device=DEV).manual_seed(1)
    q, k, v, g = inputs(SHAPE, torch.bfloat16, gen)
    for causal in (False, True):
        mask = aa.Causal() if causal else None
        for variant, kw in VARIANTS.items():
            if variant not in TIMED:
                continue
            before = compiled_kernels()
            try:
                t0 = time.time()
                out, st = forward_with_stats(q, k, v, mask=mask, backend="triton", **kw)
                aa.attention_backward(q, k, v, g, out=out, lse=st, mask=mask, backend="triton",
                                      **kw)
                if not TINY:
                    torch.cuda.synchronize()
                first = time.time() - t0
                fwd = bench_ms(lambda: aa.attention(q, k, v, mask=mask, backend="triton", **kw))
                bwd = bench_ms(lambda: aa.attention_backward(q, k, v, g, out=out, lse=st,
                                                             mask=mask, backend="triton", **kw))
                record("anyattn-triton", variant, "bf16", causal, fwd, bwd, SHAPE,
                       extra=dict(first_call_s=round(first, 1)))
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                record("anyattn-triton", variant, "bf16", causal, 0, 0, SHAPE, err=repr(e))
            note_kernels(f"{variant}_{'causal' if causal else 'noncausal'}", before)
            save_now()
            torch.cuda.empty_cache()


def phase_flex():
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.config.recompile_limit = 10_000
    torch._dynamo.config.accumulated_recompile_limit = 10_000
    flex = flex_attention if TINY else torch.compile(flex_attention, dynamic=False)
    gen = torch.Generator(device=DEV).manual_seed(3)
    q, k, v, g = inputs(SHAPE, torch.bfloat16, gen)
    S = SHAPE[2]

    def softcap_mod(score, b, h, qi, ki):
        return CAP * torch.tanh(score / CAP)

    for causal in (False, True):
        bm = (create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S, device=DEV)
              if causal else None)
        for variant, sm in (("plain", None), ("softcap", softcap_mod)):
            t0 = time.time()
            try:
                fn = (lambda q_, k_, v_, sm=sm, bm=bm: flex(q_, k_, v_, score_mod=sm, block_mask=bm))
                fn(q, k, v)
                fwd, bwd = time_autograd(fn, q, k, v, g)
                record("flex", variant, "bf16", causal, fwd, bwd, SHAPE,
                       extra=dict(first_call_s=round(time.time() - t0, 1)))
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                record("flex", variant, "bf16", causal, 0, 0, SHAPE, err=repr(e))
            torch.cuda.empty_cache()


def phase_fa2():
    try:
        from flash_attn import flash_attn_func
    except Exception as e:  # noqa: BLE001
        RESULTS["meta"]["flash_attn"] = f"not importable on this machine: {e!r}"[:200]
        log("FA2:", RESULTS["meta"]["flash_attn"])
        return
    import torch

    RESULTS["meta"]["flash_attn"] = "importable"
    gen = torch.Generator(device=DEV).manual_seed(4)
    q, k, v, g = (x.transpose(1, 2).contiguous() for x in inputs(SHAPE, torch.bfloat16, gen))
    for causal in (False, True):
        for variant, p in (("plain", 0.0), ("dropout", P_DROP)):
            try:
                fwd, bwd = time_autograd(lambda a, b, c, p=p, causal=causal: flash_attn_func(
                    a, b, c, dropout_p=p, causal=causal), q, k, v, g)
                record("flash-attn2", variant, "bf16", causal, fwd, bwd, SHAPE)
            except Exception as e:  # noqa: BLE001
                record("flash-attn2", variant, "bf16", causal, 0, 0, SHAPE, err=repr(e))


# ----------------------------------------------------------------------------- summary
def summarize():
    rows = [r for r in RESULTS["bench"] if "total_ms" in r]

    def get(impl, variant, causal):
        xs = [r for r in rows if (r["impl"], r["variant"], r["causal"]) == (impl, variant, causal)]
        return xs[-1] if xs else None

    summ = {}
    for causal in (False, True):
        c = "causal" if causal else "noncausal"
        base = get("anyattn-triton", "plain", causal)
        dr = get("anyattn-triton", "dropout", causal)
        if base and dr:
            fr, br = dr["fwd_ms"] / base["fwd_ms"], dr["bwd_ms"] / base["bwd_ms"]
            summ[f"dropout_{c}"] = dict(fwd_ratio=round(fr, 3), bwd_ratio=round(br, 3),
                                        total_ratio=round(dr["total_ms"] / base["total_ms"], 3),
                                        meets_fwd_1_10=fr <= 1.10, meets_bwd_1_15=br <= 1.15)
        for v in ("softcap", "softcap_portable"):
            sc = get("anyattn-triton", v, causal)
            if base and sc:
                r = dict(ms=sc["total_ms"], plain_ms=base["total_ms"],
                         over_plain=round(sc["total_ms"] / base["total_ms"] - 1, 4),
                         fwd_over_plain=round(sc["fwd_ms"] / base["fwd_ms"] - 1, 4),
                         bwd_over_plain=round(sc["bwd_ms"] / base["bwd_ms"] - 1, 4),
                         meets_overhead=sc["total_ms"] / base["total_ms"] <= 1.10)
                fx = get("flex", "softcap", causal)
                if fx:
                    r.update(flex_ms=fx["total_ms"], vs_flex=round(sc["total_ms"] / fx["total_ms"], 3),
                             meets_flex=sc["total_ms"] <= fx["total_ms"])
                summ[f"{v}_{c}"] = r
        fa, fd = get("flash-attn2", "plain", causal), get("flash-attn2", "dropout", causal)
        if fa and fd:
            summ[f"fa2_dropout_{c}"] = dict(fwd_ratio=round(fd["fwd_ms"] / fa["fwd_ms"], 3),
                                            bwd_ratio=round(fd["bwd_ms"] / fa["bwd_ms"], 3))
    RESULTS["summary"] = summ
    return summ


# ----------------------------------------------------------------------------- plot
def plot(json_path, png_path=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as fh:
        res = json.load(fh)
    # rows of the latest process first (a merged file marks older rows with 'run')
    rows = sorted((r for r in res["bench"] if "total_ms" in r and not r.get("superseded")),
                  key=lambda r: "run" in r)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.8))
    labels = [("anyattn-triton", "plain"), ("anyattn-triton", "dropout"),
              ("anyattn-triton", "softcap"), ("anyattn-triton", "softcap_portable"),
              ("flex", "plain"), ("flex", "softcap"), ("flash-attn2", "plain"),
              ("flash-attn2", "dropout")]
    for ax, causal in zip(axes, (False, True)):
        names, fw, bw = [], [], []
        for impl, var in labels:
            r = next((r for r in rows if r["impl"] == impl and r["variant"] == var
                      and r["causal"] == causal), None)
            if r:
                names.append(f"{'ours' if impl.startswith('any') else impl} {var}")
                fw.append(r["fwd_ms"])
                bw.append(r["bwd_ms"])
        x = list(range(len(names)))
        ax.bar(x, fw, 0.6, label="fwd")
        ax.bar(x, bw, 0.6, bottom=fw, label="bwd")
        for i, (a, b) in enumerate(zip(fw, bw)):
            ax.text(i, a + b, f"{a + b:.2f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(x)
        ax.set_xticklabels(names, rotation=30, ha="right", fontsize=7)
        ax.set_ylabel("ms (median)")
        ax.set_title(f"bf16 B=4 H=16 S=4096 D=128, {'causal' if causal else 'non-causal'}")
        ax.legend(fontsize=8)
    fig.suptitle(f"Dropout p={P_DROP} and softcap {CAP:g}, {res['meta'].get('device', '?')}, "
                 f"{res['meta'].get('date', '')}")
    fig.tight_layout()
    png_path = png_path or os.path.splitext(json_path)[0] + ".png"
    fig.savefig(png_path, dpi=110)
    return png_path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--phases", default="fa2,check,time,flex")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--name", default="dropout-triton-h200.json")
    ap.add_argument("--plot", default="")
    ap.add_argument("--cases", default="", help="check only the cases whose name starts so")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="timed variants")
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args()
    if a.plot:
        log(plot(a.plot))
        return
    global TINY, DEV, SHAPE, CASES, TIMED
    CASES, TIMED = a.cases, tuple(a.variants.split(","))
    if a.tiny:
        os.environ["TRITON_INTERPRET"] = "1"
        TINY, DEV, SHAPE = True, "cpu", (1, 2, 48, 16)
    H.tiny, H.dev = TINY, DEV
    H.meta(shape="B=4 H=16 S=4096 D=128 bf16", dropout_p=P_DROP, softcap_timing=CAP,
           phases=a.phases)
    H.run_phases({"check": phase_check, "time": phase_time, "flex": phase_flex,
                  "fa2": phase_fa2}, a.phases.split(","), a.out, a.name, summarize)

if __name__ == "__main__":
    main()
