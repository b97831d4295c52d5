"""The "torch module" column: forward + backward of one attention layer through anyattn.torch.

Shape legend: B batch, H heads, S = Sq = Sk tokens, D head dim.

Per size it times, side by side in one process, a full step ``out = f(q, k, v);
out.backward(g)`` of:

- ``module``: ``anyattn.torch.attention`` (custom ops + autograd: what a model sees);
- ``api``: the core API called directly (``anyattn.attention(return_lse=True)`` then
  ``anyattn.attention_backward(out=, lse=)``): same backend, no torch wrapper;
- ``kernel``: the backend's own ``forward``/``backward`` with a prebuilt Problem (no
  validation, no dispatch): the raw kernels;
- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` with autograd;
- ``module_ops``: ``module`` through the custom ops (the path tracing takes);
- with ``--graph`` (CUDA): ``module_graph``, one replay of a CUDA graph that captured the
  module's forward and ``torch.autograd.grad`` (docs/torch.md "CUDA graphs": no host
  work per step but the replay), and the check that a replay gives the eager module's
  out / dq / dk / dv bits.

Wrapper overhead = module / kernel - 1 (and module / api - 1).  FLOPs by the
FlashAttention convention: fwd 4*B*H*S*S*D, bwd 2.5x fwd, causal halves both; the
step is fwd + bwd = 3.5x.  It also checks the module's output and gradients against
torch's SDPA before timing.  Results as JSON (and a PNG with --png).

    PYTHONPATH=src python bench/torch_module_bench.py --device cpu --threads 1 \
        --out dev/perf/torch-module-cpu-<date>.json --png dev/perf/torch-module-cpu-<date>.png
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

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from anyattn.modifiers import NO_MODS
import anyattn  # noqa: E402
import anyattn.torch as at  # noqa: E402
from anyattn import Causal  # noqa: E402
from anyattn.backends.registry import choose  # noqa: E402
from anyattn.problem import describe  # noqa: E402
from anyattn.torch import eager  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def sync(dev):
    """Wait for the GPU (a no-op on the CPU)."""
    if dev.type == "cuda":
        torch.cuda.synchronize()


def time_once(fn, dev, inner: int = 1):
    """Seconds per step of ``inner`` steps run back to back (inner > 1 lets the host run
    ahead of the GPU, as in a model, so that only overhead the GPU cannot hide shows):
    CUDA events on a GPU, the wall clock on the CPU.  Shared with torch_host_profile."""
    if dev.type == "cuda":
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3 / inner
    t0 = time.perf_counter()
    for _ in range(inner):
        fn()
    return (time.perf_counter() - t0) / inner


class set_env:
    """Environment variables set for a block (restored after)."""

    def __init__(self, env):
        self.env, self.old = env, {}

    def __enter__(self):
        for n, v in self.env.items():
            self.old[n] = os.environ.get(n)
            os.environ[n] = v

    def __exit__(self, *a):
        for n, v in self.old.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v
        return False


def time_round_robin(fns, dev, reps: int, warmup: int, budget_s: float, inner: int = 1):
    """{name: [seconds, ...]}: the variants timed in turn, rep after rep, so that a load
    change on a shared machine hits all of them alike (stops after budget_s, >= 3 reps)."""
    for fn in fns.values():
        with set_env(getattr(fn, "env", {})):
            for _ in range(warmup):
                fn()
    sync(dev)
    times = {n: [] for n in fns}
    t_start = time.perf_counter()
    for r in range(reps):
        for n, fn in fns.items():
            with set_env(getattr(fn, "env", {})):
                times[n].append(time_once(fn, dev, inner))
        if time.perf_counter() - t_start > budget_s and r >= 2:
            break
    return times


class Trivial(torch.autograd.Function):
    """torch's floor for any module step: a 3-input autograd.Function that allocates its
    output (bench/lab/host_overhead.py and bench/lab/torch_host_profile.py time it)."""

    @staticmethod
    def forward(ctx, a, b, c):
        return torch.empty_like(a)

    @staticmethod
    def backward(ctx, g):
        return g, g, g


def variants(q, k, v, g, causal, backend):
    """The steps to time, each a zero-argument callable."""
    mask = Causal() if causal else None
    qg, kg, vg = (x.detach().clone().requires_grad_() for x in (q, k, v))

    def module():
        for x in (qg, kg, vg):
            x.grad = None
        at.attention(qg, kg, vg, mask=mask, backend=backend).backward(g)

    def api():
        out, lse = anyattn.attention(q, k, v, mask=mask, return_lse=True, backend=backend)
        anyattn.attention_backward(q, k, v, g, out=out, lse=lse, mask=mask, backend=backend)

    p = describe(q, k, v, mask=mask, wrt=("q", "k", "v"))
    be = choose(p, backend)

    def kernel():
        out, lse = be.forward(p, q, k, v, None, NO_MODS)
        be.backward(p, q, k, v, g, out, lse, None, NO_MODS)

    def sdpa():
        for x in (qg, kg, vg):
            x.grad = None
        F.scaled_dot_product_attention(qg, kg, vg, is_causal=causal).backward(g)

    def module_ops():
        """``module`` through the custom ops (the path tracing takes; the eager path off)."""
        keep, eager.eligible = eager.eligible, lambda *a: False
        try:
            module()
        finally:
            eager.eligible = keep

    fns = {"module": module, "api": api, "kernel": kernel, "sdpa": sdpa,
           "module_ops": module_ops}
    return fns, be.name


def graph_step(q, k, v, g, causal, backend):
    """(CUDAGraph, its static (out, dq, dk, dv)) of one module step captured after three
    warm-up steps on a side stream, on static copies of q, k, v, g.  The static inputs
    ride on the graph (``graph.static_inputs``): a replay reads them by address, so they
    must live as long as the graph.  (Session 6's version let them go when this function
    returned; the next eager call's allocations then took their memory and the replay
    read someone else's data: the "replay != eager bits" of the 21:47 UTC run.)"""
    mask = Causal() if causal else None
    sq, sk, sv = (x.detach().clone().requires_grad_() for x in (q, k, v))
    sg = g.clone()

    def step():
        out = at.attention(sq, sk, sv, mask=mask, backend=backend)
        return (out,) + torch.autograd.grad(out, (sq, sk, sv), sg)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    graph.static_inputs = (sq, sk, sv, sg)
    return graph, outs


def graph_bits(graph, outs, q, k, v, g, causal, backend):
    """What one replay gives against the eager module on the same inputs: whether its
    out / dq / dk / dv are the eager bits, whether two eager steps agree with each other
    (eager repeatability at this size), the largest difference per output, and the
    replay's errors against torch SDPA in fp32 (so a mismatch says wrong or merely
    different)."""
    graph.replay()

    def eager():
        qa, ka, va = (x.detach().clone().requires_grad_() for x in (q, k, v))
        out = at.attention(qa, ka, va, mask=Causal() if causal else None, backend=backend)
        return (out,) + torch.autograd.grad(out, (qa, ka, va), g)

    want, again = eager(), eager()
    torch.cuda.synchronize()
    names = ("out", "dq", "dk", "dv")
    return dict(
        graph_same_bits=all(torch.equal(a, b) for a, b in zip(outs, want)),
        eager_repeat_same_bits=all(torch.equal(a, b) for a, b in zip(want, again)),
        graph_maxdiff_vs_eager={n: float((a.float() - b.float()).abs().max())
                                for n, a, b in zip(names, outs, want)},
        graph_err_vs_sdpa=_errs_vs_sdpa(outs, q, k, v, g, causal))


def _errs_vs_sdpa(outs, q, k, v, g, causal):
    """Relative max-abs errors of (out, dq, dk, dv) against torch SDPA in fp32."""
    qs, ks, vs = (x.detach().float().requires_grad_() for x in (q, k, v))
    ref = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal)
    refs = (ref,) + torch.autograd.grad(ref, (qs, ks, vs), g.float())
    return {n: float((a.detach().float() - b.detach().float()).abs().max()
                     / b.detach().float().abs().max().clamp_min(1e-30))
            for n, a, b in zip(("out", "dq", "dk", "dv"), outs, refs)}


def probe_fully_masked(dev):
    """What torch SDPA returns for a query row that keeps no key, per dtype (for docs)."""
    res = {}
    for dname, dt in DTYPES.items():
        q = torch.randn(1, 2, 8, 64, device=dev, dtype=dt)
        m = torch.ones(8, 8, dtype=torch.bool, device=dev)
        m[3] = False
        try:
            o = F.scaled_dot_product_attention(q, q, q, attn_mask=m)
            row = o[0, 0, 3].float()
            res[dname] = "nan" if torch.isnan(row).any() else f"max|row|={float(row.abs().max())}"
        except Exception as e:  # noqa: BLE001 - recorded, not raised
            res[dname] = f"{type(e).__name__}: {e}"[:200]
    return res


def check(q, k, v, g, causal, backend):
    """Relative max-abs errors of the module's out/dq/dk/dv against torch SDPA (fp32 math)."""
    qa, ka, va = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out = at.attention(qa, ka, va, mask=Causal() if causal else None, backend=backend)
    agr = torch.autograd.grad(out, (qa, ka, va), g)
    return _errs_vs_sdpa((out,) + agr, q, k, v, g, causal)


def run(args, on_row=lambda rows: None):
    dev = torch.device(args.device)
    rows = []
    for dname in args.dtypes:
        dt = DTYPES[dname]
        for S in args.seqs:
            for causal in (False, True):
                torch.manual_seed(0)
                B, H, D = args.batch, args.heads, args.head_dim
                q, k, v, g = (torch.randn(B, H, S, D, device=dev, dtype=dt) for _ in range(4))
                flops = 3.5 * 4 * B * H * S * S * D * (0.5 if causal else 1.0)
                fns, be_name = variants(q, k, v, g, causal, args.backend)
                row = dict(dtype=dname, B=B, H=H, S=S, D=D, causal=causal, backend=be_name,
                           flops=flops, inner=args.inner)
                graph = gouts = None
                if args.graph:   # a failed capture is recorded (and printed), not fatal
                    try:
                        graph, gouts = graph_step(q, k, v, g, causal, args.backend)
                        fns["module_graph"] = graph.replay
                    except Exception as e:  # noqa: BLE001
                        row["graph_error"] = f"{type(e).__name__}: {e}"[:400]
                        print(f"S={S} causal={int(causal)}: CUDA graph capture failed: "
                              f"{row['graph_error']}", flush=True)
                        torch.cuda.synchronize()
                if S <= args.check_max_s:
                    row["err_vs_sdpa"] = check(q, k, v, g, causal, args.backend)
                if graph is not None:
                    row.update(graph_bits(graph, gouts, q, k, v, g, causal, args.backend))
                times = time_round_robin(fns, dev, args.reps, args.warmup, args.budget,
                                         args.inner)
                for name, ts in times.items():
                    med = statistics.median(ts)
                    row[f"{name}_ms"] = med * 1e3
                    row[f"{name}_min_ms"] = min(ts) * 1e3
                    row[f"{name}_n"] = len(ts)
                    row[f"{name}_tflops"] = flops / med / 1e12
                for tag, key in (("", "ms"), ("_min", "min_ms")):
                    row[f"overhead_vs_kernel{tag}"] = (row[f"module_{key}"]
                                                       / row[f"kernel_{key}"] - 1)
                    row[f"overhead_vs_api{tag}"] = row[f"module_{key}"] / row[f"api_{key}"] - 1
                    row[f"overhead_ops_vs_kernel{tag}"] = (row[f"module_ops_{key}"]
                                                           / row[f"kernel_{key}"] - 1)
                    if graph is not None:
                        row[f"overhead_graph_vs_kernel{tag}"] = (
                            row[f"module_graph_{key}"] / row[f"kernel_{key}"] - 1)
                del graph, gouts, fns   # the graph's memory pool goes with them
                rows.append(row)
                on_row(rows)
                print(f"{dname} S={S:5d} causal={int(causal)} {be_name}: kernel "
                      f"{row['kernel_ms']:.2f} api {row['api_ms']:.2f} module "
                      f"{row['module_ms']:.2f} sdpa {row['sdpa_ms']:.2f} ms; overhead "
                      f"{100 * row['overhead_vs_kernel']:+.1f}% vs kernel (min "
                      f"{100 * row['overhead_vs_kernel_min']:+.1f}%; through the ops "
                      f"{100 * row['overhead_ops_vs_kernel']:+.1f}%"
                      + (f"; graph: {row['module_graph_ms']:.2f} ms, "
                         f"{100 * row['overhead_graph_vs_kernel']:+.1f}% vs kernel, same "
                         f"bits {row['graph_same_bits']} (eager repeat {row['eager_repeat_same_bits']}, "
                         f"replay errs {row['graph_err_vs_sdpa']})" if "module_graph_ms" in row else "")
                      + "); "
                      f"{row['module_tflops'] * 1e3:.1f} GFLOP/s; errs "
                      f"{row.get('err_vs_sdpa')}", flush=True)
    return rows


def machine(dev):
    info = dict(python=platform.python_version(), torch=torch.__version__,
                platform=platform.platform(), processor=platform.processor(),
                threads=torch.get_num_threads())
    if dev.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
    return info


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    keys = sorted({(r["dtype"], r["causal"]) for r in rows})
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 3.6), squeeze=False)
    for ax, (dt, causal) in zip(axes[0], keys):
        sel = [r for r in rows if r["dtype"] == dt and r["causal"] == causal]
        xs = [r["S"] for r in sel]
        for name in ("module", "api", "kernel", "sdpa"):
            ax.plot(xs, [r[f"{name}_tflops"] * 1e3 for r in sel], marker="o",
                    label={"module": "anyattn.torch", "api": "anyattn core API",
                           "kernel": "backend kernels", "sdpa": "torch SDPA"}[name])
        ax.set_xscale("log", base=2)
        ax.set_xlabel("S")
        ax.set_ylabel("fwd+bwd GFLOP/s (FA convention)")
        ax.set_title(f"{dt}{' causal' if causal else ''}, B={sel[0]['B']} H={sel[0]['H']} "
                     f"D={sel[0]['D']}")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--dtypes", nargs="+", default=["fp32"], choices=sorted(DTYPES))
    ap.add_argument("--seqs", nargs="+", type=int, default=[256, 512, 1024, 2048])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--budget", type=float, default=6.0, help="seconds per variant and size")
    ap.add_argument("--check-max-s", type=int, default=2048)
    ap.add_argument("--inner", type=int, default=1,
                    help="steps per timed sample, back to back (1: one isolated step)")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads for torch and the numpy backend (default: all cores)")
    ap.add_argument("--graph", action="store_true",
                    help="also time one CUDA-graph replay of the module step (CUDA only)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--png", default=None)
    args = ap.parse_args(argv)
    if args.graph and args.device != "cuda":
        ap.error("--graph needs --device cuda (CUDA graphs)")
    if args.threads:
        torch.set_num_threads(args.threads)
        os.environ["ANYATTN_NUMPY_THREADS"] = str(args.threads)  # read when numpy is loaded
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    doc = dict(bench="torch_module_bench", date=datetime.now(timezone.utc).isoformat(),
               machine=machine(torch.device(args.device)), args=vars(args),
               load_average_1min_at_start=load,
               flop_convention="fwd 4*B*H*S*S*D, bwd 2.5x, causal 0.5x; step = fwd+bwd",
               sdpa_fully_masked_row=probe_fully_masked(torch.device(args.device)),
               rows=[])

    def save(rows):  # after every row, so a run cut short keeps what it measured
        doc["rows"] = rows
        if args.out:
            Path(args.out).parent.mkdir(parents=True, exist_ok=True)
            Path(args.out).write_text(json.dumps(doc, indent=1))

    rows = run(args, save)
    if args.out:
        print(f"wrote {args.out}")
    if args.png:
        plot(rows, args.png)
        print(f"wrote {args.png}")


if __name__ == "__main__":
    main()
