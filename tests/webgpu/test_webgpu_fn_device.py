"""Score and mask functions on anyattn.webgpu device arrays and over batch chunks, against
the float64 reference: forward (out, lse) and the gradients of q, k, v.

One score function and one mask function serve every test (their kernels compile once
per session on lavapipe).  The score function reads a float capture per (b, h) and an
integer bucket table at the relative position; the mask keeps a per-batch prefix or the
causal lower triangle.  Shape legend: B batch, Hq/Hkv heads, Sq/Sk queries/keys, D head
dim."""
import numpy as np
import pytest

import anyattn as aa
from anyattn import math as am

from helpers import assert_close, make_qkv

HQ, HKV, SQ, SK, D = 2, 1, 24, 40, 16
NB = 4          # batch rows of the per-batch captures (their shapes are in the kernel text)
WRT = ("q", "k", "v")


def _functions(rng):
    n_rel = SQ + SK - 1
    bucket = (np.arange(n_rel) % 5).astype(np.int32)
    table = (0.5 * rng.standard_normal(5)).astype(np.float32)
    gain = (1.0 + 0.5 * rng.standard_normal((NB, HQ))).astype(np.float32)

    def fn(score, b, h, q_idx, kv_idx, bucket, table, gain):
        return am.tanh(score * gain[b, h]) * 3.0 + table[bucket[kv_idx - q_idx + (SQ - 1)]]

    prefix = rng.integers(1, SK, size=NB).astype(np.int64)
    mask = aa.Causal() | aa.MaskMod(lambda b, h, q_idx, kv_idx, n: kv_idx < n[b], n=prefix)
    return aa.ScoreMod(fn, bucket=bucket, table=table, gain=gain), mask, prefix


def _f64(*xs):
    return [np.asarray(x, np.float64) for x in xs]


def _host(x):
    return x if isinstance(x, np.ndarray) else x.numpy()


def _check(q, k, v, g, kw, inputs=None, what=""):
    """webgpu on ``inputs`` (default the NumPy q, k, v, dout) vs the float64 reference."""
    inputs = inputs or (q, k, v, g)
    out, lse = aa.attention(*inputs[:3], return_lse=True, backend="webgpu", **kw)
    ro, rl = aa.attention(*_f64(q, k, v), return_lse=True, backend="reference", **kw)
    assert_close(_host(out), ro, "float32", f"{what} out")
    fin = np.isfinite(rl)
    np.testing.assert_array_equal(np.isfinite(_host(lse)), fin)
    assert_close(_host(lse)[fin], rl[fin], "float32", f"{what} lse")
    gr = aa.attention_backward(*inputs, wrt=WRT, backend="webgpu", **kw)
    rg = aa.attention_backward(*_f64(q, k, v, g), wrt=WRT, backend="reference", **kw)
    for n in ("d" + w for w in WRT):
        assert_close(_host(getattr(gr, n)), getattr(rg, n), "float32", f"{what} {n}")


def test_device_arrays_run_functions_and_follow_new_captures(be):
    """q/k/v/dout as device arrays with NumPy captures: forward and backward match
    float64; captures changed in place give the new results (a cached launch template
    never keeps old capture words) and compile nothing."""
    from anyattn import webgpu as wg

    rng = np.random.default_rng(3)
    B = 2
    q, k, v, g = make_qkv(rng, B, HQ, HKV, SQ, SK, D)
    sm, mask, prefix = _functions(rng)
    dev = tuple(wg.asarray(x) for x in (q, k, v, g))
    kw = dict(score_mod=sm, mask=mask)
    _check(q, k, v, g, kw, dev, "device arrays")
    _check(q, k, v, g, kw, dev, "device arrays, repeat")        # the cached templates
    pipes = len(be.runner().pipes)
    sm.captures["table"][...] = rng.standard_normal(5)
    sm.captures["gain"][...] *= -0.5
    prefix[...] = SK - 1 - prefix
    _check(q, k, v, g, kw, dev, "device arrays, new captures")
    assert len(be.runner().pipes) == pipes


def test_batch_chunks_pass_the_global_batch_to_functions(be):
    """Past the storage-binding limit the batch is split; functions reading captures
    at ``b`` see the global batch index, so every chunk matches float64."""
    rng = np.random.default_rng(4)
    B = NB
    q, k, v, g = make_qkv(rng, B, HQ, HKV, SQ, SK, D)
    sm, mask, _ = _functions(rng)
    sm.captures["gain"][2:] *= 4.0                # the chunks differ clearly
    run = be.runner()
    saved = run.max_binding
    # two batches' dk/dv buffer fits, not three: chunks of B=2 (the kernels of the
    # device-array test, B=2, serve them)
    run.max_binding = 2 * 4 * HKV * SK * 2 * D + 16
    try:
        _check(q, k, v, g, dict(score_mod=sm, mask=mask), what="chunks")
        assert be.last_pieces.get("batch_chunks") == 2
    finally:
        run.max_binding = saved


def test_device_array_captures_are_read_in_place(be):
    """Float captures of a score function given as device arrays (f32 and f16, one a
    strided view) are read on the device, never by the host: forward and backward match
    float64, and values written into the capture's buffer afterwards are what the next
    call (a cached template) reads."""
    from anyattn import webgpu as wg

    rng = np.random.default_rng(5)
    B = 2
    q, k, v, g = make_qkv(rng, B, HQ, HKV, SQ, SK, D)
    sm, mask, _ = _functions(rng)
    host = dict(sm.captures)
    gain_t = np.ascontiguousarray(host["gain"].T)                      # [HQ, NB]
    table16 = host["table"].astype(np.float16)
    gain_dev = wg.asarray(gain_t)
    caps = dict(bucket=host["bucket"], table=wg.asarray(table16), gain=gain_dev.transpose())
    dev_sm = aa.ScoreMod(sm.fn, **caps)
    ref_sm = aa.ScoreMod(sm.fn, bucket=host["bucket"], table=table16.astype(np.float32),
                         gain=gain_t.T)
    inputs = tuple(wg.asarray(x) for x in (q, k, v, g))

    def check(what):
        out, lse = aa.attention(*inputs[:3], return_lse=True, backend="webgpu",
                                score_mod=dev_sm, mask=mask)
        ro, rl = aa.attention(*_f64(q, k, v), return_lse=True, backend="reference",
                              score_mod=ref_sm, mask=mask)
        assert_close(out.numpy(), ro, "float32", f"{what} out")
        assert_close(lse.numpy(), rl, "float32", f"{what} lse")
        gr = aa.attention_backward(*inputs, wrt=WRT, backend="webgpu", score_mod=dev_sm,
                                   mask=mask)
        rg = aa.attention_backward(*_f64(q, k, v, g), wrt=WRT, backend="reference",
                                   score_mod=ref_sm, mask=mask)
        for n in ("d" + w for w in WRT):
            assert_close(getattr(gr, n).numpy(), getattr(rg, n), "float32", f"{what} {n}")

    check("device captures")
    gain_t[...] = -2.0 * gain_t                    # the reference's view follows
    wg.device().queue.write_buffer(gain_dev.buffer, 4 * gain_dev.offset, gain_t)
    check("device captures written in place")
    gain_dev = wg.asarray(-gain_t)                 # another buffer, one signature
    caps["gain"] = gain_dev.transpose()
    gain_t[...] = -gain_t
    dev_sm = aa.ScoreMod(sm.fn, **caps)
    check("another device capture buffer")


def test_device_arrays_run_a_function_spelling_alibi_with_host_slopes(be):
    """A function that spells ALiBi runs as the built-in on host arrays (host slopes);
    on device arrays its NumPy slopes run through the generated function."""
    from anyattn import webgpu as wg

    rng = np.random.default_rng(7)
    q, k, v, _ = make_qkv(rng, 1, HQ, HKV, SQ, SK, D)
    slopes = np.array([0.5, 0.125], np.float32)
    sm = aa.ScoreMod(lambda s, b, h, q_idx, kv_idx, sl: s - sl[h] * abs(q_idx - kv_idx),
                     sl=slopes)
    out = aa.attention(*(wg.asarray(x) for x in (q, k, v)), backend="webgpu", score_mod=sm)
    ro = aa.attention(*_f64(q, k, v), backend="reference", score_mod=sm)
    assert_close(out.numpy(), ro, "float32", "ALiBi-spelling function on device arrays")


def test_device_array_captures_refusals(be):
    from anyattn import webgpu as wg

    rng = np.random.default_rng(6)
    q, k, v, _ = make_qkv(rng, 1, HQ, HKV, SQ, SK, D)
    dq, dk, dv = (wg.asarray(x) for x in (q, k, v))
    gain = wg.asarray(np.ones(HQ, np.float32))
    mm = aa.MaskMod(lambda b, h, q_idx, kv_idx, gain: kv_idx * gain[h] < 9.0, gain=gain)
    with pytest.raises(NotImplementedError, match="capture 'gain'.*device array.*host"):
        aa.attention(dq, dk, dv, backend="webgpu", mask=mm)
    sm = aa.ScoreMod(lambda score, b, h, q_idx, kv_idx, gain: score * gain[h], gain=gain)
    with pytest.raises(ValueError, match="capture 'gain' is on webgpu:0 but q is on cpu"):
        aa.attention(q, k, v, backend="webgpu", score_mod=sm)
