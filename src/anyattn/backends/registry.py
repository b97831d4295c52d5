"""Which backends exist, in priority order, and how one is chosen for a problem.

An explicit ``backend=`` raises when that backend cannot serve the problem
(never a silent fallback); auto-dispatch takes the first one that can and,
when none can, raises with every backend's reason.
"""
from __future__ import annotations

import importlib
from typing import Dict, List, Optional, Tuple

from ..problem import Problem
from .base import Backend, BackendUnavailable

__all__ = ["BACKEND_NAMES", "get_backend", "choose", "describe_backends", "available_backends"]

#: name -> "module:Class"; auto-dispatch tries them in this order.
_ENTRIES: Dict[str, str] = {
    "triton": "anyattn.backends.triton.backend:TritonBackend",
    "webgpu": "anyattn.backends.webgpu.backend:WebGPUBackend",
    "numpy": "anyattn.backends.numpy_backend:NumpyBackend",
    "reference": "anyattn.backends.reference_backend:ReferenceBackend",
}
BACKEND_NAMES: Tuple[str, ...] = tuple(_ENTRIES)

_instances: Dict[str, Backend] = {}
_load_errors: Dict[str, str] = {}


def get_backend(name: str) -> Optional[Backend]:
    """The backend instance, or None if its module cannot be imported (see describe_backends)."""
    if name not in _ENTRIES:
        raise ValueError(f"backend={name!r} is unknown; expected one of {BACKEND_NAMES} "
                         "or None (automatic choice)")
    if name in _instances:
        return _instances[name]
    if name in _load_errors:
        return None
    mod_name, cls_name = _ENTRIES[name].split(":")
    try:
        cls = getattr(importlib.import_module(mod_name), cls_name)
    except Exception as e:  # a broken optional backend must not break anyattn
        _load_errors[name] = f"cannot be imported ({type(e).__name__}: {e})"
        return None
    _instances[name] = inst = cls()
    return inst


def unavailable_reason(name: str) -> Optional[str]:
    """None if the named backend can run on this machine, else why not."""
    be = get_backend(name)
    if be is None:
        return _load_errors[name]
    return be.availability()


def describe_backends() -> List[Tuple[str, Optional[str]]]:
    """[(name, None | reason it is unavailable)] for every backend."""
    return [(n, unavailable_reason(n)) for n in BACKEND_NAMES]


def available_backends() -> List[str]:
    return [n for n, why in describe_backends() if why is None]


def choose(p: Problem, backend: Optional[str] = None) -> Backend:
    """The backend that computes ``p``: the named one (or an exception), else the first able."""
    if backend is not None:
        if not isinstance(backend, str):
            raise TypeError(f"backend: expected a name from {BACKEND_NAMES} or None, got "
                            f"{type(backend).__name__}")
        why = unavailable_reason(backend)
        if why is not None:
            raise BackendUnavailable(f"backend={backend!r} is not available here: {why}")
        be = get_backend(backend)
        reasons = be.unsupported_reasons(p)
        if reasons:
            others = [n for n in BACKEND_NAMES if n != backend and _can(n, p)]
            hint = f"; backends that can: {others}" if others else ""
            raise NotImplementedError(
                f"backend={backend!r} cannot compute this problem: " + "; ".join(reasons) + hint)
        return be
    refusals = []
    for name in BACKEND_NAMES:
        be = get_backend(name)
        why = unavailable_reason(name)
        if why is not None:
            refusals.append(f"{name}: {why}")
            continue
        if not be.auto_eligible():
            continue
        reasons = be.unsupported_reasons(p)
        if not reasons:
            return be
        refusals.append(f"{name}: " + "; ".join(reasons))
    raise NotImplementedError("no backend can compute this problem:\n  " + "\n  ".join(refusals))


def _can(name: str, p: Problem) -> bool:
    return unavailable_reason(name) is None and not get_backend(name).unsupported_reasons(p)
