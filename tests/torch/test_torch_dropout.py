"""anyattn.torch with dropout: the shared mask from torch's seed, saved for the backward;
gradients against the reference applying anyattn.dropout_mask; opcheck; compile."""
import numpy as np
import pytest
import torch

import anyattn.torch as at
import anyattn.torch.ops  # noqa: F401  (registers torch.ops.anyattn.*)
from anyattn import Causal
from anyattn import reference as R

BACKENDS = ["reference", "numpy"]


def _case(dtype, seed=0, B=2, Hq=4, Hkv=2, Sq=7, Sk=9, D=8):
    g = torch.Generator().manual_seed(seed)
    mk = (lambda *s: torch.randn(*s, generator=g, dtype=dtype).requires_grad_())
    return mk(B, Hq, Sq, D), mk(B, Hkv, Sk, D), mk(B, Hkv, Sk, D), \
        torch.randn(B, Hq, Sq, D, generator=g, dtype=dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_autograd_matches_the_reference_with_the_same_seed(backend, dtype):
    q, k, v, g = _case(dtype)
    kw = dict(mask=Causal(align="bottom_right"), dropout_p=0.3, dropout_seed=2 ** 40 + 3,
              q_offset=4, k_offset=2)
    out = at.attention(q, k, v, backend=backend, softcap=3.0, **kw)
    out.backward(g)
    n = (lambda x: x.detach().double().numpy())
    ro, _ = R.forward(n(q), n(k), n(v), softcap=3.0, **kw)
    rg = R.backward(n(q), n(k), n(v), n(g), softcap=3.0, **kw)
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(n(out), ro, **tol)
    for name, x in (("dq", q), ("dk", k), ("dv", v)):
        np.testing.assert_allclose(n(x.grad), getattr(rg, name), err_msg=name, **tol)


@pytest.mark.parametrize("backend", BACKENDS)
def test_seed_comes_from_torch_and_is_saved_for_the_backward(backend):
    """torch.manual_seed reproduces out and grads; a second call draws a new mask; the
    backward uses the forward's mask even if torch's generator moved on in between."""
    q, k, v, g = _case(torch.float64)

    def run(reseed):
        for x in (q, k, v):
            x.grad = None
        if reseed:
            torch.manual_seed(11)
        out = at.attention(q, k, v, dropout_p=0.4, backend=backend)
        torch.rand(100)                               # the generator moves on
        out.backward(g)
        return out.detach(), [x.grad.clone() for x in (q, k, v)]

    a, ga = run(True)
    b, gb = run(True)
    c, _ = run(False)
    assert torch.equal(a, b) and all(torch.equal(x, y) for x, y in zip(ga, gb))
    assert not torch.equal(a, c)
    gen = torch.Generator().manual_seed(5)
    d = at.attention(q, k, v, dropout_p=0.4, backend=backend, generator=gen)
    gen2 = torch.Generator().manual_seed(5)
    e = at.attention(q, k, v, dropout_p=0.4, backend=backend, generator=gen2)
    assert torch.equal(d, e)


def test_opcheck_with_dropout():
    q, k, v, _ = _case(torch.float64, 1)
    seed = torch.tensor([123], dtype=torch.int64)
    args = (q, k, v, None, None, None, None, None, 0, 0.3, "reference", None, 0, 0, None,
            None, None, 0.25, seed)
    torch.library.opcheck(torch.ops.anyattn.attention_fwd.default, args)


def test_compile_fullgraph_with_dropout():
    torch._dynamo.reset()
    q, k, v, g = _case(torch.float64, 2)

    def f(q, k, v):
        return at.attention(q, k, v, mask=Causal(), dropout_p=0.2, backend="reference")

    out = torch.compile(f, fullgraph=True)(q, k, v)
    out.backward(g)
    assert torch.isfinite(out).all() and q.grad is not None
    # the mask is anyattn's: zeros where dropout_mask drops every kept key is rare, but
    # out must differ from the undropped result
    assert not torch.allclose(out, at.attention(q, k, v, mask=Causal(), backend="reference"))


def test_bad_dropout_refused():
    q = torch.zeros(1, 2, 3, 8)
    with pytest.raises(ValueError, match="dropout_p"):
        at.attention(q, q, q, dropout_p=1.0)
    with pytest.raises(TypeError, match="generator"):
        at.attention(q, q, q, dropout_p=0.1, generator=3)
    with pytest.raises(ValueError, match="dropout_seed"):
        at.attention(q, q, q, dropout_p=0.1, dropout_seed=2 ** 63)
