"""webgpu float16 with f16 math (TileConfig.half): f16 workgroup tiles, packed f16
products over short runs, f32 accumulation.  Against the float64 reference at the
float16 tolerance; masks, GQA, head dims, strides, bias, empty rows, split launches."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import anyattn as aa
from anyattn.backends.webgpu.launch import TileConfig, choose_config, half_config

from helpers import make_qkv
from test_webgpu_numerics import MASKS, run_both
from wg_util import assert_backward_trips_within_model


@pytest.fixture
def be16(be):
    if not be.context.has_f16:
        pytest.skip(f"adapter {be.context.name} has no shader-f16 (f16 is refused there)")
    return be


def _f16(*arrs):
    return tuple(np.asarray(a).astype(np.float16) for a in arrs)


def test_f16_uses_the_half_config(be16):
    cfg = choose_config(be16.context, 64, "f16")
    assert cfg.half and cfg.DC == 32 and cfg.check() is None
    assert not choose_config(be16.context, 64).half
    assert cfg.smem_bytes("bwd_dkdv") < choose_config(be16.context, 64).smem_bytes("bwd_dkdv")


@pytest.mark.parametrize("shape", [
    (1, 1, 1, 1, 1, 8), (1, 2, 2, 3, 3, 16), (2, 2, 2, 19, 45, 16), (1, 2, 2, 45, 19, 8),
    (1, 4, 2, 33, 40, 24), (1, 1, 1, 5, 7, 3), (1, 2, 1, 70, 90, 40),
], ids=lambda s: "x".join(map(str, s)))
def test_f16_shapes(be16, shape):
    B, Hq, Hkv, Sq, Sk, D = shape
    q, k, v, g = make_qkv(np.random.default_rng(20), B, Hq, Hkv, Sq, Sk, D, dtype="float16")
    run_both(q, k, v, g, dtype="float16")


@pytest.mark.parametrize("D", [64, 160, 256])
def test_f16_head_dims(be16, D):
    q, k, v, g = make_qkv(np.random.default_rng(21), 1, 2, 1, 37, 41, D, dtype="float16")
    run_both(q, k, v, g, mask=aa.Causal("bottom_right"), dtype="float16")


@pytest.mark.parametrize("name", [n for n in MASKS if n != "offsets"])
def test_f16_masks(be16, name):
    B, Hq, Hkv, Sq, Sk, D = 2, 2, 1, 40, 70, 16
    r = np.random.default_rng(22)
    q, k, v, g = make_qkv(r, B, Hq, Hkv, Sq, Sk, D, dtype="float16")
    run_both(q, k, v, g, mask=MASKS[name](Sq, Sk, r), dtype="float16")


def test_f16_empty_rows_bias_and_strides(be16):
    r = np.random.default_rng(23)
    keep = r.random((1, 1, 40, 36)) < 0.5
    keep[:, :, ::3] = False
    q, k, v, g = make_qkv(r, 1, 2, 1, 40, 36, 16, dtype="float16")
    out, lse, gr = run_both(q, k, v, g, mask=aa.KeepMask(keep), dtype="float16")
    assert np.all(out[:, :, ::3] == 0) and np.all(np.isneginf(lse[:, :, ::3]))
    assert np.all(gr.dq[:, :, ::3] == 0)
    bias = r.standard_normal((1, 2, 40, 36)).astype(np.float16)
    run_both(q, k, v, g, bias=bias, wrt=("q", "k", "v", "bias"), dtype="float16")
    # strided views (packed kv, odd element offsets: the unaligned load path)
    big = r.standard_normal((2, 20, 3, 3 * 16 + 1)).astype(np.float16)
    k2 = big[:, 3:, :, 1:17].swapaxes(1, 2)
    v2 = big[:, 3:, :, 17:33].swapaxes(1, 2)
    q2 = r.standard_normal((2, 13, 3, 16)).astype(np.float16).swapaxes(1, 2)
    g2 = r.standard_normal((2, 3, 13, 16)).astype(np.float16)[:, :, ::-1]
    run_both(q2, k2, v2, g2, mask=aa.Causal(), dtype="float16")


def test_f16_out_read_by_delta_where_it_lies(be16):
    """The delta kernel reads an f16 out as f16 (OUT16: widened exactly), on device
    arrays bound where they lie (an odd element offset and a strided view included):
    no gather launch before it; dk and dv written in f16 into one buffer (two views,
    as in f32); results within the f16 tolerances of float64."""
    from anyattn import reference as R
    from anyattn import webgpu as wg
    from anyattn.api import forward_with_stats

    from helpers import assert_close

    q, k, v, g = make_qkv(np.random.default_rng(53), 1, 4, 2, 37, 45, 24, dtype="float16")
    dq_, dk_, dv_, dg_ = (wg.asarray(x) for x in (q, k, v, g))
    out, st = forward_with_stats(dq_, dk_, dv_, mask=aa.Causal())
    ref = R.backward(q, k, v, g, mask=aa.Causal())
    arena = np.zeros(1 + 2 * out.size, np.float16)
    arena[1:1 + out.size] = out.numpy().reshape(-1)          # odd element offset
    arena[1 + out.size:] = out.numpy().swapaxes(1, 2).reshape(-1)   # bshd copy
    buf = wg.asarray(arena).buffer
    B, H, S, D = out.shape
    views = (out, wg.from_buffer(buf, out.shape, "float16", offset=1),
             wg.from_buffer(buf, out.shape, "float16", offset=1 + out.size,
                            strides=(S * H * D, D, H * D, 1)))
    for o in views:
        gr = aa.attention_backward(dq_, dk_, dv_, dg_, out=o, lse=st, mask=aa.Causal())
        tpl = list(be16.runner().templates._d.values())[-1]
        # no gather before delta; f16 dk and dv written by the dK/dV pass into one buffer
        # and the f16 dq by the dQ pass (OUTB16: no cast launches, session 7)
        assert [l[4] for l in tpl.launches] == ["delta", "bwd_dkdv", "bwd_dq"]
        assert gr.dk.buffer is gr.dv.buffer and gr.dv.offset == gr.dk.size
        for name in ("dq", "dk", "dv"):
            assert_close(getattr(gr, name).numpy(), getattr(ref, name), "float16", name)


def test_f16_split_launch_and_repeat_bitwise(be16):
    r = np.random.default_rng(24)
    q, k, v, g = make_qkv(r, 1, 4, 2, 70, 100, 24, dtype="float16")
    kw = dict(mask=aa.Causal("bottom_right"))
    o1 = aa.attention(q, k, v, backend="webgpu", **kw)
    g1 = aa.attention_backward(q, k, v, g, backend="webgpu", **kw)
    g1b = aa.attention_backward(q, k, v, g, backend="webgpu", **kw)
    cfg = choose_config(be16.context, 24, "f16")
    per = max(cfg.trips_per_unit(kn, 24) for kn in ("forward", "bwd_dq", "bwd_dkdv"))
    be16.loop_limit_override = TileConfig.FIXED_TRIPS + 2 * per     # 2 units per piece
    o2 = aa.attention(q, k, v, backend="webgpu", **kw)
    g2 = aa.attention_backward(q, k, v, g, backend="webgpu", **kw)
    assert be16.last_pieces["bwd_dq"] > 1 and be16.last_pieces["bwd_dkdv"] > 1
    o3 = aa.attention(q, k, v, backend="webgpu", **kw)
    assert be16.last_pieces["forward"] > 1
    np.testing.assert_array_equal(o1, o3)
    np.testing.assert_array_equal(o1, o2)
    for n in ("dq", "dk", "dv"):
        np.testing.assert_array_equal(getattr(g1, n), getattr(g2, n))
        np.testing.assert_array_equal(getattr(g1, n), getattr(g1b, n))


@pytest.mark.parametrize("DC,HC,IC,UC", [(32, 1, 8, 0), (32, 4, 16, 0), (32, 8, 16, 0),
                                         (64, 2, 32, 16), (64, 2, 16, 8)])
def test_f16_run_lengths(be16, DC, HC, IC, UC):
    """Other f16 run lengths and chunks (benchmark variants) are correct too."""
    cfg = dataclasses.replace(half_config(choose_config(be16.context, 32)), DC=DC, HC=HC,
                              IC=IC, UC=UC)
    cfg.check()
    be16.config_override = cfg
    q, k, v, g = make_qkv(np.random.default_rng(25), 1, 2, 1, 37, 45, 32, dtype="float16")
    run_both(q, k, v, g, mask=aa.Causal(), dtype="float16")


def test_half_config_checks(be16):
    with pytest.raises(ValueError):
        dataclasses.replace(half_config(TileConfig(8, 8, 16, 8, 2)), HC=3).check()
    be16.config_override = half_config(TileConfig(8, 8, 16, 8, 2))
    q, k, v, _ = make_qkv(np.random.default_rng(26), 1, 1, 1, 4, 4, 8)
    with pytest.raises(ValueError, match="needs float16"):
        aa.attention(q, k, v, backend="webgpu")


def test_f16_trip_model_bounds_the_loops(be16):
    """The loop-trip model holds for the half kernels (DC = 32) as well."""
    from anyattn.problem import describe

    q, k, v, g = make_qkv(np.random.default_rng(27), 1, 2, 1, 70, 90, 40, dtype="float16")
    o, l = aa.attention(q, k, v, return_lse=True, backend="webgpu")
    p = describe(q, k, v, dout=g, wrt=("q", "k", "v"))
    be16.debug_trips = True
    call, _ = be16._build_backward(p, q, k, v, g, o, aa.RowStats.from_lse(l), None)
    assert call.cfg.half
    assert_backward_trips_within_model(call, 40)


def test_f16_gpu_backward_config_on_this_adapter(be16):
    """The GPU backward variant (D chunks of 64, long staged chunks) is correct here
    too (D past one chunk, masks, GQA) and bitwise equal to the forward's chunking:
    the f16 runs and their f32 order do not depend on DC or IC."""
    ctx = be16.context
    cpu = choose_config(ctx, 160, "f16")
    big = dataclasses.replace(cpu, DC=64, IC=32)
    big.check()
    r = np.random.default_rng(28)
    q, k, v, g = make_qkv(r, 1, 4, 2, 45, 70, 160, dtype="float16")
    mask = aa.Causal() & aa.Window(left=30)
    res = []
    for cfg in (cpu, big):
        be16.config_override = cfg
        res.append(run_both(q, k, v, g, mask=mask, dtype="float16")[2])
    for n in ("dq", "dk", "dv"):
        np.testing.assert_array_equal(getattr(res[0], n), getattr(res[1], n))
