"""Attention dropout on the numpy backend against the float64 reference applying the same
mask (``anyattn.dropout_mask``): out, lse (undropped), dq, dk, dv, dbias, dsinks with
every mask kind, bias, GQA, Sq != Sk, odd sizes, offsets (which shift the draw), the
score modifiers, fp64/fp32/fp16/bf16, torch tensors, the bshd layout; the mask itself
read back bit for bit; the same bits for 1 and 2 worker threads, across calls and from
concurrent callers; seeds >= 2**63; p near 0 and near 1.

Shape legend: B batch, Hq/Hkv query/key-value heads, Sq/Sk queries/keys, D head dim.
Errors are measured as in ``np_util.check``: relative to max|ref|, or, where that is
exceeded, to the summed magnitude of each result's terms (``helpers.term_magnitudes``,
which knows the dropout), within ``helpers.TOL``.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

import anyattn as aa
from anyattn import reference as R
from anyattn.backends.numpy_tiles import DropoutDraw
from anyattn.backends.registry import get_backend
from anyattn.dropout import dropout_mask, threshold

from helpers import TOL, assert_close, term_magnitudes, to_np
from np_util import mask_cases, qkv

DTYPES = ["float64", "float32"]
GRADS = {"q": "dq", "k": "dk", "v": "dv", "bias": "dbias", "sinks": "dsinks"}
SEED = 2 ** 63 + 0x9E3779B97F4A7C15 % 2 ** 62          # above 2**63: both key words used


@pytest.fixture(autouse=True)
def small_tiles(np_config):
    """Small tiles: these sizes then span full, partial, empty and ragged tiles."""
    np_config(fwd_bq=32, fwd_bk=48, bwd_bq=48, bwd_bk=32, threads=2)


# ------------------------------------------------------------------------ harness
def check(q, k, v, g, *, dtype, p=0.3, seed=SEED, wrt=("q", "k", "v"), tol=None, **kw):
    """numpy backend vs the reference with dropout (p, seed): out, lse, the requested
    gradients.  ``kw``: mask, bias, scale, q_offset, k_offset, softcap, alibi_slopes,
    sinks, layout.  Returns (out, lse, grads)."""
    tol = TOL[dtype] if tol is None else tol
    kw = dict(kw, dropout_p=p, dropout_seed=seed)
    out, lse = aa.attention(q, k, v, return_lse=True, backend="numpy", **kw)
    grads = aa.attention_backward(q, k, v, g, wrt=wrt, backend="numpy", **kw)
    layout = kw.pop("layout", "bhsd")
    sw = (lambda x: x) if layout == "bhsd" else (lambda x: np.swapaxes(to_np(x), 1, 2))
    q, k, v, g = (sw(x) for x in (q, k, v, g))
    ro, rl = R.forward(q, k, v, **kw)
    rg = R.backward(q, k, v, g, wrt=wrt, **kw)
    mkw = {n: x for n, x in kw.items() if n not in ("dropout_p", "dropout_seed")}
    mag = term_magnitudes(q, k, v, g, dropout_p=p, dropout_seed=seed, **mkw)
    out_np, lse_np = sw(to_np(out)), to_np(lse)
    assert out_np.dtype == np.dtype(dtype) and out_np.shape == ro.shape
    assert_close(out_np, ro, dtype, "out", tol=tol, magnitude=mag["out"])
    _, rl0 = R.forward(q, k, v, **mkw)                   # lse is that of the undropped P
    np.testing.assert_array_equal(rl, rl0)
    fin = np.isfinite(rl)
    assert np.array_equal(np.isfinite(lse_np), fin), "lse must be -inf exactly where ref is"
    if fin.any():
        el = np.max(np.abs(lse_np[fin] - rl[fin])) / max(1.0, np.abs(rl[fin]).max())
        assert el <= tol, f"lse: error {el:.3g} > {tol:.1g}"
    for name in wrt:
        key = GRADS[name]
        got = getattr(grads, key)
        got = to_np(got) if key in ("dbias", "dsinks") else sw(to_np(got))
        ref = getattr(rg, key)
        assert got.shape == ref.shape, (key, got.shape, ref.shape)
        assert_close(got, ref, dtype, key, tol=tol, magnitude=mag[key])
    for name, key in GRADS.items():
        if name not in wrt:
            assert getattr(grads, key) is None, f"{key} computed though not requested"
    return out, lse, grads


SHAPES = {  # (B, Hq, Hkv, Sq, Sk, D)
    "odd113": (1, 2, 2, 113, 113, 24),
    "gqa_sq<sk": (2, 4, 2, 70, 131, 20),
    "sq>sk": (1, 3, 1, 97, 41, 16),
    "one": (1, 1, 1, 1, 1, 1),
}


# ------------------------------------------------------------------- against the oracle
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", list(SHAPES))
def test_shapes(shape, dtype):
    check(*qkv(2, *SHAPES[shape], dtype=dtype), dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_name", list(mask_cases(2, 5, 5, np.random.default_rng(0))))
def test_every_mask(mask_name, dtype):
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 83, 101, 16
    mask = mask_cases(Hq, Sq, Sk, np.random.default_rng(3))[mask_name]
    out, lse, _ = check(*qkv(4, B, Hq, Hkv, Sq, Sk, D, dtype=dtype), dtype=dtype, mask=mask)
    if mask_name == "keep":
        assert np.all(to_np(out)[:, :, 3] == 0) and np.all(to_np(lse)[:, :, 3] == -np.inf)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias_shape", [(2, 4, 75, 90), (1, 4, 1, 90), (2, 4, 75, 1),
                                        (75, 90)], ids=["full", "1h1k", "bhq1", "qk_2d"])
def test_bias_and_dbias(bias_shape, dtype):
    """A bias runs the natural-unit forward; dbias = dS with the dropped dP."""
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 75, 90, 16
    bias = np.random.default_rng(7).standard_normal(bias_shape).astype(dtype)
    _, _, gr = check(*qkv(8, B, Hq, Hkv, Sq, Sk, D, dtype=dtype), dtype=dtype, bias=bias,
                     mask=aa.Causal("bottom_right"), wrt=("q", "k", "v", "bias"))
    assert gr.dbias.shape == bias.shape


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_bias", [False, True])
def test_with_softcap_alibi_sinks(dtype, with_bias):
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 77, 95, 16
    rng = np.random.default_rng(9)
    kw = dict(softcap=1.7, alibi_slopes=rng.uniform(0.05, 1.0, (B, Hq)).astype(dtype),
              sinks=rng.standard_normal(Hq).astype(dtype))
    wrt = ("q", "k", "v", "sinks")
    if with_bias:
        kw["bias"] = rng.standard_normal((1, Hq, Sq, Sk)).astype(dtype)
        wrt += ("bias",)
    check(*qkv(10, B, Hq, Hkv, Sq, Sk, D, dtype=dtype), dtype=dtype,
          mask=aa.Causal("bottom_right") & aa.Window(left=40, align="bottom_right"),
          q_offset=7, k_offset=3, wrt=wrt, **kw)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offsets", [(40, 3), (0, 25), (3000, 0), (2 ** 32 - 60, 2 ** 32 - 90)],
                         ids=["q40_k3", "k25", "q3000", "near_2^32"])
def test_offsets_shift_the_draw(offsets, dtype):
    """Offsets move the mask (global positions): results match the reference drawing at
    those positions and differ from the draw at offset 0."""
    qo, ko = offsets
    B, Hq, Hkv, Sq, Sk, D = 1, 2, 2, 50, 90, 16
    q, k, v, g = qkv(12, B, Hq, Hkv, Sq, Sk, D, dtype=dtype)
    out, _, _ = check(q, k, v, g, dtype=dtype, q_offset=qo, k_offset=ko)
    # the same problem at offset 0 (no mask depends on the offsets here): another draw
    at0 = aa.attention(q, k, v, backend="numpy", dropout_p=0.3, dropout_seed=SEED)
    assert np.max(np.abs(to_np(out) - to_np(at0))) > 0.1


@pytest.mark.parametrize("dtype", DTYPES)
def test_large_logits_take_the_running_max_path(dtype):
    """Logits past the bounded forward's limit: running-max tiles (base 2 and natural)."""
    B, Hq, Hkv, Sq, Sk, D = 1, 2, 1, 70, 80, 16
    q, k, v, g = qkv(14, B, Hq, Hkv, Sq, Sk, D, dtype=dtype)
    check((q * 12).astype(dtype), k, v, g, dtype=dtype, mask=aa.Causal())


@pytest.mark.parametrize("dtype", DTYPES)
def test_running_max_forward(np_config, dtype):
    np_config(fwd_bq=32, fwd_bk=48, bwd_bq=48, bwd_bk=32, threads=2, bounded=False)
    check(*qkv(15, 2, 2, 1, 67, 99, 12, dtype=dtype), dtype=dtype, mask=aa.Window(left=30))


@pytest.mark.parametrize("dtype", DTYPES)
def test_one_key_rows(dtype):
    """Rows keeping exactly one key (the bounded forward sets out = v of it): out =
    keep·v/(1 - p) of that key, exactly 0 where it is dropped."""
    B, Hq, Hkv, Sq, Sk, D = 1, 3, 1, 90, 90, 8
    q, k, v, g = qkv(16, B, Hq, Hkv, Sq, Sk, D, dtype=dtype)
    p = 0.5
    out, _, _ = check(q, k, v, g, dtype=dtype, p=p, mask=aa.Window(left=0, right=0),
                      k_offset=5, q_offset=5)
    keep = dropout_mask((B, Hq, Sq, Sk), p, SEED, q_offset=5, k_offset=5)
    diag = keep[..., np.arange(Sq), np.arange(Sq)]                       # [B, Hq, Sq]
    assert 0 < diag.sum() < diag.size
    assert np.all(to_np(out)[~diag] == 0)
    want = np.where(diag[..., None], np.repeat(v, Hq, axis=1) * 2, 0)
    np.testing.assert_allclose(to_np(out), want, rtol=TOL[dtype], atol=0)


@pytest.mark.parametrize("wrt", [("v",), ("q",), ("k", "sinks"), ("sinks",)])
def test_partial_wrt(wrt):
    """dv alone (the kernel skips dS), dq alone, dk with dsinks, dsinks alone."""
    B, Hq, Hkv, Sq, Sk, D = 1, 2, 1, 60, 70, 8
    sinks = np.array([0.3, -0.2])
    check(*qkv(17, B, Hq, Hkv, Sq, Sk, D), dtype="float64", mask=aa.Causal(), wrt=wrt,
          sinks=sinks)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_inputs(dtype):
    torch = pytest.importorskip("torch")
    B, Hq, Hkv, Sq, Sk, D = 1, 2, 1, 60, 75, 16
    tq, tk, tv, tg = (torch.from_numpy(x).to(getattr(torch, dtype))
                      for x in qkv(18, B, Hq, Hkv, Sq, Sk, D, dtype="float32"))
    kw = dict(mask=aa.Causal(), dropout_p=0.2, dropout_seed=SEED)
    out = aa.attention(tq, tk, tv, backend="numpy", **kw)
    gr = aa.attention_backward(tq, tk, tv, tg, backend="numpy", **kw)
    assert out.dtype == getattr(torch, dtype) and gr.dq.dtype == getattr(torch, dtype)
    n = (lambda x: x.float().numpy())
    ro, _ = R.forward(n(tq), n(tk), n(tv), **kw)
    rg = R.backward(n(tq), n(tk), n(tv), n(tg), **kw)
    mag = term_magnitudes(n(tq), n(tk), n(tv), n(tg), dropout_p=0.2, dropout_seed=SEED,
                          mask=aa.Causal())
    assert_close(n(out), ro, dtype, "out", magnitude=mag["out"])
    for key in ("dq", "dk", "dv"):
        assert_close(n(getattr(gr, key)), getattr(rg, key), dtype, key, magnitude=mag[key])


def test_torch_cpu_tensors_and_bshd_layout():
    torch = pytest.importorskip("torch")
    B, Hq, Hkv, Sq, Sk, D = 2, 4, 2, 45, 66, 16
    q, k, v, g = qkv(19, B, Hq, Hkv, Sq, Sk, D, dtype="float32")
    sw = (lambda x: torch.from_numpy(np.ascontiguousarray(np.swapaxes(x, 1, 2))))
    out, _, gr = check(sw(q), sw(k), sw(v), sw(g), dtype="float32", layout="bshd",
                       mask=aa.Causal(), q_offset=9)
    assert isinstance(out, torch.Tensor) and isinstance(gr.dq, torch.Tensor)
    assert out.shape == (B, Sq, Hq, D)


# ------------------------------------------------------------- the mask, bit for bit
def _read_mask(q_offset, k_offset, p, seed, path):
    """The keep mask the backend applies, read back: with q = 0 every kept key has P =
    1/Sk, so out = keep·v/((1 - p)·Sk) and v = identity (Sk = D) gives out[i, j] > 0
    iff keep[i, j]; dv = (P∘keep/(1 - p))ᵀ·dout with dout = identity (Sq = D) gives
    dv[j, i] > 0 iff keep[i, j] (Hq = Hkv: no group sum)."""
    B, H, S = 2, 3, 70
    q = np.zeros((B, H, S, S), np.float32)
    eye = np.broadcast_to(np.eye(S, dtype=np.float32), (B, H, S, S)).copy()
    kw = dict(dropout_p=p, dropout_seed=seed, q_offset=q_offset, k_offset=k_offset)
    if path == "bias":                                       # natural-unit forward/backward
        kw["bias"] = np.zeros((1, 1, S, S), np.float32)
    out = aa.attention(q, q, eye, backend="numpy", **kw)
    dv = aa.attention_backward(q, q, eye, eye, wrt=("v",), backend="numpy", **kw).dv
    want = dropout_mask((B, H, S, S), p, seed, q_offset=q_offset, k_offset=k_offset)
    s = 1.0 / ((1.0 - p) * S)
    np.testing.assert_allclose(out, np.where(want, s, 0), rtol=1e-6, atol=0)
    return out > 0, np.swapaxes(dv, 2, 3) > 0, want


@pytest.mark.parametrize("path", ["bounded", "running", "bias"])
@pytest.mark.parametrize("offsets", [(0, 0), (17, 2 ** 31 + 5), (2 ** 32 - 70, 123)],
                         ids=["0", "k_2^31", "q_2^32"])
def test_mask_is_anyattns_bit_for_bit(np_config, path, offsets):
    if path == "running":
        np_config(fwd_bq=32, fwd_bk=48, bwd_bq=48, bwd_bk=32, threads=2, bounded=False)
    got_f, got_b, want = _read_mask(*offsets, 0.37, SEED, path)
    np.testing.assert_array_equal(got_f, want)
    np.testing.assert_array_equal(got_b, want)


@pytest.mark.parametrize("seed", [0, 1, 2 ** 32 - 1, 2 ** 32, 2 ** 63, 2 ** 64 - 1])
def test_mask_for_seeds_across_the_range(seed):
    """Both key words reach the draw: seeds s and s + 2**32 or s + 2**63 draw differently."""
    got, _, want = _read_mask(3, 4, 0.5, seed, "bounded")
    np.testing.assert_array_equal(got, want)


def test_seed_words_both_matter():
    a = _read_mask(0, 0, 0.5, 12345, "bounded")[0]
    b = _read_mask(0, 0, 0.5, 12345 + 2 ** 32, "bounded")[0]
    c = _read_mask(0, 0, 0.5, 12345 + 2 ** 63, "bounded")[0]
    assert np.mean(a != b) > 0.3 and np.mean(a != c) > 0.3


def test_tile_draw_matches_dropout_mask():
    """DropoutDraw / DropoutTiles (the folded generator) on ragged tiles of every
    threshold kind, float32 and float64, against the dense reference mask."""
    B, H, Sq, Sk = 2, 2, 37, 53
    for p in (1e-9, 0.1, 0.5, 0.9, 1 - 2 ** -20):
        want = dropout_mask((B, H, Sq, Sk), p, SEED, q_offset=11, k_offset=2 ** 32 - Sk)
        draw = DropoutDraw(p, SEED, 11, 2 ** 32 - Sk, Sq, Sk)
        for dt in (np.float32, np.float64):
            tiles = draw.tiles(20 * 20, np.dtype(dt))
            for b in range(B):
                for h in range(H):
                    rows = draw.rows(b, h)
                    for i0 in range(0, Sq, 20):
                        for j0 in range(0, Sk, 20):
                            i1, j1 = min(i0 + 20, Sq), min(j0 + 20, Sk)
                            kt = tiles.keep_t(rows[i0:i1], j0, j1)
                            w = want[b, h, i0:i1, j0:j1].T
                            if kt is None:
                                assert draw.keep_all and w.all()
                                continue
                            assert kt.dtype == dt
                            np.testing.assert_array_equal(kt, w.astype(dt))
                    jj = np.arange(Sk)[::-1][:Sq] if Sk >= Sq else np.arange(Sq) % Sk
                    np.testing.assert_array_equal(draw.keep_pairs(rows, jj),
                                                  want[b, h, np.arange(Sq), jj])


def test_folded_compare_on_the_threshold_window():
    """The kernels compare ``x ^ (t >> 16) >= t`` instead of finishing mix32: the two
    differ in nothing, including the draws whose high half equals t's (one in 2**16,
    which random tests rarely meet): found here and checked one by one."""
    p, seed, Sq, Sk = 0.37, SEED, 512, 1024
    t = threshold(p)
    assert t & 0xFFFF                                       # low half matters for this p
    draw = DropoutDraw(p, seed, 0, 0, Sq, Sk)
    rows = draw.rows(0, 0)
    x = rows[None, :] ^ draw.cols[:, None]                  # [Sk, Sq], before mix32's rest
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)                              # mix32 but its last xorshift
    jj, ii = np.nonzero((x >> np.uint32(16)) == np.uint32(t >> 16))
    assert len(jj) >= 3                                     # ~8 expected
    w = x[jj, ii]
    assert np.any((w >= np.uint32(t)) != ((w ^ (w >> np.uint32(16))) >= np.uint32(t))), \
        "no window draw where skipping the last xorshift would matter: pick another p"
    want = dropout_mask((1, 1, Sq, Sk), p, seed)[0, 0]
    assert 0 < want[ii, jj].sum() < len(jj)                 # both outcomes in the window
    np.testing.assert_array_equal(draw.keep_pairs(rows[ii], jj), want[ii, jj])
    kt = draw.tiles(Sq * Sk, np.dtype(np.float32)).keep_t(rows, 0, Sk)   # [Sk, Sq]
    np.testing.assert_array_equal(kt[jj, ii], want[ii, jj].astype(np.float32))
    np.testing.assert_array_equal(kt, want.T.astype(np.float32))


# -------------------------------------------------------------------- p at the edges
def test_p_close_to_zero_keeps_everything_and_scales():
    """p = 1e-12: threshold 0, nothing dropped (the kernels skip the draw), out scaled
    by 1/(1 - p) (a no-op in float32)."""
    p = 1e-12
    assert threshold(p) == 0
    q, k, v, g = qkv(20, 1, 2, 2, 50, 60, 8)
    out, _, _ = check(q, k, v, g, dtype="float64", p=p, mask=aa.Causal())
    plain = aa.attention(q, k, v, backend="numpy", mask=aa.Causal())
    np.testing.assert_allclose(out, plain / (1 - p), rtol=1e-14, atol=1e-300)


@pytest.mark.parametrize("p", [0.999, 1 - 2 ** -24, 1 - 1e-12])
@pytest.mark.parametrize("dtype", DTYPES)
def test_p_close_to_one(p, dtype):
    """Nearly everything dropped; the kept few carry 1/(1 - p).  At t = 2**32 - 1 only a
    draw of 0xFFFFFFFF is kept: out and every gradient but dsinks' are 0 here."""
    q, k, v, g = qkv(21, 1, 2, 1, 64, 70, 8, dtype=dtype)
    out, _, gr = check(q, k, v, g, dtype=dtype, p=p, mask=aa.Causal("bottom_right"),
                       sinks=np.array([0.1, 0.4], dtype), wrt=("q", "k", "v", "sinks"))
    if threshold(p) == 2 ** 32 - 1:
        assert not dropout_mask((1, 2, 64, 70), p, SEED).any()
        assert np.all(out == 0) and np.all(gr.dq == 0) and np.all(gr.dv == 0)


# ------------------------------------------------------------ determinism, threads
def test_same_bits_for_one_and_two_threads_and_across_calls(np_config):
    """The draw depends on positions only: out, dk, dv bitwise equal at 1 and 2 worker
    threads (whichever unit drew a tile) and across calls; dq (split key ranges are
    summed in chunk order, which depends on the thread count) within rounding."""
    q, k, v, g = qkv(22, 2, 4, 2, 150, 170, 16, dtype="float32")
    kw = dict(mask=aa.Causal("bottom_right"), dropout_p=0.2, dropout_seed=SEED,
              softcap=5.0, q_offset=3)
    res = {}
    for threads in (1, 2, 2):
        np_config(fwd_bq=32, fwd_bk=48, bwd_bq=48, bwd_bk=32, threads=threads)
        out = aa.attention(q, k, v, backend="numpy", **kw)
        gr = aa.attention_backward(q, k, v, g, backend="numpy", **kw)
        res.setdefault(threads, []).append((out, gr))
    (o1, g1), = res[1]
    (o2, g2), (o3, g3) = res[2]
    for a, b in ((o1, o2), (o2, o3), (g1.dk, g2.dk), (g1.dv, g2.dv), (g2.dq, g3.dq),
                 (g2.dk, g3.dk), (g2.dv, g3.dv)):
        assert np.array_equal(a, b)
    np.testing.assert_allclose(g1.dq, g2.dq, rtol=0, atol=1e-5 * np.abs(g1.dq).max())


def test_concurrent_callers_get_their_own_draws():
    """Four threads calling at once with different seeds (per-unit scratch, shared
    pool) get exactly what they get one at a time."""
    q, k, v, g = qkv(23, 1, 4, 2, 120, 130, 16, dtype="float32")

    def run(seed):
        kw = dict(dropout_p=0.3, dropout_seed=seed, mask=aa.Causal())
        return (aa.attention(q, k, v, backend="numpy", **kw),
                aa.attention_backward(q, k, v, g, backend="numpy", **kw).dv)

    seeds = [5, 6, 2 ** 64 - 7, 2 ** 40]
    alone = [run(s) for s in seeds]
    got = [None] * len(seeds)

    def worker(i):
        for _ in range(3):
            got[i] = run(seeds[i])

    ths = [threading.Thread(target=worker, args=(i,)) for i in range(len(seeds))]
    for t in ths:
        t.start()
    for t in ths:
        t.join()
    for (ao, adv), (go, gdv) in zip(alone, got):
        assert np.array_equal(ao, go) and np.array_equal(adv, gdv)
    assert not np.array_equal(alone[0][0], alone[1][0])


def test_capability_and_no_refusal():
    """numpy takes dropout (it refused it before): no reason given, auto-dispatch on
    CPU arrays may pick it."""
    from anyattn.problem import describe

    be = get_backend("numpy")
    assert "dropout" in be.capabilities.modifiers
    q = np.zeros((1, 1, 4, 8))
    assert be.unsupported_reasons(describe(q, q, q, dropout_p=0.1, dropout_seed=1)) == []


def test_no_dense_mask_is_stored():
    """Dropout adds per-tile scratch and O(Sq + Sk) words, never an [Sq, Sk] array:
    the traced peak of a forward and a backward grows by far less than one bool per
    score over the call without dropout."""
    import tracemalloc

    B, H, S, D = 1, 2, 1024, 16
    q, k, v, g = qkv(24, B, H, H, S, S, D, dtype="float32")

    def peak(**kw):
        tracemalloc.start()
        try:
            out = aa.attention(q, k, v, backend="numpy", **kw)
            aa.attention_backward(q, k, v, g, out=out, backend="numpy",
                                  lse=aa.attention(q, k, v, backend="numpy",
                                                   return_lse=True, **kw)[1], **kw)
            return tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()

    plain = peak()
    dropped = peak(dropout_p=0.2, dropout_seed=SEED)
    assert dropped - plain < 0.1 * B * H * S * S, (plain, dropped)
