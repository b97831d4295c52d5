"""Thread safety of the numpy backend (issue 12 item 3): concurrent calls, pool size,
BLAS thread limits.  Shape legend: B batch, H heads, S sequence, D head dim."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from anyattn.modifiers import NO_MODS
import anyattn as aa
from anyattn.backends import blas_threads
from anyattn.backends import numpy_backend as nb
from anyattn.backends.numpy_backend import (NumpyBackend, NumpyConfig, available_cpus,
                                            cgroup_cpu_quota)
from anyattn.problem import describe

from np_util import qkv


def _problem(seed):
    q, k, v, g = qkv(seed, 1, 4, 2, 70, 90, 16, dtype="float32")
    bias = np.random.default_rng(seed).standard_normal((1, 1, 70, 90)).astype(np.float32)
    mask = aa.Causal("bottom_right")
    return q, k, v, g, bias, mask


def _call(be, q, k, v, g, bias, mask):
    """forward + backward on one backend instance: every result array."""
    p = describe(q, k, v, mask=mask, bias=bias)
    out, st = be.forward(p, q, k, v, bias, NO_MODS)
    pb = describe(q, k, v, dout=g, mask=mask, bias=bias, wrt=("q", "k", "v", "bias"))
    r = be.backward(pb, q, k, v, g, out, st, bias, NO_MODS)
    return (out, st.max, st.log_norm, r["dq"], r["dk"], r["dv"], r["dbias"])


def test_concurrent_calls_give_the_serial_bits(monkeypatch):
    """8 threads x 50 calls at once, on backends with 2..5 workers, while the shared pool
    is replaced under them again and again (as when a call with more workers comes in;
    a churn thread forces it every 2 ms): no exception (before: "cannot schedule new
    futures after shutdown" in ~230 of the 400 calls), every result bitwise equal to
    the same call made alone."""
    monkeypatch.setattr(nb, "_pool", None)
    monkeypatch.setattr(nb, "_pool_size", 0)
    cfg = dict(fwd_bq=16, fwd_bk=32, bwd_bq=32, bwd_bk=16)
    backends = [NumpyBackend(NumpyConfig(threads=t, **cfg)) for t in (2, 3, 4, 5)]
    problems = [_problem(s) for s in range(4)]
    serial = {(bi, pi): _call(be, *pr) for bi, be in enumerate(backends)
              for pi, pr in enumerate(problems)}
    monkeypatch.setattr(nb, "_pool", None)          # grow again while the threads run
    monkeypatch.setattr(nb, "_pool_size", 0)
    errors, mismatches = [], []
    start = threading.Barrier(8)

    def client(t):
        try:
            start.wait()
            for i in range(50):
                bi, pi = (t + i) % len(backends), (t * 7 + i) % len(problems)
                got = _call(backends[bi], *problems[pi])
                if not all(np.array_equal(a, b) for a, b in zip(got, serial[(bi, pi)])):
                    mismatches.append((t, i))
        except Exception as e:  # noqa: BLE001 - collected and reported below
            errors.append(repr(e))

    stop = threading.Event()

    def churn():                  # the next submission must build a new, larger pool
        while not stop.is_set():
            with nb._pool_lock:
                nb._pool_size = 1
            stop.wait(0.002)

    threads = [threading.Thread(target=client, args=(t,)) for t in range(8)]
    churner = threading.Thread(target=churn)
    churner.start()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    stop.set()
    churner.join()
    assert not errors, errors[:3]
    assert not mismatches, mismatches[:5]


def test_score_and_mask_functions_are_bitwise_independent_of_thread_count(np_config):
    """A score function with a learnable table and a mask function: out, lse and every
    gradient, the table's (scattered per unit slot, slots added in order) included, are
    the same bits with 1, 2 and 3 workers."""
    q, k, v, g = qkv(12, 2, 4, 2, 70, 90, 16, dtype="float32")
    tab = np.random.default_rng(1).standard_normal((4, 159)).astype(np.float32)
    sm = aa.ScoreMod(lambda s, b, h, i, j, tab: s + tab[h, i - j + 89] * np.tanh(s),
                     tab=tab)
    mask = aa.MaskMod(lambda b, h, i, j: (i + j) % 5 != 0) & aa.Causal("bottom_right")
    runs = []
    for t in (1, 2, 3):
        np_config(fwd_bq=16, fwd_bk=32, bwd_bq=32, bwd_bk=16, threads=t)
        out, lse = aa.attention(q, k, v, score_mod=sm, mask=mask, return_lse=True)
        gr = aa.attention_backward(q, k, v, g, score_mod=sm, mask=mask,
                                   wrt=("q", "k", "v", "tab"))
        runs.append((out, lse, gr.dq, gr.dk, gr.dv, gr.dcaptures["tab"]))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            np.testing.assert_array_equal(a, b)


def test_one_score_function_shared_by_concurrent_callers(np_config):
    """Four threads call the backward with one ScoreMod (whose derivatives are built on
    first use, under a lock) and new wrt sets: every result equals the serial one."""
    np_config(fwd_bq=16, fwd_bk=16, bwd_bq=16, bwd_bk=16, threads=2)
    q, k, v, g = qkv(13, 1, 2, 2, 40, 40, 8, dtype="float32")
    t = np.linspace(0.5, 1.5, 2).astype(np.float32)
    u = np.linspace(-1.0, 1.0, 79).astype(np.float32)

    def make():
        return aa.ScoreMod(lambda s, b, h, i, j, t, u: s * t[h] + u[i - j + 39] * np.tanh(s),
                           t=t, u=u)

    wrts = [("q", "t"), ("k", "u"), ("t", "u"), ("v", "t", "u")]
    serial = [aa.attention_backward(q, k, v, g, score_mod=make(), wrt=w) for w in wrts]
    shared = make()
    results, errors = [None] * 4, []
    start = threading.Barrier(4)

    def client(n):
        try:
            start.wait()
            results[n] = aa.attention_backward(q, k, v, g, score_mod=shared, wrt=wrts[n])
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=client, args=(n,)) for n in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors
    for got, want in zip(results, serial):
        for name in ("dq", "dk", "dv"):
            a, b = getattr(got, name), getattr(want, name)
            assert (a is None) == (b is None)
            if a is not None:
                np.testing.assert_array_equal(a, b)
        for n, x in want.dcaptures.items():
            np.testing.assert_array_equal(got.dcaptures[n], x)


def test_concurrent_calls_through_the_api(np_config):
    """The registered backend through aa.attention / attention_backward from several
    threads at once: the serial bits."""
    np_config(fwd_bq=32, fwd_bk=32, bwd_bq=32, bwd_bk=32, threads=3)
    q, k, v, g, bias, mask = _problem(9)

    def run():
        out, lse = aa.attention(q, k, v, mask=mask, bias=bias, return_lse=True, backend="numpy")
        gr = aa.attention_backward(q, k, v, g, mask=mask, bias=bias, backend="numpy",
                                   wrt=("q", "k", "v", "bias"))
        return (out, lse) + tuple(gr)

    want = run()
    results, errors = [], []

    def client():
        try:
            for _ in range(10):
                results.append(run())
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=client) for _ in range(6)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors[:3]
    assert len(results) == 60
    for got in results:
        assert all(np.array_equal(a, b) for a, b in zip(got, want))


def test_worker_exception_leaves_no_worker_running(monkeypatch):
    """A failing unit re-raises in the caller after all of the call's workers ended."""
    running = []

    def boom(*a, **k):
        running.append(1)
        raise RuntimeError("tile failure")

    monkeypatch.setattr(nb, "forward_rows", boom)
    be = NumpyBackend(NumpyConfig(threads=3, fwd_bq=8, fwd_bk=8))
    q, k, v, _ = qkv(3, 1, 4, 1, 40, 40, 8)
    bias = np.zeros((1, 1, 40, 40))
    with pytest.raises(RuntimeError, match="tile failure"):
        be.forward(describe(q, k, v, bias=bias), q, k, v, bias, NO_MODS)
    n = len(running)
    assert n >= 1 and len(running) == n            # nothing still running afterwards


# ------------------------------------------------------------------ CPU count
def _cgroup(tmp_path, *, v2=None, v1=None, own="/", nested=None):
    root = tmp_path / "cgroup"
    root.mkdir(parents=True)
    if v2 is not None:
        (root / "cpu.max").write_text(v2 + "\n")
    if nested is not None:
        d = root / own.strip("/")
        d.mkdir(parents=True)
        (d / "cpu.max").write_text(nested + "\n")
    if v1 is not None:
        d = root / "cpu"
        d.mkdir()
        (d / "cpu.cfs_quota_us").write_text(f"{v1[0]}\n")
        (d / "cpu.cfs_period_us").write_text(f"{v1[1]}\n")
    self_cg = tmp_path / "self_cgroup"
    self_cg.write_text(f"0::{own}\n")
    return dict(root=str(root), self_cgroup=str(self_cg))


def _affinity(n):
    return lambda pid: set(range(n))


def test_available_cpus_follows_affinity_and_cgroup_quota(tmp_path):
    paths = _cgroup(tmp_path / "a", v2="150000 100000")
    assert cgroup_cpu_quota(**paths) == pytest.approx(1.5)
    assert available_cpus(affinity=_affinity(8), **paths) == 2        # quota rounded up
    assert available_cpus(affinity=_affinity(1), **paths) == 1        # affinity smaller
    paths = _cgroup(tmp_path / "b", v2="max 100000")
    assert cgroup_cpu_quota(**paths) is None
    assert available_cpus(affinity=_affinity(6), **paths) == 6
    paths = _cgroup(tmp_path / "c", v1=(300000, 100000))             # cgroup v1
    assert available_cpus(affinity=_affinity(16), **paths) == 3
    paths = _cgroup(tmp_path / "d", v1=(-1, 100000))                 # v1 without quota
    assert available_cpus(affinity=_affinity(4), **paths) == 4
    paths = _cgroup(tmp_path / "e", v2="max 100000", own="/user.slice/app.scope",  # nested
                    nested="200000 100000")
    assert available_cpus(affinity=_affinity(64), **paths) == 2
    paths = _cgroup(tmp_path / "f", v2="50000 100000", own="/app",    # parent stricter
                    nested="400000 100000")
    assert available_cpus(affinity=_affinity(64), **paths) == 1
    paths = _cgroup(tmp_path / "g", v2="lots of cpus")
    assert available_cpus(affinity=_affinity(3), **paths) == 3


def test_available_cpus_without_affinity_or_cgroup(tmp_path, monkeypatch):
    nothing = dict(root=str(tmp_path / "none"), self_cgroup=str(tmp_path / "none2"))
    monkeypatch.setattr(os, "cpu_count", lambda: 5)

    def no_affinity(pid):
        raise OSError("not here")

    assert available_cpus(affinity=no_affinity, **nothing) == 5
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert available_cpus(affinity=no_affinity, **nothing) == 1


def test_default_thread_count_is_the_usable_cpus(monkeypatch):
    """Without ANYATTN_NUMPY_THREADS the worker count is available_cpus(), not os.cpu_count()."""
    monkeypatch.delenv("ANYATTN_NUMPY_THREADS", raising=False)
    nb._default_threads.cache_clear()
    monkeypatch.setattr(nb, "available_cpus", lambda: 3)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    try:
        assert NumpyConfig.from_env().n_threads() == 3
        assert NumpyConfig(threads=7).n_threads() == 7
    finally:
        monkeypatch.undo()
        nb._default_threads.cache_clear()
    assert NumpyConfig().n_threads() == available_cpus()


# ------------------------------------------------------------------ BLAS threads
def test_blas_limit_is_counted_and_restored(monkeypatch):
    """The process-wide BLAS limit (used where no per-thread setting exists) is taken by
    the first concurrent call and restored by the last one."""
    calls = []

    class Limiter:
        def restore_original_limits(self):
            calls.append("restore")

    class Controller:
        lib_controllers = [object()]

        def limit(self, limits):
            calls.append(("limit", limits))
            return Limiter()

    monkeypatch.setattr(blas_threads, "_resolved", True)
    monkeypatch.setattr(blas_threads, "_controller", Controller())
    with blas_threads.limited(1) as on:
        assert on
        with blas_threads.limited(1):
            pass
        assert calls == [("limit", 1)]
    assert calls == [("limit", 1), "restore"]


def test_blas_limits_without_threadpoolctl_are_no_ops(monkeypatch):
    """Without threadpoolctl (an install without dependencies) nothing can be limited:
    the mode is "fallback" and calls still work."""
    import builtins

    real_import = builtins.__import__

    def fake_import(name, *a, **k):
        if name == "threadpoolctl":
            raise ImportError("no threadpoolctl")
        return real_import(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    monkeypatch.setattr(blas_threads, "_resolved", False)
    monkeypatch.setattr(blas_threads, "_controller", None)
    monkeypatch.setattr(blas_threads, "_set_local", [])
    monkeypatch.setattr(blas_threads, "_path", None)
    monkeypatch.setattr(blas_threads, "_core", None)
    monkeypatch.setattr(blas_threads, "_import_error", None)
    assert not blas_threads.threadpoolctl_available()
    assert not blas_threads.per_thread_supported()
    assert blas_threads.limit_this_thread(1) is False
    with blas_threads.limited(1) as on:
        assert on is False
    assert blas_threads.blas_library_path() is None
    assert blas_threads.mode() == "fallback" and blas_threads.blas_info() == []
    assert "threadpoolctl cannot be imported" in blas_threads.unavailable_reason()
    be = NumpyBackend(NumpyConfig(threads=2, fwd_bq=16, fwd_bk=16, bwd_bq=16, bwd_bk=16))
    q, k, v, g, bias, mask = _problem(4)
    _call(be, q, k, v, g, bias, mask)


def test_blas_found_through_threadpoolctl():
    pytest.importorskip("threadpoolctl")
    assert blas_threads.threadpoolctl_available()
    assert blas_threads.blas_library_path()
    if blas_threads.per_thread_supported():
        assert blas_threads.limit_this_thread(1) is True


def test_describe_device_names_blas_pool_and_mode():
    """`python -m anyattn info`'s numpy line: the BLAS threadpoolctl found (name,
    version, path, threads), the pool size and how workers limit BLAS."""
    pytest.importorskip("threadpoolctl")
    be = NumpyBackend(NumpyConfig(threads=3))
    text = be.describe_device()
    info = blas_threads.blas_info()
    assert info, "threadpoolctl found no BLAS"
    assert info[0]["name"] in text and info[0]["path"] in text
    assert f"{info[0]['threads']} thread" in text
    assert "pool 3 workers (set)" in text
    assert {"per-thread": "per thread", "process-wide": "process-wide"}[
        blas_threads.mode()] in text


def test_openblas_is_limited_process_wide_and_restored():
    """OpenBLAS's ``openblas_set_num_threads_local`` changes the whole process's count
    (pthreads builds), so OpenBLAS is not taken as per-thread: its limit is the counted
    process-wide one, lifted when the call ends."""
    pytest.importorskip("threadpoolctl")
    libs = blas_threads.blas_info()
    if not libs or any(x["name"] != "openblas" for x in libs):
        pytest.skip("numpy's BLAS is not OpenBLAS")
    assert blas_threads.mode() == "process-wide"
    before = [x["threads"] for x in blas_threads.blas_info()]
    with blas_threads.limited(1):
        assert all(x["threads"] == 1 for x in blas_threads.blas_info())
    assert [x["threads"] for x in blas_threads.blas_info()] == before


def test_fallback_mode_defaults_to_one_worker(monkeypatch):
    """Where BLAS threads cannot be limited, the default pool is one worker (and
    describe_device says why); an explicit thread count is kept."""
    monkeypatch.setattr(blas_threads, "mode", lambda: "fallback")
    monkeypatch.setattr(blas_threads, "blas_info", lambda: [])
    monkeypatch.setattr(blas_threads, "unavailable_reason",
                        lambda: "threadpoolctl cannot be imported (test)")
    monkeypatch.delenv("ANYATTN_NUMPY_THREADS", raising=False)
    monkeypatch.setattr(nb, "available_cpus", lambda **kw: 2)
    nb._default_threads.cache_clear()
    try:
        with pytest.warns(RuntimeWarning, match="1 worker instead of 2.*without --no-deps"):
            assert NumpyConfig().n_threads() == 1
        assert NumpyConfig(threads=2).n_threads() == 2
        text = NumpyBackend(NumpyConfig()).describe_device()
        assert "pool 1 worker," in text and "fallback" in text
        assert "threadpoolctl cannot be imported" in text
    finally:
        monkeypatch.undo()
        nb._default_threads.cache_clear()
