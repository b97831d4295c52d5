"""The numpy forward with a group's query heads stacked into one unit (few queries,
``numpy_tiles.forward_group``): the same problem with stacked and per-head units, both
against the float64 reference, every forward feature at Sq 1 and 4 with GQA 4 and MQA,
the backward on the stacked forward's statistics, thread independence, poisoned
outputs and the rule that picks the stacked units.

Shape legend: B batch, Hq/Hkv query/key-value heads, Sq/Sk queries/keys, D head dim,
Dv value head dim.
"""
from __future__ import annotations

import numpy as np
import pytest

import anyattn as aa
from anyattn import reference as R
from anyattn.backends import numpy_backend as nb

from helpers import TOL, assert_close, rel_err, stable_seed, term_magnitudes, to_np

B, SK, D = 2, 200, 16
GROUPS = [(8, 2), (4, 1)]               # GQA 4, MQA
DT = "float32"


def _inputs(seed, Hq, Hkv, Sq, Dv=D):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Hq, Sq, D)).astype(DT)
    k = rng.standard_normal((B, Hkv, SK, D)).astype(DT)
    v = rng.standard_normal((B, Hkv, SK, Dv)).astype(DT)
    g = rng.standard_normal((B, Hq, Sq, Dv)).astype(DT)
    return rng, q, k, v, g


def _case(name, rng, Hq, Sq):
    """Keyword arguments of attention() for one feature."""
    if name == "plain":
        return {}
    if name == "causal_br":
        return dict(mask=aa.Causal("bottom_right"))
    if name == "causal_tl":                       # rows keep 1..Sq keys: mostly empty tiles
        return dict(mask=aa.Causal())
    if name == "window":
        return dict(mask=aa.Window(left=70, right=0, align="bottom_right"))
    if name == "documents":
        ids_q = np.sort(rng.integers(0, 3, Sq))
        return dict(mask=aa.Documents(ids_q, np.sort(rng.integers(0, 3, SK))))
    if name == "keep":
        keep = rng.random((Sq, SK)) < 0.5
        keep[-1] = False                          # an empty row
        return dict(mask=aa.KeepMask(keep))
    if name == "keep_per_head":
        keep = rng.random((1, Hq, Sq, SK)) < 0.5
        keep[0, 1, -1] = False                    # one head's row keeps nothing
        keep[0, 2, :, :100] = False               # one head skips the first key tiles
        return dict(mask=aa.KeepMask(keep))
    if name == "mask_fn":
        return dict(mask=aa.MaskMod(lambda b, h, i, j: (i + j + h) % 3 != 0)
                    & aa.Causal("bottom_right"))
    if name == "bias":
        return dict(bias=rng.standard_normal((1, 1, Sq, SK)).astype(DT))
    if name == "bias_per_head":
        return dict(bias=rng.standard_normal((B, Hq, Sq, SK)).astype(DT))
    if name == "bias_neginf_alibi":               # far ALiBi tiles re-zero a -inf bias
        bias = rng.standard_normal((B, Hq, Sq, SK)).astype(DT)
        bias[rng.random(bias.shape) < 0.3] = -np.inf
        bias[0, 1, -1] = -np.inf                  # a row the bias empties
        # top-left causal: the last tile computed is a far one (anchors at the left)
        return dict(bias=bias, alibi_slopes=rng.uniform(0.6, 1.0, Hq).astype(DT),
                    mask=aa.Causal())
    if name == "softcap":
        return dict(softcap=1.7)
    if name == "alibi":
        return dict(alibi_slopes=rng.uniform(0.05, 1.0, Hq).astype(DT))
    if name == "sinks":
        return dict(sinks=rng.standard_normal(Hq).astype(DT))
    if name == "dropout":
        return dict(dropout_p=0.3, dropout_seed=1234)
    if name == "all":
        return dict(mask=aa.Causal("bottom_right"), softcap=2.5,
                    alibi_slopes=rng.uniform(0.05, 1.0, Hq).astype(DT),
                    sinks=rng.standard_normal(Hq).astype(DT), dropout_p=0.2,
                    dropout_seed=7)
    raise AssertionError(name)


FEATURES = ["plain", "causal_br", "causal_tl", "window", "documents", "keep",
            "keep_per_head", "mask_fn", "bias", "bias_per_head", "bias_neginf_alibi",
            "softcap", "alibi", "sinks", "dropout", "all"]


def _forward(np_config, stack, q, k, v, **kw):
    be = np_config(fwd_bk=48, bwd_bq=48, bwd_bk=32, threads=2, stack_heads=stack)
    out, lse = aa.attention(q, k, v, return_lse=True, backend="numpy", **kw)
    assert be.last_stacked is stack
    return to_np(out), to_np(lse)


def _check(np_config, q, k, v, g, tol_kw=True, **kw):
    """Stacked and per-head forwards vs the reference and each other; the backward (on
    the stacked forward's statistics) vs the reference."""
    tol = TOL[DT]
    ro, rl = R.forward(q, k, v, **kw)
    mag = term_magnitudes(q, k, v, g, **kw) if tol_kw else None
    res = {}
    for stack in (True, False):
        out, lse = _forward(np_config, stack, q, k, v, **kw)
        assert_close(out, ro, DT, f"out (stacked={stack})", tol=tol,
                     magnitude=None if mag is None else mag["out"])
        fin = np.isfinite(rl)
        assert np.array_equal(np.isfinite(lse), fin), "lse -inf exactly where ref is"
        if fin.any():
            el = np.max(np.abs(lse[fin] - rl[fin])) / max(1.0, np.abs(rl[fin]).max())
            assert el <= tol, f"lse (stacked={stack}): error {el:.3g}"
        assert np.all(out[np.all(ro == 0, axis=-1)] == 0)
        res[stack] = out, lse
    assert rel_err(res[True][0], res[False][0]) <= 2 * tol
    # the backward recomputes the forward (stacked) and takes its statistics
    np_config(fwd_bk=48, bwd_bq=48, bwd_bk=32, threads=2, stack_heads=True)
    wrt = ("q", "k", "v")
    grads = aa.attention_backward(q, k, v, g, wrt=wrt, backend="numpy", **kw)
    rg = R.backward(q, k, v, g, wrt=wrt, **kw)
    for key in ("dq", "dk", "dv"):
        assert_close(to_np(getattr(grads, key)), getattr(rg, key), DT, key, tol=tol,
                     magnitude=None if mag is None else mag[key])


@pytest.mark.parametrize("Hq,Hkv", GROUPS)
@pytest.mark.parametrize("Sq", [1, 4])
@pytest.mark.parametrize("feature", FEATURES)
def test_feature_stacked_vs_per_head_vs_reference(np_config, feature, Sq, Hq, Hkv):
    rng, q, k, v, g = _inputs(stable_seed(feature, Sq, Hq), Hq, Hkv, Sq)
    _check(np_config, q, k, v, g, **_case(feature, rng, Hq, Sq))


@pytest.mark.parametrize("Hq,Hkv", GROUPS)
@pytest.mark.parametrize("Sq", [1, 4])
def test_score_function_and_value_dim(np_config, Sq, Hq, Hkv):
    """A score function reading a per-head table, with Dv != D and a causal mask."""
    rng, q, k, v, g = _inputs(5, Hq, Hkv, Sq, Dv=24)
    tab = rng.standard_normal(Hq).astype(DT)
    sm = aa.ScoreMod(lambda s, b, h, i, j, tab: s * 0.5 + tab[h] * np.tanh(s), tab=tab)
    _check(np_config, q, k, v, g, tol_kw=False, score_mod=sm,
           mask=aa.Causal("bottom_right"))


def test_bitwise_independent_of_thread_count(np_config):
    rng, q, k, v, g = _inputs(3, 8, 2, 4)
    tab = rng.standard_normal(8).astype(DT)
    kw = dict(mask=aa.MaskMod(lambda b, h, i, j: (i + j + h) % 5 != 0)
              & aa.Causal("bottom_right"),
              score_mod=aa.ScoreMod(lambda s, b, h, i, j, tab: s + tab[h], tab=tab),
              softcap=4.0, sinks=rng.standard_normal(8).astype(DT), dropout_p=0.25,
              dropout_seed=3)
    runs = []
    for t in (1, 2, 3):
        be = np_config(fwd_bk=48, threads=t)
        runs.append(aa.attention(q, k, v, return_lse=True, backend="numpy", **kw))
        assert be.last_stacked
    for out, lse in runs[1:]:
        np.testing.assert_array_equal(out, runs[0][0])
        np.testing.assert_array_equal(lse, runs[0][1])


def test_every_output_element_is_written(np_config, monkeypatch):
    """Results allocated full of NaN: the stacked units write every row, empty ones too."""
    rng, q, k, v, g = _inputs(4, 8, 2, 4)
    keep = rng.random((B, 8, 4, SK)) < 0.3
    keep[1, 3] = False                              # a whole head keeps nothing
    keep[0, 5, 2] = False                           # one row keeps nothing
    kw = dict(mask=aa.KeepMask(keep), softcap=3.0)
    clean = _forward(np_config, True, q, k, v, **kw)
    monkeypatch.setattr(nb, "_alloc", lambda shape, dt: np.full(shape, np.nan, dt))
    poisoned = _forward(np_config, True, q, k, v, **kw)
    for a, b in zip(clean, poisoned):
        assert not np.isnan(b).any()
        np.testing.assert_array_equal(a, b)
    assert np.all(poisoned[0][1, 3] == 0) and np.all(poisoned[1][1, 3] == -np.inf)


@pytest.mark.parametrize("Hq,Hkv,Sq,cfg,stacked", [
    (8, 2, 1, {}, True),
    (8, 2, 16, {}, True),
    (32, 8, 4, {}, True),
    (8, 2, 64, {}, True),
    (8, 2, 65, {}, False),                      # many queries: per-head bounded forward
    (8, 8, 1, {}, False),                       # no group: nothing to share
    (8, 2, 4, dict(fwd_bq=2), False),           # more than one query tile
    (64, 1, 8, {}, False),                      # 512 stacked rows: too many for one tile
    (8, 2, 4, dict(stack_heads=False), False),  # turned off
])
def test_rule(np_config, Hq, Hkv, Sq, cfg, stacked):
    _, q, k, v, _ = _inputs(0, Hq, Hkv, Sq)
    be = np_config(**cfg)
    aa.attention(q, k, v, backend="numpy")
    assert be.last_stacked is stacked


def test_float64_with_offsets(np_config):
    """float64 at its tolerance, offsets moving the band, ALiBi's diagonal and dropout."""
    rng = np.random.default_rng(9)
    q = rng.standard_normal((B, 8, 3, D))
    k = rng.standard_normal((B, 2, SK, D))
    v = rng.standard_normal((B, 2, SK, 20))
    kw = dict(q_offset=7, k_offset=3, mask=aa.Causal("bottom_right"), softcap=2.0,
              alibi_slopes=rng.uniform(0.1, 1.0, 8), sinks=rng.standard_normal(8),
              dropout_p=0.2, dropout_seed=5, bias=rng.standard_normal((1, 8, 1, SK)))
    be = np_config(fwd_bk=48, threads=2)
    out, lse = aa.attention(q, k, v, return_lse=True, backend="numpy", **kw)
    assert be.last_stacked
    ro, rl = R.forward(q, k, v, **kw)
    assert rel_err(out, ro) <= TOL["float64"]
    assert np.max(np.abs(to_np(lse) - rl)) <= TOL["float64"] * max(1.0, np.abs(rl).max())
