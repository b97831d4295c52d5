"""A fast first call: dispatch decides by the arrays before it imports anything heavy.

Each check runs in a fresh interpreter (a subprocess), as a user's first call would.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

import anyattn
from anyattn.backends import registry

SRC = os.path.dirname(os.path.dirname(os.path.abspath(anyattn.__file__)))
HEAVY = ("torch", "triton", "wgpu")


def _fresh(code: str, **env) -> dict:
    """Run ``code`` in a new interpreter; it prints one JSON line last."""
    e = dict(os.environ, PYTHONPATH=SRC, **env)
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                       text=True, env=e, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_first_numpy_call_imports_no_heavy_module():
    res = _fresh("""
        import json, sys, time
        t0 = time.perf_counter()
        import numpy as np
        import anyattn as aa
        t1 = time.perf_counter()
        rng = np.random.default_rng(0)
        q, k, v = (rng.standard_normal((1, 2, 16, 8)).astype(np.float32) for _ in range(3))
        out, lse = aa.attention(q, k, v, mask=aa.Causal(), return_lse=True)
        g = aa.attention_backward(q, k, v, np.ones_like(out), out=out, lse=lse,
                                  mask=aa.Causal())
        t2 = time.perf_counter()
        assert g.dq.shape == q.shape and np.isfinite(g.dv).all()
        print(json.dumps({"import_s": t1 - t0, "call_s": t2 - t1,
                          "heavy": [m for m in %r if m in sys.modules]}))
        """ % (HEAVY,))
    print(f"\nfirst call from a fresh interpreter: import {res['import_s']:.3f} s, "
          f"forward + backward {res['call_s']:.3f} s")
    assert res["heavy"] == []


@pytest.mark.parametrize("dtype", ["float64", "float16"])
def test_numpy_call_with_explicit_refusal_imports_no_heavy_module(dtype):
    """backend='triton' on NumPy arrays, backend='webgpu' on float64: refused from the
    registry's table, the hint names who can, and nothing heavy was imported to say so."""
    res = _fresh("""
        import json, sys
        import numpy as np
        import anyattn as aa
        q = np.zeros((1, 1, 4, 8), %r)
        msgs = []
        for be in ("triton", "webgpu") if q.dtype == np.float64 else ("triton",):
            try:
                aa.attention(q, q, q, backend=be)
            except NotImplementedError as e:
                msgs.append(str(e))
        print(json.dumps({"msgs": msgs, "heavy": [m for m in %r if m in sys.modules]}))
        """ % (dtype, HEAVY))
    assert res["heavy"] == []
    assert res["msgs"] and all("backends that can" in m and "'numpy'" in m for m in res["msgs"])
    assert "takes ['torch'] arrays, got numpy: pass torch CUDA tensors" in res["msgs"][0]


def test_torch_cpu_tensors_never_probe_triton():
    """torch CPU tensors go to the numpy backend without importing triton (also with
    TRITON_INTERPRET=1, which only an explicit backend='triton' uses)."""
    pytest.importorskip("torch")
    res = _fresh("""
        import json, sys
        import torch
        import anyattn as aa
        from anyattn.backends.registry import choose
        from anyattn.problem import describe
        q = torch.randn(1, 2, 8, 4)
        name = choose(describe(q, q, q), None).name
        print(json.dumps({"name": name, "triton": "triton" in sys.modules,
                          "wgpu": "wgpu" in sys.modules}))
        """, TRITON_INTERPRET="1")
    assert res == {"name": "numpy", "triton": False, "wgpu": False}


def test_webgpu_and_reference_only_by_name():
    """The documented rule: automatic dispatch keeps host arrays on the host (numpy);
    only WebGPU device arrays (anyattn.webgpu, already on the GPU) go to webgpu."""
    assert registry.auto_array_kinds("webgpu") == frozenset({"webgpu"})
    assert registry.auto_array_kinds("reference") == frozenset()
    assert "numpy" in registry.auto_array_kinds("numpy")
    assert registry.auto_array_kinds("triton") == frozenset({"torch"})


def test_describe_backends_reports_every_backend():
    names = [n for n, _ in anyattn.describe_backends()]
    assert names == list(registry.BACKEND_NAMES) == ["triton", "webgpu", "numpy", "reference"]


def test_entries_cover_each_backends_capabilities():
    """The cheap table may never refuse what a backend itself would take."""
    res = _fresh("""
        import inspect, json
        from anyattn.backends import registry
        out = {}
        for name, e in registry.ENTRIES.items():
            be = registry.get_backend(name)
            if be is None:
                continue
            if isinstance(inspect.getattr_static(type(be), "capabilities", None), property):
                if be.availability() is not None:   # the table needs the device
                    continue
            c = be.capabilities
            out[name] = {
                "kinds": sorted(c.array_kinds - e.array_kinds),
                "devices": sorted(c.device_types - e.device_types_now()),
                "dtypes": sorted(c.dtypes - e.dtypes)}
        print(json.dumps(out))
        """, TRITON_INTERPRET="1")
    assert {"numpy", "reference"} <= set(res)
    for name, missing in res.items():
        assert missing == {"kinds": [], "devices": [], "dtypes": []}, name


# -- a suite a user can run ----------------------------------------------------------------

_HIDE = """
import importlib.machinery, sys
HIDDEN = {"torch", "triton", "wgpu", "transformers"}
class NotInstalled:
    '''Finds the hidden packages only outside site-packages: as if not installed (a
    folder of the same name elsewhere on sys.path still shadows them, as it would).'''
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name.split(".")[0] not in HIDDEN:
            return None
        where = [p for p in (path or sys.path) if "-packages" not in p]
        spec = importlib.machinery.PathFinder.find_spec(name, where)
        if spec is None:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return spec
sys.meta_path.insert(0, NotInstalled)
"""


def test_suite_runs_without_torch():
    """The suite collects (every folder) and runs with torch, triton, wgpu and
    transformers not installed: the tests/torch and tests/triton folders must not pass
    for those packages (tests/conftest.py used to crash on `torch.cuda`)."""
    tests = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    code = _HIDE + textwrap.dedent("""
        import pytest
        sys.exit(pytest.main(["-q", "-p", "no:cacheprovider", %r, "-k", "test_masks"]))
        """ % tests)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=os.path.dirname(tests), env=dict(os.environ, PYTHONPATH=SRC),
                       timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert " passed" in r.stdout and "error" not in r.stdout.lower()
