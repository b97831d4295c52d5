"""The split-key forward of decoding shapes (kernels.fwd_split_kernel + fwd_combine_kernel,
routed by route.decode_splits): out and lse against float64, the row statistics against
the unsplit kernel's, the backward after a split forward, determinism, and the route's
table of which shapes split and why.

Shape legend: B batch, Hq / Hkv heads, Sq / Sk queries / keys, D / Dv head dims.  Under
the interpreter the split kernel's key tile is 16 (configs.decode_config) and the route
assumes route.NO_GPU_SMS SMs, so B * Hq < 8 programs and Sk >= 128 split.
"""
from __future__ import annotations

import numpy as np
import pytest

from tr_util import T, needs_triton, torch

import anyattn as aa
from anyattn import settings
from anyattn.backends.triton import configs
from anyattn.backends.triton import launch as L
from anyattn.backends.triton import prepared
from anyattn.backends.triton import route as ROUTE
from anyattn.modifiers import ScoreMods
from anyattn.problem import describe

from helpers import assert_close, make_qkv

H100 = ROUTE.DeviceFacts("cuda", (9, 0), 132)


def _rounded(x, dtype):
    return torch.from_numpy(x).to(getattr(torch, dtype)).double().numpy()


def _forward_routes():
    """The routes of the forward launches prepared since the last clear."""
    return [pr.route for pr in prepared.PREPARED._d.values()
            if pr.route.direction == "forward"]


def _forward_splits():
    """The key-split counts of the forward launches prepared since the last clear."""
    return [r.splits for r in _forward_routes()]


def _mods(Hq, rng, alibi, sinks):
    slopes = (2.0 ** -np.arange(1, Hq + 1)).astype(np.float32) if alibi else None
    snk = rng.standard_normal(Hq).astype(np.float32) if sinks else None
    return slopes, snk


#: (id, dtype, B, Hq, Hkv, Sq, Sk, D, Dv, options, ALiBi?, sinks?, backward?)
CASES = [
    ("fp32-sq1-gqa-causal-br", "float32", 1, 4, 2, 1, 200, 16, 16,
     dict(mask=aa.Causal(align="bottom_right")), False, False, True),
    ("bf16-sq4-offsets-dv", "bfloat16", 1, 4, 1, 4, 150, 24, 40,
     dict(mask=aa.Causal(), q_offset=280, k_offset=150), False, False, True),
    # 8 query heads of one kv head: two programs of 4 heads x 16 queries (64 rows)
    ("fp16-sq16-window-softcap", "float16", 1, 8, 1, 16, 260, 32, 32,
     dict(mask=aa.Window(left=90, right=0, align="bottom_right"), softcap=4.0), False,
     False, False),
    ("bf16-sq1-alibi-sinks", "bfloat16", 1, 4, 2, 1, 181, 16, 16,
     dict(mask=aa.Causal(align="bottom_right")), True, True, True),
    ("fp32-sq4-softcap-alibi-sinks", "float32", 2, 2, 1, 4, 170, 16, 24,
     dict(softcap=3.0), True, True, False),
    # queries 0 and 1 keep no key (k_offset 2, causal top-left): out 0, lse -inf
    ("fp16-empty-rows", "float16", 1, 2, 1, 4, 140, 16, 16,
     dict(mask=aa.Causal(), k_offset=2), False, False, False),
]


@needs_triton
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_split_forward_matches_float64(case):
    """out, lse (and dq, dk, dv where flagged) of a split forward against float64 on the
    inputs rounded to the dtype, at the dtype's tolerance (DESIGN.md §4)."""
    name, dtype, B, Hq, Hkv, Sq, Sk, D, Dv, kw, alibi, sinks, backward = case
    rng = np.random.default_rng(len(name) * Sk)
    q, k, v, g = make_qkv(rng, B, Hq, Hkv, Sq, Sk, D, Dv=Dv)
    slopes, snk = _mods(Hq, rng, alibi, sinks)
    td = getattr(torch, dtype)
    ref = [_rounded(x, dtype) for x in (q, k, v, g)]
    extra = dict(kw, alibi_slopes=None if slopes is None else T(slopes),
                 sinks=None if snk is None else T(snk))
    rextra = dict(kw, alibi_slopes=slopes, sinks=snk)
    L.clear_prepared()
    out, lse = aa.attention(T(q, td), T(k, td), T(v, td), return_lse=True,
                            backend="triton", **extra)
    splits = _forward_splits()
    assert splits and min(splits) > 1, splits
    # GQA packing: every query head of a kv head in one program (two programs of 4 at G 8)
    assert [r.pack for r in _forward_routes()] == [min(Hq // Hkv, 64 // Sq)]
    ro, rl = aa.attention(*ref[:3], return_lse=True, backend="reference", **rextra)
    assert out.dtype == td and tuple(out.shape) == ro.shape
    assert_close(out.float().cpu().numpy(), ro, dtype, "out")
    fin = np.isfinite(rl)
    np.testing.assert_array_equal(np.isfinite(lse.cpu().numpy()), fin)
    assert_close(lse.cpu().numpy()[fin], rl[fin], dtype, "lse")
    if name == "fp16-empty-rows":
        assert not fin.all() and fin.any()
        np.testing.assert_array_equal(out.float().cpu().numpy()[~fin], 0.0)
    if not backward:
        return
    wrt = ("q", "k", "v") + (("sinks",) if sinks else ())
    L.clear_prepared()
    gr = aa.attention_backward(T(q, td), T(k, td), T(v, td), T(g, td), wrt=wrt,
                               backend="triton", **extra)
    assert min(_forward_splits()) > 1        # the gradients used the split forward's stats
    rg = aa.attention_backward(*ref, wrt=wrt, backend="reference", **rextra)
    for n in ("dq", "dk", "dv", "dsinks"):
        want = getattr(rg, n)
        if want is not None:
            assert_close(getattr(gr, n).float().cpu().numpy(), want, dtype, n)


def _launch(dtype, sms, seed=0, **kw):
    """(out, RowStats, forward splits) of one forward through the launch code, with the
    route assuming ``sms`` SMs (1: every grid fills them, the unsplit kernel)."""
    rng = np.random.default_rng(seed)
    Hq = 2
    q, k, v, _ = make_qkv(rng, 1, Hq, 1, 3, 230, 16, Dv=24)
    td = getattr(torch, dtype)
    q, k, v = T(q, td), T(k, td), T(v, td)
    slopes, snk = _mods(Hq, rng, True, True)
    mods = ScoreMods(alibi_slopes=T(slopes), sinks=T(snk))
    p = describe(q, k, v, alibi_slopes=mods.alibi_slopes, sinks=mods.sinks, **kw)
    saved = ROUTE.NO_GPU_SMS
    try:
        ROUTE.NO_GPU_SMS = sms
        L.clear_prepared()
        out, stats = L.forward(p, q, k, v, None, mods=mods)
        return out, stats, _forward_splits()
    finally:
        ROUTE.NO_GPU_SMS = saved
        L.clear_prepared()


@needs_triton
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_split_statistics_equal_the_unsplit_kernels(dtype):
    """The same call split and unsplit: the row max bitwise equal (both are the largest
    fl(q.k * scale) of the row, sink folded in), log_norm to fp32 rounding of the
    different summation order, out within the dtype's tolerance; two split runs are
    bitwise equal."""
    kw = dict(mask=aa.Window(left=150, right=0, align="bottom_right"), softcap=6.0)
    o1, s1, n1 = _launch(dtype, 1, **kw)
    o2, s2, n2 = _launch(dtype, ROUTE.NO_GPU_SMS, **kw)
    o3, s3, _ = _launch(dtype, ROUTE.NO_GPU_SMS, **kw)
    assert n1 == [1] and n2[0] > 2, (n1, n2)
    assert torch.equal(s1.max, s2.max)
    np.testing.assert_allclose(s2.log_norm.cpu().numpy(), s1.log_norm.cpu().numpy(),
                               rtol=1e-6, atol=1e-6)
    assert_close(o2.float().cpu().numpy(), o1.double().cpu().numpy(), dtype, "out")
    assert torch.equal(o2, o3) and torch.equal(s2.max, s3.max)
    assert torch.equal(s2.log_norm, s3.log_norm)


# ----------------------------------------------------------------------------- the route
@pytest.fixture
def heuristic(monkeypatch):
    """The GPU's settings: no interpreter, no Triton switch set."""
    for switch in settings.SWITCHES:
        if switch.name.startswith(("ANYATTN_TRITON_", "TRITON_")):
            monkeypatch.delenv(switch.name, raising=False)


DECODE = dict(batch=1, heads_q=32, heads_kv=8, seq_q=1, seq_k=32768, head_dim=128,
              dtype="bfloat16")

#: (id, facts over DECODE, ANYATTN_TRITON_PATH, forward's splits, a phrase of its reason)
ROUTES = [
    ("B1 32k", {}, "auto", 33, "8 programs (4 query heads x Sq 1 rows each) < 132 SMs"),
    ("B8 32k", dict(batch=8), "auto", 5, "64 programs (4 query heads x Sq 1 rows each)"),
    ("B4 Sq16 causal", dict(batch=4, seq_q=16, mask_class="band"), "auto", 9,
     "32 programs (4 query heads x Sq 16 rows each) < 132 SMs"),
    ("G32 Sq4", dict(heads_kv=1, seq_q=4), "auto", 128,
     "2 programs (16 query heads x Sq 4 rows each) < 132 SMs"),
    ("B4 4k softcap alibi sinks", dict(batch=4, seq_k=4096,
                                       features=frozenset({"softcap", "alibi", "sinks"})),
     "portable", 9, "32 programs (4 query heads"),
    ("long cache, many splits", dict(seq_k=131072, heads_q=1, heads_kv=1), "auto", 128,
     "1 programs (1 query heads x Sq 1 rows each) < 132 SMs"),
    ("B32 fills the SMs", dict(batch=32), "auto", 1, "256 programs (4 query heads x Sq 1 "
     "rows each) fill 132 SMs"),
    ("Sq 17", dict(seq_q=17), "auto", 1, None),
    ("Sq 0", dict(seq_q=0), "auto", 1, "an empty problem"),
    ("short cache", dict(seq_k=256), "auto", 1, "fewer than 2 splits"),
    ("dropout", dict(features=frozenset({"dropout"})), "auto", 1, "lacks dropout"),
    ("bias", dict(features=frozenset({"bias"})), "auto", 1, "lacks bias"),
    ("documents", dict(mask_class="documents"), "auto", 1, "mask class documents"),
    ("PATH=hopper", {}, "hopper", 1, "ANYATTN_TRITON_PATH=hopper"),
]


@pytest.mark.parametrize("case", ROUTES, ids=[c[0] for c in ROUTES])
def test_decode_split_route_table(case, heuristic, monkeypatch):
    name, facts, path, want, phrase = case
    monkeypatch.setenv("ANYATTN_TRITON_PATH", path)
    problem = ROUTE.ProblemFacts(**dict(DECODE, **facts))
    fwd = ROUTE.route(problem, "forward", H100)
    assert fwd.splits == want, fwd.describe()
    if want > 1:
        rows = fwd.pack * problem.seq_q
        assert fwd.path == "portable" and fwd.split == configs.decode_config(128, "bfloat16",
                                                                             rows)
        assert fwd.config == f"split{fwd.split.bm}x64w4s3x{want}"
        assert rows <= fwd.split.bm <= max(16, 2 * rows)
    if phrase is None:
        assert not any(r.startswith("split") for r in fwd.reasons)
    else:
        assert any(r.startswith("split") and phrase in r for r in fwd.reasons), fwd.reasons
    bwd = ROUTE.route(problem, "backward", H100)
    assert bwd.splits == 1 and not any(r.startswith("split") for r in bwd.reasons)


def test_decode_split_count_fills_about_two_waves(heuristic):
    """NS = cdiv(DECODE_WAVES * SMs, programs), capped so each split keeps
    >= DECODE_MIN_TILES key tiles; an explicit plan keeps the unsplit kernel; HP the
    largest divisor of the group with HP * Sq <= DECODE_MAX_ROWS."""
    for batch, sk, want in ((1, 32768, 33), (2, 32768, 17), (1, 1024, 4), (1, 512, 2)):
        problem = ROUTE.ProblemFacts(**dict(DECODE, batch=batch, seq_k=sk))
        assert ROUTE.decode_splits(problem, H100)[0] == want, (batch, sk)
    problem = ROUTE.ProblemFacts(**DECODE)
    explicit = ROUTE.route(problem, "forward", H100, plan=configs.fixed_plan())
    assert explicit.splits == 1 and "explicit plan" in explicit.reasons[-1]
    assert [ROUTE.decode_pack(g, sq) for g, sq in ((4, 1), (8, 16), (6, 16), (32, 4),
                                                     (1, 16), (7, 16))] == [4, 4, 3, 16, 1, 1]


def test_info_route_prints_the_split(capsys, heuristic):
    """``python -m anyattn info --route``: the split forward's config and reason."""
    from anyattn.cli import main

    assert main(["info", "--route", "1,32,8,1,32768,128", "--cc", "9.0"]) == 0
    text = capsys.readouterr().out
    assert "forward: portable split16x64w4s3x33" in text
    assert "split: 33 key splits (B*Hkv*G/HP = 8 programs (4 query heads x Sq 1 rows each)" \
        " < 132 SMs" in text
