"""flash_attn_with_kvcache with its lengths, indices and page table left on the device:
no host read of them (so no synchronisation, and a CUDA graph can capture the call),
the Triton backend's paged kernel sized from the shapes, the value checks opt-in
(ANYATTN_CHECK_DEVICE_INPUTS=1).

On this machine the device path runs on CPU tensors through the Triton interpreter
(TRITON_INTERPRET=1): ``device_path`` makes flash_attn_with_kvcache treat the CPU as a
device whose tensors it must not read (``_HOST_DEVICE_TYPES``) and sends its core call
to the Triton backend.  The host reads are recorded by ``HostReads``, which follows
every tensor derived from the watched ones."""
import weakref

import numpy as np
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

import anyattn as aa
import anyattn.flash_attn as fa
from anyattn.flash_attn import flash_attn_interface as fai
from test_flash_attn import close, paged_copy, rand, ref_rotary, ref_seq

aten = torch.ops.aten

#: ops that read a tensor's values on the host (on CUDA: a synchronisation)
_SYNC_OPS = {aten._local_scalar_dense.default, aten.nonzero.default,
             aten.masked_select.default, aten.unique_consecutive.default,
             aten._unique2.default, aten.unique_dim.default, aten.equal.default,
             aten.allclose.default}
#: tensor methods that hand the values to Python
_READ_METHODS = {torch.Tensor.numpy, torch.Tensor.tolist, torch.Tensor.item,
                 torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.__float__,
                 torch.Tensor.__bool__, torch.Tensor.__array__}
#: in-place writes whose tainted inputs are indices: the data written is not derived
_INDEXED_WRITES = {aten.index_put_.default, aten.index_put.default,
                   aten._index_put_impl_.default}


class HostReads:
    """Records every host read of the watched tensors and of every tensor computed from
    them (``records``: 'op' strings): values handed to Python (.numpy(), .tolist(),
    int(), bool(), .item()), ops that read values on the host (nonzero, ...) and copies
    to the CPU from another device."""

    def __init__(self, *watched):
        self.records = []
        self._live = {}
        for t in watched:
            if isinstance(t, torch.Tensor):
                self.taint(t)
        outer = self

        class Functions(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func in _READ_METHODS and args and outer.tainted(args[0]):
                    outer.records.append(getattr(func, "__name__", str(func)))
                return func(*args, **kwargs)

        class Dispatch(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                leaves = [x for x in pytree.tree_leaves((args, kwargs))
                          if isinstance(x, torch.Tensor)]
                if not any(outer.tainted(x) for x in leaves):
                    return out
                if func in _SYNC_OPS:
                    outer.records.append(str(func))
                if func in (aten._to_copy.default, aten.copy_.default):
                    dst = out if func is aten._to_copy.default else args[0]
                    src = args[0] if func is aten._to_copy.default else args[1]
                    if dst.device.type == "cpu" and src.device.type != "cpu":
                        outer.records.append(f"{func} to the host")
                if func not in _INDEXED_WRITES:
                    for x in pytree.tree_leaves(out):
                        if isinstance(x, torch.Tensor):
                            outer.taint(x)
                return out

        self._modes = (Functions(), Dispatch())

    def taint(self, t):
        self._live[id(t)] = weakref.ref(t)

    def tainted(self, t) -> bool:
        if not isinstance(t, torch.Tensor):
            return False
        ref = self._live.get(id(t))
        return ref is not None and ref() is t

    def __enter__(self):
        for m in self._modes:
            m.__enter__()
        return self

    def __exit__(self, *exc):
        for m in reversed(self._modes):
            m.__exit__(*exc)


@pytest.fixture
def device_path(monkeypatch):
    """CPU tensors through flash_attn_with_kvcache's device path and the Triton
    interpreter; -> the list of the Pages its core calls received."""
    from anyattn.backends.registry import unavailable_reason

    pytest.importorskip("triton")
    if unavailable_reason("triton"):
        pytest.skip(f"triton unavailable: {unavailable_reason('triton')}")
    monkeypatch.setattr(fai, "_HOST_DEVICE_TYPES", ())
    monkeypatch.delenv("ANYATTN_CHECK_DEVICE_INPUTS", raising=False)
    calls = []
    real = fai.core_attention
    monkeypatch.setattr(fai, "core_attention", lambda *a, **kw: calls.append(
        kw["pages"]) or real(*a, backend="triton", **kw))
    return calls


def _case(paged, rng_seed=0, b=3, page=16, hq=4, hk=2, d=16, per_seq=4):
    torch.manual_seed(rng_seed)
    if paged:
        n_blocks = b * per_seq + 2
        kp, vp = rand(n_blocks, page, hk, d), rand(n_blocks, page, hk, d)
        table = torch.randperm(n_blocks, dtype=torch.int32)[:b * per_seq].reshape(b, per_seq)
        return kp, vp, dict(block_table=table)
    return rand(b, per_seq * page, hk, d), rand(b, per_seq * page, hk, d), {}


def _keys(kc, vc, extra, i, end, idx=None):
    """Entry i's cache positions [0, end) (after the call) as [end, Hk, D] copies."""
    if "block_table" in extra:
        t = extra["block_table"][i:i + 1]
        return paged_copy(kc, t, end)[0], paged_copy(vc, t, end)[0]
    r = i if idx is None else int(idx[i])
    return kc[r, :end], vc[r, :end]


# ----------------------------------------------------------------------- correctness

@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("sq", [1, 3])
def test_device_path_matches_float64(device_path, paged, sq):
    """Append in place, rotary, causal window, ALiBi, softcap, GQA and ragged lengths on
    the device path (one core call with Pages(on_device=True)) against float64."""
    kc, vc, extra = _case(paged)
    before_k = kc.clone()
    b, hq, hk, d = 3, 4, 2, 16
    lengths = torch.tensor([17, 40, 0], dtype=torch.int32)
    q, k_new, v_new = rand(b, sq, hq, d), rand(b, sq, hk, d), rand(b, sq, hk, d)
    ang = torch.rand(64, 4) * 6.3
    cos, sin = ang.cos(), ang.sin()
    slopes = torch.rand(b, hq)
    out, lse = fa.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, rotary_cos=cos,
                                          rotary_sin=sin, cache_seqlens=lengths, causal=True,
                                          window_size=(20, -1), alibi_slopes=slopes,
                                          softcap=3.0, rotary_interleaved=False,
                                          return_softmax_lse=True, **extra)
    assert len(device_path) == 1 and device_path[0].on_device
    for i in range(b):
        n = int(lengths[i])
        kpos = n + torch.arange(sq)
        keys, vals = _keys(kc, vc, extra, i, n + sq)
        k_ro = ref_rotary(k_new[i], cos, sin, kpos, False)
        close(keys[n:], k_ro)                                      # stored rotated
        assert torch.equal(vals[n:], v_new[i])
        assert torch.equal(keys[:n], _keys(before_k, vc, extra, i, n)[0])
        o, s, _ = ref_seq(ref_rotary(q[i], cos, sin, kpos, False), keys, vals, causal=True,
                          window=(20, -1), softcap=3.0, slopes=slopes[i])
        close(out[i], o)
        close(lse[i], s)


@pytest.mark.parametrize("paged", [True, False])
def test_device_path_leftpad_batch_idx_and_int_seqlens(device_path, paged):
    """cache_leftpad (the Pages' starts), cache_batch_idx (a contiguous cache's rows as
    pages), an int cache_seqlens with a device table or index, and no cache_seqlens."""
    b, hq, hk, d, sq = 3, 4, 2, 16, 2
    q = rand(b, sq, hq, d)
    kc, vc, extra = _case(paged)
    lengths = torch.tensor([17, 40, 5], dtype=torch.int32)
    pad = torch.tensor([3, 21, 5], dtype=torch.int32)
    idx = None
    if not paged:
        kc, vc = rand(5, 64, hk, d), rand(5, 64, hk, d)
        idx = torch.tensor([4, 0, 2], dtype=torch.int32)
        extra = dict(cache_batch_idx=idx)
    out = fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=lengths, cache_leftpad=pad,
                                     causal=True, **extra)
    assert device_path[-1].on_device and device_path[-1].starts is not None
    for i in range(b):
        keys, vals = _keys(kc, vc, extra, i, int(lengths[i]), idx)
        close(out[i], ref_seq(q[i], keys[int(pad[i]):], vals[int(pad[i]):], causal=True)[0])
    out = fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=30, **extra)
    assert device_path[-1].on_device
    for i in range(b):
        keys, vals = _keys(kc, vc, extra, i, 30, idx)
        close(out[i], ref_seq(q[i], keys, vals)[0])
    out = fa.flash_attn_with_kvcache(q, kc, vc, **extra)                  # the whole cache
    assert device_path[-1].on_device
    for i in range(b):
        keys, vals = _keys(kc, vc, extra, i, 64, idx)
        close(out[i], ref_seq(q[i], keys, vals)[0])


@pytest.mark.parametrize("checked", [False, True])
def test_device_path_rotary_leftpad_and_padded_table(device_path, monkeypatch, checked):
    """The device path agrees with the host path and FlashAttention's definitions:
    rotary positions cache_seqlens[b] + i counted from the cache start with a
    cache_leftpad (interleaved, rotary_dim 8 < D 16), and block_table entries outside
    the pages holding [cache_leftpad[b], cache_seqlens[b] + Snew) never read (-1 past the
    used pages and before the left pad), with and without ANYATTN_CHECK_DEVICE_INPUTS."""
    if checked:
        monkeypatch.setenv("ANYATTN_CHECK_DEVICE_INPUTS", "1")
    b, hq, hk, d, sq, page = 3, 4, 2, 16, 2, 16
    kp, vp, extra = _case(True)                                 # 4 pages of 16 per entry
    full = extra["block_table"]
    table = full.clone()
    lengths = torch.tensor([17, 40, 2], dtype=torch.int32)
    pad = torch.tensor([0, 35, 1], dtype=torch.int32)
    table[0, 2:] = -1                       # entry 0 reads [0, 19): pages 0, 1
    table[1, :2] = -1                       # entry 1 reads [35, 42): page 2 only
    table[1, 3] = -1
    table[2, 1:] = -1                       # entry 2 reads [1, 4): page 0
    before = kp.clone()
    q, k_new, v_new = rand(b, sq, hq, d), rand(b, sq, hk, d), rand(b, sq, hk, d)
    ang = torch.rand(64, 4) * 6.3
    cos, sin = ang.cos(), ang.sin()
    out = fa.flash_attn_with_kvcache(q, kp, vp, k_new, v_new, rotary_cos=cos, rotary_sin=sin,
                                     cache_seqlens=lengths, cache_leftpad=pad, causal=True,
                                     block_table=table, rotary_interleaved=True)
    assert len(device_path) == 1 and device_path[0].on_device
    for i in range(b):
        n, lo = int(lengths[i]), int(pad[i])
        kpos = n + torch.arange(sq)
        keys, vals = _keys(kp, vp, dict(block_table=full), i, n + sq)
        k_ro = ref_rotary(k_new[i], cos, sin, kpos, True)
        close(keys[n:], k_ro)
        assert torch.equal(keys[:n], _keys(before, vp, dict(block_table=full), i, n)[0])
        o, _, _ = ref_seq(ref_rotary(q[i], cos, sin, kpos, True), keys[lo:], vals[lo:],
                          causal=True)
        close(out[i], o)
    if checked:                             # an entry in use out of range still raises
        table[1, 2] = -1
        with pytest.raises(ValueError, match=r"block_table: entry \[1, 2\] is -1"):
            fa.flash_attn_with_kvcache(q, kp, vp, k_new, v_new, rotary_cos=cos,
                                       rotary_sin=sin, cache_seqlens=lengths,
                                       cache_leftpad=pad, causal=True, block_table=table)


def test_host_path_where_nothing_is_on_the_device(monkeypatch):
    """Only host values (an int cache_seqlens, a contiguous cache) or more than 16 queries
    per entry: the host path, as before (more queries: the lengths are read to the
    host, documented)."""
    monkeypatch.setattr(fai, "_HOST_DEVICE_TYPES", ())
    calls = []
    real = fai.core_attention
    monkeypatch.setattr(fai, "core_attention",
                        lambda *a, **kw: calls.append(kw["pages"]) or real(*a, **kw))
    kc, vc, _ = _case(False)
    q = rand(3, 1, 4, 16)
    out = fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=9)
    assert calls == []                           # one dense call over a slice
    close(out[1], ref_seq(q[1], kc[1, :9], vc[1, :9])[0])
    q17 = rand(3, 17, 4, 16)
    lengths = torch.tensor([3, 30, 12], dtype=torch.int32)
    with HostReads(lengths) as reads:
        out = fa.flash_attn_with_kvcache(q17, kc, vc, cache_seqlens=lengths, causal=True)
    assert reads.records and not calls[0].on_device
    for i in range(3):
        n = int(lengths[i])
        close(out[i], ref_seq(q17[i], kc[i, :n], vc[i, :n], causal=True)[0])


# --------------------------------------------------------------------- no host reads

@pytest.mark.parametrize("paged", [True, False])
def test_no_host_read_of_the_lengths(device_path, paged):
    """The call reads none of cache_seqlens, cache_batch_idx, cache_leftpad,
    block_table, nor anything computed from them, on the host (on CUDA: no
    synchronisation); the Pages it builds keeps them on the device."""
    kc, vc, extra = _case(paged)
    b, hq, hk, d, sq = 3, 4, 2, 16, 2
    lengths = torch.tensor([17, 40, 5], dtype=torch.int32)
    pad = torch.tensor([3, 0, 1], dtype=torch.int32)
    if not paged:
        kc, vc = rand(4, 64, hk, d), rand(4, 64, hk, d)
        extra = dict(cache_batch_idx=torch.tensor([3, 1, 0], dtype=torch.int32))
    q, k_new, v_new = rand(b, sq, hq, d), rand(b, sq, hk, d), rand(b, sq, hk, d)
    ang = torch.rand(64, 4) * 6.3
    watched = (lengths, pad, *extra.values())
    with HostReads(*watched) as reads:
        out = fa.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, rotary_cos=ang.cos(),
                                         rotary_sin=ang.sin(), cache_seqlens=lengths,
                                         cache_leftpad=pad, causal=True,
                                         alibi_slopes=torch.rand(hq), **extra)
    assert reads.records == []
    assert len(device_path) == 1 and device_path[0].on_device
    assert torch.isfinite(out).all()


def test_the_watch_sees_host_reads():
    """HostReads records what the test above must not see (it can fail)."""
    x = torch.tensor([4, 5], dtype=torch.int32)
    with HostReads(x) as reads:
        y = (x + 1)[1:]
        y.detach().cpu().numpy()
        int(y[0])
        bool((x > 3).all())
        (x * 2).tolist()
    assert reads.records == ["numpy", "__int__", "aten._local_scalar_dense.default",
                             "__bool__", "aten._local_scalar_dense.default", "tolist"]
    with HostReads(x) as reads:
        torch.arange(3).tolist()                  # not derived from x
        torch.zeros(2).index_put_((x.long() - 4,), torch.ones(2)).tolist()
    assert reads.records == []


def test_one_kernel_signature_for_every_length(device_path):
    """A repeat call with other lengths (same shapes) launches the same signatures (the
    paged launch's scalars and grid come from the shapes), so no new compile and no new
    launch site per cache length."""
    from anyattn.backends.triton import forward as triton_forward

    kc, vc, extra = _case(True)
    q = rand(3, 1, 4, 16)
    keys = []
    for lengths in ([17, 40, 5], [1, 63, 33], [0, 0, 64]):
        triton_forward._paged_sites.clear()
        out = fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=torch.tensor(
            lengths, dtype=torch.int32), causal=True, **extra)
        keys.append(sorted(map(repr, triton_forward._paged_sites)))
        for i, n in enumerate(lengths):
            keys_i, vals_i = _keys(kc, vc, extra, i, n)
            close(out[i], ref_seq(q[i], keys_i, vals_i, causal=True)[0])
    assert len(keys[0]) >= 2                      # split, combine (and the records)
    assert keys[0] == keys[1] == keys[2]


# ------------------------------------------------------------------ opt-in checks

def test_opt_in_checks_raise_before_any_write(device_path, monkeypatch):
    """ANYATTN_CHECK_DEVICE_INPUTS=1: the device values are read and checked as on the
    host path (the same errors), before anything is written."""
    monkeypatch.setenv("ANYATTN_CHECK_DEVICE_INPUTS", "1")
    kp, vp, extra = _case(True, b=2, per_seq=2)                     # 6 blocks of 16
    q, knew = rand(2, 1, 4, 16), rand(2, 1, 2, 16)
    table = extra["block_table"]
    snapshot = kp.clone()
    with pytest.raises(ValueError, match="cache_seqlens: entry 1 holds 32 keys, and 1 new "
                                         "ones would end at 33, beyond the 2 pages of 16 "
                                         "positions that block_table maps"):
        fa.flash_attn_with_kvcache(q, kp, vp, knew, knew, block_table=table,
                                   cache_seqlens=torch.tensor([3, 32], dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_seqlens: holds -1; lengths are >= 0"):
        fa.flash_attn_with_kvcache(q, kp, vp, knew, knew, block_table=table,
                                   cache_seqlens=torch.tensor([-1, 3], dtype=torch.int32))
    bad = table.clone()
    bad[1, 1] = 6
    with pytest.raises(ValueError, match=r"block_table: entry \[1, 1\] is 6, outside the "
                                         r"cache's 6 blocks \[0, 6\)"):
        fa.flash_attn_with_kvcache(q, kp, vp, knew, knew, block_table=bad,
                                   cache_seqlens=torch.tensor([3, 16], dtype=torch.int32))
    with pytest.raises(ValueError, match=r"cache_leftpad: entry 0 is 4, outside \[0, "
                                         r"cache_seqlens\[0\] = 3\]"):
        fa.flash_attn_with_kvcache(q, kp, vp, knew, knew, block_table=table,
                                   cache_seqlens=torch.tensor([3, 16], dtype=torch.int32),
                                   cache_leftpad=torch.tensor([4, 0], dtype=torch.int32))
    ang = torch.rand(10, 4)
    with pytest.raises(ValueError, match="rotary_cos: has 10 rows but position 16 is "
                                         "rotated"):
        fa.flash_attn_with_kvcache(q, kp, vp, knew, knew, block_table=table,
                                   rotary_cos=ang, rotary_sin=ang,
                                   cache_seqlens=torch.tensor([3, 16], dtype=torch.int32))
    kc, vc = rand(3, 32, 2, 16), rand(3, 32, 2, 16)
    with pytest.raises(ValueError, match=r"cache_batch_idx: holds 3, outside the cache's 3 "
                                         r"rows \[0, 3\)"):
        fa.flash_attn_with_kvcache(q, kc, vc, cache_seqlens=4,
                                   cache_batch_idx=torch.tensor([0, 3], dtype=torch.int32))
    assert torch.equal(kp, snapshot) and device_path == []          # nothing written or run
    # a good call reads the values (the switch is what reads them) and runs
    lengths = torch.tensor([3, 16], dtype=torch.int32)
    with HostReads(lengths) as reads:
        out = fa.flash_attn_with_kvcache(q, kp, vp, cache_seqlens=lengths, block_table=table)
    assert reads.records
    close(out[1], ref_seq(q[1], *_keys(kp, vp, extra, 1, 16))[0])


def test_switch_value_is_checked(monkeypatch):
    from anyattn import settings

    monkeypatch.setenv("ANYATTN_CHECK_DEVICE_INPUTS", "yes")
    with pytest.raises(ValueError, match="ANYATTN_CHECK_DEVICE_INPUTS='yes': expected 0 or 1"):
        settings.current()
    monkeypatch.setenv("ANYATTN_CHECK_DEVICE_INPUTS", "1")
    assert settings.current().check_device_inputs


# ------------------------------------------------------------- the core's on_device

def _core_case(seed=3):
    rng = np.random.default_rng(seed)
    n, hkv, page, d = 8, 2, 16, 8
    k = torch.from_numpy(rng.standard_normal((n, hkv, page, d)).astype(np.float32))
    v = torch.from_numpy(rng.standard_normal((n, hkv, page, d)).astype(np.float32))
    q = torch.from_numpy(rng.standard_normal((2, 4, 2, d)).astype(np.float32))
    table = torch.tensor([[5, 2, 7], [0, 3, -1]], dtype=torch.int32)
    return q, k, v, table, torch.tensor([40, 20], dtype=torch.int32), \
        torch.tensor([4, 0], dtype=torch.int32)


@pytest.mark.parametrize("backend", ["numpy", "triton"])
def test_core_pages_on_device_equal_host_pages(backend):
    """Pages(on_device=True) gives what the host Pages gives, on the NumPy backend (which
    reads it to the host at the call) and on the Triton backend (which does not)."""
    from anyattn.backends.registry import unavailable_reason

    if backend == "triton" and unavailable_reason("triton"):
        pytest.skip(f"triton unavailable: {unavailable_reason('triton')}")
    q, k, v, table, ends, starts = _core_case()
    mask = aa.Causal(align="bottom_right") & aa.Window(left=9, align="bottom_right")
    kw = dict(mask=mask, backend=backend, return_lse=True, alibi_slopes=torch.rand(4))
    want = aa.attention(q, k, v, pages=aa.Pages(table, ends, starts), **kw)
    dev_pages = aa.Pages(table, ends, starts, on_device=True)
    with HostReads(table, ends, starts) as reads:
        got = aa.attention(q, k, v, pages=dev_pages, **kw)
    # the NumPy backend reads the tables (in its worker threads, which the watch, a
    # per-thread mode, does not see: the Pages' host copies tell)
    assert bool(dev_pages._host) == (backend == "numpy")
    if backend == "triton":
        assert reads.records == []
    close(got[0], want[0])
    close(got[1], want[1])


def test_core_pages_on_device_refusals(monkeypatch):
    q, k, v, table, ends, starts = _core_case()
    with pytest.raises(TypeError, match="block_table: Pages[(]on_device=True[)] takes torch "
                                        "tensors"):
        aa.Pages(table.numpy(), ends, on_device=True)
    with pytest.raises(TypeError, match="seqlens: dtype float32 is not an integer type"):
        aa.Pages(table, ends.float(), on_device=True)
    with pytest.raises(ValueError, match=r"starts: shape \(3,\) does not match seqlens' "
                                         r"\(2,\)"):
        aa.Pages(table, ends, torch.zeros(3, dtype=torch.int32), on_device=True)
    with pytest.raises(TypeError, match="on_device: expected a bool"):
        aa.Pages(table, ends, on_device=1)
    # a band side mixing top-left and bottom-right terms has no single slope
    mixed = aa.Causal() & aa.Window(right=0, align="bottom_right")
    with pytest.raises(NotImplementedError, match="upper band side mixes top-left and "
                                                  "bottom-right"):
        aa.attention(q, k, v, pages=aa.Pages(table, ends, on_device=True), mask=mixed)
    # the value checks: only with the switch
    big = torch.tensor([40, 49], dtype=torch.int32)
    aa.Pages(table, big, on_device=True)                             # not read
    monkeypatch.setenv("ANYATTN_CHECK_DEVICE_INPUTS", "1")
    with pytest.raises(ValueError, match=r"pages: seqlens\[1\] = 49 exceeds the 3 pages x 16 "
                                         "positions = 48"):
        aa.attention(q, k, v, pages=aa.Pages(table, big, on_device=True))
    with pytest.raises(ValueError, match=r"starts: entry 1 is 30, outside \[0, seqlens\[1\] "
                                         r"= 20\]"):
        aa.Pages(table, ends, torch.tensor([0, 30], dtype=torch.int32), on_device=True)


# -------------------------------------------------------------------- CUDA graphs

@pytest.mark.gpu
@pytest.mark.parametrize("paged", [True, False])
def test_kvcache_call_is_captured_by_a_cuda_graph(paged):
    """GPU machines only: flash_attn_with_kvcache with cache_seqlens, cache_leftpad and
    block_table on the device (append, rotary, causal, ALiBi) is captured by a CUDA
    graph; each replay over new lengths and new queries copied into the static tensors
    gives the eager call's bits, and the cache the eager call's writes."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    dev, dt = "cuda", torch.bfloat16
    b, page, hq, hk, d, sq, per_seq = 4, 64, 8, 2, 128, 1, 8
    g = torch.Generator(device=dev).manual_seed(5)

    def randn(*shape):
        return torch.randn(*shape, device=dev, generator=g).to(dt)
    if paged:
        kc, vc = randn(b * per_seq + 3, page, hk, d), randn(b * per_seq + 3, page, hk, d)
        table = torch.randperm(b * per_seq + 3, device=dev)[:b * per_seq].reshape(
            b, per_seq).to(torch.int32)
        extra = dict(block_table=table)
    else:
        kc, vc = randn(b, page * per_seq, hk, d), randn(b, page * per_seq, hk, d)
        extra = dict(cache_batch_idx=torch.tensor([2, 0, 3, 1], dtype=torch.int32,
                                                  device=dev))
    ang = torch.rand(page * per_seq, 32, device=dev) * 6.3
    cos, sin = ang.cos().to(dt), ang.sin().to(dt)
    q, k_new, v_new = randn(b, sq, hq, d), randn(b, sq, hk, d), randn(b, sq, hk, d)
    lengths = torch.tensor([100, 7, 300, 0], dtype=torch.int32, device=dev)
    pad = torch.tensor([3, 0, 50, 0], dtype=torch.int32, device=dev)
    slopes = torch.rand(hq, device=dev)

    def step(kc, vc):
        return fa.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, rotary_cos=cos,
                                          rotary_sin=sin, cache_seqlens=lengths,
                                          cache_leftpad=pad, causal=True,
                                          alibi_slopes=slopes, return_softmax_lse=True,
                                          **extra)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step(kc, vc)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step(kc, vc)
    for new_lengths, new_pad in (([250, 1, 0, 511], [0, 0, 0, 100]),
                                 ([64, 65, 63, 128], [64, 1, 0, 0])):
        lengths.copy_(torch.tensor(new_lengths, dtype=torch.int32))
        pad.copy_(torch.tensor(new_pad, dtype=torch.int32))
        q.copy_(randn(b, sq, hq, d))
        k_new.copy_(randn(b, sq, hk, d))
        kc_eager, vc_eager = kc.clone(), vc.clone()
        graph.replay()
        want, want_lse = step(kc_eager, vc_eager)
        torch.cuda.synchronize()
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
        assert torch.equal(kc, kc_eager) and torch.equal(vc, vc_eager)
