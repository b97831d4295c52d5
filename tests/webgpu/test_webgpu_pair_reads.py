"""Gradients of captures read at one element per score-matrix pair (``t[h, q_idx,
kv_idx]``: capture_reads' "pair" reads) on the WebGPU backward (lavapipe): against the
float64 reference in fp32 (GQA 4 : 2, two batches, Sq != Sk, a bottom-right causal mask
with empty rows and a skipped tile, captures larger than the region read, a read per
head, a read without b or h with keys first, mixed with a diagonal read) and f16 (pair
reads only: a read per batch and head); two runs bitwise equal; batch chunks bitwise
equal to one piece; device-array inputs and a device-array capture bitwise equal to
the NumPy path; the slots' size refused against the storage binding limit before any
work (NumPy and device arrays).  The backward gets out and the row statistics from the
NumPy backend and asks for dk, dv and the captures: the dK/dV pass computes them all,
so no test compiles the dQ kernel; one function per dtype (one pipeline each).

Shape legend: B batch, Hq/Hkv heads, Sq/Sk queries/keys, D head dim."""
import numpy as np
import pytest

import anyattn as aa

from helpers import assert_close

B, HQ, HKV, SQ, SK, D = 2, 4, 2, 72, 40, 16


def _inputs(seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q, g = (rng.standard_normal((B, HQ, SQ, D)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((B, HKV, SK, D)).astype(dtype) for _ in range(2))
    return q, k, v, g


def _mixed_fn(s, b, h, i, j, t, u, rel):
    """A pair read per head (offset), a pair read shared by every (b, h) with the keys
    first, times a diagonal read of another capture."""
    return s + t[h, i + 1, j] + u[j + 2, i] * rel[h, i - j + SK - 1]


def _mixed_captures(seed=9):
    rng = np.random.default_rng(seed)
    return {"t": rng.standard_normal((HQ, SQ + 3, SK + 2)).astype(np.float32),
            "u": rng.standard_normal((SK + 2, SQ + 1)).astype(np.float32),
            "rel": rng.standard_normal((HQ, SQ + SK - 1)).astype(np.float32)}


MASK = aa.Causal("bottom_right")      # query rows < SQ - SK = 32 empty: tile row 0 skipped


def _stats(q, k, v, kw):
    return aa.forward_with_stats(q, k, v, backend="numpy", **kw)


def _backward(q, k, v, g, wrt, **kw):
    out, st = _stats(q, k, v, kw)
    return aa.attention_backward(q, k, v, g, out=out, lse=st, wrt=wrt, backend="webgpu", **kw)


def _reference(q, k, v, g, wrt, fn, caps):
    sm = aa.ScoreMod(fn, **{n: x.astype(np.float64) for n, x in caps.items()})
    return aa.attention_backward(*(x.astype(np.float64) for x in (q, k, v, g)), wrt=wrt,
                                 backend="reference", score_mod=sm, mask=MASK)


def test_pair_reads_mixed_with_a_diagonal_read_match_the_reference_repeat_and_chunk(be):
    """dk, dv and the gradients of two pair tables and a diagonal table (the capture's
    shape and dtype) against the float64 reference; elements no kept pair reads are
    exact zeros (the empty rows, the skipped tile, the rows and columns past the region
    read); a second run and a run over two batch chunks (a smaller binding limit) give
    the same bits."""
    caps = _mixed_captures()
    q, k, v, g = _inputs(1)
    kw = dict(score_mod=aa.ScoreMod(_mixed_fn, **caps), mask=MASK)
    wrt = ("k", "v") + tuple(caps)
    runs = [_backward(q, k, v, g, wrt, **kw) for _ in range(2)]
    assert be.last_pieces.get("batch_chunks", 1) == 1
    rg = _reference(q, k, v, g, wrt, _mixed_fn, caps)
    for n in ("dk", "dv"):
        assert_close(getattr(runs[0], n), getattr(rg, n), "float32", n)
    for n in caps:
        got = runs[0].dcaptures[n]
        assert isinstance(got, np.ndarray) and got.shape == caps[n].shape
        assert got.dtype == np.float32
        assert_close(got, rg.dcaptures[n], "float32", f"d{n}")
        np.testing.assert_array_equal(runs[1].dcaptures[n], got, err_msg=n)
    i, j = np.meshgrid(np.arange(SQ), np.arange(SK), indexing="ij")
    unread = np.ones(caps["t"].shape, bool)
    unread[:, 1:SQ + 1, :SK] = ~(j <= i - (SQ - SK))
    assert (runs[0].dcaptures["t"][unread] == 0).all()
    assert np.abs(runs[0].dcaptures["t"][~unread]).min() > 0
    run = be.runner()
    saved = run.max_binding
    # one batch's slots (two pair reads of [Hq, Sq, Sk] and the diagonal read's tile
    # slots, bounded as batch_chunks bounds them) fit; two batches' do not
    run.max_binding = 4 * 2 * HQ * SQ * SK + 4 * HQ * 3 * 2 * 63 + 64
    try:
        chunked = _backward(q, k, v, g, wrt, **kw)
        assert be.last_pieces.get("batch_chunks") == 2
    finally:
        run.max_binding = saved
    for n in caps:
        np.testing.assert_array_equal(chunked.dcaptures[n], runs[0].dcaptures[n], err_msg=n)
    np.testing.assert_array_equal(chunked.dk, runs[0].dk)


def test_pair_reads_alone_in_f16_match_the_reference(be):
    """A pair read per batch and head (one writer per capture element, no tile sums):
    f16 inputs, the table's gradient (f32, its shape) and dk against the float64
    reference at f16's tolerance."""
    if not be.context.has_f16:
        pytest.skip("the adapter lacks shader-f16")

    def fn(s, b, h, i, j, t):
        return s * t[b, h, i, j]

    t = (0.5 + np.random.default_rng(3).random((B, HQ, SQ, SK))).astype(np.float32)
    q, k, v, g = _inputs(2, np.float16)
    kw = dict(score_mod=aa.ScoreMod(fn, t=t), mask=MASK)
    gr = _backward(q, k, v, g, ("k", "t"), **kw)
    rg = _reference(q, k, v, g, ("k", "t"), fn, {"t": t})
    assert_close(gr.dk, rg.dk, "float16", "dk")
    got = gr.dcaptures["t"]
    assert got.shape == t.shape and got.dtype == np.float32
    assert_close(got, rg.dcaptures["t"], "float16", "dt")


def test_device_array_inputs_and_captures_give_the_numpy_path_bits(be):
    """Device-array q, k, v, dout, out, statistics and a device-array pair table: each
    capture gradient is the NumPy-array path's bit for bit, the device-array capture's
    a DeviceArray in its dtype."""
    from anyattn import webgpu as wg
    from anyattn.backends.webgpu.device_array import DeviceArray

    caps = _mixed_captures()
    q, k, v, g = _inputs(4)
    wrt = ("k", "v") + tuple(caps)
    host = _backward(q, k, v, g, wrt, score_mod=aa.ScoreMod(_mixed_fn, **caps), mask=MASK)
    out, st = _stats(q, k, v, dict(score_mod=aa.ScoreMod(_mixed_fn, **caps), mask=MASK))
    dcaps = dict(caps, t=wg.asarray(caps["t"]))
    gr = aa.attention_backward(*(wg.asarray(x) for x in (q, k, v, g)), out=wg.asarray(out),
                               lse=aa.RowStats(wg.asarray(st.max), wg.asarray(st.log_norm)),
                               wrt=wrt, backend="webgpu", mask=MASK,
                               score_mod=aa.ScoreMod(_mixed_fn, **dcaps))
    np.testing.assert_array_equal(gr.dk.numpy(), host.dk)
    dt = gr.dcaptures["t"]
    assert isinstance(dt, DeviceArray) and dt.dtype == np.float32 and dt.shape == caps["t"].shape
    np.testing.assert_array_equal(dt.numpy(), host.dcaptures["t"])
    for n in ("u", "rel"):
        assert isinstance(gr.dcaptures[n], np.ndarray)
        np.testing.assert_array_equal(gr.dcaptures[n], host.dcaptures[n], err_msg=n)


def test_pair_slots_past_the_binding_limit_are_refused_before_any_work(be, monkeypatch):
    """The pair reads' slots (4 bytes per (b, h, q_idx, kv_idx) each) past the adapter's
    storage binding: refused by the backend choice naming the reads, the bytes and the
    limit, before any backward starts; one batch's with NumPy arrays (the batch is split
    beyond), the whole call's with device arrays (one piece)."""
    from anyattn import webgpu as wg
    from anyattn.backends.webgpu import resident
    from anyattn.backends.webgpu.backend import WebGPUBackend

    def no_work(*a, **kw):
        raise AssertionError("a backward started")

    monkeypatch.setattr(WebGPUBackend, "_backward_device", no_work)
    monkeypatch.setattr(resident, "backward", no_work)
    caps = _mixed_captures()
    q, k, v, g = _inputs(1)
    sm = aa.ScoreMod(_mixed_fn, **caps)
    one = 4 * 2 * HQ * SQ * SK                 # one batch's slots of the two pair reads
    run = be.runner()
    monkeypatch.setattr(run, "max_binding", one - 4)
    reads = r"t\[h, \(q_idx \+ 1\), kv_idx\], u\[\(kv_idx \+ 2\), q_idx\]"
    with pytest.raises(NotImplementedError,
                       match=rf"webgpu.*the slots of the pair read\(s\) {reads} need {one} "
                             rf"bytes \(4·Hq·Sq·Sk bytes per read for one batch\), past this "
                             rf"adapter's max storage binding of {one - 4} bytes"):
        aa.attention_backward(q, k, v, g, wrt=("q", "t", "u"), backend="webgpu",
                              score_mod=sm)
    monkeypatch.setattr(run, "max_binding", 2 * one - 4)
    with pytest.raises(NotImplementedError,
                       match=rf"the slots of the pair read\(s\) {reads} need {2 * one} bytes "
                             rf"\(4·B·Hq·Sq·Sk bytes per read: device arrays run in one "
                             rf"piece\), past this adapter's max storage binding of "
                             rf"{2 * one - 4} bytes"):
        aa.attention_backward(*(wg.asarray(x) for x in (q, k, v, g)), wrt=("k", "t", "u"),
                              backend="webgpu", score_mod=sm)


def test_the_slot_layout_puts_the_pair_reads_last_without_a_tile_block():
    """slot_layout: the diagonal read first (a tile block), the pair reads after it in
    graph order (no block: DCPR), and a pair-only layout with no tile reads (DCPO)."""
    from anyattn.backends.webgpu.capture_grads import slot_layout
    from anyattn.backends.webgpu.launch import TileConfig

    caps = _mixed_captures()
    lay = slot_layout(aa.ScoreMod(_mixed_fn, **caps).program, set(caps))
    assert lay.kinds == ("pair", "pair", "diag") and lay.order == (2, 0, 1)
    assert lay.counts == (1, 0, 0) and lay.pairs == 2
    cfg = TileConfig(8, 8, 16, 8, 2)
    c = cfg.dcap_consts(lay.counts, lay.pairs)
    assert c["DCPR"] == 1 and c["DCRC"] == 1 and "DCPO" not in c and c["DCND"] == 1
    only = slot_layout(aa.ScoreMod(lambda s, b, h, i, j, t: s + t[i, j],
                                   t=np.zeros((8, 8), np.float32)).program, {"t"})
    assert only.counts == (0, 0, 0) and only.pairs == 1
    assert cfg.dcap_consts(only.counts, only.pairs)["DCPO"] == 1
    assert not {"DCPR", "DCPO", "DCRC"} & set(cfg.dcap_consts((1, 0, 0)))
