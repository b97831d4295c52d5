"""Host cost of Triton's own launcher (``kernel[grid](...)``) per training step, on a CPU.

Shape legend: B batch, H heads, S = Sq = Sk, D head dim.

Without a GPU no CUDA kernel can launch, so this measures what Triton's Python launcher
does before its C launcher (``CompiledKernel.run``): the generated binder that binds the
arguments and specialises each one (type, 16-divisibility of ints, 16-byte alignment of
pointers), the kernel-cache key, and the check of the kernel's global values.  It first
records the launches of one fwd+bwd step of the backend's launch code (kernels swapped
for recorders, CPU tensors, no interpreter), then replays each recorded launch through
that part of ``JITFunction.run`` for a CUDA sm_90 target, with a warm key cache as after
the first call.  What it leaves out: the driver's device / stream queries, the launch
metadata and the C launcher itself (a few us each on a GPU host).  Beside it, the check
a direct launch (backends/triton/direct.py, ANYATTN_TRITON_DIRECT_LAUNCH=1) makes
instead: ``Direct.matches`` on the same arguments.

    python bench/lab/triton_launcher_cost.py [--shape 2,4,256,64] [--causal]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)       # the real JITFunctions, not the interpreter
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import torch  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler.compiler import make_backend  # noqa: E402
from triton.runtime import jit as J  # noqa: E402

import anyattn  # noqa: E402
from anyattn.backends.triton import direct as DL  # noqa: E402
from anyattn.backends.triton import kernels as K  # noqa: E402
from anyattn.backends.triton import launch as L  # noqa: E402
from anyattn.problem import describe  # noqa: E402


class _Recorder:
    """Stands in for a @triton.jit kernel and records kernel[grid](*args, **kw)."""

    def __init__(self, name, fn, log):
        self.name, self.fn, self.log = name, fn, log

    def __getitem__(self, grid):
        return lambda *a, **kw: self.log.append((self.name, self.fn, grid, a, kw))


def record(q, k, v, g, mask):
    log = []
    real = {}
    for name in dir(K):
        obj = getattr(K, name)
        if isinstance(obj, J.JITFunction):
            real[name] = obj
            setattr(K, name, _Recorder(name, obj, log))
    try:
        pf = describe(q, k, v, mask=mask)
        pb = describe(q, k, v, dout=g, mask=mask, wrt=("q", "k", "v"))
        out, st = L.forward(pf, q, k, v, None)
        L.backward(pb, q, k, v, g, out, st, None)   # first calls resolve the launches
        log.clear()
        L.forward(pf, q, k, v, None)
        L.backward(pb, q, k, v, g, out, st, None)
    finally:
        for name, obj in real.items():
            setattr(K, name, obj)
    return list(log)


def launcher_front(fn, backend, binder, key_cache, args, kw):
    """The part of JITFunction.run before the C launcher, on a warm key cache."""
    kw = dict(kw)
    kw["debug"] = kw.get("debug", fn.debug) or J.knobs.runtime.debug
    kw["instrumentation_mode"] = J.knobs.compilation.instrumentation_mode
    bound, spec, options = binder(*args, **kw)
    key = J.compute_cache_key(key_cache, spec, options)
    for (name, _), (val, globals_dict) in fn.used_global_vals.items():
        if globals_dict.get(name) != val:
            raise RuntimeError(name)
    return key, tuple(bound.values())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="2,4,256,64", help="B,H,S,D")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--reps", type=int, default=2000)
    a = ap.parse_args()
    B, H, S, D = (int(x) for x in a.shape.split(","))
    q, k, v, g = (torch.randn(B, H, S, D, dtype=torch.bfloat16) for _ in range(4))
    launches = record(q, k, v, g, anyattn.Causal() if a.causal else None)
    backend = make_backend(GPUTarget("cuda", 90, 32))
    total = total_d = 0.0
    print(f"Triton {J.__name__.split('.')[0]} launcher front per launch, shape {a.shape}"
          f"{' causal' if a.causal else ''}, load {os.getloadavg()[0]:.2f}")
    for name, fn, grid, args, kw in launches:
        binder = J.create_function_from_signature(fn.signature, fn.params, backend)
        key_cache = {}
        for _ in range(50):
            launcher_front(fn, backend, binder, key_cache, args, kw)
        d = DL.Direct(fn, None, args, ())
        assert d.matches(args)
        best = best_d = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(a.reps):
                launcher_front(fn, backend, binder, key_cache, args, kw)
            t1 = time.perf_counter()
            for _ in range(a.reps):
                d.matches(args)
            t2 = time.perf_counter()
            best = min(best, (t1 - t0) / a.reps * 1e6)
            best_d = min(best_d, (t2 - t1) / a.reps * 1e6)
        total += best
        total_d += best_d
        print(f"  {name:20s} {len(args):3d} args {len(kw):2d} keywords  {best:6.1f} us  "
              f"(direct check {best_d:5.1f} us)")
    print(f"  per fwd+bwd step ({len(launches)} launches): {total:.1f} us "
          f"(direct checks {total_d:.1f} us)")


if __name__ == "__main__":
    main()
