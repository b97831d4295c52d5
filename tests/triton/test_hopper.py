"""The Triton backend's Hopper path (backends/triton/hopper): coverage table and routing
(CPU), an offline sm_90a compile that must hold HGMMA / UTMALDG (CPU, ~5 s), and the
forward against float64, the portable kernels and itself (sm_90 GPUs only).

Shape legend: B batch, H / Hkv heads, Sq / Sk queries / keys, D head dim.
"""
from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import anyattn as aa  # noqa: E402
from anyattn import reference as R  # noqa: E402
from anyattn.problem import describe  # noqa: E402
from anyattn import settings  # noqa: E402
from anyattn.backends.triton import route as ROUTE  # noqa: E402
from anyattn.backends.triton.hopper import coverage as HCOV  # noqa: E402
from anyattn.backends.triton.hopper import launch as HL  # noqa: E402

from helpers import TOL, assert_close, np_mask, to_np  # noqa: E402

from tr_util import SM90, needs_gluon, needs_sm90  # noqa: E402


def _problem(dtype=torch.bfloat16, D=128, mask=None, bias=None, device="cpu", **kw):
    q = torch.zeros(1, 2, 8, D, dtype=dtype, device=device)
    k = torch.zeros(1, 2, 8, D, dtype=dtype, device=device)
    return describe(q, k, k, mask=mask, bias=bias, **kw)


# ----------------------------------------------------------------------------- coverage
def _facts(cc=(9, 0), sms=132):
    return ROUTE.DeviceFacts("cuda", cc, sms)


def _why(p, direction, cc=(9, 0), tensors=()):
    """coverage.uncovered of Problem p on an sm_<cc> device (plain facts: no GPU)."""
    return HCOV.uncovered(ROUTE.ProblemFacts.of(p, tensors), direction, _facts(cc))


def _route(p, direction, sms=132):
    """The route of Problem p on an sm_90 device with ``sms`` SMs, under the settings in
    effect."""
    return ROUTE.route(ROUTE.ProblemFacts.of(p), direction, _facts(sms=sms))


def test_coverage_reasons_name_what_is_missing():
    p = _problem()
    assert _why(p, "forward") is None
    assert _why(p, "backward") is None
    for kw, word in ((dict(dtype=torch.float32), "dtype float32"), (dict(D=96), "head_dim 96"),
                     (dict(D=64, mask=aa.Documents(torch.tensor([0] * 4 + [1] * 4))),
                      "mask class documents at head_dim 64"),
                     (dict(bias=torch.zeros(1, 1, 8, 8)), "bias"),
                     (dict(softcap=30.0, mask=aa.Documents(torch.tensor([0] * 4 + [1] * 4))),
                      "score features with mask class documents")):
        p = _problem(**kw)
        assert word in _why(p, "forward"), (kw, _why(p, "forward"))
    # the score modifiers: covered (with no mask or a band), not routed by 'auto'
    for kw in (dict(softcap=30.0), dict(softcap=30.0, mask=aa.Causal())):
        p = _problem(**kw)
        assert _why(p, "forward") is None and _why(p, "backward") is None, kw
    # Documents: covered by the forward and, at D=128, the backward
    p = _problem(mask=aa.Documents(torch.tensor([0] * 4 + [1] * 4)))
    assert _why(p, "forward") is None
    assert _why(p, "backward") is None
    p = _problem(D=64, mask=aa.Documents(torch.tensor([0] * 4 + [1] * 4)))
    assert "mask class documents at head_dim 64" in _why(p, "backward")
    assert "compute capability 8.0" in _why(_problem(), "forward", cc=(8, 0))
    interp = ROUTE.DeviceFacts("cpu", interpreter=True)
    assert "interpreter" in HCOV.uncovered(ROUTE.ProblemFacts.of(_problem()), "forward", interp)


def test_coverage_tensor_rules():
    p = _problem()
    x = torch.zeros(1, 2, 8, 136, dtype=torch.bfloat16)[..., :128]
    assert _why(p, "forward", tensors=(("q", x),)) is None          # 272-byte rows
    y = torch.zeros(1, 2, 8, 132, dtype=torch.bfloat16)[..., :128]
    assert "16 bytes" in _why(p, "forward", tensors=(("k", y),))
    z = torch.zeros(1, 2, 128, 8, dtype=torch.bfloat16).transpose(-1, -2)
    assert "last-dim stride" in _why(p, "forward", tensors=(("v", z),))


def test_backward_routes_d128_and_d64_bands(monkeypatch):
    """The Hopper backward covers D=64 and 128; 'auto' routes both, with a band or
    without (coverage.py); 'hopper' forces it, 'portable' keeps it off."""
    assert HCOV.routed_by_default("backward", "none", 128)
    assert HCOV.routed_by_default("backward", "band", 128)
    assert HCOV.routed_by_default("backward", "band", 64)
    assert HCOV.routed_by_default("backward", "none", 64)
    monkeypatch.delenv("ANYATTN_TRITON_PATH", raising=False)
    for d, mask, routed in ((128, None, True), (128, aa.Causal(), True), (64, None, True),
                            (64, aa.Causal(), True)):
        p = _problem(D=d, mask=mask)
        assert _why(p, "backward") is None
        assert _route(p, "backward").hop is routed, (d, mask)
    p = _problem(D=64)
    monkeypatch.setenv("ANYATTN_TRITON_PATH", "hopper")
    assert _route(p, "backward").hop is True
    monkeypatch.setenv("ANYATTN_TRITON_PATH", "portable")
    assert _route(_problem(), "backward").hop is False


def test_backward_config_keeps_dq_waits_within_half_the_sms():
    """The dQ-inside config (its programs wait for each other's add turns) is the route
    while a (batch, kv head)'s key tiles are at most half the SMs; past that the
    dK/dV-only config (portable dQ, no waits) is; D=64 too (the transposed consumers
    with 128-row query tiles)."""
    from anyattn.backends.triton.hopper import configs as HCF

    cases = ((128, None, 66 * 128, True), (128, None, 66 * 128 + 1, False),
             (128, aa.Causal(), 2048, True), (64, aa.Causal(), 4096, True),
             (64, None, 4096, True), (64, None, 66 * 128 + 1, False))
    for d, mask, sk, dq in cases:
        q = torch.zeros(1, 2, 8, d, dtype=torch.bfloat16)
        k = torch.zeros(1, 2, sk, d, dtype=torch.bfloat16)
        p = describe(q, k, k, mask=mask)
        cfg = _route(p, "backward", sms=132).hopper
        assert cfg.dq is dq, (d, mask, sk, cfg.name)
        if dq:
            assert cfg == HCF.bwd_config(d, p.mask_class)
            assert cfg.bm == (128 if d == 64 else 64) and cfg.trans is (d == 64), cfg.name
        else:
            assert cfg == HCF.bwd_config_dkdv_only(d)


def test_d64_forward_is_routed_without_a_mask_and_with_a_band(monkeypatch):
    """D=64: the forward is covered and routed by 'auto' with no mask (3 consumer
    warpgroups) or a band (2 consumers in the persistent kernel on the host-built
    schedule), and the array masks are refused at D=64 with the reason (coverage.py,
    configs.py)."""
    from anyattn.backends.triton.hopper import configs as HCF

    monkeypatch.delenv("ANYATTN_TRITON_PATH", raising=False)
    assert HCOV.routed_by_default("forward", "none", 64)
    assert HCOV.routed_by_default("forward", "band", 64)
    assert HCOV.routed_by_default("forward", "band", 128)
    assert HCOV.routed_by_default("forward", "documents", 128)
    for mask, routed in ((None, True), (aa.Causal(), True)):
        p = _problem(D=64, mask=mask)
        assert _why(p, "forward") is None
        assert _route(p, "forward").hop is routed, mask
    assert HCF.fwd_config(64, "none").name == "ws192x128s3opf"
    assert HCF.fwd_config(64, "band").name == "ws128x128s3opfPg"
    assert HCF.fwd_config(128, "none") == HCF.fwd_config(128, "band")
    p = _problem(D=64, mask=aa.Documents(torch.tensor([0] * 4 + [1] * 4)))
    monkeypatch.setenv("ANYATTN_TRITON_PATH", "hopper")
    with pytest.raises(NotImplementedError, match="documents at head_dim 64"):
        _route(p, "forward")


def test_d128_forward_routes_the_scheduled_persistent_kernel_without_a_mask_and_with_a_band():
    """D=128: no mask or a band -> the persistent kernel on the host-built schedule
    ('ws128x128s2opfPg'); the array mask classes (the schedule takes band masks only) ->
    the per-tile kernel of the same loop ('ws128x128s2opf')."""
    from anyattn.backends.triton.hopper import configs as HCF

    for mc in ("none", "band"):
        cfg = HCF.fwd_config(128, mc)
        assert cfg.persist and cfg.name == "ws128x128s2opfPg", mc
    for mc in ("documents", "keep", "band+documents", "band+keep", "documents+keep",
               "band+documents+keep"):
        cfg = HCF.fwd_config(128, mc)
        assert cfg == HCF.fwd_config(128, "band").per_tile() and not cfg.persist, mc
        assert cfg.name == "ws128x128s2opf"


def test_routed_configs_are_the_compiled_lists():
    """FWD_CONFIGS / BWD_CONFIGS are exactly what the routes can launch (every covered
    class's config, the persistent ones' per-tile twins, the dK/dV-only fallback, the
    D=256 forward), eleven in all, each within the shared memory of an H100 / H200; uncovered cases raise."""
    from anyattn.backends.triton.hopper import configs as HCF

    classes = {64: ("none", "band"),
               128: ("none", "band", "documents", "keep", "band+documents", "band+keep",
                     "documents+keep", "band+documents+keep")}
    fwd, bwd, at = set(), set(), set()
    for d, mcs in classes.items():
        for mc in mcs:
            c = HCF.fwd_config(d, mc)
            fwd |= {c, c.per_tile()}
            bwd.add(HCF.bwd_config(d, mc))
            at |= {(c, d), (c.per_tile(), d), (HCF.bwd_config(d, mc), d)}
        bwd.add(HCF.bwd_config_dkdv_only(d))
        at.add((HCF.bwd_config_dkdv_only(d), d))
    for mc in ("none", "band"):       # D=256: a forward only
        c = HCF.fwd_config(256, mc)
        fwd.add(c)
        at.add((c, 256))
    assert fwd == set(HCF.FWD_CONFIGS) and bwd == set(HCF.BWD_CONFIGS)
    assert len(HCF.FWD_CONFIGS) + len(HCF.BWD_CONFIGS) == 11
    assert sorted(c.name for c in HCF.BWD_CONFIGS) == [
        "wdkdv128x64s2", "wdkdvq128x128s2nhtri", "wdkdvq128x128s2nhtrie",
        "wdkdvq128x64s2nhri", "wdkdvq128x64s2nhrie"]
    for c, d in at:   # each at the head dim it is routed at
        assert c.smem_bytes(d) <= 227 * 1024, (c.name, d)
    for bad in (lambda: HCF.fwd_config(64, "documents"), lambda: HCF.fwd_config(96, "none"),
                lambda: HCF.bwd_config(64, "keep"), lambda: HCF.bwd_config_dkdv_only(96),
                lambda: HCF.bwd_config(256, "none"), lambda: HCF.fwd_config(256, "keep")):
        with pytest.raises(KeyError):
            bad()


def test_configs_reject_shapes_the_kernels_do_not_implement():
    """Config fields that the kernels do not implement raise instead of being ignored."""
    from anyattn.backends.triton.hopper.configs import HopperBwdConfig, HopperConfig

    with pytest.raises(ValueError, match="2 or 3 consumer"):
        HopperConfig(256, 128, 2)
    with pytest.raises(ValueError, match="bm 64"):
        HopperBwdConfig(128)
    with pytest.raises(ValueError, match="bn 128"):
        HopperBwdConfig(64, bn=64, dq=True)
    with pytest.raises(ValueError, match="options of dq configs"):
        HopperBwdConfig(64, late_release=True)
    c = HopperConfig(192, 128, 3, consumer_regs=160)
    assert c.name == "ws192x128s3opf" and c.consumers == 3
    assert c.smem_bytes(64) == 2 * 64 * (192 + 2 * 3 * 128)


def test_dq_tiles_all_visited_matches_the_tile_ranges():
    """launch._dq_tiles_all_visited (whether the dQ accumulator needs zeroing first)
    against the key tiles' query-tile ranges (tile_ranges.query_tile_range's rule) over
    random band masks and sizes."""
    import random

    def visited(Sq, Sk, lo, hi, bm, bn):
        nq, seen = -(-Sq // bm), set()
        for j in range(-(-Sk // bn)):
            j0, j1 = j * bn, min(j * bn + bn, Sk)
            s0 = max(j0 - hi, 0) // bm
            s1 = max(s0, min(nq, -(-max(j1 - lo, 0) // bm)))
            seen.update(range(s0, s1))
        return len(seen) == nq

    rng = random.Random(3)
    big = 1 << 30
    for _ in range(400):
        Sq, Sk = rng.randint(1, 900), rng.randint(1, 900)
        lo = rng.choice([-big, rng.randint(-900, 900)])
        hi = rng.choice([big, rng.randint(max(lo, -900), 900)])
        assert HL._dq_tiles_all_visited(Sq, Sk, lo, hi, 64, 128) == \
            visited(Sq, Sk, lo, hi, 64, 128), (Sq, Sk, lo, hi)


def test_path_setting(monkeypatch):
    monkeypatch.setenv("ANYATTN_TRITON_PATH", "fast")
    with pytest.raises(ValueError, match="ANYATTN_TRITON_PATH"):
        settings.current()
    monkeypatch.setenv("ANYATTN_TRITON_PATH", "Portable")
    assert settings.current().triton_path == "portable"


def test_forcing_hopper_where_not_covered_raises(monkeypatch):
    """On this machine (no sm_90) a forced Hopper path names the reason."""
    if SM90:
        pytest.skip("an sm_90 GPU covers the call")
    from anyattn.backends.triton import launch as TL

    monkeypatch.setenv("ANYATTN_TRITON_PATH", "hopper")
    p = _problem()
    q = torch.zeros(1, 2, 8, 128, dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="Hopper forward path does not cover"):
        TL.forward(p, q, q, q, None)
    with pytest.raises(NotImplementedError, match="Hopper backward path does not cover"):
        TL.backward(p, q, q, q, q, q, None, None)


# ----------------------------------------------------------------------------- offline
def _compile_counts(expr):
    """Instruction counts of ``expr`` (a bench/lab/hopper_offline.compile_* call, ``O``)
    compiled for sm_90a in a child process without TRITON_INTERPRET (tests/conftest.py
    sets it where no GPU is present, and Gluon functions do not compile under the
    interpreter)."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.join(os.path.dirname(__file__), "..", "..")
    env["PYTHONPATH"] = os.pathsep.join([os.path.join(root, "src"),
                                         os.path.join(root, "bench", "lab"),
                                         env.get("PYTHONPATH", "")])
    code = ("import json; import hopper_offline as O; "
            "from anyattn.backends.triton.hopper import configs as C; "
            f"c = {expr}; "
            "print(json.dumps(dict(O.instruction_counts(c), has_sass=bool(O.sass_of(c.asm['cubin'])))))")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@needs_gluon
@pytest.mark.parametrize("expr,stores", [
    ("O.compile_fwd('bfloat16', 128, True, C.fwd_config(128, 'band').per_tile())", 2),
    ("O.compile_fwd('bfloat16', 64, False)", 3),
    # the dK/dV-only kernel: dK and dV of each consumer's 64 key rows
    ("O.compile_bwd('bfloat16', 64, True, C.bwd_config_dkdv_only(64))", 4)])
def test_compiles_for_sm90a_with_hopper_instructions(expr, stores):
    """The kernels compile for sm_90a here (no GPU) and their SASS holds warpgroup MMAs
    (HGMMA) and bulk tensor loads (UTMALDG), no HMMA fallback, no local memory; the
    warp-specialised kernels move registers between their partitions (setmaxnreg); the
    overlapped forward loop issues two products per tile."""
    n = _compile_counts(expr)
    assert n["ptx_wgmma"] > 0 and n["ptx_tma_load"] > 0 and n["ptx_tma_store"] == stores, n
    assert n["ptx_setmaxnreg"] > 0, n
    if "compile_fwd('bfloat16', 128" in expr and n["has_sass"]:
        assert n["sass_HGMMA"] == 64, n   # per consumer: S(0), S(j) + P.V(j-1), last P.V
    if n["has_sass"]:
        assert n["sass_HGMMA"] > 0 and n["sass_UTMALDG"] > 0 and n["sass_HMMA"] == 0, n
        assert n["local_bytes"] == 0 and n.get("stack_bytes", 0) == 0, n


# ----------------------------------------------------------------------------- GPU
def _inputs(B, H, Hkv, Sq, Sk, D, dtype, layout="bhsd", seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if layout == "bshd":
        mk = lambda h, s: torch.randn(B, s, h, D, device="cuda", generator=g).to(dtype).transpose(1, 2)  # noqa: E731
    else:
        mk = lambda h, s: torch.randn(B, h, s, D, device="cuda", generator=g).to(dtype)  # noqa: E731
    return mk(H, Sq), mk(Hkv, Sk), mk(Hkv, Sk)


MASKS = {"none": None, "causal": aa.Causal(), "causal_br": aa.Causal(align="bottom_right"),
         "window": aa.Causal() & aa.Window(left=100), "window2": aa.Window(left=64, right=37)}
#: (shape (B, Hq, Hkv, Sq, Sk), layout) of the GPU checks: GQA with odd sizes, Sq > Sk,
#: [B, S, H, D] strides
GPU_SHAPES = [((2, 4, 2, 257, 383), "bhsd"), ((1, 2, 1, 300, 200), "bhsd"),
              ((2, 4, 4, 256, 256), "bshd")]


def gpu_grid(kinds=tuple(MASKS), dims=(64, 128)):
    """The GPU checks' grid: dtype x D x mask kind x (shape, layout), on sm_90 only."""
    marks = [pytest.mark.parametrize("dtype", ["bfloat16", "float16"]),
             pytest.mark.parametrize("D", list(dims)),
             pytest.mark.parametrize("kind", list(kinds)),
             pytest.mark.parametrize("shape,layout", GPU_SHAPES),
             pytest.mark.gpu, needs_sm90]

    def apply(fn):
        for m in reversed(marks):
            fn = m(fn)
        return fn
    return apply


@gpu_grid(dims=(64, 128, 256))
def test_forward_matches_float64(dtype, D, kind, shape, layout):
    """out within the dtype's tolerance of float64 (rounded inputs), lse -inf exactly on
    the empty rows, every element written (poisoned buffers), two runs bitwise equal."""

    B, H, Hkv, Sq, Sk = shape
    q, k, v = _inputs(B, H, Hkv, Sq, Sk, D, getattr(torch, dtype), layout)
    mask = MASKS[kind]
    p = describe(q, k, v, mask=mask)
    if D == 128:
        assert HCOV.uncovered(ROUTE.ProblemFacts.of(p, (("q", q), ("k", k), ("v", v))),
                              "forward", ROUTE.device_facts(q.device)) is None
    res = []
    for _ in range(2):
        out = torch.full((B, H, Sq, D), float("nan"), dtype=q.dtype, device="cuda")
        st = torch.full((2, B, H, Sq), float("nan"), device="cuda")
        res.append(HL.forward(p, q, k, v, out=out, stats=st))
    (o, rs), (o2, rs2) = res
    assert torch.equal(o, o2) and torch.equal(rs.max, rs2.max) and torch.equal(rs.log_norm, rs2.log_norm)
    qr, kr, vr = (to_np(x).astype(np.float64) for x in (q, k, v))
    ro, rl = R.forward(qr, kr, vr, mask=np_mask(mask))
    assert_close(o, ro, dtype, "out")
    lse = to_np(rs.max + rs.log_norm).astype(np.float64)
    assert np.array_equal(np.isfinite(lse), np.isfinite(rl)), "lse -inf exactly on empty rows"
    fin = np.isfinite(rl)
    assert np.abs(lse[fin] - rl[fin]).max() <= 10 * TOL[dtype] * max(1.0, np.abs(rl[fin]).max())
    assert not torch.isnan(rs.log_norm).any()


@pytest.mark.gpu
@needs_sm90
def test_auto_routes_covered_calls_to_hopper(monkeypatch):

    calls = []
    orig = HL.forward
    monkeypatch.setattr(HL, "forward", lambda *a, **k: calls.append(1) or orig(*a, **k))
    q, k, v = _inputs(1, 2, 2, 64, 64, 128, torch.bfloat16)
    monkeypatch.delenv("ANYATTN_TRITON_PATH", raising=False)
    a = aa.attention(q, k, v, mask=aa.Causal(), backend="triton")
    assert calls == [1]
    aa.attention(q, k, v, bias=torch.zeros(1, 1, 64, 64, device="cuda"), backend="triton")
    assert calls == [1], "a biased call stays portable"
    monkeypatch.setenv("ANYATTN_TRITON_PATH", "portable")
    b = aa.attention(q, k, v, mask=aa.Causal(), backend="triton")
    assert calls == [1]
    assert (a.float() - b.float()).abs().max().item() < 2e-2


@gpu_grid(["none", "causal", "causal_br", "window2"], dims=(64, 128, 256))
def test_forward_ws_matches_float64(dtype, D, kind, shape, layout):
    """The routed forward config of the mask's class and its per-tile twin: out within
    tolerance of float64, every element written, bitwise equal to itself."""
    from anyattn.backends.triton.hopper import configs as HCF

    B, H, Hkv, Sq, Sk = shape
    q, k, v = _inputs(B, H, Hkv, Sq, Sk, D, getattr(torch, dtype), layout, seed=3)
    mask = MASKS[kind]
    p = describe(q, k, v, mask=mask)
    qr, kr, vr = (to_np(x).astype(np.float64) for x in (q, k, v))
    ro, rl = R.forward(qr, kr, vr, mask=np_mask(mask))
    routed = HCF.fwd_config(D, p.mask_class)
    for cfg in sorted({routed, routed.per_tile()}, key=lambda c: c.name):
        res = []
        for _ in range(2):
            out = torch.full((B, H, Sq, D), float("nan"), dtype=q.dtype, device="cuda")
            st = torch.full((2, B, H, Sq), float("nan"), device="cuda")
            res.append(HL.forward(p, q, k, v, out=out, stats=st, cfg=cfg))
        (o, rs), (o2, rs2) = res
        assert torch.equal(o, o2) and torch.equal(rs.max, rs2.max)
        assert_close(o, ro, dtype, f"out {cfg.name}")
        lse = to_np(rs.max + rs.log_norm).astype(np.float64)
        assert np.array_equal(np.isfinite(lse), np.isfinite(rl)), cfg.name


@gpu_grid()
def test_backward_matches_float64(dtype, D, kind, shape, layout):
    """The routed backward (portable delta, the Hopper backward config with dQ inside) and
    every backward config of that head dim into poisoned buffers (dq too where the config
    computes it): within the dtype's tolerance of float64, two runs bitwise equal."""
    from anyattn.backends.triton import launch as TL
    from anyattn.backends.triton.hopper import configs as HCF

    B, H, Hkv, Sq, Sk = shape
    q, k, v = _inputs(B, H, Hkv, Sq, Sk, D, getattr(torch, dtype), layout, seed=5)
    mask = MASKS[kind]
    p = describe(q, k, v, mask=mask)
    assert HCOV.uncovered(ROUTE.ProblemFacts.of(p, (("q", q), ("k", k), ("v", v))),
                          "backward", ROUTE.device_facts(q.device)) is None
    out, rs = TL.forward(p, q, k, v, None)
    g = torch.Generator(device="cuda").manual_seed(7)
    dout = torch.randn(out.shape, device="cuda", generator=g).to(q.dtype)
    p = describe(q, k, v, mask=mask, dout=dout, wrt=("q", "k", "v"))
    os.environ["ANYATTN_TRITON_PATH"] = "hopper"
    try:
        r1 = TL.backward(p, q, k, v, dout, out, rs, None)
        r2 = TL.backward(p, q, k, v, dout, out, rs, None)
    finally:
        os.environ.pop("ANYATTN_TRITON_PATH", None)
    for n in ("dq", "dk", "dv"):
        assert torch.equal(r1[n], r2[n]), n
    f64 = lambda x: to_np(x).astype(np.float64)  # noqa: E731
    rg = R.backward(f64(q), f64(k), f64(v), f64(dout), mask=np_mask(mask), out=f64(out),
                    stats=type(rs)(f64(rs.max), f64(rs.log_norm)))
    for n in ("dq", "dk", "dv"):
        assert_close(r1[n], getattr(rg, n), dtype, n)
    # the dK/dV configs alone, from the same preprocess terms, into poisoned buffers
    delta = (out.float() * dout.float()).sum(-1).contiguous()
    mx = torch.where(rs.max == float("-inf"), float("inf"), rs.max)
    l2 = torch.stack([mx, rs.log_norm * 1.4426950408889634], 2).contiguous()
    for cfg in [HCF.bwd_config(D, "none"), HCF.bwd_config(D, "band"),
                HCF.bwd_config_dkdv_only(D)]:
        dk = torch.full((B, Hkv, Sk, D), float("nan"), dtype=q.dtype, device="cuda")
        dv = torch.full_like(dk, float("nan"))
        dq = torch.full_like(q.contiguous(), float("nan"))
        if cfg.dq:
            got = HL.backward_fused(p, q, k, v, dout, l2, delta, dq, dk, dv, cfg=cfg)[0]
            assert_close(got, rg.dq, dtype, f"dq {cfg.name}")
            # the ascending add order (what the launcher takes when the key tiles of a
            # head do not fit on the SMs at once): the same sums, other bits
            got0 = [HL.backward_fused(p, q, k, v, dout, l2, delta,
                                      torch.full_like(dq, float("nan")), cfg=cfg,
                                      order=0)[0] for _ in range(2)]
            assert_close(got0[0], rg.dq, dtype, f"dq {cfg.name} order 0")
            assert torch.equal(got0[0], got0[1]), f"dq {cfg.name} order 0 repeat"
        else:
            HL.dkdv(p, q, k, v, dout, l2, delta, dk, dv)
        assert_close(dk, rg.dk, dtype, f"dk {cfg.name}")
        assert_close(dv, rg.dv, dtype, f"dv {cfg.name}")
