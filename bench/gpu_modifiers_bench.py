"""GPU benchmark of the score modifiers (softcap, ALiBi, sinks) in the triton backend.

    PYTHONUNBUFFERED=1 python bench/gpu_modifiers_bench.py --phases check,ours,fp32,flex --out $OUT
    python bench/gpu_modifiers_bench.py --plot dev/perf/modifiers-triton-h200-2026-12-03.json

Phases (any subset, in this order; one process, the JSON rewritten after every row):
  check  correctness on the GPU vs a float64 torch computation with autograd (independent
         of anyattn.reference): every modifier alone and all together, bf16 and fp32, no
         mask / causal / Sq != Sk bottom-right causal + window with offsets, GQA, D=128
         and D=64; out, lse, dq, dk, dv, dsinks, relative max error vs the dtype's tolerance
  ours   B=4 H=16 S=4096 D=128 bf16, causal and not: plain vs softcap vs ALiBi vs sinks (with
         dsinks) vs all three, fwd and bwd medians (triton.testing.do_bench: CUDA events)
  fp32   the same shape in fp32 (precision 'highest'): ours plain / softcap / all three vs
         SDPA memory-efficient fp32 (plain; ALiBi as a dense fp32 bias [1, H, S, S])
  fp32ours  the fp32 rows of ours alone
  flex   FlexAttention (torch.compile'd) on the same shapes with the same score_mod:
         tanh softcap, ALiBi; sinks are no score_mod (an extra denominator term): timed as
         flex with its lse and the rescale out * sigmoid(lse - sink) outside the kernel
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

TOL = {"bf16": 2e-2, "fp32": 1e-5}
RESULTS = {"meta": {}, "check": [], "bench": [], "summary": {}}
CAP = 50.0          # Gemma 2's attention softcap (timing); the checks use smaller caps
#: --tiny: a dry run of the script's plumbing on CPU tensors through Triton's interpreter
#: (TRITON_INTERPRET=1) at tiny sizes, no timing worth the name
TINY = False
DEV = "cuda"
H = Harness(RESULTS)
bench_ms, record, inputs, time_autograd, save_now = (H.bench_ms, H.record, H.inputs,
                                                     H.time_autograd, H.save_now)


# ----------------------------------------------------------------------------- inputs
def alibi_slopes(H, dev):
    import torch

    return torch.tensor([2.0 ** (-8.0 * (h + 1) / H) for h in range(H)], dtype=torch.float32,
                        device=dev)


def mods_of(variant, H, dev, gen, cap=CAP, B=None):
    """variant in plain / softcap / alibi / sinks / all -> anyattn keyword arguments."""
    import torch

    kw = {}
    if variant in ("softcap", "all"):
        kw["softcap"] = cap
    if variant in ("alibi", "all"):
        s = alibi_slopes(H, dev)
        kw["alibi_slopes"] = s if B is None else s[None, :] * torch.rand(
            (B, 1), generator=gen, device=dev).add_(0.5)
    if variant in ("sinks", "all"):
        kw["sinks"] = torch.randn(H, generator=gen, device=dev, dtype=torch.float32)
    return kw


# ----------------------------------------------------------------------------- reference
def ref64(q, k, v, g, *, mask=None, q_offset=0, k_offset=0, softcap=None,
          alibi_slopes=None, sinks=None):
    """float64 torch with autograd: (out, lse, {dq, dk, dv, dsinks}); the mask's dense keep
    pattern from anyattn.masks.resolve, everything else written out here."""
    import torch

    from anyattn.masks import resolve

    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    qq, kk, vv = (x.detach().double().requires_grad_(True) for x in (q, k, v))
    st = None if sinks is None else sinks.detach().double().requires_grad_(True)
    ke, ve = kk.repeat_interleave(G, 1), vv.repeat_interleave(G, 1)
    s = (qq @ ke.transpose(-1, -2)) / math.sqrt(D)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    i = torch.arange(Sq, device=q.device)[:, None] + q_offset
    j = torch.arange(Sk, device=q.device)[None, :] + k_offset
    diag = Sk - Sq
    if alibi_slopes is not None:
        sl = alibi_slopes.double().reshape(-1, Hq, 1, 1)
        s = s - sl * (i - j + diag).abs()
    keep = torch.from_numpy(resolve(mask, B, Hq, Sq, Sk, q_offset, k_offset)
                            .dense_keep(B, Hq)).to(q.device)
    s = s.masked_fill(~keep, float("-inf"))
    if st is not None:
        s = torch.cat([s, st.reshape(1, Hq, 1, 1).expand(B, Hq, Sq, 1)], dim=-1)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    if st is not None:
        p = p[..., :-1]
    out = p @ ve
    grads = torch.autograd.grad((out * g.double()).sum(), [qq, kk, vv] + ([st] if st is not None else []))
    res = dict(dq=grads[0], dk=grads[1], dv=grads[2])
    if st is not None:
        res["dsinks"] = grads[3]
    return out.detach(), lse.detach(), res


def phase_check():
    import torch

    import anyattn as aa
    from anyattn.api import forward_with_stats

    dev = DEV
    gen = torch.Generator(device=dev).manual_seed(0)
    # (each new constexpr combination compiles new kernels: the fp32 cases are the
    # combined ones; every modifier alone in fp32 runs in the interpreter tests)
    cases = []
    for variant in ("softcap", "alibi", "sinks", "all"):
        cases.append(("bf16", f"{variant}_none_D128", variant, 2, 8, 2, 1024, 1024, 128, None,
                      None, 0, 0))
    for dt_name in ("bf16", "fp32"):
        if dt_name == "fp32":
            cases.append(("fp32", "all_none_D128", "all", 2, 8, 2, 1024, 1024, 128, None,
                          None, 0, 0))
        cases.append((dt_name, "all_causal_D128", "all", 2, 8, 2, 1024, 1024, 128, "top_left",
                      None, 0, 0))
        cases.append((dt_name, "all_br_window_offsets", "all", 2, 8, 4, 768, 1000, 128,
                      "bottom_right", 300, 16, 3))
    cases.append(("bf16", "all_causal_D64", "all", 2, 8, 2, 1024, 1024, 64, "top_left", None,
                  0, 0))
    if TINY:
        cases = [(dn, n, vv, 1, 2, 1, 40 if sq == sk else 24, 40, 16, c,
                  None if w is None else 9, qo, ko)
                 for (dn, n, vv, b, hq, hkv, sq, sk, d, c, w, qo, ko) in cases]
    for (dt_name, name, variant, B, Hq, Hkv, Sq, Sk, D, causal, window, qo, ko) in cases:
        dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dt_name]
        t0 = time.time()
        row = dict(case=name, dtype=dt_name, B=B, Hq=Hq, Hkv=Hkv, Sq=Sq, Sk=Sk, D=D)
        try:
            q = (2.0 * torch.randn(B, Hq, Sq, D, generator=gen, device=dev)).to(dt)
            k = torch.randn(B, Hkv, Sk, D, generator=gen, device=dev).to(dt)
            v = torch.randn(B, Hkv, Sk, D, generator=gen, device=dev).to(dt)
            g = torch.randn(B, Hq, Sq, D, generator=gen, device=dev).to(dt)
            kw = mods_of(variant, Hq, dev, gen, cap=4.0, B=B if variant == "all" else None)
            mask = None
            if causal == "top_left":
                mask = aa.Causal()
            elif causal == "bottom_right":
                mask = aa.Causal("bottom_right")
            if window is not None:
                w = aa.Window(left=window, align="bottom_right")
                mask = w if mask is None else mask & w
            wrt = ("q", "k", "v") + (("sinks",) if "sinks" in kw else ())
            out, st = forward_with_stats(q, k, v, mask=mask, backend="triton",
                                            q_offset=qo, k_offset=ko, **kw)
            gr = aa.attention_backward(q, k, v, g, out=out, lse=st, mask=mask, wrt=wrt,
                                       backend="triton", q_offset=qo, k_offset=ko, **kw)
            ro, rl, rg = ref64(q, k, v, g, mask=mask, q_offset=qo, k_offset=ko, **kw)
            errs = dict(out=rel(out, ro), dq=rel(gr.dq, rg["dq"]), dk=rel(gr.dk, rg["dk"]),
                        dv=rel(gr.dv, rg["dv"]))
            if "sinks" in kw:
                errs["dsinks"] = rel(gr.dsinks, rg["dsinks"])
            lse = st.lse
            fin = torch.isfinite(rl)
            errs["lse_abs"] = float((lse.double()[fin] - rl[fin]).abs().max())
            same_fin = bool(torch.equal(torch.isfinite(lse), fin))
            tol = TOL[dt_name]
            ok = same_fin and all(e <= tol for n, e in errs.items() if n != "lse_abs") and \
                errs["lse_abs"] <= 1e-4 * max(1.0, float(rl[fin].abs().max()))
            row.update(errs={n: float(f"{e:.3g}") for n, e in errs.items()}, tol=tol, ok=ok,
                       seconds=round(time.time() - t0, 1))
        except Exception as e:  # noqa: BLE001
            row.update(ok=False, error=repr(e)[:300])
            traceback.print_exc()
        RESULTS["check"].append(row)
        log("CHECK", json.dumps(row))
        save_now()
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- timing
def time_ours(q, k, v, g, mask, kw, precision=None):
    import anyattn as aa
    from anyattn.api import forward_with_stats

    wrt = ("q", "k", "v") + (("sinks",) if "sinks" in kw else ())
    out, st = forward_with_stats(q, k, v, mask=mask, backend="triton", precision=precision,
                                    **kw)
    fwd = bench_ms(lambda: aa.attention(q, k, v, mask=mask, backend="triton",
                                        precision=precision, **kw))
    bwd = bench_ms(lambda: aa.attention_backward(q, k, v, g, out=out, lse=st, mask=mask, wrt=wrt,
                                                 backend="triton", precision=precision, **kw))
    return fwd, bwd


SHAPE = (4, 16, 4096, 128)


def phase_ours(dt_name="bf16", variants=("plain", "softcap", "alibi", "sinks", "all")):
    import torch

    import anyattn as aa

    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dt_name]
    gen = torch.Generator(device=DEV).manual_seed(1)
    q, k, v, g = inputs(SHAPE, dt, gen)
    for causal in (False, True):
        mask = aa.Causal() if causal else None
        for variant in variants:
            kw = mods_of(variant, SHAPE[1], DEV, gen)
            try:
                fwd, bwd = time_ours(q, k, v, g, mask, kw)
                record("anyattn-triton", variant, dt_name, causal, fwd, bwd, SHAPE)
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                record("anyattn-triton", variant, dt_name, causal, 0, 0, SHAPE, err=repr(e))
            torch.cuda.empty_cache()


def phase_fp32():
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    phase_ours("fp32", variants=("plain", "softcap", "all"))
    gen = torch.Generator(device=DEV).manual_seed(2)
    q, k, v, g = inputs(SHAPE, torch.float32, gen)
    B, H, S, D = SHAPE
    for causal in (False, True):
        def sd(q_, k_, v_, causal=causal):
            with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
                return F.scaled_dot_product_attention(q_, k_, v_, is_causal=causal)
        try:
            fwd, bwd = time_autograd(sd, q, k, v, g)
            record("sdpa-efficient", "plain", "fp32", causal, fwd, bwd, SHAPE)
        except Exception as e:  # noqa: BLE001
            record("sdpa-efficient", "plain", "fp32", causal, 0, 0, SHAPE, err=repr(e))
        torch.cuda.empty_cache()
    # ALiBi as a dense fp32 bias [1, H, S, S] (1 GiB), causal folded in as -inf
    try:
        i = torch.arange(S, device=DEV)
        dist = (i[:, None] - i[None, :]).abs().float()
        for causal in (False, True):
            bias = -alibi_slopes(H, DEV).reshape(1, H, 1, 1) * dist
            if causal:
                bias = bias.masked_fill(i[None, :] > i[:, None], float("-inf"))

            def sdb(q_, k_, v_, bias=bias):
                with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
                    return F.scaled_dot_product_attention(q_, k_, v_, attn_mask=bias)
            fwd, bwd = time_autograd(sdb, q, k, v, g)
            record("sdpa-efficient", "alibi(dense bias)", "fp32", causal, fwd, bwd, SHAPE)
            del bias
            torch.cuda.empty_cache()
    except Exception as e:  # noqa: BLE001
        record("sdpa-efficient", "alibi(dense bias)", "fp32", False, 0, 0, SHAPE, err=repr(e))


def phase_flex():
    import torch
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    torch._dynamo.config.recompile_limit = 10_000
    torch._dynamo.config.accumulated_recompile_limit = 10_000
    flex = flex_attention if TINY else torch.compile(flex_attention, dynamic=False)
    gen = torch.Generator(device=DEV).manual_seed(3)
    q, k, v, g = inputs(SHAPE, torch.bfloat16, gen)
    B, H, S, D = SHAPE
    slopes = alibi_slopes(H, DEV)
    sinks = torch.randn(H, generator=gen, device=DEV).requires_grad_(True)

    def softcap_mod(score, b, h, qi, ki):
        return CAP * torch.tanh(score / CAP)

    def alibi_mod(score, b, h, qi, ki):
        return score - slopes[h] * (qi - ki).abs()

    mods = {"plain": None, "softcap": softcap_mod, "alibi": alibi_mod}
    for causal in (False, True):
        bm = (create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, S, S, device=DEV)
              if causal else None)
        for variant, sm in mods.items():
            t0 = time.time()
            try:
                fn = (lambda q_, k_, v_, sm=sm, bm=bm: flex(q_, k_, v_, score_mod=sm, block_mask=bm))
                fn(q, k, v)   # compile outside the timing
                fwd, bwd = time_autograd(fn, q, k, v, g)
                record("flex", variant, "bf16", causal, fwd, bwd, SHAPE,
                       extra=dict(first_call_s=round(time.time() - t0, 1)))
            except Exception as e:  # noqa: BLE001
                traceback.print_exc()
                record("flex", variant, "bf16", causal, 0, 0, SHAPE, err=repr(e))
            torch.cuda.empty_cache()
        # sinks: not a score_mod; flex's lse, then out * sigmoid(lse - sink) outside
        t0 = time.time()
        try:
            def fs(q_, k_, v_, bm=bm):
                o, lse = flex(q_, k_, v_, block_mask=bm, return_lse=True)
                w = torch.sigmoid(lse - sinks.reshape(1, -1, 1))
                return (o.float() * w[..., None]).to(o.dtype)
            fs(q, k, v)
            fwd, bwd = time_autograd(fs, q, k, v, g, params=(sinks,))
            record("flex+rescale", "sinks", "bf16", causal, fwd, bwd, SHAPE,
                   extra=dict(first_call_s=round(time.time() - t0, 1),
                              note="sinks are no score_mod: flex lse + out*sigmoid(lse-sink) "
                                   "in eager torch"))
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            record("flex+rescale", "sinks", "bf16", causal, 0, 0, SHAPE, err=repr(e))
        torch.cuda.empty_cache()


# ----------------------------------------------------------------------------- summary
def summarize():
    rows = [r for r in RESULTS["bench"] if "total_ms" in r]

    def get(impl, variant, dt, causal):
        xs = [r for r in rows if (r["impl"], r["variant"], r["dtype"], r["causal"]) ==
              (impl, variant, dt, causal)]
        return xs[-1]["total_ms"] if xs else None

    summ = {}
    for causal in (False, True):
        c = "causal" if causal else "noncausal"
        base = get("anyattn-triton", "plain", "bf16", causal)
        for variant, target in (("plain", None), ("softcap", 1.10), ("alibi", 1.10),
                                ("sinks", 1.05), ("all", None)):
            t = get("anyattn-triton", variant, "bf16", causal)
            if base and t:
                r = dict(ms=t, plain_ms=base, over_plain=round(t / base - 1, 4))
                if target is not None:
                    r["target_over_plain"] = round(target - 1, 2)
                    r["meets_overhead"] = t / base <= target
                fx = get("flex", variant, "bf16", causal) or \
                    get("flex+rescale", variant, "bf16", causal)
                if fx:
                    r["flex_ms"] = fx
                    r["vs_flex"] = round(t / fx, 3)
                    if variant in ("softcap", "alibi"):
                        r["meets_flex"] = t <= fx
                summ[f"bf16_{variant}_{c}"] = r
        o32 = get("anyattn-triton", "plain", "fp32", causal)
        s32 = get("sdpa-efficient", "plain", "fp32", causal)
        if o32 and s32:
            summ[f"fp32_plain_{c}"] = dict(ours_ms=o32, sdpa_eff_ms=s32,
                                          speedup=round(s32 / o32, 3),
                                          meets_2x=s32 / o32 >= 2.0)
        a32 = get("anyattn-triton", "alibi", "fp32", causal) or \
            get("anyattn-triton", "all", "fp32", causal)
        sa = get("sdpa-efficient", "alibi(dense bias)", "fp32", causal)
        if a32 and sa:
            summ[f"fp32_all_vs_sdpa_alibi_bias_{c}"] = dict(ours_all_ms=a32, sdpa_alibi_ms=sa,
                                                           speedup=round(sa / a32, 3))
    RESULTS["summary"] = summ
    return summ


# ----------------------------------------------------------------------------- plot
def plot(json_path, png_path=None):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(json_path) as fh:
        res = json.load(fh)
    rows = [r for r in res["bench"] if "total_ms" in r]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8))
    for ax, causal in zip(axes[:2], (False, True)):
        variants = ["plain", "softcap", "alibi", "sinks", "all"]
        ours = [next((r["total_ms"] for r in rows if r["impl"] == "anyattn-triton" and
                      r["variant"] == vv and r["dtype"] == "bf16" and r["causal"] == causal), 0)
                for vv in variants]
        flex = [next((r["total_ms"] for r in rows if r["impl"] in ("flex", "flex+rescale") and
                      r["variant"] == vv and r["dtype"] == "bf16" and r["causal"] == causal), 0)
                for vv in variants]
        x = list(range(len(variants)))
        ax.bar([i - 0.2 for i in x], ours, 0.4, label="anyattn triton")
        ax.bar([i + 0.2 for i in x], flex, 0.4, label="FlexAttention (sinks: + rescale)")
        for i, (a, b) in enumerate(zip(ours, flex)):
            if a:
                ax.text(i - 0.2, a, f"{a:.2f}", ha="center", va="bottom", fontsize=7)
            if b:
                ax.text(i + 0.2, b, f"{b:.2f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(x)
        ax.set_xticklabels(variants)
        ax.set_ylabel("fwd + bwd ms (median)")
        ax.set_title(f"bf16 B=4 H=16 S=4096 D=128, {'causal' if causal else 'non-causal'}")
        ax.legend(fontsize=8)
    ax = axes[2]
    labels, vals = [], []
    for impl, variant in (("anyattn-triton", "plain"), ("anyattn-triton", "softcap"),
                          ("anyattn-triton", "all"), ("sdpa-efficient", "plain"),
                          ("sdpa-efficient", "alibi(dense bias)")):
        for causal in (False, True):
            t = next((r["total_ms"] for r in rows if r["impl"] == impl and r["variant"] == variant
                      and r["dtype"] == "fp32" and r["causal"] == causal), None)
            if t:
                labels.append(f"{'ours' if impl.startswith('any') else 'sdpa-eff'} {variant}"
                              f"{' C' if causal else ''}")
                vals.append(t)
    ax.barh(range(len(vals)), vals, color="tab:green")
    ax.set_yticks(range(len(vals)))
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_xlabel("fwd + bwd ms (median)")
    ax.set_title("fp32 (highest), same shape (C: causal)")
    fig.suptitle(f"Score modifiers, {res['meta'].get('device', '?')}, "
                 f"{res['meta'].get('date', '')}")
    fig.tight_layout()
    png_path = png_path or os.path.splitext(json_path)[0] + ".png"
    fig.savefig(png_path, dpi=110)
    return png_path


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--phases", default="check,ours,fp32,flex")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--name", default="modifiers_bench.json")
    ap.add_argument("--plot", default="", help="a JSON written by this script: draw its PNG")
    ap.add_argument("--tiny", action="store_true", help="dry run on CPU (TRITON_INTERPRET=1)")
    a = ap.parse_args()
    if a.plot:
        log(plot(a.plot))
        return
    global TINY, DEV, SHAPE
    if a.tiny:
        os.environ["TRITON_INTERPRET"] = "1"
        TINY, DEV, SHAPE = True, "cpu", (1, 2, 48, 16)
    H.tiny, H.dev = TINY, DEV
    H.meta(shape="B=4 H=16 S=4096 D=128", softcap_timing=CAP, phases=a.phases)
    H.run_phases({"check": phase_check, "ours": phase_ours, "fp32": phase_fp32,
                  "fp32ours": lambda: phase_ours("fp32", variants=("plain", "softcap", "all")),
                  "flex": phase_flex}, a.phases.split(","), a.out, a.name, summarize)


if __name__ == "__main__":
    main()
