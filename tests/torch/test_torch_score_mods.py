"""Score and mask functions under anyattn.torch.attention (CPU, autograd): gradients of
q, k, v and of captured tensors that require grad, against the float64 reference.

Shape legend: B batch, Hq/Hkv heads, Sq/Sk queries/keys, D head dim."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

import anyattn as aa  # noqa: E402
import anyattn.torch as at  # noqa: E402


def test_captured_tensors_get_gradients_through_autograd():
    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 20, 28, 8
    q = torch.randn(B, Hq, Sq, D, generator=g, requires_grad=True)
    k = torch.randn(B, Hkv, Sk, D, generator=g, requires_grad=True)
    v = torch.randn(B, Hkv, Sk, D, generator=g, requires_grad=True)
    table = torch.randn(Hq, Sq + Sk - 1, generator=g, requires_grad=True)
    frozen = torch.randn(Hq, generator=g)                        # no grad wanted
    sm = aa.ScoreMod(lambda s, b, h, i, j, table, frozen:
                     s * frozen[h] + table[h, i - j + Sk - 1], table=table, frozen=frozen)
    mask = aa.Causal("bottom_right") | aa.MaskMod(lambda b, h, i, j: j < 3)
    out = at.attention(q, k, v, score_mod=sm, mask=mask)
    dout = torch.randn(out.shape, generator=g)
    out.backward(dout)
    f64 = [x.detach().double().numpy() for x in (q, k, v, dout)]
    sm64 = aa.ScoreMod(sm.fn, table=table.detach().double().numpy(),
                       frozen=frozen.double().numpy())
    ref = aa.attention(*f64[:3], score_mod=sm64, mask=mask, backend="reference")
    rg = aa.attention_backward(*f64, score_mod=sm64, mask=mask, backend="reference",
                               wrt=("q", "k", "v", "table"))
    np.testing.assert_allclose(out.detach().numpy(), ref, rtol=0, atol=1e-5)
    for mine, theirs in ((q.grad, rg.dq), (k.grad, rg.dk), (v.grad, rg.dv),
                         (table.grad, rg.dcaptures["table"])):
        err = float(np.abs(mine.numpy() - theirs).max() / np.abs(theirs).max())
        assert err < 1e-5, err
    assert frozen.grad is None


def test_layout_and_lse_with_a_plain_function():
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 16, 2, 8, generator=g) for _ in range(3))     # bshd
    def fn(s, b, h, i, j):
        return 5.0 * torch.tanh(s / 5.0)              # torch functions trace too

    out, lse = at.attention(q, k, v, score_mod=fn, layout="bshd", return_lse=True)
    ref, rlse = at.attention(q, k, v, softcap=5.0, layout="bshd", return_lse=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse, rlse, atol=1e-5, rtol=1e-5)
