"""The per-call host caches of the webgpu backend (issue 17): uniform blocks by content
and bind groups by bound buffers (launch.Runner), device-array results written to
pooled scratch and copied into fresh buffers (resident._keep).

What must hold: a repeated call (cache hits) gives the bits of the uncached path (caches
cleared first), also with a fresh dropout seed per call (no key field: no rebuild);
every returned array stays valid and unchanged after later calls, with the same or
other inputs; any changed argument (mask, bias, scale, softcap, ALiBi,
sinks, dropout seed, wrt, the input data or view) is never served stale state; the
caches stay bounded.

Shape legend: B batch, Hq/Hkv heads, S queries = keys, D head dim.
"""
from __future__ import annotations

import numpy as np
import pytest

import anyattn as aa
from anyattn import reference as R
from anyattn.api import forward_with_stats

from helpers import assert_close, make_qkv

wg = pytest.importorskip("anyattn.webgpu")

B, HQ, HKV, S, D = 1, 2, 1, 24, 16        # GQA, an odd tile remainder
FWD_KEYS = ("mask", "bias", "scale", "softcap", "alibi_slopes", "sinks", "dropout_p",
            "dropout_seed")


@pytest.fixture(scope="module")
def data(be):
    rng = np.random.default_rng(7)
    host = make_qkv(rng, B, HQ, HKV, S, S, D)
    return host, tuple(wg.asarray(x) for x in host)


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x).view(np.uint8)


def _same_bits(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].shape == b[name].shape, name
        assert np.array_equal(_bits(a[name]), _bits(b[name])), f"{name}: bits differ"


def _call(dev, **kw):
    """forward_with_stats + attention_backward on device arrays -> (device results,
    their NumPy copies)."""
    q, k, v, g = dev
    fkw = {n: x for n, x in kw.items() if n in FWD_KEYS}
    out, st = forward_with_stats(q, k, v, **fkw)
    gr = aa.attention_backward(q, k, v, g, out=out, lse=st, **kw)
    arrs = {"out": out, "max": st.max, "log_norm": st.log_norm}
    for name in ("dq", "dk", "dv", "dbias", "dsinks"):
        if getattr(gr, name) is not None:
            arrs[name] = getattr(gr, name)
    return arrs, {n: x.numpy() for n, x in arrs.items()}


def _uncached(be, dev, **kw):
    be.runner().clear_caches()
    return _call(dev, **kw)[1]


def test_repeat_hits_and_matches_uncached(be, data):
    """A backward repeated on the same arguments creates no uniform buffer and no bind
    group (a new forward's out costs the delta launch one); results have the bits of
    the uncached path."""
    host, dev = data
    run = be.runner()
    first = _call(dev, mask=aa.Causal())[1]
    q, k, v, g = dev
    out, st = forward_with_stats(q, k, v, mask=aa.Causal())
    aa.attention_backward(q, k, v, g, out=out, lse=st, mask=aa.Causal())
    before = dict(run.cache_stats)
    gr = aa.attention_backward(q, k, v, g, out=out, lse=st, mask=aa.Causal())
    after = run.cache_stats
    assert after["uniform_misses"] == before["uniform_misses"]
    assert after["group_misses"] == before["group_misses"]
    # the template's bound set (same buffer objects): no bind-group lookup at all
    assert after["bound_hits"] > before["bound_hits"]
    assert after["bound_misses"] == before["bound_misses"]
    _same_bits({n: getattr(gr, n).numpy() for n in ("dq", "dk", "dv")},
               {n: first[n] for n in ("dq", "dk", "dv")})
    # training steps that keep the previous step's results alive while the next runs:
    # two sets of result buffers alternate, so after a few steps a step creates no bind
    # group, no uniform block and no buffer
    prev = None
    for step in range(6):
        if step == 4:
            before = dict(run.cache_stats)
            created = run.results.stats["created"]
        out, st = forward_with_stats(q, k, v, mask=aa.Causal())
        gr = aa.attention_backward(q, k, v, g, out=out, lse=st, mask=aa.Causal())
        prev = (out, st, gr)                 # the step before this one dies here
    assert run.cache_stats["group_misses"] == before["group_misses"]
    assert run.cache_stats["uniform_misses"] == before["uniform_misses"]
    assert run.results.stats["created"] == created
    del prev
    again = _call(dev, mask=aa.Causal())[1]
    _same_bits(first, again)
    _same_bits(first, _uncached(be, dev, mask=aa.Causal()))
    q, k, v, g = host
    ref = R.backward(q, k, v, g, mask=aa.Causal())
    for name in ("dq", "dk", "dv"):
        assert_close(again[name], getattr(ref, name), "float32", name)


def test_returned_arrays_survive_later_calls(be, data):
    """Results of call 1 keep their values (and own their buffers) after call 2 with the
    same inputs and call 3 with other inputs."""
    host, dev = data
    arrs1, vals1 = _call(dev)
    arrs2, _ = _call(dev)
    rng = np.random.default_rng(8)
    other = tuple(wg.asarray(x) for x in make_qkv(rng, B, HQ, HKV, S, S, D))
    _call(other)
    for name, x in arrs1.items():
        assert x.buffer is not arrs2[name].buffer, name
    _same_bits(vals1, {n: x.numpy() for n, x in arrs1.items()})


def test_views_and_in_place_data(be, data):
    """The same values through another view (one arena buffer, [B, S, H, D] layout)
    give the same bits; new data written into a cached input buffer is read (cached
    bind groups bind buffers, not contents)."""
    host, dev = data
    ref = _call(dev)[1]
    arena_dev = wg.device()
    views = []
    bufs = []
    for x in host:
        bshd = np.ascontiguousarray(x.transpose(0, 2, 1, 3))
        buf = arena_dev.create_buffer(size=-(-(bshd.nbytes + 64) // 16) * 16,
                                      usage=dev[0].buffer.usage)
        arena_dev.queue.write_buffer(buf, 64, bshd)
        Bx, Hx, Sx, Dx = x.shape
        views.append(wg.from_buffer(buf, x.shape, "float32", offset=16,
                                    strides=(Sx * Hx * Dx, Dx, Hx * Dx, 1)))
        bufs.append(buf)
    _same_bits(ref, _call(tuple(views))[1])
    _same_bits(ref, _call(tuple(views))[1])      # again, cached
    # new values into the first view's buffer (q): the next call must see them
    q2 = np.ascontiguousarray((host[0] * 0.5).transpose(0, 2, 1, 3))
    arena_dev.queue.write_buffer(bufs[0], 64, q2)
    new = _call(tuple(views))[1]
    fresh = _call((wg.asarray(host[0] * 0.5),) + dev[1:])[1]
    _same_bits(fresh, new)
    assert not np.array_equal(new["dq"], ref["dq"])


def _bias():
    return wg.asarray(np.random.default_rng(3).standard_normal((1, HQ, S, S)).astype(np.float32))


def _bias2():
    return wg.asarray(np.random.default_rng(4).standard_normal((1, 1, S, S)).astype(np.float32))


def _slopes(mult=1.0):
    return wg.asarray(np.random.default_rng(5).uniform(0.1, 0.4, HQ).astype(np.float32) * mult)


def _sinks(add=0.0):
    return wg.asarray(np.random.default_rng(6).standard_normal(HQ).astype(np.float32) + add)

#: (field, kwargs of call A, kwargs of call B): B differs from A in that field only
CHANGES = {
    "mask": (dict(mask=aa.Causal()), dict(mask=aa.Causal() & aa.Window(left=3))),
    "mask-docs": (dict(mask=aa.Documents(np.arange(S) // 8, np.arange(S) // 8)),
                  dict(mask=aa.Documents(np.arange(S) // 6, np.arange(S) // 6))),
    "bias": (dict(bias=_bias, wrt=("q", "k", "v", "bias")),
             dict(bias=_bias2, wrt=("q", "k", "v", "bias"))),
    "scale": (dict(scale=0.25), dict(scale=0.3)),
    "softcap": (dict(softcap=2.0), dict(softcap=3.0)),
    "alibi": (dict(alibi_slopes=_slopes), dict(alibi_slopes=lambda: _slopes(2.0))),
    "sinks": (dict(sinks=_sinks, wrt=("q", "k", "v", "sinks")),
              dict(sinks=lambda: _sinks(1.0), wrt=("q", "k", "v", "sinks"))),
    "dropout-seed": (dict(dropout_p=0.2, dropout_seed=1), dict(dropout_p=0.2, dropout_seed=2)),
    "wrt": (dict(wrt=("q", "k", "v")), dict(wrt=("k",))),
    # fields of the launch-template key (resident._key) beyond the uniform content
    "dropout-p": (dict(dropout_p=0.2, dropout_seed=1), dict(dropout_p=0.3, dropout_seed=1)),
    "q_offset": (dict(mask=aa.Causal(), q_offset=0), dict(mask=aa.Causal(), q_offset=5)),
    "keep-mask": (dict(mask=aa.KeepMask(np.tri(S, S, 2, dtype=bool))),
                  dict(mask=aa.KeepMask(np.tri(S, S, 3, dtype=bool)))),
    "alibi-offset": (dict(alibi_slopes=_slopes, k_offset=0),
                     dict(alibi_slopes=_slopes, k_offset=3)),
}


def _resolve(kw):
    return {n: (x() if callable(x) else x) for n, x in kw.items()}


@pytest.mark.parametrize("field", list(CHANGES))
def test_changed_field_never_stale(be, data, field):
    """Call A warms the caches; call B (one field changed) has the bits of B on cleared
    caches, and differs from A (the field matters)."""
    _, dev = data
    ka, kb = CHANGES[field]
    ka, kb = _resolve(ka), _resolve(kb)
    a = _call(dev, **ka)[1]
    b = _call(dev, **kb)[1]
    _same_bits(b, _uncached(be, dev, **kb))
    assert a.keys() != b.keys() or any(not np.array_equal(a[n], b[n]) for n in a)


def test_fresh_dropout_seed_hits_the_template(be, data):
    """A training loop's fresh seed per step: the seed is no field of the template key
    (written into the template's own uniform blocks per call), so steps 2.. build no
    launch list; every step has the bits of its seed on cleared caches, an earlier
    step's results stay as they were, and the runner's shared (content-keyed) uniform
    blocks keep their seed (a host-array call with seed 1 after the others)."""
    host, dev = data
    run = be.runner()
    kw = dict(mask=aa.Causal(), dropout_p=0.3)
    ref = {s: _uncached(be, dev, dropout_seed=s, **kw) for s in (1, 2, 2**64 - 3)}
    first = _call(dev, dropout_seed=1, **kw)
    misses = run.templates.stats["misses"]
    steps = [first] + [_call(dev, dropout_seed=s, **kw) for s in (2, 2**64 - 3, 1)]
    assert run.templates.stats["misses"] == misses
    for (arrs, got), s in zip(steps, (1, 2, 2**64 - 3, 1)):
        _same_bits(got, ref[s])
        _same_bits({n: x.numpy() for n, x in arrs.items()}, ref[s])   # still as returned
    assert not np.array_equal(ref[1]["dq"], ref[2]["dq"])
    q, k, v, g = host
    o, l = aa.attention(q, k, v, return_lse=True, backend="webgpu", dropout_seed=1, **kw)
    _call(dev, dropout_seed=2, **kw)
    o2 = aa.attention(q, k, v, backend="webgpu", dropout_seed=1, **kw)
    assert np.array_equal(_bits(o), _bits(o2)) and np.array_equal(_bits(o), _bits(ref[1]["out"]))


def test_caches_bounded(be, data, monkeypatch):
    """Past the bounds the oldest entries go; results stay those of the uncached path."""
    _, dev = data
    run = be.runner()
    for name, n in (("MAX_PACKED", 6), ("MAX_UNIFORMS", 6), ("MAX_GROUPS", 4)):
        monkeypatch.setattr(run, name, n)
    run.clear_caches()
    for s in (0.2, 0.21, 0.22, 0.23):
        got = _call(dev, scale=s)[1]
        assert len(run._packed) <= 6 and len(run._uniforms) <= 6 and len(run._groups) <= 4
    monkeypatch.undo()
    _same_bits(got, _uncached(be, dev, scale=0.23))


def test_uniform_key_tells_signed_zero_apart(be):
    """0.0 and -0.0 pack to different bits: the content cache keeps them apart."""
    run = be.runner()
    a = run.uniform("t", {"softcap": 0.0})
    b = run.uniform("t", {"softcap": -0.0})
    assert a is not b
    assert run.uniform("t", {"softcap": 0.0}) is a


def test_cache_keeps_no_caller_buffer_alive(be, data):
    """A bind group entry holds its buffers weakly and a launch template holds slots,
    not buffers: once the caller drops a buffer of its own that calls bound (here
    ``out`` of the backward, a copy the caller made), the buffer is freed and its
    entries leave the cache.  A result buffer goes back to the pool (bounded free list)
    when its arrays die, and is handed out again."""
    import gc
    import weakref

    _, dev = data
    q, k, v, g = dev
    run = be.runner()
    out, st = forward_with_stats(q, k, v)
    mine = wg.asarray(out.numpy())
    gr = aa.attention_backward(q, k, v, g, out=mine, lse=st)
    ref = weakref.ref(mine.buffer)
    n = len(run._groups)
    dq_buf = gr.dq.buffer
    del mine, gr
    gc.collect()
    assert ref() is None
    assert len(run._groups) < n
    assert run.results.is_free(dq_buf)
    gr = aa.attention_backward(q, k, v, g, out=out, lse=st)
    assert gr.dq.buffer is dq_buf and not run.results.is_free(dq_buf)


def test_result_buffer_reused_only_when_no_array_holds_it(be, data):
    """A view keeps its base's buffer held; ``from_buffer`` on a result's buffer takes it
    out of the pool for good; a poisoned (NaN) reused buffer is fully rewritten."""
    import gc

    host, dev = data
    q, k, v, g = dev
    run = be.runner()
    out, st = forward_with_stats(q, k, v)
    gr = aa.attention_backward(q, k, v, g, out=out, lse=st)
    ref = {n: getattr(gr, n).numpy() for n in ("dq", "dk", "dv")}
    view = gr.dq[0, 1:]                       # a view of dq only
    bufs = {n: getattr(gr, n).buffer for n in ("dq", "dk", "dv")}
    del gr
    gc.collect()
    assert not run.results.is_free(bufs["dq"]) and run.results.is_free(bufs["dk"])
    for _ in range(3):                         # later calls never write into the view
        aa.attention_backward(q, k, v, g, out=out, lse=st)
    np.testing.assert_array_equal(view.numpy(), ref["dq"][0, 1:])
    mine = wg.from_buffer(view.buffer, view.shape, view.dtype, offset=view.offset,
                          strides=view.strides)
    del view
    gc.collect()
    assert not run.results.is_free(bufs["dq"])     # claimed: the caller owns it now
    aa.attention_backward(q, k, v, g, out=out, lse=st)
    np.testing.assert_array_equal(mine.numpy(), ref["dq"][0, 1:])
    run.poison()                               # free result buffers too
    gr = aa.attention_backward(q, k, v, g, out=out, lse=st)
    for n in ("dq", "dk", "dv"):
        np.testing.assert_array_equal(getattr(gr, n).numpy(), ref[n])


def _arena_views(dev, arrays, offsets):
    """Each [B, H, S, D] float32 array at its element offset in its own buffer of room
    for all of them ([B, H, S, D] strides) -> views."""
    out = []
    for a, off in zip(arrays, offsets):
        buf = dev.create_buffer(size=4 * (max(offsets) + a.size + 16), usage=_usage())
        dev.queue.write_buffer(buf, 4 * off, np.ascontiguousarray(a))
        out.append(wg.from_buffer(buf, a.shape, "float32", offset=off))
    return out


def _usage():
    import wgpu

    return wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST


def test_offsets_and_shared_buffers_never_stale(be, data):
    """The same data at another element offset, and q/k/v in one shared buffer vs in
    three: each call has the bits of its own uncached path (a template recorded with
    shared buffers must not bind q's buffer for k when they differ)."""
    host, dev = data
    d = wg.device()
    a = _call(tuple(_arena_views(d, host, (0, 0, 0, 0))))[1]
    b = _call(tuple(_arena_views(d, host, (8, 24, 40, 0))))[1]
    _same_bits(a, b)                                  # same values, other offsets
    # k and v views into q's buffer, then the same views into two other buffers
    qv, o1, o2 = _arena_views(d, (host[0], 0.5 * host[0], 0.25 * host[0]), (4, 4, 4))
    shared = (qv, qv[:, :1], qv[:, 1:2], dev[3])
    apart = (qv, o1[:, :1], o2[:, 1:2], dev[3])
    s1 = _call(shared)[1]
    a1 = _call(apart)[1]
    _same_bits(a1, _uncached(be, apart))
    _same_bits(s1, _uncached(be, shared))
    assert not np.array_equal(a1["dq"], s1["dq"])


def test_key_tells_config_variant_and_limits_apart(be, data, monkeypatch):
    """Tile config, kernel variant (by name or environment), loop budget, debug builds,
    strides, offsets and buffer sharing are fields of the template key (dtypes, sizes
    and the problem's options are, through the Problem and the arrays' signatures)."""
    from anyattn.backends.webgpu import resident
    from anyattn.backends.webgpu.launch import ENV_VARIANT, TileConfig
    from anyattn.problem import describe

    _, dev = data
    q, k, v, g = dev
    out, st = forward_with_stats(q, k, v)

    def key(q=q, k=k, **kw):
        p = describe(q, k, v, dout=g, out=out, lse=st.max, wrt=("q", "k", "v"))
        inputs = dict(q=q, k=k, v=v, dout=g, out=out, max=st.max, log_norm=st.log_norm,
                      bias=None, slopes=None, sinks=None)
        return resident._key("bwd", be, p, inputs)

    base = key()
    assert key() == base
    keys = {}
    be.config_override = TileConfig(8, 8, 16, 16, 1)
    keys["config"] = key()
    be.config_override = None
    be.loop_limit_override = 100
    keys["loop limit"] = key()
    be.loop_limit_override = None
    be.debug_trips = True
    keys["debug"] = key()
    be.debug_trips = False
    monkeypatch.setenv(ENV_VARIANT, "prefetch")
    keys["variant"] = key()
    monkeypatch.delenv(ENV_VARIANT)
    q2 = wg.from_buffer(q.buffer, q.shape, "float32", strides=(0,) + q.strides[1:])
    keys["strides"] = key(q=q2)
    d = wg.device()
    at4, at8 = (_arena_views(d, (np.zeros(q.shape, np.float32),), (off,))[0] for off in (4, 8))
    keys["offset"] = key(q=at8)
    assert key(q=at4) != keys["offset"]
    keys["shared buffer"] = key(k=wg.from_buffer(q.buffer, k.shape, "float32"))
    assert key() == base
    for name, kk in keys.items():
        assert kk != base, name
    assert len(set(keys.values())) == len(keys)
