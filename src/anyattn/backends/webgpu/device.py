"""Adapter and device choice for the webgpu backend (wgpu is imported lazily).

High-performance adapter by default; ``ANYATTN_WGPU_ADAPTER`` overrides it with a
case-insensitive substring of the adapter's name, vendor, description or type
(e.g. ``llvmpipe``, ``nvidia``, ``cpu``).  The limits the kernels need are
requested explicitly at the adapter's own values (the WebGPU defaults are far
lower); ``shader-f16`` is requested where the adapter has it.

Native backends only (Vulkan, Metal, DX12), unless GL is asked for: wgpu's GL/EGL
backend loads Mesa's EGL driver (libEGL_mesa, swrast_dri), which brings Mesa's libLLVM
into the global symbol scope; a later ``import triton`` (automatic dispatch,
``anyattn.torch``, ``torch.compile``) can then crash with SIGSEGV.  The
instance is created with ``set_instance_extras(backends=[Vulkan, Metal, DX12])`` before
wgpu creates it.  ``ANYATTN_WGPU_ADAPTER`` naming GL (a word ``gl``, ``opengl``,
``gles`` or ``egl``, e.g. ``opengl`` or ``llvmpipe gl``: the words other than the GL
one then select the adapter) enables every backend.  If the process created wgpu's
instance before anyattn did, that instance (and its backends) is used as it is.
"""
from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass, field
from typing import Dict, Optional

from ... import settings

__all__ = ["Context", "get_context", "unavailable_reason", "tried", "ENV_ADAPTER",
           "LLVMPIPE_LOOP_LIMIT", "wants_gl", "NATIVE_BACKENDS", "SUBGROUP_FEATURE"]

ENV_ADAPTER = "ANYATTN_WGPU_ADAPTER"
#: the wgpu instance backends used unless GL is asked for (InstanceBackend flag names)
NATIVE_BACKENDS = ("Vulkan", "Metal", "DX12")
_GL_WORDS = frozenset({"gl", "opengl", "gles", "egl"})
#: llvmpipe stops every loop of an invocation once their trips together reach
#: 65,535 (and the results are wrong, silently); we keep a margin below it.
LLVMPIPE_LOOP_LIMIT = 65_000
#: wgpu-py 0.32's name of WebGPU's "subgroups" feature
SUBGROUP_FEATURE = "subgroup"

_LIMIT_NAMES = (
    "max-storage-buffer-binding-size", "max-buffer-size", "max-compute-workgroup-storage-size",
    "max-compute-invocations-per-workgroup", "max-compute-workgroup-size-x",
    "max-compute-workgroups-per-dimension", "max-storage-buffers-per-shader-stage",
    "max-bindings-per-bind-group", "max-uniform-buffer-binding-size",
)
_NEEDED = {"max-storage-buffers-per-shader-stage": 9, "max-compute-invocations-per-workgroup": 64,
           "max-compute-workgroup-storage-size": 16384}


@dataclass
class Context:
    """One wgpu device with what the launch code needs to know about it."""

    adapter: object
    device: object
    info: Dict[str, object]
    limits: Dict[str, int]
    features: frozenset
    is_cpu: bool             # llvmpipe / any CPU adapter
    is_llvmpipe: bool
    loop_limit: Optional[int]  # per-invocation loop-trip budget (None = unbounded)
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def name(self) -> str:
        return f"{self.info.get('device', '?')} ({self.info.get('backend_type', '?')})"

    @property
    def has_f16(self) -> bool:
        return "shader-f16" in self.features

    @property
    def has_subgroups(self) -> bool:
        return SUBGROUP_FEATURE in self.features


_ctx: Optional[Context] = None
_err: Optional[str] = None
_lock = threading.Lock()


def _describe(adapter) -> str:
    i = adapter.info
    return " ".join(str(i.get(k, "")) for k in ("vendor", "device", "description",
                                                 "adapter_type", "backend_type"))


def _words(text: str):
    return [w for w in re.split(r"[^0-9a-z]+", text.lower()) if w]


def wants_gl(want: Optional[str] = None) -> bool:
    """Does ``ANYATTN_WGPU_ADAPTER`` (or ``want``) ask for wgpu's GL backend?"""
    if want is None:
        want = settings.current().wgpu_adapter
    return any(w in _GL_WORDS for w in _words(want))


def _limit_instance_backends() -> Optional[str]:
    """Create wgpu's instance with the native backends only (unless GL is asked for).

    Returns a note when it could not (the instance existed already, or this wgpu has no
    ``set_instance_extras``); the adapter choice then proceeds as before."""
    if wants_gl():
        return None
    try:
        from wgpu.backends.wgpu_native.extras import set_instance_extras
    except ImportError as e:        # another wgpu implementation: nothing to restrict
        return f"no set_instance_extras ({e})"
    try:
        set_instance_extras(backends=list(NATIVE_BACKENDS))
    except RuntimeError as e:       # "Instance already exists": created by the caller
        return str(e)
    return None


def _pick_adapter(wgpu):
    want = settings.current().wgpu_adapter
    if wants_gl(want):              # the GL word picks the backend, other words the adapter
        adapters = wgpu.gpu.enumerate_adapters_sync()
        rest = [w for w in _words(want) if w not in _GL_WORDS]
        for a in adapters:
            if "opengl" in str(a.info.get("backend_type", "")).lower() and \
                    all(w in _describe(a).lower() for w in rest):
                return a
        names = "; ".join(_describe(a) for a in adapters) or "none"
        raise RuntimeError(f"{ENV_ADAPTER}={want!r} asks for wgpu's GL backend, but no GL "
                           f"adapter matches (found: {names})")
    if not want:
        a = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
        if a is None:
            raise RuntimeError("wgpu found no adapter (no Vulkan/Metal/DX12 driver; on Linux "
                               "install mesa-vulkan-drivers libvulkan1 for lavapipe; "
                               f"{ENV_ADAPTER}=opengl allows wgpu's GL backend)")
        if "opengl" in str(a.info.get("backend_type", "")).lower():
            # an instance created by the caller may include GL, whose compute path is the
            # least capable: take a native adapter if there is one
            native = [b for b in wgpu.gpu.enumerate_adapters_sync()
                      if "opengl" not in str(b.info.get("backend_type", "")).lower()]
            if native:
                return native[0]
        return a
    adapters = wgpu.gpu.enumerate_adapters_sync()
    for a in adapters:
        if want.lower() in _describe(a).lower():
            return a
    names = "; ".join(_describe(a) for a in adapters) or "none"
    raise RuntimeError(f"{ENV_ADAPTER}={want!r} matches no adapter (found: {names})")


def _quiet_loader_env() -> None:
    """Mesa's Vulkan WSI layer prints 'XDG_RUNTIME_DIR is invalid' on headless machines;
    give it a private directory when the variable is unset (compute never uses it),
    removed again when the process exits.  (The loader's variable, not an anyattn
    switch: read and written here, not in settings.py.)"""
    if not os.environ.get("XDG_RUNTIME_DIR"):
        import atexit
        import shutil
        import tempfile

        path = tempfile.mkdtemp(prefix="anyattn-xdg-")
        os.environ["XDG_RUNTIME_DIR"] = path
        atexit.register(shutil.rmtree, path, ignore_errors=True)


def _create() -> Context:
    _quiet_loader_env()
    try:
        import wgpu
    except ImportError as e:
        from ...extras import import_error

        raise RuntimeError(str(import_error("wgpu", "webgpu", e))) from e
    _limit_instance_backends()
    adapter = _pick_adapter(wgpu)
    lim = adapter.limits
    for k, need in _NEEDED.items():
        if lim.get(k, 0) < need:
            raise RuntimeError(f"adapter {_describe(adapter)!r} offers {k}={lim.get(k)}, the "
                               f"kernels need {need}")
    req = {k: lim[k] for k in _LIMIT_NAMES if k in lim}
    # 'subgroup' (wgpu-py's name; WGSL's subgroup builtins with naga 0.32 need no
    # `enable`): requested only where offered, used by the 'subgroups' kernel variant
    feats = [f for f in ("shader-f16", "timestamp-query", SUBGROUP_FEATURE)
             if f in adapter.features]
    device = adapter.request_device_sync(required_features=feats, required_limits=req)
    info = dict(adapter.info)
    desc = _describe(adapter).lower()
    is_llvm = "llvmpipe" in desc
    is_cpu = is_llvm or str(info.get("adapter_type", "")).lower() == "cpu"
    return Context(adapter=adapter, device=device, info=info, limits=dict(device.limits),
                   features=frozenset(device.features), is_cpu=is_cpu, is_llvmpipe=is_llvm,
                   loop_limit=LLVMPIPE_LOOP_LIMIT if is_llvm else None)


def get_context() -> Context:
    """The process-wide device (created on first use); RuntimeError if there is none."""
    global _ctx, _err
    with _lock:
        if _ctx is None and _err is None:
            try:
                _ctx = _create()
            except Exception as e:  # no wgpu, no adapter, device request refused
                _err = str(e) or type(e).__name__
        if _ctx is None:
            raise RuntimeError(_err)
        return _ctx


def tried() -> bool:
    """Was the device created, or its creation tried and failed?  (Imports nothing.)"""
    return _ctx is not None or _err is not None


def unavailable_reason() -> Optional[str]:
    try:
        get_context()
    except RuntimeError as e:
        return str(e)
    return None
