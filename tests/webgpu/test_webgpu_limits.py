"""llvmpipe's loop-trip trap, split launches, adapter limits and error paths."""
from __future__ import annotations

import numpy as np
import pytest

import anyattn as aa
from anyattn import reference as R
from anyattn.backends.webgpu import device as wdev
from anyattn.backends.webgpu.launch import LoopLimitError, TileConfig, split_range
from anyattn.backends.webgpu.pipelines import KernelError

from helpers import assert_close, make_qkv
from wg_util import run_probe


def _grads(q, k, v, g, **kw):
    return aa.attention_backward(q, k, v, g, backend="webgpu", **kw)


def test_trip_counts_are_bounded_by_the_model(be):
    """Debug builds count every loop iteration per invocation; the launch code's
    model (TileConfig.trips_per_unit) must be an upper bound for each tiled kernel."""
    q, k, v, g = make_qkv(np.random.default_rng(0), 1, 2, 1, 70, 90, 40)
    be.debug_trips = True
    p_fwd = aa.attention(q, k, v, return_lse=True, backend="webgpu")
    be.debug_trips = False
    from anyattn.problem import describe

    p = describe(q, k, v, dout=g, wrt=("q", "k", "v"))
    be.debug_trips = True
    call, _ = be._build_backward(p, q, k, v, g, p_fwd[0], aa.RowStats.from_lse(p_fwd[1]), None)
    measured = {}
    for l in call.launches:
        if l.kernel in ("bwd_dq", "bwd_dkdv"):
            call.run.run([l])
            trips = call.run.read(l.buffers[9], call.trip_count if l.kernel == "bwd_dq" else
                                  l.grid[0] * l.grid[1] * l.grid[2] * call.cfg.NT)
            measured[l.kernel] = (int(trips.max()), call.cfg.trips_per_unit(l.kernel, 40) *
                                  (call.nkt if l.kernel == "bwd_dq" else call.nqt * 2))
    be.debug_trips = False
    assert set(measured) == {"bwd_dq", "bwd_dkdv"}
    for kern, (got, model) in measured.items():
        assert 0 < got <= model, (kern, got, model)
        assert got >= 0.5 * model, (kern, got, model)      # the model is tight, not vacuous


def test_split_launch_equals_single_launch(be):
    """With a tiny loop budget every tiled launch is split into pieces that continue
    from stored partials: bitwise the same results as one launch, and correct."""
    r = np.random.default_rng(1)
    q, k, v, g = make_qkv(r, 1, 4, 2, 70, 100, 24)
    bias = r.standard_normal((1, 4, 70, 100)).astype(np.float32)
    kw = dict(mask=aa.Causal("bottom_right"), bias=bias, wrt=("q", "k", "v", "bias"))
    o1 = aa.attention(q, k, v, mask=kw["mask"], bias=bias, backend="webgpu")
    g1 = _grads(q, k, v, g, **kw)
    be.loop_limit_override = 100
    o2 = aa.attention(q, k, v, mask=kw["mask"], bias=bias, backend="webgpu")
    assert be.last_pieces["forward"] > 1
    g2 = _grads(q, k, v, g, **kw)
    assert be.last_pieces["bwd_dq"] > 1 and be.last_pieces["bwd_dkdv"] > 1
    np.testing.assert_array_equal(o1, o2)
    for n in ("dq", "dk", "dv", "dbias"):
        np.testing.assert_array_equal(getattr(g1, n), getattr(g2, n))
    rg = R.backward(q, k, v, g, mask=kw["mask"], bias=bias, wrt=kw["wrt"])
    for n in ("dq", "dk", "dv", "dbias"):
        assert_close(getattr(g2, n), getattr(rg, n), "float32", n)


def test_refuses_what_it_cannot_split(be):
    q, k, v, g = make_qkv(np.random.default_rng(2), 1, 1, 1, 8, 8, 8)
    be.loop_limit_override = 3
    with pytest.raises(LoopLimitError, match="loop trips per invocation"):
        aa.attention(q, k, v, backend="webgpu")
    with pytest.raises(LoopLimitError):
        split_range(10, 50, 49, "x")


def test_real_llvmpipe_limit_splits_and_is_right(be):
    """A problem past 65,535 trips per invocation on llvmpipe: split, never wrong.
    Unsplit (budget lifted) llvmpipe returns wrong numbers without an error."""
    ctx = be.context
    if not ctx.is_llvmpipe:
        pytest.skip("needs the llvmpipe adapter (the trap is llvmpipe's)")
    r = np.random.default_rng(3)
    Sq, Sk, D = 4, 22000, 256
    q, k, v = (r.standard_normal((1, 1, s, D)).astype(np.float32) for s in (Sq, Sk, Sk))
    out = aa.attention(q, k, v, backend="webgpu")
    assert be.last_pieces["forward"] >= 2
    ro, _ = R.forward(q, k, v)
    assert_close(out, ro, "float32", "out")
    be.loop_limit_override = 10 ** 9           # what an unguarded launch would do
    bad = aa.attention(q, k, v, backend="webgpu")
    assert be.last_pieces["forward"] == 1
    err = np.max(np.abs(bad - ro)) / np.max(np.abs(ro))
    if err <= 1e-5:
        pytest.skip("this llvmpipe build does not stop long loops (no trap to guard)")
    assert err > 1e-3


def test_buffer_too_large_raises_before_work(be, monkeypatch):
    run = be.runner()
    monkeypatch.setattr(run, "max_binding", 1024)
    q, k, v, _ = make_qkv(np.random.default_rng(4), 1, 2, 2, 64, 64, 16)
    with pytest.raises(ValueError, match="max storage binding"):
        aa.attention(q, k, v, backend="webgpu")
    with pytest.raises(ValueError, match="max storage binding"):
        run.buffer("big", 4096)


def test_batches_split_at_the_binding_limit(be, monkeypatch):
    """Buffers past the storage-binding limit: the batch is split, results as one call."""
    r = np.random.default_rng(13)
    B, Hq, Hkv, Sq, Sk, D = 5, 2, 1, 19, 23, 16
    q, k, v, g = make_qkv(r, B, Hq, Hkv, Sq, Sk, D)
    bias = r.standard_normal((1, Hq, Sq, Sk)).astype(np.float32)
    keep = r.random((B, 1, Sq, Sk)) < 0.7
    mask = aa.KeepMask(keep) & aa.Causal("bottom_right")
    kw = dict(mask=mask, bias=bias)
    wrt = ("q", "k", "v", "bias")
    o1 = aa.attention(q, k, v, backend="webgpu", **kw)
    g1 = aa.attention_backward(q, k, v, g, wrt=wrt, backend="webgpu", **kw)
    monkeypatch.setattr(be.runner(), "max_binding", 2 * 4 * 6 * Hq * Sq + 4 * Hq * Sq * Sk)
    o2 = aa.attention(q, k, v, backend="webgpu", **kw)
    assert be.last_pieces.get("batch_chunks", 1) > 1
    g2 = aa.attention_backward(q, k, v, g, wrt=wrt, backend="webgpu", **kw)
    assert be.last_pieces.get("batch_chunks", 1) > 1
    np.testing.assert_array_equal(o1, o2)
    for n in ("dq", "dk", "dv"):
        np.testing.assert_array_equal(getattr(g1, n), getattr(g2, n))
    rg = R.backward(q, k, v, g, wrt=wrt, **kw)
    assert_close(g2.dbias, rg.dbias, "float32", "dbias")


def test_dispatch_limit(be, monkeypatch):
    run = be.runner()
    monkeypatch.setattr(run, "max_groups", 2)
    q, k, v, _ = make_qkv(np.random.default_rng(5), 1, 3, 3, 100, 10, 8)
    with pytest.raises(ValueError, match="workgroups along x"):
        aa.attention(q, k, v, backend="webgpu")


def test_bh_grid_is_chunked(be, monkeypatch):
    """More batch*heads than workgroups per dimension: launches are chunked (bh0)."""
    run = be.runner()
    q, k, v, g = make_qkv(np.random.default_rng(6), 2, 3, 3, 9, 10, 8)
    ref = aa.attention(q, k, v, backend="webgpu")
    monkeypatch.setattr(run, "max_groups", 4)
    got = aa.attention(q, k, v, backend="webgpu")
    np.testing.assert_array_equal(ref, got)


def test_compile_failure_names_the_kernel(be):
    with pytest.raises(KernelError, match="scatter"):
        be.runner().pipes.get("scatter", "tile", {})    # bindings of another layout


def test_f16_refused_without_the_feature(be, monkeypatch):
    from anyattn.problem import describe

    q, k, v, _ = make_qkv(np.random.default_rng(7), 1, 1, 1, 4, 4, 8, dtype="float16")
    ctx = be.context
    monkeypatch.setattr(ctx, "features", frozenset())
    why = be.unsupported_reasons(describe(q, k, v))
    assert any("shader-f16" in w for w in why)
    with pytest.raises(NotImplementedError, match="shader-f16"):
        aa.attention(q, k, v, backend="webgpu")


def test_bad_adapter_name(monkeypatch):
    pytest.importorskip("wgpu")
    monkeypatch.setenv(wdev.ENV_ADAPTER, "no-such-adapter-xyz")
    with pytest.raises(RuntimeError, match="matches no adapter"):
        wdev._create()


def test_missing_wgpu_reason(monkeypatch):
    import sys

    monkeypatch.setitem(sys.modules, "wgpu", None)
    with pytest.raises(RuntimeError, match=r"needs wgpu, which is not installed: pip install \"anyattn\[webgpu\]\""):
        wdev._create()


def test_uniform_overflow_raises():
    from anyattn.backends.webgpu import uniforms

    with pytest.raises(OverflowError, match="2\\*\\*32"):
        uniforms.pack({"q_off": 1 << 32})


def test_tile_config_consistency():
    with pytest.raises(ValueError):
        TileConfig(16, 16, 16, 16, 2).check()      # update chunk does not fit the staging
    with pytest.raises(ValueError):
        TileConfig(16, 8, 16, 8, 1).check()        # the dK/dV pass needs TX == TY
    TileConfig(16, 16, 16, 8, 2).check()


_TRAP_SRC = """
@group(0) @binding(0) var<storage, read_write> o: array<u32>;
@group(0) @binding(1) var<uniform> P: vec4<u32>;
@compute @workgroup_size(1)
fn main() {
  var acc = 0u;
  for (var i = 0u; i < P.x; i++) {
    for (var j = 0u; j < P.y; j++) { acc += 1u; }
  }
  o[0] = acc;
}"""


def test_llvmpipe_counting_rule(be):
    """The rule the launch code budgets with: every loop test counts, so a loop entered
    once that runs n times costs n + 1; past 65,535 the loops stop (silently)."""
    import struct

    import wgpu

    ctx = be.context
    if not ctx.is_llvmpipe:
        pytest.skip("llvmpipe only")
    dev = ctx.device
    mod = dev.create_shader_module(code=_TRAP_SRC)
    pipe = dev.create_compute_pipeline(layout="auto", compute={"module": mod, "entry_point": "main"})
    ob = dev.create_buffer(size=16, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)

    def run(m, n):
        ub = dev.create_buffer_with_data(data=struct.pack("<4I", m, n, 0, 0),
                                         usage=wgpu.BufferUsage.UNIFORM)
        return int(np.frombuffer(run_probe(dev, pipe, [
            {"binding": 0, "resource": {"buffer": ob}},
            {"binding": 1, "resource": {"buffer": ub}}], ob), np.uint32)[0])

    n = 10
    m_ok = (65535 - 1) // (n + 2)          # outer tests m + 1, inner m * (n + 1)
    assert run(m_ok, n) == m_ok * n
    if run(m_ok + 50, n) == (m_ok + 50) * n:
        pytest.skip("this llvmpipe build does not stop long loops")
    assert run(m_ok + 50, n) < (m_ok + 50) * n
