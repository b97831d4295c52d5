"""Host time per device-array call of the webgpu backend (issue 17), one process.

python bench/webgpu_hosttime.py SRC S DTYPE N  ->  one JSON line on stdout

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
"""
from __future__ import annotations

import json
import sys
import time

sys.path.insert(0, sys.argv[1])

import numpy as np  # noqa: E402

import anyattn as aa  # noqa: E402
from anyattn import abi  # noqa: E402
from anyattn import webgpu as wg  # noqa: E402
from anyattn.api import forward_with_stats  # noqa: E402
from anyattn.backends.registry import get_backend  # noqa: E402
from anyattn.problem import describe  # noqa: E402


def main():
    S, dt, N = int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    B, H, D = 1, 8, 64
    rng = np.random.default_rng(0)
    host = [rng.standard_normal((B, H, S, D)).astype(dt) for _ in range(4)]
    q, k, v, g = (wg.asarray(x) for x in host)
    be = get_backend("webgpu")
    run = be._run()
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


if __name__ == "__main__":
    main()
