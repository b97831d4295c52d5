"""Documents.from_lengths: packed sequences from their lengths (FlashAttention's
cu_seqlens as lengths)."""
import numpy as np
import pytest

import anyattn as aa


def test_from_lengths_is_documents_of_those_ids():
    rng = np.random.default_rng(0)
    lq, lk = [3, 0, 5, 2], [4, 2, 0, 6]
    q = rng.standard_normal((1, 2, sum(lq), 8))
    k, v = (rng.standard_normal((1, 2, sum(lk), 8)) for _ in range(2))
    m = aa.Documents.from_lengths(lq, lk)
    assert m.q_ids.tolist() == [0, 0, 0, 2, 2, 2, 2, 2, 3, 3]
    assert m.k_ids.tolist() == [0, 0, 0, 0, 1, 1, 3, 3, 3, 3, 3, 3]
    ids_q, ids_k = np.repeat(np.arange(4), lq), np.repeat(np.arange(4), lk)
    want = aa.attention(q, k, v, mask=aa.KeepMask(ids_q[:, None] == ids_k[None, :]),
                        backend="reference")
    assert np.allclose(aa.attention(q, k, v, mask=m), want, atol=1e-12)
    same = aa.Documents.from_lengths(np.array([2, 3]))
    assert same.q_ids.tolist() == same.k_ids.tolist() == [0, 0, 1, 1, 1]


def test_from_lengths_bad_input():
    with pytest.raises(ValueError, match="holds -1; lengths are >= 0"):
        aa.Documents.from_lengths([2, -1])
    with pytest.raises(TypeError, match="expected a 1-D sequence of ints"):
        aa.Documents.from_lengths([[1, 2]])
    with pytest.raises(TypeError, match="expected a 1-D sequence of ints"):
        aa.Documents.from_lengths([1.5, 2.0])
    with pytest.raises(ValueError, match="2 query lengths but 3 key lengths"):
        aa.Documents.from_lengths([1, 2], [1, 1, 1])
