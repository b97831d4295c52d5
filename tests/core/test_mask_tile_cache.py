"""Tile maps are reused across calls (masks.TILE_CACHE), never stale.

Every call resolves its mask anew; the document and immutable keep parts of a tile
map come from a content-keyed LRU.  Counted builds show the reuse; mutated ids,
writable keep arrays and a recycled id() show that nothing stale is served.
"""
import gc
import threading
import weakref

import numpy as np
import pytest

import anyattn as aa
from anyattn.masks import TILE_CACHE, TileMapCache, resolve


@pytest.fixture(autouse=True)
def _fresh_cache():
    TILE_CACHE.clear()
    yield
    TILE_CACHE.clear()


def _dense_codes(mask, B, H, S, bq, bk):
    """Tile codes from the dense keep pattern (the oracle)."""
    keep = resolve(mask, B, H, S, S).dense_keep(B, H)
    nq, nk = -(-S // bq), -(-S // bk)
    out = np.zeros(keep.shape[:2] + (nq, nk), np.int8)
    for i in range(nq):
        for j in range(nk):
            t = keep[..., i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
            out[..., i, j] = np.where(t.all(axis=(-1, -2)), 2, np.where(t.any(axis=(-1, -2)), 1, 0))
    return out


def test_documents_map_built_once_across_calls():
    S = 200
    ids = np.repeat(np.arange(5), 40)
    mask = aa.Causal() & aa.Documents(ids)
    first = resolve(mask, 1, 2, S, S).tile_map(32, 48)
    assert TILE_CACHE.builds == 1
    for _ in range(3):                           # each call resolves anew
        again = resolve(mask, 1, 2, S, S).tile_map(32, 48)
        np.testing.assert_array_equal(again, first)
    assert TILE_CACHE.builds == 1 and TILE_CACHE.hits == 3
    # equal ids in another array (another Documents object) hit the same entry
    resolve(aa.Documents(ids.copy()), 1, 2, S, S).tile_map(32, 48)
    assert TILE_CACHE.builds == 1
    np.testing.assert_array_equal(first, _dense_codes(mask, 1, 2, S, 32, 48))


def test_mutated_ids_are_not_served_stale():
    S = 128
    ids = np.repeat(np.arange(4), 32)
    mask = aa.Documents(ids)
    before = resolve(mask, 1, 1, S, S).tile_map(32, 32)
    ids[:] = 0                                   # the user edits the array in place
    after = resolve(mask, 1, 1, S, S).tile_map(32, 32)
    assert TILE_CACHE.builds == 2
    assert (before != after).any()
    np.testing.assert_array_equal(after, _dense_codes(mask, 1, 1, S, 32, 32))


def test_read_only_keep_mask_cached_writable_not():
    rng = np.random.default_rng(0)
    S = 96
    km = rng.random((S, S)) < 0.3
    km[:, :32] = False
    codes = resolve(aa.KeepMask(km), 1, 1, S, S).tile_map(32, 32)
    resolve(aa.KeepMask(km), 1, 1, S, S).tile_map(32, 32)
    assert TILE_CACHE.builds == 0                # writable: reduced on every call
    km[:, :32] = True                            # ... so an edit shows at once
    edited = resolve(aa.KeepMask(km), 1, 1, S, S).tile_map(32, 32)
    assert (edited != codes).any()
    np.testing.assert_array_equal(edited, _dense_codes(aa.KeepMask(km), 1, 1, S, 32, 32))

    frozen = km.copy()
    frozen.setflags(write=False)
    m = aa.KeepMask(frozen)
    a = resolve(m, 1, 1, S, S).tile_map(32, 32)
    b = resolve(m, 1, 1, S, S).tile_map(32, 32)
    assert TILE_CACHE.builds == 1 and TILE_CACHE.hits == 1
    np.testing.assert_array_equal(a, b)
    # a read-only view of writable memory can still change: not cached
    view = km.view()
    view.setflags(write=False)
    resolve(aa.KeepMask(view), 1, 1, S, S).tile_map(32, 32)
    assert TILE_CACHE.builds == 1


def test_recycled_id_does_not_hit():
    """A dead array's id() may be reused by a new array: the weak reference says no."""
    S = 64
    cache = TileMapCache(maxsize=4)
    ids = []
    for trial in range(8):
        arr = np.zeros((S, S), bool) if trial % 2 else np.ones((S, S), bool)
        arr.setflags(write=False)
        token = (id(arr), weakref.ref(arr))
        ids.append(token[0])
        got = cache.get(("keep", token[0]), lambda a=arr: bool(a[0, 0]), token[1])
        assert got == bool(arr[0, 0])
        del arr, token
        gc.collect()
    assert len(set(ids)) < len(ids), "no id was reused: the case this test is about"
    assert cache.builds == 8                     # every array new: never a hit


def test_cache_is_bounded_and_thread_safe():
    cache = TileMapCache(maxsize=8)

    def work(t):
        for i in range(200):
            assert cache.get(("k", (i + t) % 16), lambda i=i, t=t: (i + t) % 16) == (i + t) % 16

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(cache) <= 8


def test_numpy_backend_reuses_map_and_stays_correct():
    """Through the public API: the second call builds nothing, results equal."""
    rng = np.random.default_rng(1)
    B, H, S, D = 1, 2, 160, 16
    q, k, v, g = (rng.standard_normal((B, H, S, D)).astype(np.float32) for _ in range(4))
    ids = np.repeat(np.arange(4), 40)
    mask = aa.Causal() & aa.Documents(ids)
    o1 = aa.attention(q, k, v, mask=mask, backend="numpy")
    n = TILE_CACHE.builds
    assert n >= 1
    o2 = aa.attention(q, k, v, mask=mask, backend="numpy")
    assert TILE_CACHE.builds == n
    np.testing.assert_array_equal(o1, o2)
    ref = aa.attention(q, k, v, mask=mask, backend="reference")
    np.testing.assert_allclose(o2, ref, atol=2e-5, rtol=1e-5)
    ids[:80] = 7                                  # mutate: a fresh map, a new answer
    o3 = aa.attention(q, k, v, mask=mask, backend="numpy")
    np.testing.assert_allclose(o3, aa.attention(q, k, v, mask=mask, backend="reference"),
                               atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_document_tiles_match_the_dense_pattern(seed):
    """The incidence-matrix builder equals the dense any/all per tile: unsorted and
    negative ids, ids only one side has, a broadcast batch side, ragged last tiles."""
    rng = np.random.default_rng(seed)
    B, S = 2, int(rng.integers(40, 200))
    nd = int(rng.integers(1, 12))
    q_ids = rng.integers(-2, nd, (B, S))
    k_ids = np.sort(rng.integers(0, nd + 2, (1, S)), axis=1) if seed % 2 else \
        rng.integers(-2, nd, (B, S))
    mask = aa.Documents(q_ids, k_ids)
    bq, bk = int(rng.integers(3, 50)), int(rng.integers(3, 50))
    got = resolve(mask, B, 1, S, S).tile_map(bq, bk)
    np.testing.assert_array_equal(got, _dense_codes(mask, B, 1, S, bq, bk))
