"""Random score functions with capture reads on every backend against the float64
reference: forward, dq / dk / dv and a capture's gradient.

Each seed builds a smooth function (sums, products, tanh, a clamped exp, selections on
index comparisons; no floor / modulo of float values, whose fp32 results may flip at a
boundary) over reads of every shape a kernel lowers differently: a per-key vector
``kb[h, kv_idx]``, a per-query vector ``qb[q_idx]``, a diagonal ``rel[h, q_idx - kv_idx +
Sk - 1]``, a pair tile ``tab[q_idx, kv_idx]``, a read through another read
``tab2[h, bucket[kv_idx - q_idx + Sq - 1]]`` and a scalar ``w[h]``; sizes that are no
multiple of a tile, GQA, and a causal, windowed or no mask.  The gradient of one capture
read along the diagonal (``rel``) or as a pair (``tab``) is asked for too.
"""
from __future__ import annotations

import numpy as np
import pytest

import anyattn as aa
from anyattn.backends.registry import unavailable_reason

from helpers import assert_close, harness_for, to_np

#: backend -> seeds (WebGPU compiles each function's shaders on lavapipe: ~8 s a seed)
SEEDS = {"numpy": range(12), "triton": range(4), "webgpu": range(1)}
B, HQ, HKV, SQ, SK, D = 2, 4, 2, 21, 27, 16


def _params(seeds_of):
    """(backend, seed) parameters, skipped with the backend's reason where unavailable."""
    out = []
    for name, seeds in seeds_of.items():
        why = unavailable_reason(name)
        marks = [pytest.mark.skip(reason=f"{name} unavailable: {why}")] if why else []
        out += [pytest.param(name, seed, marks=marks, id=f"{name}-{seed}") for seed in seeds]
    return out


def _captures(rng):
    n = np.abs(np.arange(-(SQ - 1), SK))
    return {"kb": rng.standard_normal((HQ, SK)).astype(np.float32),
            "qb": rng.standard_normal(SQ).astype(np.float32),
            "rel": (0.5 * rng.standard_normal((HQ, SQ + SK - 1))).astype(np.float32),
            "tab": (0.5 * rng.standard_normal((SQ, SK))).astype(np.float32),
            "tab2": rng.standard_normal((HQ, 6)).astype(np.float32),
            "bucket": np.minimum(n // 4, 5).astype(np.int32),
            "w": (1.0 + 0.25 * rng.standard_normal(HQ)).astype(np.float32)}


def _term(rng):
    """A random smooth float term of (s, b, h, i, j, captures)."""
    k = int(rng.integers(0, 7))
    c = float(rng.integers(1, 5)) / 4
    return [lambda s, b, h, i, j, C: C["kb"][h, j] * c,
            lambda s, b, h, i, j, C: C["qb"][i] - c,
            lambda s, b, h, i, j, C: C["rel"][h, i - j + SK - 1],
            lambda s, b, h, i, j, C: C["tab"][i, j] * s,
            lambda s, b, h, i, j, C: C["tab2"][h, C["bucket"][j - i + SQ - 1]],
            lambda s, b, h, i, j, C: np.tanh(s * C["w"][h]),
            lambda s, b, h, i, j, C: (i - j) * 0.0625 + b * c][k]


def _function(rng):
    """score -> a random combination of terms (built once, traced by ScoreMod)."""
    terms = [_term(rng) for _ in range(3)]
    shape = int(rng.integers(0, 3))

    def fn(s, b, h, i, j, kb, qb, rel, tab, tab2, bucket, w):
        C = dict(kb=kb, qb=qb, rel=rel, tab=tab, tab2=tab2, bucket=bucket, w=w)
        x, y, z = (t(s, b, h, i, j, C) for t in terms)
        if shape == 0:
            return s + x + y * 0.5 - z * 0.25
        if shape == 1:
            return s * 0.75 + np.where(i >= j, x, y) + np.exp(np.clip(z, -2.0, 2.0)) * 0.25
        return s + np.tanh(x) * y * 0.5 + z
    return fn


def _mask(rng):
    return [None, aa.Causal(), aa.Window(5, 3)][int(rng.integers(0, 3))]


@pytest.mark.parametrize("backend, seed", _params(SEEDS))
def test_random_functions_match_the_float64_reference(backend, seed):
    hx = harness_for(backend)
    rng = np.random.default_rng(1000 + seed)
    caps = _captures(rng)
    fn = _function(rng)
    mask = _mask(rng)
    grad_of = ("rel", "tab")[seed % 2]
    q = rng.standard_normal((B, HQ, SQ, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, HKV, SK, D)).astype(np.float32) for _ in range(2))
    g = rng.standard_normal((B, HQ, SQ, D)).astype(np.float32)
    wrt = ("q", "k", "v", grad_of)
    ref_sm = aa.ScoreMod(fn, **{n: (a.astype(np.float64) if a.dtype == np.float32 else a)
                                for n, a in caps.items()})
    want_out = aa.attention(*(x.astype(np.float64) for x in (q, k, v)), score_mod=ref_sm,
                            mask=mask, backend="reference")
    want = aa.attention_backward(*(x.astype(np.float64) for x in (q, k, v, g)),
                                 score_mod=ref_sm, mask=mask, wrt=wrt, backend="reference")
    sm = aa.ScoreMod(fn, **caps)
    T, N = hx.put, to_np
    out = aa.attention(T(q), T(k), T(v), score_mod=sm, mask=mask, backend=backend)
    got = aa.attention_backward(T(q), T(k), T(v), T(g), score_mod=sm, mask=mask, wrt=wrt,
                                backend=backend)
    where = f"{backend} seed {seed} mask {mask}"
    assert_close(N(out), want_out, "float32", f"{where} out")
    for n in ("dq", "dk", "dv"):
        assert_close(N(getattr(got, n)), getattr(want, n), "float32", f"{where} {n}")
    assert_close(N(got.dcaptures[grad_of]), want.dcaptures[grad_of], "float32",
                 f"{where} d{grad_of}")


#: backend -> seeds of the mask-function test
MASK_SEEDS = {"numpy": range(12), "triton": range(4), "webgpu": range(1)}


def _conjunct(rng):
    """A random mask conjunct of (b, h, i, j, prefix, ids)."""
    k = int(rng.integers(0, 7))
    w = int(rng.integers(1, 4))
    return [lambda b, h, i, j, P, I: j <= i,
            lambda b, h, i, j, P, I: (i - j) % (w + 1) == 0,
            lambda b, h, i, j, P, I: j < P[b],
            lambda b, h, i, j, P, I: I[b, i] == I[b, j],
            lambda b, h, i, j, P, I: abs(i // 4 - j // 4) <= w,
            lambda b, h, i, j, P, I: ~(i % 7 == w),
            lambda b, h, i, j, P, I: (h == 1) | (j >= i - 2 * w)][k]


@pytest.mark.parametrize("backend, seed", _params(MASK_SEEDS))
def test_random_mask_functions_match_the_float64_reference(backend, seed):
    """Random mask functions (a union of conjunctions of bands, strides, a per-batch
    prefix, document ids, blocks and head conditions; empty rows included) beside a
    causal or no built-in term, with a per-key score read: forward and dq / dk / dv."""
    hx = harness_for(backend)
    rng = np.random.default_rng(2000 + seed)
    prefix = rng.integers(1, SK, size=B).astype(np.int32)
    ids = np.sort(rng.integers(0, 3, size=(B, max(SQ, SK))), axis=1).astype(np.int32)
    a, b_, c = (_conjunct(rng) for _ in range(3))

    def mfn(b, h, i, j, prefix, ids):
        return (a(b, h, i, j, prefix, ids) & b_(b, h, i, j, prefix, ids)) \
            | c(b, h, i, j, prefix, ids)
    kb = rng.standard_normal((HQ, SK)).astype(np.float32)
    mm = aa.MaskMod(mfn, prefix=prefix, ids=ids)
    mask = [mm, aa.Causal() & mm, aa.Causal() | mm][seed % 3]
    q = rng.standard_normal((B, HQ, SQ, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, HKV, SK, D)).astype(np.float32) for _ in range(2))
    g = rng.standard_normal((B, HQ, SQ, D)).astype(np.float32)
    f64 = [x.astype(np.float64) for x in (q, k, v, g)]
    ref_sm = aa.ScoreMod(lambda s, b, h, i, j, kb: s + kb[h, j], kb=kb.astype(np.float64))
    want_out = aa.attention(*f64[:3], score_mod=ref_sm, mask=mask, backend="reference")
    want = aa.attention_backward(*f64, score_mod=ref_sm, mask=mask, backend="reference")
    sm = aa.ScoreMod(lambda s, b, h, i, j, kb: s + kb[h, j], kb=kb)
    T = hx.put
    out = aa.attention(T(q), T(k), T(v), score_mod=sm, mask=mask, backend=backend)
    got = aa.attention_backward(T(q), T(k), T(v), T(g), score_mod=sm, mask=mask,
                                backend=backend)
    where = f"{backend} seed {seed}"
    assert_close(to_np(out), want_out, "float32", f"{where} out")
    for n in ("dq", "dk", "dv"):
        assert_close(to_np(getattr(got, n)), getattr(want, n), "float32", f"{where} {n}")
