"""The float64 reference: gradients vs central finite differences, and its properties."""
import numpy as np
import pytest

import anyattn as aa
from anyattn import reference as R


def _loss(q, k, v, g, bias, mask, scale=None):
    out, _ = R.forward(q, k, v, mask=mask, bias=bias, scale=scale)
    return float(np.sum(out * g))


def _fd(f, x, eps=1e-6):
    grad = np.zeros_like(x)
    it = np.nditer(x, flags=["multi_index"])
    for _ in it:
        idx = it.multi_index
        old = x[idx]
        x[idx] = old + eps
        fp = f()
        x[idx] = old - eps
        fm = f()
        x[idx] = old
        grad[idx] = (fp - fm) / (2 * eps)
    return grad


MASKS = [None, aa.Causal(), aa.Causal("bottom_right") & aa.Window(left=2),
         aa.Documents(np.array([0, 0, 1, 1, 1]), np.array([0, 1, 1, 1, 2, 2]))]


@pytest.mark.parametrize("mask", MASKS, ids=["none", "causal", "br_window", "docs"])
def test_gradients_match_finite_differences(mask):
    rng = np.random.default_rng(0)
    B, Hq, Hkv, Sq, Sk, D = 1, 4, 2, 5, 6, 3
    q = rng.standard_normal((B, Hq, Sq, D))
    k = rng.standard_normal((B, Hkv, Sk, D))
    v = rng.standard_normal((B, Hkv, Sk, D))
    g = rng.standard_normal((B, Hq, Sq, D))
    bias = rng.standard_normal((1, Hq, 1, Sk))
    res = R.backward(q, k, v, g, mask=mask, bias=bias, scale=0.7,
                     wrt=("q", "k", "v", "bias"))
    for name, x in (("dq", q), ("dk", k), ("dv", v), ("dbias", bias)):
        num = _fd(lambda: _loss(q, k, v, g, bias, mask, 0.7), x)
        np.testing.assert_allclose(getattr(res, name), num, atol=1e-7, rtol=1e-6, err_msg=name)


def test_lse_is_logsumexp_and_empty_rows():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal((1, 1, 4, 3)) for _ in range(3))
    keep = np.ones((4, 4), bool)
    keep[2] = False
    out, lse = R.forward(q, k, v, mask=aa.KeepMask(keep), scale=1.0)
    s = q[0, 0] @ k[0, 0].T
    for i in (0, 1, 3):
        assert np.isclose(lse[0, 0, i], np.log(np.exp(s[i]).sum()))
    assert lse[0, 0, 2] == -np.inf and np.all(out[0, 0, 2] == 0)
    g = R.backward(q, k, v, np.ones_like(q), mask=aa.KeepMask(keep))
    assert not np.isnan(g.dq).any() and np.all(g.dq[0, 0, 2] == 0)


def test_seed_mode_uniform_rows():
    """The seed's quirk: under a mask kind, a row that keeps no key attends uniformly."""
    rng = np.random.default_rng(2)
    q, k, v, dy = (rng.standard_normal((1, 1, 3, 4)) for _ in range(4))
    mask = np.ones((1, 1, 3, 3))
    mask[0, 0, 1] = 0.0
    dv = R.seed_backward(q, k, v, dy, mask_kind=2, scale=0.5, mask=mask, wrt=2)
    # row 1 contributes dy[1] / Sk to every key's dV
    p = np.exp(0.5 * q[0, 0] @ k[0, 0].T)
    p[1] = 1.0
    p /= p.sum(-1, keepdims=True)
    np.testing.assert_allclose(dv[0, 0], p.T @ dy[0, 0], rtol=1e-12)
