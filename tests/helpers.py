"""Shared test utilities: seeded problems, error measures, tolerances, backend harnesses.

Shape legend: B batch, Hq/Hkv heads, Sq/Sk queries/keys, D head dim.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import numpy as np

#: relative max-abs error allowed vs the float64 reference, by dtype (DESIGN.md §4).
TOL = {"float64": 1e-12, "float32": 1e-5, "tf32": 3e-4, "float16": 3e-3, "bfloat16": 2e-2}


def rel_err(got, ref) -> float:
    """max|got - ref| / max|ref| over finite reference entries (0-size -> 0)."""
    got = np.asarray(to_np(got), dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    if ref.size == 0:
        return 0.0
    scale = np.max(np.abs(ref))
    diff = np.max(np.abs(got - ref))
    if scale == 0:
        return float(diff)
    return float(diff / scale)


def assert_close(got, ref, dtype: str, what: str = "", tol: Optional[float] = None):
    tol = TOL[dtype] if tol is None else tol
    g = to_np(got)
    assert not np.isnan(g).any(), f"{what}: NaN in result"
    e = rel_err(g, ref)
    assert e <= tol, f"{what}: relative error {e:.3g} > {tol:.1g} ({dtype})"


def to_np(x):
    if x is None:
        return None
    if isinstance(x, np.ndarray):
        return x
    if type(x).__module__.startswith("torch"):
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        return x.numpy()
    return np.asarray(x)


def make_qkv(rng, B, Hq, Hkv, Sq, Sk, D, dtype="float32", scale_v=1.0):
    q = rng.standard_normal((B, Hq, Sq, D))
    k = rng.standard_normal((B, Hkv, Sk, D))
    v = rng.standard_normal((B, Hkv, Sk, D)) * scale_v
    g = rng.standard_normal((B, Hq, Sq, D))
    return tuple(x.astype(dtype) for x in (q, k, v, g))


@dataclass
class Harness:
    """How a backend takes test inputs: array library, device, dtypes, sizes."""

    name: str
    kind: str            # 'numpy' | 'torch'
    device: str          # 'cpu' | 'cuda'
    dtypes: tuple        # float dtypes exercised by the suite
    small: bool          # interpreted / emulated: keep sizes tiny

    def put(self, x):
        if x is None or self.kind == "numpy":
            return x
        import torch

        if isinstance(x, np.ndarray) and x.dtype == bool:
            return torch.from_numpy(x).to(self.device)
        return torch.from_numpy(np.ascontiguousarray(x)).to(self.device)

    def put_mask(self, m):
        """Mask arrays live where the inputs live."""
        return self.put(m)


def harness_for(name: str) -> Harness:
    if name == "numpy":
        return Harness("numpy", "numpy", "cpu", ("float32", "float64"), small=False)
    if name == "reference":
        return Harness("reference", "numpy", "cpu", ("float32", "float64"), small=False)
    if name == "triton":
        import torch

        dev = "cuda" if torch.cuda.is_available() else "cpu"
        small = dev == "cpu" or os.environ.get("TRITON_INTERPRET") == "1"
        return Harness("triton", "torch", dev, ("float32",), small=small)
    if name == "webgpu":
        small = True
        try:
            from anyattn.backends.registry import get_backend

            be = get_backend("webgpu")
            small = bool(getattr(be, "is_cpu_adapter", lambda: True)())
        except Exception:
            pass
        return Harness("webgpu", "numpy", "cpu", ("float32",), small=small)
    raise KeyError(name)
