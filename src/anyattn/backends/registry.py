"""Which backends exist, in priority order, and how one is chosen for a problem.

An explicit ``backend=`` raises when that backend cannot serve the problem
(never a silent fallback); auto-dispatch takes the first one that can and,
when none can, raises with every backend's reason.

Cheap before heavy: every backend has an entry here that says, as plain data,
which arrays it could ever take (array kind, device type, dtype).  A call is
checked against these entries first; only a backend that passes is imported and
asked for its ``availability()`` (which may import torch, triton or wgpu and
open a device).  So a call on NumPy arrays never imports torch, triton or wgpu.

Automatic dispatch, the rule:

- torch tensors on a CUDA device: ``triton``;
- NumPy arrays and torch CPU tensors: ``numpy`` (host memory stays on the host);
- WebGPU device arrays (``anyattn.webgpu.asarray`` / ``from_buffer``): ``webgpu``
  (device memory stays on the device, even on a CPU adapter such as lavapipe);
- ``webgpu`` and ``reference`` only when named (``backend="webgpu"``).  Auto-
  dispatch never moves host arrays to a GPU: it would create a wgpu device
  (0.5-1 s and GPU memory the caller did not ask for), copy every input to the
  GPU and the results back on each call, and return bits that depend on the
  driver.  On a machine with a GPU and large NumPy problems, pass
  ``backend="webgpu"`` (``python -m anyattn info`` says whether it runs there).
"""
from __future__ import annotations

import importlib
import os
import sys
from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Optional, Tuple

from ..problem import Problem
from .base import Backend, BackendUnavailable

__all__ = ["BACKEND_NAMES", "Entry", "ENTRIES", "get_backend", "choose", "describe_backends",
           "available_backends", "unavailable_reason", "reach_reasons", "auto_array_kinds",
           "clear_choices"]

_F16_32 = frozenset({"float16", "bfloat16", "float32"})
_ALL = frozenset({"float16", "bfloat16", "float32", "float64"})
#: why a host backend refuses WebGPU device arrays, and the remedy
_HOST_REMEDY = ("WebGPU device arrays stay on the GPU: use backend='webgpu' (or None), or "
                "read them back with .numpy()")


@dataclass(frozen=True)
class Entry:
    """What a backend could ever take, readable without importing it or its libraries.

    A superset of the backend's own ``Capabilities`` (tests check it); the backend
    still refuses finer cases itself once it is loaded.
    """

    target: str                        # "module:Class"
    array_kinds: FrozenSet[str]        # 'numpy', 'torch'
    device_types: FrozenSet[str]       # 'cpu', 'cuda'
    dtypes: FrozenSet[str]
    auto_array_kinds: FrozenSet[str]   # the array kinds auto-dispatch may give it
    #: (variable, value): with this environment setting the backend takes CPU
    #: devices too (Triton's interpreter); never for auto-dispatch.
    cpu_when_env: Optional[Tuple[str, str]] = None
    #: modules its availability() imports: a refusal's hint probes the backend only
    #: when they are already loaded (an error message never imports them)
    heavy: Tuple[str, ...] = ()
    #: the remedy appended to a refusal for the array kind / the device
    kind_remedy: str = ""
    device_remedy: str = ""

    def device_types_now(self, auto: bool = False) -> FrozenSet[str]:
        if auto or self.cpu_when_env is None:
            return self.device_types
        if os.environ.get(self.cpu_when_env[0]) == self.cpu_when_env[1]:
            return self.device_types | {"cpu"}
        return self.device_types


#: name -> Entry; auto-dispatch tries them in this order.
ENTRIES: Dict[str, Entry] = {
    "triton": Entry("anyattn.backends.triton.backend:TritonBackend",
                    frozenset({"torch"}), frozenset({"cuda"}), _F16_32,
                    auto_array_kinds=frozenset({"torch"}),
                    cpu_when_env=("TRITON_INTERPRET", "1"), heavy=("torch", "triton"),
                    kind_remedy="pass torch CUDA tensors",
                    device_remedy="move the inputs with .cuda() (CPU tensors run only "
                                  "under Triton's interpreter, TRITON_INTERPRET=1)"),
    # host (NumPy) arrays by name only; WebGPU device arrays (anyattn.webgpu) automatically
    "webgpu": Entry("anyattn.backends.webgpu.backend:WebGPUBackend",
                    frozenset({"numpy", "webgpu"}), frozenset({"cpu", "webgpu"}),
                    frozenset({"float32", "float16"}),
                    auto_array_kinds=frozenset({"webgpu"}), heavy=("wgpu",),
                    kind_remedy="pass NumPy arrays or anyattn.webgpu device arrays"),
    "numpy": Entry("anyattn.backends.numpy_backend:NumpyBackend",
                   frozenset({"numpy", "torch"}), frozenset({"cpu"}), _ALL,
                   auto_array_kinds=frozenset({"numpy", "torch"}),
                   kind_remedy=_HOST_REMEDY,
                   device_remedy="move the inputs with .cpu()"),
    "reference": Entry("anyattn.backends.reference_backend:ReferenceBackend",
                       frozenset({"numpy", "torch"}), frozenset({"cpu"}), _ALL,
                       auto_array_kinds=frozenset(),         # the oracle: by name only
                       kind_remedy=_HOST_REMEDY,
                       device_remedy="move the inputs with .cpu()"),
}
BACKEND_NAMES: Tuple[str, ...] = tuple(ENTRIES)

_instances: Dict[str, Backend] = {}
_load_errors: Dict[str, str] = {}


def _check_name(name: str) -> Entry:
    if name not in ENTRIES:
        raise ValueError(f"backend={name!r} is unknown; expected one of {BACKEND_NAMES} "
                         "or None (automatic choice)")
    return ENTRIES[name]


def get_backend(name: str) -> Optional[Backend]:
    """The backend instance, or None if its module cannot be imported (see describe_backends)."""
    entry = _check_name(name)
    if name in _instances:
        return _instances[name]
    if name in _load_errors:
        return None
    mod_name, cls_name = entry.target.split(":")
    try:
        cls = getattr(importlib.import_module(mod_name), cls_name)
    except Exception as e:  # a broken optional backend must not break anyattn
        _load_errors[name] = f"cannot be imported ({type(e).__name__}: {e})"
        return None
    _instances[name] = inst = cls()
    return inst


def unavailable_reason(name: str) -> Optional[str]:
    """None if the named backend can run on this machine, else why not (may import
    the backend's libraries and open its device)."""
    be = get_backend(name)
    if be is None:
        return _load_errors[name]
    return be.availability()


def reach_reasons(name: str, p: Problem, auto: bool = False) -> List[str]:
    """Why the named backend can never take ``p``'s arrays, from its entry alone
    (imports nothing; empty list: it may, ask the backend itself).  ``auto``: for
    automatic dispatch (no interpreter devices)."""
    e = _check_name(name)
    why = []
    if p.array_kind not in e.array_kinds:
        why.append(f"takes {sorted(e.array_kinds)} arrays, got {p.array_kind}"
                   + (f": {e.kind_remedy}" if e.kind_remedy else ""))
    devices = e.device_types_now(auto)
    if p.array_kind in e.array_kinds and p.device.split(":")[0] not in devices:
        why.append(f"runs on {sorted(devices)} devices, the inputs are on {p.device}"
                   + (f": {e.device_remedy}" if e.device_remedy else ""))
    if p.dtype not in e.dtypes:
        why.append(f"supports dtypes {sorted(e.dtypes)}, got {p.dtype}")
    return why


def auto_array_kinds(name: str) -> FrozenSet[str]:
    """The array kinds automatic dispatch may give the named backend (see the rule above)."""
    return _check_name(name).auto_array_kinds


def describe_backends() -> List[Tuple[str, Optional[str]]]:
    """[(name, None | reason it is unavailable)] for every backend (imports them all)."""
    return [(n, unavailable_reason(n)) for n in BACKEND_NAMES]


def available_backends() -> List[str]:
    return [n for n, why in describe_backends() if why is None]


#: (Problem, backend argument, TRITON_INTERPRET) -> the backend ``choose`` gave.  Only
#: Problems that hold no array (describe's memo hands the same one back per signature);
#: a refusal is never kept.  What a choice reads besides the Problem: the name, that
#: variable (the Triton backend's CPU devices) and the backends' availability, taken as
#: fixed once a backend has computed a call (clear_choices() forgets).
_choices: Dict[tuple, Backend] = {}
_CHOICES_MAX = 256


def clear_choices() -> None:
    """Forget the kept choices (tests; a backend's availability changed at run time)."""
    _choices.clear()


def choose(p: Problem, backend: Optional[str] = None) -> Backend:
    """The backend that computes ``p``: the named one (or an exception), else the first able."""
    key = None
    if p.mask.q_ids is None and p.mask.keep is None:
        key = (p, backend, os.environ.get("TRITON_INTERPRET"))
        try:
            be = _choices.get(key)
        except TypeError:                 # an unhashable backend argument: refused below
            key = be = None
        if be is not None:
            return be
    be = _choose(p, backend)
    if key is not None:
        if len(_choices) >= _CHOICES_MAX:
            _choices.clear()
        _choices[key] = be
    return be


def _choose(p: Problem, backend: Optional[str]) -> Backend:
    """choose's decision, in full."""
    if backend is not None:
        if not isinstance(backend, str):
            raise TypeError(f"backend: expected a name from {BACKEND_NAMES} or None, got "
                            f"{type(backend).__name__}")
        _check_name(backend)
        reasons = reach_reasons(backend, p)
        if not reasons:
            why = unavailable_reason(backend)
            if why is not None:
                raise BackendUnavailable(f"backend={backend!r} is not available here: {why}")
            reasons = get_backend(backend).unsupported_reasons(p)
        if reasons:
            raise NotImplementedError(
                f"backend={backend!r} cannot compute this problem: " + "; ".join(reasons)
                + _hint(backend, p))
        return get_backend(backend)
    refusals = []
    for name in BACKEND_NAMES:
        if p.array_kind not in ENTRIES[name].auto_array_kinds:
            continue                      # by name only for these arrays: not even loaded
        reasons = reach_reasons(name, p, auto=True)
        if reasons:
            refusals.append(f"{name}: " + "; ".join(reasons))
            continue
        why = unavailable_reason(name)
        if why is not None:
            refusals.append(f"{name}: {why}")
            continue
        be = get_backend(name)
        if not be.auto_eligible():
            continue
        reasons = be.unsupported_reasons(p)
        if not reasons:
            return be
        refusals.append(f"{name}: " + "; ".join(reasons))
    by_name = [n for n in BACKEND_NAMES if p.array_kind not in ENTRIES[n].auto_array_kinds
               and not reach_reasons(n, p)]
    hint = (f"\n(automatic dispatch does not use {by_name} for {p.array_kind} arrays; "
            "pass backend=... to use one)") if by_name else ""
    raise NotImplementedError("no backend can compute this problem:\n  "
                              + "\n  ".join(refusals) + hint)


def _hint(refused: str, p: Problem) -> str:
    """The other backends that can compute ``p``.  One whose probe would import a
    module not yet loaded (torch, triton, wgpu) is named as a maybe, not probed."""
    can, maybe = [], []
    for name in BACKEND_NAMES:
        if name == refused or reach_reasons(name, p):
            continue
        if not all(m in sys.modules for m in ENTRIES[name].heavy):
            maybe.append(name)
        elif unavailable_reason(name) is None and not get_backend(name).unsupported_reasons(p):
            can.append(name)
    hint = f"; backends that can: {can}" if can else ""
    if maybe:
        hint += (f"; perhaps also {maybe} (not probed: `python -m anyattn info` says "
                 "whether it runs here)")
    return hint
