"""BLAS threads and bitwise results of the numpy backend, each in a fresh process.

The BLAS thread count and threadpoolctl's presence are fixed when a process loads
them, so every case here runs in a subprocess: with threadpoolctl importable or
blocked (a meta-path finder that makes ``import threadpoolctl`` fail, as after a
``--no-deps`` install), with ``OPENBLAS_NUM_THREADS`` and ``ANYATTN_NUMPY_THREADS`` set
or not.  Shape legend: B batch, Hq/Hkv heads, Sq/Sk queries/keys, D head dim.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__)))), "src")

#: makes ``import threadpoolctl`` fail in the subprocess (put before everything else)
BLOCK_THREADPOOLCTL = textwrap.dedent("""
    import sys
    class _NoThreadpoolctl:
        def find_spec(self, name, path=None, target=None):
            if name == "threadpoolctl" or name.startswith("threadpoolctl."):
                raise ImportError("threadpoolctl blocked for this test")
            return None
    sys.meta_path.insert(0, _NoThreadpoolctl())
""")

#: ctypes access to the loaded OpenBLAS's thread count (None where numpy uses another BLAS)
OPENBLAS_PROBE = textwrap.dedent("""
    import ctypes
    def openblas_threads_getter():
        libs = []
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.split()[-1] if len(line.split()) >= 6 else ""
                if "openblas" in os.path.basename(path).lower() and path not in libs:
                    libs.append(path)
        for path in libs:
            lib = ctypes.CDLL(path)
            for sym in ("openblas_get_num_threads", "openblas_get_num_threads64_",
                        "scipy_openblas_get_num_threads64_", "scipy_openblas_get_num_threads"):
                fn = getattr(lib, sym, None)
                if fn is not None:
                    fn.restype = ctypes.c_int
                    fn.argtypes = []
                    return fn
        return None
""")


def _run(code: str, env_extra: dict, block: bool) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
                        "ANYATTN_NUMPY_THREADS", "ANYATTN_NUMPY_BLAS_LOCAL")}
    env.update(env_extra)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    prog = (BLOCK_THREADPOOLCTL if block else "") + "import os, sys, json\n" + \
        OPENBLAS_PROBE + textwrap.dedent(code)
    r = subprocess.run([sys.executable, "-c", prog], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------- oversubscription
BLAS_IN_WORKERS = """
import threading
import numpy as np
from anyattn.backends import numpy_backend as nb
from anyattn.backends import blas_threads
from anyattn.modifiers import NO_MODS
from anyattn.problem import describe

get = openblas_threads_getter()
if get is None:
    print(json.dumps({"skip": "numpy's BLAS is not OpenBLAS"}))
    sys.exit(0)
if BLOCKED:
    try:
        import threadpoolctl  # noqa: F401
        raise SystemExit("threadpoolctl was not blocked")
    except ImportError:
        pass

seen = []                       # (thread id, BLAS threads in effect) inside every unit
lock = threading.Lock()

def spy(fn):
    def wrapped(*a, **k):
        with lock:
            seen.append((threading.get_ident(), get()))
        return fn(*a, **k)
    return wrapped

for name in ("forward_rows", "forward_rows_bounded", "backward_keys"):
    setattr(nb, name, spy(getattr(nb, name)))
submitted = [0]                 # workers started for one call (they run concurrently)
real_submit = nb._submit_all

def submit_spy(fn, n):
    submitted[0] = max(submitted[0], n)
    return real_submit(fn, n)

nb._submit_all = submit_spy

rng = np.random.default_rng(0)
B, Hq, Hkv, S, D = 1, 4, 2, 384, 32
q, k, v, g = (rng.standard_normal(s).astype(np.float32)
              for s in ((B, Hq, S, D), (B, Hkv, S, D), (B, Hkv, S, D), (B, Hq, S, D)))
bias = rng.standard_normal((1, 1, S, S)).astype(np.float32)
be = nb.NumpyBackend(nb.NumpyConfig(fwd_bq=64, fwd_bk=64, bwd_bq=64, bwd_bk=64))
before = get()
for b in (None, bias):
    wrt = ("q", "k", "v") + (() if b is None else ("bias",))
    p = describe(q, k, v, bias=b)
    out, st = be.forward(p, q, k, v, b, NO_MODS)
    pb = describe(q, k, v, dout=g, bias=b, wrt=wrt)
    be.backward(pb, q, k, v, g, out, st, b, NO_MODS)
after = get()
workers = max(len({t for t, _ in seen}), submitted[0])
print(json.dumps({"workers": workers, "blas_in_units": max(n for _, n in seen),
                  "before": before, "after": after, "cpus": os.cpu_count(),
                  "pool": nb.NumpyConfig().n_threads(), "units": len(seen),
                  "info": getattr(be, "describe_device", lambda: "")()}))
"""


@pytest.mark.parametrize("blocked", [False, True], ids=["threadpoolctl", "no_threadpoolctl"])
def test_workers_times_blas_threads_fit_the_cpus(blocked):
    """Inside the backend's worker threads, during real forward and backward calls, the
    BLAS threads in effect (OpenBLAS's own count, read through ctypes) times the workers
    (those started for a call, or that ran units) stay within the CPUs; the caller's BLAS threads are what they were
    before the calls.  Without threadpoolctl the backend runs its units on the calling
    thread (BLAS keeps its threads) and says so in describe_device()."""
    if (os.cpu_count() or 1) < 2:
        pytest.skip("needs 2 CPUs to oversubscribe")
    if not blocked:
        pytest.importorskip("threadpoolctl")
    r = _run(f"BLOCKED = {blocked!r}\n" + BLAS_IN_WORKERS, {}, blocked)
    if "skip" in r:
        pytest.skip(r["skip"])
    assert r["before"] > 1, r          # BLAS starts with several threads: a real test
    assert r["workers"] * r["blas_in_units"] <= r["cpus"], r
    assert r["after"] == r["before"], r
    if blocked:
        assert r["workers"] == 1 and r["blas_in_units"] == r["before"], r
        assert "threadpoolctl" in r["info"] and "fallback" in r["info"], r["info"]
    else:
        assert r["workers"] > 1, r     # the pool runs (else this proves nothing)
        assert "fallback" not in r["info"], r["info"]


# ------------------------------------------------------------- bitwise results
BITS = """
import hashlib
import numpy as np
import anyattn as aa
from anyattn.backends.registry import get_backend
from anyattn.backends.numpy_backend import NumpyConfig

def digest(arrs):
    h = hashlib.sha256()
    for a in arrs:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()

res = {}
be = get_backend("numpy")
rng = np.random.default_rng(11)
# the magnitude case bias_logits:1e3 of tests/backends/test_magnitudes.py
B, Hq, Hkv, Sq, Sk, D = 1, 2, 1, 9, 11, 8
q, k, v, g = (rng.standard_normal(s).astype(np.float32) for s in
              ((B, Hq, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, D), (B, Hq, Sq, D)))
bias = (1e3 + rng.standard_normal((1, Hq, Sq, Sk))).astype(np.float32)
out, lse = aa.attention(q, k, v, bias=bias, return_lse=True, backend="numpy")
gr = aa.attention_backward(q, k, v, g, bias=bias, backend="numpy",
                           wrt=("q", "k", "v", "bias"))
res["bias_logits"] = digest((out, lse) + tuple(x for x in gr if x is not None))

# the automatic 512-wide tiles: GEMMs large enough for BLAS to split them over its
# threads where a unit runs on the calling thread (one worker)
q, k, v, g = (rng.standard_normal((1, 1, 1024, 64)).astype(np.float32) for _ in range(4))
out, lse = aa.attention(q, k, v, return_lse=True, backend="numpy")
gr = aa.attention_backward(q, k, v, g, backend="numpy")
res["auto_tiles"] = digest((out, lse) + tuple(x for x in gr if x is not None))

# several key tiles per head (dq over key tiles), broadcast biases (dbias reductions
# over batch, heads and keys), GQA; small tiles so that every reduction has many terms
be.config = NumpyConfig(fwd_bq=16, fwd_bk=16, bwd_bq=16, bwd_bk=16,
                        threads=be.config.threads)
B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 70, 90, 16
q, k, v, g = (rng.standard_normal(s).astype(np.float32) for s in
              ((B, Hq, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, D), (B, Hq, Sq, D)))
for name, bshape, mask in (("none", None, None),
                           ("bias_1_1_q_k", (1, 1, Sq, Sk), aa.Causal("bottom_right")),
                           ("bias_b_1_q_1", (B, 1, Sq, 1), None),
                           ("bias_1_h_1_k", (1, Hq, 1, Sk), aa.Window(left=30))):
    b = None if bshape is None else rng.standard_normal(bshape).astype(np.float32)
    wrt = ("q", "k", "v") + (() if b is None else ("bias",))
    out, lse = aa.attention(q, k, v, bias=b, mask=mask, return_lse=True, backend="numpy")
    gr = aa.attention_backward(q, k, v, g, bias=b, mask=mask, backend="numpy", wrt=wrt)
    res[name] = digest((out, lse) + tuple(x for x in gr if x is not None))
print(json.dumps(res))
"""

#: (ANYATTN_NUMPY_THREADS, OPENBLAS_NUM_THREADS, threadpoolctl blocked)
BIT_RUNS = [("1", "1", False), ("1", None, False), ("2", None, False), ("3", "1", False),
            ("4", None, False), (None, None, True), ("3", None, True)]


def test_results_do_not_depend_on_threads():
    """The same problems (the bias_logits:1e3 magnitude case; backwards with dq, dk, dv
    and dbias reduced over several key tiles, heads and batches) give the same bits
    with 1..4 workers, BLAS at 1 thread or its default, threadpoolctl present or not."""
    digests = {}
    for nt, blas, blocked in BIT_RUNS:
        env = {}
        if nt is not None:
            env["ANYATTN_NUMPY_THREADS"] = nt
        if blas is not None:
            env["OPENBLAS_NUM_THREADS"] = blas
        digests[(nt, blas, blocked)] = _run(BITS, env, blocked)
    first = digests[BIT_RUNS[0]]
    for key, d in digests.items():
        diff = sorted(n for n in first if d[n] != first[n])
        assert not diff, f"{key}: other bits than {BIT_RUNS[0]} in {diff}"
