"""Block-range lowering of Documents / KeepMask masks (launch.set_mask_lowering("ranges"),
kernels' MODE 2): the range tables, and out / lse / gradients vs the float64 reference.

Runs through Triton's interpreter on CPU tensors (tests/conftest.py) with the fixed test
plan (tiles 16 / 32, mask blocks 32, so each block is two sub-tiles).
Shape legend: B batch, Hq/Hkv heads, Sq/Sk queries/keys, D head dim.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import anyattn as aa  # noqa: E402
from anyattn import reference as R  # noqa: E402

from helpers import assert_close, make_qkv, np_mask, to_np  # noqa: E402
from tr_util import DEV, needs_triton, T  # noqa: E402


@pytest.fixture
def ranges():
    from anyattn.backends.triton import launch

    launch.set_mask_lowering("ranges")
    yield launch
    launch.set_mask_lowering(None)


def _ranges_brute(part, full):
    """The table _block_ranges documents, row by row in Python."""
    out = np.zeros(part.shape[:-1] + (4,), dtype=np.int64)
    for idx in np.ndindex(*part.shape[:-1]):
        kept = np.flatnonzero(part[idx] | full[idx])
        if kept.size == 0:
            continue
        t0, t1 = kept[0], kept[-1] + 1
        fl = np.flatnonzero(full[idx])
        if fl.size == 0:
            f0 = f1 = t0
        else:
            f0 = f1 = fl[0]
            while f1 < part.shape[-1] and full[idx][f1]:
                f1 += 1
        out[idx] = (t0, f0, f1, t1)
    return out


def test_block_ranges_match_their_definition():
    from anyattn.backends.triton.tiles import block_ranges as _block_ranges

    rng = np.random.default_rng(0)
    for shape in ((1, 1, 7, 9), (2, 3, 5, 4), (1, 1, 4, 1)):
        code = rng.integers(0, 3, shape)          # 0 empty, 1 partial, 2 full
        code[..., 0, :] = 0                       # an empty row
        if shape[-2] > 2:
            code[..., 1, :] = 1                   # a row without full blocks
        part, full = code == 1, code == 2
        got = _block_ranges(torch.from_numpy(part), torch.from_numpy(full))
        assert got.dtype == torch.int32
        assert np.array_equal(got.numpy(), _ranges_brute(part, full))


def test_unknown_lowering_refused_naming_the_choices():
    from anyattn.backends.triton import launch

    with pytest.raises(ValueError, match="'lists'.*'ranges'"):
        launch.set_mask_lowering("intervals")


def _check(q, k, v, g, mask, dtype="float32"):
    """Forward + backward on triton vs the float64 reference; bitwise repeatable."""
    qt, kt, vt, gt = (T(x) for x in (q, k, v, g))
    out, lse = aa.attention(qt, kt, vt, mask=mask, return_lse=True, backend="triton")
    gr = aa.attention_backward(qt, kt, vt, gt, mask=mask, backend="triton")
    rm = np_mask(mask)
    ro, rl = R.forward(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                       mask=rm)
    rg = R.backward(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
                    g.astype(np.float64), mask=rm)
    assert_close(out, ro, dtype, "out")
    assert np.array_equal(np.isfinite(to_np(lse)), np.isfinite(rl)), "lse -inf on empty rows"
    for n in ("dq", "dk", "dv"):
        assert_close(getattr(gr, n), getattr(rg, n), dtype, n)
    again = aa.attention_backward(qt, kt, vt, gt, mask=mask, backend="triton")
    for n in ("dq", "dk", "dv"):
        assert torch.equal(getattr(gr, n), getattr(again, n)), n
    return gr


def _docs(rng, B, S, lengths):
    """Sorted ids [B, S]: documents of the given lengths (cycled), per batch row shifted."""
    ids = np.zeros((B, S), dtype=np.int32)
    for b in range(B):
        pos, d = 0, 0
        while pos < S:
            n = lengths[(d + b) % len(lengths)]
            ids[b, pos:pos + n] = d
            pos, d = pos + n, d + 1
    return ids


@needs_triton
@pytest.mark.parametrize("causal", [False, True])
def test_documents_with_full_and_partial_blocks(ranges, causal):
    """Long and short documents (full blocks, runs of them, partial edges), batch-varying
    ids, Sq != Sk with bottom-right causal, GQA; the range tables are exact here."""
    rng = np.random.default_rng(1)
    B, Hq, Hkv, Sq, Sk = 2, 2, 1, 72, 104
    q, k, v, g = make_qkv(rng, B, Hq, Hkv, Sq, Sk, 16)
    qi = _docs(rng, B, Sq, (66, 5, 13))
    ki = _docs(rng, B, Sk, (70, 9, 25))
    mask = aa.Documents(T(qi), T(ki))
    if causal:
        mask = mask & aa.Causal("bottom_right")
    _check(q, k, v, g, mask)
    from anyattn.problem import describe

    p = describe(T(q), T(k), T(v), mask=mask)
    tl = ranges.tile_lists(p, ranges.tiles.mask_args(p, T(q), None), 32, 32, torch.device(DEV))
    assert tl.mode == 2 and tuple(tl.row_cnt.shape) == (B, 1, 3, 4)
    assert tuple(tl.col_cnt.shape) == (B, 1, 4, 4)
    codes = p.mask.tile_map(32, 32)                    # core's NumPy tile map [B, 1, nQ, nK]
    rr = to_np(tl.row_cnt)
    assert ((codes == 2).sum(-1) >= 2).any(), "the case should have a run of full blocks"
    for b in range(B):
        for r in range(codes.shape[2]):
            t0, f0, f1, t1 = rr[b, 0, r]
            kept = np.flatnonzero(codes[b, 0, r] > 0)
            if kept.size:
                assert t0 == kept[0] and t1 == kept[-1] + 1
            assert (codes[b, 0, r, f0:f1] == 2).all()   # the unmasked run is full


@needs_triton
def test_documents_with_empty_rows_and_scattered_keepmask(ranges):
    """Query ids with no key (empty rows: out 0, lse -inf) and a KeepMask whose kept
    blocks are scattered (its ranges visit empty blocks, masked)."""
    rng = np.random.default_rng(2)
    B, Sq, Sk = 1, 64, 96
    q, k, v, g = make_qkv(rng, B, 2, 2, Sq, Sk, 16)
    qi = np.sort(rng.integers(0, 3, (B, Sq)), axis=1)
    ki = np.sort(rng.integers(1, 3, (B, Sk)), axis=1)       # id 0: no keys
    _check(q, k, v, g, aa.Documents(T(qi), T(ki)))
    blocks = rng.random((2, 3)) < 0.5
    blocks[0, 1] = False
    blocks[0, 0] = blocks[0, 2] = True                        # a gap inside row 0's range
    keep = np.repeat(np.repeat(blocks, 32, 0), 32, 1)[:Sq, :Sk]
    keep[5, :] = False                                        # one empty row
    keep[40, 7] = False                                       # a partial block
    _check(q, k, v, g, aa.KeepMask(torch.from_numpy(keep).to(DEV)))
