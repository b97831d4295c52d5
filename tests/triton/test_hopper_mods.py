"""The score modifiers inside the Hopper kernels (softcap, ALiBi, sinks; an sm_90 GPU):
under ANYATTN_TRITON_PATH=hopper the forward and every gradient (dq, dk, dv, dsinks)
against the float64 reference in the dtype's tolerance (DESIGN.md section 4), for
D = 64 / 128, no mask / top-left causal / bottom-right causal, GQA, Sq != Sk both ways,
fp16 / bf16, and the modifiers together; the Hopper kernels are checked to have run
(their launchers spied on), on both backward routes (dQ inside; dK / dV with the
portable dQ), and two runs are bitwise equal.  Skipped without an sm_90 GPU (the Gluon
kernels have no interpreter); their host side is test_hopper_mods_host.py's.

Shape legend: B batch, H / Hkv heads, Sq / Sk queries / keys, D head dim.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import anyattn as aa  # noqa: E402
from anyattn import reference  # noqa: E402
from anyattn.backends.triton import launch as triton_launch  # noqa: E402
from anyattn.backends.triton import route  # noqa: E402
from anyattn.backends.triton.hopper import launch as hopper_launch  # noqa: E402

from helpers import TOL, assert_close, make_qkv, np_mask, stable_seed, to_np  # noqa: E402
from tr_util import GRAD, needs_sm90  # noqa: E402

pytestmark = [pytest.mark.gpu, needs_sm90]

MASKS = {"none": None, "causal": aa.Causal(), "causal_br": aa.Causal(align="bottom_right")}
#: (B, H, Hkv, Sq, Sk): GQA with Sq < Sk and odd sizes, Sq > Sk, equal lengths
SHAPES = [(2, 4, 2, 257, 383), (1, 2, 1, 300, 200), (2, 4, 4, 256, 256)]
#: modifier sets: name -> (softcap, alibi 'h' [H] / 'bh' [B, H] / None, sinks)
MODS = {"softcap": (True, None, False), "alibi": (False, "h", False),
        "alibi_bh": (False, "bh", False), "sinks": (False, None, True),
        "all": (True, "h", True)}


def _mods(rng, B, H, dtype, which):
    """The modifiers' arguments (NumPy float32) and the input scale: softcap's cap
    within reach of the scores (x 2 inputs), small enough in fp16 that tanh.approx's
    2^-11 stays inside the tolerance; sinks around the row maxima, one -inf."""
    softcap, alibi, sinks = MODS[which]
    kw, gain = {}, 1.0
    if softcap:
        kw["softcap"] = 2.0 if dtype == "float16" else 5.0
        gain = 2.0
    if alibi == "h":
        kw["alibi_slopes"] = rng.uniform(0.01, 0.3, H).astype(np.float32)
    elif alibi == "bh":
        kw["alibi_slopes"] = rng.uniform(0.01, 0.3, (B, H)).astype(np.float32)
    if sinks:
        s = rng.standard_normal(H).astype(np.float32) + 2.0
        s[-1] = -np.inf
        kw["sinks"] = s
    return kw, gain


@pytest.fixture
def hopper_spy(monkeypatch):
    """ANYATTN_TRITON_PATH=hopper, the prepared launches emptied, and the Hopper
    launchers counted -> the dict of counts (forward, backward_fused, dkdv)."""
    counts = {"forward": 0, "backward_fused": 0, "dkdv": 0}
    for name in counts:
        real = getattr(hopper_launch, name)

        def spy(*a, _real=real, _name=name, **kw):
            counts[_name] += 1
            return _real(*a, **kw)
        monkeypatch.setattr(hopper_launch, name, spy)
    monkeypatch.setenv("ANYATTN_TRITON_PATH", "hopper")
    triton_launch.clear_prepared()
    yield counts
    triton_launch.clear_prepared()


def _check(q, k, v, g, mods, mask, dtype, counts):
    """Forward + backward (every gradient) on the Hopper path vs float64 -> grads."""
    tdt = getattr(torch, dtype)
    qt, kt, vt, gt = (torch.as_tensor(x).to("cuda", tdt) for x in (q, k, v, g))
    tm = {n: (torch.as_tensor(x, device="cuda") if isinstance(x, np.ndarray) else x)
          for n, x in mods.items()}
    wrt = ("q", "k", "v") + (("sinks",) if "sinks" in mods else ())
    common = dict(mask=mask, backend="triton", **tm)
    out, lse = aa.attention(qt, kt, vt, return_lse=True, **common)
    out2, lse2 = aa.attention(qt, kt, vt, return_lse=True, **common)
    assert torch.equal(out, out2) and torch.equal(lse, lse2), "forward bitwise repeatable"
    assert counts["forward"] == 2, counts
    gr = aa.attention_backward(qt, kt, vt, gt, out=out, lse=lse, wrt=wrt, **common)
    gr2 = aa.attention_backward(qt, kt, vt, gt, out=out, lse=lse, wrt=wrt, **common)
    assert counts["backward_fused"] + counts["dkdv"] == 2, counts
    qr, kr, vr, grr = (to_np(x).astype(np.float64) for x in (qt, kt, vt, gt))
    ro, rl = reference.forward(qr, kr, vr, mask=np_mask(mask), **mods)
    rg = reference.backward(qr, kr, vr, grr, mask=np_mask(mask), wrt=wrt, **mods)
    assert_close(out, ro, dtype, "out")
    lt = to_np(lse).astype(np.float64)
    assert np.array_equal(np.isfinite(lt), np.isfinite(rl)), "lse finite where float64's is"
    fin = np.isfinite(rl)
    assert np.abs(lt[fin] - rl[fin]).max() <= 10 * TOL[dtype] * max(1.0, np.abs(rl[fin]).max())
    for n in wrt:
        got, again = getattr(gr, GRAD[n]), getattr(gr2, GRAD[n])
        assert torch.equal(got, again), f"{GRAD[n]} bitwise repeatable"
        assert_close(got, getattr(rg, GRAD[n]), dtype, GRAD[n])
    return gr


@pytest.mark.parametrize("which", list(MODS))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kind", list(MASKS))
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_modifiers_match_float64(hopper_spy, dtype, D, kind, shape, which):
    B, H, Hkv, Sq, Sk = shape
    rng = np.random.default_rng(stable_seed(dtype, D, kind, shape, which))
    q, k, v, g = make_qkv(rng, B, H, Hkv, Sq, Sk, D)
    mods, gain = _mods(rng, B, H, dtype, which)
    _check(gain * q, k, v, g, mods, MASKS[kind], dtype, hopper_spy)
    assert hopper_spy["backward_fused"] == 2     # the dQ-inside route at these lengths


@pytest.mark.parametrize("D", [64, 128])
def test_modifiers_dkdv_route_with_portable_dq(hopper_spy, monkeypatch, D):
    """Past half the SMs' worth of key tiles the backward runs the dK / dV kernel with
    the modifiers and the portable dQ kernel with them (here forced: an SM count of 2)."""
    monkeypatch.setitem(route.SM_COUNTS, "cuda:0", 2)
    monkeypatch.setitem(route.SM_COUNTS, "cuda", 2)
    rng = np.random.default_rng(stable_seed("dkdv", D))
    B, H, Hkv, Sq, Sk = 1, 4, 2, 300, 520
    q, k, v, g = make_qkv(rng, B, H, Hkv, Sq, Sk, D)
    mods, gain = _mods(rng, B, H, "bfloat16", "all")
    _check(gain * q, k, v, g, mods, aa.Causal(align="bottom_right"), "bfloat16", hopper_spy)
    assert hopper_spy["dkdv"] == 2 and hopper_spy["backward_fused"] == 0


def test_empty_rows_with_sinks_and_huge_alibi(hopper_spy):
    """A window that leaves the first queries no key (Sq > Sk, bottom-right causal): out
    0 and lse = the sink there, dsinks over the rest; a steep ALiBi slope (scores far
    below the row's first key) changes nothing of the row statistics' accuracy."""
    rng = np.random.default_rng(11)
    B, H, Hkv, Sq, Sk, D = 1, 2, 1, 300, 200, 128
    q, k, v, g = make_qkv(rng, B, H, Hkv, Sq, Sk, D)
    mods = dict(alibi_slopes=np.array([0.01, 4.0], np.float32),
                sinks=np.array([0.3, -0.5], np.float32))
    _check(q, k, v, g, mods, aa.Causal(align="bottom_right"), "bfloat16", hopper_spy)
    qt, kt, vt = (torch.as_tensor(x).to("cuda", torch.bfloat16) for x in (q, k, v))
    tm = {n: torch.as_tensor(x, device="cuda") for n, x in mods.items()}
    out, lse = aa.attention(qt, kt, vt, mask=aa.Causal(align="bottom_right"),
                            return_lse=True, backend="triton", **tm)
    empty = slice(0, Sq - Sk)                     # queries i < Sq - Sk keep no key
    assert (out[:, :, empty] == 0).all()
    assert torch.equal(lse[0, :, empty], tm["sinks"][:, None].expand(H, Sq - Sk))
