"""Helpers of the numpy-backend tests: run the backend and the float64 reference, compare.

Shape legend: B batch, Hq/Hkv heads, Sq/Sk queries/keys, D head dim.
"""
from __future__ import annotations

import numpy as np

import anyattn as aa
from anyattn import reference as R

from helpers import TOL, assert_close, rel_err, term_magnitudes, to_np


def mask_cases(Hq, Sq, Sk, rng):
    """name -> mask of every kind (a keep mask with an empty row, row 3), for the
    per-feature test files.  Sq, Sk > 3."""
    keep = rng.random((Sq, Sk)) < 0.6
    keep[3] = False                                           # an empty row
    ids_q = np.sort(rng.integers(0, 3, Sq))
    ids_k = np.sort(rng.integers(0, 3, Sk))
    return {
        "causal_tl": aa.Causal(),
        "causal_br": aa.Causal("bottom_right"),
        "window": aa.Window(left=11, right=4),
        "window_br_causal": aa.Causal("bottom_right") & aa.Window(left=20,
                                                                   align="bottom_right"),
        "documents": aa.Documents(ids_q, ids_k),
        "causal_docs": aa.Causal() & aa.Documents(ids_q, ids_k),
        "keep": aa.KeepMask(keep),
        "keep_per_head": aa.KeepMask(rng.random((1, Hq, Sq, Sk)) < 0.5),
    }


def qkv(seed, B, Hq, Hkv, Sq, Sk, D, dtype="float64"):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Hq, Sq, D))
    k = rng.standard_normal((B, Hkv, Sk, D))
    v = rng.standard_normal((B, Hkv, Sk, D))
    g = rng.standard_normal((B, Hq, Sq, D))
    return tuple(x.astype(dtype) for x in (q, k, v, g))


def check(q, k, v, g, *, dtype, mask=None, bias=None, wrt=("q", "k", "v"), scale=None,
          tol=None, **kw):
    """numpy backend vs the reference: out, lse (-inf on exactly the empty rows), grads.

    Gradients that are exactly 0 in exact arithmetic (a bias broadcast over keys:
    sum_j dS_ij = 0; dq/dk when every row keeps a single key) hold only rounding
    noise in the reference: their error is measured against the summed magnitude of
    their terms (``helpers.term_magnitudes``), as in the shared contract suite.
    """
    tol = TOL[dtype] if tol is None else tol
    out, lse = aa.attention(q, k, v, mask=mask, bias=bias, scale=scale, return_lse=True,
                            backend="numpy", **kw)
    grads = aa.attention_backward(q, k, v, g, mask=mask, bias=bias, scale=scale, wrt=wrt,
                                  backend="numpy", **kw)
    ro, rl = R.forward(q, k, v, mask=mask, bias=bias, scale=scale, **kw)
    rg = R.backward(q, k, v, g, mask=mask, bias=bias, scale=scale, wrt=wrt, **kw)
    out_np, lse_np = to_np(out), to_np(lse)
    assert out_np.dtype == np.dtype(dtype) and out_np.shape == ro.shape
    assert lse_np.dtype == np.dtype("float64" if dtype == "float64" else "float32")
    assert not np.isnan(out_np).any(), "NaN in out"
    e = rel_err(out_np, ro)
    assert e <= tol, f"out: relative error {e:.3g} > {tol:.1g}"
    fin = np.isfinite(rl)
    assert np.array_equal(np.isfinite(lse_np), fin), "lse must be -inf exactly on empty rows"
    assert np.all(lse_np[~fin] == -np.inf)
    if fin.any():
        el = np.max(np.abs(lse_np[fin] - rl[fin])) / max(1.0, np.abs(rl[fin]).max())
        assert el <= tol, f"lse: error {el:.3g} > {tol:.1g}"
    assert np.all(out_np[~fin] == 0), "empty rows must give out = 0"
    mag = None
    for name in ("dq", "dk", "dv", "dbias"):
        got, ref = getattr(grads, name), getattr(rg, name)
        if ref is None:
            assert got is None, f"{name} computed though not requested"
            continue
        got = to_np(got)
        assert got.shape == ref.shape, (name, got.shape, ref.shape)
        assert not np.isnan(got).any(), f"NaN in {name}"
        if mag is None:
            mag = term_magnitudes(q, k, v, g, mask=mask, bias=bias, scale=scale,
                                  q_offset=kw.get("q_offset", 0), k_offset=kw.get("k_offset", 0))
        assert_close(got, ref, dtype, name, tol=tol, magnitude=mag[name])
    if grads.dq is not None:
        assert np.all(to_np(grads.dq)[~fin] == 0), "empty rows must give dq = 0"
    return out, lse, grads
