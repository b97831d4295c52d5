"""The NumPy backend finds mask terms and modifiers through tables keyed by feature name
(numpy_tiles.TILE_TERMS, numpy_backend.MODIFIER_STEPS); its capabilities are those keys."""
import numpy as np
import pytest

import anyattn as aa
from anyattn import features
from anyattn.backends.numpy_backend import MODIFIER_STEPS, NumpyBackend
from anyattn.backends.numpy_tiles import TILE_TERMS, TilePlan
from anyattn.masks import TERM_KINDS, resolve

B, H, SQ, SK = 2, 3, 37, 45
RNG = np.random.default_rng(5)
MASKS = {
    "band": aa.Causal() & aa.Window(left=7, right=2),
    "documents": aa.Documents(RNG.integers(0, 4, (B, SQ)), RNG.integers(0, 4, (1, SK))),
    "keep": aa.KeepMask(RNG.random((B, 1, SQ, SK)) > 0.4),
    "keep-row": aa.KeepMask(RNG.random((1, H, 1, SK)) > 0.4),
}


def test_capabilities_are_the_tables_keys():
    c = NumpyBackend.capabilities
    assert c.mask_terms == set(TILE_TERMS) == set(TERM_KINDS)
    assert c.modifiers == set(MODIFIER_STEPS) == features.MODIFIERS


@pytest.mark.parametrize("name", sorted(MASKS))
def test_each_tile_function_is_the_cores_rule_transposed(name):
    rm = resolve(MASKS[name], B, H, SQ, SK, q_offset=4, k_offset=1)
    (term,) = rm.terms
    plan = TilePlan(bq=16, bk=16, sq=SQ, sk=SK, dtype=np.dtype(np.float32), mask=rm,
                    bias=None, codes=None)
    want = np.broadcast_to(rm.dense_keep(B, H), (B, H, SQ, SK))
    for b in range(B):
        for h in range(H):
            for i0, i1, j0, j1 in ((0, 16, 0, 16), (16, 32, 32, 45), (32, 37, 5, 21)):
                ex = np.broadcast_to(TILE_TERMS[term](plan, b, h, i0, i1, j0, j1),
                                     (j1 - j0, i1 - i0))
                assert np.array_equal(ex, ~want[b, h, i0:i1, j0:j1].T), (name, b, h)


def test_excluded_t_of_every_term_together_is_the_dense_pattern():
    mask = MASKS["band"] & MASKS["documents"] & MASKS["keep"] & MASKS["keep-row"]
    rm = resolve(mask, B, H, SQ, SK)
    assert rm.terms == ("band", "documents", "keep")
    plan = TilePlan(bq=16, bk=16, sq=SQ, sk=SK, dtype=np.dtype(np.float32), mask=rm,
                    bias=None, codes=None)
    want = np.broadcast_to(rm.dense_keep(B, H), (B, H, SQ, SK))
    for b in range(B):
        for h in range(H):
            ex = plan.excluded_t(b, h, 3, 30, 10, 41)
            assert ex.shape == (31, 27) and ex.flags.c_contiguous
            assert np.array_equal(ex, ~want[b, h, 3:30, 10:41].T)
