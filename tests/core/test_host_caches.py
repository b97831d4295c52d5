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
from anyattn import settings
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


# ------------------------------------------------------------------ core describe memo

def _problem_fields(p):
    import dataclasses

    d = {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.name != "mask"}
    m = p.mask
    d["mask"] = (m.sq, m.sk, m.band_lo, m.band_hi, m.q_ids is None, m.k_ids is None,
                 m.keep is None, m.keep_key)
    return d


def _np_args(seed=0, B=2, H=4, Hkv=2, Sq=5, Sk=7, D=8, dt="float32"):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, H, Sq, D)).astype(dt)
    k = rng.standard_normal((B, Hkv, Sk, D)).astype(dt)
    v = rng.standard_normal((B, Hkv, Sk, D)).astype(dt)
    return q, k, v


def _check_memo(args, kw):
    """describe through the memo (twice) == describe in full, field by field."""
    from anyattn import problem as P

    a = P.describe(*args, **kw)
    b = P.describe(*args, **kw)
    full = P._describe(*args, **{**dict(dout=None, out=None, lse=None, mask=None, bias=None,
                                        scale=None, precision=None, wrt=None, q_offset=0,
                                        k_offset=0, softcap=None, alibi_slopes=None,
                                        sinks=None, dropout_p=0.0, dropout_seed=None), **kw})
    assert _problem_fields(a) == _problem_fields(b) == _problem_fields(full), kw
    return a, b


def test_describe_memo_field_by_field():
    from anyattn import problem as P

    P.clear_cache()
    q, k, v = _np_args()
    base = (q, k, v)
    p0, p1 = _check_memo(base, {})
    assert p0 is p1, "a repeated call is a hit"
    g = np.ones_like(q)
    bias = np.zeros((1, 4, 5, 7), np.float32)
    variants = [
        dict(scale=0.5), dict(scale=1), dict(scale=-0.0), dict(scale=0.0),
        dict(precision="highest"), dict(precision="tf32"),
        dict(q_offset=3), dict(k_offset=-2), dict(q_offset=3, k_offset=3),
        dict(softcap=30.0), dict(softcap=30),
        dict(mask=anyattn.Causal()), dict(mask=anyattn.Causal(align="bottom_right")),
        dict(mask=anyattn.Window(left=2)), dict(mask=anyattn.Window(left=3)),
        dict(mask=anyattn.Window(left=2, right=1)),
        dict(mask=anyattn.Causal() & anyattn.Window(left=2)),
        dict(mask=anyattn.Causal(), q_offset=4),
        dict(bias=bias), dict(bias=bias[0]), dict(bias=np.zeros((7,), np.float32)),
        dict(alibi_slopes=np.ones(4, np.float32)), dict(alibi_slopes=np.ones((2, 4), np.float32)),
        dict(sinks=np.zeros(4, np.float32)),
        dict(dropout_p=0.1, dropout_seed=3), dict(dropout_p=0.1, dropout_seed=4),
        dict(dout=g, wrt=("q",)), dict(dout=g, wrt=("q", "k")), dict(dout=g, wrt="v"),
        dict(dout=g, wrt=["k", "q"]), dict(dout=g, wrt=frozenset({"k"})),
        dict(dout=g, wrt=("q", "bias"), bias=bias),
        dict(dout=g, out=np.zeros_like(q), lse=np.zeros((2, 4, 5), np.float32), wrt=("q",)),
    ]
    for kw in variants:
        _check_memo(base, kw)
    for args in (_np_args(Sq=6), _np_args(Sk=9), _np_args(D=16), _np_args(B=1),
                 _np_args(H=2), _np_args(Hkv=1), _np_args(dt="float64"),
                 _np_args(dt="float16"), tuple(x[:, :, ::-1] for x in _np_args()),
                 tuple(np.asfortranarray(x) for x in _np_args())):
        _check_memo(args, {})
        _check_memo(args, dict(mask=anyattn.Causal()))


def test_describe_memo_never_skips_a_refusal():
    from anyattn import problem as P

    P.clear_cache()
    q, k, v = _np_args()
    P.describe(q, k, v, mask=anyattn.Causal(), q_offset=1)
    bad = [
        (dict(q_offset=1.0), TypeError), (dict(q_offset=True), TypeError),
        (dict(k_offset=False), TypeError), (dict(scale=float("inf")), ValueError),
        (dict(scale=float("nan")), ValueError), (dict(softcap=-1.0), ValueError),
        (dict(softcap=True), TypeError), (dict(precision="fast"), ValueError),
        (dict(dropout_p=0.1), ValueError), (dict(dropout_p=True), TypeError),
        (dict(dropout_p=1.0, dropout_seed=1), ValueError),
        (dict(dout=np.ones_like(q), wrt=None), TypeError),
        (dict(dout=np.ones_like(q), wrt=()), ValueError),
        (dict(dout=np.ones_like(q), wrt=("bias",)), ValueError),
        (dict(bias=np.zeros((3, 1, 1, 1), np.float32)), ValueError),
        (dict(bias=np.zeros((1, 1, 1, 7), np.float64)), TypeError),
        (dict(mask=anyattn.Window(left=2), out=np.zeros_like(q)), ValueError),
    ]
    for _ in range(2):
        for kw, exc in bad:
            with pytest.raises(exc):
                P.describe(q, k, v, **kw)
        P.describe(q, k, v)
    for args, exc in (((q, k[..., :4], v[..., :4]), ValueError),
                      ((np.ma.masked_array(q), k, v), TypeError),
                      ((q.astype(">f4"), k, v), TypeError),
                      ((q.astype("int32"), k, v), TypeError),
                      ((q.tolist(), k, v), TypeError),
                      ((q[0], k, v), ValueError)):
        for _ in range(2):
            with pytest.raises(exc):
                P.describe(*args)
    assert all(p.array_kind == "numpy" for p in P._PROBLEMS.values())


def test_describe_memo_skips_array_masks_and_odd_scalars():
    """Documents / KeepMask (NumPy arrays may change in place, nothing to key them on),
    iterators as wrt and non-plain scalars are validated in full each time."""
    from anyattn import problem as P

    q, k, v = _np_args()
    P.clear_cache()
    ids_q, ids_k = np.arange(5) // 2, np.arange(7) // 3
    keep = np.ones((5, 7), bool)
    for kw in (dict(mask=anyattn.Documents(ids_q, ids_k)), dict(mask=anyattn.KeepMask(keep)),
               dict(mask=anyattn.Causal() & anyattn.KeepMask(keep)),
               dict(q_offset=np.int64(2)), dict(scale=np.float32(0.5)),
               dict(q_offset=np.array(2))):
        a, b = P.describe(q, k, v, **kw), P.describe(q, k, v, **kw)
        assert not P._PROBLEMS and a is not b and a.mask is not b.mask, kw
    P.describe(q, k, v, dout=np.ones_like(q), wrt=iter(("q",)))
    assert not P._PROBLEMS
    p = P.describe(q, k, v, mask=anyattn.Documents(ids_q, ids_k))
    assert p.mask.q_ids is not None and not P._PROBLEMS


def test_describe_memo_torch_device_and_dtype_apart():
    torch = _torch()
    from anyattn import problem as P

    P.clear_cache()
    t = [torch.zeros(1, 2, 3, 4) for _ in range(3)]
    p32 = P.describe(*t)
    p16 = P.describe(*(x.half() for x in t))
    pbf = P.describe(*(x.bfloat16() for x in t))
    n = P.describe(*(x.numpy() for x in t))
    assert (p32.dtype, p16.dtype, pbf.dtype, n.dtype) == ("float32", "float16", "bfloat16",
                                                          "float32")
    assert (p32.array_kind, n.array_kind) == ("torch", "numpy")
    assert P.describe(*t) is p32 and P.describe(*(x.numpy() for x in t)) is n
    with pytest.raises(TypeError, match="same library"):
        P.describe(t[0], t[1].numpy(), t[2])


# ------------------------------------------------------------------- choose memo

def test_choose_memo_per_problem_name_and_interpreter(monkeypatch):
    from anyattn import problem as P
    from anyattn.backends import registry as R

    P.clear_cache()
    R.clear_choices()
    q, k, v = _np_args()
    p = P.describe(q, k, v)
    assert R.choose(p).name == "numpy" and R.choose(p, "reference").name == "reference"
    assert R.choose(p).name == "numpy" and R.choose(p, "reference").name == "reference"
    assert {key[1] for key in R._choices} == {None, "reference"}
    for _ in range(2):
        with pytest.raises(NotImplementedError, match="triton"):
            R.choose(p, "triton")                     # refusals are never kept
        with pytest.raises(ValueError, match="unknown"):
            R.choose(p, "nonesuch")
        with pytest.raises(TypeError, match="backend"):
            R.choose(p, ["numpy"])
    n = len(R._choices)
    monkeypatch.setenv("TRITON_INTERPRET",
                       "0" if settings.current().triton_interpret else "1")
    assert R.choose(p).name == "numpy" and len(R._choices) == n + 1, "the variable is keyed"
    pd = P.describe(q, k, v, mask=anyattn.Documents(np.arange(5) // 2, np.arange(7) // 3))
    R.choose(pd)
    assert all(key[0] is not pd for key in R._choices), "Problems holding arrays: not kept"
    R.clear_choices()
    assert not R._choices
