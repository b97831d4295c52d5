"""Hypothesis-drawn small problems: the numpy backend agrees with the float64 reference."""
from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import anyattn as aa
from anyattn.backends.numpy_backend import NumpyConfig
from anyattn.backends.registry import get_backend

from helpers import examples
from np_util import check


@st.composite
def problems(draw):
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 2))
    Hq = Hkv * draw(st.integers(1, 3))
    Sq = draw(st.integers(1, 70))
    Sk = draw(st.integers(1, 70))
    D = draw(st.integers(1, 20))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    terms = []
    if draw(st.booleans()):
        terms.append(aa.Causal(draw(st.sampled_from(["top_left", "bottom_right"]))))
    if draw(st.booleans()):
        left = draw(st.one_of(st.none(), st.integers(0, 40)))
        right = draw(st.one_of(st.none(), st.integers(0, 40)))
        terms.append(aa.Window(left, right, draw(st.sampled_from(["top_left", "bottom_right"]))))
    if draw(st.booleans()):
        shape = draw(st.sampled_from([(Sq, Sk), (B, 1, Sq, Sk), (B, 1, 1, Sk), (1, Hq, Sq, Sk)]))
        terms.append(aa.KeepMask(rng.random(shape) < draw(st.floats(0.1, 1.0))))
    if draw(st.booleans()):
        nd = draw(st.integers(1, 4))
        terms.append(aa.Documents(np.sort(rng.integers(0, nd, Sq)), np.sort(rng.integers(0, nd, Sk))))
    mask = None
    for t in terms:
        mask = t if mask is None else mask & t
    bias = None
    if draw(st.booleans()):
        shape = draw(st.sampled_from([(B, Hq, Sq, Sk), (Sq, Sk), (1, Hq, 1, Sk), (B, 1, Sq, 1)]))
        bias = rng.standard_normal(shape)
        if draw(st.booleans()):
            bias[rng.random(shape) < 0.2] = -np.inf
    tiles = draw(st.tuples(*[st.sampled_from([4, 8, 16, 32, 64])] * 4))
    threads = draw(st.sampled_from([1, 2]))
    Dv = D if draw(st.booleans()) else draw(st.integers(1, 20))     # v's head dim
    arrays = [rng.standard_normal(s) for s in
              [(B, Hq, Sq, D), (B, Hkv, Sk, D), (B, Hkv, Sk, Dv), (B, Hq, Sq, Dv)]]
    return arrays, mask, bias, tiles, threads


def _run(prob, dtype):
    (q, k, v, g), mask, bias, tiles, threads = prob
    q, k, v, g = (x.astype(dtype) for x in (q, k, v, g))
    bias = None if bias is None else bias.astype(dtype)
    be = get_backend("numpy")
    old = be.config
    be.config = NumpyConfig(*tiles, threads=threads)
    try:
        wrt = ("q", "k", "v") + (("bias",) if bias is not None else ())
        check(q, k, v, g, dtype=dtype, mask=mask, bias=bias, wrt=wrt)
    finally:
        be.config = old


@settings(max_examples=examples(50, 150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_drawn_problems_float64(prob):
    _run(prob, "float64")


@settings(max_examples=examples(20, 60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(problems())
def test_drawn_problems_float32(prob):
    _run(prob, "float32")
