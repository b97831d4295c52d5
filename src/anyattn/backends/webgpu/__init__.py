"""The webgpu backend: tiled WGSL attention kernels through wgpu-py.

Modules: device (adapter/device/limits), pipelines (WGSL assembly + cache),
launch (tile configs, loop-trip budgets, buffers, dispatch), engine (one call's
uploads and launch plan), abi_bridge (the seed's arena ABI), backend
(``WebGPUBackend``).  wgpu is imported only when the backend is used;
:func:`probe` says what it can without importing it.
"""
from __future__ import annotations

from ... import settings
from ...extras import installed, missing_message
from ..base import Probe

__all__ = ["probe"]


def probe() -> Probe:
    """The webgpu backend's state without importing wgpu or creating a device: 'loaded'
    once anyattn's device was created (or failed to be), else whether wgpu is installed."""
    from . import device

    if device.tried():
        return Probe("loaded")
    if not installed("wgpu"):
        return Probe("unavailable", missing_message("wgpu", "webgpu"))
    want = settings.current().wgpu_adapter
    chosen = f"the adapter {device.ENV_ADAPTER}={want!r} selects" if want else \
        "the adapter (high-performance, Vulkan/Metal/DX12)"
    return Probe("installed", f"wgpu found; {chosen} is opened and checked at first use")
