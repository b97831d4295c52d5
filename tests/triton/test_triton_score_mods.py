"""Score and mask functions on the portable Triton kernels (interpreter on CPU tensors):
the gallery's forward against the float64 reference (fp32, bf16), GQA and Sq != Sk,
mask-function tile skipping, no recompilation for new captured values, refusals.

Shape legend: B batch, Hq/Hkv heads, Sq/Sk queries/keys, D head dim."""
import os

import numpy as np
import pytest

from tr_util import DEV, T, needs_triton, torch

import anyattn as aa

from helpers import assert_close, load_gallery

gallery = load_gallery()

pytestmark = needs_triton


def _inputs(seed, B, Hq, Hkv, Sq, Sk, D):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Hq, Sq, D)).astype(np.float32)
    k = rng.standard_normal((B, Hkv, Sk, D)).astype(np.float32)
    v = rng.standard_normal((B, Hkv, Sk, D)).astype(np.float32)
    return q, k, v


def _reference(q, k, v, **kw):
    return aa.attention(*(x.astype(np.float64) for x in (q, k, v)), return_lse=True,
                        backend="reference", **kw)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", sorted(gallery.GALLERY))
def test_gallery_matches_the_float64_reference(name, dtype):
    """Forward (out, lse) and dq, dk, dv of every gallery entry, GQA 2 : 1 (two query
    heads, so the functions see h = 0 and 1), Sq != Sk where the entry allows."""
    make, square = gallery.GALLERY[name]
    sq, sk = (32, 32) if square else (24, 40)
    q, k, v = _inputs(len(name), 1, 2, 1, sq, sk, 16)
    g = np.random.default_rng(len(name) + 1).standard_normal(q.shape).astype(np.float32)
    if dtype == "bfloat16":   # the reference sees the rounded inputs
        q, k, v, g = (torch.from_numpy(x).to(torch.bfloat16).float().numpy()
                      for x in (q, k, v, g))
    e = make(1, 2, sq, sk, np.random.default_rng(7))
    td = getattr(torch, dtype)
    out, lse = aa.attention(T(q, td), T(k, td), T(v, td), return_lse=True, backend="triton",
                            **e.kwargs)
    ro, rl = _reference(q, k, v, **e.kwargs)
    assert_close(out.float().cpu().numpy(), ro, dtype, f"{name} out")
    lse = lse.cpu().numpy()
    fin = np.isfinite(rl)
    np.testing.assert_array_equal(np.isfinite(lse), fin)
    assert_close(lse[fin], rl[fin], dtype, f"{name} lse")
    gr = aa.attention_backward(T(q, td), T(k, td), T(v, td), T(g, td), wrt=("q", "k", "v"),
                               backend="triton", **e.kwargs)
    rg = aa.attention_backward(*(x.astype(np.float64) for x in (q, k, v, g)),
                               wrt=("q", "k", "v"), backend="reference", **e.kwargs)
    for n in ("dq", "dk", "dv"):
        assert_close(getattr(gr, n).float().cpu().numpy(), getattr(rg, n), dtype, f"{name} {n}")


def test_score_function_with_a_full_bias_and_its_gradient():
    """dbias is the gradient of the final score (after the function); dq / dk go
    through d score_mod / d score."""
    S = 24
    q, k, v = _inputs(9, 1, 2, 2, S, S, 16)
    rng = np.random.default_rng(3)
    g = rng.standard_normal(q.shape).astype(np.float32)
    bias = rng.standard_normal((1, 2, S, S)).astype(np.float32)
    kw = dict(score_mod=lambda s, b, h, i, j: 3.0 * aa.math.tanh(s / 3.0) * (1.0 + 0.1 * h),
              mask=aa.Causal())
    wrt = ("q", "k", "v", "bias")
    gr = aa.attention_backward(T(q), T(k), T(v), T(g), bias=T(bias), wrt=wrt,
                               backend="triton", **kw)
    rg = aa.attention_backward(*(x.astype(np.float64) for x in (q, k, v, g)),
                               bias=bias.astype(np.float64), wrt=wrt, backend="reference", **kw)
    for n in ("dq", "dk", "dv", "dbias"):
        assert_close(getattr(gr, n).cpu().numpy(), getattr(rg, n), "float32", n)


def test_power_with_a_computed_exponent_follows_numpy():
    """``score ** (h + 1)``: a negative base with a whole exponent keeps its sign (as
    np.power does), forward and gradients; a fractional exponent of a positive base."""
    S = 20
    q, k, v = _inputs(11, 1, 3, 3, S, S, 16)
    g = np.random.default_rng(5).standard_normal(q.shape).astype(np.float32)
    for fn in (lambda s, b, h, i, j: 0.3 * s ** (h + 1),
               lambda s, b, h, i, j: (s * 0.0 + 2.0) ** (s * 0.5)):
        out = aa.attention(T(q), T(k), T(v), score_mod=fn, backend="triton")
        assert_close(out.cpu().numpy(), _reference(q, k, v, score_mod=fn)[0], "float32", "out")
        gr = aa.attention_backward(T(q), T(k), T(v), T(g), score_mod=fn, backend="triton")
        rg = aa.attention_backward(*(x.astype(np.float64) for x in (q, k, v, g)),
                                   score_mod=fn, backend="reference")
        for n in ("dq", "dk", "dv"):
            assert_close(getattr(gr, n).cpu().numpy(), getattr(rg, n), "float32", n)


def test_generated_modules_are_named_after_their_text(tmp_path, monkeypatch):
    """A module file left by another generator version for the same graph is never
    read: every file's name is the hash of its own text."""
    import hashlib

    from anyattn.backends.triton import programs as tp

    monkeypatch.setattr(tp, "cache_dir", lambda: str(tmp_path))
    monkeypatch.setattr(tp, "_modules", {})
    q, k, v = _inputs(12, 1, 2, 2, 16, 16, 16)
    aa.attention(T(q), T(k), T(v), score_mod=lambda s, b, h, i, j: s * 0.5 + h,
                 backend="triton")
    files = [f for f in os.listdir(tp.cache_dir()) if f.endswith(".py")]
    assert files
    for f in files:
        with open(os.path.join(tp.cache_dir(), f)) as fh:
            text = fh.read()
        assert f == f"anyattn_fn_{hashlib.blake2b(text.encode(), digest_size=12).hexdigest()}.py"


def _returns(tmp_path, name):
    """The return line of generated function ``name`` in the one module under tmp_path."""
    files = [f for f in os.listdir(tmp_path) if f.endswith(".py")]
    assert len(files) == 1, files
    with open(os.path.join(tmp_path, files[0])) as fh:
        body = fh.read().split(f"def {name}(", 1)[1]
    return next(ln.strip() for ln in body.splitlines() if ln.strip().startswith("return"))


def _loads(tmp_path, name):
    """The capture reads of generated function ``name`` in the one module under tmp_path."""
    files = [f for f in os.listdir(tmp_path) if f.endswith(".py")]
    assert len(files) == 1, files
    with open(os.path.join(tmp_path, files[0])) as fh:
        body = fh.read().split(f"def {name}(", 1)[1].split("@triton.jit", 1)[0]
    return [ln.split("=", 1)[1].strip() for ln in body.splitlines()
            if "tl.load(" in ln or "gather_tile(" in ln]


def test_capture_reads_are_unmasked_vectors_or_tiles(tmp_path, monkeypatch):
    """Every capture read lies in range (the functions see padding as the last real
    position), so none is masked: a read of kv_idx (or q_idx) alone stays a vector, one
    of both is a tile read through gather_tile (kept out of the software pipeliner),
    a scalar read stays scalar."""
    from anyattn.backends.triton import programs as tp

    monkeypatch.setattr(tp, "cache_dir", lambda: str(tmp_path))
    monkeypatch.setattr(tp, "_modules", {})
    Sq, Sk = 21, 27
    q, k, v = _inputs(15, 1, 2, 2, Sq, Sk, 16)
    rng = np.random.default_rng(16)
    kb, qb = rng.standard_normal(Sk).astype(np.float32), rng.standard_normal(Sq).astype(np.float32)
    table, w = rng.standard_normal((Sq, Sk)).astype(np.float32), np.float32([0.5, 2.0])
    sm = aa.ScoreMod(lambda s, b, h, i, j, kb, qb, table, w: s * w[h] + kb[j] + qb[i] + table[i, j],
                     kb=kb, qb=qb, table=table, w=w)
    out = aa.attention(T(q), T(k), T(v), score_mod=sm, backend="triton")
    loads = _loads(tmp_path, "score")
    assert len(loads) == 4 and not any("mask" in ld for ld in loads), loads
    assert sum(ld.startswith("gather_tile(") for ld in loads) == 1, loads
    ref = _reference(q, k, v, score_mod=sm)[0]
    assert_close(out.cpu().numpy(), ref, "float32", "out")


@pytest.mark.parametrize("mask", [None, aa.Causal()])
def test_functions_of_reads_stay_finite_at_the_padding(mask):
    """Dividing by a capture read (s / t[kv_idx], s / (t[kv_idx] u[q_idx])) at sizes that
    are no multiple of a tile: the padding's reads are real positions' values, and its
    gradients 0, so dq and dk are finite and match the reference."""
    Sq, Sk = 37, 45
    q, k, v = _inputs(17, 1, 2, 2, Sq, Sk, 16)
    g = np.random.default_rng(18).standard_normal(q.shape).astype(np.float32)
    rng = np.random.default_rng(19)
    t, u = (rng.random(Sk) + 0.5).astype(np.float32), (rng.random(Sq) + 0.5).astype(np.float32)
    for sm in (aa.ScoreMod(lambda s, b, h, i, j, t: s / t[j], t=t),
               aa.ScoreMod(lambda s, b, h, i, j, t, u: s / (t[j] * u[i]), t=t, u=u)):
        gr = aa.attention_backward(T(q), T(k), T(v), T(g), score_mod=sm, mask=mask,
                                   backend="triton")
        rg = aa.attention_backward(*(x.astype(np.float64) for x in (q, k, v, g)),
                                   score_mod=sm, mask=mask, backend="reference")
        for n in ("dq", "dk", "dv"):
            assert_close(getattr(gr, n).cpu().numpy(), getattr(rg, n), "float32", n)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")   # the interpreter: log(<= 0)
def test_a_slope_not_finite_at_masked_pairs_gives_no_nan():
    """s * log1p((i - j + 8) / 4) under a causal mask: its slope is -inf or NaN at masked
    pairs, where dS is 0; the gradients there are 0 (not 0 * inf), as on the reference."""
    Sq, Sk = 37, 45
    q, k, v = _inputs(20, 1, 2, 2, Sq, Sk, 16)
    g = np.random.default_rng(21).standard_normal(q.shape).astype(np.float32)
    fn = lambda s, b, h, i, j: s * np.log1p(0.25 * (i - j + 8))  # noqa: E731
    gr = aa.attention_backward(T(q), T(k), T(v), T(g), score_mod=fn, mask=aa.Causal(),
                               backend="triton")
    rg = aa.attention_backward(*(x.astype(np.float64) for x in (q, k, v, g)),
                               score_mod=fn, mask=aa.Causal(), backend="reference")
    for n in ("dq", "dk", "dv"):
        assert_close(getattr(gr, n).cpu().numpy(), getattr(rg, n), "float32", n)


def test_functions_fused_backward_equals_two_launches(monkeypatch):
    """A score function and a mask function in the fused backward (one launch: dK/dV and
    dQ programs) give the two-launch backward's bits, and the reference's values."""
    from tr_util import two_launch_backward

    Sq, Sk = 37, 45
    q, k, v = _inputs(22, 1, 4, 2, Sq, Sk, 16)
    g = np.random.default_rng(23).standard_normal(q.shape).astype(np.float32)
    kb = np.random.default_rng(24).standard_normal((4, Sk)).astype(np.float32)
    kw = dict(score_mod=aa.ScoreMod(lambda s, b, h, i, j, kb: s * 0.75 + kb[h, j], kb=kb),
              mask=aa.Causal() | aa.MaskMod(lambda b, h, i, j: (i - j) % 5 == 0))
    fused = aa.attention_backward(T(q), T(k), T(v), T(g), backend="triton", **kw)
    two_launch_backward(monkeypatch)
    split = aa.attention_backward(T(q), T(k), T(v), T(g), backend="triton", **kw)
    rg = aa.attention_backward(*(x.astype(np.float64) for x in (q, k, v, g)),
                               backend="reference", **kw)
    for n in ("dq", "dk", "dv"):
        assert torch.equal(getattr(fused, n), getattr(split, n)), n
        assert_close(getattr(fused, n).cpu().numpy(), getattr(rg, n), "float32", n)


@pytest.mark.parametrize("fn, score_bare, grad_bare", [
    # reads the score: a tile already; its derivative 0.5 is a constant (broadcast)
    (lambda s, b, h, i, j: s * 0.5 + h, True, False),
    # derivative reads both index vectors: a tile already
    (lambda s, b, h, i, j: s * (0.01 * (i - j)), True, True),
    # reads no score and one index vector only: broadcast
    (lambda s, b, h, i, j: 0.25 * i, False, False),
])
def test_score_function_tiles_return_without_a_broadcast_add(tmp_path, monkeypatch, fn,
                                                             score_bare, grad_bare):
    """A generated score function whose value is already a full tile returns it as it
    is (adding tl.zeros_like(s) costs an add per element the compiler must keep); one
    that is not is broadcast; results as the reference either way."""
    from anyattn.backends.triton import programs as tp

    monkeypatch.setattr(tp, "cache_dir", lambda: str(tmp_path))
    monkeypatch.setattr(tp, "_modules", {})
    q, k, v = _inputs(13, 1, 2, 2, 16, 16, 16)
    g = np.random.default_rng(14).standard_normal(q.shape).astype(np.float32)
    out = aa.attention(T(q), T(k), T(v), score_mod=fn, backend="triton")
    gr = aa.attention_backward(T(q), T(k), T(v), T(g), score_mod=fn, backend="triton")
    assert ("zeros_like" not in _returns(tmp_path, "score")) == score_bare
    value, grad = _returns(tmp_path, "score_grad")[len("return ("):-1].split(", ")
    assert ("zeros_like" not in value) == score_bare
    assert ("zeros_like" not in grad) == grad_bare
    ref = _reference(q, k, v, score_mod=fn)[0]
    assert_close(out.cpu().numpy(), ref, "float32", "out")
    rg = aa.attention_backward(*(x.astype(np.float64) for x in (q, k, v, g)),
                               score_mod=fn, backend="reference")
    for n in ("dq", "dk", "dv"):
        assert_close(getattr(gr, n).cpu().numpy(), getattr(rg, n), "float32", n)


def test_functions_with_softcap_sinks_and_a_union_mask():
    """softcap -> score function -> mask union (Causal | MaskMod) with sinks: out and
    dq, dk, dv, dsinks against the reference."""
    S = 24
    rng = np.random.default_rng(11)
    q, k, v, g = (rng.standard_normal((1, 2, S, 16)).astype(np.float32) for _ in range(4))
    sinks = rng.standard_normal(2).astype(np.float32)
    kw = dict(score_mod=lambda s, b, h, i, j: s * (1.0 + 0.5 * h) - 0.1 * abs(i - j),
              softcap=4.0, mask=aa.Causal() | aa.MaskMod(lambda b, h, i, j: j < 3))
    wrt = ("q", "k", "v", "sinks")
    out = aa.attention(T(q), T(k), T(v), sinks=T(sinks), backend="triton", **kw)
    gr = aa.attention_backward(T(q), T(k), T(v), T(g), sinks=T(sinks), wrt=wrt,
                               backend="triton", **kw)
    f64 = [x.astype(np.float64) for x in (q, k, v, g, sinks)]
    ro = aa.attention(*f64[:3], sinks=f64[4], backend="reference", **kw)
    rg = aa.attention_backward(*f64[:4], sinks=f64[4], wrt=wrt, backend="reference", **kw)
    assert_close(out.cpu().numpy(), ro, "float32", "out")
    for n in ("dq", "dk", "dv", "dsinks"):
        assert_close(getattr(gr, n).cpu().numpy(), getattr(rg, n), "float32", n)


def _launched_tiles(monkeypatch):
    """Counts the key tiles the forward's lists hold (partial, full) per call."""
    from anyattn.backends.triton import tiles

    seen = []
    real = tiles._build_lists

    def spy(p, ma, sb_q, sb_k, device):
        tl_ = real(p, ma, sb_q, sb_k, device)
        seen.append((int(tl_.row_cnt.sum()), int(tl_.row_fcnt.sum())))
        return tl_

    monkeypatch.setattr(tiles, "_build_lists", spy)
    return seen


def test_mask_function_skips_empty_tiles_and_matches_the_builtin(monkeypatch):
    """A chunked mask as a function gives the tile lists of the built-in spelling and
    the same output (spelled ``(i // C) * C``: ``i // C == j // C`` itself lowers to the
    Documents term)."""
    seen = _launched_tiles(monkeypatch)
    S, C = 256, 64
    q, k, v = _inputs(3, 1, 2, 2, S, S, 16)
    fn = aa.MaskMod(lambda b, h, q_idx, kv_idx: (q_idx // C) * C == (kv_idx // C) * C)
    ids = torch.arange(S) // C
    a = aa.attention(T(q), T(k), T(v), mask=fn, backend="triton")
    bi = aa.attention(T(q), T(k), T(v), mask=aa.Documents(ids.to(DEV)), backend="triton")
    assert len(seen) == 2 and seen[0] == seen[1], seen
    part, full = seen[0]
    blocks = (S // 64) ** 2                     # at most this many at any block size
    assert 0 < part + full < blocks * 16
    torch.testing.assert_close(a, bi, rtol=0, atol=0)
    ro, _ = _reference(q, k, v, mask=fn)
    assert_close(a.cpu().numpy(), ro, "float32", "chunked")


@pytest.mark.parametrize("name", ["prefix_lm", "sliding_global", "dilated",
                                  "neighbourhood_2d"])   # document_causal, chunked: the
#                                   Documents term (tests/core/test_score_mods.py)
def test_device_block_maps_match_the_core_classification(name):
    """The device classification (mask_blocks_kernel with the generated mask function)
    gives the NumPy core's any / all block maps."""
    from anyattn.backends.triton import programs
    from anyattn.masks import resolve
    from anyattn.programs.bound import mask_tile_parts

    make, square = gallery.GALLERY[name]
    sq, sk = (48, 48) if square else (40, 56)
    e = make(2, 4, sq, sk, np.random.default_rng(7))
    rm = resolve(e.kwargs["mask"], 2, 4, sq, sk)
    assert rm.mask_fns
    a, l = programs.mask_blocks(rm.mask_fns, (2, 4, sq, sk), 16, 32, torch.device(DEV))
    ra, rl = None, None
    for bp in rm.mask_fns:
        x, y = mask_tile_parts(bp, 16, 32)
        ra = x if ra is None else ra & x
        rl = y if rl is None else rl & y
    np.testing.assert_array_equal(np.broadcast_to(a.cpu().numpy(), ra.shape), ra)
    np.testing.assert_array_equal(np.broadcast_to(l.cpu().numpy(), rl.shape), rl)


def test_new_captured_values_do_not_recompile():
    """The generated functions are keyed by the graph, not the captures' values: a
    second call with another table reuses the compiled kernel (interpreter: the same
    generated JITFunction objects)."""
    from anyattn.backends.triton import programs

    S = 32
    q, k, v = _inputs(5, 1, 2, 2, S, S, 16)

    def rel(score, b, h, q_idx, kv_idx, table):
        return score + table[h, q_idx - kv_idx + S - 1]

    fns = []
    real = programs.functions

    def spy(*a, **kw):
        f = real(*a, **kw)
        fns.append(f)
        return f

    programs.functions = spy
    try:
        for seed in (0, 1):
            t = np.random.default_rng(seed).standard_normal((2, 2 * S - 1)).astype(np.float32)
            sm = aa.ScoreMod(rel, table=t)
            out = aa.attention(T(q), T(k), T(v), score_mod=sm, backend="triton")
            ro, _ = _reference(q, k, v, score_mod=sm)
            assert_close(out.cpu().numpy(), ro, "float32", f"table {seed}")
    finally:
        programs.functions = real
    assert fns[0].key == fns[1].key and fns[0].score is fns[1].score
    assert not torch.equal(fns[0].caps[0], fns[1].caps[0])


def test_builtin_launch_passes_no_function():
    """Without functions the forward's constexprs are the built-in ones: no CAPS, SMOD or
    MMOD keyword reaches the kernel (its compiled code is the built-in kernel's)."""
    from anyattn.backends.triton import prepared

    prepared.clear_prepared()
    q, k, v = _inputs(1, 1, 2, 2, 32, 32, 16)
    aa.attention(T(q), T(k), T(v), mask=aa.Causal(), backend="triton")
    kws = [r[2] for pr in prepared.PREPARED._d.values() for r in pr.ready.values()]
    assert kws and all(not {"CAPS", "SMOD", "MMOD"} & set(kw) for kw in kws)


def test_too_many_captures_are_refused():
    S = 16
    q, k, v = _inputs(2, 1, 1, 1, S, S, 16)
    ts = {f"t{i}": np.zeros(S, np.float32) for i in range(5)}

    def fn(score, b, h, q_idx, kv_idx, t0, t1, t2, t3, t4):
        return score + t0[q_idx] + t1[q_idx] + t2[kv_idx] + t3[kv_idx] + t4[q_idx]

    with pytest.raises(NotImplementedError, match="at most 4"):
        aa.attention(T(q), T(k), T(v), score_mod=aa.ScoreMod(fn, **ts), backend="triton")


def test_capture_gradients_off_the_diagonal_and_broadcast_dbias_are_refused():
    """wrt naming a capture read at an index of q_idx and kv_idx other than their
    difference (test_triton_capture_grads.py has the supported reads) raises before any
    work, as does a dbias broadcast over queries or keys."""
    S = 16
    q, k, v = _inputs(2, 1, 2, 2, S, S, 16)
    t = np.zeros((2, 2 * S - 1), np.float32)
    sm = aa.ScoreMod(lambda s, b, h, i, j, t: s + t[h, i + j], t=t)
    with pytest.raises(NotImplementedError,
                       match="computes the gradient of a score_mod capture only where"):
        aa.attention_backward(T(q), T(k), T(v), T(q), wrt=("q", "t"), backend="triton",
                              score_mod=sm)
    with pytest.raises(NotImplementedError, match="dbias with score / mask functions"):
        aa.attention_backward(T(q), T(k), T(v), T(q), bias=T(np.zeros((1, 1, 1, S), np.float32)),
                              wrt=("q", "bias"), backend="triton", score_mod=sm)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA tensors")
def test_torch_on_cuda_runs_functions_and_capture_gradients():
    """Score functions on CUDA tensors, a per-head capture's gradient by autograd (the
    CPU path's), and a capture read at [q_idx, kv_idx] refused in the forward."""
    import anyattn.torch as at

    q, k, v = (T(x) for x in _inputs(4, 1, 2, 2, 32, 32, 16))
    fn = lambda s, b, h, i, j: s * 0.5                                  # noqa: E731
    out = at.attention(q.requires_grad_(), k, v, score_mod=fn)
    out.sum().backward()
    ro, _ = _reference(*(x.detach().cpu().numpy() for x in (q, k, v)), score_mod=fn)
    assert_close(out.detach().cpu().numpy(), ro, "float32", "torch cuda")
    grads = []
    for x in (q, k, v), tuple(x.detach().cpu() for x in (q, k, v)):
        t = torch.tensor([0.5, -0.25], device=x[0].device, requires_grad=True)
        o = at.attention(*x, score_mod=aa.ScoreMod(lambda s, b, h, i, j, t: s + t[h], t=t))
        (o * o).sum().backward()
        grads.append(t.grad.cpu().double().numpy())
    assert_close(grads[0], grads[1], "float32", "dt")
    t = torch.zeros((32, 32), device=q.device, requires_grad=True)
    with pytest.raises(NotImplementedError, match=r"capture 't' is read at t\[q_idx, kv_idx\]"):
        at.attention(q, k, v, score_mod=aa.ScoreMod(lambda s, b, h, i, j, t: s + t[i, j], t=t))
