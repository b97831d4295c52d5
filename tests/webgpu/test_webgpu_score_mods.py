"""Score and mask functions on the WebGPU backend (generated WGSL) against the float64
reference: forward, lse and the gradients of q, k, v; GQA and Sq != Sk; new captured
values compile nothing; refusals.  Every function compiles its own kernels on lavapipe
(~10-20 s per kernel), so the default run takes one composite problem (many operations,
a score function and mask functions in one compile); the gallery runs with --exhaustive.

Shape legend: B batch, Hq/Hkv heads, Sq/Sk queries/keys, D head dim."""
import math

import numpy as np
import pytest

import anyattn as aa
from anyattn import math as am
from anyattn.backends.webgpu.pipelines import KernelError, build_source

from helpers import assert_close, load_gallery, make_qkv

gallery = load_gallery()

B, HQ, HKV, SQ, SK, D = 2, 4, 2, 40, 56, 16


def _f64(*xs):
    return [x.astype(np.float64) for x in xs]


def _check(kw, q, k, v, g, dtype, what, grads=True):
    out, lse = aa.attention(q, k, v, return_lse=True, backend="webgpu", **kw)
    ro, rl = aa.attention(*_f64(q, k, v), return_lse=True, backend="reference", **kw)
    assert_close(out, ro, dtype, f"{what} out")
    fin = np.isfinite(rl)
    np.testing.assert_array_equal(np.isfinite(lse), fin)
    assert_close(lse[fin], rl[fin], dtype, f"{what} lse")
    if not grads:
        return
    gr = aa.attention_backward(q, k, v, g, wrt=("q", "k", "v"), backend="webgpu", **kw)
    rg = aa.attention_backward(*_f64(q, k, v, g), wrt=("q", "k", "v"), backend="reference",
                               **kw)
    for n in ("dq", "dk", "dv"):
        assert_close(getattr(gr, n), getattr(rg, n), dtype, f"{what} {n}")


def _composite(rng):
    """A score function reading a gather of a gather (T5-style buckets), tanh, a float
    and an integer capture, // and % of negative operands, a power of a negative base
    with a computed exponent, where with -inf; mask
    functions: a prefix per batch row (| causal) and a dilated pattern of negative
    differences, with a band conjunct."""
    n_rel = SQ + SK - 1
    bucket = (np.arange(n_rel) % 7).astype(np.int32)
    table = (0.5 * rng.standard_normal((HQ, 7))).astype(np.float32)
    temp = (1.0 + 0.2 * rng.standard_normal(HQ)).astype(np.float32)

    def fn(score, b, h, q_idx, kv_idx, bucket, table, temp):
        d = kv_idx - q_idx
        s = 4.0 * am.tanh(score * temp[h] / 4.0) + table[h, bucket[d + (SQ - 1)]]
        s = s + 0.25 * ((d // 3) % 5) - 0.1 * (d % -4) + am.exp(-abs(d) / 16.0)
        s = s + 0.05 * (score * 0.25) ** (h + 1)     # a negative base, a computed exponent
        return am.where((d % 11 == 10) & (q_idx > 3), -math.inf, s)

    prefix = rng.integers(1, SK, size=B).astype(np.int64)
    mask = (aa.Causal() | aa.MaskMod(lambda b, h, q_idx, kv_idx, n: kv_idx < n[b], n=prefix)) \
        & aa.MaskMod(lambda b, h, q_idx, kv_idx: ((q_idx - kv_idx) % 3 != 1)
                     & (q_idx - kv_idx <= 30))
    return aa.ScoreMod(fn, bucket=bucket, table=table, temp=temp), mask


def test_functions_match_the_float64_reference_and_new_captures_compile_nothing(be):
    rng = np.random.default_rng(11)
    q, k, v, g = make_qkv(rng, B, HQ, HKV, SQ, SK, D)            # GQA 4 : 2, Sq != Sk
    sm, mask = _composite(rng)
    kw = dict(score_mod=sm, mask=mask)
    _check(kw, q, k, v, g, "float32", "composite")
    # new captured values (in place, as a training step updates them): same kernels
    pipes = len(be.runner().pipes)
    sm.captures["table"][...] = rng.standard_normal(sm.captures["table"].shape)
    sm.captures["temp"][...] *= 0.5
    _check(kw, q, k, v, g, "float32", "composite, new captures")
    assert len(be.runner().pipes) == pipes


def test_kernels_without_functions_carry_no_generated_text():
    from wg_util import GPU_TILE

    consts = GPU_TILE.consts()
    plain = build_source("forward", consts)
    assert "capb" not in plain and "smod_" not in plain
    with pytest.raises(KernelError, match="generated functions"):
        build_source("forward", dict(consts, SCOREMOD=1))
    with pytest.raises(KernelError, match="generated functions"):
        build_source("forward", consts, progs="fn f() {}")


@pytest.mark.exhaustive          # each entry compiles its own kernels on lavapipe (~30 s)
@pytest.mark.parametrize("name", sorted(gallery.GALLERY))
def test_gallery_fp32(be, name):
    make, square = gallery.GALLERY[name]
    sq, sk = (48, 48) if square else (SQ, SK)
    q, k, v, g = make_qkv(np.random.default_rng(5), B, HQ, HKV, sq, sk, D)
    e = make(B, HQ, sq, sk, np.random.default_rng(7))
    _check(e.kwargs, q, k, v, g, "float32", name)


@pytest.mark.exhaustive          # the f16 kernels of one entry (~40 s on lavapipe)
def test_gallery_entry_f16(be):
    if not be.context.has_f16:
        pytest.skip("the adapter lacks shader-f16")
    make, _ = gallery.GALLERY["relative_position_bias"]
    q, k, v, g = make_qkv(np.random.default_rng(6), B, HQ, HKV, SQ, SK, D, "float16")
    e = make(B, HQ, SQ, SK, np.random.default_rng(8))
    _check(e.kwargs, q, k, v, g, "float16", "relative position bias f16")
