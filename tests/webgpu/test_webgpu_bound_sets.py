"""Session 7 (issue 17) host work of device-array calls: a template's bound sets, the
forward's statistics bound in place, f16 results written by the dQ / dK/dV passes,
GPU timestamps.

What must hold: a template never serves a bind group made for other buffers — new
input buffers with the same signature, a result buffer replaced, a pooled role grown
into a new buffer, a buffer that died and whose id a new one took — each call's
results are the ones of its own inputs (checked against an uncached call and
float64, mutation-style: the data differs between the sets, so a stale binding gives
wrong numbers); the statistics are bound in place only for unclaimed pool buffers no
other input shares, bitwise the copying path, the caller's max / log_norm unchanged;
f16 results from the epilogue are bitwise the cast path's (split launches / D % 4 != 0
keep the cast); timestamps are refused clearly without the feature.

Shape legend: B batch, HQ/HKV heads, S queries = keys, D head dim.
"""
from __future__ import annotations

import gc

import numpy as np
import pytest

import anyattn as aa
from anyattn import reference as R
from anyattn.api import forward_with_stats

from helpers import assert_close, make_qkv

wg = pytest.importorskip("anyattn.webgpu")

B, HQ, HKV, S, D = 1, 2, 1, 24, 16


def _bits(x):
    return np.ascontiguousarray(x).view(np.uint8)


def _grads(dev, **kw):
    q, k, v, g = dev
    out, st = forward_with_stats(q, k, v, **kw)
    gr = aa.attention_backward(q, k, v, g, out=out, lse=st, **kw)
    return {n: getattr(gr, n).numpy() for n in ("dq", "dk", "dv")}


def _check_vs_ref(host, got, dtype="float32"):
    ref = R.backward(*host)
    for n in ("dq", "dk", "dv"):
        assert_close(got[n], getattr(ref, n), dtype, n)


def test_new_buffers_same_signature_never_served_old_bind_groups(be):
    """Three input sets of one signature, called in turn and again: each call's results
    are its own data's (the bound sets differ by buffer identity, never by the key)."""
    rng = np.random.default_rng(3)
    hosts = [make_qkv(rng, B, HQ, HKV, S, S, D) for _ in range(3)]
    devs = [tuple(wg.asarray(x) for x in h) for h in hosts]
    first = [_grads(d) for d in devs]
    for h, got in zip(hosts, first):
        _check_vs_ref(h, got)
    run = be.runner()
    before = dict(run.cache_stats)
    for d, want in zip(devs * 2, first * 2):       # repeats: bound-set hits
        got = _grads(d)
        for n in want:
            assert np.array_equal(_bits(got[n]), _bits(want[n])), n
    assert run.cache_stats["bound_hits"] > before["bound_hits"]


def test_dead_buffer_id_reuse_and_grown_roles(be):
    """A set whose input buffer died is dropped; a new buffer (whatever its id) and
    a pooled role destroyed and recreated between calls give the new data's results."""
    rng = np.random.default_rng(5)
    h1 = make_qkv(rng, B, HQ, HKV, S, S, D)
    d1 = tuple(wg.asarray(x) for x in h1)
    _grads(d1)
    _grads(d1)
    run = be.runner()
    tpl_count = sum(len(t._bound) for t in run.templates._d.values())
    del d1
    gc.collect()
    assert sum(len(t._bound) for t in run.templates._d.values()) < tpl_count
    for _ in range(4):       # fresh buffers: CPython may hand out the old ids
        h2 = make_qkv(rng, B, HQ, HKV, S, S, D)
        d2 = tuple(wg.asarray(x) for x in h2)
        _check_vs_ref(h2, _grads(d2))
        del d2
        gc.collect()
    # pooled scratch roles replaced by new buffers (f16: dev_out32 in the forward)
    h3 = make_qkv(rng, B, HQ, HKV, S, S, D)
    d3 = tuple(wg.asarray(x) for x in h3)
    want = _grads(d3)
    run.release("dev_")
    got = _grads(d3)
    for n in want:
        assert np.array_equal(_bits(got[n]), _bits(want[n])), n


def test_stats_in_place_bitwise_and_caller_rows_unchanged(be):
    """The forward's RowStats bound in place (no copies in the template) give the bits
    of the copying path (the same statistics copied into a claimed buffer); the
    caller's max / log_norm keep their bits; a claimed buffer or a buffer shared with
    another input is copied."""
    from anyattn.backends.webgpu import resident
    from anyattn.rowstats import RowStats

    rng = np.random.default_rng(9)
    host = make_qkv(rng, B, HQ, HKV, S, S, D)
    q, k, v, g = (wg.asarray(x) for x in host)
    run = be.runner()
    out, st = forward_with_stats(q, k, v)
    mx0, ln0 = st.max.numpy().copy(), st.log_norm.numpy().copy()
    gr = aa.attention_backward(q, k, v, g, out=out, lse=st)
    tpl = list(run.templates._d.values())[-1]
    assert tpl.copies_before == []
    n = B * HQ * S
    assert np.array_equal(_bits(st.max.numpy()), _bits(mx0))
    assert np.array_equal(_bits(st.log_norm.numpy()), _bits(ln0))
    # the same statistics in a buffer of the caller's (from_buffer: not the pool's)
    arena = wg.asarray(np.concatenate([mx0.reshape(-1), ln0.reshape(-1)]))
    own = RowStats(wg.from_buffer(arena.buffer, mx0.shape, "float32"),
                   wg.from_buffer(arena.buffer, ln0.shape, "float32", offset=n))
    gr2 = aa.attention_backward(q, k, v, g, out=out, lse=own)
    tpl2 = list(run.templates._d.values())[-1]
    assert len(tpl2.copies_before) == 2
    for name in ("dq", "dk", "dv"):
        assert np.array_equal(_bits(getattr(gr, name).numpy()),
                              _bits(getattr(gr2, name).numpy())), name
    _check_vs_ref(host, {n_: getattr(gr, n_).numpy() for n_ in ("dq", "dk", "dv")})
    # claimed by from_buffer: the caller now owns rows 1-5 too -> copied
    wg.from_buffer(st.max.buffer, (4,), "float32")
    inputs = dict(q=q, k=k, v=v, dout=g, out=out, max=st.max, log_norm=st.log_norm,
                  bias=None, slopes=None, sinks=None)
    from anyattn.problem import describe

    p = describe(q, k, v, dout=g, wrt=("q", "k", "v"))
    assert not resident._stats_in_place(run, p, inputs)
    out2, st2 = forward_with_stats(q, k, v)
    inputs.update(max=st2.max, log_norm=st2.log_norm)
    assert resident._stats_in_place(run, p, inputs)
    inputs["out"] = st2.max                   # another input on the same buffer
    assert not resident._stats_in_place(run, p, inputs)


@pytest.mark.parametrize("D_", [24, 18])
def test_f16_results_from_the_epilogue_bitwise_the_cast(be, D_):
    """f16 dq, dk, dv written by the dQ and dK/dV passes (3 launches) have the bits of
    the cast path, taken by forcing split launches (a loop limit: partial sums in f32,
    then ``ew`` casts); D % 4 != 0 keeps the casts."""
    if not be.context.has_f16:
        pytest.skip("adapter without shader-f16")
    rng = np.random.default_rng(11)
    host = make_qkv(rng, 1, 4, 2, 70, 70, D_, dtype="float16")
    dev = tuple(wg.asarray(x) for x in host)
    run = be.runner()
    got = _grads(dev, mask=aa.Causal())
    launches = [l[4] for l in list(run.templates._d.values())[-1].launches]
    if D_ % 4 == 0:
        assert launches == ["delta", "bwd_dkdv", "bwd_dq"]
    else:
        assert launches.count("ew") >= 2
    from anyattn.backends.webgpu.launch import TileConfig, choose_config

    per = max(choose_config(be.context, D_, "f16", backward=bw).trips_per_unit(kn, D_)
              for bw in (False, True) for kn in ("forward", "bwd_dq", "bwd_dkdv"))
    be.loop_limit_override = TileConfig.FIXED_TRIPS + per          # one unit per piece
    try:
        split = _grads(dev, mask=aa.Causal())
        launches = [l[4] for l in list(run.templates._d.values())[-1].launches]
        assert be.last_pieces["bwd_dq"] > 1 and be.last_pieces["bwd_dkdv"] > 1
        assert launches.count("ew") >= 2
    finally:
        be.loop_limit_override = None
    for n in got:
        assert np.array_equal(_bits(got[n]), _bits(split[n])), n
    ref = R.backward(*host, mask=aa.Causal())
    for n in got:
        assert_close(got[n], getattr(ref, n), "float16", n)


def test_timestamps_recorded_or_refused(be):
    """Runner.timestamps records one device time per submission where the adapter has
    'timestamp-query'; without it the constructor refuses with the reason."""
    from anyattn.backends.webgpu import timestamps as T

    run = be.runner()
    if T.FEATURE not in run.ctx.features:
        with pytest.raises(NotImplementedError, match="timestamp-query"):
            T.Timestamps(run, 4)
        return
    with pytest.raises(ValueError):
        T.Timestamps(run, 4096)
    rng = np.random.default_rng(13)
    dev = tuple(wg.asarray(x) for x in make_qkv(rng, B, HQ, HKV, S, S, D))
    out, st = forward_with_stats(*dev[:3])
    ts = T.Timestamps(run, 8)
    run.timestamps = ts
    try:
        for _ in range(3):
            aa.attention_backward(*dev, out=out, lse=st)
    finally:
        run.timestamps = None
    ns = ts.read()
    assert ns.shape == (3,) and np.all(ns > 0)


def test_bound_sets_keep_no_buffer_alive(be):
    """A bound set holds its buffers weakly, also where the template copies from an
    input (statistics in a caller's buffer): once the caller drops it, it dies."""
    import weakref

    from anyattn.rowstats import RowStats

    rng = np.random.default_rng(17)
    dev = tuple(wg.asarray(x) for x in make_qkv(rng, B, HQ, HKV, S, S, D))
    out, st = forward_with_stats(*dev[:3])
    n = B * HQ * S
    arena = wg.asarray(np.concatenate([st.max.numpy().reshape(-1),
                                       st.log_norm.numpy().reshape(-1)]))
    own = RowStats(wg.from_buffer(arena.buffer, st.max.shape, "float32"),
                   wg.from_buffer(arena.buffer, st.max.shape, "float32", offset=n))
    for _ in range(2):                                   # a miss, then a bound-set hit
        aa.attention_backward(*dev, out=out, lse=own)
    tpl = list(be.runner().templates._d.values())[-1]
    assert len(tpl.copies_before) == 2 and tpl.stats["bound_hits"] >= 1
    ref = weakref.ref(arena.buffer)
    del arena, own
    gc.collect()
    assert ref() is None
