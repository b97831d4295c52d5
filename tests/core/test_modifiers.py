"""Score modifiers in the float64 reference (softcap, ALiBi, sinks): finite differences
for every gradient, the contract's closed forms, and the validation of bad input."""
import numpy as np
import pytest

import anyattn as aa
from anyattn import reference as R
from anyattn.masks import Causal, Documents, KeepMask, Window
from anyattn.modifiers import NO_MODS, fold_sinks, sinks_grad
from anyattn.rowstats import RowStats


def _inputs(seed=0, B=2, Hq=4, Hkv=2, Sq=5, Sk=7, D=3):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Hq, Sq, D))
    k = rng.standard_normal((B, Hkv, Sk, D))
    v = rng.standard_normal((B, Hkv, Sk, D))
    g = rng.standard_normal((B, Hq, Sq, D))
    return rng, q, k, v, g


CASES = {
    "softcap": dict(softcap=0.9),
    "alibi_heads": dict(alibi_slopes="h"),
    "alibi_batch": dict(alibi_slopes="bh"),
    "sinks": dict(sinks=True),
    "all_causal_bias": dict(softcap=1.3, alibi_slopes="h", sinks=True, bias=True,
                            mask=Causal()),
    "all_offsets_window": dict(softcap=2.0, alibi_slopes="bh", sinks=True,
                               mask=Window(left=2, align="bottom_right"), q_offset=3,
                               k_offset=1),
}


def _build(case, rng, B, Hq, Sq, Sk):
    kw = dict(CASES[case])
    if kw.get("alibi_slopes") == "h":
        kw["alibi_slopes"] = rng.uniform(0.1, 1.0, Hq)
    elif kw.get("alibi_slopes") == "bh":
        kw["alibi_slopes"] = rng.uniform(0.1, 1.0, (B, Hq))
    if kw.get("sinks"):
        kw["sinks"] = rng.standard_normal(Hq)
    if kw.get("bias"):
        kw["bias"] = rng.standard_normal((1, Hq, Sq, Sk))
    return kw


@pytest.mark.parametrize("case", sorted(CASES))
def test_reference_gradients_match_finite_differences(case):
    rng, q, k, v, g = _inputs()
    B, Hq, Sq, _ = q.shape
    kw = _build(case, rng, B, Hq, Sq, k.shape[2])
    wrt = ["q", "k", "v"] + (["bias"] if "bias" in kw else []) + \
        (["sinks"] if "sinks" in kw else [])
    grads = R.backward(q, k, v, g, wrt=wrt, **kw)
    names = {"q": "dq", "k": "dk", "v": "dv", "bias": "dbias", "sinks": "dsinks"}
    base = dict(q=q, k=k, v=v, **kw)

    def loss(**over):
        args = dict(base, **over)
        out, _ = R.forward(args.pop("q"), args.pop("k"), args.pop("v"), **args)
        return float((out * g).sum())

    eps = 1e-6
    for name in wrt:
        x = base[name]
        got = getattr(grads, names[name])
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            xp, xm = x.copy(), x.copy()
            xp[idx] += eps
            xm[idx] -= eps
            num[idx] = (loss(**{name: xp}) - loss(**{name: xm})) / (2 * eps)
        np.testing.assert_allclose(got, num, rtol=1e-6, atol=1e-7, err_msg=name)


def test_softcap_and_alibi_closed_form():
    """softcap: s = c·tanh(scale·qk / c); ALiBi: −slope·|i + Sk − Sq − j| (no offsets)."""
    rng, q, k, v, _ = _inputs(1, Hkv=4)
    B, Hq, Sq, D = q.shape
    Sk = k.shape[2]
    c, slopes = 0.7, rng.uniform(0.1, 1, Hq)
    out, lse = R.forward(q, k, v, softcap=c, alibi_slopes=slopes)
    s = np.einsum("bhid,bhjd->bhij", q, k) / np.sqrt(D)
    s = c * np.tanh(s / c)
    i, j = np.arange(Sq)[:, None], np.arange(Sk)[None, :]
    s = s - slopes[None, :, None, None] * np.abs(i + Sk - Sq - j)
    want_lse = np.log(np.exp(s).sum(-1))
    np.testing.assert_allclose(lse, want_lse, rtol=1e-13)
    np.testing.assert_allclose(out, np.einsum("bhij,bhjd->bhid",
                                              np.exp(s - want_lse[..., None]), v), rtol=1e-12)


def test_sinks_closed_form_and_empty_rows():
    rng, q, k, v, g = _inputs(2, Hkv=4)
    Hq = q.shape[1]
    sinks = rng.standard_normal(Hq)
    mask = Window(left=0, right=0)                   # key i only; queries 5, 6 keep none
    out, lse = R.forward(q, k[:, :, :4], v[:, :, :4], sinks=sinks, mask=mask)
    s = np.einsum("bhid,bhjd->bhij", q, k[:, :, :4]) / np.sqrt(q.shape[-1])
    i, j = np.arange(5)[:, None], np.arange(4)[None, :]
    s = np.where(i == j, s, -np.inf)
    want = np.log(np.exp(s).sum(-1) + np.exp(sinks)[None, :, None])
    np.testing.assert_allclose(lse, want, rtol=1e-13)
    assert np.all(out[:, :, 4] == 0)
    np.testing.assert_array_equal(lse[:, :, 4], np.broadcast_to(sinks, lse[:, :, 4].shape))


def test_fold_sinks_and_sinks_grad_match_the_reference():
    """The backend-neutral sink steps reproduce the reference's sink statistics and
    dsinks, for NumPy (float32 and float64) and torch."""
    rng, q, k, v, g = _inputs(3)
    sinks = rng.standard_normal(q.shape[1])
    sinks[1] = -np.inf                                   # a -inf sink is no sink
    mask = Causal() & Window(left=1)
    kk, vv = k[:, :, :4], v[:, :, :4]                    # rows 4.. keep keys; add a
    out0, st0 = R.forward_stats(q, kk, vv, mask=mask & KeepMask(
        np.arange(4)[None, :] < np.array([1, 2, 3, 4, 0])[:, None]))
    want_out, want_st = R.forward_stats(q, kk, vv, sinks=sinks, mask=mask & KeepMask(
        np.arange(4)[None, :] < np.array([1, 2, 3, 4, 0])[:, None]))
    got_out, got_st = fold_sinks(out0, st0, sinks)
    np.testing.assert_allclose(got_out, want_out, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(got_st.lse, want_st.lse, rtol=1e-13)
    want_ds = R.backward(q, kk, vv, g, sinks=sinks, wrt=("sinks",), out=want_out,
                         stats=want_st, mask=mask).dsinks
    np.testing.assert_allclose(sinks_grad(g, got_out, got_st, sinks), want_ds, rtol=1e-12)
    for dt in ("float32",):
        f_out, f_st = fold_sinks(out0.astype(dt), RowStats(st0.max.astype(dt),
                                                           st0.log_norm.astype(dt)),
                                 sinks.astype(dt))
        np.testing.assert_allclose(f_out, want_out, rtol=2e-6, atol=1e-7)
        assert f_out.dtype == dt and f_st.max.dtype == dt
    torch = pytest.importorskip("torch")
    t_out, t_st = fold_sinks(torch.from_numpy(out0), RowStats(torch.from_numpy(st0.max),
                             torch.from_numpy(st0.log_norm)), torch.from_numpy(sinks))
    np.testing.assert_allclose(t_out.numpy(), want_out, rtol=1e-13, atol=1e-15)
    np.testing.assert_allclose(sinks_grad(torch.from_numpy(g), t_out, t_st,
                                          torch.from_numpy(sinks)).numpy(), want_ds,
                               rtol=1e-12)


def test_api_through_the_reference_backend_and_layouts():
    rng, q, k, v, g = _inputs(4)
    B, Hq, Sq, D = q.shape
    kw = dict(softcap=1.1, alibi_slopes=rng.uniform(0.1, 1, (B, Hq)),
              sinks=rng.standard_normal(Hq), mask=Causal(align="bottom_right"))
    out, lse = aa.attention(q, k, v, return_lse=True, backend="reference", **kw)
    ro, rl = R.forward(q, k, v, **kw)
    np.testing.assert_array_equal(out, ro)
    np.testing.assert_allclose(lse, rl, rtol=1e-15)
    gr = aa.attention_backward(q, k, v, g, wrt=("q", "k", "v", "sinks"), backend="reference",
                               **kw)
    rg = R.backward(q, k, v, g, wrt=("q", "k", "v", "sinks"), **kw)
    for name in ("dq", "dk", "dv", "dsinks"):
        np.testing.assert_allclose(getattr(gr, name), getattr(rg, name), rtol=1e-12)
    sw = (lambda x: x.swapaxes(1, 2))
    gs = aa.attention_backward(sw(q), sw(k), sw(v), sw(g), wrt=("q", "sinks"), layout="bshd",
                               backend="reference", out=sw(out), lse=lse, **kw)
    np.testing.assert_allclose(sw(gs.dq), rg.dq, rtol=1e-12)
    np.testing.assert_allclose(gs.dsinks, rg.dsinks, rtol=1e-12)


def test_empty_problem_with_sinks():
    q = np.zeros((1, 2, 3, 4))
    k = v = np.zeros((1, 2, 0, 4))
    sinks = np.array([0.5, -1.0])
    out, lse = aa.attention(q, k, v, sinks=sinks, return_lse=True, backend="reference")
    assert np.all(out == 0)
    np.testing.assert_array_equal(lse, np.broadcast_to(sinks[None, :, None], (1, 2, 3)))
    gr = aa.attention_backward(q, k, v, q, sinks=sinks, wrt=("sinks",), backend="reference")
    np.testing.assert_array_equal(gr.dsinks, 0.0)


# ------------------------------------------------------------------------- bad input
BAD = [
    (dict(softcap=0.0), ValueError, "softcap"),
    (dict(softcap=-1.0), ValueError, "softcap"),
    (dict(softcap=float("nan")), ValueError, "softcap"),
    (dict(softcap=float("inf")), ValueError, "softcap"),
    (dict(softcap=True), TypeError, "softcap"),
    (dict(softcap="1"), TypeError, "softcap"),
    (dict(alibi_slopes=np.ones(3, np.float32)), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=np.ones((2, 2, 4), np.float32)), ValueError, "alibi_slopes"),
    (dict(alibi_slopes=np.ones(4, np.int32)), TypeError, "alibi_slopes"),
    (dict(alibi_slopes=[1.0] * 4), TypeError, "alibi_slopes"),
    (dict(sinks=np.ones((1, 4), np.float32)), ValueError, "sinks"),
    (dict(sinks=np.ones(4, np.float16)), TypeError, "sinks"),
    (dict(sinks=np.ones(5, np.float32)), ValueError, "sinks"),
]


@pytest.mark.parametrize("kw,exc,name", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_modifiers_are_refused_naming_the_argument(kw, exc, name):
    q = np.zeros((2, 4, 3, 8), np.float32)
    k = v = np.zeros((2, 2, 5, 8), np.float32)
    with pytest.raises(exc, match=name):
        aa.attention(q, k, v, backend="reference", **kw)
    with pytest.raises(exc, match=name):
        aa.attention_backward(q, k, v, q, backend="reference", **kw)


def test_sinks_gradient_needs_sinks_and_torch_modifiers_must_match_q():
    q = np.zeros((1, 2, 3, 8), np.float32)
    with pytest.raises(ValueError, match="'sinks' was asked for"):
        aa.attention_backward(q, q, q, q, wrt=("q", "sinks"), backend="reference")
    torch = pytest.importorskip("torch")
    tq = torch.zeros(1, 2, 3, 8)
    with pytest.raises(TypeError, match="sinks: is a numpy array"):
        aa.attention(tq, tq, tq, sinks=np.zeros(2, np.float32), backend="reference")
    with pytest.raises(TypeError, match="alibi_slopes: dtype float64"):
        aa.attention(tq, tq, tq, alibi_slopes=torch.zeros(2, dtype=torch.float64),
                     backend="reference")


def test_backends_without_a_modifier_refuse_it_with_a_reason():
    """A backend that lacks a modifier says so (capabilities as data); none drops one."""
    from anyattn.backends.registry import get_backend
    from anyattn.problem import describe

    q = np.zeros((1, 2, 3, 8), np.float32)
    p = describe(q, q, q, softcap=1.0, alibi_slopes=np.ones(2, np.float32),
                 sinks=np.ones(2, np.float32))
    for name in ("reference", "numpy", "webgpu", "triton"):
        be = get_backend(name)
        c = be.capabilities
        why = " ".join(be.unsupported_reasons(p))
        for flag, word in (("softcap" in c.modifiers, "softcap"),
                           ("alibi" in c.modifiers, "alibi_slopes"),
                           ("sinks" in c.modifiers, "sinks")):
            assert (word in why) != flag, (name, word, why)
    assert NO_MODS.empty
