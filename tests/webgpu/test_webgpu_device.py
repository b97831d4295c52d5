"""wgpu instance backends (issue 12 item 1): no GL/EGL driver unless asked for.

wgpu's GL backend loads Mesa's EGL driver (libEGL_mesa, swrast_dri), which puts Mesa's
libLLVM into the global symbol scope; a later ``import triton`` can then die with
SIGSEGV.  anyattn creates wgpu's instance with Vulkan/Metal/DX12 only unless
ANYATTN_WGPU_ADAPTER names GL.  Each check runs in a fresh interpreter.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from anyattn.backends.webgpu.device import wants_gl

SRC = str(Path(__file__).resolve().parents[2] / "src")

#: libraries of an EGL/GL driver stack (Mesa's, glvnd's, NVIDIA's)
GL_LIBS = ("libEGL", "libGLX", "libGLdispatch", "libGL.so", "libGLES", "_dri.so",
           "libnvidia-eglcore", "libnvidia-glcore")

PROBE = r"""
import ctypes, json, os, sys
import numpy as np
import anyattn as aa
q = np.random.default_rng(0).standard_normal((1, 1, 8, 8)).astype(np.float32)
from anyattn.backends.registry import unavailable_reason
why = unavailable_reason("webgpu")
if why:
    print(json.dumps({"skip": why})); sys.exit(0)
out = aa.attention(q, q, q, backend="webgpu")
ok = bool(np.allclose(out, aa.attention(q, q, q, backend="reference"), atol=1e-5))
from anyattn.backends.webgpu.device import get_context
maps = open("/proc/self/maps").read() if os.path.exists("/proc/self/maps") else ""
libs = sorted({l.split()[-1] for l in maps.splitlines() if "/" in l})
llvm_global = hasattr(ctypes.CDLL(None), "LLVMContextCreate") if os.name == "posix" else False
print(json.dumps({"ok": ok, "libs": libs, "adapter": get_context().name,
                  "llvm_global": llvm_global}), flush=True)
if "--triton" in sys.argv:
    try:
        import triton  # noqa: F401  (the import that crashed after wgpu's GL backend)
    except ImportError:
        pass
    import anyattn
    anyattn.describe_backends()          # probes every backend, triton included
"""


def _probe(env_extra, *args):
    env = dict(os.environ)
    env.pop("ANYATTN_WGPU_ADAPTER", None)
    env.update(env_extra)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", PROBE, *args], env=env, capture_output=True,
                       text=True, timeout=600)
    lines = [l for l in r.stdout.splitlines() if l.startswith("{")]
    info = json.loads(lines[-1]) if lines else {}
    return r, info


def _gl_libs(libs):
    return [l for l in libs if any(g in os.path.basename(l) for g in GL_LIBS)]


def test_webgpu_then_triton_exits_cleanly_without_gl_drivers():
    """A webgpu call, then ``import triton`` and describe_backends(): exit code 0, and
    (Linux) no EGL/GL driver library mapped, Mesa's LLVM not in the global scope."""
    r, info = _probe({}, "--triton")
    assert r.returncode == 0, f"exit code {r.returncode}\n{r.stdout[-2000:]}\n{r.stderr[-4000:]}"
    if "skip" in info:
        pytest.skip(f"webgpu unavailable: {info['skip']}")
    assert info["ok"]
    if sys.platform.startswith("linux"):
        assert not _gl_libs(info["libs"]), \
            f"GL/EGL driver libraries mapped by a webgpu call: {_gl_libs(info['libs'])}"
        assert not info["llvm_global"], "LLVM symbols reached the global scope"
    assert "opengl" not in info["adapter"].lower()


def test_gl_only_when_asked():
    """ANYATTN_WGPU_ADAPTER=opengl selects wgpu's GL backend (where a GL adapter exists);
    this also shows the probe above would see the GL driver libraries."""
    r, info = _probe({"ANYATTN_WGPU_ADAPTER": "opengl"})
    if "skip" in info:
        pytest.skip(f"no GL adapter here: {info['skip']}")
    assert r.returncode == 0, r.stderr[-4000:]
    assert "opengl" in info["adapter"].lower()
    if sys.platform.startswith("linux"):
        assert _gl_libs(info["libs"]), "the GL backend maps an EGL/GL library"


@pytest.mark.parametrize("value,gl", [("", False), ("llvmpipe", False), ("nvidia", False),
                                      ("vulkan", False), ("angle", False), ("gl", True),
                                      ("OpenGL", True), ("llvmpipe gl", True),
                                      ("llvmpipe:gles", True), ("egl", True)])
def test_wants_gl(value, gl):
    assert wants_gl(value) is gl
