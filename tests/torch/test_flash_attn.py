"""anyattn.flash_attn against a float64 oracle written from FlashAttention's documented
semantics (bottom-right causal / window / ALiBi, softcap, GQA, varlen, KV cache)."""
import numpy as np
import pytest
import torch

import anyattn.flash_attn as fa

TOL = 1e-5          # float32 inputs against the float64 oracle, relative to the largest value


# ------------------------------------------------------------------------------ oracle

def ref_seq(q, k, v, scale=None, causal=False, window=(-1, -1), softcap=0.0, slopes=None,
            keep=None, p=0.0):
    """One sequence in float64: q [Sq, Hq, D], k [Sk, Hk, D], v [Sk, Hk, Dv] -> out
    [Sq, Hq, Dv], lse [Hq, Sq], P [Hq, Sq, Sk].  ``keep`` [Hq, Sq, Sk]: dropout mask."""
    q, k, v = (x.double() for x in (q, k, v))
    sq, hq, d = q.shape
    sk, hk, _ = k.shape
    g = hq // hk
    scale = d ** -0.5 if scale is None else scale
    kk = k.repeat_interleave(g, dim=1).permute(1, 0, 2)
    vv = v.repeat_interleave(g, dim=1).permute(1, 0, 2)
    s = scale * q.permute(1, 0, 2) @ kk.transpose(-1, -2)                 # [Hq, Sq, Sk]
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    row = torch.arange(sq)[:, None] + sk - sq
    col = torch.arange(sk)[None, :]
    if slopes is not None:
        s = s - slopes.double()[:, None, None] * (row - col).abs()
    left, right = window
    if causal:
        right = 0
    allowed = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        allowed &= col >= row - left
    if right >= 0:
        allowed &= col <= row + right
    s = s.masked_fill(~allowed, -torch.inf)
    lse = torch.logsumexp(s, -1)
    P = torch.exp(s - lse[..., None]).nan_to_num(0.0)
    Pd = P if keep is None else P * keep / (1 - p)
    return (Pd @ vv).permute(1, 0, 2), lse, P


def ref_batch(q, k, v, **kw):
    """[B, S, H, D] batches: out [B, Sq, Hq, Dv], lse [B, Hq, Sq]."""
    slopes = kw.pop("slopes", None)
    outs, lses = [], []
    for b in range(q.shape[0]):
        sl = None if slopes is None else (slopes if slopes.ndim == 1 else slopes[b])
        o, l, _ = ref_seq(q[b], k[b], v[b], slopes=sl, **kw)
        outs.append(o)
        lses.append(l)
    return torch.stack(outs), torch.stack(lses)


def close(got, want, tol=TOL):
    got, want = got.detach().double(), want.detach().double()
    fin = torch.isfinite(want)
    assert torch.equal(torch.isfinite(got), fin), "infinite entries differ"
    scale = max(1.0, float(want[fin].abs().max()) if fin.any() else 1.0)
    err = float((got[fin] - want[fin]).abs().max()) if fin.any() else 0.0
    assert err <= tol * scale, f"max error {err:.3g} > {tol * scale:.3g}"


def rand(*shape, grad=False):
    return torch.randn(*shape, dtype=torch.float32).requires_grad_(grad)


def grads_vs_ref(fn, ref, inputs):
    """Gradients of fn(*inputs) (float32) against ref(*float64 copies)."""
    out = fn(*inputs)
    dout = torch.randn_like(out)
    got = torch.autograd.grad(out, inputs, dout)
    ins64 = [x.detach().double().requires_grad_() for x in inputs]
    want = torch.autograd.grad(ref(*ins64), ins64, dout.double())
    for a, b in zip(got, want):
        close(a, b)


# ------------------------------------------------------------------------ flash_attn_func

CASES = [
    dict(),
    dict(causal=True),
    dict(window=(3, 2)),
    dict(causal=True, window=(4, -1)),
    dict(window=(-1, 1)),
    dict(softcap=2.0),
    dict(slopes="h"),
    dict(slopes="bh", causal=True),
    dict(causal=True, softcap=5.0, slopes="h", window=(6, 6), scale=0.3),
]


def _kw(case, b, h):
    kw = dict(case)
    if "slopes" in kw:
        kw["slopes"] = torch.rand(h) if kw["slopes"] == "h" else torch.rand(b, h)
    return kw


def _fa_kw(kw):
    out = dict(causal=kw.get("causal", False), window_size=kw.get("window", (-1, -1)),
               softcap=kw.get("softcap", 0.0), alibi_slopes=kw.get("slopes"),
               softmax_scale=kw.get("scale"))
    return out


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("sq,sk", [(9, 9), (5, 12), (12, 5)])
def test_func_matches_oracle(case, sq, sk):
    b, hq, hk, d = 2, 4, 2, 8
    q, k, v = rand(b, sq, hq, d, grad=True), rand(b, sk, hk, d, grad=True), \
        rand(b, sk, hk, d, grad=True)
    kw = _kw(case, b, hq)
    out, lse, _ = fa.flash_attn_func(q, k, v, return_attn_probs=True, **_fa_kw(kw))
    ro, rl = ref_batch(q, k, v, **kw)
    assert out.shape == (b, sq, hq, d) and lse.shape == (b, hq, sq)
    assert out.dtype == q.dtype and lse.dtype == torch.float32
    close(out, ro)
    close(lse, rl)
    grads_vs_ref(lambda *x: fa.flash_attn_func(*x, **_fa_kw(kw)),
                 lambda *x: ref_batch(*x, **dict(kw))[0], [q, k, v])


def test_causal_sq_above_sk_gives_zero_rows():
    q, k, v = rand(1, 5, 2, 8), rand(1, 2, 2, 8), rand(1, 2, 2, 8)
    out, lse, _ = fa.flash_attn_func(q, k, v, causal=True, return_attn_probs=True)
    assert torch.equal(out[0, :3], torch.zeros_like(out[0, :3]))    # FlashAttention's example
    assert torch.isneginf(lse[0, :, :3]).all() and torch.isfinite(lse[0, :, 3:]).all()


def test_packed_variants_and_their_gradients():
    b, s, h, d = 2, 7, 3, 8
    qkv = rand(b, s, 3, h, d, grad=True)
    out = fa.flash_attn_qkvpacked_func(qkv, causal=True, window_size=(2, 0))
    ro, _ = ref_batch(qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2], causal=True, window=(2, 0))
    close(out, ro)
    grads_vs_ref(lambda x: fa.flash_attn_qkvpacked_func(x, causal=True),
                 lambda x: ref_batch(x[:, :, 0], x[:, :, 1], x[:, :, 2], causal=True)[0],
                 [qkv])
    q, kv = rand(b, 4, 4, d, grad=True), rand(b, s, 2, 2, d, grad=True)   # GQA, Sq != Sk
    grads_vs_ref(lambda x, y: fa.flash_attn_kvpacked_func(x, y, causal=True, softcap=3.0),
                 lambda x, y: ref_batch(x, y[:, :, 0], y[:, :, 1], causal=True,
                                        softcap=3.0)[0], [q, kv])


def test_dropout_reconstructed_from_attn_probs():
    """FlashAttention's tests rebuild the dropout mask from S_dmask's signs."""
    b, sq, sk, h, d, p = 2, 33, 40, 2, 8, 0.17
    q, k, v = rand(b, sq, h, d, grad=True), rand(b, sk, h, d, grad=True), \
        rand(b, sk, h, d, grad=True)
    torch.manual_seed(3)
    out, lse, S = fa.flash_attn_func(q, k, v, dropout_p=p, causal=True,
                                     return_attn_probs=True)
    keep = S >= 0
    allowed = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + sk - sq
    frac = 1 - keep[..., allowed].float().mean()
    assert abs(float(frac) - p) < 0.04
    want = []
    for i in range(b):
        _, _, P = ref_seq(q[i], k[i], v[i], causal=True)
        close(S[i].abs(), P)
        want.append(ref_seq(q[i], k[i], v[i], causal=True, keep=keep[i], p=p)[0])
    close(out, torch.stack(want))
    # the backward regenerates the same mask: gradients of the dropped function
    torch.manual_seed(3)
    grads_vs_ref(lambda *x: fa.flash_attn_func(*x, dropout_p=p, causal=True),
                 lambda *x: torch.stack([ref_seq(x[0][i], x[1][i], x[2][i], causal=True,
                                                 keep=keep[i], p=p)[0] for i in range(b)]),
                 [q, k, v])


def test_attn_probs_without_dropout_are_the_softmax():
    q, k, v = rand(1, 6, 2, 8), rand(1, 9, 2, 8), rand(1, 9, 2, 8)
    sl = torch.rand(2)
    _, _, S = fa.flash_attn_func(q, k, v, window_size=(2, 3), alibi_slopes=sl, softcap=1.5,
                                 return_attn_probs=True)
    _, _, P = ref_seq(q[0], k[0], v[0], window=(2, 3), slopes=sl, softcap=1.5)
    close(S[0], P)


# ------------------------------------------------------------------------------- varlen

def _cu(lengths):
    return torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32)


def ref_varlen(q, k, v, lq, lk, slopes=None, **kw):
    cq, ck = _cu(lq), _cu(lk)
    outs, lses = [], []
    for d in range(len(lq)):
        a, b, c, e = int(cq[d]), int(cq[d + 1]), int(ck[d]), int(ck[d + 1])
        sl = None if slopes is None else (slopes if slopes.ndim == 1 else slopes[d])
        o, l, _ = ref_seq(q[a:b], k[c:e], v[c:e], slopes=sl, **kw)
        outs.append(o)
        lses.append(l)
    return torch.cat(outs), torch.cat(lses, dim=1)


VARLEN = [
    dict(),
    dict(causal=True),
    dict(causal=True, window=(3, -1), softcap=4.0),
    dict(window=(2, 5)),
    dict(slopes="h", causal=True),
    dict(slopes="bh"),
    dict(slopes="bh", causal=True, window=(4, 1)),
]


@pytest.mark.parametrize("case", VARLEN)
@pytest.mark.parametrize("same_lengths", [False, True])
def test_varlen_matches_oracle(case, same_lengths):
    rng = np.random.default_rng(len(str(case)) + same_lengths)
    n, hq, hk, d = 5, 4, 2, 8
    lq = rng.integers(0, 12, n)
    lq[1] = 0                                                        # an empty sequence
    lk = lq.copy() if same_lengths else rng.integers(0, 12, n)
    if not same_lengths:
        lk[3] = 0                                                    # keys of one are empty
    q = rand(int(lq.sum()), hq, d, grad=True)
    k, v = rand(int(lk.sum()), hk, d, grad=True), rand(int(lk.sum()), hk, d, grad=True)
    kw = _kw(case, n, hq)
    cq, ck = _cu(lq), _cu(lk)
    args = (cq, ck, int(lq.max()), int(lk.max()))
    out, lse, S = fa.flash_attn_varlen_func(q, k, v, *args, return_attn_probs=True,
                                            **_fa_kw(kw))
    ro, rl = ref_varlen(q, k, v, lq, lk, **kw)
    assert out.shape == q.shape and lse.shape == (hq, q.shape[0])
    close(out, ro)
    close(lse, rl)
    assert S.shape == (n, hq, int(lq.max()), int(lk.max()))
    grads_vs_ref(lambda *x: fa.flash_attn_varlen_func(*x, *args, **_fa_kw(kw)),
                 lambda *x: ref_varlen(*x, lq, lk, **dict(kw))[0], [q, k, v])


def test_varlen_packed_variants_and_dropout():
    lengths = np.array([5, 0, 9, 3])
    cu, h, d, p = _cu(lengths), 2, 8, 0.2
    qkv = rand(int(lengths.sum()), 3, h, d, grad=True)
    out = fa.flash_attn_varlen_qkvpacked_func(qkv, cu, 9, causal=True)
    close(out, ref_varlen(qkv[:, 0], qkv[:, 1], qkv[:, 2], lengths, lengths, causal=True)[0])
    lq = np.array([2, 4, 1, 3])
    q = rand(int(lq.sum()), 4, d, grad=True)
    kv = rand(int(lengths.sum()), 2, h, d, grad=True)
    torch.manual_seed(1)
    out, lse, S = fa.flash_attn_varlen_kvpacked_func(q, kv, _cu(lq), cu, 4, 9, dropout_p=p,
                                                     causal=True, return_attn_probs=True)
    cq = _cu(lq)
    want = []
    for i in range(len(lq)):
        a, b, c, e = int(cq[i]), int(cq[i + 1]), int(cu[i]), int(cu[i + 1])
        keep = S[i, :, :b - a, :e - c] >= 0
        want.append(ref_seq(q[a:b], kv[c:e, 0], kv[c:e, 1], causal=True, keep=keep, p=p)[0])
    close(out, torch.cat(want))
    grads_vs_ref(lambda x, y: fa.flash_attn_varlen_kvpacked_func(x, y, _cu(lq), cu, 4, 9,
                                                                 causal=True),
                 lambda x, y: ref_varlen(x, y[:, 0], y[:, 1], lq, lengths, causal=True)[0],
                 [q, kv])


def test_varlen_cpu_cu_seqlens_int64_and_max_seqlen_above_lengths():
    lq = np.array([3, 6])
    q, k = rand(9, 2, 8), rand(9, 2, 8)
    cu = _cu(lq).long()
    out = fa.flash_attn_varlen_func(q, k, k, cu, cu, 100, 100, causal=True)
    close(out, ref_varlen(q, k, k, lq, lq, causal=True)[0])


# ------------------------------------------------------------------------------ KV cache

def test_kvcache_append_in_place_causal_and_lse():
    b, s_cache, hq, hk, d = 3, 20, 4, 2, 8
    k_cache, v_cache = rand(b, s_cache, hk, d), rand(b, s_cache, hk, d)
    before_k = k_cache.clone()
    lengths = torch.tensor([4, 0, 11], dtype=torch.int32)
    q, k_new, v_new = rand(b, 3, hq, d), rand(b, 3, hk, d), rand(b, 3, hk, d)
    sl = torch.rand(b, hq)
    out, lse = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new,
                                          cache_seqlens=lengths, causal=True,
                                          window_size=(5, -1), softcap=3.0, alibi_slopes=sl,
                                          return_softmax_lse=True)
    for i in range(b):
        n = int(lengths[i])
        assert torch.equal(k_cache[i, n:n + 3], k_new[i])
        assert torch.equal(v_cache[i, n:n + 3], v_new[i])
        assert torch.equal(k_cache[i, :n], before_k[i, :n])
        assert torch.equal(k_cache[i, n + 3:], before_k[i, n + 3:])
        o, l, _ = ref_seq(q[i], k_cache[i, :n + 3], v_cache[i, :n + 3], causal=True,
                          window=(5, -1), softcap=3.0, slopes=sl[i])
        close(out[i], o)
        close(lse[i], l)


def test_kvcache_contiguous_lengths_that_differ_run_as_one_paged_call(monkeypatch):
    """On the CPU a contiguous cache whose entries hold different numbers of keys is one
    core call over pages of s_cache positions (page = cache row, cache_batch_idx the
    table), not one call per entry."""
    from anyattn.flash_attn import flash_attn_interface as fai

    calls = []
    real = fai.core_attention
    monkeypatch.setattr(fai, "core_attention",
                        lambda *a, **kw: calls.append(kw["pages"]) or real(*a, **kw))
    k_cache, v_cache = rand(5, 12, 2, 8), rand(5, 12, 2, 8)
    q, k_new, v_new = rand(3, 2, 4, 8), rand(3, 2, 2, 8), rand(3, 2, 2, 8)
    idx = torch.tensor([4, 0, 2], dtype=torch.int32)
    lengths = torch.tensor([9, 0, 3], dtype=torch.int32)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, cache_seqlens=lengths,
                                     cache_batch_idx=idx, causal=True)
    assert len(calls) == 1
    assert calls[0].table.tolist() == [[4], [0], [2]] and calls[0].lengths.tolist() == [11, 2, 5]
    for i, r in enumerate((4, 0, 2)):
        n = int(lengths[i]) + 2
        assert torch.equal(k_cache[r, n - 2:n], k_new[i])
        close(out[i], ref_seq(q[i], k_cache[r, :n], v_cache[r, :n], causal=True)[0])


def test_kvcache_batch_idx_leftpad_int_seqlens_and_whole_cache():
    hq, d = 2, 8
    k_cache, v_cache = rand(4, 10, 1, d), rand(4, 10, 1, d)
    q = rand(2, 1, hq, d)
    idx = torch.tensor([3, 1], dtype=torch.int32)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=7,
                                     cache_batch_idx=idx, causal=True)
    for i, r in enumerate((3, 1)):
        close(out[i], ref_seq(q[i], k_cache[r, :7], v_cache[r, :7], causal=True)[0])
    pad = torch.tensor([2, 0], dtype=torch.int32)
    lengths = torch.tensor([6, 9], dtype=torch.int32)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, cache_seqlens=lengths,
                                     cache_batch_idx=idx, cache_leftpad=pad)
    close(out[0], ref_seq(q[0], k_cache[3, 2:6], v_cache[3, 2:6])[0])
    close(out[1], ref_seq(q[1], k_cache[1, :9], v_cache[1, :9])[0])
    q2 = rand(4, 2, hq, d)
    out = fa.flash_attn_with_kvcache(q2, k_cache, v_cache)                 # the whole cache
    for i in range(4):
        close(out[i], ref_seq(q2[i], k_cache[i], v_cache[i])[0])


# ------------------------------------------------------------------------ rotary, pages

def ref_rotary(x, cos, sin, pos, interleaved):
    """float64 rotary from the formula: the pair (x_a, x_b) of channel pair j becomes
    (x_a cos - x_b sin, x_a sin + x_b cos) at angle row pos; a = 2j, b = 2j + 1
    (interleaved) or a = j, b = j + r/2.  x [..., H, D], pos [...] ints."""
    x = x.detach().double().clone()
    half = cos.shape[1]
    c = cos.double()[pos][..., None, :]
    s = sin.double()[pos][..., None, :]
    a = torch.arange(half) * 2 if interleaved else torch.arange(half)
    b = a + 1 if interleaved else a + half
    xa, xb = x[..., a].clone(), x[..., b].clone()
    x[..., a] = xa * c - xb * s
    x[..., b] = xa * s + xb * c
    return x


@pytest.mark.parametrize("interleaved", [False, True])
def test_apply_rotary_emb_matches_formula(interleaved):
    from anyattn.flash_attn.layers.rotary import apply_rotary_emb

    b, s, h, d, half = 3, 5, 2, 12, 4                                # rotary_dim 8 < d
    ang = torch.rand(20, half) * 6.3
    cos, sin = ang.cos(), ang.sin()
    x = rand(b, s, h, d, grad=True)
    offsets = torch.tensor([0, 7, 15], dtype=torch.int32)
    pos = offsets[:, None].long() + torch.arange(s)[None, :]
    got = apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=offsets)
    close(got, ref_rotary(x, cos, sin, pos, interleaved))
    assert torch.equal(got[..., 2 * half:], x[..., 2 * half:])      # the rest passes through
    close(apply_rotary_emb(x, cos, sin, interleaved=interleaved, seqlen_offsets=3),
          ref_rotary(x, cos, sin, torch.arange(s)[None, :].expand(b, s) + 3, interleaved))
    # the rotation is orthogonal: the gradient is the inverse rotation of the upstream one
    g = torch.randn_like(got)
    (dx,) = torch.autograd.grad(got, x, g)
    close(dx, ref_rotary(g, cos, -sin, pos, interleaved))
    # packed sequences: the same tokens give the same rotation
    lengths = [2, 0, 5]
    packed = torch.cat([x[i, :n] for i, n in enumerate(lengths)]).detach()
    cu = torch.tensor([0, 2, 2, 7], dtype=torch.int32)
    out = apply_rotary_emb(packed, cos, sin, interleaved=interleaved, seqlen_offsets=offsets,
                           cu_seqlens=cu, max_seqlen=5)
    close(out, torch.cat([got[i, :n] for i, n in enumerate(lengths)]))
    y = x.detach().clone()
    assert apply_rotary_emb(y, cos, sin, interleaved=interleaved, inplace=True,
                            seqlen_offsets=offsets) is y
    close(y, got)
    with pytest.raises(ValueError, match="seqlen_offsets: position 19 needs row 19"):
        apply_rotary_emb(x, cos[:19], sin[:19], seqlen_offsets=offsets)
    with pytest.raises(ValueError, match="cos: rotary_dim = 2 [*] 8 = 16 exceeds"):
        apply_rotary_emb(x, torch.ones(20, 8), torch.ones(20, 8))


@pytest.mark.parametrize("causal,window", [(True, (-1, -1)), (False, (-1, -1)),
                                           (False, (4, 3))])
@pytest.mark.parametrize("interleaved", [False, True])
def test_kvcache_rotary_matches_oracle(causal, window, interleaved):
    b, s_cache, hq, hk, d, sq, half = 2, 24, 4, 2, 16, 3, 6
    k_cache, v_cache = rand(b, s_cache, hk, d), rand(b, s_cache, hk, d)
    before = k_cache.clone()
    q, k_new, v_new = rand(b, sq, hq, d), rand(b, sq, hk, d), rand(b, sq, hk, d)
    ang = torch.rand(s_cache, half) * 6.3
    cos, sin = ang.cos(), ang.sin()
    lengths = torch.tensor([5, 13], dtype=torch.int32)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos,
                                     rotary_sin=sin, cache_seqlens=lengths, causal=causal,
                                     window_size=window, rotary_interleaved=interleaved)
    local = causal or window != (-1, -1)
    for i in range(b):
        n = int(lengths[i])
        kpos = n + torch.arange(sq)
        qpos = kpos if local else torch.full((sq,), n)             # FlashAttention's rule
        k_ro = ref_rotary(k_new[i], cos, sin, kpos, interleaved)
        close(k_cache[i, n:n + sq], k_ro)                            # rotated keys are stored
        assert torch.equal(k_cache[i, :n], before[i, :n])
        keys = torch.cat([before[i, :n].double(), k_ro])
        o, _, _ = ref_seq(ref_rotary(q[i], cos, sin, qpos, interleaved), keys,
                          v_cache[i, :n + sq], causal=causal, window=window)
        close(out[i], o)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("interleaved", [False, True])
def test_kvcache_rotary_leftpad_counts_from_the_cache_start(causal, interleaved):
    """With cache_leftpad the rotary positions stay cache positions counted from 0
    (FlashAttention: new key i and, causal, query i at cache_seqlens[b] + i), not from
    the left pad; rotary_dim 8 < D 16 leaves the other channels as they are."""
    b, s_cache, hq, hk, d, sq, half = 3, 32, 4, 2, 16, 2, 4
    k_cache, v_cache = rand(b, s_cache, hk, d), rand(b, s_cache, hk, d)
    before = k_cache.clone()
    q, k_new, v_new = rand(b, sq, hq, d), rand(b, sq, hk, d), rand(b, sq, hk, d)
    ang = torch.rand(s_cache, half) * 6.3
    cos, sin = ang.cos(), ang.sin()
    lengths = torch.tensor([9, 20, 4], dtype=torch.int32)
    pad = torch.tensor([5, 0, 4], dtype=torch.int32)
    out = fa.flash_attn_with_kvcache(q, k_cache, v_cache, k_new, v_new, rotary_cos=cos,
                                     rotary_sin=sin, cache_seqlens=lengths, cache_leftpad=pad,
                                     causal=causal, rotary_interleaved=interleaved)
    for i in range(b):
        n, lo = int(lengths[i]), int(pad[i])
        kpos = n + torch.arange(sq)
        qpos = kpos if causal else torch.full((sq,), n)
        k_ro = ref_rotary(k_new[i], cos, sin, kpos, interleaved)
        assert torch.equal(k_cache[i, n:n + sq, :, 2 * half:], k_new[i, :, :, 2 * half:])
        close(k_cache[i, n:n + sq], k_ro)
        keys = torch.cat([before[i, lo:n].double(), k_ro])
        o, _, _ = ref_seq(ref_rotary(q[i], cos, sin, qpos, interleaved), keys,
                          v_cache[i, lo:n + sq], causal=causal)
        close(out[i], o)


def test_kvcache_rotary_needs_new_keys():
    """FlashAttention rotates q only together with new keys (it refuses rotary tables
    without k / v); so does this, instead of rotating q alone."""
    q, kc = rand(2, 1, 2, 8), rand(2, 16, 2, 8)
    ang = torch.rand(16, 4)
    with pytest.raises(ValueError, match="rotary_cos, rotary_sin: rotate q together with "
                                         "the new keys k"):
        fa.flash_attn_with_kvcache(q, kc, kc, rotary_cos=ang.cos(), rotary_sin=ang.sin(),
                                   cache_seqlens=3)


def paged_copy(cache, table, length):
    """The contiguous [B, length, ...] view of a paged cache (the test's own gather)."""
    rows = []
    for r in table.long():
        rows.append(torch.cat([cache[int(blk)] for blk in r])[:length])
    return torch.stack(rows)


def test_kvcache_paged_equals_contiguous():
    b, page, hq, hk, d, sq = 3, 16, 4, 2, 8, 2
    num_blocks, per_seq = 12, 3
    kp, vp = rand(num_blocks, page, hk, d), rand(num_blocks, page, hk, d)
    table = torch.randperm(num_blocks, dtype=torch.int32)[:b * per_seq].reshape(b, per_seq)
    table[0, 2] = -1                     # an unused page (entry 0 ends in its second page)
    lengths = torch.tensor([17, 30, 2], dtype=torch.int32)
    ends = lengths + sq
    kc, vc = (paged_copy(x, table.clamp(min=0), per_seq * page) for x in (kp, vp))
    q, k_new, v_new = rand(b, sq, hq, d), rand(b, sq, hk, d), rand(b, sq, hk, d)
    ang = torch.rand(64, 4) * 6.3
    pad = torch.tensor([3, 0, 1], dtype=torch.int32)
    kw = dict(cache_seqlens=lengths, causal=True, window_size=(20, -1),
              alibi_slopes=torch.rand(b, hq), rotary_cos=ang.cos(), rotary_sin=ang.sin(),
              cache_leftpad=pad, return_softmax_lse=True)
    want, want_lse = fa.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, **kw)
    got, got_lse = fa.flash_attn_with_kvcache(q, kp, vp, k_new, v_new, block_table=table, **kw)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)
    for i in range(b):                                   # the pages were appended in place
        e = int(ends[i])
        assert torch.equal(paged_copy(kp, table[i:i + 1].clamp(min=0), e)[0], kc[i, :e])
        assert torch.equal(paged_copy(vp, table[i:i + 1].clamp(min=0), e)[0], vc[i, :e])
    # without new keys and without cache_seqlens: every mapped position
    q1 = rand(b, 1, hq, d)
    full = fa.flash_attn_with_kvcache(q1, kp, vp, block_table=table.clamp(min=0))
    close(full, fa.flash_attn_with_kvcache(q1, *(paged_copy(x, table.clamp(min=0),
                                                            per_seq * page) for x in (kp, vp))))


@pytest.mark.parametrize("sq", [1, 4])
def test_kvcache_paged_on_the_cpu_reads_the_pages_in_place(sq, monkeypatch):
    """Without cache_leftpad a CPU paged cache goes to the core's paged form (pages=),
    no gathered copy: the result matches the float64 oracle over the test's own gather,
    and the new keys land in their pages."""
    from anyattn.flash_attn import flash_attn_interface as fai

    calls = []
    real = fai.core_attention
    monkeypatch.setattr(fai, "core_attention",
                        lambda *a, **kw: calls.append(kw["pages"]) or real(*a, **kw))
    b, page, hq, hk, d = 3, 16, 4, 2, 8
    num_blocks, per_seq = 12, 4
    kp, vp = rand(num_blocks, page, hk, d), rand(num_blocks, page, hk, d)
    table = torch.randperm(num_blocks, dtype=torch.int32)[:b * per_seq].reshape(b, per_seq)
    table[2, 0] = table[0, 0]                             # a shared (full) first page
    table[2, 2:] = -1                                     # never read
    lengths = torch.tensor([17, 40, 16], dtype=torch.int32)
    q, k_new, v_new = rand(b, sq, hq, d), rand(b, sq, hk, d), rand(b, sq, hk, d)
    before = kp.clone()
    slopes = torch.rand(hq)
    out, lse = fa.flash_attn_with_kvcache(q, kp, vp, k_new, v_new, cache_seqlens=lengths,
                                          block_table=table, causal=True,
                                          window_size=(20, -1), alibi_slopes=slopes,
                                          softcap=3.0, return_softmax_lse=True)
    assert len(calls) == 1 and calls[0].lengths.tolist() == (lengths + sq).tolist()
    for i in range(b):
        e = int(lengths[i]) + sq
        kc, vc = (paged_copy(x, table[i:i + 1].clamp(min=0), e)[0] for x in (kp, vp))
        assert torch.equal(kc[e - sq:], k_new[i]) and torch.equal(vc[e - sq:], v_new[i])
        assert torch.equal(kc[:e - sq], paged_copy(before, table[i:i + 1].clamp(min=0),
                                                   e - sq)[0])
        o, s, _ = ref_seq(q[i], kc, vc, causal=True, window=(20, -1), softcap=3.0,
                          slopes=slopes)
        close(out[i], o)
        close(lse[i], s)


@pytest.mark.parametrize("gathered", [False, True])
def test_kvcache_block_table_reads_only_the_pages_in_use(monkeypatch, gathered):
    """block_table entries outside the pages holding [cache_leftpad[b], cache_seqlens[b] +
    Snew) are never read: -1 (or garbage) past the used pages and before the left pad
    work, in place and through the gathered copy (``gathered``: the GPU route for many
    queries); an entry in use out of range still raises."""
    from anyattn.flash_attn import flash_attn_interface as fai

    if gathered:
        monkeypatch.setattr(fai, "_reads_in_place", lambda *a: False)
    b, page, hq, hk, d, sq = 3, 16, 4, 2, 8, 2
    num_blocks, per_seq = 12, 4
    kp, vp = rand(num_blocks, page, hk, d), rand(num_blocks, page, hk, d)
    table = torch.randperm(num_blocks, dtype=torch.int32).reshape(b, per_seq)
    lengths = torch.tensor([17, 40, 2], dtype=torch.int32)
    pad = torch.tensor([0, 35, 1], dtype=torch.int32)
    full = table.clone()
    table[0, 2:] = -1                    # entry 0 reads positions [0, 19): pages 0, 1
    table[1, :2] = -1                    # entry 1 reads [35, 42): pages 2 and ...
    table[1, 3] = num_blocks + 7         # ... not 3
    table[2, 1:] = -1                    # entry 2 reads [1, 4): page 0
    kc, vc = (paged_copy(x, full, per_seq * page) for x in (kp, vp))
    q, k_new, v_new = rand(b, sq, hq, d), rand(b, sq, hk, d), rand(b, sq, hk, d)
    kw = dict(cache_seqlens=lengths, cache_leftpad=pad, causal=True)
    want = fa.flash_attn_with_kvcache(q, kc, vc, k_new, v_new, **kw)
    got = fa.flash_attn_with_kvcache(q, kp, vp, k_new, v_new, block_table=table, **kw)
    assert torch.equal(got, want)
    ends = lengths + sq
    for i in range(b):
        e = int(ends[i])
        assert torch.equal(paged_copy(kp, full[i:i + 1], e)[0], kc[i, :e])
    bad = table.clone()
    bad[1, 2] = -1
    with pytest.raises(ValueError, match=r"block_table: entry \[1, 2\] is -1, outside "
                                         r"the cache's 12 blocks"):
        fa.flash_attn_with_kvcache(q, kp, vp, k_new, v_new, block_table=bad, **kw)



def test_kvcache_reads_in_place_where_the_core_paged_form_serves():
    """In place (one core call with pages=) on the CPU and, with at most 16 queries per
    entry (the Triton paged kernel's), on a GPU, cache_leftpad included (the starts of
    the core's Pages); not for a contiguous cache whose entries all hold keys [0, end)
    with one end (a dense call over a slice of it)."""
    from anyattn.flash_attn.flash_attn_interface import _reads_in_place

    no_pad, ragged, even = np.zeros(3, np.int64), np.array([5, 9, 2]), np.array([7, 7, 7])
    pad = np.array([0, 1, 0])
    assert _reads_in_place("cuda", 16, True, no_pad, even)
    assert _reads_in_place("cuda", 1, False, no_pad, ragged)
    assert not _reads_in_place("cuda", 17, True, no_pad, ragged)
    assert _reads_in_place("cpu", 17, True, no_pad, ragged)
    assert not _reads_in_place("cuda", 1, False, no_pad, even)
    assert _reads_in_place("cpu", 1, True, pad, ragged)
    assert _reads_in_place("cpu", 17, False, pad, even)
    assert _reads_in_place("cuda", 16, False, pad, even)
    assert not _reads_in_place("cuda", 17, False, pad, even)
    assert not _reads_in_place("cuda", 1, True, no_pad[:0], ragged[:0])


def _no_gathers(monkeypatch, backend=None):
    """flash_attn_with_kvcache's fallbacks (the gathered copy of a paged cache, dense
    calls over slices) raise; the core calls with pages= are recorded (-> the list)."""
    from anyattn.flash_attn import flash_attn_interface as fai

    def refuse(name):
        def fail(*a, **kw):
            raise AssertionError(f"{name} was called: the cache was not read in place")
        return fail
    monkeypatch.setattr(fai, "_gather_pages", refuse("_gather_pages"))
    monkeypatch.setattr(fai, "_dense_over_ranges", refuse("_dense_over_ranges"))
    monkeypatch.setattr(fai, "attention", refuse("the dense attention"))
    calls = []
    real = fai.core_attention
    extra = {} if backend is None else dict(backend=backend)
    monkeypatch.setattr(fai, "core_attention", lambda *a, **kw: calls.append(
        kw["pages"]) or real(*a, **extra, **kw))
    return calls


@pytest.mark.parametrize("paged", [True, False])
@pytest.mark.parametrize("sq", [1, 3])
def test_kvcache_leftpad_reads_the_cache_in_place(paged, sq, monkeypatch):
    """cache_leftpad: one core call with pages= whose starts are the left padding (no
    gathered copy, no call per entry), ragged and even ends, cache_batch_idx, GQA, a
    causal window, ALiBi, softcap and new keys appended in place; FlashAttention's
    semantic: entry b attends its keys [leftpad[b], seqlens[b] + Snew) as a dense
    problem of those keys, causal and window aligned at their bottom right."""
    calls = _no_gathers(monkeypatch)
    b, page, hq, hk, d = 3, 16, 4, 2, 8
    lengths = torch.tensor([17, 40, 5], dtype=torch.int32)
    pad = torch.tensor([3, 21, 5], dtype=torch.int32)          # entry 2: only the new keys
    slopes = torch.rand(b, hq)
    q, k_new, v_new = rand(b, sq, hq, d), rand(b, sq, hk, d), rand(b, sq, hk, d)
    extra = {}
    if paged:
        kp, vp = rand(12, page, hk, d), rand(12, page, hk, d)
        table = torch.randperm(12, dtype=torch.int32)[:b * 4].reshape(b, 4)
        extra = dict(block_table=table)
    else:
        kp, vp = rand(4, 4 * page, hk, d), rand(4, 4 * page, hk, d)
        idx = torch.tensor([2, 0, 3], dtype=torch.int32)
        extra = dict(cache_batch_idx=idx)
    out, lse = fa.flash_attn_with_kvcache(q, kp, vp, k_new, v_new, cache_seqlens=lengths,
                                          cache_leftpad=pad, causal=True,
                                          window_size=(20, -1), alibi_slopes=slopes,
                                          softcap=3.0, return_softmax_lse=True, **extra)
    assert len(calls) == 1 and calls[0].firsts.tolist() == pad.tolist()
    assert calls[0].lengths.tolist() == (lengths + sq).tolist()
    for i in range(b):
        lo, e = int(pad[i]), int(lengths[i]) + sq
        if paged:
            kc, vc = (paged_copy(x, table[i:i + 1].clamp(min=0), e)[0] for x in (kp, vp))
        else:
            kc, vc = kp[int(idx[i]), :e], vp[int(idx[i]), :e]
        assert torch.equal(kc[e - sq:], k_new[i]) and torch.equal(vc[e - sq:], v_new[i])
        o, s, _ = ref_seq(q[i], kc[lo:], vc[lo:], causal=True, window=(20, -1), softcap=3.0,
                          slopes=slopes[i])
        close(out[i], o)
        close(lse[i], s)
    # even ends and one padding for every entry: in place too
    calls.clear()
    kc2, vc2 = rand(b, 24, hk, d), rand(b, 24, hk, d)
    pad2 = torch.full((b,), 4, dtype=torch.int32)
    out = fa.flash_attn_with_kvcache(q, kc2, vc2, cache_seqlens=20, cache_leftpad=pad2,
                                     causal=True)
    assert len(calls) == 1
    for i in range(b):
        close(out[i], ref_seq(q[i], kc2[i, 4:20], vc2[i, 4:20], causal=True)[0])


@pytest.mark.parametrize("paged", [True, False])
def test_kvcache_leftpad_on_the_triton_paged_kernel(paged, monkeypatch):
    """cache_leftpad on the Triton paged kernel (STARTS; TRITON_INTERPRET=1 on CPU
    tensors, the route a GPU takes with <= 16 queries), in place, against float64."""
    from anyattn.backends.registry import unavailable_reason

    pytest.importorskip("triton")
    if unavailable_reason("triton"):
        pytest.skip(f"triton unavailable: {unavailable_reason('triton')}")
    calls = _no_gathers(monkeypatch, backend="triton")
    b, page, hq, hk, d, sq = 3, 16, 4, 2, 8, 2
    lengths = torch.tensor([17, 40, 5], dtype=torch.int32)
    pad = torch.tensor([3, 21, 0], dtype=torch.int32)
    q, k_new, v_new = rand(b, sq, hq, d), rand(b, sq, hk, d), rand(b, sq, hk, d)
    if paged:
        kp, vp = rand(12, page, hk, d), rand(12, page, hk, d)
        table = torch.randperm(12, dtype=torch.int32)[:b * 4].reshape(b, 4)
        extra = dict(block_table=table)
    else:
        kp, vp = rand(b, 4 * page, hk, d), rand(b, 4 * page, hk, d)
        extra = {}
    out, lse = fa.flash_attn_with_kvcache(q, kp, vp, k_new, v_new, cache_seqlens=lengths,
                                          cache_leftpad=pad, causal=True,
                                          return_softmax_lse=True, **extra)
    assert len(calls) == 1
    for i in range(b):
        lo, e = int(pad[i]), int(lengths[i]) + sq
        if paged:
            kc, vc = (paged_copy(x, table[i:i + 1], e)[0] for x in (kp, vp))
        else:
            kc, vc = kp[i, :e], vp[i, :e]
        o, s, _ = ref_seq(q[i], kc[lo:], vc[lo:], causal=True)
        close(out[i], o)
        close(lse[i], s)


@pytest.mark.parametrize("paged", [True, False])
def test_kvcache_in_place_on_the_triton_paged_kernel(paged, monkeypatch):
    """The core call flash_attn_with_kvcache makes for a paged cache (and for a contiguous
    one of ragged lengths: its rows as pages) computed by the Triton backend's paged
    kernel (TRITON_INTERPRET=1, CPU tensors; on a GPU the call routes there by itself):
    FlashAttention's bshd pages read in place, against the float64 oracle."""
    from anyattn.backends.registry import unavailable_reason
    from anyattn.flash_attn import flash_attn_interface as fai

    pytest.importorskip("triton")
    if unavailable_reason("triton"):
        pytest.skip(f"triton unavailable: {unavailable_reason('triton')}")
    calls = []
    real = fai.core_attention
    monkeypatch.setattr(fai, "core_attention", lambda *a, **kw: calls.append(
        kw["pages"]) or real(*a, backend="triton", **kw))
    b, page, hq, hk, d, sq = 3, 16, 4, 2, 8, 2
    num_blocks, per_seq = 12, 4
    lengths = torch.tensor([17, 40, 5], dtype=torch.int32)
    slopes = torch.rand(hq)
    q, k_new, v_new = rand(b, sq, hq, d), rand(b, sq, hk, d), rand(b, sq, hk, d)
    if paged:
        kp, vp = rand(num_blocks, page, hk, d), rand(num_blocks, page, hk, d)
        table = torch.randperm(num_blocks, dtype=torch.int32)[:b * per_seq].reshape(b, per_seq)
        table[2, 1:] = -1                                 # never read
        extra = dict(block_table=table)
    else:
        kp, vp = rand(b, per_seq * page, hk, d), rand(b, per_seq * page, hk, d)
        extra = {}
    out, lse = fa.flash_attn_with_kvcache(q, kp, vp, k_new, v_new, cache_seqlens=lengths,
                                          causal=True, window_size=(20, -1),
                                          alibi_slopes=slopes, softcap=3.0,
                                          return_softmax_lse=True, **extra)
    assert len(calls) == 1
    for i in range(b):
        e = int(lengths[i]) + sq
        if paged:
            kc, vc = (paged_copy(x, table[i:i + 1].clamp(min=0), e)[0] for x in (kp, vp))
        else:
            kc, vc = kp[i, :e], vp[i, :e]
        o, s, _ = ref_seq(q[i], kc, vc, causal=True, window=(20, -1), softcap=3.0,
                          slopes=slopes)
        close(out[i], o)
        close(lse[i], s)


def test_kvcache_paged_bad_arguments():
    kp = rand(4, 16, 1, 8)
    q, knew = rand(2, 1, 2, 8), rand(2, 1, 1, 8)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    snapshot = kp.clone()
    with pytest.raises(ValueError, match="k_cache: its page size [(]dim 1[)] is 20; with "
                                         "block_table the pages hold a multiple of 16"):
        fa.flash_attn_with_kvcache(q, rand(4, 20, 1, 8), rand(4, 20, 1, 8), block_table=table)
    with pytest.raises(ValueError, match=r"block_table: entry \[1, 1\] is 4, outside the "
                                         r"cache's 4 blocks"):
        fa.flash_attn_with_kvcache(q, kp, kp.clone(), knew, knew, cache_seqlens=torch.tensor(
            [3, 16], dtype=torch.int32), block_table=torch.tensor([[0, 1], [2, 4]],
                                                                  dtype=torch.int32))
    with pytest.raises(ValueError, match=r"block_table: entry \[0, 0\] is -1"):
        fa.flash_attn_with_kvcache(q, kp, kp, cache_seqlens=1,
                                   block_table=torch.tensor([[-1, 1], [2, 3]],
                                                            dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_seqlens: entry 0 holds 32 keys, and 1 new "
                                         "ones would end at 33, beyond the 2 pages of 16 "
                                         "positions that block_table maps"):
        fa.flash_attn_with_kvcache(q, kp, kp.clone(), knew, knew, cache_seqlens=32,
                                   block_table=table)
    with pytest.raises(NotImplementedError, match="cache_batch_idx: is not supported with "
                                                  "block_table"):
        fa.flash_attn_with_kvcache(q, kp, kp, cache_seqlens=1, block_table=table,
                                   cache_batch_idx=torch.tensor([1, 0], dtype=torch.int32))
    with pytest.raises(TypeError, match="block_table: expected dtype torch.int32"):
        fa.flash_attn_with_kvcache(q, kp, kp, block_table=table.float())
    with pytest.raises(ValueError, match="block_table: expected shape .* batch_size 2, got "
                                         r"\(3, 2\)"):
        fa.flash_attn_with_kvcache(q, kp, kp, block_table=torch.zeros(3, 2, dtype=torch.int32))
    assert torch.equal(kp, snapshot)                                 # nothing written
    # the unused entries of a row may hold anything
    out = fa.flash_attn_with_kvcache(q, kp, kp, cache_seqlens=16, block_table=torch.tensor(
        [[0, -7], [3, 1000]], dtype=torch.int32))
    close(out[1], ref_seq(q[1], kp[3], kp[3])[0])


def test_varlen_paged_keys_equal_packed_keys():
    kp, vp = rand(6, 16, 2, 8, grad=True), rand(6, 16, 2, 8, grad=True)
    table = torch.tensor([[4, 1], [0, 5], [2, -3]], dtype=torch.int32)   # -3: never used
    lk = [20, 7, 0]
    q = rand(6, 4, 8)
    cuq = torch.tensor([0, 3, 5, 6], dtype=torch.int32)
    cuk = torch.tensor([0, 20, 27, 27], dtype=torch.int32)
    kw = dict(causal=True, window_size=(9, -1), alibi_slopes=torch.rand(4))
    out = fa.flash_attn_varlen_func(q, kp, vp, cuq, cuk, 3, 20, block_table=table, **kw)
    k = torch.cat([torch.cat([kp[int(b)] for b in table[d].clamp(min=0)])[:lk[d]]
                   for d in range(3)])
    v = torch.cat([torch.cat([vp[int(b)] for b in table[d].clamp(min=0)])[:lk[d]]
                   for d in range(3)])
    want = fa.flash_attn_varlen_func(q, k, v, cuq, cuk, 3, 20, **kw)
    assert torch.equal(out, want)
    (gk,) = torch.autograd.grad(out.sum(), kp)                       # into the pages
    assert torch.equal(gk[3], torch.zeros_like(gk[3])) and gk[4].abs().sum() > 0
    with pytest.raises(ValueError, match=r"block_table: entry \[1, 0\] is 6, outside"):
        fa.flash_attn_varlen_func(q, kp, vp, cuq, cuk, 3, 20,
                                  block_table=torch.tensor([[4, 1], [6, 5], [2, 2]],
                                                           dtype=torch.int32))
    with pytest.raises(ValueError, match="block_table: sequence 0 has 20 keys but its 1 "
                                         "pages of 16 positions hold 16"):
        fa.flash_attn_varlen_func(q, kp, vp, cuq, cuk, 3, 20, block_table=table[:, :1])
    with pytest.raises(ValueError, match="k: its page size [(]dim 1[)] is 8"):
        fa.flash_attn_varlen_func(q, kp[:, :8], vp[:, :8], cuq, cuk, 3, 20, block_table=table)


# ------------------------------------------------------------------------- bert_padding

def test_bert_padding_round_trips():
    from anyattn.flash_attn.bert_padding import (index_first_axis, index_put_first_axis,
                                                 pad_input, unpad_input)

    b, s = 3, 5
    x = rand(b, s, 2, 4, grad=True)
    mask = torch.tensor([[1, 1, 0, 0, 0], [0, 0, 0, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)
    tokens, indices, cu, mx, used = unpad_input(x, mask)
    assert tokens.shape == (7, 2, 4) and mx == 5
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 2, 2, 7]
    assert used.tolist() == [2, 0, 5] and indices.tolist() == [0, 1, 10, 11, 12, 13, 14]
    assert torch.equal(tokens, torch.cat([x[0, :2], x[2]]))
    back = pad_input(tokens, indices, b, s)
    assert torch.equal(back, x * mask[:, :, None, None])             # zeros where padded
    (g,) = torch.autograd.grad(back.sum(), x)
    assert torch.equal(g, mask[:, :, None, None].expand_as(g).float())
    assert torch.equal(index_first_axis(x.reshape(b * s, 2, 4), indices), tokens)
    assert torch.equal(index_put_first_axis(tokens, indices, b * s).reshape(b, s, 2, 4), back)
    unused = torch.zeros(b, s, dtype=torch.int32)
    unused[0, 2] = 1                                                  # allocated, unused
    tokens, indices, cu, mx, used = unpad_input(x, mask.int(), unused)
    assert cu.tolist() == [0, 3, 3, 8] and used.tolist() == [2, 0, 5]
    assert torch.equal(tokens[2], x[0, 2])
    with pytest.raises(ValueError, match="attention_mask: expected a tensor of shape"):
        unpad_input(x, mask[:, :4])
    with pytest.raises(ValueError, match="indices: holds 7 rows but values has 6"):
        index_put_first_axis(tokens[:6], indices[:7], b * s)


# ------------------------------------------------------------------ a tiny GPT on the CPU

class TinyGPT(torch.nn.Module):
    def __init__(self, vocab=17, dim=32, heads=4, kv_heads=2, layers=2):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, dim // heads
        self.emb = torch.nn.Embedding(vocab, dim)
        self.pos = torch.nn.Embedding(64, dim)
        self.qkv = torch.nn.ModuleList(
            torch.nn.Linear(dim, (heads + 2 * kv_heads) * self.hd) for _ in range(layers))
        self.proj = torch.nn.ModuleList(torch.nn.Linear(dim, dim) for _ in range(layers))
        self.head = torch.nn.Linear(dim, vocab)

    def forward(self, ids, caches=None, start=0):
        b, s = ids.shape
        x = self.emb(ids) + self.pos(torch.arange(start, start + s))
        for i, (qkv, proj) in enumerate(zip(self.qkv, self.proj)):
            q, k, v = qkv(x).view(b, s, -1, self.hd).split(
                [self.heads, self.kv_heads, self.kv_heads], dim=2)
            if caches is None:
                y = fa.flash_attn_func(q, k, v, causal=True)
            else:
                y = fa.flash_attn_with_kvcache(q, caches[i][0], caches[i][1], k, v,
                                               cache_seqlens=start, causal=True)
            x = x + proj(y.reshape(b, s, -1))
        return self.head(x)


def test_tiny_gpt_trains_and_generates():
    torch.manual_seed(0)
    model = TinyGPT()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    data = torch.arange(12).repeat(4, 1) % 17                       # count upwards
    losses = []
    for _ in range(25):
        logits = model(data[:, :-1])
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 17), data[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    with torch.no_grad():
        prompt = data[:1, :4]
        caches = [(torch.zeros(1, 16, 2, 8), torch.zeros(1, 16, 2, 8)) for _ in range(2)]
        logits = model(prompt, caches, 0)
        tokens = [int(logits[0, -1].argmax())]
        for t in range(4, 9):
            logits = model(torch.tensor([[tokens[-1]]]), caches, t)
            tokens.append(int(logits[0, -1].argmax()))
        full = prompt
        for _ in range(6):                                           # without a cache
            full = torch.cat([full, model(full)[:, -1:].argmax(-1)], dim=1)
    assert tokens == full[0, 4:].tolist()


# --------------------------------------------------------------------------- bad input

def _varlen_args():
    q = rand(6, 2, 8)
    return q, q, q


@pytest.mark.parametrize("cu,total,match", [
    ([0, 4, 2, 6], 6, "non-decreasing"),
    ([1, 3, 6], 6, "must start at 0"),
    ([0, 3, 5], 6, "last entry is 5"),
    ([0, 1, 6], 6, "max_seqlen_q: is 4 but sequence 1 has 5"),
])
def test_bad_cu_seqlens(cu, total, match):
    q, k, v = _varlen_args()
    cu_t = torch.tensor(cu, dtype=torch.int32)
    good = _cu([3, 3])
    with pytest.raises(ValueError, match=match):
        fa.flash_attn_varlen_func(q, k, v, cu_t, good, 4, 4)


def test_bad_varlen_arguments():
    q, k, v = _varlen_args()
    cu = _cu([3, 3])
    with pytest.raises(TypeError, match="cu_seqlens_q: expected dtype torch.int32"):
        fa.flash_attn_varlen_func(q, k, v, cu.float(), cu, 3, 3)
    with pytest.raises(ValueError, match="cu_seqlens_k: has 4 entries"):
        fa.flash_attn_varlen_func(q, k, v, cu, _cu([3, 3, 0]), 3, 3)
    with pytest.raises(ValueError, match="max_seqlen_k: is -1"):
        fa.flash_attn_varlen_func(q, k, v, cu, cu, 3, -1)
    with pytest.raises(ValueError, match="q: expected 3 dims"):
        fa.flash_attn_varlen_func(q[None], k, v, cu, cu, 3, 3)
    with pytest.raises(ValueError, match="k: expected 4 dims .*; block_table needs paged"):
        fa.flash_attn_varlen_func(q, k, v, cu, cu, 3, 3, block_table=cu)
    with pytest.raises(ValueError, match=r"alibi_slopes: expected shape \(2,\) or \(2, 2\)"):
        fa.flash_attn_varlen_func(q, k, v, cu, cu, 3, 3, alibi_slopes=torch.ones(3, 2))


def test_bad_func_arguments():
    q = rand(1, 4, 4, 8)
    k = rand(1, 4, 3, 8)
    with pytest.raises(ValueError, match="k: 3 key/value heads do not divide q's 4"):
        fa.flash_attn_func(q, k, k)
    with pytest.raises(ValueError, match="q: expected 4 dims"):
        fa.flash_attn_func(q[0], q[0], q[0])
    with pytest.raises(ValueError, match="window_size: its left side is -2"):
        fa.flash_attn_func(q, q, q, window_size=(-2, 0))
    with pytest.raises(TypeError, match="window_size: expected a pair"):
        fa.flash_attn_func(q, q, q, window_size=3)
    with pytest.raises(TypeError, match="window_size: its right side is 1.5"):
        fa.flash_attn_func(q, q, q, window_size=(1, 1.5))
    with pytest.raises(ValueError, match="v: its number of keys"):
        fa.flash_attn_func(q, q, rand(1, 5, 4, 8))
    with pytest.raises(ValueError, match="qkv: expected 3 at dim 2"):
        fa.flash_attn_qkvpacked_func(rand(1, 4, 2, 4, 8))
    with pytest.raises(ValueError, match="kv: expected 5 dims"):
        fa.flash_attn_kvpacked_func(q, rand(1, 4, 2, 8))
    with pytest.raises(TypeError, match="causal: expected a bool"):
        fa.flash_attn_func(q, q, q, causal=1)
    with pytest.raises(ValueError, match="dropout_p: 1.0 is outside"):
        fa.flash_attn_func(q, q, q, dropout_p=1.0)
    with pytest.raises(ValueError, match="alibi_slopes: requires grad"):
        fa.flash_attn_func(q, q, q, alibi_slopes=torch.ones(4, requires_grad=True))


def test_bad_kvcache_arguments():
    q, kc = rand(2, 1, 2, 8), rand(2, 6, 1, 8)
    knew = rand(2, 3, 1, 8)
    snapshot = kc.clone()
    with pytest.raises(ValueError, match="cache_seqlens: entry 1 holds 4 keys, and 3 new"):
        fa.flash_attn_with_kvcache(q, kc, kc.clone(), knew, knew,
                                   cache_seqlens=torch.tensor([1, 4], dtype=torch.int32))
    assert torch.equal(kc, snapshot)                                 # nothing written
    with pytest.raises(ValueError, match="cache_seqlens: is None but k and v"):
        fa.flash_attn_with_kvcache(q, kc, kc, knew, knew)
    with pytest.raises(ValueError, match="cache_seqlens: holds -1"):
        fa.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=torch.tensor([-1, 2]))
    with pytest.raises(ValueError, match="cache_batch_idx: holds 2, outside"):
        fa.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=2,
                                   cache_batch_idx=torch.tensor([0, 2], dtype=torch.int32))
    with pytest.raises(ValueError, match="cache_leftpad: entry 0 is 3, outside"):
        fa.flash_attn_with_kvcache(q, kc, kc, cache_seqlens=2,
                                   cache_leftpad=torch.tensor([3, 0], dtype=torch.int32))
    with pytest.raises(ValueError, match="k_cache: holds 2 sequences but q has batch size 3"):
        fa.flash_attn_with_kvcache(rand(3, 1, 2, 8), kc, kc, cache_seqlens=2)
    with pytest.raises(ValueError, match="k, v: pass both"):
        fa.flash_attn_with_kvcache(q, kc, kc, knew, cache_seqlens=0)
    with pytest.raises(ValueError, match="rotary_cos: has 2 rows but position 2"):
        fa.flash_attn_with_kvcache(q, kc, kc.clone(), knew, knew, cache_seqlens=0,
                                   rotary_cos=torch.ones(2, 4), rotary_sin=torch.ones(2, 4))
    with pytest.raises(ValueError, match="rotary_cos: rotary_dim = 2 [*] 5 = 10 exceeds"):
        fa.flash_attn_with_kvcache(q, kc, kc, knew, knew, cache_seqlens=0,
                                   rotary_cos=torch.ones(8, 5), rotary_sin=torch.ones(8, 5))
    with pytest.raises(ValueError, match="rotary_cos, rotary_sin: pass both"):
        fa.flash_attn_with_kvcache(q, kc, kc, rotary_cos=torch.ones(8, 4))
    with pytest.raises(NotImplementedError, match="num_splits: 4"):
        fa.flash_attn_with_kvcache(q, kc, kc, num_splits=4)
    for kw, err, match in ((dict(softmax_scale=float("nan")), ValueError, "scale: nan"),
                           (dict(alibi_slopes=torch.ones(2, dtype=torch.int64)), TypeError,
                            "alibi_slopes: dtype int64")):
        with pytest.raises(err, match=match):           # refused by the core, before writing
            fa.flash_attn_with_kvcache(q, kc, kc.clone(), knew, knew, cache_seqlens=0, **kw)
    with pytest.raises(TypeError, match="k: has dtype torch.float64"):
        fa.flash_attn_with_kvcache(q, kc, kc, knew.double(), knew.double(), cache_seqlens=0)
    assert torch.equal(kc, snapshot)


def test_install_alias():
    import sys

    names = ("flash_attn", "flash_attn.flash_attn_interface", "flash_attn.bert_padding",
             "flash_attn.layers", "flash_attn.layers.rotary")
    saved = {n: sys.modules.pop(n, None) for n in names}
    try:
        fa.install()
        fa.install()                                                 # again: a no-op
        from flash_attn import flash_attn_func
        from flash_attn.bert_padding import index_first_axis, pad_input, unpad_input
        from flash_attn.flash_attn_interface import (USE_TRITON_ROCM, _get_block_size_n,
                                                     flash_attn_varlen_func)
        from flash_attn.layers.rotary import apply_rotary_emb

        assert flash_attn_func is fa.flash_attn_func
        assert flash_attn_varlen_func is fa.flash_attn_varlen_func
        assert apply_rotary_emb is fa.rotary.apply_rotary_emb
        assert (pad_input, unpad_input, index_first_axis) == (
            fa.bert_padding.pad_input, fa.bert_padding.unpad_input,
            fa.bert_padding.index_first_axis)
        assert USE_TRITON_ROCM is False
        assert [_get_block_size_n("cpu", d, drop, False)
                for d, drop in ((64, False), (64, True), (128, True), (128, False))] == [
            128, 64, 32, 64]
        sys.modules["flash_attn"] = type(sys)("flash_attn")          # another flash_attn
        with pytest.raises(ValueError, match="install: a module 'flash_attn' is already"):
            fa.install()
    finally:
        for n, m in saved.items():
            sys.modules.pop(n, None)
            if m is not None:
                sys.modules[n] = m


# ------------------------------------------------------------------------------ the GPU

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 2e-2)])
def test_cuda_func_and_varlen(dtype, tol):
    dev = "cuda"
    q = torch.randn(2, 70, 8, 64, device=dev, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 90, 2, 64, device=dev, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 90, 2, 64, device=dev, dtype=dtype, requires_grad=True)
    sl = torch.rand(8, device=dev)
    out = fa.flash_attn_func(q, k, v, causal=True, alibi_slopes=sl, window_size=(30, -1))
    ro, _ = ref_batch(q.cpu(), k.cpu(), v.cpu(), causal=True, slopes=sl.cpu(), window=(30, -1))
    close(out.cpu(), ro, tol)
    out.sum().backward()
    lq, lk = np.array([17, 0, 60, 33]), np.array([40, 5, 60, 2])
    qv = torch.randn(int(lq.sum()), 8, 64, device=dev, dtype=dtype)
    kv = torch.randn(int(lk.sum()), 2, 64, device=dev, dtype=dtype)
    out = fa.flash_attn_varlen_func(qv, kv, kv, _cu(lq).to(dev), _cu(lk).to(dev), 60, 60,
                                    causal=True)
    close(out.cpu(), ref_varlen(qv.cpu(), kv.cpu(), kv.cpu(), lq, lk, causal=True)[0], tol)
    kc = torch.zeros(2, 128, 2, 64, device=dev, dtype=dtype)
    out = fa.flash_attn_with_kvcache(q[:, :1].detach(), kc, kc.clone(), k[:, :5].detach(),
                                     v[:, :5].detach(), cache_seqlens=torch.tensor(
                                         [3, 100], dtype=torch.int32, device=dev), causal=True)
    assert out.shape == (2, 1, 8, 64) and torch.isfinite(out).all()


def test_varlen_without_sequences_and_kvcache_empty_keys():
    q = rand(0, 2, 8)
    cu = torch.tensor([0], dtype=torch.int32)
    out, lse, S = fa.flash_attn_varlen_func(q, q, q, cu, cu, 0, 0, causal=True,
                                            return_attn_probs=True)
    assert out.shape == (0, 2, 8) and lse.shape == (2, 0) and S.shape == (0, 2, 0, 0)
    kc = rand(1, 4, 2, 8)
    out, lse = fa.flash_attn_with_kvcache(rand(1, 2, 2, 8), kc, kc, cache_seqlens=0,
                                          return_softmax_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()


def test_varlen_layout_reused_for_the_same_lengths():
    """The layers of a step share cu_seqlens: one layout (ids, tile lists) serves them."""
    from anyattn.flash_attn.varlen import layout

    lq, lk = np.array([3, 0, 5]), np.array([4, 2, 5])
    a = layout(lq, lk, True, False, torch.device("cpu"))
    b = layout(lq.copy(), lk.copy(), True, False, torch.device("cpu"))
    assert a is b and a.kind == "slots"
    assert layout(lq, lk, False, False, torch.device("cpu")) is not a


def test_varlen_keys_not_copied_when_no_sequence_has_more_queries_than_keys():
    from anyattn.flash_attn.varlen import layout

    lq, lk = np.array([2, 0, 4, 1]), np.array([5, 3, 4, 6])
    lay = layout(lq, lk, True, False, torch.device("cpu"))
    assert lay.kind == "slots" and lay.k_rows is None and lay.q_rows is not None
    lay = layout(lk, lq, True, False, torch.device("cpu"))
    assert lay.q_rows is None and lay.k_rows is not None
    q, k = rand(int(lq.sum()), 2, 8, grad=True), rand(int(lk.sum()), 1, 8, grad=True)
    grads_vs_ref(lambda x, y: fa.flash_attn_varlen_func(x, y, y, _cu(lq), _cu(lk), 4, 6,
                                                        causal=True, window_size=(2, -1)),
                 lambda x, y: ref_varlen(x, y, y, lq, lk, causal=True, window=(2, -1))[0],
                 [q, k])
    qb, kb = rand(int(lk.sum()), 2, 8, grad=True), rand(int(lq.sum()), 1, 8, grad=True)
    grads_vs_ref(lambda x, y: fa.flash_attn_varlen_func(x, y, y, _cu(lk), _cu(lq), 6, 4,
                                                        causal=True),
                 lambda x, y: ref_varlen(x, y, y, lk, lq, causal=True)[0], [qb, kb])
