"""The SDPA drop-in: torch's semantics, and errors where torch raises."""
import pytest
import torch
import torch.nn.functional as F

import anyattn.torch as at
from anyattn.torch import scaled_dot_product_attention as sdpa


def _close(a, b, tol=1e-5):
    a, b = a.detach(), b.detach()
    scale = b.abs().max().clamp_min(1e-30)
    return float((a - b).abs().max() / scale) <= tol


def _inputs(qs=(2, 4, 9, 8), ks=(2, 4, 11, 8), grad=True):
    q, k, v = torch.randn(qs), torch.randn(ks), torch.randn(ks)
    return [x.requires_grad_(grad) for x in (q, k, v)]


CASES = {
    "plain": dict(),
    "causal": dict(is_causal=True),
    "scale": dict(scale=0.37),
    "bool_mask": dict(attn_mask="bool"),
    "float_mask": dict(attn_mask="float"),
}


def _mask(kind, L=9, S=11):
    if kind == "bool":
        return torch.rand(1, 4, L, S) > 0.3
    if kind == "float":
        return torch.randn(L, S)
    return None


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_torch(case):
    kw = dict(CASES[case])
    kw["attn_mask"] = _mask(kw.get("attn_mask"))
    q, k, v = _inputs()
    got, want = sdpa(q, k, v, **kw), F.scaled_dot_product_attention(q, k, v, **kw)
    assert _close(got, want)
    g = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), g),
                    torch.autograd.grad(want, (q, k, v), g)):
        assert _close(a, b)


def test_float_mask_gradient():
    q, k, v = _inputs()
    m = torch.randn(2, 1, 9, 11, requires_grad=True)
    got, want = sdpa(q, k, v, attn_mask=m), F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    (ga,) = torch.autograd.grad(got.sum(), m)
    (gb,) = torch.autograd.grad(want.sum(), m)
    assert _close(ga, gb)


@pytest.mark.parametrize("shapes", [((2, 4, 9, 8), (2, 2, 11, 8)), ((2, 4, 9, 8), (2, 1, 11, 8))])
def test_gqa(shapes):
    q, k, v = _inputs(*shapes)
    got = sdpa(q, k, v, enable_gqa=True, is_causal=True)
    want = F.scaled_dot_product_attention(q, k, v, enable_gqa=True, is_causal=True)
    assert _close(got, want)


@pytest.mark.parametrize("shapes", [
    ((9, 8), (11, 8)),                        # [L, E]
    ((4, 9, 8), (4, 11, 8)),                  # [H, L, E]
    ((3, 2, 4, 9, 8), (3, 2, 4, 11, 8)),      # two batch dims
    ((2, 4, 9, 8), (1, 4, 11, 8)),            # key/value batch broadcast
])
def test_other_ranks_and_broadcast(shapes):
    q, k, v = _inputs(*shapes)
    m = torch.rand(9, 11) > 0.2
    got = sdpa(q, k, v, attn_mask=m)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=m)
    assert got.shape == want.shape and _close(got, want)
    g = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), g),
                    torch.autograd.grad(want, (q, k, v), g)):
        assert _close(a, b)


def test_fully_masked_row_is_zero_like_torch_cpu():
    q, k, v = _inputs(grad=False)
    m = torch.ones(9, 11, dtype=torch.bool)
    m[2] = False
    got = sdpa(q, k, v, attn_mask=m)
    assert torch.all(got[:, :, 2] == 0)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=m)  # torch 2.13 CPU: 0 as well
    assert torch.allclose(got.nan_to_num(), want.nan_to_num(), atol=1e-5)


q0, k0, v0 = torch.randn(2, 4, 9, 8), torch.randn(2, 4, 11, 8), torch.randn(2, 4, 11, 8)
bmask = torch.rand(9, 11, generator=torch.Generator().manual_seed(1)) > 0.3
#: case -> (the argument our message names, the call)
BAD = {
    "mixed_dtype": ("query", lambda f: f(q0, k0.double(), v0)),
    "integer_inputs": ("query", lambda f: f(q0.int(), k0.int(), v0.int())),
    "int_mask": ("attn_mask", lambda f: f(q0, k0, v0,
                                          attn_mask=torch.ones(9, 11, dtype=torch.int32))),
    "float64_mask": ("attn_mask", lambda f: f(q0, k0, v0, attn_mask=torch.ones(
        9, 11, dtype=torch.float64))),
    "mask_shape": ("attn_mask", lambda f: f(q0, k0, v0,
                                            attn_mask=torch.ones(9, 9, dtype=torch.bool))),
    "mask_batch": ("attn_mask", lambda f: f(q0, k0, v0, attn_mask=torch.ones(
        3, 1, 9, 11, dtype=torch.bool))),
    "mask_5d": ("attn_mask", lambda f: f(q0, k0, v0, attn_mask=torch.ones(
        1, 1, 1, 9, 11, dtype=torch.bool))),
    "mask_not_a_tensor": ("attn_mask", lambda f: f(q0, k0, v0, attn_mask=bmask.numpy())),
    "heads_without_gqa": ("key", lambda f: f(q0, k0[:, :2], v0[:, :2])),
    "value_heads_differ": ("value", lambda f: f(q0, k0, v0[:, :2])),
    "gqa_not_a_divisor": ("key", lambda f: f(q0, k0[:, :3], v0[:, :3], enable_gqa=True)),
    "head_dim": ("key", lambda f: f(q0, k0[..., :4], v0[..., :4])),
    "one_dim_inputs": ("query", lambda f: f(q0[0, 0, 0], k0[0, 0, 0], v0[0, 0, 0])),
    "scale_type": ("scale", lambda f: f(q0, k0, v0, scale="a")),
    "scale_positional": ("scale", lambda f: f(q0, k0, v0, None, 0.0, False, 0.5)),
    "dropout_type": ("dropout_p", lambda f: f(q0, k0, v0, dropout_p="0.1")),
    "dropout_above_one": ("dropout_p", lambda f: f(q0, k0, v0, dropout_p=1.5)),
    "dropout_inf": ("dropout_p", lambda f: f(q0, k0, v0, dropout_p=float("inf"))),
    "is_causal_type": ("is_causal", lambda f: f(q0, k0, v0, is_causal=1)),
    "enable_gqa_type": ("enable_gqa", lambda f: f(q0, k0, v0, enable_gqa=None)),
    # torch raises for these with every kernel but its 4-D CPU one (next test)
    "mask_and_causal_3d": ("attn_mask", lambda f: f(q0[0], k0[0], v0[0], attn_mask=bmask,
                                                    is_causal=True)),
    "float_mask_and_causal_2d": ("attn_mask", lambda f: f(
        q0[0, 0], k0[0, 0], v0[0, 0], attn_mask=torch.zeros(9, 11), is_causal=True)),
    "mask_and_causal_dropout": ("attn_mask", lambda f: f(q0, k0, v0, attn_mask=bmask,
                                                         is_causal=True, dropout_p=0.1)),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_raises_where_torch_raises(case):
    name, call = BAD[case]
    with pytest.raises(Exception) as torch_err:
        call(F.scaled_dot_product_attention)
    with pytest.raises(type(torch_err.value)) as ours:
        call(sdpa)
    msg = str(ours.value)
    # our message names the argument (keyword-only scale: Python's own message, as torch's)
    assert name in msg or (case == "scale_positional" and "positional" in msg), msg


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
def test_mask_with_is_causal_raises_like_torchs_math_kernel(mask_kind):
    """attn_mask with is_causal=True was accepted (keeping the pairs both keep); torch
    documents an error, and raises it from its math kernel (its 4-D CPU kernel alone
    accepts the pair).  Ours: a RuntimeError (and ValueError) naming attn_mask."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    m = bmask if mask_kind == "bool" else torch.randn(9, 11)
    with sdpa_kernel(SDPBackend.MATH), pytest.raises(RuntimeError, match="is_causal=True"):
        F.scaled_dot_product_attention(q0, k0, v0, attn_mask=m, is_causal=True)
    with pytest.raises(RuntimeError, match=r"attn_mask: must be None when is_causal=True"):
        sdpa(q0, k0, v0, attn_mask=m, is_causal=True)
    with pytest.raises(ValueError, match="attn_mask"):
        sdpa(q0, k0, v0, attn_mask=m, is_causal=True)


def test_numpy_scalars_are_taken_like_torch():
    """np.float32 / np.int64 scale or dropout_p were refused; torch takes them."""
    import numpy as np

    want = F.scaled_dot_product_attention(q0, k0, v0, scale=0.5)
    for scale in (np.float32(0.5), np.float64(0.5)):
        assert _close(sdpa(q0, k0, v0, scale=scale), want)
    assert _close(sdpa(q0, k0, v0, scale=np.int64(1)),
                  F.scaled_dot_product_attention(q0, k0, v0, scale=1.0))
    torch.manual_seed(4)
    a = sdpa(q0, k0, v0, dropout_p=np.float32(0.25))
    torch.manual_seed(4)
    assert torch.equal(a, sdpa(q0, k0, v0, dropout_p=float(np.float32(0.25))))


def test_key_value_length_mismatch_raises():
    """torch's math kernel raises; its flash CPU kernel silently accepts.  We raise."""
    with pytest.raises(RuntimeError, match="value"):
        sdpa(q0, k0, v0[:, :, :5])


def test_dropout_draws_the_shared_mask_from_torchs_seed():
    """dropout_p > 0: anyattn.dropout_mask with a seed drawn from torch's generator, so
    torch.manual_seed reproduces the call; p >= 1 is refused."""
    import anyattn
    from anyattn import reference as R

    q, k, v = (x.double() for x in (q0, k0, v0))
    with at.use_backend("reference"):
        torch.manual_seed(3)
        a = sdpa(q, k, v, dropout_p=0.25, is_causal=True)
        torch.manual_seed(3)
        b = sdpa(q, k, v, dropout_p=0.25, is_causal=True)
        torch.manual_seed(3)
        seed = int(torch.randint(0, 2 ** 63 - 1, (1,), dtype=torch.int64)[0])
    assert torch.equal(a, b)
    want, _ = R.forward(q.numpy(), k.numpy(), v.numpy(), mask=anyattn.Causal(),
                        dropout_p=0.25, dropout_seed=seed)
    torch.testing.assert_close(a, torch.from_numpy(want), rtol=1e-12, atol=1e-12)
    with pytest.raises(ValueError, match="dropout_p"):
        sdpa(q0, k0, v0, dropout_p=1.0)


@pytest.mark.parametrize("e,ev", [(12, 8), (8, 12), (5, 3)])
@pytest.mark.parametrize("case", ["plain", "causal", "bool_mask", "gqa"])
def test_value_head_dim_differs_like_torch(case, e, ev):
    """value [*, S, Ev] with Ev != E gives [*, L, Ev], as torch's SDPA: forward and every
    gradient (scale 1/sqrt(E) by default); a 3-D batchless call too."""
    torch.manual_seed(5)
    hkv = 2 if case == "gqa" else 4
    q = torch.randn(2, 4, 9, e, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, hkv, 11, e, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, hkv, 11, ev, dtype=torch.float64, requires_grad=True)
    kw = dict(is_causal=case == "causal", enable_gqa=case == "gqa")
    if case == "bool_mask":
        kw["attn_mask"] = _mask("bool")
    got, want = sdpa(q, k, v, **kw), F.scaled_dot_product_attention(q, k, v, **kw)
    assert got.shape == want.shape == (2, 4, 9, ev)
    assert _close(got, want, 1e-12)
    g = torch.randn_like(got)
    for a, b in zip(torch.autograd.grad(got, (q, k, v), g),
                    torch.autograd.grad(want, (q, k, v), g)):
        assert a.shape == b.shape and _close(a, b, 1e-12)
    if case == "gqa":
        return
    got3 = sdpa(q[0], k[0], v[0], is_causal=True)
    want3 = F.scaled_dot_product_attention(q[0], k[0], v[0], is_causal=True)
    assert got3.shape == (4, 9, ev) and _close(got3, want3, 1e-12)
