"""webgpu dropout (DESIGN.md §1 "Dropout", anyattn.dropout) against the float64
reference applying the same mask, at the project's tolerances: out, lse (undropped),
dq, dk, dv, dbias, dsinks with masks, bias, GQA, Sq != Sk, offsets, softcap / ALiBi /
sinks, column slices, layouts, float16; the drawn mask bit for bit against
``anyattn.dropout_mask`` (read back from the forward's P·V, the dK/dV pass's dV and
the dQ pass's dS), the shader's Philox against NumPy's, the same bits across calls,
split launches and batch chunks, seeds near 2**64, p near 0 and 1.

Shape legend: B batch, Hq/Hkv heads, Sq/Sk queries/keys, D head dim.
"""
from __future__ import annotations

import re
import sys
import zlib

import numpy as np
import pytest

import anyattn as aa
from anyattn import reference as R
from anyattn.backends.webgpu import pipelines, uniforms
from anyattn.dropout import dropout_mask, keep_scale, philox4x32

if __name__ == "__main__" and "helpers" not in sys.modules:   # run as the cost script
    import importlib.util
    import os

    _spec = importlib.util.spec_from_file_location("helpers", os.path.join(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers.py"))
    sys.modules["helpers"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["helpers"])
from helpers import assert_close, compare_with_reference, make_qkv, term_magnitudes  # noqa: E402
from wg_util import CASE_MASKS as MASKS  # noqa: E402
from wg_util import bind_whole, bshd_strided_qkv, run_probe  # noqa: E402


def run_both(q, k, v, g, **kw):
    """webgpu with dropout vs the reference applying the same mask
    (``helpers.compare_with_reference``; lse undropped)."""
    return compare_with_reference("webgpu", q, k, v, g, **kw)


# (p, seed, mask, bias shape or None, extras, (B, Hq, Hkv, Sq, Sk, D))
CASES = [
    (0.3, 12345, None, None, "", (1, 2, 1, 37, 45, 16)),
    (0.1, 7, "causal", "full", "offsets", (2, 4, 2, 33, 40, 16)),
    (0.5, 2**40 + 3, "window", (1, 2, 1, 27), "", (2, 2, 2, 21, 27, 24)),
    (0.2, 99, "docs_b_causal", (1, 3, 23, 31), "softcap-alibi_b-sinks", (2, 3, 1, 23, 31, 13)),
    (0.7, 2**64 - 1, "keep", None, "sinks-offsets", (1, 4, 2, 40, 36, 16)),
    (0.25, 2**64 - 2**32 + 5, "causal_br", None, "softcap-alibi", (1, 2, 2, 19, 70, 8)),
    (1e-7, 5, None, None, "", (1, 2, 1, 30, 30, 16)),
    (0.99, 6, "causal_br", (1, 1, 1, 50), "", (1, 2, 1, 30, 50, 16)),
    (0.4, 8, None, None, "offsets", (1, 2, 1, 20, 33, 80)),      # column slices (D > DS)
    (0.5, 9, None, None, "", (1, 1, 1, 1, 1, 8)),
]


def _extras(r, names, B, Hq, dtype="float32"):
    m = {}
    if "softcap" in names:
        m["softcap"] = 1.7
    if "alibi_b" in names:
        m["alibi_slopes"] = r.uniform(0.05, 0.6, (B, Hq)).astype(dtype)
    elif "alibi" in names:
        m["alibi_slopes"] = r.uniform(0.05, 0.6, Hq).astype(dtype)
    if "sinks" in names:
        m["sinks"] = r.standard_normal(Hq).astype(dtype)
    if "offsets" in names:
        m.update(q_offset=1000, k_offset=3)
    return m


@pytest.mark.parametrize("p,seed,mname,bshape,extras,shape", CASES,
                         ids=[f"p{c[0]}-{c[2]}-{'bias' if c[3] else 'nobias'}-{c[4] or 'plain'}"
                              for c in CASES])
def test_dropout_against_reference(be, p, seed, mname, bshape, extras, shape):
    B, Hq, Hkv, Sq, Sk, D = shape
    r = np.random.default_rng(zlib.crc32(f"{p}/{mname}/{extras}".encode()))
    q, k, v, g = make_qkv(r, B, Hq, Hkv, Sq, Sk, D)
    kw = _extras(r, extras.split("-"), B, Hq)
    if bshape == "full":
        bshape = (B, Hq, Sq, Sk)
    bias = None if bshape is None else r.standard_normal(bshape).astype(np.float32)
    wrt = ("q", "k", "v") + (("bias",) if bias is not None else ()) + \
        (("sinks",) if "sinks" in kw else ())
    run_both(q, k, v, g, mask=MASKS[mname](Sq, Sk, r), bias=bias, wrt=wrt, dropout_p=p,
             dropout_seed=seed, **kw)


def test_dropout_bshd_layout_and_strided_views(be):
    r = np.random.default_rng(1)
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 19, 26, 16
    q, k, v, g = bshd_strided_qkv(r, B, Hq, Hkv, Sq, Sk, D)
    run_both(q, k, v, g, mask=aa.Causal("bottom_right"), layout="bshd", dropout_p=0.35,
             dropout_seed=2024, q_offset=4, k_offset=11)


def test_dropout_float16(be):
    if not be.context.has_f16:
        pytest.skip(f"adapter {be.context.name} has no shader-f16")
    r = np.random.default_rng(2)
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 33, 41, 32
    q, k, v, g = make_qkv(r, B, Hq, Hkv, Sq, Sk, D, dtype="float16")
    bias = r.standard_normal((1, Hq, Sq, Sk)).astype(np.float16)
    run_both(q, k, v, g, mask=aa.Causal(), bias=bias, wrt=("q", "k", "v", "bias"),
             dropout_p=0.2, dropout_seed=31337, softcap=3.0, q_offset=2, k_offset=5)


def test_dropout_gpu_tile_config(be):
    """The GPU tiles (16 x 16 threads, BQ = BK = 64: 256 invocations, row / column
    words from the first 64; D chunks of 8 so that it fits lavapipe's 32 KiB) on this
    adapter: the reference with the same mask."""
    from anyattn.backends.webgpu.launch import TileConfig

    cfg = TileConfig(16, 16, 8, 8, 1)
    lim = be.context.limits
    if cfg.NT > lim.get("max-compute-invocations-per-workgroup", 256) or any(
            cfg.smem_bytes(k, dropout=True) > lim.get("max-compute-workgroup-storage-size",
                                                      16384)
            for k in ("forward", "bwd_dq", "bwd_dkdv")):
        pytest.skip(f"{cfg} does not fit {be.context.name}")
    be.config_override = cfg
    r = np.random.default_rng(12)
    q, k, v, g = make_qkv(r, 1, 2, 1, 70, 90, 16)
    run_both(q, k, v, g, mask=aa.Causal("bottom_right"), dropout_p=0.3, dropout_seed=2**64 - 9,
             q_offset=5, k_offset=2)


# ------------------------------------------------------------- the mask, bit for bit
def _eye_rows(B, H, S, D):
    """[B, H, S, D] with row j = e_j (one-hot)."""
    x = np.zeros((B, H, S, D), np.float32)
    x[:, :, np.arange(S), np.arange(S)] = 1.0
    return x


MASK_CASES = [
    (0.5, 0, 0, 0),
    (0.3, 2**64 - 1, 100, 7),
    (0.9, 2**63 + 12345, 2**32 - 70, 2**32 - 100),     # positions at the top of u32
    (0.05, 2**32 - 1, 5, 2**31),
    (1e-6, 11, 0, 0),
    (1 - 1e-6, 12, 0, 0),
]


@pytest.mark.parametrize("p,seed,qo,ko", MASK_CASES)
def test_mask_bits_forward_and_dv(be, p, seed, qo, ko):
    """v[j] = e_j gives out[i, j] = P_ij·keep_ij/(1 − p) and dout[i] = e_i gives
    dv[j, i] = the same: out != 0 and dv != 0 are the masks the forward and the dK/dV
    pass drew; both equal dropout_mask exactly (every P_ij > 0 here)."""
    B, H, Sq, Sk = 2, 3, 45, 70
    D = max(Sq, Sk)
    r = np.random.default_rng(seed % 1000)
    q = r.standard_normal((B, H, Sq, D)).astype(np.float32) * np.float32(0.3)
    k = r.standard_normal((B, H, Sk, D)).astype(np.float32) * np.float32(0.3)
    v = _eye_rows(B, H, Sk, D)
    g = _eye_rows(B, H, Sq, D)
    kw = dict(dropout_p=p, dropout_seed=seed, q_offset=qo, k_offset=ko, backend="webgpu")
    want = dropout_mask((B, H, Sq, Sk), p, seed, q_offset=qo, k_offset=ko)
    out = aa.attention(q, k, v, **kw)
    assert np.all(np.isfinite(out)) and np.all(out[..., Sk:] == 0)
    np.testing.assert_array_equal(out[..., :Sk] != 0, want)
    gr = aa.attention_backward(q, k, v, g, wrt=("v",), **kw)
    np.testing.assert_array_equal(gr.dv[..., :Sq].swapaxes(-1, -2) != 0, want)
    # and the values: P/(1 - p) on kept pairs
    ro, _ = R.forward(q, k, v, dropout_p=p, dropout_seed=seed, q_offset=qo, k_offset=ko)
    assert_close(out, ro, "float32", "out")
    if p > 0.5:
        assert want.mean() < 0.2
    else:
        assert want.mean() > 0.5


def test_mask_bits_dq_pass(be):
    """k[j] = e_j gives dq[i, j] = scale·dS_ij with dS_ij = P_ij·(dP_ij·keep_ij/(1 − p)
    − δ_i): where P_ij·|dP_ij|/(1 − p) stands far above the rounding, the nearer of the
    kept / dropped values tells the bit the dQ pass drew: it equals dropout_mask."""
    B, H, Sq, Sk, p, seed = 1, 2, 40, 56, 0.4, 2**64 - 12
    D = Sk
    r = np.random.default_rng(3)
    q = r.standard_normal((B, H, Sq, D)).astype(np.float32)
    k = _eye_rows(B, H, Sk, D)
    v = r.standard_normal((B, H, Sk, D)).astype(np.float32)
    g = r.standard_normal((B, H, Sq, D)).astype(np.float32)
    kw = dict(dropout_p=p, dropout_seed=seed, q_offset=9, k_offset=17)
    gr = aa.attention_backward(q, k, v, g, wrt=("q",), backend="webgpu", **kw)
    scale = 1.0 / np.sqrt(D)
    q64, k64, v64, g64 = (x.astype(np.float64) for x in (q, k, v, g))
    s = scale * np.einsum("bhid,bhjd->bhij", q64, k64)
    P = np.exp(s - s.max(-1, keepdims=True))
    P /= P.sum(-1, keepdims=True)
    out, _ = R.forward(q, k, v, **kw)
    dp = np.einsum("bhid,bhjd->bhij", g64, v64)
    delta = np.sum(g64 * out, axis=-1, keepdims=True)
    got = gr.dq.astype(np.float64) / scale
    keep_v = P * (dp * keep_scale(p) - delta)
    drop_v = -P * delta
    gap = np.abs(keep_v - drop_v)
    sure = gap > 1e-4 * gap.max()
    assert sure.mean() > 0.9
    drawn = np.abs(got - keep_v) < np.abs(got - drop_v)
    want = dropout_mask((B, H, Sq, Sk), p, seed, q_offset=9, k_offset=17)
    np.testing.assert_array_equal(drawn[sure], want[sure])
    err = np.minimum(np.abs(got - keep_v), np.abs(got - drop_v))[sure]
    assert np.all(err < 0.01 * gap[sure])      # every decision clear-cut


# ------------------------------------------------------------- the shader's Philox
def _philox_kernel(device):
    """common.wgsl's DROPOUT helpers: y[i] = philox_w0(counter i) under the uniform key,
    y[n + i] = 1 when drop_keep(row = counter i's x, col = its y) (threshold U.drop_t)."""
    text = (pipelines.SHADER_DIR / "common.wgsl").read_text()
    m = re.search(r"^//@if DROPOUT\n(.*?)^//@endif DROPOUT", text, flags=re.M | re.S)
    assert m, "the DROPOUT block of common.wgsl not found"
    body = pipelines._reinit_vars(pipelines._unroll(m.group(1), {}))
    src = (uniforms.wgsl_struct()
           + "@group(0) @binding(0) var<uniform> U: Uni;\n"
           + "@group(0) @binding(1) var<storage, read> cin: array<vec4<u32>>;\n"
           + "@group(0) @binding(2) var<storage, read_write> yout: array<u32>;\n"
           + body + """
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
  let n = arrayLength(&cin);
  if (gid.x >= n) { return; }
  let c = cin[gid.x];
  yout[gid.x] = philox_w0(c);
  yout[n + gid.x] = select(0u, 1u, drop_keep(c.x, c.y));
}
""")
    return device.create_compute_pipeline(
        layout="auto", compute={"module": device.create_shader_module(code=src),
                                "entry_point": "main"})


def _run_philox(be, counters, seed, t):
    import wgpu

    dev = be.device
    pipe = _philox_kernel(dev)
    ub = dev.create_buffer_with_data(
        data=uniforms.pack({"drop_k0": seed & 0xFFFFFFFF, "drop_k1": seed >> 32,
                            "drop_t": t}), usage=wgpu.BufferUsage.UNIFORM)
    cb = dev.create_buffer_with_data(data=np.ascontiguousarray(counters, np.uint32),
                                     usage=wgpu.BufferUsage.STORAGE)
    n = counters.shape[0]
    yb = dev.create_buffer(size=8 * n, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
    y = np.frombuffer(run_probe(dev, pipe, bind_whole(ub, cb, yb), yb, -(-n // 64)), np.uint32)
    return y[:n], y[n:].astype(bool)


@pytest.mark.parametrize("seed", [0, 2**64 - 1, 0xA4093822 | (0x299F31D0 << 32),
                                  0x123456789ABCDEF])
def test_shader_philox_and_finaliser_exact(be, seed):
    """The WGSL Philox4x32-10 (16-bit partial products for the high halves) equals
    NumPy's uint64 one on random and extreme counters, and the per-pair finaliser
    and threshold equal anyattn.dropout's, at t = 0, 2**31 and 2**32 − 1."""
    from anyattn.dropout import mix32

    r = np.random.default_rng(seed % 97)
    c = r.integers(0, 2**32, (4000, 4), dtype=np.uint64)
    c[:8] = [[0, 0, 0, 0], [0xFFFFFFFF] * 4, [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344],
             [1, 0, 0, 1], [0xFFFFFFFF, 0, 0, 1], [0x10000, 0xFFFF, 0x10000, 0xFFFF],
             [0xFFFF, 0x10000, 0xFFFF, 0x10000], [0x80000000, 1, 0x80000000, 1]]
    want = philox4x32(c[:, 0], c[:, 1], c[:, 2], c[:, 3], seed & 0xFFFFFFFF, seed >> 32)[0]
    for t in (0, 2**31, 2**32 - 1):
        got, keep = _run_philox(be, c, seed, t)
        np.testing.assert_array_equal(got, want)
        x = mix32((c[:, 0] ^ c[:, 1]).astype(np.uint32))
        np.testing.assert_array_equal(keep, x >= np.uint32(t))
    if seed == 0xA4093822 | (0x299F31D0 << 32):       # Random123 known answer, word 0
        assert int(got[2]) == 0xD16CFE09
    if seed == 2**64 - 1:
        assert int(got[1]) == 0x408F276D


# --------------------------------------------------- same bits: calls, launches, chunks
def test_same_seed_same_bits_across_calls_splits_and_chunks(be):
    """Repeated calls, split launches (tiny loop budget) and batch chunks (a small
    binding limit: the chunks draw at their global batch) give the same bits; another
    seed gives other results."""
    r = np.random.default_rng(4)
    B, Hq, Hkv, Sq, Sk, D = 3, 2, 1, 50, 70, 16
    q, k, v, g = make_qkv(r, B, Hq, Hkv, Sq, Sk, D)
    bias = r.standard_normal((B, 1, Sq, Sk)).astype(np.float32)
    sinks = r.standard_normal(Hq).astype(np.float32)
    kw = dict(mask=aa.Causal("bottom_right"), bias=bias, dropout_p=0.3, dropout_seed=2**64 - 5,
              q_offset=3, k_offset=1, softcap=2.0, sinks=sinks, backend="webgpu")
    wrt = ("q", "k", "v", "bias", "sinks")
    names = ("dq", "dk", "dv", "dbias", "dsinks")
    run = be.runner()
    saved = run.max_binding
    fwd_pieces = []

    def both(lim_f=None, lim_b=None):
        try:
            run.max_binding = lim_f or saved
            o, l = aa.attention(q, k, v, return_lse=True, **kw)
            nf = be.last_pieces.get("batch_chunks", 1)
            fwd_pieces.append(be.last_pieces.get("forward", 1))
            run.max_binding = lim_b or saved
            gr = aa.attention_backward(q, k, v, g, wrt=wrt, **kw)
            nb = be.last_pieces.get("batch_chunks", 1)
        finally:
            run.max_binding = saved
        return (o, l) + tuple(getattr(gr, n) for n in names), (nf, nb)
    ref, _ = both()
    for a, b in zip(ref, both()[0]):
        np.testing.assert_array_equal(a, b)
    be.loop_limit_override = 40           # every tiled launch in pieces of 1-2 units
    split, _ = both()
    assert be.last_pieces["bwd_dq"] > 1 and be.last_pieces["bwd_dkdv"] > 1
    assert fwd_pieces[-1] > 1
    be.loop_limit_override = None
    # one batch's bias (forward) / dS (backward) buffer fits, not two
    chunked, n = both(4 * Sq * Sk + 16, 4 * Hq * Sq * Sk + 16)
    assert n == (B, B)
    for a, b, c in zip(ref, split, chunked):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    # the chunked run is the reference's too (batch 1 and 2 draw at b = 1, 2)
    rk = {n: x for n, x in kw.items() if n != "backend"}
    ro, _ = R.forward(q, k, v, **rk)
    assert_close(ref[0], ro, "float32", "out",
                 magnitude=term_magnitudes(q, k, v, g, **{n: x for n, x in rk.items()
                                                if n != "mask" and n != "bias"},
                                 mask=kw["mask"], bias=bias)["out"])
    kw["dropout_seed"] = 2**64 - 6
    other = aa.attention(q, k, v, **kw)
    assert np.mean(other != ref[0]) > 0.5


def test_dropout_given_out_and_stats(be):
    """Backward from the forward's out and RowStats / lse equals the recomputing one."""
    from anyattn.api import forward_with_stats

    r = np.random.default_rng(5)
    q, k, v, g = make_qkv(r, 2, 2, 1, 25, 33, 16)
    kw = dict(dropout_p=0.2, dropout_seed=77, mask=aa.Causal(), backend="webgpu")
    full = aa.attention_backward(q, k, v, g, **kw)
    out, st = forward_with_stats(q, k, v, **kw)
    _, lse = aa.attention(q, k, v, return_lse=True, **kw)
    for given in (st, lse):
        gv = aa.attention_backward(q, k, v, g, out=out, lse=given, **kw)
        for n in ("dq", "dk", "dv"):
            np.testing.assert_allclose(getattr(gv, n), getattr(full, n), rtol=0, atol=1e-6)


def test_dropout_poisoned_scratch(be):
    r = np.random.default_rng(6)
    q, k, v, g = make_qkv(r, 2, 2, 1, 23, 29, 16)
    bias = r.standard_normal((2, 1, 23, 29)).astype(np.float32)
    kw = dict(mask=aa.Causal(), bias=bias, dropout_p=0.5, dropout_seed=3, backend="webgpu")
    wrt = ("q", "k", "v", "bias")
    o1 = aa.attention(q, k, v, **kw)
    a = aa.attention_backward(q, k, v, g, wrt=wrt, **kw)
    be.runner().poison()
    np.testing.assert_array_equal(o1, aa.attention(q, k, v, **kw))
    be.runner().poison()
    b = aa.attention_backward(q, k, v, g, wrt=wrt, **kw)
    for n in ("dq", "dk", "dv", "dbias"):
        np.testing.assert_array_equal(getattr(a, n), getattr(b, n))


# ------------------------------------------------------------- kernels, capabilities
def test_plain_kernels_carry_no_dropout_code(be):
    """Without dropout the kernels are the plain ones (the seed ABI runs those): no
    Philox, no keep test; DROPOUT brings it into forward, dQ and dK/dV."""
    from anyattn.backends.webgpu.launch import choose_config

    consts = choose_config(be.context, 16).consts()
    for kern in ("forward", "bwd_dq", "bwd_dkdv"):
        plain = pipelines.build_source(kern, consts)
        body = plain.split("const F_SEED_FLOOR", 1)[1]         # past the uniform struct
        body = re.sub(r"//[^\n]*", "", body)                    # code, not comments
        assert "drop_" not in body and "philox" not in body and "dcw" not in body
        dr = pipelines.build_source(kern, dict(consts, DROPOUT=1))
        assert "drop_keep(rwd, cwd[" in dr and "drop_col(j0 + lid)" in dr
        assert "drop_row(b, h," in dr


def test_capabilities_and_auto_dispatch(be):
    assert "dropout" in be.capabilities.modifiers
    q, k, v, _ = make_qkv(np.random.default_rng(7), 1, 1, 1, 4, 4, 8)
    from anyattn.problem import describe

    p = describe(q, k, v, dropout_p=0.5, dropout_seed=1)
    assert not any("dropout" in w for w in be.unsupported_reasons(p))
    with pytest.raises(ValueError, match="dropout_seed"):
        aa.attention(q, k, v, dropout_p=0.5, backend="webgpu")
    with pytest.raises(ValueError, match="q_offset"):
        aa.attention(q, k, v, dropout_p=0.5, dropout_seed=1, q_offset=2**32 - 3,
                     backend="webgpu")


def test_engine_refuses_positions_past_u32(be):
    """Call.set_dropout names a batch chunk or offset past 2**32 (the API refuses
    offsets earlier; this guards the engine's own callers)."""
    from anyattn.backends.webgpu.launch import choose_config
    from anyattn.backends.webgpu.engine import Call

    call = Call(be.runner(), choose_config(be.context, 8), 2, 1, 1, 4, 4, 8)
    with pytest.raises(ValueError, match=r"^batch: positions"):
        call.set_dropout(0.5, 1, 0, 0, b0=2**32 - 1)
    with pytest.raises(ValueError, match=r"^k_offset: positions"):
        call.set_dropout(0.5, 1, 0, 2**32 - 2)
    assert "DROPOUT" not in call.mod_consts
    call.set_dropout(0.0, None, 0, 0)
    assert "DROPOUT" not in call.mod_consts


# ------------------------------------------------------------------ cost (not a test)
def bench(rounds: int = 15, p: float = 0.1):
    """Forward + backward process CPU time, plain vs dropout p, device-resident plans of
    two backend instances (no shared buffers), medians of interleaved rounds.  Run as
    ``LP_NUM_THREADS=1 python tests/webgpu/test_webgpu_dropout.py`` (docs/webgpu.md
    'Dropout')."""
    import json
    import time

    from anyattn.backends.webgpu.backend import WebGPUBackend
    from anyattn.problem import describe

    def plans(B, H, S, D, drop, causal):
        r = np.random.default_rng(0)
        q, k, v, g = (r.standard_normal((B, H, S, D)).astype(np.float32) for _ in range(4))
        kw = dict(mask=aa.Causal() if causal else None)
        if drop:
            kw.update(dropout_p=drop, dropout_seed=1234567)
        pr = describe(q, k, v, dout=g, wrt=("q", "k", "v"), **kw)
        f, b, _, _ = WebGPUBackend().plan(pr, q, k, v, g)
        return f, b

    def once(f, b):
        t0 = time.process_time()
        f.submit()
        f.wait()
        b.submit()
        b.wait()
        return time.process_time() - t0

    for B, H, S, D, causal in ((1, 4, 384, 64, False), (1, 4, 512, 16, False),
                               (1, 4, 512, 64, True), (1, 2, 256, 128, False)):
        pa, pb = plans(B, H, S, D, 0.0, causal), plans(B, H, S, D, p, causal)
        once(*pa)
        once(*pb)                                           # compile, warm
        ta, tb = [], []
        for r in range(rounds):
            for which in ((0, 1) if r % 2 == 0 else (1, 0)):
                (ta if which == 0 else tb).append(once(*(pa if which == 0 else pb)))
        ma, mb = float(np.median(ta)), float(np.median(tb))
        print(json.dumps(dict(B=B, H=H, S=S, D=D, causal=causal, plain_cpu_s=ma,
                              drop_cpu_s=mb, ratio=mb / ma, paired_ratio=float(
                                  np.median(np.array(tb) / np.array(ta))))), flush=True)


if __name__ == "__main__":
    bench(int(sys.argv[1]) if len(sys.argv) > 1 else 15)


def test_workgroup_memory_counts_the_dropout_words(be):
    """choose_config counts drw/dcw (4·(BQ + BK) bytes) for dropout, never for the plain
    kernels; a config that only fits without them is refused, naming the kernel."""
    from types import SimpleNamespace

    from anyattn.backends.webgpu.engine import Call
    from anyattn.backends.webgpu.launch import TileConfig, choose_config

    plain = choose_config(be.context, 64)
    need = max(plain.smem_bytes(k) for k in ("forward", "bwd_dq", "bwd_dkdv"))
    ctx = SimpleNamespace(is_cpu=be.context.is_cpu, limits={
        "max-compute-workgroup-storage-size": need + 100,
        "max-compute-invocations-per-workgroup": 1024})
    assert choose_config(ctx, 64) == plain
    assert plain.smem_bytes("bwd_dq", dropout=True) == need + 4 * (plain.BQ + plain.BK)
    with pytest.raises(NotImplementedError, match="workgroup memory"):
        choose_config(ctx, 64, dropout=True)
    big = TileConfig(16, 16, 16, 16, 1)
    limit = be.context.limits.get("max-compute-workgroup-storage-size", 16384)
    if big.smem_bytes("forward", dropout=True) <= limit:
        pytest.skip(f"{big} fits {be.context.name} with dropout")
    call = Call(be.runner(), big, 1, 1, 1, 8, 8, 16)
    with pytest.raises(NotImplementedError, match=r"with dropout needs \d+ bytes"):
        call.set_dropout(0.5, 1, 0, 0)
