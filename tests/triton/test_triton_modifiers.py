"""Score modifiers (softcap, ALiBi, sinks + dsinks) in the triton kernels vs the float64
reference, alone and together, with every mask kind, bias + dbias (all three dbias
paths), GQA, Sq != Sk, offsets, odd sizes, empty rows, -inf sinks, huge logits, every
fp32 product scheme and bf16.

Runs on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1, set by
tests/conftest.py where no GPU is present) at tiny sizes with the fixed test plan
(tiles 16/32, mask blocks 32: several tiles even at S ~ 40); ``gpu`` tests need CUDA.
Shape legend: B batch, Hq/Hkv heads, Sq/Sk queries/keys, D head dim.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import anyattn as aa  # noqa: E402
from anyattn import reference as R  # noqa: E402

from helpers import TOL, assert_close, make_qkv, np_mask, to_np  # noqa: E402
from tr_util import GRAD, HAS_CUDA, needs_triton, T, two_launch_backward  # noqa: E402


def mods_for(rng, B, Hq, softcap=None, alibi=None, sinks=None):
    """Modifier arguments (NumPy float32): alibi 'h' -> [Hq], 'bh' -> [B, Hq]; sinks True
    -> standard normal [Hq] (or the array given)."""
    kw = {}
    if softcap is not None:
        kw["softcap"] = softcap
    if alibi == "h":
        kw["alibi_slopes"] = rng.uniform(0.05, 0.6, Hq).astype(np.float32)
    elif alibi == "bh":
        kw["alibi_slopes"] = rng.uniform(0.05, 0.6, (B, Hq)).astype(np.float32)
    if sinks is True:
        kw["sinks"] = rng.standard_normal(Hq).astype(np.float32)
    elif sinks is not None:
        kw["sinks"] = np.asarray(sinks, np.float32)
    return kw


def check(q, k, v, g, mods, *, mask=None, bias=None, wrt=None, dtype="float32", tdtype=None,
          precision=None, tol=None, q_offset=0, k_offset=0):
    """Forward + backward on triton vs the float64 reference, both with the modifiers
    ``mods`` (softcap / alibi_slopes / sinks, NumPy); returns (out, lse, grads)."""
    if wrt is None:
        wrt = ("q", "k", "v") + (("bias",) if bias is not None else ()) + \
            (("sinks",) if "sinks" in mods else ())
    qt, kt, vt, gt = (T(x, tdtype) for x in (q, k, v, g))
    tm = {n: (T(x) if isinstance(x, np.ndarray) else x) for n, x in mods.items()}
    common = dict(mask=mask, bias=T(bias), backend="triton", precision=precision,
                  q_offset=q_offset, k_offset=k_offset, **tm)
    out, lse = aa.attention(qt, kt, vt, return_lse=True, **common)
    gr = aa.attention_backward(qt, kt, vt, gt, wrt=wrt, **common)
    # the reference sees the inputs as rounded to the tested dtype
    qr, kr, vr, gr_ = (to_np(x).astype(np.float64) for x in (qt, kt, vt, gt))
    rkw = dict(mask=np_mask(mask), bias=bias, q_offset=q_offset, k_offset=k_offset, **mods)
    ro, rl = R.forward(qr, kr, vr, **rkw)
    rg = R.backward(qr, kr, vr, gr_, wrt=wrt, **rkw)
    assert not torch.isnan(out).any(), "NaN in out"
    assert_close(out, ro, dtype, "out", tol=tol)
    lt = to_np(lse)
    assert lt.dtype == np.float32
    assert np.array_equal(np.isfinite(lt), np.isfinite(rl)), "lse finite exactly where the reference's is"
    fin = np.isfinite(rl)
    if fin.any():
        assert np.abs(lt[fin] - rl[fin]).max() <= 1e-4 * max(1.0, np.abs(rl[fin]).max())
    for n in wrt:
        got, ref = getattr(gr, GRAD[n]), getattr(rg, GRAD[n])
        assert got is not None, n
        assert tuple(got.shape) == tuple(ref.shape), (n, got.shape, ref.shape)
        assert not torch.isnan(got).any(), f"NaN in {GRAD[n]}"
        assert_close(got, ref, dtype, GRAD[n], tol=tol)
    if "sinks" in wrt:
        assert gr.dsinks.dtype == tm["sinks"].dtype
    return out, lse, gr


# ----------------------------------------------------------------------------- each alone
@needs_triton
def test_capabilities_accept_every_modifier():
    from anyattn.backends.registry import get_backend
    from anyattn.problem import describe

    rng = np.random.default_rng(0)
    q, k, v = (T(x) for x in make_qkv(rng, 1, 2, 1, 5, 7, 8)[:3])
    p = describe(q, k, v, softcap=5.0, alibi_slopes=T(np.ones(2, np.float32)),
                 sinks=T(np.zeros(2, np.float32)), wrt=("q", "sinks"))
    assert get_backend("triton").unsupported_reasons(p) == []


@needs_triton
def test_softcap_gqa_sq_ne_sk():
    rng = np.random.default_rng(1)
    q, k, v, g = make_qkv(rng, 1, 2, 1, 21, 35, 16)
    check(3 * q, k, v, g, mods_for(rng, 1, 2, softcap=1.5))


@needs_triton
def test_alibi_heads_causal_bottom_right_odd_sizes():
    rng = np.random.default_rng(2)
    q, k, v, g = make_qkv(rng, 1, 2, 1, 19, 45, 24)        # D = 24: padded to 32
    check(q, k, v, g, mods_for(rng, 1, 2, alibi="h"), mask=aa.Causal("bottom_right"))


@needs_triton
def test_alibi_batch_heads_window_offsets():
    rng = np.random.default_rng(3)
    q, k, v, g = make_qkv(rng, 2, 2, 2, 33, 26, 8)
    check(q, k, v, g, mods_for(rng, 2, 2, alibi="bh"),
          mask=aa.Window(left=9, right=3, align="bottom_right"), q_offset=5, k_offset=2)


@needs_triton
def test_sinks_documents_empty_rows():
    """Rows that keep no key: out 0 and lse = sinks[h] exactly; dsinks over the rest."""
    rng = np.random.default_rng(4)
    B, Hq, Sq, Sk = 2, 2, 21, 40
    q, k, v, g = make_qkv(rng, B, Hq, 1, Sq, Sk, 8)
    qi = rng.integers(0, 4, (B, Sq))
    ki = rng.integers(1, 4, (B, Sk))                      # id 0 has no keys: empty rows
    mods = mods_for(rng, B, Hq, sinks=True)
    out, lse, _ = check(q, k, v, g, mods, mask=aa.Documents(T(qi), T(ki)))
    empty = qi == 0
    assert empty.any()
    o, l_ = to_np(out), to_np(lse)
    for b in range(B):
        assert np.all(o[b][:, empty[b]] == 0)
        assert np.array_equal(l_[b][:, empty[b]],
                              np.broadcast_to(mods["sinks"][:, None], l_[b][:, empty[b]].shape))


@needs_triton
def test_minus_inf_sinks_are_no_sinks():
    """A -inf sink changes nothing (same bits as without sinks) and gets dsinks 0."""
    rng = np.random.default_rng(5)
    q, k, v, g = make_qkv(rng, 1, 3, 3, 20, 30, 8)
    sinks = np.array([-np.inf, 0.5, -np.inf], np.float32)
    keep = rng.random((20, 30)) < 0.6
    keep[3] = False                                      # an empty row under a -inf sink
    mask = aa.KeepMask(T(keep))
    out, lse, gr = check(q, k, v, g, mods_for(rng, 1, 3, softcap=2.0, sinks=sinks), mask=mask)
    base, blse = aa.attention(T(q), T(k), T(v), mask=mask, softcap=2.0, return_lse=True,
                              backend="triton")
    for h in (0, 2):
        assert torch.equal(out[:, h], base[:, h]), h
        assert torch.equal(lse[:, h], blse[:, h]), h
        assert float(gr.dsinks[h]) == 0.0
    assert torch.isneginf(lse[:, 0, 3]).all() and float(lse[0, 1, 3]) == 0.5


# ----------------------------------------------------------------------------- together
@needs_triton
def test_all_keepmask_full_bias_dbias():
    rng = np.random.default_rng(6)
    B, H, Sq, Sk = 2, 2, 33, 24
    q, k, v, g = make_qkv(rng, B, H, 1, Sq, Sk, 8)
    bias = rng.standard_normal((B, H, Sq, Sk)).astype(np.float32)
    bias[:, :, 5, :] = -np.inf                            # fully excluded rows
    keep = rng.random((B, 1, Sq, Sk)) < 0.7
    check(2 * q, k, v, g, mods_for(rng, B, H, softcap=1.2, alibi="bh", sinks=True),
          bias=bias, mask=aa.KeepMask(T(keep)))


@needs_triton
@pytest.mark.parametrize("shape", [(1, 2, 25, 37), (2, 1, 1, 37)], ids=["1hqk", "b11k"])
def test_all_broadcast_dbias(shape):
    """[1, H, Sq, Sk]: the dq programs own and sum the dbias rows (ALiBi + bias without
    softcap: natural units); [B, 1, 1, Sk]: the separate reduction kernel (all three);
    both recompute the scores with the modifiers."""
    rng = np.random.default_rng(7)
    B, H, Sq, Sk = 2, 2, 25, 37
    q, k, v, g = make_qkv(rng, B, H, H, Sq, Sk, 8)
    bias = rng.standard_normal(shape).astype(np.float32)
    cap = 1.7 if shape[1] == 1 else None
    check(2 * q, k, v, g, mods_for(rng, B, H, softcap=cap, alibi="h", sinks=True), bias=bias,
          mask=aa.Causal())


@needs_triton
def test_all_documents_causal_offsets_gqa():
    rng = np.random.default_rng(8)
    B, Sq, Sk = 1, 29, 40
    q, k, v, g = make_qkv(rng, B, 2, 1, Sq, Sk, 8)
    qs = np.sort(rng.integers(0, 3, (B, Sq)), axis=1)
    ks = np.sort(rng.integers(0, 3, (B, Sk)), axis=1)
    check(q, k, v, g, mods_for(rng, B, 2, softcap=0.8, alibi="h", sinks=True),
          mask=aa.Documents(T(qs), T(ks)) & aa.Causal("bottom_right"), q_offset=3, k_offset=7)


@needs_triton
def test_all_two_launch_backward_equals_fused(monkeypatch):
    """The dK/dV + dQ kernels give the bits of the one-launch backward, modifiers on."""
    rng = np.random.default_rng(9)
    q, k, v, g = make_qkv(rng, 1, 2, 1, 33, 33, 8)
    mods = mods_for(rng, 1, 2, softcap=1.1, alibi="h", sinks=True)
    tm = {n: (T(x) if isinstance(x, np.ndarray) else x) for n, x in mods.items()}
    wrt = ("q", "k", "v", "sinks")
    runs = {"1": aa.attention_backward(T(q), T(k), T(v), T(g), mask=aa.Causal(), wrt=wrt,
                                       backend="triton", **tm)}
    two_launch_backward(monkeypatch)
    runs["0"] = aa.attention_backward(T(q), T(k), T(v), T(g), mask=aa.Causal(), wrt=wrt,
                                      backend="triton", **tm)
    for n in wrt:
        assert torch.equal(getattr(runs["1"], GRAD[n]), getattr(runs["0"], GRAD[n])), n
    rg = R.backward(q, k, v, g, mask=aa.Causal(), wrt=wrt, **mods)
    for n in wrt:
        assert_close(getattr(runs["0"], GRAD[n]), getattr(rg, GRAD[n]), "float32", GRAD[n])


# ----------------------------------------------------------------------------- precisions
@needs_triton
def test_all_bf16():
    rng = np.random.default_rng(10)
    q, k, v, g = make_qkv(rng, 1, 2, 1, 19, 26, 16)
    out, lse, gr = check(2 * q, k, v, g, mods_for(rng, 1, 2, softcap=1.5, alibi="h", sinks=True),
                         mask=aa.Causal(), tdtype=torch.bfloat16, dtype="bfloat16")
    assert out.dtype == torch.bfloat16 and gr.dk.dtype == torch.bfloat16
    assert lse.dtype == torch.float32 and gr.dsinks.dtype == torch.float32


@needs_triton
def test_all_tf32_opt_in():
    rng = np.random.default_rng(12)
    q, k, v, g = make_qkv(rng, 1, 2, 2, 17, 23, 16)
    check(q, k, v, g, mods_for(rng, 1, 2, softcap=2.5, alibi="bh", sinks=True),
          precision="tf32", tol=TOL["tf32"])


# ----------------------------------------------------------------------------- edges
@needs_triton
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_softcap_huge_logits_no_nan():
    """|scale q.k| up to ~1e6: tanh saturates to +-1 (no inf / inf), 1 - tanh^2 to 0.  (The
    interpreter warns of the small-argument polynomial overflowing on these elements: that
    branch is computed for every element and not selected there.)"""
    rng = np.random.default_rng(13)
    q, k, v, g = make_qkv(rng, 1, 2, 1, 18, 21, 16)
    q = q * np.float32(2e5)
    out, lse, gr = check(q, k, v, g, mods_for(rng, 1, 2, softcap=30.0, sinks=True))
    for x in (out, lse, gr.dq, gr.dk, gr.dv, gr.dsinks):
        assert torch.isfinite(x).all()


@needs_triton
def test_dsinks_alone_from_lse_and_repeatable():
    """wrt=('sinks',) alone, with out and a plain lse from the forward (P = exp(s - lse)):
    dsinks matches the reference and is bitwise the same on every run."""
    rng = np.random.default_rng(14)
    B, H = 2, 3
    q, k, v, g = (T(x) for x in make_qkv(rng, B, H, 1, 26, 31, 8))
    mods = mods_for(rng, B, H, alibi="h", sinks=True)
    tm = {n: T(x) for n, x in mods.items()}
    out, lse = aa.attention(q, k, v, mask=aa.Causal(), return_lse=True, backend="triton", **tm)
    runs = [aa.attention_backward(q, k, v, g, out=out, lse=lse, mask=aa.Causal(), wrt=("sinks",),
                                  backend="triton", **tm) for _ in range(2)]
    assert runs[0].dq is None and runs[0].dk is None
    assert torch.equal(runs[0].dsinks, runs[1].dsinks)
    rg = R.backward(*(to_np(x) for x in (q, k, v, g)), mask=aa.Causal(), wrt=("sinks",),
                    out=to_np(out), lse=to_np(lse), **mods)
    assert_close(runs[0].dsinks, rg.dsinks, "float32", "dsinks")


# ----------------------------------------------------------------------------- GPU sizes
@pytest.mark.parametrize("dt", ["bfloat16", "float32"])
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU (large sizes: too slow for the interpreter)")
def test_gpu_all_modifiers_large(dt):
    rng = np.random.default_rng(15)
    B, Hq, Hkv, S, D = 2, 8, 2, 1024, 128
    q, k, v, g = make_qkv(rng, B, Hq, Hkv, S, S, D)
    check(2 * q, k, v, g, mods_for(rng, B, Hq, softcap=20.0, alibi="h", sinks=True),
          mask=aa.Causal(), tdtype=getattr(torch, dt), dtype=dt)
    check(q, k, v, g, mods_for(rng, B, Hq, softcap=5.0, alibi="bh", sinks=True),
          mask=aa.Window(left=300), tdtype=getattr(torch, dt), dtype=dt)
