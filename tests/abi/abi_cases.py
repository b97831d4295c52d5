"""Shared builders for the ABI tests: logical inputs, masks with empty rows, checks.

Shape legend: B batch, H heads, Sq/Sk queries/keys, D head_dim, R output rows.
"""
from __future__ import annotations

import os

import numpy as np

from anyattn import abi as A
from anyattn import reference as R
from anyattn.backends.registry import unavailable_reason

from helpers import assert_close

#: the backend the ABI tests run on: 'numpy' once it is registered, else the reference;
#: ANYATTN_ABI_BACKEND=<name> picks another.  (test_default_backend_* covers backend=None.)
BACKEND = os.environ.get("ANYATTN_ABI_BACKEND") or (
    "numpy" if unavailable_reason("numpy") is None else "reference")


def inputs(rng, B, H, Sq, Sk, D):
    """q, dy [B, H, Sq, D]; k, v [B, H, Sk, D] as float32."""
    q = rng.standard_normal((B, H, Sq, D)).astype(np.float32)
    dy = rng.standard_normal((B, H, Sq, D)).astype(np.float32)
    k = rng.standard_normal((B, H, Sk, D)).astype(np.float32)
    v = rng.standard_normal((B, H, Sk, D)).astype(np.float32)
    return q, k, v, dy


def keep_values(rng, shape, empty_rows=True, nans=True):
    """A kind-2 mask (f32 0/1 values, some NaN = keep) with a few all-excluded rows."""
    m = (rng.random(shape) > 0.45).astype(np.float32)
    m[m == 1] = rng.choice(np.array([0.5, 1.0, 7.0], np.float32), size=int((m == 1).sum()))
    m[m == 0] = rng.choice(np.array([0.0, 0.49, -3.0], np.float32), size=int((m == 0).sum()))
    if nans and m.size > 3:
        m.reshape(-1)[rng.integers(0, m.size, 2)] = np.nan
    if empty_rows and shape[-2] > 1 and shape[-1] > 1:
        m[..., shape[-2] // 2, :] = 0.0          # one row of every (b, h): no key kept
        if m.ndim == 4 and shape[0] > 1:
            m[0, ..., 0, :] = 0.25               # and the first row of batch 0
    return m


def bias_values(rng, shape, empty_rows=True):
    """A kind-4 bias with -inf entries and (optionally) whole -inf rows."""
    b = rng.standard_normal(shape).astype(np.float32)
    b[rng.random(shape) < 0.2] = -np.inf
    if empty_rows and shape[-2] > 1:
        b[..., 0, :] = -np.inf
    return b


def mask_for(rng, kind, shape, empty_rows=True):
    if kind == A.MASK_KEEP:
        return keep_values(rng, shape, empty_rows)
    if kind == A.MASK_BIAS:
        return bias_values(rng, shape, empty_rows)
    return None


def out_index_mask(arena_len, params):
    """bool [arena_len]: True at every element the launch writes."""
    hit = np.zeros(arena_len, dtype=bool)
    for idx in params.regions()["out"].indices():
        hit[idx] = True
    return hit


def run_and_check(arena, params, q, k, v, dy, mask=None, backend=BACKEND, tol=None):
    """Run the ABI entry point; compare with reference.seed_backward; check that every
    output element was written (the arena's output holds NaN before) and that every
    other element is bitwise untouched.  -> the output [B, H, R, D]."""
    before = arena.copy()
    A.attention_backward_arena(arena, params, backend=backend)
    if isinstance(params, bytes):
        params = A.Params.unpack(params)
    got = A.read_output(arena, params)
    ref = R.seed_backward(q, k, v, dy, mask_kind=params.mask_kind, scale=params.scale,
                          mask=mask, window=params.window, wrt=params.wrt)
    assert_close(got, ref, "float32", f"kind {params.mask_kind} wrt {params.wrt}", tol=tol)
    outside = ~out_index_mask(arena.size, params)
    assert np.array_equal(arena.view(np.uint32)[outside], before.view(np.uint32)[outside]), \
        "an element outside the output changed"
    return got
