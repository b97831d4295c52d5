"""The triton backend: numerics vs the float64 reference, tile skipping, caches,
determinism and every error path.

Runs on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py where no GPU is present) at tiny sizes with the fixed test
plan (tiles 16/32, mask blocks 32); ``gpu`` tests need CUDA.
Shape legend: B batch, Hq/Hkv heads, Sq/Sk queries/keys, D head dim.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import anyattn as aa  # noqa: E402
from anyattn import reference as R  # noqa: E402

from helpers import TOL, assert_close, make_qkv, np_mask, to_np  # noqa: E402
from tr_util import DEV, HAS_CUDA, needs_triton, T, two_launch_backward  # noqa: E402

INTERP = os.environ.get("TRITON_INTERPRET") == "1"

gpu = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]


def check(q, k, v, g, *, mask=None, bias=None, wrt=("q", "k", "v"), dtype="float32",
          tdtype=None, precision=None, tol=None, qt=None, kt=None, vt=None, gt=None):
    """Forward + backward on triton vs the float64 reference; returns the triton results."""
    qt = T(q, tdtype) if qt is None else qt
    kt = T(k, tdtype) if kt is None else kt
    vt = T(v, tdtype) if vt is None else vt
    gt = T(g, tdtype) if gt is None else gt
    bt = T(bias)
    out, lse = aa.attention(qt, kt, vt, mask=mask, bias=bt, return_lse=True, backend="triton",
                            precision=precision)
    gr = aa.attention_backward(qt, kt, vt, gt, mask=mask, bias=bt, wrt=wrt, backend="triton",
                               precision=precision)
    rm = np_mask(mask)
    # the reference sees the inputs as rounded to the tested dtype
    qr, kr, vr, gr_ = (to_np(x).astype(np.float64) for x in (qt, kt, vt, gt))
    ro, rl = R.forward(qr, kr, vr, mask=rm, bias=bias)
    rg = R.backward(qr, kr, vr, gr_, mask=rm, bias=bias, wrt=wrt)
    assert_close(out, ro, dtype, "out", tol=tol)
    l = to_np(lse)
    assert l.dtype == np.float32
    assert np.array_equal(np.isfinite(l), np.isfinite(rl)), "lse -inf exactly on empty rows"
    fin = np.isfinite(rl)
    if fin.any():
        assert np.abs(l[fin] - rl[fin]).max() <= 1e-4 * max(1.0, np.abs(rl[fin]).max())
    for n in ("dq", "dk", "dv", "dbias"):
        ref = getattr(rg, n)
        got = getattr(gr, n)
        if ref is None:
            assert got is None, n
            continue
        assert tuple(got.shape) == tuple(ref.shape), (n, got.shape, ref.shape)
        assert_close(got, ref, dtype, n, tol=tol)
    return out, lse, gr


# ----------------------------------------------------------------------------- numerics
@needs_triton
@pytest.mark.parametrize("D", [8, 24, 40])
def test_head_dims_not_power_of_two(D):
    rng = np.random.default_rng(0)
    q, k, v, g = make_qkv(rng, 1, 2, 1, 21, 35, D)
    check(q, k, v, g, mask=aa.Causal("bottom_right"))


@needs_triton
def test_gqa_group3_window_sq_gt_sk():
    rng = np.random.default_rng(1)
    q, k, v, g = make_qkv(rng, 1, 6, 2, 40, 23, 16)
    check(q, k, v, g, mask=aa.Window(left=9, right=2, align="bottom_right"))


def _block_keep(rng, Sq, Sk, blk=32):
    """A keep mask with empty, full and partial 32x32 blocks."""
    nq, nk = -(-Sq // blk), -(-Sk // blk)
    code = rng.integers(0, 3, (nq, nk))
    code[0, 0], code[0, -1], code[-1, 0] = 0, 2, 1
    m = np.zeros((nq * blk, nk * blk), bool)
    for a in range(nq):
        for b in range(nk):
            tile = (np.ones((blk, blk), bool) if code[a, b] == 2 else
                    rng.random((blk, blk)) < 0.5 if code[a, b] == 1 else np.zeros((blk, blk), bool))
            m[a * blk:(a + 1) * blk, b * blk:(b + 1) * blk] = tile
    return m[:Sq, :Sk]


@needs_triton
def test_keepmask_block_skipping_and_cache():
    from anyattn.backends.triton import launch
    from anyattn.problem import describe

    rng = np.random.default_rng(2)
    Sq, Sk = 64, 96
    keep = _block_keep(rng, Sq, Sk)
    q, k, v, g = make_qkv(rng, 1, 2, 2, Sq, Sk, 16)
    km = torch.from_numpy(keep).to(DEV)
    mask = aa.KeepMask(km)
    check(q, k, v, g, mask=mask)
    # the tile lists: counts match the block codes of the mask, and are cached
    p = describe(T(q), T(k), T(v), mask=mask)
    ma = launch.tiles.mask_args(p, T(q), None)
    a = launch.tile_lists(p, ma, 32, 32, torch.device(DEV))
    b = launch.tile_lists(p, ma, 32, 32, torch.device(DEV))
    assert a is b
    codes = p.mask.tile_map(32, 32)[0, 0]                    # core's NumPy tile map
    assert to_np(a.row_fcnt).reshape(-1).tolist() == (codes == 2).sum(1).tolist()
    assert to_np(a.row_cnt).reshape(-1).tolist() == (codes == 1).sum(1).tolist()
    assert to_np(a.col_fcnt).reshape(-1).tolist() == (codes == 2).sum(0).tolist()
    km[0, 0] = True                                        # in-place change: rebuilt
    c = launch.tile_lists(p, ma, 32, 32, torch.device(DEV))
    assert c is not a


@needs_triton
def test_documents_unsorted_and_sorted_with_empty_rows():
    rng = np.random.default_rng(3)
    B, Sq, Sk = 2, 37, 50
    q, k, v, g = make_qkv(rng, B, 2, 1, Sq, Sk, 16)
    qi = rng.integers(0, 4, (B, Sq))                      # unsorted: dense block path
    ki = rng.integers(1, 4, (B, Sk))                      # id 0 has no keys: empty rows
    check(q, k, v, g, mask=aa.Documents(T(qi), T(ki)))
    qs, ks = np.sort(qi, axis=1), np.sort(ki, axis=1)      # sorted: interval path
    check(q, k, v, g, mask=aa.Documents(T(qs), T(ks)) & aa.Causal("bottom_right"))


@needs_triton
@pytest.mark.parametrize("shape", [(1, 3, 31, 45), (2, 1, 31, 45), (2, 1, 1, 45)],
                         ids=["1hqk", "b1qk", "b11k"])
def test_dbias_broadcast(shape):
    rng = np.random.default_rng(4)
    B, H, Sq, Sk = 2, 3, 31, 45
    q, k, v, g = make_qkv(rng, B, H, H, Sq, Sk, 16)
    bias = rng.standard_normal(shape).astype(np.float32)
    check(q, k, v, g, bias=bias, wrt=("q", "k", "v", "bias"), mask=aa.Causal())


@needs_triton
def test_dbias_broadcast_over_keys_is_zero():
    """Sum over keys of dS is 0 (softmax rows sum to 1): [B,H,Sq,1] and scalar biases."""
    rng = np.random.default_rng(4)
    q, k, v, g = (T(x) for x in make_qkv(rng, 2, 3, 3, 31, 45, 16))
    for shape in ((2, 3, 31, 1), (1, 1, 1, 1)):
        bias = T(rng.standard_normal(shape).astype(np.float32))
        gr = aa.attention_backward(q, k, v, g, bias=bias, wrt=("bias",), backend="triton")
        assert tuple(gr.dbias.shape) == shape
        assert float(gr.dbias.abs().max()) <= 1e-5


@needs_triton
def test_dbias_full_with_keepmask_and_minus_inf_rows():
    rng = np.random.default_rng(5)
    B, H, Sq, Sk = 2, 2, 33, 40
    q, k, v, g = make_qkv(rng, B, H, 1, Sq, Sk, 16)
    bias = rng.standard_normal((B, H, Sq, Sk)).astype(np.float32)
    bias[:, :, 5, :] = -np.inf                            # fully excluded rows
    keep = rng.random((B, 1, Sq, Sk)) < 0.7
    out, _, gr = check(q, k, v, g, bias=bias, mask=aa.KeepMask(T(keep)),
                       wrt=("q", "k", "v", "bias"))
    assert np.all(to_np(out)[:, :, 5] == 0)
    assert np.all(to_np(gr.dbias)[:, :, 5] == 0)


@needs_triton
def test_strided_views_and_copy_path():
    rng = np.random.default_rng(6)
    B, H, S, D = 1, 2, 29, 16
    packed = torch.from_numpy(rng.standard_normal((B, S, 3, H, D)).astype(np.float32)).to(DEV)
    q, k, v = (packed[:, :, i].transpose(1, 2) for i in range(3))   # [B,H,S,D] views
    wide = torch.from_numpy(rng.standard_normal((B, H, S, 2 * D)).astype(np.float32)).to(DEV)
    g = wide[..., ::2]                                     # last-dim stride 2: copied
    check(*(to_np(x) for x in (q, k, v, g)), qt=q, kt=k, vt=v, gt=g, mask=aa.Causal())


@needs_triton
@pytest.mark.parametrize("dt, tol", [("float16", 3e-3), ("bfloat16", 2e-2)])
def test_half_precisions(dt, tol):
    rng = np.random.default_rng(7)
    q, k, v, g = make_qkv(rng, 1, 2, 1, 19, 26, 16)
    out, lse, gr = check(q, k, v, g, mask=aa.Causal(), tdtype=getattr(torch, dt), dtype=dt)
    assert out.dtype == getattr(torch, dt) and gr.dk.dtype == getattr(torch, dt)
    assert lse.dtype == torch.float32


@needs_triton
def test_tf32_opt_in_accepted():
    rng = np.random.default_rng(8)
    q, k, v, g = make_qkv(rng, 1, 1, 1, 17, 17, 16)
    check(q, k, v, g, precision="tf32", tol=TOL["tf32"])


@needs_triton
def test_bitwise_repeatable_gqa_bias_mask():
    rng = np.random.default_rng(9)
    # the interpreter runs the programs one after another: there the repeat checks the
    # host side (two query and key tiles suffice); on a GPU, the kernels' reductions
    Sq, Sk = (21, 35) if INTERP else (33, 41)
    q, k, v, g = (T(x) for x in make_qkv(rng, 1, 4, 2, Sq, Sk, 16))
    bias = T(rng.standard_normal((1, 4, Sq, Sk)).astype(np.float32))
    keep = aa.KeepMask(T(rng.random((Sq, Sk)) < 0.6))
    runs = [aa.attention_backward(q, k, v, g, bias=bias, mask=keep, backend="triton",
                                  wrt=("q", "k", "v", "bias")) for _ in range(2)]
    for n in ("dq", "dk", "dv", "dbias"):
        assert torch.equal(getattr(runs[0], n), getattr(runs[1], n)), n


@needs_triton
@pytest.mark.parametrize("case", ["band_gqa", "docs_bias", "keep_fullbias"])
def test_fused_backward_equals_two_launches(case, monkeypatch):
    """The one-launch backward (dK/dV and dQ programs in one grid) gives the same bits
    as the separate dK/dV and dQ kernels, in both iteration modes and with dbias."""
    rng = np.random.default_rng(11)
    Sq, Sk = 37, 50                  # several query and key tiles of either launch
    q, k, v, g = (T(x) for x in make_qkv(rng, 2, 2, 1, Sq, Sk, 24))
    mask, bias, wrt = None, None, ("q", "k", "v")
    if case == "band_gqa":
        mask = aa.Causal("bottom_right") & aa.Window(left=20)
    elif case == "docs_bias":
        ids = np.sort(rng.integers(0, 3, (2, Sq)), axis=1)
        kid = np.sort(rng.integers(0, 3, (2, Sk)), axis=1)
        mask = aa.Documents(T(ids), T(kid))
        bias, wrt = T(rng.standard_normal((1, 2, Sq, Sk)).astype(np.float32)), wrt + ("bias",)
    else:
        mask = aa.KeepMask(T(rng.random((Sq, Sk)) < 0.5))
        bias, wrt = T(rng.standard_normal((2, 2, Sq, Sk)).astype(np.float32)), wrt + ("bias",)
    runs = {"1": aa.attention_backward(q, k, v, g, mask=mask, bias=bias, wrt=wrt,
                                       backend="triton")}
    two_launch_backward(monkeypatch)
    runs["0"] = aa.attention_backward(q, k, v, g, mask=mask, bias=bias, wrt=wrt,
                                      backend="triton")
    for n in wrt:
        n = "d" + n
        assert torch.equal(getattr(runs["1"], n), getattr(runs["0"], n)), (case, n)
    if case == "band_gqa":   # and both are right
        rm = np_mask(mask)
        rg = R.backward(*(to_np(x).astype(np.float64) for x in (q, k, v, g)), mask=rm)
        for n in ("dq", "dk", "dv"):
            assert_close(getattr(runs["1"], n), getattr(rg, n), "float32", n)


@needs_triton
def test_scaled_fp16_parts_and_scales():
    """The scaled-fp16 split: sigma is a power of two per (batch, kv-head group) from the
    finite max |x| (NaN / inf ignored), |x * sigma| <= 2^14, and hi + lo (fp16, side by
    side) give x * sigma to 2^-21 of the group max elementwise."""
    from anyattn.backends.triton import operands
    from anyattn.problem import describe

    B, Hq, Hkv, S, D = 2, 4, 2, 37, 20
    base = torch.randn(B, S, Hq, D, device=DEV)
    base = base * (10.0 ** torch.arange(-3, 5, device=DEV).reshape(B, 1, Hq, 1))
    q = base.permute(0, 2, 1, 3)                          # [B, H, S, D], a strided view
    q[1, 3, 4, 2] = float("nan")                          # ignored by the scales
    q[1, 3, 5, 0] = float("inf")
    k = torch.randn(B, Hkv, S, D, device=DEV) * 1e-6
    v = torch.randn(B, Hkv, S, D, device=DEV) * 1e5
    p = describe(q, k, v)
    sc, sig = operands.f16_scales(p, q, k, v)
    fin = torch.where(torch.isfinite(q), q.abs(), torch.zeros_like(q))
    for name, x, g in (("q", q, 2), ("k", k, 1), ("v", v, 1)):
        s = sig[name]
        assert s.shape == (B * Hkv,)
        assert torch.equal(torch.exp2(torch.log2(s).round()), s)          # powers of two
        xa = (fin if name == "q" else x.abs()).reshape(B * Hkv, -1).amax(1)
        assert ((xa * s) <= 2.0 ** 14).all() and ((xa * s) > 2.0 ** 13).all()
        y = operands.split_half(x, s, g)
        assert y.dtype == torch.float16 and y.shape == (B, x.shape[1], S, 2 * D)
        xs = x.double() * s.double().repeat_interleave(g).reshape(B, -1, 1, 1)
        back = y[..., :D].double() + y[..., D:].double()
        ok = torch.isfinite(xs)
        err = (back - xs).abs()[ok].max()
        assert err <= 2.0 ** -21 * 2.0 ** 14, (name, float(err))
    assert torch.equal(sc[:, 0], 1.0 / (sig["q"] * sig["k"]))


@needs_triton
@pytest.mark.parametrize("precision", [
    "highest",
    # fp32 takes the same scaled-fp16 kernels under both precisions
    # (test_configs_plans_and_tuner): the second run repeats the first's launches
    pytest.param("tf32", marks=pytest.mark.exhaustive)])
def test_scaled_fp16_far_from_unit_inputs(precision):
    """fp32 through the default scaled-fp16 products with every (batch, head) of q, k, v,
    dout at its own power of ten (1e-6 .. 1e6, differing inside a GQA group), a huge and
    a tiny row, a causal mask and a head-broadcast bias: fp32 accuracy (1e-5)."""
    rng = np.random.default_rng(21)
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 33, 47, 24
    q, k, v, g = make_qkv(rng, B, Hq, Hkv, Sq, Sk, D)
    ex = lambda n: rng.integers(-6, 7, (B, n, 1, 1)).astype(np.float64)  # noqa: E731
    q = (q * 10.0 ** (ex(Hq) / 4)).astype(np.float32)
    k = (k * 10.0 ** (ex(Hkv) / 4)).astype(np.float32)
    v = (v * 10.0 ** ex(Hkv)).astype(np.float32)
    g = (g * 10.0 ** ex(Hq)).astype(np.float32)
    v[0, 0, 5] *= 1e4
    v[0, 0, 6] *= 1e-4
    bias = rng.standard_normal((1, Hq, Sq, Sk)).astype(np.float32)
    check(q, k, v, g, mask=aa.Causal("bottom_right"), bias=bias,
          wrt=("q", "k", "v", "bias"), precision=precision, tol=TOL["float32"])


@needs_triton
def test_scaled_fp16_given_lse_below_the_true_one():
    """A given lse may understate the row's log-sum-exp (p > 1) by up to ln 64 under the
    scaled fp16 products (p * 2^10 and dS * gamma stay in fp16 range): here by 2 (p up to
    e^2), checked against the reference backward with the same out / lse."""
    rng = np.random.default_rng(22)
    q, k, v, g = make_qkv(rng, 1, 2, 1, 29, 31, 16)
    qt, kt, vt, gt = (T(x) for x in (q, k, v, g))
    out, lse = aa.attention(qt, kt, vt, return_lse=True, backend="triton")
    low = lse - 2.0
    gr = aa.attention_backward(qt, kt, vt, gt, out=out, lse=low, backend="triton")
    args = [to_np(x).astype(np.float64) for x in (qt, kt, vt, gt)]
    rg = R.backward(*args, out=to_np(out).astype(np.float64), lse=to_np(low).astype(np.float64))
    for n in ("dq", "dk", "dv"):
        assert_close(getattr(gr, n), getattr(rg, n), "float32", n)


@needs_triton
@pytest.mark.parametrize("bshape", ["1H", "B1"])
def test_dbias_owner_sum_with_batch_varying_masks(bshape):
    """A bias broadcast over batch or heads: the dq programs sum dS into dbias in place
    (tiles one batch's mask skips and another's keeps included); the reference's
    numbers, bitwise repeatable."""
    rng = np.random.default_rng(10)
    B, Hq, Hkv, Sq, Sk = 2, 2, 1, 40, 67
    q, k, v, g = make_qkv(rng, B, Hq, Hkv, Sq, Sk, 16)
    shape = (1, Hq, Sq, Sk) if bshape == "1H" else (B, 1, Sq, Sk)
    bias = rng.standard_normal(shape).astype(np.float32)
    qi = np.sort(rng.integers(0, 3, (B, Sq)), axis=1)
    ki = np.sort(rng.integers(0, 3, (B, Sk)), axis=1)
    mask = aa.Documents(T(qi), T(ki)) & aa.Causal("bottom_right")
    from anyattn.problem import describe

    for bq, bk in ((32, 16), (16, 32), (32, 32)):      # the case: dq, dK/dV, mask tiles
        skip = describe(T(q), T(k), T(v), mask=mask).mask.tile_map(bq, bk) == 0
        assert (skip.any(0) & ~skip.all(0)).any(), "a tile skipped in one batch only"
    wrt = ("q", "k", "v", "bias")
    _, _, gr = check(q, k, v, g, mask=mask, bias=bias, wrt=wrt)
    qt, kt, vt, gt, bt = (T(x) for x in (q, k, v, g, bias))
    again = aa.attention_backward(qt, kt, vt, gt, mask=mask, bias=bt, wrt=wrt, backend="triton")
    for n in ("dq", "dk", "dv", "dbias"):
        assert torch.equal(getattr(gr, n), getattr(again, n)), n


@needs_triton
def test_nan_propagates_only_in_its_row():
    rng = np.random.default_rng(10)
    q, k, v, _ = make_qkv(rng, 1, 1, 1, 20, 20, 16)
    q[0, 0, 3, 1] = np.nan
    out = to_np(aa.attention(T(q), T(k), T(v), backend="triton"))
    assert np.isnan(out[0, 0, 3]).all()
    assert not np.isnan(np.delete(out[0, 0], 3, axis=0)).any()


# ----------------------------------------------------------------------------- errors
def _tq(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, dtype=dtype, device=device)


def test_cpu_tensors_without_interpreter_refused(monkeypatch):
    from anyattn.backends.triton.backend import TritonBackend
    from anyattn.problem import describe

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    be = TritonBackend()
    assert be.capabilities.device_types == frozenset({"cuda"})
    p = describe(_tq(1, 1, 4, 8), _tq(1, 1, 4, 8), _tq(1, 1, 4, 8))
    why = " ".join(be.unsupported_reasons(p))
    assert "cuda" in why and "cpu" in why


def test_availability_explains_without_cuda(monkeypatch):
    from anyattn.backends.triton.backend import TritonBackend

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    be = TritonBackend()
    why = be.availability()
    if HAS_CUDA:
        assert why is None
    else:
        assert "CUDA" in why and "TRITON_INTERPRET" in why


@needs_triton
def test_interpreter_accepts_cpu():
    from anyattn.backends.registry import get_backend

    caps = get_backend("triton").capabilities
    assert "cuda" in caps.device_types
    if INTERP:
        assert "cpu" in caps.device_types


@needs_triton
def test_float64_refused_naming_dtype_and_alternative():
    x = torch.randn(1, 1, 4, 8, dtype=torch.float64, device=DEV)
    with pytest.raises(NotImplementedError) as ei:
        aa.attention(x, x, x, backend="triton")
    msg = str(ei.value)
    assert "triton" in msg and "float64" in msg
    if DEV == "cpu":
        assert "reference" in msg          # a backend that can serve it is named


@needs_triton
def test_head_dim_too_large_refused():
    """Above 256 only decoding forwards run (≤ 16 queries); above 1024 nothing does."""
    x = _tq(1, 1, 17, 300, device=DEV)
    with pytest.raises(NotImplementedError, match="head dim"):
        aa.attention(x, x, x, backend="triton")
    x = _tq(1, 1, 4, 1100, device=DEV)
    with pytest.raises(NotImplementedError, match="head_dim"):
        aa.attention(x, x, x, backend="triton")


@needs_triton
def test_numpy_inputs_refused_explicitly():
    x = np.zeros((1, 1, 4, 8), np.float32)
    with pytest.raises(NotImplementedError, match="torch"):
        aa.attention(x, x, x, backend="triton")


@needs_triton
def test_mixed_devices_refused():
    q = _tq(1, 1, 4, 8, device=DEV)
    k = torch.empty(1, 1, 4, 8, device="meta")
    with pytest.raises(ValueError, match="k: is on meta"):
        aa.attention(q, k, k, backend="triton")


@needs_triton
def test_bad_bias_refused_before_work():
    q = _tq(1, 2, 4, 8, device=DEV)
    with pytest.raises(ValueError, match="bias"):
        aa.attention(q, q, q, bias=_tq(3, 4, 4, device=DEV), backend="triton")


# ----------------------------------------------------------------------------- GPU only
@pytest.mark.parametrize("dt", ["bfloat16", "float16", "float32"])
@pytest.mark.parametrize("mask", ["none", "causal", "sliding", "docs", "keep"])
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_larger(dt, mask):
    rng = np.random.default_rng(11)
    B, Hq, Hkv, S, D = 2, 4, 2, 1000, 128
    q, k, v, g = make_qkv(rng, B, Hq, Hkv, S, S, D)
    m = {"none": None, "causal": aa.Causal(), "sliding": aa.Causal() & aa.Window(left=200),
         "docs": aa.Documents(T(np.sort(rng.integers(0, 5, S)))),
         "keep": aa.KeepMask(T(rng.random((S, S)) < 0.5))}[mask]
    check(q, k, v, g, mask=m, tdtype=getattr(torch, dt), dtype=dt)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_gpu_head_dims_and_bias():
    rng = np.random.default_rng(12)
    for D in (8, 72, 256):
        q, k, v, g = make_qkv(rng, 1, 2, 1, 300, 257, D)
        bias = rng.standard_normal((1, 2, 300, 257)).astype(np.float32)
        check(q, k, v, g, bias=bias, wrt=("q", "k", "v", "bias"), mask=aa.Causal())


# ----------------------------------------------------------------------------- configs
def test_configs_plans_and_tuner():
    from anyattn.backends.triton import configs as C
    from anyattn.backends.triton.prepared import fallbacks as _fallbacks

    for dp in (16, 64, 128, 256):
        for dt in ("bfloat16", "float16", "float32"):
            p = C.plan_for(dp, dt, "highest", "none", False, 4096)   # fixed under the interpreter
            for c in (p.fwd, p.dq, p.dkdv):
                assert p.sbq % c.bm == 0 and p.sbk % c.bn == 0
    # fp32 multiplies as scaled fp16 parts under both precisions (fp32-accurate)
    from anyattn.backends.triton import operands
    from anyattn.problem import describe

    x = torch.zeros(1, 1, 4, 8)
    for precision in ("highest", "tf32"):
        assert operands.kernel_prec(describe(x, x, x, precision=precision)) == "hsplit3"
        assert operands.register_prec(describe(x, x, x, precision=precision)) == "bf16x6"
    assert operands.kernel_prec(describe(x.half(), x.half(), x.half())) == "tf32"
    # every fallback keeps tiles that divide the mask block (128)
    for c in _fallbacks(C.KernelConfig(128, 64, 8, 3)):
        assert 128 % c.bm == 0 and 128 % c.bn == 0 and c.num_stages >= 1
    # the tuner picks the fastest runnable candidate once and caches it
    cands = [C.KernelConfig(64, 64), C.KernelConfig(128, 64), C.KernelConfig(32, 32)]
    times = {64: 2.0, 128: 1.0, 32: 0.5}
    calls = []

    def run(c):
        if c.bm == 32:
            def boom():
                raise RuntimeError("out of resources")
            return boom
        return lambda: calls.append(c)

    best = C.tune(("test", 1), cands, run, timer=lambda fn: times[calls[-1].bm])
    assert best == C.KernelConfig(128, 64)
    assert C.tune(("test", 1), cands, run, timer=None) == best      # cached: no timing


def test_import_is_lazy_and_strided_views_are_not_copied():
    import subprocess
    import sys

    code = ("import sys, anyattn; from anyattn.backends.registry import get_backend; "
            "get_backend('triton'); print('triton' in sys.modules)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.stdout.strip() == "False", r.stderr
    from anyattn.backends.triton.operands import unit_last as _unit_last

    arena = torch.zeros(4 * 3 * 10 * 8 * 2)                  # a float32 arena
    view = arena.as_strided((4, 3, 10, 8), (480, 160, 16, 1))  # strided, last stride 1
    assert _unit_last(view) is view                          # read in place, no copy
    odd = arena.as_strided((4, 3, 10, 8), (480, 160, 16, 2))
    assert _unit_last(odd).stride(-1) == 1                   # copied once
