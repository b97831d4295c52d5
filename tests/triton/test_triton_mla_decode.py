"""Head dims above 256 on Triton: the forward of decoding shapes (the split-key kernel
with q.k summed over chunks of D and the value columns in chunks of Dv per program,
configs.wide_decode_config), e.g. DeepSeek's absorbed MLA decoding D = 576 / Dv = 512
with one latent kv head; and the refusals of everything else above 256 (backward,
Sq > 16, masks and features the split kernel lacks), before any work.

Shape legend: B batch, Hq / Hkv heads, Sq / Sk queries / keys, D / Dv head dims, P page
size.  Under the interpreter the split kernel's key tile is 16 and the route assumes
route.NO_GPU_SMS SMs, so one program per sequence over >= 128 keys splits the keys.
"""
from __future__ import annotations

import numpy as np
import pytest

from tr_util import HAS_CUDA, T, needs_triton, torch

import anyattn as aa
from anyattn.backends.triton import head_dims as TB
from anyattn.backends.triton import configs
from anyattn.backends.triton import launch as L
from anyattn.backends.triton import prepared
from anyattn.backends.triton import route as ROUTE

from helpers import assert_close

H100 = ROUTE.DeviceFacts("cuda", (9, 0), 132)


def _rounded(x, dtype):
    """float64 of x rounded to ``dtype`` (the reference's inputs)."""
    return torch.from_numpy(x).to(getattr(torch, dtype)).double().numpy()


@pytest.fixture
def poisoned():
    """torch.empty fills floats with NaN (torch's deterministic mode): every output and
    workspace element the kernels should write starts as NaN."""
    was = torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(was)
    torch.utils.deterministic.fill_uninitialized_memory = fill


def _pages(rng, lengths, P, Hkv, D, Dv):
    """A paged cache of the sequences' keys and values: k_pages [N, Hkv, P, D], v_pages
    [N, Hkv, P, Dv] float64 (a spare page first, pages of each sequence shuffled), the
    block table [B, M] int32, the lengths [B]."""
    M = max(-(-n // P) for n in lengths)
    N = 1 + len(lengths) * M
    order = rng.permutation(np.arange(1, N))
    table = order.reshape(len(lengths), M).astype(np.int32)
    k = rng.standard_normal((N, Hkv, P, D))
    v = rng.standard_normal((N, Hkv, P, Dv))
    return k, v, table, np.asarray(lengths, np.int64)


#: (id, D, Dv, dtype, B, Hq, Hkv, Sq, Sk (contiguous) or the lengths (paged), P (0:
#: contiguous), mask, options, splits of the contiguous forward)
CASES = [
    # MLA decoding: 8 query heads over one latent kv head, Sk 150: 2 key splits
    ("576-512-bf16-sq1", 576, 512, "bfloat16", 1, 8, 1, 1, 150, 0, None, {}, 2),
    ("576-512-fp32-sq4-causal-paged16", 576, 512, "float32", 2, 8, 1, 4, [70, 21], 16,
     aa.Causal(align="bottom_right"), {}, None),
    # an odd pair: the last value chunk partly padding (264 = 2 * 128 + 8)
    ("320-264-bf16-sq4-causal", 320, 264, "bfloat16", 1, 8, 1, 4, 140, 0,
     aa.Causal(align="bottom_right"), {}, 2),
    # pages of 5 positions (every key row looks its page up), the score modifiers, the
    # last q / k chunk partly padding (300 = 4 * 64 + 44)
    ("300-264-fp32-sq1-paged5-mods", 300, 264, "float32", 2, 4, 2, 1, [33, 12], 5,
     None, dict(softcap=5.0, alibi=True, sinks=True), None),
]


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_wide_decode_forward_matches_float64(case, poisoned):
    """out and lse of a head-dim > 256 decoding forward against float64 on the inputs
    rounded to the dtype, at the dtype's tolerance (DESIGN.md §4), every output
    element written (NaN-poisoned buffers), routed to the chunked split kernel."""
    name, D, Dv, dtype, B, Hq, Hkv, Sq, Sk, P, mask, opts, splits = case
    rng = np.random.default_rng(D + Dv + Sq + P)
    td = getattr(torch, dtype)
    q = rng.standard_normal((B, Hq, Sq, D))
    kw = dict(mask=mask, softcap=opts.get("softcap"))
    rkw = dict(kw)
    if opts.get("alibi"):
        slopes = (2.0 ** -np.arange(1, Hq + 1)).astype(np.float32)
        kw["alibi_slopes"], rkw["alibi_slopes"] = T(slopes), slopes
    if opts.get("sinks"):
        snk = rng.standard_normal(Hq).astype(np.float32)
        kw["sinks"], rkw["sinks"] = T(snk), snk
    if P:
        k, v, table, lengths = _pages(rng, Sk, P, Hkv, D, Dv)
        kw["pages"] = rkw["pages"] = aa.Pages(table, lengths)
    else:
        k = rng.standard_normal((B, Hkv, Sk, D))
        v = rng.standard_normal((B, Hkv, Sk, Dv))
    L.clear_prepared()
    out, lse = aa.attention(T(q, td), T(k, td), T(v, td), return_lse=True,
                            backend="triton", **kw)
    ro, rl = aa.attention(*(_rounded(x, dtype) for x in (q, k, v)), return_lse=True,
                          backend="reference", **rkw)
    assert out.dtype == td and tuple(out.shape) == (B, Hq, Sq, Dv)
    assert not torch.isnan(out).any() and not torch.isnan(lse).any()
    assert_close(out.float().cpu().numpy(), ro, dtype, "out")
    fin = np.isfinite(rl)
    np.testing.assert_array_equal(np.isfinite(lse.cpu().numpy()), fin)
    assert_close(lse.cpu().numpy()[fin], rl[fin], dtype, "lse")
    if not P:
        routes = [pr.route for pr in prepared.PREPARED._d.values()]
        assert [r.config.split("x")[-1] for r in routes] == [str(splits)], routes
        assert routes[0].config.startswith("wide-split") and routes[0].split.dc > 0


@needs_triton
def test_wide_decode_unsplit_equals_split(poisoned):
    """The same call with one key split (the grid fills the SMs) and with 2: the row
    max bitwise equal, log_norm to fp32 rounding, out within bf16's tolerance; a repeat
    of the split call is bitwise equal (every value chunk's program wrote its columns,
    the first its statistics)."""
    rng = np.random.default_rng(5)
    q, k, v = (T(rng.standard_normal(s), torch.bfloat16)
               for s in ((1, 4, 2, 320), (1, 1, 130, 320), (1, 1, 130, 264)))
    res = []
    saved = ROUTE.NO_GPU_SMS
    try:
        for sms in (1, saved, saved):
            ROUTE.NO_GPU_SMS = sms
            L.clear_prepared()
            res.append(aa.attention(q, k, v, return_lse=True, backend="triton"))
            res[-1] += ([pr.route.splits for pr in prepared.PREPARED._d.values()],)
    finally:
        ROUTE.NO_GPU_SMS = saved
        L.clear_prepared()
    (o1, l1, n1), (o2, l2, n2), (o3, l3, _) = res
    assert n1 == [1] and n2 == [2], (n1, n2)
    np.testing.assert_allclose(l2.numpy(), l1.numpy(), rtol=1e-6, atol=1e-6)
    assert_close(o2.float().numpy(), o1.double().numpy(), "bfloat16", "out")
    assert torch.equal(o2, o3) and torch.equal(l2, l3)


# ----------------------------------------------------------------------------- refusals
def _qkv(D=576, Dv=512, Sq=1, Sk=40, dtype=torch.bfloat16, grad=False):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(s, generator=g).to(dtype).requires_grad_(grad)
                 for s in ((1, 4, Sq, D), (1, 1, Sk, D), (1, 1, Sk, Dv)))


#: (id, call -> raises, phrases of the message)
REFUSALS = [
    ("backward", lambda q, k, v: aa.attention_backward(q, k, v, torch.ones_like(q[..., :512]),
                                                        wrt=("q", "k", "v"), backend="triton"),
     ("head dims above 256", "D = 576, Dv = 512", "a backward", "backend='numpy'")),
    ("sq17", lambda q, k, v: aa.attention(torch.cat([q] * 17, 2), k, v, backend="triton"),
     ("Sq = 17 queries", "Sq <= 16")),
    ("bias", lambda q, k, v: aa.attention(q, k, v, bias=torch.zeros(1, 1, 1, 40),
                                          backend="triton"), ("not with bias",)),
    ("documents", lambda q, k, v: aa.attention(
        q, k, v, mask=aa.Documents(torch.zeros(1, dtype=torch.int32),
                                   torch.zeros(40, dtype=torch.int32)), backend="triton"),
     ("a documents mask",)),
    ("dropout", lambda q, k, v: aa.attention(q, k, v, dropout_p=0.1, dropout_seed=1,
                                             backend="triton"), ("dropout",)),
    ("torch-autograd", lambda q, k, v: __import__("anyattn.torch", fromlist=["x"]).attention(
        q.detach().requires_grad_(True), k, v, backend="triton"), ("a backward",)),
]


@needs_triton
@pytest.mark.parametrize("case", REFUSALS, ids=[c[0] for c in REFUSALS])
def test_wide_refusals_name_the_supported_case(case, monkeypatch):
    """Above 256 everything but the decoding forward is refused with NotImplementedError
    by the capability check (head_dims.wide_refusal), before any kernel runs."""
    name, call, phrases = case
    monkeypatch.setattr(L, "forward", _no_work)
    monkeypatch.setattr(L, "backward", _no_work)
    with pytest.raises(NotImplementedError) as e:
        call(*_qkv())
    for phrase in phrases:
        assert phrase in str(e.value), (phrase, str(e.value))


def _no_work(*a, **kw):
    raise AssertionError("a kernel launch was reached")


@needs_triton
def test_head_dims_above_the_wide_bound_are_refused():
    q, k, v = _qkv(D=TB.WIDE_MAX_HEAD_DIM + 8, Dv=64)
    with pytest.raises(NotImplementedError, match=f"head_dim <= {TB.WIDE_MAX_HEAD_DIM}, "
                                                  f"got {TB.WIDE_MAX_HEAD_DIM + 8}"):
        aa.attention(q, k, v, backend="triton")


def test_wide_refusal_is_the_one_rule():
    """head_dims.wide_refusal: None at <= 256 or for a decoding forward, else every
    unsupported part named once."""
    ok = dict(head_dim=576, head_dim_v=512, seq_q=16, backward=False, mask_class="band",
              features=frozenset({"gqa", "value_dim", "band", "softcap", "alibi", "sinks",
                                  "paged_kv"}))
    assert TB.wide_refusal(**ok) is None
    assert TB.wide_refusal(**dict(ok, head_dim=256, head_dim_v=256, backward=True)) is None
    why = TB.wide_refusal(**dict(ok, head_dim=64, head_dim_v=264, seq_q=17, backward=True,
                                 mask_class="band+documents",
                                 features=frozenset({"bias", "documents", "bias_grad"})))
    assert why.count("a backward") == 1 and "Sq = 17" in why
    assert "a band+documents mask" in why and why.endswith("use backend='numpy' "
                                                           "(or 'reference') for it")
    assert "not with a backward and Sq = 17 queries and a band+documents mask and bias;" in why


# ----------------------------------------------------------------------------- the route
@pytest.fixture
def heuristic(monkeypatch):
    """The GPU's settings: no interpreter, no Triton switch set."""
    from anyattn import settings

    for switch in settings.SWITCHES:
        if switch.name.startswith(("ANYATTN_TRITON_", "TRITON_")):
            monkeypatch.delenv(switch.name, raising=False)


MLA = dict(batch=4, heads_q=16, heads_kv=1, seq_q=1, seq_k=4096, head_dim=576,
           head_dim_v=512, dtype="bfloat16")


#: (id, facts over MLA, splits, the config's name)
WIDE_ROUTES = [
    ("B4 Hq16 4k", {}, 32, "wide-split16x32w4s2d64v128x32"),
    ("Sq4: 64 rows", dict(seq_q=4), 32, "wide-split64x32w8s2d64v64x32"),
    ("Sq2: 32 rows", dict(seq_q=2), 32, "wide-split32x32w8s2d64v128x32"),
    # fp32: at most 32 rows (8 heads x Sq 4; route.WIDE_FP32_MAX_ROWS), 8 programs
    ("fp32 Sq4", dict(dtype="float32", seq_q=4), 32, "wide-split32x32w8s1d64v64x32"),
    ("B256 fills the SMs: one split", dict(batch=256), 1, "wide-split16x32w4s2d64v128x1"),
    ("odd dims", dict(head_dim=320, head_dim_v=264, heads_kv=2, seq_k=300), 2,
     "wide-split16x32w4s2d64v128x2"),
]


@pytest.mark.parametrize("case", WIDE_ROUTES, ids=[c[0] for c in WIDE_ROUTES])
def test_wide_route_table(case, heuristic):
    name, facts, splits, config = case
    problem = ROUTE.ProblemFacts(**dict(MLA, **facts))
    r = ROUTE.route(problem, "forward", H100)
    assert (r.path, r.splits, r.config) == ("portable", splits, config), r.describe()
    assert r.split.dc == configs.WIDE_DC and "above 256" in r.reasons[0]
    most = ROUTE.WIDE_FP32_MAX_ROWS if problem.dtype == "float32" else ROUTE.DECODE_MAX_ROWS
    assert r.pack * problem.seq_q <= min(most, r.split.bm)
    if splits == 1:
        assert "fill 132 SMs" in r.reasons[-1]
    pr = ROUTE.paged_route(problem, H100)
    assert (pr.splits, pr.split) == (r.splits, r.split)


def test_wide_route_refuses(heuristic, monkeypatch):
    problem = ROUTE.ProblemFacts(**MLA)
    with pytest.raises(NotImplementedError, match="a backward"):
        ROUTE.route(problem, "backward", H100)
    with pytest.raises(NotImplementedError, match="Sq = 17 queries"):
        ROUTE.route(ROUTE.ProblemFacts(**dict(MLA, seq_q=17)), "forward", H100)
    with pytest.raises(NotImplementedError, match="plan=None"):
        ROUTE.route(problem, "forward", H100, plan=configs.fixed_plan())
    monkeypatch.setenv("ANYATTN_TRITON_PATH", "hopper")
    with pytest.raises(NotImplementedError, match="does not cover head dims above 256"):
        ROUTE.route(problem, "forward", H100)


# ----------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("sq", [1, 4])
def test_gpu_mla_decode_matches_sdpa_math(dtype, sq):
    """B = 4, Hq = 16 over one latent kv head, a 4k cache, D = 576 / Dv = 512, causal
    bottom-right: anyattn.attention (contiguous cache) and
    flash_attn.flash_attn_with_kvcache (a paged cache of 256-position pages, ragged
    lengths) against SDPA's math backend in float64 on the same rounded inputs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from anyattn.flash_attn import flash_attn_with_kvcache

    B, Hq, Sk, D, Dv, P = 4, 16, 4096, 576, 512, 256
    td = getattr(torch, dtype)
    g = torch.Generator(device="cuda").manual_seed(sq)
    q = torch.randn(B, Hq, sq, D, device="cuda", generator=g).to(td)
    k = torch.randn(B, 1, Sk, D, device="cuda", generator=g).to(td)
    v = torch.randn(B, 1, Sk, Dv, device="cuda", generator=g).to(td)
    mask = torch.ones(sq, Sk, dtype=torch.bool, device="cuda").tril(Sk - sq)
    with sdpa_kernel(SDPBackend.MATH):
        ref = sdpa(q.double(), k.double().expand(B, Hq, Sk, D),
                   v.double().expand(B, Hq, Sk, Dv), attn_mask=mask)
    out = aa.attention(q, k, v, mask=aa.Causal(align="bottom_right"), backend="triton")
    assert_close(out.double().cpu().numpy(), ref.cpu().numpy(), dtype, "out")
    # the same keys as pages, the sequences cut to different lengths
    lengths = torch.tensor([Sk, Sk - 700, 1000, 17], dtype=torch.int32, device="cuda")
    M = Sk // P
    table = torch.randperm(B * M, device="cuda").to(torch.int32).view(B, M)
    kc = torch.empty(B * M, P, 1, D, dtype=td, device="cuda")
    vc = torch.empty(B * M, P, 1, Dv, dtype=td, device="cuda")
    kc[table.view(-1).long()] = k.transpose(1, 2).reshape(B * M, P, 1, D)
    vc[table.view(-1).long()] = v.transpose(1, 2).reshape(B * M, P, 1, Dv)
    got = flash_attn_with_kvcache(q.transpose(1, 2), kc, vc, cache_seqlens=lengths,
                                  block_table=table, causal=True).transpose(1, 2)
    for b, n in enumerate(lengths.tolist()):
        m = torch.ones(sq, n, dtype=torch.bool, device="cuda").tril(n - sq)
        with sdpa_kernel(SDPBackend.MATH):
            rb = sdpa(q[b:b + 1].double(), k[b:b + 1, :, :n].double().expand(1, Hq, n, D),
                      v[b:b + 1, :, :n].double().expand(1, Hq, n, Dv), attn_mask=m)
        assert_close(got[b:b + 1].double().cpu().numpy(), rb.cpu().numpy(), dtype,
                     f"paged out {b}")
