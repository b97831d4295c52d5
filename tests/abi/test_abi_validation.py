"""Every validation error of the arena entry point: raised before any work, naming the field."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import event, given, settings, strategies as st

from anyattn import abi as A
from anyattn.abi.regions import Region, first_common, first_duplicate

from abi_cases import BACKEND, inputs, mask_for, run_and_check
from helpers import examples

B, H, SQ, SK, D = 2, 2, 3, 4, 5

REGION_FIELDS = {
    "q": ("q_off", "q_batch_stride", "q_head_stride", "q_seq_stride"),
    "k": ("k_off", "k_batch_stride", "k_head_stride", "k_seq_stride"),
    "v": ("v_off", "v_batch_stride", "v_head_stride", "v_seq_stride"),
    "dy": ("dy_off",),
    "mask": ("mask_off", "mask_batch_stride", "mask_head_stride", "seq_q_stride",
             "seq_k_stride"),
    "out": ("out_off", "o_batch_stride", "o_head_stride", "o_seq_stride"),
}


def _case(kind=A.MASK_KEEP, wrt=A.WRT_K, layout="bhsd", seed=0):
    rng = np.random.default_rng(seed)
    q, k, v, dy = inputs(rng, B, H, SQ, SK, D)
    m = mask_for(rng, kind, (B, H, SQ, SK))
    arena, p = A.pack_arena(q, k, v, dy, wrt=wrt, mask_kind=kind, mask=m, layout=layout, gap=1)
    return arena, p, (q, k, v, dy, m)


def _untouched_after_error(arena, p, match, exc=ValueError):
    before = arena.copy()
    with pytest.raises(exc, match=match):
        A.attention_backward_arena(arena, p, backend=BACKEND)
    assert np.array_equal(arena.view(np.uint32), before.view(np.uint32)), \
        "arena changed before the error"


@pytest.mark.parametrize("field", [f for fs in REGION_FIELDS.values() for f in fs])
@pytest.mark.parametrize("kind", [A.MASK_KEEP, A.MASK_BIAS])
def test_every_field_past_the_arena_end(field, kind):
    arena, p, _ = _case(kind)
    p = dataclasses.replace(p, **{field: getattr(p, field) + arena.size})
    _untouched_after_error(arena, p, rf"{field}=\d+.*past the arena's end .*{arena.size} "
                                     "elements")


@pytest.mark.parametrize("field", ["batch", "heads", "seq_q", "seq_k", "head_dim"])
def test_sizes_past_the_arena_end(field):
    arena, p, _ = _case()
    p = dataclasses.replace(p, **{field: getattr(p, field) * 50})
    _untouched_after_error(arena, p, "past the arena's end")


@pytest.mark.parametrize("wrt", [0, 1, 2])
def test_output_rows_follow_wrt(wrt):
    """dQ writes seq_q rows, dK/dV seq_k rows: an arena ending right after R rows is fine."""
    rng = np.random.default_rng(1)
    q, k, v, dy = inputs(rng, 1, 1, 3, 6, 2)
    arena, p = A.pack_arena(q, k, v, dy, wrt=wrt)
    assert arena.size == p.out_off + p.out_rows * 2
    run_and_check(arena, p, q, k, v, dy)
    with pytest.raises(ValueError, match="out_off"):
        A.attention_backward_arena(arena[:-1].copy(), p, backend=BACKEND)


@pytest.mark.parametrize("kind", [A.MASK_NONE, A.MASK_CAUSAL, A.MASK_CAUSAL_WINDOW])
def test_mask_fields_ignored_when_not_read(kind):
    rng = np.random.default_rng(2)
    q, k, v, dy = inputs(rng, B, H, SQ, SK, D)
    arena, p = A.pack_arena(q, k, v, dy, wrt=0, mask_kind=kind, window=1)
    p = dataclasses.replace(p, mask_off=2**32 - 1, mask_batch_stride=2**31, seq_q_stride=7,
                            mask_head_stride=9, seq_k_stride=2**32 - 1)
    run_and_check(arena, p, q, k, v, dy)


@pytest.mark.parametrize("field,val,match", [
    ("head_dim", 0, r"head_dim=0: expected >= 1"),
    ("mask_kind", 5, r"mask_kind=5: expected 0\.\.4"),
    ("mask_kind", 2**32 - 1, r"mask_kind=4294967295"),
    ("wrt", 3, r"wrt=3: expected 0 \(dQ\), 1 \(dK\) or 2 \(dV\)"),
    ("scale_bits", 0x7FC00000, r"scale_bits=0x7fc00000.*finite"),
    ("scale_bits", 0x7F800000, r"scale_bits=0x7f800000.*finite"),
])
def test_bad_kinds_and_values(field, val, match):
    arena, p, _ = _case()
    _untouched_after_error(arena, dataclasses.replace(p, **{field: val}), match)


@pytest.mark.parametrize("name", ["q", "k", "v", "dy", "mask"])
def test_output_overlapping_an_input(name):
    arena, p, _ = _case(A.MASK_BIAS, wrt=A.WRT_Q)
    off = {"q": p.q_off, "k": p.k_off, "v": p.v_off, "dy": p.dy_off, "mask": p.mask_off}[name]
    _untouched_after_error(arena, dataclasses.replace(p, out_off=off),
                           rf"out_off={off}.*overlaps the input {name} ")


def test_output_partly_overlapping_an_input():
    arena, p, _ = _case(A.MASK_NONE, wrt=A.WRT_Q)
    # the output starting at dy's last element overlaps dy there only
    last = p.regions()["dy"].extent()[1]
    assert last < p.out_off
    bad = dataclasses.replace(p, out_off=last)
    _untouched_after_error(arena, bad, rf"overlaps the input dy .* at element {last};")


def test_interleaved_output_sharing_an_input_element():
    """Strides interleave out with q; the intervals overlap, the exact check finds the hit."""
    arena, p, _ = _case(A.MASK_NONE, wrt=A.WRT_Q, layout="bshd")
    # q in [B, S, H, D]; out placed at q's head 1 of the same rows (same strides)
    bad = dataclasses.replace(p, out_off=p.q_off + D, o_batch_stride=p.q_batch_stride,
                              o_head_stride=p.q_head_stride, o_seq_stride=p.q_seq_stride)
    _untouched_after_error(arena, bad, r"overlaps the input q ")


@pytest.mark.parametrize("change,match", [
    (dict(o_seq_stride=0), "written more than once"),
    (dict(o_seq_stride=D - 1), "written more than once"),
    (dict(o_head_stride=0), "written more than once"),
    (dict(o_batch_stride=D), "written more than once"),
])
def test_duplicate_writes(change, match):
    arena, p, _ = _case(A.MASK_NONE, wrt=A.WRT_V)
    _untouched_after_error(arena, dataclasses.replace(p, **change),
                           rf"{next(iter(change))}=\d+.*{match}")


def test_injective_but_not_nested_output_is_accepted():
    """o_head_stride=3, o_seq_stride=2 with D=1: indices h*3 + s*2 are distinct."""
    rng = np.random.default_rng(3)
    q, k, v, dy = inputs(rng, 1, 2, 3, 3, 1)
    arena, p = A.pack_arena(q, k, v, dy, wrt=A.WRT_Q)
    arena = np.concatenate([arena, np.full(8, np.nan, np.float32)])
    p = dataclasses.replace(p, o_head_stride=3, o_seq_stride=2, o_batch_stride=0)
    assert first_duplicate(p.regions()["out"]) is None
    run_and_check(arena, p, q, k, v, dy)


def test_arena_type_errors():
    arena, p, _ = _case()
    with pytest.raises(TypeError, match="arena: expected a 1-D float32"):
        A.attention_backward_arena(list(arena), p)
    with pytest.raises(TypeError, match="arena: dtype float64"):
        A.attention_backward_arena(arena.astype(np.float64), p)
    with pytest.raises(ValueError, match="arena: shape .*expected 1-D"):
        A.attention_backward_arena(arena.reshape(1, -1), p)
    big = np.zeros(2 * arena.size, np.float32)
    with pytest.raises(ValueError, match="arena: stride 8 bytes"):
        A.attention_backward_arena(big[::2], p)
    ro = arena.copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        A.attention_backward_arena(ro, p)
    with pytest.raises(TypeError, match="params: expected anyattn.abi.Params"):
        A.attention_backward_arena(arena, dataclasses.asdict(p))
    with pytest.raises(ValueError, match="152 bytes"):
        A.attention_backward_arena(arena, p.pack()[:-4])
    with pytest.raises(TypeError, match="backend: expected"):
        A.attention_backward_arena(arena, p, backend=3)
    with pytest.raises(ValueError, match="backend='nope' is unknown"):
        A.attention_backward_arena(arena, p, backend="nope")


def test_torch_arena_errors():
    torch = pytest.importorskip("torch")
    arena, p, _ = _case()
    with pytest.raises(TypeError, match="arena: dtype float64"):
        A.attention_backward_arena(torch.zeros(arena.size, dtype=torch.float64), p)
    with pytest.raises(ValueError, match="arena: stride 2"):
        A.attention_backward_arena(torch.zeros(2 * arena.size)[::2], p)
    with pytest.raises(ValueError, match="expected 1-D"):
        A.attention_backward_arena(torch.zeros(1, arena.size), p)
    t = torch.from_numpy(arena.copy())
    with pytest.raises(ValueError, match="q_off"):
        A.attention_backward_arena(t, dataclasses.replace(p, q_off=arena.size))


def test_regions_geometry():
    r = Region("x", 5, (2, 3), (3, 1), ())
    assert r.extent() == (5, 10) and first_duplicate(r) is None
    assert first_duplicate(Region("x", 5, (2, 3), (2, 1), ())) == 7
    assert Region("x", 0, (0, 3), (3, 1), ()).extent() is None
    a = Region("a", 0, (4, 2), (4, 1), ())     # 0 1 4 5 8 9 12 13
    b = Region("b", 2, (4, 2), (4, 1), ())     # 2 3 6 7 ...
    assert first_common(a, b) is None
    assert first_common(a, Region("c", 9, (1,), (1,), ())) == 9
    chunks = list(Region("x", 1, (3, 2, 2), (10, 0, 1), ()).indices(chunk=5))
    assert np.concatenate(chunks).tolist() == [1, 2, 1, 2, 11, 12, 11, 12, 21, 22, 21, 22]


def _brute(off, shape, strides):
    idx = np.full(shape, off, dtype=np.int64)
    for ax, (n, s) in enumerate(zip(shape, strides)):
        sh = [1] * len(shape)
        sh[ax] = n
        idx = idx + (np.arange(n) * s).reshape(sh)
    return idx.reshape(-1)


@settings(max_examples=examples(100, 300), deadline=None)
@given(st.data())
def test_validation_agrees_with_brute_force(data):
    """Random small Params: accepted iff every index is in the arena, the output is
    injective and disjoint from every input (checked by enumerating them all)."""
    d = data.draw
    sizes = dict(batch=d(st.integers(1, 2)), heads=d(st.integers(1, 2)),
                 seq_q=d(st.integers(1, 3)), seq_k=d(st.integers(1, 3)),
                 head_dim=d(st.integers(1, 3)))
    kind = d(st.sampled_from([A.MASK_NONE, A.MASK_KEEP, A.MASK_BIAS]))
    fields = {n: d(st.integers(0, 160) if n.endswith("_off") else st.integers(0, 12))
              for n in A.FIELD_NAMES if n.endswith(("_off", "_stride")) and n[0] != "_"}
    p = A.Params(**sizes, **fields, mask_kind=kind, wrt=d(st.sampled_from([0, 1, 2])))
    n = d(st.integers(1, 250))
    regs = p.regions()
    sets = {k: _brute(r.off, r.shape, r.strides) for k, r in regs.items()}
    out = sets.pop("out")
    ok = (all(s.max() < n for s in sets.values()) and out.max() < n
          and np.unique(out).size == out.size
          and not any(np.intersect1d(out, s).size for s in sets.values()))
    event("accepted" if ok else "rejected")
    if ok:
        p.validate(n)
        rng = np.random.default_rng(0)
        arena = rng.standard_normal(n).astype(np.float32)
        arena[out] = np.nan
        before = arena.copy()
        A.attention_backward_arena(arena, p, backend=BACKEND)
        changed = np.nonzero(arena.view(np.uint32) != before.view(np.uint32))[0]
        assert set(changed.tolist()) <= set(out.tolist())
        assert not np.isnan(arena[out]).any() or np.isnan(before[np.concatenate(
            list(sets.values()))]).any()
    else:
        with pytest.raises(ValueError, match="Params"):
            p.validate(n)


def test_backend_that_cannot_take_the_arena_is_refused_cleanly():
    """A NumPy arena on the triton backend (torch only): a clear error, arena untouched."""
    from anyattn import BackendUnavailable

    arena, p, _ = _case()
    before = arena.copy()
    with pytest.raises((BackendUnavailable, NotImplementedError), match="backend='triton'"):
        A.attention_backward_arena(arena, p, backend="triton")
    assert np.array_equal(arena.view(np.uint32), before.view(np.uint32))


# ------------------------------------------------- geometry without enumeration
def _huge_params(log_rows=16, **change):
    """[1, 1, R, D] tensors with R = D = 2**log_rows, all inputs at offset 0 (2**32
    elements each by default; nothing is allocated: validate() takes the arena length)."""
    R = D_ = 1 << log_rows
    f = dict(batch=1, heads=1, seq_q=R, seq_k=R, head_dim=D_, wrt=A.WRT_Q,
             q_off=0, k_off=0, v_off=0, dy_off=0, out_off=0,
             q_batch_stride=0, q_head_stride=0, q_seq_stride=D_,
             k_batch_stride=0, k_head_stride=0, k_seq_stride=D_,
             v_batch_stride=0, v_head_stride=0, v_seq_stride=D_,
             o_batch_stride=0, o_head_stride=0, o_seq_stride=D_)
    f.update(change)
    return A.Params(**f)


@pytest.mark.parametrize("change,match", [
    (dict(o_seq_stride=1), r"o_seq_stride=1\b.*written more than once"),   # 2**32 overlaps
    (dict(o_seq_stride=(1 << 16) - 3), "written more than once"),
    (dict(out_off=(1 << 32) - 1), r"overlaps the input q .* at element 4294967295;"),
])
def test_huge_overlaps_are_found_in_constant_time(change, match):
    """Before: 2**32 overlapping elements were enumerated (2**28 took 24 s; 2**32: 83 s,
    then MemoryError)."""
    import time

    p = _huge_params(**change)
    t = time.perf_counter()
    with pytest.raises(ValueError, match=match):
        p.validate(1 << 40)
    assert time.perf_counter() - t < 0.5


def test_huge_interleaved_disjoint_regions_are_accepted_in_constant_time():
    """Every input on the even rows of a [2R, D] block, the output on the odd ones: the
    extents overlap, no element does.  Decided exactly without enumerating 2**30 indices
    per region (before: about 2 minutes)."""
    import time

    D_ = 1 << 15
    p = _huge_params(15, q_seq_stride=2 * D_, k_seq_stride=2 * D_, v_seq_stride=2 * D_,
                     out_off=D_, o_seq_stride=2 * D_)
    t = time.perf_counter()
    p.validate(1 << 32)
    assert time.perf_counter() - t < 0.5
    row = 2 * D_ - 2                       # onto the inputs' last row
    with pytest.raises(ValueError, match=r"overlaps the input q .* at element \d+;") as ei:
        dataclasses.replace(p, out_off=row * D_).validate(1 << 32)
    hit = int(str(ei.value).split("at element ")[1].split(";")[0])
    assert row * D_ <= hit < (row + 1) * D_        # an element of that row


def _brute_region(r):
    return _brute(r.off, r.shape, r.strides)


def test_region_checks_agree_with_brute_force_on_random_geometry():
    """Duplicates and common elements on 3000 random small regions: the solver's answer
    exists iff the enumeration finds one, and the element it names is a real hit."""
    rng = np.random.default_rng(7)
    choices = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 12, 15, 16, 20, 24, 30, 36]

    def region(name):
        nd = int(rng.integers(1, 5))
        return Region(name, int(rng.integers(0, 60)), tuple(int(x) for x in
                      rng.integers(1, 7, nd)), tuple(int(x) for x in rng.choice(choices, nd)),
                      ())

    for _ in range(3000):
        a, b = region("a"), region("b")
        ia, ib = _brute_region(a), _brute_region(b)
        d = first_duplicate(a)
        assert (d is not None) == (np.unique(ia).size < ia.size), a
        assert d is None or (ia == d).sum() >= 2, (a, d)
        c = first_common(a, b)
        common = np.intersect1d(ia, ib)
        assert (c is not None) == (common.size > 0), (a, b)
        assert c is None or c in common, (a, b, c)


def test_solver_out_of_budget(monkeypatch):
    """Past its budget the solver enumerates small regions (still exact) and refuses
    large ones with a ValueError that names the fields (never a wrong answer)."""
    from anyattn.abi import regions as abi_regions

    monkeypatch.setattr(abi_regions, "BUDGET", 0)
    assert first_duplicate(Region("x", 5, (2, 3), (2, 1), ())) == 7
    a = Region("a", 0, (4, 2), (4, 1), ())
    assert first_common(a, Region("b", 2, (4, 2), (4, 1), ())) is None
    with pytest.raises(ValueError, match=r"o_seq_stride=1\b.*cannot prove"):
        _huge_params(o_seq_stride=1).validate(1 << 40)


@pytest.mark.parametrize("scale", [1e39, -1e39, float("inf"), float("nan")])
def test_scale_that_is_no_float32_is_refused(scale):
    """Params(scale=1e39) was an unnamed OverflowError from struct; now a ValueError."""
    _, p, _ = _case()
    fields_ = {f: getattr(p, f) for f in A.FIELD_NAMES if f != "scale_bits"}
    with pytest.raises(ValueError, match=r"Params\.scale=.*not a finite float32"):
        A.Params(**fields_, scale=scale)


def test_big_endian_arena_is_refused_with_a_true_message():
    arena, p, _ = _case()
    be = arena.astype(">f4")
    with pytest.raises(TypeError, match=r"arena: dtype >f4 is float32 in non-native "
                                        r"\(big-endian\) byte order.*astype\('<f4'\)"):
        A.attention_backward_arena(be, p, backend=BACKEND)
    assert np.array_equal(be, arena, equal_nan=True)


@pytest.mark.parametrize("which", ["v", "dy", "k"])
def test_pack_arena_refuses_a_value_head_dim(which):
    """The seed's ABI has one head_dim: v (or dy) with a head dim of its own (Dv != D), or
    a k of another shape, is refused by name before an arena is made (the Params could
    not describe it; anyattn.attention_backward takes Dv != D)."""
    rng = np.random.default_rng(3)
    q, k, v, dy = inputs(rng, B, H, SQ, SK, D)
    x = {"v": v, "dy": dy, "k": k}[which]
    bad = np.concatenate([x, x[..., :2]], axis=-1)
    args = dict(q=q, k=k, v=v, dy=dy)
    args[which] = bad
    with pytest.raises(ValueError, match=rf"^{which}: shape .*one head_dim for q, k, v and dy"):
        A.pack_arena(**args, wrt=A.WRT_V)
