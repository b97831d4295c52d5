"""torch.library.opcheck on both custom ops (schema, fake impl, autograd registration, AOT)."""
import pytest
import torch

import anyattn.torch.ops  # noqa: F401  (registers torch.ops.anyattn.*)
from anyattn.torch import functional


def _backend():
    return functional._default_backend


def _fwd_cases():
    torch.manual_seed(0)
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 9, 11, 8
    q = torch.randn(B, Hq, Sq, D, requires_grad=True)
    k = torch.randn(B, Hkv, Sk, D, requires_grad=True)
    v = torch.randn(B, Hkv, Sk, D, requires_grad=True)
    bias = torch.randn(1, Hq, Sq, Sk, requires_grad=True)
    keep = torch.rand(B, 1, Sq, Sk) > 0.2
    qi, ki = (torch.arange(Sq) // 4)[None], (torch.arange(Sk) // 5)[None]
    sc = D ** -0.5
    return {
        "plain": (q, k, v, None, None, None, None, None, None, sc, _backend(), None),
        "causal": (q, k, v, None, None, None, None, None, 0, sc, _backend(), None),
        "window_bias": (q, k, v, bias, None, None, None, -3, 0, 0.3, _backend(), None),
        "keep_docs": (q, k, v, None, keep, qi, ki, None, 2, sc, _backend(), "highest"),
        # a value head dim of its own (5 != 8): out [B, Hq, Sq, 5] (the fake impl too)
        "value_dim": (q, k, torch.randn(B, Hkv, Sk, 5, requires_grad=True), bias, None, None,
                      None, None, 0, sc, _backend(), None),
        "no_grad": tuple(x.detach() if isinstance(x, torch.Tensor) else x
                         for x in (q, k, v, None, None, None, None, None, None, sc,
                                   _backend(), None)),
    }


@pytest.mark.parametrize("case", sorted(_fwd_cases()))
def test_opcheck_forward(case):
    args = _fwd_cases()[case]
    torch.library.opcheck(torch.ops.anyattn.attention_fwd.default, args)


@pytest.mark.parametrize("case", ["window_bias", "value_dim"])
@pytest.mark.parametrize("grads", [(True, True, True, False), (True, False, False, False),
                                   (False, True, True, True)])
def test_opcheck_backward(grads, case):
    q, k, v, bias, keep, qi, ki, lo, hi, sc, be, pr = _fwd_cases()[case]
    q, k, v, bias = (x.detach() for x in (q, k, v, bias))
    out, row_max, log_norm = torch.ops.anyattn.attention_fwd(q, k, v, bias, keep, qi, ki, lo,
                                                             hi, sc, be, pr)
    dout = torch.randn_like(out)
    args = (dout, q, k, v, out, row_max, log_norm, bias, keep, qi, ki, lo, hi, sc, be, pr,
            *grads)
    torch.library.opcheck(torch.ops.anyattn.attention_bwd.default, args)


def test_registered_autograd_matches_the_eager_fast_path():
    """Eager calls go through an autograd.Function; tracing uses register_autograd: same grads."""
    from anyattn.torch.ops import attention_with_grad

    args = _fwd_cases()["window_bias"]
    q, k, v, bias = args[:4]
    g = torch.randn(q.shape)
    via_op = torch.autograd.grad(torch.ops.anyattn.attention_fwd(*args)[0], (q, k, v, bias), g)
    via_fn = torch.autograd.grad(attention_with_grad(*args)[0], (q, k, v, bias), g)
    for a, b in zip(via_op, via_fn):
        assert torch.equal(a, b)


def test_outputs_never_alias_when_a_backend_returns_views_of_one_buffer(monkeypatch):
    """The Triton kernels return the row max and log-normaliser as two views of one
    [2, B, H, Sq] buffer; a custom op's outputs may not alias, so the op separates them
    (found on the H200: anyattn.torch on CUDA raised torch's aliasing error)."""
    from anyattn import api
    from anyattn.rowstats import RowStats
    from anyattn.torch import ops

    real = api.forward_with_stats

    def views(*a, **kw):
        out, st = real(*a, **kw)
        both = torch.stack([st.max, st.log_norm])          # one buffer, two views
        return out, RowStats(both[0], both[1])

    monkeypatch.setattr(ops.api, "forward_with_stats", views)
    q = torch.randn(1, 2, 5, 8, requires_grad=True)
    out, row_max, log_norm = ops.attention_fwd(q, q, q, None, None, None, None, None, None,
                                               0.3, None, None)
    assert row_max.untyped_storage().data_ptr() != log_norm.untyped_storage().data_ptr()
    at_out = functional.attention(q, q, q)
    at_out.sum().backward()
    assert torch.isfinite(q.grad).all()
