"""webgpu score modifiers (softcap, ALiBi, sinks; DESIGN.md §1) against the float64
reference at the project's tolerances: each alone and all together, with every mask
term, bias + dbias, GQA, Sq != Sk, offsets, odd sizes, layouts, float16, empty rows,
-inf sinks, dsinks, saturated soft-capping; the shader's tanh against float64; split
launches and batch chunks; the error paths.

Shape legend: B batch, Hq/Hkv heads, Sq/Sk queries/keys, D head dim.
"""
from __future__ import annotations

import re
import zlib

import numpy as np
import pytest

import anyattn as aa
from anyattn import reference as R
from anyattn.api import forward_with_stats
from anyattn.backends.webgpu import pipelines, uniforms
from anyattn.modifiers import NO_MODS
from anyattn.problem import describe

from helpers import assert_close, compare_with_reference, make_qkv, term_magnitudes
from wg_util import CASE_MASKS as MASKS
from wg_util import bind_whole, bshd_strided_qkv, run_probe


def run_both(q, k, v, g, **kw):
    """webgpu vs the reference (``helpers.compare_with_reference``)."""
    return compare_with_reference("webgpu", q, k, v, g, **kw)


def _mods(r, names, B, Hq, dtype="float32"):
    m = {}
    if "softcap" in names:
        m["softcap"] = 1.7
    if "alibi" in names:
        m["alibi_slopes"] = r.uniform(0.05, 0.6, Hq).astype(dtype)
    if "alibi_b" in names:
        m["alibi_slopes"] = r.uniform(0.05, 0.6, (B, Hq)).astype(dtype)
    if "sinks" in names:
        m["sinks"] = r.standard_normal(Hq).astype(dtype)
    if "offsets" in names:
        m.update(q_offset=7, k_offset=3)
    if "koffsets" in names:                # ALiBi's diagonal negative: keys ahead
        m.update(q_offset=1, k_offset=12)
    return m


def _wrt(mods, bias=None):
    return ("q", "k", "v") + (("bias",) if bias is not None else ()) + \
        (("sinks",) if "sinks" in mods else ())


# (modifiers, mask, bias shape or None, (B, Hq, Hkv, Sq, Sk, D))
CASES = [
    ("softcap", "causal", None, (1, 4, 2, 37, 45, 16)),
    ("softcap", "window", (1, 2, 21, 27), (2, 2, 2, 21, 27, 16)),
    ("alibi", None, None, (1, 2, 1, 45, 19, 16)),
    ("alibi_b-offsets", "causal_br", None, (2, 2, 1, 30, 41, 16)),
    ("alibi", "docs", None, (1, 3, 3, 33, 40, 8)),
    ("sinks", "keep", None, (1, 4, 2, 40, 36, 16)),
    ("sinks", "causal", (2, 1, 1, 27), (2, 2, 1, 21, 27, 16)),
    ("softcap-alibi-sinks", "docs_b_causal", (1, 3, 23, 31), (2, 3, 1, 23, 31, 13)),
    ("softcap-alibi_b-sinks-offsets", "window", (2, 4, 1, 35), (2, 4, 2, 17, 35, 24)),
    ("softcap-alibi-sinks-koffsets", "causal_br", None, (1, 2, 1, 5, 7, 3)),
    ("softcap-alibi-sinks", None, (1, 1, 1, 1), (1, 1, 1, 1, 1, 8)),
]


@pytest.mark.parametrize("names,mname,bshape,shape", CASES,
                         ids=[f"{c[0]}-{c[1]}-{'bias' if c[2] else 'nobias'}" for c in CASES])
def test_modifiers(be, names, mname, bshape, shape):
    B, Hq, Hkv, Sq, Sk, D = shape
    r = np.random.default_rng(zlib.crc32(f"{names}/{mname}".encode()))
    q, k, v, g = make_qkv(r, B, Hq, Hkv, Sq, Sk, D)
    mods = _mods(r, names.split("-"), B, Hq)
    bias = None if bshape is None else r.standard_normal(bshape).astype(np.float32)
    run_both(q, k, v, g, mask=MASKS[mname](Sq, Sk, r), bias=bias, wrt=_wrt(mods, bias), **mods)


def test_modifiers_bshd_layout_and_strided_views(be):
    r = np.random.default_rng(1)
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 19, 26, 16
    q, k, v, g = bshd_strided_qkv(r, B, Hq, Hkv, Sq, Sk, D)
    mods = _mods(r, ["softcap", "alibi_b", "sinks", "offsets"], B, Hq)
    run_both(q, k, v, g, mask=aa.Causal("bottom_right"), layout="bshd", wrt=_wrt(mods),
             **mods)


def test_modifiers_float16(be):
    if not be.context.has_f16:
        pytest.skip(f"adapter {be.context.name} has no shader-f16")
    r = np.random.default_rng(2)
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 33, 41, 32
    q, k, v, g = make_qkv(r, B, Hq, Hkv, Sq, Sk, D, dtype="float16")
    mods = _mods(r, ["softcap", "alibi_b", "offsets"], B, Hq, "float16")
    mods["sinks"] = r.standard_normal(Hq).astype(np.float32)   # sinks in float32: dsinks too
    bias = r.standard_normal((1, Hq, Sq, Sk)).astype(np.float16)
    run_both(q, k, v, g, mask=aa.Causal(), bias=bias, wrt=_wrt(mods, bias), **mods)


def test_sinks_on_rows_that_keep_no_key(be):
    """out 0, lse = sinks[h] exactly, no gradient from the row; a -inf sink is no sink
    (lse -inf there); whole empty tiles (bottom-right causal, Sq > Sk) too."""
    r = np.random.default_rng(3)
    B, Hq, Hkv, Sq, Sk, D = 1, 3, 1, 40, 36, 16
    keep = r.random((B, 1, Sq, Sk)) < 0.5
    keep[:, :, ::3] = False
    q, k, v, g = make_qkv(r, B, Hq, Hkv, Sq, Sk, D)
    sinks = np.array([0.7, -np.inf, -2.5], np.float32)
    out, lse, gr = run_both(q, k, v, g, mask=aa.KeepMask(keep), sinks=sinks,
                            wrt=("q", "k", "v", "sinks"))
    assert np.all(out[:, :, ::3] == 0)
    np.testing.assert_array_equal(lse[0, 0, ::3], np.float32(0.7))
    np.testing.assert_array_equal(lse[0, 2, ::3], np.float32(-2.5))
    assert np.all(np.isneginf(lse[0, 1, ::3]))
    assert np.all(gr.dq[:, :, ::3] == 0)
    assert np.isfinite(gr.dsinks).all() and gr.dsinks[1] == 0
    # Sq > Sk, bottom-right: the first 50 rows keep nothing (whole skipped tiles)
    q, k, v, g = make_qkv(r, 1, 2, 1, 70, 20, 16)
    sinks = np.array([1.25, -np.inf], np.float32)
    out, lse, _ = run_both(q, k, v, g, mask=aa.Causal("bottom_right"), sinks=sinks,
                           softcap=2.5, wrt=("q", "k", "v", "sinks"))
    assert np.all(out[:, :, :50] == 0)
    np.testing.assert_array_equal(lse[0, 0, :50], np.float32(1.25))
    assert np.all(np.isneginf(lse[0, 1, :50]))


def test_sinks_all_minus_inf_is_plain_attention(be):
    r = np.random.default_rng(4)
    q, k, v, g = make_qkv(r, 1, 2, 1, 21, 30, 16)
    sinks = np.full(2, -np.inf, np.float32)
    o1, l1 = aa.attention(q, k, v, mask=aa.Causal(), sinks=sinks, return_lse=True,
                          backend="webgpu")
    o0, l0 = aa.attention(q, k, v, mask=aa.Causal(), return_lse=True, backend="webgpu")
    np.testing.assert_array_equal(o1, o0)
    np.testing.assert_array_equal(l1, l0)
    gr = aa.attention_backward(q, k, v, g, mask=aa.Causal(), sinks=sinks,
                               wrt=("q", "sinks"), backend="webgpu")
    np.testing.assert_array_equal(gr.dsinks, np.zeros(2, np.float32))


def test_dsinks_alone_and_with_given_out_lse(be):
    """wrt=('sinks',) runs no kernel and equals the dsinks of a full backward; a
    RowStats / plain lse from the forward (sink included) gives the same gradients."""
    r = np.random.default_rng(5)
    B, Hq, Hkv, Sq, Sk, D = 2, 2, 1, 25, 33, 16
    q, k, v, g = make_qkv(r, B, Hq, Hkv, Sq, Sk, D)
    mods = _mods(r, ["softcap", "alibi", "sinks"], B, Hq)
    full = aa.attention_backward(q, k, v, g, wrt=("q", "k", "v", "sinks"), backend="webgpu",
                                 **mods)
    alone = aa.attention_backward(q, k, v, g, wrt=("sinks",), backend="webgpu", **mods)
    assert alone.dq is None and alone.dk is None
    np.testing.assert_array_equal(alone.dsinks, full.dsinks)
    rg = R.backward(q, k, v, g, wrt=("sinks",), **mods)
    mag = term_magnitudes(q, k, v, g, **mods)
    assert_close(alone.dsinks, rg.dsinks, "float32", "dsinks", magnitude=mag["dsinks"])
    out, st = forward_with_stats(q, k, v, backend="webgpu", **mods)
    _, lse = aa.attention(q, k, v, return_lse=True, backend="webgpu", **mods)
    for given in (st, lse):
        gv = aa.attention_backward(q, k, v, g, out=out, lse=given,
                                   wrt=("q", "k", "v", "sinks"), backend="webgpu", **mods)
        for n in ("dq", "dk", "dv", "dsinks"):
            np.testing.assert_allclose(getattr(gv, n), getattr(full, n), rtol=0, atol=1e-6)


def test_softcap_saturated_logits(be):
    """Logits far past the cap (|scale·qk| ~ 1e3..1e5, c = 5): scores saturate at ±c,
    1 - tanh² underflows to 0 without NaN; everything matches the reference."""
    r = np.random.default_rng(6)
    q, k, v, g = make_qkv(r, 1, 2, 1, 29, 37, 16)
    q = q * np.float32(300.0)
    q[0, 0, 3] *= np.float32(100.0)
    bias = r.standard_normal((1, 2, 29, 37)).astype(np.float32)
    out, lse, gr = run_both(q, k, v, g, bias=bias, mask=aa.Causal("bottom_right"),
                            softcap=5.0, wrt=("q", "k", "v", "bias"))
    for x in (out, lse, gr.dq, gr.dk, gr.dv, gr.dbias):
        assert not np.isnan(x).any()
    assert np.all(np.abs(lse) <= 5.0 + np.log(37) + 4.0)


# ------------------------------------------------------------ the shader's tanh
def _softcap_kernel(device):
    """A compute pipeline running common.wgsl's softcap_t over an f32 array:
    y[2i] = c·tanh(x/c), y[2i+1] = 1 − tanh²(x/c) (c from the uniform block)."""
    text = (pipelines.SHADER_DIR / "common.wgsl").read_text()
    m = re.search(r"^fn softcap_t\(.*?^}\n", text, flags=re.M | re.S)
    assert m, "softcap_t not found in common.wgsl"
    src = (uniforms.wgsl_struct()
           + "@group(0) @binding(0) var<uniform> U: Uni;\n"
           + "@group(0) @binding(1) var<storage, read> xin: array<f32>;\n"
           + "@group(0) @binding(2) var<storage, read_write> yout: array<f32>;\n"
           + pipelines._reinit_vars(m.group(0))
           + """
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  if (gid.x >= arrayLength(&xin)) { return; }
  let r = softcap_t(xin[gid.x]);
  yout[2u * gid.x] = r.x;
  yout[2u * gid.x + 1u] = r.y;
}
""")
    return device.create_compute_pipeline(
        layout="auto", compute={"module": device.create_shader_module(code=src),
                                "entry_point": "main"})


def _run_softcap_kernel(be, x, c):
    import wgpu

    dev = be.device
    pipe = _softcap_kernel(dev)
    ub = dev.create_buffer_with_data(data=uniforms.pack({"softcap": c}),
                                     usage=wgpu.BufferUsage.UNIFORM)
    xb = dev.create_buffer_with_data(data=x, usage=wgpu.BufferUsage.STORAGE)
    yb = dev.create_buffer(size=8 * x.size,
                           usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
    return np.frombuffer(run_probe(dev, pipe, bind_whole(ub, xb, yb), yb, -(-x.size // 64)),
                         np.float32).reshape(-1, 2)


@pytest.mark.parametrize("c", [1.0, 30.0])
def test_shader_tanh_against_float64(be, c):
    """c·tanh(x/c) within 4 ulp of float64 everywhere (tanh itself <= 2.6 ulp measured,
    plus the roundings of x/c and c·t), including |x/c| from 1e-30 to the saturation
    (WGSL's own tanh on llvmpipe: 6.9e-5 relative at 1e-3, any relative error below),
    exactly ±c when saturated; 1 − tanh² to a few ulp plus its
    conditioning while it is above 1e-30 (no cancellation near saturation: 1 − t·t
    from a rounded t would be 100 % off there), never NaN."""
    y = np.concatenate([np.geomspace(1e-30, 1e-3, 200), np.linspace(1e-3, 12, 6000),
                        [0.55, np.nextafter(np.float32(0.55), np.float32(0)), 40.0, 1e4,
                         1e30]])
    y = np.concatenate([y, -y, [0.0]])
    x = (y * c).astype(np.float32)
    got = _run_softcap_kernel(be, x, c).astype(np.float64)
    th = np.tanh(x.astype(np.float64) / c)
    want = c * th
    ulp = np.spacing(np.abs(want).astype(np.float32)).astype(np.float64)
    err_ulp = np.abs(got[:, 0] - want) / ulp
    assert err_ulp.max() <= 4.0, (err_ulp.max(), x[np.argmax(err_ulp)])
    sat = np.abs(x.astype(np.float64) / c) >= 9.1
    np.testing.assert_array_equal(got[sat, 0], np.float32(c) * np.sign(x[sat]))
    d = 1.0 - th * th
    big = d > 1e-30
    # the condition number of 1 − tanh²(y) in y is 2|y|·tanh(y) (y = x/c rounds to
    # f32 first) and WGSL's exp is 3 + 2|2y| ulp: a few ulp plus 6|y| ulp
    rel = np.abs(got[big, 1] - d[big]) / d[big]
    allowed = 2.0 ** -23 * (4.0 + 6.0 * np.abs(x[big].astype(np.float64) / c))
    assert np.all(rel <= allowed), (rel.max(), x[big][np.argmax(rel / allowed)])
    print(f"c={c}: tanh {err_ulp.max():.2f} ulp, 1 - tanh^2 {(rel / allowed).max():.2f} "
          "of its bound")
    assert np.all(got[~big, 1] <= 1e-30) and not np.isnan(got).any()
    assert got[x == 0, 0][0] == 0 and got[x == 0, 1][0] == 1


# ---------------------------------------------------- launches, chunks, kernels
def test_split_launches_with_modifiers(be):
    """A tiny loop budget splits every tiled launch; the sink joins only in the last
    piece of the forward: the same results as one launch, bitwise."""
    r = np.random.default_rng(7)
    q, k, v, g = make_qkv(r, 1, 4, 2, 40, 100, 24)
    mods = _mods(r, ["softcap", "alibi", "sinks"], 1, 4)
    kw = dict(mask=aa.Causal("bottom_right"), backend="webgpu", **mods)
    o1, l1 = aa.attention(q, k, v, return_lse=True, **kw)
    g1 = aa.attention_backward(q, k, v, g, wrt=("q", "k", "v", "sinks"), **kw)
    be.loop_limit_override = 100
    o2, l2 = aa.attention(q, k, v, return_lse=True, **kw)
    assert be.last_pieces["forward"] > 1
    g2 = aa.attention_backward(q, k, v, g, wrt=("q", "k", "v", "sinks"), **kw)
    assert be.last_pieces["bwd_dq"] > 1 and be.last_pieces["bwd_dkdv"] > 1
    np.testing.assert_array_equal(o1, o2)
    np.testing.assert_array_equal(l1, l2)
    for n in ("dq", "dk", "dv", "dsinks"):
        np.testing.assert_array_equal(getattr(g1, n), getattr(g2, n))


def test_batch_chunks_slice_per_batch_slopes(be):
    """Past the storage-binding limit the batch is split; [B, Hq] slopes are sliced
    with it and dsinks sums over every batch."""
    r = np.random.default_rng(8)
    B, Hq, Hkv, Sq, Sk, D = 3, 2, 1, 20, 24, 16
    q, k, v, g = make_qkv(r, B, Hq, Hkv, Sq, Sk, D)
    mods = _mods(r, ["alibi_b", "sinks", "softcap"], B, Hq)
    mods["alibi_slopes"][1] *= 4                  # batches differ clearly
    run = be.runner()
    saved = run.max_binding
    run.max_binding = 4 * 2 * Hkv * Sk * D + 16   # one batch's dk/dv buffer fits, not two
    try:
        run_both(q, k, v, g, mask=aa.Causal(), wrt=_wrt(mods), **mods)
        assert be.last_pieces.get("batch_chunks") == B
    finally:
        run.max_binding = saved


def test_plain_kernels_carry_no_modifier_code(be):
    """Without modifiers the kernels are the plain ones (the seed ABI runs those): no
    tanh, no ALiBi, no sink in their source; each define brings its own code."""
    from anyattn.backends.webgpu.launch import choose_config

    consts = choose_config(be.context, 16).consts()
    for kern in ("forward", "bwd_dq", "bwd_dkdv"):
        plain = pipelines.build_source(kern, consts)
        assert "softcap_t(" not in plain and "U.al_off" not in plain and "U.snk_off" not in plain
        cap = pipelines.build_source(kern, dict(consts, SOFTCAP=1))
        assert "softcap_t(s[" in cap
        assert "U.al_off" in pipelines.build_source(kern, dict(consts, ALIBI=1))
    assert "U.snk_off" in pipelines.build_source("forward", dict(consts, SINKS=1))


def test_poisoned_scratch_with_modifiers(be):
    r = np.random.default_rng(9)
    q, k, v, g = make_qkv(r, 2, 2, 1, 23, 29, 16)
    bias = r.standard_normal((2, 1, 23, 29)).astype(np.float32)
    mods = _mods(r, ["softcap", "alibi_b", "sinks"], 2, 2)
    kw = dict(mask=aa.Causal(), bias=bias, backend="webgpu", **mods)
    wrt = ("q", "k", "v", "bias", "sinks")
    o1 = aa.attention(q, k, v, **kw)
    a = aa.attention_backward(q, k, v, g, wrt=wrt, **kw)
    be.runner().poison()
    np.testing.assert_array_equal(o1, aa.attention(q, k, v, **kw))
    be.runner().poison()
    b = aa.attention_backward(q, k, v, g, wrt=wrt, **kw)
    for n in ("dq", "dk", "dv", "dbias", "dsinks"):
        np.testing.assert_array_equal(getattr(a, n), getattr(b, n))


# ------------------------------------------------------------------ error paths
def test_alibi_offsets_past_i32_are_named(be):
    q, k, v, _ = make_qkv(np.random.default_rng(10), 1, 2, 1, 4, 4, 8)
    with pytest.raises(ValueError, match=r"^q_offset/k_offset: the ALiBi distance"):
        aa.attention(q, k, v, alibi_slopes=np.ones(2, np.float32), q_offset=2**31 - 2,
                     backend="webgpu")


def test_softcap_overflowing_f32_is_named(be):
    q, k, v, _ = make_qkv(np.random.default_rng(11), 1, 1, 1, 4, 4, 8)
    p = describe(q, k, v, softcap=1e39)                 # finite in float64
    with pytest.raises(ValueError, match=r"^softcap: .*overflows float32"):
        be.forward(p, q, k, v, None, NO_MODS)
