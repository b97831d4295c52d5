"""sha256 of the sm_90a SASS (and PTX) of the portable Triton kernels for the routed
constexpr combinations, compiled offline (no GPU needed).

The companion of sass_hashes.py (the Hopper kernels).  Each case is a call the route
sends to the portable kernels on a CUDA device (dtype, precision, head dim, mask,
bias, score modifiers, dropout); the script runs the real launch code of the tree on
PYTHONPATH (forward.py / backward.py with the heuristic plans of configs.plan_for) with
CPU tensors and every kernel of kernels.py replaced by a recorder, so each launch the
call would make is captured with its arguments, constexprs, warps and stages.  Each
recorded launch is then specialised as Triton's own launcher specialises it (the binder
of triton.runtime.jit: argument types, 16-byte alignment, integers equal to 1 or
divisible by 16) and compiled for sm_90a.  The softcap constexpr of 16-bit inputs is
taken as on a GPU of compute capability >= 7.5 (the hardware tanh); the recorder runs
on the CPU, where the launch code picks the portable tanh.

    PYTHONPATH=src python3 bench/lab/portable_hashes.py --out /tmp/p_before.json
    PYTHONPATH=src python3 bench/lab/portable_hashes.py --out /tmp/p_after.json \
        --compare /tmp/p_before.json

Must run without TRITON_INTERPRET (the kernels must be jit functions, not interpreted).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from contextlib import contextmanager

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SM90A = ("cuda", 90, 32)

#: the feature sets of a case: name -> (mask, bias shape or None, softcap, alibi, sinks,
#: dropout p); the mask by name (built per case)
FEATURES = {
    "none": (None, None, None, False, False, 0.0),
    "causal": ("causal", None, None, False, False, 0.0),
    "window": ("window", None, None, False, False, 0.0),
    "docs": ("docs", None, None, False, False, 0.0),
    "keep": ("keep", None, None, False, False, 0.0),
    "causal_docs": ("causal_docs", None, None, False, False, 0.0),
    "bias_full": (None, "BHQK", None, False, False, 0.0),
    "bias_1H": ("causal", "1HQK", None, False, False, 0.0),
    "bias_B1": (None, "B1QK", None, False, False, 0.0),
    "bias_11K": (None, "11_K", None, False, False, 0.0),
    "softcap": (None, None, 2.5, False, False, 0.0),
    "alibi": ("causal", None, None, True, False, 0.0),
    "sinks": (None, None, None, False, True, 0.0),
    "dropout": (None, None, None, False, False, 0.2),
    "all": ("causal", "1HQK", 3.0, True, True, 0.1),
    "docs_all": ("docs", "BHQK", 3.0, True, True, 0.1),
    # decoding shapes (DECODE_SHAPE): the split-key forward, then the usual backward
    "decode": (None, None, None, False, False, 0.0),
    "decode_all": ("causal_br", None, 3.0, True, True, 0.0),
}
#: (B, H, Hkv, Sq, Sk) of the "decode*" cases: 4 programs, fewer than the SMs the route
#: assumes without a GPU (route.NO_GPU_SMS), so the forward splits the keys
DECODE_SHAPE = (1, 4, 2, 1, 4096)
DTYPES = (("float16", "highest"), ("bfloat16", "highest"), ("float32", "highest"),
          ("float32", "tf32"))
HEAD_DIMS = (64, 128)
#: the kernels' names in kernels.py (every @triton.jit there that a launch may call)
KERNEL_NAMES = ("fwd_kernel", "bwd_pre_kernel", "dkdv_kernel", "dq_kernel", "bwd_kernel",
                "dq_dbias_kernel", "dbias_kernel", "split_kernel", "split_f16_kernel",
                "row_stats_kernel", "drop_words_kernel", "fwd_split_kernel",
                "fwd_combine_kernel")


def _mask(name, B, Sq, Sk, torch):
    import anyattn as aa

    g = torch.Generator().manual_seed(3)
    if name is None:
        return None
    if name == "causal":
        return aa.Causal()
    if name == "causal_br":
        return aa.Causal(align="bottom_right")
    if name == "window":
        return aa.Window(left=100)
    ids = torch.sort(torch.randint(0, 4, (B, Sq), generator=g), dim=1).values.to(torch.int32)
    if name == "docs":
        return aa.Documents(ids)
    if name == "causal_docs":
        return aa.Causal() & aa.Documents(ids)
    if name == "keep":
        return aa.KeepMask(torch.rand(Sq, Sk, generator=g) < 0.5)
    raise ValueError(name)


class _Recorder:
    """Stands in for one jit kernel: ``rec[grid](*args, **kw)`` records the launch."""

    def __init__(self, name, log):
        self.name, self.log = name, log

    def __getitem__(self, grid):
        import torch

        def launch(*args, **kw):
            args = tuple(_Ptr(a) if isinstance(a, torch.Tensor) else a for a in args)
            self.log.append((self.name, args, kw))
        return launch


@contextmanager
def recording(names=None):
    """Within: the kernels ``names`` of kernels.py (default KERNEL_NAMES, those present)
    replaced by recorders, the launch caches cleared; yields the log [(kernel name, args,
    kw)] they fill.  After: the kernels restored, the caches cleared again."""
    from anyattn.backends.triton import kernels as K
    from anyattn.backends.triton import launch as L

    log = []
    saved = {n: getattr(K, n) for n in (names or KERNEL_NAMES) if hasattr(K, n)}
    try:
        for n in saved:
            setattr(K, n, _Recorder(n, log))
        L.clear_caches()
        yield log
    finally:
        for n, fn in saved.items():
            setattr(K, n, fn)
        L.clear_caches()


def record(case):
    """The launches of one case's forward and backward: [(kernel name, args, kw)]."""
    import torch

    from anyattn.backends.triton import launch as L
    from anyattn.modifiers import ScoreMods
    from anyattn.problem import describe

    dtype, precision, d, feat = case
    mask_name, bshape, softcap, alibi, sinks, drop = FEATURES[feat]
    B, H, Hkv, Sq, Sk = DECODE_SHAPE if feat.startswith("decode") else (2, 4, 2, 1024, 1024)
    tdt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(B, H, Sq, d, generator=g).to(tdt)
    k = torch.randn(B, Hkv, Sk, d, generator=g).to(tdt)
    v = torch.randn(B, Hkv, Sk, d, generator=g).to(tdt)
    dout = torch.randn(B, H, Sq, d, generator=g).to(tdt)
    bias = None
    if bshape is not None:
        shape = tuple({"B": B, "H": H, "Q": Sq, "K": Sk, "1": 1, "_": 1}[c] for c in bshape)
        bias = torch.randn(shape, generator=g).to(tdt)
    mods = ScoreMods(alibi_slopes=torch.rand(H, generator=g) if alibi else None,
                     sinks=torch.randn(H, generator=g) if sinks else None)
    mask = _mask(mask_name, B, Sq, Sk, torch)
    kw = dict(mask=mask, bias=bias, precision=precision, softcap=softcap,
              alibi_slopes=mods.alibi_slopes, sinks=mods.sinks, dropout_p=drop,
              dropout_seed=7 if drop else None)
    with recording() as log:
        p = describe(q, k, v, **kw)
        out, stats = L.forward(p, q, k, v, bias, mods=mods)
        wrt = ("q", "k", "v") + (("bias",) if bias is not None else ()) + \
            (("sinks",) if sinks else ())
        pb = describe(q, k, v, dout=dout, out=out, lse=stats.max, wrt=wrt, **kw)
        L.backward(pb, q, k, v, dout, out, stats, bias, mods=mods)
    return log


def _compile(fn, args, kw):
    """Compile fn as Triton's launcher would for these arguments, for sm_90a."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget(*SM90A)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kw = dict(kw, debug=False)
    bound, spec, options = binder(*args, **kw)
    options, signature, constexprs, attrs = fn._pack_args(backend, kw, bound, spec, options)
    return triton.compile(ASTSource(fn, signature, constexprs, attrs), target=target,
                          options=options.__dict__)


class _Ptr:
    """A tensor as Triton's binder sees it: its dtype and its address (16-byte aligned or
    not); recorded launches carry these instead of the tensors."""

    def __init__(self, t):
        self.dtype, self._ptr = t.dtype, 16 if t.data_ptr() % 16 == 0 else 8

    def data_ptr(self):
        return self._ptr

    def __repr__(self):
        return f"{str(self.dtype)[6:]}{'a' if self._ptr == 16 else 'u'}"


def _launch_key(name, args, kw):
    """A distinct compile: the kernel, its arguments as the binder reads them (tensors by
    dtype and alignment, integers by 1 / divisible by 16 / other) and its keywords."""
    kinds = []
    for a in args:
        if isinstance(a, _Ptr):
            kinds.append(repr(a))
        elif isinstance(a, bool):
            kinds.append(f"b{int(a)}")
        elif isinstance(a, int):
            kinds.append("1" if a == 1 else ("d16" if a % 16 == 0 else "i"))
        elif isinstance(a, float):
            kinds.append("f")
        else:
            kinds.append(type(a).__name__)
    kws = ",".join(f"{k}={kw[k]}" for k in sorted(kw))
    return f"{name}[{kws}]({' '.join(kinds)})"


def _fast_tanh(kw, dtype):
    """SOFTCAP as on a GPU of compute capability >= 7.5: 2 for 16-bit inputs."""
    if kw.get("SOFTCAP") == 1 and dtype in ("float16", "bfloat16"):
        return dict(kw, SOFTCAP=2)
    return kw


def _one(item):
    """(launch key, kernel name, args, kw) -> hashes."""
    from anyattn.backends.triton import kernels as K
    from sass_hashes import _ptx_code, sass_of

    lkey, name, args, kw = item
    t = time.time()
    ck = _compile(getattr(K, name), args, kw)
    sass = sass_of(ck.asm["cubin"])
    if not sass.strip():
        raise RuntimeError(f"{lkey}: empty SASS")
    return (lkey, hashlib.sha256(sass.encode()).hexdigest(),
            hashlib.sha256(_ptx_code(ck.asm["ptx"]).encode()).hexdigest(),
            len(sass.splitlines()), time.time() - t)


def cases():
    return [(dt, prec, d, f) for dt, prec in DTYPES for d in HEAD_DIMS for f in FEATURES]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--compare", help="a previous run's JSON: every case's launches must "
                    "compile to the same SASS")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", default="", help="substring filter on the case names")
    ap.add_argument("--list", action="store_true", help="print the launches and stop")
    a = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        ap.error("unset TRITON_INTERPRET: the kernels must be compiled, not interpreted")
    todo, per_case = {}, {}
    for c in cases():
        ckey = f"{c[0]}/{c[1]}/D{c[2]}/{c[3]}"
        if a.only not in ckey:
            continue
        per_case[ckey] = []
        for name, args, kw in record(c):
            kw = _fast_tanh(kw, c[0])
            lkey = _launch_key(name, args, kw)
            per_case[ckey].append(lkey)
            todo.setdefault(lkey, (lkey, name, args, kw))
    print(f"{len(todo)} distinct launches from {len(per_case)} cases", flush=True)
    if a.list:
        for ckey, launches in per_case.items():
            print(ckey)
            for lkey in launches:
                print("   ", lkey)
        return 0
    compiled = {}
    with ProcessPoolExecutor(a.jobs) as ex:
        for lkey, h, hp, n, dt in ex.map(_one, todo.values()):
            compiled[lkey] = {"sass_sha256": h, "ptx_sha256": hp, "sass_lines": n}
            print(f"{lkey[:100]:100s} {h[:12]} {n:6d} lines {dt:6.1f} s", flush=True)
    res = {ckey: [[lk.split("[")[0], compiled[lk]["sass_sha256"], compiled[lk]["ptx_sha256"],
                   compiled[lk]["sass_lines"]] for lk in launches]
           for ckey, launches in per_case.items()}
    with open(a.out, "w") as f:
        json.dump({"cases": res, "launches": compiled}, f, indent=1, sort_keys=True)
    print(f"{len(res)} cases, {len(compiled)} compiled launches -> {a.out}")
    if a.compare:
        with open(a.compare) as f:
            ref = json.load(f)["cases"]
        sass = lambda rows: [(r[0], r[1]) for r in rows]   # noqa: E731
        ptx_of = lambda rows: [(r[0], r[2]) for r in rows]   # noqa: E731
        same = [k for k in res if k in ref and sass(res[k]) == sass(ref[k])]
        new = [k for k in res if k not in ref]
        # SASS that differs where every launch's PTX is the same: ptxas, whose output for
        # some spilling kernels varies from run to run, not the source
        ptxas = [k for k in res if k in ref and k not in same and ptx_of(res[k]) == ptx_of(ref[k])]
        bad = [k for k in res if k not in same and k not in new and k not in ptxas]
        missing = [k for k in ref if k not in res]
        ptx = [k for k in same if [r[2] for r in res[k]] != [r[2] for r in ref[k]]]
        print(f"compared {len(res)} cases: {len(same)} identical (every launch's SASS), "
              f"{len(ptxas)} with the same PTX but other SASS (ptxas), {len(new)} new, "
              f"{len(bad)} differ, {len(missing)} missing; PTX differs in {len(ptx)} of the "
              "identical ones")
        for k in new:
            print("  NEW (not in the reference run):", k)
        for k in ptxas:
            print("  SAME PTX, OTHER SASS:", k, [m[0] for m, t in zip(sass(res[k]), sass(ref[k]))
                                                 if m != t])
        for k in bad:
            mine = sass(res[k])
            theirs = sass(ref.get(k, []))
            print("  DIFFERS:", k, [m[0] for m, t in zip(mine, theirs) if m != t]
                  or f"{len(theirs)} -> {len(mine)} launches")
        for k in missing:
            print("  MISSING:", k)
        return 1 if bad or missing else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
