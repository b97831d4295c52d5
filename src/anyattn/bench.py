"""``python -m anyattn bench``: time backends forward + backward, side by side.

FLOPs by the FlashAttention convention: forward 4·B·H·Sq·Sk·D, backward 2.5x
the forward, forward + backward 3.5x; a causal mask halves each.  Each of
``--repeats`` timed runs is one forward followed by one backward; the table
gives the medians over the runs of the forward time, the backward time and
the whole run's time (forward + backward of the same run), and GFLOP/s from
those medians; the JSON keeps every time and the fastest whole run too.  All
implementations of one case are timed in the same process, interleaved run by
run, so that load from elsewhere hits them alike; with ``--vs torch`` the table
also gives the *paired* ratio, the median over the rounds of torch's time /
this implementation's time in the same round.

As a yardstick the table is followed by this machine's NumPy matrix-product
rate (``gemm_yardstick``): attention's counted FLOPs are matrix products, so
that rate is about the most a CPU implementation built on them can reach.

``--vs torch`` adds torch's CPU ``scaled_dot_product_attention`` (forward +
``.backward``) on the same inputs.  ``--memory`` measures the peak extra
memory of one anyattn forward + backward at (1, 8, 8192, 64) with
``tracemalloc`` (which sees NumPy's allocations) against the size of one
dense [B, H, S, S] float32 score tensor.

Library use: ``add_arguments(parser)`` then ``run(args) -> exit code``.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

__all__ = ["add_arguments", "run", "flops", "Case", "Result", "DEFAULT_SHAPES",
           "MEMORY_SHAPE"]

#: the two shapes of the performance target, (B, H, S, D)
DEFAULT_SHAPES: Tuple[Tuple[int, int, int, int], ...] = ((1, 8, 2048, 64), (1, 4, 4096, 128))
MEMORY_SHAPE = (1, 8, 8192, 64)


def flops(B: int, H: int, Sq: int, Sk: int, D: int, causal: bool, what: str) -> float:
    """FA convention: 'fwd' 4·B·H·Sq·Sk·D, 'bwd' 2.5x, 'fwd+bwd' 3.5x; causal halves."""
    f = 4.0 * B * H * Sq * Sk * D * (0.5 if causal else 1.0)
    return f * {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[what]


@dataclass(frozen=True)
class Case:
    B: int
    H: int
    S: int
    D: int
    causal: bool
    dtype: str

    @property
    def label(self) -> str:
        return f"({self.B},{self.H},{self.S},{self.D}){' causal' if self.causal else ''}"


@dataclass
class Result:
    """One implementation on one case.  ``*_ms``: medians over the timed runs (``total_ms``
    of whole forward + backward runs, not a sum of two medians); GFLOP/s from them."""

    case: Dict
    impl: str
    fwd_ms: float
    bwd_ms: float
    total_ms: float
    fwd_gflops: float
    bwd_gflops: float
    total_gflops: float
    min_total_ms: float
    times_fwd_ms: List[float] = field(default_factory=list)
    times_bwd_ms: List[float] = field(default_factory=list)
    times_total_ms: List[float] = field(default_factory=list)
    #: torch's median total / this median total
    ratio_vs_torch: Optional[float] = None
    #: median over rounds of torch total / this total in the same round
    paired_ratio_vs_torch: Optional[float] = None
    max_abs_diff_vs_torch: Optional[float] = None


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _parse_shape(text: str) -> Tuple[int, int, int, int]:
    try:
        parts = tuple(int(x) for x in text.split(","))
    except ValueError:
        parts = ()
    if len(parts) != 4 or min(parts) < 1:
        raise argparse.ArgumentTypeError(
            f"shape {text!r}: expected four positive integers B,H,S,D (e.g. 1,8,2048,64)")
    return parts  # type: ignore[return-value]


DEFAULT_REPEATS = 3
DEFAULT_WARMUP = 1


def host_backends() -> Tuple[str, ...]:
    """The backends the benchmark can time: those that take NumPy arrays."""
    from .backends.registry import ENTRIES

    return tuple(n for n, e in ENTRIES.items() if "numpy" in e.array_kinds)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the bench options to ``parser`` (the ``bench`` sub-command)."""
    from .cli_args import int_at_least, out_path, seed_arg

    parser.add_argument("--shapes", nargs="+", type=_parse_shape, metavar="B,H,S,D",
                        default=None,
                        help="problem shapes (default: 1,8,2048,64 and 1,4,4096,128)")
    parser.add_argument("--causal", nargs="?", const="only", default="both",
                        choices=("both", "only", "off"),
                        help="causal and not (both, default), causal only (--causal), "
                             "or unmasked only (off)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "float64"),
                        help="input dtype (default float32)")
    parser.add_argument("--backend", nargs="+", default=["numpy"], choices=host_backends(),
                        help="anyattn backends to time, those that take NumPy arrays "
                             "(default: numpy)")
    parser.add_argument("--repeats", type=int_at_least(1), default=None,
                        help=f"timed runs per implementation and case (default "
                             f"{DEFAULT_REPEATS}); the table gives their median")
    parser.add_argument("--warmup", type=int_at_least(0), default=None,
                        help=f"untimed runs first (default {DEFAULT_WARMUP})")
    parser.add_argument("--vs", choices=("torch",), default=None,
                        help="also time torch's CPU scaled_dot_product_attention")
    parser.add_argument("--json", metavar="PATH", type=out_path, default=None,
                        help="write results as JSON (the directory must exist)")
    parser.add_argument("--plot", metavar="PATH", type=out_path, default=None,
                        help="write a PNG bar plot (needs matplotlib; the directory must exist)")
    parser.add_argument("--memory", action="store_true",
                        help="measure peak extra memory of fwd+bwd at (1,8,8192,64) instead "
                             "(--shapes overrides the shape)")
    parser.add_argument("--seed", type=seed_arg, default=0,
                        help="input seed, in [0, 2**64) (default 0)")


def usage_error(args: argparse.Namespace) -> Optional[str]:
    """None if ``args`` make a benchmark this machine can run, else one line naming the
    flag, what it accepts and the remedy (checked before any work)."""
    from .extras import installed

    from .backends.registry import ENTRIES
    from .cli_args import backend_unavailable

    names = host_backends()
    for b in args.backend:
        if b not in names:
            return f"argument --backend: {b!r} is not one of {', '.join(names)}"
    if len(set(args.backend)) < len(args.backend):
        return f"argument --backend: a backend is named twice in {' '.join(args.backend)}"
    if args.memory:
        for flag, used in (("--vs", args.vs is not None), ("--plot", args.plot is not None),
                           ("--repeats", args.repeats is not None),
                           ("--warmup", args.warmup is not None)):
            if used:
                return (f"argument {flag}: --memory does not use it (it measures one "
                        "forward + backward per shape, backend and mask); drop one of the two")
    for b in args.backend:
        if args.dtype not in ENTRIES[b].dtypes:
            return (f"argument --dtype: backend {b!r} takes "
                    f"{', '.join(sorted(ENTRIES[b].dtypes))}, got {args.dtype}")
    if args.vs == "torch" and not installed("torch"):
        return "argument --vs: torch is not installed: pip install 'anyattn[torch]'"
    if args.plot and not installed("matplotlib"):
        return "argument --plot: needs matplotlib, not installed: pip install 'anyattn[bench]'"
    for b in args.backend:
        why = backend_unavailable(b)
        if why is not None:
            return f"argument --backend: {b!r} cannot run here: {why}"
    return None


# ------------------------------------------------------------------ machine
def machine_info() -> Dict:
    """The machine and software the numbers come from."""
    info: Dict = {"python": platform.python_version(), "numpy": np.__version__,
                  "platform": platform.platform(), "cpu_count": os.cpu_count()}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    info["cpu"] = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        from .backends.blas_threads import blas_core_name, blas_library_path

        info["blas_library"] = blas_library_path()
        info["blas_core"] = blas_core_name()
    except Exception:  # pragma: no cover - informational only
        pass
    if hasattr(os, "getloadavg"):
        info["loadavg_at_start"] = list(os.getloadavg())
    # reported, not acted on: the variables that shaped this run, as set (settings.py
    # parses anyattn's own switches)
    info["env"] = {k: os.environ[k] for k in ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE",
                                              "OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                                              "ANYATTN_NUMPY_THREADS") if k in os.environ}
    try:
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    except ImportError:
        pass
    return info


# ------------------------------------------------------------------ timing
class _Impl:
    """One thing to time: make(case, arrays) -> (fwd(), bwd(state))."""

    name = "?"

    def prepare(self, case: Case, arrays):  # -> state
        raise NotImplementedError

    def fwd(self, state):
        raise NotImplementedError

    def bwd(self, state, fwd_out):
        raise NotImplementedError

    def output(self, state, fwd_out) -> np.ndarray:
        raise NotImplementedError


class _AnyattnImpl(_Impl):
    def __init__(self, backend: str):
        self.backend = backend
        self.name = f"anyattn-{backend}"

    def prepare(self, case, arrays):
        from .masks import Causal

        q, k, v, g = arrays
        return dict(q=q, k=k, v=v, g=g, mask=Causal() if case.causal else None)

    def fwd(self, st):
        from .api import attention

        return attention(st["q"], st["k"], st["v"], mask=st["mask"], return_lse=True,
                         backend=self.backend)

    def bwd(self, st, fo):
        from .api import attention_backward

        out, lse = fo
        return attention_backward(st["q"], st["k"], st["v"], st["g"], out=out, lse=lse,
                                  mask=st["mask"], backend=self.backend)

    def output(self, st, fo):
        return np.asarray(fo[0])


class _TorchImpl(_Impl):
    name = "torch-sdpa"

    def prepare(self, case, arrays):
        import torch

        q, k, v, g = (torch.from_numpy(np.ascontiguousarray(x)) for x in arrays)
        return dict(q=q.requires_grad_(), k=k.requires_grad_(), v=v.requires_grad_(), g=g,
                    causal=case.causal)

    def fwd(self, st):
        import torch.nn.functional as F

        for t in (st["q"], st["k"], st["v"]):
            t.grad = None
        return F.scaled_dot_product_attention(st["q"], st["k"], st["v"],
                                              is_causal=st["causal"])

    def bwd(self, st, fo):
        fo.backward(st["g"])
        return None

    def output(self, st, fo):
        return fo.detach().numpy()


def _make_arrays(case: Case, seed: int):
    rng = np.random.default_rng(seed)
    shape = (case.B, case.H, case.S, case.D)
    return tuple(rng.standard_normal(shape).astype(case.dtype) for _ in range(4))


def _time_case(case: Case, impls: Sequence[_Impl], repeats: int, warmup: int,
               seed: int, step: List[int], n_steps: int) -> List[Result]:
    arrays = _make_arrays(case, seed)
    states = [im.prepare(case, arrays) for im in impls]
    tf: List[List[float]] = [[] for _ in impls]
    tb: List[List[float]] = [[] for _ in impls]
    tt: List[List[float]] = [[] for _ in impls]   # whole runs: forward + backward together
    outs: List[Optional[np.ndarray]] = [None] * len(impls)
    for r in range(warmup + repeats):
        timed = r >= warmup
        for i, (im, st) in enumerate(zip(impls, states)):
            step[0] += 1 if timed else 0
            tag = f"run {r - warmup + 1}/{repeats}" if timed else "warm-up"
            _progress(f"[{step[0]}/{n_steps}] {case.label} {case.dtype} {im.name}: {tag}")
            time.sleep(0.05)  # let another library's spinning worker threads go idle
            t0 = time.perf_counter()
            fo = im.fwd(st)
            t1 = time.perf_counter()
            im.bwd(st, fo)
            t2 = time.perf_counter()
            if timed:
                tf[i].append((t1 - t0) * 1e3)
                tb[i].append((t2 - t1) * 1e3)
                tt[i].append((t2 - t0) * 1e3)
            if outs[i] is None:
                outs[i] = im.output(st, fo)
    results = []
    for i, im in enumerate(impls):
        f, b, t = (float(np.median(x)) for x in (tf[i], tb[i], tt[i]))
        results.append(Result(
            case=asdict(case), impl=im.name, fwd_ms=f, bwd_ms=b, total_ms=t,
            fwd_gflops=flops(case.B, case.H, case.S, case.S, case.D, case.causal, "fwd") / f / 1e6,
            bwd_gflops=flops(case.B, case.H, case.S, case.S, case.D, case.causal, "bwd") / b / 1e6,
            total_gflops=flops(case.B, case.H, case.S, case.S, case.D, case.causal,
                               "fwd+bwd") / t / 1e6,
            min_total_ms=min(tt[i]), times_fwd_ms=tf[i], times_bwd_ms=tb[i],
            times_total_ms=tt[i]))
    torch_i = next((i for i, im in enumerate(impls) if im.name == "torch-sdpa"), None)
    if torch_i is not None:
        for i, res in enumerate(results):
            res.ratio_vs_torch = results[torch_i].total_ms / res.total_ms
            res.paired_ratio_vs_torch = float(np.median(
                [x / y for x, y in zip(tt[torch_i], tt[i])]))
            res.max_abs_diff_vs_torch = float(np.max(np.abs(
                outs[i].astype(np.float64) - outs[torch_i].astype(np.float64))))
    return results


def gemm_yardstick(dtype: str, n: int = 1024, repeats: int = 5) -> Dict:
    """This machine's NumPy matrix-product rate: ``n`` x ``n`` @ ``n`` x ``n`` in
    ``dtype``, the fastest of ``repeats`` timed products after one untimed one."""
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((n, n)).astype(dtype) for _ in range(2))
    a @ b
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t0)
    return {"n": n, "dtype": dtype, "ms": best * 1e3, "gflops": 2.0 * n ** 3 / best / 1e9,
            "statistic": f"fastest of {repeats}"}


# ------------------------------------------------------------------ output
def _table(results: Sequence[Result], gemm_gflops: Optional[float] = None) -> str:
    """Times are medians over the timed runs; 'f+b' is the whole forward + backward run."""
    has_ratio = any(r.ratio_vs_torch is not None for r in results)
    head = (f"{'case':<30} {'impl':<16} {'fwd ms med':>10} {'bwd ms med':>10} "
            f"{'f+b ms med':>10} {'fwd GF/s':>9} {'bwd GF/s':>9} {'f+b GF/s':>9}"
            + (f" {'of GEMM':>7}" if gemm_gflops else "")
            + (f" {'vs torch':>8} {'paired':>7}" if has_ratio else ""))
    lines = [head, "-" * len(head)]
    for r in results:
        c = Case(**r.case)
        line = (f"{c.label + ' ' + c.dtype:<30} {r.impl:<16} {r.fwd_ms:10.1f} {r.bwd_ms:10.1f} "
                f"{r.total_ms:10.1f} {r.fwd_gflops:9.1f} {r.bwd_gflops:9.1f} "
                f"{r.total_gflops:9.1f}")
        if gemm_gflops:
            line += f" {100 * r.total_gflops / gemm_gflops:6.0f}%"
        if r.ratio_vs_torch is not None:
            line += f" {r.ratio_vs_torch:7.2f}x {r.paired_ratio_vs_torch:6.2f}x"
        lines.append(line)
    return "\n".join(lines)


def _legend(repeats: int, warmup: int, gemm: Dict, has_torch: bool) -> str:
    """What the table's numbers mean, printed under it."""
    lines = [
        f"ms med: median of {repeats} timed run(s) after {warmup} untimed; each run is one "
        "forward then one backward, and f+b is the whole run's time.",
        "GF/s: FlashAttention FLOP count (fwd 4*B*H*S*S*D, bwd 2.5x, causal half) / the "
        "median time.",
        f"yardstick: NumPy {gemm['dtype']} matrix product {gemm['n']}x{gemm['n']} @ "
        f"{gemm['n']}x{gemm['n']} runs at {gemm['gflops']:.1f} GFLOP/s here "
        f"({gemm['statistic']}); 'of GEMM' = f+b GF/s / that rate.",
    ]
    if has_torch:
        lines.append("vs torch: torch's median f+b time / this one's; paired: median over "
                     "the runs of the same ratio within each run.")
    else:
        from .extras import installed

        how = ("add --vs torch" if installed("torch")
               else "pip install 'anyattn[torch]' and add --vs torch")
        lines.append(f"for torch's CPU scaled_dot_product_attention side by side: {how}.")
    return "\n".join(lines)


def _plot(results: Sequence[Result], path: str, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as e:
        from .extras import import_error

        _progress(f"no plot written: {import_error('matplotlib', 'bench', e)}")
        return False
    cases: List[str] = []
    impls: List[str] = []
    for r in results:
        lab = Case(**r.case).label
        if lab not in cases:
            cases.append(lab)
        if r.impl not in impls:
            impls.append(r.impl)
    val = {(Case(**r.case).label, r.impl): r.total_gflops for r in results}
    fig, ax = plt.subplots(figsize=(max(6, 1.8 * len(cases) + 2), 4.5))
    w = 0.8 / max(1, len(impls))
    for j, im in enumerate(impls):
        xs = [i + (j - (len(impls) - 1) / 2) * w for i in range(len(cases))]
        ys = [val.get((c, im), 0.0) for c in cases]
        bars = ax.bar(xs, ys, w, label=im)
        for bx, by in zip(bars, ys):
            ax.text(bx.get_x() + bx.get_width() / 2, by, f"{by:.0f}", ha="center",
                    va="bottom", fontsize=8)
    ax.set_xticks(range(len(cases)))
    ax.set_xticklabels(cases, fontsize=9)
    ax.set_ylabel("fwd+bwd GFLOP/s, median run (FA convention, causal ½)")
    ax.set_title(title, fontsize=10)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ------------------------------------------------------------------ memory
def measure_memory(shape=MEMORY_SHAPE, causal: bool = False, dtype: str = "float32",
                   backend: str = "numpy", seed: int = 0) -> Dict:
    """Peak bytes allocated during one forward + backward, beyond the inputs.

    ``outputs_bytes``: what the results themselves take (out, lse, dq, dk, dv);
    ``workspace_bytes`` = peak extra - outputs.  ``dense_scores_bytes``: one
    [B, H, S, S] float32 score tensor, what a dense implementation needs per
    intermediate.
    """
    import tracemalloc

    from .api import attention, attention_backward
    from .masks import Causal

    B, H, S, D = shape
    case = Case(B, H, S, D, causal, dtype)
    q, k, v, g = _make_arrays(case, seed)
    mask = Causal() if causal else None
    tracemalloc.start()
    tracemalloc.reset_peak()
    base = tracemalloc.get_traced_memory()[0]
    t0 = time.perf_counter()
    out, lse = attention(q, k, v, mask=mask, return_lse=True, backend=backend)
    grads = attention_backward(q, k, v, g, out=out, lse=lse, mask=mask, backend=backend)
    elapsed = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    outputs = sum(int(np.asarray(x).nbytes) for x in (out, lse, grads.dq, grads.dk, grads.dv))
    extra = peak - base
    dense = B * H * S * S * 4
    return {"shape": list(shape), "causal": causal, "dtype": dtype, "backend": backend,
            "peak_extra_bytes": int(extra), "outputs_bytes": outputs,
            "workspace_bytes": int(extra - outputs), "dense_scores_bytes": dense,
            "peak_over_dense": extra / dense, "seconds": elapsed,
            "method": "tracemalloc (NumPy allocations), peak minus the bytes before the call"}


# ------------------------------------------------------------------ main
def run(args: argparse.Namespace) -> int:
    """Run the benchmark described by ``args``; print a table; 0 on success, 2 (and one
    line on stderr) for arguments it cannot run."""
    why = usage_error(args)
    if why is not None:
        print(f"error: {why}", file=sys.stderr)
        return 2
    repeats = DEFAULT_REPEATS if args.repeats is None else args.repeats
    warmup = DEFAULT_WARMUP if args.warmup is None else args.warmup
    date = _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    report: Dict = {"date": date, "machine": machine_info(),
                    "convention": "FlashAttention: fwd 4*B*H*Sq*Sk*D, bwd 2.5x, fwd+bwd 3.5x, "
                                  "causal 0.5x; *_ms and GFLOP/s from the median over the "
                                  "timed runs (total: whole forward + backward runs)"}

    if args.memory:
        shapes = args.shapes or [MEMORY_SHAPE]
        mems = []
        for shp in shapes:
            for causal in _causal_list(args.causal, default_off=True):
                for backend in args.backend:
                    _progress(f"memory: {shp} {'causal ' if causal else ''}{backend} ...")
                    m = measure_memory(shp, causal, args.dtype, backend, args.seed)
                    mems.append(m)
                    print(f"{str(tuple(shp)):<20} {'causal' if causal else 'full':<7} "
                          f"{backend}: peak extra {m['peak_extra_bytes'] / 2**20:8.1f} MiB "
                          f"(outputs {m['outputs_bytes'] / 2**20:.1f} MiB, workspace "
                          f"{m['workspace_bytes'] / 2**20:.1f} MiB) vs dense scores "
                          f"{m['dense_scores_bytes'] / 2**30:.2f} GiB = "
                          f"{100 * m['peak_over_dense']:.2f}%, {m['seconds']:.1f} s")
        report["memory"] = mems
        _write_json(args.json, report)
        return 0

    impls: List[_Impl] = [_AnyattnImpl(b) for b in args.backend]
    if args.vs == "torch":
        impls.append(_TorchImpl())
    cases = [Case(*shp, causal, args.dtype) for shp in (args.shapes or DEFAULT_SHAPES)
             for causal in _causal_list(args.causal)]
    n_steps = len(cases) * len(impls) * repeats
    step = [0]
    results: List[Result] = []
    for case in cases:
        results += _time_case(case, impls, repeats, warmup, args.seed, step, n_steps)
    gemm = gemm_yardstick(args.dtype)
    print(_table(results, gemm["gflops"]))
    print(_legend(repeats, warmup, gemm, args.vs == "torch"))
    report["gemm_yardstick"] = gemm
    report["repeats"], report["warmup"] = repeats, warmup
    report["results"] = [asdict(r) for r in results]
    if hasattr(os, "getloadavg"):
        report["machine"]["loadavg_at_end"] = list(os.getloadavg())
    _write_json(args.json, report)
    if args.plot:
        core = report["machine"].get("blas_core")
        title = (f"attention fwd+bwd, {args.dtype}, {report['machine'].get('cpu', 'CPU')} "
                 f"x{os.cpu_count()}" + (f", OpenBLAS {core}" if core else "") + f", {date[:10]}")
        if _plot(results, args.plot, title):
            _progress(f"plot written to {args.plot}")
    return 0


def _causal_list(mode: str, default_off: bool = False) -> List[bool]:
    if mode == "only":
        return [True]
    if mode == "off" or (default_off and mode == "both"):
        return [False]
    return [False, True]


def _write_json(path: Optional[str], report: Dict) -> None:
    if not path:
        return
    with open(path, "w") as f:
        json.dump(report, f, indent=2)
    _progress(f"JSON written to {path}")
