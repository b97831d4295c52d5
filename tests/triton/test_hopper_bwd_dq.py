"""The Hopper backward with dQ inside (hopper/bwd_ws_dq_kernel.py; 't': the transposed
consumers, hopper/bwd_ws_t_kernel.py): the routed configs as data, the accumulator's
interleaved descriptor and the offline sm_90a compile (CPU); dq / dk / dv against
float64 with both add orders on a long key-tile chain and with a band and empty rows in
fp16 (sm_90 GPUs only).

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

#: the routed dQ-inside configs by name -> head dim
_DQ = {c.name: d for d in (64, 128) for c in (HCF.bwd_config(d, "none"),
                                               HCF.bwd_config(d, "band"))}


def test_routed_dq_configs_and_their_accumulator_descriptor():
    """The dQ-inside routes: 'nhri' at D=128 and the transposed 128-row 'nhtri' at D=64,
    'e' (the writer's late release) on top without a mask; the accumulator descriptor
    is the 5-D view that swaps the row bits (launch.dqa_desc)."""
    from anyattn.backends.triton.hopper import launch as HL

    assert sorted(_DQ) == ["wdkdvq128x128s2nhtri", "wdkdvq128x128s2nhtrie",
                           "wdkdvq128x64s2nhri", "wdkdvq128x64s2nhrie"]
    for d in (64, 128):
        assert HCF.bwd_config(d, "none") == dataclasses.replace(HCF.bwd_config(d, "band"),
                                                                late_release=True)
    if not HAS_GLUON:
        return
    acc = torch.zeros((3, 200, 128), dtype=torch.float32)
    d = HL.dqa_desc(acc, 64, 64)
    assert list(d.shape) == [3, 25, 4, 2, 128]
    assert list(d.strides) == [200 * 128, 8 * 128, 128, 4 * 128, 1]
    assert list(d.block_shape) == [1, 8, 4, 2, 64]
    # (g, b0, b1) -> the accumulator's row 8 g + 4 b1 + b0
    g, b0, b1 = 5, 3, 1
    assert g * d.strides[1] + b0 * d.strides[2] + b1 * d.strides[3] == (8 * g + 4 * b1 + b0) * 128
    with pytest.raises(ValueError, match="multiples of 8"):
        HL.dqa_desc(torch.zeros((1, 100, 64), dtype=torch.float32), 64, 32)


def test_backward_fused_refuses_a_dkdv_only_config():
    """backward_fused() runs the dQ-inside kernels: the dK/dV-only config is refused,
    not half run."""
    from anyattn.backends.triton.hopper import launch as HL

    q = torch.zeros(1, 1, 64, 128, dtype=torch.bfloat16)
    p = describe(q, q, q)
    with pytest.raises(ValueError, match="dkdv"):
        HL.backward_fused(p, q, q, q, q, None, None, cfg=HCF.bwd_config_dkdv_only(128))


@needs_gluon
@pytest.mark.parametrize("name,band,hgmma", [
    ("wdkdvq128x64s2nhri", True, 64), ("wdkdvq128x64s2nhrie", False, 64),
    ("wdkdvq128x128s2nhtri", True, 80), ("wdkdvq128x128s2nhtrie", False, 80)])
def test_routed_dq_configs_compile_for_sm90a(name, band, hgmma):
    """Offline sm_90a: per consumer S (S^T), dP (dP^T), dV, dK and two dQ products of
    [BM, D / 2]; the writer's bulk reduce-adds (UTMAREDG, one 64-column box a half);
    setmaxnreg; no HMMA fallback; few spills; shared memory as configs.smem_bytes says; at D=128 the
    consumers read the row statistics from shared memory (LDS) and load nothing from
    global memory in their loops (the producer stages them)."""
    D = _DQ[name]
    setup = f"cfg = next(c for c in HCF.BWD_CONFIGS if c.name == {name!r})"
    f = offline_facts(f"O.compile_bwd('bfloat16', {D}, {band}, cfg)", setup)
    cfg = next(c for c in HCF.BWD_CONFIGS if c.name == name)
    assert f["ptx_setmaxnreg"] > 0 and f["ptx_tma_load"] > 0, f
    assert f["shared"] <= cfg.smem_bytes(D) + 1024, (f["shared"], cfg.smem_bytes(D))
    sass = f["sass"]
    if not sass:
        return
    assert f["sass_HGMMA"] == hgmma and f["sass_HMMA"] == 0, f
    assert re.search(r"\bUTMAREDG", sass), "no bulk reduce-add"
    # few spills: the bounds the split configs have always kept (D=64 128-row tiles 96
    # stack bytes, D=128 192)
    assert f["stack_bytes"] <= (96 if D == 64 else 192), f
    if D == 64:
        return
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


# ----------------------------------------------------------------------------- GPU
#: the GPU cases: (B, H, Hkv, Sq, Sk, dtype, mask, seed)
_GPU_CASES = {
    # many key tiles per query tile (Sk 3000: 24 key tiles, 16 query tiles), GQA 2
    "long-none": (1, 4, 2, 1000, 3000, "bfloat16", None, 11),
    "long-causal": (1, 4, 2, 1000, 3000, "bfloat16", "causal_br", 11),
    # a bottom-right causal band over Sq 300 > Sk 200 (empty rows), GQA 2, fp16
    "band-empty-rows-fp16": (2, 4, 2, 300, 200, "float16", "causal_br", 12),
}


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("case", list(_GPU_CASES))
def test_ws_dq_against_float64(D, case):
    """dq / dk / dv of the routed dQ-inside configs of D within the dtype's tolerance of
    float64 into NaN-poisoned buffers, with the rotated add order (1) and the ascending
    one (0), each bitwise repeatable, 'e' bitwise the results without it; dk / dv alone
    (dkdv: the dK/dV-only kernel) too."""
    from anyattn.backends.triton.hopper import launch as HL

    B, H, Hkv, Sq, Sk, dt, kind, seed = _GPU_CASES[case]
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(B, h, s, D, device="cuda", generator=g).to(getattr(torch, dt))
               for h, s in ((H, Sq), (Hkv, Sk), (Hkv, Sk)))
    mask = aa.Causal(align="bottom_right") if kind == "causal_br" else None
    p, dout, l2, delta, rg = bwd_gpu_inputs(q, k, v, mask, g)
    nan = lambda x: torch.full_like(x.contiguous(), float("nan"))  # noqa: E731
    base = {}     # order -> the results without 'e'
    for cfg in (HCF.bwd_config(D, "band"), HCF.bwd_config(D, "none")):
        for order in (1, 0):
            runs = [HL.backward_fused(p, q, k, v, dout, l2, delta, nan(q), nan(k), nan(v),
                                      cfg=cfg, order=order) for _ in range(2)]
            for i, n in enumerate(("dq", "dk", "dv")):
                assert torch.equal(runs[0][i], runs[1][i]), f"{n} {cfg.name} order {order}"
                assert_close(runs[0][i], getattr(rg, n), dt, f"{n} {cfg.name} order {order}")
            if not cfg.late_release:
                base[order] = runs[0]
            else:
                for i, n in enumerate(("dq", "dk", "dv")):
                    assert torch.equal(runs[0][i], base[order][i]), f"{n} {cfg.name}"
    dk, dv = HL.dkdv(p, q, k, v, dout, l2, delta, nan(k), nan(v))
    assert_close(dk, rg.dk, dt, "dk without dq")
    assert_close(dv, rg.dv, dt, "dv without dq")
