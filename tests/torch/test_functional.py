"""anyattn.torch.attention: values and gradients against torch SDPA and the float64 reference."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import anyattn
import anyattn.torch as at
from anyattn import Causal, Documents, KeepMask, Window
from helpers import TOL, rel_err


def _qkv(B=2, Hq=4, Hkv=2, Sq=37, Sk=45, D=24, dtype=torch.float32, grad=True, Dv=None):
    q = torch.randn(B, Hq, Sq, D, dtype=dtype)
    k = torch.randn(B, Hkv, Sk, D, dtype=dtype)
    v = torch.randn(B, Hkv, Sk, D if Dv is None else Dv, dtype=dtype)
    return [x.requires_grad_(grad) for x in (q, k, v)]


def _grads(out, inputs, g):
    return torch.autograd.grad(out, inputs, g)


def _ref(q, k, v, dout, mask=None, bias=None, wrt=("q", "k", "v")):
    out, _ = anyattn.reference.forward(q.detach(), k.detach(), v.detach(), mask=mask,
                                       bias=None if bias is None else bias.detach())
    g = anyattn.reference.backward(q.detach(), k.detach(), v.detach(), dout, mask=mask,
                                   bias=None if bias is None else bias.detach(), wrt=wrt)
    return out, g


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("gqa", [False, True])
def test_matches_torch_sdpa_fp32(causal, gqa):
    q, k, v = _qkv(Hkv=2 if gqa else 4, Sq=45)
    out = at.attention(q, k, v, mask=Causal() if causal else None)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    g = torch.randn_like(out)
    for got, want, name in zip(_grads(out, (q, k, v), g), _grads(ref, (q, k, v), g), "qkv"):
        assert rel_err(got, want.detach().numpy()) < 1e-5, name
    assert rel_err(out, ref.detach().numpy()) < 1e-5


@pytest.mark.parametrize("Dv", [None, 40], ids=["D", "Dv40"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_on_cpu(dtype, Dv):
    """CPU half precision (fp32 accumulation); compare with the fp64 oracle and torch
    (also with a value head dim of its own)."""
    if at.functional._default_backend == "reference":
        pytest.skip("the reference computes in float64: nothing to learn about half precision")
    q, k, v = _qkv(dtype=dtype, Dv=Dv)
    out = at.attention(q, k, v, mask=Causal())
    assert out.dtype == dtype
    g = torch.randn_like(out)
    dq, dk, dv = _grads(out, (q, k, v), g)
    ro, rg = _ref(q, k, v, g, mask=Causal())
    tol = TOL[str(dtype).replace("torch.", "")]
    assert rel_err(out, ro) < tol
    for got, want, name in ((dq, rg.dq, "dq"), (dk, rg.dk, "dk"), (dv, rg.dv, "dv")):
        assert got.dtype == dtype
        assert rel_err(got, want) < tol, name
    # and against torch's own bf16/fp16 SDPA, within the same budget
    sd = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert rel_err(out.float(), sd.detach().float().numpy()) < 2 * tol


MASKS = {
    "window": lambda B, Sq, Sk: Causal() & Window(left=7),
    "bottom_right": lambda B, Sq, Sk: Causal("bottom_right"),
    "documents": lambda B, Sq, Sk: Documents(torch.arange(Sq) // 10, torch.arange(Sk) // 12),
    "documents_np": lambda B, Sq, Sk: Documents(np.arange(Sq) // 10, np.arange(Sk) // 12),
    "keep": lambda B, Sq, Sk: KeepMask(torch.rand(B, 1, Sq, Sk) > 0.3),
    "two_documents": lambda B, Sq, Sk: (Documents(torch.arange(Sq) // 10, torch.arange(Sk) // 12)
                                        & Documents(torch.arange(Sq) % 3, torch.arange(Sk) % 3)),
    "causal_keep_docs": lambda B, Sq, Sk: (Causal() & KeepMask(torch.rand(Sq, Sk) > 0.2)
                                           & Documents(torch.arange(B * Sq).view(B, Sq) // 9,
                                                       torch.arange(B * Sk).view(B, Sk) // 11)),
}


@pytest.mark.parametrize("name", sorted(MASKS))
def test_masks_against_reference(name):
    q, k, v = _qkv()
    mask = MASKS[name](2, q.shape[2], k.shape[2])
    out = at.attention(q, k, v, mask=mask)
    g = torch.randn_like(out)
    dq, dk, dv = _grads(out, (q, k, v), g)
    ro, rg = _ref(q, k, v, g, mask=mask)
    assert rel_err(out, ro) < TOL["float32"]
    for got, want, n in ((dq, rg.dq, "dq"), (dk, rg.dk, "dk"), (dv, rg.dv, "dv")):
        assert rel_err(got, want) < TOL["float32"], n


@pytest.mark.parametrize("shape", [(2, 4, 37, 45), (1, 4, 1, 45), (37, 45)])
def test_bias_and_its_gradient(shape):
    q, k, v = _qkv()
    bias = torch.randn(*shape, requires_grad=True)
    out = at.attention(q, k, v, bias=bias, mask=Causal("bottom_right"))
    g = torch.randn_like(out)
    dq, dk, dv, db = _grads(out, (q, k, v, bias), g)
    assert db.shape == bias.shape
    ro, rg = _ref(q, k, v, g, mask=Causal("bottom_right"), bias=bias,
                  wrt=("q", "k", "v", "bias"))
    for got, want, n in ((out, ro, "out"), (dq, rg.dq, "dq"), (dk, rg.dk, "dk"),
                         (dv, rg.dv, "dv"), (db, rg.dbias, "dbias")):
        assert rel_err(got, want) < TOL["float32"], n


def test_only_requested_gradients():
    q, k, v = _qkv()
    k.requires_grad_(False)
    out = at.attention(q, k, v)
    out.sum().backward()
    assert q.grad is not None and v.grad is not None and k.grad is None


def test_bshd_layout_and_strided_inputs():
    B, S, H, D = 2, 33, 4, 16
    qkv = torch.randn(B, S, 3, H, D, requires_grad=True)  # packed QKV
    q, k, v = qkv.unbind(2)                                # [B, S, H, D], strided views
    out = at.attention(q, k, v, mask=Causal(), layout="bshd")
    assert out.shape == (B, S, H, D)
    ref = F.scaled_dot_product_attention(*(x.transpose(1, 2) for x in (q, k, v)),
                                         is_causal=True).transpose(1, 2)
    g = torch.randn_like(out)
    (ga,) = torch.autograd.grad(out, qkv, g)
    (gb,) = torch.autograd.grad(ref, qkv, g)
    assert rel_err(out, ref.detach().numpy()) < 1e-5
    assert rel_err(ga, gb.numpy()) < 1e-5


def test_empty_rows_give_zero_and_zero_gradients():
    q, k, v = _qkv(Sq=8, Sk=8)
    keep = torch.ones(8, 8, dtype=torch.bool)
    keep[3] = False
    out = at.attention(q, k, v, mask=KeepMask(keep))
    assert torch.all(out[:, :, 3] == 0)
    out.sum().backward()
    assert torch.all(q.grad[:, :, 3] == 0)
    assert not any(torch.isnan(x.grad).any() for x in (q, k, v))


def test_return_lse():
    q, k, v = _qkv(grad=False)
    out, lse = at.attention(q, k, v, return_lse=True)
    s = torch.einsum("bhid,bhjd->bhij", q, k.repeat_interleave(2, 1)) * q.shape[-1] ** -0.5
    assert torch.allclose(lse, torch.logsumexp(s, -1), atol=1e-5)
    assert lse.dtype == torch.float32


def test_gradcheck_float64():
    q, k, v = _qkv(B=1, Hq=2, Hkv=1, Sq=6, Sk=7, D=5, dtype=torch.float64)
    bias = torch.randn(1, 2, 6, 7, dtype=torch.float64, requires_grad=True)

    def f(q, k, v, bias):
        return at.attention(q, k, v, bias=bias, mask=Causal("bottom_right") & Window(left=3))

    assert torch.autograd.gradcheck(f, (q, k, v, bias))
    assert torch.autograd.gradcheck(lambda q, k, v: at.attention(q, k, v, mask=Documents(
        torch.tensor([0, 0, 1, 1, 1, 2]), torch.tensor([0, 0, 0, 1, 1, 2, 2]))), (q, k, v))


def test_no_grad_and_inference_mode():
    q, k, v = _qkv()
    with torch.no_grad():
        a = at.attention(q, k, v)
    with torch.inference_mode():
        b = at.attention(q.detach(), k.detach(), v.detach())
    assert not a.requires_grad and torch.equal(a, b)
