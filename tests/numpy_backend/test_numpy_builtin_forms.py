"""Score functions that spell softcap or ALiBi exactly (anyattn.programs.builtin_forms):
recognised on their graph, run by the NumPy backend as the built-in (bitwise its
result), near misses left as functions (and still right against the float64 reference).

Shape legend: B batch, Hq/Hkv heads, Sq/Sk queries/keys, D head dim."""
import math

import numpy as np
import pytest

import anyattn as aa
from anyattn import math as am
from anyattn.programs.builtin_forms import Alibi, Scale, Softcap, band_where, match_builtin

from helpers import assert_close
from np_util import qkv

TILES = dict(fwd_bq=32, fwd_bk=16, bwd_bq=16, bwd_bk=32)
H = 4
SLOPES = (2.0 ** -np.arange(1, H + 1)).astype(np.float32)
SLOPES_B = np.stack([SLOPES, 0.5 * SLOPES])          # [B=2, Hq]


def _form(fn, sizes=(2, H, 40, 56), **caps):
    sm = aa.ScoreMod(fn, **caps)
    return match_builtin(sm.program, sizes)


@pytest.mark.parametrize("fn, want", [
    (lambda s, b, h, i, j: 30.0 * np.tanh(s / 30.0), Softcap(30.0)),
    (lambda s, b, h, i, j: np.tanh(s / 5.0) * 5.0, Softcap(5.0)),
    (lambda s, b, h, i, j: 7.0 * am.tanh(s / 7.0), Softcap(7.0)),
])
def test_softcap_spellings_are_recognised(fn, want):
    assert _form(fn) == want


def test_softcap_with_torch_tanh_is_recognised():
    torch = pytest.importorskip("torch")
    assert _form(lambda s, b, h, i, j: 2.5 * torch.tanh(s / 2.5)) == Softcap(2.5)


@pytest.mark.parametrize("fn, want", [
    (lambda s, b, h, i, j, slopes: s - slopes[h] * abs(i - j), Alibi("slopes", 0, False)),
    (lambda s, b, h, i, j, slopes: s - abs(j - i) * slopes[h], Alibi("slopes", 0, False)),
    (lambda s, b, h, i, j, slopes: s - slopes[h] * abs(i - j + 16),
     Alibi("slopes", 16, False)),
    (lambda s, b, h, i, j, slopes: s - slopes[h] * abs(i + 16 - j),
     Alibi("slopes", 16, False)),
    (lambda s, b, h, i, j, slopes: s - slopes[h] * abs(j - (i + 16)),
     Alibi("slopes", 16, False)),
    (lambda s, b, h, i, j, slopes: s - slopes[h] * abs(-(j - i) - 3),
     Alibi("slopes", -3, False)),
])
def test_alibi_spellings_are_recognised(fn, want):
    assert _form(fn, slopes=SLOPES) == want


def test_alibi_per_batch_slopes_are_recognised():
    fn = lambda s, b, h, i, j, sl: s - sl[b, h] * abs(i - j)      # noqa: E731
    assert _form(fn, sl=SLOPES_B) == Alibi("sl", 0, True)


@pytest.mark.parametrize("fn", [
    lambda s, b, h, i, j: 30.0 * np.tanh(s / 20.0),               # two constants
    lambda s, b, h, i, j: -3.0 * np.tanh(s / -3.0),               # c <= 0
    lambda s, b, h, i, j: 30.0 * np.tanh(s * (1 / 30.0)),          # not s / c
    lambda s, b, h, i, j: 30.0 * np.tanh(s / 30.0) + 1.0,          # an extra term
    lambda s, b, h, i, j: math.inf * np.tanh(s / math.inf),       # not finite
    lambda s, b, h, i, j: 2.0 * np.tanh((s + 0.0) / 2.0),         # not the score itself
])
def test_softcap_near_misses_stay_functions(fn):
    assert _form(fn) is None


@pytest.mark.parametrize("fn", [
    lambda s, b, h, i, j, slopes: s + slopes[h] * abs(i - j),      # sign
    lambda s, b, h, i, j, slopes: s - slopes[h] * abs(i + j),      # not a difference
    lambda s, b, h, i, j, slopes: s - slopes[h] * abs(2 * i - j),  # a coefficient
    lambda s, b, h, i, j, slopes: s - slopes[h] * (i - j),         # no abs
    lambda s, b, h, i, j, slopes: s - slopes[b] * abs(i - j),      # not the head
    lambda s, b, h, i, j, slopes: 2.0 * s - slopes[h] * abs(i - j),
    lambda s, b, h, i, j, slopes: s - slopes[h] * abs(i - j) * 1.0,
    lambda s, b, h, i, j, slopes: s - slopes[h] * am.abs(1.0 * i - j),  # a float distance
])
def test_alibi_near_misses_stay_functions(fn):
    assert _form(fn, slopes=SLOPES) is None


def test_alibi_with_slopes_of_another_shape_stays_a_function():
    fn = lambda s, b, h, i, j, sl: s - sl[h] * abs(i - j)          # noqa: E731
    assert _form(fn, sl=np.ones(H + 1, np.float32)) is None         # [Hq + 1]
    fn2 = lambda s, b, h, i, j, sl: s - sl[b, h] * abs(i - j)      # noqa: E731
    assert _form(fn2, sizes=(3, H, 40, 56), sl=SLOPES_B) is None     # [2, Hq] with B = 3


def _f64(*xs):
    return [x.astype(np.float64) for x in xs]


def _run(kw, q, k, v, g, wrt=("q", "k", "v"), **extra):
    out, lse = aa.attention(q, k, v, return_lse=True, backend="numpy", **kw, **extra)
    gr = aa.attention_backward(q, k, v, g, wrt=wrt, backend="numpy", **kw, **extra)
    return out, lse, gr


def _cases():
    br = aa.Causal("bottom_right")
    return {
        "softcap": (dict(score_mod=lambda s, b, h, i, j: 5.0 * np.tanh(s / 5.0)),
                    dict(softcap=5.0)),
        "softcap_causal": (dict(score_mod=lambda s, b, h, i, j: 30.0 * np.tanh(s / 30.0),
                                mask=br), dict(softcap=30.0, mask=br)),
        "alibi": (dict(score_mod=aa.ScoreMod(lambda s, b, h, i, j, sl:
                                             s - sl[h] * abs(i - j + 16), sl=SLOPES),
                       mask=br), dict(alibi_slopes=SLOPES, mask=br)),
        "alibi_per_batch": (dict(score_mod=aa.ScoreMod(lambda s, b, h, i, j, sl:
                                                       s - sl[b, h] * abs(j - i - 16),
                                                       sl=SLOPES_B)),
                            dict(alibi_slopes=SLOPES_B)),
    }


@pytest.mark.parametrize("name", sorted(_cases()))
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_spelled_builtins_give_the_builtins_bits(name, dtype, np_config):
    """The function runs as the built-in: forward, lse and gradients bitwise equal, and
    within tolerance of the function's own float64 reference."""
    np_config(threads=2, **TILES)
    fn_kw, bi_kw = _cases()[name]
    q, k, v, g = qkv(11, 2, H, 2, 40, 56, 16, dtype)
    fo, fl, fg = _run(fn_kw, q, k, v, g)
    bo, bl, bg = _run(bi_kw, q, k, v, g)
    np.testing.assert_array_equal(fo, bo)
    np.testing.assert_array_equal(fl, bl)
    for n in ("dq", "dk", "dv"):
        np.testing.assert_array_equal(getattr(fg, n), getattr(bg, n), err_msg=n)
    ro = aa.attention(*_f64(q, k, v), backend="reference", **fn_kw)
    rg = aa.attention_backward(*_f64(q, k, v, g), backend="reference", **fn_kw)
    assert_close(fo, ro, dtype, f"{name} out")
    for n in ("dq", "dk", "dv"):
        assert_close(getattr(fg, n), getattr(rg, n), dtype, f"{name} {n}")


def test_alibi_function_with_the_slopes_gradient_and_offsets(np_config):
    """The slopes' gradient keeps the function's backward; q_offset moves the built-in's
    diagonal, not the function's local indices (no match there): both right."""
    np_config(threads=2, **TILES)
    q, k, v, g = qkv(12, 1, H, 2, 40, 56, 16, "float32")
    sm = aa.ScoreMod(lambda s, b, h, i, j, sl: s - sl[h] * abs(i - j + 16), sl=SLOPES)
    for extra, wrt in (({}, ("q", "k", "v", "sl")),
                       (dict(q_offset=5), ("q", "k", "v")),
                       (dict(q_offset=5), ("q", "k", "v", "sl"))):
        fo, _, fg = _run(dict(score_mod=sm), q, k, v, g, wrt, **extra)
        ro = aa.attention(*_f64(q, k, v), backend="reference", score_mod=sm, **extra)
        rg = aa.attention_backward(*_f64(q, k, v, g), wrt=wrt, backend="reference",
                                   score_mod=sm, **extra)
        assert_close(fo, ro, "float32", f"out {extra}")
        for n in ("dq", "dk", "dv"):
            assert_close(getattr(fg, n), getattr(rg, n), "float32", f"{n} {extra}")
        if "sl" in wrt:
            assert_close(fg.dcaptures["sl"], rg.dcaptures["sl"], "float32", f"dsl {extra}")


def test_a_softcap_function_on_top_of_softcap_stays_a_function(np_config):
    """softcap= then the function (two caps): not folded into one built-in."""
    np_config(**TILES)
    q, k, v, g = qkv(13, 1, H, H, 40, 40, 16, "float32")
    kw = dict(softcap=3.0, score_mod=lambda s, b, h, i, j: 2.0 * np.tanh(s / 2.0))
    fo, _, fg = _run(kw, q, k, v, g)
    ro = aa.attention(*_f64(q, k, v), backend="reference", **kw)
    rg = aa.attention_backward(*_f64(q, k, v, g), backend="reference", **kw)
    assert_close(fo, ro, "float32", "out")
    for n in ("dq", "dk", "dv"):
        assert_close(getattr(fg, n), getattr(rg, n), "float32", n)


def _split(fn, **caps):
    return band_where(aa.ScoreMod(fn, **caps).program)


def test_where_band_minus_inf_splits_into_the_band_and_the_function():
    fn = lambda s, b, h, i, j, t: am.where(j <= i + 16, s * t[h], -math.inf)   # noqa: E731
    bands, rest = _split(fn, t=SLOPES)
    assert bands == [(None, 16)]
    assert rest.out.op == "mul"
    fn2 = lambda s, b, h, i, j: am.where((j <= i) & (abs(i - j) <= 8), s, -math.inf)  # noqa
    bands, rest = _split(fn2)
    assert sorted(bands, key=str) == sorted([(None, 0), (-8, 8)], key=str)
    assert rest.out.op == "input"


@pytest.mark.parametrize("fn", [
    lambda s, b, h, i, j: am.where(j <= i, s, 0.0),                     # not -inf
    lambda s, b, h, i, j: am.where(j <= i, -math.inf, s),                # branches swapped
    lambda s, b, h, i, j: am.where(j % 2 == 0, s, -math.inf),            # not a band
    lambda s, b, h, i, j: am.where((j <= i) & (j % 2 == 0), s, -math.inf),  # partly
    lambda s, b, h, i, j: am.where(s > 0, s, -math.inf),                 # reads the score
])
def test_where_near_misses_stay_functions(fn):
    assert _split(fn) is None


def test_a_where_band_function_skips_the_bands_empty_tiles(np_config):
    """where(kv <= q + (Sk - Sq), s·t[h], -inf) runs as Causal('bottom_right') with the
    function s·t[h]: the same bits, and the tiles above the diagonal are skipped."""
    be = np_config(threads=2, **TILES)
    q, k, v, g = qkv(14, 2, H, 2, 40, 56, 16, "float32")
    t = (1.0 + 0.2 * np.random.default_rng(3).standard_normal(H)).astype(np.float32)
    fn = aa.ScoreMod(lambda s, b, h, i, j, t: am.where(j <= i + 16, s * t[h], -math.inf), t=t)
    spelled = dict(score_mod=aa.ScoreMod(lambda s, b, h, i, j, t: s * t[h], t=t),
                   mask=aa.Causal("bottom_right"))
    wrt = ("q", "k", "v", "t")
    fo, fl, fg = _run(dict(score_mod=fn), q, k, v, g, wrt)
    so, sl, sg = _run(spelled, q, k, v, g, wrt)
    np.testing.assert_array_equal(fo, so)
    np.testing.assert_array_equal(fl, sl)
    for n in ("dq", "dk", "dv"):
        np.testing.assert_array_equal(getattr(fg, n), getattr(sg, n), err_msg=n)
    np.testing.assert_array_equal(fg.dcaptures["t"], sg.dcaptures["t"])
    aa.attention(q, k, v, backend="numpy", score_mod=fn)
    assert be.last_counts["forward"].skipped > 0
    aa.attention_backward(q, k, v, g, wrt=wrt, backend="numpy", score_mod=fn)
    assert be.last_counts["backward"].skipped > 0
    ro = aa.attention(*_f64(q, k, v), backend="reference", score_mod=fn)
    rg = aa.attention_backward(*_f64(q, k, v, g), wrt=wrt, backend="reference", score_mod=fn)
    assert_close(fo, ro, "float32", "out")
    for n in ("dq", "dk", "dv"):
        assert_close(getattr(fg, n), getattr(rg, n), "float32", n)
    assert_close(fg.dcaptures["t"], rg.dcaptures["t"], "float32", "dt")


def test_scatter_add_at_scalar_indices_sums_in_float64():
    """A capture read at (b, h) only: the tile's contributions go to one element."""
    from anyattn.programs.bound import scatter_add
    rng = np.random.default_rng(5)
    vals = rng.standard_normal((33, 17)).astype(np.float32)
    dst = np.zeros((2, H))
    scatter_add(dst, [np.int64(1), np.int32(3)], vals)
    want = np.zeros((2, H))
    want[1, 3] = vals.astype(np.float64).sum()
    np.testing.assert_allclose(dst, want, rtol=1e-12)
    scatter_add(dst, [np.int64(0), np.int64(2)], vals[:, :1])      # broadcast [33, 1]
    assert dst[0, 2] == pytest.approx(vals[:, 0].astype(np.float64).sum(), rel=1e-12)


@pytest.mark.parametrize("fn, diagonal", [
    (lambda s, b, h, i, j, t: s - t[h, 0] * abs(i - j), True),
    (lambda s, b, h, i, j, t: s + t[h, i - j + 55], True),
    (lambda s, b, h, i, j, t: am.where((i - j) % 3 == 0, s, s * t[h, (j - i) // 2 + 40]),
     True),
    (lambda s, b, h, i, j, t: am.where(j <= i + 3, s, 0.0), True),
    (lambda s, b, h, i, j, t: s + t[h, i // 2 - j // 2 + 40], False),   # not of i - j
    (lambda s, b, h, i, j, t: s * t[h, i % 7], False),
])
def test_diagonal_subexpressions_give_the_per_pair_values(fn, diagonal, np_config):
    """The score function with its diagonal nodes as Toeplitz views equals the per-pair
    evaluation bit for bit (value and derivatives), on tiles of every position (Sq != Sk)."""
    from anyattn.programs.bound import ScoreTiles
    from anyattn.programs.evaluate import evaluate
    rng = np.random.default_rng(4)
    sm = aa.ScoreMod(fn, t=rng.standard_normal((H, 96)).astype(np.float32))
    bound = sm.bind((2, H, 40, 56))
    tiles = ScoreTiles(bound, np.dtype(np.float32), wrt=frozenset({"t"}))
    assert bool(tiles.grad_diag) == diagonal
    for (i0, i1, j0, j1) in ((0, 40, 0, 56), (5, 17, 30, 56), (32, 40, 0, 9)):
        st = rng.standard_normal((j1 - j0, i1 - i0)).astype(np.float32)
        env = {"score": st.copy(), "b": 1, "h": 2,
               "q_idx": np.arange(i0, i1)[None, :], "kv_idx": np.arange(j0, j1)[:, None]}
        memo = {}
        want = evaluate(tiles.outs, env, tiles.caps, np.dtype(np.float32), memo)
        got_st = st.copy()
        new, dsc, gath = tiles.apply_grad_t(got_st, 1, 2, i0, i1, j0, j1)
        np.testing.assert_array_equal(new, np.broadcast_to(want[0], st.shape))
        if dsc is not None:
            np.testing.assert_array_equal(np.broadcast_to(dsc, st.shape),
                                          np.broadcast_to(want[1], st.shape))
        for (name, idx, dg), (g, _), w in zip(gath, tiles.dgathers, want[2:]):
            np.testing.assert_array_equal(np.broadcast_to(dg, st.shape),
                                          np.broadcast_to(w, st.shape))
            for a, x in zip(g.args, idx):
                np.testing.assert_array_equal(np.broadcast_to(x, st.shape),
                                              np.broadcast_to(memo[a.uid], st.shape))
        got = st.copy()
        tiles.apply_t(got, 1, 2, i0, i1, j0, j1)
        np.testing.assert_array_equal(got, np.broadcast_to(want[0], st.shape))


def test_diagonal_mask_functions_give_the_per_pair_keep():
    from anyattn.programs.evaluate import evaluate
    mm = aa.MaskMod(lambda b, h, i, j: ((i - j) % 3 == 0) & ((i - j) // 3 <= 6))
    bound = mm._bound_function(1, H, 40, 56, 0, 0)
    assert bound._diagonal
    for (i0, i1, j0, j1) in ((0, 40, 0, 56), (5, 17, 30, 56), (32, 40, 0, 9)):
        env = {"b": 0, "h": 0, "q_idx": np.arange(i0, i1)[None, :],
               "kv_idx": np.arange(j0, j1)[:, None]}
        want, = evaluate([bound.program.out], env, {}, np.dtype(np.float64))
        np.testing.assert_array_equal(bound.keep_t(0, 0, i0, i1, j0, j1), want)


@pytest.mark.parametrize("fn, caps, want", [
    (lambda s, b, h, i, j, t: s * t[h], dict(t=SLOPES), Scale("t", False)),
    (lambda s, b, h, i, j, t: t[h] * s, dict(t=SLOPES), Scale("t", False)),
    (lambda s, b, h, i, j, t: s * t[b, h], dict(t=SLOPES_B), Scale("t", True)),
    (lambda s, b, h, i, j: s * 0.5, {}, Scale(None, False, 0.5)),
    (lambda s, b, h, i, j, t: s * t[b], dict(t=SLOPES), None),        # not the head
    (lambda s, b, h, i, j, t: s * t[h] + 0.0, dict(t=SLOPES), None),
    (lambda s, b, h, i, j: s * s, {}, None),
])
def test_per_head_factors_are_recognised(fn, caps, want):
    assert _form(fn, **caps) == want


@pytest.mark.parametrize("per_batch", [False, True])
def test_a_per_head_factor_folds_into_the_queries_of_the_forward(per_batch, np_config):
    """score * t[h]: the forward is the plain problem on q·t[h] (its bits), the backward
    stays the function's; both within tolerance of the float64 reference."""
    np_config(threads=2, **TILES)
    q, k, v, g = qkv(15, 2, H, 2, 40, 56, 16, "float32")
    t = SLOPES_B * 3.0 if per_batch else SLOPES * 3.0
    fn = (lambda s, b, h, i, j, t: s * t[b, h]) if per_batch else \
        (lambda s, b, h, i, j, t: s * t[h])
    kw = dict(score_mod=aa.ScoreMod(fn, t=t), mask=aa.Causal("bottom_right"))
    fo, fl = aa.attention(q, k, v, return_lse=True, backend="numpy", **kw)
    tq = (t if per_batch else t[None])[:, :, None, None]
    qt = q * tq.astype(np.float32)
    bo, bl = aa.attention(qt, k, v, return_lse=True, backend="numpy",
                          mask=aa.Causal("bottom_right"))
    np.testing.assert_array_equal(fo, bo)
    np.testing.assert_array_equal(fl, bl)
    wrt = ("q", "k", "v", "t")
    fg = aa.attention_backward(q, k, v, g, wrt=wrt, backend="numpy", **kw)
    ro = aa.attention(*_f64(q, k, v), backend="reference", **kw)
    rg = aa.attention_backward(*_f64(q, k, v, g), wrt=wrt, backend="reference", **kw)
    assert_close(fo, ro, "float32", "out")
    for n in ("dq", "dk", "dv"):
        assert_close(getattr(fg, n), getattr(rg, n), "float32", n)
    assert_close(fg.dcaptures["t"], rg.dcaptures["t"], "float32", "dt")


def test_a_non_finite_factor_is_not_folded():
    from anyattn.backends.numpy_backend import _fold_scale, _fold_scale_form
    from anyattn.problem import describe
    q, k, v, _ = qkv(16, 1, H, H, 8, 8, 4, "float32")
    for t, folded in ((SLOPES, True), (np.array([1, np.inf, 1, 1], np.float32), False),
                      (np.array([1, np.nan, 1, 1], np.float32), False)):
        p = describe(q, k, v, score_mod=aa.ScoreMod(lambda s, b, h, i, j, t: s * t[h], t=t))
        scale = _fold_scale_form(p)
        assert scale == Scale("t", False)
        p3, q3 = _fold_scale(p, q, scale)
        assert (p3.score_mod is None) == folded
        assert (q3 is q) != folded


def test_a_per_head_factor_after_softcap_is_not_folded(np_config):
    """softcap= then score * t[h]: the factor applies after the cap, not inside tanh."""
    np_config(**TILES)
    q, k, v, g = qkv(17, 1, H, H, 40, 40, 16, "float32")
    kw = dict(softcap=2.0, score_mod=aa.ScoreMod(lambda s, b, h, i, j, t: s * t[h],
                                                 t=SLOPES * 4.0))
    fo = aa.attention(q, k, v, backend="numpy", **kw)
    ro = aa.attention(*_f64(q, k, v), backend="reference", **kw)
    assert_close(fo, ro, "float32", "out")


def test_a_where_band_function_with_offsets_and_a_window(np_config):
    """The band of where(...) is on local indices (as the function's); q_offset moves
    only the built-in Window it meets."""
    np_config(**TILES)
    q, k, v, g = qkv(18, 1, H, H, 40, 56, 16, "float32")
    fn = aa.ScoreMod(lambda s, b, h, i, j: am.where(abs(i - j) <= 20, 0.5 * s, -math.inf))
    for extra in (dict(q_offset=7), dict(q_offset=7, mask=aa.Window(left=9, right=30))):
        fo = aa.attention(q, k, v, backend="numpy", score_mod=fn, **extra)
        fg = aa.attention_backward(q, k, v, g, backend="numpy", score_mod=fn, **extra)
        ro = aa.attention(*_f64(q, k, v), backend="reference", score_mod=fn, **extra)
        rg = aa.attention_backward(*_f64(q, k, v, g), backend="reference", score_mod=fn,
                                   **extra)
        assert_close(fo, ro, "float32", f"out {extra}")
        for n in ("dq", "dk", "dv"):
            assert_close(getattr(fg, n), getattr(rg, n), "float32", f"{n} {extra}")
