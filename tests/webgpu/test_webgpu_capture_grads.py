"""Gradients of score-function captures on the WebGPU backward (lavapipe): the
gallery's learnable tables against the float64 reference (fp32 and one f16; GQA,
Sq != Sk, causal where the entry is), captures read at q_idx alone (rows) or kv_idx
alone (columns), mixed with a read of q_idx - kv_idx (fp32) and alone (rows, f16; GQA,
Sq != Sk, causal; repeated runs bitwise equal), reads indexed by b, h and every kind
with a capture of rank 0 and batch chunks, softcap / dropout / sinks / a mask union
with repeated runs and a split launch bitwise equal, the loop-trip model of the DCAP
pass, device-array inputs with NumPy and device-array captures (bitwise those of the
NumPy-array path; a cached repeat too), and the refusals (reads of q_idx and kv_idx
otherwise than through their difference or a pair read's (test_webgpu_pair_reads.py),
with NumPy or device arrays; more reads than
the workgroup tile holds; an index reading a device-array capture).  The backward
gets out and the row statistics from the NumPy backend (the WebGPU forward is tested
elsewhere) and asks for dk, dv and the captures: the dK/dV pass computes all three, so
no test compiles the dQ kernel.

Shape legend: B batch, Hq/Hkv heads, Sq/Sk queries/keys, D head dim."""
import numpy as np
import pytest

import anyattn as aa
from anyattn.backends.webgpu.launch import TileConfig
from anyattn.problem import describe

from helpers import assert_close, load_gallery

gallery = load_gallery()

#: the gallery entries with learnable captures
LEARNABLE = sorted(n for n, (m, _) in gallery.GALLERY.items()
                   if m(1, 2, 8, 8, np.random.default_rng(0)).wrt)


def _inputs(seed, B, Hq, Hkv, Sq, Sk, D, dtype=np.float32):
    rng = np.random.default_rng(seed)
    q, g = (rng.standard_normal((B, Hq, Sq, D)).astype(dtype) for _ in range(2))
    k, v = (rng.standard_normal((B, Hkv, Sk, D)).astype(dtype) for _ in range(2))
    return q, k, v, g


def _backward(q, k, v, g, wrt, **kw):
    """attention_backward on WebGPU with out / statistics from the NumPy backend."""
    out, st = aa.forward_with_stats(q, k, v, backend="numpy", **kw)
    return aa.attention_backward(q, k, v, g, out=out, lse=st, wrt=wrt, backend="webgpu", **kw)


def _reference(q, k, v, g, wrt, **kw):
    kw = {n: (x.astype(np.float64) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}
    return aa.attention_backward(*(x.astype(np.float64) for x in (q, k, v, g)), wrt=wrt,
                                 backend="reference", **kw)


def test_the_gallery_has_learnable_tables():
    assert {"relative_position_bias", "t5_buckets", "alibi", "tanh_gate"} <= set(LEARNABLE)


#: by default the diagonal reads of a table and of a bucket table; the total reads (alibi,
#: tanh_gate) also run in test_reads_of_batch_head_diagonal_row_column_... (one pipeline
#: per function: ~3 s each on lavapipe), so their gallery cases run with --exhaustive
_DEFAULT_GALLERY = ("relative_position_bias", "t5_buckets")


@pytest.mark.parametrize("name, dtype", [
    pytest.param(n, "float32", marks=() if n in _DEFAULT_GALLERY else pytest.mark.exhaustive)
    for n in LEARNABLE] + [("relative_position_bias", "float16")])
def test_gallery_capture_gradients_match_the_float64_reference(be, name, dtype):
    """dk, dv and the capture gradients (in the capture's shape and dtype), GQA 4 : 2,
    Sq != Sk; causal where the entry is."""
    if dtype == "float16" and not be.context.has_f16:
        pytest.skip("the adapter lacks shader-f16")
    make, _ = gallery.GALLERY[name]
    sq, sk = 24, 40
    q, k, v, g = _inputs(len(name), 1, 4, 2, sq, sk, 16, np.dtype(dtype))
    e = make(1, 4, sq, sk, np.random.default_rng(7))
    wrt = ("k", "v") + e.wrt
    gr = _backward(q, k, v, g, wrt, **e.kwargs)
    rg = _reference(q, k, v, g, wrt, **e.kwargs)
    for n in ("dk", "dv"):
        assert_close(getattr(gr, n), getattr(rg, n), dtype, f"{name} {n}")
    for n in e.wrt:
        got = gr.dcaptures[n]
        cap = e.kwargs["score_mod"].captures[n]
        assert isinstance(got, np.ndarray) and got.shape == cap.shape
        assert got.dtype == cap.dtype
        assert_close(got, rg.dcaptures[n], dtype, f"{name} d{n}")


#: score functions with row reads (an index of q_idx alone), column reads (kv_idx
#: alone) and a mix with a diagonal read (several reads of one capture, of two kinds:
#: _bhd_function); name -> (function, {capture: shape} of Hq, Sq, Sk)
ROWS_COLS = {
    # a per-query temperature (row reads only)
    "query_temperature": (lambda s, b, h, i, j, t: s * t[b, i],
                          lambda H, Sq, Sk: {"t": (2, Sq)}),
    # a per-query temperature, a relative-position table, a per-key bias and a bucketed
    # key table: a row, a diagonal and two column reads (four: lavapipe's most)
    "mixed": (lambda s, b, h, i, j, t, rel, kb, tab:
              s * t[b, i] + rel[h, i - j + 40 - 1] + kb[h, j] + tab[h, j // 4],
              lambda H, Sq, Sk: {"t": (2, Sq), "rel": (H, Sq + Sk - 1), "kb": (H, Sk),
                                 "tab": (H, -(-Sk // 4))}),
}


@pytest.mark.parametrize("name, dtype", [("mixed", "float32"), ("query_temperature", "float16")])
def test_row_and_column_reads_match_the_float64_reference(be, name, dtype):
    """Captures read at q_idx or kv_idx alone (with b, h; alone and mixed with a
    diagonal read): dk, dv and the capture gradients (the capture's shape and dtype)
    against the float64 reference, a second run bitwise equal; GQA 4 : 2, two batches,
    Sq != Sk (not multiples of the tiles), causal."""
    if dtype == "float16" and not be.context.has_f16:
        pytest.skip("the adapter lacks shader-f16")
    fn, shapes = ROWS_COLS[name]
    B, H, Sq, Sk = 2, 4, 24, 40
    q, k, v, g = _inputs(len(name), B, H, 2, Sq, Sk, 16, np.dtype(dtype))
    rng = np.random.default_rng(9)
    caps = {n: (0.5 + rng.random(s) if n == "t" else rng.standard_normal(s)).astype(np.float32)
            for n, s in shapes(H, Sq, Sk).items()}
    kw = dict(score_mod=aa.ScoreMod(fn, **caps), mask=aa.Causal("bottom_right"))
    wrt = ("k", "v") + tuple(caps)
    runs = [_backward(q, k, v, g, wrt, **kw) for _ in range(2)]
    rg = _reference(q, k, v, g, wrt, **kw)
    for n in ("dk", "dv"):
        assert_close(getattr(runs[0], n), getattr(rg, n), dtype, f"{name} {n}")
    for n in caps:
        got = runs[0].dcaptures[n]
        assert isinstance(got, np.ndarray) and got.shape == caps[n].shape
        assert got.dtype == caps[n].dtype
        assert_close(got, rg.dcaptures[n], dtype, f"{name} d{n}")
        np.testing.assert_array_equal(runs[1].dcaptures[n], got, err_msg=n)


def _bhd_function(B, Sq, Sk, seed):
    rng = np.random.default_rng(seed)
    t = rng.standard_normal((B, Sq + Sk - 1)).astype(np.float32)
    w = rng.standard_normal((B, 2, Sk)).astype(np.float32)
    c = np.array(0.7, np.float32)

    def fn(s, b, h, i, j, t, w, c):
        return s * c + t[b, i - j + Sk - 1] - 0.5 * t[b, i] * w[b, h, j]

    return aa.ScoreMod(fn, t=t, w=w, c=c)


def test_reads_of_batch_head_diagonal_row_column_a_scalar_capture_and_batch_chunks(be):
    """Two reads of one table (per batch, along the diagonals and the query rows), a
    table read at [b, h] down the key columns and a capture of rank 0 (the score's
    factor): four reads, the most the lavapipe tile holds; wrt naming the captures only;
    the same call over two batch chunks (a smaller binding limit) gives the same bits."""
    B, Sq, Sk = 2, 20, 12
    q, k, v, g = _inputs(3, B, 2, 1, Sq, Sk, 16)
    sm = _bhd_function(B, Sq, Sk, 4)
    wrt = ("t", "w", "c")
    gr = _backward(q, k, v, g, wrt, score_mod=sm)
    rg = _reference(q, k, v, g, wrt, score_mod=sm)
    assert gr.dq is None and gr.dk is None and gr.dv is None
    for n in wrt:
        assert gr.dcaptures[n].shape == sm.captures[n].shape
        assert_close(gr.dcaptures[n], rg.dcaptures[n], "float32", f"d{n}")
    run = be.runner()
    saved = run.max_binding
    run.max_binding = 4 * 2 * Sq * 16 + 64       # one batch of the out buffer
    try:
        gc = _backward(q, k, v, g, wrt, score_mod=sm)
        assert be.last_pieces.get("batch_chunks") == 2
    finally:
        run.max_binding = saved
    for n in wrt:
        np.testing.assert_array_equal(gc.dcaptures[n], gr.dcaptures[n], err_msg=n)


def _modified_call(rng, Sq, Sk):
    tab = rng.standard_normal((4, Sq + Sk - 1)).astype(np.float32)
    sm = aa.ScoreMod(lambda s, b, h, i, j, tab: s * 0.5 + tab[h, i - j + Sk - 1], tab=tab)
    return dict(score_mod=sm, softcap=2.0, dropout_p=0.2, dropout_seed=11,
                sinks=rng.standard_normal(4).astype(np.float32),
                mask=aa.Causal("bottom_right") | aa.MaskMod(lambda b, h, i, j: j < 3))


def test_softcap_dropout_sinks_mask_union_repeated_and_split_runs_bitwise_equal(be):
    """A mask union (a mask function in partial tiles) with softcap, dropout and sinks:
    dk, dv, dsinks and the table's gradient against the reference; a second run and a
    run split into several launches (a smaller loop-trip budget) give the same bits."""
    Sq, Sk = 40, 24
    q, k, v, g = _inputs(6, 1, 4, 2, Sq, Sk, 16)
    kw = _modified_call(np.random.default_rng(8), Sq, Sk)
    wrt = ("k", "v", "tab", "sinks")
    runs = [_backward(q, k, v, g, wrt, **kw) for _ in range(2)]
    assert be.last_pieces["bwd_dkdv"] == 1
    cfg = _capture_call(be, q, k, v, g, ("k", "v", "tab"), dict(score_mod=kw["score_mod"])).cfg
    per = cfg.trips_per_unit("bwd_dkdv", 16, True, True, 1)
    be.loop_limit_override = TileConfig.FIXED_TRIPS + 2 * per     # two units per launch
    try:
        runs.append(_backward(q, k, v, g, wrt, **kw))
        assert be.last_pieces["bwd_dkdv"] > 1
    finally:
        be.loop_limit_override = None
    rg = _reference(q, k, v, g, wrt, **kw)
    for n in ("dk", "dv", "dsinks"):
        assert_close(getattr(runs[0], n), getattr(rg, n), "float32", n)
    assert_close(runs[0].dcaptures["tab"], rg.dcaptures["tab"], "float32", "dtab")
    for r in runs[1:]:
        np.testing.assert_array_equal(r.dcaptures["tab"], runs[0].dcaptures["tab"])
        np.testing.assert_array_equal(r.dk, runs[0].dk)


def _capture_call(be, q, k, v, g, wrt, kw, debug_trips=False):
    """The backward's engine Call (built, not submitted) for ``wrt`` with the score
    function ``kw["score_mod"]`` (no other modifier)."""
    out, st = aa.forward_with_stats(q, k, v, backend="numpy", **kw)
    p = describe(q, k, v, dout=g, wrt=wrt, **kw)
    be.debug_trips = debug_trips
    try:
        call, _ = be._build_backward(p, q, k, v, g, out, st, None)
    finally:
        be.debug_trips = False
    return call


def test_the_capture_pass_stays_within_its_loop_trip_model(be):
    """A trip-counting build of the DCAP dK/dV pass (a diagonal read, a row read and a
    column read): every invocation's loop trips at most the model's (llvmpipe's loop
    limit is budgeted on it), the busiest at least half of it."""
    B, Sq, Sk = 2, 20, 12
    q, k, v, g = _inputs(3, B, 2, 1, Sq, Sk, 16)
    kw = dict(score_mod=_bhd_function(B, Sq, Sk, 4))
    call = _capture_call(be, q, k, v, g, ("k", "v", "t", "w"), kw, debug_trips=True)
    assert call.dcap is not None and call.dcap[2] == 3 and call.dcap[3].counts == (1, 1, 1)
    (lch,) = [x for x in call.launches if x.kernel == "bwd_dkdv"]
    call.run.run([x for x in call.launches if x.kernel != "bwd_dkdv"], call.clears)
    call.run.run([lch])
    n = lch.grid[0] * lch.grid[1] * lch.grid[2] * call.cfg.NT
    got = int(call.run.read(lch.buffers[9], n).max())
    model = call.cfg.trips_per_unit("bwd_dkdv", 16, True, True, 1, 1, 1) * call.nqt * 2
    assert 0.5 * model <= got <= model, (got, model)


@pytest.mark.parametrize("fn, index", [
    (lambda s, b, h, i, j, t: s + t[i // 2, j],
     r"whose indices \(q_idx // 2\) and kv_idx together"),
    (lambda s, b, h, i, j, t: s + t[h, i // 8 + j],
     r"whose index \(\(q_idx // 8\) \+ kv_idx\) depends on q_idx and kv_idx otherwise "
     r"than through q_idx - kv_idx"),
    (lambda s, b, h, i, j, t: s + t[h, i - j + 15] * t[i, i - j + 15],
     r"whose indices q_idx and \(\(q_idx - kv_idx\) \+ 15\) together"),
])
def test_a_capture_read_at_q_idx_and_kv_idx_is_refused_before_any_work(be, monkeypatch, fn,
                                                                        index):
    """An index of q_idx and kv_idx other than their difference or a pair read's, or
    indices of a row and a diagonal together, are refused by the backend choice with
    the Triton backward's words, naming the capture and its read; no backward starts."""
    from anyattn.backends.webgpu.backend import WebGPUBackend

    def no_work(*a, **kw):
        raise AssertionError("a backward started")

    monkeypatch.setattr(WebGPUBackend, "_backward_device", no_work)
    S = 16
    q, k, v, g = _inputs(2, 1, 2, 2, S, S, 16)
    t = np.zeros((2 * S - 1, 2 * S - 1), np.float32)
    with pytest.raises(NotImplementedError,
                       match=r"webgpu.*only where each read of it is indexed by b, h and "
                             r"one of q_idx - kv_idx, q_idx or kv_idx, or by b, h, q_idx "
                             r"and kv_idx with q_idx and kv_idx each an index of its own "
                             r"plus an integer constant \(t\[h, q_idx, kv_idx\]\): "
                             r"capture 't' is read at t\[.*\], " + index):
        aa.attention_backward(q, k, v, g, wrt=("q", "t"), backend="webgpu",
                              score_mod=aa.ScoreMod(fn, t=t))


def test_more_capture_reads_than_the_workgroup_tile_holds_are_refused_by_name(be):
    """Five capture reads (lavapipe's 32 x 32 tile holds four) are refused by the config
    choice before any work, naming the reads and the remedy."""
    if not be.context.is_cpu or \
            be.context.limits.get("max-compute-workgroup-storage-size") != 32768:
        pytest.skip("the count is lavapipe's (32 KiB of workgroup memory)")
    S = 16
    q, k, v, g = _inputs(2, 1, 2, 2, S, S, 16)
    t = np.random.default_rng(1).standard_normal((2, 2 * S - 1)).astype(np.float32)
    sm = aa.ScoreMod(lambda s, b, h, i, j, t: s + t[h, i] + t[h, j] + t[h, i - j + S - 1]
                     + t[0, i] * t[1, j], t=t)
    with pytest.raises(NotImplementedError, match=r"workgroup memory \(32768 bytes\) with "
                                                  r"the gradients of 5 score_mod capture "
                                                  r"reads.*fewer captures"):
        _backward(q, k, v, g, ("t",), score_mod=sm)


def _device_stats(q, k, v, kw):
    """out and the row statistics from the NumPy backend, as device arrays."""
    from anyattn import webgpu as wg

    out, st = aa.forward_with_stats(q, k, v, backend="numpy", **kw)
    return wg.asarray(out), aa.RowStats(wg.asarray(st.max), wg.asarray(st.log_norm))


@pytest.mark.parametrize("device_captures", [False, True])
def test_device_array_inputs_give_the_numpy_path_capture_gradients_bitwise(be,
                                                                          device_captures):
    """Device-array q, k, v, dout (out and statistics too) with a relative-position table
    (diagonal reads), a per-key bias (column reads), a per-query temperature (row) and a
    bucketed key table: the capture gradients are those of the NumPy-array path bit for
    bit (same kernels, same host sums) and within the fp32 tolerance of the float64
    reference; each comes back as its capture's kind (a DeviceArray in its dtype for a
    device-array capture, NumPy for a NumPy capture); a repeat call (its launch template
    cached) gives the same bits, and so does a call asking for the captures alone.  The problem of the mixed row / column test (one set of
    shader variants)."""
    from anyattn import webgpu as wg
    from anyattn.backends.webgpu.device_array import DeviceArray

    fn, shapes = ROWS_COLS["mixed"]
    B, H, Sq, Sk = 2, 4, 24, 40
    q, k, v, g = _inputs(5, B, H, 2, Sq, Sk, 16)
    rng = np.random.default_rng(9)
    caps = {n: (0.5 + rng.random(s) if n == "t" else rng.standard_normal(s)).astype(np.float32)
            for n, s in shapes(H, Sq, Sk).items()}
    on_device = ("rel", "kb") if device_captures else ()
    dcaps = {n: wg.asarray(x) if n in on_device else x for n, x in caps.items()}
    mask = aa.Causal("bottom_right")
    wrt = ("k", "v") + tuple(caps)
    host = _backward(q, k, v, g, wrt, score_mod=aa.ScoreMod(fn, **caps), mask=mask)
    dq, dk, dv, dg = (wg.asarray(x) for x in (q, k, v, g))
    kw = dict(score_mod=aa.ScoreMod(fn, **dcaps), mask=mask)
    out, st = _device_stats(q, k, v, dict(score_mod=aa.ScoreMod(fn, **caps), mask=mask))
    tpl = be.runner().templates
    runs = []
    for _ in range(2):
        hits = tpl.stats["hits"]
        runs.append(aa.attention_backward(dq, dk, dv, dg, out=out, lse=st, wrt=wrt,
                                          backend="webgpu", **kw))
    assert tpl.stats["hits"] == hits + 1          # the repeat ran the cached template
    rg = _reference(q, k, v, g, wrt, score_mod=aa.ScoreMod(fn, **caps), mask=mask)
    for n in ("dk", "dv"):
        np.testing.assert_array_equal(getattr(runs[0], n).numpy(), getattr(host, n))
    for n in caps:
        for r in runs:
            got = r.dcaptures[n]
            if n in on_device:
                assert isinstance(got, DeviceArray) and got.dtype == np.float32
                got = got.numpy()
            else:
                assert isinstance(got, np.ndarray) and got.dtype == np.float32
            assert got.shape == caps[n].shape
            np.testing.assert_array_equal(got, host.dcaptures[n], err_msg=n)
        assert_close(host.dcaptures[n], rg.dcaptures[n], "float32", f"d{n}")
    if device_captures:             # the captures alone: the dK/dV pass runs for them
        only = aa.attention_backward(dq, dk, dv, dg, out=out, lse=st, wrt=tuple(caps),
                                     backend="webgpu", **kw)
        assert only.dk is None and only.dv is None
        for n in caps:
            got = only.dcaptures[n]
            got = got.numpy() if n in on_device else got
            np.testing.assert_array_equal(got, host.dcaptures[n], err_msg=f"{n} alone")


def test_device_array_refusals_for_capture_gradients(be, monkeypatch):
    """Device-array inputs: a capture read at q_idx and kv_idx otherwise than through
    their difference, and a read whose index reads a device-array capture (the host
    evaluates the indices; that read alone would be supported), raise before any work;
    the call without the capture's gradient runs."""
    from anyattn import math as am
    from anyattn import webgpu as wg
    from anyattn.backends.webgpu import resident

    S = 16
    q, k, v, g = _inputs(2, 1, 2, 2, S, S, 16)
    rng = np.random.default_rng(1)
    t = rng.standard_normal((2, 2 * S - 1)).astype(np.float32)
    u = np.float32([3.0, 5.0])
    dev = tuple(wg.asarray(x) for x in (q, k, v, g))
    calls = []
    real = resident.backward
    monkeypatch.setattr(resident, "backward", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    prod = aa.ScoreMod(lambda s, b, h, i, j, t: s + t[h, (i * j) % (2 * S - 1)],
                       t=wg.asarray(t))
    with pytest.raises(NotImplementedError, match=r"indexed by b, h and one of"):
        aa.attention_backward(*dev, wrt=("k", "t"), backend="webgpu", score_mod=prod)
    by_dev = aa.ScoreMod(lambda s, b, h, i, j, t, u:
                         s + t[h, am.clamp(am.to_int(u[h]), 0, 2 * S - 2)],
                         t=t, u=wg.asarray(u))
    with pytest.raises(NotImplementedError, match=r"an index reads the device-array "
                                                   r"capture\(s\) \['u'\]; pass those as "
                                                   r"NumPy arrays"):
        aa.attention_backward(*dev, wrt=("k", "t"), backend="webgpu", score_mod=by_dev)
    assert not calls
    out, st = _device_stats(q, k, v, dict(score_mod=aa.ScoreMod(prod.fn, t=t)))
    gr = aa.attention_backward(*dev, out=out, lse=st, wrt=("k",), backend="webgpu",
                               score_mod=prod)
    assert calls and gr.dk is not None and gr.dcaptures is None


def test_an_empty_problem_gives_zero_capture_gradients_of_each_capture_kind(be):
    """No queries: each capture's gradient is zero, of its capture's kind, shape and
    dtype (a DeviceArray for a device-array capture, NumPy for a NumPy one)."""
    from anyattn import webgpu as wg
    from anyattn.backends.webgpu.device_array import DeviceArray

    q = wg.asarray(np.zeros((1, 2, 0, 16), np.float32))
    k = wg.asarray(np.zeros((1, 2, 8, 16), np.float32))
    sm = aa.ScoreMod(lambda s, b, h, i, j, t, w: s * w[h] + t[h, j],
                     t=wg.asarray(np.ones((2, 8), np.float16)), w=np.ones(2, np.float32))
    gr = aa.attention_backward(q, k, k, q, wrt=("k", "t", "w"), backend="webgpu",
                               score_mod=sm)
    t, w = gr.dcaptures["t"], gr.dcaptures["w"]
    assert isinstance(t, DeviceArray) and t.shape == (2, 8) and t.dtype == np.float16
    assert isinstance(w, np.ndarray) and w.shape == (2,) and w.dtype == np.float32
    assert not t.numpy().any() and not w.any()
