"""CUDA tensors through the triton backend (GPU machines only)."""
import pytest
import torch
import torch.nn.functional as F

import anyattn.torch as at
from anyattn import Causal

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.fixture(autouse=True)
def _cuda_backend():
    with at.use_backend(None):   # automatic: triton for CUDA tensors
        yield


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_sdpa_on_cuda(dtype, tol, causal):
    q = torch.randn(2, 8, 300, 64, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(2, 2, 300, 64, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(2, 2, 300, 64, device="cuda", dtype=dtype, requires_grad=True)
    out = at.attention(q, k, v, mask=Causal() if causal else None)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=causal, enable_gqa=True)
    want = torch.autograd.grad(ref, (q64, k64, v64), g.double())
    for a, b in zip((out, *got), (ref, *want)):
        err = float((a.double() - b).abs().max() / b.abs().max())
        assert err < tol


def test_compile_on_cuda():
    def f(q, k, v):
        return at.attention(q, k, v, mask=Causal())

    q = torch.randn(1, 4, 128, 64, device="cuda", requires_grad=True)
    out = torch.compile(f, fullgraph=True)(q, q, q)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()
