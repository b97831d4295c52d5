"""The block-range tables of Documents / KeepMask masks (tiles.block_ranges: what the
Hopper kernels walk) against their definition, row by row.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")


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
