"""Host time of the core per call (describe / choose / eager prepare), one tree per process.

python bench/lab/core_hosttime.py SRC [N]  ->  one JSON line on stdout: median µs per stage
python bench/lab/core_hosttime.py --compare BEFORE_SRC AFTER_SRC ROUNDS OUT.json [N]
    -> ROUNDS interleaved processes per tree (before, after, before, ...), per stage the
       median over rounds of each round's median, and after / before

SRC: the anyattn source tree to import (a checkout's src/, or an older commit's via
``git archive``).  Stages (each timed alone, perf_counter, medians of N calls):
``np_describe`` / ``np_choose`` / ``np_fwd`` / ``np_bwd``: NumPy float32 B=1 H=2 S=4 D=8
(``describe`` of the backward's inputs; ``choose`` of that Problem; the public calls,
pure host); ``wg_describe`` / ``wg_choose`` / ``wg_bwd``: WebGPU device arrays float32
B=1 H=8 S=64 D=64 on whatever adapter wgpu gives (lavapipe here), the backward with
out + RowStats (``wg_bwd`` includes the adapter's own work, lavapipe runs kernels inside
``queue.submit``); ``tdoc_prepare`` / ``tdoc_fwd`` / ``tdoc_step``: ``anyattn.torch``
eager on CPU float32 tensors B=1 H=2 S=64 D=16 with a Documents mask (3 documents): the
core's part of a call (``eager._prepare``), a no-grad forward, forward + backward.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time

import numpy as np


def _med(f, n):
    ts = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return 1e6 * float(np.median(ts))


def one(src, n=300):
    sys.path.insert(0, src)
    import anyattn as aa
    from anyattn.api import attention_backward, forward_with_stats
    from anyattn.backends.registry import choose
    from anyattn.problem import describe

    rng = np.random.default_rng(0)
    res = {}
    q, k, v, g = (rng.standard_normal((1, 2, 4, 8)).astype("float32") for _ in range(4))
    p = describe(q, k, v, dout=g, wrt=("q", "k", "v"))
    stages = {"np_describe": lambda: describe(q, k, v, dout=g, wrt=("q", "k", "v")),
              "np_choose": lambda: choose(p),
              "np_fwd": lambda: aa.attention(q, k, v),
              "np_bwd": lambda: aa.attention_backward(q, k, v, g)}
    try:
        from anyattn import webgpu as wg
        host = [rng.standard_normal((1, 8, 64, 64)).astype("float32") for _ in range(4)]
        wq, wk, wv, wgr = (wg.asarray(x) for x in host)
        out, st = forward_with_stats(wq, wk, wv)
        wp = describe(wq, wk, wv, dout=wgr, out=out, lse=st.max, wrt=("q", "k", "v"))
        stages.update(
            wg_describe=lambda: describe(wq, wk, wv, dout=wgr, out=out, lse=st.max,
                                         wrt=("q", "k", "v")),
            wg_choose=lambda: choose(wp),
            wg_bwd=lambda: attention_backward(wq, wk, wv, wgr, out=out, lse=st))
    except Exception as e:                        # no wgpu adapter: say so in the JSON
        res["wg_error"] = f"{type(e).__name__}: {e}"
    try:
        import torch

        import anyattn.torch as at
        from anyattn.torch import eager
        from anyattn.torch.ops import LoweredMask

        torch.manual_seed(0)
        tq, tk, tv = (torch.randn(1, 2, 64, 16, requires_grad=True) for _ in range(3))
        ids = torch.tensor([0] * 20 + [1] * 30 + [2] * 14)
        m = aa.Documents(ids)
        call = eager._Call(LoweredMask(None, None, ids[None], ids[None], None), 0.25,
                           None, None, 0, 0, None, None, 0.0, None)
        tqd, tkd, tvd = (x.detach() for x in (tq, tk, tv))

        def step():
            at.attention(tq, tk, tv, mask=m).sum().backward()

        def fwd():
            with torch.no_grad():
                at.attention(tqd, tkd, tvd, mask=m)

        stages.update(
            tdoc_prepare=lambda: eager._prepare(call, tq, tk, tv, None, None, ("q", "k", "v")),
            tdoc_fwd=fwd, tdoc_step=step)
    except ImportError as e:
        res["torch_error"] = str(e)
    for f in stages.values():
        f()
    for name, f in stages.items():
        res[name] = _med(f, n if not name.startswith(("wg_bwd", "tdoc_step")) else n // 3)
    return res


def compare(before, after, rounds, out_path, n=300):
    runs = {"before": [], "after": []}
    for r in range(int(rounds)):
        for tag, src in (("before", before), ("after", after)):
            line = subprocess.run([sys.executable, __file__, src, str(n)], check=True,
                                  capture_output=True, text=True).stdout.strip().splitlines()[-1]
            runs[tag].append(json.loads(line))
    stages = [k for k in runs["after"][0] if not k.endswith("_error")]
    summary = {}
    for s in stages:
        b = float(np.median([x[s] for x in runs["before"] if s in x]))
        a = float(np.median([x[s] for x in runs["after"]]))
        summary[s] = {"before_us": round(b, 2), "after_us": round(a, 2),
                      "after_over_before": round(a / b, 3)}
    doc = {"method": "bench/lab/core_hosttime.py --compare: interleaved processes, median of "
                     "per-round medians", "before": before, "after": after,
           "rounds": int(rounds), "n": n, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
           "summary": summary, "runs": runs}
    with open(out_path, "w") as f:
        json.dump(doc, f, indent=1)
    for s, d in summary.items():
        print(f"{s:14s} {d['before_us']:10.1f} {d['after_us']:10.1f}  {d['after_over_before']:.3f}")


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        compare(*sys.argv[2:])
    else:
        print(json.dumps(one(sys.argv[1], *(int(a) for a in sys.argv[2:]))))
