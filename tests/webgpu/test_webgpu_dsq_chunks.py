"""The 5-product backward's dS scratch (``*-dsq`` variants), bounded and chunked.

* Chunks (launch.dsq_chunks): past DSQ_MAX_BYTES the backward runs over chunks of
  (batch, KV head) rows, each chunk's dK/dV launches then its dQ launches, one chunk's dS
  in the scratch at a time.  Every workgroup does what it does unchunked and no sum
  crosses a chunk (a KV row's dK/dV sums over its G query heads inside one chunk), so
  the results are the unchunked ones bit for bit (f32 and f16), within float64's
  tolerance (GQA, causal with empty rows, softcap / ALiBi / sinks / dropout, odd D), and
  the scratch never grows past the cap.
* One scratch per device (launch.DSQ_ROLE): the ABI's cached plans and the device-array
  launch templates share the runner's one dS buffer; when a larger call grows it (the old
  buffer destroyed), a cached plan / template re-binds at submit instead of submitting a
  bind group of the destroyed buffer (mutation tests: a plan that kept its first binding
  fails here).
Small sizes (lavapipe); the shapes of test_webgpu_dsq.py where possible (compiled once).
"""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import anyattn as aa
from anyattn import abi
from anyattn import reference as R
from anyattn.api import forward_with_stats
from anyattn.backends.webgpu import abi_bridge, launch
from anyattn.backends.webgpu.launch import (DSQ_ROLE, ENV_VARIANT, choose_config, dsq_bytes,
                                            dsq_chunks)

from helpers import assert_close, compare_with_reference, make_qkv
from wg_util import (assert_same, backward_call, backward_from_float64, base_and_dsq, grads,
                     modifiers_case, one_unit_loop_limit)


def test_dsq_chunks_rows():
    """Fewest chunks of equal size within the limit; None where one row does not fit."""
    gib = 1 << 30
    assert dsq_chunks(8, 1, 4096, 4096, 64, gib) == [(0, 8)]            # 512 MiB
    assert dsq_chunks(8, 1, 5800, 5800, 64, gib) == [(0, 4), (4, 8)]    # 129 MiB a row
    assert dsq_chunks(5, 2, 10, 10, 8, dsq_bytes(4, 10, 10, 8)) == [(0, 2), (2, 4), (4, 5)]
    assert dsq_chunks(8, 1, 16400, 16400, 64, gib) is None
    assert dsq_chunks(3, 1, 0, 5, 8, 16) == [(0, 3)]
    # every chunk within the limit, all rows covered once
    for n in range(1, 12):
        for lim_rows in range(1, n + 1):
            ch = dsq_chunks(n, 3, 7, 9, 8, dsq_bytes(3 * lim_rows, 7, 9, 8))
            assert [a for a, _ in ch] == [0] + [b for _, b in ch[:-1]] and ch[-1][1] == n
            assert max(b - a for a, b in ch) <= lim_rows
            assert len(ch) == -(-n // lim_rows)


def test_chunked_bitwise_unchunked(be, monkeypatch):
    """B = 2, HQ = 4, HKV = 2 (4 KV rows), causal bottom-right with empty rows, D = 40 (the
    shapes of test_webgpu_dsq): 4 chunks of one row and 2 of two give the unchunked bits
    (portable's too), against float64; the launches alternate dK/dV and dQ per chunk, and
    the scratch stays within the cap."""
    base, dsq = base_and_dsq(be, 40)
    q, k, v, g = make_qkv(np.random.default_rng(71), 2, 4, 2, 37, 70, 40)
    mask = aa.Causal("bottom_right") & aa.Window(left=40)
    ref = grads(be, q, k, v, g, base, mask=mask)
    one = grads(be, q, k, v, g, dsq, mask=mask)
    assert_same(ref, one)
    row = dsq_bytes(2, 37, 70, dsq.BK)
    run = be.runner()
    for rows, n_chunks in ((1, 4), (3, 2)):
        run.release(DSQ_ROLE)
        monkeypatch.setattr(launch, "DSQ_MAX_BYTES", rows * row)
        got = grads(be, q, k, v, g, dsq, mask=mask)
        assert_same(one, got)
        assert run.role_buffers[DSQ_ROLE].size <= rows * row
        call = backward_call(be, q, k, v, g, dsq, mask)
        seq = [lch.kernel for lch in call.launches if lch.kernel in ("bwd_dkdv", "bwd_dq")]
        assert seq == ["bwd_dkdv", "bwd_dq"] * n_chunks
        assert len(call.dsq_marks) == n_chunks
    rg = R.backward(q, k, v, g, mask=mask)
    for name, x in zip(("dq", "dk", "dv"), got):
        assert_close(x, getattr(rg, name), "float32", name)


def test_chunked_against_float64_modifiers(be, monkeypatch):
    """Through the API, two chunks (one KV row each): causal GQA with empty rows, softcap +
    ALiBi + sinks (+ dsinks), dropout, D = 20 (test_webgpu_dsq's float64 case)."""
    q, k, v, g, kw = modifiers_case(64, 20)
    bk = choose_config(be.context, 20, variant="portable-dsq").BK
    monkeypatch.setattr(launch, "DSQ_MAX_BYTES", dsq_bytes(2, 29, 41, bk))
    monkeypatch.setenv(ENV_VARIANT, "portable-dsq")
    compare_with_reference("webgpu", q, k, v, g, wrt=("q", "k", "v", "sinks"), **kw)


def test_chunked_f16_bitwise(be, monkeypatch):
    """f16: two chunks give the unchunked bits (test_webgpu_dsq's f16 shapes)."""
    if not be.context.has_f16:
        pytest.skip("no shader-f16")
    q, k, v, g = make_qkv(np.random.default_rng(65), 1, 4, 2, 45, 70, 24, dtype="float16")
    _, dsq = base_and_dsq(be, 24, "f16")
    res = []
    for cap in (None, dsq_bytes(2, 45, 70, dsq.BK)):
        if cap:
            monkeypatch.setattr(launch, "DSQ_MAX_BYTES", cap)
        gr = backward_from_float64(be, q, k, v, g, dsq, aa.Causal())
        res.append([gr.dq, gr.dk, gr.dv])
    assert_same(*res)


def _abi_group(be, seed, B, H, S, D):
    """A causal (kind 1) dQ + dK group of the seed ABI on one arena buffer."""
    import wgpu

    r = np.random.default_rng(seed)
    q, k, v, dy = (r.standard_normal((B, H, S, D)) for _ in range(4))
    arena, p1 = abi.pack_arena(q, k, v, dy, wrt=1, mask_kind=1)
    n = arena.size
    arena = np.concatenate([arena, np.full(B * H * S * D, np.nan, np.float32)])
    p0 = dataclasses.replace(p1, wrt=0, out_off=n, o_batch_stride=H * S * D,
                             o_head_stride=S * D, o_seq_stride=D)
    buf = be.device.create_buffer_with_data(
        data=arena, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC
        | wgpu.BufferUsage.COPY_DST)
    refs = [R.seed_backward(q, k, v, dy, mask_kind=1, scale=1 / np.sqrt(D), wrt=w)
            for w in (0, 1)]
    return buf, arena, (p0, p1), refs


def _abi_run(be, buf, arena, group, refs):
    be.device.queue.write_buffer(buf, 0, arena)          # outputs NaN again
    abi.attention_backward_arena(buf, list(group))
    after = np.frombuffer(be.device.queue.read_buffer(buf), np.float32).copy()
    got = [abi.read_output(after, p) for p in group]
    for x, ref in zip(got, refs):
        assert np.max(np.abs(x - ref)) / np.max(np.abs(ref)) <= 1e-5
    return got


def test_abi_plans_share_one_scratch(be, monkeypatch):
    """The ABI's cached plans bind the runner's one dS scratch (no per-plan copy); a
    larger problem grows it (the old buffer destroyed) and the first plan, submitted
    again from the cache, re-binds the new buffer: the same bits, one re-encode."""
    monkeypatch.setenv(ENV_VARIANT, "portable-dsq")
    run = be.runner()
    run.release(DSQ_ROLE)
    small = _abi_group(be, 81, 1, 2, 24, 16)
    first = _abi_run(be, *small)
    key = next(k for k, v in abi_bridge._PLANS.items() if v[0] is small[0])
    plan = abi_bridge._PLANS[key][1]
    old = run.role_buffers[DSQ_ROLE]
    assert plan.roles[DSQ_ROLE][1] is old
    _abi_run(be, *_abi_group(be, 82, 1, 2, 80, 16))       # grows the shared scratch
    assert run.role_buffers[DSQ_ROLE] is not old and run.role_buffers[DSQ_ROLE].size > old.size
    assert [r for r in run.role_buffers if r.endswith("dsq")] == [DSQ_ROLE]
    assert abi_bridge._PLANS[key][1] is plan and plan.rebinds == 0
    again = _abi_run(be, *small)                           # the cached plan, re-bound
    assert plan.rebinds == 1 and plan.roles[DSQ_ROLE][1] is run.role_buffers[DSQ_ROLE]
    for x, y in zip(first, again):
        np.testing.assert_array_equal(x, y)
    _abi_run(be, *small)                                   # no further re-encode
    assert plan.rebinds == 1


def test_templates_rebind_a_grown_scratch(be, monkeypatch):
    """Device-array calls: a launch template resolves the shared dS scratch at submit; after
    a larger call grew it, a repeat binds the new buffer (a new bound set): the same bits."""
    wg = pytest.importorskip("anyattn.webgpu")
    monkeypatch.setenv(ENV_VARIANT, "portable-dsq")
    run = be.runner()
    run.release(DSQ_ROLE)

    def call(S, seed):
        dev = [wg.asarray(x) for x in make_qkv(np.random.default_rng(seed), 1, 2, 1, S, S, 16)]
        q, k, v, g = dev
        out, st = forward_with_stats(q, k, v, mask=aa.Causal())
        gr = aa.attention_backward(q, k, v, g, out=out, lse=st, mask=aa.Causal())
        return [gr.dq.numpy(), gr.dk.numpy(), gr.dv.numpy()], dev

    first, dev = call(24, 91)
    old = run.role_buffers[DSQ_ROLE]
    call(80, 92)
    assert run.role_buffers[DSQ_ROLE] is not old
    misses = run.cache_stats["bound_misses"]
    q, k, v, g = dev
    out, st = forward_with_stats(q, k, v, mask=aa.Causal())
    gr = aa.attention_backward(q, k, v, g, out=out, lse=st, mask=aa.Causal())
    assert run.cache_stats["bound_misses"] > misses
    assert_same(first, [gr.dq.numpy(), gr.dk.numpy(), gr.dv.numpy()])


def test_staged_dsq_prefetch_chunks_split(be, monkeypatch):
    """staged-dsq (its dQ pass prefetches the next tile's dS: DSQ_PF) over 2 chunks, with
    the dK/dV launches split at the loop budget (a piece continues the chunk's partial
    sums) and key tiles skipped by a band (the prefetched tile is not always the next one
    run): staged's bits, and the same with DSQ_PREFETCH off."""
    r = np.random.default_rng(72)
    q, k, v, g = make_qkv(r, 1, 4, 2, 40, 150, 24)
    mask = aa.Causal("bottom_right") & aa.Window(left=60)
    base, dsq = base_and_dsq(be, 24, base="staged")
    assert dsq.prefetch
    ref = grads(be, q, k, v, g, base, mask=mask)
    monkeypatch.setattr(launch, "DSQ_MAX_BYTES", dsq_bytes(2, 40, 150, dsq.BK))
    be.loop_limit_override = one_unit_loop_limit(dsq, 24)
    for pf in (True, False):
        monkeypatch.setattr(launch, "DSQ_PREFETCH", pf)
        got = grads(be, q, k, v, g, dsq, mask=mask)
        assert be.last_pieces["bwd_dkdv"] > 1
        assert_same(ref, got)


def test_dbias_uses_the_shared_scratch(be, monkeypatch):
    """The dbias path's dS [B, HQ, SQ, SK] (written by the dQ pass, read by the reduction)
    lives in the one shared dS scratch: no other dS buffer; in a scratch a larger dsq call
    grew and filled, then poisoned (NaN), a dbias call whose band skips key tiles (their
    dS never written) clears what it needs and gives the bits of a fresh scratch (host
    arrays and device arrays)."""
    wg = pytest.importorskip("anyattn.webgpu")
    run = be.runner()
    run.release(DSQ_ROLE)
    r = np.random.default_rng(93)
    q, k, v, g = make_qkv(r, 1, 2, 1, 70, 150, 24)
    bias = r.standard_normal((1, 2, 1, 150)).astype(np.float32)
    mask = aa.Causal("bottom_right") & aa.Window(left=20)     # 21 keys a row: tiles skipped
    wrt = ("q", "k", "v", "bias")

    def device_call():
        dq, dk, dv, dg, db = (wg.asarray(x) for x in (q, k, v, g, bias))
        out, st = forward_with_stats(dq, dk, dv, bias=db, mask=mask)
        gr = aa.attention_backward(dq, dk, dv, dg, out=out, lse=st, bias=db, mask=mask,
                                   wrt=wrt)
        return [x.numpy() for x in (gr.dq, gr.dk, gr.dv, gr.dbias)]

    fresh = grads(be, q, k, v, g, None, mask, bias, wrt), device_call()
    need = 4 * 2 * 70 * 150
    assert need <= run.role_buffers[DSQ_ROLE].size < 4 * 2 * 160 * 160
    monkeypatch.setenv(ENV_VARIANT, "portable-dsq")
    grads(be, *make_qkv(np.random.default_rng(94), 1, 2, 1, 160, 160, 16), None, aa.Causal())
    monkeypatch.delenv(ENV_VARIANT)
    big = run.role_buffers[DSQ_ROLE]
    assert big.size >= 4 * 2 * 160 * 160
    run.poison()
    again_dev = device_call()
    run.poison()
    again = grads(be, q, k, v, g, None, mask, bias, wrt), again_dev
    assert run.role_buffers[DSQ_ROLE] is big
    assert not {"ds", "dev_ds"} & set(run.role_buffers)
    for a, b in zip(fresh, again):
        assert_same(a, b)
