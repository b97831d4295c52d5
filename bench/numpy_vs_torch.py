"""Paired, interleaved timing of the NumPy backend against torch's CPU SDPA.

Each round times every implementation once, forward then backward, in alternating
order (A B C, then C B A, ...), so that load from other processes hits them alike;
per round the speed ratio torch_time / impl_time is formed, and the median over the
rounds is reported (forward, backward, forward + backward).  The 1-minute load
average is recorded before and after every case.

Implementations: ``anyattn`` (the package on ``sys.path``), ``torch`` (SDPA,
``.backward``), and optionally ``before``: the package as of a git revision
(``--before REV``), exported by :func:`export_revision` under another name, for
before/after comparisons in one process.

FLOPs by the FlashAttention convention: fwd 4·B·H·S²·D, bwd 2.5x, causal ½.

Usage::

    python bench/numpy_vs_torch.py --rounds 15 --json dev/perf/x.json --plot x.png
    python bench/numpy_vs_torch.py --threads 1          # one worker, BLAS and torch at 1
    python bench/numpy_vs_torch.py --before HEAD~3      # also the package as of HEAD~3
"""
from __future__ import annotations

import argparse
import datetime as _dt
import importlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Callable, Dict, List, Tuple

import numpy as np

SHAPES = ((1, 8, 2048, 64), (1, 4, 4096, 128))


def export_revision(rev: str, name: str = "anyattn_before"):
    """The package ``src/anyattn`` as of git revision ``rev``, importable as ``name``.

    ``git archive`` into a temporary folder, renamed; the registry's backend paths
    (strings such as ``"anyattn.backends.numpy_backend:NumpyBackend"``) are rewritten
    too, else the old copy would load today's backends.  Returns the module."""
    root = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True,
                          text=True, check=True).stdout.strip()
    tmp = tempfile.mkdtemp(prefix="anyattn-before-")
    tar = subprocess.run(["git", "-C", root, "archive", rev, "src/anyattn"],
                         capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", tmp], input=tar, check=True)
    pkg = os.path.join(tmp, name)
    os.rename(os.path.join(tmp, "src", "anyattn"), pkg)
    for d, _, files in os.walk(pkg):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(d, f)
                with open(path) as fh:
                    text = fh.read()
                new = text.replace('"anyattn.', f'"{name}.')
                if new != text:
                    with open(path, "w") as fh:
                        fh.write(new)
    sys.path.insert(0, tmp)
    return importlib.import_module(name)


def _flops(B, H, S, D, causal, what):
    f = 4.0 * B * H * S * S * D * (0.5 if causal else 1.0)
    return f * {"fwd": 1.0, "bwd": 2.5, "total": 3.5}[what]


def _anyattn_impl(mod, q, k, v, g, causal: bool, threads: int) -> Callable[[], Tuple[float, float]]:
    from importlib import import_module

    reg = import_module(mod.__name__ + ".backends.registry")
    nb = import_module(mod.__name__ + ".backends.numpy_backend")
    be = reg.get_backend("numpy")
    if threads:
        be.config = nb.NumpyConfig(threads=threads)
    mask = mod.Causal() if causal else None

    def run() -> Tuple[float, float]:
        t0 = time.perf_counter()
        out, lse = mod.attention(q, k, v, mask=mask, return_lse=True, backend="numpy")
        t1 = time.perf_counter()
        mod.attention_backward(q, k, v, g, out=out, lse=lse, mask=mask, backend="numpy")
        return t1 - t0, time.perf_counter() - t1
    return run


def _torch_impl(q, k, v, g, causal: bool) -> Callable[[], Tuple[float, float]]:
    import torch
    import torch.nn.functional as F

    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    tg = torch.from_numpy(g)

    def run() -> Tuple[float, float]:
        for t in (tq, tk, tv):
            t.grad = None
        t0 = time.perf_counter()
        o = F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal)
        t1 = time.perf_counter()
        o.backward(tg)
        return t1 - t0, time.perf_counter() - t1
    return run


def run_case(shape, causal: bool, impls: Dict[str, Callable], rounds: int) -> Dict:
    for f in impls.values():                         # warm-up (pools, caches)
        f()
    names = list(impls)
    times: Dict[str, List[Tuple[float, float]]] = {n: [] for n in names}
    load0 = os.getloadavg()[0]
    for r in range(rounds):
        for n in (names if r % 2 == 0 else names[::-1]):
            time.sleep(0.02)
            times[n].append(impls[n]())
    load1 = os.getloadavg()[0]
    B, H, S, D = shape
    res = {"shape": list(shape), "causal": causal, "rounds": rounds,
           "load_before": load0, "load_after": load1, "impls": {}}
    tt = times["torch"]
    for n in names:
        ts = times[n]
        tot = [a + b for a, b in ts]
        entry = {"fwd_ms_median": 1e3 * statistics.median(a for a, _ in ts),
                 "bwd_ms_median": 1e3 * statistics.median(b for _, b in ts),
                 "total_ms_median": 1e3 * statistics.median(tot),
                 "total_ms_min": 1e3 * min(tot),
                 "total_gflops_median": _flops(B, H, S, D, causal, "total") /
                 statistics.median(tot) / 1e9,
                 "times_ms": [[1e3 * a, 1e3 * b] for a, b in ts]}
        entry["speed_vs_torch"] = {
            "fwd": statistics.median(x[0] / y[0] for x, y in zip(tt, ts)),
            "bwd": statistics.median(x[1] / y[1] for x, y in zip(tt, ts)),
            "total": statistics.median((x[0] + x[1]) / (y[0] + y[1]) for x, y in zip(tt, ts))}
        res["impls"][n] = entry
    return res


def _plot(cases: List[Dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [n for n in cases[0]["impls"] if n != "torch"]
    labels = [f"({','.join(map(str, c['shape']))}){' causal' if c['causal'] else ''}"
              for c in cases]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5), sharey=True)
    w = 0.8 / max(1, len(names))
    for ax, what in zip(axes, ("fwd", "bwd", "total")):
        for j, n in enumerate(names):
            ys = [c["impls"][n]["speed_vs_torch"][what] for c in cases]
            xs = [i + (j - (len(names) - 1) / 2) * w for i in range(len(cases))]
            bars = ax.bar(xs, ys, w, label=n)
            for bx, by in zip(bars, ys):
                ax.text(bx.get_x() + bx.get_width() / 2, by, f"{by:.2f}", ha="center",
                        va="bottom", fontsize=8)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xticks(range(len(cases)))
        ax.set_xticklabels(labels, fontsize=7, rotation=15)
        ax.set_title({"fwd": "forward", "bwd": "backward", "total": "forward + backward"}[what])
    axes[0].set_ylabel("speed vs torch SDPA (median of paired rounds; >1 = faster)")
    axes[0].legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--threads", type=int, default=0,
                    help="0: defaults (pool per CPU, torch's own); n: numpy workers n, "
                         "torch threads n, BLAS limited to 1 thread when n == 1")
    ap.add_argument("--before", default=None, metavar="REV",
                    help="also time the package as of git revision REV (export_revision)")
    ap.add_argument("--causal", choices=("both", "only", "off"), default="both")
    ap.add_argument("--shapes", nargs="+", default=None, metavar="B,H,S,D")
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None)
    a = ap.parse_args(argv)
    if a.threads == 1:
        from threadpoolctl import threadpool_limits

        threadpool_limits(1)
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    import anyattn

    mods = {"anyattn": anyattn}
    if a.before:
        mods = {"before": export_revision(a.before), **mods}
    shapes = [tuple(int(x) for x in s.split(",")) for s in a.shapes] if a.shapes else SHAPES
    causals = {"both": (False, True), "only": (True,), "off": (False,)}[a.causal]
    from anyattn.bench import machine_info

    report = {"date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
              "machine": machine_info(), "threads": a.threads or "default",
              "method": "paired interleaved rounds; speed = median over rounds of "
                        "torch_time / impl_time; FLOPs FA convention (fwd 4BHS^2D, bwd 2.5x, "
                        "causal 1/2)", "cases": []}
    rng = np.random.default_rng(0)
    for shape in shapes:
        q, k, v, g = (rng.standard_normal(shape).astype(np.float32) for _ in range(4))
        for causal in causals:
            impls = {n: _anyattn_impl(m, q, k, v, g, causal, a.threads) for n, m in mods.items()}
            impls["torch"] = _torch_impl(q, k, v, g, causal)
            c = run_case(shape, causal, impls, a.rounds)
            report["cases"].append(c)
            lab = f"{shape}{' causal' if causal else ''}"
            print(f"{lab}: load {c['load_before']:.2f}->{c['load_after']:.2f}", flush=True)
            for n, e in c["impls"].items():
                s = e["speed_vs_torch"]
                print(f"  {n:8s} fwd {e['fwd_ms_median']:7.1f} bwd {e['bwd_ms_median']:7.1f} "
                      f"ms  {e['total_gflops_median']:6.1f} GFLOP/s  vs torch: fwd "
                      f"{s['fwd']:.2f} bwd {s['bwd']:.2f} total {s['total']:.2f}", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    if a.plot:
        _plot(report["cases"], a.plot,
              f"NumPy backend vs torch CPU SDPA, fp32, {report['machine'].get('cpu', '')}, "
              f"threads {report['threads']}, {report['date'][:10]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
