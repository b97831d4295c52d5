"""attention_backward_arena against the seed semantics (reference.seed_backward).

Every mask kind x wrt on [B,H,S,D], [B,S,H,D] and packed-QKV arenas, broadcast
mask strides, rows with no kept key (the uniform quirk), sizes past the seed's
512/128 limits, poisoned outputs, and untouched neighbours.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from anyattn import abi as A
from anyattn import reference as R
from anyattn.backends.registry import unavailable_reason

from abi_cases import BACKEND, inputs, mask_for, run_and_check
from helpers import assert_close, examples

KINDS = [A.MASK_NONE, A.MASK_CAUSAL, A.MASK_KEEP, A.MASK_CAUSAL_WINDOW, A.MASK_BIAS]
WRTS = [A.WRT_Q, A.WRT_K, A.WRT_V]


def _host_backends():
    out = []
    for name in ("numpy", "reference"):
        why = unavailable_reason(name)
        out.append(pytest.param(name, id=name, marks=[pytest.mark.skip(
            reason=f"{name} unavailable: {why}")] if why else []))
    return out


@pytest.mark.parametrize("backend", _host_backends())
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("wrt", WRTS)
@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_and_wrt(kind, wrt, layout, backend):
    rng = np.random.default_rng(100 * kind + 10 * wrt + (layout == "bshd"))
    B, H, Sq, Sk, D = 2, 3, 9, 6, 5          # Sq > Sk + window: kind 3's last row keeps nothing
    q, k, v, dy = inputs(rng, B, H, Sq, Sk, D)
    m = mask_for(rng, kind, (B, H, Sq, Sk))
    arena, p = A.pack_arena(q, k, v, dy, wrt=wrt, mask_kind=kind, mask=m, window=2,
                            layout=layout, gap=3, scale=0.37)
    run_and_check(arena, p, q, k, v, dy, m, backend=backend)


@pytest.mark.skipif(unavailable_reason("webgpu") is not None, reason="webgpu unavailable")
@pytest.mark.parametrize("kind", KINDS)
def test_numpy_arena_on_the_webgpu_backend(kind):
    """backend= picks the gradient's backend; here WebGPU kernels on NumPy views."""
    rng = np.random.default_rng(50 + kind)
    q, k, v, dy = inputs(rng, 1, 2, 9, 6, 4)
    m = mask_for(rng, kind, (1, 2, 9, 6))
    for wrt in WRTS:
        arena, p = A.pack_arena(q, k, v, dy, wrt=wrt, mask_kind=kind, mask=m, window=2,
                                layout="bshd")
        run_and_check(arena, p, q, k, v, dy, m, backend="webgpu")


@pytest.mark.parametrize("wrt", WRTS)
@pytest.mark.parametrize("kind", [A.MASK_KEEP, A.MASK_BIAS])
@pytest.mark.parametrize("mshape", [(9, 6), (2, 1, 9, 6), (1, 3, 9, 6), (2, 1, 1, 6),
                                    (2, 3, 9, 1)], ids=str)
def test_broadcast_mask_strides(kind, wrt, mshape):
    rng = np.random.default_rng(7)
    B, H, Sq, Sk, D = 2, 3, 9, 6, 4
    q, k, v, dy = inputs(rng, B, H, Sq, Sk, D)
    m = mask_for(rng, kind, mshape)
    arena, p = A.pack_arena(q, k, v, dy, wrt=wrt, mask_kind=kind, mask=m, layout="bshd")
    m4 = (1,) * (4 - len(mshape)) + mshape
    strides = (p.mask_batch_stride, p.mask_head_stride, p.seq_q_stride, p.seq_k_stride)
    assert all((s == 0) == (n == 1) for s, n in zip(strides, m4))
    run_and_check(arena, p, q, k, v, dy, m)
    # stride-0 dims stay size 1 in the anyattn call (no B*H*Sq*Sk blow-up)
    views = A.arena_views(arena, p)
    small = views.bias if kind == A.MASK_BIAS else views.mask.mask
    assert tuple(small.shape) == m4


def _packed_arena(q, k, v, dy, wrt, kind, m, window, gap=5):
    """q, k, v, the output and dy interleaved in one [B, S, 5, H, D] block (slots 0..4;
    dy must share q's strides), the mask [B, H, S, S] after it.  Sq == Sk == S."""
    B, H, S, D = q.shape
    blk = np.full((B, S, 5, H, D), np.nan, dtype=np.float32)
    for slot, x in ((0, q), (1, k), (2, v), (4, dy)):
        blk[:, :, slot] = np.swapaxes(x, 1, 2)
    parts = [blk.reshape(-1)] + ([m.reshape(-1)] if m is not None else [])
    offs, pos = [], gap
    for x in parts:
        offs.append(pos)
        pos += x.size + gap
    arena = np.full(pos, np.nan, dtype=np.float32)
    for x, off in zip(parts, offs):
        arena[off:off + x.size] = x
    bs, hs, ss = S * 5 * H * D, D, 5 * H * D
    mk = {}
    if m is not None:
        mk = dict(mask_off=offs[1], mask_batch_stride=H * S * S, mask_head_stride=S * S,
                  seq_q_stride=S, seq_k_stride=1)
    slot = {n: offs[0] + i * H * D for i, n in enumerate(("q", "k", "v", "out", "dy"))}
    p = A.Params(batch=B, heads=H, seq_q=S, seq_k=S, head_dim=D, wrt=wrt, mask_kind=kind,
                 window=window, q_off=slot["q"], k_off=slot["k"], v_off=slot["v"],
                 out_off=slot["out"], dy_off=slot["dy"], **mk,
                 q_batch_stride=bs, q_head_stride=hs, q_seq_stride=ss,
                 k_batch_stride=bs, k_head_stride=hs, k_seq_stride=ss,
                 v_batch_stride=bs, v_head_stride=hs, v_seq_stride=ss,
                 o_batch_stride=bs, o_head_stride=hs, o_seq_stride=ss)
    return arena, p


@pytest.mark.parametrize("wrt", WRTS)
@pytest.mark.parametrize("kind", KINDS)
def test_packed_qkv_with_interleaved_output(kind, wrt):
    """The output's interval overlaps q/k/v's (exact element check) but no element."""
    rng = np.random.default_rng(3 + kind)
    B, H, S, D = 2, 2, 7, 3
    q, k, v, dy = inputs(rng, B, H, S, S, D)
    m = mask_for(rng, kind, (B, H, S, S))
    arena, p = _packed_arena(q, k, v, dy, wrt, kind, m, window=1)
    run_and_check(arena, p, q, k, v, dy, m)


def test_uniform_quirk_rows():
    """Rows with no kept key attend uniformly (kinds 2, 3) -- not the contract's zeros."""
    rng = np.random.default_rng(11)
    B, H, Sq, Sk, D = 1, 2, 8, 4, 3
    q, k, v, dy = inputs(rng, B, H, Sq, Sk, D)
    m = np.ones((B, H, Sq, Sk), np.float32)
    m[0, 1, 2] = 0.0
    cases = [(A.MASK_KEEP, m, 0, [(0, 1, 2)]),
             (A.MASK_CAUSAL_WINDOW, None, 1, [(0, h, i) for h in range(H) for i in (5, 6, 7)])]
    for kind, mask, window, empty in cases:
        arena, p = A.pack_arena(q, k, v, dy, wrt=A.WRT_Q, mask_kind=kind, mask=mask,
                                window=window)
        views = A.arena_views(arena, p)
        rows = np.broadcast_to(views.uniform_rows, (B, H, Sq))
        assert sorted(zip(*np.nonzero(rows))) == empty
        got = run_and_check(arena, p, q, k, v, dy, mask)
        for b, h, i in empty:   # dq_i = scale/Sk * sum_j dy_i.(v_j - vbar) k_j
            a = (v[b, h] - v[b, h].mean(0)) @ dy[b, h, i].astype(np.float64)
            want = p.scale / Sk * (a @ k[b, h])
            np.testing.assert_allclose(got[b, h, i], want, rtol=1e-5, atol=1e-6)
            assert np.abs(want).max() > 1e-3     # the contract would give 0 here


@pytest.mark.parametrize("wrt", WRTS)
@pytest.mark.parametrize("kind", [A.MASK_KEEP, A.MASK_CAUSAL_WINDOW])
def test_past_the_seeds_limits(kind, wrt):
    """S = 600 > 512 and head_dim = 160 > 128: the seed writes nothing there; we compute."""
    rng = np.random.default_rng(600 + kind + wrt)
    B, H, Sq, Sk, D = 1, 1, 600, 520, 160
    q, k, v, dy = inputs(rng, B, H, Sq, Sk, D)
    m = mask_for(rng, kind, (1, 1, Sq, Sk)) if kind == A.MASK_KEEP else None
    arena, p = A.pack_arena(q, k, v, dy, wrt=wrt, mask_kind=kind, mask=m, window=40,
                            layout="bshd")
    run_and_check(arena, p, q, k, v, dy, m)


@pytest.mark.parametrize("wrt", WRTS)
def test_zero_sizes(wrt):
    rng = np.random.default_rng(0)
    for Sq, Sk in ((0, 4), (3, 0)):
        q, k, v, dy = inputs(rng, 2, 2, Sq, Sk, 3)
        arena, p = A.pack_arena(q, k, v, dy, wrt=wrt, mask_kind=A.MASK_CAUSAL, gap=2)
        before = arena.copy()
        A.attention_backward_arena(arena, p, backend=BACKEND)
        out = A.read_output(arena, p)
        assert out.shape == (2, 2, p.out_rows, 3)
        assert np.array_equal(out, np.zeros_like(out))   # the seed writes zeros (or nothing)
        changed = arena.view(np.uint32) != before.view(np.uint32)
        assert changed.sum() == out.size
    q, k, v, dy = inputs(rng, 0, 2, 3, 3, 3)
    arena, p = A.pack_arena(q, k, v, dy, wrt=wrt, gap=4)
    before = arena.copy()
    A.attention_backward_arena(arena, p, backend=BACKEND)
    assert np.array_equal(arena.view(np.uint32), before.view(np.uint32))


def test_stride_zero_inputs_and_params_bytes():
    """q and dy shared by every batch (q_batch_stride = 0); Params given as its bytes."""
    rng = np.random.default_rng(5)
    B, H, S, D = 3, 2, 5, 4
    q, k, v, dy = inputs(rng, B, H, S, S, D)
    q, dy = np.broadcast_to(q[:1], q.shape), np.broadcast_to(dy[:1], dy.shape)
    one = H * S * D                                   # one batch of q (or dy)
    parts = [q[0], dy[0], k, v]
    offs = np.cumsum([0] + [x.size for x in parts])
    arena = np.full(offs[-1] + B * one, np.nan, np.float32)
    for x, off in zip(parts, offs):
        arena[off:off + x.size] = x.reshape(-1)
    p = A.Params.for_layout(batch=B, heads=H, seq_q=S, seq_k=S, head_dim=D, wrt=A.WRT_K,
                            q_off=int(offs[0]), dy_off=int(offs[1]), k_off=int(offs[2]),
                            v_off=int(offs[3]), out_off=int(offs[4]), mask_kind=A.MASK_CAUSAL)
    p = dataclasses.replace(p, q_batch_stride=0)
    run_and_check(arena, p.pack(), q, k, v, dy)


def test_wrt_computes_only_that_gradient(monkeypatch):
    import anyattn.api as api

    seen = []
    real = api.attention_backward

    def spy(*a, **kw):
        seen.append(kw["wrt"])
        return real(*a, **kw)

    monkeypatch.setattr(api, "attention_backward", spy)
    rng = np.random.default_rng(1)
    q, k, v, dy = inputs(rng, 1, 2, 4, 5, 3)
    for wrt, name in ((0, "q"), (1, "k"), (2, "v")):
        arena, p = A.pack_arena(q, k, v, dy, wrt=wrt)
        run_and_check(arena, p, q, k, v, dy)
        assert tuple(seen[-1]) == (name,)


def test_repeated_runs_are_bitwise_equal():
    rng = np.random.default_rng(2)
    q, k, v, dy = inputs(rng, 2, 2, 7, 5, 6)
    m = mask_for(rng, A.MASK_KEEP, (2, 2, 7, 5))
    arena, p = A.pack_arena(q, k, v, dy, wrt=A.WRT_K, mask_kind=A.MASK_KEEP, mask=m)
    a2 = arena.copy()
    A.attention_backward_arena(arena, p, backend=BACKEND)
    A.attention_backward_arena(a2, p, backend=BACKEND)
    assert np.array_equal(arena.view(np.uint32), a2.view(np.uint32))


def test_arena_views_describe_the_launch():
    rng = np.random.default_rng(4)
    q, k, v, dy = inputs(rng, 2, 3, 6, 4, 2)
    arena, p = A.pack_arena(q, k, v, dy, wrt=A.WRT_V, mask_kind=A.MASK_CAUSAL_WINDOW,
                            window=1, layout="bshd", scale=0.5)
    vw = A.arena_views(arena, p)
    assert vw.wrt == "v" and vw.scale == 0.5 and vw.bias is None
    assert repr(vw.mask) == "Causal(align='top_left') & Window(left=1, right=None, " \
                            "align='top_left')"
    np.testing.assert_array_equal(vw.q, q)
    np.testing.assert_array_equal(vw.dy, dy)
    np.testing.assert_array_equal(vw.k, k)
    assert vw.out.shape == (2, 3, 4, 2)
    assert not vw.q.flags.writeable and vw.out.flags.writeable
    assert vw.uniform_rows.shape == (1, 1, 6) and vw.uniform_rows[0, 0].tolist() == \
        [False] * 5 + [True]
    b = np.zeros((6, 4), np.float32)
    arena, p = A.pack_arena(q, k, v, dy, wrt=0, mask_kind=A.MASK_BIAS, mask=b)
    vw = A.arena_views(arena, p)
    assert vw.mask is None and vw.bias.shape == (1, 1, 6, 4) and vw.uniform_rows is None


def test_bias_rows_of_minus_inf_give_zeros():
    rng = np.random.default_rng(9)
    q, k, v, dy = inputs(rng, 1, 1, 4, 3, 2)
    b = np.zeros((4, 3), np.float32)
    b[1] = -np.inf
    for wrt in WRTS:
        arena, p = A.pack_arena(q, k, v, dy, wrt=wrt, mask_kind=A.MASK_BIAS, mask=b)
        got = run_and_check(arena, p, q, k, v, dy, b)
        if wrt == A.WRT_Q:
            assert np.array_equal(got[0, 0, 1], np.zeros(2, np.float32))


@settings(max_examples=examples(40, 100), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 2), H=st.integers(1, 2), Sq=st.integers(1, 11), Sk=st.integers(1, 11),
       D=st.integers(1, 9), kind=st.sampled_from(KINDS), wrt=st.sampled_from(WRTS),
       layout=st.sampled_from(["bhsd", "bshd"]), window=st.integers(0, 4),
       gap=st.integers(0, 3), seed=st.integers(0, 2**16), bcast=st.booleans())
def test_hypothesis_against_seed_semantics(B, H, Sq, Sk, D, kind, wrt, layout, window, gap,
                                           seed, bcast):
    rng = np.random.default_rng(seed)
    q, k, v, dy = inputs(rng, B, H, Sq, Sk, D)
    m = mask_for(rng, kind, (1, Sq, Sk) if bcast else (B, H, Sq, Sk))
    arena, p = A.pack_arena(q, k, v, dy, wrt=wrt, mask_kind=kind, mask=m, window=window,
                            layout=layout, gap=gap, scale=float(rng.uniform(0.1, 1.0)))
    run_and_check(arena, p, q, k, v, dy, m)


# ----------------------------------------------------------------------------- torch arenas
try:
    import torch
except ImportError:  # torch is an optional extra
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")


@needs_torch
@pytest.mark.parametrize("backend", _host_backends())
@pytest.mark.parametrize("wrt", WRTS)
@pytest.mark.parametrize("kind", [A.MASK_KEEP, A.MASK_CAUSAL_WINDOW, A.MASK_BIAS])
def test_torch_cpu_arena_through_torch_views(kind, wrt, backend):
    """An explicit backend taking torch tensors: views and the correction in torch."""
    rng = np.random.default_rng(20 + kind + wrt)
    B, H, Sq, Sk, D = 2, 2, 8, 5, 3
    q, k, v, dy = inputs(rng, B, H, Sq, Sk, D)
    m = mask_for(rng, kind, (B, 1, Sq, Sk))
    arena, p = A.pack_arena(q, k, v, dy, wrt=wrt, mask_kind=kind, mask=m, window=1, gap=2)
    big = torch.full((arena.size + 7,), float("nan"))
    t = big[7:]                                   # a view with a storage offset
    t.copy_(torch.from_numpy(arena))
    before = t.clone()
    A.attention_backward_arena(t, p, backend=backend)
    got = A.read_output(t, p)
    assert isinstance(got, torch.Tensor)
    ref = R.seed_backward(q, k, v, dy, mask_kind=kind, scale=p.scale, mask=m, window=1, wrt=wrt)
    assert_close(got.numpy(), ref, "float32")
    from abi_cases import out_index_mask

    outside = torch.from_numpy(~out_index_mask(t.numel(), p))
    assert torch.equal(t.view(torch.int32)[outside], before.view(torch.int32)[outside])
    assert torch.isnan(big[:7]).all()


@needs_torch
@pytest.mark.skipif(unavailable_reason("numpy") is not None,
                    reason="the numpy backend is not registered yet")
def test_default_backend_numpy_and_torch_cpu():
    rng = np.random.default_rng(30)
    q, k, v, dy = inputs(rng, 1, 2, 6, 6, 4)
    m = mask_for(rng, A.MASK_KEEP, (1, 2, 6, 6))
    arena, p = A.pack_arena(q, k, v, dy, wrt=A.WRT_Q, mask_kind=A.MASK_KEEP, mask=m)
    run_and_check(arena.copy(), p, q, k, v, dy, m, backend=None)
    t = torch.from_numpy(arena.copy())
    A.attention_backward_arena(t, p)              # CPU torch arena: NumPy views, same memory
    ref = R.seed_backward(q, k, v, dy, mask_kind=2, scale=p.scale, mask=m, wrt=0)
    assert_close(A.read_output(t, p).numpy(), ref, "float32")


@pytest.mark.gpu
@pytest.mark.skipif(torch is None or not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("wrt", WRTS)
@pytest.mark.parametrize("kind", KINDS)
def test_cuda_arena(kind, wrt):
    rng = np.random.default_rng(40 + kind + wrt)
    B, H, Sq, Sk, D = 2, 3, 70, 65, 40
    q, k, v, dy = inputs(rng, B, H, Sq, Sk, D)
    m = mask_for(rng, kind, (B, 1, Sq, Sk))
    arena, p = A.pack_arena(q, k, v, dy, wrt=wrt, mask_kind=kind, mask=m, window=5,
                            layout="bshd", gap=1)
    t = torch.from_numpy(arena).cuda()
    A.attention_backward_arena(t, p)
    ref = R.seed_backward(q, k, v, dy, mask_kind=kind, scale=p.scale, mask=m, window=5, wrt=wrt)
    assert_close(A.read_output(t, p).cpu().numpy(), ref, "float32")


# ----------------------------------------------------------------------------- anyattn -> seed
def test_seed_mask_kinds():
    import anyattn as aa

    sz = dict(batch=2, heads=3, seq_q=5, seq_k=5)
    assert A.seed_mask(None, **sz) == (A.MASK_NONE, 0, None)
    assert A.seed_mask(aa.Causal(), **sz) == (A.MASK_CAUSAL, 0, None)
    assert A.seed_mask(aa.Causal() & aa.Window(left=3), **sz) == (A.MASK_CAUSAL_WINDOW, 3, None)
    assert A.seed_mask(aa.Window(left=2, right=0), **sz) == (A.MASK_CAUSAL_WINDOW, 2, None)
    kind, w, vals = A.seed_mask(aa.Causal(align="bottom_right"), **{**sz, "seq_k": 7})
    assert kind == A.MASK_KEEP and vals.shape == (1, 1, 5, 7)
    np.testing.assert_array_equal(vals[0, 0], np.tril(np.ones((5, 7)), 2))
    keep = np.random.default_rng(0).random((2, 1, 5, 5)) > 0.5
    kind, _, vals = A.seed_mask(aa.KeepMask(keep), **sz)
    assert kind == A.MASK_KEEP and np.array_equal(vals, keep.astype(np.float32))
    ids = np.array([0, 0, 1, 1, 1])
    kind, _, vals = A.seed_mask(aa.Documents(ids), **sz)
    assert kind == A.MASK_KEEP and np.array_equal(vals[0, 0], (ids[:, None] == ids).astype("f4"))
    bias = np.ones((5, 5), np.float32)
    kind, _, vals = A.seed_mask(aa.Causal(), bias=bias, **sz)
    assert kind == A.MASK_BIAS
    np.testing.assert_array_equal(vals[0, 0], np.where(np.tril(np.ones((5, 5))) > 0, 1, -np.inf))


@pytest.mark.parametrize("wrt", WRTS)
def test_contract_problems_through_the_seed_abi(wrt):
    """Without empty rows (or with them as kind 4) the ABI gives anyattn's own gradients."""
    import anyattn as aa

    rng = np.random.default_rng(60 + wrt)
    B, H, S, D = 2, 2, 8, 4
    q, k, v, dy = inputs(rng, B, H, S, S, D)
    keep = rng.random((B, 1, S, S)) > 0.5
    keep[0, 0, 3] = False                                   # an empty row: use kind 4
    bias = rng.standard_normal((1, H, S, S)).astype(np.float32)
    cases = [(aa.Documents(np.array([0, 0, 0, 1, 1, 2, 2, 2])), None),
             (aa.Causal() & aa.Window(left=2), None),
             (aa.KeepMask(keep), bias)]
    for mask, b in cases:
        kind, window, vals = A.seed_mask(mask, bias=b, batch=B, heads=H, seq_q=S, seq_k=S)
        arena, p = A.pack_arena(q, k, v, dy, wrt=wrt, mask_kind=kind, mask=vals, window=window)
        A.attention_backward_arena(arena, p, backend=BACKEND)
        want = aa.attention_backward(q.astype(np.float64), k.astype(np.float64),
                                     v.astype(np.float64), dy.astype(np.float64), mask=mask,
                                     bias=None if b is None else b.astype(np.float64),
                                     wrt=("qkv"[wrt],), backend="reference")
        assert_close(A.read_output(arena, p), getattr(want, "d" + "qkv"[wrt]), "float32",
                     repr(mask))
