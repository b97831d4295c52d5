"""Run the real seed shader (../shared/seed/attention_bwd.wgsl) through wgpu.

An extra oracle for the ABI tests: the shader is loaded from its own path at
test time (never copied into this repository).  On lavapipe every loop of an
invocation stops after 65,535 iterations in total, so callers keep sizes tiny.
"""
from __future__ import annotations

import functools
import math
from pathlib import Path
from typing import Optional

import numpy as np

REPO = Path(__file__).resolve().parents[2]
SEED_PATH = REPO.parent / "shared" / "seed" / "attention_bwd.wgsl"
WORKGROUP = 64  # the shader's @workgroup_size


def why_unavailable() -> Optional[str]:
    """None when the seed shader and a wgpu adapter are present, else the reason."""
    if not SEED_PATH.is_file():
        return f"seed shader not found at {SEED_PATH}"
    try:
        _device()
    except Exception as e:  # no wgpu, no adapter, no Vulkan loader
        return f"no wgpu adapter ({type(e).__name__}: {e})"
    return None


@functools.lru_cache(maxsize=1)
def _device():
    import wgpu

    adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    if adapter is None:
        raise RuntimeError("request_adapter_sync returned None")
    return adapter.request_device_sync()


@functools.lru_cache(maxsize=1)
def _pipeline():
    dev = _device()
    module = dev.create_shader_module(code=SEED_PATH.read_text())
    return dev.create_compute_pipeline(layout="auto",
                                       compute={"module": module, "entry_point": "attention_bwd"})


def loop_trips(p) -> int:
    """Upper bound on the loop iterations of one seed invocation (lavapipe stops at 65,535)."""
    sq, sk, d = p.seq_q, p.seq_k, p.head_dim
    if p.wrt == 0:
        return sk * d + 3 * sk + sk * d + sk + d * sk
    per_q = sk * d + 3 * sk + (d if p.wrt == 2 else sk * d + sk)
    return d + sq * per_q


def run_seed(arena: np.ndarray, params) -> np.ndarray:
    """One seed launch on a copy of ``arena`` -> the arena after the launch (float32)."""
    import wgpu

    assert loop_trips(params) < 65535, "too large for lavapipe's loop limit"
    dev = _device()
    pipe = _pipeline()
    abuf = dev.create_buffer_with_data(
        data=np.ascontiguousarray(arena, dtype=np.float32).tobytes(),
        usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
    pbuf = dev.create_buffer_with_data(data=params.pack(), usage=wgpu.BufferUsage.UNIFORM)
    group = dev.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=[
        {"binding": 0, "resource": {"buffer": abuf, "offset": 0, "size": abuf.size}},
        {"binding": 1, "resource": {"buffer": pbuf, "offset": 0, "size": pbuf.size}},
    ])
    rows = params.batch * params.heads * params.out_rows
    enc = dev.create_command_encoder()
    cp = enc.begin_compute_pass()
    cp.set_pipeline(pipe)
    cp.set_bind_group(0, group)
    cp.dispatch_workgroups(max(1, math.ceil(rows / WORKGROUP)), 1, 1)
    cp.end()
    dev.queue.submit([enc.finish()])
    return np.frombuffer(dev.queue.read_buffer(abuf), dtype=np.float32).copy()


def make_buffer(arena: np.ndarray, device=None):
    """A wgpu storage buffer holding ``arena`` (on ``device``, default this module's)."""
    import wgpu

    return (device or _device()).create_buffer_with_data(
        data=np.ascontiguousarray(arena, dtype=np.float32).tobytes(),
        usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST)
