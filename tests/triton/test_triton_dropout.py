"""Attention dropout in the triton kernels: the mask is anyattn.dropout_mask bit for bit
(global positions, 64-bit seeds), and out / lse / dq / dk / dv / dbias match the float64
reference applying that mask, with every mask kind, bias (all three dbias paths), GQA,
Sq != Sk, offsets, the score modifiers, the fp32 schemes and bf16; bitwise repeatable.

Runs on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py where no GPU is present) at tiny sizes with the fixed test plan
(tiles 16/32, mask blocks 32).  Shape legend: B batch, Hq/Hkv heads, Sq/Sk queries/keys,
D head dim.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import anyattn as aa  # noqa: E402
from anyattn import reference as R  # noqa: E402

from helpers import TOL, assert_close, make_qkv, np_mask, to_np  # noqa: E402
from tr_util import GRAD, needs_triton, T, two_launch_backward  # noqa: E402


BIG_SEED = (1 << 64) - 0x1234_5678_9ABC   # >= 2**63: both halves with the top bit set


def check(q, k, v, g, *, p, seed, mods=None, mask=None, bias=None, wrt=None,
          dtype="float32", tdtype=None, tol=None, q_offset=0, k_offset=0):
    """Forward + backward with dropout on triton vs the float64 reference with the same
    mask; returns (out, lse, grads)."""
    mods = {} if mods is None else mods
    if wrt is None:
        wrt = ("q", "k", "v") + (("bias",) if bias is not None else ()) + \
            (("sinks",) if "sinks" in mods else ())
    qt, kt, vt, gt = (T(x, tdtype) for x in (q, k, v, g))
    tm = {n: (T(x) if isinstance(x, np.ndarray) else x) for n, x in mods.items()}
    common = dict(mask=mask, bias=T(bias), backend="triton", q_offset=q_offset,
                  k_offset=k_offset, dropout_p=p, dropout_seed=seed, **tm)
    out, lse = aa.attention(qt, kt, vt, return_lse=True, **common)
    gr = aa.attention_backward(qt, kt, vt, gt, wrt=wrt, **common)
    qr, kr, vr, gr_ = (to_np(x).astype(np.float64) for x in (qt, kt, vt, gt))
    rkw = dict(mask=np_mask(mask), bias=bias, q_offset=q_offset, k_offset=k_offset,
               dropout_p=p, dropout_seed=seed, **mods)
    ro, rl = R.forward(qr, kr, vr, **rkw)
    rg = R.backward(qr, kr, vr, gr_, wrt=wrt, **rkw)
    assert_close(out, ro, dtype, "out", tol=tol)
    lt = to_np(lse)
    assert np.array_equal(np.isfinite(lt), np.isfinite(rl))
    fin = np.isfinite(rl)
    if fin.any():   # the statistics are those of the undropped softmax
        assert np.abs(lt[fin] - rl[fin]).max() <= 1e-4 * max(1.0, np.abs(rl[fin]).max())
    for n in wrt:
        got, ref = getattr(gr, GRAD[n]), getattr(rg, GRAD[n])
        assert got is not None and tuple(got.shape) == tuple(ref.shape), n
        assert_close(got, ref, dtype, GRAD[n], tol=tol)
    return out, lse, gr


# ----------------------------------------------------------------------------- the mask itself
@needs_triton
@pytest.mark.parametrize("seed, q_off, k_off", [
    (BIG_SEED, 0, 0),
    (1, (1 << 32) - 40, 7),                  # low seed word 1; rows up to 2**32 - 1
    ((7 << 32) | 0xFFFFFFFF, 123456, (1 << 31) + 5),
], ids=["seed>=2^63", "seed1-top-rows", "offsets-2^31"])
def test_mask_bit_for_bit(seed, q_off, k_off):
    """q = 0 (uniform P = 1 / Sk) and v = identity (Sk = D): out[i, j] = keep[i, j] /
    (Sk (1 - p)), exactly 0 where dropped; dout = identity (Sq = D): dv[j, i] = the same
    transposed, from the dK/dV programs (forward and backward draw the mask apart)."""
    B, H, S, p = 2, 3, 16, 0.37
    q = np.zeros((B, H, S, S), np.float32)
    k = np.random.default_rng(0).standard_normal((B, H, S, S)).astype(np.float32)
    eye = np.broadcast_to(np.eye(S, dtype=np.float32), (B, H, S, S))
    want = aa.dropout_mask((B, H, S, S), p, seed, q_offset=q_off, k_offset=k_off)
    assert 0.2 < 1 - want.mean() < 0.55                  # a real mix of kept and dropped
    kw = dict(backend="triton", dropout_p=p, dropout_seed=seed, q_offset=q_off,
              k_offset=k_off)
    out = to_np(aa.attention(T(q), T(k), T(eye), **kw))
    assert np.array_equal(out != 0, want)
    np.testing.assert_allclose(out[want], 1.0 / (S * (1 - p)), rtol=1e-6)
    gr = aa.attention_backward(T(q), T(k), T(eye), T(eye), wrt=("v",), **kw)
    dv = to_np(gr.dv)
    assert np.array_equal(dv.transpose(0, 1, 3, 2) != 0, want)
    # another seed or other offsets give another mask
    other = to_np(aa.attention(T(q), T(k), T(eye), **dict(kw, dropout_seed=seed ^ (1 << 40))))
    assert not np.array_equal(other != 0, want)


@needs_triton
def test_p_zero_is_no_dropout():
    rng = np.random.default_rng(1)
    q, k, v, _ = (T(x) for x in make_qkv(rng, 1, 2, 1, 20, 24, 8))
    a = aa.attention(q, k, v, mask=aa.Causal(), backend="triton")
    b = aa.attention(q, k, v, mask=aa.Causal(), backend="triton", dropout_p=0.0,
                     dropout_seed=5)
    assert torch.equal(a, b)


# ----------------------------------------------------------------------------- vs reference
@needs_triton
def test_causal_gqa_sq_ne_sk_offsets():
    rng = np.random.default_rng(2)
    q, k, v, g = make_qkv(rng, 2, 2, 1, 37, 29, 16)
    check(2 * q, k, v, g, p=0.2, seed=BIG_SEED, mask=aa.Causal("bottom_right"),
          q_offset=11, k_offset=3)


@needs_triton
def test_keepmask_window_full_bias_modifiers():
    """Tile lists (KeepMask), full bias + dbias (written by the dq programs), softcap,
    ALiBi and sinks + dsinks together."""
    rng = np.random.default_rng(3)
    B, H, Sq, Sk = 1, 2, 33, 40
    q, k, v, g = make_qkv(rng, B, H, 1, Sq, Sk, 8)
    bias = rng.standard_normal((B, H, Sq, Sk)).astype(np.float32)
    keep = rng.random((B, 1, Sq, Sk)) < 0.8
    mods = dict(softcap=1.3, alibi_slopes=rng.uniform(0.05, 0.5, H).astype(np.float32),
                sinks=rng.standard_normal(H).astype(np.float32))
    check(2 * q, k, v, g, p=0.3, seed=12345, mods=mods, bias=bias,
          mask=aa.KeepMask(T(keep)) & aa.Window(left=20, right=6), q_offset=4, k_offset=9)


@needs_triton
@pytest.mark.parametrize("shape", [(1, 2, 25, 37), (2, 1, 1, 37)], ids=["1hqk", "b11k"])
def test_broadcast_dbias(shape):
    """[1, H, Sq, Sk]: the dq programs own and sum the dbias rows; [B, 1, 1, Sk]: the
    separate reduction kernel; both regenerate the mask."""
    rng = np.random.default_rng(4)
    B, H, Sq, Sk = 2, 2, 25, 37
    q, k, v, g = make_qkv(rng, B, H, H, Sq, Sk, 8)
    bias = rng.standard_normal(shape).astype(np.float32)
    mods = {"softcap": 1.7} if shape[1] == 1 else {}
    check(q, k, v, g, p=0.25, seed=BIG_SEED, mods=mods, bias=bias, mask=aa.Causal(),
          q_offset=2, k_offset=0)


@needs_triton
def test_documents_two_launch_equals_fused(monkeypatch):
    """The dK/dV + dQ kernels give the bits of the one-launch backward."""
    rng = np.random.default_rng(5)
    q, k, v, g = make_qkv(rng, 1, 2, 1, 33, 40, 8)
    qs = np.sort(rng.integers(0, 3, (1, 33)), axis=1)
    ks = np.sort(rng.integers(0, 3, (1, 40)), axis=1)
    mask = aa.Documents(T(qs), T(ks))
    one = aa.attention_backward(T(q), T(k), T(v), T(g), mask=mask, backend="triton",
                                dropout_p=0.15, dropout_seed=99)
    two_launch_backward(monkeypatch)
    two = check(q, k, v, g, p=0.15, seed=99, mask=mask)[2]
    for n in ("dq", "dk", "dv"):
        assert torch.equal(getattr(one, n), getattr(two, n)), n


@needs_triton
def test_bf16():
    rng = np.random.default_rng(6)
    q, k, v, g = make_qkv(rng, 1, 2, 1, 19, 26, 16)
    out, _, gr = check(q, k, v, g, p=0.1, seed=BIG_SEED, mask=aa.Causal(),
                       mods=dict(softcap=2.0), tdtype=torch.bfloat16, dtype="bfloat16")
    assert out.dtype == torch.bfloat16 and gr.dq.dtype == torch.bfloat16


@needs_triton
def test_fp32_scaled_parts():
    """fp32 'highest' (products of scaled fp16 parts) with dropout: fp32 accuracy."""
    rng = np.random.default_rng(7)
    q, k, v, g = make_qkv(rng, 1, 2, 1, 20, 34, 8)
    check(2 * q, k, v, g, p=0.3, seed=2024, mask=aa.Causal("bottom_right"),
          tol=TOL["float32"])


@needs_triton
def test_bitwise_repeatable_and_seed_matters():
    rng = np.random.default_rng(8)
    q, k, v, g = (T(x) for x in make_qkv(rng, 1, 2, 2, 24, 24, 8))
    kw = dict(mask=aa.Causal(), backend="triton", dropout_p=0.2, dropout_seed=BIG_SEED)
    runs = [(aa.attention(q, k, v, **kw), aa.attention_backward(q, k, v, g, **kw))
            for _ in range(2)]
    assert torch.equal(runs[0][0], runs[1][0])
    for n in ("dq", "dk", "dv"):
        assert torch.equal(getattr(runs[0][1], n), getattr(runs[1][1], n)), n
    other = aa.attention(q, k, v, **dict(kw, dropout_seed=BIG_SEED - 1))
    assert not torch.equal(other, runs[0][0])
