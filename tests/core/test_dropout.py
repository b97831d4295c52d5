"""anyattn.dropout: the shared keep mask (generator, statistics, positions) and dropout
in the float64 reference (closed form, finite differences), with bad input refused."""
import numpy as np
import pytest

import anyattn as aa
from anyattn import reference as R
from anyattn.dropout import (col_words, dropout_mask, mix32, philox4x32, row_words,
                             threshold)
from anyattn.masks import Causal, Window


def test_philox_known_answers():
    """Philox4x32-10 against the Random123 known-answer vectors."""
    assert [int(x) for x in philox4x32(0, 0, 0, 0, 0, 0)] == \
        [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    f = 0xFFFFFFFF
    assert [int(x) for x in philox4x32(f, f, f, f, f, f)] == \
        [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    assert [int(x) for x in philox4x32(0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344,
                                       0xA4093822, 0x299F31D0)] == \
        [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_mix32_is_the_documented_finaliser():
    x = np.array([0, 1, 0xFFFFFFFF, 0x12345678], np.uint32)

    def one(v):
        v ^= v >> 16
        v = (v * 0x7FEB352D) & 0xFFFFFFFF
        v ^= v >> 15
        v = (v * 0x846CA68B) & 0xFFFFFFFF
        return v ^ (v >> 16)

    assert [int(v) for v in mix32(x.copy())] == [one(int(v)) for v in x]


def test_mask_is_a_function_of_global_positions():
    """A block of the mask at offsets equals the same block of the whole mask: tiling,
    sharding and launch order cannot change it."""
    full = dropout_mask((2, 3, 40, 50), 0.3, 99)
    part = dropout_mask((2, 3, 15, 20), 0.3, 99, q_offset=10, k_offset=25)
    np.testing.assert_array_equal(part, full[:, :, 10:25, 25:45])
    x = row_words(99, [1], [2], [7])[0, 0, 0] ^ col_words(99, [3])[0]
    assert bool(mix32(np.array([x], np.uint32))[0] >= threshold(0.3)) == bool(full[1, 2, 7, 3])


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_mask_statistics(p):
    """Drop rate within 5 sigma; no correlation along any axis; seeds differ."""
    m = dropout_mask((4, 8, 128, 256), p, 12345)
    n = m.size
    sigma = np.sqrt(p * (1 - p) / n)
    assert abs((1 - m.mean()) - p) < 5 * sigma
    f = m.astype(np.float64) - m.mean()
    for ax in range(4):
        a = np.take(f, range(f.shape[ax] - 1), axis=ax).ravel()
        b = np.take(f, range(1, f.shape[ax]), axis=ax).ravel()
        corr = float(a @ b / np.sqrt((a @ a) * (b @ b)))
        assert abs(corr) < 5 / np.sqrt(a.size), (ax, corr)
    # per-row and per-column drop rates look binomial (no stuck rows or columns)
    rows = 1 - m.mean(axis=-1)
    assert np.abs(rows - p).max() < 6 * np.sqrt(p * (1 - p) / m.shape[-1])
    other = dropout_mask((4, 8, 128, 256), p, 12346)
    assert 0.3 < np.mean(other != m) / (2 * p * (1 - p)) < 1.7
    assert np.array_equal(dropout_mask((4, 8, 128, 256), p, 12345), m)


def test_mask_edge_values():
    assert dropout_mask((1, 1, 3, 3), 0.0, 5).all()
    assert threshold(0.0) == 0 and threshold(1 - 1e-12) == 2 ** 32 - 1
    assert dropout_mask((1, 1, 2, 2), 0.5, 2 ** 64 - 1).shape == (1, 1, 2, 2)
    with pytest.raises(ValueError, match="q_offset"):
        dropout_mask((1, 1, 2, 2), 0.5, 1, q_offset=-1)
    with pytest.raises(ValueError, match="k_offset"):
        dropout_mask((1, 1, 2, 2), 0.5, 1, k_offset=2 ** 32 - 1)


def _inputs(seed=0, B=2, Hq=4, Hkv=2, Sq=6, Sk=9, D=4):
    rng = np.random.default_rng(seed)
    return rng, tuple(rng.standard_normal(s) for s in
                      ((B, Hq, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, D), (B, Hq, Sq, D)))


def test_reference_forward_closed_form():
    _, (q, k, v, _) = _inputs(1, Hkv=4)
    p, seed = 0.25, 7
    out, lse = R.forward(q, k, v, dropout_p=p, dropout_seed=seed, q_offset=3, k_offset=4)
    _, lse0 = R.forward(q, k, v, q_offset=3, k_offset=4)
    np.testing.assert_array_equal(lse, lse0)                 # lse is undropped
    s = np.einsum("bhid,bhjd->bhij", q, k) / 2.0
    P = np.exp(s - lse0[..., None])
    keep = dropout_mask(P.shape, p, seed, q_offset=3, k_offset=4)
    np.testing.assert_allclose(out, np.einsum("bhij,bhjd->bhid", P * keep / (1 - p), v),
                               rtol=1e-12)


@pytest.mark.parametrize("extra", [{}, dict(softcap=1.2, sinks="yes", mask=Causal()),
                                   dict(mask=Window(left=2), bias="yes", q_offset=2)])
def test_reference_gradients_match_finite_differences(extra):
    rng, (q, k, v, g) = _inputs(2)
    kw = dict(extra, dropout_p=0.3, dropout_seed=2024)
    if kw.get("sinks") == "yes":
        kw["sinks"] = rng.standard_normal(q.shape[1])
    if kw.get("bias") == "yes":
        kw["bias"] = rng.standard_normal((1, q.shape[1], q.shape[2], k.shape[2]))
    wrt = ["q", "k", "v"] + [n for n in ("bias", "sinks") if n in kw]
    grads = R.backward(q, k, v, g, wrt=wrt, **kw)
    base = dict(q=q, k=k, v=v, **kw)

    def loss(**over):
        a = dict(base, **over)
        out, _ = R.forward(a.pop("q"), a.pop("k"), a.pop("v"), **a)
        return float((out * g).sum())

    names = {"q": "dq", "k": "dk", "v": "dv", "bias": "dbias", "sinks": "dsinks"}
    for name in wrt:
        x = base[name]
        num = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            xp, xm = x.copy(), x.copy()
            xp[idx] += 1e-6
            xm[idx] -= 1e-6
            num[idx] = (loss(**{name: xp}) - loss(**{name: xm})) / 2e-6
        np.testing.assert_allclose(getattr(grads, names[name]), num, rtol=1e-6, atol=1e-7,
                                   err_msg=name)


def test_api_dropout_through_the_reference_backend():
    rng, (q, k, v, g) = _inputs(3)
    kw = dict(dropout_p=0.2, dropout_seed=11, mask=Causal())
    out = aa.attention(q, k, v, backend="reference", **kw)
    ro, _ = R.forward(q, k, v, **kw)
    np.testing.assert_array_equal(out, ro)
    gr = aa.attention_backward(q, k, v, g, backend="reference", **kw)
    rg = R.backward(q, k, v, g, **kw)
    np.testing.assert_allclose(gr.dq, rg.dq, rtol=1e-12)
    assert not np.array_equal(out, aa.attention(q, k, v, backend="reference", mask=Causal()))


BAD = [
    (dict(dropout_p=-0.1, dropout_seed=1), ValueError, "dropout_p"),
    (dict(dropout_p=1.0, dropout_seed=1), ValueError, "dropout_p"),
    (dict(dropout_p=float("nan"), dropout_seed=1), ValueError, "dropout_p"),
    (dict(dropout_p="0.1", dropout_seed=1), TypeError, "dropout_p"),
    (dict(dropout_p=0.1), ValueError, "dropout_seed"),
    (dict(dropout_p=0.1, dropout_seed=-1), ValueError, "dropout_seed"),
    (dict(dropout_p=0.1, dropout_seed=2 ** 64), ValueError, "dropout_seed"),
    (dict(dropout_p=0.1, dropout_seed=1.5), TypeError, "dropout_seed"),
    (dict(dropout_p=0.1, dropout_seed=1, q_offset=-3), ValueError, "q_offset"),
]


@pytest.mark.parametrize("kw,exc,name", BAD, ids=[f"{b[2]}-{i}" for i, b in enumerate(BAD)])
def test_bad_dropout_refused_naming_the_argument(kw, exc, name):
    q = np.zeros((1, 2, 3, 8), np.float32)
    with pytest.raises(exc, match=name):
        aa.attention(q, q, q, backend="reference", **kw)
    with pytest.raises(exc, match=name):
        aa.attention_backward(q, q, q, q, backend="reference", **kw)
