"""torch.compile(fullgraph=True): a two-layer model and the SDPA drop-in, no graph break."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import anyattn.torch as at
from anyattn import Causal, Documents


class Block(nn.Module):
    def __init__(self, d=32, h=4, hkv=2, mask_kind="causal"):
        super().__init__()
        self.h, self.hkv, self.dh, self.kind = h, hkv, d // h, mask_kind
        self.q = nn.Linear(d, d)
        self.kv = nn.Linear(d, 2 * hkv * self.dh)
        self.o = nn.Linear(d, d)

    def forward(self, x, doc_ids=None):
        B, S, _ = x.shape
        q = self.q(x).view(B, S, self.h, self.dh)
        k, v = self.kv(x).view(B, S, 2, self.hkv, self.dh).unbind(2)
        mask = Causal() if doc_ids is None else Causal() & Documents(doc_ids)
        y = at.attention(q, k, v, mask=mask, layout="bshd")
        return x + self.o(y.reshape(B, S, -1))


class TwoLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = Block(), Block()

    def forward(self, x, doc_ids=None):
        return self.b(self.a(x, doc_ids), doc_ids)


def _run(model, x, *extra):
    model.zero_grad()
    out = model(x, *extra)
    out.square().mean().backward()
    return out.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("docs", [False, True])
def test_two_layer_model_compiles_fullgraph(docs):
    torch._dynamo.reset()
    model = TwoLayer()
    x = torch.randn(2, 24, 32)
    extra = (torch.arange(2 * 24).view(2, 24) // 7,) if docs else ()
    ref_out, ref_grads = _run(model, x, *extra)
    compiled = torch.compile(model, fullgraph=True)
    out, grads = _run(compiled, x, *extra)
    assert torch.allclose(out, ref_out, atol=1e-5)
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g, r, atol=1e-5, rtol=1e-4)


def test_sdpa_drop_in_compiles_fullgraph():
    torch._dynamo.reset()

    def f(q, k, v, m):
        return at.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)

    q, k, v = torch.randn(2, 4, 16, 8), torch.randn(2, 2, 16, 8), torch.randn(2, 2, 16, 8)
    m = torch.rand(16, 16) > 0.3
    got = torch.compile(f, fullgraph=True)(q, k, v, m)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=m, enable_gqa=True)
    assert torch.allclose(got, want, atol=1e-5)


def test_value_head_dim_compiles_fullgraph():
    """v with a head dim of its own (MLA): the fake implementations give out
    [B, Hq, Sq, Dv] and dv of v's shape; compiled equals eager, both calls of the op."""
    torch._dynamo.reset()

    def f(q, k, v):
        return at.attention(q, k, v, mask=Causal()).square().sum()

    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 12, 24, generator=g, requires_grad=True)
    k = torch.randn(2, 2, 12, 24, generator=g, requires_grad=True)
    v = torch.randn(2, 2, 12, 16, generator=g, requires_grad=True)
    want = torch.autograd.grad(f(q, k, v), (q, k, v))
    got = torch.autograd.grad(torch.compile(f, fullgraph=True)(q, k, v), (q, k, v))
    for a, b in zip(got, want):
        assert a.shape == b.shape and torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_dynamic_shapes_bottom_right_band():
    """With dynamic shapes the band offset Sk - Sq is a SymInt argument of the op."""
    torch._dynamo.reset()

    def f(q, k, v):
        return at.attention(q, k, v, mask=Causal("bottom_right"))

    cf = torch.compile(f, fullgraph=True, dynamic=True)
    for sq, sk in ((5, 9), (7, 12)):
        q = torch.randn(1, 2, sq, 8, requires_grad=True)
        k, v = torch.randn(1, 2, sk, 8), torch.randn(1, 2, sk, 8)
        got = cf(q, k, v)
        want = f(q, k, v)
        assert torch.allclose(got, want, atol=1e-6)
        (g1,) = torch.autograd.grad(got.sum(), q)
        (g2,) = torch.autograd.grad(want.sum(), q)
        assert torch.allclose(g1, g2, atol=1e-5)


def test_every_term_kind_folds_inside_fullgraph_like_the_core():
    """The core's lowering (anyattn.masks.lower over torch ops) traces without a graph
    break for every term kind together, a second Documents term and two keep arrays
    included, and gives the bits of the eager call, which folds with NumPy."""
    from anyattn import KeepMask, Window

    torch._dynamo.reset()
    ids = torch.arange(20) // 6
    k1 = torch.rand(20, 20, generator=torch.Generator().manual_seed(0)) > 0.2
    k2 = torch.rand(1, 1, 1, 20, generator=torch.Generator().manual_seed(1)) > 0.1

    def f(q, k, v, ids, k1, k2):
        mask = (Causal() & Window(left=9) & Documents(ids) & Documents(ids % 2)
                & KeepMask(k1) & KeepMask(k2))
        return at.attention(q, k, v, mask=mask, q_offset=3, k_offset=1)

    q = torch.randn(1, 2, 20, 8, requires_grad=True)
    k, v = torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    got = torch.compile(f, fullgraph=True)(q, k, v, ids, k1, k2)
    want = f(q, k, v, ids, k1, k2)
    assert torch.equal(got, want)
    (g1,) = torch.autograd.grad(got.sum(), q)
    (g2,) = torch.autograd.grad(want.sum(), q)
    assert torch.allclose(g1, g2, atol=1e-6)
