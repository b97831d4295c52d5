"""The numpy backend's own promises: strides, torch tensors, tile skipping, determinism,
NaN propagation, memory, threads and config."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

from anyattn.modifiers import NO_MODS
import anyattn as aa
from anyattn import reference as R
from anyattn.backends.numpy_backend import NumpyBackend, NumpyConfig
from anyattn.backends.registry import choose, get_backend
from anyattn.problem import describe

from helpers import rel_err
from np_util import check, qkv


# ---------------------------------------------------------------- strides
def _bshd_view(x):
    """Same logical [B, H, S, D] array stored as [B, S, H, D] in memory."""
    return np.ascontiguousarray(x.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
def test_bshd_memory_and_slices(dtype, np_config):
    np_config(fwd_bq=32, fwd_bk=32, bwd_bq=32, bwd_bk=32, threads=2)
    q, k, v, g = qkv(20, 2, 4, 2, 70, 90, 24, dtype=dtype)
    check(_bshd_view(q), _bshd_view(k), _bshd_view(v), _bshd_view(g), dtype=dtype,
          mask=aa.Causal())
    # non-contiguous slices: every other row, and a D-stride of 2 (not BLAS-readable)
    rng = np.random.default_rng(21)
    big = rng.standard_normal((2, 4, 140, 48)).astype(dtype)
    qs = big[:, :, ::2, :24]
    ks = rng.standard_normal((2, 2, 90, 48)).astype(dtype)[..., ::2]
    vs = rng.standard_normal((2, 2, 180, 24)).astype(dtype)[:, :, 1::2]
    gs = rng.standard_normal((2, 4, 70, 24, 2)).astype(dtype)[..., 0]
    check(qs, ks, vs, gs, dtype=dtype, mask=aa.Window(left=10, right=10))


def test_layout_bshd_argument():
    q, k, v, g = qkv(22, 1, 2, 1, 33, 40, 8)
    qt, kt, vt, gt = (np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (q, k, v, g))
    out = aa.attention(qt, kt, vt, layout="bshd", backend="numpy")
    ref, _ = R.forward(q, k, v)
    assert out.shape == qt.shape and rel_err(out.transpose(0, 2, 1, 3), ref) < 1e-12
    gr = aa.attention_backward(qt, kt, vt, gt, layout="bshd", backend="numpy")
    rg = R.backward(q, k, v, g)
    assert rel_err(gr.dk.transpose(0, 2, 1, 3), rg.dk) < 1e-12


# ---------------------------------------------------------------- torch tensors
def test_torch_cpu_tensors_in_and_out():
    torch = pytest.importorskip("torch")
    q, k, v, g = qkv(23, 1, 4, 2, 60, 75, 16, dtype="float32")
    tq, tk, tv, tg = (torch.from_numpy(x) for x in (q, k, v, g))
    tq.requires_grad_()                       # a leaf that requires grad is fine too
    mask = aa.Causal() & aa.KeepMask(torch.rand(60, 75, generator=torch.Generator().manual_seed(0)) < 0.8)
    bias = torch.randn(1, 4, 1, 75, generator=torch.Generator().manual_seed(1))
    assert get_backend("numpy").unsupported_reasons(describe(tq, tk, tv, mask=mask)) == []
    out, lse = aa.attention(tq, tk, tv, mask=mask, bias=bias, return_lse=True, backend="numpy")
    assert isinstance(out, torch.Tensor) and out.dtype == torch.float32 and lse.dtype == torch.float32
    gr = aa.attention_backward(tq, tk, tv, tg, mask=mask, bias=bias, out=out, lse=lse,
                               wrt=("q", "k", "v", "bias"), backend="numpy")
    for x in (gr.dq, gr.dk, gr.dv, gr.dbias):
        assert isinstance(x, torch.Tensor) and x.dtype == torch.float32
    # same numbers as the NumPy path, bit for bit
    nmask = aa.Causal() & aa.KeepMask(mask.terms[1].mask.numpy())
    nout, nlse = aa.attention(q, k, v, mask=nmask, bias=bias.numpy(), return_lse=True,
                              backend="numpy")
    ngr = aa.attention_backward(q, k, v, g, mask=nmask, bias=bias.numpy(), out=nout,
                                lse=nlse, wrt=("q", "k", "v", "bias"), backend="numpy")
    assert np.array_equal(out.numpy(), nout) and np.array_equal(lse.numpy(), nlse)
    for a, b in zip(gr, ngr):
        assert (a is None and b is None) or np.array_equal(a.numpy(), b)
    # and against torch's own SDPA (float32 vs float32: loose)
    ref = torch.nn.functional.scaled_dot_product_attention(
        tq.detach(), tk.repeat_interleave(2, 1), tv.repeat_interleave(2, 1),
        attn_mask=torch.tril(torch.ones(60, 75, dtype=torch.bool)) & mask.terms[1].mask)
    out_nb = aa.attention(tq, tk, tv, mask=mask, backend="numpy")
    assert float((out_nb - ref).abs().max()) < 1e-5


def test_torch_strided_float64_and_bfloat16():
    torch = pytest.importorskip("torch")
    q, k, v, g = qkv(24, 1, 2, 2, 40, 40, 8)
    tq = torch.from_numpy(_bshd_view(q))          # strided view, float64
    out = aa.attention(tq, torch.from_numpy(k), torch.from_numpy(v), backend="numpy")
    ref, _ = R.forward(q, k, v)
    assert out.dtype == torch.float64 and rel_err(out.numpy(), ref) < 1e-12
    b16 = [torch.from_numpy(x).to(torch.bfloat16) for x in (q, k, v)]
    out = aa.attention(*b16, backend="numpy")
    assert out.dtype == torch.bfloat16 and rel_err(out.float().numpy(), ref) < 2e-2


# ---------------------------------------------------------------- tile skipping
def _counts(be, kind):
    return be.last_counts[kind]


@pytest.mark.parametrize("threads", [1, 2])
def test_causal_skips_tiles(np_config, threads):
    be = np_config(fwd_bq=16, fwd_bk=16, bwd_bq=16, bwd_bk=16, threads=threads)
    q, k, v, g = qkv(25, 1, 2, 1, 128, 128, 8, dtype="float32")
    aa.attention(q, k, v, mask=aa.Causal(), backend="numpy")
    c = _counts(be, "forward")
    n = 8                                        # tiles per side
    assert c.computed == 2 * n * (n + 1) // 2    # lower triangle incl. diagonal, 2 heads
    assert c.partial == 2 * n and c.skipped == 2 * n * (n - 1) // 2
    aa.attention_backward(q, k, v, g, mask=aa.Causal(), backend="numpy")
    c = _counts(be, "backward")
    assert c.computed == 2 * n * (n + 1) // 2 and c.partial == 2 * n


def test_window_and_documents_skip_tiles(np_config):
    be = np_config(fwd_bq=16, fwd_bk=16, bwd_bq=16, bwd_bk=16, threads=1)
    q, k, v, g = qkv(26, 1, 1, 1, 256, 256, 8, dtype="float32")
    # sliding window of 16 keys behind: only the diagonal and one sub-diagonal
    aa.attention(q, k, v, mask=aa.Causal() & aa.Window(left=15), backend="numpy")
    assert _counts(be, "forward").computed == 16 + 15
    # 4 documents of 64 tokens: block diagonal, 4 tiles each side per document
    ids = np.repeat(np.arange(4), 64)
    aa.attention(q, k, v, mask=aa.Documents(ids), backend="numpy")
    c = _counts(be, "forward")
    assert c.computed == 4 * 16 and c.partial == 0          # aligned: every kept tile full
    # an all-False KeepMask block is skipped; an all-True one needs no keep-array
    keep = np.ones((256, 256), bool)
    keep[:, 64:128] = False
    keep[0, 0] = False
    aa.attention_backward(q, k, v, g, mask=aa.KeepMask(keep), backend="numpy")
    c = _counts(be, "backward")
    assert c.skipped == 16 * 4 and c.partial == 1 and c.computed == 16 * 12
    check(q.astype(np.float64), k.astype(np.float64), v.astype(np.float64),
          g.astype(np.float64), dtype="float64", mask=aa.KeepMask(keep))


def test_cost_follows_kept_fraction(np_config):
    """The work done (tiles) scales with the kept fraction, not with Sq*Sk."""
    be = np_config(fwd_bq=32, fwd_bk=32, bwd_bq=32, bwd_bk=32, threads=1)
    q, k, v, g = qkv(27, 1, 1, 1, 1024, 1024, 4, dtype="float32")
    aa.attention(q, k, v, backend="numpy")
    full = _counts(be, "forward").computed
    aa.attention(q, k, v, mask=aa.Causal() & aa.Window(left=63), backend="numpy")
    assert _counts(be, "forward").computed <= 3 * 32 and full == 32 * 32


# ---------------------------------------------------------------- determinism
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("shape", [(2, 4, 2, 150, 170, 24), (1, 3, 1, 150, 170, 24)],
                         ids=["many_units", "split_keys"])
def test_bitwise_repeatable(np_config, threads, shape):
    np_config(fwd_bq=32, fwd_bk=64, bwd_bq=64, bwd_bk=32, threads=threads)
    B, Hq, Hkv, Sq, Sk, D = shape
    q, k, v, g = qkv(28, *shape, dtype="float32")
    bias = np.random.default_rng(1).standard_normal((1, 1, Sq, Sk)).astype(np.float32)
    mask = aa.Causal("bottom_right")
    runs = []
    for _ in range(3):
        out, lse = aa.attention(q, k, v, mask=mask, bias=bias, return_lse=True, backend="numpy")
        gr = aa.attention_backward(q, k, v, g, mask=mask, bias=bias, out=out, lse=lse,
                                   wrt=("q", "k", "v", "bias"), backend="numpy")
        runs.append((out, lse) + tuple(gr))
    for other in runs[1:]:
        for a, b in zip(runs[0], other):
            assert np.array_equal(a, b)
    check(*(x.astype(np.float64) for x in (q, k, v, g)), dtype="float64", mask=mask,
          bias=bias.astype(np.float64), wrt=("q", "k", "v", "bias"))


# ---------------------------------------------------------------- NaN
def test_nan_inputs_propagate():
    q, k, v, g = qkv(29, 1, 2, 1, 40, 50, 8)
    q[0, 1, 7, 3] = np.nan
    out, lse = aa.attention(q, k, v, return_lse=True, backend="numpy")
    ro, rl = R.forward(q, k, v)
    assert np.array_equal(np.isnan(out), np.isnan(ro)) and np.isnan(out[0, 1, 7]).all()
    assert np.isnan(lse[0, 1, 7]) and not np.isnan(np.delete(lse[0, 1], 7)).any()
    k2 = k.copy()
    k2[0, 0, 10, 0] = np.nan                     # a NaN key reaches every query (no mask)
    assert np.isnan(aa.attention(q * 0 + 1, k2, v, backend="numpy")).all()
    v2 = v.copy()
    v2[0, 0, 3, 2] = np.nan
    gr = aa.attention_backward(q * 0 + 1, k, v2, g, backend="numpy", wrt=("v",))
    assert np.isnan(gr.dv[0, 0, :, 2]).any()


def test_masking_creates_no_nan():
    q, k, v, g = qkv(30, 1, 1, 1, 64, 64, 8, dtype="float32")
    keep = np.zeros((64, 64), bool)
    keep[::3, ::5] = True
    out, lse = aa.attention(q, k, v, mask=aa.KeepMask(keep) & aa.Causal(), return_lse=True,
                            backend="numpy")
    gr = aa.attention_backward(q, k, v, g, mask=aa.KeepMask(keep) & aa.Causal(), backend="numpy")
    for x in (out, gr.dq, gr.dk, gr.dv):
        assert not np.isnan(x).any()
    assert not np.isnan(lse).any()


# ---------------------------------------------------------------- memory
@pytest.mark.parametrize("S,tile", [(3072, 256), (6144, None)])
def test_memory_is_tile_sized(np_config, S, tile):
    """No [Sq, Sk] array: peak extra memory of fwd+bwd stays at tiles + O((Sq+Sk)*D).

    ``tile=None``: the automatic tiles (512 x 512 without a mask: ~12 MiB of tile
    buffers over two workers, independent of S, so S is doubled to keep the check about
    [Sq, Sk] arrays rather than about tile sizes)."""
    np_config(threads=2, **({} if tile is None else dict(fwd_bq=tile, fwd_bk=tile,
                                                         bwd_bq=tile, bwd_bk=tile)))
    D = 16
    q, k, v, g = qkv(31, 1, 1, 1, S, S, D, dtype="float32")
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    out, lse = aa.attention(q, k, v, mask=aa.Causal(), return_lse=True, backend="numpy")
    aa.attention_backward(q, k, v, g, out=out, lse=lse, backend="numpy")
    peak = tracemalloc.get_traced_memory()[1] - base
    tracemalloc.stop()
    dense = S * S * 4                      # one [Sq, Sk] float32 matrix: 36 / 144 MiB
    assert peak < dense / 6, f"peak extra {peak / 2**20:.1f} MiB"


# ---------------------------------------------------------------- config / dispatch
def test_default_backend_on_cpu_and_capabilities():
    q, k, v, _ = qkv(32, 1, 1, 1, 4, 4, 4, dtype="float32")
    assert choose(describe(q, k, v), None).name in ("numpy", "triton", "webgpu")
    be = get_backend("numpy")
    assert be.availability() is None
    p = describe(q, k, v, precision="tf32")
    assert any("precision" in r for r in be.unsupported_reasons(p))
    with pytest.raises(NotImplementedError, match="precision"):
        aa.attention(q, k, v, precision="tf32", backend="numpy")


def test_config_from_env(monkeypatch):
    monkeypatch.setenv("ANYATTN_NUMPY_THREADS", "3")
    monkeypatch.setenv("ANYATTN_NUMPY_BLOCK_Q", "64")
    c = NumpyConfig.from_env()
    assert c.threads == 3 and c.fwd_bq == 64 and c.bwd_bq == 64
    monkeypatch.setenv("ANYATTN_NUMPY_THREADS", "zero")
    with pytest.raises(ValueError, match="ANYATTN_NUMPY_THREADS"):
        NumpyConfig.from_env()
    monkeypatch.setenv("ANYATTN_NUMPY_THREADS", "0")
    with pytest.raises(ValueError, match=r"ANYATTN_NUMPY_THREADS=.0.: expected an integer >= 1"):
        NumpyConfig.from_env()


def test_worker_exception_propagates(np_config, monkeypatch):
    from anyattn.backends import numpy_backend as nb

    np_config(threads=2)

    def boom(*a, **k):
        raise RuntimeError("tile failure")

    monkeypatch.setattr(nb, "forward_rows", boom)
    monkeypatch.setattr(nb, "forward_rows_bounded", boom)
    monkeypatch.setattr(nb, "forward_group", boom)
    q, k, v, _ = qkv(33, 1, 2, 1, 8, 8, 4)
    with pytest.raises(RuntimeError, match="tile failure"):
        aa.attention(q, k, v, backend="numpy")


def test_instance_with_own_config():
    be = NumpyBackend(NumpyConfig(fwd_bq=8, fwd_bk=8, threads=1))
    q, k, v, _ = qkv(34, 1, 1, 1, 20, 20, 4)
    p = describe(q, k, v, mask=aa.Causal())
    out, lse = be.forward(p, q, k, v, None, NO_MODS)
    ro, rl = R.forward(q, k, v, mask=aa.Causal())
    assert rel_err(out, ro) < 1e-12
    assert be.last_counts["forward"].computed == 6


# ---------------------------------------------------------------- bounded forward
@pytest.mark.parametrize("dtype", ["float32", "float64"])
def test_bounded_forward_falls_back_on_underflow(dtype, np_config):
    """A bound far above the true row max (big orthogonal keys) must not lose rows."""
    np_config(fwd_bq=16, fwd_bk=16, threads=1)
    q, k, v, g = qkv(40, 1, 1, 1, 40, 48, 4, dtype=dtype)
    q[..., 0] *= 300.0                           # large queries along axis 0
    k[..., 0] = 0.01                             # keys nearly orthogonal to them ...
    k[0, 0, 5, 1] = 300.0                        # ... one huge key along axis 1
    for mask in (aa.Causal("bottom_right"), None):
        if dtype == "float64":
            check(q, k, v, g, dtype=dtype, mask=mask)
            continue
        # float32: logits ~1e2-1e4 make the gradients ill-conditioned; check the forward
        out, lse = aa.attention(q, k, v, mask=mask, return_lse=True, backend="numpy")
        ro, rl = R.forward(q, k, v, mask=mask)
        fin = np.isfinite(rl)
        assert rel_err(out, ro) < 1e-5 and np.array_equal(np.isfinite(lse), fin)
        assert np.max(np.abs(lse[fin] - rl[fin]) / np.maximum(1, np.abs(rl[fin]))) < 1e-5


def test_bounded_and_running_max_agree(np_config):
    q, k, v, g = qkv(41, 2, 2, 1, 90, 70, 16)
    keep = np.random.default_rng(0).random((90, 70)) < 0.3
    mask = aa.KeepMask(keep) & aa.Window(left=40, right=5)
    np_config(fwd_bq=32, fwd_bk=16, bounded=True)
    a = aa.attention(q, k, v, mask=mask, return_lse=True, backend="numpy")
    np_config(fwd_bq=32, fwd_bk=16, bounded=False)
    b = aa.attention(q, k, v, mask=mask, return_lse=True, backend="numpy")
    assert rel_err(a[0], b[0]) < 1e-13
    assert np.array_equal(np.isinf(a[1]), np.isinf(b[1]))
    check(q, k, v, g, dtype="float64", mask=mask)
