"""The webgpu backend: tiled WGSL attention kernels through wgpu-py.

Modules: device (adapter/device/limits), pipelines (WGSL assembly + cache),
launch (tile configs, loop-trip budgets, buffers, dispatch), engine (one call's
uploads and launch plan), abi_bridge (the seed's arena ABI), backend
(``WebGPUBackend``).  wgpu is imported only when the backend is used.
"""
