"""webgpu backend against the float64 reference: shapes, masks, bias, GQA, strides, f16."""
from __future__ import annotations

import numpy as np
import pytest

import anyattn as aa
from anyattn import reference as R

from helpers import assert_close, make_qkv


def run_both(q, k, v, g, mask=None, bias=None, wrt=("q", "k", "v"), dtype="float32", tol=None):
    out, lse = aa.attention(q, k, v, mask=mask, bias=bias, return_lse=True, backend="webgpu")
    gr = aa.attention_backward(q, k, v, g, mask=mask, bias=bias, wrt=wrt, backend="webgpu")
    ro, rl = R.forward(q, k, v, mask=mask, bias=bias)
    rg = R.backward(q, k, v, g, mask=mask, bias=bias, wrt=wrt)
    assert out.dtype == q.dtype and lse.dtype == np.float32
    assert_close(out, ro, dtype, "out", tol)
    fin = np.isfinite(rl)
    assert np.array_equal(np.isfinite(lse), fin), "lse -inf exactly on empty rows"
    if fin.any():
        assert np.max(np.abs(lse[fin] - rl[fin])) <= 1e-5 * max(1.0, np.abs(rl[fin]).max()) * \
            (300 if dtype == "float16" else 1)
    for n in ("dq", "dk", "dv", "dbias"):
        ref = getattr(rg, n)
        got = getattr(gr, n)
        if ref is None:
            assert got is None
            continue
        assert got.shape == ref.shape and got.dtype == (q.dtype if n != "dbias" else bias.dtype)
        assert_close(got, ref, dtype, n, tol)
    return out, lse, gr


@pytest.mark.parametrize("shape", [
    (1, 1, 1, 1, 1, 8), (1, 2, 2, 3, 3, 16), (1, 1, 1, 33, 33, 24), (2, 2, 2, 19, 45, 16),
    (1, 2, 2, 45, 19, 8), (1, 4, 2, 33, 40, 16), (1, 3, 1, 17, 17, 8), (1, 1, 1, 5, 7, 3),
], ids=lambda s: "x".join(map(str, s)))
def test_shapes(be, shape):
    B, Hq, Hkv, Sq, Sk, D = shape
    q, k, v, g = make_qkv(np.random.default_rng(0), B, Hq, Hkv, Sq, Sk, D)
    run_both(q, k, v, g)


@pytest.mark.parametrize("D", [24, 64, 160, 256])
def test_head_dims(be, D):
    q, k, v, g = make_qkv(np.random.default_rng(1), 1, 2, 1, 37, 41, D)
    run_both(q, k, v, g, mask=aa.Causal("bottom_right"))


MASKS = {
    "causal": lambda Sq, Sk, r: aa.Causal(),
    "causal_br": lambda Sq, Sk, r: aa.Causal("bottom_right"),
    "window": lambda Sq, Sk, r: aa.Window(left=5, right=3),
    "sliding": lambda Sq, Sk, r: aa.Causal() & aa.Window(left=7),
    "docs": lambda Sq, Sk, r: aa.Documents(np.sort(r.integers(0, 3, Sq)),
                                            np.sort(r.integers(0, 3, Sk))),
    "docs_b_causal": lambda Sq, Sk, r: aa.Causal() & aa.Documents(
        np.sort(r.integers(0, 4, (2, Sq)), axis=1), np.sort(r.integers(0, 4, (2, Sk)), axis=1)),
    "keep": lambda Sq, Sk, r: aa.KeepMask(r.random((Sq, Sk)) < 0.6),
    "keep_b1qk": lambda Sq, Sk, r: aa.KeepMask(r.random((2, 1, Sq, Sk)) < 0.5),
    "keep_window": lambda Sq, Sk, r: aa.KeepMask(r.random((Sq, Sk)) < 0.8) & aa.Window(6, 6),
    "offsets": None,
}


@pytest.mark.parametrize("name", list(MASKS))
def test_masks(be, name):
    B, Hq, Hkv, Sq, Sk, D = 2, 2, 1, 40, 70, 16
    r = np.random.default_rng(2)
    q, k, v, g = make_qkv(r, B, Hq, Hkv, Sq, Sk, D)
    if name == "offsets":
        out = aa.attention(q, k, v, mask=aa.Causal(), q_offset=30, backend="webgpu")
        ro, _ = R.forward(q, k, v, mask=aa.Causal(), q_offset=30)
        assert_close(out, ro, "float32", "out")
        return
    run_both(q, k, v, g, mask=MASKS[name](Sq, Sk, r))


def test_empty_rows(be):
    r = np.random.default_rng(3)
    B, Hq, Hkv, Sq, Sk, D = 1, 2, 1, 40, 36, 16
    keep = r.random((B, 1, Sq, Sk)) < 0.5
    keep[:, :, ::3] = False
    q, k, v, g = make_qkv(r, B, Hq, Hkv, Sq, Sk, D)
    out, lse, gr = run_both(q, k, v, g, mask=aa.KeepMask(keep))
    assert np.all(out[:, :, ::3] == 0) and np.all(np.isneginf(lse[:, :, ::3]))
    assert np.all(gr.dq[:, :, ::3] == 0)
    # bottom-right causal, Sq > Sk: the first Sq - Sk rows keep nothing (whole empty tiles)
    q, k, v, g = make_qkv(r, 1, 1, 1, 70, 20, 16)
    out, lse, gr = run_both(q, k, v, g, mask=aa.Causal("bottom_right"))
    assert np.all(out[:, :, :50] == 0) and np.all(np.isneginf(lse[:, :, :50]))


@pytest.mark.parametrize("bshape", [(2, 3, 21, 27), (1, 3, 21, 27), (2, 1, 1, 27), (21, 27),
                                    (2, 3, 1, 27), (2, 1, 21, 27)],
                         ids=["full", "1hqk", "b11k", "qk", "bh1k", "b1qk"])
def test_bias_dbias(be, bshape):
    # (a bias constant along keys has a zero gradient: sum_j dS_ij = 0, so no [.., 1] shapes)
    r = np.random.default_rng(4)
    q, k, v, g = make_qkv(r, 2, 3, 3, 21, 27, 16)
    bias = r.standard_normal(bshape).astype(np.float32)
    run_both(q, k, v, g, bias=bias, wrt=("q", "k", "v", "bias"),
             mask=aa.Causal() if bshape == (1, 3, 21, 27) else None)


def test_bias_minus_inf(be):
    r = np.random.default_rng(5)
    q, k, v, g = make_qkv(r, 1, 2, 2, 17, 21, 16)
    bias = r.standard_normal((1, 1, 17, 21)).astype(np.float32)
    bias[..., r.random((17, 21)) < 0.3] = -np.inf
    bias[..., 4, :] = -np.inf
    out, lse, _ = run_both(q, k, v, g, bias=bias, wrt=("q", "k", "v", "bias"))
    assert np.all(out[..., 4, :] == 0) and np.all(np.isneginf(lse[..., 4]))


def test_strided_views(be):
    r = np.random.default_rng(6)
    B, H, Sq, Sk, D = 2, 3, 13, 17, 16
    big = r.standard_normal((B, Sk + 3, H, 3 * D)).astype(np.float32)   # packed kv
    k = big[:, 3:, :, :D].swapaxes(1, 2)
    v = big[:, 3:, :, D:2 * D].swapaxes(1, 2)
    q = r.standard_normal((B, Sq, H, D)).astype(np.float32).swapaxes(1, 2)
    g = r.standard_normal((B, H, Sq, D)).astype(np.float32)[:, :, ::-1]   # negative stride
    run_both(q, k, v, g, mask=aa.Causal())


def test_broadcast_views(be):
    """Stride-0 views: k/v broadcast over batch (read in place), q broadcast along D (copied)."""
    r = np.random.default_rng(12)
    k1 = r.standard_normal((1, 2, 19, 8)).astype(np.float32)
    k = np.broadcast_to(k1, (3, 2, 19, 8))
    v = np.broadcast_to(r.standard_normal((1, 2, 19, 8)).astype(np.float32), (3, 2, 19, 8))
    q = np.broadcast_to(r.standard_normal((3, 2, 11, 1)).astype(np.float32), (3, 2, 11, 8))
    g = r.standard_normal((3, 2, 11, 8)).astype(np.float32)
    run_both(q, k, v, g)


def test_wrt_subsets(be):
    r = np.random.default_rng(7)
    q, k, v, g = make_qkv(r, 1, 2, 1, 11, 13, 8)
    for wrt in (("q",), ("k",), ("v",), ("k", "v")):
        run_both(q, k, v, g, wrt=wrt, mask=aa.Causal())


def test_nan_propagates(be):
    r = np.random.default_rng(8)
    q, k, v, _ = make_qkv(r, 1, 1, 1, 8, 8, 8)
    q[0, 0, 2, 0] = np.nan
    out = aa.attention(q, k, v, mask=aa.Causal(), backend="webgpu")
    assert np.isnan(out[0, 0, 2]).all()
    assert not np.isnan(np.delete(out[0, 0], 2, axis=0)).any()


def test_float16(be):
    if not be.context.has_f16:
        pytest.skip("adapter has no shader-f16")
    r = np.random.default_rng(9)
    q, k, v, g = make_qkv(r, 1, 2, 1, 37, 45, 64, dtype="float16")
    run_both(q, k, v, g, mask=aa.Causal(), dtype="float16")


def test_deterministic(be):
    r = np.random.default_rng(10)
    q, k, v, g = make_qkv(r, 1, 4, 2, 40, 50, 16)
    bias = r.standard_normal((1, 4, 40, 50)).astype(np.float32)
    runs = [aa.attention_backward(q, k, v, g, bias=bias, mask=aa.Causal(),
                                  wrt=("q", "k", "v", "bias"), backend="webgpu") for _ in range(2)]
    for n in ("dq", "dk", "dv", "dbias"):
        np.testing.assert_array_equal(getattr(runs[0], n), getattr(runs[1], n))


def test_poisoned_scratch(be):
    """Every output element is written: NaN in every scratch buffer beforehand changes nothing."""
    r = np.random.default_rng(11)
    q, k, v, g = make_qkv(r, 2, 2, 1, 35, 29, 24)
    bias = r.standard_normal((2, 1, 35, 29)).astype(np.float32)
    kw = dict(mask=aa.Causal("bottom_right"), bias=bias)
    base = aa.attention_backward(q, k, v, g, wrt=("q", "k", "v", "bias"), backend="webgpu", **kw)
    o1 = aa.attention(q, k, v, backend="webgpu", **kw)
    be.runner().poison()
    o2 = aa.attention(q, k, v, backend="webgpu", **kw)
    np.testing.assert_array_equal(o1, o2)
    be.runner().poison()
    again = aa.attention_backward(q, k, v, g, wrt=("q", "k", "v", "bias"), backend="webgpu", **kw)
    for n in ("dq", "dk", "dv", "dbias"):
        np.testing.assert_array_equal(getattr(base, n), getattr(again, n))
