"""webgpu numerics at any magnitude (DESIGN.md §1, issue 12 item 2).

The kernels keep the row max and the log-normaliser apart: P = exp((s - max) - log_norm),
never exp(s - lse) with one rounded lse.  Checked here against an extended-precision
oracle (np.longdouble), with PyTorch's math SDPA (fp32, CPU) as the yardstick:
err(webgpu) <= max(3 * err(torch math), 1e-5) for out, lse, dq, dk, dv, dbias.

Shapes span several key tiles (the online softmax rescales across tiles, where a
running max of finfo.min must not be taken for "empty"), and one variant forces split
launches (the partial (m, l) of a piece carried to the next).  Also: a finite bias,
even finfo(float32).min, is a number (the row attends uniformly over its kept keys);
-inf still excludes; a row keeping one key gets P exactly 1; the f16 path follows the
same rules.

``python tests/webgpu/test_webgpu_magnitudes.py`` prints the error table.
"""
from __future__ import annotations

import numpy as np
import pytest

from anyattn.modifiers import NO_MODS
import anyattn as aa
from anyattn import reference as R

from helpers import magnitude_oracle as oracle, rel_to_terms as rel, torch_math_sdpa as torch_math

torch = pytest.importorskip("torch")

F32_MIN = float(np.finfo(np.float32).min)
FLOOR = 1e-5
SHAPE = (1, 2, 1, 37, 70, 16)      # B, Hq, Hkv, Sq, Sk, D: 3 key tiles, 2 query tiles (CPU)


# ----------------------------------------------------------------------------- oracle
# ------------------------------------------------------------------------------ cases
def make_case(name, rng, shape=SHAPE):
    """-> (q, k, v, g, bias or None, scale, keep [B, Hq, Sq, Sk] bool, mask or None)."""
    B, Hq, Hkv, Sq, Sk, D = shape
    q, k, v, g = (rng.standard_normal(s) for s in ((B, Hq, Sq, D), (B, Hkv, Sk, D),
                                                    (B, Hkv, Sk, D), (B, Hq, Sq, D)))
    scale = D ** -0.5
    bias = None
    keep = np.ones((B, Hq, Sq, Sk), bool)
    mask = None
    kind, _, val = name.partition(":")
    if kind == "plain":
        pass
    elif kind == "bias_logits":               # |s| ~ val, rows far from one-hot
        bias = float(val) + rng.standard_normal((1, Hq, Sq, Sk))
    elif kind == "q_logits":                  # |s| ~ val from the queries: one-hot rows
        q = q * (float(val) / np.sqrt(D))
    elif kind == "uniform_row":               # rows 2, 5 (head 1), 36 carry one constant
        c = F32_MIN if val == "min" else float(val)
        bias = np.zeros((1, Hq, Sq, Sk))
        bias[:, :, 2, :] = c
        bias[:, 1, 5, :] = c
        bias[:, :, Sq - 1, :] = c
    elif kind == "hf_padding":                # left padding of 40 keys by finfo.min (past
        bias = np.zeros((B, 1, Sq, Sk))       # the first key tile), and rows 0-3 and 33
        bias[..., :40] = F32_MIN              # see only padding (attend uniformly)
        bias[..., :4, :] = F32_MIN
        bias[..., 33, :] = F32_MIN
    elif kind == "min_and_ninf":              # finfo.min keys attended, -inf keys excluded
        bias = np.zeros((1, Hq, Sq, Sk))
        bias[..., 3, :] = F32_MIN
        bias[..., 3, ::3] = -np.inf
        bias[..., 7, :] = -np.inf             # a row of -inf: empty (out 0, lse -inf)
        bias[..., 9, :50] = -1e30
        bias[..., 9, 50:] = -np.inf
    elif kind == "single_key":                # causal: row 0 keeps key 0 only
        keep = np.broadcast_to(np.tril(np.ones((Sq, Sk), bool)), keep.shape).copy()
        mask = aa.Causal()
        q = q * 30.0
    else:
        raise KeyError(name)
    if bias is not None:                      # -inf bias entries exclude, like a mask
        keep = keep & ~np.isneginf(bias)
    q, k, v, g = (x.astype(np.float32) for x in (q, k, v, g))
    bias = None if bias is None else bias.astype(np.float32)
    return q, k, v, g, bias, scale, keep, mask


CASES = ["plain", "bias_logits:1e3", "bias_logits:-1e6", "bias_logits:1e6", "q_logits:1e3",
         "q_logits:1e6", "uniform_row:-1e12", "uniform_row:-1e30", "uniform_row:min",
         "hf_padding", "min_and_ninf", "single_key"]


def errors(case, given=False, rng_seed=0, shape=SHAPE):
    """-> {name: (err webgpu, err torch math)} vs the extended-precision oracle."""
    rng = np.random.default_rng(rng_seed)
    q, k, v, g, bias, scale, keep, mask = make_case(case, rng, shape)
    ref, mag = oracle(q, k, v, g, bias, scale, keep)
    # torch: the mask terms as -inf in its attn_mask (keep), the bias as a number
    tb = None if bias is None else np.where(keep, bias, 0.0).astype(np.float32)
    yard = torch_math(q, k, v, g, tb, scale, keep)
    if bias is not None:                      # torch's bias grad in the bias's own shape
        yard["dbias"] = R.reduce_to_shape(yard["dbias"], bias.shape)
    out, lse = aa.attention(q, k, v, mask=mask, bias=bias, scale=scale, return_lse=True,
                            backend="webgpu")
    wrt = ("q", "k", "v") + (("bias",) if bias is not None else ())
    kw = dict(out=out, lse=lse) if given else {}
    gr = aa.attention_backward(q, k, v, g, mask=mask, bias=bias, scale=scale, wrt=wrt,
                               backend="webgpu", **kw)
    got = dict(out=out, lse=lse, dq=gr.dq, dk=gr.dk, dv=gr.dv)
    if bias is not None:
        got["dbias"] = gr.dbias
    return {n: (rel(x, ref[n], mag[n]), rel(yard[n], ref[n], mag[n])) for n, x in got.items()}


def _check(res):
    bad = {n: e for n, e in res.items() if not e[0] <= max(3 * e[1], FLOOR)}
    assert not bad, "errors vs extended precision (webgpu, torch math): " + ", ".join(
        f"{n}: {e[0]:.2e} vs {e[1]:.2e}" for n, e in bad.items())


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("given", [False, True], ids=["recompute", "given_lse"])
def test_error_no_worse_than_torch_math(be, case, given):
    _check(errors(case, given))


@pytest.mark.parametrize("case", ["uniform_row:min", "hf_padding", "bias_logits:1e6"])
def test_split_launches_keep_statistics(be, case):
    """Forced split launches (the partial m, l of a piece carried to the next) give the
    same numbers: a running max of finfo.min is a max, not an empty row."""
    be.loop_limit_override = 45         # one key tile / query tile per piece (D = 16)
    res = errors(case, given=False)
    assert be.last_pieces["bwd_dq"] > 1 and be.last_pieces["bwd_dkdv"] > 1
    _check(res)
    q, k, v, _, bias, scale, _, mask = make_case(case, np.random.default_rng(0))
    out = aa.attention(q, k, v, mask=mask, bias=bias, scale=scale, backend="webgpu")
    assert be.last_pieces["forward"] > 1
    be.loop_limit_override = None
    np.testing.assert_array_equal(
        out, aa.attention(q, k, v, mask=mask, bias=bias, scale=scale, backend="webgpu"))


def test_finfo_min_row_attends_uniformly(be):
    """A row whose bias is all finfo.min (HF padding) averages v over its kept keys,
    like torch; a row of -inf keeps none: out 0, lse -inf, no gradient."""
    rng = np.random.default_rng(3)
    q, k, v, g = (rng.standard_normal((1, 1, 4, 8)).astype(np.float32) for _ in range(4))
    k = np.concatenate([k] * 20, axis=2)                   # 80 keys: three key tiles
    v = rng.standard_normal((1, 1, 80, 8)).astype(np.float32)
    bias = np.zeros((1, 1, 4, 80), np.float32)
    bias[0, 0, 1] = F32_MIN
    bias[0, 0, 2] = -np.inf
    bias[0, 0, 3, :50] = F32_MIN
    bias[0, 0, 3, 50:] = -np.inf
    out, lse = aa.attention(q, k, v, bias=bias, return_lse=True, backend="webgpu")
    np.testing.assert_allclose(out[0, 0, 1], v[0, 0].mean(0), rtol=2e-6, atol=2e-6)
    np.testing.assert_allclose(out[0, 0, 3], v[0, 0, :50].mean(0), rtol=2e-6, atol=2e-6)
    assert np.all(out[0, 0, 2] == 0) and np.isneginf(lse[0, 0, 2])
    np.testing.assert_allclose(lse[0, 0, 1], np.float32(F32_MIN) + np.log(80), rtol=1e-7)
    gr = aa.attention_backward(q, k, v, g, bias=bias, wrt=("q", "k", "v", "bias"),
                               backend="webgpu")
    # uniform row: P = 1/80 per key, so dv picks up g/80 from row 1 on every key
    ref = R.backward(q, k, v, g, bias=bias, wrt=("v", "bias"))
    np.testing.assert_allclose(gr.dv, ref.dv, rtol=1e-5, atol=1e-6)
    assert np.all(gr.dbias[0, 0, 2] == 0)
    np.testing.assert_allclose(gr.dbias, ref.dbias, rtol=1e-4, atol=1e-6)


def test_single_key_p_is_exactly_one(be):
    """One kept key: out = v and dv = dout bit for bit, at logits of 1e3 and with a
    bias of -1e30 (P = 1 exactly, not 1 ± ulp)."""
    rng = np.random.default_rng(5)
    q, k, v, g = (rng.standard_normal((1, 2, 1, 24)).astype(np.float32) for _ in range(4))
    q *= 300.0
    for bias in (None, np.full((1, 1, 1, 1), -1e30, np.float32)):
        out = aa.attention(q, k, v, bias=bias, backend="webgpu")
        gr = aa.attention_backward(q, k, v, g, bias=bias, backend="webgpu", wrt=("v",))
        assert np.array_equal(out, v)
        assert np.array_equal(gr.dv, g)


def test_given_plain_lse_keeps_literal_meaning(be):
    """RowStats.from_lse(lse) (max = lse, log_norm = 0) reproduces P = exp(s - lse): an
    lse raised by log 3 (as if over more keys) divides dv by 3."""
    from anyattn.backends.registry import get_backend
    from anyattn.problem import describe

    rng = np.random.default_rng(4)
    q, k, v, g = (rng.standard_normal((1, 1, 6, 8)).astype(np.float32) for _ in range(4))
    out, lse = aa.attention(q, k, v, return_lse=True, backend="webgpu")
    p = describe(q, k, v, dout=g, wrt=("v",))
    b = get_backend("webgpu")
    a = b.backward(p, q, k, v, g, out, aa.RowStats.from_lse(lse + np.float32(np.log(3.0))),
                   None, NO_MODS)
    c = b.backward(p, q, k, v, g, out, aa.RowStats.from_lse(lse), None, NO_MODS)
    np.testing.assert_allclose(a["dv"], c["dv"] / 3.0, rtol=2e-6, atol=1e-7)


def test_forward_returns_row_stats(be):
    """The backend's forward gives (max, log_norm) apart: max is the largest kept score
    (finite even at -1e30 + log(Sk)), log_norm = log of the row's normaliser."""
    from anyattn.backends.registry import get_backend
    from anyattn.problem import describe

    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((1, 1, 3, 8)).astype(np.float32) for _ in range(3))
    bias = np.zeros((1, 1, 3, 3), np.float32)
    bias[0, 0, 0] = -1e30
    bias[0, 0, 2] = -np.inf
    p = describe(q, k, v, bias=bias)
    _, st = get_backend("webgpu").forward(p, q, k, v, bias, NO_MODS)
    assert st.max.dtype == np.float32 and st.log_norm.dtype == np.float32
    assert st.max[0, 0, 0] == np.float32(-1e30)
    np.testing.assert_allclose(st.log_norm[0, 0, 0], np.log(3.0), rtol=1e-6)
    assert np.isneginf(st.max[0, 0, 2]) and st.log_norm[0, 0, 2] == 0
    s1 = q[0, 0, 1] @ k[0, 0].T / np.sqrt(8)
    np.testing.assert_allclose(st.max[0, 0, 1], s1.max(), rtol=1e-6)
    np.testing.assert_allclose(st.log_norm[0, 0, 1],
                               np.log(np.exp(s1 - s1.max()).sum()), rtol=1e-5)


def test_f16_finite_bias_rows(be):
    """f16 inputs follow the same rules: a float32 bias row of finfo.min, or a float16
    bias row of finfo(float16).min, attends uniformly; -inf excludes."""
    from anyattn.backends.registry import get_backend

    if not get_backend("webgpu").context.has_f16:
        pytest.skip("adapter lacks shader-f16")
    rng = np.random.default_rng(8)
    q, g = (rng.standard_normal((1, 1, 5, 16)).astype(np.float16) for _ in range(2))
    k, v = (rng.standard_normal((1, 1, 70, 16)).astype(np.float16) for _ in range(2))
    for bdt, low in ((np.float32, F32_MIN), (np.float16, float(np.finfo(np.float16).min))):
        bias = np.zeros((1, 1, 5, 70), bdt)
        bias[0, 0, 1] = low
        bias[0, 0, 2] = -np.inf
        bias[0, 0, 3, 40:] = low
        bias[0, 0, 3, :40] = -np.inf
        bias[0, 0, 4, :] = -1e4
        out, lse = aa.attention(q, k, v, bias=bias, return_lse=True, backend="webgpu")
        ro, rl = R.forward(q, k, v, bias=bias)
        assert np.all(out[0, 0, 2] == 0) and np.isneginf(lse[0, 0, 2])
        np.testing.assert_allclose(out.astype(np.float64), ro, atol=3e-3)
        gr = aa.attention_backward(q, k, v, g, bias=bias, wrt=("q", "k", "v", "bias"),
                                   backend="webgpu")
        rg = R.backward(q, k, v, g, bias=bias, wrt=("q", "k", "v", "bias"))
        for n in ("dq", "dk", "dv", "dbias"):
            got, ref = getattr(gr, n).astype(np.float64), getattr(rg, n)
            assert np.max(np.abs(got - ref)) <= 3e-3 * max(1.0, np.max(np.abs(ref))), n


if __name__ == "__main__":      # the error table of the issue-12 report
    print(f"{'case':22s} " + " ".join(f"{n:>19s}" for n in
                                       ("out", "lse", "dq", "dk", "dv", "dbias")))
    print(f"{'':22s} " + " ".join(f"{'webgpu / torch':>19s}" for _ in range(6)))
    for case in CASES:
        for given in (False, True):
            res = errors(case, given)
            cells = [f"{res[n][0]:8.1e} / {res[n][1]:8.1e}" if n in res else f"{'-':>19s}"
                     for n in ("out", "lse", "dq", "dk", "dv", "dbias")]
            print(f"{case + (' (lse)' if given else ''):22s} " + " ".join(cells))
