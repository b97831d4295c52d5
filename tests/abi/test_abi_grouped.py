"""The grouped ABI call: attention_backward_arena(arena, [p_dq, p_dk, p_dv]).

A group shares every input field and differs in ``wrt`` and the output's placement;
one call gives what the separate calls give (on WebGPU bitwise: the same kernels from
one set of statistics, dK and dV from one pass), writes only the outputs, and refuses
anything else before any work.  The single-Params contract is covered by the other
ABI tests and is unchanged.

Shape legend: B batch, H heads, Sq/Sk queries/keys, D head_dim.
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from anyattn import abi as A
from anyattn import reference as R
from anyattn.backends.registry import get_backend, unavailable_reason

from abi_cases import BACKEND, inputs, mask_for, out_index_mask
from helpers import assert_close

KINDS = [A.MASK_NONE, A.MASK_CAUSAL, A.MASK_KEEP, A.MASK_CAUSAL_WINDOW, A.MASK_BIAS]
B, H, SQ, SK, D = 2, 2, 11, 7, 5          # Sq > Sk + window: kind 3 has uniform rows
WINDOW = 2
webgpu_only = pytest.mark.skipif(unavailable_reason("webgpu") is not None,
                                 reason=f"webgpu unavailable: {unavailable_reason('webgpu')}")


def grouped_arena(rng, kind, layout="bhsd", gap=3, sizes=(B, H, SQ, SK, D)):
    """One arena holding q, k, v, dy, the mask and three output regions (dQ, dK, dV,
    NaN-poisoned) -> (arena, [p_dq, p_dk, p_dv], (q, k, v, dy, mask))."""
    b, h, sq, sk, d = sizes
    q, k, v, dy = inputs(rng, b, h, sq, sk, d)
    m = mask_for(rng, kind, (b, h, sq, sk))
    arena, p0 = A.pack_arena(q, k, v, dy, wrt=A.WRT_Q, mask_kind=kind, mask=m,
                             window=WINDOW, layout=layout, gap=gap, scale=0.37)
    pos = arena.size + gap
    group = [p0]
    for wrt in (A.WRT_K, A.WRT_V):
        o = A.layout_strides(layout, h, sk, d)
        group.append(dataclasses.replace(p0, wrt=wrt, out_off=pos, o_batch_stride=o[0],
                                         o_head_stride=o[1], o_seq_stride=o[2]))
        pos += b * h * sk * d + gap
    full = np.full(pos, np.nan, np.float32)
    full[:arena.size] = arena
    return full, group, (q, k, v, dy, m)


def _wgpu(arena):
    import wgpu

    be = get_backend("webgpu")
    return be.device.create_buffer_with_data(
        data=arena, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC
        | wgpu.BufferUsage.COPY_DST)


def _read(buf):
    dev = get_backend("webgpu").device
    return np.frombuffer(dev.queue.read_buffer(buf), np.float32).copy()


def _check_outputs(before, after, group, data):
    """Each member's output against the seed reference; everything else untouched."""
    q, k, v, dy, m = data
    written = np.zeros(after.size, bool)
    for p in group:
        ref = R.seed_backward(q, k, v, dy, mask_kind=p.mask_kind, scale=p.scale, mask=m,
                              window=p.window, wrt=p.wrt)
        assert_close(A.read_output(after, p), ref, "float32", f"kind {p.mask_kind} wrt {p.wrt}")
        written |= out_index_mask(after.size, p)
    assert np.array_equal(after.view(np.uint32)[~written], before.view(np.uint32)[~written])


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
@pytest.mark.parametrize("kind", KINDS)
def test_host_group_matches_reference(kind, layout):
    rng = np.random.default_rng(10 + kind)
    arena, group, data = grouped_arena(rng, kind, layout)
    before = arena.copy()
    A.attention_backward_arena(arena, group, backend=BACKEND)
    _check_outputs(before, arena, group, data)
    # the separate calls give the same outputs (one backward for all vs one per wrt)
    sep = before.copy()
    for p in group:
        A.attention_backward_arena(sep, p, backend=BACKEND)
    for p in group:
        assert_close(A.read_output(arena, p), A.read_output(sep, p).astype(np.float64),
                     "float32", f"group vs single wrt {p.wrt}")


@webgpu_only
@pytest.mark.parametrize("kind", KINDS)
def test_webgpu_group_bitwise_equals_single_calls(kind):
    rng = np.random.default_rng(20 + kind)
    arena, group, data = grouped_arena(rng, kind, "bshd")
    buf = _wgpu(arena)
    A.attention_backward_arena(buf, group)
    after = _read(buf)
    _check_outputs(arena, after, group, data)
    single = _wgpu(arena)
    for p in group:
        A.attention_backward_arena(single, p)
    assert np.array_equal(after.view(np.uint32), _read(single).view(np.uint32))


@webgpu_only
@pytest.mark.parametrize("members", [(1, 2), (2, 0), (1,), (0, 2, 1)])
def test_webgpu_subsets_and_orders(members):
    """Any subset of the gradients, in any order; split launches (a small loop budget,
    as on llvmpipe) give the same bits."""
    rng = np.random.default_rng(30)
    arena, group, data = grouped_arena(rng, A.MASK_CAUSAL, sizes=(1, 2, 70, 75, 5))
    sub = [group[i] for i in members]
    buf = _wgpu(arena)
    A.attention_backward_arena(buf, sub)
    after = _read(buf)
    _check_outputs(arena, after, sub, data)
    be = get_backend("webgpu")
    be.loop_limit_override = 40
    try:
        split = _wgpu(arena)
        A.attention_backward_arena(split, sub)
        assert be.last_pieces and max(be.last_pieces.values()) > 1
    finally:
        be.loop_limit_override = None
    assert np.array_equal(after.view(np.uint32), _read(split).view(np.uint32))


@webgpu_only
def test_webgpu_group_repeat_reads_new_arena_data():
    """The cached plan of a group re-runs every pass: new inputs in the arena are read."""
    rng = np.random.default_rng(40)
    arena, group, data = grouped_arena(rng, A.MASK_NONE)
    buf = _wgpu(arena)
    A.attention_backward_arena(buf, group)
    q, k, v, dy, m = data
    a2 = arena.copy()
    p0 = group[0]
    q2 = np.lib.stride_tricks.as_strided(a2[p0.q_off:], q.shape, [4 * s for s in (
        p0.q_batch_stride, p0.q_head_stride, p0.q_seq_stride, 1)], writeable=True)
    q2[...] = 0.5 * q
    get_backend("webgpu").device.queue.write_buffer(buf, 0, a2)
    A.attention_backward_arena(buf, group)
    _check_outputs(a2, _read(buf), group, (0.5 * q, k, v, dy, m))


def _group():
    return grouped_arena(np.random.default_rng(50), A.MASK_NONE)


@pytest.mark.parametrize("arena_kind", ["numpy", pytest.param("wgpu", marks=webgpu_only)])
def test_refusals(arena_kind):
    arena, (pq, pk, pv), _ = _group()
    target = _wgpu(arena) if arena_kind == "wgpu" else arena
    cases = [
        ([], ValueError, "empty group"),
        ([pq, dataclasses.replace(pk, q_off=pk.q_off + 1)], ValueError,
         r"params\[1\]\.q_off=.* differs from params\[0\]\.q_off"),
        ([pq, dataclasses.replace(pk, scale_bits=A.f32_bits(0.5))], ValueError,
         r"params\[1\]\.scale_bits"),
        ([pk, dataclasses.replace(pv, wrt=A.WRT_K)], ValueError, r"params\[1\]\.wrt=1 .* repeats"),
        ([pk, dataclasses.replace(pv, out_off=pk.out_off + 3)], ValueError,
         r"overlaps the output of params\[0\]"),
        ([pq, dataclasses.replace(pv, out_off=arena.size - 3)], ValueError,
         r"params\[1\]: .*past the arena's end"),
        ([pq, "not params"], TypeError, r"params\[1\]"),
    ]
    for group, exc, msg in cases:
        with pytest.raises(exc, match=msg):
            A.attention_backward_arena(target, group)
    if arena_kind == "numpy":       # nothing was written by a refused call
        assert np.isnan(A.read_output(arena, pq)).all()


def test_single_params_in_a_list_is_a_group_of_one():
    arena, (pq, _, _), data = _group()
    a1, a2 = arena.copy(), arena.copy()
    A.attention_backward_arena(a1, pq, backend=BACKEND)
    A.attention_backward_arena(a2, [pq.pack()], backend=BACKEND)
    assert np.array_equal(a1.view(np.uint32), a2.view(np.uint32))


def test_validation_memo_never_hides_an_error():
    """A repeat skips the checks only for the same Params (or group) on an arena of the
    same length: the same Params on a shorter arena, or in a bad group, still raise."""
    arena, (pq, pk, pv), _ = _group()
    A.attention_backward_arena(arena.copy(), pq, backend=BACKEND)
    A.attention_backward_arena(arena.copy(), [pq, pk, pv], backend=BACKEND)
    short = arena[:pv.out_off + 2].copy()
    with pytest.raises(ValueError, match="past the arena's end"):
        A.attention_backward_arena(short, pv, backend=BACKEND)
    with pytest.raises(ValueError, match=r"params\[2\]: .*past the arena's end"):
        A.attention_backward_arena(short, [pq, pk, pv], backend=BACKEND)
    with pytest.raises(ValueError, match="repeats"):
        A.attention_backward_arena(arena.copy(), [pq, pk, pk], backend=BACKEND)


@pytest.mark.parametrize("kind", [A.MASK_KEEP, A.MASK_CAUSAL_WINDOW, A.MASK_BIAS])
@pytest.mark.parametrize("backend", [None, BACKEND])
def test_torch_cpu_arena_group(kind, backend):
    """A torch CPU arena: NumPy views (backend=None) or torch views (a named backend),
    the uniform-row correction per member, outputs only."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(60 + kind)
    arena, group, data = grouped_arena(rng, kind)
    t = torch.from_numpy(arena.copy())
    A.attention_backward_arena(t, group, backend=backend)
    _check_outputs(arena, t.numpy(), group, data)
