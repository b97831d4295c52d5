"""The real seed shader as an extra oracle (wgpu; lavapipe on a CPU machine).

Skips when ../shared/seed/attention_bwd.wgsl or a wgpu adapter is absent.  Sizes
stay tiny: lavapipe stops an invocation's loops after 65,535 iterations in total.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from anyattn import abi as A
from anyattn import reference as R
from anyattn.backends.base import Backend
from anyattn.backends.registry import get_backend, unavailable_reason

import abi_seed_shader as S
from abi_cases import BACKEND, inputs, mask_for, out_index_mask
from helpers import assert_close

WHY = S.why_unavailable()
pytestmark = pytest.mark.skipif(WHY is not None, reason=str(WHY))

KINDS = [A.MASK_NONE, A.MASK_CAUSAL, A.MASK_KEEP, A.MASK_CAUSAL_WINDOW, A.MASK_BIAS]


def _compare(arena, p, q, k, v, dy, m):
    seed = S.run_seed(arena, p)
    ours = arena.copy()
    A.attention_backward_arena(ours, p, backend=BACKEND)
    s_out, o_out = A.read_output(seed, p), A.read_output(ours, p)
    ref = R.seed_backward(q, k, v, dy, mask_kind=p.mask_kind, scale=p.scale, mask=m,
                          window=p.window, wrt=p.wrt)
    assert_close(s_out, ref, "float32", "seed shader vs reference.seed_backward")
    assert_close(o_out, ref, "float32", "abi vs reference.seed_backward")
    assert_close(o_out, s_out.astype(np.float64), "float32", "abi vs seed shader")
    outside = ~out_index_mask(arena.size, p)
    assert np.array_equal(seed.view(np.uint32)[outside], arena.view(np.uint32)[outside])


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("wrt", [0, 1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_matches_the_seed_shader(kind, wrt, layout):
    rng = np.random.default_rng(kind * 7 + wrt)
    B, H, Sq, Sk, D = 2, 2, 7, 4, 5        # Sq > Sk + window: uniform rows under kind 3
    q, k, v, dy = inputs(rng, B, H, Sq, Sk, D)
    m = mask_for(rng, kind, (B, H, Sq, Sk))
    arena, p = A.pack_arena(q, k, v, dy, wrt=wrt, mask_kind=kind, mask=m, window=1,
                            layout=layout, gap=3, scale=0.6)
    assert S.loop_trips(p) < 65535
    _compare(arena, p, q, k, v, dy, m)


@pytest.mark.parametrize("wrt", [0, 1, 2])
@pytest.mark.parametrize("kind", [A.MASK_KEEP, A.MASK_BIAS])
@pytest.mark.parametrize("mshape", [(6, 5), (2, 1, 1, 5), (1, 3, 6, 5)], ids=str)
def test_broadcast_mask_matches_the_seed_shader(kind, wrt, mshape):
    rng = np.random.default_rng(17)
    B, H, Sq, Sk, D = 2, 3, 6, 5, 3
    q, k, v, dy = inputs(rng, B, H, Sq, Sk, D)
    m = mask_for(rng, kind, mshape)
    arena, p = A.pack_arena(q, k, v, dy, wrt=wrt, mask_kind=kind, mask=m, layout="bshd")
    _compare(arena, p, q, k, v, dy, m)


def test_all_false_keep_mask_is_uniform_in_the_seed_too():
    rng = np.random.default_rng(5)
    q, k, v, dy = inputs(rng, 1, 1, 4, 6, 3)
    m = np.zeros((4, 6), np.float32)
    for wrt in (0, 1, 2):
        arena, p = A.pack_arena(q, k, v, dy, wrt=wrt, mask_kind=A.MASK_KEEP, mask=m)
        _compare(arena, p, q, k, v, dy, m)


def test_zero_rows_and_the_seeds_size_limit():
    """Sk = 0: the seed writes dQ = 0.  S = 513: the seed writes nothing; we compute."""
    rng = np.random.default_rng(6)
    q, k, v, dy = inputs(rng, 1, 1, 3, 0, 2)
    arena, p = A.pack_arena(q, k, v, dy, wrt=A.WRT_Q)
    seed = S.run_seed(arena, p)
    assert np.array_equal(A.read_output(seed, p), np.zeros((1, 1, 3, 2), np.float32))
    q, k, v, dy = inputs(rng, 1, 1, 513, 2, 2)
    arena, p = A.pack_arena(q, k, v, dy, wrt=A.WRT_Q)
    assert np.isnan(A.read_output(S.run_seed(arena, p), p)).all()   # untouched by the seed
    A.attention_backward_arena(arena, p, backend=BACKEND)
    ref = R.seed_backward(q, k, v, dy, mask_kind=0, scale=p.scale, wrt=0)
    assert_close(A.read_output(arena, p), ref, "float32")


# ----------------------------------------------------------------------------- wgpu buffers
def test_wgpu_buffer_arena_is_validated_first():
    rng = np.random.default_rng(8)
    q, k, v, dy = inputs(rng, 1, 2, 3, 3, 2)
    arena, p = A.pack_arena(q, k, v, dy, wrt=A.WRT_K)
    buf = S.make_buffer(arena)
    with pytest.raises(ValueError, match="q_off=.*past the arena's end"):
        A.attention_backward_arena(buf, dataclasses.replace(p, q_off=arena.size))
    with pytest.raises(ValueError, match="overlaps the input k"):
        A.attention_backward_arena(buf, dataclasses.replace(p, out_off=p.k_off))
    with pytest.raises(ValueError, match="backend='numpy'.*wgpu buffer"):
        A.attention_backward_arena(buf, p, backend="numpy")
    with pytest.raises(TypeError, match="wgpu buffer"):
        A.arena_views(buf, p)


def _webgpu_arena_ready() -> str:
    why = unavailable_reason("webgpu")
    if why is not None:
        return f"webgpu backend unavailable: {why}"
    if type(get_backend("webgpu")).backward_arena is Backend.backward_arena:
        return "webgpu backend has no backward_arena yet"
    return ""


@pytest.mark.parametrize("wrt", [0, 1, 2])
@pytest.mark.parametrize("kind", KINDS)
def test_wgpu_buffer_arena_matches_the_seed(kind, wrt):
    why = _webgpu_arena_ready()
    if why:
        pytest.skip(why)
    rng = np.random.default_rng(90 + kind + wrt)
    B, H, Sq, Sk, D = 1, 2, 7, 4, 3
    q, k, v, dy = inputs(rng, B, H, Sq, Sk, D)
    m = mask_for(rng, kind, (B, 1, Sq, Sk))
    arena, p = A.pack_arena(q, k, v, dy, wrt=wrt, mask_kind=kind, mask=m, window=1,
                            layout="bshd", gap=2)
    seed = S.run_seed(arena, p)
    dev = get_backend("webgpu").device            # buffers must live on the backend's device
    buf = S.make_buffer(arena, dev)
    try:
        A.attention_backward_arena(buf, p)
    except NotImplementedError as e:
        pytest.skip(f"webgpu backward_arena: {e}")
    got = np.frombuffer(dev.queue.read_buffer(buf), dtype=np.float32)
    assert_close(A.read_output(got, p), A.read_output(seed, p).astype(np.float64),
                 "float32", "webgpu arena vs seed shader")
    outside = ~out_index_mask(arena.size, p)
    assert np.array_equal(got.view(np.uint32)[outside], arena.view(np.uint32)[outside])
