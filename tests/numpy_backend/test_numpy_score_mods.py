"""Score and mask functions on the NumPy backend: the gallery against the float64
reference (forward, lse and every gradient, captures included), GQA and Sq != Sk, the
functions that spell a built-in against the built-in, tile skipping, composition with
the other modifiers.

Shape legend: B batch, Hq/Hkv heads, Sq/Sk queries/keys, D head dim."""

import numpy as np
import pytest

import anyattn as aa

from helpers import assert_close, load_gallery
from np_util import qkv

gallery = load_gallery()

TILES = dict(fwd_bq=32, fwd_bk=16, bwd_bq=16, bwd_bk=32)


def _sizes(square):
    return (48, 48) if square else (40, 56)          # Sq != Sk where the entry allows


def _f64(*xs):
    return [x.astype(np.float64) for x in xs]


def _run(kw, q, k, v, g, wrt):
    out, lse = aa.attention(q, k, v, return_lse=True, backend="numpy", **kw)
    grads = aa.attention_backward(q, k, v, g, wrt=wrt, backend="numpy", **kw)
    return out, lse, grads


@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("name", sorted(gallery.GALLERY))
def test_gallery_matches_the_float64_reference(name, dtype, np_config):
    np_config(threads=2, **TILES)
    make, square = gallery.GALLERY[name]
    sq, sk = _sizes(square)
    q, k, v, g = qkv(hash(name) % 1000, 2, 4, 2, sq, sk, 16, dtype)     # GQA 4 : 2
    e = make(2, 4, sq, sk, np.random.default_rng(7))
    wrt = ("q", "k", "v") + e.wrt
    out, lse, gr = _run(e.kwargs, q, k, v, g, wrt)
    ro, rl = aa.attention(*_f64(q, k, v), return_lse=True, backend="reference", **e.kwargs)
    rg = aa.attention_backward(*_f64(q, k, v, g), wrt=wrt, backend="reference", **e.kwargs)
    assert_close(out, ro, dtype, f"{name} out")
    fin = np.isfinite(rl)
    np.testing.assert_array_equal(np.isfinite(lse), fin)
    assert_close(lse[fin], rl[fin], dtype, f"{name} lse")
    for n in ("dq", "dk", "dv"):
        assert_close(getattr(gr, n), getattr(rg, n), dtype, f"{name} {n}")
    for n in e.wrt:
        assert gr.dcaptures[n].dtype == e.kwargs["score_mod"].captures[n].dtype
        assert_close(gr.dcaptures[n], rg.dcaptures[n], dtype, f"{name} d{n}")


@pytest.mark.parametrize("name", sorted(n for n, (m, _) in gallery.GALLERY.items()
                                        if m(1, 2, 8, 8, np.random.default_rng(0)).builtin))
def test_functions_that_spell_a_builtin_give_its_result(name, np_config):
    np_config(**TILES)
    make, square = gallery.GALLERY[name]
    sq, sk = _sizes(square)
    q, k, v, g = qkv(3, 1, 4, 4, sq, sk, 16, "float32")
    e = make(1, 4, sq, sk, np.random.default_rng(1))
    out, lse, gr = _run(e.kwargs, q, k, v, g, ("q", "k", "v"))
    bo, bl, bg = _run(e.builtin, q, k, v, g, ("q", "k", "v"))
    ro = aa.attention(*_f64(q, k, v), backend="reference", **e.builtin)
    rg = aa.attention_backward(*_f64(q, k, v, g), backend="reference", **e.builtin)
    assert_close(out, ro, "float32", f"{name} out vs the built-in's reference")
    assert_close(bo, ro, "float32", f"{name} built-in out")
    for n in ("dq", "dk", "dv"):
        assert_close(getattr(gr, n), getattr(rg, n), "float32", f"{name} {n}")


def test_mask_functions_skip_empty_tiles_and_evaluate_partial_ones_only(np_config):
    """chunked attention (chunks of 16) on 16 x 16 tiles: the tile map has the same
    empty / partial / full tiles as the built-in Causal() & Documents(chunk ids)."""
    be = np_config(fwd_bq=16, fwd_bk=16, bwd_bq=16, bwd_bk=16, threads=1)
    q, k, v, g = qkv(4, 1, 2, 2, 64, 64, 8, "float32")
    chunk = gallery.chunked(1, 2, 64, 64, None, chunk=16).kwargs["mask"]
    ids = np.arange(64) // 16
    builtin = aa.Causal() & aa.Documents(ids)
    aa.attention(q, k, v, mask=chunk)
    fn_counts = be.last_counts["forward"]
    aa.attention(q, k, v, mask=builtin)
    bi_counts = be.last_counts["forward"]
    assert (fn_counts.full, fn_counts.partial, fn_counts.skipped) == \
        (bi_counts.full, bi_counts.partial, bi_counts.skipped) == (0, 8, 24)
    np.testing.assert_array_equal(aa.attention(q, k, v, mask=chunk),
                                  aa.attention(q, k, v, mask=builtin))


def test_rows_a_mask_function_empties_give_zero_not_nan(np_config):
    np_config(**TILES)
    q, k, v, g = qkv(5, 1, 2, 2, 40, 40, 8, "float32")
    mask = aa.MaskMod(lambda b, h, i, j: (i % 4 != 1) & (j <= i))
    sm = aa.ScoreMod(lambda s, b, h, i, j, t: s * t[h], t=np.ones(2, np.float32))
    out, lse, gr = _run(dict(mask=mask, score_mod=sm), q, k, v, g, ("q", "k", "v", "t"))
    assert (out[:, :, 1::4] == 0).all() and np.isneginf(lse[:, :, 1::4]).all()
    for x in (gr.dq, gr.dk, gr.dv, gr.dcaptures["t"]):
        assert np.isfinite(x).all()
    assert (gr.dq[:, :, 1::4] == 0).all()


@pytest.mark.parametrize("extra", ["softcap_bias", "dropout_sinks"])
def test_score_functions_compose_with_the_other_arguments(extra, np_config):
    """score_mod after softcap and before bias and masks; with dropout and sinks."""
    np_config(**TILES)
    q, k, v, g = qkv(6, 2, 4, 2, 40, 56, 16, "float32")
    rng = np.random.default_rng(8)
    tab = rng.standard_normal((4, 96)).astype(np.float32)
    sm = aa.ScoreMod(lambda s, b, h, i, j, tab: s * 0.5 + tab[h, i - j + 55], tab=tab)
    kw = dict(score_mod=sm, mask=aa.Causal("bottom_right") | aa.MaskMod(
        lambda b, h, i, j: j < 3))
    wrt = ("q", "k", "v", "tab")
    if extra == "softcap_bias":
        kw.update(softcap=2.0, bias=rng.standard_normal((1, 4, 40, 56)).astype(np.float32))
        wrt += ("bias",)
    else:
        kw.update(dropout_p=0.2, dropout_seed=11,
                  sinks=rng.standard_normal(4).astype(np.float32))
        wrt += ("sinks",)
    out, lse, gr = _run(kw, q, k, v, g, wrt)
    ref_kw = {n: (x.astype(np.float64) if isinstance(x, np.ndarray) else x)
              for n, x in kw.items()}
    ro = aa.attention(*_f64(q, k, v), backend="reference", **ref_kw)
    rg = aa.attention_backward(*_f64(q, k, v, g), wrt=wrt, backend="reference", **ref_kw)
    assert_close(out, ro, "float32", "out")
    for n in ("dq", "dk", "dv", "dbias", "dsinks"):
        if getattr(rg, n) is not None:
            assert_close(getattr(gr, n), getattr(rg, n), "float32", n)
    assert_close(gr.dcaptures["tab"], rg.dcaptures["tab"], "float32", "dtab")


def test_capture_gradients_alone_and_torch_cpu_tensors(np_config):
    """wrt names a capture only; d(s·t[h])/dt is the score itself (the tile kernel used to
    overwrite it with s' - max before scattering: dt was wrong by 60 %)."""
    torch = pytest.importorskip("torch")
    np_config(**TILES)
    q, k, v, g = qkv(9, 1, 2, 2, 24, 24, 8, "float32")
    t = torch.linspace(0.5, 1.5, 2)
    sm = aa.ScoreMod(lambda s, b, h, i, j, t: s * t[h], t=t)
    tq, tk, tv, tg = (torch.from_numpy(x) for x in (q, k, v, g))
    gr = aa.attention_backward(tq, tk, tv, tg, score_mod=sm, wrt=("t",))
    assert gr.dq is None and isinstance(gr.dcaptures["t"], torch.Tensor)
    rg = aa.attention_backward(*_f64(q, k, v, g), score_mod=sm, wrt=("t",),
                               backend="reference")
    assert_close(gr.dcaptures["t"].numpy(), rg.dcaptures["t"], "float32", "dt")


def test_rows_a_score_function_sends_to_minus_inf_are_empty_rows(np_config):
    """-inf from the score function drops a key like a mask: a row with every key at -inf
    has out 0, lse -inf and zero gradients (the capture's included)."""
    np_config(**TILES)
    q, k, v, g = qkv(10, 1, 2, 2, 24, 24, 8, "float32")
    t = np.ones(2, np.float32)
    sm = aa.ScoreMod(lambda s, b, h, i, j, t: aa.math.where(i % 2 == 0, s * t[h], -np.inf),
                     t=t)
    out, lse, gr = _run(dict(score_mod=sm), q, k, v, g, ("q", "k", "v", "t"))
    assert (out[:, :, 1::2] == 0).all() and np.isneginf(lse[:, :, 1::2]).all()
    rg = aa.attention_backward(*_f64(q, k, v, g), score_mod=sm, wrt=("q", "k", "t"),
                               backend="reference")
    assert (gr.dq[:, :, 1::2] == 0).all()
    assert_close(gr.dq, rg.dq, "float32", "dq")
    assert_close(gr.dcaptures["t"], rg.dcaptures["t"], "float32", "dt")


def test_empty_problems_give_zero_capture_gradients():
    q = np.zeros((1, 2, 0, 8), np.float32)
    k = np.zeros((1, 2, 5, 8), np.float32)
    t = np.ones((2, 3), np.float32)
    sm = aa.ScoreMod(lambda s, b, h, i, j, t: s + t[h, j % 3], t=t)
    gr = aa.attention_backward(q, k, k, q, score_mod=sm, wrt=("q", "t"))
    assert gr.dq.shape == q.shape and (gr.dcaptures["t"] == 0).all()
    assert gr.dcaptures["t"].shape == t.shape


def test_score_and_mask_functions_with_a_value_head_dim(np_config):
    """Dv != D: out and dv in v's head dim, the capture gradient unchanged."""
    np_config(**TILES)
    rng = np.random.default_rng(12)
    q, k = (rng.standard_normal((1, 4, 40, 16)).astype(np.float32) for _ in range(2))
    v, g = (rng.standard_normal((1, 4, 40, 24)).astype(np.float32) for _ in range(2))
    sm = aa.ScoreMod(lambda s, b, h, i, j, t: s * t[h] + 0.1 * (i - j),
                     t=np.linspace(0.5, 1.5, 4).astype(np.float32))
    kw = dict(score_mod=sm, mask=aa.MaskMod(lambda b, h, i, j: (i + j) % 3 != 0))
    wrt = ("q", "k", "v", "t")
    out, lse, gr = _run(kw, q, k, v, g, wrt)
    ro = aa.attention(*_f64(q, k, v), backend="reference", **kw)
    rg = aa.attention_backward(*_f64(q, k, v, g), wrt=wrt, backend="reference", **kw)
    assert out.shape == (1, 4, 40, 24)
    assert_close(out, ro, "float32", "out")
    for n in ("dq", "dk", "dv"):
        assert_close(getattr(gr, n), getattr(rg, n), "float32", n)
    assert_close(gr.dcaptures["t"], rg.dcaptures["t"], "float32", "dt")
