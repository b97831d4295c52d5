"""How a Documents / KeepMask mask's arrays reach the kernels (backends/triton/
mask_inputs.py): copies to the device that do not synchronise, kept per mask tensor, and
the ids' sortedness read where the ids live, once per id tensors.

A torch tensor's ``__bool__`` / ``item`` / ``tolist`` (and int / float / index) is a
host-device synchronisation on a GPU: the CPU tests count them while a new mask's tables
are built; the GPU tests run torch's sync debug mode around a routed training step.

Shape legend: B batch, H heads, S positions, D head dim; ids [S] or [B, S].
"""
from __future__ import annotations

import contextlib
import gc
import warnings
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import anyattn as aa  # noqa: E402
from anyattn.backends.triton import launch as L  # noqa: E402
from anyattn.backends.triton import mask_inputs as MI  # noqa: E402
from anyattn.problem import describe  # noqa: E402

from tr_util import needs_sm90, sorted_ids  # noqa: E402

_READS = ("__bool__", "item", "tolist", "__int__", "__float__", "__index__")


@contextlib.contextmanager
def device_reads():
    """Counts the torch tensor -> Python reads made inside the block (a list of names)."""
    seen, real = [], {n: getattr(torch.Tensor, n) for n in _READS}

    def counting(name):
        def read(self, *a, **kw):
            seen.append(name)
            return real[name](self, *a, **kw)
        return read

    for n in _READS:
        setattr(torch.Tensor, n, counting(n))
    try:
        yield seen
    finally:
        for n, f in real.items():
            setattr(torch.Tensor, n, f)


@pytest.fixture
def device_resident(monkeypatch):
    """Ids read as if they lived on a GPU (mask_inputs' device branch, on CPU tensors)."""
    monkeypatch.setattr(MI, "on_host", lambda ids: False)


@pytest.fixture(autouse=True)
def fresh_caches():
    L.clear_caches()
    yield
    L.clear_caches()


def _id_cases():
    g = torch.Generator().manual_seed(3)
    s = sorted_ids(g, 300, 5)
    uns = s.clone()
    uns[[10, 200]] = uns[[200, 10]]
    two = torch.stack([s, uns])                      # one row sorted, one not
    return {
        "sorted_1d": (s, s),
        "sorted_q_unsorted_k": (s, uns),
        "unsorted_q_sorted_k": (uns, s),
        "rows_mixed": (two, two),
        "equal": (torch.zeros(64, dtype=torch.int32), torch.zeros(64, dtype=torch.int32)),
        "length_one": (torch.tensor([4], dtype=torch.int32), torch.tensor([4])),
        "numpy_rows": (two.numpy(), s.numpy()[None]),
        "descending": (torch.arange(9, 0, -1), torch.arange(9)),
    }


def _rows_sorted(x) -> bool:
    a = np.asarray(x).astype(object)
    a = a.reshape(-1, a.shape[-1])
    return bool(np.all(a[:, 1:] >= a[:, :-1]))


CPU = torch.device("cpu")


@pytest.mark.parametrize("name", list(_id_cases()))
@pytest.mark.parametrize("where", ["host", "device"])
def test_kernel_ids_order_facts_are_the_rows_order(name, where, monkeypatch):
    if where == "device":
        monkeypatch.setattr(MI, "on_host", lambda ids: False)
    q, k = _id_cases()[name]
    ids = MI.kernel_ids(q, k, CPU)
    assert (ids.q_sorted, ids.k_sorted) == (_rows_sorted(q), _rows_sorted(k))
    assert ids.q.dtype == ids.k.dtype == torch.int32


def _wide_cases():
    """Ids a plain int32 cast would merge or reorder: name -> (q_ids, k_ids)."""
    big = np.array([0, 0, 2 ** 32, 2 ** 32, 5, 2 ** 32 + 5], dtype=np.int64)
    return {
        "int64_2^32": (big, big),
        "int64_negative": (-big, np.sort(-big)),
        "int64_sorted": (np.sort(big), np.sort(big)),
        "uint32_2^31": (np.array([1, 2 ** 31, 2 ** 31 + 1], dtype=np.uint32),
                        np.array([2 ** 31 + 1, 1, 7], dtype=np.uint32)),
        "uint64_2^63": (np.array([3, 2 ** 63 + 3, 2 ** 64 - 1], dtype=np.uint64),
                        np.array([2 ** 64 - 1, 3, 3], dtype=np.uint64)),
        "int64_vs_uint64": (np.array([-1, 2 ** 40, 9], dtype=np.int64),
                            np.array([2 ** 64 - 1, 2 ** 40, 9], dtype=np.uint64)),
        "narrow_int8": (np.array([-128, 127, 0], dtype=np.int8),
                        np.array([127, 0, 0], dtype=np.int8)),
    }


@pytest.mark.parametrize("name", list(_wide_cases()))
@pytest.mark.parametrize("where", ["host", "device"])
def test_kernel_ids_are_equal_exactly_where_the_given_ids_are(name, where, monkeypatch):
    """int32 ids for the kernels: equal where the given ids are equal (a plain cast of
    2**32 and 0 would merge two documents), in the same order (sorted rows stay sorted).
    The device branch runs on torch tensors of the ids (int64 and int8 ones; unsigned
    wide ids go through the host branch there too)."""
    q, k = _wide_cases()[name]
    if where == "device":
        monkeypatch.setattr(MI, "on_host", lambda ids: False)
        q, k = (torch.from_numpy(x) if x.dtype in (np.int64, np.int8) else x for x in (q, k))
    ids = MI.kernel_ids(q[None], k[None], CPU)
    qo, ko = (np.asarray(x).astype(object).reshape(-1) for x in (q, k))
    want = qo[:, None] == ko[None, :]
    got = (ids.q.reshape(-1)[:, None] == ids.k.reshape(-1)[None, :]).numpy()
    assert ids.q.dtype == torch.int32 and np.array_equal(got, want)
    assert (ids.q_sorted, ids.k_sorted) == (_rows_sorted(q), _rows_sorted(k))
    qa = ids.q.reshape(-1).numpy()
    assert all((qo[i] < qo[j]) == (qa[i] < qa[j]) for i in range(len(qo))
               for j in range(len(qo)))          # the order kept too


def test_documents_beyond_int32_give_the_reference():
    """End to end through the triton backend: document ids 0 and 2**32 (one int32 value
    after a cast) stay two documents (this call was 0.79 off before session 14)."""
    S = 64
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(1, 2, S, 16, generator=g) for _ in range(3))
    ids = np.r_[np.zeros(S // 2), np.full(S // 2, 2 ** 32)].astype(np.int64)
    ref = aa.attention(q.numpy(), k.numpy(), v.numpy(), mask=aa.Documents(ids),
                       backend="reference")
    for mask_ids in (ids, torch.from_numpy(ids)):
        out = aa.attention(q, k, v, mask=aa.Documents(mask_ids), backend="triton")
        assert np.abs(out.numpy() - ref).max() < 1e-5


def test_host_ids_are_checked_without_device_reads():
    q, k = _id_cases()["rows_mixed"]
    with device_reads() as seen:
        ids = MI.kernel_ids(q, k, CPU)
    assert (ids.q_sorted, ids.k_sorted) == (False, False)
    assert seen == []


def test_device_ids_are_read_once_per_id_tensors(device_resident):
    q, k = _id_cases()["sorted_q_unsorted_k"]

    def facts():
        ids = MI.kernel_ids(q[None], k[None], CPU)    # as masks.resolve gives them: [1, S]
        return ids.q_sorted, ids.k_sorted

    with device_reads() as seen:
        assert facts() == (True, False)
    assert seen == ["tolist"]                        # both arrays in one read
    with device_reads() as seen:                     # a new resolve's views: same contents
        assert facts() == (True, False)
    assert seen == []
    k[10], k[200] = int(k[200]), int(k[10])          # in place: a new version, read again
    with device_reads() as seen:
        assert facts() == (True, True)
    assert seen == ["tolist"]
    wide = q.to(torch.int64)                         # int64: range and order, one read
    with device_reads() as seen:
        MI.kernel_ids(wide[None], wide[None], CPU)
    assert seen == ["tolist"]


def _docs_problem(ids, B=1, H=2, D=8):
    S = ids.shape[-1]
    q = torch.zeros(B, H, S, D, dtype=torch.float64)
    return describe(q, q, q, mask=aa.Causal() & aa.Documents(ids)), q


def _build_all(p, q):
    """What a step builds for a new Documents mask: the portable tile lists at two block
    sizes (forward and backward tiles), the Hopper backward's tables (its route for
    array masks: ANYATTN_TRITON_PATH=hopper) and the Hopper forward's mask arrays."""
    from anyattn.backends.triton.hopper import configs as HCF, launch as HL

    ma = L.tiles.mask_args(p, q, None)
    for sb in ((32, 32), (64, 32)):
        L.tile_lists(p, ma, *sb, q.device)
    HL.bwd_mask_tables(p, q, 64, 128)
    return HL.mask_arrays(p, q, HCF.fwd_config(128, p.mask_class))


def test_new_host_documents_mask_builds_without_device_reads():
    """Before session 14 each new mask's build read the device five times on the routed
    step (the ids' sortedness per block size and once more for the Hopper forward's
    intervals), once more through the Hopper backward (its unvisited-tile flag)."""
    g = torch.Generator().manual_seed(5)
    for step in range(3):                            # fresh ids each step, as a loop has
        p, q = _docs_problem(sorted_ids(g, 400, 3 + step))
        with device_reads() as seen:
            marr = _build_all(p, q)
        assert seen == [], seen
        assert marr[-1] == 2                         # sorted: the interval walk


def test_new_device_documents_mask_builds_with_one_device_read(device_resident):
    g = torch.Generator().manual_seed(6)
    ids = sorted_ids(g, 400, 4)
    uns = ids.flip(0).contiguous()
    for case, docs_mode in ((ids, 2), (uns, 1)):
        p, q = _docs_problem(case)
        with device_reads() as seen:
            marr = _build_all(p, q)
        assert seen == ["tolist"], seen
        assert marr[-1] == docs_mode


@pytest.mark.parametrize("sorted_case", [True, False])
def test_doc_blocks_interval_path_equals_pairwise_comparison(sorted_case):
    """The sorted ids' interval test gives the pairwise comparison's any / all blocks
    exactly (partial edge blocks included); unsorted ids always take the comparison."""
    g = torch.Generator().manual_seed(8)
    q = torch.stack([sorted_ids(g, 333, 7), sorted_ids(g, 333, 2)])
    k = torch.stack([sorted_ids(g, 301, 5), sorted_ids(g, 301, 9)])
    if not sorted_case:
        q = q[:, torch.randperm(333, generator=g)]
    qi, ki = q.to(torch.int32), k.to(torch.int32)
    for sb in ((32, 32), (64, 16)):
        pair = L.tiles.doc_blocks(qi, ki, *sb, sorted_ids=False)
        if sorted_case:
            fast = L.tiles.doc_blocks(qi, ki, *sb, sorted_ids=True)
            assert all(torch.equal(a, b) for a, b in zip(pair, fast))
        eq = (qi[:, :, None] == ki[:, None, :]).numpy()
        nq, nk = -(-333 // sb[0]), -(-301 // sb[1])
        for b in range(2):
            for i in range(nq):
                for j in range(nk):
                    blk = eq[b, i * sb[0]:(i + 1) * sb[0], j * sb[1]:(j + 1) * sb[1]]
                    assert bool(pair[0][b, 0, i, j]) == bool(blk.any())
                    assert bool(pair[1][b, 0, i, j]) == bool(blk.all())


def test_kept_copy_per_mask_tensor_version():
    ids = torch.arange(50, dtype=torch.int64) // 10
    dev = torch.device("cpu")
    a = MI.to_device(ids, dev, torch.int32, keep=True)
    assert a.dtype == torch.int32 and torch.equal(a, (ids // 1).to(torch.int32))
    assert MI.to_device(ids, dev, torch.int32, keep=True) is a
    assert MI.to_device(ids, dev, torch.int32) is not a        # per call unless kept
    ids[0] = 7                                                 # a new version: copied anew
    b = MI.to_device(ids, dev, torch.int32, keep=True)
    assert b is not a and int(b[0]) == 7 and int(a[0]) == 0
    assert MI.to_device(b, dev, torch.int32, keep=True) is b   # already there: itself
    np_ids = np.arange(5)
    assert MI.to_device(np_ids, dev, torch.int32, keep=True).tolist() == [0, 1, 2, 3, 4]


def test_kept_copies_hold_their_source_and_are_bounded():
    """An entry holds its source tensor (an identity key cannot be taken over by a new
    tensor at the same address while the entry lives); the cache keeps CACHE_SIZE."""
    dev = torch.device("cpu")
    src = torch.arange(10, dtype=torch.int64)
    ref = weakref.ref(src)
    MI.to_device(src, dev, torch.int32, keep=True)
    del src
    gc.collect()
    assert ref() is not None
    for i in range(MI.CACHE_SIZE):
        MI.to_device(torch.full((3,), i), dev, torch.int32, keep=True)
    gc.collect()
    assert ref() is None
    assert len(MI._copies) == MI.CACHE_SIZE


def test_kept_copies_stay_within_their_byte_budget(monkeypatch):
    """A copy larger than KEPT_BYTES (a big host KeepMask) is made per call, not held;
    older copies make room for a new one."""
    dev = torch.device("cpu")
    monkeypatch.setattr(MI, "KEPT_BYTES", 1000)
    big = torch.zeros(300, dtype=torch.int64)                 # 1200 bytes as int32
    a = MI.to_device(big, dev, torch.int32, keep=True)
    assert MI.to_device(big, dev, torch.int32, keep=True) is not a
    assert not MI._copies
    small = [torch.full((100,), i) for i in range(3)]          # 400 bytes each as int32
    kept = [MI.to_device(x, dev, torch.int32, keep=True) for x in small]
    assert len(MI._copies) == 2                               # 800 bytes; the first made room
    assert MI.to_device(small[2], dev, torch.int32, keep=True) is kept[2]
    assert MI.to_device(small[0], dev, torch.int32, keep=True) is not kept[0]


# ----------------------------------------------------------------------------- GPU
def _gpu_step(ids, q, k, v, g):
    out = aa.torch.attention(q, k, v, mask=aa.Causal() & aa.Documents(ids), backend="triton")
    return torch.autograd.grad(out, (q, k, v), g)


def _syncs(fn) -> list:
    """The synchronising CUDA calls torch reports while fn runs (sync debug mode 'warn')."""
    prev = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as got:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode(prev)
    # torch's own notice that the debug mode is a prototype is not a synchronising call
    return [str(w.message) for w in got if "synchronizing CUDA operation" in str(w.message)]


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("path", ["auto", "hopper"])
@pytest.mark.parametrize("ids_on", ["cpu", "cuda"])
def test_gpu_step_with_a_fresh_documents_mask_synchronises_at_most_once(ids_on, path,
                                                                        monkeypatch):
    """A training step (D=128 bf16: the routed forward and backward, or with
    ANYATTN_TRITON_PATH=hopper the Hopper backward and its tables) with new document
    ids: none of its work waits for the GPU when the ids come from the host (a data
    loader's), and it waits once (the ids' sortedness) when they are on the GPU."""
    import anyattn.torch  # noqa: F401

    monkeypatch.setenv("ANYATTN_TRITON_PATH", path)
    L.clear_prepared()
    g = torch.Generator().manual_seed(9)
    B, H, S, D = 2, 4, 1536, 128
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
               .requires_grad_() for _ in range(3))
    dout = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
    for step in range(2):                            # compile, resolve the launch sites
        _gpu_step(sorted_ids(g, S, 3 + step).to(ids_on), q, k, v, dout)
    torch.cuda.synchronize()
    for step in range(2):
        ids = sorted_ids(g, S, 5 + step).to(ids_on)
        syncs = _syncs(lambda: _gpu_step(ids, q, k, v, dout))
        assert len(syncs) == (0 if ids_on == "cpu" else 1), syncs
    L.clear_prepared()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("pinned", [False, True])
def test_gpu_host_copy_is_the_contents_at_the_call(pinned):
    """The copy is queued behind the GPU's work (a sleep kernel) without waiting for it,
    and the caller refills its buffer at once: the GPU copy holds the contents at the
    call (the staging buffer is private), converted to the asked dtype."""
    n = 1 << 20
    src = torch.arange(n, dtype=torch.int64)
    src = src.pin_memory() if pinned else src
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e8))                      # ~0.1 s of queued GPU work
    out = MI.to_device(src, torch.device("cuda"), torch.int32)
    src.fill_(-1)
    torch.cuda.synchronize()
    assert out.dtype == torch.int32 and torch.equal(out.cpu(), torch.arange(n, dtype=torch.int32))
