"""Paged key/value caches on the webgpu backend (anyattn.Pages; the PAGED forward kernel)
against the float64 dense reference over each sequence's gathered keys: score
modifiers, v's own head dim, device arrays as pages (bound in place, no read-back),
split launches, the prefetching kernels, poisoned scratch, bad tables, and the plain
kernels' text.  Caches from tests/core/test_paged_kv.make_cache: shuffled pages, a
shared first page, -1 past the pages in use and NaN in every position no sequence
reads.  The masks x page sizes x Sq grid runs in tests/core/test_paged_kv.py."""
from __future__ import annotations

import importlib.util
import os

import numpy as np
import pytest

import anyattn as aa
from anyattn.backends.webgpu import pipelines
from anyattn.backends.webgpu.launch import choose_config

from helpers import assert_close


def _core_cases():
    """tests/core/test_paged_kv.py (the cache builder and the oracle), loaded by path:
    tests/ is not on sys.path (tests/conftest.py)."""
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "core",
                        "test_paged_kv.py")
    spec = importlib.util.spec_from_file_location("paged_kv_cases", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


_cases = _core_cases()
check, make_cache, oracle = _cases.check, _cases.make_cache, _cases.oracle

wg = pytest.importorskip("anyattn.webgpu")

CAUSAL = aa.Causal(align="bottom_right")


def _case(seed, lengths, P, B_heads=(4, 2), sq=2, D=8, Dv=8):
    rng = np.random.default_rng(seed)
    Hq, Hkv = B_heads
    k, v, table, sl = make_cache(rng, lengths, P, Hkv=Hkv, D=D, Dv=Dv)
    q = rng.standard_normal((len(lengths), Hq, sq, D)).astype(np.float32)
    return rng, q, k, v, table, sl


def _mods_case(seed):
    """MQA (3 query heads over 1), Dv = 3 != D = 6, page size 5, an empty sequence,
    softcap, per-batch ALiBi slopes and sinks (one kernel: lavapipe compiles slowly)."""
    lengths = [21, 50, 9, 0]
    rng, q, k, v, table, sl = _case(seed, lengths, 5, (3, 1), sq=2, D=6, Dv=3)
    kw = dict(mask=CAUSAL, softcap=1.5,
              alibi_slopes=rng.uniform(0.1, 1.0, (4, 3)).astype(np.float32),
              sinks=rng.standard_normal(3).astype(np.float32))
    return lengths, q, k, v, table, sl, kw


def test_paged_modifiers_and_value_dim(be):
    lengths, q, k, v, table, sl, kw = _mods_case(1)
    got = aa.attention(q, k, v, pages=aa.Pages(table, sl), backend="webgpu",
                       return_lse=True, **kw)
    want = oracle(q, k, v, table, lengths, **kw)
    check(got, want, "float32")
    # each modifier matters here (the same kernel, one modifier neutral at a time)
    for name, neutral in (("softcap", 1e30), ("sinks", np.full(3, -np.inf, np.float32))):
        alt = dict(kw, **{name: neutral})
        assert not np.allclose(oracle(q, k, v, table, lengths, **alt)[0], want[0])


def test_paged_decode_long_cache_and_window(be):
    """Decoding (Sq = 1) over caches of several key tiles, a window that skips most of
    them, page size 16, GQA 8 over 2."""
    lengths = [300, 130, 77]
    _, q, k, v, table, sl = _case(3, lengths, 16, (8, 2), sq=1, D=16, Dv=16)
    for mask in (CAUSAL, CAUSAL & aa.Window(left=40, align="bottom_right"), None):
        got = aa.attention(q, k, v, pages=aa.Pages(table, sl), mask=mask, backend="webgpu",
                           return_lse=True)
        check(got, oracle(q, k, v, table, lengths, mask=mask), "float32")


def test_paged_prefill_chunk(be):
    """A prefill chunk (Sq = 19 queries at the end of each sequence, more than one query
    tile on lavapipe's config) over per-sequence key counts; the bshd page layout."""
    lengths = [60, 19, 41]
    _, q, k, v, table, sl = _case(4, lengths, 16, (2, 2), sq=19)
    want = oracle(q, k, v, table, lengths, mask=CAUSAL)
    got = aa.attention(q.transpose(0, 2, 1, 3), k.transpose(0, 2, 1, 3).copy(),
                       v.transpose(0, 2, 1, 3).copy(), pages=aa.Pages(table, sl),
                       mask=CAUSAL, layout="bshd", backend="webgpu", return_lse=True)
    check((got[0].transpose(0, 2, 1, 3), got[1]), want, "float32")


def test_paged_every_output_written_after_poison(be):
    """Rows that keep no key (a window past them), an empty sequence: every element of
    out / lse written, bitwise the same after the scratch is poisoned (NaN)."""
    lengths = [20, 0, 7]
    _, q, k, v, table, sl = _case(5, lengths, 5, sq=4)
    mask = aa.Window(left=2, right=0, align="bottom_right")
    kw = dict(pages=aa.Pages(table, sl), mask=mask, backend="webgpu", return_lse=True)
    be.runner().poison()
    out, lse = aa.attention(q, k, v, **kw)
    assert not np.isnan(out).any() and not np.isnan(lse).any()
    assert np.all(out[1] == 0) and np.all(lse[1] == -np.inf)
    check((out, lse), oracle(q, k, v, table, lengths, mask=mask), "float32")
    be.runner().poison()
    out2, lse2 = aa.attention(q, k, v, **kw)
    np.testing.assert_array_equal(out, out2)
    np.testing.assert_array_equal(lse, lse2)


def test_paged_split_launches_are_bitwise_one_launch(be):
    """A loop budget that splits the forward into pieces over key tiles (the per-sequence
    tile maps and key counts carried across pieces): every bit of one launch's result."""
    lengths = [150, 33, 97]
    _, q, k, v, table, sl = _case(6, lengths, 16, sq=3)
    kw = dict(pages=aa.Pages(table, sl), mask=CAUSAL, backend="webgpu", return_lse=True)
    one = aa.attention(q, k, v, **kw)
    assert be.last_pieces["forward"] == 1
    be.loop_limit_override = 120          # ~36 trips per key tile here: 5 tiles, 2 a piece
    split = aa.attention(q, k, v, **kw)
    assert be.last_pieces["forward"] > 1
    np.testing.assert_array_equal(one[0], split[0])
    np.testing.assert_array_equal(one[1], split[1])
    check(split, oracle(q, k, v, table, lengths, mask=CAUSAL), "float32")


def test_paged_prefetching_variant(be, monkeypatch):
    """The register-prefetch loaders (sdp_ld, upd_q_ld; variant staged) read through the
    table too: bitwise the portable kernel's results."""
    from anyattn.backends.webgpu.launch import ENV_VARIANT

    lengths = [70, 5, 41]
    _, q, k, v, table, sl = _case(7, lengths, 5, sq=4, D=24, Dv=24)
    kw = dict(pages=aa.Pages(table, sl), mask=CAUSAL, backend="webgpu", return_lse=True)
    base = aa.attention(q, k, v, **kw)
    monkeypatch.setenv(ENV_VARIANT, "staged")
    got = aa.attention(q, k, v, **kw)
    np.testing.assert_array_equal(base[0], got[0])
    np.testing.assert_array_equal(base[1], got[1])


def test_paged_float16(be):
    if not be.context.has_f16:
        pytest.skip("adapter without shader-f16")
    lengths = [45, 12]
    _, q, k, v, table, sl = _case(8, lengths, 16, sq=2, D=16, Dv=16)
    q16, k16, v16 = (x.astype(np.float16) for x in (q, k, v))
    out = aa.attention(q16, k16, v16, pages=aa.Pages(table, sl), mask=CAUSAL,
                       backend="webgpu")
    assert out.dtype == np.float16
    ro, _ = oracle(*(x.astype(np.float64) for x in (q16, k16, v16)), table, lengths,
                   mask=CAUSAL)
    assert_close(out.astype(np.float64), ro, "float16", "out")


# ------------------------------------------------------------------ device arrays
def _transfers(monkeypatch, be):
    """Record the queue's read-backs and writes from here on -> (reads, writes as
    (label, usage, bytes))."""
    queue = type(be.device.queue)
    reads, writes = [], []
    r0, w0 = queue.read_buffer, queue.write_buffer

    def wb(self, buffer, offset, data, *a, **k):
        writes.append((buffer.label, int(buffer.usage), memoryview(data).nbytes))
        return w0(self, buffer, offset, data, *a, **k)
    monkeypatch.setattr(queue, "read_buffer",
                        lambda self, *a, **k: (reads.append(a), r0(self, *a, **k))[1])
    monkeypatch.setattr(queue, "write_buffer", wb)
    return reads, writes


def test_paged_device_arrays_in_place(be, monkeypatch):
    """Pages as device arrays (one arena, each cache a view at an offset): read where they
    lie (no read-back, no copy of the cache), results device arrays; dispatched to webgpu
    automatically."""
    import wgpu

    lengths, q, k, v, table, sl, kw = _mods_case(9)
    dev = wg.device()
    pad = 7
    host = np.concatenate([np.zeros(pad, np.float32), k.ravel(), np.zeros(pad, np.float32),
                           v.ravel()])
    usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST
    buf = dev.create_buffer(size=host.nbytes, usage=usage)
    dev.queue.write_buffer(buf, 0, host)
    dk = wg.from_buffer(buf, k.shape, np.float32, offset=pad)
    dv = wg.from_buffer(buf, v.shape, np.float32, offset=2 * pad + k.size)
    dq = wg.asarray(q)
    dsl, dsk = (wg.asarray(kw[n]) for n in ("alibi_slopes", "sinks"))
    pages = aa.Pages(table, sl)
    dkw = dict(kw, alibi_slopes=dsl, sinks=dsk)
    aa.attention(dq, dk, dv, pages=pages, **dkw)
    reads, writes = _transfers(monkeypatch, be)
    out, lse = aa.attention(dq, dk, dv, pages=pages, return_lse=True, **dkw)
    monkeypatch.undo()
    assert not reads
    # a repeat with the same Pages: its launch template (kept in the Pages) writes no aux
    # table (block table, records, tile map) and nothing the size of the cache
    other = [w for w in writes if not w[1] & int(wgpu.BufferUsage.UNIFORM)]
    assert not other, other
    assert isinstance(out, wg.DeviceArray) and isinstance(lse, wg.DeviceArray)
    check((out.numpy(), lse.numpy()), oracle(q, k, v, table, lengths, **kw), "float32")


@pytest.mark.parametrize("arrays", ["device", "numpy"])
def test_paged_repeat_with_same_pages_uploads_no_table(be, monkeypatch, arrays):
    """The aux table of a paged call (block table, records, tile map) is uploaded once per
    Pages (device arrays: with the launch template, kept in the Pages too), so a repeat
    with the same Pages writes no aux and is bitwise equal; a new Pages (new lengths, or
    rows of the table swapped) and the same Pages under another mask each upload their
    own and match the oracle; ``clear_caches`` drops what the Pages keeps."""
    lengths = [40, 17, 33]
    _, q, k, v, table, sl = _case(14, lengths, 8, sq=1)
    args = tuple(wg.asarray(x) for x in (q, k, v)) if arrays == "device" else (q, k, v)
    _, writes = _transfers(monkeypatch, be)

    def run(pages, lens, tab, mask=CAUSAL):
        del writes[:]
        out, lse = aa.attention(*args, pages=pages, mask=mask, return_lse=True,
                                backend="webgpu")
        n = sum(1 for label, _, _ in writes if label == "aux")
        got = tuple(np.asarray(x.numpy() if arrays == "device" else x) for x in (out, lse))
        check(got, oracle(q, k, v, tab, lens, mask=mask), "float32")
        return got, n

    pages = aa.Pages(table, sl)
    first, n1 = run(pages, lengths, table)
    assert n1 >= 1
    again, n2 = run(pages, lengths, table)
    assert n2 == 0
    for a, b in zip(first, again):
        assert np.array_equal(a, b, equal_nan=True)
    # new lengths (same table and max length: the same signature but for the Pages)
    short = [40, 9, 20]
    _, n3 = run(aa.Pages(table, np.asarray(short, np.int32)), short, table)
    assert n3 >= 1
    # a new table: sequences 0 and 1 swap their pages (and lengths)
    alt_lengths = [17, 40, 33]
    alt = np.ascontiguousarray(table[[1, 0, 2]])
    _, n4 = run(aa.Pages(alt, np.asarray(alt_lengths, np.int32)), alt_lengths, alt)
    assert n4 >= 1
    # the same Pages under another mask: another table (its own bands)
    win = CAUSAL & aa.Window(left=5, align="bottom_right")
    _, n5 = run(pages, lengths, table, win)
    assert n5 >= 1
    _, n6 = run(pages, lengths, table, win)
    assert n6 == 0
    be.runner().clear_caches()          # drops what the Pages keeps too
    _, n7 = run(pages, lengths, table, win)
    assert n7 >= 1


def test_paged_table_changed_in_place_is_not_read(be):
    """Pages copies its tables when made: a block table changed in place afterwards
    changes neither the first call with that Pages nor a repeat (the kept template)."""
    lengths = [40, 17]
    _, q, k, v, table, sl = _case(15, lengths, 8, sq=1)
    dq, dk, dv = wg.asarray(q), wg.asarray(k), wg.asarray(v)
    mine = table.copy()
    pages = aa.Pages(mine, sl)
    want = oracle(q, k, v, table, lengths, mask=CAUSAL)
    mine[:] = mine[::-1].copy()         # another (valid) table, after the Pages was made
    for _ in range(2):
        out, lse = aa.attention(dq, dk, dv, pages=pages, mask=CAUSAL, return_lse=True,
                                backend="webgpu")
        check((out.numpy(), lse.numpy()), want, "float32")
        mine[:, 0] = mine[:, -1]


def test_paged_device_arrays_bshd(be):
    lengths = [40, 17]
    _, q, k, v, table, sl = _case(10, lengths, 16, sq=1)
    dq, dk, dv = (wg.asarray(np.ascontiguousarray(x.transpose(0, 2, 1, 3)))
                  for x in (q, k, v))
    out = aa.attention(dq, dk, dv, pages=aa.Pages(table, sl), mask=CAUSAL, layout="bshd",
                       backend="webgpu")
    ro, _ = oracle(q, k, v, table, lengths, mask=CAUSAL)
    assert_close(out.numpy().transpose(0, 2, 1, 3), ro, "float32", "out")


@pytest.mark.parametrize("table, lengths, match", [
    (((0, 3), (2, -1)), (7, 4), r"block_table\[0, 1\] = 3 is outside the cache's 3 pages"),
    (((0, 1), (2, -1)), (9, 4), r"seqlens\[0\] = 9 exceeds the 2 pages x 4"),
])
def test_paged_bad_tables_raise_before_work_on_device_arrays(be, table, lengths, match):
    k = wg.asarray(np.zeros((3, 2, 4, 8), np.float32))
    q = wg.asarray(np.zeros((2, 2, 1, 8), np.float32))
    pages = aa.Pages(np.array(table, np.int32), np.array(lengths, np.int32))
    with pytest.raises(ValueError, match=match):
        aa.attention(q, k, k, pages=pages)


def test_paged_unsupported_raise(be):
    """What no backend does with pages stays refused on webgpu (before any work)."""
    lengths = [9, 4]
    _, q, k, v, table, sl = _case(11, lengths, 5, sq=1)
    pages = aa.Pages(table, sl)
    with pytest.raises(NotImplementedError, match="dropout_p"):
        aa.attention(q, k, v, pages=pages, dropout_p=0.1, dropout_seed=1, backend="webgpu")
    with pytest.raises(NotImplementedError, match="score_mod"):
        aa.attention(q, k, v, pages=pages, score_mod=lambda s, b, h, i, j: s,
                     backend="webgpu")


# ------------------------------------------------------------------ kernel text
def test_plain_kernels_carry_no_paging_code(be):
    """Without PAGED every tiled kernel is the plain one: no block-table read and the
    uniforms pg_off / pg_p unnamed; PAGED brings them into the forward."""
    consts = choose_config(be.context, 16).consts()
    for kern in ("forward", "bwd_dq", "bwd_dkdv"):
        assert "pg_" not in pipelines.build_source(kern, consts), kern
    paged = pipelines.build_source("forward", dict(consts, PAGED=1))
    assert "pg_row(b, j, U.k_sb, U.k_ss)" in paged and "pg_row(b, j, U.v_sb" in paged
    assert "pg_off: u32" in paged
    # PGSTART only with starts: the PAGED text without it reads no start
    assert "aux[row - 1u]" not in paged
    started = pipelines.build_source("forward", dict(consts, PAGED=1, PGSTART=1))
    assert "aux[row - 1u]" in started


def test_paged_starts_device_arrays_modifiers(be):
    """Pages(starts=) on device-array pages: softcap, per-batch ALiBi and sinks, Dv != D,
    MQA, starts within and on page boundaries and one equal to its sequence's end."""
    lengths, starts = [21, 50, 9, 0], [3, 15, 9, 0]
    rng = np.random.default_rng(12)
    k, v, table, sl = make_cache(rng, lengths, 5, Hkv=1, D=6, Dv=3, starts=starts)
    q = rng.standard_normal((4, 3, 2, 6)).astype(np.float32)
    kw = dict(mask=CAUSAL & aa.Window(left=12, align="bottom_right"), softcap=1.5,
              alibi_slopes=rng.uniform(0.1, 1.0, (4, 3)).astype(np.float32),
              sinks=rng.standard_normal(3).astype(np.float32))
    pages = aa.Pages(table, sl, np.asarray(starts, np.int32))
    dkw = dict(kw, **{n: wg.asarray(kw[n]) for n in ("alibi_slopes", "sinks")})
    out, lse = aa.attention(wg.asarray(q), wg.asarray(k), wg.asarray(v), pages=pages,
                            return_lse=True, backend="webgpu", **dkw)
    check((out.numpy(), lse.numpy()), oracle(q, k, v, table, lengths, starts=starts, **kw),
          "float32")
