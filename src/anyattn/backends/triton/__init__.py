"""The ``triton`` backend: fused attention forward and backward for torch CUDA tensors
(and CPU tensors under ``TRITON_INTERPRET=1``).

kernels.py   @triton.jit kernels only
launch.py    the entry points (forward, backward) and the caches' controls
route.py     which path (Hopper or portable) and config a call runs: one function
forward.py   the forward's launch;  backward.py: the backward's launches
prepared.py  per-signature prepared launches, launch resolution (fallbacks, autotuning)
tiles.py     mask arguments, tile lists;  operands.py: layouts, fp32 schemes, modifiers
configs.py   frozen tile configs, heuristics, autotuning, the fixed test plan
backend.py   TritonBackend: capabilities, availability, refusals, dispatch
head_dims.py the head-dim rule (<= 256 everywhere, above it the decoding forward)
hopper/      the Hopper kernels (Gluon), their configs and coverage table

Nothing here imports torch or triton at package import time; backend.py does so lazily.
:func:`probe` says what it can without importing them.
"""
from __future__ import annotations

import os
import sys
from typing import List

from ... import settings
from ...extras import installed, missing_message
from ..base import Probe

__all__ = ["probe", "gpu_driver_files"]

#: files a GPU driver torch can use for its "cuda" devices leaves on Linux: NVIDIA's
#: (native and WSL2) and AMD's ROCm
_LINUX_DRIVER_FILES = ("/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/dxg",
                       "/usr/lib/wsl/lib/libcuda.so.1", "/dev/kfd")
NO_DEVICE = "TRITON_INTERPRET=1 is not set for the CPU interpreter"


def _driver_paths() -> tuple:
    if sys.platform.startswith("linux"):
        return _LINUX_DRIVER_FILES
    if sys.platform == "win32":
        # Windows' own variable (where the system lives), not an anyattn switch
        return (os.path.join(os.environ.get("SystemRoot", r"C:\Windows"), "System32",
                             "nvcuda.dll"),)
    return ()


def gpu_driver_files() -> List[str]:
    """The GPU driver files present on this machine (file checks only)."""
    return [p for p in _driver_paths() if os.path.exists(p)]


def probe() -> Probe:
    """The triton backend's state from installed packages, the interpreter flag and the
    driver files; torch.cuda is asked only where torch is imported already."""
    for package in ("torch", "triton"):
        if not installed(package):
            return Probe("unavailable", missing_message(package, "triton"))
    if "torch" in sys.modules and "triton" in sys.modules:
        return Probe("loaded")
    if settings.current().triton_interpret:
        return Probe("installed", "torch and triton found; CPU tensors run under Triton's "
                                  "interpreter (TRITON_INTERPRET=1), checked at first use")
    if "torch" in sys.modules:
        if not sys.modules["torch"].cuda.is_available():
            return Probe("unavailable", "no CUDA device (torch.cuda.is_available() is False) "
                                        f"and {NO_DEVICE}")
        return Probe("installed", "torch and triton found; a CUDA device is present "
                                  "(torch.cuda.is_available()), triton is checked at first use")
    files = gpu_driver_files()
    if not files:
        paths = _driver_paths()
        where = f"none of {', '.join(paths)} exists" if paths else f"no CUDA on {sys.platform}"
        return Probe("unavailable", f"no GPU driver found ({where}) and {NO_DEVICE}")
    return Probe("installed", f"torch and triton found; GPU driver found ({files[0]}), the "
                              "CUDA device is checked at first use")
