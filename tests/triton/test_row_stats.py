"""The triton backend's softmax row statistics (row max and log-normaliser kept apart):
accuracy independent of the logit magnitude (issue 12, item 2; DESIGN.md §1, "Numerics
at any magnitude").

Every class here failed with the single rounded lse the kernels used before (``exp2(s2 -
lse2)``): exact logits with a row offset of 1e3 / 1e6 (errors |lse|·2⁻²⁴), uniform finite
bias rows of -1e12 / -1e30 (every gradient ≈ Sk× too large), rows whose bias is all
``finfo.min`` (×log2(e) overflowed to -inf: out = 0 instead of torch's uniform average),
a row attending to one key (P = 1 ± ulps instead of 1).  Yardstick: errors against the
float64 reference no worse than 3× PyTorch's math SDPA in the same precision, plus a
rounding floor of a few fp32 ulps (the scaled-fp16 products round an operand to ~2⁻²²).

Runs on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1) at tiny sizes.
Shape legend: B batch, Hq/Hkv heads, Sq/Sk queries/keys, D head dim.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from anyattn.modifiers import NO_MODS
import anyattn as aa  # noqa: E402
from anyattn import reference as R  # noqa: E402

from helpers import term_magnitudes, to_np  # noqa: E402
from tr_util import DEV, needs_triton  # noqa: E402


F32_MIN = float(np.finfo(np.float32).min)
#: relative rounding floor under the 3x-torch rule, by dtype (a few ulps of the scheme)
FLOOR = {"float32": 5e-7, "float16": 2e-3, "bfloat16": 1.6e-2}
TDT = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


# ----------------------------------------------------------------------------- harness
def _rounded(x, dtype):
    """x as the dtype holds it (float32 NumPy), None stays None."""
    if x is None:
        return None
    return torch.from_numpy(np.asarray(x, np.float32)).to(TDT[dtype]).float().numpy()


def _torch_math(q, k, v, g, bias, keep, dtype):
    """PyTorch's math SDPA in ``dtype`` on the CPU -> out, lse (logsumexp of its own scores,
    fp32), dq, dk, dv, dbias (float32 NumPy)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    dt = TDT[dtype]
    qt, kt, vt = (torch.from_numpy(x).to(dt).requires_grad_(True) for x in (q, k, v))
    gt = torch.from_numpy(g).to(dt)
    grp = q.shape[1] // k.shape[1]
    ke, ve = kt.repeat_interleave(grp, 1), vt.repeat_interleave(grp, 1)
    am = bt = None
    if bias is not None:
        bt = torch.from_numpy(bias).to(dt).requires_grad_(True)
        am = bt
    if keep is not None:
        neg = torch.zeros(keep.shape, dtype=dt).masked_fill(~torch.from_numpy(keep),
                                                          float("-inf"))
        am = neg if am is None else am + neg
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(qt, ke, ve, attn_mask=am)
    out.backward(gt)
    with torch.no_grad():
        sc = q.shape[-1] ** -0.5
        s = (qt * sc ** 0.5) @ (ke * sc ** 0.5).transpose(-1, -2)
        s = s if am is None else s + am
        lse = torch.logsumexp(s.float(), -1)
    res = dict(out=out, lse=lse, dq=qt.grad, dk=kt.grad, dv=vt.grad,
               dbias=None if bt is None else bt.grad)
    return {n: None if x is None else x.detach().float().numpy() for n, x in res.items()}


def _ours(q, k, v, g, bias, keep, dtype, precision=None):
    dt = TDT[dtype]
    t = lambda x: None if x is None else torch.from_numpy(x).to(DEV, dt)  # noqa: E731
    mask = None if keep is None else aa.KeepMask(torch.from_numpy(keep).to(DEV))
    wrt = ("q", "k", "v") + (("bias",) if bias is not None else ())
    out, lse = aa.attention(t(q), t(k), t(v), bias=t(bias), mask=mask, return_lse=True,
                            backend="triton", precision=precision)
    gr = aa.attention_backward(t(q), t(k), t(v), t(g), bias=t(bias), mask=mask, wrt=wrt,
                               backend="triton", precision=precision)
    res = dict(out=out, lse=lse, dq=gr.dq, dk=gr.dk, dv=gr.dv, dbias=gr.dbias)
    return {n: None if x is None else to_np(x.float()) for n, x in res.items()}


def _err(got, ref, scale):
    """max |got - ref| / scale over the finite reference entries; inf where the
    finite / non-finite pattern differs."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    fin = np.isfinite(ref)
    if not np.array_equal(np.isfinite(got), fin):
        return float("inf")
    if not fin.any():
        return 0.0
    d = float(np.abs(got[fin] - ref[fin]).max())
    return d / scale if scale > 0 else d


def compare(q, k, v, g, bias=None, keep=None, dtype="float32", precision=None):
    """{name: (our error, torch math's error)} against the float64 reference.

    Errors of out / dq / dk / dv / dbias are relative to max(max |ref|, max Σ|terms|) (the
    scale of rounding in a sum whose terms cancel: in one-hot rows dq is 0 up to noise);
    lse errors are absolute."""
    q, k, v, g, bias = (_rounded(x, dtype) for x in (q, k, v, g, bias))
    f64 = lambda x: None if x is None else x.astype(np.float64)  # noqa: E731
    mask = None if keep is None else aa.KeepMask(keep)
    wrt = ("q", "k", "v") + (("bias",) if bias is not None else ())
    ro, rl = R.forward(f64(q), f64(k), f64(v), bias=f64(bias), mask=mask)
    rg = R.backward(f64(q), f64(k), f64(v), f64(g), bias=f64(bias), mask=mask, wrt=wrt)
    ref = dict(out=ro, lse=rl, dq=rg.dq, dk=rg.dk, dv=rg.dv, dbias=rg.dbias)
    mag = term_magnitudes(q, k, v, g, mask=mask, bias=bias)
    tm = _torch_math(q, k, v, g, bias, keep, dtype)
    us = _ours(q, k, v, g, bias, keep, dtype, precision)
    res = {}
    for n, r in ref.items():
        if r is None:
            continue
        if n == "lse":
            sc = 1.0
        else:
            fin = np.isfinite(r)
            sc = max(float(np.abs(r[fin]).max()) if fin.any() else 0.0, float(np.max(mag[n])))
        res[n] = (_err(us[n], r, sc), _err(tm[n], r, sc))
    return res


def assert_3x_torch(res, dtype, what=""):
    """Every error within 3x torch math's, plus the dtype's rounding floor (lse: the
    floor relative to max(1, |lse|) is folded into the absolute one by the caller)."""
    bad = {n: (a, b) for n, (a, b) in res.items() if not a <= 3.0 * b + FLOOR[dtype]}
    assert not bad, f"{what}: ours vs torch math (float64 reference): {bad}"


def problem(kind, L, rng, B=1, Hq=2, Hkv=1, S=24, D=16):
    """Inputs of one magnitude class (float32 NumPy): q, k, v, g, bias, keep."""
    q = rng.standard_normal((B, Hq, S, D))
    k = rng.standard_normal((B, Hkv, S, D))
    v = rng.standard_normal((B, Hkv, S, D))
    g = rng.standard_normal((B, Hq, S, D))
    bias = keep = None
    if kind == "exact_offset":
        # integer q, k with scale 1/4: every score is exact in fp32, then a row offset of
        # +-L through the bias (exact too): only the softmax's own rounding is left
        q = rng.integers(-3, 4, q.shape).astype(np.float64)
        k = rng.integers(-3, 4, k.shape).astype(np.float64)
        bias = np.repeat(np.where(rng.random((B, Hq, S, 1)) < 0.5, -L, L), S, -1)
    elif kind == "exact_common":
        # no bias: integer q, k sharing a large first component a (a^2 / 4 ~ L), the rest
        # in -3..3: exact scores L + O(1), rows far from one-hot
        a = np.round(np.sqrt(4 * L))
        q = rng.integers(-3, 4, q.shape).astype(np.float64)
        k = rng.integers(-3, 4, k.shape).astype(np.float64)
        q[..., 0], k[..., 0] = a, a
    elif kind == "scaled":                       # |s| ~ L: rows nearly one-hot
        q, k = q * np.sqrt(L), k * np.sqrt(L)
    elif kind == "uniform_bias":                 # 40 % of the rows: bias L on every key
        bias = rng.standard_normal((B, Hq, S, S))
        bias[rng.random((B, Hq, S)) < 0.4] = L
    elif kind == "single_key":                   # every row keeps one key; |s| ~ L
        q, k = q * np.sqrt(L), k * np.sqrt(L)
        keep = np.zeros((S, S), bool)
        keep[np.arange(S), rng.permutation(S)] = True
    f = lambda x: None if x is None else x.astype(np.float32)  # noqa: E731
    return f(q), f(k), f(v), f(g), f(bias), keep


# ----------------------------------------------------------------------------- 3x torch
@needs_triton
@pytest.mark.parametrize("kind, L", [
    ("exact_offset", 1e3), ("exact_offset", 1e6), ("exact_common", 1e3), ("exact_common", 1e6),
    ("uniform_bias", -1e12), ("uniform_bias", -1e30), ("uniform_bias", F32_MIN),
    ("scaled", 1e3), ("scaled", 1e6), ("single_key", 1e6)],
    ids=["exact1e3", "exact1e6", "common1e3", "common1e6", "bias-1e12", "bias-1e30",
         "bias_f32min", "scaled1e3", "scaled1e6", "onekey1e6"])
def test_fp32_any_magnitude_within_3x_torch_math(kind, L):
    """fp32 (default scaled-fp16 products): out, lse, dq, dk, dv, dbias at logits up to
    1e6 and finite bias rows down to finfo.min, GQA, against float64 — no worse than 3x
    torch math SDPA in fp32 (+ a rounding floor)."""
    rng = np.random.default_rng(120)
    res = compare(*problem(kind, L, rng))
    lse_ours, lse_torch = res["lse"]
    assert lse_ours <= 3.0 * lse_torch + 4e-7 * max(1.0, abs(L)), (kind, L, res["lse"])
    res["lse"] = (0.0, 0.0)
    assert_3x_torch(res, "float32", f"{kind} {L:g}")


@needs_triton
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_padding_rows_at_finfo_min_within_3x_torch_math(dtype):
    """16-bit inputs with a bias in the same dtype whose padding rows are all
    finfo(dtype).min (Hugging Face's masks): a finite bias is a number — those rows attend
    uniformly, as in torch — and the rest stays within 3x torch math in that dtype."""
    rng = np.random.default_rng(121)
    q, k, v, g, _, _ = problem("none", 1.0, rng)
    fmin = float(torch.finfo(TDT[dtype]).min)
    bias = np.zeros((1, 1, 24, 24), np.float32)
    bias[..., :5] = fmin                                    # left padding: keys 0..4
    bias[..., :3, :] = fmin                                 # padded query rows: all min
    res = compare(q, k, v, g, bias=bias, dtype=dtype)
    assert_3x_torch(res, dtype, dtype)
    # the padded rows themselves: the float64 softmax of (score + min) — uniform for bf16
    # (min = -3.4e38), softmax(score) for fp16 (min = -65504 leaves the scores apart)
    out = aa.attention(*(torch.from_numpy(x).to(DEV, TDT[dtype]) for x in (q, k, v)),
                       bias=torch.from_numpy(bias).to(DEV, TDT[dtype]), backend="triton")
    qr, kr, vr, br = (_rounded(x, dtype).astype(np.float64) for x in (q, k, v, bias))
    ro, _ = R.forward(qr, kr, vr, bias=br)
    rows = to_np(out.float())[:, :, :3]
    assert np.abs(rows - ro[:, :, :3]).max() <= 2 * FLOOR[dtype] * np.abs(ro).max()
    if dtype == "bfloat16":
        assert np.abs(ro[:, :, :3] - vr.mean(2)[:, :, None]).max() <= 1e-12


# ----------------------------------------------------------------------------- exactness
@needs_triton
@pytest.mark.parametrize("L", [1.0, 1e3, 1e6])
def test_single_key_rows_give_p_exactly_one(L):
    """A row that attends to one key has P = 1 exactly, whatever |s| is: with exact
    products (bf16 inputs: every product is exact in fp32) out is that key's v and dv
    that row's dout, bit for bit; its log_norm is exactly 0 and its max is its score."""
    from anyattn.api import forward_with_stats

    rng = np.random.default_rng(122)
    S, D = 20, 16
    q, k, v, g, _, keep = problem("single_key", L, rng, Hq=1, Hkv=1, S=S, D=D)
    t = lambda x: torch.from_numpy(x).to(DEV, torch.bfloat16)  # noqa: E731
    mask = aa.KeepMask(torch.from_numpy(keep).to(DEV))
    out, st = forward_with_stats(t(q), t(k), t(v), mask=mask, backend="triton")
    j = keep.argmax(1)                                         # the key of each row
    assert torch.equal(out[0, 0], t(v)[0, 0, j])
    assert torch.equal(st.log_norm, torch.zeros_like(st.log_norm))
    qq = to_np(t(q).double())[0, 0]
    kk = to_np(t(k).double())[0, 0, j]
    s = (qq * kk).sum(1) / np.sqrt(D)
    terms = (np.abs(qq) * np.abs(kk)).sum(1) / np.sqrt(D)
    assert (np.abs(to_np(st.max)[0, 0] - s) <= 4e-7 * terms).all()
    gr = aa.attention_backward(t(q), t(k), t(v), t(g), mask=mask, backend="triton",
                               wrt=("v",))
    inv = np.argsort(j)                                        # row of each key
    assert torch.equal(gr.dv[0, 0], t(g)[0, 0, inv])


@needs_triton
@pytest.mark.parametrize("c", [-1e12, -1e30, F32_MIN])
def test_uniform_finite_bias_row_is_a_uniform_softmax(c):
    """A row whose bias is c on every key attends uniformly (fp32 cannot tell its scores
    apart): out = mean of v, lse = c + log(Sk) to fp32 rounding, and P sums to 1 in the
    backward — dbias rows sum to 0 and dv is 1/Sk of that row's dout, not Sk times more."""
    rng = np.random.default_rng(124)
    S, D = 24, 16
    q, k, v, g, _, _ = problem("none", 1.0, rng, Hq=1, Hkv=1, S=S, D=D)
    bias = np.zeros((1, 1, S, S), np.float32)
    bias[..., 3, :] = c                                    # one row, every key
    gz = np.zeros_like(g)
    gz[..., 3, :] = g[..., 3, :]                           # dout only on that row
    t = lambda x: torch.from_numpy(x).to(DEV)  # noqa: E731
    out, lse = aa.attention(t(q), t(k), t(v), bias=t(bias), return_lse=True, backend="triton")
    assert np.abs(to_np(out)[0, 0, 3] - v[0, 0].mean(0)).max() <= 1e-6
    assert abs(float(lse[0, 0, 3]) - (np.float32(c) + np.log(S))) <= 2e-7 * abs(c) + 1e-6
    gr = aa.attention_backward(t(q), t(k), t(v), t(gz), bias=t(bias), backend="triton",
                               wrt=("v", "bias"))
    want = np.broadcast_to(g[0, 0, 3] / S, (S, D))
    assert np.abs(to_np(gr.dv)[0, 0] - want).max() <= 1e-6 * np.abs(g[0, 0, 3]).max()
    db = to_np(gr.dbias)[0, 0, 3].astype(np.float64)
    assert abs(db.sum()) <= 1e-5 * np.abs(db).sum()


@needs_triton
def test_minus_inf_still_excludes_next_to_finfo_min():
    """-inf excludes; finfo.min is a number.  Row 0: all -inf (empty: out 0, lse -inf,
    zero gradients); row 1: keys 0..9 -inf, the rest finfo.min (uniform over keys 10..);
    row 2: key 0 finite, the rest finfo.min (one-hot on key 0)."""
    rng = np.random.default_rng(125)
    S, D = 20, 16
    q, k, v, g, _, _ = problem("none", 1.0, rng, Hq=1, Hkv=1, S=S, D=D)
    bias = rng.standard_normal((1, 1, S, S)).astype(np.float32)
    bias[..., 0, :] = -np.inf
    bias[..., 1, :10] = -np.inf
    bias[..., 1, 10:] = F32_MIN
    bias[..., 2, 1:] = F32_MIN
    t = lambda x: torch.from_numpy(x).to(DEV)  # noqa: E731
    out, lse = aa.attention(t(q), t(k), t(v), bias=t(bias), return_lse=True, backend="triton")
    o, ls = to_np(out)[0, 0], to_np(lse)[0, 0]
    assert np.all(o[0] == 0) and ls[0] == -np.inf
    assert np.abs(o[1] - v[0, 0, 10:].mean(0)).max() <= 1e-6
    assert np.abs(o[2] - v[0, 0, 0]).max() <= 1e-6
    gr = aa.attention_backward(t(q), t(k), t(v), t(g), bias=t(bias), backend="triton",
                               wrt=("q", "k", "v", "bias"))
    assert np.all(to_np(gr.dq)[0, 0, 0] == 0) and np.all(to_np(gr.dbias)[0, 0, 0] == 0)
    assert np.all(to_np(gr.dbias)[0, 0, 1, :10] == 0)
    bias[..., 0, :] = 0.0                 # (torch's math SDPA gives NaN on an empty row)
    res = compare(q, k, v, g, bias=bias)
    assert_3x_torch(res, "float32", "-inf next to finfo.min")


# ----------------------------------------------------------------------------- statistics
@needs_triton
def test_forward_statistics_contract():
    """RowStats of the forward: max = the largest kept score, log_norm >= 0 with
    lse = max + log_norm; an empty row has (-inf, 0); a NaN row has (NaN, NaN)."""
    from anyattn.api import forward_with_stats

    rng = np.random.default_rng(126)
    S, D = 20, 16
    q, k, v, _, _, _ = problem("none", 1.0, rng, Hq=2, Hkv=1, S=S, D=D)
    q[0, 1, 7, 2] = np.nan
    bias = rng.standard_normal((1, 2, S, S)).astype(np.float32) * 3
    bias[0, 0, 4] = -np.inf
    for b in (None, bias):
        t = lambda x: None if x is None else torch.from_numpy(x).to(DEV)  # noqa: E731
        _, st = forward_with_stats(t(q), t(k), t(v), bias=t(b), backend="triton")
        ref_out, ref = R.forward_stats(q, k, v, bias=b)
        mx, ln = to_np(st.max), to_np(st.log_norm)
        assert mx.dtype == np.float32 and ln.dtype == np.float32
        assert np.isnan(mx[0, 1, 7]) and np.isnan(ln[0, 1, 7])
        ok = ~np.isnan(ref.max)
        if b is not None:
            assert mx[0, 0, 4] == -np.inf and ln[0, 0, 4] == 0.0
        fin = ok & np.isfinite(ref.max)
        assert np.abs(mx[fin] - ref.max[fin]).max() <= 1e-6 * max(1, np.abs(ref.max[fin]).max())
        assert np.abs(ln[fin] - ref.log_norm[fin]).max() <= 1e-6
        assert (ln[ok] >= 0).all()


@needs_triton
def test_given_lse_keeps_its_literal_meaning():
    """RowStats.from_lse(lse) (max = lse, log_norm = 0) gives P = exp(s - lse) literally —
    also an lse over more keys than these (ring attention's global one, here + log 3) —
    and the forward's own statistics give the same gradients as their lse."""
    from anyattn.api import forward_with_stats
    from anyattn.backends.registry import get_backend
    from anyattn.problem import describe
    from anyattn.rowstats import RowStats

    rng = np.random.default_rng(127)
    q, k, v, g, _, _ = problem("none", 1.0, rng, Hq=2, Hkv=1, S=21, D=16)
    bias = rng.standard_normal((1, 2, 21, 21)).astype(np.float32)
    t = lambda x: torch.from_numpy(x).to(DEV)  # noqa: E731
    qt, kt, vt, gt, bt = (t(x) for x in (q, k, v, g, bias))
    out, st = forward_with_stats(qt, kt, vt, bias=bt, backend="triton")
    be = get_backend("triton")
    wrt = ("q", "k", "v", "bias")
    for lse in (st.lse, st.lse + float(np.log(3.0))):
        p = describe(qt, kt, vt, dout=gt, out=out, lse=lse, bias=bt, wrt=wrt)
        got = be.backward(p, qt, kt, vt, gt, out, RowStats.from_lse(lse), bt, NO_MODS)
        f64 = lambda x: to_np(x).astype(np.float64)  # noqa: E731
        rg = R.backward(f64(qt), f64(kt), f64(vt), f64(gt), bias=f64(bt), wrt=wrt,
                        out=f64(out), lse=f64(lse))
        for n in ("dq", "dk", "dv", "dbias"):
            ref = getattr(rg, n)
            assert np.abs(to_np(got[n]) - ref).max() <= 2e-6 * np.abs(ref).max(), n
    p = describe(qt, kt, vt, dout=gt, out=out, lse=st.lse, bias=bt, wrt=wrt)
    a = be.backward(p, qt, kt, vt, gt, out, st, bt, NO_MODS)
    b = be.backward(p, qt, kt, vt, gt, out, RowStats.from_lse(st.lse), bt, NO_MODS)
    for n in ("dq", "dk", "dv", "dbias"):
        assert torch.allclose(a[n], b[n], rtol=0, atol=2e-6 * float(a[n].abs().max())), n
