"""Host work per training step of anyattn.torch, with the Triton kernels replaced by no-ops.

Shape legend: B batch, H heads, S = Sq = Sk, D head dim.

Runs on the CPU (TRITON_INTERPRET=1 makes the Triton backend take CPU tensors; every
@triton.jit kernel is swapped for a launch that does nothing), so what is timed is the
Python and torch work around the kernels, which on a GPU decides whether the host keeps
ahead of the device at moderate sizes.  Variants, timed in turn round after round:

- ``raw``: the backend's launch code (``launch.forward`` + ``launch.backward``) on a
  prebuilt Problem: the floor;
- ``core``: ``anyattn.api.forward_with_stats`` + ``anyattn.attention_backward``;
- ``module``: ``anyattn.torch.attention`` + ``torch.autograd.grad`` (what a model runs);
- ``module_ops``: the same through the custom ops (the path tracing uses);
- ``autograd``: a trivial 3-input ``autograd.Function`` fwd+bwd (torch's own floor for
  any module step).

``--hopper-fwd`` routes the forward through the Hopper launch code (hopper/launch.py:
TMA descriptors, prepared launch) with its Gluon kernels swapped for no-ops too, and the
backward through the portable kernels; ``--hopper-bwd`` the backward alone (the portable
delta preprocess, then launch.backward's Hopper route: hopper/launch.py
``backward_config`` -> ``backward_fused`` with its Gluon kernel and
``dq_convert_kernel``); ``--hopper`` both: the route the H200 runs at D=128 bf16 (use
such a shape, e.g. ``--shape 4,16,2048,128``).  The routing is the library's own
(route.route: hopper/coverage.py's table and 'auto' set) with only the device
facts of an sm_90 CUDA device put in (no interpreter, a CUDA device, capability 9.0,
132 SMs), so a call the table does not route stays portable; the JSON names the
routed configs.

``--launcher``: each kernel launch, instead of doing nothing, runs the front of Triton's
``JITFunction.run`` for an sm_90 target (the generated binder over the call's arguments
with every parameter's specialisation, the kernel-cache key, the check of the kernel's
globals; bench/lab/triton_launcher_cost.py): the part of a real launch that is Python and
depends on the arguments.  Still left out: the driver's device / stream queries, the
launch metadata, the C launcher (which encodes each TMA descriptor) and the CUDA
allocations (CPU ones here).  ``--direct`` (with ``--launcher``): a launch site's repeats
go through ``direct.Direct`` instead (the facts' check and the binding in signature
order, no binder), as on a CUDA device by default since session 13.

    python bench/lab/host_overhead.py --out dev/perf/host-overhead-cpu-<date>.json

Before / after a change on a loaded machine: ``--compare OLD_SRC`` (a ``src`` tree of the
earlier revision, e.g. ``git archive <rev> src | tar -x -C /tmp/old``; ``--new NEW_SRC``
the later one, default this checkout's) runs this script
from both trees in alternating child processes (``--pairs`` times, ``--rounds`` each),
so that a load change hits both alike, and reports per variant the medians of each and
the median of the paired differences.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"
_SRC = os.environ.get("ANYATTN_BENCH_SRC") or str(Path(__file__).resolve().parents[2] / "src")
sys.path.insert(0, _SRC)

import torch  # noqa: E402

import anyattn  # noqa: E402
import anyattn.torch as at  # noqa: E402
from anyattn.api import forward_with_stats  # noqa: E402
from anyattn.backends.triton import kernels as K  # noqa: E402
from anyattn.backends.triton import launch as L  # noqa: E402
from anyattn.problem import describe  # noqa: E402
from anyattn.torch import eager  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: torch_module_bench
from torch_module_bench import Trivial  # noqa: E402


class _NoLaunch:
    """Stands in for a @triton.jit kernel: kernel[grid](...) does nothing."""

    def __getitem__(self, grid):
        return lambda *a, **kw: None


class _LauncherFront:
    """Stands in for a @triton.jit / @gluon.jit kernel: kernel[grid](*args, **kw) runs
    the front of Triton's JITFunction.run for an sm_90 target on these arguments
    (triton_launcher_cost.launcher_front: binder, cache key, globals' check) and
    launches nothing."""

    _backend = None

    def __init__(self, fn):
        from triton.backends.compiler import GPUTarget
        from triton.compiler.compiler import make_backend
        from triton.runtime import jit as J

        if type(fn).__name__ == "InterpretedFunction":   # TRITON_INTERPRET=1's wrapper
            fn = J.JITFunction(fn.fn, **fn.kwargs)
        if _LauncherFront._backend is None:
            _LauncherFront._backend = make_backend(GPUTarget("cuda", 90, 32))
        self.fn, self.key_cache = fn, {}
        self.binder = J.create_function_from_signature(fn.signature, fn.params,
                                                       _LauncherFront._backend)

    def __getitem__(self, grid):
        return self._front

    def _front(self, *args, **kw):      # triton_launcher_cost.launcher_front
        from triton.runtime import jit as J

        fn = self.fn
        kw["debug"] = kw.get("debug", fn.debug) or J.knobs.runtime.debug
        kw["instrumentation_mode"] = J.knobs.compilation.instrumentation_mode
        bound, spec, options = self.binder(*args, **kw)
        J.compute_cache_key(self.key_cache, spec, options)
        for (name, _), (val, globals_dict) in fn.used_global_vals.items():
            if globals_dict.get(name) != val:
                raise RuntimeError(name)
        return tuple(bound.values())


def _direct_sites() -> None:
    """--direct (with --launcher): a launch site's repeats take direct.Direct's path as on
    a CUDA device (the default there since session 13): the facts' check and the binding
    in signature order, resolved from the stand-in's binder after a launch through the
    launcher front; its C launch is left out, as the launcher front's is."""
    from anyattn.backends.triton import direct as DL

    class _NoRunDirect(DL.Direct):
        def run(self, grid, vals):
            return True

    def resolve(kernel, args, kw):
        if not isinstance(kernel, _LauncherFront):
            return False
        from triton.runtime import jit as J

        kw2 = dict(kw, debug=kw.get("debug", kernel.fn.debug) or J.knobs.runtime.debug,
                   instrumentation_mode=J.knobs.compilation.instrumentation_mode)
        bound, _, _ = kernel.binder(*args, **kw2)
        d = _NoRunDirect(kernel, None, tuple(args), kw, dict(bound))
        vals = d.values(tuple(args), kw)
        if vals is None or any(a is not b for a, b in zip(vals, bound.values())):
            raise AssertionError("direct.Direct binds otherwise than Triton's binder")
        return d

    DL.resolve = resolve
    DL.enabled = lambda device: True


def _stand_in(fn, launcher: bool):
    return _LauncherFront(fn) if launcher else _NoLaunch()


def _stub_kernels(launcher: bool = False) -> int:
    n = 0
    for name in dir(K):
        obj = getattr(K, name)
        if type(obj).__name__ in ("JITFunction", "InterpretedFunction"):
            setattr(K, name, _stand_in(obj, launcher))
            n += 1
    return n


class _NoDevice:
    """Stands in for torch.cuda.device on CPU tensors (the Hopper launch code enters it)."""

    def __init__(self, device):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


class _OnCuda:
    """A Problem as the routing sees it on the H200: its device a CUDA one."""

    def __init__(self, p):
        self._p = p

    device = "cuda:0"

    def __getattr__(self, name):
        return getattr(self._p, name)


def _route_hopper(forward: bool = True, backward: bool = False,
                  launcher: bool = False) -> None:
    """The forward (and / or the backward) take the route route.route picks on an
    sm_90 device (coverage.py's table, 'auto'), the Hopper launch code's Gluon kernels
    no-ops (CPU) or, with ``launcher``, Triton's launcher front (_LauncherFront)."""
    from anyattn.backends.triton.hopper import (bwd_dq_convert, bwd_ws_dq_kernel, bwd_ws_kernel,
                                                bwd_ws_t_kernel, fwd_persist_kernel,
                                                fwd_ws_kernel)

    for mod, name in ((fwd_ws_kernel, "fwd_ws_kernel"),
                      (fwd_persist_kernel, "fwd_persist_kernel"),
                      (bwd_ws_kernel, "dkdv_ws_kernel"),
                      (bwd_ws_dq_kernel, "dkdvq_ws_kernel"),
                      (bwd_ws_t_kernel, "dkdvq_ws_t_kernel"),
                      (bwd_dq_convert, "dq_convert_kernel")):
        setattr(mod, name, _stand_in(getattr(mod, name), launcher))
    import dataclasses

    from anyattn import settings
    from anyattn.backends.triton import route as triton_route

    # the H200's SM count (persistent grid, the backward's config, dq_order)
    triton_route.SM_COUNTS["cpu"] = 132
    facts = triton_route.DeviceFacts("cuda", (9, 0), 132)
    routed = {"forward": forward, "backward": backward}

    def route_call(p, direction, plan=None, tensors=()):   # a signature's first call only
        path = "auto" if routed[direction] else "portable"
        env = dataclasses.replace(settings.current(), triton_path=path)
        return triton_route.route(triton_route.ProblemFacts.of(p, tensors), direction, facts,
                                  env, plan)

    triton_route.route_call = route_call
    torch.cuda.device = _NoDevice
    # the persistent forward asks before its schedule's first build (a CPU torch raises)
    torch.cuda.is_current_stream_capturing = lambda: False


def _routes(pf, pb) -> dict:
    """The routes the prepared launches took (after a first call): per direction
    'portable' or the Hopper config's name."""
    out = {"forward": "portable", "backward": "portable"}
    for key, pr in L.prepared.PREPARED._d.items():
        if pr.hop:
            out[key[0]] = "hopper " + pr.route.config
    return out


def _flags(a) -> str:
    return "".join(f" {n}" for n, on in (("hopper-fwd", a.hopper_fwd), ("hopper-bwd", a.hopper_bwd),
                                          ("hopper", a.hopper), ("launcher", a.launcher),
                                          ("direct", getattr(a, "direct", False)),
                                          (f"docs={a.docs}", a.docs)) if on)


def compare(a, argv) -> None:
    """Alternate child runs of this script from ``a.compare`` (old) and this tree (new)."""
    import subprocess
    import tempfile

    new_src = a.new or str(Path(__file__).resolve().parents[2] / "src")
    runs = {"old": [], "new": []}
    mins = {"old": [], "new": []}       # per run, the fastest round (least load)
    routes = {}
    skip = {"--compare", "--pairs", "--out", "--png", "--new", "--profile"}
    child = [x for i, x in enumerate(argv)
             if x not in skip and (i == 0 or argv[i - 1] not in skip)]
    with tempfile.TemporaryDirectory() as td:
        for i in range(a.pairs):
            for tag, src in (("old", a.compare), ("new", new_src)) if i % 2 == 0 else \
                    (("new", new_src), ("old", a.compare)):
                out = os.path.join(td, f"{tag}{i}.json")
                subprocess.run([sys.executable, __file__, *child, "--out", out], check=True,
                               env=dict(os.environ, ANYATTN_BENCH_SRC=src),
                               stdout=subprocess.DEVNULL)
                doc = json.loads(Path(out).read_text())
                runs[tag].append(doc["median"])
                routes[tag] = doc.get("routes")
                mins[tag].append({n: min(r) for n, r in doc["rounds"].items()})
    names = list(runs["new"][0])
    res = {}
    print(f"host us per fwd+bwd step, shape {a.shape}{' causal' if a.causal else ''}"
          f"{_flags(a)}, {a.pairs} alternating pairs of runs, load {os.getloadavg()[0]:.2f}")
    for n in names:
        old = [r[n] for r in runs["old"]]
        new = [r[n] for r in runs["new"]]
        diff = statistics.median(b - c for b, c in zip(new, old))
        mo, mn = [r[n] for r in mins["old"]], [r[n] for r in mins["new"]]
        mdiff = statistics.median(b - c for b, c in zip(mn, mo))
        res[n] = dict(old=statistics.median(old), new=statistics.median(new),
                      paired_diff=diff, old_runs=old, new_runs=new,
                      old_min=statistics.median(mo), new_min=statistics.median(mn),
                      paired_diff_min=mdiff, old_run_mins=mo, new_run_mins=mn)
        print(f"  {n:11s} old {res[n]['old']:8.1f}  new {res[n]['new']:8.1f}  "
              f"paired diff {diff:+8.1f} ({diff / res[n]['old']:+.0%});  fastest rounds: "
              f"old {res[n]['old_min']:7.1f} new {res[n]['new_min']:7.1f} paired diff "
              f"{mdiff:+7.1f} ({mdiff / res[n]['old_min']:+.0%})")
    if a.out:
        Path(a.out).write_text(json.dumps(dict(
            date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            machine=platform.processor() or platform.machine(), cpus=os.cpu_count(),
            load=os.getloadavg(), torch=torch.__version__, shape=a.shape, causal=a.causal,
            hopper_fwd=a.hopper_fwd, hopper_bwd=a.hopper_bwd, hopper=a.hopper,
            launcher=a.launcher, routes=routes, old_src=a.compare, new_src=new_src, pairs=a.pairs, rounds=a.rounds, steps=a.steps,
            unit="microseconds of host time per fwd+bwd step (kernels no-op), medians",
            variants=res), indent=1))
    if a.png:
        plot(res, a, a.png)


def plot(res, a, path) -> None:
    """Bars: old and new median per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(res)
    fig, ax = plt.subplots(figsize=(6.4, 3.4))
    xs = range(len(names))
    for off, tag in ((-0.2, "old"), (0.2, "new")):
        ax.bar([x + off for x in xs], [res[n][tag] for n in names], width=0.4, label=tag)
    ax.set_xticks(list(xs), names)
    ax.set_ylabel("host us per fwd+bwd step")
    ax.set_title(f"anyattn host work, kernels no-op, shape {a.shape}"
                 f"{' causal' if a.causal else ''}", fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def profile(fns, a, routes, top: int = 40) -> None:
    """cProfile of a.steps steps per variant -> a.profile (text): per variant the top
    entries by own time and by cumulative time, in us per step."""
    import cProfile
    import io
    import pstats

    parts = [f"host_overhead --shape {a.shape}{' causal' if a.causal else ''}{_flags(a)}; "
             f"routes {routes}; {a.steps} steps per variant under cProfile (times are "
             f"inflated by the profiler; divide by {a.steps} for per step)\n"]
    for n, f in fns.items():
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(a.steps):
            f()
        pr.disable()
        for key in ("tottime", "cumulative"):
            buf = io.StringIO()
            pstats.Stats(pr, stream=buf).sort_stats(key).print_stats(top)
            parts.append(f"===== {n} by {key}\n{buf.getvalue()}")
    Path(a.profile).write_text("\n".join(parts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", default="2,4,256,64", help="B,H,S,D")
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--docs", type=int, default=0,
                    help="a Documents mask of this many equal documents (with --causal: "
                    "causal within each); ANYATTN_TRITON_PATH=hopper routes its backward "
                    "to Hopper")
    ap.add_argument("--hopper-fwd", action="store_true",
                    help="forward through the Hopper launch code (no-op kernels), as on "
                         "the H200 at D=128")
    ap.add_argument("--hopper-bwd", action="store_true",
                    help="backward through the Hopper route (the portable delta "
                         "preprocess, backward_fused's kernel and dq conversion, no-op)")
    ap.add_argument("--hopper", action="store_true",
                    help="forward and backward through the Hopper launch code (no-op "
                         "kernels): the route the H200 runs at D=128 bf16 (since session 8 "
                         "the backward's dQ-inside kernel)")
    ap.add_argument("--launcher", action="store_true",
                    help="kernels run Triton's launcher front for sm_90 (binder, cache "
                         "key) instead of nothing")
    ap.add_argument("--direct", action="store_true",
                    help="with --launcher: repeats of a launch site go through "
                    "direct.Direct (the facts' check, no binder) as on a CUDA device")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--steps", type=int, default=200, help="steps per round and variant")
    ap.add_argument("--out", help="JSON file")
    ap.add_argument("--compare", metavar="OLD_SRC", help="src tree of the earlier revision")
    ap.add_argument("--pairs", type=int, default=4, help="alternating runs per tree")
    ap.add_argument("--new", metavar="NEW_SRC",
                    help="with --compare: the src tree of the later revision (default: this "
                         "checkout's, which may hold others' uncommitted edits)")
    ap.add_argument("--png", help="with --compare: a bar chart of old / new")
    ap.add_argument("--variants", help="comma-separated subset of the variants (default: "
                    "all; module_ops clones the statistics plane, milliseconds on a CPU)")
    ap.add_argument("--profile", metavar="TXT",
                    help="after the timing, cProfile --steps steps of each variant and "
                         "write the top entries (own and cumulative time) to this file")
    a = ap.parse_args()
    if a.compare:
        if a.profile:
            raise SystemExit("--profile profiles this tree's variants in this process; "
                             "run it without --compare")
        compare(a, sys.argv[1:])
        return
    if a.direct and not a.launcher:
        raise SystemExit("--direct models the launch path after Triton's launcher front: "
                         "give --launcher too")
    assert _stub_kernels(a.launcher) > 0
    if a.direct:
        _direct_sites()
    if a.hopper_fwd or a.hopper_bwd or a.hopper:
        _route_hopper(forward=a.hopper_fwd or a.hopper, backward=a.hopper_bwd or a.hopper,
                      launcher=a.launcher)
    B, H, S, D = (int(x) for x in a.shape.split(","))
    q = torch.randn(B, H, S, D, dtype=torch.bfloat16, requires_grad=True)
    k, v = torch.randn_like(q).requires_grad_(), torch.randn_like(q).requires_grad_()
    g = torch.randn_like(q)
    mask = anyattn.Causal() if a.causal else None
    if a.docs:     # equal documents, one id row shared by the batch
        ids = (torch.arange(S) * a.docs // S).to(torch.int32)
        mask = anyattn.Documents(ids) if mask is None else mask & anyattn.Documents(ids)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    pf = describe(qd, kd, vd, mask=mask)
    pb = describe(qd, kd, vd, dout=g, mask=mask, wrt=("q", "k", "v"))
    out0, st0 = L.forward(pf, qd, kd, vd, None)

    def raw():
        L.forward(pf, qd, kd, vd, None)
        L.backward(pb, qd, kd, vd, g, out0, st0, None)

    def core():   # RowStats, not lse: the no-op kernels leave the statistics unwritten,
        # and a garbage lse would be refined (one more forward) as a huge one must be
        o, st = forward_with_stats(qd, kd, vd, mask=mask, backend="triton")
        anyattn.attention_backward(qd, kd, vd, g, out=o, lse=st, mask=mask, backend="triton")

    def module():
        torch.autograd.grad(at.attention(q, k, v, mask=mask, backend="triton"), (q, k, v), g)

    def module_ops():
        real = eager.eligible
        eager.eligible = lambda *x: False
        try:
            module()
        finally:
            eager.eligible = real

    def autograd():
        torch.autograd.grad(Trivial.apply(q, k, v), (q, k, v), g)

    fns = dict(raw=raw, core=core, module=module, module_ops=module_ops, autograd=autograd)
    if a.variants:
        fns = {n: fns[n] for n in a.variants.split(",")}
    for f in fns.values():
        for _ in range(20):
            f()
    routes = _routes(pf, pb)
    us = {n: [] for n in fns}
    for _ in range(a.rounds):
        for n, f in fns.items():
            t0 = time.perf_counter()
            for _ in range(a.steps):
                f()
            us[n].append((time.perf_counter() - t0) / a.steps * 1e6)
    med = {n: statistics.median(x) for n, x in us.items()}
    print(f"host us per fwd+bwd step, shape {a.shape}{' causal' if a.causal else ''}"
          f"{_flags(a)}, load {os.getloadavg()[0]:.2f}")
    print(f"  routes: forward {routes['forward']}, backward {routes['backward']}")
    for n in fns:
        print(f"  {n:11s} median {med[n]:8.1f}  min {min(us[n]):8.1f}  "
              f"(+{med[n] - med.get('raw', med[n]):.1f} over raw)")
    if a.profile:
        profile(fns, a, routes)
    if a.out:
        Path(a.out).write_text(json.dumps(dict(
            date=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            machine=platform.processor() or platform.machine(), cpus=os.cpu_count(),
            load=os.getloadavg(), torch=torch.__version__, shape=a.shape, causal=a.causal,
            hopper_fwd=a.hopper_fwd, hopper_bwd=a.hopper_bwd, hopper=a.hopper,
            launcher=a.launcher, routes=routes,
            unit="microseconds of host time per fwd+bwd step (kernels no-op"
                 + (", or Triton's launcher front for sm_90" if a.launcher else "") + ")",
            rounds=us, median=med), indent=1))


if __name__ == "__main__":
    main()
