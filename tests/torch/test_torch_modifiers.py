"""anyattn.torch with score modifiers: autograd (sinks get their gradient), both custom
ops under opcheck, torch.compile(fullgraph=True), and early refusals."""
import numpy as np
import pytest
import torch
import torch.nn as nn

import anyattn.torch as at
import anyattn.torch.ops  # noqa: F401  (registers torch.ops.anyattn.*)
from anyattn import Causal, Window
from anyattn import reference as R

BACKENDS = ["reference", "numpy"]


def _t(x):
    """[B, S, H, D] torch -> [B, H, S, D] float64 numpy."""
    return x.detach().transpose(1, 2).double().numpy()


def _case(dtype, seed=0, B=2, Hq=4, Hkv=2, Sq=7, Sk=9, D=8):
    g = torch.Generator().manual_seed(seed)
    mk = (lambda *s: torch.randn(*s, generator=g, dtype=dtype).requires_grad_())
    q, k, v = mk(B, Sq, Hq, D), mk(B, Sk, Hkv, D), mk(B, Sk, Hkv, D)
    sinks = mk(Hq)
    slopes = torch.rand(B, Hq, generator=g, dtype=dtype)
    return q, k, v, sinks, slopes, torch.randn(B, Sq, Hq, D, generator=g, dtype=dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_autograd_matches_the_reference(backend, dtype):
    q, k, v, sinks, slopes, g = _case(dtype)
    mask = Causal(align="bottom_right") & Window(left=3)
    kw = dict(softcap=2.5, q_offset=2, k_offset=1)
    out, lse = at.attention(q, k, v, mask=mask, layout="bshd", alibi_slopes=slopes,
                            sinks=sinks, backend=backend, return_lse=True, **kw)
    out.backward(g)
    rkw = dict(kw, mask=mask, alibi_slopes=slopes.double().numpy(),
               sinks=sinks.detach().double().numpy())
    ro, rl = R.forward(_t(q), _t(k), _t(v), **rkw)
    rg = R.backward(_t(q), _t(k), _t(v), _t(g), wrt=("q", "k", "v", "sinks"), **rkw)
    tol = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=2e-5)
    np.testing.assert_allclose(_t(out), ro, **tol)
    np.testing.assert_allclose(lse.double().numpy(), rl, **tol)
    for name, x in (("dq", q), ("dk", k), ("dv", v)):
        np.testing.assert_allclose(_t(x.grad), getattr(rg, name), err_msg=name, **tol)
    assert sinks.grad.dtype == dtype
    np.testing.assert_allclose(sinks.grad.double().numpy(), rg.dsinks, **tol)


def _op_args(**over):
    q, k, v, sinks, slopes, _ = _case(torch.float64, 1)
    q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    args = dict(q=q, k=k, v=v, bias=None, keep=None, q_ids=None, k_ids=None, band_lo=None,
                band_hi=0, scale=0.3, backend="reference", precision=None, q_offset=1,
                k_offset=0, softcap=1.7, alibi_slopes=slopes, sinks=sinks)
    args.update(over)
    return args


@pytest.mark.parametrize("mods", ["all", "sinks_only", "softcap_only"])
def test_opcheck_forward_with_modifiers(mods):
    over = {"all": {}, "sinks_only": dict(softcap=None, alibi_slopes=None),
            "softcap_only": dict(alibi_slopes=None, sinks=None)}[mods]
    args = tuple(_op_args(**over).values())
    torch.library.opcheck(torch.ops.anyattn.attention_fwd.default, args)


@pytest.mark.parametrize("grad_sinks", [True, False])
def test_opcheck_backward_with_modifiers(grad_sinks):
    a = _op_args()
    q, k, v = (a[n].detach() for n in ("q", "k", "v"))
    sinks = a["sinks"].detach()
    fwd = (q, k, v, *list(a.values())[3:15], a["alibi_slopes"], sinks)
    out, row_max, log_norm = torch.ops.anyattn.attention_fwd(*fwd)
    dout = torch.randn_like(out)
    args = (dout, q, k, v, out, row_max, log_norm, None, None, None, None, None, 0, 0.3,
            "reference", None, True, False, True, False, 1, 0, 1.7, a["alibi_slopes"], sinks,
            grad_sinks)
    torch.library.opcheck(torch.ops.anyattn.attention_bwd.default, args)


class SinkBlock(nn.Module):
    """A gpt-oss-like attention block: learnable sinks, softcap, sliding window."""

    def __init__(self, d=32, h=4, hkv=2):
        super().__init__()
        self.h, self.hkv, self.dh = h, hkv, d // h
        self.q = nn.Linear(d, d, dtype=torch.float64)
        self.kv = nn.Linear(d, 2 * hkv * self.dh, dtype=torch.float64)
        self.sinks = nn.Parameter(torch.randn(h, dtype=torch.float64))
        self.register_buffer("slopes", torch.rand(h, dtype=torch.float64))

    def forward(self, x):
        B, S, _ = x.shape
        q = self.q(x).view(B, S, self.h, self.dh)
        k, v = self.kv(x).view(B, S, 2, self.hkv, self.dh).unbind(2)
        y = at.attention(q, k, v, mask=Causal() & Window(left=5), layout="bshd", softcap=3.0,
                         alibi_slopes=self.slopes, sinks=self.sinks, backend="reference")
        return x + y.reshape(B, S, -1)


def test_compile_fullgraph_with_learnable_sinks():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = SinkBlock()
    x = torch.randn(2, 12, 32, dtype=torch.float64)

    def step(m):
        m.zero_grad()
        out = m(x)
        out.square().mean().backward()
        return out.detach(), [p.grad.clone() for p in m.parameters()]

    ref_out, ref_grads = step(model)
    out, grads = step(torch.compile(model, fullgraph=True))
    assert torch.allclose(out, ref_out, rtol=1e-12, atol=1e-13)
    assert model.sinks.grad is not None and model.sinks.grad.abs().sum() > 0
    for g, r in zip(grads, ref_grads):
        assert torch.allclose(g, r, rtol=1e-10, atol=1e-12)


def test_bad_modifiers_refused_before_any_work():
    q = torch.zeros(1, 4, 2, 8, requires_grad=True)
    with pytest.raises(ValueError, match="alibi_slopes: requires grad"):
        at.attention(q, q, q, alibi_slopes=torch.ones(4, requires_grad=True))
    with pytest.raises(ValueError, match="sinks: shape"):
        at.attention(q, q, q, sinks=torch.ones(2, 4))
    with pytest.raises(TypeError, match="sinks: expected a torch.Tensor"):
        at.attention(q, q, q, sinks=np.ones(4, np.float32))
    with pytest.raises(TypeError, match="softcap"):
        at.attention(q, q, q, softcap="2")
    with pytest.raises(ValueError, match="softcap"):
        at.attention(q, q, q, softcap=-1.0)
