"""webgpu bad inputs, checked before work and cheaply (issue 12 item 5, WebGPU parts).

* a scale that overflows f32 (finite in float64) is a ValueError naming ``scale`` in the
  backend itself (the uniform packer never raises an unnamed OverflowError);
* buffer sizes are checked from shapes before a bias is copied to the host: a broadcast
  bias is uploaded with its broadcast dims at size 1, never materialised, and one that
  cannot fit is refused before any copy.
"""
from __future__ import annotations

import dataclasses
import tracemalloc

import numpy as np
import pytest

from anyattn.modifiers import NO_MODS
import anyattn as aa
from anyattn import reference as R
from anyattn.backends.webgpu import uniforms
from anyattn.backends.webgpu.engine import compact_broadcast, f32_scalar
from anyattn.problem import describe

from helpers import assert_close, make_qkv


@pytest.mark.parametrize("scale", [1e39, -1e39, 1e300])
def test_scale_overflowing_f32_is_named(be, scale):
    q, k, v, g = make_qkv(np.random.default_rng(0), 1, 1, 1, 4, 4, 8)
    p = dataclasses.replace(describe(q, k, v), scale=scale)   # past any API-level check
    with pytest.raises(ValueError, match=r"^scale: .*overflows float32"):
        be.forward(p, q, k, v, None, NO_MODS)
    pb = dataclasses.replace(describe(q, k, v, dout=g, wrt=("q", "k", "v")), scale=scale)
    st = aa.RowStats(np.zeros((1, 1, 4), np.float32), np.zeros((1, 1, 4), np.float32))
    with pytest.raises(ValueError, match=r"^scale: "):
        be.backward(pb, q, k, v, g, q, st, None, NO_MODS)


def test_scale_through_the_api_is_named(be):
    q, k, v, _ = make_qkv(np.random.default_rng(0), 1, 1, 1, 4, 4, 8)
    with pytest.raises(ValueError, match="scale"):
        aa.attention(q, k, v, scale=1e39, backend="webgpu")


def test_uniform_packer_names_an_overflowing_f32_field():
    with pytest.raises(ValueError, match=r"^scale: .*overflows float32"):
        uniforms.pack({"scale": 1e39})
    with pytest.raises(ValueError, match=r"^inv_sk: "):
        uniforms.pack({"inv_sk": -1e40})
    assert len(uniforms.pack({"scale": 0.125})) == uniforms.NBYTES


def test_f32_scalar():
    assert f32_scalar("scale", 0.1) == float(np.float32(0.1))
    assert f32_scalar("scale", 1e-50) == 0.0          # underflow is a value, not an error
    for bad in (float("nan"), float("inf"), 1e39):
        with pytest.raises(ValueError, match="^scale: "):
            f32_scalar("scale", bad)


def test_compact_broadcast_is_a_view():
    base = np.arange(6, dtype=np.float32).reshape(1, 1, 1, 6)
    b = np.broadcast_to(base, (3, 4, 5, 6))
    c = compact_broadcast(b)
    assert c.shape == (1, 1, 1, 6) and np.shares_memory(c, base)
    full = np.ones((2, 3), np.float32)
    assert compact_broadcast(full).shape == (2, 3)


def test_broadcast_bias_is_not_materialised(be):
    """A [B, H, Sq, Sk] view broadcast from one row of keys runs (uploaded as the row),
    where materialising it would pass the binding limit (lowered here to 64 KiB)."""
    rng = np.random.default_rng(1)
    q, k, v, g = make_qkv(rng, 2, 2, 1, 64, 256, 8)
    row = rng.standard_normal((1, 1, 1, 256)).astype(np.float32)
    bias = np.broadcast_to(row, (2, 2, 64, 256))      # 256 KiB if materialised
    run = be.runner()
    saved = run.max_binding
    run.max_binding = 64 * 1024
    try:
        out = aa.attention(q, k, v, bias=bias, backend="webgpu")
        gr = aa.attention_backward(q, k, v, g, bias=bias, backend="webgpu")
    finally:
        run.max_binding = saved
    assert_close(out, R.forward(q, k, v, bias=bias)[0], "float32", "out")
    rg = R.backward(q, k, v, g, bias=bias)
    for n in ("dq", "dk", "dv"):
        assert_close(getattr(gr, n), getattr(rg, n), "float32", n)


def test_oversized_bias_is_refused_before_any_copy(be):
    """A bias that cannot fit the binding limit (128 MiB on lavapipe) even compacted is
    refused from its shape: no host copy (the view below would copy to 256 MiB)."""
    run = be.runner()
    lim = min(run.max_binding, run.max_buffer)
    n = int(np.sqrt(lim // 4)) * 2                     # n*n*4 = 4 * lim bytes
    rng = np.random.default_rng(2)
    q, k, v, _ = make_qkv(rng, 1, 1, 1, n, n, 4)
    small = np.zeros(2 * n, np.float32)
    # rows overlap (stride 4 bytes along i and j): n*n elements over 2n of memory, and no
    # stride is 0, so it is not a broadcast: compacting cannot shrink it
    bias = np.lib.stride_tricks.as_strided(small, shape=(1, 1, n, n), strides=(0, 0, 4, 4))
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match="bias"):
            aa.attention(q, k, v, bias=bias, backend="webgpu")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < lim // 4, f"{peak} bytes allocated before the refusal"
