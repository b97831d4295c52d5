"""Describing the backends imports none of their libraries (torch, triton, wgpu).

``describe_backends()``, ``available_backends()`` and ``python -m anyattn info`` decide
from installed packages, environment flags and driver files.  Importing triton to
decide crashed the process (SIGSEGV) after the caller had opened a wgpu GL device: wgpu's
GL backend loads Mesa's EGL driver, which puts Mesa's libLLVM in the global symbol scope.
Each check runs in a fresh interpreter.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

import anyattn
from anyattn.backends import registry
from anyattn.backends import triton as triton_pkg
from anyattn.backends.base import Probe
from anyattn.backends.registry import BackendStatus

SRC = os.path.dirname(os.path.dirname(os.path.abspath(anyattn.__file__)))
HEAVY = ("torch", "triton", "wgpu")

#: argv[1]: "none" (a fresh interpreter), "caller" (the caller opens a device on every
#: wgpu adapter first, GL and Vulkan), "gl-env" (anyattn's own webgpu call on the
#: adapter ANYATTN_WGPU_ADAPTER=opengl selects).  Prints one JSON line last.
SCRIPT = r"""
import json, sys
mode = sys.argv[1]
if mode == "caller":
    import wgpu
    adapters = wgpu.gpu.enumerate_adapters_sync()
    kinds = sorted({str(a.info.get("backend_type", "")).lower() for a in adapters})
    if not {"opengl", "vulkan"} <= set(kinds):
        print(json.dumps({"skip": f"needs a GL and a Vulkan wgpu adapter, found {kinds}"}))
        sys.exit(0)
    devices = [a.request_device_sync() for a in adapters]
before = set(sys.modules)
import numpy as np
import anyattn
if mode == "gl-env":
    from anyattn.backends.registry import unavailable_reason
    why = unavailable_reason("webgpu")
    if why is not None:
        print(json.dumps({"skip": f"no GL adapter: {why}"}))
        sys.exit(0)
    q = np.ones((1, 1, 4, 8), np.float32)
    anyattn.attention(q, q, q, backend="webgpu")
    from anyattn.backends.webgpu.device import get_context
    assert "opengl" in get_context().name.lower(), get_context().name
    before = set(sys.modules)
from anyattn.cli import main
statuses = {st.name: [st.state, st.reason] for st in anyattn.describe_backends()}
names = anyattn.available_backends()
print("--- info ---")
main(["info"])
new = sorted(m for m in set(sys.modules) - before if m.split(".")[0] in %r)
print(json.dumps({"new": new, "statuses": statuses, "available": names}))
""" % (HEAVY,)


def _run(mode: str, interpret: bool, **env_extra):
    env = dict(os.environ, PYTHONPATH=SRC)
    env.pop("ANYATTN_WGPU_ADAPTER", None)
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    env.update(env_extra)
    r = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, (f"exit code {r.returncode}\n{r.stdout[-3000:]}\n"
                               f"{r.stderr[-3000:]}")
    res = json.loads(r.stdout.strip().splitlines()[-1])
    if "skip" in res:
        pytest.skip(res["skip"])
    return res, r.stdout


def _needs_wgpu():
    if importlib.util.find_spec("wgpu") is None:
        pytest.skip("wgpu is not installed")


def _check(res, out, interpret: bool, webgpu_state: str):
    assert res["new"] == [], f"describing the backends imported {res['new']}"
    st = res["statuses"]
    assert st["numpy"] == ["available", None] and st["reference"] == ["available", None]
    assert st["webgpu"][0] == webgpu_state
    # triton is never loaded to describe it
    assert st["triton"][0] == ("installed" if interpret else st["triton"][0])
    assert st["triton"][0] in ("installed", "unavailable")
    if st["triton"][0] == "unavailable":
        assert "TRITON_INTERPRET=1 is not set" in st["triton"][1]
    for name in ("triton", "webgpu"):
        if st[name][0] == "installed":
            assert name in res["available"]
            assert f"{name:10s} installed, not yet loaded (" in out
            assert "checked at first use" in out


@pytest.mark.parametrize("interpret", [False, True], ids=["no-interpreter", "interpreter"])
def test_describe_in_a_fresh_interpreter_imports_nothing_heavy(interpret):
    res, out = _run("none", interpret)
    _check(res, out, interpret, "installed" if importlib.util.find_spec("wgpu") else
           "unavailable")


@pytest.mark.parametrize("interpret", [False, True], ids=["no-interpreter", "interpreter"])
def test_describe_after_the_callers_gl_and_vulkan_devices(interpret):
    """The reproducer: the caller opens a device on every wgpu adapter (GL included), then
    describes anyattn's backends: exit code 0, triton not imported."""
    _needs_wgpu()
    res, out = _run("caller", interpret)
    _check(res, out, interpret, "installed")


@pytest.mark.parametrize("interpret", [False, True], ids=["no-interpreter", "interpreter"])
def test_describe_after_anyattns_own_gl_device(interpret):
    """ANYATTN_WGPU_ADAPTER=opengl: a webgpu call on the GL adapter, then describe: webgpu
    verified available, triton not imported."""
    _needs_wgpu()
    res, out = _run("gl-env", interpret, ANYATTN_WGPU_ADAPTER="opengl")
    _check(res, out, interpret, "available")
    assert "webgpu     available" in out


def test_a_loaded_backend_is_reported_as_verified():
    """Once a call (here unavailable_reason, the full check) loaded triton, describe
    reports what the check found."""
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    code = textwrap.dedent("""
        import json
        import anyattn
        from anyattn.backends.registry import backend_status, unavailable_reason
        before = backend_status("triton").state
        why = unavailable_reason("triton")
        after = backend_status("triton")
        print(json.dumps([before, why, after.state, after.reason]))
        """)
    env = dict(os.environ, PYTHONPATH=SRC, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == ["installed", None, "available",
                                                             None]


def test_backend_status_is_a_name_reason_pair():
    ok = BackendStatus("numpy", "available")
    inst = BackendStatus("webgpu", "installed", "wgpu found")
    bad = BackendStatus("triton", "unavailable", "no GPU")
    assert ok == ("numpy", None) and inst == ("webgpu", None) and bad == ("triton", "no GPU")
    name, why = bad
    assert (name, why, bad.state, bad.detail) == ("triton", "no GPU", "unavailable", "no GPU")
    assert str(inst) == "webgpu: installed, not yet loaded: wgpu found"
    assert dict(anyattn.describe_backends())["numpy"] is None
    import copy
    import pickle

    for st in (ok, inst, bad):
        for back in (copy.copy(st), pickle.loads(pickle.dumps(st))):
            assert (back, back.state, back.detail) == (st, st.state, st.detail)
    assert repr(inst) == "BackendStatus('webgpu', 'installed', 'wgpu found')"
    with pytest.raises(ValueError, match="state"):
        BackendStatus("numpy", "maybe")
    with pytest.raises(ValueError, match="state"):
        Probe("ready")


def test_describe_verify_loads_and_checks():
    """verify=True is the full check of every backend (what unavailable_reason says)."""
    for st in registry.describe_backends(verify=True):
        assert st.state in ("available", "unavailable")
        assert st.reason == registry.unavailable_reason(st.name)


def test_triton_probe_from_driver_files(monkeypatch, tmp_path):
    """Without the interpreter and with torch not imported, the driver files decide."""
    for package in ("torch", "triton"):
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.delitem(sys.modules, "triton", raising=False)
    driver = tmp_path / "nvidiactl"
    monkeypatch.setattr(triton_pkg, "_driver_paths", lambda: (str(driver),))
    pr = triton_pkg.probe()
    assert pr.state == "unavailable" and str(driver) in pr.detail
    driver.write_text("")
    pr = triton_pkg.probe()
    assert pr.state == "installed" and str(driver) in pr.detail
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    pr = triton_pkg.probe()
    assert pr.state == "installed" and "interpreter" in pr.detail
