"""anyattn.torch's eager path (anyattn.torch.eager: the core called directly) against the
custom-op path (torch.ops.anyattn.* with their autograd): same bits, same refusals."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import anyattn
import anyattn.torch as at
from anyattn.torch import eager, ops
from anyattn import settings


def _inputs(B=2, Hq=4, Hkv=2, Sq=13, Sk=17, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Sq, D, generator=g, requires_grad=True)
    k = torch.randn(B, Hkv, Sk, D, generator=g, requires_grad=True)
    v = torch.randn(B, Hkv, Sk, D, generator=g, requires_grad=True)
    return q, k, v, torch.randn(B, Hq, Sq, D, generator=g)


def _cases():
    B, Hq, Sq, Sk = 2, 4, 13, 17
    g = torch.Generator().manual_seed(1)
    bias = torch.randn(1, Hq, Sq, Sk, generator=g, requires_grad=True)
    keep = torch.rand(B, 1, Sq, Sk, generator=g) > 0.3
    ids_q, ids_k = (torch.arange(Sq) // 5)[None], (torch.arange(Sk) // 6)[None]
    sinks = torch.randn(Hq, generator=g, requires_grad=True)
    slopes = 2.0 ** -torch.arange(1, Hq + 1, dtype=torch.float32)
    return {
        "plain": {},
        "causal": dict(mask=anyattn.Causal()),
        "window_bias": dict(mask=anyattn.Window(left=4, right=2), bias=bias),
        "keep_docs": dict(mask=anyattn.KeepMask(keep) & anyattn.Documents(ids_q, ids_k)),
        "modifiers": dict(mask=anyattn.Causal(), softcap=5.0, alibi_slopes=slopes,
                          sinks=sinks),
        "dropout": dict(dropout_p=0.25, dropout_seed=1234),
        "offsets": dict(mask=anyattn.Causal(), q_offset=4, k_offset=0),
    }


def _via_ops(monkeypatch, fn):
    """fn() with the eager path switched off: every call goes through the custom ops."""
    with monkeypatch.context() as m:
        m.setattr(eager, "eligible", lambda *a: False)
        return fn()


def _step(q, k, v, g, kw, layout="bhsd"):
    out, lse = at.attention(q, k, v, return_lse=True, layout=layout, **kw)
    wrt = [x for x in (q, k, v, kw.get("bias"), kw.get("sinks"))
           if x is not None and x.requires_grad]
    return (out, lse) + torch.autograd.grad(out, wrt, g)


@pytest.mark.parametrize("case", sorted(_cases()))
def test_eager_path_gives_the_ops_bits(case, monkeypatch):
    q, k, v, g = _inputs()
    kw = _cases()[case]
    direct = _step(q, k, v, g, kw)
    via_ops = _via_ops(monkeypatch, lambda: _step(q, k, v, g, kw))
    assert len(direct) == len(via_ops)
    for a, b in zip(direct, via_ops):
        assert a.shape == b.shape and a.dtype == b.dtype
        assert torch.equal(a, b), case


@pytest.mark.parametrize("case", ["plain", "window_bias", "modifiers", "dropout"])
def test_eager_path_value_head_dim_gives_the_ops_bits(case, monkeypatch):
    """v [B, Hkv, Sk, Dv] with Dv (24) != D (16): out [B, Hq, Sq, Dv], dv of v's shape, the
    same bits on both paths and the reference's values."""
    from anyattn import reference as R

    q, k, _, _ = _inputs()
    gen = torch.Generator().manual_seed(3)
    v = torch.randn(2, 2, 17, 24, generator=gen, requires_grad=True)
    g = torch.randn(2, 4, 13, 24, generator=gen)
    kw = _cases()[case]
    direct = _step(q, k, v, g, kw)
    via_ops = _via_ops(monkeypatch, lambda: _step(q, k, v, g, kw))
    assert direct[0].shape == (2, 4, 13, 24) and direct[4].shape == v.shape
    for a, b in zip(direct, via_ops):
        assert a.shape == b.shape and torch.equal(a, b), case
    if case == "plain":
        ro, _ = R.forward(q.detach(), k.detach(), v.detach())
        rg = R.backward(q.detach(), k.detach(), v.detach(), g)
        for got, ref in zip((direct[0],) + direct[2:5], (ro, rg.dq, rg.dk, rg.dv)):
            torch.testing.assert_close(got, torch.from_numpy(ref).float(), rtol=0,
                                       atol=1e-5 * float(abs(ref).max()))


def test_eager_path_bshd_layout_and_partial_grads(monkeypatch):
    q, k, v, g = _inputs()
    qs, ks, vs = (x.detach().transpose(1, 2).requires_grad_(x is q) for x in (q, k, v))
    out = at.attention(qs, ks, vs, layout="bshd", mask=anyattn.Causal())
    (dq,) = torch.autograd.grad(out, (qs,), g.transpose(1, 2))
    out2 = _via_ops(monkeypatch, lambda: at.attention(qs, ks, vs, layout="bshd",
                                                      mask=anyattn.Causal()))
    (dq2,) = torch.autograd.grad(out2, (qs,), g.transpose(1, 2))
    assert torch.equal(out, out2) and torch.equal(dq, dq2)
    assert ks.grad is None and vs.grad is None


def test_eager_path_is_taken_and_skipped_under_a_dispatch_mode(monkeypatch):
    q, k, v, g = _inputs()
    calls = []
    real = ops.attention_fwd

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(ops, "attention_fwd", spy)
    at.attention(q, k, v)
    assert calls == []                       # the core directly, no custom op

    class Passthrough(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    with Passthrough():
        assert not eager.eligible(q, k, v)
    assert eager.eligible(q, k, v, None)


def test_no_grad_returns_plain_tensors():
    q, k, v, _ = _inputs()
    with torch.no_grad():
        out, lse = at.attention(q, k, v, return_lse=True)
    assert out.grad_fn is None and lse.grad_fn is None and not out.requires_grad


DOUBLE = r"double backward \(second-order gradients\) is not supported by anyattn"


def _double_backward_cases():
    """numpy on both paths; the interpreted Triton backend (same autograd Function) once."""
    from anyattn.backends.registry import unavailable_reason

    cases = [("numpy", path, dg) for path in ("eager", "ops") for dg in (False, True)]
    return cases + ([("triton", "eager", False)] if unavailable_reason("triton") is None
                    else [])


@pytest.mark.parametrize("backend,path,dout_grad", _double_backward_cases())
def test_double_backward_raises_ours(backend, path, dout_grad, monkeypatch):
    """A gradient of a gradient raised torch's 'element 0 of tensors does not require
    grad' (eager path, dout without grad: the first-order gradient stood for a constant)
    or 'no autograd formula was registered' (ops path); now one clear message on both
    paths, the numpy backend and the interpreted Triton one.  The first-order gradients
    are those of a plain backward."""
    q, k, v, g = _inputs(B=1, Hq=2, Hkv=1, Sq=9, Sk=11)
    g.requires_grad_(dout_grad)
    kw = dict(backend=backend, mask=anyattn.Causal())

    def run(create_graph):
        out = at.attention(q, k, v, **kw)
        return torch.autograd.grad(out, (q, k, v), g, create_graph=create_graph)

    run_path = (lambda f: _via_ops(monkeypatch, f)) if path == "ops" else (lambda f: f())
    plain = run_path(lambda: run(False))
    grads = run_path(lambda: run(True))
    for a, b in zip(grads, plain):
        assert torch.equal(a.detach(), b) and a.requires_grad
    with pytest.raises(RuntimeError, match=DOUBLE):
        torch.autograd.grad(grads[0].square().sum(), (q,))
    with pytest.raises(RuntimeError, match=DOUBLE):      # a gradient penalty
        (grads[1].square().sum() + grads[2].sum()).backward()


@pytest.mark.parametrize("path", ["eager", "ops"])
def test_gradgradcheck_raises_ours(path, monkeypatch):
    """gradgradcheck reported a Jacobian mismatch on the eager path (second-order terms
    silently 0)."""
    q, k, v = (x.detach().double()[:1, :2, :5, :4].requires_grad_() for x in _inputs()[:3])

    def check():
        return torch.autograd.gradgradcheck(lambda *a: at.attention(*a), (q, k, v))

    with pytest.raises(RuntimeError, match=DOUBLE):
        check() if path == "eager" else _via_ops(monkeypatch, check)


def test_double_backward_of_the_sdpa_drop_in_raises_ours():
    q, k, v, _ = _inputs(Hkv=4)
    out = at.scaled_dot_product_attention(q, k, v, is_causal=True)
    (dq,) = torch.autograd.grad(out.sum(), (q,), create_graph=True)
    with pytest.raises(RuntimeError, match=DOUBLE):
        dq.sum().backward()


def test_inplace_change_after_forward_is_caught():
    q, k, v, g = _inputs()
    qq = q.detach().clone().requires_grad_()
    x = qq * 1.0
    out = at.attention(x, k, v)
    with torch.no_grad():
        x.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward(g)


def test_empty_queries_give_zero_gradients():
    q, k, v, _ = _inputs(Sq=0)
    out = at.attention(q, k, v)
    assert out.shape == (2, 4, 0, 16)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert dq.shape == q.shape and not dk.any() and not dv.any()


def test_refusals_come_at_the_forward():
    q, k, v, _ = _inputs()
    slopes = torch.ones(4, requires_grad=True)
    with pytest.raises(ValueError, match="alibi_slopes: requires grad"):
        at.attention(q, k, v, alibi_slopes=slopes)
    with pytest.raises(ValueError, match="k"):
        at.attention(q, k[:, :, :, :8], v)


def test_vmap_of_the_forward_and_a_clear_refusal_under_func_grad():
    q, k, v, _ = _inputs()
    qs, ks, vs = (x.detach().unsqueeze(0).expand(3, *x.shape).clone() for x in (q, k, v))
    qs = qs + torch.randn_like(qs)
    out = torch.vmap(lambda a, b, c: at.attention(a, b, c))(qs, ks, vs)
    for i in range(3):
        assert torch.equal(out[i], at.attention(qs[i], ks[i], vs[i]).detach())
    with pytest.raises(NotImplementedError, match="torch.func transforms"):
        torch.func.grad(lambda a: at.attention(a, k.detach(), v.detach()).sum())(q.detach())


def _cache_cases():
    """name -> (input changer, keywords): each differs from the plain call in one input
    the eager path's Problem depends on."""
    g = torch.Generator().manual_seed(3)
    return {
        "plain": (None, {}),
        "causal": (None, dict(mask=anyattn.Causal())),
        "window": (None, dict(mask=anyattn.Window(left=3, right=1))),
        "bias": (None, dict(bias=torch.randn(1, 4, 13, 17, generator=g))),
        "bias_rows": (None, dict(bias=torch.randn(2, 1, 1, 17, generator=g))),
        "scale": (None, dict(scale=0.2)),
        "softcap": (None, dict(softcap=4.0)),
        "alibi": (None, dict(alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625]))),
        "sinks": (None, dict(sinks=torch.randn(4, generator=g))),
        "offsets": (None, dict(mask=anyattn.Causal(), q_offset=4)),
        "f64": (lambda x: x.double(), {}),
        "longer": ("Sq", {}),
        "only_q": ("q_only", {}),
    }


def _cache_step(name, change, kw):
    q, k, v, g = _inputs(Sq=15 if change == "Sq" else 13)
    if callable(change):
        q, k, v, g = (change(x.detach()).requires_grad_(x.requires_grad) for x in (q, k, v, g))
    if change == "q_only":
        k, v = k.detach(), v.detach()
    out, lse = at.attention(q, k, v, return_lse=True, **kw)
    wrt = [x for x in (q, k, v) if x.requires_grad]
    return (out, lse) + torch.autograd.grad(out, wrt, g)


def test_problem_cache_gives_the_bits_of_uncached_calls():
    """Each signature after all the others were cached (a stale Problem would be reused
    there) and alone with the cache emptied: the same bits; repeats hit the cache."""
    cases = _cache_cases()
    eager._problems.clear()
    cached = {n: _cache_step(n, *c) for n, c in cases.items()}
    n_entries = len(eager._problems)
    assert n_entries == len(cases)
    for n, c in cases.items():
        assert all(torch.equal(a, b) for a, b in zip(cached[n], _cache_step(n, *c))), n
    assert len(eager._problems) == n_entries
    for n, c in cases.items():
        eager._problems.clear()
        fresh = _cache_step(n, *c)
        assert all(torch.equal(a, b) for a, b in zip(cached[n], fresh)), n


def test_problem_cache_skips_dropout_and_never_skips_a_refusal():
    """Dropout (a per-call seed) is never cached; tensor masks are, without their
    tensors (tests/core/test_host_caches.py holds them to the uncached bits)."""
    q, k, v, g = _inputs()
    eager._problems.clear()
    keep = torch.rand(2, 1, 13, 17) > 0.3
    ids_q, ids_k = (torch.arange(13) // 5)[None], (torch.arange(17) // 6)[None]
    for kw in (dict(mask=anyattn.KeepMask(keep)), dict(mask=anyattn.Documents(ids_q, ids_k)),
               dict(dropout_p=0.2, dropout_seed=5)):
        at.attention(q, k, v, **kw)
    assert len(eager._problems) == 2
    assert all(pf.mask.q_ids is None and pf.mask.keep is None and p.mask.keep is None
               for p, pf in eager._problems.values()), "no mask tensor is kept"
    eager._problems.clear()
    at.attention(q, k, v)
    with pytest.raises(ValueError, match="head_dim"):
        at.attention(q, k[..., :8], v[..., :8])
    with pytest.raises(ValueError, match="scale"):
        at.attention(q, k, v, scale=float("inf"))
    with pytest.raises(ValueError, match="softcap"):
        at.attention(q, k, v, softcap=-1.0)
    assert len(eager._problems) == 1


def test_backend_choice_memo_follows_name_and_interpreter_setting(monkeypatch):
    """The memoised choice is choose()'s for every (signature, backend name,
    TRITON_INTERPRET); a named backend that cannot take the call still refuses after the
    signature was cached under another name."""
    from anyattn.backends import registry

    q, k, v, _ = _inputs()
    eager.clear_caches()
    calls = []
    real = registry.choose
    monkeypatch.setattr(eager, "choose", lambda p, name=None: calls.append(name) or real(p, name))
    for _ in range(3):
        at.attention(q, k, v, backend="numpy")
        at.attention(q, k, v, backend="reference")
    assert calls == ["numpy", "reference"]
    keys = list(eager._chosen)
    assert {be.name for be in eager._chosen.values()} == {"numpy", "reference"}
    assert all(ck[1] in ("numpy", "reference") for ck in keys)
    monkeypatch.setenv("TRITON_INTERPRET",
                       "0" if settings.current().triton_interpret else "1")
    at.attention(q, k, v, backend="numpy")
    assert calls == ["numpy", "reference", "numpy"], "a changed TRITON_INTERPRET asks again"
    with pytest.raises(NotImplementedError, match="backend='webgpu'|webgpu"):
        at.attention(q, k, v, backend="webgpu")
    eager.clear_caches()
    assert not eager._chosen and not eager._problems


def test_dropout_seed_fast_path_keeps_the_checks():
    from anyattn.torch.functional import _dropout_seed

    assert _dropout_seed(0.0, None, None) is None
    assert _dropout_seed(0, None, None) is None
    for bad, err in ((-0.1, ValueError), (1.0, ValueError), (True, TypeError),
                     (float("nan"), ValueError), ("0", TypeError)):
        with pytest.raises(err):
            _dropout_seed(bad, None, None)
    with pytest.raises(TypeError):
        _dropout_seed(0.0, None, 1.5)
    assert _dropout_seed(0.5, None, 7).item() == 7


def test_drawn_dropout_seed_is_refused_under_graph_capture(monkeypatch):
    """A seed drawn at capture would be baked into the graph (every replay the same
    mask): refused; a given seed is what the caller asked for, and p = 0 is untouched."""
    from anyattn.torch import functional

    q, k, v, _ = _inputs()
    monkeypatch.setattr(functional.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(functional.torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(NotImplementedError, match="CUDA graph capture"):
        at.attention(q, k, v, dropout_p=0.25)
    at.attention(q, k, v, dropout_p=0.25, dropout_seed=3)
    at.attention(q, k, v)


def test_backward_gets_no_zero_filled_statistics_gradients(monkeypatch):
    """The statistics are not differentiable: the backward receives None for them (no
    zero-filled tensors allocated and filled per step), and the gradients are the bits of
    the materialised-zeros behaviour (the ops path's)."""
    seen = []
    real = eager._Attention.backward

    def spy(ctx, dout, dmax, dlog_norm):
        seen.append((dmax, dlog_norm))
        return real(ctx, dout, dmax, dlog_norm)

    monkeypatch.setattr(eager._Attention, "backward", staticmethod(spy))
    q, k, v, g = _inputs()
    out, lse = at.attention(q, k, v, mask=anyattn.Causal(), return_lse=True)
    got = torch.autograd.grad(out, (q, k, v), g)
    assert seen == [(None, None)]
    want = _via_ops(monkeypatch, lambda: torch.autograd.grad(
        at.attention(q, k, v, mask=anyattn.Causal()), (q, k, v), g))
    assert all(torch.equal(a, b) for a, b in zip(got, want))
