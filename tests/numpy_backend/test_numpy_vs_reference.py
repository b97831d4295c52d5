"""The numpy backend against the float64 reference: sizes, GQA, masks, bias, dtypes."""
from __future__ import annotations

import numpy as np
import pytest

import anyattn as aa
from anyattn import reference as R

from helpers import rel_err
from np_util import check, qkv

DTYPES = ["float64", "float32"]

# (B, Hq, Hkv, Sq, Sk, D)
SHAPES = {
    "one": (1, 1, 1, 1, 1, 1),
    "three": (1, 2, 2, 3, 3, 3),
    "odd113": (1, 2, 2, 113, 113, 24),
    "sq_lt_sk": (2, 2, 2, 70, 301, 40),
    "sq_gt_sk": (1, 2, 2, 290, 33, 40),
    "gqa": (2, 4, 2, 97, 130, 24),
    "mqa": (1, 3, 1, 150, 77, 16),
    "d_odd": (1, 1, 1, 65, 66, 37),
}


@pytest.fixture(autouse=True)
def small_tiles(np_config):
    """Small tiles, so that these sizes span many full, partial and empty tiles."""
    np_config(fwd_bq=32, fwd_bk=48, bwd_bq=48, bwd_bk=32, threads=2)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(SHAPES))
def test_shapes_no_mask(name, dtype):
    check(*qkv(1, *SHAPES[name], dtype=dtype), dtype=dtype)


def _masks(B, Hq, Sq, Sk, rng):
    keep2 = rng.random((Sq, Sk)) < 0.6
    keep2[:, 0] = True
    ids_q = np.sort(rng.integers(0, 3, Sq))
    ids_k = np.sort(rng.integers(0, 3, Sk))
    return {
        "causal_tl": aa.Causal(),
        "causal_br": aa.Causal("bottom_right"),
        "window_l": aa.Window(left=17),
        "window_lr_br": aa.Window(left=5, right=9, align="bottom_right"),
        "seed_kind3": aa.Causal() & aa.Window(left=20),
        "keep_2d": aa.KeepMask(keep2),
        "keep_b1qk": aa.KeepMask(rng.random((B, 1, Sq, Sk)) < 0.5),
        "keep_b11k": aa.KeepMask(rng.random((B, 1, 1, Sk)) < 0.5),
        "keep_per_head": aa.KeepMask(rng.random((1, Hq, Sq, Sk)) < 0.7),
        "keep_blocks_false": aa.KeepMask(np.kron(rng.random((-(-Sq // 40), -(-Sk // 40))) < 0.5,
                                                 np.ones((40, 40), bool))[:Sq, :Sk]),
        "docs_1d": aa.Documents(ids_q, ids_k),
        "docs_2d": aa.Documents(np.stack([ids_q, np.sort(rng.integers(0, 4, Sq))][:B]),
                                np.stack([ids_k, np.sort(rng.integers(0, 4, Sk))][:B])),
        "causal_docs": aa.Causal() & aa.Documents(ids_q, ids_k),
        "window_keep": aa.Window(left=30, right=3) & aa.KeepMask(keep2),
        "br_window_docs": aa.Causal("bottom_right") & aa.Window(left=40, align="bottom_right")
                          & aa.Documents(ids_q, ids_k),
    }


MASK_NAMES = list(_masks(2, 4, 5, 5, np.random.default_rng(0)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_name", MASK_NAMES)
@pytest.mark.parametrize("shape", [(2, 4, 2, 97, 130, 24), (2, 2, 2, 131, 64, 40)],
                         ids=["gqa_sq<sk", "sq>sk"])
def test_masks(mask_name, shape, dtype):
    B, Hq, Hkv, Sq, Sk, D = shape
    rng = np.random.default_rng(7)
    mask = _masks(B, Hq, Sq, Sk, rng)[mask_name]
    check(*qkv(3, *shape, dtype=dtype), dtype=dtype, mask=mask)


@pytest.mark.parametrize("dtype", DTYPES)
def test_offsets_shift_the_band(dtype):
    q, k, v, g = qkv(4, 1, 2, 2, 50, 90, 16, dtype=dtype)
    check(q, k, v, g, dtype=dtype, mask=aa.Causal() & aa.Window(left=30), q_offset=40,
          k_offset=3)


BIAS_SHAPES = {
    "full": lambda B, H, Sq, Sk: (B, H, Sq, Sk),
    "qk_2d": lambda B, H, Sq, Sk: (Sq, Sk),
    "b1qk": lambda B, H, Sq, Sk: (B, 1, Sq, Sk),
    "1h1k": lambda B, H, Sq, Sk: (1, H, 1, Sk),
    "bhq1": lambda B, H, Sq, Sk: (B, H, Sq, 1),
    "k_1d": lambda B, H, Sq, Sk: (Sk,),
    "scalar4": lambda B, H, Sq, Sk: (1, 1, 1, 1),
}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias_name", list(BIAS_SHAPES))
def test_bias_and_dbias(bias_name, dtype):
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 75, 90, 24
    rng = np.random.default_rng(11)
    bias = rng.standard_normal(BIAS_SHAPES[bias_name](B, Hq, Sq, Sk)).astype(dtype)
    _, _, grads = check(*qkv(5, B, Hq, Hkv, Sq, Sk, D, dtype=dtype), dtype=dtype, bias=bias,
                        mask=aa.Causal("bottom_right"), wrt=("q", "k", "v", "bias"))
    assert grads.dbias.shape == bias.shape


@pytest.mark.parametrize("dtype", DTYPES)
def test_bias_only_dbias_requested(dtype):
    B, Hq, Hkv, Sq, Sk, D = 1, 2, 1, 60, 70, 8
    bias = np.random.default_rng(2).standard_normal((1, Hq, Sq, Sk)).astype(dtype)
    check(*qkv(6, B, Hq, Hkv, Sq, Sk, D, dtype=dtype), dtype=dtype, bias=bias, wrt=("bias",))


@pytest.mark.parametrize("wrt", [("q",), ("k",), ("v",), ("k", "v"), ("q", "bias")])
def test_wrt_subsets(wrt):
    B, Hq, Hkv, Sq, Sk, D = 1, 2, 1, 60, 70, 8
    bias = np.random.default_rng(2).standard_normal((Sq, Sk))
    check(*qkv(6, B, Hq, Hkv, Sq, Sk, D), dtype="float64", bias=bias, wrt=wrt,
          mask=aa.Causal())


@pytest.mark.parametrize("dtype", DTYPES)
def test_neg_inf_bias_excludes_keys_and_empties_rows(dtype):
    B, Hq, Hkv, Sq, Sk, D = 1, 2, 2, 70, 90, 16
    rng = np.random.default_rng(3)
    bias = rng.standard_normal((B, Hq, Sq, Sk))
    bias[rng.random(bias.shape) < 0.4] = -np.inf
    bias[:, :, 5, :] = -np.inf          # a row with no finite score: empty
    bias[:, 1, 40:45, :] = -np.inf
    out, lse, grads = check(*qkv(8, B, Hq, Hkv, Sq, Sk, D, dtype=dtype), dtype=dtype,
                            bias=bias.astype(dtype), wrt=("q", "k", "v", "bias"))
    assert np.all(np.asarray(lse)[:, :, 5] == -np.inf)
    assert np.all(np.asarray(out)[:, 1, 40:45] == 0)
    assert np.all(grads.dbias[bias == -np.inf] == 0)


@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_rows_from_masks(dtype):
    """Rows that keep no key: out 0, lse -inf, zero grads from them, never NaN."""
    B, Hq, Hkv, Sq, Sk, D = 1, 2, 1, 80, 40, 16
    keep = np.random.default_rng(0).random((Sq, Sk)) < 0.5
    keep[10:30] = False                          # empty rows inside partial tiles
    keep[:, 35:] = False                         # keys nobody sees: dk = dv = 0
    q, k, v, g = qkv(9, B, Hq, Hkv, Sq, Sk, D, dtype=dtype)
    out, lse, grads = check(q, k, v, g, dtype=dtype, mask=aa.KeepMask(keep))
    assert np.all(np.asarray(out)[:, :, 10:30] == 0)
    assert np.all(grads.dk[:, :, 35:] == 0) and np.all(grads.dv[:, :, 35:] == 0)
    # bottom-right causal with Sq > Sk: the first Sq - Sk queries see nothing
    out, lse, grads = check(q, k, v, g, dtype=dtype, mask=aa.Causal("bottom_right"))
    assert np.all(np.asarray(lse)[:, :, :Sq - Sk] == -np.inf)
    # everything masked
    out, lse, grads = check(q, k, v, g, dtype=dtype, mask=aa.KeepMask(np.zeros((Sq, Sk), bool)))
    assert np.all(np.asarray(out) == 0) and np.all(grads.dq == 0) and np.all(grads.dk == 0)


def test_float16_inputs():
    q, k, v, g = qkv(10, 1, 2, 1, 70, 90, 32, dtype="float16")
    out, lse, grads = check(q, k, v, g, dtype="float16", mask=aa.Causal(), tol=3e-3)
    assert grads.dq.dtype == np.float16 and lse.dtype == np.float32


def test_scale_argument():
    check(*qkv(12, 1, 1, 1, 40, 50, 8), dtype="float64", scale=0.37)


def test_float16_with_bias_and_float64_with_float32_bias():
    q, k, v, g = qkv(13, 1, 2, 1, 50, 60, 16, dtype="float16")
    bias = np.random.default_rng(4).standard_normal((50, 60)).astype(np.float16)
    check(q, k, v, g, dtype="float16", bias=bias, wrt=("q", "k", "v", "bias"), tol=3e-3)
    q, k, v, g = qkv(14, 1, 2, 1, 50, 60, 16)
    bias = np.random.default_rng(5).standard_normal((1, 2, 50, 60)).astype(np.float32)
    check(q, k, v, g, dtype="float64", bias=bias)
    # dbias comes back in the bias's own dtype (float32): float32 rounding only
    db = aa.attention_backward(q, k, v, g, bias=bias, wrt=("bias",), backend="numpy").dbias
    ref = R.backward(q, k, v, g, bias=bias, wrt=("bias",)).dbias
    assert db.dtype == np.float32 and rel_err(db, ref) < 1e-6
