"""Shared plumbing of the GPU feature benches (gpu_dropout_bench, gpu_modifiers_bench):
timing, result rows, inputs, the error measure and the phase loop that rewrites the JSON
after every phase.

Shape legend: B batch, H heads, S sequence, D head dim.  FLOPs by the FlashAttention
convention: forward 4*B*H*S*S*D, backward 2.5x the forward, causal 1/2.
"""
from __future__ import annotations

import json
import os
import time
import traceback

__all__ = ["Harness", "fa_flops", "log", "rel"]


def log(*a):
    print(*a, flush=True)


def fa_flops(b, h, s, d, causal):
    f = 4.0 * b * h * s * s * d
    return f / 2 if causal else f


def rel(got, ref):
    """Largest error over the finite reference entries, relative to their largest
    magnitude; NaN where the result has a NaN there."""
    import torch

    got, ref = got.double(), ref.double()
    fin = torch.isfinite(ref)
    if not bool(fin.any()):
        return 0.0
    if bool(torch.isnan(got[fin]).any()):
        return float("nan")
    return float((got[fin] - ref[fin]).abs().max() / ref[fin].abs().max().clamp_min(1e-300))


class Harness:
    """One bench run's state: the results dict ({"meta", "check", "bench", "summary",
    ...}), the device, and ``tiny`` (a CPU dry run through Triton's interpreter: one
    untimed call stands for a measurement)."""

    def __init__(self, results: dict):
        self.results = results
        self.tiny = False
        self.dev = "cuda"
        self._save = None

    def save_now(self):
        if self._save is not None:
            self._save()

    def bench_ms(self, fn, rep=60):
        import triton

        if self.tiny:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        return triton.testing.do_bench(fn, warmup=15, rep=rep, return_mode="median")

    def record(self, impl, variant, dt, causal, fwd, bwd, shape, err=None, extra=None):
        """Append a timing row (or an error row) to results["bench"] and save."""
        b, h, s, d = shape
        row = dict(impl=impl, variant=variant, dtype=dt, causal=causal, B=b, H=h, S=s, D=d)
        if err is not None:
            row["error"] = err[:300]
        else:
            ff = fa_flops(b, h, s, d, causal)
            row.update(fwd_ms=round(fwd, 4), bwd_ms=round(bwd, 4),
                       total_ms=round(fwd + bwd, 4), fwd_tflops=round(ff / fwd / 1e9, 1),
                       bwd_tflops=round(2.5 * ff / bwd / 1e9, 1))
        if extra:
            row.update(extra)
        self.results["bench"].append(row)
        log("BENCH", json.dumps(row))
        self.save_now()
        return row

    def inputs(self, shape, dt, gen):
        """q, k, v, dout: [B, H, S, D] standard normal in dtype dt."""
        import torch

        b, h, s, d = shape
        return [torch.randn(b, h, s, d, generator=gen, device=self.dev,
                            dtype=torch.float32).to(dt) for _ in range(4)]

    def time_autograd(self, attn, q, k, v, g, params=()):
        """(forward ms, backward ms) of attn(q, k, v) through torch autograd; params are
        extra leaves whose gradients the backward also computes."""
        import torch

        qq, kk, vv = (x.detach().requires_grad_(True) for x in (q, k, v))
        fwd = self.bench_ms(lambda: attn(qq, kk, vv))
        o = attn(qq, kk, vv)
        bwd = self.bench_ms(lambda: torch.autograd.grad(o, (qq, kk, vv) + tuple(params), g,
                                                        retain_graph=True))
        return fwd, bwd

    def meta(self, **extra):
        """Fill results["meta"] with the versions, the device and the date, plus extra."""
        import torch
        import triton

        self.results["meta"].update(
            torch=torch.__version__, triton=triton.__version__,
            device=torch.cuda.get_device_name() if self.dev == "cuda" else "cpu",
            cuda=torch.version.cuda, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            flops="FA convention: fwd 4*B*H*S*S*D, bwd 2.5x fwd, causal 1/2",
            timing="triton.testing.do_bench medians (CUDA events), same process", **extra)
        log(json.dumps(self.results["meta"]))

    def run_phases(self, phases: dict, names, out_dir: str, name: str, summarize) -> None:
        """Run the named phases in order (a failing phase is printed and the next runs),
        rewriting out_dir/name (the results with summarize()'s summary) after each."""
        os.makedirs(out_dir, exist_ok=True)
        t0 = time.time()
        path = os.path.join(out_dir, name)

        def save():
            self.results["meta"]["elapsed_s"] = round(time.time() - t0, 1)
            summarize()
            with open(path, "w") as fh:
                json.dump(self.results, fh, indent=1)

        self._save = save
        for ph in names:
            try:
                phases[ph]()
            except Exception:  # noqa: BLE001
                traceback.print_exc()
            save()
            log(f"phase {ph} done at {time.time() - t0:.0f}s")
        log("SUMMARY", json.dumps(self.results["summary"], indent=1))
        bad = [r for r in self.results["check"] if not r.get("ok")]
        log(f"checks: {len(self.results['check']) - len(bad)} ok, {len(bad)} failed")
