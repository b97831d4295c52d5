"""Where autograd's hand-over to its CUDA device thread spends host time, per step.

Shape legend: B batch, H heads, S = Sq = Sk, D head dim.

Session 8 found that an ``anyattn.torch`` training step on the H200 machine costs about
340 µs more host time with autograd's device threads on (torch's default) than with the
backward on the calling thread, against about 60 µs for a trivial ``autograd.Function``.
This probe splits a step's host time into segments by stamping ``time.perf_counter``:

    fwd      the forward call (``anyattn.torch.attention``)
    to_bwd   from ``out.backward(g)`` until the first line of the library's eager
             backward (``eager._Attention.backward``) runs — the hand-over in
    bwd      that backward, split into ``bwd_pre`` (up to the backend's backward),
             ``backend_bwd`` (the backend's backward: checks, allocation, launches) and
             ``bwd_post``
    back     from the backward's return until ``out.backward`` returns — the hand-over out

at a shape so small that the GPU never limits (the steps are queued back to back, one
synchronize at the end), with device threads on and off, medians over steps.  The same
for ``Trivial`` (torch's floor: a 3-input Function whose backward returns its inputs'
gradients).

    python bench/lab/autograd_handover.py --out OUT_DIR [--shape 1,2,128,64] [--steps 200]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import torch  # noqa: E402

import anyattn.torch as at  # noqa: E402
from anyattn.backends import registry  # noqa: E402
from anyattn.torch import eager  # noqa: E402

STAMPS: dict = {}


def _stamp(name):
    STAMPS[name] = (time.perf_counter(), threading.get_ident())


class Trivial(torch.autograd.Function):
    """torch's floor: the backward hands back its gradient three times."""

    @staticmethod
    def forward(ctx, q, k, v):
        return q + k + v

    @staticmethod
    def backward(ctx, g):
        _stamp("bwd_in")
        out = (g, g, g)
        _stamp("bwd_out")
        return out


def _instrument(backend_obj):
    """Stamps around the library's eager backward (eager._Attention.backward) and the
    backend's backward inside it; returns the undo."""
    orig = eager._Attention.backward
    cls = type(backend_obj)
    orig_be = cls.backward

    def backward(ctx, dout, dmax, dlog_norm):
        _stamp("bwd_in")
        out = orig(ctx, dout, dmax, dlog_norm)
        _stamp("bwd_out")
        return out

    def be_backward(self, *a, **kw):
        _stamp("be_in")
        out = orig_be(self, *a, **kw)
        _stamp("be_out")
        return out

    eager._Attention.backward = staticmethod(backward)
    cls.backward = be_backward

    def undo():
        eager._Attention.backward = staticmethod(orig)
        cls.backward = orig_be
    return undo


def _thread_names() -> dict:
    """This process's threads by name (Linux /proc), counted."""
    names: dict = {}
    for t in Path("/proc/self/task").glob("*"):
        try:
            n = (t / "comm").read_text().strip()
        except OSError:
            continue
        names[n] = names.get(n, 0) + 1
    return names


def run(kind, threads, shape, steps, dev, backend, causal):
    B, H, S, D = shape
    torch.manual_seed(0)
    dt = torch.bfloat16 if dev == "cuda" else torch.float32
    q, k, v, g = (torch.randn(B, H, S, D, device=dev, dtype=dt) for _ in range(4))
    qg, kg, vg = (x.clone().requires_grad_() for x in (q, k, v))
    mask = at.Causal() if causal else None
    seg = {n: [] for n in ("fwd", "to_bwd", "bwd", "bwd_pre", "backend_bwd", "bwd_post",
                           "back", "step")}
    same_thread = []
    undo = (_instrument(registry.get_backend(backend)) if kind == "module"
            else (lambda: None))
    try:
        with torch.autograd.set_multithreading_enabled(threads):
            for i in range(steps + 10):
                STAMPS.clear()
                for x in (qg, kg, vg):
                    x.grad = None
                t0 = time.perf_counter()
                if kind == "trivial":
                    o = Trivial.apply(qg, kg, vg)
                else:
                    o = at.attention(qg, kg, vg, mask=mask, backend=backend)
                t1 = time.perf_counter()
                o.backward(g)
                t2 = time.perf_counter()
                if i < 10:
                    continue
                bi, bo = STAMPS["bwd_in"][0], STAMPS["bwd_out"][0]
                seg["fwd"].append(t1 - t0)
                seg["to_bwd"].append(bi - t1)
                seg["bwd"].append(bo - bi)
                seg["back"].append(t2 - bo)
                seg["step"].append(t2 - t0)
                if "be_in" in STAMPS:
                    seg["bwd_pre"].append(STAMPS["be_in"][0] - bi)
                    seg["backend_bwd"].append(STAMPS["be_out"][0] - STAMPS["be_in"][0])
                    seg["bwd_post"].append(bo - STAMPS["be_out"][0])
                same_thread.append(STAMPS["bwd_in"][1] == threading.get_ident())
            if dev == "cuda":
                torch.cuda.synchronize()
    finally:
        undo()
    return {"median_us": {n: statistics.median(v) * 1e6 for n, v in seg.items() if v},
            "p10_us": {n: sorted(v)[len(v) // 10] * 1e6 for n, v in seg.items() if v},
            "backward_on_calling_thread": all(same_thread)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--shape", default="1,2,128,64")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--backend", default=None, help="default: triton on CUDA, numpy else")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--torch-threads", type=int, default=0,
                    help="torch.set_num_threads(N) first (0: leave torch's default)")
    a = ap.parse_args()
    if a.torch_threads:
        torch.set_num_threads(a.torch_threads)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    backend = a.backend or ("triton" if dev == "cuda" else "numpy")
    shape = tuple(int(x) for x in a.shape.split(","))
    res = {"when": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
           "torch": torch.__version__, "shape_BHSD": shape, "backend": backend,
           "causal": a.causal, "steps": a.steps, "runs": {}}
    for rnd in range(2):                       # two rounds, rotating order
        order = [(kd, th) for kd in ("trivial", "module") for th in (True, False)]
        if rnd:
            order = order[::-1]
        for kind, threads in order:
            r = run(kind, threads, shape, a.steps, dev, backend, a.causal)
            key = f"{kind}-{'threads' if threads else 'calling'}-r{rnd}"
            res["runs"][key] = r
            m = r["median_us"]
            print(key, " ".join(f"{n}={v:.1f}" for n, v in m.items()),
                  "calling_thread" if r["backward_on_calling_thread"] else "device_thread",
                  flush=True)
    res["threads"] = _thread_names()
    res["torch_num_threads"] = torch.get_num_threads()
    res["affinity"] = sorted(os.sched_getaffinity(0))
    print("threads:", res["threads"], "torch threads:", res["torch_num_threads"],
          "affinity:", res["affinity"], flush=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "autograd_handover.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
