"""WebGPU device arrays (anyattn.webgpu): asarray / from_buffer views, the public API on
them against the float64 reference (every tensor argument on the device: q, k, v, dout,
out, lse, bias, sinks, alibi_slopes; results device arrays), zero-copy arena views with
offsets and strides, automatic dispatch, the refusals, and a count of host transfers.

Shape legend: B batch, Hq/Hkv heads, Sq/Sk queries/keys, D head dim.
"""
from __future__ import annotations

import numpy as np
import pytest

import anyattn as aa
from anyattn import reference as R
from anyattn.api import forward_with_stats

from helpers import TOL, assert_close, make_qkv, stable_seed, term_magnitudes

wg = pytest.importorskip("anyattn.webgpu")


@pytest.fixture(scope="module")
def dev(be):
    return wg.device()


def _usage():
    import wgpu

    return wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST


def arena_views(dev, arrays, dtype, layout="bshd", pad=5):
    """Every [B, H, S, D] array written into ONE buffer (arena) at odd offsets, in
    ``layout`` memory ('bshd': [B, S, H, D]; 'dstride': D stride 2) -> views."""
    it = np.dtype(dtype).itemsize
    total = sum(a.size * (2 if layout == "dstride" else 1) + pad for a in arrays) + 8
    host = np.full(total, np.nan, dtype)
    views, pos = [], pad
    for a in arrays:
        B, H, S, D = a.shape
        if layout == "bshd":
            strides = (S * H * D, D, H * D, 1)
        elif layout == "dstride":
            strides = (H * S * D * 2, S * D * 2, D * 2, 2)
        else:
            strides = (H * S * D, S * D, D, 1)
        span = np.lib.stride_tricks.as_strided(host[pos:], a.shape,
                                               [s * it for s in strides])
        span[...] = a
        views.append((pos, strides))
        pos += a.size * (2 if layout == "dstride" else 1) + pad
    buf = dev.create_buffer(size=-(-host.nbytes // 16) * 16, usage=_usage())
    dev.queue.write_buffer(buf, 0, host)
    return [wg.from_buffer(buf, a.shape, dtype, offset=o, strides=s)
            for a, (o, s) in zip(arrays, views)]


def check(q, k, v, g, *, place="asarray", mask=None, bias=None, wrt=("q", "k", "v"),
          pass_stats="rowstats", dev=None, **mods):
    """Forward + backward on device arrays vs the float64 reference."""
    dtype = str(q.dtype)
    if place == "asarray":
        dq, dk, dv, dg = (wg.asarray(x) for x in (q, k, v, g))
    else:
        dq, dk, dv, dg = arena_views(dev, [q, k, v, g], q.dtype, place)
    dmods = {n: (wg.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in mods.items()}
    dbias = None if bias is None else wg.asarray(bias)
    out, st = forward_with_stats(dq, dk, dv, mask=mask, bias=dbias, **dmods)
    assert isinstance(out, wg.DeviceArray) and isinstance(st.max, wg.DeviceArray)
    lse = st.lse
    kw = dict(mask=mask, bias=dbias, wrt=wrt, **dmods)
    if pass_stats == "rowstats":
        gr = aa.attention_backward(dq, dk, dv, dg, out=out, lse=st, **kw)
    elif pass_stats == "lse":
        gr = aa.attention_backward(dq, dk, dv, dg, out=out, lse=lse, **kw)
    else:
        gr = aa.attention_backward(dq, dk, dv, dg, **kw)
    ro, rl = R.forward(q, k, v, mask=mask, bias=bias, **mods)
    rg = R.backward(q, k, v, g, mask=mask, bias=bias, wrt=wrt, **mods)
    mag = term_magnitudes(q, k, v, g, mask=mask, bias=bias, **mods)
    o = out.numpy()
    assert o.dtype == q.dtype
    assert_close(o, ro, dtype, "out", magnitude=mag["out"])
    lh = lse.numpy()
    assert np.array_equal(np.isfinite(lh), np.isfinite(rl))
    fin = np.isfinite(rl)
    if fin.any():
        assert np.max(np.abs(lh[fin] - rl[fin])) <= 10 * TOL[dtype] * max(1.0, np.abs(rl[fin]).max())
    for n in ("dq", "dk", "dv", "dbias", "dsinks"):
        ref, got = getattr(rg, n), getattr(gr, n)
        if ref is None:
            assert got is None, n
            continue
        assert isinstance(got, wg.DeviceArray), n
        want_dt = {"dbias": None if bias is None else bias.dtype,
                   "dsinks": mods["sinks"].dtype if "sinks" in mods else None}.get(n, q.dtype)
        h = got.numpy()
        assert h.shape == ref.shape and h.dtype == want_dt, (n, h.shape, h.dtype)
        assert_close(h, ref, dtype, n, magnitude=mag.get(n))
    return out, gr


# ---------------------------------------------------------------------- arrays
def test_asarray_roundtrip_and_attributes(be):
    x = np.arange(2 * 3 * 5, dtype=np.float32).reshape(2, 3, 5)
    a = wg.asarray(x)
    assert (a.shape, a.dtype, a.strides, a.offset, a.ndim, a.size) == \
        ((2, 3, 5), np.float32, (15, 5, 1), 0, 3, 30)
    assert a.device == "webgpu:0" and a.is_contiguous
    np.testing.assert_array_equal(a.numpy(), x)
    h = wg.asarray(x.astype(np.float16)[:, ::2])      # a strided host array: uploaded compact
    np.testing.assert_array_equal(h.numpy(), x.astype(np.float16)[:, ::2])
    t = a.swapaxes(0, 2)
    assert t.shape == (5, 3, 2) and not t.is_contiguous
    np.testing.assert_array_equal(t.numpy(), x.swapaxes(0, 2))
    np.testing.assert_array_equal(a[1, 1:].numpy(), x[1, 1:])
    np.testing.assert_array_equal(a[:, ::2, 1:4].numpy(), x[:, ::2, 1:4])
    with pytest.raises(TypeError, match="numpy"):
        np.asarray(a)
    with pytest.raises(TypeError, match="float64"):
        wg.asarray(x.astype(np.float64))
    with pytest.raises(NotImplementedError, match="copy"):
        t.reshape(30)


def test_from_buffer_views_and_validation(dev):
    import wgpu

    host = np.arange(64, dtype=np.float32)
    buf = dev.create_buffer(size=256, usage=_usage())
    dev.queue.write_buffer(buf, 0, host)
    v = wg.from_buffer(buf, (2, 3), "float32", offset=5, strides=(10, 2))
    np.testing.assert_array_equal(v.numpy(), host[5:][:20:10, None] + np.arange(0, 6, 2))
    b = wg.from_buffer(buf, (4, 3), np.float32, offset=1, strides=(0, 1))   # broadcast
    np.testing.assert_array_equal(b.numpy(), np.broadcast_to(host[1:4], (4, 3)))
    wg.from_buffer(buf, (64,), "float32")                                    # exactly fits
    with pytest.raises(ValueError, match="past the end"):
        wg.from_buffer(buf, (65,), "float32")
    with pytest.raises(ValueError, match="past the end"):
        wg.from_buffer(buf, (2, 3), "float32", offset=42, strides=(20, 1))
    with pytest.raises(ValueError, match="negative"):
        wg.from_buffer(buf, (2,), "float32", strides=(-1,))
    with pytest.raises(ValueError, match="offset"):
        wg.from_buffer(buf, (2,), "float32", offset=-1)
    with pytest.raises(ValueError, match="strides"):
        wg.from_buffer(buf, (2, 2), "float32", strides=(1,))
    with pytest.raises(TypeError, match="float64"):
        wg.from_buffer(buf, (2,), "float64")
    with pytest.raises(TypeError, match="int32"):
        wg.from_buffer(buf, (2,), np.int32)
    with pytest.raises(TypeError, match="GPUBuffer"):
        wg.from_buffer(host, (2,), "float32")
    ub = dev.create_buffer(size=64, usage=wgpu.BufferUsage.UNIFORM | wgpu.BufferUsage.COPY_DST)
    with pytest.raises(ValueError, match="STORAGE"):
        wg.from_buffer(ub, (2,), "float32")
    h16 = wg.from_buffer(buf, (128,), "float16")
    assert h16.size == 128
    with pytest.raises(ValueError, match="past the end"):
        wg.from_buffer(buf, (129,), "float16")


# ---------------------------------------------------------------------- the API on them
@pytest.mark.parametrize("case", [
    dict(B=1, Hq=2, Hkv=1, Sq=37, Sk=70, D=16, mask="causal_br"),
    dict(B=2, Hq=2, Hkv=2, Sq=9, Sk=9, D=20, mask=None, bias="full", wrt=("q", "k", "v", "bias")),
    dict(B=2, Hq=4, Hkv=2, Sq=13, Sk=17, D=8, mask="window", bias="bcast",
         wrt=("q", "k", "v", "bias"), mods=("softcap", "alibi", "sinks")),
    dict(B=1, Hq=3, Hkv=1, Sq=21, Sk=5, D=12, mask="docs", mods=("sinks",),
         wrt=("q", "v", "sinks")),
    dict(B=2, Hq=2, Hkv=1, Sq=16, Sk=33, D=32, mask="keep", mods=("alibi_b",)),
])
@pytest.mark.parametrize("place", ["asarray", "bshd", "dstride"])
def test_api_on_device_arrays(be, dev, case, place):
    rng = np.random.default_rng(stable_seed(place, case["Sq"]))
    B, Hq, Hkv, Sq, Sk, D = (case[n] for n in ("B", "Hq", "Hkv", "Sq", "Sk", "D"))
    q, k, v, g = make_qkv(rng, B, Hq, Hkv, Sq, Sk, D)
    mask = {None: None, "causal_br": aa.Causal(align="bottom_right"),
            "window": aa.Causal() & aa.Window(left=4),
            "docs": aa.Documents(np.repeat(np.arange(3), 7)[:Sq], np.arange(Sk) % 2),
            "keep": aa.KeepMask(rng.random((1, 1, Sq, Sk)) > 0.3)}[case.get("mask")]
    bias = {None: None, "full": rng.standard_normal((B, Hq, Sq, Sk)).astype(np.float32),
            "bcast": rng.standard_normal((1, Hq, 1, Sk)).astype(np.float32)}[case.get("bias")]
    mods = {}
    for m in case.get("mods", ()):
        if m == "softcap":
            mods["softcap"] = 2.5
        if m == "alibi":
            mods["alibi_slopes"] = rng.uniform(0.05, 0.5, Hq).astype(np.float32)
        if m == "alibi_b":
            mods["alibi_slopes"] = rng.uniform(0.05, 0.5, (B, Hq)).astype(np.float32)
        if m == "sinks":
            mods["sinks"] = rng.standard_normal(Hq).astype(np.float32)
    check(q, k, v, g, place=place, mask=mask, bias=bias, wrt=case.get("wrt", ("q", "k", "v")),
          dev=dev, **mods)


@pytest.mark.parametrize("pass_stats", ["lse", "none"])
def test_plain_lse_and_recompute(be, pass_stats):
    """A plain lse device array is refined on the device; without out/lse the
    backward recomputes them (both against the reference), large logits included."""
    rng = np.random.default_rng(3)
    q, k, v, g = make_qkv(rng, 1, 2, 2, 11, 19, 8)
    check(q * 30, k * 30, v, g, mask=aa.Causal(align="bottom_right"), pass_stats=pass_stats)
    check(q, k, v, g, mask=aa.Causal(align="bottom_right"), pass_stats=pass_stats,
          sinks=rng.standard_normal(2).astype(np.float32), wrt=("q", "k", "v", "sinks"))


def test_float16_device_arrays(be):
    if not be.context.has_f16:
        pytest.skip("adapter lacks shader-f16")
    rng = np.random.default_rng(5)
    q, k, v, g = make_qkv(rng, 1, 2, 1, 19, 23, 16, dtype="float16")
    bias = rng.standard_normal((1, 2, 19, 23)).astype(np.float16)
    sinks = rng.standard_normal(2).astype(np.float16)
    check(q, k, v, g, mask=aa.Causal(), bias=bias, sinks=sinks,
          wrt=("q", "k", "v", "bias", "sinks"))
    check(q, k, v, g, place="bshd", dev=wg.device(), mask=aa.Causal())


def test_attention_layout_dispatch_and_empty(be):
    rng = np.random.default_rng(9)
    q, k, v, g = make_qkv(rng, 1, 2, 2, 6, 7, 8)
    qs, ks, vs = (wg.asarray(np.ascontiguousarray(x.swapaxes(1, 2))) for x in (q, k, v))
    out = aa.attention(qs, ks, vs, layout="bshd")              # automatic: webgpu
    assert isinstance(out, wg.DeviceArray) and out.shape == (1, 6, 2, 8)
    np.testing.assert_allclose(out.numpy().swapaxes(1, 2), R.forward(q, k, v)[0],
                               rtol=0, atol=2e-6)
    e = wg.asarray(np.zeros((1, 2, 0, 8), np.float32))         # Sk = 0: empty rows
    sinks = wg.asarray(np.array([0.5, -1.0], np.float32))
    o, lse = aa.attention(wg.asarray(q), e, e, return_lse=True, sinks=sinks)
    assert isinstance(o, wg.DeviceArray) and not o.numpy().any()
    np.testing.assert_array_equal(lse.numpy(), np.broadcast_to(np.array([0.5, -1.0], np.float32)[None, :, None], (1, 2, 6)))
    o, lse = aa.attention(wg.asarray(q), e, e, return_lse=True)
    assert np.all(lse.numpy() == -np.inf)
    gr = aa.attention_backward(wg.asarray(q), e, e, wg.asarray(g))
    assert isinstance(gr.dq, wg.DeviceArray) and not gr.dq.numpy().any()


def test_refusals(be, dev):
    rng = np.random.default_rng(1)
    q, k, v, g = make_qkv(rng, 1, 2, 2, 4, 4, 8)
    dq, dk, dv = (wg.asarray(x) for x in (q, k, v))
    with pytest.raises(TypeError, match="numpy array but q is a webgpu"):
        aa.attention(dq, k, dv)
    with pytest.raises(TypeError, match="webgpu array but q is a numpy"):
        aa.attention(q, dk, v, backend="webgpu")
    with pytest.raises(NotImplementedError, match="backend='numpy'.*webgpu"):
        aa.attention(dq, dk, dv, backend="numpy")
    with pytest.raises(NotImplementedError, match="reference"):
        aa.attention(dq, dk, dv, backend="reference")
    with pytest.raises(TypeError, match="sinks: is a numpy array"):
        aa.attention(dq, dk, dv, sinks=np.zeros(2, np.float32))
    with pytest.raises(TypeError, match="bias"):
        aa.attention(dq, dk, dv, bias=np.zeros((4, 4), np.float32))
    with pytest.raises(TypeError, match="dtype differs"):
        aa.attention(dq, wg.asarray(k.astype(np.float16)), dv)
    # another wgpu device: refused by name
    import wgpu

    other = wgpu.gpu.request_adapter_sync().request_device_sync()
    ob = other.create_buffer(size=256, usage=_usage())
    ok = wg.from_buffer(ob, k.shape, "float32")
    assert ok.device != "webgpu:0"
    with pytest.raises(ValueError, match="webgpu:0"):
        aa.attention(dq, ok, dv)
    oq = wg.from_buffer(ob, (1, 1, 2, 8), "float32")
    with pytest.raises(NotImplementedError, match="another wgpu device"):
        aa.attention(oq, oq, oq)


def test_no_host_transfers(be, monkeypatch):
    """A call on device arrays moves no tensor data through the host: no read-back at
    all, and the only writes are uniforms and the ``aux`` mask tables (bounded: tile
    map + ids + zeros for sinks/slopes, here < 1 KiB)."""
    import wgpu

    rng = np.random.default_rng(2)
    B, H, S, D = 1, 2, 40, 16
    q, k, v, g = make_qkv(rng, B, H, H, S, S, D)
    dq, dk, dv, dg = (wg.asarray(x) for x in (q, k, v, g))
    bias = wg.asarray(rng.standard_normal((1, H, S, S)).astype(np.float32))
    sinks = wg.asarray(rng.standard_normal(H).astype(np.float32))
    slopes = wg.asarray(rng.uniform(0.1, 0.3, H).astype(np.float32))
    kw = dict(mask=aa.Causal(), bias=bias, sinks=sinks, alibi_slopes=slopes, softcap=3.0)
    forward_with_stats(dq, dk, dv, **kw)            # compile first (no transfers counted)
    queue = type(be.device.queue)
    writes, reads, maps = [], [], []
    w0, r0 = queue.write_buffer, queue.read_buffer

    def wb(self, buffer, offset, data, *a, **k):
        writes.append((buffer.label, int(buffer.usage), memoryview(data).nbytes))
        return w0(self, buffer, offset, data, *a, **k)

    def rb(self, *a, **k):
        reads.append(a)
        return r0(self, *a, **k)
    monkeypatch.setattr(queue, "write_buffer", wb)
    monkeypatch.setattr(queue, "read_buffer", rb)
    for name in ("map_sync", "map_async", "read_mapped"):
        orig = getattr(type(dq.buffer), name)
        monkeypatch.setattr(type(dq.buffer), name,
                            lambda self, *a, _o=orig, **k: (maps.append(a), _o(self, *a, **k))[1])
    out, st = forward_with_stats(dq, dk, dv, **kw)
    gr = aa.attention_backward(dq, dk, dv, dg, out=out, lse=st,
                               wrt=("q", "k", "v", "bias", "sinks"), **kw)
    lse = st.lse
    assert not reads and not maps
    uni = [w for w in writes if w[1] & int(wgpu.BufferUsage.UNIFORM)]
    other = [w for w in writes if not w[1] & int(wgpu.BufferUsage.UNIFORM)]
    assert all(label == "aux" for label, _, _ in other), other
    assert sum(n for _, _, n in other) < 1024, other
    assert uni and all(n <= 512 for _, _, n in uni)
    monkeypatch.undo()
    ro, rl = R.forward(q, k, v, mask=aa.Causal(), bias=bias.numpy(), sinks=sinks.numpy(),
                       alibi_slopes=slopes.numpy(), softcap=3.0)
    assert_close(out.numpy(), ro, "float32", "out")
    assert np.allclose(lse.numpy(), rl, atol=1e-5)
    assert gr.dbias.shape == (1, H, S, S) and gr.dsinks.shape == (H,)
