"""Shared setup of the triton-backend tests: where tensors live, whether the backend can
run here, and the gradient names.

On a machine without a GPU, tests/conftest.py sets TRITON_INTERPRET=1, so the kernels
run on CPU tensors through Triton's interpreter.  Importing this module skips the
importing test module where torch or triton is missing.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from anyattn.backends.registry import unavailable_reason  # noqa: E402

from helpers import torch_on  # noqa: E402

__all__ = ["DEV", "GRAD", "HAS_CUDA", "HAS_GLUON", "RUNNABLE", "SM90", "T", "needs_gluon",
           "needs_sm90", "needs_triton"]

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
RUNNABLE = unavailable_reason("triton") is None
needs_triton = pytest.mark.skipif(not RUNNABLE, reason=f"triton: {unavailable_reason('triton')}")
HAS_GLUON = True
try:
    from triton.experimental.gluon.language.nvidia import hopper as _h  # noqa: F401
except ImportError:
    HAS_GLUON = False
needs_gluon = pytest.mark.skipif(not HAS_GLUON, reason="needs triton.experimental.gluon")
#: an sm_90 GPU (H100 / H200): the Hopper path's kernels can run
SM90 = HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)
needs_sm90 = pytest.mark.skipif(not SM90,
                                reason="needs an sm_90 GPU (H100 / H200) for the Hopper path")
#: argument name -> the Grads field holding its gradient
GRAD = {"q": "dq", "k": "dk", "v": "dv", "bias": "dbias", "sinks": "dsinks"}


def T(x, dtype=None):
    """A NumPy array as a torch tensor on DEV (dtype: a torch dtype or None)."""
    return torch_on(x, DEV, dtype)
