"""The row statistics' public way in: forward_with_stats -> (out, RowStats), which
attention_backward takes without the plain lse's magnitude check."""
import numpy as np

import anyattn as aa


def test_forward_with_stats_is_public_and_feeds_the_backward():
    assert "forward_with_stats" in aa.__all__
    rng = np.random.default_rng(3)
    q, k, v, g = (rng.standard_normal((1, 2, 7, 4)) for _ in range(4))
    out, st = aa.forward_with_stats(q, k, v, mask=aa.Causal(), backend="reference")
    assert isinstance(st, aa.RowStats)
    np.testing.assert_allclose(out, aa.attention(q, k, v, mask=aa.Causal(),
                                                 backend="reference"), rtol=0, atol=0)
    a = aa.attention_backward(q, k, v, g, out=out, lse=st, mask=aa.Causal(),
                              backend="reference")
    b = aa.attention_backward(q, k, v, g, mask=aa.Causal(), backend="reference")
    for x, y in ((a.dq, b.dq), (a.dk, b.dk), (a.dv, b.dv)):
        np.testing.assert_allclose(x, y, rtol=1e-12, atol=1e-12)
