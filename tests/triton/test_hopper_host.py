"""Host side of the Hopper forward (backends/triton/hopper/launch.py): the TMA descriptors
``make_desc`` builds from its per-(shape, strides, dtype, rows, alignment) parts are the
ones ``TensorDescriptor`` builds, always over the call's own tensor; the prepared forward
launch (``FwdLaunch``, kept per call signature by launch.py) passes the arguments the
uncached path passes and holds no tensor.  CPU: the Gluon kernels are swapped for
recorders (nothing runs) and the SM count the persistent launch asks torch.cuda for is
set (``_SMS``); GPU (sm_90): the cached launches give the bits of uncached ones on new,
strided, freed-and-reallocated tensors.

Shape legend: B batch, H / Hkv heads, S = Sq = Sk, D head dim.
"""
from __future__ import annotations

import dataclasses
import gc
import os
import weakref

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
try:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
except ImportError:                                      # pragma: no cover
    pytest.skip("needs triton.experimental.gluon", allow_module_level=True)

import anyattn as aa  # noqa: E402
from anyattn.backends.triton import launch as L  # noqa: E402
from anyattn.backends.triton import route as ROUTE  # noqa: E402
from anyattn.backends.triton.hopper import configs as HCF  # noqa: E402
from anyattn.backends.triton.hopper import launch as HL  # noqa: E402
from anyattn.problem import describe  # noqa: E402

from tr_util import needs_sm90, route_to_hopper  # noqa: E402


def _fields(d) -> dict:
    return {f.name: getattr(d, f.name) for f in dataclasses.fields(d)}


def _same_desc(a, b) -> None:
    """Field by field: the same tensor object, equal shape / strides / block / layout."""
    fa, fb = _fields(a), _fields(b)
    assert fa.keys() == fb.keys()
    assert fa.pop("base") is fb.pop("base")
    for name in fa:
        assert fa[name] == fb[name], name
    assert type(a) is type(b) is TensorDescriptor


def _tensors(dtype=torch.bfloat16):
    """Layouts the Hopper path takes: contiguous, a [B, S, H, D] storage seen as
    [B, H, S, D], size-1 dims, a slice of a wider head dim."""
    return [torch.randn(2, 4, 48, 128).to(dtype),
            torch.randn(2, 48, 4, 128).to(dtype).transpose(1, 2),
            torch.randn(1, 1, 40, 128).to(dtype),
            torch.randn(2, 3, 24, 256).to(dtype)[..., :128]]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [64, 128])
def test_cached_descriptor_is_the_built_one(dtype, rows):
    HL._desc_parts.clear()
    for make in (lambda: _tensors(dtype), lambda: _tensors(dtype)):   # miss, then hits
        for x in make():          # new tensors every time: the base is always the call's
            _same_desc(HL.make_desc(x, rows), HL._new_desc(x, rows))
    assert len(HL._desc_parts) == 4


def test_cached_dq_accumulator_descriptor_is_the_built_one():
    HL._desc_parts.clear()
    for _ in range(2):                                   # miss, then hits
        for shape in ((8, 48, 128), (1, 8, 128), (8, 40, 64)):
            x = torch.empty(shape, dtype=torch.float32)
            cols = shape[2] // 2
            _same_desc(HL.dqa_desc(x, 64, cols), HL._new_dqa_desc(x, 64, cols))
    assert len(HL._desc_parts) == 3


def test_descriptor_key_changes_with_every_input():
    x = torch.randn(2, 4, 48, 128).to(torch.bfloat16)
    base = HL.desc_key(x, 64)
    buf = torch.empty(2 * 4 * 48 * 128 + 8, dtype=torch.bfloat16)
    off = buf[1:1 + x.numel()].view(x.shape)          # same shape and strides, 2 bytes off
    for other in (HL.desc_key(x, 128), HL.desc_key(x.to(torch.float16), 64),
                  HL.desc_key(x.transpose(1, 2).contiguous().transpose(1, 2), 64),
                  HL.desc_key(x[:, :, :40], 64), HL.desc_key(off, 64)):
        assert other != base


def test_misaligned_tensor_is_still_refused_after_cached_calls():
    x = torch.randn(2, 4, 48, 128).to(torch.bfloat16)
    HL.make_desc(x, 64)
    HL.make_desc(x.clone(), 64)                       # a hit
    buf = torch.empty(x.numel() + 8, dtype=torch.bfloat16)
    off = buf[1:1 + x.numel()].view(x.shape)
    with pytest.raises(AssertionError, match="16-byte aligned"):
        HL.make_desc(off, 64)


def test_descriptor_cache_holds_no_tensor():
    HL._desc_parts.clear()
    x = torch.randn(2, 4, 48, 128).to(torch.bfloat16)
    HL.make_desc(x, 64)
    d = HL.make_desc(x, 64)
    ref = weakref.ref(x)
    del x, d
    gc.collect()
    assert ref() is None
    assert not any(isinstance(v, torch.Tensor)
                   for _, fields in HL._desc_parts.values() for v in fields.values())


def test_descriptor_cache_is_bounded():
    HL._desc_parts.clear()
    for s in range(1, HL._DESC_PARTS + 20):
        HL.make_desc(torch.empty(1, 1, s, 128, dtype=torch.bfloat16), 64)
    assert len(HL._desc_parts) == HL._DESC_PARTS


# ------------------------------------------------------------------ the prepared forward
class _Recorder:
    """Stands in for a Gluon kernel: kernel[grid](*args, **kw) records the call."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *a, **kw: self.calls.append((grid, a, kw))


#: the SM count the persistent forward's launch is given here (route.sm_count asks
#: torch.cuda on a GPU): fewer programs than the tests' 8 query tiles, so that the
#: schedule deals several tiles to a program
SMS = 3


@pytest.fixture
def sm_count(monkeypatch):
    """route.sm_count of the CPU device set to SMS (no torch.cuda here).  describe's
    Problem cache is emptied first: test_hopper.py re-points cached CPU Problems at
    'cuda:0' (object.__setattr__), whose SM count would be asked of torch.cuda."""
    from anyattn import problem

    problem.clear_cache()
    monkeypatch.setitem(ROUTE.SM_COUNTS, "cpu", SMS)
    return SMS


@pytest.fixture
def recorded(monkeypatch, sm_count):
    """The Gluon forward kernels (per-tile and persistent) swapped for recorders; the
    forward routed to Hopper; the SM count set (sm_count); no CUDA-graph capture (the
    scheduled launch asks torch.cuda whether one is under way before it builds a
    schedule; torch without CUDA cannot answer)."""
    from anyattn.backends.triton.hopper import fwd_persist_kernel, fwd_ws_kernel

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    rec = _Recorder()
    monkeypatch.setattr(fwd_ws_kernel, "fwd_ws_kernel", rec)
    monkeypatch.setattr(fwd_persist_kernel, "fwd_persist_kernel", rec)
    route_to_hopper(monkeypatch, "forward")
    L.clear_prepared()
    yield rec
    L.clear_prepared()


def _expected(p, q, k, v, out, stats):
    """The uncached launch: a FwdLaunch built for this call alone, descriptors built by
    TensorDescriptor itself -> kernel, grid, arguments, keywords."""
    fresh = HL.prepare_forward(p)
    rq, rk = fresh.q_rows, fresh.cfg.bn
    descs = (HL._new_desc(q, rq), HL._new_desc(k, rk), HL._new_desc(v, rk),
             HL._new_desc(out, rq))
    marr, kw = fresh.mask_args(q, p)     # placeholders here (no Documents / KeepMask)
    return fresh.grid, descs + (stats,) + fresh.args + marr, kw


@pytest.mark.parametrize("route", ["routed", "per_tile"])
@pytest.mark.parametrize("mask", [None, aa.Causal(), aa.Window(5, 3)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_prepared_forward_passes_the_uncached_arguments(recorded, monkeypatch, mask, dtype,
                                                        layout, route):
    """Repeated launch.forward calls on new tensors (the prepared launch, the descriptor
    cache) record the launch the uncached code made: the same grid, keywords, scalars and
    descriptor fields, the descriptors over each call's own q, k, v and out.  'routed':
    the D=128 route without a mask or with a band (the persistent kernel on the
    host-built schedule): one program per SM (SMS here) over the 8 query tiles, B * H
    and the schedule (bands) or its placeholder (no mask: the kernel's own walk) after
    the mask arguments.  'per_tile': the route pinned to the per-tile kernel of the same
    loop (the route of Documents / KeepMask calls): one program per query tile."""
    routed = HCF.fwd_config(128, "band")
    per_tile = routed.per_tile()
    if route == "per_tile":
        for mc in ("none", "band"):
            monkeypatch.setitem(HCF._FWD, (128, mc), per_tile)
    want = routed if route == "routed" else per_tile
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        if layout == "bshd":
            q, k, v = (torch.randn(2, 40, h, 128, generator=g).to(dtype).transpose(1, 2)
                       for h in (4, 2, 2))
        else:
            q, k, v = (torch.randn(2, h, 40, 128, generator=g).to(dtype) for h in (4, 2, 2))
        p = describe(q, k, v, mask=mask)
        out, st = L.forward(p, q, k, v, None)
        grid, args, kw = recorded.calls.pop()
        stats = args[4]
        assert st.max.data_ptr() == stats[0].data_ptr() and tuple(stats.shape) == (2, 2, 4, 40)
        wgrid, wargs, wkw = _expected(p, q, k, v, out, stats)
        assert grid == wgrid and kw == wkw and len(args) == len(wargs)
        for a, b in zip(args, wargs):
            if isinstance(b, TensorDescriptor):
                _same_desc(a, b)
            elif isinstance(b, torch.Tensor):
                assert a is b
            else:
                assert a == b and type(a) is type(b)
        assert all(a.base is t for a, t in zip(args[:4], (q, k, v, out)))
        assert tuple(out.shape) == (2, 4, 40, 128) and out.dtype == dtype
        (pr,) = L.prepared.PREPARED._d.values()
        assert pr.hfwd.cfg == want, pr.hfwd.cfg.name
        n_tiles = 1 * 2 * 4                        # cdiv(40, 128) query tiles x B x H
        if route == "routed":
            assert grid == (min(SMS, n_tiles),) == (SMS,)
            assert kw["HAS_BAND"] is (mask is not None) and "XOVER" not in kw
            # the persistent kernel takes no array masks and always 2 consumers
            assert not {"ARRAY", "DOCS", "HAS_KEEP", "SCHED", "NC"} & set(kw)
            assert args[-2] == 2 * 4                # B * H
            if mask is not None:                   # the cached schedule for SMS programs
                assert pr.hfwd.sched[-1] == SMS
                assert args[-1] is HL.persist_schedule(*pr.hfwd.sched, device=q.device)
                assert args[-1].numel() == SMS + 1 + n_tiles
                assert pr.hfwd.per_tile.cfg == per_tile
            else:
                assert pr.hfwd.sched is None and args[-1].numel() == 1
        else:
            assert grid == (1, n_tiles) and "NC" in kw
            assert not kw["ARRAY"] and kw["HAS_BAND"] is (mask is not None)
    assert len(L.prepared.PREPARED) == 1


def test_prepared_forward_holds_no_tensor(recorded):
    q, k, v = (torch.randn(1, 2, 40, 128).to(torch.bfloat16) for _ in range(3))
    p = describe(q, k, v, mask=aa.Causal())
    L.forward(p, q, k, v, None)
    L.forward(p, q, k, v, None)
    (pr,) = L.prepared.PREPARED._d.values()
    assert isinstance(pr.hfwd, HL.FwdLaunch)
    # the route (persistent, scheduled) and its per-tile twin for graph capture
    assert pr.hfwd.cfg.persist and isinstance(pr.hfwd.per_tile, HL.FwdLaunch)
    for launch in (pr.hfwd, pr.hfwd.per_tile):
        assert not any(isinstance(x, torch.Tensor) for x in vars(launch).values())
    refs = [weakref.ref(x) for x in (q, k, v)]
    recorded.calls.clear()
    del q, k, v
    gc.collect()
    assert all(r() is None for r in refs)


def test_scheduled_forward_under_capture_launches_its_per_tile_twin(recorded, monkeypatch):
    """Under CUDA-graph capture, a scheduled launch whose schedule is not built yet (a
    host copy cannot be captured) launches the per-tile kernel of the same loop (one
    program per query tile, bitwise the same results: GPU test
    test_gpu_scheduled_forward_under_graph_capture_without_warmup) and builds nothing;
    once the schedule is built, capture or not, the persistent kernel."""
    q, k, v = (torch.randn(1, 4, 300, 128).to(torch.bfloat16) for _ in range(3))
    p = describe(q, k, v, mask=aa.Causal())
    pr = HL.prepare_forward(p)
    assert pr.cfg == HCF.fwd_config(128, "band") and pr.sched is not None
    HL._sched_cache.clear()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    HL.forward(p, q, k, v, prepared=pr)
    grid, args, kw = recorded.calls.pop()
    assert grid == (3, 4) and "NC" in kw         # the per-tile kernel
    assert not HL.schedule_ready(*pr.sched, device=q.device)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    HL.forward(p, q, k, v, prepared=pr)
    grid, args, kw = recorded.calls.pop()
    assert grid == (SMS,) and kw["HAS_BAND"] and HL.schedule_ready(*pr.sched, device=q.device)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    HL.forward(p, q, k, v, prepared=pr)                 # built: the persistent kernel
    grid, args, kw = recorded.calls.pop()
    assert grid == (SMS,) and kw["HAS_BAND"] and args[-1] is HL.persist_schedule(
        *pr.sched, device=q.device)


def test_prepared_forward_refuses_a_different_config(sm_count):
    q = torch.zeros(1, 2, 8, 128, dtype=torch.bfloat16)
    p = describe(q, q, q)
    pr = HL.prepare_forward(p)
    assert pr.cfg == HCF.fwd_config(128, "none")
    # any other config, the per-tile kernel of the same loop (bitwise its results) too
    for other in (HCF.fwd_config(64, "band"), pr.cfg.per_tile()):
        with pytest.raises(ValueError, match="differs from the prepared"):
            HL.forward(p, q, q, q, cfg=other, prepared=pr)


def test_d128_forward_launch_is_persistent_without_a_mask_and_with_a_band(sm_count):
    """The D=128 forward's launch (prepare_forward): no mask
    or a band (causal, bottom-right, window) -> the persistent kernel on min(SMs, query
    tiles) programs, the host-built schedule with a band only; Documents / KeepMask ->
    the per-tile warp-specialised kernel (the schedule takes band masks only), one
    program per query tile; fp16 as bf16."""
    from anyattn.backends.triton.hopper.fwd_persist_kernel import fwd_persist_kernel
    from anyattn.backends.triton.hopper.fwd_ws_kernel import fwd_ws_kernel

    ids = torch.arange(300, dtype=torch.int32) // 100
    keep = torch.ones(1, 1, 300, 300, dtype=torch.bool)
    for dt in (torch.bfloat16, torch.float16):
        q = torch.zeros(1, 4, 300, 128, dtype=dt)      # 3 query tiles a head, 12 in all
        for mask, sched in ((None, False), (aa.Causal(), True),
                            (aa.Causal(align="bottom_right"), True),
                            (aa.Window(left=200, right=37), True)):
            pr = HL.prepare_forward(describe(q, q, q, mask=mask))
            assert pr.cfg == HCF.fwd_config(128, "band"), (mask, pr.cfg.name)
            assert pr.kernel is fwd_persist_kernel and pr.grid == (SMS,)
            assert (pr.sched is not None) is sched and pr.kw["HAS_BAND"] is sched
        for mask in (aa.Documents(ids), aa.Causal() & aa.Documents(ids), aa.KeepMask(keep)):
            pr = HL.prepare_forward(describe(q, q, q, mask=mask))
            assert pr.cfg == HCF.fwd_config(128, "band").per_tile() and not pr.cfg.persist
            assert pr.kernel is fwd_ws_kernel and pr.grid == (3, 4)


# ----------------------------------------------------------------------------- GPU bits
@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("mask", [None, aa.Causal()])
def test_cached_hopper_forward_same_bits_on_new_tensors(mask):
    """launch.forward through the prepared launch and the descriptor cache == an uncached
    HL.forward on the same inputs, for new tensors each call, a strided layout, and a
    tensor freed and its memory reallocated for another."""
    if os.environ.get("ANYATTN_TRITON_PATH", "auto") == "portable":
        pytest.skip("ANYATTN_TRITON_PATH=portable: the forward is not routed to Hopper")
    L.clear_prepared()
    dt = torch.bfloat16

    def inputs(seed, layout):
        g = torch.Generator(device="cuda").manual_seed(seed)
        if layout == "bshd":
            return [torch.randn(2, 256, 4, 128, device="cuda", generator=g).to(dt)
                    .transpose(1, 2) for _ in range(3)]
        return [torch.randn(2, 4, 256, 128, device="cuda", generator=g).to(dt)
                for _ in range(3)]

    def uncached(p, q, k, v):
        HL._desc_parts.clear()
        return HL.forward(p, q, k, v, prepared=HL.prepare_forward(p))

    for seed, layout in [(0, "bhsd"), (1, "bhsd"), (2, "bshd"), (3, "bhsd"), (4, "bshd")]:
        q, k, v = inputs(seed, layout)
        p = describe(q, k, v, mask=mask)
        o1, s1 = L.forward(p, q, k, v, None)
        assert all(pr.hop and pr.hfwd is not None for pr in L.prepared.PREPARED._d.values())
        o2, s2 = uncached(p, q, k, v)
        assert torch.equal(o1, o2) and torch.equal(s1.max, s2.max)
        assert torch.equal(s1.log_norm, s2.log_norm)
        del q, k, v, o1, o2, s1, s2
        q, k, v = inputs(seed + 100, layout)   # the freed blocks come back from the pool
        o1, s1 = L.forward(p, q, k, v, None)
        o2, s2 = uncached(p, q, k, v)
        assert torch.equal(o1, o2) and torch.equal(s1.log_norm, s2.log_norm)


@pytest.mark.parametrize("mask", [None, aa.Causal()])
def test_prepared_forward_repeats_go_direct_and_hold_no_tensor(recorded, monkeypatch, mask):
    """With direct launches on (a CUDA device's default; here put in), the prepared
    forward's first call resolves its launch site and the repeats on fresh tensors
    replay it with the arguments the recorded launch had (descriptors over the call's
    own tensors, the persistent kernel's schedule); the resolved site keeps facts, not
    tensors."""
    from anyattn.backends.triton import direct as DL

    replayed = []

    class RecordedDirect(DL.Direct):
        def run(self, grid, vals):
            replayed.append((grid, vals))
            return True

    monkeypatch.setattr(DL, "enabled", lambda dev: True)
    monkeypatch.setattr(DL, "resolve", lambda kern, a, k: RecordedDirect(kern, None, a, k))
    refs = []
    for i in range(3):
        q, k, v = (torch.randn(1, 2, 40, 128).to(torch.bfloat16) for _ in range(3))
        p = describe(q, k, v, mask=mask)
        out, st = L.forward(p, q, k, v, None)
        if i == 0:
            assert len(recorded.calls) == 1 and not replayed
            first = recorded.calls.pop()
        else:
            assert not recorded.calls
            grid, vals = replayed.pop()
            # no binding here (the fake resolution has no signature): the positional
            # arguments, then the keywords' values in the launch's order
            n = len(first[1])
            assert grid == first[0] and vals[n:] == tuple(first[2].values())
            assert all(d.base is t for d, t in zip(vals[:4], (q, k, v, out)))
            assert vals[4].data_ptr() == st.max.data_ptr()
            scalars = [x for x in vals[5:n] if not isinstance(x, torch.Tensor)]
            assert scalars == [x for x in first[1][5:] if not isinstance(x, torch.Tensor)]
        refs += [weakref.ref(x) for x in (q, k, v, out)]
    (pr,) = L.prepared.PREPARED._d.values()
    assert pr.hfwd.site.hits == 2
    del q, k, v, out, st, vals, first
    replayed.clear()
    gc.collect()
    assert all(r() is None for r in refs)
