"""GPU benchmark of the score modifiers inside the Hopper kernels (softcap, ALiBi, sinks):
per modifier, the routed Hopper kernels with it (ANYATTN_TRITON_PATH=hopper) against the
same kernels without it and against the portable kernels with it.

    PYTHONUNBUFFERED=1 python bench/gpu_hopper_mods_bench.py --out $OUT

Shape: B=4 H=16 S=4096 D=128 bf16, no mask and causal.  Rows (impl, variant):
  hopper / plain        the Hopper kernels, no modifier (the baseline)
  hopper / <modifier>   the Hopper kernels with softcap (cap 50), ALiBi (per-head slopes
                        2^(-8 (h + 1) / H)) or sinks (N(0, 1) per head, with dsinks)
  portable / <modifier> the portable kernels (ANYATTN_TRITON_PATH=portable) with it
Forward: aa.attention; backward: aa.attention_backward given out and lse (the delta
preprocess and the kernels, every gradient incl. dsinks); triton.testing.do_bench
medians (CUDA events), one process.  Before timing, every configuration runs once at
B=1 in a pool of processes, so that the kernels compile in parallel into Triton's cache
(the whole run stays within ~2 minutes on an H100).  Each hopper row also records the
relative difference of its out / dq / dk / dv / dsinks from the portable row's (both
against each other, not float64: tests/triton/test_hopper_mods.py checks float64).
Summary: per (variant, causal) the time over hopper / plain (forward, backward, both)
for hopper and portable, and whether the backward meets the target (softcap <= +10 %,
ALiBi <= +5 %, sinks <= +3 %).  TFLOP/s by the FlashAttention convention (fwd
4*B*H*S*S*D, bwd 2.5x, causal 1/2).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))

from gpu_harness import Harness, log, rel  # noqa: E402

SHAPE = (4, 16, 4096, 128)            # B, H, S, D
CAP = 50.0
VARIANTS = ("softcap", "alibi", "sinks")
#: backward time over the plain Hopper backward, at most
TARGETS = {"softcap": 1.10, "alibi": 1.05, "sinks": 1.03}
RESULTS = {"meta": {}, "check": [], "bench": [], "summary": {}}
H = Harness(RESULTS)


def mods_of(variant, heads, dev, seed=0):
    """variant in plain / softcap / alibi / sinks -> anyattn keyword arguments."""
    import torch

    gen = torch.Generator(device=dev).manual_seed(seed)
    if variant == "softcap":
        return dict(softcap=CAP)
    if variant == "alibi":
        return dict(alibi_slopes=torch.tensor([2.0 ** (-8.0 * (h + 1) / heads)
                                               for h in range(heads)], device=dev))
    if variant == "sinks":
        return dict(sinks=torch.randn(heads, generator=gen, device=dev))
    return {}


def _run(path, variant, causal, batch, dev="cuda", seed=0):
    """One configuration's forward and backward (ANYATTN_TRITON_PATH=path) on fresh
    inputs of SHAPE with ``batch`` -> (q, k, v, g, kw, mask, out, lse, grads)."""
    import torch

    import anyattn as aa
    from anyattn.backends.triton import launch as triton_launch

    os.environ["ANYATTN_TRITON_PATH"] = path
    triton_launch.clear_prepared()
    _, heads, s, d = SHAPE
    gen = torch.Generator(device=dev).manual_seed(seed)
    q, k, v, g = (torch.randn(batch, heads, s, d, generator=gen, device=dev)
                  .to(torch.bfloat16) for _ in range(4))
    kw = mods_of(variant, heads, dev, seed)
    mask = aa.Causal() if causal else None
    wrt = ("q", "k", "v") + (("sinks",) if "sinks" in kw else ())
    out, lse = aa.attention(q, k, v, mask=mask, backend="triton", return_lse=True, **kw)
    gr = aa.attention_backward(q, k, v, g, out=out, lse=lse, mask=mask, wrt=wrt,
                               backend="triton", **kw)
    torch.cuda.synchronize()
    return q, k, v, g, kw, mask, wrt, out, lse, gr


def _warm(job):
    """A pool worker: one configuration at B=1 (its kernels compile into the cache)."""
    path, variant, causal = job
    t0 = time.time()
    try:
        _run(path, variant, causal, 1)
        return job, round(time.time() - t0, 1), None
    except Exception as e:  # noqa: BLE001
        return job, round(time.time() - t0, 1), repr(e)[:300]


def configurations():
    """(path, variant, causal) of every row, the baseline first."""
    rows = []
    for causal in (False, True):
        rows.append(("hopper", "plain", causal))
        for variant in VARIANTS:
            rows += [("hopper", variant, causal), ("portable", variant, causal)]
    return rows


def phase_warm(jobs: int):
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    t0 = time.time()
    with ProcessPoolExecutor(jobs, mp_context=mp.get_context("spawn")) as ex:
        for job, sec, err in ex.map(_warm, configurations()):
            log("WARM", job, sec, "s", err or "")
            if err:
                RESULTS["check"].append(dict(case="warm", job=list(job), ok=False, error=err))
    RESULTS["meta"]["warm_s"] = round(time.time() - t0, 1)


def phase_time():
    import torch

    import anyattn as aa

    B, heads, s, d = SHAPE
    ref = {}
    for path, variant, causal in configurations():
        try:
            q, k, v, g, kw, mask, wrt, out, lse, gr = _run(path, variant, causal, B)
            fwd = H.bench_ms(lambda: aa.attention(q, k, v, mask=mask, backend="triton", **kw))
            bwd = H.bench_ms(lambda: aa.attention_backward(
                q, k, v, g, out=out, lse=lse, mask=mask, wrt=wrt, backend="triton", **kw))
            extra = dict(path=path)
            key = (variant, causal)
            res = dict(out=out, dq=gr.dq, dk=gr.dk, dv=gr.dv, dsinks=gr.dsinks)
            if path == "hopper" and variant != "plain":
                ref[key] = res
            elif path == "portable" and key in ref:   # hopper vs portable, both ways ours
                extra["rel_diff_vs_hopper"] = {n: float(f"{rel(ref[key][n], x):.3g}")
                                               for n, x in res.items() if x is not None}
            H.record(path, variant, "bf16", causal, fwd, bwd, SHAPE, extra=extra)
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            H.record(path, variant, "bf16", causal, 0, 0, SHAPE, err=repr(e))
        torch.cuda.empty_cache()
    os.environ["ANYATTN_TRITON_PATH"] = "auto"


def summarize():
    rows = {(r["impl"], r["variant"], r["causal"]): r for r in RESULTS["bench"]
            if "error" not in r}
    summ = {}
    for causal in (False, True):
        base = rows.get(("hopper", "plain", causal))
        if base is None:
            continue
        for variant in VARIANTS:
            entry = {}
            for impl in ("hopper", "portable"):
                r = rows.get((impl, variant, causal))
                if r is None:
                    continue
                entry[impl] = dict(fwd=round(r["fwd_ms"] / base["fwd_ms"], 3),
                                   bwd=round(r["bwd_ms"] / base["bwd_ms"], 3),
                                   total=round(r["total_ms"] / base["total_ms"], 3))
            if "hopper" in entry:
                entry["bwd_target"] = TARGETS[variant]
                entry["bwd_meets_target"] = entry["hopper"]["bwd"] <= TARGETS[variant]
                por = rows.get(("portable", variant, causal), {})
                entry["hopper_vs_portable_rel_diff"] = por.get("rel_diff_vs_hopper")
            summ[f"{variant}_{'causal' if causal else 'nomask'}"] = entry
    RESULTS["summary"] = summ


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="a directory: hopper-mods.json is written there")
    ap.add_argument("--jobs", type=int, default=8, help="processes compiling before timing")
    ap.add_argument("--no-warm", action="store_true", help="compile in the timing process")
    a = ap.parse_args()
    H.meta(shape=dict(zip("BHSD", SHAPE)), cap=CAP, targets=TARGETS)
    phases = {"warm": lambda: phase_warm(a.jobs), "time": phase_time}
    H.run_phases(phases, ([] if a.no_warm else ["warm"]) + ["time"], a.out,
                 "hopper-mods.json", summarize)
    return 0


if __name__ == "__main__":
    sys.exit(main())
