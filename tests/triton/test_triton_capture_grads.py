"""Gradients of score-function captures on the portable Triton backward (interpreter on
CPU tensors): the diagonal sums of a tile, the gallery's learnable tables against the
float64 reference (fp32, bf16; GQA, Sq != Sk, causal), reads indexed by b, h and
q_idx - kv_idx, row reads (q_idx alone) and column reads (kv_idx alone) alone and mixed
with those, a capture of rank 0, tile lists with softcap, dropout and sinks, repeated
runs bitwise equal, anyattn.torch's autograd, and the refusal of a capture read
otherwise (pair reads, t[h, q_idx, kv_idx]: test_triton_pair_reads.py).  The backward
gets out and the row statistics from the NumPy backend (the Triton forward is tested
elsewhere) and asks for dk, dv and the captures: the dK/dV launch computes all three,
so no test pays for the dQ kernel.

Shape legend: B batch, Hq/Hkv heads, Sq/Sk queries/keys, D head dim."""
import numpy as np
import pytest

from tr_util import T, grad_inputs, needs_triton, torch

import triton  # noqa: E402  (tr_util skips this module without it)
import triton.language as tl

import anyattn as aa
from anyattn.backends.triton.kernels import _dcap_store
from anyattn.rowstats import RowStats

from helpers import assert_close, load_gallery

gallery = load_gallery()

pytestmark = needs_triton

#: the gallery entries with learnable captures
LEARNABLE = sorted(n for n, (m, _) in gallery.GALLERY.items()
                   if m(1, 2, 8, 8, np.random.default_rng(0)).wrt)




def _f64(*xs):
    return [x.astype(np.float64) for x in xs]


def test_the_gallery_has_learnable_tables():
    assert {"relative_position_bias", "t5_buckets", "alibi", "tanh_gate"} <= set(LEARNABLE)


@triton.jit
def _probe(E, OUT, TOT, BN: tl.constexpr, BM: tl.constexpr):
    jj = tl.arange(0, BN)
    ii = tl.arange(0, BM)
    e = tl.load(E + jj[:, None] * BM + ii[None, :])                                 # [BN, BM]
    _dcap_store(OUT, e, BN, BM, True)
    _dcap_store(TOT, e, BN, BM, False)


def _backward(q, k, v, g, wrt, dtype="float32", **kw):
    """attention_backward on Triton with out / statistics from the NumPy backend's fp32
    forward (on the same rounded inputs)."""
    td = getattr(torch, dtype)
    fw = {n: x for n, x in kw.items() if n not in ("score_mod",)}
    out, st = aa.forward_with_stats(q, k, v, backend="numpy", score_mod=kw.get("score_mod"),
                                    **fw)
    tkw = {n: (T(x) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}
    return aa.attention_backward(*(T(x, td) for x in (q, k, v, g)), out=T(out, td),
                                 lse=RowStats(T(st.max), T(st.log_norm)), wrt=wrt,
                                 backend="triton", **tkw)


def _reference(q, k, v, g, wrt, **kw):
    kw = {n: (x.astype(np.float64) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}
    return aa.attention_backward(*_f64(q, k, v, g), wrt=wrt, backend="reference", **kw)


@pytest.mark.parametrize("bm, bn", [(16, 32), (32, 16), (16, 16)])
def test_a_tiles_diagonal_sums(bm, bn):
    """kernels._dcap_store: a transposed tile [BN, BM] summed along each diagonal
    t = ii - jj + BN - 1 (both orders of the tile sides), and its total."""
    e = np.random.default_rng(bm + bn).standard_normal((bn, bm)).astype(np.float32)
    out = torch.full((bm + bn,), 7.0)                 # the last entry stays untouched
    tot = torch.zeros(1)
    _probe[(1,)](T(e), out, tot, BN=bn, BM=bm)
    want = np.zeros(bm + bn - 1)
    for jj in range(bn):
        for ii in range(bm):
            want[ii - jj + bn - 1] += e[jj, ii]
    np.testing.assert_allclose(out[:-1].numpy(), want, rtol=1e-5, atol=1e-5)
    assert out[-1] == 7.0
    np.testing.assert_allclose(tot.numpy(), [e.astype(np.float64).sum()], rtol=1e-5)


@pytest.mark.parametrize("name, dtype", [(n, "float32") for n in LEARNABLE]
                         + [("relative_position_bias", "bfloat16"), ("t5_buckets", "bfloat16")])
def test_gallery_capture_gradients_match_the_float64_reference(name, dtype):
    """dk, dv and the capture gradients (in the capture's shape and dtype), GQA 4 : 2,
    Sq != Sk; causal where the entry is."""
    make, _ = gallery.GALLERY[name]
    sq, sk = 24, 40
    q, k, v, g = grad_inputs(len(name), 1, 4, 2, sq, sk, 16, dtype)
    e = make(1, 4, sq, sk, np.random.default_rng(7))
    wrt = ("k", "v") + e.wrt
    gr = _backward(q, k, v, g, wrt, dtype, **e.kwargs)
    rg = _reference(q, k, v, g, wrt, **e.kwargs)
    for n in ("dk", "dv"):
        assert_close(getattr(gr, n).float().cpu().numpy(), getattr(rg, n), dtype, f"{name} {n}")
    for n in e.wrt:
        got = gr.dcaptures[n]
        cap = e.kwargs["score_mod"].captures[n]
        assert isinstance(got, torch.Tensor) and tuple(got.shape) == cap.shape
        assert got.dtype == getattr(torch, str(cap.dtype))
        assert_close(got.cpu().numpy(), rg.dcaptures[n], dtype, f"{name} d{n}")


def test_the_plans_capture_tile_runs_the_capture_backward(monkeypatch):
    """Plan.dkdv_captures (the dK/dV tile where capture gradients are summed) is the one
    that runs them, and gives the reference's results: a plan whose capture tile (32 query
    rows, 16 keys) differs from its dK/dV tile (16 x 32)."""
    from dataclasses import replace

    from anyattn.backends.triton import capture_grads, configs

    fixed = configs.fixed_plan
    monkeypatch.setattr(configs, "fixed_plan", lambda fused_bwd=True: replace(
        fixed(fused_bwd), dkdv_captures=configs.KernelConfig(32, 16, 4, 1)).check())
    monkeypatch.setattr(configs, "_plan_cache", {})
    tiles = []
    real = capture_grads.CaptureGrads.scratch

    def scratch(self, bm, bn, *chunk):   # the slots are shaped by the tile that runs
        tiles.append((bm, bn))
        return real(self, bm, bn, *chunk)
    monkeypatch.setattr(capture_grads.CaptureGrads, "scratch", scratch)
    make, _ = gallery.GALLERY["relative_position_bias"]
    sq, sk = 24, 40
    q, k, v, g = grad_inputs(3, 1, 4, 2, sq, sk, 16, "float32")
    e = make(1, 4, sq, sk, np.random.default_rng(7))
    wrt = ("k", "v") + e.wrt
    gr = _backward(q, k, v, g, wrt, **e.kwargs)
    rg = _reference(q, k, v, g, wrt, **e.kwargs)
    assert tiles == [(32, 16)], tiles
    for n in ("dk", "dv"):
        assert_close(getattr(gr, n).cpu().numpy(), getattr(rg, n), "float32", n)
    for n in e.wrt:
        assert_close(gr.dcaptures[n].cpu().numpy(), rg.dcaptures[n], "float32", f"d{n}")


def test_reads_of_batch_head_and_diagonal_and_a_scalar_capture():
    """Two reads of one table (per batch, at +d and -d), a table read at [b, h] and a
    capture of rank 0 (the score's factor), wrt naming the captures only."""
    B, Sq, Sk = 2, 20, 12
    q, k, v, g = grad_inputs(3, B, 2, 1, Sq, Sk, 16)
    rng = np.random.default_rng(4)
    t = rng.standard_normal((B, Sq + Sk - 1)).astype(np.float32)
    w = rng.standard_normal((B, 2)).astype(np.float32)
    c = np.array(0.7, np.float32)

    def fn(s, b, h, i, j, t, w, c):
        return s * c + t[b, i - j + Sk - 1] - 0.5 * t[b, j - i + Sq - 1] * w[b, h]

    sm = aa.ScoreMod(fn, t=t, w=w, c=c)
    wrt = ("t", "w", "c")
    gr = _backward(q, k, v, g, wrt, score_mod=sm)
    rg = _reference(q, k, v, g, wrt, score_mod=sm)
    assert gr.dq is None and gr.dk is None and gr.dv is None
    for n in wrt:
        assert tuple(gr.dcaptures[n].shape) == sm.captures[n].shape
        assert_close(gr.dcaptures[n].cpu().numpy(), rg.dcaptures[n], "float32", f"d{n}")


def test_tile_lists_with_softcap_dropout_sinks_and_repeated_runs_bitwise_equal():
    """A mask union (tile lists; mask blocks whose last sub-tiles lie past Sq) with
    softcap, dropout and sinks, a diagonal, a row and a column read: dk, dv, dsinks and
    the captures' gradients against the reference, and a second run gives the same
    bits."""
    Sq, Sk = 40, 24
    q, k, v, g = grad_inputs(6, 1, 4, 2, Sq, Sk, 16)
    rng = np.random.default_rng(8)
    tab = rng.standard_normal((4, Sq + Sk - 1)).astype(np.float32)
    qb = rng.standard_normal(Sq).astype(np.float32)
    kb = rng.standard_normal((4, Sk)).astype(np.float32)
    sm = aa.ScoreMod(lambda s, b, h, i, j, tab, qb, kb:
                     s * 0.5 + tab[h, i - j + Sk - 1] + qb[i] * kb[h, j],
                     tab=tab, qb=qb, kb=kb)
    kw = dict(score_mod=sm, softcap=2.0, dropout_p=0.2, dropout_seed=11,
              sinks=rng.standard_normal(4).astype(np.float32),
              mask=aa.Causal("bottom_right") | aa.MaskMod(lambda b, h, i, j: j < 3))
    wrt = ("k", "v", "tab", "qb", "kb", "sinks")
    runs = [_backward(q, k, v, g, wrt, **kw) for _ in range(2)]
    rg = _reference(q, k, v, g, wrt, **kw)
    for n in ("dk", "dv", "dsinks"):
        assert_close(getattr(runs[0], n).cpu().numpy(), getattr(rg, n), "float32", n)
    for n in ("tab", "qb", "kb"):
        assert_close(runs[0].dcaptures[n].cpu().numpy(), rg.dcaptures[n], "float32", f"d{n}")
        assert torch.equal(runs[0].dcaptures[n], runs[1].dcaptures[n])
    assert torch.equal(runs[0].dk, runs[1].dk)


#: score functions with row reads (an index of q_idx alone), column reads (kv_idx
#: alone) and mixes; name -> (function, {capture: shape} of Hq, Sq, Sk)
ROWS_COLS = {
    "key_bias": (lambda s, b, h, i, j, kb: s + kb[h, j],
                 lambda H, Sq, Sk: {"kb": (H, Sk)}),
    "query_temperature": (lambda s, b, h, i, j, t: s * t[b, i],
                          lambda H, Sq, Sk: {"t": (2, Sq)}),
    "bucketed_keys": (lambda s, b, h, i, j, tab: s + tab[h, j // 4],
                      lambda H, Sq, Sk: {"tab": (H, -(-Sk // 4))}),
    # a relative-position table, a per-query temperature, and one capture read down the
    # key columns and along the diagonals
    "mixed": (lambda s, b, h, i, j, rel, t, w:
              s * t[b, i] + rel[h, i - j + 40 - 1] + w[h, j] * w[h, i - j + 40 - 1],
              lambda H, Sq, Sk: {"rel": (H, Sq + Sk - 1), "t": (2, Sq),
                                 "w": (H, Sq + Sk - 1)}),
}


@pytest.mark.parametrize("name, dtype", [(n, "float32") for n in ROWS_COLS]
                         + [("mixed", "bfloat16"), ("query_temperature", "bfloat16")])
def test_row_and_column_reads_match_the_float64_reference(name, dtype):
    """Captures read at q_idx or kv_idx alone (with b, h; mixed with diagonal reads):
    dk, dv and the capture gradients (the capture's shape and dtype) against the float64
    reference; GQA 4 : 2, two batches, Sq != Sk (not multiples of the tiles), causal."""
    fn, shapes = ROWS_COLS[name]
    B, H, Sq, Sk = 2, 4, 24, 40
    q, k, v, g = grad_inputs(len(name), B, H, 2, Sq, Sk, 16, dtype)
    rng = np.random.default_rng(9)
    caps = {n: (0.5 + rng.random(s) if n == "t" else rng.standard_normal(s)).astype(np.float32)
            for n, s in shapes(H, Sq, Sk).items()}
    sm = aa.ScoreMod(fn, **caps)
    kw = dict(score_mod=sm, mask=aa.Causal("bottom_right"))
    wrt = ("k", "v") + tuple(caps)
    gr = _backward(q, k, v, g, wrt, dtype, **kw)
    rg = _reference(q, k, v, g, wrt, **kw)
    for n in ("dk", "dv"):
        assert_close(getattr(gr, n).float().cpu().numpy(), getattr(rg, n), dtype, f"{name} {n}")
    for n in caps:
        got = gr.dcaptures[n]
        assert tuple(got.shape) == caps[n].shape and got.dtype == torch.float32
        assert_close(got.cpu().numpy(), rg.dcaptures[n], dtype, f"{name} d{n}")


@pytest.mark.parametrize("fn, index", [
    (lambda s, b, h, i, j, t: s + t[i // 2, j],
     r"whose indices \(q_idx // 2\) and kv_idx together"),
    (lambda s, b, h, i, j, t: s + t[h, i // 8 + j],
     r"whose index \(\(q_idx // 8\) \+ kv_idx\) depends on q_idx and kv_idx otherwise "
     r"than through q_idx - kv_idx"),
    (lambda s, b, h, i, j, t: s + t[h, i - j + 15] * t[i, i - j + 15],
     r"whose indices q_idx and \(\(q_idx - kv_idx\) \+ 15\) together"),
])
def test_a_capture_read_at_q_idx_and_kv_idx_is_refused_before_any_work(monkeypatch, fn,
                                                                        index):
    """An index of q_idx and kv_idx other than their difference or a pair read's
    (test_triton_pair_reads.py), or indices of a row and a diagonal together, are
    refused by the backend choice, naming the capture and its read; the kernels are
    never reached."""
    from anyattn.backends.triton import launch

    def no_kernels(*a, **kw):
        raise AssertionError("a kernel launched")

    monkeypatch.setattr(launch, "backward", no_kernels)
    monkeypatch.setattr(launch, "forward", no_kernels)
    S = 16
    q, k, v, g = grad_inputs(2, 1, 2, 2, S, S, 16)
    t = np.zeros((2 * S - 1, 2 * S - 1), np.float32)
    with pytest.raises(NotImplementedError,
                       match=r"only where each read of it is indexed by b, h and one of "
                             r"q_idx - kv_idx, q_idx or kv_idx, or by b, h, q_idx and "
                             r"kv_idx with q_idx and kv_idx each an index of its own plus an "
                             r"integer constant \(t\[h, q_idx, kv_idx\]\): capture 't' is "
                             r"read at t\[.*\], " + index):
        aa.attention_backward(*(T(x) for x in (q, k, v, g)), wrt=("q", "t"),
                              backend="triton", score_mod=aa.ScoreMod(fn, t=t))


def test_torch_autograd_reaches_the_triton_capture_gradients():
    """anyattn.torch.attention with backend='triton' (the path of CUDA tensors): a
    captured table read along the diagonals and a per-key bias that require grad get
    the Triton backward's gradients (the NumPy backend's within fp32's tolerance); a
    read at [q_idx // 2, kv_idx] raises in the forward.  One batch, one head, one tile: a
    region of one slot (dcs_g = 1, an integer a GPU launch takes as a constant)."""
    import anyattn.torch as at

    S = 16
    q, k, v, _ = (T(x) for x in grad_inputs(5, 1, 1, 1, S, S, 16))
    rng = np.random.default_rng(6)
    t0 = torch.from_numpy(rng.standard_normal((1, 2 * S - 1)).astype(np.float32))
    kb0 = torch.from_numpy(rng.standard_normal((1, S)).astype(np.float32))

    def rel(s, b, h, i, j, t, kb):
        return s + t[h, i - j + S - 1] + kb[h, j]

    grads = {}
    for be in ("triton", "numpy"):
        t, kb = t0.clone().requires_grad_(), kb0.clone().requires_grad_()
        out = at.attention(q, k, v, backend=be, mask=aa.Causal(),
                           score_mod=aa.ScoreMod(rel, t=t, kb=kb))
        (out * out).sum().backward()
        grads[be] = (t.grad, kb.grad)
    for n, a, b in zip(("dt", "dkb"), grads["triton"], grads["numpy"]):
        assert_close(a.numpy(), b.double().numpy(), "float32", n)
    t = torch.zeros((S // 2, S)).requires_grad_()
    with pytest.raises(NotImplementedError,
                       match=r"capture 't' is read at t\[\(q_idx // 2\), kv_idx\]"):
        at.attention(q, k, v, backend="triton",
                     score_mod=aa.ScoreMod(lambda s, b, h, i, j, t: s + t[i // 2, j], t=t))


def test_an_empty_batch_gives_zero_capture_gradients_as_tensors():
    """B = 0: the capture gradients are zeros in the capture's shape and dtype, torch
    tensors beside the inputs (as a non-empty call returns them), not NumPy arrays."""
    t = np.random.default_rng(0).standard_normal((2, 8, 8)).astype(np.float32)
    q = torch.zeros(0, 2, 8, 16)
    g = aa.attention_backward(q, q, q, q, wrt=("q", "t"), backend="triton",
                              score_mod=aa.ScoreMod(lambda s, b, h, i, j, t: s + t[h, i, j], t=t))
    got = g.dcaptures["t"]
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32
    assert tuple(got.shape) == (2, 8, 8) and not got.any()
