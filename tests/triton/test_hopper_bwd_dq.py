"""The warp-specialised Hopper backward with dQ inside (hopper/bwd_ws_dq_kernel.py, configs
'wdkdvq…'; 'h': one partial per key tile, the column split; 't': its transposed consumers,
hopper/bwd_ws_t_kernel.py): config rules and the offline sm_90a compile (CPU), dq / dk /
dv against float64 with both add orders on a long key-tile chain, and the split configs
with a band and empty rows in fp16 (sm_90 GPUs only; the contract grid runs 'n' too,
tests/triton/test_hopper.py::test_backward_matches_float64).

Shape legend: B batch, H / Hkv heads, Sq / Sk queries / keys, D head dim.
"""
from __future__ import annotations

import dataclasses
import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import anyattn as aa  # noqa: E402
from anyattn.problem import describe  # noqa: E402
from anyattn.backends.triton.hopper import configs as HCF  # noqa: E402

from helpers import assert_close  # noqa: E402

from tr_util import HAS_GLUON, bwd_gpu_inputs, needs_gluon, needs_sm90, offline_facts  # noqa: E402


def test_ws_dq_configs_are_data():
    """Names, the rules of the ws kernel with dq, shared memory within an H100 / H200's."""
    c = HCF.HopperBwdConfig(128, 64, 2, ws=True, dq=True)
    assert c.name == "wdkdvq128x64s2"
    assert HCF.HopperBwdConfig(128, 64, 2, ws=True, dq=True, prefetch=False).name == \
        "wdkdvq128x64s2n"
    assert c.smem_bytes(128) == 2 * 128 * (2 * 128 + 2 * 2 * 64) + 2 * 2 * 64 * 128 \
        + 2 * 4 * 64 * 128
    with pytest.raises(ValueError, match="dq=False"):
        HCF.HopperBwdConfig(128, 64, 2, ws=True, dq=True, pingpong=True)
    with pytest.raises(ValueError, match="prefetch"):
        HCF.HopperBwdConfig(128, 64, 2, ws=True, prefetch=False)
    with pytest.raises(ValueError, match="chains"):
        HCF.HopperBwdConfig(128, 64, 2, ws=True, chains=2)
    assert HCF.HopperBwdConfig(128, 64, 2, ws=True, dq=True, prefetch=False,
                               chains=2).name == "wdkdvq128x64s2nc2"
    h = HCF.HopperBwdConfig(128, 64, 2, ws=True, dq=True, prefetch=False, split=True)
    assert h.name == "wdkdvq128x64s2nh"
    # one [bm, D / 2] fp32 staging buffer a consumer, dS double-buffered
    assert h.smem_bytes(128) == 2 * 128 * (2 * 128 + 2 * 2 * 64) + 3 * 2 * 64 * 128 \
        + 2 * 4 * 64 * 64
    lag = HCF.HopperBwdConfig(128, 64, 2, ws=True, dq=True, prefetch=False, split=True,
                              lag=True)
    assert lag.name == "wdkdvq128x64s2nhl"
    assert lag.smem_bytes(128) == h.smem_bytes(128) + 2 * 64 * 128     # a third dS slot
    with pytest.raises(ValueError, match="lag"):
        HCF.HopperBwdConfig(128, 64, 2, ws=True, dq=True, lag=True)
    for bad in (dict(chains=2), dict(dq=False, prefetch=True)):
        with pytest.raises(ValueError, match="split"):
            HCF.HopperBwdConfig(128, 64, 2, ws=True, **{"dq": True, "prefetch": False,
                                                        "split": True, **bad})
    t = HCF.HopperBwdConfig(128, 64, 2, ws=True, dq=True, prefetch=False, split=True,
                            trans=True)
    assert t.name == "wdkdvq128x64s2nht"
    # no P buffers; the queries' statistics staged in shared memory (3 x 4 x bm fp32)
    assert t.smem_bytes(128) == h.smem_bytes(128) - 2 * 64 * 128 + 48 * 64
    for bad in (dict(split=False), dict(lag=True)):
        with pytest.raises(ValueError, match="trans"):
            HCF.HopperBwdConfig(128, 64, 2, ws=True, dq=True, prefetch=False,
                                **{"split": True, "trans": True, **bad})
    # session 10: query tiles of 128 rows for the transposed consumers (D=64)
    t128 = dataclasses.replace(t, bm=128)
    assert t128.name == "wdkdvq128x128s2nht"
    assert t128.smem_bytes(64) <= 227 * 1024
    with pytest.raises(ValueError, match="bm 64"):
        dataclasses.replace(t128, trans=False)
    assert HCF.WS_DQT_BWD_VARIANTS[64] == [t, t128, dataclasses.replace(t, stats=True),
                                           dataclasses.replace(t128, stats=True)]
    for d in (64, 128):
        assert HCF.WS_DQT_BWD_VARIANTS[d][0] == t
        assert HCF.WS_DQ_BWD_VARIANTS[d][1] in HCF.BWD_VARIANTS[d]   # the contract grid's
        assert HCF.WS_DQS_BWD_VARIANTS[d][0] == h
        for cfg in (HCF.WS_DQ_BWD_VARIANTS[d] + HCF.WS_DQS_BWD_VARIANTS[d]
                    + HCF.WS_DQT_BWD_VARIANTS[d]):
            assert cfg.ws and cfg.dq
            assert cfg.smem_bytes(d) <= 227 * 1024, cfg.name


def test_staged_statistics_and_swizzle_configs_are_data():
    """Session 11's options of 'nh': 'r' (the producer stages the row statistics in shared
    memory, 4 fp32 rows a stage) and 'z' (the dQ staging buffers swizzled at 32 bytes);
    both refused where they do not apply."""
    h = HCF.WS_DQS_BWD_VARIANTS[128][0]
    r, z, rz, rq = HCF.WS_DQR_BWD_VARIANTS[128]
    assert (r.name, z.name, rz.name, rq.name) == (
        "wdkdvq128x64s2nhr", "wdkdvq128x64s2nhz", "wdkdvq128x64s2nhrz", "wdkdvq128x64s2nhrq")
    assert [c.name for c in HCF.WS_DQR_BWD_VARIANTS[64]][3:] == [
        "wdkdvq128x64s3nhr", "wdkdvq128x64s2nhrq", "wdkdvq128x64s3nhrq"]
    # the routes (session 12: 'r' with the interleaved staging rows 'i'; without a mask
    # the writer's late release 'e' too)
    assert HCF.bwd_config(128) == dataclasses.replace(r, dq_interleave=True)
    assert HCF.bwd_config(128, "none") == dataclasses.replace(r, dq_interleave=True,
                                                              late_release=True)
    assert HCF.bwd_config(64, "band").name == "wdkdvq128x128s2nhtri"
    assert HCF.bwd_config(64, "none").name == "wdkdvq128x128s2nhtrie"
    assert r.smem_bytes(128) == h.smem_bytes(128) + 16 * 2 * 64
    assert z.smem_bytes(128) == h.smem_bytes(128)
    for d in (64, 128):
        for cfg in HCF.WS_DQR_BWD_VARIANTS[d]:
            assert cfg.smem_bytes(d) <= 227 * 1024, cfg.name
    with pytest.raises(ValueError, match="stats"):
        dataclasses.replace(h, prefetch=True, stats=True)
    # the transposed consumers: one producer-staged copy instead of each consumer's two
    tr = dataclasses.replace(HCF.WS_DQT_BWD_VARIANTS[128][0], stats=True)
    assert tr.name == "wdkdvq128x64s2nhtr"
    assert tr.smem_bytes(128) == HCF.WS_DQT_BWD_VARIANTS[128][0].smem_bytes(128) \
        + 16 * 2 * 64 - 48 * 64
    with pytest.raises(ValueError, match="dq_swizzle"):
        dataclasses.replace(h, dq_swizzle=64)
    with pytest.raises(ValueError, match="dq_swizzle"):
        HCF.HopperBwdConfig(128, 64, 2, ws=True, dq_swizzle=32)
    for bad in (dict(lag=True), dict(trans=True), dict(split=False)):
        with pytest.raises(ValueError, match="dq_first"):
            dataclasses.replace(h, dq_first=True, **bad)


def test_interleaved_staging_configs_are_data():
    """Session 12's 'i' (HopperBwdConfig.dq_interleave): the routed dQ-inside configs with
    the staging rows interleaved, the same shared memory; refused without dq or at a
    32-byte swizzle; its accumulator descriptor is the 5-D view that swaps the row
    bits (launch.dqa_desc).  'e' (late_release) on top, refused without split."""
    from anyattn.backends.triton.hopper import launch as HL

    i128, e128, ti128, te128 = HCF.WS_DQI_BWD_VARIANTS[128]
    assert (ti128.name, te128.name) == ("wdkdvq128x64s2nhtri", "wdkdvq128x64s2nhtrie")
    i64, e64 = HCF.WS_DQI_BWD_VARIANTS[64]
    assert (e128, e64) == (dataclasses.replace(i128, late_release=True),
                           dataclasses.replace(i64, late_release=True))
    assert (e128.name, e64.name) == ("wdkdvq128x64s2nhrie", "wdkdvq128x128s2nhtrie")
    with pytest.raises(ValueError, match="late_release"):
        dataclasses.replace(i128, split=False, dq_interleave=False, late_release=True)
    assert i128 == HCF.bwd_config(128) == dataclasses.replace(
        HCF.WS_DQR_BWD_VARIANTS[128][0], dq_interleave=True)             # routed (session 12)
    assert i64 == HCF.bwd_config(64, "band") == \
        dataclasses.replace(HCF.WS_DQT_BWD_VARIANTS[64][3], dq_interleave=True)
    assert (HCF.bwd_config(128, "none"), HCF.bwd_config(64, "none")) == (e128, e64)
    assert (i128.name, i64.name) == ("wdkdvq128x64s2nhri", "wdkdvq128x128s2nhtri")
    for d, c in ((128, i128), (64, i64)):
        assert c.smem_bytes(d) == dataclasses.replace(c, dq_interleave=False).smem_bytes(d)
    with pytest.raises(ValueError, match="dq_interleave"):
        dataclasses.replace(i128, dq_swizzle=32)
    with pytest.raises(ValueError, match="dq_interleave"):
        HCF.HopperBwdConfig(128, 64, 2, ws=True, dq_interleave=True)
    for bad in (dict(lag=True), dict(split=False)):   # forms not checked on a GPU
        with pytest.raises(ValueError, match="dq_interleave"):
            dataclasses.replace(i128, late_release=False, **bad)
    if not HAS_GLUON:
        return
    acc = torch.zeros((3, 200, 128), dtype=torch.float32)
    d = HL.dqa_desc(acc, 64, 64, 128, True)
    assert list(d.shape) == [3, 25, 4, 2, 128]
    assert list(d.strides) == [200 * 128, 8 * 128, 128, 4 * 128, 1]
    assert list(d.block_shape) == [1, 8, 4, 2, 64]
    # (g, b0, b1) -> the accumulator's row 8 g + 4 b1 + b0
    g, b0, b1 = 5, 3, 1
    assert g * d.strides[1] + b0 * d.strides[2] + b1 * d.strides[3] == (8 * g + 4 * b1 + b0) * 128
    with pytest.raises(ValueError, match="multiples of 8"):
        HL.dqa_desc(torch.zeros((1, 100, 64), dtype=torch.float32), 64, 32, 128, True)


@needs_gluon
@pytest.mark.parametrize("name", ["wdkdvq128x64s2nhri", "wdkdvq128x128s2nhtri"])
def test_interleaved_staging_compiles_for_sm90a(name):
    """Offline sm_90a: 'i' keeps its base config's shared memory, HGMMA, 8-byte staging
    stores and bulk reduce-adds (the 5-D box: as many), and adds no spill over it."""
    D = 128 if "x64" in name else 64
    setup = ("import dataclasses\n"
             f"cfg = next(c for c in HCF.WS_DQI_BWD_VARIANTS[{D}] if c.name == {name!r})\n"
             "base = dataclasses.replace(cfg, dq_interleave=False)")
    f = offline_facts(f"BO.compile_dkdvq_ws('bfloat16', {D}, False, cfg)", setup)
    fb = offline_facts(f"BO.compile_dkdvq_ws('bfloat16', {D}, False, base)", setup)
    # the same buffers (but their alignment): within a KB of the config's count
    assert f["shared"] <= fb["shared"] + 1024 and f["shared"] <= HCF.WS_DQI_BWD_VARIANTS[D][
        0].smem_bytes(D) + 1024, (f["shared"], fb["shared"])
    if not f["sass"]:
        return
    assert f["sass_HGMMA"] == fb["sass_HGMMA"]
    n_red = lambda s: len(re.findall(r"\bUTMAREDG", s))  # noqa: E731
    assert n_red(f["sass"]) == n_red(fb["sass"]) > 0
    n_sts64 = lambda s: len(re.findall(r"\bSTS\.64\b", s))  # noqa: E731
    assert n_sts64(f["sass"]) == n_sts64(fb["sass"])
    assert f["sass_STL"] <= fb["sass_STL"] and f["sass_LDL"] <= fb["sass_LDL"], f


@needs_gluon
@pytest.mark.parametrize("D", [128, 64])
def test_late_release_compiles_for_sm90a(D):
    """Offline sm_90a: 'e' (the writer's late release) changes the writer warp only: the
    consumers' HGMMA and staging stores as in 'i'; the writer still issues reduce-adds."""
    setup = ("import dataclasses\n"
             f"cfg = HCF.WS_DQI_BWD_VARIANTS[{D}][1]\n"
             "base = dataclasses.replace(cfg, late_release=False)")
    f = offline_facts(f"BO.compile_dkdvq_ws('bfloat16', {D}, False, cfg)", setup)
    fb = offline_facts(f"BO.compile_dkdvq_ws('bfloat16', {D}, False, base)", setup)
    assert f["shared"] <= fb["shared"] + 1024, (f["shared"], fb["shared"])
    if not f["sass"]:
        return
    assert f["sass_HGMMA"] == fb["sass_HGMMA"]
    n = lambda pat, x: len(re.findall(pat, x["sass"]))  # noqa: E731
    assert n(r"\bSTS\.64\b", f) == n(r"\bSTS\.64\b", fb)
    # the writer's adds (ptxas may peel its first tile: more copies of the same adds)
    assert n(r"\bUTMAREDG", f) >= n(r"\bUTMAREDG", fb) > 0


@needs_gluon
@pytest.mark.parametrize("name", ["wdkdvq128x64s2nhr", "wdkdvq128x64s2nhrz",
                                  "wdkdvq128x64s2nhrq"])
def test_staged_statistics_compile_for_sm90a(name):
    """Offline sm_90a, D=128: 'nh''s 64 HGMMA; the consumers read the row statistics from
    shared memory (LDS) and load nothing from global memory in their loops (the
    producer's loop does: its LDG); 'z' issues 8-column reduce-adds (16 UTMAREDG, 'nh' 4)."""
    cfg = next(c for c in HCF.WS_DQR_BWD_VARIANTS[128] if c.name == name)
    f = offline_facts("BO.compile_dkdvq_ws('bfloat16', 128, False, cfg)",
                      f"cfg = next(c for c in HCF.WS_DQR_BWD_VARIANTS[128] if c.name == {name!r})")
    assert f["shared"] <= cfg.smem_bytes(128) + 1024, f["shared"]
    sass = f["sass"]
    if not sass:
        return
    assert f["sass_HGMMA"] == 64 and f["sass_HMMA"] == 0, f
    assert len(re.findall(r"\bUTMAREDG", sass)) == (16 if cfg.dq_swizzle == 32 else 4)
    ins = re.findall(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass)
    loops = []       # (head, back edge) of the loops with the consumers' 32 HGMMA
    for a, t in ins:
        m = re.search(r"\bBRA (0x[0-9a-f]+)", t)
        if m and int(m.group(1), 16) < int(a, 16):
            body = [x for aa, x in ins if int(m.group(1), 16) <= int(aa, 16) <= int(a, 16)]
            if sum("HGMMA" in x for x in body) == 32 and len(body) < 1000:
                loops.append(body)
    assert len(loops) >= 2, [len(b) for b in loops]
    for body in sorted(loops, key=len)[:2]:     # the two consumers' innermost loops
        assert any(re.search(r"\bLDS", x) for x in body)
        assert not any(re.search(r"\bLDG", x) for x in body), "a global load in a consumer loop"


def test_dkdv_refuses_a_dq_config():
    """dkdv() computes dk / dv only: a config with dq is refused, not half run."""
    from anyattn.backends.triton.hopper import launch as HL

    q = torch.zeros(1, 1, 64, 128, dtype=torch.bfloat16)
    p = describe(q, q, q)
    with pytest.raises(ValueError, match="backward_fused"):
        HL.dkdv(p, q, q, q, q, None, None, cfg=HCF.WS_DQ_BWD_VARIANTS[128][0])


@needs_gluon
def test_ws_dq_compiles_for_sm90a():
    """Offline sm_90a: two consumers of S, dP (64x64), dV, dK and dQ (64xD) each: at D=64
    40 HGMMA; the writer's bulk reduce-adds (UTMAREDG); setmaxnreg; no HMMA fallback; the
    shared memory of the four staged buffers within 227 KB; few spills (8 stack bytes at
    D=64 with a band, 2026-12-04)."""
    f = offline_facts("BO.compile_dkdvq_ws('bfloat16', 64, True, HCF.WS_DQ_BWD_VARIANTS[64][1])")
    assert f["ptx_setmaxnreg"] > 0 and f["ptx_tma_load"] > 0, f
    assert f["shared"] <= 227 * 1024, f["shared"]
    sass = f["sass"]
    if sass:
        assert f["sass_HGMMA"] == 40 and f["sass_HMMA"] == 0, f
        assert re.search(r"\bUTMAREDG", sass), "no bulk reduce-add"
        assert f["stack_bytes"] <= 32, f


@needs_gluon
@pytest.mark.parametrize("D,band,name,hgmma,stack", [
    (128, False, "wdkdvq128x64s2nh", 64, 192), (64, True, "wdkdvq128x64s2nh", 48, 0),
    (128, False, "wdkdvq128x64s2nhl", 80, 192), (128, True, "wdkdvq128x64s2nht", 64, 256),
    (64, True, "wdkdvq128x64s2nht", 48, 0), (64, False, "wdkdvq128x128s2nht", 80, 96),
    (64, True, "wdkdvq128x128s2nht", 80, 96)])
def test_ws_dq_split_compiles_for_sm90a(D, band, name, hgmma, stack):
    """Offline sm_90a, one partial per key tile ('nh', 'nhl'; 't': the transposed
    consumers, bwd_ws_t_kernel): per consumer S (S^T), dP (dP^T), dV, dK and two dQ
    products of [BM, D / 2] (dS_0 . K_0 and dS_1 . K_1 on its column half; 'nhl' issues
    the last tile's after the loop: 8 more at D=128); the writer's reduce-adds; shared
    memory as configs.smem_bytes says (2026-12-04: 'nh' 213,536 B at D=128 vs the
    two-partial kernel's 229,896; 'nht' 200,256); no spills at D=64, few at D=128 (104 /
    160 stack bytes; 'nht' 120-136)."""
    cfg = next(c for c in HCF.WS_DQS_BWD_VARIANTS[D] + HCF.WS_DQT_BWD_VARIANTS[D]
               if c.name == name)
    f = offline_facts(f"BO.compile_dkdvq_ws('bfloat16', {D}, {band}, cfg)",
                      f"cfg = next(c for c in HCF.WS_DQS_BWD_VARIANTS[{D}] + "
                      f"HCF.WS_DQT_BWD_VARIANTS[{D}] if c.name == {name!r})")
    assert f["ptx_setmaxnreg"] > 0 and f["ptx_tma_load"] > 0, f
    assert f["shared"] <= cfg.smem_bytes(D) + 1024, (f["shared"], cfg.smem_bytes(D))
    sass = f["sass"]
    if sass:
        assert f["sass_HGMMA"] == hgmma and f["sass_HMMA"] == 0, f
        assert re.search(r"\bUTMAREDG", sass), "no bulk reduce-add"
        assert f["stack_bytes"] <= stack, f


# ----------------------------------------------------------------------------- GPU
#: the GPU cases: (B, H, Hkv, Sq, Sk, dtype, mask, seed, the config lists)
_GPU_CASES = {
    # many key tiles per query tile (Sk 3000: 24 key tiles, 16 query tiles), GQA 2
    "long-none": (1, 4, 2, 1000, 3000, "bfloat16", None, 11, "all"),
    "long-causal": (1, 4, 2, 1000, 3000, "bfloat16", "causal_br", 11, "all"),
    # a bottom-right causal band over Sq 300 > Sk 200 (empty rows), GQA 2, fp16
    "band-empty-rows-fp16": (2, 4, 2, 300, 200, "float16", "causal_br", 12, "split"),
}


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("case", list(_GPU_CASES))
def test_ws_dq_against_float64(D, case):
    """dq / dk / dv of the ws dq configs within the dtype's tolerance of float64 into
    NaN-poisoned buffers, with the rotated add order (1) and the ascending one (0), each
    bitwise repeatable: every config (two partials, split 'h' / 'l', transposed 't') on
    the long chains, the split ones with the band and empty rows, and there dk / dv alone
    too (want_dq=False: the same consumers without dq, bwd_ws_kernel)."""
    from anyattn.backends.triton.hopper import launch as HL

    B, H, Hkv, Sq, Sk, dt, kind, seed, which = _GPU_CASES[case]
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(B, h, s, D, device="cuda", generator=g).to(getattr(torch, dt))
               for h, s in ((H, Sq), (Hkv, Sk), (Hkv, Sk)))
    mask = aa.Causal(align="bottom_right") if kind == "causal_br" else None
    p, dout, l2, delta, rg = bwd_gpu_inputs(q, k, v, mask, g)
    nan = lambda x: torch.full_like(x.contiguous(), float("nan"))  # noqa: E731
    cfgs = (HCF.WS_DQS_BWD_VARIANTS[D] + HCF.WS_DQT_BWD_VARIANTS[D]
            + HCF.WS_DQR_BWD_VARIANTS[D] + HCF.WS_DQI_BWD_VARIANTS[D])
    if which == "all":
        cfgs = HCF.WS_DQ_BWD_VARIANTS[D] + cfgs
    nh = {}       # (config name, order) -> the results of each base config
    for cfg in cfgs:
        for order in (1, 0):
            runs = [HL.backward_fused(p, q, k, v, dout, l2, delta, nan(q), nan(k), nan(v),
                                      cfg=cfg, order=order) for _ in range(2)]
            for i, n in enumerate(("dq", "dk", "dv")):
                assert torch.equal(runs[0][i], runs[1][i]), f"{n} {cfg.name} order {order}"
                assert_close(runs[0][i], getattr(rg, n), dt, f"{n} {cfg.name} order {order}")
            base = dataclasses.replace(cfg, stats=False, dq_swizzle=128, dq_first=False,
                                       stages=2, dq_interleave=False, late_release=False)
            if cfg == base:
                nh[(cfg.name, order)] = runs[0]
            else:   # 'r' / 'z' / 'q' / 'i' / 'e' / 3 stages: the same bits as without them
                for i, n in enumerate(("dq", "dk", "dv")):
                    assert torch.equal(runs[0][i], nh[(base.name, order)][i]), \
                        f"{n} {cfg.name} != {base.name}"
        if which == "split":   # dk / dv alone (want_dq=False)
            none, dk, dv = HL.backward_fused(p, q, k, v, dout, l2, delta, cfg=cfg,
                                             want_dq=False)
            assert none is None
            assert_close(dk, rg.dk, dt, f"dk {cfg.name} without dq")
            assert_close(dv, rg.dv, dt, f"dv {cfg.name} without dq")
