"""Host time per device-array call of the webgpu backend (issue 17), one process.

python bench/lab/webgpu_hosttime.py SRC S DTYPE N  ->  one JSON line on stdout
python bench/lab/webgpu_hosttime.py --stages OUT.json [SxDxDTYPE,...]  ->  where the host
    time of a device-array backward goes, per stage (below), this tree
python bench/lab/webgpu_hosttime.py --aggregate RUNS.jsonl OUT.json [BEFORE_TAG]
    -> medians per (S, dtype, case, tree) over rounds, ratios after/before, vs the plan;
       OUT.json and OUT.png (a tree whose SRC path contains BEFORE_TAG, default
       "before", is the before side)

SRC: the anyattn source tree to import (a checkout's src/, e.g. an older commit's via
``git archive``), so that trees can be compared in interleaved processes.  Shape
B=1 H=8 D=64, S queries = keys.  Per case, N calls, each timed with perf_counter from
the call until it returns (the GPU is waited for after each call, outside the timed
region): ``call_ms`` the median call time, ``host_ms`` the median of call time minus
the time spent inside wgpu's ``queue.submit`` (the driver: lavapipe runs part of the
work there), ``host_min_ms`` the smallest.  Cases: ``plan`` (the raw encoded backward
plan re-submitted: the floor, what ``bench/webgpu_bench.py --resident`` compares with),
``bwd`` (anyattn.attention_backward on device arrays with out + RowStats), ``fwd``
(forward_with_stats), ``step`` (both, the forward's results into the backward),
``abi3`` / ``abi_grouped`` (the seed ABI on one wgpu arena: three calls dQ, dK, dV /
one grouped call; ``abi_grouped`` is skipped on trees without it).

python bench/lab/webgpu_hosttime.py --pyonly SRC DTYPE N -> one JSON line: the Python work
    alone of a device-array backward (B=1 H=1 S=16 D=16, out + RowStats), with
    ``Runner.submit`` replaced by a no-op (no encoding, no driver): what the API and the
    backend add on top of the raw plan, whose Python work per call is that ``submit``
    alone; median and minimum of N calls (session 7).

``--stages`` (issue 17: the f16 S=512 D=64 host anomaly): B=1 H=8, per SxDxDTYPE point,
the raw plan and the device-array backward timed back to back (N calls, one wait:
``loop_ms``), and per call with the GPU waited for outside the timing: the whole call
and, inclusive, the time inside ``describe`` + ``choose`` (api layer), the template
key, ``Template.acquire_results`` (pool), ``Template.submit`` (bind-group lookups +
encoding + ``queue.submit``), ``queue.submit`` alone, the result arrays; the launch and
buffer counts of the template; GC collections seen; the same call with ``gc``
disabled; each kernel of the plan submitted alone (``plan_kernels_ms``, N submissions,
one wait; a kernel of one name split into pieces counts once).  Medians over calls.
"""
from __future__ import annotations

import json
import sys
import time

if sys.argv[1] not in ("--aggregate", "--stages", "--pyonly"):
    sys.path.insert(0, sys.argv[1])
elif sys.argv[1] == "--pyonly":
    sys.path.insert(0, sys.argv[2])

import numpy as np  # noqa: E402


def main():
    import anyattn as aa
    from anyattn import abi
    from anyattn import webgpu as wg
    from anyattn.api import forward_with_stats
    from anyattn.backends.registry import get_backend
    from anyattn.problem import describe

    S, dt, N = int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    B, H, D = 1, 8, 64
    rng = np.random.default_rng(0)
    host = [rng.standard_normal((B, H, S, D)).astype(dt) for _ in range(4)]
    q, k, v, g = (wg.asarray(x) for x in host)
    be = get_backend("webgpu")
    run = be.runner()
    queue_cls = type(run.device.queue)
    orig = queue_cls.submit
    inside = [0.0]

    def timed_submit(self, *a, **kw):
        t = time.perf_counter()
        try:
            return orig(self, *a, **kw)
        finally:
            inside[0] += time.perf_counter() - t

    queue_cls.submit = timed_submit

    def wait():
        run.read(run.dummy, 1)

    out, st = forward_with_stats(q, k, v)
    p = describe(host[0], host[1], host[2], dout=host[3], wrt=("q", "k", "v"))
    _, plan, _, _ = be.plan(p, *host)
    cases = {
        "plan": lambda: plan.submit(1),
        "bwd": lambda: aa.attention_backward(q, k, v, g, out=out, lse=st),
        "fwd": lambda: forward_with_stats(q, k, v),
        "step": lambda: (lambda o: aa.attention_backward(q, k, v, g, out=o[0], lse=o[1]))(
            forward_with_stats(q, k, v)),
    }
    if dt == "float32":
        import wgpu

        arena, p0 = abi.pack_arena(*host, wrt=0)
        import dataclasses

        n_out = B * H * S * D
        full = np.zeros(arena.size + 2 * n_out, np.float32)
        full[:arena.size] = arena
        group = [p0] + [dataclasses.replace(p0, wrt=w, out_off=arena.size + i * n_out)
                        for i, w in enumerate((1, 2))]
        buf = run.device.create_buffer_with_data(
            data=full, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC
            | wgpu.BufferUsage.COPY_DST)
        cases["abi3"] = lambda: [abi.attention_backward_arena(buf, x) for x in group]
        try:
            abi.attention_backward_arena(buf, group)
            cases["abi_grouped"] = lambda: abi.attention_backward_arena(buf, group)
        except (TypeError, ValueError):
            pass                              # a tree without the grouped call
    res = {}
    for name, fn in cases.items():
        fn()
        fn()
        wait()
        calls, hosts = [], []
        for _ in range(N):
            inside[0] = 0.0
            t = time.perf_counter()
            fn()
            dtm = time.perf_counter() - t
            sub = inside[0]
            wait()
            calls.append(dtm)
            hosts.append(dtm - sub)
        res[name] = dict(call_ms=1e3 * float(np.median(calls)),
                         host_ms=1e3 * float(np.median(hosts)), host_min_ms=1e3 * min(hosts))
    print(json.dumps(dict(src=sys.argv[1], S=S, dtype=dt, N=N, **res)))


def pyonly(src, dt, N):
    """Python work per device-array backward with Runner.submit a no-op (module doc)."""
    import anyattn as aa
    from anyattn import webgpu as wg
    from anyattn.api import forward_with_stats
    from anyattn.backends.registry import get_backend

    N = int(N)
    rng = np.random.default_rng(0)
    q, k, v, g = (wg.asarray(rng.standard_normal((1, 1, 16, 16)).astype(dt)) for _ in range(4))
    be = get_backend("webgpu")
    run = be.runner()
    out, st = forward_with_stats(q, k, v)
    for _ in range(20):
        aa.attention_backward(q, k, v, g, out=out, lse=st)
    run.read(run.dummy, 1)
    type(run).submit = lambda self, *a, **kw: None
    ts = []
    for _ in range(N):
        t = time.perf_counter()
        aa.attention_backward(q, k, v, g, out=out, lse=st)
        ts.append(time.perf_counter() - t)
    print(json.dumps(dict(src=src, dtype=dt, N=N, pyonly_us=1e6 * float(np.median(ts)),
                          pyonly_min_us=1e6 * float(min(ts)))))


class _Timers:
    """Inclusive wall time per stage: wraps callables, accumulates per call."""

    def __init__(self):
        self.t = {}

    def wrap(self, owner, name, stage):
        orig = getattr(owner, name)
        acc = self.t

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return orig(*a, **kw)
            finally:
                acc[stage] = acc.get(stage, 0.0) + time.perf_counter() - t
        setattr(owner, name, timed)


def stages(out_path, points="512x64xfloat32,512x64xfloat16,512x128xfloat32,512x128xfloat16",
           N=60):
    """Per point: loop times (plan, device arrays) and the host time per stage."""
    import gc
    from pathlib import Path

    import anyattn as aa
    from anyattn import api
    from anyattn import webgpu as wg
    from anyattn.api import forward_with_stats
    from anyattn.backends.registry import get_backend
    from anyattn.backends.webgpu import resident, templates
    from anyattn.problem import describe

    be = get_backend("webgpu")
    run = be.runner()
    tm = _Timers()
    tm.wrap(api, "describe", "api_describe")
    tm.wrap(api, "choose", "api_choose")
    tm.wrap(resident, "_key", "key")
    tm.wrap(templates.Template, "acquire_results", "pool_acquire")
    tm.wrap(templates.Template, "submit", "template_submit")
    tm.wrap(type(run), "bind_group", "bind_groups")
    tm.wrap(type(run.device.queue), "submit", "queue_submit")
    tm.wrap(type(run.results), "hold", "result_hold")
    gcn = [0]
    gc.callbacks.append(lambda phase, info: gcn.__setitem__(0, gcn[0] + (phase == "start")))

    def wait():
        run.read(run.dummy, 1)

    res = []
    for pt in points.split(","):
        S, D, dt = pt.split("x")
        S, D = int(S), int(D)
        rng = np.random.default_rng(0)
        host = [rng.standard_normal((1, 8, S, D)).astype(dt) for _ in range(4)]
        q, k, v, g = (wg.asarray(x) for x in host)
        out, st = forward_with_stats(q, k, v)
        p = describe(host[0], host[1], host[2], dout=host[3], wrt=("q", "k", "v"))
        _, plan, _, _ = be.plan(p, *host)
        bwd = lambda: aa.attention_backward(q, k, v, g, out=out, lse=st)   # noqa: E731
        rec = dict(S=S, D=D, dtype=dt)
        for name, fn in (("plan", lambda: plan.submit(1)), ("bwd", bwd)):
            for _ in range(3):
                fn()
            wait()
            loops = []
            for _ in range(5):
                t = time.perf_counter()
                for _ in range(N // 5):
                    fn()
                wait()
                loops.append((time.perf_counter() - t) / (N // 5))
            rec[f"{name}_loop_ms"] = 1e3 * float(np.median(loops))
        from anyattn.backends.webgpu.engine import Plan

        kern = {}                 # each kernel of the plan alone, N submissions, one wait
        for kname in dict.fromkeys(e[3] for e in plan.encoded):
            part = Plan(run, [e for e in plan.encoded if e[3] == kname], [])
            part.submit(1)
            wait()
            t = time.perf_counter()
            for _ in range(N):
                part.submit(1)
            wait()
            kern[kname] = 1e3 * (time.perf_counter() - t) / N
        rec["plan_kernels_ms"] = kern
        tpl = list(run.templates._d.values())[-1]
        rec["launches"] = [l[4] for l in tpl.launches]
        rec["plan_launches"] = [e[3] for e in plan.encoded]
        rec["results"] = [n for n, _ in tpl.result_sizes]
        from anyattn.backends.webgpu.launch import choose_config

        rec["config"] = str(choose_config(be.context, D, "f16" if dt == "float16" else "f32",
                                          backward=True, rows=(8, S)))
        for name, fn, nogc in (("plan", lambda: plan.submit(1), False), ("bwd", bwd, False),
                               ("bwd_nogc", bwd, True)):
            calls, parts = [], []
            gcn[0] = 0
            if nogc:
                gc.disable()
            try:
                for _ in range(N):
                    tm.t.clear()
                    t = time.perf_counter()
                    fn()
                    calls.append(time.perf_counter() - t)
                    parts.append(dict(tm.t))
                    wait()
            finally:
                gc.enable()
            rec[name] = dict(call_ms=1e3 * float(np.median(calls)),
                             min_ms=1e3 * float(np.min(calls)), gc_collections=gcn[0],
                             stages_ms={k: 1e3 * float(np.median([x.get(k, 0.0) for x in parts]))
                                        for k in sorted({k for x in parts for k in x})})
        print(json.dumps(rec), flush=True)
        res.append(rec)
    Path(out_path).write_text(json.dumps(dict(
        machine=dict(adapter=be.context.name, date=time.strftime("%Y-%m-%d %H:%M UTC",
                                                                 time.gmtime())),
        B=1, H=8, N=N, method="see bench/lab/webgpu_hosttime.py --stages", results=res), indent=1))


def aggregate(runs_path, out_path, before_tag="before"):
    """Rounds of interleaved processes -> medians, before/after ratios, JSON + PNG."""
    from pathlib import Path

    rows = [json.loads(line) for line in open(runs_path) if line.startswith("{")]
    loads = [r["load"] for r in rows if "load" in r]
    rows = [r for r in rows if "S" in r]
    agg = {}
    for r in rows:
        side = "before" if before_tag in r["src"] else "after"
        for case in ("plan", "bwd", "fwd", "step", "abi3", "abi_grouped"):
            if case in r:
                agg.setdefault((r["S"], r["dtype"], case), {}).setdefault(side, []).append(
                    (r[case]["host_ms"], r[case]["host_min_ms"], r[case]["call_ms"]))
    out = []
    for (S, dt, case), d in sorted(agg.items()):
        b, a = np.array(d.get("before", [])), np.array(d.get("after", []))
        if not len(b) or not len(a):
            continue
        rec = dict(S=S, dtype=dt, case=case, rounds=min(len(a), len(b)),
                   before_host_ms=float(np.median(b[:, 0])),
                   after_host_ms=float(np.median(a[:, 0])),
                   before_host_min_ms=float(b[:, 1].min()), after_host_min_ms=float(a[:, 1].min()))
        rec["host_ratio"] = rec["after_host_ms"] / rec["before_host_ms"]
        out.append(rec)
    plan = {(r["S"], r["dtype"]): r for r in out if r["case"] == "plan"}
    for r in out:
        pl = plan.get((r["S"], r["dtype"]))
        if pl and r["case"] != "plan":
            r["before_vs_plan_host"] = r["before_host_ms"] / pl["before_host_ms"]
            r["after_vs_plan_host"] = r["after_host_ms"] / pl["after_host_ms"]
    res = dict(machine="2 CPU cores shared with other helpers' jobs, lavapipe (wgpu 0.32), no GPU",
               load_1_5_15=loads, B=1, H=8, D=64, runs=runs_path,
               method="per call: perf_counter from the call until it returns, minus the time "
                      "inside wgpu queue.submit (the driver); the GPU waited for after each "
                      "call, outside the timing; medians over calls, then over rounds of "
                      "interleaved before/after processes",
               results=out)
    Path(out_path).write_text(json.dumps(res, indent=1))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [r for r in out if r["case"] in ("plan", "bwd", "fwd", "step")]
    fig, ax = plt.subplots(figsize=(11, 4.2))
    x = np.arange(len(cases))
    ax.bar(x - 0.2, [r["before_host_ms"] for r in cases], 0.4, label="before")
    ax.bar(x + 0.2, [r["after_host_ms"] for r in cases], 0.4, label="after")
    ax.set_xticks(x)
    ax.set_xticklabels([f"{r['case']}\nS={r['S']} {r['dtype'][5:]}" for r in cases], fontsize=7)
    ax.set_ylabel("host ms per call (median)")
    ax.set_title("webgpu device-array calls, host time per call on lavapipe (B=1 H=8 D=64)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(Path(out_path).with_suffix(".png"), dpi=110)
    for r in out:
        print(f"S={r['S']:4d} {r['dtype']:8s} {r['case']:11s} host {r['before_host_ms']:.3f} -> "
              f"{r['after_host_ms']:.3f} ms ({r['host_ratio']:.2f}x; rounds {r['rounds']})"
              + (f"  vs plan {r['before_vs_plan_host']:.2f} -> {r['after_vs_plan_host']:.2f}"
                 if "after_vs_plan_host" in r else ""))


if __name__ == "__main__":
    if sys.argv[1] == "--aggregate":
        aggregate(*sys.argv[2:])
    elif sys.argv[1] == "--stages":
        stages(*sys.argv[2:])
    elif sys.argv[1] == "--pyonly":
        pyonly(*sys.argv[2:])
    else:
        main()
