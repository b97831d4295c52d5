"""Where the host time of an ``anyattn.torch`` training step goes, on a GPU machine.

Shape legend: B batch, H heads, S = Sq = Sk, D head dim.

The user path's overhead over the raw backend call (issue 15's "within 5 % at S = 2k")
depends on the host's speed as much as on the library's work: a step is host-bound when
its Python + launch work takes longer than its kernels.  This script measures, in one
process on the machine that runs the kernels:

- ``cpu_calibration``: a fixed pure-Python loop and a fixed torch-CPU op loop (µs), so that
  host times measured on different machines can be compared;
- ``host_per_step``: µs per step of ``module`` (``anyattn.torch.attention`` + backward),
  ``kernel`` (the backend's forward + backward on a prebuilt Problem) and ``autograd``
  (a trivial 3-input ``autograd.Function``, torch's floor) at shapes so small that the GPU
  never limits: N steps back to back, one synchronize, median of rounds;
- ``profile``: cProfile of ``module`` steps at the small shape (the top entries by own
  and by cumulative time), written as text;
- ``gaps``: at a large shape, the GPU's idle time between kernels within a step
  (torch.profiler's CUDA kernel intervals of ``inner`` steps back to back), for
  ``module`` and ``kernel``;
- ``ablation`` (``--ablate``): the same host-per-step and, at the large shape, ms per step
  (CUDA events around ``inner`` steps back to back, rounds in rotating order) of
  ``module`` and ``kernel`` as they are, with autograd's device threads off
  (``torch.autograd.set_multithreading_enabled(False)``: the backward runs on the
  calling thread), to tell which part of the step's host time it accounts for.

    python bench/lab/torch_host_profile.py --out OUT_DIR [--big 4,16,2048,128] [--ablate]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import platform
import pstats
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import torch_module_bench as TMB  # noqa: E402


DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sync():
    TMB.sync(DEV)


def cpu_calibration(rounds: int = 7) -> dict:
    """µs of a fixed pure-Python loop and of 1000 small torch CPU ops (medians)."""
    def py_loop():
        d = {}
        for i in range(20000):
            d[i & 255] = (i * 3) ^ (d.get(i & 255, 0))
        return d

    a = torch.ones(8)

    def torch_ops():
        x = a
        for _ in range(1000):
            x = x.add(1.0)
        return x

    out = {}
    for name, fn in (("python_loop_20k_us", py_loop), ("torch_cpu_1000_adds_us", torch_ops)):
        ts = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            fn()
            ts.append((time.perf_counter() - t0) * 1e6)
        out[name] = statistics.median(ts)
    return out


def steps(shape, causal, dtype, dev):
    """{name: zero-argument step} for one shape: torch_module_bench's ``module`` and
    ``kernel`` steps, and ``autograd`` (torch_module_bench.Trivial, torch's floor)."""
    B, H, S, D = shape
    torch.manual_seed(0)
    q, k, v, g = (torch.randn(B, H, S, D, device=dev, dtype=dtype) for _ in range(4))
    fns, _ = TMB.variants(q, k, v, g, causal, "triton")
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))

    def autograd():
        for x in (qg, kg, vg):
            x.grad = None
        TMB.Trivial.apply(qg, kg, vg).backward(g)

    return {"module": fns["module"], "kernel": fns["kernel"], "autograd": autograd}


def host_per_step(fns, n: int, rounds: int) -> dict:
    """µs per step, N steps back to back and one synchronize (GPU work negligible)."""
    for fn in fns.values():
        for _ in range(5):
            fn()
    _sync()
    res = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            _sync()
            res[name].append((time.perf_counter() - t0) / n * 1e6)
    return {name: {"median_us": statistics.median(v), "min_us": min(v), "rounds_us": v}
            for name, v in res.items()}


def profile_text(fn, n: int, top: int = 45) -> str:
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n):
        fn()
    _sync()
    pr.disable()
    buf = io.StringIO()
    st = pstats.Stats(pr, stream=buf)
    st.sort_stats("tottime").print_stats(top)
    st.sort_stats("cumulative").print_stats(top)
    return buf.getvalue()


def gaps(fn, inner: int) -> dict:
    """GPU idle between the first kernel's start and the last kernel's end of ``inner``
    steps back to back (torch.profiler's CUDA kernel intervals), in µs."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    _sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        host_us = (time.perf_counter() - t0) * 1e6
        _sync()
    ivs = []
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0:
            ivs.append((e.time_range.start, e.time_range.end, e.name))
    ivs.sort()
    if not ivs:
        return {"error": "no CUDA events"}
    busy, cur_s, cur_e, gaps_us = 0.0, ivs[0][0], ivs[0][1], []
    for s, e, _ in ivs[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps_us.append(s - cur_e)
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = ivs[-1][1] - ivs[0][0]
    names = {}
    for s, e, nm in ivs:
        names.setdefault(nm[:80], [0, 0.0])
        names[nm[:80]][0] += 1
        names[nm[:80]][1] += e - s
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)
    return {"span_us": span, "busy_us": busy, "idle_us": span - busy,
            "idle_fraction": (span - busy) / span, "host_issue_us": host_us,
            "largest_gaps_us": sorted(gaps_us, reverse=True)[:12], "n_kernels": len(ivs),
            "kernels": {k: {"count": c, "us": t} for k, (c, t) in names.items()},
            "cpu_table": table}


class _Setting:
    """A step run under one setting: autograd's device threads off, or environment
    variables set (restored after), both around every step."""

    def __init__(self, fn, threads: bool = True, env: dict | None = None):
        self.fn, self.threads, self.step_env = fn, threads, env or {}

    def __call__(self):
        with TMB.set_env(self.step_env), \
                torch.autograd.set_multithreading_enabled(self.threads):
            self.fn()


def _settings(fns) -> dict:
    out = {}
    for name in ("module", "kernel", "autograd"):
        out[name] = _Setting(fns[name])
        out[name + "_one_thread"] = _Setting(fns[name], threads=False)
    return out


def device_ms_per_step(fns, inner: int, rounds: int) -> dict:
    """ms per step: CUDA events around ``inner`` steps back to back (the wall clock in a
    smoke run on the CPU), rounds rotating (torch_module_bench.time_round_robin)."""
    ts = TMB.time_round_robin(fns, DEV, rounds, warmup=3, budget_s=float("inf"),
                              inner=inner)
    return {name: {"median_ms": statistics.median(v) * 1e3, "min_ms": min(v) * 1e3,
                   "rounds_ms": [t * 1e3 for t in v]}
            for name, v in ts.items()}


def ablation(small, big, dtype, dev, args) -> dict:
    res = {}
    for causal in (False, True):
        tag = "causal" if causal else "none"
        hs = host_per_step(_settings(steps(small, causal, dtype, dev)), args.n, args.rounds)
        bg = device_ms_per_step(_settings(steps(big, causal, dtype, dev)), args.inner,
                                args.rounds + 4)
        res[tag] = {"host_per_step_small": hs, "ms_per_step_big": bg}
        print(tag, "host us", {k: round(v["median_us"], 1) for k, v in hs.items()}, flush=True)
        print(tag, "big ms", {k: round(v["median_ms"], 4) for k, v in bg.items()}, flush=True)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--small", default="1,1,128,128")
    ap.add_argument("--big", default="4,16,2048,128")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--inner", type=int, default=10)
    ap.add_argument("--ablate", action="store_true",
                    help="only the ablation (settings side by side), no profiles")
    args = ap.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    dev = DEV
    dtype = getattr(torch, args.dtype)
    small = tuple(int(x) for x in args.small.split(","))
    big = tuple(int(x) for x in args.big.split(","))
    res = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "machine": {"gpu": torch.cuda.get_device_name() if dev.type == "cuda" else None, "cpu": platform.processor(),
                       "python": platform.python_version(), "torch": torch.__version__},
           "cpu_calibration": cpu_calibration(), "host_per_step": {}, "gaps": {}}
    if args.ablate:
        res["small"], res["big"] = small, big
        res["ablation"] = ablation(small, big, dtype, dev, args)
        res["cpu_calibration_after"] = cpu_calibration()
        (out / "torch-host-ablation.json").write_text(json.dumps(res, indent=1))
        return
    for causal in (False, True):
        tag = "causal" if causal else "none"
        fns = steps(small, causal, dtype, dev)
        res["host_per_step"][tag] = host_per_step(fns, args.n, args.rounds)
        print(tag, {k: round(v["median_us"], 1) for k, v in res["host_per_step"][tag].items()},
              flush=True)
        (out / f"profile-module-{tag}.txt").write_text(profile_text(fns["module"], args.n))
        (out / f"profile-kernel-{tag}.txt").write_text(profile_text(fns["kernel"], args.n))
        bfns = steps(big, causal, dtype, dev)
        res["gaps"][tag] = {name: gaps(bfns[name], args.inner) for name in ("module", "kernel")}
        for name, gd in res["gaps"][tag].items():
            (out / f"cpu-table-{name}-{tag}.txt").write_text(gd.pop("cpu_table", ""))
            print(tag, name, {k: gd.get(k) for k in ("span_us", "idle_us", "host_issue_us")},
                  flush=True)
        (out / "torch-host-profile.json").write_text(json.dumps(res, indent=1))
    res["cpu_calibration_after"] = cpu_calibration()
    (out / "torch-host-profile.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
