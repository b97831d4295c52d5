"""The contract suite (DESIGN.md §1, §4): one set of cases, every registered backend.

A backend joins by being registered in anyattn.backends.registry; where it is
unavailable its cases skip with the backend's own reason.  Interpreted or
emulated backends (Triton under TRITON_INTERPRET, WebGPU on lavapipe) run the
small variant of each case.
"""
from __future__ import annotations

import numpy as np
import pytest

import anyattn as aa
from anyattn import reference as R
from anyattn.backends.registry import unavailable_reason

from helpers import (assert_close, examples, exhaustive, harness_for, make_qkv, np_mask,
                     term_magnitudes, to_np, TOL)

import os

#: ANYATTN_SUITE_BACKENDS=reference,numpy runs the suite on a chosen list (the
#: reference checks the suite itself).
SUITE_BACKENDS = tuple(os.environ.get("ANYATTN_SUITE_BACKENDS", "numpy,triton,webgpu").split(","))


def _backend_params():
    out = []
    for name in SUITE_BACKENDS:
        why = unavailable_reason(name)
        marks = [pytest.mark.skip(reason=f"{name} unavailable: {why}")] if why else []
        out.append(pytest.param(name, marks=marks, id=name))
    return out


@pytest.fixture(params=_backend_params())
def hx(request):
    return harness_for(request.param)


# (B, Hq, Hkv, Sq, Sk, D) full-size and small variants
SHAPES = [
    ("one", (1, 1, 1, 1, 1, 8), (1, 1, 1, 1, 1, 8)),
    ("three", (1, 2, 2, 3, 3, 16), (1, 2, 2, 3, 3, 16)),
    ("odd113", (1, 2, 2, 113, 113, 24), (1, 1, 1, 37, 37, 24)),
    ("sq_ne_sk", (2, 2, 2, 70, 129, 40), (1, 1, 1, 19, 45, 16)),
    ("sq_gt_sk", (1, 2, 2, 130, 33, 32), (1, 1, 1, 41, 17, 16)),
    ("gqa", (2, 4, 2, 64, 80, 16), (1, 4, 2, 20, 24, 16)),
    ("mqa", (1, 3, 1, 50, 50, 8), (1, 3, 1, 17, 17, 8)),
]


def _shape(case, hx):
    return case[2] if hx.small else case[1]


def _run_both(hx, dtype, q, k, v, g, mask=None, bias=None, wrt=("q", "k", "v"), scale=None,
              mods=None):
    """Run forward + backward on the backend and on the reference; compare everything.
    ``mods``: score modifiers and offsets (softcap, alibi_slopes, sinks, q/k_offset)."""
    put = hx.put
    mods = dict(mods or {})
    bmods = {n: (put(x) if isinstance(x, np.ndarray) else x) for n, x in mods.items()}
    out, lse = aa.attention(put(q), put(k), put(v), mask=mask, bias=put(bias), scale=scale,
                            return_lse=True, backend=hx.name, **bmods)
    grads = aa.attention_backward(put(q), put(k), put(v), put(g), mask=mask, bias=put(bias),
                                  scale=scale, wrt=wrt, backend=hx.name, **bmods)
    rmask = np_mask(mask)
    ro, rl = R.forward(q, k, v, mask=rmask, bias=bias, scale=scale, **mods)
    rg = R.backward(q, k, v, g, mask=rmask, bias=bias, scale=scale, wrt=wrt, **mods)
    mag = term_magnitudes(q, k, v, g, mask=rmask, bias=bias, scale=scale, **mods)
    assert_close(out, ro, dtype, "out", magnitude=mag["out"])
    lse_np = to_np(lse)
    assert str(lse_np.dtype) in ("float32", "float64")
    fin = np.isfinite(rl)
    assert np.array_equal(np.isfinite(lse_np), fin), "lse: -inf exactly on the empty rows"
    if fin.any():
        assert np.max(np.abs(lse_np[fin] - rl[fin])) <= 10 * TOL[dtype] * max(1, np.abs(rl[fin]).max())
    for name in ("dq", "dk", "dv", "dbias", "dsinks"):
        got, ref = getattr(grads, name), getattr(rg, name)
        if ref is None:
            assert got is None, f"{name} computed though not requested"
        else:
            assert got is not None, f"{name} missing"
            assert tuple(got.shape) == tuple(ref.shape), (name, got.shape, ref.shape)
            assert_close(got, ref, dtype, name, magnitude=mag[name])
    return out, grads


@pytest.mark.parametrize("case", SHAPES, ids=[c[0] for c in SHAPES])
def test_dense_shapes(hx, case):
    B, Hq, Hkv, Sq, Sk, D = _shape(case, hx)
    for dtype in hx.dtypes:
        rng = np.random.default_rng(1)
        q, k, v, g = make_qkv(rng, B, Hq, Hkv, Sq, Sk, D, dtype)
        _run_both(hx, dtype, q, k, v, g)


MASKS = {
    "causal_tl": lambda Sq, Sk, B, H, rng: aa.Causal(),
    "causal_br": lambda Sq, Sk, B, H, rng: aa.Causal("bottom_right"),
    "window_lr": lambda Sq, Sk, B, H, rng: aa.Window(left=5, right=3),
    "sliding": lambda Sq, Sk, B, H, rng: aa.Causal() & aa.Window(left=7),
    "window_br": lambda Sq, Sk, B, H, rng: aa.Window(left=4, right=None, align="bottom_right"),
    "keep_2d": lambda Sq, Sk, B, H, rng: aa.KeepMask(rng.random((Sq, Sk)) < 0.6),
    "keep_b1qk": lambda Sq, Sk, B, H, rng: aa.KeepMask(rng.random((B, 1, Sq, Sk)) < 0.5),
    "keep_b11k": lambda Sq, Sk, B, H, rng: aa.KeepMask(rng.random((B, 1, 1, Sk)) < 0.7),
    "docs_1d": lambda Sq, Sk, B, H, rng: aa.Documents(
        np.sort(rng.integers(0, 3, Sq)), np.sort(rng.integers(0, 3, Sk))),
    "docs_2d_causal": lambda Sq, Sk, B, H, rng: aa.Causal() & aa.Documents(
        np.sort(rng.integers(0, 4, (B, Sq)), axis=1), np.sort(rng.integers(0, 4, (B, Sk)), axis=1)),
    "keep_and_window": lambda Sq, Sk, B, H, rng: aa.KeepMask(rng.random((Sq, Sk)) < 0.8)
    & aa.Window(left=6, right=6),
    # ids beyond int32: 0, 2**32, 2**33 are three documents (a cast to int32 merges them)
    "docs_wide_ids": lambda Sq, Sk, B, H, rng: aa.Documents(
        np.sort(rng.integers(0, 3, Sq)).astype(np.int64) << 32,
        np.sort(rng.integers(0, 3, Sk)).astype(np.int64) << 32),
}


@pytest.mark.parametrize("mname", list(MASKS))
@pytest.mark.parametrize("shape", [(2, 2, 1, 45, 61, 16), (1, 2, 2, 61, 45, 16)],
                         ids=["sq<sk", "sq>sk"])
def test_masks(hx, mname, shape):
    B, Hq, Hkv, Sq, Sk, D = shape
    if hx.small:
        B, Sq, Sk = 1, max(3, Sq // 3), max(3, Sk // 3)
    rng = np.random.default_rng(2)
    mask = MASKS[mname](Sq, Sk, B, Hq, rng)
    mask = _put_mask(hx, mask)
    for dtype in hx.dtypes:
        q, k, v, g = make_qkv(np.random.default_rng(3), B, Hq, Hkv, Sq, Sk, D, dtype)
        _run_both(hx, dtype, q, k, v, g, mask=mask)


def _put_mask(hx, mask):
    if isinstance(mask, aa.KeepMask):
        return aa.KeepMask(hx.put_mask(mask.mask))
    if isinstance(mask, aa.Documents):
        return aa.Documents(hx.put_mask(mask.q_ids), hx.put_mask(mask.k_ids))
    if hasattr(mask, "terms"):
        ms = [_put_mask(hx, t) for t in mask.terms]
        out = ms[0]
        for m in ms[1:]:
            out = out & m
        return out
    return mask


def test_empty_rows(hx):
    """Rows that keep no key: out 0, lse -inf, zero gradients, never NaN."""
    B, Hq, Hkv, Sq, Sk, D = (1, 2, 1, 24, 20, 16) if hx.small else (2, 2, 1, 70, 50, 16)
    rng = np.random.default_rng(4)
    keep = rng.random((B, 1, Sq, Sk)) < 0.5
    keep[:, :, ::3, :] = False                     # every third row empty
    q, k, v, g = make_qkv(rng, B, Hq, Hkv, Sq, Sk, D)
    mask = aa.KeepMask(hx.put_mask(keep))
    out, grads = _run_both(hx, "float32", q, k, v, g, mask=mask)
    o = to_np(out)
    assert np.all(o[:, :, ::3] == 0)
    assert np.all(to_np(grads.dq)[:, :, ::3] == 0)
    # bottom-right causal with Sq > Sk: the first Sq - Sk rows are empty
    q, k, v, g = make_qkv(rng, 1, 1, 1, Sq, Sk // 2, D)
    _run_both(hx, "float32", q, k, v, g, mask=aa.Causal("bottom_right"))


BIAS_SHAPES = {
    "full": lambda B, H, Sq, Sk: (B, H, Sq, Sk),
    "1hqk": lambda B, H, Sq, Sk: (1, H, Sq, Sk),
    "b1qk": lambda B, H, Sq, Sk: (B, 1, Sq, Sk),
    "b11k": lambda B, H, Sq, Sk: (B, 1, 1, Sk),
    "qk": lambda B, H, Sq, Sk: (Sq, Sk),
}


@pytest.mark.parametrize("bname", list(BIAS_SHAPES))
def test_bias_and_dbias(hx, bname):
    B, Hq, Hkv, Sq, Sk, D = (2, 2, 1, 19, 23, 16) if hx.small else (2, 4, 2, 67, 75, 24)
    rng = np.random.default_rng(5)
    q, k, v, g = make_qkv(rng, B, Hq, Hkv, Sq, Sk, D)
    bias = rng.standard_normal(BIAS_SHAPES[bname](B, Hq, Sq, Sk)).astype(np.float32)
    _run_both(hx, "float32", q, k, v, g, bias=bias, wrt=("q", "k", "v", "bias"),
              mask=aa.Causal() if bname == "1hqk" else None)


def test_bias_minus_inf_excludes(hx):
    B, Hq, Hkv, Sq, Sk, D = 1, 2, 2, 17, 21, 16
    rng = np.random.default_rng(6)
    q, k, v, g = make_qkv(rng, B, Hq, Hkv, Sq, Sk, D)
    bias = rng.standard_normal((1, 1, Sq, Sk)).astype(np.float32)
    bias[..., rng.random((Sq, Sk)) < 0.3] = -np.inf
    bias[..., 4, :] = -np.inf                     # one row fully excluded
    out, grads = _run_both(hx, "float32", q, k, v, g, bias=bias, wrt=("q", "k", "v", "bias"))
    assert np.all(to_np(out)[..., 4, :] == 0)


def test_strided_inputs(hx):
    """[B, S, H, D] memory, non-contiguous slices: results in logical layout."""
    B, H, Sq, Sk, D = (1, 2, 13, 17, 16) if hx.small else (2, 3, 41, 57, 24)
    rng = np.random.default_rng(7)
    big = rng.standard_normal((B, Sk + 3, H, 2 * D)).astype(np.float32)
    k = big[:, 3:, :, :D].swapaxes(1, 2)           # [B, H, Sk, D], strided view
    v = big[:, 3:, :, D:].swapaxes(1, 2)
    q = rng.standard_normal((B, Sq, H, D)).astype(np.float32).swapaxes(1, 2)
    g = rng.standard_normal((B, H, Sq, D)).astype(np.float32)[:, :, ::-1]
    if hx.kind == "numpy":
        qq, kk, vv, gg = q, k, v, g
    else:  # torch: build the same strided views on the device
        import torch

        bigt = torch.from_numpy(big).to(hx.device)
        kk = bigt[:, 3:, :, :D].transpose(1, 2)
        vv = bigt[:, 3:, :, D:].transpose(1, 2)
        qq = torch.from_numpy(np.ascontiguousarray(q.swapaxes(1, 2))).to(hx.device).transpose(1, 2)
        gg = torch.from_numpy(np.ascontiguousarray(g)).to(hx.device)
    out = aa.attention(qq, kk, vv, mask=aa.Causal(), backend=hx.name)
    gr = aa.attention_backward(qq, kk, vv, gg, mask=aa.Causal(), backend=hx.name)
    ro, _ = R.forward(q, k, v, mask=aa.Causal())
    rg = R.backward(q, k, v, g, mask=aa.Causal())
    assert_close(out, ro, "float32", "out")
    for n in ("dq", "dk", "dv"):
        assert_close(getattr(gr, n), getattr(rg, n), "float32", n)


def test_layout_bshd(hx):
    B, H, S, D = 1, 2, 9, 16
    rng = np.random.default_rng(8)
    q, k, v, g = (hx.put(rng.standard_normal((B, S, H, D)).astype(np.float32)) for _ in range(4))
    out = aa.attention(q, k, v, layout="bshd", backend=hx.name)
    assert tuple(out.shape) == (B, S, H, D)
    ro, _ = R.forward(*(to_np(x).swapaxes(1, 2) for x in (q, k, v)))
    assert_close(to_np(out).swapaxes(1, 2), ro, "float32", "out")


def test_wrt_subsets(hx):
    B, Hq, Hkv, Sq, Sk, D = 1, 2, 1, 11, 13, 8
    rng = np.random.default_rng(9)
    q, k, v, g = make_qkv(rng, B, Hq, Hkv, Sq, Sk, D)
    for wrt in (("q",), ("k",), ("v",), ("k", "v")):
        _run_both(hx, "float32", q, k, v, g, wrt=wrt, mask=aa.Causal())


def test_given_out_lse_is_used(hx):
    """The backward with out/lse from the forward agrees with the one that recomputes
    (a plain lse defines P = exp(s - lse), the recomputed statistics keep max and
    log-normaliser apart: equal up to fp32 rounding), and the given lse is really used:
    an lse raised by log 2 halves dv."""
    B, Hq, Hkv, Sq, Sk, D = 1, 2, 2, 15, 15, 16
    rng = np.random.default_rng(10)
    q, k, v, g = (hx.put(x) for x in make_qkv(rng, B, Hq, Hkv, Sq, Sk, D))
    out, lse = aa.attention(q, k, v, return_lse=True, backend=hx.name)
    a = aa.attention_backward(q, k, v, g, out=out, lse=lse, backend=hx.name)
    b = aa.attention_backward(q, k, v, g, backend=hx.name)
    for n in ("dq", "dk", "dv"):
        ref = to_np(getattr(b, n))
        np.testing.assert_allclose(to_np(getattr(a, n)), ref, rtol=0,
                                   atol=1e-5 * np.max(np.abs(ref)))
    half = aa.attention_backward(q, k, v, g, out=out, lse=lse + float(np.log(2.0)),
                                 backend=hx.name, wrt=("v",))
    ref = to_np(b.dv) / 2
    np.testing.assert_allclose(to_np(half.dv), ref, rtol=0, atol=1e-5 * np.max(np.abs(ref)))


def test_deterministic(hx):
    B, Hq, Hkv, Sq, Sk, D = (1, 2, 1, 21, 29, 16) if hx.small else (2, 4, 2, 100, 130, 32)
    rng = np.random.default_rng(11)
    q, k, v, g = (hx.put(x) for x in make_qkv(rng, B, Hq, Hkv, Sq, Sk, D))
    bias = hx.put(rng.standard_normal((1, Hq, Sq, Sk)).astype(np.float32))
    runs = [aa.attention_backward(q, k, v, g, bias=bias, mask=aa.Causal(),
                                  wrt=("q", "k", "v", "bias"), backend=hx.name)
            for _ in range(2)]
    for n in ("dq", "dk", "dv", "dbias"):
        np.testing.assert_array_equal(to_np(getattr(runs[0], n)), to_np(getattr(runs[1], n)))


def test_key_permutation_invariance(hx):
    B, H, Sq, Sk, D = 1, 2, 12, 19, 16
    rng = np.random.default_rng(12)
    q, k, v, _ = make_qkv(rng, B, H, H, Sq, Sk, D)
    perm = rng.permutation(Sk)
    o1 = to_np(aa.attention(hx.put(q), hx.put(k), hx.put(v), backend=hx.name))
    o2 = to_np(aa.attention(hx.put(q), hx.put(np.ascontiguousarray(k[:, :, perm])),
                            hx.put(np.ascontiguousarray(v[:, :, perm])), backend=hx.name))
    assert np.max(np.abs(o1 - o2)) <= 1e-5 * np.max(np.abs(o1))


def test_causal_ignores_future(hx):
    B, H, S, D = 1, 1, 24, 16
    rng = np.random.default_rng(13)
    q, k, v, _ = make_qkv(rng, B, H, H, S, S, D)
    k2, v2 = k.copy(), v.copy()
    k2[:, :, 15:] = rng.standard_normal(k2[:, :, 15:].shape)
    v2[:, :, 15:] = rng.standard_normal(v2[:, :, 15:].shape)
    o1 = to_np(aa.attention(hx.put(q), hx.put(k), hx.put(v), mask=aa.Causal(), backend=hx.name))
    o2 = to_np(aa.attention(hx.put(q), hx.put(k2), hx.put(v2), mask=aa.Causal(),
                            backend=hx.name))
    np.testing.assert_array_equal(o1[:, :, :15], o2[:, :, :15])


def test_nan_propagates_not_created(hx):
    B, H, S, D = 1, 1, 8, 8
    rng = np.random.default_rng(14)
    q, k, v, _ = make_qkv(rng, B, H, H, S, S, D)
    q[0, 0, 2, 0] = np.nan
    out = to_np(aa.attention(hx.put(q), hx.put(k), hx.put(v), mask=aa.Causal(), backend=hx.name))
    assert np.isnan(out[0, 0, 2]).all()
    others = np.delete(out[0, 0], 2, axis=0)
    assert not np.isnan(others).any()


# ----------------------------------------------------------------- Hypothesis-drawn
from hypothesis import HealthCheck, given, settings, strategies as st


@st.composite
def problems(draw, small):
    top = 24 if small else 80
    group = draw(st.sampled_from([1, 2, 3]))
    hkv = draw(st.integers(1, 2))
    sq = draw(st.integers(1, top))
    sk = draw(st.integers(1, top))
    d = draw(st.sampled_from([8, 16, 24] if small else [8, 16, 24, 40, 64]))
    b = draw(st.integers(1, 2))
    mask_kind = draw(st.sampled_from(["none", "causal", "causal_br", "window", "keep", "docs"]))
    with_bias = draw(st.booleans())
    seed = draw(st.integers(0, 2 ** 16))
    return b, hkv * group, hkv, sq, sk, d, mask_kind, with_bias, seed


def _draw_mask(kind, B, Sq, Sk, rng):
    if kind == "causal":
        return aa.Causal()
    if kind == "causal_br":
        return aa.Causal("bottom_right")
    if kind == "window":
        return aa.Window(left=int(rng.integers(0, 8)), right=int(rng.integers(0, 8)))
    if kind == "keep":
        return aa.KeepMask(rng.random((B, 1, Sq, Sk)) < 0.6)
    if kind == "docs":
        return aa.Documents(np.sort(rng.integers(0, 3, Sq)), np.sort(rng.integers(0, 3, Sk)))
    return None


@pytest.mark.parametrize("name", [p.values[0] for p in _backend_params()])
def test_hypothesis_problems(name):
    why = unavailable_reason(name)
    if why:
        pytest.skip(f"{name} unavailable: {why}")
    hx = harness_for(name)

    @settings(max_examples=examples(3, 6) if hx.small else examples(25, 25), deadline=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(problems(hx.small))
    def check(prob):
        B, Hq, Hkv, Sq, Sk, D, mk, with_bias, seed = prob
        rng = np.random.default_rng(seed)
        q, k, v, g = make_qkv(rng, B, Hq, Hkv, Sq, Sk, D)
        mask = _put_mask(hx, _draw_mask(mk, B, Sq, Sk, rng))
        bias = rng.standard_normal((1, Hq, Sq, Sk)).astype(np.float32) if with_bias else None
        wrt = ("q", "k", "v", "bias") if with_bias else ("q", "k", "v")
        _run_both(hx, "float32", q, k, v, g, mask=mask, bias=bias, wrt=wrt)

    check()


def test_given_out_lse_define_p_and_delta(hx):
    """Blockwise backward (ring attention): out/lse from ALL keys, gradients for a key
    block: P = exp(s - lse), δ = <dout, out>, exactly as the reference computes."""
    B, H, Sq, Sk, D = 1, 2, 13, 22, 16
    rng = np.random.default_rng(15)
    q, k, v, g = make_qkv(rng, B, H, H, Sq, Sk, D)
    out, lse = R.forward(q, k, v, mask=aa.Causal("bottom_right"))
    half = Sk // 2
    kb, vb = np.ascontiguousarray(k[:, :, :half]), np.ascontiguousarray(v[:, :, :half])
    got = aa.attention_backward(hx.put(q), hx.put(kb), hx.put(vb), hx.put(g),
                                out=hx.put(out.astype(np.float32)),
                                lse=hx.put(lse.astype(np.float32)),
                                mask=aa.Causal(), k_offset=0, q_offset=Sk - Sq,
                                backend=hx.name)
    ref = R.backward(q, kb, vb, g, out=out, lse=lse, mask=aa.Causal(), q_offset=Sk - Sq)
    for n in ("dq", "dk", "dv"):
        assert_close(getattr(got, n), getattr(ref, n), "float32", n)


# ------------------------------------------------------------------- score modifiers
def _mods(rng, case, B, Hq, dtype):
    """The modifiers of a case: softcap c, ALiBi slopes ([Hq] or [B, Hq]), sinks [Hq]."""
    out = {}
    if "softcap" in case:
        out["softcap"] = 1.5
    if "alibi" in case:
        shape = (B, Hq) if "alibi_b" in case else (Hq,)
        out["alibi_slopes"] = rng.uniform(0.05, 0.6, shape).astype(dtype)
    if "sinks" in case:
        out["sinks"] = rng.standard_normal(Hq).astype(dtype)
    if "offsets" in case:
        out.update(q_offset=5, k_offset=2)
    return out


MOD_CASES = [
    # (name, shape index in SHAPES, mask, bias)
    ("softcap", "gqa", None, False),
    ("alibi", "sq_ne_sk", None, False),
    ("alibi_b-offsets", "sq_gt_sk", "causal_br", False),
    ("sinks", "gqa", "causal", False),
    ("softcap-alibi-sinks", "odd113", "window", True),
    ("softcap-alibi_b-sinks-offsets", "gqa", "causal_br", True),
]


@pytest.mark.parametrize("case,shape,mname,with_bias", MOD_CASES,
                         ids=[c[0] for c in MOD_CASES])
def test_score_modifiers(hx, case, shape, mname, with_bias):
    """softcap / ALiBi / sinks (DESIGN.md §1) alone and together, with masks, bias+dbias,
    GQA, Sq != Sk and offsets; dsinks against the reference."""
    B, Hq, Hkv, Sq, Sk, D = _shape(dict((c[0], c) for c in SHAPES)[shape], hx)
    mask = {None: None, "causal": aa.Causal(), "causal_br": aa.Causal("bottom_right"),
            "window": aa.Window(left=7, right=3)}[mname]
    for dtype in hx.dtypes:
        rng = np.random.default_rng(7)
        q, k, v, g = make_qkv(rng, B, Hq, Hkv, Sq, Sk, D, dtype)
        mods = _mods(rng, case, B, Hq, dtype)
        bias = rng.standard_normal((1, Hq, Sq, Sk)).astype(dtype) if with_bias else None
        wrt = ("q", "k", "v") + (("bias",) if with_bias else ()) + \
            (("sinks",) if "sinks" in mods else ())
        _run_both(hx, dtype, q, k, v, g, mask=mask, bias=bias, wrt=wrt, mods=mods)


def test_sinks_on_rows_that_keep_no_key(hx):
    """A row that keeps no key: out 0, lse = sinks[h], zero dq; -inf sinks are no sinks."""
    rng = np.random.default_rng(8)
    B, Hq, Hkv, Sq, Sk, D = 1, 2, 1, 9, 6, 8
    q, k, v, g = make_qkv(rng, B, Hq, Hkv, Sq, Sk, D, "float32")
    sinks = np.array([0.7, -np.inf], np.float32)
    mask = aa.Causal() & aa.Window(left=1)          # queries 7, 8 keep no key (Sk = 6)
    out, grads = _run_both(hx, "float32", q, k, v, g, mask=mask, wrt=("q", "k", "v", "sinks"),
                           mods=dict(sinks=sinks, softcap=3.0))
    _, lse = aa.attention(hx.put(q), hx.put(k), hx.put(v), mask=mask, sinks=hx.put(sinks),
                          softcap=3.0, return_lse=True, backend=hx.name)
    lse = to_np(lse)
    assert np.all(to_np(out)[:, :, 7:] == 0)
    np.testing.assert_array_equal(lse[0, 0, 7:], np.float32(0.7))
    assert np.all(lse[0, 1, 7:] == -np.inf)
    assert np.all(to_np(grads.dq)[:, :, 7:] == 0)


# ------------------------------------------------------------------------- dropout
DROPOUT_CASES = [
    # (name, shape, mask, bias, extra)
    ("plain", "gqa", None, False, {}),
    ("causal_bias_offsets", "sq_ne_sk", "causal_br", True, dict(q_offset=3, k_offset=1)),
    ("window_modifiers", "odd113", "window", False, dict(softcap=2.0, alibi_slopes="h",
                                                          sinks=True)),
]


@pytest.mark.parametrize("case,shape,mname,with_bias,extra", DROPOUT_CASES,
                         ids=[c[0] for c in DROPOUT_CASES])
def test_dropout_draws_the_shared_mask(hx, case, shape, mname, with_bias, extra):
    """Every backend applies anyattn.dropout_mask bit for bit (one dropped or kept entry
    of difference moves out by ~P/(1 − p), far above the tolerance): out, lse (undropped)
    and every gradient against the reference drawing the same mask."""
    B, Hq, Hkv, Sq, Sk, D = _shape(dict((c[0], c) for c in SHAPES)[shape], hx)
    mask = {None: None, "causal_br": aa.Causal("bottom_right"),
            "window": aa.Window(left=7, right=3)}[mname]
    for dtype in hx.dtypes:
        rng = np.random.default_rng(9)
        q, k, v, g = make_qkv(rng, B, Hq, Hkv, Sq, Sk, D, dtype)
        mods = dict(extra)
        if mods.get("alibi_slopes") == "h":
            mods["alibi_slopes"] = rng.uniform(0.05, 0.6, Hq).astype(dtype)
        if mods.get("sinks"):
            mods["sinks"] = rng.standard_normal(Hq).astype(dtype)
        mods.update(dropout_p=0.25, dropout_seed=2 ** 63 + 17)
        bias = rng.standard_normal((1, Hq, Sq, Sk)).astype(dtype) if with_bias else None
        wrt = ("q", "k", "v") + (("bias",) if with_bias else ()) + \
            (("sinks",) if "sinks" in mods else ())
        _run_both(hx, dtype, q, k, v, g, mask=mask, bias=bias, wrt=wrt, mods=mods)


# ----------------------------------------------------------- value head dim (Dv != D)
#: (D, Dv): q/k head dim and v's (multi-head latent attention: 192/128; odd dims)
VALUE_DIMS = [(192, 128), (128, 64), (64, 128), (40, 24), (24, 40)]
VALUE_DIM_MASKS = {
    "causal": lambda Sq, Sk, B, rng: aa.Causal("bottom_right"),
    "window": lambda Sq, Sk, B, rng: aa.Window(left=5, right=3),
    "documents": lambda Sq, Sk, B, rng: aa.Documents(
        np.sort(rng.integers(0, 3, (B, Sq)), axis=1), np.sort(rng.integers(0, 3, (B, Sk)), axis=1)),
    "keep": lambda Sq, Sk, B, rng: aa.KeepMask(rng.random((B, 1, Sq, Sk)) < 0.6),
}


#: what an interpreted or emulated backend runs by default: every (D, Dv) pair once and
#: every mask kind once (the kernels' value head dim and their mask are independent
#: parts); every pair with every mask on the other backends and with --exhaustive
VALUE_DIM_COVER = {(dims, list(VALUE_DIM_MASKS)[i % len(VALUE_DIM_MASKS)])
                   for i, dims in enumerate(VALUE_DIMS)}


def _value_dim_supported(hx) -> bool:
    from anyattn.backends.registry import get_backend

    return get_backend(hx.name).capabilities.supports("value_dim")


def _value_dim_refused(hx):
    """A backend without the feature refuses Dv != D with the table's words, before any
    work (forward and backward)."""
    from anyattn import features

    q, k, v, g = (hx.put(x) for x in make_qkv(np.random.default_rng(0), 1, 2, 1, 5, 7, 16,
                                              Dv=8))
    words = features.get("value_dim").refusal
    with pytest.raises(NotImplementedError, match=r"cannot compute this problem") as ei:
        aa.attention(q, k, v, backend=hx.name)
    assert words in str(ei.value)
    with pytest.raises(NotImplementedError) as ei:
        aa.attention_backward(q, k, v, g, backend=hx.name)
    assert words in str(ei.value)


@pytest.mark.parametrize("mname", list(VALUE_DIM_MASKS))
@pytest.mark.parametrize("dims", VALUE_DIMS, ids=[f"{d}-{dv}" for d, dv in VALUE_DIMS])
def test_value_head_dim(hx, dims, mname):
    """q, k [.., D], v [.., Dv] -> out [.., Dv]: forward, lse and every gradient against
    float64 with each mask kind, GQA and Sq != Sk (a backend without the ``value_dim``
    feature must refuse it instead)."""
    if not _value_dim_supported(hx):
        if dims == VALUE_DIMS[0] and mname == "causal":
            _value_dim_refused(hx)
            return
        pytest.skip(f"{hx.name} refuses value_dim (checked once)")
    if hx.small and not exhaustive() and (dims, mname) not in VALUE_DIM_COVER:
        pytest.skip(f"exhaustive: {hx.name} runs each (D, Dv) pair and mask kind once "
                    "by default (VALUE_DIM_COVER); pytest --exhaustive runs every pair")
    D, Dv = dims
    B, Hq, Hkv, Sq, Sk = (1, 4, 2, 7, 11) if hx.small else (2, 4, 2, 29, 37)
    rng = np.random.default_rng(D + Dv)
    mask = _put_mask(hx, VALUE_DIM_MASKS[mname](Sq, Sk, B, rng))
    for dtype in hx.dtypes:
        q, k, v, g = make_qkv(np.random.default_rng(D), B, Hq, Hkv, Sq, Sk, D, dtype, Dv=Dv)
        out, grads = _run_both(hx, dtype, q, k, v, g, mask=mask)
        assert tuple(out.shape) == (B, Hq, Sq, Dv)
        assert tuple(grads.dv.shape) == (B, Hkv, Sk, Dv)
        assert tuple(grads.dk.shape) == (B, Hkv, Sk, D)


@pytest.mark.parametrize("dims", [(40, 24), (24, 40)], ids=["40-24", "24-40"])
def test_value_head_dim_with_modifiers_bias_dropout(hx, dims):
    """Dv != D with bias + dbias, softcap, ALiBi, sinks + dsinks, dropout and offsets at
    once; then the backward with the forward's out/lse given, and a bshd layout."""
    if not _value_dim_supported(hx):
        pytest.skip(f"{hx.name} refuses value_dim (test_value_head_dim checks the refusal)")
    D, Dv = dims
    B, Hq, Hkv, Sq, Sk = (1, 4, 2, 9, 13) if hx.small else (2, 4, 2, 33, 41)
    rng = np.random.default_rng(21)
    q, k, v, g = make_qkv(rng, B, Hq, Hkv, Sq, Sk, D, Dv=Dv)
    bias = rng.standard_normal((1, Hq, Sq, Sk)).astype(np.float32)
    mods = dict(softcap=2.0, alibi_slopes=rng.uniform(0.05, 0.6, Hq).astype(np.float32),
                sinks=rng.standard_normal(Hq).astype(np.float32), q_offset=3, k_offset=1,
                dropout_p=0.2, dropout_seed=99)
    _run_both(hx, "float32", q, k, v, g, mask=aa.Causal("bottom_right"), bias=bias,
              wrt=("q", "k", "v", "bias", "sinks"), mods=mods)
    out, lse = aa.attention(hx.put(q), hx.put(k), hx.put(v), mask=aa.Causal(),
                            return_lse=True, backend=hx.name)
    given = aa.attention_backward(hx.put(q), hx.put(k), hx.put(v), hx.put(g), out=out,
                                  lse=lse, mask=aa.Causal(), backend=hx.name)
    rg = R.backward(q, k, v, g, mask=aa.Causal())
    for n in ("dq", "dk", "dv"):
        assert_close(getattr(given, n), getattr(rg, n), "float32", n)
    t = (lambda x: hx.put(np.ascontiguousarray(x.swapaxes(1, 2))))
    out = aa.attention(t(q), t(k), t(v), layout="bshd", backend=hx.name)
    assert tuple(out.shape) == (B, Sq, Hq, Dv)
    assert_close(to_np(out).swapaxes(1, 2), R.forward(q, k, v)[0], "float32", "out")


def test_value_head_dim_writes_every_element(hx, monkeypatch):
    """Every element of out, dq, dk, dv is written with Dv != D: the NumPy backend's
    np.empty buffers (results and scratch) are poisoned with NaN."""
    if hx.name != "numpy":
        pytest.skip("poisons the NumPy backend's buffers")
    from anyattn.backends import numpy_backend, numpy_tiles

    class Poisoned:
        def __getattr__(self, name):
            return getattr(np, name)

        @staticmethod
        def empty(shape, dtype=float, **kw):
            return np.full(shape, np.nan, dtype=dtype, **kw)

    q, k, v, g = make_qkv(np.random.default_rng(22), 2, 4, 2, 23, 31, 40, Dv=24)
    ro, _ = R.forward(q, k, v, mask=aa.Causal())
    rg = R.backward(q, k, v, g, mask=aa.Causal())
    monkeypatch.setattr(numpy_backend, "np", Poisoned())
    monkeypatch.setattr(numpy_tiles, "np", Poisoned())
    out = aa.attention(q, k, v, mask=aa.Causal(), backend="numpy")
    grads = aa.attention_backward(q, k, v, g, mask=aa.Causal(), backend="numpy")
    assert_close(out, ro, "float32", "out")
    for n in ("dq", "dk", "dv"):
        assert_close(getattr(grads, n), getattr(rg, n), "float32", n)
