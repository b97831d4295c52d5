"""Numerics at any magnitude (DESIGN.md §1, issue 12 item 2) on the numpy backend.

The row maximum and the log-normaliser are kept apart, so P carries a few ulps of
relative error whatever |s| is: uniform finite bias rows (-1e12, -1e30, finfo.min)
attend uniformly, rows attending to one key get P = 1 exactly, logits of 1e3..1e6
stay within 3x torch's math SDPA (same precision, against float64), float64 stays
float64.  Shape legend: B batch, H heads, S sequence, D head dim.
"""
from __future__ import annotations

import numpy as np
import pytest

import anyattn as aa
from anyattn import reference as R
from anyattn.api import forward_with_stats
from anyattn.rowstats import RowStats

from helpers import TOL, rel_err

F32MIN = float(np.finfo(np.float32).min)
F64MIN = float(np.finfo(np.float64).min)


def _data(seed, B=1, H=2, S=96, D=32, dtype="float32"):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((B, H, S, D)).astype(dtype) for _ in range(4))


def _ours(q, k, v, g, *, bias=None, mask=None, via_lse=False):
    wrt = ("q", "k", "v") + (("bias",) if bias is not None else ())
    out, lse = aa.attention(q, k, v, bias=bias, mask=mask, return_lse=True, backend="numpy")
    kw = dict(out=out, lse=lse) if via_lse else {}
    gr = aa.attention_backward(q, k, v, g, bias=bias, mask=mask, wrt=wrt, backend="numpy", **kw)
    return dict(out=out, lse=lse, dq=gr.dq, dk=gr.dk, dv=gr.dv, dbias=gr.dbias)


def _ref(q, k, v, g, *, bias=None, mask=None):
    f = lambda x: None if x is None else np.asarray(x, np.float64)  # noqa: E731
    wrt = ("q", "k", "v") + (("bias",) if bias is not None else ())
    out, st = R.forward_stats(f(q), f(k), f(v), bias=f(bias), mask=mask)
    gr = R.backward(f(q), f(k), f(v), f(g), bias=f(bias), mask=mask, wrt=wrt)
    return dict(out=out, lse=st.max + st.log_norm, dq=gr.dq, dk=gr.dk, dv=gr.dv, dbias=gr.dbias)


def _torch_math(q, k, v, g, *, bias=None, causal=False):
    """torch's math SDPA in the inputs' precision: out, lse (logsumexp of its scores), grads."""
    torch = pytest.importorskip("torch")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tq, tk, tv = (torch.from_numpy(np.array(x)).requires_grad_() for x in (q, k, v))
    tb = None if bias is None else torch.from_numpy(np.array(bias)).requires_grad_()
    with sdpa_kernel(SDPBackend.MATH):
        o = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=tb,
                                                             is_causal=causal)
    o.backward(torch.from_numpy(np.array(g)))
    with torch.no_grad():
        s = (tq @ tk.transpose(-1, -2)) / float(np.sqrt(q.shape[-1]))
        if tb is not None:
            s = s + tb
        if causal:
            n = s.shape[-1]
            s = s.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), float("-inf"))
        lse = torch.logsumexp(s, -1)
    return dict(out=o.detach().numpy(), lse=lse.numpy(), dq=tq.grad.numpy(),
                dk=tk.grad.numpy(), dv=tv.grad.numpy(),
                dbias=None if tb is None else tb.grad.numpy())


def _err(name, got, ref):
    if name == "lse":
        fin = np.isfinite(ref)
        d = np.abs(np.asarray(got, np.float64)[fin] - ref[fin])
        return float(d.max() / max(1.0, np.abs(ref[fin]).max())) if fin.any() else 0.0
    return rel_err(got, ref)


def _assert_within_3x_torch(ours, torch_res, ref, floor):
    """``ours``, ``torch_res``, ``ref``: one result dict or a list of them (seeds).

    At large logits the error of one output is set by a few rows whose top scores
    nearly tie, where either implementation may round luckily: the errors are
    averaged over the seeds before comparing."""
    if isinstance(ref, dict):
        ours, torch_res, ref = [ours], [torch_res], [ref]
    for name in ref[0]:
        if ref[0][name] is None:
            continue
        eo = np.mean([_err(name, o[name], r[name]) for o, r in zip(ours, ref)])
        et = np.mean([_err(name, t[name], r[name]) for t, r in zip(torch_res, ref)])
        assert eo <= 3 * et + floor, f"{name}: ours {eo:.3g} > 3 x torch {et:.3g} (+{floor:g})"


# ------------------------------------------------------------------ uniform bias rows
@pytest.mark.parametrize("value", [-1e30, F32MIN])
@pytest.mark.parametrize("via_lse", [False, True], ids=["stats", "plain_lse"])
def test_uniform_bias_rows_float32(value, via_lse):
    """A finite bias, however large, is a number: such a row attends uniformly (torch
    semantics).  Before: finfo.min rows gave out = 0 (the bias times log2 e overflowed
    to -inf) and -1e30 rows gave gradients Sk times too large."""
    q, k, v, g = _data(1)
    S = q.shape[2]
    bias = np.zeros((1, 1, S, S), np.float32)
    bias[..., ::5, :] = value                    # whole rows: uniform after rounding
    bias[..., 3, :] = value
    bias[..., 3, 7] = -np.inf                    # -inf still excludes
    res, ref = _ours(q, k, v, g, bias=bias, via_lse=via_lse), _ref(q, k, v, g, bias=bias)
    for name in ("out", "dq", "dk", "dv", "dbias"):
        assert np.isfinite(res[name]).all(), name
        e = rel_err(res[name], ref[name])
        assert e <= TOL["float32"], f"{name}: {e:.3g}"
    keep = np.ones(S, bool)
    keep[7] = False
    assert np.allclose(res["out"][0, :, 3], v[0, :, keep].mean(0), atol=1e-6, rtol=0)
    assert np.allclose(res["out"][0, :, 5], v[0, :, :].mean(1), atol=1e-6, rtol=0)
    assert np.all(res["dv"][0, :, 7] == res["dv"][0, :, 7])   # no NaN from the excluded key
    assert _err("lse", res["lse"], ref["lse"]) <= TOL["float32"]


def test_uniform_bias_rows_minus_1e12_float32_vs_torch():
    """-1e12 absorbs every score in float32 (ulp 65536): torch then attends uniformly;
    the float64 reference does not, so the yardstick is 3x torch's own error."""
    q, k, v, g = _data(2)
    S = q.shape[2]
    bias = np.zeros((1, 1, S, S), np.float32)
    bias[..., ::4, :] = -1e12
    ours, tm, ref = (_ours(q, k, v, g, bias=bias), _torch_math(q, k, v, g, bias=bias),
                     _ref(q, k, v, g, bias=bias))
    _assert_within_3x_torch(ours, tm, ref, floor=1e-6)
    for name in ("out", "dq", "dk", "dv", "dbias"):      # same numbers as torch, closely
        assert rel_err(ours[name], np.asarray(tm[name], np.float64)) <= 1e-5, name


@pytest.mark.parametrize("value", [-1e12, -1e30, F64MIN])
def test_uniform_bias_rows_float64(value):
    q, k, v, g = _data(3, dtype="float64")
    S = q.shape[2]
    bias = np.zeros((1, 2, S, S))
    bias[..., 1::6, :] = value
    res, ref = _ours(q, k, v, g, bias=bias), _ref(q, k, v, g, bias=bias)
    assert res["out"].dtype == np.float64 and res["lse"].dtype == np.float64
    for name in ("out", "dq", "dk", "dv", "dbias"):
        e = rel_err(res[name], ref[name])
        assert e <= TOL["float64"], f"{name}: {e:.3g}"
    assert _err("lse", res["lse"], ref["lse"]) <= TOL["float64"]


def test_hf_padding_rows_match_torch():
    """HF left padding: causal mask as a finfo.min bias, padded query rows all finfo.min.
    torch attends uniformly on those rows; so must we (before: out = 0 there)."""
    q, k, v, g = _data(4, S=64)
    S = 64
    bias = np.where(np.tril(np.ones((S, S), bool)), 0.0, F32MIN).astype(np.float32)
    bias[:4, :] = F32MIN
    bias[:, :4] = F32MIN
    bias = bias[None, None].copy()
    ours, tm, ref = (_ours(q, k, v, g, bias=bias), _torch_math(q, k, v, g, bias=bias),
                     _ref(q, k, v, g, bias=bias))
    assert np.allclose(ours["out"][0, :, 1], v[0, :, :].mean(1), atol=1e-6, rtol=0)
    _assert_within_3x_torch(ours, tm, ref, floor=2e-7)


# ------------------------------------------------------------------ one key: P = 1
def _one_key_cases(S):
    eye = aa.KeepMask(np.eye(S, dtype=bool))
    diag_bias = np.where(np.eye(S, dtype=bool), 0.0, -np.inf)[None, None]
    return [("keepmask", eye, None), ("bias_inf", None, diag_bias)]


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("via_lse", [False, True], ids=["stats", "plain_lse"])
@pytest.mark.parametrize("scale", [1.0, 3.0])
def test_one_key_rows_have_p_exactly_one(dtype, via_lse, scale):
    """Each row keeps exactly one key: out = v and dv = dout bit for bit (before:
    P = 1 ± 7e-7 from the rounded lse)."""
    S = 130
    q, k, v, g = _data(6, S=S, D=40, dtype=dtype)
    q = (q * scale).astype(dtype)
    for label, mask, bias in _one_key_cases(S):
        b = None if bias is None else bias.astype(dtype)
        res = _ours(q, k, v, g, mask=mask, bias=b, via_lse=via_lse)
        assert np.array_equal(res["out"], v), label
        assert np.array_equal(res["dv"], g), label


def test_one_key_rows_stats():
    """Forward statistics of one-key rows: log_norm is zero, lse equals the row max."""
    S = 50
    q, k, v, _ = _data(7, S=S)
    out, st = forward_with_stats(q, k, v, mask=aa.KeepMask(np.eye(S, dtype=bool)),
                                 backend="numpy")
    assert np.all(st.log_norm == 0) and np.array_equal(st.lse, st.max)
    s = np.einsum("bhid,bhid->bhi", q.astype(np.float64), k.astype(np.float64)) / np.sqrt(32)
    assert np.max(np.abs(st.max - s)) <= 1e-6 * max(1.0, np.abs(s).max())


def test_causal_first_row_and_rows_dominated_by_one_key():
    """Causal row 0 keeps one key; with large logits every row is carried by its top
    key.  Their top key gets P = 1 exactly: dv of a key seen only by such rows is dout."""
    q, k, v, g = _data(8, S=64)
    res = _ours(q, k, v, g, mask=aa.Causal())
    assert np.array_equal(res["out"][:, :, 0], v[:, :, 0])
    # every row's top key is its own key (k = q, |q| large): dv = dout exactly
    kq = q.copy()
    qb = (q * 1e3).astype(np.float32)
    res = _ours(qb, kq, v, g)
    assert np.array_equal(res["out"], v)
    assert np.array_equal(res["dv"], g)


# ------------------------------------------------------------------ large logits
@pytest.mark.parametrize("qscale", [1e3, 1e4, 1e5])
@pytest.mark.parametrize("causal", [False, True])
def test_large_logits_within_3x_torch_math(qscale, causal):
    """Logits up to ~1e6 (q scaled): every output within 3x torch's math SDPA error
    (float32, against float64).  Before: dv 8x (1e4) and 2e5x (1e5) torch's."""
    mask = aa.Causal() if causal else None
    ours, tm, ref = [], [], []
    for seed in (9, 1, 2, 3):
        q, k, v, g = _data(seed, S=128, D=64)
        q = (q * qscale).astype(np.float32)
        ours.append(_ours(q, k, v, g, mask=mask))
        tm.append(_torch_math(q, k, v, g, causal=causal))
        ref.append(_ref(q, k, v, g, mask=mask))
    _assert_within_3x_torch(ours, tm, ref, floor=1e-6)


@pytest.mark.parametrize("offset", [1e3, 1e6])
def test_large_bias_within_3x_torch_math(offset):
    """Logits of 1e3 / 1e6 through the bias: rows offset by ±offset plus N(0, 1)."""
    ours, tm, ref = [], [], []
    for seed in (10, 11, 12):
        q, k, v, g = _data(seed, S=96)
        rng = np.random.default_rng(seed)
        sign = np.where(rng.random((1, 1, 96, 1)) < 0.5, -1.0, 1.0)
        bias = (offset * sign + rng.standard_normal((1, 2, 96, 96))).astype(np.float32)
        ours.append(_ours(q, k, v, g, bias=bias))
        tm.append(_torch_math(q, k, v, g, bias=bias))
        ref.append(_ref(q, k, v, g, bias=bias))
    _assert_within_3x_torch(ours, tm, ref, floor=1e-6)


@pytest.mark.parametrize("qscale", [1.0, 30.0, 1e3])
def test_plain_lse_backward_matches_stats_backward(qscale):
    """attention_backward(out=, lse=) (a plain lse: refined when large) is as accurate
    as the backward from the forward's own statistics."""
    q, k, v, g = _data(11, S=100)
    q = (q * qscale).astype(np.float32)
    a, b, ref = _ours(q, k, v, g), _ours(q, k, v, g, via_lse=True), _ref(q, k, v, g)
    for name in ("dq", "dk", "dv"):
        ea, eb = rel_err(a[name], ref[name]), rel_err(b[name], ref[name])
        assert eb <= 1.5 * ea + 1e-6, f"{name}: plain lse {eb:.3g} vs stats {ea:.3g}"


@pytest.mark.parametrize("qscale", [1.0, 1e3])
def test_float64_stays_float64(qscale):
    """float64 in: float64 statistics, outputs and float64-level errors at large logits."""
    q, k, v, g = _data(12, S=90, D=24, dtype="float64")
    q = q * qscale
    out, st = forward_with_stats(q, k, v, mask=aa.Causal(), backend="numpy")
    assert out.dtype == np.float64 and st.max.dtype == np.float64
    assert st.log_norm.dtype == np.float64
    res, ref = _ours(q, k, v, g, mask=aa.Causal()), _ref(q, k, v, g, mask=aa.Causal())
    for name in ("out", "dq", "dk", "dv"):
        assert res[name].dtype == np.float64
        e = rel_err(res[name], ref[name])
        assert e <= TOL["float64"], f"{name}: {e:.3g}"
    assert _err("lse", res["lse"], ref["lse"]) <= TOL["float64"]


# ------------------------------------------------------------------ the statistics
@pytest.mark.parametrize("qscale", [1.0, 20.0, 1e3, 1e6 / 8])
@pytest.mark.parametrize("bias", [False, True])
def test_forward_statistics(qscale, bias):
    """The forward's statistics on every path (bounded, running max, natural units):
    ``P = exp((s - max) - log_norm)`` is the softmax, ``max + log_norm`` the lse,
    ``log_norm >= 0``, -inf / 0 on empty rows.  Where the forward keeps a running max
    (a bias, logits past the bounded path's 64), ``max`` is the row's largest score;
    the bounded path (small logits, no bias) derives it from the sum (an upper bound
    of the largest score by at most log Sk)."""
    S, D = 80, 32
    q, k, v, _ = _data(13, S=S, D=D)
    q = (q * qscale).astype(np.float32)
    keep = np.random.default_rng(1).random((S, S)) < 0.5
    keep[5] = False
    keep[7] = False
    keep[7, 3] = True                             # a row with one key
    b = (np.random.default_rng(2).standard_normal((1, 1, S, S)).astype(np.float32)
         if bias else None)
    mask = aa.KeepMask(keep)
    out, st = forward_with_stats(q, k, v, mask=mask, bias=b, backend="numpy")
    f64 = lambda x: None if x is None else x.astype(np.float64)  # noqa: E731
    _, rs = R.forward_stats(f64(q), f64(k), f64(v), mask=mask, bias=f64(b))
    assert st.max.dtype == np.float32 and st.log_norm.dtype == np.float32
    fin = np.isfinite(rs.max)
    assert np.array_equal(np.isfinite(st.max), fin)
    assert np.all(st.max[~fin] == -np.inf) and np.all(st.log_norm[~fin] == 0)
    assert np.all(st.log_norm >= 0)
    # rounding scale of the scores: eps·|q|·|k|
    bound = max(1.0, np.max(np.linalg.norm(q, axis=-1)) * np.max(np.linalg.norm(k, axis=-1))
                / np.sqrt(D))
    tol = 4e-7 * bound + 1e-6
    lse, rlse = st.max.astype(np.float64) + st.log_norm, rs.max + rs.log_norm
    assert np.max(np.abs(lse[fin] - rlse[fin])) <= tol
    assert np.all(st.max[fin] >= rs.max[fin] - tol)
    assert np.all(st.max[fin] <= rlse[fin] + tol)
    # P from the statistics is the softmax
    s = np.einsum("bhid,bhjd->bhij", f64(q), f64(k)) / np.sqrt(D)
    if b is not None:
        s = s + b
    s = np.where(keep, s, -np.inf)
    with np.errstate(invalid="ignore", over="ignore"):
        p = np.exp((s - st.max[..., None].astype(np.float64)) - st.log_norm[..., None])
        p_ref = np.exp((s - rs.max[..., None]) - rs.log_norm[..., None])
    p, p_ref = np.where(fin[..., None], p, 0), np.where(fin[..., None], p_ref, 0)
    assert np.max(np.abs(p - p_ref)) <= 2 * tol
    assert np.all(st.log_norm[:, :, 7] == 0) and np.array_equal(st.max[:, :, 7], lse[:, :, 7])
    tracks_max = bias or qscale * np.sqrt(D) * 1.5 > 64        # past the bounded path
    if tracks_max:
        assert np.max(np.abs(st.max[fin] - rs.max[fin])) <= tol
        assert np.max(np.abs(st.log_norm[fin] - rs.log_norm[fin])) <= tol


def test_given_global_lse_keeps_its_literal_meaning():
    """RowStats.from_lse(lse) with an lse over more keys (ring attention's global one):
    P = exp(s - lse) literally, as the float64 reference computes it."""
    q, k, v, g = _data(14, S=60, dtype="float64")
    rng = np.random.default_rng(3)
    out, lse = aa.attention(q, k, v, return_lse=True, backend="numpy")
    lse_global = lse + rng.random(lse.shape)                  # more mass elsewhere
    out_g = out * 0.7
    got = aa.attention_backward(q, k, v, g, out=out_g, lse=RowStats.from_lse(lse_global),
                                backend="numpy")
    ref = R.backward(q, k, v, g, out=out_g, lse=lse_global)
    for name in ("dq", "dk", "dv"):
        assert rel_err(getattr(got, name), getattr(ref, name)) <= TOL["float64"], name
