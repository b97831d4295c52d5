"""webgpu ``*-dsq`` kernel variants (launch.VARIANTS): the 5-product backward.

The dK/dV pass also stores dS [B, HQ, SQ, SK] (f32) into a scratch buffer (DSQ_OUT),
and the dQ pass reads it back and computes only dQ = scale * dS.K (DSQ_IN) instead of
recomputing S and dP.  The dS bits are the ones the base variant's dQ pass computes and
the dQ sums run in the same order, so every result equals the base variant's bit for bit:

* portable-dsq on the adapter's tiles: mask, bias (not differentiated: the dsq path
  runs), GQA, odd sizes, D = 40; the dsq path is checked to be the one taken;
* with dbias the dQ pass recomputes (its own dS for dbias): portable's bits, dbias too;
* a split launch (loop budget) continues from f32 partials: one launch's bits;
* against float64 through the API: causal GQA with empty rows, softcap + ALiBi + sinks
  (+ dsinks), dropout;
* f16 (HALF): portable's bits, and float64's tolerance;
* wide-dsq on the H200's tiles (RM = 8, ALIAS) is wide's bits;
* the table takes a dsq entry only where its scratch (one chunk of it) is known to fit;
  a forced dsq variant whose one (batch, KV head) chunk is past the cap is a ValueError
  naming the bytes (chunking, the shared scratch: test_webgpu_dsq_chunks.py).
Small sizes: each distinct config compiles its own pipelines on lavapipe.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

import anyattn as aa
from anyattn.backends.webgpu import launch
from anyattn.backends.webgpu.launch import ENV_VARIANT, choose_config

from helpers import compare_with_reference, make_qkv
from wg_util import (GPU_TILE, assert_bitwise_and_close, assert_same, backward_call,
                     base_and_dsq, grads, modifiers_case, one_unit_loop_limit)


def test_dsq_is_bitwise_portable(be):
    """mask, a (1, H, Sq, Sk) bias (not differentiated), GQA, Sq != Sk off the tiles,
    D = 40: every bit of dq, dk, dv equals portable's, and the 5-product path ran (the
    dK/dV and dQ launches bind the dS scratch, the dQ pass built with DSQ_IN)."""
    base, dsq = base_and_dsq(be, 40)
    r = np.random.default_rng(61)
    q, k, v, g = make_qkv(r, 2, 4, 2, 37, 70, 40)
    bias = r.standard_normal((1, 4, 37, 70)).astype(np.float32)
    mask = aa.Causal("bottom_right") & aa.Window(left=40)
    assert_same(grads(be, q, k, v, g, base, mask, bias), grads(be, q, k, v, g, dsq, mask, bias))
    # the path taken: dS scratch bound by both passes
    call = backward_call(be, q, k, v, g, dsq, mask, bias)
    assert call.dsq_buf is not None and call.dsq_buf.size >= 4 * 2 * 4 * 37 * 70
    assert call.dsq_buf.size >= 4 * 2 * 4 * 37 * call.nkt * dsq.BK     # tile order, padded
    bound = {lch.kernel: lch.buffers[9] for lch in call.launches if lch.layout == "tile"}
    assert bound["bwd_dkdv"] is call.dsq_buf and bound["bwd_dq"] is call.dsq_buf


def test_dsq_with_dbias_recomputes(be):
    """With dbias wanted the dQ pass computes its own dS (written for the reduction):
    portable's bits, dbias included; no dS scratch."""
    base, dsq = base_and_dsq(be, 24)
    r = np.random.default_rng(62)
    q, k, v, g = make_qkv(r, 1, 2, 2, 21, 33, 24)
    bias = r.standard_normal((1, 2, 1, 33)).astype(np.float32)
    wrt = ("q", "k", "v", "bias")
    assert_same(grads(be, q, k, v, g, base, aa.Causal(), bias, wrt),
                grads(be, q, k, v, g, dsq, aa.Causal(), bias, wrt))


def test_dsq_split_launches_bitwise(be, monkeypatch):
    """Launches split at the loop budget: one launch's bits (and portable's)."""
    r = np.random.default_rng(63)
    q, k, v, g = make_qkv(r, 1, 4, 2, 70, 300, 24)
    base, dsq = base_and_dsq(be, 24)
    kw = dict(mask=aa.Causal("bottom_right"))
    ref = grads(be, q, k, v, g, base, **kw)
    one = grads(be, q, k, v, g, dsq, **kw)
    be.loop_limit_override = one_unit_loop_limit(dsq, 24)
    split = grads(be, q, k, v, g, dsq, **kw)
    assert be.last_pieces["bwd_dq"] > 1 and be.last_pieces["bwd_dkdv"] > 1
    assert_same(one, split)
    assert_same(ref, one)


def test_dsq_against_float64(be, monkeypatch):
    """Through the API (ANYATTN_WEBGPU_VARIANT=portable-dsq): causal GQA with empty
    rows, softcap + ALiBi + sinks (+ dsinks), dropout, odd D."""
    q, k, v, g, kw = modifiers_case(64, 20)
    monkeypatch.setenv(ENV_VARIANT, "portable-dsq")
    compare_with_reference("webgpu", q, k, v, g, wrt=("q", "k", "v", "sinks"), **kw)


def test_dsq_f16(be):
    """f16 (HALF): the dQ update from the stored dS converts it to f16 as the recomputing
    pass does: portable f16's bits, within float64's f16 tolerance (backward alone from
    the float64 out / lse: one f16 compile less)."""
    if not be.context.has_f16:
        pytest.skip("no shader-f16")
    q, k, v, g = make_qkv(np.random.default_rng(65), 1, 4, 2, 45, 70, 24, dtype="float16")
    base, dsq = base_and_dsq(be, 24, "f16")
    assert_bitwise_and_close(be, q, k, v, g, base, dsq, aa.Causal())


def test_wide_dsq_is_bitwise_wide(be):
    """The H200's tiles with RM = 8 and the aliased tiles: wide-dsq computes wide's bits
    (mask, GQA, odd sizes, D = 40; ~1 min of llvmpipe compiles cold)."""
    r = np.random.default_rng(66)
    q, k, v, g = make_qkv(r, 1, 4, 2, 37, 150, 40)
    mask = aa.Causal("bottom_right") & aa.Window(left=90)
    fwd = dataclasses.replace(GPU_TILE, variant="staged", IC=16, UC=8)
    fwd.check()
    res = []
    for var in ("wide", "wide-dsq"):
        bwd = dataclasses.replace(fwd, variant=var, RM=8)
        bwd.check()
        res.append(grads(be, q, k, v, g, bwd, mask, cfg_f=fwd))
    assert_same(*res)


def test_dsq_table_and_cap(be, monkeypatch):
    """A dsq table entry applies only where the scratch is known to fit (SK given, within
    DSQ_MAX_BYTES and the binding limit); a forced dsq past it is a ValueError."""
    gpu = SimpleNamespace(is_cpu=False, has_subgroups=False, name="fake GPU",
                          limits={"max-compute-workgroup-storage-size": 49152,
                                  "max-compute-invocations-per-workgroup": 1024,
                                  "max-storage-buffer-binding-size": 1 << 31,
                                  "max-buffer-size": 1 << 40})
    # the table itself (H200 2026-12-04): wide-dsq where its dQ grid fills the GPU, else
    # staged-dsq; f16 portable-dsq; a scratch past the binding limit: the 7-product kernels
    real = lambda rows, elem="f32": choose_config(gpu, 128, elem, True, rows=rows).variant  # noqa: E731
    assert real((8, 4096, 4096)) == "wide-dsq" and real((8, 1024, 1024)) == "staged-dsq"
    assert real((8, 4096, 4096), "f16") == "portable-dsq"
    assert real((8, 16384, 16384)) == "wide" and real((8, 16384, 16384), "f16") == "portable"
    monkeypatch.setattr(launch, "VARIANT_TABLE", (
        ((False, False, "f32", 0), "wide-dsq"), ((False, False, None, 0), "staged")))
    monkeypatch.setattr(launch, "DSQ_MAX_BYTES", 1 << 20)
    pick = lambda rows: choose_config(gpu, 64, backward=True, rows=rows).variant  # noqa: E731
    assert pick((8, 256, 128)) == "wide-dsq"          # 1 MiB: fits
    assert pick((8, 256, 129)) == "staged"            # past the cap
    assert pick((8, 256)) == "staged" and pick(None) == "staged"   # unknown SK
    # G = HQ / HKV known (the backend passes it): one chunk of G query heads must fit
    assert pick((8, 256, 129, 1)) == "wide-dsq" and pick((8, 256, 129, 8)) == "staged"
    q, k, v, g = make_qkv(np.random.default_rng(67), 1, 4, 2, 40, 40, 8)
    bk = choose_config(be.context, 8, variant="portable-dsq").BK
    need = 4 * 2 * 40 * (-(-40 // bk) * bk)           # one KV row: G = 2, SK padded
    monkeypatch.setattr(launch, "DSQ_MAX_BYTES", need - 4)
    monkeypatch.setenv(ENV_VARIANT, "portable-dsq")
    out, lse = aa.attention(q, k, v, return_lse=True, backend="webgpu")
    with pytest.raises(ValueError, match=f"dS scratch needs {need} bytes for one"):
        aa.attention_backward(q, k, v, g, out=out, lse=lse, backend="webgpu")
