"""Non-finite inputs: NaN/Inf propagate as through a matmul, and no NumPy
RuntimeWarning leaks out of the numpy or the reference backend (their overflows and
inf - inf are internal: the results say what happened).  Shape legend: B batch,
H heads, S sequence, D head dim."""
from __future__ import annotations

import warnings

import numpy as np
import pytest

import anyattn as aa

from np_util import qkv

B, H, S, D = 1, 2, 40, 8


def _run(backend, q, k, v, g, bias, mask):
    wrt = ("q", "k", "v") + (() if bias is None else ("bias",))
    out, lse = aa.attention(q, k, v, bias=bias, mask=mask, return_lse=True, backend=backend)
    gr = aa.attention_backward(q, k, v, g, bias=bias, mask=mask, backend=backend, wrt=wrt)
    return dict(out=out, lse=lse, dq=gr.dq, dk=gr.dk, dv=gr.dv, dbias=gr.dbias)


@pytest.mark.parametrize("backend", ["numpy", "reference"])
@pytest.mark.parametrize("where", ["q", "k", "v"])
@pytest.mark.parametrize("value", [np.inf, -np.inf, np.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("variant", ["plain", "bias", "causal", "tiles"])
def test_nonfinite_input_raises_no_warning(np_config, backend, where, value, variant):
    """One non-finite entry in q, k or v: no RuntimeWarning (``simplefilter("error")``
    turns any into an exception, in the worker threads too); the output row that
    reads the bad entry is non-finite, the head it cannot reach stays finite, and
    entries finite here and in the float64 reference (warnings ignored) agree."""
    if variant == "tiles":                     # several tiles and workers
        np_config(fwd_bq=16, fwd_bk=16, bwd_bq=16, bwd_bk=16, threads=2)
    q, k, v, g = qkv(4, B, H, H, S, S, D, dtype="float32")
    dict(q=q, k=k, v=v)[where][0, 0, 3, 2] = value
    bias = (np.random.default_rng(1).standard_normal((B, H, S, S)).astype(np.float32)
            if variant == "bias" else None)
    mask = aa.Causal() if variant in ("causal", "tiles") else None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = _run(backend, q, k, v, g, bias, mask)
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        want = _run("reference", *(x.astype(np.float64) for x in (q, k, v, g)),
                    None if bias is None else bias.astype(np.float64), mask)
    for name, x in got.items():
        if x is None:
            continue
        x, w = np.asarray(x, np.float64), np.asarray(want[name])
        both = np.isfinite(x) & np.isfinite(w)        # finite entries are right
        np.testing.assert_allclose(x[both], w[both], rtol=1e-4, atol=1e-4, err_msg=name)
        assert np.isfinite(x[:, 1]).all(), name       # the head never reached: finite
    row = got["out"][0, 0, 3]                         # the row that reads the bad entry
    if where in ("q", "v"):      # (a bad k only has to mix +inf and -inf scores)
        assert not np.isfinite(row).all(), row        # propagated, not swallowed
