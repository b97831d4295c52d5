"""Mask terms: semantics, composition, tile maps against the dense pattern."""
import numpy as np
import pytest

import anyattn as aa
from anyattn.masks import TILE_EMPTY, TILE_FULL, TILE_PARTIAL, resolve


def dense(mask, B=1, H=1, Sq=7, Sk=9):
    return np.broadcast_to(resolve(mask, B, H, Sq, Sk).dense_keep(B, H), (B, H, Sq, Sk))


def test_causal_alignments():
    i, j = np.arange(5)[:, None], np.arange(8)[None]
    assert np.array_equal(dense(aa.Causal(), Sq=5, Sk=8)[0, 0], j <= i)
    assert np.array_equal(dense(aa.Causal("bottom_right"), Sq=5, Sk=8)[0, 0], j <= i + 3)


def test_window_and_seed_kind3():
    i, j = np.arange(9)[:, None], np.arange(9)[None]
    w = 3
    m = dense(aa.Causal() & aa.Window(left=w), Sq=9, Sk=9)[0, 0]
    assert np.array_equal(m, (j <= i) & (i - j <= w))
    assert m.sum(axis=1).max() == w + 1
    m2 = dense(aa.Window(left=1, right=2), Sq=9, Sk=9)[0, 0]
    assert np.array_equal(m2, (i - j <= 1) & (j - i <= 2))


def test_offsets_shift_band():
    r = resolve(aa.Causal(), 1, 1, 4, 4, q_offset=8, k_offset=4)
    assert r.band_hi == 4  # key 4+j visible to query 8+i iff j <= i + 4


def test_documents_and_keep():
    qi = np.array([0, 0, 1, 1, 2])
    ki = np.array([0, 1, 1, 2])
    m = dense(aa.Documents(qi, ki), Sq=5, Sk=4)[0, 0]
    assert np.array_equal(m, qi[:, None] == ki[None])
    keep = np.random.default_rng(0).random((2, 1, 5, 4)) < 0.5
    m = dense(aa.KeepMask(keep) & aa.Documents(qi, ki), B=2, H=3, Sq=5, Sk=4)
    assert np.array_equal(m, np.broadcast_to(keep & (qi[:, None] == ki[None]), m.shape))


def test_two_document_terms_combine():
    a = aa.Documents(np.array([0, 0, 1, 1]))
    b = aa.Documents(np.array([5, 6, 6, 6]))
    m = dense(a & b, Sq=4, Sk=4)[0, 0]
    ids = [(0, 5), (0, 6), (1, 6), (1, 6)]
    ref = np.array([[x == y for y in ids] for x in ids])
    assert np.array_equal(m, ref)


MASKS = {
    "causal": aa.Causal(),
    "br": aa.Causal("bottom_right"),
    "win": aa.Window(left=9, right=4),
    "docs": aa.Documents(np.sort(np.random.default_rng(1).integers(0, 4, 50)),
                         np.sort(np.random.default_rng(2).integers(0, 4, 70))),
    "keep": aa.KeepMask(np.random.default_rng(3).random((2, 1, 50, 70)) < 0.02),
    "combo": aa.Causal() & aa.KeepMask(np.random.default_rng(4).random((50, 70)) < 0.9),
}


@pytest.mark.parametrize("name", list(MASKS))
@pytest.mark.parametrize("tiles", [(8, 16), (16, 16), (7, 5)])
def test_tile_map_matches_dense(name, tiles):
    bq, bk = tiles
    r = resolve(MASKS[name], 2, 3, 50, 70)
    full = np.broadcast_to(r.dense_keep(2, 3), (2, 3, 50, 70))
    tm = np.broadcast_to(r.tile_map(bq, bk), (2, 3, -(-50 // bq), -(-70 // bk)))
    for t in range(tm.shape[2]):
        for u in range(tm.shape[3]):
            blk = full[:, :, t * bq:(t + 1) * bq, u * bk:(u + 1) * bk]
            want = np.where(blk.all(axis=(2, 3)), TILE_FULL,
                            np.where(blk.any(axis=(2, 3)), TILE_PARTIAL, TILE_EMPTY))
            assert np.array_equal(tm[:, :, t, u], want), (t, u)
    assert r.tile_map(bq, bk) is r.tile_map(bq, bk)  # memoised


@pytest.mark.parametrize("name", ["causal", "br", "win"])
def test_band_tile_range_covers_kept(name):
    r = resolve(MASKS[name], 1, 1, 50, 70)
    full = r.dense_keep(1, 1)[0, 0]
    for i0 in range(0, 50, 8):
        t0, t1 = r.band_tile_range(i0, min(i0 + 8, 50), 16)
        cols = np.nonzero(full[i0:i0 + 8].any(axis=0))[0]
        if cols.size:
            assert t0 <= cols.min() // 16 and cols.max() // 16 < t1


def test_mask_errors():
    with pytest.raises(ValueError, match="align"):
        aa.Causal("middle")
    with pytest.raises(ValueError, match="left"):
        aa.Window(left=-1)
    with pytest.raises(TypeError, match="right"):
        aa.Window(right=1.5)
    with pytest.raises(TypeError, match="bool"):
        aa.KeepMask(np.ones((3, 3)))
    with pytest.raises(TypeError, match="integer"):
        aa.Documents(np.ones(3))
    with pytest.raises(ValueError, match="broadcast"):
        resolve(aa.KeepMask(np.ones((4, 4), bool)), 1, 1, 5, 4)
    with pytest.raises(ValueError, match="Documents"):
        resolve(aa.Documents(np.zeros(3, np.int32)), 1, 1, 5, 5)
    with pytest.raises(TypeError, match="mask"):
        resolve(np.ones((3, 3), bool), 1, 1, 3, 3)


def test_masks_hashable_and_value_equal():
    assert aa.Causal() == aa.Causal() and hash(aa.Causal()) == hash(aa.Causal())
    assert aa.Window(left=3) != aa.Window(left=4)
    km = aa.KeepMask(np.ones((2, 2), bool))
    assert km == km and km != aa.KeepMask(np.ones((2, 2), bool))
    assert len({aa.Causal() & aa.Window(left=2), aa.Causal() & aa.Window(left=2)}) == 1


# ------------------------------------- issue "First hour", item 6: arrays as mask terms
def _same_terms(a, b):
    """Two compositions with the same terms in the same order (arrays by identity)."""
    ta, tb = a.terms, b.terms
    return len(ta) == len(tb) and all(
        type(x) is type(y) and (x.mask is y.mask if isinstance(x, aa.KeepMask) else x == y)
        for x, y in zip(ta, tb))


def test_boolean_array_in_and_is_a_keep_mask_term_on_either_side():
    """Causal() & m was a bare TypeError ('unsupported operand'); m & Causal() too."""
    m = np.random.default_rng(5).random((7, 9)) < 0.6
    w = aa.Window(left=3)
    assert _same_terms(aa.Causal() & m, aa.Causal() & aa.KeepMask(m))
    assert _same_terms(m & aa.Causal(), aa.KeepMask(m) & aa.Causal())
    assert _same_terms(aa.Causal() & m & w, aa.Causal() & aa.KeepMask(m) & w)
    assert _same_terms(m & (aa.Causal() & w), aa.KeepMask(m) & aa.Causal() & w)
    i, j = np.arange(7)[:, None], np.arange(9)[None]
    assert np.array_equal(dense(m & aa.Causal())[0, 0], m & (j <= i))
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((1, 2, s, 8)).astype(np.float32) for s in (7, 9, 9))
    want = aa.attention(q, k, v, mask=aa.Causal() & aa.KeepMask(m), backend="reference")
    for mask in (aa.Causal() & m, m & aa.Causal()):
        np.testing.assert_array_equal(aa.attention(q, k, v, mask=mask, backend="reference"),
                                      want)


@pytest.mark.parametrize("dtype", [np.float32, np.int64, np.uint8])
def test_non_boolean_array_in_and_names_the_remedy(dtype):
    m = np.ones((7, 9), dtype)
    for build in (lambda: aa.Causal() & m, lambda: m & aa.Causal()):
        with pytest.raises(TypeError, match=r"mask & array: the array has dtype .*"
                                            r"KeepMask\(m\.astype\(bool\)\).*bias="):
            build()


def test_or_of_mask_terms_is_the_union_on_either_side_of_an_array():
    """'|' keeps a pair iff either side keeps it, lowered to one mask function; a bool
    array on either side is a KeepMask (NumPy used to apply '|' element by element)."""
    m = np.zeros((7, 9), bool)
    m[:, 8] = True
    i, j = np.arange(7)[:, None], np.arange(9)[None, :]
    causal = j <= i
    window = (i - j <= 2) & (j - i <= 0)
    for mask, want in ((aa.Causal() | aa.Window(left=2, right=0), causal | window),
                       (aa.Causal() | m, causal | m), (m | aa.Causal(), m | causal),
                       ((aa.Causal() | m) & aa.Window(left=2), (causal | m) & (i - j <= 2))):
        rm = resolve(mask, 1, 1, 7, 9)
        assert "mask_mod" in rm.terms
        np.testing.assert_array_equal(rm.dense_keep(1, 1)[0, 0], want)
    with pytest.raises(TypeError, match="does not support ufuncs"):
        np.logical_and(m, aa.Causal())


def test_mask_class_instead_of_instance_is_named():
    """mask=Causal (the class) failed with 'Causal._lower() missing 1 required ...'."""
    with pytest.raises(TypeError, match=r"mask: got the class Causal.*mask=Causal\(\)"):
        resolve(aa.Causal, 1, 1, 3, 3)
