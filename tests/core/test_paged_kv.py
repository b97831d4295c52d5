"""Paged key/value caches (anyattn.Pages, attention(..., pages=)) against the float64
dense reference over each sequence's keys, gathered here position by position."""
import numpy as np
import pytest

import anyattn as aa
from anyattn import features
from anyattn.backends import numpy_paged
from anyattn.backends.registry import get_backend, unavailable_reason

from helpers import assert_close, rel_err

MASKS = {
    "none": lambda: None,
    "causal_br": lambda: aa.Causal(align="bottom_right"),
    "window_br": lambda: aa.Causal(align="bottom_right") & aa.Window(left=7, align="bottom_right"),
    "causal_offset": lambda: aa.Causal(),        # placed by q_offset below
}


def make_cache(rng, lengths, P, Hkv=2, D=8, Dv=8, dtype=np.float32, spare=3, starts=None):
    """Shuffled pages, sequence 2 sharing sequence 0's first page (a common prefix),
    table entries past the pages in use set to -1, and every position no sequence
    uses (spare pages, tails of last pages) set to NaN: a kernel that reads them
    returns NaN.  ``starts``: sequence b's keys are positions [starts[b], lengths[b]);
    the positions before them hold NaN and table entries of pages wholly before them
    are -1."""
    starts = [0] * len(lengths) if starts is None else list(starts)
    B = len(lengths)
    need = [-(-L // P) for L in lengths]
    N = sum(need) + spare
    perm = rng.permutation(N)
    table = np.full((B, max(need) + 1), -1, np.int32)
    used = np.zeros((N, P), bool)
    at = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[at:at + n]
        at += n
    if B > 2 and need[0] and need[2]:
        shared = table[0, 0]
        if lengths[2] >= P or lengths[0] >= P:      # the shared page's rows: both in use
            table[2, 0] = shared
    for b, L in enumerate(lengths):
        for t in range(starts[b], L):
            used[table[b, t // P], t % P] = True
        table[b, :starts[b] // P] = -1
    k = rng.standard_normal((N, Hkv, P, D)).astype(dtype)
    v = rng.standard_normal((N, Hkv, P, Dv)).astype(dtype)
    k[~used.reshape(N, 1, P).repeat(Hkv, 1)] = np.nan
    v[~used.reshape(N, 1, P).repeat(Hkv, 1)] = np.nan
    return k, v, table, np.asarray(lengths, np.int32)


def dense_keys(pages, table, b, L, start=0):
    """Sequence b's keys [1, Hkv, L - start, Dx] (positions [start, L)), one position at
    a time."""
    P = pages.shape[2]
    rows = [pages[table[b, t // P], :, t % P] for t in range(start, L)]
    out = np.stack(rows, axis=1) if rows else np.zeros(pages.shape[1:2] + (0,) + pages.shape[3:])
    return out[None].astype(np.float64)


def oracle(q, k, v, table, lengths, alibi_slopes=None, starts=None, **kw):
    """Per sequence: the float64 dense reference over its gathered keys."""
    outs, lses = [], []
    starts = [0] * len(lengths) if starts is None else starts
    for b, L in enumerate(lengths):
        sl = alibi_slopes
        if sl is not None and sl.ndim == 2:
            sl = sl[b:b + 1]
        o, s = aa.attention(q[b:b + 1].astype(np.float64),
                            dense_keys(k, table, b, L, starts[b]),
                            dense_keys(v, table, b, L, starts[b]), backend="reference",
                            return_lse=True, alibi_slopes=sl, **kw)
        outs.append(o)
        lses.append(s)
    return np.concatenate(outs), np.concatenate(lses)


def check(got, want, dtype):
    (o, s), (ro, rs) = got, want
    assert_close(o, ro, dtype, "out")
    fin = np.isfinite(rs)
    assert np.array_equal(np.isfinite(np.asarray(s)), fin)
    assert np.array_equal(np.asarray(s)[~fin], rs[~fin])
    assert rel_err(np.asarray(s)[fin], rs[fin]) <= 10 * {"float32": 1e-6, "float64": 1e-13}.get(
        dtype, 1e-2)


@pytest.fixture(params=[512, 20], ids=["tiles512", "tiles20"])
def tile_keys(request, monkeypatch):
    monkeypatch.setattr(numpy_paged, "TILE_KEYS", request.param)
    return request.param


@pytest.mark.parametrize("backend, tiles", [("numpy", 512), ("numpy", 20),
                                            ("reference", None), ("webgpu", None)])
@pytest.mark.parametrize("P", [16, 5])
@pytest.mark.parametrize("sq", [1, 4])
@pytest.mark.parametrize("mask", sorted(MASKS))
def test_paged_matches_the_dense_reference(backend, tiles, P, sq, mask, monkeypatch):
    if backend == "webgpu":
        pytest.importorskip("wgpu")
        why = unavailable_reason("webgpu")
        if why:
            pytest.skip(f"webgpu unavailable: {why}")
    if tiles is not None:
        monkeypatch.setattr(numpy_paged, "TILE_KEYS", tiles)
    rng = np.random.default_rng([P, sq, len(mask)])
    lengths = [37, 0, 16, 80, 3]
    k, v, table, sl = make_cache(rng, lengths, P)
    q = rng.standard_normal((5, 4, sq, 8)).astype(np.float32)       # GQA: 4 heads over 2
    kw = dict(mask=MASKS[mask]())
    if mask == "causal_offset":
        kw.update(q_offset=9, k_offset=2)
    got = aa.attention(q, k, v, pages=aa.Pages(table, sl), backend=backend,
                       return_lse=True, **kw)
    check(got, oracle(q, k, v, table, lengths, **kw), "float32")


#: lengths and starts of the starts tests: a start on a page boundary (P = 5), within
#: a page, a sequence emptied by its start, one of no positions, one starting at 1
LEFT_LENGTHS = [37, 0, 16, 80, 3]
LEFT_STARTS = [5, 0, 16, 33, 1]


def _webgpu_or_skip():
    pytest.importorskip("wgpu")
    why = unavailable_reason("webgpu")
    if why:
        pytest.skip(f"webgpu unavailable: {why}")


@pytest.mark.parametrize("backend, tiles", [("numpy", 512), ("numpy", 20),
                                            ("reference", None), ("webgpu", None)])
@pytest.mark.parametrize("P", [16, 5])
@pytest.mark.parametrize("sq", [1, 4])
@pytest.mark.parametrize("mask", sorted(MASKS))
def test_paged_starts_match_the_dense_reference(backend, tiles, P, sq, mask, monkeypatch):
    """Pages(starts=): sequence b is the dense problem over its positions [starts[b],
    seqlens[b]) (FlashAttention's cache_leftpad), the positions before them NaN and
    their pages' table entries -1 (never read)."""
    if backend == "webgpu":
        _webgpu_or_skip()
    if tiles is not None:
        monkeypatch.setattr(numpy_paged, "TILE_KEYS", tiles)
    rng = np.random.default_rng([P, sq, len(mask), 1])
    k, v, table, sl = make_cache(rng, LEFT_LENGTHS, P, starts=LEFT_STARTS)
    q = rng.standard_normal((5, 4, sq, 8)).astype(np.float32)       # GQA: 4 heads over 2
    kw = dict(mask=MASKS[mask]())
    if mask == "causal_offset":
        kw.update(q_offset=9, k_offset=2)
    st = np.asarray(LEFT_STARTS, np.int32)
    got = aa.attention(q, k, v, pages=aa.Pages(table, sl, st), backend=backend,
                       return_lse=True, **kw)
    check(got, oracle(q, k, v, table, LEFT_LENGTHS, starts=LEFT_STARTS, **kw), "float32")


@pytest.mark.parametrize("backend", ["numpy", "reference"])
def test_paged_starts_modifiers_float64(backend, tile_keys):
    """Starts with softcap, per-batch ALiBi (distances of the key indices from the
    start), sinks, a window, Dv != D and MQA, float64."""
    rng = np.random.default_rng(11)
    lengths, starts = [21, 50, 9, 0], [4, 13, 9, 0]
    k, v, table, sl = make_cache(rng, lengths, 5, Hkv=1, D=6, Dv=3, dtype=np.float64,
                                 starts=starts)
    q = rng.standard_normal((4, 3, 2, 6))
    kw = dict(mask=aa.Causal(align="bottom_right") & aa.Window(left=20, align="bottom_right"),
              softcap=1.5, alibi_slopes=rng.uniform(0.1, 1.0, (4, 3)),
              sinks=rng.standard_normal(3))
    got = aa.attention(q, k, v, pages=aa.Pages(table, sl, np.asarray(starts)),
                       backend=backend, return_lse=True, **kw)
    check(got, oracle(q, k, v, table, lengths, starts=starts, **kw), "float64")


@pytest.mark.parametrize("P", [40, 23])
def test_numpy_pages_longer_than_a_tile(P, monkeypatch):
    """Pages longer than TILE_KEYS (a contiguous cache row taken as one page) are read in
    parts of TILE_KEYS keys within a page; with starts, a window and ALiBi."""
    monkeypatch.setattr(numpy_paged, "TILE_KEYS", 16)
    rng = np.random.default_rng(P)
    lengths, starts = [100, 37, 0, 60], [33, 0, 0, 59]
    k, v, table, sl = make_cache(rng, lengths, P, starts=starts)
    q = rng.standard_normal((4, 4, 3, 8)).astype(np.float32)
    kw = dict(mask=aa.Causal(align="bottom_right") & aa.Window(left=30, align="bottom_right"),
              alibi_slopes=rng.uniform(0.1, 0.5, 4).astype(np.float32))
    got = aa.attention(q, k, v, pages=aa.Pages(table, sl, np.asarray(starts)),
                       backend="numpy", return_lse=True, **kw)
    check(got, oracle(q, k, v, table, lengths, starts=starts, **kw), "float32")
    # whole pages as tiles would be at most 5 per kv head (2 + 2 + 1 pages in use)
    assert get_backend("numpy").last_counts["forward"].computed > 2 * 5


def test_zero_starts_are_no_starts():
    rng = np.random.default_rng(12)
    k, v, table, sl = make_cache(rng, [30, 7], 16)
    q = rng.standard_normal((2, 4, 3, 8)).astype(np.float32)
    mask = aa.Causal(align="bottom_right")
    want = aa.attention(q, k, v, pages=aa.Pages(table, sl), mask=mask, return_lse=True)
    got = aa.attention(q, k, v, pages=aa.Pages(table, sl, np.zeros(2, np.int64)), mask=mask,
                       return_lse=True)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


@pytest.mark.parametrize("mods", ["softcap", "alibi", "sinks", "all"])
def test_paged_modifiers_value_dim_float64(mods, tile_keys):
    rng = np.random.default_rng(len(mods))
    lengths = [21, 50, 9, 0]
    k, v, table, sl = make_cache(rng, lengths, 5, Hkv=1, D=6, Dv=3, dtype=np.float64)
    q = rng.standard_normal((4, 3, 2, 6))                            # MQA, Sq = 2
    kw = dict(mask=aa.Causal(align="bottom_right"))
    if mods in ("softcap", "all"):
        kw["softcap"] = 1.5
    if mods in ("alibi", "all"):
        kw["alibi_slopes"] = rng.uniform(0.1, 1.0, (4, 3))
    if mods in ("sinks", "all"):
        kw["sinks"] = rng.standard_normal(3)
    got = aa.attention(q, k, v, pages=aa.Pages(table, sl), backend="numpy",
                       return_lse=True, **kw)
    check(got, oracle(q, k, v, table, lengths, **kw), "float64")


def test_paged_bshd_layout_is_flash_attentions_pages():
    rng = np.random.default_rng(3)
    lengths = [40, 17]
    k, v, table, sl = make_cache(rng, lengths, 16)
    q = rng.standard_normal((2, 4, 1, 8)).astype(np.float32)
    want = aa.attention(q, k, v, pages=aa.Pages(table, sl), return_lse=True)
    got = aa.attention(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3).copy(),
                       v.transpose(0, 2, 1, 3).copy(), pages=aa.Pages(table, sl),
                       layout="bshd", return_lse=True)
    assert np.array_equal(got[0].transpose(0, 2, 1, 3), want[0])
    assert np.array_equal(got[1], want[1])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_paged_torch_cpu_tensors(dtype):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(4)
    lengths = [33, 5, 18]
    k, v, table, sl = make_cache(rng, lengths, 16)
    q = rng.standard_normal((3, 4, 4, 8)).astype(np.float32)
    tdt = getattr(torch, dtype)
    tq, tk, tv = (torch.from_numpy(x).to(tdt) for x in (q, k, v))
    out, lse = aa.attention(tq, tk, tv, pages=aa.Pages(torch.from_numpy(table),
                                                       torch.from_numpy(sl)),
                            mask=aa.Causal(align="bottom_right"), return_lse=True)
    assert out.dtype == tdt and lse.dtype == torch.float32
    back = [x.to(torch.float64).numpy() for x in (tq, tk, tv)]
    ro, rs = oracle(*back, table, lengths, mask=aa.Causal(align="bottom_right"))
    assert_close(out.to(torch.float64).numpy(), ro, dtype, "out")


def test_every_output_element_is_written(monkeypatch):
    monkeypatch.setattr(numpy_paged, "_alloc", lambda shape, dt: np.full(shape, np.nan, dt))
    rng = np.random.default_rng(5)
    lengths = [20, 0, 7]
    k, v, table, sl = make_cache(rng, lengths, 5)
    q = rng.standard_normal((3, 4, 4, 8)).astype(np.float32)
    mask = aa.Window(left=2, right=0, align="bottom_right")         # rows with no key too
    out, lse = aa.attention(q, k, v, pages=aa.Pages(table, sl), mask=mask, return_lse=True)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert np.all(out[1] == 0) and np.all(lse[1] == -np.inf)
    check((out, lse), oracle(q, k, v, table, lengths, mask=mask), "float32")


def test_a_window_reads_only_the_pages_it_reaches():
    rng = np.random.default_rng(6)
    lengths = [1000]
    k, v, table, sl = make_cache(rng, lengths, 16, D=4, Dv=4)
    # pages outside the window hold NaN: a read of any of them would show in the output
    keep = {int(x) for x in table[0, (1000 - 30) // 16:63]}
    clean_k, clean_v = k.copy(), v.copy()
    for j in set(range(k.shape[0])) - keep:
        k[j] = v[j] = np.nan              # masked scores hide a NaN key, not a NaN value
    q = rng.standard_normal((1, 2, 1, 4)).astype(np.float32)
    mask = aa.Causal(align="bottom_right") & aa.Window(left=20, align="bottom_right")
    out, lse = aa.attention(q, k, v, pages=aa.Pages(table, sl), mask=mask, return_lse=True,
                            backend="numpy")
    assert get_backend("numpy").last_counts["forward"].computed == 2     # (B, Hkv) x 1 tile
    check((out, lse), oracle(q, clean_k, clean_v, table, lengths, mask=mask), "float32")


def test_all_sequences_empty():
    k = np.zeros((2, 1, 4, 3), np.float32)
    q = np.ones((2, 2, 1, 3), np.float32)
    out, lse = aa.attention(q, k, k, pages=aa.Pages(np.zeros((2, 1), np.int32),
                                                    np.zeros(2, np.int32)), return_lse=True)
    assert np.all(out == 0) and np.all(lse == -np.inf) and out.shape == (2, 2, 1, 3)


# ------------------------------------------------------------------- bad input
def _call(table=((0, 1), (2, -1)), lengths=(7, 4), pages_shape=(3, 2, 4, 8), v_shape=None,
          starts=None, **kw):
    k = np.zeros(pages_shape, np.float32)
    v = np.zeros(v_shape or pages_shape, np.float32)
    q = np.zeros((2, 2, 1, 8), np.float32)
    t = table if not isinstance(table, tuple) else np.array(table, np.int32)
    s = lengths if not isinstance(lengths, tuple) else np.array(lengths, np.int32)
    st = starts if not isinstance(starts, tuple) else np.array(starts, np.int32)
    return aa.attention(q, k, v, pages=aa.Pages(t, s, st), **kw)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(table=((0, 3), (2, -1))), ValueError,
     r"block_table\[0, 1\] = 3 is outside the cache's 3 pages \[0, 3\)"),
    (dict(table=((0, 1), (-2, 0))), ValueError, r"block_table\[1, 0\] = -2"),
    (dict(lengths=(9, 4)), ValueError, r"seqlens\[0\] = 9 exceeds the 2 pages x 4"),
    (dict(lengths=(3, -1)), ValueError, r"seqlens: entry 1 is -1"),
    (dict(lengths=(3,)), ValueError, r"seqlens: shape \(1,\) does not match"),
    (dict(table=np.zeros((2, 2), np.float32)), TypeError, "block_table: dtype float32"),
    (dict(table=np.zeros(2, np.int32)), ValueError, r"block_table: expected 2 dims"),
    (dict(table=[[0, 1], [2, 0]]), TypeError, "block_table: expected an integer NumPy array"),
    (dict(table=np.zeros((3, 2), np.int32), lengths=(1, 1, 1)), ValueError,
     "block_table has 3 rows but q has batch 2"),
    (dict(pages_shape=(3, 2, 0, 8), lengths=(0, 0)), ValueError,
     "page_size is 0"),
    (dict(v_shape=(3, 2, 5, 8)), ValueError, "v_pages: shape"),
    (dict(pages_shape=(3, 2, 4, 8, 1)), ValueError, "k_pages: expected 4 dims"),
    (dict(bias=np.zeros((1, 1, 1, 7), np.float32)), NotImplementedError, "bias:"),
    (dict(dropout_p=0.1, dropout_seed=1), NotImplementedError, "dropout_p:"),
    (dict(score_mod=lambda s, b, h, i, j: s), NotImplementedError, "score_mod:"),
    (dict(mask=aa.Documents(np.zeros(1, np.int64), np.zeros(7, np.int64))),
     NotImplementedError, r"mask: terms \['documents'\]"),
    (dict(starts=(8, 0)), ValueError, r"starts: entry 0 is 8, outside \[0, seqlens\[0\] = 7\]"),
    (dict(starts=(0, -1)), ValueError, r"starts: entry 1 is -1, outside \[0, seqlens\[1\] = 4\]"),
    (dict(starts=(1,)), ValueError, r"starts: shape \(1,\) does not match seqlens' \(2,\)"),
    (dict(starts=np.zeros((2, 1), np.int32)), ValueError, r"starts: expected 1 dim"),
    (dict(starts=np.zeros(2, np.float32)), TypeError, r"starts: dtype float32 is not an "
                                                      r"integer type"),
    (dict(starts=[0, 0]), TypeError, r"starts: expected an integer NumPy array"),
    # the pages before a sequence's start are not read, those after it are checked
    (dict(table=((0, 1), (-1, 7)), starts=(0, 4), lengths=(7, 8)), ValueError,
     r"block_table\[1, 1\] = 7 is outside .* positions 4..7"),
])
def test_bad_pages_raise_before_work(kw, exc, match):
    with pytest.raises(exc, match=match):
        _call(**kw)


# ------------------------------------------------------------------- the Triton backend
# (TRITON_INTERPRET=1 on CPU tensors: kernels.fwd_split_kernel with PAGE = page size; a
# reduced set of the cases above, for the interpreter's time)
def _triton():
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    why = unavailable_reason("triton")
    if why:
        pytest.skip(f"triton unavailable: {why}")
    return torch


def _triton_paged(torch, dtype, q, k, v, table, sl, layout="bhsd", starts=None, **kw):
    """The Triton paged forward on ``dtype`` tensors -> (out, lse) float64 NumPy, and the
    inputs as rounded to ``dtype`` (float64 NumPy, bhsd: the oracle's)."""
    tdt = getattr(torch, dtype)
    tq, tk, tv = (torch.from_numpy(x).to(tdt) for x in (q, k, v))
    if layout == "bshd":
        tq, tk, tv = (x.transpose(1, 2) for x in (tq, tk, tv))     # strided views
    tkw = {n: (torch.from_numpy(np.asarray(x, np.float32))
               if n in ("alibi_slopes", "sinks") else x) for n, x in kw.items()}
    st = None if starts is None else np.asarray(starts, np.int32)
    out, lse = aa.attention(tq, tk, tv, pages=aa.Pages(table, sl, st), backend="triton",
                            return_lse=True, layout=layout, **tkw)
    assert out.dtype == tdt and lse.dtype == torch.float32
    if layout == "bshd":
        out, tq, tk, tv = (x.transpose(1, 2) for x in (out, tq, tk, tv))
    back = [x.to(torch.float64).numpy() for x in (tq, tk, tv)]
    return (out.to(torch.float64).numpy(), lse.numpy().astype(np.float64)), back


@pytest.mark.parametrize("P, sq, mask", [(16, 1, "causal_br"), (16, 4, "window_br"),
                                         (5, 1, "none"), (5, 4, "causal_offset")])
def test_triton_paged_matches_the_dense_reference(P, sq, mask):
    """Shuffled and shared pages, partly filled last pages, an empty sequence, NaN in
    every unread position, GQA (4 heads over 2), fp32."""
    torch = _triton()
    rng = np.random.default_rng([P, sq, len(mask)])
    lengths = [37, 0, 16, 80, 3]
    k, v, table, sl = make_cache(rng, lengths, P)
    q = rng.standard_normal((5, 4, sq, 8)).astype(np.float32)
    kw = dict(mask=MASKS[mask]())
    if mask == "causal_offset":
        kw.update(q_offset=9, k_offset=2)
    got, _ = _triton_paged(torch, "float32", q, k, v, table, sl, **kw)
    check(got, oracle(q, k, v, table, lengths, **kw), "float32")


@pytest.mark.parametrize("dtype, layout", [("float16", "bhsd"), ("bfloat16", "bshd"),
                                           ("float32", "bhsd")])
def test_triton_paged_modifiers_value_dim(dtype, layout):
    """Softcap, per-batch ALiBi slopes, sinks, Dv != D, MQA, Sq = 2 (bshd: the strided
    transposes of FlashAttention's page layout), against float64 of the rounded inputs."""
    torch = _triton()
    rng = np.random.default_rng(len(dtype))
    lengths = [21, 50, 9, 0]
    k, v, table, sl = make_cache(rng, lengths, 16, Hkv=1, D=6, Dv=3)
    q = rng.standard_normal((4, 3, 2, 6)).astype(np.float32)
    kw = dict(mask=aa.Causal(align="bottom_right"), softcap=1.5,
              alibi_slopes=rng.uniform(0.1, 1.0, (4, 3)), sinks=rng.standard_normal(3))
    got, back = _triton_paged(torch, dtype, q, k, v, table, sl, layout=layout, **kw)
    check(got, oracle(*back, table, lengths, **kw), dtype)


@pytest.mark.parametrize("P", [16, 7])
def test_triton_paged_split_keys(P):
    """Few programs over long sequences: the keys of each sequence split across programs
    (route.paged_route; its own key count per sequence), a window and ALiBi per sequence."""
    torch = _triton()
    from anyattn.backends.triton import route
    from anyattn.paged import describe_paged

    rng = np.random.default_rng(P)
    lengths = [150, 0, 61]
    k, v, table, sl = make_cache(rng, lengths, P, Hkv=1)
    q = rng.standard_normal((3, 2, 3, 8)).astype(np.float32)
    kw = dict(mask=aa.Causal(align="bottom_right") & aa.Window(left=90, align="bottom_right"),
              alibi_slopes=rng.uniform(0.1, 0.5, 2))
    p = describe_paged(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
                       aa.Pages(table, sl), mask=kw["mask"],
                       alibi_slopes=torch.from_numpy(kw["alibi_slopes"]).float())
    rt = route.paged_route(route.ProblemFacts.of(p), route.device_facts(p.device))
    assert rt.splits > 1, rt.describe()
    got, _ = _triton_paged(torch, "float32", q, k, v, table, sl, **kw)
    check(got, oracle(q, k, v, table, lengths, **kw), "float32")


@pytest.mark.parametrize("P, sq, mask", [(16, 1, "causal_br"), (16, 4, "window_br"),
                                         (5, 4, "none"), (5, 1, "causal_offset")])
def test_triton_paged_starts_match_the_dense_reference(P, sq, mask):
    """Pages(starts=) on the Triton paged kernel (STARTS): starts within and on page
    boundaries, a sequence emptied by its start, NaN before every start, GQA, fp32."""
    torch = _triton()
    rng = np.random.default_rng([P, sq, len(mask), 2])
    k, v, table, sl = make_cache(rng, LEFT_LENGTHS, P, starts=LEFT_STARTS)
    q = rng.standard_normal((5, 4, sq, 8)).astype(np.float32)
    kw = dict(mask=MASKS[mask]())
    if mask == "causal_offset":
        kw.update(q_offset=9, k_offset=2)
    got, _ = _triton_paged(torch, "float32", q, k, v, table, sl, starts=LEFT_STARTS, **kw)
    check(got, oracle(q, k, v, table, LEFT_LENGTHS, starts=LEFT_STARTS, **kw), "float32")


def test_triton_paged_starts_split_keys_modifiers():
    """Starts with the keys split across programs, a window, ALiBi, softcap, sinks,
    bf16 in FlashAttention's page layout (bshd)."""
    torch = _triton()
    from anyattn.backends.triton import route
    from anyattn.paged import describe_paged

    rng = np.random.default_rng(21)
    lengths, starts = [150, 0, 61], [37, 0, 60]
    k, v, table, sl = make_cache(rng, lengths, 16, Hkv=1, starts=starts)
    q = rng.standard_normal((3, 2, 3, 8)).astype(np.float32)
    kw = dict(mask=aa.Causal(align="bottom_right") & aa.Window(left=90, align="bottom_right"),
              alibi_slopes=rng.uniform(0.1, 0.5, 2), softcap=2.0, sinks=rng.standard_normal(2))
    p = describe_paged(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v),
                       aa.Pages(table, sl, np.asarray(starts)), mask=kw["mask"])
    rt = route.paged_route(route.ProblemFacts.of(p), route.device_facts(p.device))
    assert rt.splits > 1, rt.describe()
    got, back = _triton_paged(torch, "bfloat16", q, k, v, table, sl, layout="bshd",
                              starts=starts, **kw)
    check(got, oracle(*back, table, lengths, starts=starts, **kw), "bfloat16")


def test_triton_page_buffer_is_uploaded_once_per_pages():
    """A repeated call with one Pages object reuses its device buffer of tables (kept in
    the Pages); a new Pages (here: new starts) uploads its own."""
    torch = _triton()

    rng = np.random.default_rng(22)
    k, v, table, sl = make_cache(rng, [20, 9], 16, starts=[3, 0])
    q = torch.from_numpy(rng.standard_normal((2, 4, 1, 8)).astype(np.float32))
    tk, tv = torch.from_numpy(k), torch.from_numpy(v)
    pages = aa.Pages(table, sl, np.array([3, 0], np.int32))
    made = []
    real = torch.from_numpy

    def spy(x):
        if isinstance(x, np.ndarray) and x.dtype == np.int32 and x.ndim == 1:
            made.append(x.shape)                # a PG buffer of tables (_page_buffer)
        return real(x)
    mask = aa.Causal(align="bottom_right")
    try:
        torch.from_numpy = spy
        for _ in range(3):
            aa.attention(q, tk, tv, pages=pages, mask=mask, backend="triton")
        n_once = len(made)
        other = aa.Pages(table, sl, np.array([4, 0], np.int32))
        aa.attention(q, tk, tv, pages=other, mask=mask, backend="triton")
    finally:
        torch.from_numpy = real
    assert n_once == 1 and len(made) == 2
    assert len(pages.device_cache) == 1 and len(other.device_cache) == 1


def test_triton_paged_launches_reuse_their_site_per_signature():
    """The paged launches go through one direct.Site per signature: the layers of a step
    (the same shapes, Pages and scalars) share it; on a CUDA device its repeats skip
    Triton's binder (GPU: hits > 0), in the interpreter it is Triton's path (off)."""
    torch = _triton()
    from anyattn.backends.triton import forward

    rng = np.random.default_rng(23)
    k, v, table, sl = make_cache(rng, [20, 9], 16)
    q = torch.from_numpy(rng.standard_normal((2, 4, 1, 8)).astype(np.float32))
    tk, tv = torch.from_numpy(k), torch.from_numpy(v)
    pages = aa.Pages(table, sl)
    forward._paged_sites.clear()
    outs = [aa.attention(q, tk, tv, pages=pages, backend="triton") for _ in range(3)]
    assert all(torch.equal(o, outs[0]) for o in outs)
    sites = list(forward._paged_sites.values())
    assert len(sites) == 2 and all(not s.on for s in sites)       # fwd_split, combine
    aa.attention(q[:, :, :1] * 2, tk, tv, pages=aa.Pages(table, sl - 1), backend="triton")
    assert len(forward._paged_sites) == 2 + 1       # new lengths: a new split signature


@pytest.mark.gpu
def test_triton_paged_launches_skip_the_binder_on_a_gpu():
    """GPU machines only: from the second call of one signature the paged launches run
    the resolved kernel directly (direct.Site hits), with the bits of the first call."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from anyattn.backends.triton import forward

    rng = np.random.default_rng(24)
    k, v, table, sl = make_cache(rng, [200, 33], 16, starts=[5, 0])
    k, v = (np.nan_to_num(x) for x in (k, v))
    tq = torch.from_numpy(rng.standard_normal((2, 4, 1, 8)).astype(np.float32)).cuda().half()
    tk, tv = (torch.from_numpy(x).cuda().half() for x in (k, v))
    pages = aa.Pages(table, sl, np.array([5, 0], np.int32))
    forward._paged_sites.clear()
    outs = [aa.attention(tq, tk, tv, pages=pages, backend="triton") for _ in range(4)]
    assert all(torch.equal(o, outs[0]) for o in outs)
    assert all(s.hits >= 2 for s in forward._paged_sites.values()), \
        [(s.hits, s.d) for s in forward._paged_sites.values()]


def test_triton_paged_refusals():
    torch = _triton()
    k = torch.zeros(3, 2, 4, 8)
    pages = aa.Pages(np.array([[0, 1], [2, 0]], np.int32), np.array([7, 4], np.int32))
    q = torch.zeros(2, 2, 17, 8)
    with pytest.raises(NotImplementedError, match=r"backend='triton'.*paged cache \(pages=\) "
                                                  r"with at most 16 queries .* Sq = 17"):
        aa.attention(q, k, k, pages=pages, backend="triton")
    with pytest.raises(NotImplementedError, match=r"bias:"):
        aa.attention(q[:, :, :1], k, k, pages=pages, backend="triton",
                     bias=torch.zeros(1, 1, 1, 7))
    bad = aa.Pages(np.array([[0, 3], [2, 0]], np.int32), np.array([7, 4], np.int32))
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = 3 is outside"):
        aa.attention(q[:, :, :1], k, k, pages=bad, backend="triton")


def test_triton_paged_route_refuses_what_the_split_kernel_lacks():
    from anyattn.backends.triton import route

    dev = route.DeviceFacts("cuda", (9, 0), 132)
    with pytest.raises(NotImplementedError, match=r"at most 16 queries .* Sq = 17"):
        route.paged_route(route.ProblemFacts(1, 4, 4, 17, 100, 64, "bfloat16"), dev)
    with pytest.raises(NotImplementedError, match=r"lacks bias"):
        route.paged_route(route.ProblemFacts(1, 4, 4, 1, 100, 64, "bfloat16",
                                             features=frozenset({"bias"})), dev)
    rt = route.paged_route(route.ProblemFacts(64, 32, 8, 1, 4096, 128, "bfloat16"), dev)
    assert rt.splits == 1 and rt.pack == 4            # 512 programs fill 132 SMs
    rt = route.paged_route(route.ProblemFacts(1, 32, 8, 1, 65536, 128, "bfloat16"), dev)
    assert rt.splits > 1


def test_pages_is_checked_to_be_pages():
    q = np.zeros((1, 1, 1, 2), np.float32)
    with pytest.raises(TypeError, match=r"pages: expected anyattn.Pages"):
        aa.attention(q, q, q, pages=(np.zeros((1, 1)), np.zeros(1)))


def test_unused_table_entries_are_never_read():
    out = _call(table=((0, 1), (2, 99)), lengths=(7, 4))            # 99: past sequence 1
    assert out.shape == (2, 2, 1, 8)
    # before a sequence's start; a sequence that its start empties reads none
    out = _call(table=((-5, 1), (99, 99)), lengths=(7, 4), starts=(4, 4))
    assert out.shape == (2, 2, 1, 8)


def test_numpy_reference_webgpu_and_triton_declare_paged_kv():
    from anyattn.backends.reference_backend import ReferenceBackend
    from anyattn.backends.webgpu.backend import _CAPS as webgpu_caps

    assert get_backend("numpy").capabilities.supports("paged_kv")
    assert ReferenceBackend.capabilities.supports("paged_kv")
    assert webgpu_caps.supports("paged_kv")
    from anyattn.backends.triton.backend import TritonBackend
    assert TritonBackend().capabilities.supports("paged_kv")
    assert "paged_kv" not in features.DEFAULT_INPUTS


def test_paged_results_do_not_depend_on_the_thread_count():
    from anyattn.arguments import score_mods
    from anyattn.backends.numpy_backend import NumpyBackend, NumpyConfig
    from anyattn.paged import describe_paged

    rng = np.random.default_rng(7)
    lengths = [70, 33, 0, 51]
    k, v, table, sl = make_cache(rng, lengths, 5)
    q = rng.standard_normal((4, 4, 4, 8)).astype(np.float32)
    p = describe_paged(q, k, v, aa.Pages(table, sl), mask=aa.Causal(align="bottom_right"))
    mods = score_mods(p, None, None)
    runs = [NumpyBackend(NumpyConfig(threads=n)).forward_paged(p, q, k, v, mods)
            for n in (1, 2, 3)]
    for out, st in runs[1:]:
        assert np.array_equal(out, runs[0][0])
        assert np.array_equal(st.max, runs[0][1].max)
        assert np.array_equal(st.log_norm, runs[0][1].log_norm)


@pytest.mark.parametrize("magnitude", [30.0, 1000.0])
def test_paged_error_at_large_logits_is_within_3x_torch_math_sdpa(magnitude):
    torch = pytest.importorskip("torch")
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rng = np.random.default_rng(8)
    lengths = [90, 57]
    k, v, table, sl = make_cache(rng, lengths, 16, D=16, Dv=16)
    k *= np.float32(magnitude)
    q = rng.standard_normal((2, 4, 4, 16)).astype(np.float32)
    mask = aa.Causal(align="bottom_right")
    out = aa.attention(q, k, v, pages=aa.Pages(table, sl), mask=mask)
    ref, _ = oracle(q, k, v, table, lengths, mask=mask)
    for b, L in enumerate(lengths):
        kd, vd = (torch.from_numpy(dense_keys(x, table, b, L)[0].astype(np.float32))
                  .repeat_interleave(2, 0) for x in (k, v))
        keep = torch.ones(4, L, dtype=torch.bool).tril(L - 4)
        with sdpa_kernel(SDPBackend.MATH):
            t = torch.nn.functional.scaled_dot_product_attention(
                torch.from_numpy(q[b]), kd, vd, attn_mask=keep).numpy()
        sdpa_err = np.abs(t - ref[b]).max()
        assert np.abs(out[b] - ref[b]).max() <= 3 * sdpa_err + 1e-7


def test_paged_problems_are_not_kept_by_the_dispatch_memo():
    """A paged Problem holds the caller's tables: choose must not keep it (each call
    makes a new one; a kept one would pin up to 256 tables)."""
    from anyattn.backends import registry

    registry.clear_choices()
    rng = np.random.default_rng(9)
    k, v, table, sl = make_cache(rng, [9, 4], 5)
    q = rng.standard_normal((2, 4, 1, 8)).astype(np.float32)
    for _ in range(3):
        aa.attention(q, k, v, pages=aa.Pages(table, sl))
    assert not any(key[0].pages is not None for key in registry._choices)



@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_triton_paged_call_is_captured_by_a_cuda_graph(dtype):
    """GPU machines only: after a warm-up call with the same Pages (its device buffer of
    tables uploaded then), the paged forward makes no host synchronisation and no host
    copy, so a CUDA graph captures it; a replay over new cache contents copied into the
    static pages gives the eager bits (the tables are the Pages', baked into the graph)."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    rng = np.random.default_rng(30)
    lengths, starts = [300, 0, 77], [40, 0, 3]
    k, v, table, sl = make_cache(rng, lengths, 16, starts=starts)
    tdt = getattr(torch, dtype)
    k, v = (np.nan_to_num(x) for x in (k, v))
    q = rng.standard_normal((3, 4, 2, 8)).astype(np.float32)
    tq, tk, tv = (torch.from_numpy(x).to("cuda", tdt) for x in (q, k, v))
    pages = aa.Pages(table, sl, np.asarray(starts, np.int32))
    kw = dict(pages=pages, mask=aa.Causal(align="bottom_right"), backend="triton",
              return_lse=True, alibi_slopes=torch.rand(4, device="cuda"))

    def step():
        return aa.attention(tq, tk, tv, **kw)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, lse = step()
    for seed in (1, 2):
        g = torch.Generator(device="cuda").manual_seed(seed)
        for x in (tq, tk, tv):
            x.copy_(torch.randn(x.shape, device="cuda", generator=g).to(tdt))
        graph.replay()
        want, want_lse = step()
        assert torch.equal(out, want) and torch.equal(lse, want_lse)
