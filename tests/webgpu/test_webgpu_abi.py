"""The seed ABI on a wgpu arena: same results as the seed (float64 seed semantics),
only the output elements written, every mask kind, strides, quirk rows, errors."""
from __future__ import annotations

import numpy as np
import pytest

from anyattn import abi
from anyattn import reference as R


def _arena_buffer(be, arena):
    import wgpu

    return be.device.create_buffer_with_data(
        data=arena, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC
        | wgpu.BufferUsage.COPY_DST)


def _run(be, q, k, v, dy, wrt, kind, mask=None, window=3, layout="bhsd"):
    arena, p = abi.pack_arena(q, k, v, dy, wrt=wrt, mask_kind=kind, mask=mask, window=window,
                              layout=layout, gap=5)
    buf = _arena_buffer(be, arena)
    abi.attention_backward_arena(buf, p)
    after = np.frombuffer(be.device.queue.read_buffer(buf), np.float32).copy()
    return arena, after, p


@pytest.mark.parametrize("kind", [0, 1, 2, 3, 4])
@pytest.mark.parametrize("wrt", [0, 1, 2])
def test_seed_semantics(be, kind, wrt):
    r = np.random.default_rng(kind * 3 + wrt)
    B, H, Sq, Sk, D = 2, 2, 37, 29, 16
    q, k, v, dy = (r.standard_normal((B, H, s, D)) for s in (Sq, Sk, Sk, Sq))
    mask = None
    if kind == 2:
        mask = (r.random((B, H, Sq, Sk)) > 0.4).astype(np.float32)
        mask[:, :, 3] = 0                   # a row that keeps nothing: uniform (quirk)
        mask[0, 0, 5, 2] = np.nan           # NaN keeps
    elif kind == 4:
        mask = r.standard_normal((1, H, Sq, Sk)).astype(np.float32)
        mask[..., 7, :] = -np.inf           # all -inf row: zeros
    arena, after, p = _run(be, q, k, v, dy, wrt, kind, mask, window=3,
                           layout="bshd" if wrt == 1 else "bhsd")
    got = abi.read_output(after, p)
    ref = R.seed_backward(q, k, v, dy, mask_kind=kind, scale=1 / np.sqrt(D), mask=mask,
                          window=3, wrt=wrt)
    err = np.max(np.abs(got - ref)) / np.max(np.abs(ref))
    assert err <= 1e-5, err
    # every element outside the output is bitwise unchanged (NaN fill included)
    out_idx = np.zeros(arena.size, bool)
    flat = abi.read_output(np.arange(arena.size, dtype=np.float32), p)   # element indices
    out_idx[flat.astype(np.int64).ravel()] = True
    np.testing.assert_array_equal(arena[~out_idx].view(np.uint32), after[~out_idx].view(np.uint32))
    assert not np.isnan(got).any()


def test_window_quirk_rows(be):
    """kind 3 with Sq > Sk + window: late rows keep no key and attend uniformly."""
    r = np.random.default_rng(9)
    q, k, v, dy = (r.standard_normal((1, 1, s, 8)) for s in (20, 6, 6, 20))
    for wrt in range(3):
        _, after, p = _run(be, q, k, v, dy, wrt, 3, window=2)
        ref = R.seed_backward(q, k, v, dy, mask_kind=3, scale=1 / np.sqrt(8), window=2, wrt=wrt)
        got = abi.read_output(after, p)
        assert np.max(np.abs(got - ref)) <= 1e-5 * np.max(np.abs(ref))


def test_past_the_seed_limits(be):
    """S > 512 and head_dim > 128, where the seed writes nothing."""
    r = np.random.default_rng(10)
    q, k, v, dy = (r.standard_normal((1, 1, s, 160)) for s in (520, 515, 515, 520))
    _, after, p = _run(be, q, k, v, dy, 0, 1)
    ref = R.seed_backward(q, k, v, dy, mask_kind=1, scale=1 / np.sqrt(160), wrt=0)
    got = abi.read_output(after, p)
    assert np.max(np.abs(got - ref)) <= 1e-5 * np.max(np.abs(ref))


def test_repeat_call_reuses_plan_and_sees_new_data(be):
    r = np.random.default_rng(11)
    q, k, v, dy = (r.standard_normal((1, 2, 9, 8)) for _ in range(4))
    arena, p = abi.pack_arena(q, k, v, dy, wrt=0)
    buf = _arena_buffer(be, arena)
    abi.attention_backward_arena(buf, p)
    first = abi.read_output(np.frombuffer(be.device.queue.read_buffer(buf), np.float32).copy(), p)
    arena2, _ = abi.pack_arena(2 * q, k, v, dy, wrt=0)
    be.device.queue.write_buffer(buf, 0, arena2)
    abi.attention_backward_arena(buf, p)
    second = abi.read_output(np.frombuffer(be.device.queue.read_buffer(buf), np.float32).copy(), p)
    ref = R.seed_backward(2 * q, k, v, dy, mask_kind=0, scale=1 / np.sqrt(8), wrt=0)
    assert np.max(np.abs(second - ref)) <= 1e-5 * np.max(np.abs(ref))
    assert not np.allclose(first, second)


def test_arena_errors(be):
    import wgpu

    r = np.random.default_rng(12)
    q, k, v, dy = (r.standard_normal((1, 1, 4, 8)) for _ in range(4))
    arena, p = abi.pack_arena(q, k, v, dy, wrt=0)
    buf = be.device.create_buffer_with_data(data=arena, usage=wgpu.BufferUsage.COPY_SRC)
    with pytest.raises(ValueError, match="STORAGE"):
        abi.attention_backward_arena(buf, p)
    small = _arena_buffer(be, arena[:10].copy())
    with pytest.raises(ValueError):
        abi.attention_backward_arena(small, p)


@pytest.mark.parametrize("wrt", [0, 1, 2])
def test_kind4_large_finite_bias_rows(be, wrt):
    """Kind 4 rows of one large finite bias: -1e30 and -3.2e38 are scores (the seed
    attends uniformly; a single rounded lse gave P = 1 per key, Sk x too large), while
    finfo.min lies below the seed's -3.4e38 running-max floor and gives zeros there,
    like -inf; mixed rows drop only their finfo.min keys."""
    r = np.random.default_rng(40 + wrt)
    B, H, Sq, Sk, D = 1, 2, 21, 45, 8
    q, k, v, dy = (r.standard_normal((B, H, s, D)) for s in (Sq, Sk, Sk, Sq))
    f32min = np.finfo(np.float32).min
    mask = r.standard_normal((B, H, Sq, Sk)).astype(np.float32)
    mask[..., 1, :] = -1e30
    mask[..., 2, :] = -3.2e38
    mask[..., 3, :] = f32min
    mask[..., 4, :] = -np.inf
    mask[..., 5, ::2] = f32min
    arena, after, p = _run(be, q, k, v, dy, wrt, 4, mask)
    got = abi.read_output(after, p)
    ref = R.seed_backward(q, k, v, dy, mask_kind=4, scale=1 / np.sqrt(D), mask=mask, wrt=wrt)
    err = np.max(np.abs(got - ref)) / np.max(np.abs(ref))
    assert err <= 1e-5, err
    assert not np.isnan(got).any()
