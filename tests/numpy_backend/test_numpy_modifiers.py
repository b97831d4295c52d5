"""Score modifiers on the numpy backend (softcap, ALiBi, sinks) against the float64
reference: alone and together, with every mask kind, bias + dbias, GQA, Sq != Sk,
offsets, empty rows, -inf sinks, fp32/fp64, bshd layout, torch tensors, large logits.

Shape legend: B batch, Hq/Hkv query/key-value heads, Sq/Sk queries/keys, D head dim.
Errors are measured as in ``np_util.check``: relative to max|ref|, or, where that is
exceeded, to the summed magnitude of each result's terms (``helpers.term_magnitudes``, which
knows the modifiers), within ``helpers.TOL``.
"""
from __future__ import annotations

import numpy as np
import pytest

import anyattn as aa
from anyattn import reference as R
from anyattn.api import forward_with_stats
from anyattn.backends import numpy_backend as nb
from anyattn.backends.numpy_tiles import AlibiRows, alibi_anchors, shift_stats, ONE_KEY
from anyattn.masks import resolve
from anyattn.rowstats import RowStats

from helpers import TOL, assert_close, term_magnitudes, to_np
from np_util import mask_cases, qkv

DTYPES = ["float64", "float32"]
GRADS = {"q": "dq", "k": "dk", "v": "dv", "bias": "dbias", "sinks": "dsinks"}


@pytest.fixture(autouse=True)
def small_tiles(np_config):
    """Small tiles: these sizes then span full, partial, empty and ragged tiles."""
    np_config(fwd_bq=32, fwd_bk=48, bwd_bq=48, bwd_bk=32, threads=2)


# ------------------------------------------------------------------------ harness
def check(q, k, v, g, *, dtype, wrt=("q", "k", "v"), tol=None, **kw):
    """numpy backend vs the reference: out, lse, the requested gradients (dsinks too).

    ``kw``: mask, bias, scale, q_offset, k_offset, softcap, alibi_slopes, sinks.
    Returns (out, lse, grads, ref_lse)."""
    tol = TOL[dtype] if tol is None else tol
    out, lse = aa.attention(q, k, v, return_lse=True, backend="numpy", **kw)
    grads = aa.attention_backward(q, k, v, g, wrt=wrt, backend="numpy", **kw)
    ro, rl = R.forward(q, k, v, **kw)
    rg = R.backward(q, k, v, g, wrt=wrt, **kw)
    mag = term_magnitudes(q, k, v, g, **kw)
    out_np, lse_np = to_np(out), to_np(lse)
    assert out_np.dtype == np.dtype(dtype) and out_np.shape == ro.shape
    assert lse_np.dtype == np.dtype("float64" if dtype == "float64" else "float32")
    assert_close(out_np, ro, dtype, "out", tol=tol, magnitude=mag["out"])
    fin = np.isfinite(rl)
    assert np.array_equal(np.isfinite(lse_np), fin), "lse must be -inf exactly where ref is"
    assert np.all(lse_np[~fin] == -np.inf)
    if fin.any():
        el = np.max(np.abs(lse_np[fin] - rl[fin])) / max(1.0, np.abs(rl[fin]).max())
        assert el <= tol, f"lse: error {el:.3g} > {tol:.1g}"
    empty = np.all(ro == 0, axis=-1)              # rows keeping no key (random v elsewhere)
    assert np.all(out_np[empty] == 0), "rows that keep no key must give out = 0"
    for name in wrt:
        key = GRADS[name]
        got, ref = getattr(grads, key), getattr(rg, key)
        got = to_np(got)
        assert got.shape == ref.shape, (key, got.shape, ref.shape)
        assert_close(got, ref, dtype, key, tol=tol, magnitude=mag[key])
    for name, key in GRADS.items():
        if name not in wrt:
            assert getattr(grads, key) is None, f"{key} computed though not requested"
    return out, lse, grads, rl


def _mods(rng, B, Hq, dtype, which, slopes_batch=False):
    """Modifier arguments: which ⊆ {'softcap', 'alibi', 'sinks'}."""
    kw = {}
    if "softcap" in which:
        kw["softcap"] = 1.7
    if "alibi" in which:
        shape = (B, Hq) if slopes_batch else (Hq,)
        kw["alibi_slopes"] = rng.uniform(0.05, 1.0, shape).astype(dtype)
    if "sinks" in which:
        kw["sinks"] = rng.standard_normal(Hq).astype(dtype)
    return kw


def _wrt(kw, bias=False):
    return ("q", "k", "v") + (("bias",) if bias else ()) + \
        (("sinks",) if kw.get("sinks") is not None else ())


COMBOS = {"softcap": ("softcap",), "alibi": ("alibi",), "sinks": ("sinks",),
          "all": ("softcap", "alibi", "sinks")}
SHAPES = {  # (B, Hq, Hkv, Sq, Sk, D)
    "odd113": (1, 2, 2, 113, 113, 24),
    "gqa_sq<sk": (2, 4, 2, 70, 131, 20),
    "sq>sk": (1, 3, 1, 97, 41, 16),
    "one": (1, 1, 1, 1, 1, 1),
}


# ------------------------------------------------------------------ the tile helpers
ANCHOR_MASKS = {  # (mask, k_offset)
    "none": (None, 0), "causal_tl": (aa.Causal(), 0), "causal_br": (aa.Causal("bottom_right"), 0),
    "window": (aa.Window(left=30, right=5), 0),
    "band_off_diag": (aa.Window(left=10, right=10), 30)}    # keys i-40 .. i-20


@pytest.mark.parametrize("mask_name", list(ANCHOR_MASKS))
@pytest.mark.parametrize("diag", [0, 37, -37, 200, -200, 5])
def test_alibi_tile_term_matches_the_dense_distance(diag, mask_name):
    """AlibiRows.add_t + the row term == -slope·|i - j + diag| on every kept key of
    every tile (Toeplitz runs and [nj, 1] columns), the tile term is <= 0 everywhere
    and 0 at each row's anchor, which is a kept key where the band keeps any."""
    sq, sk, slope = 90, 70, 0.3
    mask, ko = ANCHOR_MASKS[mask_name]
    rm = resolve(mask, 1, 1, sq, sk, 0, ko)
    anchor, dmin = alibi_anchors(rm, sq, sk, diag)
    rows = AlibiRows(slope, anchor, sk, np.dtype(np.float64))
    keep = rm.band_keep(0, sq, 0, sk)
    keep = np.ones((sq, sk), bool) if keep is None else keep
    dense = -slope * np.abs(np.arange(sq)[:, None] - np.arange(sk)[None, :] + diag)
    whole = np.zeros((sk, sq))
    for i0, i1 in [(0, 33), (33, 64), (64, 89), (89, 90)]:
        for j0, j1 in [(0, 32), (32, 64), (64, 69), (69, 70)]:
            st = np.zeros((j1 - j0, i1 - i0))
            rows.add_t(st, i0, i1, j0, j1)
            whole[j0:j1, i0:i1] = st
    got = whole.T - slope * dmin[:, None]                      # [Sq, Sk]
    np.testing.assert_allclose(got[keep], dense[keep], rtol=1e-14, atol=1e-12)
    assert np.all(whole <= 0)
    assert np.all(whole.T[np.arange(sq), anchor] == 0)
    has = keep.any(axis=1)
    assert np.all(keep[np.arange(sq), anchor][has])


def test_shift_stats_keeps_the_sum_and_the_one_key_mark():
    rmax = np.array([1.5, -np.inf, 3.0, np.nan, 1e3], np.float32)
    rlog = np.array([0.25, 0.0, ONE_KEY, np.nan, 0.0], np.float32)
    shift = np.array([-1234.567, -5.0, -0.1, 2.0, -1e-3])
    mx, ln = shift_stats(rmax, rlog, shift)
    want = rmax.astype(np.float64) + rlog + shift
    assert mx.dtype == ln.dtype == np.float32
    # exact but for log_norm's own rounding (|ln| < 1: < 6e-8), whatever |max| is
    np.testing.assert_allclose((mx.astype(np.float64) + ln)[[0, 4]], want[[0, 4]],
                               rtol=0, atol=6e-8)
    assert np.all(ln[[0, 4]] >= 0)
    assert mx[1] == -np.inf and ln[1] == 0 and np.isnan(mx[3]) and np.isnan(ln[3])
    assert ln[2] == 0 and np.signbit(ln[2])                 # ONE_KEY kept
    assert abs(float(mx[2]) - (3.0 - 0.1)) < 3e-7


# ----------------------------------------------------------------- modifiers, shapes
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("combo", list(COMBOS))
def test_each_modifier_and_all(combo, shape, dtype):
    B, Hq, Hkv, Sq, Sk, D = SHAPES[shape]
    rng = np.random.default_rng(1)
    kw = _mods(rng, B, Hq, dtype, COMBOS[combo], slopes_batch=B > 1)
    check(*qkv(2, *SHAPES[shape], dtype=dtype), dtype=dtype, wrt=_wrt(kw), **kw)


MASKS = list(mask_cases(2, 5, 5, np.random.default_rng(0)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_name", MASKS)
def test_all_modifiers_with_every_mask(mask_name, dtype):
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 83, 101, 16
    rng = np.random.default_rng(3)
    mask = mask_cases(Hq, Sq, Sk, rng)[mask_name]
    kw = _mods(rng, B, Hq, dtype, ("softcap", "alibi", "sinks"), slopes_batch=True)
    check(*qkv(4, B, Hq, Hkv, Sq, Sk, D, dtype=dtype), dtype=dtype, mask=mask,
          wrt=_wrt(kw), **kw)


@pytest.mark.parametrize("combo", ["softcap", "alibi", "sinks"])
@pytest.mark.parametrize("mask_name", ["causal_tl", "documents", "keep"])
def test_each_modifier_with_masks_float32(combo, mask_name):
    B, Hq, Hkv, Sq, Sk, D = 1, 2, 1, 77, 90, 16
    rng = np.random.default_rng(5)
    mask = mask_cases(Hq, Sq, Sk, rng)[mask_name]
    kw = _mods(rng, B, Hq, "float32", COMBOS[combo])
    check(*qkv(6, B, Hq, Hkv, Sq, Sk, D, dtype="float32"), dtype="float32", mask=mask,
          wrt=_wrt(kw), **kw)


BIAS_SHAPES = {"full": lambda B, H, Sq, Sk: (B, H, Sq, Sk),
               "1h1k": lambda B, H, Sq, Sk: (1, H, 1, Sk),
               "bhq1": lambda B, H, Sq, Sk: (B, H, Sq, 1),
               "qk_2d": lambda B, H, Sq, Sk: (Sq, Sk)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias_name", list(BIAS_SHAPES))
def test_bias_and_dbias_with_all_modifiers(bias_name, dtype):
    """dbias stays dS (not multiplied by 1 - tanh²); the bias runs in natural units."""
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 75, 90, 16
    rng = np.random.default_rng(7)
    bias = rng.standard_normal(BIAS_SHAPES[bias_name](B, Hq, Sq, Sk)).astype(dtype)
    kw = _mods(rng, B, Hq, dtype, ("softcap", "alibi", "sinks"))
    _, _, grads, _ = check(*qkv(8, B, Hq, Hkv, Sq, Sk, D, dtype=dtype), dtype=dtype,
                           bias=bias, mask=aa.Causal("bottom_right"),
                           wrt=_wrt(kw, bias=True), **kw)
    assert grads.dbias.shape == bias.shape


@pytest.mark.parametrize("dtype", DTYPES)
def test_softcap_bias_dbias_is_ds_not_the_capped_one(dtype):
    """With only softcap and a full bias: dbias must equal the reference's dS exactly
    in tolerance (a dbias multiplied by 1 - tanh² differs by far more)."""
    B, Hq, Hkv, Sq, Sk, D = 1, 2, 2, 50, 60, 8
    rng = np.random.default_rng(9)
    bias = rng.standard_normal((B, Hq, Sq, Sk)).astype(dtype)
    q, k, v, g = qkv(10, B, Hq, Hkv, Sq, Sk, D, dtype=dtype)
    q = q * 4                                                  # tanh well away from linear
    _, _, grads, _ = check(q, k, v, g, dtype=dtype, bias=bias, softcap=0.5,
                           wrt=("q", "k", "bias"))
    wrong = R.backward(q, k, v, g, bias=bias, wrt=("bias",)).dbias
    assert np.max(np.abs(to_np(grads.dbias) - wrong)) > 100 * TOL[dtype] * np.abs(wrong).max()


@pytest.mark.parametrize("sinks", [False, True])
@pytest.mark.parametrize("dtype", DTYPES)
def test_neg_inf_bias_and_masks_with_steep_alibi(dtype, sinks):
    """Steep slopes floor the exponents of far tiles (no subnormals); a -inf bias and
    the masks still drop their keys exactly (re-zeroed after the exp) and empty whole
    rows: out 0, lse -inf (or the sink), no gradient from them."""
    B, Hq, Hkv, Sq, Sk, D = 1, 2, 2, 70, 90, 16
    rng = np.random.default_rng(36)
    bias = rng.standard_normal((B, Hq, Sq, Sk))
    bias[rng.random(bias.shape) < 0.3] = -np.inf
    bias[:, :, 5, :] = -np.inf                                 # an empty row
    keep = np.ones((Sq, Sk), bool)
    keep[40:44] = False                                        # empty rows from the mask
    kw = dict(alibi_slopes=np.array([5.0, 0.4], dtype), softcap=4.0)
    if sinks:
        kw["sinks"] = np.array([0.5, -0.5], dtype)
    q, k, v, g = qkv(37, B, Hq, Hkv, Sq, Sk, D, dtype=dtype)
    for b4 in (bias.astype(dtype), None):
        wrt = ("q", "k", "v") + (("bias",) if b4 is not None else ()) + \
            (("sinks",) if sinks else ())
        out, lse, grads, _ = check(q, k, v, g, dtype=dtype, bias=b4, mask=aa.KeepMask(keep),
                                   wrt=wrt, **kw)
        rows = [40, 41, 42, 43] + ([5] if b4 is not None else [])
        assert np.all(to_np(out)[:, :, rows] == 0)
        assert np.all(to_np(grads.dq)[:, :, rows] == 0)
        if b4 is not None:
            assert np.all(grads.dbias[bias == -np.inf] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offsets", [(40, 3), (0, 25), (3000, 0), (0, 2500)],
                         ids=["q40_k3", "k25", "q3000", "k2500"])
def test_offsets(offsets, dtype):
    """q_offset/k_offset shift the band and ALiBi's diagonal; at offsets of thousands
    the per-row rebasing keeps fp32 exact (a score of -slope·3000 rounds at 1e-4)."""
    qo, ko = offsets
    B, Hq, Hkv, Sq, Sk, D = 1, 2, 2, 50, 90, 16
    rng = np.random.default_rng(11)
    kw = _mods(rng, B, Hq, dtype, ("softcap", "alibi"))
    kw["alibi_slopes"] = np.array([0.5, 0.125], dtype)
    mask = aa.Window(left=60, right=60, align="bottom_right") if qo < 100 and ko < 100 \
        else None
    q, k, v, g = qkv(12, B, Hq, Hkv, Sq, Sk, D, dtype=dtype)
    # sinks near each head's lse (at lse ~ -1500 a sink of ~0 would take all the weight)
    _, rl = R.forward(q, k, v, mask=mask, q_offset=qo, k_offset=ko, **kw)
    kw["sinks"] = (np.median(rl, axis=(0, 2)) + rng.standard_normal(Hq)).astype(dtype)
    check(q, k, v, g, dtype=dtype, mask=mask, q_offset=qo, k_offset=ko, wrt=_wrt(kw), **kw)


@pytest.mark.parametrize("dtype", DTYPES)
def test_alibi_with_nearest_keys_masked_out_takes_the_running_max_path(dtype, monkeypatch):
    """Steep slopes and a KeepMask that drops every key within 40 of the diagonal: the
    bounded forward's terms all underflow (below 2^-80), those query tiles are
    recomputed with a running max (counted here); nothing reads as an empty row."""
    calls = []
    real = nb.forward_rows

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    monkeypatch.setattr(nb, "forward_rows", counted)
    B, Hq, Hkv, Sq, Sk, D = 1, 2, 1, 96, 96, 8
    i, j = np.arange(Sq)[:, None], np.arange(Sk)[None, :]
    keep = np.abs(i - j) >= 40
    out, lse, _, rl = check(*qkv(13, B, Hq, Hkv, Sq, Sk, D, dtype=dtype), dtype=dtype,
                            mask=aa.KeepMask(keep), alibi_slopes=np.array([1.5, 1.2], dtype))
    assert calls, "the running-max path never ran"
    assert np.all(np.isfinite(to_np(lse))) and np.all(rl < -40)


@pytest.mark.parametrize("dtype", DTYPES)
def test_alibi_far_from_the_band_stays_exact(dtype):
    """Top-left causal with Sk - Sq = 700: ALiBi's diagonal sits 700 keys right of the
    last kept key, every score ~ -350 (fp32 ulp 3e-5); anchored at the band's edge the
    kernels' scores stay small and fp32 keeps its 1e-5."""
    B, Hq, Hkv, Sq, Sk, D = 1, 2, 1, 40, 740, 16
    kw = dict(alibi_slopes=np.array([0.5, 0.9], dtype), softcap=3.0,
              sinks=np.array([-350.0, -630.0], dtype))
    _, _, _, rl = check(*qkv(35, B, Hq, Hkv, Sq, Sk, D, dtype=dtype), dtype=dtype,
                        mask=aa.Causal(), wrt=("q", "k", "v", "sinks"), **kw)
    assert np.all(rl < -300)


@pytest.mark.parametrize("bounded", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_large_logits_softcap_saturates_without_nan(dtype, bounded, np_config):
    """q·1e3 (logits ~1e3): tanh saturates, |s| <= c; both forward paths (bounded and
    running-max) and the backward stay finite and match the reference."""
    np_config(fwd_bq=32, fwd_bk=48, bwd_bq=48, bwd_bk=32, threads=2, bounded=bounded)
    B, Hq, Hkv, Sq, Sk, D = 1, 2, 1, 70, 90, 16
    q, k, v, g = qkv(14, B, Hq, Hkv, Sq, Sk, D, dtype=dtype)
    q = (q * 1e3).astype(dtype)
    rng = np.random.default_rng(15)
    for kw in (dict(softcap=30.0), dict(softcap=5.0, alibi_slopes=np.array([0.2, 0.7], dtype),
                                        sinks=rng.standard_normal(Hq).astype(dtype))):
        out, lse, grads, _ = check(q, k, v, g, dtype=dtype, mask=aa.Causal(),
                                   wrt=_wrt(kw), **kw)
        for x in (out, lse, grads.dq, grads.dk, grads.dv):
            assert np.all(np.isfinite(to_np(x)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_logits_alibi_without_softcap(dtype):
    """q·30 without a cap (natural-unit running-max path) plus ALiBi and sinks."""
    B, Hq, Hkv, Sq, Sk, D = 1, 2, 2, 60, 75, 16
    q, k, v, g = qkv(16, B, Hq, Hkv, Sq, Sk, D, dtype=dtype)
    q = (q * 30).astype(dtype)
    rng = np.random.default_rng(17)
    kw = _mods(rng, B, Hq, dtype, ("alibi", "sinks"))
    check(q, k, v, g, dtype=dtype, mask=aa.Causal("bottom_right"), wrt=_wrt(kw), **kw)


# ------------------------------------------------------------------- sinks specifics
@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_rows_with_sinks_give_out_zero_and_lse_sink(dtype):
    B, Hq, Hkv, Sq, Sk, D = 1, 3, 1, 80, 40, 16
    rng = np.random.default_rng(18)
    keep = rng.random((Sq, Sk)) < 0.5
    keep[10:30] = False                                       # empty rows in partial tiles
    sinks = rng.standard_normal(Hq).astype(dtype)
    kw = dict(sinks=sinks, softcap=2.0, alibi_slopes=np.array([0.1, 0.3, 0.9], dtype))
    q, k, v, g = qkv(19, B, Hq, Hkv, Sq, Sk, D, dtype=dtype)
    out, lse, grads, _ = check(q, k, v, g, dtype=dtype, mask=aa.KeepMask(keep),
                               wrt=("q", "k", "v", "sinks"), **kw)
    assert np.all(to_np(out)[:, :, 10:30] == 0)
    np.testing.assert_array_equal(to_np(lse)[:, :, 10:30],
                                  np.broadcast_to(sinks[None, :, None], (B, Hq, 20)))
    assert np.all(to_np(grads.dq)[:, :, 10:30] == 0)
    # every row empty: out 0, lse = sink everywhere, all gradients 0
    out, lse, grads, _ = check(q, k, v, g, dtype=dtype, mask=aa.KeepMask(np.zeros((Sq, Sk),
                                                                                   bool)),
                               wrt=("q", "k", "v", "sinks"), **kw)
    assert np.all(to_np(out) == 0) and np.all(to_np(grads.dsinks) == 0)
    np.testing.assert_array_equal(to_np(lse), np.broadcast_to(sinks[None, :, None],
                                                              (B, Hq, Sq)))
    # bottom-right causal with Sq > Sk: the first Sq - Sk queries see nothing
    _, lse, _, _ = check(q, k, v, g, dtype=dtype, mask=aa.Causal("bottom_right"),
                         wrt=("q", "sinks"), sinks=sinks)
    np.testing.assert_array_equal(to_np(lse)[:, :, :Sq - Sk],
                                  np.broadcast_to(sinks[None, :, None], (B, Hq, Sq - Sk)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_minus_inf_sinks_are_no_sinks(dtype):
    """A -inf sink changes nothing: bitwise the call without sinks for that head (the
    one-key marks of the statistics included), dsinks 0 there."""
    B, Hq, Hkv, Sq, Sk, D = 2, 3, 3, 70, 64, 16
    q, k, v, g = qkv(20, B, Hq, Hkv, Sq, Sk, D, dtype=dtype)
    sinks = np.array([-np.inf, 0.7, -np.inf], dtype)
    out, lse, grads, _ = check(q, k, v, g, dtype=dtype, mask=aa.Causal(),
                               wrt=("q", "k", "v", "sinks"), sinks=sinks)
    o0, s0 = forward_with_stats(q, k, v, mask=aa.Causal(), backend="numpy")
    o1, s1 = forward_with_stats(q, k, v, mask=aa.Causal(), sinks=sinks, backend="numpy")
    for h in (0, 2):
        assert np.array_equal(o0[:, h], o1[:, h])
        assert np.array_equal(s0.max[:, h], s1.max[:, h])
        assert np.array_equal(np.signbit(s0.log_norm[:, h]), np.signbit(s1.log_norm[:, h]))
        assert np.array_equal(s0.log_norm[:, h], s1.log_norm[:, h])
    assert grads.dsinks[0] == 0 and grads.dsinks[2] == 0 and grads.dsinks[1] != 0


@pytest.mark.parametrize("wrt", [("sinks",), ("v", "sinks"), ("q", "sinks"), ("k",)])
def test_dsinks_alone_and_with_subsets(wrt):
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 60, 70, 8
    rng = np.random.default_rng(21)
    kw = _mods(rng, B, Hq, "float64", ("sinks", "softcap"))
    check(*qkv(22, B, Hq, Hkv, Sq, Sk, D), dtype="float64", wrt=wrt, mask=aa.Causal(), **kw)


def test_dsinks_dtype_follows_the_sinks():
    """float64 inputs with float32 sinks and slopes: dsinks comes back in float32."""
    B, Hq, Hkv, Sq, Sk, D = 1, 2, 1, 40, 50, 8
    q, k, v, g = qkv(23, B, Hq, Hkv, Sq, Sk, D)
    sinks = np.array([0.3, -1.2], np.float32)
    slopes = np.array([0.25, 0.5], np.float32)
    gr = aa.attention_backward(q, k, v, g, sinks=sinks, alibi_slopes=slopes,
                               wrt=("q", "sinks"), backend="numpy")
    ref = R.backward(q, k, v, g, sinks=sinks, alibi_slopes=slopes, wrt=("q", "sinks"))
    assert gr.dsinks.dtype == np.float32 and gr.dq.dtype == np.float64
    assert_close(gr.dsinks, ref.dsinks, "float32", "dsinks")
    assert_close(gr.dq, ref.dq, "float64", "dq")


@pytest.mark.parametrize("dtype", DTYPES)
def test_backward_from_given_out_and_lse(dtype):
    """The backward fed the forward's out with a plain lse (sink included) or its
    RowStats gives the same gradients as one that recomputes them."""
    B, Hq, Hkv, Sq, Sk, D = 1, 4, 2, 66, 80, 16
    rng = np.random.default_rng(24)
    kw = _mods(rng, B, Hq, dtype, ("softcap", "alibi", "sinks"))
    kw["mask"] = aa.Causal("bottom_right")
    kw["q_offset"] = 500                                   # ALiBi rows rebased by 500+
    q, k, v, g = qkv(25, B, Hq, Hkv, Sq, Sk, D, dtype=dtype)
    _, rl = R.forward(q, k, v, **dict(kw, sinks=None))     # sinks near the lse (~ -200)
    kw["sinks"] = (np.median(rl, axis=(0, 2)) + rng.standard_normal(Hq)).astype(dtype)
    wrt = ("q", "k", "v", "sinks")
    ref = R.backward(q, k, v, g, wrt=wrt, **kw)
    mag = term_magnitudes(q, k, v, g, **kw)
    out, st = forward_with_stats(q, k, v, backend="numpy", **kw)
    _, lse = aa.attention(q, k, v, return_lse=True, backend="numpy", **kw)
    for given in (st, lse):
        gr = aa.attention_backward(q, k, v, g, out=out, lse=given, wrt=wrt, backend="numpy",
                                   **kw)
        for name in wrt:
            key = GRADS[name]
            assert_close(getattr(gr, key), getattr(ref, key), dtype, key, magnitude=mag[key])
    # statistics that call a row empty (max -inf) give P = 0 on it, though its keys are
    # kept and ALiBi floors the exponents of far tiles (steep slopes)
    kw["alibi_slopes"] = np.array([3.0, 2.0, 0.5, 0.1], dtype)
    out, st = forward_with_stats(q, k, v, backend="numpy", **kw)
    mx = np.array(st.max)
    mx[:, :, 7] = -np.inf
    ln = np.array(st.log_norm)
    ln[:, :, 7] = 0
    gr = aa.attention_backward(q, k, v, g, out=out, lse=RowStats(mx, ln), wrt=wrt,
                               backend="numpy", **kw)
    ref = R.backward(q, k, v, g, out=out, stats=RowStats(mx, ln), wrt=wrt, **kw)
    assert np.all(gr.dq[:, :, 7] == 0)
    for name in wrt:
        key = GRADS[name]
        assert_close(getattr(gr, key), getattr(ref, key), dtype, key, magnitude=mag[key])


# -------------------------------------------------------------- layouts, libraries
def test_layout_bshd():
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 45, 61, 12
    rng = np.random.default_rng(26)
    kw = _mods(rng, B, Hq, "float32", ("softcap", "alibi", "sinks"), slopes_batch=True)
    q, k, v, g = qkv(27, B, Hq, Hkv, Sq, Sk, D, dtype="float32")
    sw = (lambda x: np.ascontiguousarray(x.swapaxes(1, 2)))   # [B, S, H, D] memory
    out, lse = aa.attention(sw(q), sw(k), sw(v), layout="bshd", return_lse=True,
                            backend="numpy", mask=aa.Causal(), **kw)
    gr = aa.attention_backward(sw(q), sw(k), sw(v), sw(g), layout="bshd", backend="numpy",
                               wrt=("q", "k", "v", "sinks"), mask=aa.Causal(), **kw)
    ro, rl = R.forward(q, k, v, mask=aa.Causal(), **kw)
    rg = R.backward(q, k, v, g, mask=aa.Causal(), wrt=("q", "k", "v", "sinks"), **kw)
    mag = term_magnitudes(q, k, v, g, mask=aa.Causal(), **kw)
    assert out.shape == (B, Sq, Hq, D)
    assert_close(out.swapaxes(1, 2), ro, "float32", "out", magnitude=mag["out"])
    assert_close(lse, rl, "float32", "lse")
    for key, x in (("dq", gr.dq), ("dk", gr.dk), ("dv", gr.dv)):
        assert_close(x.swapaxes(1, 2), getattr(rg, key), "float32", key, magnitude=mag[key])
    assert_close(gr.dsinks, rg.dsinks, "float32", "dsinks", magnitude=mag["dsinks"])


def test_strided_views_and_packed_qkv():
    """q, k, v as views of one packed [B, S, 3, H, D] array (non-unit strides)."""
    B, H, S, D = 1, 2, 57, 8
    rng = np.random.default_rng(28)
    qkvp = rng.standard_normal((B, S, 3, H, D))
    q, k, v = (qkvp[:, :, i].transpose(0, 2, 1, 3) for i in range(3))   # [B, H, S, D] views
    g = rng.standard_normal((B, H, S, D))
    kw = _mods(rng, B, H, "float64", ("softcap", "alibi", "sinks"))
    check(q, k, v, g, dtype="float64", mask=aa.Causal(), wrt=("q", "k", "v", "sinks"), **kw)


def test_torch_cpu_tensors_in_and_out():
    torch = pytest.importorskip("torch")
    B, Hq, Hkv, Sq, Sk, D = 1, 4, 2, 50, 64, 16
    q, k, v, g = qkv(29, B, Hq, Hkv, Sq, Sk, D, dtype="float32")
    rng = np.random.default_rng(30)
    kw = _mods(rng, B, Hq, "float32", ("softcap", "alibi", "sinks"))
    tkw = {n: (torch.from_numpy(x) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}
    tq, tk, tv, tg = (torch.from_numpy(x) for x in (q, k, v, g))
    out, lse = aa.attention(tq, tk, tv, mask=aa.Causal(), return_lse=True, backend="numpy",
                            **tkw)
    gr = aa.attention_backward(tq, tk, tv, tg, mask=aa.Causal(), wrt=("q", "k", "v", "sinks"),
                               backend="numpy", **tkw)
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32
    assert isinstance(gr.dsinks, torch.Tensor) and gr.dsinks.dtype == torch.float32
    nout, nlse = aa.attention(q, k, v, mask=aa.Causal(), return_lse=True, backend="numpy", **kw)
    ngr = aa.attention_backward(q, k, v, g, mask=aa.Causal(), wrt=("q", "k", "v", "sinks"),
                                backend="numpy", **kw)
    assert np.array_equal(out.numpy(), nout) and np.array_equal(lse.numpy(), nlse)
    for key in ("dq", "dk", "dv", "dsinks"):
        assert np.array_equal(getattr(gr, key).numpy(), getattr(ngr, key)), key
    check(q, k, v, g, dtype="float32", mask=aa.Causal(), wrt=("q", "k", "v", "sinks"), **kw)


def test_float16_inputs_with_modifiers():
    B, Hq, Hkv, Sq, Sk, D = 1, 2, 1, 50, 70, 16
    q, k, v, g = qkv(31, B, Hq, Hkv, Sq, Sk, D, dtype="float16")
    rng = np.random.default_rng(32)
    kw = _mods(rng, B, Hq, "float16", ("softcap", "alibi"))
    kw["sinks"] = rng.standard_normal(Hq).astype(np.float32)   # float32 is accepted too
    _, lse, gr, _ = check(q, k, v, g, dtype="float16", mask=aa.Causal(),
                          wrt=("q", "k", "v", "sinks"), **kw)
    assert gr.dq.dtype == np.float16 and gr.dsinks.dtype == np.float32


def test_repeatable_and_thread_count_independent_forward(np_config):
    """Bitwise repeatable; the forward does not depend on the thread count (units
    write disjoint rows), nor do the modifiers' per-unit tables."""
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 90, 100, 16
    q, k, v, g = qkv(33, B, Hq, Hkv, Sq, Sk, D, dtype="float32")
    rng = np.random.default_rng(34)
    kw = _mods(rng, B, Hq, "float32", ("softcap", "alibi", "sinks"), slopes_batch=True)
    runs = []
    for threads in (2, 2, 1, 3):
        np_config(fwd_bq=32, fwd_bk=48, bwd_bq=48, bwd_bk=32, threads=threads)
        o, l = aa.attention(q, k, v, mask=aa.Causal(), return_lse=True, backend="numpy", **kw)
        gr = aa.attention_backward(q, k, v, g, mask=aa.Causal(), backend="numpy",
                                   wrt=("q", "k", "v", "sinks"), **kw)
        runs.append((threads, o, l, gr))
    (_, o0, l0, g0), (_, o1, l1, g1) = runs[0], runs[1]
    assert np.array_equal(o0, o1) and np.array_equal(l0, l1)
    for a, b in zip(g0[:3] + (g0.dsinks,), g1[:3] + (g1.dsinks,)):
        assert np.array_equal(a, b)
    for _, o, l, _ in runs[2:]:
        assert np.array_equal(o, o0) and np.array_equal(l, l0)


def test_capabilities_declare_the_modifiers():
    from anyattn.backends.registry import get_backend
    from anyattn.problem import describe

    be = get_backend("numpy")
    q = np.zeros((1, 2, 3, 8), np.float32)
    p = describe(q, q, q, softcap=1.0, alibi_slopes=np.ones(2, np.float32),
                 sinks=np.ones(2, np.float32))
    assert be.unsupported_reasons(p) == []
    c = be.capabilities
    assert {"softcap", "alibi", "sinks"} <= c.modifiers


def test_nan_in_q_propagates_like_the_reference():
    """A NaN query row stays NaN through tanh, ALiBi's floor and the sink fold (its
    dsinks term too, as in the reference); the other rows are untouched."""
    B, Hq, Hkv, Sq, Sk, D = 1, 2, 1, 40, 40, 8
    q, k, v, g = qkv(38, B, Hq, Hkv, Sq, Sk, D, dtype="float32")
    q[0, 0, 5, 0] = np.nan
    kw = dict(softcap=3.0, alibi_slopes=np.array([0.5, 4.0], np.float32),
              sinks=np.array([0.1, -0.3], np.float32), mask=aa.Causal())
    with np.errstate(all="raise"):
        out = aa.attention(q, k, v, backend="numpy", **kw)
    gr = aa.attention_backward(q, k, v, g, wrt=("q", "sinks"), backend="numpy", **kw)
    ro, _ = R.forward(q, k, v, **kw)
    rg = R.backward(q, k, v, g, wrt=("q", "sinks"), **kw)
    assert np.array_equal(np.isnan(out), np.isnan(ro))
    assert np.array_equal(np.isnan(gr.dq), np.isnan(rg.dq))
    assert np.array_equal(np.isnan(gr.dsinks), np.isnan(rg.dsinks))
    ok = ~np.isnan(ro).any(axis=-1)
    assert_close(out[ok], ro[ok], "float32", "out")
