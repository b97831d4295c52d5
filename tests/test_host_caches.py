"""The host-side caches of one call (session 6, core host work): each holds every input
that changes the result, field by field.

- ``arrays.dtype_name``: a name per dtype object (byte order, structured dtypes, torch
  dtypes stay apart);
- ``anyattn.torch`` eager: a Documents / KeepMask call's Problem is kept per signature
  without the mask's tensors; every call runs on its own tensors' current contents
  (in-place mutation, new tensors, new shapes, strides, dtypes).
"""
from __future__ import annotations

import numpy as np
import pytest

import anyattn
from anyattn.api import _check_stats
from anyattn.arrays import _DTYPE_NAMES, dtype_name
from anyattn.rowstats import RowStats


def test_dtype_name_per_dtype_object():
    names = {"float32": "float32", "<f4": "float32", ">f4": ">f4", "float16": "float16",
             "float64": "float64", "int32": "int32", "bool": "bool"}
    for _ in range(2):                                    # cold, then from the memo
        for spec, want in names.items():
            assert dtype_name(np.zeros(1, spec)) == want == str(np.dtype(spec))
    st = np.dtype([("a", "<f4")])
    assert dtype_name(np.zeros(1, st)) == str(st)
    assert st not in _DTYPE_NAMES and np.dtype(">f4") not in _DTYPE_NAMES
    assert dtype_name(np.zeros(1, ">f4")) != dtype_name(np.zeros(1, "<f4"))


def test_dtype_name_torch_apart_from_numpy():
    torch = pytest.importorskip("torch")
    for _ in range(2):
        assert dtype_name(torch.zeros(1, dtype=torch.bfloat16)) == "bfloat16"
        assert dtype_name(torch.zeros(1, dtype=torch.float32)) == "float32"
        assert dtype_name(torch.zeros(1, dtype=torch.float16)) == "float16"
        assert dtype_name(np.zeros(1, np.float16)) == "float16"


def test_check_stats_refuses_mixed_libraries():
    torch = pytest.importorskip("torch")
    a = np.zeros((1, 2, 3), np.float32)
    _check_stats(RowStats(a, a.copy()))
    with pytest.raises(ValueError, match="differ"):
        _check_stats(RowStats(a, torch.zeros(1, 2, 3)))
    with pytest.raises(ValueError, match="differ"):
        _check_stats(RowStats(a, a.astype(np.float64)))


# ------------------------------------------------------------- torch eager tensor masks

def _torch():
    return pytest.importorskip("torch")


def _qkv(torch, B=2, H=2, Sq=13, Sk=17, D=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, S, D, generator=g, dtype=torch.float64, requires_grad=True)
            for S in (Sq, Sk, Sk)]


def _step(torch, mask, qkv, backend="numpy"):
    """out and (dq, dk, dv) of one eager call (fresh grads)."""
    import anyattn.torch as at

    q, k, v = qkv
    for x in qkv:
        x.grad = None
    out = at.attention(q, k, v, mask=mask, backend=backend)
    out.backward(torch.ones_like(out) * 0.5 + out.detach())
    return out.detach().clone(), tuple(x.grad.clone() for x in qkv)


def _uncached(torch, mask, qkv):
    from anyattn.torch import eager

    eager.clear_caches()
    try:
        return _step(torch, mask, qkv)
    finally:
        eager.clear_caches()


def _same(a, b):
    (oa, ga), (ob, gb) = a, b
    assert torch_equal(oa, ob) and all(torch_equal(x, y) for x, y in zip(ga, gb))


def torch_equal(a, b):
    import torch

    return torch.equal(a, b)


def _warm(torch, mask, qkv):
    """Calls that fill the signature cache (two: the first stores, the second hits)."""
    from anyattn.torch import eager

    _step(torch, mask, qkv)
    assert eager._problems, "the call was cached"
    return _step(torch, mask, qkv)


def test_documents_ids_mutated_in_place_are_seen():
    torch = _torch()
    qkv = _qkv(torch)
    qi, ki = torch.arange(13) // 5, torch.arange(17) // 6
    m = anyattn.Documents(qi, ki)
    _warm(torch, m, qkv)
    qi[4:9] = 7                   # torch in-place
    ki[5:12] = 7
    got = _step(torch, m, qkv)
    _same(got, _uncached(torch, m, qkv))
    qi.numpy()[:] = 0             # through NumPy: no torch version bump
    ki.numpy()[:] = np.arange(17) % 2
    got = _step(torch, m, qkv)
    _same(got, _uncached(torch, m, qkv))


def test_documents_new_tensors_shapes_strides_dtypes():
    torch = _torch()
    qkv = _qkv(torch)
    base = anyattn.Documents(torch.arange(13) // 5, torch.arange(17) // 6)
    _warm(torch, base, qkv)
    variants = [
        anyattn.Documents(torch.arange(13) // 4, torch.arange(17) // 4),              # new
        anyattn.Documents(torch.stack([torch.arange(13) // 5, torch.arange(13) // 3]),
                          torch.stack([torch.arange(17) // 6, torch.arange(17) // 2])),  # [B,S]
        anyattn.Documents((torch.arange(26) // 5)[::2], (torch.arange(34) // 6)[::2]),  # strided
        anyattn.Documents((torch.arange(13) // 5).to(torch.int32),
                          (torch.arange(17) // 6).to(torch.int32)),                     # dtype
        anyattn.Documents(torch.arange(13) // 5, torch.arange(17) // 6) & anyattn.Causal(),
    ]
    for m in variants:
        for _ in range(2):
            got = _step(torch, m, qkv)
        _same(got, _uncached(torch, m, qkv))
    with pytest.raises(ValueError, match="does not fit"):
        _step(torch, anyattn.Documents(torch.arange(12), torch.arange(17)), qkv)


def test_keep_mask_mutated_and_replaced():
    torch = _torch()
    qkv = _qkv(torch)
    g = torch.Generator().manual_seed(1)
    keep = torch.rand(2, 1, 13, 17, generator=g) > 0.3
    m = anyattn.KeepMask(keep)
    _warm(torch, m, qkv)
    keep[:, :, :6] = ~keep[:, :, :6]
    _same(_step(torch, m, qkv), _uncached(torch, m, qkv))
    keep.numpy()[0, 0, 3:] = False          # rows that keep no key, behind torch's back
    _same(_step(torch, m, qkv), _uncached(torch, m, qkv))
    for m2 in (anyattn.KeepMask(torch.rand(1, 2, 13, 17, generator=g) > 0.5),   # new shape
               anyattn.KeepMask(torch.rand(13, 17, generator=g) > 0.5),         # 2-D
               anyattn.KeepMask(keep) & anyattn.Documents(torch.arange(13) // 5,
                                                          torch.arange(17) // 6)):
        _step(torch, m2, qkv)
        _same(_step(torch, m2, qkv), _uncached(torch, m2, qkv))
    with pytest.raises(ValueError, match="broadcast"):
        _step(torch, anyattn.KeepMask(torch.ones(3, 1, 13, 17, dtype=torch.bool)), qkv)


def test_kept_problem_holds_no_mask_tensor_and_each_call_a_fresh_tile_memo():
    torch = _torch()
    from anyattn.torch import eager

    qkv = _qkv(torch)
    eager.clear_caches()
    seen = []
    real = eager._remask

    def spy(res, q_ids, k_ids, keep):
        r = real(res, q_ids, k_ids, keep)
        seen.append(r[0].mask)
        return r

    eager._remask = spy
    try:
        m = anyattn.Documents(torch.arange(13) // 5, torch.arange(17) // 6)
        for _ in range(3):
            _step(torch, m, qkv)
    finally:
        eager._remask = real
    hits = [rm for rm in seen if rm.q_ids is not None]
    assert len(hits) == 2 and hits[0] is not hits[1]
    assert all(rm.keep_key is None for rm in hits)
    for p, pf in eager._problems.values():
        assert p.mask.q_ids is None and pf.mask.q_ids is None
    eager.clear_caches()
