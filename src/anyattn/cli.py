"""Command line: ``python -m anyattn info | check | bench`` (``--version``).

info   which backends can run here and, for each that cannot, why; which arrays
       automatic dispatch gives each; --settings: every environment switch with its
       value in effect (docs/settings.md); --route B,Hq,Hkv,Sq,Sk,D[,Dv] --cc 9.0: the
       Triton route (Hopper or portable, which config, why) of forward and backward
check  forward + backward of one problem on one backend vs the float64 reference;
       exit status 1 on a mismatch
bench  time backends on a set of shapes (see anyattn.bench)
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import time
from typing import List, Optional, Tuple

import numpy as np

from . import settings
from .cli_args import backend_unavailable, seed_arg

__all__ = ["main"]

TOLERANCE = {"float64": 1e-12, "float32": 1e-5, "float16": 3e-3, "bfloat16": 2e-2}
TF32_TOLERANCE = 3e-4


#: --mask of ``info --route``: the mask classes (Problem.mask_class) and the names of
#: ``check --mask`` that map onto them
_ROUTE_MASKS = {"causal": "band", "causal_br": "band", "sliding": "band", "window": "band"}
_ROUTE_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32",
                 "bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


def _route_shape(text: str) -> Tuple[int, ...]:
    try:
        dims = tuple(int(x) for x in text.split(","))
    except ValueError:
        dims = ()
    if len(dims) not in (6, 7) or min(dims) < 0 or min(dims[:3] + dims[5:]) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected B,Hq,Hkv,Sq,Sk,D or B,Hq,Hkv,Sq,Sk,D,Dv (six or seven "
            "integers, B, Hq, Hkv, D, Dv >= 1; Dv: v's head dim, D unless given)")
    return dims


def _capability_arg(text: str) -> Tuple[int, int]:
    try:
        major, minor = (int(x) for x in text.split("."))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a compute capability "
                                         "MAJOR.MINOR, e.g. 9.0") from None
    return major, minor


def _print_route(args) -> int:
    """``info --route``: the Triton route of forward and backward from the flags' facts."""
    from .backends.triton import route as triton_route

    b, hq, hkv, sq, sk, d = args.route[:6]
    dv = args.route[6] if len(args.route) == 7 and args.route[6] != d else None
    mask = _ROUTE_MASKS.get(args.mask.split(":")[0], args.mask)
    feats = frozenset(f for f in args.features.split(",") if f)
    grads = "score_mod_grad" in feats            # a capture gradient: a score function's
    feats = (feats - {"score_mod_grad"}) | ({"score_mod"} if grads else frozenset())
    problem = triton_route.ProblemFacts(batch=b, heads_q=hq, heads_kv=hkv, seq_q=sq,
                                        seq_k=sk, head_dim=d, dtype=_ROUTE_DTYPES[args.dtype],
                                        mask_class=mask, features=feats,
                                        precision=args.precision, head_dim_v=dv,
                                        capture_grads=grads)
    sms = args.sms if args.sms is not None else 132
    device = triton_route.DeviceFacts("cuda", args.cc, sms)
    print(f"problem: {problem}")
    print(f"device: {device}" + ("" if args.sms is not None else
                                 "  (--sms not given: 132, an H100 SXM's)"))
    print(f"settings: ANYATTN_TRITON_PATH={settings.current().triton_path}")
    for direction in triton_route.DIRECTIONS:
        try:
            print(triton_route.route(problem, direction, device).describe())
        except NotImplementedError as e:
            print(f"{direction}: error: {e}")
    return 0


def _cmd_info(args) -> int:
    if getattr(args, "settings", False):
        print("anyattn settings (environment variables, docs/settings.md):")
        print(settings.describe())
        if args.route is None:
            return 0
    if args.route is not None:
        return _print_route(args)
    from . import __version__
    from .backends.registry import ENTRIES, auto_array_kinds, describe_backends, get_backend

    print(f"anyattn {__version__}")
    print(f"python {sys.version.split()[0]}, numpy {np.__version__}")
    for st in describe_backends():
        name, why = st
        if st.state == "installed":     # not loaded: nothing heavy imported to say so
            print(f"  {name:10s} installed, not yet loaded ({ENTRIES[name].dispatch}): "
                  f"{st.detail}")
        elif why is None:
            be = get_backend(name)
            c = be.capabilities
            extra = getattr(be, "describe_device", lambda: "")()
            kinds = sorted(auto_array_kinds(name) & c.array_kinds)
            auto = (f" (automatic for {', '.join(kinds)} arrays)"
                    if kinds and c.auto and be.auto_eligible()
                    else " (only when named: backend=%r)" % name)
            print(f"  {name:10s} available{auto}: dtypes {sorted(c.dtypes)}, "
                  f"arrays {sorted(c.array_kinds)} on {sorted(c.device_types)}"
                  + (f"; {extra}" if extra else ""))
        else:
            print(f"  {name:10s} unavailable: {why}")
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse with a usage error on one line, ``anyattn check: error: ...``, exit status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message}\n")


class UsageError(Exception):
    """A bad command-line argument found after parsing; ``main`` reports it as argparse does."""


def _ints(text: str) -> Optional[List[int]]:
    try:
        return [int(x) for x in text.split(",")]
    except ValueError:
        return None


def _parse_shape(text: str) -> Tuple[int, int, int, int, int, int]:
    """argparse type of ``check --shape``: B,H,S,D or B,Hq,Hkv,Sq,Sk,D, positive integers."""
    parts = _ints(text)
    if parts is None or len(parts) not in (4, 6) or min(parts) < 1:
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected positive integers B,H,S,D or B,Hq,Hkv,Sq,Sk,D "
            "(e.g. 1,4,256,64)")
    if len(parts) == 4:
        b, h, sq, d = parts
        return b, h, h, sq, sq, d
    b, hq, hkv, sq, sk, d = parts
    if hq % hkv:
        raise argparse.ArgumentTypeError(
            f"{text!r}: Hkv={hkv} key/value heads must divide Hq={hq} query heads (GQA/MQA)")
    return b, hq, hkv, sq, sk, d


def _float(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def _softcap(text: str) -> float:
    c = _float(text)
    if not (math.isfinite(c) and c > 0):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a finite number c > 0")
    return c


def _dropout(text: str) -> float:
    p = _float(text)
    if not 0 <= p < 1:                     # False for nan
        raise argparse.ArgumentTypeError(f"{text!r}: expected dropout_p in [0, 1) "
                                         "(0: no dropout)")
    return p


MASK_SPECS = "none, causal, causal_br, sliding:W, window:L[:R], documents:N or keep:P"


def _parse_mask(spec: str):
    """-> (name, argument values); ArgumentTypeError naming the spec and the accepted ones."""
    name, colon, arg = spec.partition(":")

    def bad(why: str):
        return argparse.ArgumentTypeError(f"{spec!r}: {why}; expected {MASK_SPECS}")

    def count(text: str, what: str, low: int) -> int:
        try:
            n = int(text)
        except ValueError:
            n = low - 1
        if n < low:
            raise bad(f"{what} must be an integer >= {low}, got {text!r}")
        return n

    if colon and not arg:
        raise bad("nothing after ':'")
    if name in ("none", "causal", "causal_br"):
        if colon:
            raise bad(f"{name} takes no argument")
        return name, ()
    if name == "sliding":
        return name, (count(arg, "W (keys to the left)", 0) if colon else 256,)
    if name == "window":
        if not colon:
            raise bad("window needs L (and optionally R)")
        left, colon2, right = arg.partition(":")
        if colon2 and ":" in right:
            raise bad("window takes at most two numbers, L:R")
        lo = count(left, "L", 0)
        return name, (lo, count(right, "R", 0) if colon2 else lo)
    if name == "documents":
        return name, (count(arg, "N (documents)", 1) if colon else 4,)
    if name == "keep":
        frac = _float(arg) if colon else 0.5
        if not 0 < frac <= 1:
            raise bad(f"P (kept fraction) must be in (0, 1], got {arg!r}")
        return name, (frac,)
    raise bad("unknown mask")


def build_mask(spec: str, B: int, Sq: int, Sk: int, rng):
    """Mask from a command-line spec: none, causal, causal_br, sliding:W (causal, W keys
    to the left; default 256), window:L[:R], documents:N (N equal packed docs, causal;
    default 4), keep:P (random KeepMask, fraction P in (0, 1] kept; default 0.5)."""
    from . import masks as M

    name, vals = _parse_mask(spec)
    if name == "none":
        return None
    if name == "causal":
        return M.Causal()
    if name == "causal_br":
        return M.Causal("bottom_right")
    if name == "sliding":
        return M.Causal() & M.Window(left=vals[0])
    if name == "window":
        return M.Window(left=vals[0], right=vals[1])
    if name == "documents":
        n = vals[0]
        q_ids = (np.arange(Sq) * n // max(Sq, 1)).astype(np.int32)
        k_ids = (np.arange(Sk) * n // max(Sk, 1)).astype(np.int32)
        return M.Causal() & M.Documents(q_ids, k_ids)
    return M.KeepMask(rng.random((B, 1, Sq, Sk)) < vals[0])


def _mask_spec(text: str) -> str:
    """argparse type of ``--mask``: the spec, checked now (a bad one is a usage error)."""
    try:
        build_mask(text, 1, 1, 1, np.random.default_rng(0))
    except (ValueError, TypeError) as e:
        raise argparse.ArgumentTypeError(f"{text!r}: {e}") from None
    return text


def _to_backend(x, backend_name):
    """NumPy -> what the backend takes (torch on CUDA for triton)."""
    if x is None or backend_name != "triton":
        return x
    from .extras import require

    torch = require("torch", "triton", "--backend triton")
    dev = "cuda" if torch.cuda.is_available() and not settings.current().triton_interpret \
        else "cpu"
    return torch.from_numpy(np.ascontiguousarray(x)).to(dev)


def _to_dtype(x, dtype):
    import torch

    return x.to(getattr(torch, dtype))


def _np(x):
    from .arrays import to_numpy

    return None if x is None else to_numpy(x).astype(np.float64)


def _check_usage(args) -> None:
    """``check``'s arguments against the backend they name: UsageError naming the flag."""
    from .backends.registry import ENTRIES, get_backend

    be, dt = args.backend, args.dtype
    if dt == "bfloat16" and be != "triton":
        raise UsageError(f"argument --dtype: bfloat16 needs --backend triton (NumPy has no "
                         f"bfloat16); --backend {be} takes "
                         f"{', '.join(sorted(ENTRIES[be].dtypes - {'bfloat16'}))}")
    if dt not in ENTRIES[be].dtypes:
        raise UsageError(f"argument --dtype: backend {be!r} takes "
                         f"{', '.join(sorted(ENTRIES[be].dtypes))}, got {dt}")
    why = backend_unavailable(be)
    if why is not None:
        raise UsageError(f"argument --backend: {be!r} cannot run here: {why}")
    caps = get_backend(be).capabilities
    precision = args.precision or "highest"
    if precision not in caps.precisions:
        raise UsageError(f"argument --precision: backend {be!r} takes "
                         f"{', '.join(sorted(caps.precisions))}, got {precision}")
    D = args.shape[-1]
    if caps.max_head_dim is not None and D > caps.max_head_dim:
        raise UsageError(f"argument --shape: backend {be!r} takes head dim D <= "
                         f"{caps.max_head_dim}, got D={D}")
    for flag, used, feature in (("--softcap", args.softcap is not None, "softcap"),
                                ("--alibi", args.alibi, "alibi"),
                                ("--sinks", args.sinks, "sinks"),
                                ("--dropout", args.dropout > 0, "dropout"),
                                ("--bias", args.bias != "none", "bias")):
        if used and not caps.supports(feature):
            raise UsageError(f"argument {flag}: backend {be!r} does not support it")


def _timing_note(be: str) -> str:
    """What the one timed call of ``check`` includes, for this backend."""
    if be == "triton":
        if settings.current().triton_interpret:
            return "Triton's interpreter on the CPU: slow by design, not a GPU timing"
        return "first call: includes Triton's kernel compilation"
    if be == "webgpu":
        return "first call: includes shader compilation and pipeline creation"
    return "one call each; python -m anyattn bench times repeated runs"


def _cmd_check(args) -> int:
    from . import reference
    from .api import attention, attention_backward

    B, Hq, Hkv, Sq, Sk, D = args.shape
    rng = np.random.default_rng(args.seed)
    mask = build_mask(args.mask, B, Sq, Sk, rng)
    q = rng.standard_normal((B, Hq, Sq, D)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, Sk, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, Sk, D)).astype(np.float32)
    g = rng.standard_normal((B, Hq, Sq, D)).astype(np.float32)
    bias = None
    wrt = ["q", "k", "v"]
    if args.bias != "none":
        shapes = {"full": (B, Hq, Sq, Sk), "heads": (1, Hq, Sq, Sk), "batch": (B, 1, Sq, Sk),
                  "keys": (B, 1, 1, Sk)}
        bias = rng.standard_normal(shapes[args.bias]).astype(np.float32)
        wrt.append("bias")
    mods = {}                                   # score modifiers and dropout
    if args.softcap is not None:
        mods["softcap"] = args.softcap
    if args.alibi:                              # the usual geometric slopes 2^(-8h/Hq)
        mods["alibi_slopes"] = (2.0 ** (-8.0 * np.arange(1, Hq + 1) / Hq)).astype(np.float32)
    if args.sinks:
        mods["sinks"] = rng.standard_normal(Hq).astype(np.float32)
        wrt.append("sinks")
    if args.dropout:
        mods.update(dropout_p=args.dropout, dropout_seed=args.seed)
    if B * Hq * Sq * Sk > 2 ** 28:
        print("note: the float64 reference builds the full score tensor; this shape needs "
              f"{B * Hq * Sq * Sk * 8 / 2 ** 30:.1f} GiB per copy", file=sys.stderr)
    be = args.backend
    dt = args.dtype
    # inputs are rounded to the tested dtype first; the reference sees the rounded values

    def prepare(x):
        if x is None:
            return None
        return _to_dtype(_to_backend(x, be), dt) if be == "triton" else x.astype(dt)

    cast = [prepare(x) for x in (q, k, v, g, bias)]
    bmods = {n: (prepare(x) if isinstance(x, np.ndarray) else x) for n, x in mods.items()}
    rmods = {n: (_np(x) if isinstance(x, np.ndarray) else x) for n, x in bmods.items()}
    qc, kc, vc, gc, bc = cast
    bmask = mask
    if be == "triton" and mask is not None:
        bmask = _mask_to_backend(mask, be)

    t0 = time.perf_counter()
    out, lse = attention(qc, kc, vc, mask=bmask, bias=bc, backend=be, precision=args.precision,
                         return_lse=True, **bmods)
    t1 = time.perf_counter()
    grads = attention_backward(qc, kc, vc, gc, out=out, lse=lse, mask=bmask, bias=bc,
                               wrt=wrt, backend=be, precision=args.precision, **bmods)
    _sync(out)
    t2 = time.perf_counter()

    r_in = [_np(x) for x in cast]
    ro, rl = reference.forward(r_in[0], r_in[1], r_in[2], mask=mask, bias=r_in[4], **rmods)
    rg = reference.backward(r_in[0], r_in[1], r_in[2], r_in[3], mask=mask, bias=r_in[4],
                            wrt=wrt, **rmods)
    tol = TF32_TOLERANCE if (args.precision == "tf32" and dt == "float32") else TOLERANCE[dt]
    ok = True
    print(f"backend {be}, shape B={B} Hq={Hq} Hkv={Hkv} Sq={Sq} Sk={Sk} D={D}, {dt}, "
          f"mask {args.mask}, bias {args.bias}"
          + "".join(f", {n} {'on' if isinstance(x, np.ndarray) else x}"
                    for n, x in mods.items() if n != "dropout_seed"))
    print(f"  forward {1e3 * (t1 - t0):.2f} ms, backward {1e3 * (t2 - t1):.2f} ms "
          f"({_timing_note(be)})")
    for name, got, ref in (("out", out, ro), ("lse", lse, rl), ("dq", grads.dq, rg.dq),
                           ("dk", grads.dk, rg.dk), ("dv", grads.dv, rg.dv),
                           ("dbias", grads.dbias, rg.dbias),
                           ("dsinks", grads.dsinks, rg.dsinks)):
        if ref is None:
            continue
        gn = _np(got)
        fin = np.isfinite(ref)
        if not np.array_equal(np.isfinite(gn), fin):
            print(f"  {name:6s} MISMATCH: non-finite entries differ from the reference")
            ok = False
            continue
        scale = np.abs(ref[fin]).max() if fin.any() else 0.0
        err = float(np.abs(gn[fin] - ref[fin]).max() / scale) if scale > 0 else 0.0
        status = "ok" if err <= tol else "MISMATCH"
        ok &= err <= tol
        print(f"  {name:6s} rel err {err:.2e} (tol {tol:.0e}) {status}")
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


def _sync(x):
    if type(x).__module__.startswith("torch") and x.is_cuda:
        import torch

        torch.cuda.synchronize()


def _mask_to_backend(mask, be):
    from .masks import AndMask, Documents, KeepMask

    if isinstance(mask, KeepMask):
        return KeepMask(_to_backend(mask.mask, be))
    if isinstance(mask, Documents):
        return Documents(_to_backend(mask.q_ids, be), _to_backend(mask.k_ids, be))
    if isinstance(mask, AndMask):
        return AndMask(tuple(_mask_to_backend(t, be) for t in mask.terms))
    return mask


def build_parser() -> argparse.ArgumentParser:
    from . import __version__
    from .backends.registry import BACKEND_NAMES

    ap = _Parser(prog="anyattn", description=__doc__,
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"anyattn {__version__}")
    sub = ap.add_subparsers(dest="cmd", required=True, metavar="{info,check,bench}")
    inf = sub.add_parser("info", help="which backends run here, and why the others don't; "
                                      "--settings: the switches; --route: the Triton route")
    inf.set_defaults(_error=inf.error)
    inf.add_argument("--settings", action="store_true",
                     help="print every environment switch with its value in effect")
    inf.add_argument("--route", type=_route_shape, default=None,
                     metavar="B,Hq,Hkv,Sq,Sk,D[,Dv]",
                     help="print the Triton route (path, config, reasons) of forward and "
                          "backward for this shape (Dv: v's head dim, D unless given) on "
                          "the device the flags describe (no GPU needed)")
    inf.add_argument("--dtype", default="bf16", choices=sorted(_ROUTE_DTYPES),
                     help="--route: the inputs' dtype (default bf16)")
    inf.add_argument("--mask", default="none",
                     help="--route: a mask class (none, band, documents, keep, "
                          "band+documents, ...) or causal / window / sliding (band)")
    inf.add_argument("--features", default="",
                     help="--route: score features, comma-separated: bias, softcap, alibi, "
                          "sinks, dropout, score_mod, mask_mod, score_mod_grad (a score "
                          "function's capture gradients)")
    inf.add_argument("--precision", default="highest", choices=["highest", "tf32"],
                     help="--route: precision (fp32 inputs)")
    inf.add_argument("--cc", type=_capability_arg, default=None,
                     help="--route: the device's compute capability, e.g. 9.0 (required)")
    inf.add_argument("--sms", type=int, default=None,
                     help="--route: the device's SM count (default 132)")
    ck = sub.add_parser("check", help="one problem on one backend vs the float64 reference")
    ck.set_defaults(_error=ck.error)
    ck.add_argument("--shape", type=_parse_shape, default=(1, 4, 4, 256, 256, 64),
                    help="B,H,S,D or B,Hq,Hkv,Sq,Sk,D (default 1,4,4,256,256,64)")
    ck.add_argument("--mask", default="causal", type=_mask_spec,
                    help="none | causal (default) | causal_br | sliding:W (causal, W >= 0 keys "
                         "to the left, default 256) | window:L[:R] (L, R >= 0) | documents:N "
                         "(N >= 1, default 4) | keep:P (fraction kept, P in (0, 1], "
                         "default 0.5)")
    ck.add_argument("--bias", default="none", choices=["none", "full", "heads", "batch", "keys"])
    ck.add_argument("--dtype", default="float32", choices=sorted(TOLERANCE))
    ck.add_argument("--backend", default="numpy", choices=BACKEND_NAMES,
                    help="default numpy; `python -m anyattn info` says which run here")
    ck.add_argument("--precision", default=None, choices=["highest", "tf32"])
    ck.add_argument("--seed", type=seed_arg, default=0,
                    help="inputs' random seed (also the dropout seed), in [0, 2**64)")
    ck.add_argument("--softcap", type=_softcap, default=None, help="logit soft-cap c > 0")
    ck.add_argument("--alibi", action="store_true", help="ALiBi with slopes 2^(-8h/Hq)")
    ck.add_argument("--sinks", action="store_true", help="learnable sinks (random), dsinks")
    ck.add_argument("--dropout", type=_dropout, default=0.0, help="dropout_p in [0, 1)")
    bn = sub.add_parser("bench", help="time backends on a set of shapes (GFLOP/s, JSON, PNG)")
    bn.set_defaults(_error=bn.error)
    try:
        from . import bench as _bench
    except ImportError as e:  # pragma: no cover - bench module missing
        bn.set_defaults(_bench_error=str(e))
    else:
        _bench.add_arguments(bn)
    return ap


def _dispatch(argv: Optional[List[str]]) -> int:
    args = build_parser().parse_args(argv)
    if args.cmd == "info":
        if args.route is not None and args.cc is None:
            args._error("--route needs --cc (the device's compute capability, e.g. 9.0)")
        if args.route is not None:
            try:
                return _cmd_info(args)
            except ValueError as e:      # a mask class or feature the route cannot read
                print(f"anyattn info: error: {e}", file=sys.stderr)
                return 2
        return _cmd_info(args)
    if args.cmd == "check":
        try:
            _check_usage(args)
        except UsageError as e:
            args._error(str(e))
        try:
            return _cmd_check(args)
        except (ValueError, TypeError, NotImplementedError, RuntimeError,
                ImportError) as e:
            print(f"anyattn check: error: {type(e).__name__}: {e}", file=sys.stderr)
            return 2
    if args.cmd == "bench":
        if getattr(args, "_bench_error", None):
            print(f"error: the benchmark module cannot be loaded: {args._bench_error}",
                  file=sys.stderr)
            return 2
        from . import bench as _bench

        why = _bench.usage_error(args)
        if why is not None:
            args._error(why)
        return _bench.run(args)
    return 2


def main(argv: Optional[List[str]] = None) -> int:
    """Run one subcommand; the exit status (argparse's own errors exit with 2)."""
    try:
        code = _dispatch(argv)
        sys.stdout.flush()
        return code
    except BrokenPipeError:
        # the reader of the output went away (``anyattn info | head``): stop quietly, as
        # other command-line tools do, without a traceback at interpreter exit
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
