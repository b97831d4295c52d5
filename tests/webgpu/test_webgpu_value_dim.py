"""webgpu with v's head dim Dv != q's / k's D (the opt-in input ``value_dim``).

The kernels of such a problem are the plain ones compiled with VDIM: the S / dP loop runs
over max(D, Dv) with each operand's loader reading zeros past its own dim, the column
slices cover out's Dv (forward), dQ's D, or the larger of dK's D and dV's Dv (a slice
past one skips its update).  So a problem with Dv != D computes, bit for bit, what the
plain kernels compute on inputs zero-padded to one head dim max(D, Dv) (same config,
same sums in the same order): checked for every kernel variant, f16, split launches,
device arrays; against float64 in the contract suite (tests/backends/test_contract.py)
and here for the f16 and device-array paths.  The ABI keeps Dv == D.
"""
from __future__ import annotations

import numpy as np
import pytest

import anyattn as aa
from anyattn.backends.webgpu.launch import ENV_VARIANT, choose_config

from helpers import assert_close, make_qkv
from wg_util import assert_backward_trips_within_model, backward_call, fwd_bwd, one_unit_loop_limit

#: (D, Dv) pairs: v narrower and wider than q / k, not multiples of the D chunk
DIMS = [(40, 24), (24, 40)]


def _pad(x, n):
    """x [..., d] zero-padded to [..., n]."""
    return np.concatenate([x, np.zeros(x.shape[:-1] + (n - x.shape[-1],), x.dtype)], -1)


def _padded(q, k, v, g):
    """The problem at one head dim P = max(D, Dv): the narrower pair zero-padded."""
    P = max(q.shape[-1], v.shape[-1])
    return tuple(_pad(x, P) for x in (q, k, v, g))


def _case(seed, D, Dv, dtype="float32", B=1, Hq=4, Hkv=2, Sq=21, Sk=37):
    return make_qkv(np.random.default_rng(seed), B, Hq, Hkv, Sq, Sk, D, dtype, Dv=Dv)


def _run(q, k, v, g, mask, bias=None, wrt=("q", "k", "v"), scale=None):
    """Forward (out, lse) and backward through the API: [out, lse, dq, dk, dv, dbias]."""
    out, lse = aa.attention(q, k, v, mask=mask, bias=bias, scale=scale, return_lse=True,
                            backend="webgpu")
    gr = aa.attention_backward(q, k, v, g, out=out, lse=lse, mask=mask, bias=bias, wrt=wrt,
                               scale=scale, backend="webgpu")
    return [out, lse, gr.dq, gr.dk, gr.dv, gr.dbias]


def _assert_padded_bitwise(got, padded, D, Dv):
    """Results of the (D, Dv) problem equal the padded problem's, cut to their dims."""
    cut = {"out": Dv, "dq": D, "dk": D, "dv": Dv}
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dbias"), got, padded):
        if a is None and b is None:
            continue
        if name in cut:
            assert a.shape[-1] == cut[name], (name, a.shape)
            b = b[..., :cut[name]]
        np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.parametrize("dims", DIMS, ids=[f"{d}-{dv}" for d, dv in DIMS])
def test_portable_is_the_zero_padded_problem(be, monkeypatch, dims):
    """out, lse, dq, dk, dv and dbias of Dv != D equal those of the problem zero-padded
    to max(D, Dv), bit for bit, and float64's within tolerance: GQA, a causal mask, a
    (1, Hq, Sq, Sk) bias + dbias, sizes that are no multiples of the tiles."""
    from anyattn import reference as R

    D, Dv = dims
    q, k, v, g = _case(60, D, Dv)
    bias = np.random.default_rng(61).standard_normal((1, 4, 21, 37)).astype(np.float32)
    mask = aa.Causal("bottom_right")
    wrt = ("q", "k", "v", "bias")
    monkeypatch.setenv(ENV_VARIANT, "portable")
    got = _run(q, k, v, g, mask, bias, wrt)
    _assert_padded_bitwise(got, _run(*_padded(q, k, v, g), mask, bias, wrt, 1 / np.sqrt(D)),
                           D, Dv)
    rg = R.backward(q, k, v, g, mask=mask, bias=bias, wrt=wrt)
    assert_close(got[0], R.forward(q, k, v, mask=mask, bias=bias)[0], "float32", "out")
    for name, x in zip(("dq", "dk", "dv", "dbias"), got[2:]):
        assert_close(x, getattr(rg, name), "float32", name)


@pytest.mark.exhaustive          # each variant compiles its own kernels on lavapipe (~15 s)
@pytest.mark.parametrize("variant", ["staged-dsq", "wide-dsq"])
def test_gpu_variants_are_portable_bitwise(be, monkeypatch, variant):
    """The GPU routes' variants with Dv != D (register prefetch, the staging array, 8
    query rows per invocation with aliased tiles, the 5-product backward's dS store and
    read) give portable's bits in f32, as they do for Dv == D."""
    D, Dv = 40, 24
    q, k, v, g = _case(62, D, Dv, Sq=45)
    mask = aa.Causal("bottom_right")
    res = []
    for var in ("portable", variant):
        monkeypatch.setenv(ENV_VARIANT, var)
        res.append(_run(q, k, v, g, mask))
    assert be.last_pieces["bwd_dq"] >= 1
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), *res):
        np.testing.assert_array_equal(a, b, err_msg=name)


@pytest.mark.exhaustive          # its own kernels on lavapipe (~20 s)
def test_subgroups_variant(be, monkeypatch):
    """The subgroups variant (butterfly row reductions in the forward, several lanes per
    row in the delta pass over Dv) with Dv != D against float64."""
    from helpers import compare_with_reference

    if not be.context.has_subgroups:
        pytest.skip(f"adapter {be.context.name} has no 'subgroup' feature")
    monkeypatch.setenv(ENV_VARIANT, "subgroups")
    for D, Dv in DIMS:
        q, k, v, g = _case(68, D, Dv, Sq=33)
        compare_with_reference("webgpu", q, k, v, g, mask=aa.Causal("bottom_right"))


def test_split_launches_and_column_slices(be):
    """Launches split at a one-unit loop budget (forward, dQ, dK/dV continue from stored
    f32 partials, dV's at its own stride) give one launch's bits; D and Dv past one
    column slice (the dK/dV grid covers max(D, Dv), dV's update skipped past Dv)."""
    D, Dv = 72, 40
    q, k, v, g = _case(67, D, Dv, Sq=30, Sk=70)
    cfg = choose_config(be.context, D)
    assert cfg.slices(D) > 1, "D must span several column slices"
    mask = aa.Causal("bottom_right")
    one = fwd_bwd(be, q, k, v, g, cfg, mask)
    be.loop_limit_override = one_unit_loop_limit(cfg, D)
    split = fwd_bwd(be, q, k, v, g, cfg, mask)
    assert be.last_pieces["bwd_dq"] > 1 and be.last_pieces["bwd_dkdv"] > 1
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), one, split):
        np.testing.assert_array_equal(a, b, err_msg=name)
    be.loop_limit_override = None
    _assert_padded_bitwise(one, fwd_bwd(be, *_padded(q, k, v, g), cfg, mask), D, Dv)


@pytest.mark.parametrize("dims", [(24, 40), (40, 24)], ids=["24-40", "40-24"])
def test_trip_model_bounds_the_value_dim_loops(be, dims):
    """The loop-trip model (S / dP over max(D, Dv)) bounds the VDIM kernels' loops."""
    D, Dv = dims
    q, k, v, g = _case(63, D, Dv, Sq=40, Sk=50)
    call = backward_call(be, q, k, v, g, choose_config(be.context, max(D, Dv)),
                         debug_trips=True)
    assert call.DV == Dv and call.D == D
    assert_backward_trips_within_model(call, max(D, Dv))


@pytest.mark.parametrize("dims", [(40, 24), (24, 40), (40, 22)],
                         ids=["40-24", "24-40", "40-22"])
def test_f16(be, dims):
    """float16: the padded problem's bits and float64's tolerance; Dv = 22 (no multiple
    of 4) takes f32 scratch and a cast where 24 and 40 let the kernels write f16."""
    from anyattn import reference as R

    if not be.context.has_f16:
        pytest.skip("no shader-f16")
    D, Dv = dims
    q, k, v, g = _case(64, D, Dv, "float16")
    mask = aa.Causal()
    got = _run(q, k, v, g, mask)
    assert got[0].dtype == np.float16 and got[4].dtype == np.float16
    _assert_padded_bitwise(got, _run(*_padded(q, k, v, g), mask, scale=1 / np.sqrt(D)), D, Dv)
    rg = R.backward(q, k, v, g, mask=mask)
    assert_close(got[0], R.forward(q, k, v, mask=mask)[0], "float16", "out")
    for name, x in zip(("dq", "dk", "dv"), got[2:5]):
        assert_close(x, getattr(rg, name), "float16", name)


@pytest.mark.parametrize("dtype", ["float32", pytest.param("float16",
                                                           marks=pytest.mark.exhaustive)])
def test_device_arrays(be, dtype):
    """Device arrays with Dv != D: q, k, v, dout as [B, S, H, D] views of one arena (no
    copies), results as device arrays of the right shapes, bit for bit the host path's;
    a repeat reuses the launch template."""
    import anyattn.webgpu as wg

    if dtype == "float16" and not be.context.has_f16:
        pytest.skip("no shader-f16")
    D, Dv = 40, 24
    q, k, v, g = _case(65, D, Dv, dtype, B=2, Sq=19, Sk=23)
    mask = aa.Causal("bottom_right")
    host_out, host_lse = aa.attention(q, k, v, mask=mask, return_lse=True, backend="webgpu")
    host = aa.attention_backward(q, k, v, g, mask=mask, backend="webgpu")
    parts = [np.ascontiguousarray(x.swapaxes(1, 2)) for x in (q, k, v, g)]
    arena = wg.asarray(np.concatenate([x.ravel() for x in parts]))
    views, off = [], 0
    for x, p in zip((q, k, v, g), parts):
        B, S, H, d = p.shape
        views.append(wg.from_buffer(arena.buffer, x.shape, dtype, offset=off,
                                    strides=(S * H * d, d, H * d, 1)))
        off += p.size
    dq_, dk_, dv_, dg_ = views
    for rep in range(2):
        out, st = aa.forward_with_stats(dq_, dk_, dv_, mask=mask)
        gr = aa.attention_backward(dq_, dk_, dv_, dg_, out=out, lse=st, mask=mask)
        assert isinstance(out, wg.DeviceArray) and out.shape == (2, 4, 19, Dv)
        assert gr.dv.shape == (2, 2, 23, Dv) and gr.dk.shape == (2, 2, 23, D)
        assert gr.dq.shape == (2, 4, 19, D)
        np.testing.assert_array_equal(out.numpy(), host_out)
        np.testing.assert_array_equal(st.lse.numpy(), host_lse)
        for name in ("dq", "dk", "dv"):
            np.testing.assert_array_equal(getattr(gr, name).numpy(), getattr(host, name),
                                          err_msg=name)
    assert be.runner().templates.stats["hits"] >= 2


def test_capabilities_name_value_dim(be):
    """The backend names the opt-in input; a problem with Dv != D is not refused."""
    from anyattn.problem import describe

    assert be.capabilities.supports("value_dim")
    q, k, v, g = _case(66, 16, 8)
    assert be.unsupported_reasons(describe(q, k, v, dout=g, wrt=("q", "k", "v"))) == []
