"""Sliding-window and document masks: anyattn vs FlexAttention (vs SDPA-cuDNN) on one GPU.

Shape legend: B batch, H heads, S sequence (Sq = Sk), D head dim.

Each case (mask x S x D) is timed through the path a user takes, side by side in one
process: ``anyattn.torch.attention`` (torch autograd), FlexAttention
(``torch.compile(flex_attention)``, its block mask built once outside the timing) and,
where a boolean mask is accepted, SDPA on the cuDNN backend (a dense [S, S] mask: it
cannot skip masked tiles, so it is an upper reference, not a like-for-like one).  Times:
forward, backward alone (autograd.grad on a retained graph) and forward + backward,
medians of ``triton.testing.do_bench``.

Masks: causal sliding windows ``j <= i, i - j <= w`` (w = 256, 512, 1024), documents of
equal 512-token length and of random lengths (uniform random cuts, S / 512 documents),
each bidirectional and causal within the document; the document ids are one [S] row
shared by the batch.

FLOPs count only the kept score entries (as FlexAttention's own numbers do): forward
4 * D * kept, backward 2.5x that, kept = sum over (b, h) of the kept (i, j) pairs.

Checks first, on every case: out, dq, dk, dv of one (b, h) slice of both anyattn and
Flex against a float64 torch reference of the same slice (max-abs error relative to the
reference's largest magnitude), and anyattn's fwd + bwd bitwise repeatable.

FlexAttention compiles once per (S, D, mask family): the window, the document ids and
the causal flag of a family are read from tensors inside its mask_mod (updated in
place), so the windows share one compile and the document layouts another.

``--fresh host|device``: a packed-sequence training loop's view of the document masks.
Every anyattn call builds its ``Documents`` mask from a new copy of the ids (on the
host, as a data loader yields them, or on the GPU), so its tile lists are rebuilt each
call as they are each step of such a loop; Flex rebuilds its block mask each call
(``create_block_mask`` with its defaults), as its users do when the documents change.
Window masks and the KeepMask case are unaffected.

Usage: python3 bench/gpu_masks_vs_flex.py --out DIR [--budget 90] [--variants a,b]
       python3 bench/gpu_masks_vs_flex.py --tiny        (CPU dry run, no timing)
"""
from __future__ import annotations

import argparse
import json
import math
import os
import gc
import platform
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import anyattn as aa  # noqa: E402
import anyattn.torch as at  # noqa: E402

#: masks in priority order (the issue's two first), then shapes; a run stops adding cases
#: when its budget is spent
MASKS = ("sliding:512", "doc_rand_causal", "doc_eq512", "sliding:256", "sliding:1024",
         "doc_eq512_causal", "doc_rand")
SHAPES = ((4096, 128), (4096, 64), (8192, 128), (8192, 64))
#: masks run only when named: the random causal documents as a dense KeepMask
#: [1, 1, S, S] (anyattn's KeepMask path; Flex gets the same documents as its mask_mod)
EXTRA_MASKS = ("keep_doc_rand_causal",)

# ---------------------------------------------------------------- FlexAttention's masks
# mask_mod data, updated in place between cases (one compiled graph per family and shape)
_FX: dict = {}


def _sw_mod(b, h, q, k):
    return (q >= k) & (q - k <= _FX["win"])


def _doc_mod(b, h, q, k):
    return (_FX["doc"][q] == _FX["doc"][k]) & ((q >= k) | _FX["bidir"])


def log(*a):
    print(*a, flush=True)


def doc_ids(kind: str, S: int, gen: torch.Generator, dev) -> torch.Tensor:
    """int32 [S] sorted document ids."""
    if kind.startswith("doc_eq512"):
        return (torch.arange(S, device=dev) // 512).to(torch.int32)
    n = max(2, S // 512)
    cuts = torch.randperm(S - 1, generator=gen)[: n - 1] + 1          # distinct, in [1, S)
    starts = torch.zeros(S, dtype=torch.int32)
    starts[cuts] = 1
    return torch.cumsum(starts, 0).to(torch.int32).to(dev)


def case_mask(kind: str, S: int, gen, dev):
    """-> (anyattn mask, dense keep bool [S, S], flex family, flex data dict)."""
    i = torch.arange(S, device=dev)[:, None]
    j = torch.arange(S, device=dev)[None, :]
    if kind.startswith("sliding"):
        w = int(kind.split(":")[1])
        keep = (j <= i) & (i - j <= w)
        return (aa.Causal() & aa.Window(left=w), keep, "sw",
                {"win": torch.tensor(w, device=dev)})
    as_keep = kind.startswith("keep_")
    kind = kind[len("keep_"):] if as_keep else kind
    ids = doc_ids(kind, S, gen, dev)
    causal = kind.endswith("causal")
    keep = ids[:, None] == ids[None, :]
    mask = aa.Documents(ids)
    if causal:
        keep = keep & (j <= i)
        mask = aa.Causal() & mask
    if as_keep:
        mask = aa.KeepMask(keep[None, None])
    return mask, keep, "doc", {"doc": ids, "bidir": torch.tensor(not causal, device=dev)}


def _fresh_masks(ids, causal: bool, where):
    """-> a function giving a new Documents mask (Causal within documents if ``causal``)
    on a new copy of ``ids`` on ``where`` at every call: new tensors, as each step of a
    packed-sequence loop brings."""
    src = ids.detach().to(where)         # once; each call clones it where it lives

    def make():
        m = aa.Documents(src.clone())
        return aa.Causal() & m if causal else m
    return make


# ---------------------------------------------------------------- reference and checks
def ref64(q, k, v, g, keep):
    """float64 out, dq, dk, dv of q/k/v/g [n, S, D] under keep [S, S] (empty rows -> 0)."""
    qd, kd, vd, gd = (x.double().requires_grad_(x is not g) for x in (q, k, v, g))
    s = (qd @ kd.transpose(-1, -2)) * q.shape[-1] ** -0.5
    s = s.masked_fill(~keep, float("-inf"))
    m = s.amax(-1, keepdim=True).clamp_min(-1e300)
    p = torch.exp(s - m)
    den = p.sum(-1, keepdim=True)
    p = torch.where(den > 0, p / den.clamp_min(1e-300), 0.0)
    out = p @ vd
    dq, dk, dv = torch.autograd.grad(out, (qd, kd, vd), gd)
    return out, dq, dk, dv


def rel(got, ref):
    got, ref = got.detach().double(), ref.detach().double()
    if bool(torch.isnan(got).any()):
        return float("nan")
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-300))


def fwd_bwd(fn, q, k, v, g):
    qq, kk, vv = (x.detach().clone().requires_grad_(True) for x in (q, k, v))
    out = fn(qq, kk, vv)
    dq, dk, dv = torch.autograd.grad(out, (qq, kk, vv), g)
    return out, dq, dk, dv


# ---------------------------------------------------------------- timing
def bench_ms(fn, tiny, rep=25):
    if tiny:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e3
    import triton.testing

    return triton.testing.do_bench(fn, warmup=5, rep=rep, return_mode="median")


def split_ms(fn, tiny, n=20, rounds=3):
    """-> (GPU ms, host ms) per call of fn, medians of ``rounds``: the host time of
    enqueuing n calls, and the device time of n calls queued behind a sleep kernel long
    enough that the host is done enqueuing before the first one starts (so no host gap
    is timed)."""
    if tiny:
        return 0.0, 0.0
    fn()
    gpu, host = [], []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        host.append((time.perf_counter() - t0) / n)
        torch.cuda.synchronize()
        torch.cuda._sleep(int((2 * host[-1] * n + 2e-3) * 2.0e9))      # ~2 GHz SM clock
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(n):
            fn()
        e.record()
        torch.cuda.synchronize()
        gpu.append(s.elapsed_time(e) / n)
    return statistics.median(gpu), statistics.median(host) * 1e3


def time_impl(fn, q, k, v, g, tiny):
    """-> dict fwd / bwd / fwdbwd ms of fn(q, k, v) through torch autograd (do_bench),
    and the GPU-only / host-only ms of fwd and fwdbwd (split_ms)."""
    qq, kk, vv = (x.detach().requires_grad_(True) for x in (q, k, v))
    gc.collect()          # no collection of the compilers' garbage inside the timing

    def fwd_only():
        with torch.no_grad():
            fn(q, k, v)

    fwd = bench_ms(fwd_only, tiny)
    out = fn(qq, kk, vv)
    bwd = bench_ms(lambda: torch.autograd.grad(out, (qq, kk, vv), g, retain_graph=True), tiny)

    def step():
        o = fn(qq, kk, vv)
        torch.autograd.grad(o, (qq, kk, vv), g)

    both = bench_ms(step, tiny)
    fg, fh = split_ms(fwd_only, tiny)
    sg, sh = split_ms(step, tiny)
    return {"fwd": round(fwd, 4), "bwd": round(bwd, 4), "fwdbwd": round(both, 4),
            "fwd_gpu": round(fg, 4), "fwd_host": round(fh, 4),
            "fwdbwd_gpu": round(sg, 4), "fwdbwd_host": round(sh, 4)}


# ---------------------------------------------------------------- the run
def run(args):
    tiny = args.tiny
    dev = "cpu" if tiny else "cuda"
    dtype = torch.float32 if tiny else torch.bfloat16
    B, H = (1, 2) if tiny else (args.batch, args.heads)
    shapes = ((256, 32),) if tiny else tuple(
        tuple(int(x) for x in sd.split("x")) for sd in args.shapes.split(","))
    kinds = [m for m in args.masks.split(",") if m]
    for m in kinds:
        if not (m in MASKS or m in EXTRA_MASKS
                or (m.startswith("sliding:") and m[8:].isdigit())):
            raise ValueError(f"--masks: unknown mask {m!r}; expected sliding:W or one of "
                             f"{[x for x in MASKS if x.startswith('doc')]}")
    if tiny:   # windows that fit S = 256
        kinds = [("sliding:" + str(int(m.split(":")[1]) // 8)) if m.startswith("sliding")
                 else m for m in kinds]
    t_start = time.perf_counter()
    res = {"meta": dict(
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), B=B, H=H,
        dtype=str(dtype).replace("torch.", ""), torch=torch.__version__,
        python=platform.python_version(),
        flops="kept score entries only (as FlexAttention counts): fwd 4*D*kept, "
              "bwd 2.5x fwd, fwd+bwd 3.5x fwd; kept summed over B*H",
        timing="triton.testing.do_bench median (warmup 5 ms, rep 25 ms; L2 flushed "
               "between calls); fwd under no_grad; bwd = autograd.grad on a retained graph "
               "(torch._functorch.config.donated_buffer = False); fwdbwd = one training "
               "step's forward + autograd.grad; *_gpu / *_host: device time of 20 calls "
               "queued behind a sleep kernel (no host gaps) / host enqueue time per call, "
               "medians of 3 rounds; gc.collect() before each implementation's timing",
        variants=args.variants, budget_s=args.budget, fresh=args.fresh),
        "rows": [], "skipped": []}
    if not tiny:
        import triton

        res["meta"].update(gpu=torch.cuda.get_device_name(), triton=triton.__version__,
                           cudnn=torch.backends.cudnn.version())
    out_json = os.path.join(args.out, "masks-flex.json") if args.out else None

    def save():
        if out_json:
            with open(out_json, "w") as f:
                json.dump(res, f, indent=1)

    from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    from torch.nn.attention import SDPBackend, sdpa_kernel
    import torch.nn.functional as F

    # the bwd column times autograd.grad on a retained graph, which a compiled backward
    # with donated buffers refuses; they only save memory
    import torch._functorch.config as ftc
    ftc.donated_buffer = False
    # one compiled graph per (S, D, family, grad mode): 16 for the default cases, past
    # dynamo's default limit of 8 (beyond it Flex would silently run uncompiled)
    import torch._dynamo.config as dcfg
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(dcfg, name):
            setattr(dcfg, name, max(64, getattr(dcfg, name)))
    flex = flex_attention if tiny else torch.compile(flex_attention, dynamic=False)
    variants = [None if v == "default" else v
                for v in (args.variants or "").split(",") if v] or [None]   # default: as shipped
    gen = torch.Generator().manual_seed(0)
    for S, D in shapes:
        for kind in kinds:
            if time.perf_counter() - t_start > args.budget:
                res["skipped"].append(f"S={S} D={D} {kind}")
                continue
            row = dict(S=S, D=D, mask=kind)
            try:
                t0 = time.perf_counter()
                mask, keep, fam, data = case_mask(kind, S, gen, dev)
                kept = int(keep.sum()) * B * H
                row.update(density=round(kept / (B * H * S * S), 5),
                           fwd_gflop=round(4 * D * kept / 1e9, 3))
                q, k, v, g = (torch.randn(B, H, S, D, device=dev, dtype=dtype)
                              for _ in range(4))
                for name, val in data.items():        # flex mask data, updated in place
                    if name in _FX and _FX[name].shape == val.shape:
                        _FX[name].copy_(val)
                    else:
                        _FX[name] = val.clone()
                mod = _sw_mod if fam == "sw" else _doc_mod
                bm = create_block_mask(mod, None, None, S, S, device=dev)
                fresh = "none" if fam != "doc" or kind.startswith("keep_") else args.fresh
                row["fresh"] = fresh
                mask_of = (lambda m=mask: m) if fresh == "none" else _fresh_masks(
                    data["doc"], kind.endswith("causal"), "cpu" if fresh == "host" else dev)
                impls = {}
                for var in variants:
                    nm = "anyattn" if var is None else f"anyattn[{var}]"
                    impls[nm] = (lambda q_, k_, v_: at.attention(q_, k_, v_, mask=mask_of()),
                                 var)
                if tiny:   # Flex has no CPU backward: a dense-mask stand-in for the dry run
                    impls["flex"] = (lambda q_, k_, v_, km=keep: F.scaled_dot_product_attention(
                        q_, k_, v_, attn_mask=km), None)
                elif fresh != "none":     # a new block mask per call, as for new documents
                    impls["flex"] = (lambda q_, k_, v_, mod=mod: flex(
                        q_, k_, v_, block_mask=create_block_mask(mod, None, None, S, S,
                                                                 device=dev)), None)
                else:
                    impls["flex"] = (lambda q_, k_, v_: flex(q_, k_, v_, block_mask=bm), None)
                # checks: one (b, h) slice vs float64; anyattn bitwise repeatable
                r64 = ref64(q[:1, :1, :, :], k[:1, :1], v[:1, :1], g[:1, :1], keep)
                row["err"] = {}
                for nm, (fn, var) in impls.items():
                    _set_variant(var)
                    got = fwd_bwd(fn, q, k, v, g)
                    row["err"][nm] = {n: float(f"{rel(x[:1, :1], r):.3g}") for n, x, r in
                                      zip(("out", "dq", "dk", "dv"), got, r64)}
                    if nm.startswith("anyattn"):
                        again = fwd_bwd(fn, q, k, v, g)
                        row.setdefault("bitwise", {})[nm] = all(
                            torch.equal(a, b_) for a, b_ in zip(got, again))
                    del got
                    with torch.no_grad():   # compile the no-grad forward here, not in timing
                        fn(q, k, v)
                _set_variant(None)
                row["check_s"] = round(time.perf_counter() - t0, 1)
                # timing
                row["ms"] = {}
                names = list(impls)
                reps = {nm: [] for nm in names}
                for rep in range(max(1, args.repeat)):   # rotating order: rep r starts at r
                    for nm in names[rep % len(names):] + names[:rep % len(names)]:
                        fn, var = impls[nm]
                        _set_variant(var)
                        reps[nm].append(time_impl(fn, q, k, v, g, tiny))
                    _set_variant(None)
                for nm in names:
                    row["ms"][nm] = {key: statistics.median(r[key] for r in reps[nm])
                                     for key in reps[nm][0]}
                if args.repeat > 1:
                    row["ms_reps"] = reps
                if not tiny and S == 4096 and D == 128 and args.cudnn and kind == "sliding:512":
                    km = keep[None, None]
                    try:
                        def cud(q_, k_, v_):
                            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                                return F.scaled_dot_product_attention(q_, k_, v_, attn_mask=km)
                        row["ms"]["sdpa_cudnn_dense_mask"] = time_impl(cud, q, k, v, g, tiny)
                    except Exception as e:  # noqa: BLE001 - refused: recorded
                        row["ms"]["sdpa_cudnn_dense_mask"] = {"error": str(e)[:160]}
                fl = row["fwd_gflop"]
                row["tflops"] = {nm: {p: round(fl * mul / t, 1) for p, mul, t in
                                      (("fwd", 1, m["fwd"]), ("bwd", 2.5, m["bwd"]),
                                       ("fwdbwd", 3.5, m["fwdbwd"]))}
                                 for nm, m in row["ms"].items() if "fwd" in m}
                row["vs_flex"] = {nm: {p: round(m[p] / max(row["ms"]["flex"][p], 1e-9), 3)
                                       for p in ("fwd", "bwd", "fwdbwd", "fwd_gpu",
                                                 "fwdbwd_gpu")}
                                  for nm, m in row["ms"].items()
                                  if nm.startswith("anyattn")}
                row["case_s"] = round(time.perf_counter() - t0, 1)
                del q, k, v, g, keep, r64
            except Exception as e:  # noqa: BLE001 - one failing case is recorded
                row["error"] = f"{type(e).__name__}: {e}"[:300]
                traceback.print_exc()
            res["rows"].append(row)
            log(summary_line(row))
            save()
            if not tiny:
                torch.cuda.empty_cache()
    res["meta"]["wall_s"] = round(time.perf_counter() - t_start, 1)
    save()
    if args.out and not args.no_plot:
        try:
            plot(res, os.path.join(args.out, "masks-flex.png"))
        except Exception as e:  # noqa: BLE001
            log("plot failed:", e)
    return res


_COV0 = None     # hopper/coverage.py's forward row as imported (the variants' base)
_BCOV0 = None    # ... and its backward row
_BWD_ARRAYS0 = None   # hopper/configs.py's _BWD_ARRAYS as imported

#: the array-mask classes (Documents / KeepMask)
_ARRAY_CLASSES = frozenset({"documents", "band+documents", "keep", "band+keep",
                            "documents+keep", "band+documents+keep"})


def _set_variant(var):
    """A named anyattn variant (bench A/B), '+'-joined tokens: 'lists' / 'ranges' (the
    triton launcher's mask lowering, launch.set_mask_lowering), 'fwdBMxBN' (the
    portable forward's tiles for bf16, e.g. fwd128x64) and 'hopfwd' / 'portfwd'
    (Documents / KeepMask forwards routed to the Hopper forward / kept portable:
    hopper/coverage.py's auto_mask_classes), 'hopbwd' / 'hopbwdkv' / 'portbwd' (their
    backwards routed to the Hopper backward with dQ inside, to its ws dK/dV kernel + the
    portable dQ (configs.bwd_config_dkdv_only), or kept portable); None restores the
    defaults."""
    import dataclasses

    from anyattn.backends.triton import configs as C
    from anyattn.backends.triton import launch
    from anyattn.backends.triton.hopper import coverage as HCOV

    from anyattn.backends.triton.hopper import configs as HCF

    global _COV0, _BCOV0, _BWD_ARRAYS0
    if _COV0 is None:
        _COV0 = HCOV.COVERAGE["forward"]
        _BCOV0 = HCOV.COVERAGE["backward"]
        _BWD_ARRAYS0 = HCF._BWD_ARRAYS
    HCOV.COVERAGE["forward"] = _COV0
    HCOV.COVERAGE["backward"] = _BCOV0
    HCF._BWD_ARRAYS = _BWD_ARRAYS0

    setter = getattr(launch, "set_mask_lowering", None)
    lowering, fields = None, {}
    for tok in (var or "").split("+"):
        if not tok:
            continue
        if tok in ("hopfwd", "portfwd"):
            routed = (_COV0.mask_classes if tok == "hopfwd"
                      else _COV0.auto_mask_classes - {"documents", "band+documents",
                                                      "keep", "band+keep", "documents+keep",
                                                      "band+documents+keep"})
            HCOV.COVERAGE["forward"] = dataclasses.replace(_COV0, auto_mask_classes=routed)
        elif tok in ("hopbwd", "hopbwdkv", "portbwd"):
            base = _BCOV0.auto_classes(128) or _BCOV0.mask_classes
            routed = (base | (_BCOV0.mask_classes & _ARRAY_CLASSES) if tok != "portbwd"
                      else base - _ARRAY_CLASSES)
            HCOV.COVERAGE["backward"] = dataclasses.replace(_BCOV0, auto_mask_classes=routed)
            if tok == "hopbwdkv":
                HCF._BWD_ARRAYS = HCF.bwd_config_dkdv_only(128)
        elif tok.startswith("fwd") and "x" in tok:
            bm, bn = (int(x) for x in tok[3:].split("x"))
            fields["fwd"] = C.KernelConfig(bm, bn, 8, 3)
        elif tok in ("lists", "ranges"):
            lowering = tok
        else:
            raise ValueError(f"variant token {tok!r}: expected lists, ranges, fwdBMxBN, "
                             "hopfwd, portfwd, hopbwd, hopbwdkv or portbwd")
    if setter is None and lowering is not None:
        raise ValueError(f"variant {var!r}: this tree has no launch.set_mask_lowering")
    if setter is not None:
        setter(lowering)
    for dp in (64, 128):
        C.set_override(dp, "bfloat16", "highest", **fields)
    launch.clear_caches()


def summary_line(row):
    if "error" in row:
        return f"S={row['S']} D={row['D']} {row['mask']:18s} ERROR {row['error']}"
    parts = [f"S={row['S']} D={row['D']} {row['mask']:18s} dens {row['density']:.3f}"]
    for nm, m in row["ms"].items():
        if "fwd" in m:
            parts.append(f"{nm} {m['fwd']:.3f}/{m['bwd']:.3f}/{m['fwdbwd']:.3f}")
    for nm, r in row.get("vs_flex", {}).items():
        parts.append(f"{nm}/flex {r['fwd']:.2f}/{r['bwd']:.2f}/{r['fwdbwd']:.2f}")
    for nm, m in row["ms"].items():
        if "fwd_gpu" in m:
            parts.append(f"{nm} gpu {m['fwd_gpu']:.3f}/{m['fwdbwd_gpu']:.3f} "
                         f"host {m['fwd_host']:.3f}/{m['fwdbwd_host']:.3f}")
    errs = max(v for e in row["err"].values() for v in e.values())
    parts.append(f"maxerr {errs:.1e} bitwise {all(row.get('bitwise', {}).values())}")
    return " | ".join(parts)


def plot(res, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in res["rows"] if "vs_flex" in r]
    if not rows:
        return
    shapes = sorted({(r["S"], r["D"]) for r in rows}, key=lambda x: (x[1], x[0]), reverse=True)
    fig, axes = plt.subplots(1, len(shapes), figsize=(5.5 * len(shapes), 4.2), squeeze=False)
    for ax, (S, D) in zip(axes[0], shapes):
        rs = [r for r in rows if (r["S"], r["D"]) == (S, D)]
        names = sorted({n for r in rs for n in r["vs_flex"]})
        parts = [p for p in ("fwd", "bwd", "fwdbwd", "fwd_gpu", "fwdbwd_gpu")
                 if any(p in r["vs_flex"].get(nm, {}) for r in rs for nm in names)]
        x = range(len(rs))
        width = 0.8 / (len(parts) * len(names))
        for ni, nm in enumerate(names):
            for pi, p in enumerate(parts):
                off = (ni * len(parts) + pi) * width - 0.4 + width / 2
                ax.bar([i + off for i in x], [r["vs_flex"].get(nm, {}).get(p, math.nan)
                                               for r in rs], width,
                       label=f"{nm} {p}" if ax is axes[0][0] else None)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(list(x))
        ax.set_xticklabels([r["mask"].replace("doc_", "") for r in rs], rotation=35,
                           ha="right", fontsize=8)
        ax.set_title(f"S={S} D={D} B={res['meta']['B']} H={res['meta']['H']} bf16")
        ax.set_ylabel("time / FlexAttention's time (< 1: faster)")
        ax.set_xlabel("*_gpu: device time only (calls queued behind a sleep kernel)",
                      fontsize=7)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"anyattn.torch vs FlexAttention, {res['meta'].get('gpu', 'cpu')}, "
                 f"{res['meta']['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--budget", type=float, default=90.0,
                    help="seconds after which no further case starts")
    ap.add_argument("--masks", default=",".join(MASKS),
                    help="comma-separated, in the order run (sliding:W, doc_eq512[_causal], "
                         "doc_rand[_causal])")
    ap.add_argument("--shapes", default=",".join(f"{s_}x{d_}" for s_, d_ in SHAPES),
                    help="comma-separated SxD, in the order run")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--variants", default="",
                    help="comma-separated launch.set_mask_lowering names timed side by side")
    ap.add_argument("--repeat", type=int, default=1,
                    help="time every implementation this many times in rotating order "
                         "(medians reported, each pass kept in ms_reps)")
    ap.add_argument("--fresh", choices=("none", "host", "device"), default="none",
                    help="document masks: a new mask on new ids (host or GPU copies) at "
                         "every anyattn call, a new block mask at every Flex call")
    ap.add_argument("--no-cudnn", dest="cudnn", action="store_false")
    ap.add_argument("--no-plot", action="store_true")
    ap.add_argument("--tiny", action="store_true", help="CPU dry run (numpy backend, eager Flex)")
    ap.add_argument("--plot-only", default=None, help="re-plot a JSON to --out/masks-flex.png")
    args = ap.parse_args()
    if args.plot_only:
        with open(args.plot_only) as f:
            plot(json.load(f), args.out)
        return
    if args.out:
        os.makedirs(args.out, exist_ok=True)
    run(args)


if __name__ == "__main__":
    main()
