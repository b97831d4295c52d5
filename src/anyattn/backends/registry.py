"""Which backends exist, in priority order, and how one is chosen for a problem.

An explicit ``backend=`` raises when that backend cannot serve the problem
(never a silent fallback); auto-dispatch takes the first one that can and,
when none can, raises with every backend's reason.

Cheap before heavy: every backend has an entry here that says, as plain data,
which arrays it could ever take (array kind, device type, dtype).  A call is
checked against these entries first; only a backend that passes is imported and
asked for its ``availability()`` (which may import torch, triton or wgpu and
open a device).  So a call on NumPy arrays never imports torch, triton or wgpu.

Describing the backends (``describe_backends``, ``python -m anyattn info``) imports
none of them either: a backend with heavy libraries has a ``probe()`` in its package
that decides from installed packages (``importlib.util.find_spec``), environment
flags and driver files, and asks its libraries only where they are loaded already.
Such a backend is reported "installed" (not yet loaded, its device checked at first
use) until a call (or ``unavailable_reason``) has loaded it; then "available" or
"unavailable" as verified.

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
from dataclasses import dataclass
from typing import Dict, FrozenSet, List, Optional, Tuple

from .. import settings
from ..problem import Problem
from .base import Backend, BackendUnavailable, Probe

__all__ = ["BACKEND_NAMES", "Entry", "ENTRIES", "get_backend", "choose", "describe_backends",
           "available_backends", "backend_status", "BackendStatus", "unavailable_reason",
           "reach_reasons", "auto_array_kinds", "clear_choices", "AVAILABLE", "INSTALLED",
           "UNAVAILABLE"]

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
    cpu_when_setting: Optional[str] = None
    #: "module:function" returning a ``Probe`` without importing the backend's libraries
    #: (torch, triton, wgpu); None: the backend imports nothing heavy, describing it
    #: loads and checks it
    probe: Optional[str] = None
    #: the remedy appended to a refusal for the array kind / the device
    kind_remedy: str = ""
    device_remedy: str = ""
    #: the dispatch rule in words (``python -m anyattn info`` for a backend not yet loaded)
    dispatch: str = "only when named"

    def device_types_now(self, auto: bool = False) -> FrozenSet[str]:
        if auto or self.cpu_when_setting is None:
            return self.device_types
        if getattr(settings.current(), self.cpu_when_setting):
            return self.device_types | {"cpu"}
        return self.device_types


#: name -> Entry; auto-dispatch tries them in this order.
ENTRIES: Dict[str, Entry] = {
    "triton": Entry("anyattn.backends.triton.backend:TritonBackend",
                    frozenset({"torch"}), frozenset({"cuda"}), _F16_32,
                    auto_array_kinds=frozenset({"torch"}),
                    cpu_when_setting="triton_interpret",
                    probe="anyattn.backends.triton:probe",
                    dispatch="automatic for torch CUDA tensors",
                    kind_remedy="pass torch CUDA tensors",
                    device_remedy="move the inputs with .cuda() (CPU tensors run only "
                                  "under Triton's interpreter, TRITON_INTERPRET=1)"),
    # host (NumPy) arrays by name only; WebGPU device arrays (anyattn.webgpu) automatically
    "webgpu": Entry("anyattn.backends.webgpu.backend:WebGPUBackend",
                    frozenset({"numpy", "webgpu"}), frozenset({"cpu", "webgpu"}),
                    frozenset({"float32", "float16"}),
                    auto_array_kinds=frozenset({"webgpu"}),
                    probe="anyattn.backends.webgpu:probe",
                    dispatch="automatic for WebGPU device arrays, NumPy arrays only when named",
                    kind_remedy="pass NumPy arrays or anyattn.webgpu device arrays"),
    "numpy": Entry("anyattn.backends.numpy_backend:NumpyBackend",
                   frozenset({"numpy", "torch"}), frozenset({"cpu"}), _ALL,
                   auto_array_kinds=frozenset({"numpy", "torch"}),
                   dispatch="automatic for NumPy arrays and torch CPU tensors",
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
    """None if the named backend can run on this machine, else why not: the full check,
    which imports the backend's libraries and may open its device (for a backend about
    to be used; ``backend_status`` describes one without loading it)."""
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


#: BackendStatus.state values
AVAILABLE, INSTALLED, UNAVAILABLE = "available", "installed", "unavailable"


class BackendStatus(tuple):
    """``(name, reason)``: ``reason`` is None unless the backend cannot run here.

    ``state``: ``"available"`` (loaded and checked: it runs here), ``"installed"``
    (its packages are installed but not yet loaded: the device is checked at first
    use, ``reason`` None) or ``"unavailable"`` (``reason`` says why).  ``detail``:
    what is known about an installed backend, the reason of an unavailable one.
    """

    def __new__(cls, name: str, state: str, detail: str = ""):
        if state not in (AVAILABLE, INSTALLED, UNAVAILABLE):
            raise ValueError(f"state: expected {AVAILABLE!r}, {INSTALLED!r} or "
                             f"{UNAVAILABLE!r}, got {state!r}")
        self = super().__new__(cls, (name, detail if state == UNAVAILABLE else None))
        self.state, self.detail = state, detail
        return self

    def __getnewargs__(self):                 # copy and pickle rebuild all three fields
        return self[0], self.state, self.detail

    def __repr__(self) -> str:
        return f"BackendStatus({self[0]!r}, {self.state!r}, {self.detail!r})"

    @property
    def name(self) -> str:
        return self[0]

    @property
    def reason(self) -> Optional[str]:
        return self[1]

    def __str__(self) -> str:
        if self.state == AVAILABLE:
            return f"{self.name}: available"
        if self.state == INSTALLED:
            return f"{self.name}: installed, not yet loaded: {self.detail}"
        return f"{self.name}: unavailable: {self.detail}"


def _probe(name: str) -> Probe:
    target = _check_name(name).probe
    if target is None or name in _load_errors:
        return Probe("loaded")
    mod_name, fn_name = target.split(":")
    return getattr(importlib.import_module(mod_name), fn_name)()


def backend_status(name: str, verify: bool = False) -> BackendStatus:
    """The named backend's state without importing its libraries (torch, triton, wgpu)
    unless they are loaded already; ``verify=True``: load and check it
    (``unavailable_reason``)."""
    pr = Probe("loaded") if verify else _probe(name)
    if pr.state == "unavailable":
        return BackendStatus(name, UNAVAILABLE, pr.detail)
    if pr.state == "installed":
        return BackendStatus(name, INSTALLED, pr.detail)
    why = unavailable_reason(name)
    return BackendStatus(name, AVAILABLE) if why is None else \
        BackendStatus(name, UNAVAILABLE, why)


def describe_backends(verify: bool = False) -> List[BackendStatus]:
    """Every backend's ``BackendStatus``, a ``(name, None | reason it is unavailable)``
    pair with ``.state`` ("available", "installed": not yet loaded, its device checked
    at first use, or "unavailable") and ``.detail``.  Imports no backend library
    (torch, triton, wgpu) unless ``verify=True``, which loads and checks them all."""
    return [backend_status(n, verify) for n in BACKEND_NAMES]


def available_backends(verify: bool = False) -> List[str]:
    """The backends not known to be unavailable: available ones and, unless
    ``verify=True`` (which loads and checks them), installed ones not yet loaded."""
    return [st.name for st in describe_backends(verify) if st.reason is None]


#: (Problem, backend argument, TRITON_INTERPRET) -> the backend ``choose`` gave.  Only
#: Problems that hold no array (describe's memo hands the same one back per signature;
#: not those with Documents / KeepMask terms or a paged cache's tables);
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
    if p.mask.q_ids is None and p.mask.keep is None and p.pages is None:
        key = (p, backend, settings.current().triton_interpret)
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
    """The other backends that can compute ``p``.  One not yet loaded (its check would
    import torch, triton or wgpu, or open a device) is named as a maybe, not probed."""
    can, maybe = [], []
    for name in BACKEND_NAMES:
        if name == refused or reach_reasons(name, p):
            continue
        st = backend_status(name)
        if st.state == INSTALLED:
            maybe.append(name)
        elif st.state == AVAILABLE and not get_backend(name).unsupported_reasons(p):
            can.append(name)
    hint = f"; backends that can: {can}" if can else ""
    if maybe:
        hint += (f"; perhaps also {maybe} (not probed: `python -m anyattn info` says "
                 "whether it runs here)")
    return hint
