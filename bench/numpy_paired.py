"""Shared timing of the NumPy feature benches (numpy_dropout_bench, numpy_modifiers_bench):
one training step, variants interleaved round after round, ratios to "plain" as medians
of paired rounds, and what machine the numbers come from.

Shape legend: B batch, H heads, S = Sq = Sk tokens, D head dim.

Interleaving makes load from other processes on a shared machine hit every variant
alike; the median over rounds of (variant / plain in the same round) cancels drifting
load better than a ratio of medians (also reported).
"""
from __future__ import annotations

import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
import anyattn as aa  # noqa: E402
from anyattn.api import forward_with_stats  # noqa: E402
from anyattn.backends.numpy_backend import available_cpus  # noqa: E402
from anyattn.backends.registry import get_backend  # noqa: E402
from anyattn.bench import machine_info  # noqa: E402

__all__ = ["machine", "paired_rounds", "step"]


def machine() -> dict:
    """anyattn.bench.machine_info plus the cores this process may use and the NumPy
    backend's default worker count."""
    info = machine_info()
    info["usable_cpus"] = available_cpus()
    info["numpy_default_threads"] = get_backend("numpy").config.n_threads()
    return info


def step(q, k, v, g, mask, kw):
    """-> (forward seconds, backward seconds) of one training step: forward_with_stats,
    then attention_backward(out=, lse=stats) wrt q, k, v (and sinks where given)."""
    t0 = time.perf_counter()
    out, st = forward_with_stats(q, k, v, mask=mask, backend="numpy", **kw)
    t1 = time.perf_counter()
    wrt = ("q", "k", "v") + (("sinks",) if "sinks" in kw else ())
    aa.attention_backward(q, k, v, g, out=out, lse=st, mask=mask, wrt=wrt, backend="numpy",
                          **kw)
    return t1 - t0, time.perf_counter() - t1


def _iqr(xs):
    return [float(np.percentile(xs, 25)), float(np.percentile(xs, 75))]


def paired_rounds(qkvg, variants, kws, *, threads, mask_name, reps, flops=None):
    """Time every variant (kws[name] = its keyword arguments; variants[0] is the
    baseline, "plain") in `reps` interleaved rounds with `threads` NumPy workers, causal
    or no mask.  -> one result row per variant (medians, paired ratios with IQR, every
    step's time; GFLOP/s of the step where `flops` is given), printed as it goes."""
    q, k, v, g = qkvg
    be = get_backend("numpy")
    config0 = be.config
    be.config = replace(config0, threads=threads)
    try:
        mask = aa.Causal() if mask_name == "causal" else None
        for vn in variants:                                      # warm-up
            step(q, k, v, g, mask, kws[vn])
        times = {vn: [] for vn in variants}
        for r in range(reps):
            order = variants if r % 2 == 0 else variants[::-1]  # no fixed position
            for vn in order:
                times[vn].append(step(q, k, v, g, mask, kws[vn]))
    finally:
        be.config = config0
    base = variants[0]
    med = {vn: {"fwd": statistics.median(t[0] for t in ts),
                "bwd": statistics.median(t[1] for t in ts),
                "step": statistics.median(t[0] + t[1] for t in ts),
                "step_min": min(t[0] + t[1] for t in ts)} for vn, ts in times.items()}
    rows = []
    for vn in variants:
        m, pl = med[vn], times[base]
        paired = [(a[0] + a[1]) / (b[0] + b[1]) for a, b in zip(times[vn], pl)]
        row = {"threads": threads, "mask": mask_name, "variant": vn,
               "fwd_s": m["fwd"], "bwd_s": m["bwd"],
               "step_s": m["step"], "step_min_s": m["step_min"],
               "ratio_step": statistics.median(paired), "ratio_step_q1_q3": _iqr(paired),
               "ratio_fwd": statistics.median(a[0] / b[0] for a, b in zip(times[vn], pl)),
               "ratio_bwd": statistics.median(a[1] / b[1] for a, b in zip(times[vn], pl)),
               "ratio_step_of_medians": m["step"] / med[base]["step"],
               "ratio_step_min": m["step_min"] / med[base]["step_min"],
               "all_steps_s": [t[0] + t[1] for t in times[vn]]}
        if flops is not None:
            row["gflops_step"] = flops / m["step"] / 1e9
        rows.append(row)
        print(f"{threads}t {mask_name:7s} {vn:8s} fwd {m['fwd']*1e3:8.1f} ms  "
              f"bwd {m['bwd']*1e3:8.1f} ms  step {m['step']*1e3:8.1f} ms  "
              f"x{row['ratio_step']:.3f} (IQR {row['ratio_step_q1_q3'][0]:.3f}-"
              f"{row['ratio_step_q1_q3'][1]:.3f}, medians x"
              f"{row['ratio_step_of_medians']:.3f}, min x{row['ratio_step_min']:.3f})"
              f"  fwd x{row['ratio_fwd']:.3f}  bwd x{row['ratio_bwd']:.3f}", flush=True)
    return rows
