"""The Triton route (backends/triton/route.py) as data: problem facts, device facts and
settings -> (path, config) of forward and backward, with the reason of each decision.
Plain data only: no GPU, no tensor, no Triton import.

Shape legend: B batch, Hq / Hkv heads, Sq / Sk queries / keys, D head dim.
"""
from __future__ import annotations

import pytest

from anyattn import settings
from anyattn.backends.triton import route as ROUTE
from anyattn.backends.triton.hopper import configs as HCF
from anyattn.backends.triton.hopper import coverage as HCOV

H100 = ROUTE.DeviceFacts("cuda", (9, 0), 132)
A100 = ROUTE.DeviceFacts("cuda", (8, 0), 108)
INTERPRETER = ROUTE.DeviceFacts("cpu", interpreter=True)
RAISES = ("raises", None)

#: (case, problem facts over B=1, Hq=Hkv=4, Sq=Sk=1024, bf16, ANYATTN_TRITON_PATH,
#: device, (forward path, config), (backward path, config)); the portable configs are
#: configs.plan_for's heuristic plans (TRITON_INTERPRET unset, ANYATTN_TRITON_CONFIG
#: unset), the Hopper ones hopper/configs.py's table
CASES = [
    ("bf16 D128", dict(head_dim=128), "auto", H100,
     ("hopper", "ws128x128s2opfPg"), ("hopper", "wdkdvq128x64s2nhrie")),
    ("bf16 D128 causal", dict(head_dim=128, mask_class="band"), "auto", H100,
     ("hopper", "ws128x128s2opfPg"), ("hopper", "wdkdvq128x64s2nhri")),
    ("fp16 D64", dict(head_dim=64, dtype="float16"), "auto", H100,
     ("hopper", "ws192x128s3opf"), ("hopper", "wdkdvq128x128s2nhtrie")),
    ("bf16 D64 causal", dict(head_dim=64, mask_class="band"), "auto", H100,
     ("hopper", "ws128x128s3opfPg"), ("hopper", "wdkdvq128x128s2nhtri")),
    ("fp32 D128", dict(head_dim=128, dtype="float32"), "auto", H100,
     ("portable", "fwd128x64w8s2"), ("portable", "dkdv64x128w8s1+dq128x64w8s1")),
    ("bf16 D256", dict(head_dim=256), "auto", H100,
     ("portable", "fwd64x64w8s2"), ("portable", "fused(dkdv32x64w8s2+dq64x32)")),
    # D=256: the Hopper forward is covered, not routed by 'auto'; no Hopper backward
    ("PATH=hopper bf16 D256", dict(head_dim=256), "hopper", H100,
     ("hopper", "ws128x64s2opf"), RAISES),
    ("bias", dict(head_dim=128, features=frozenset({"bias"})), "auto", H100,
     ("portable", "fwd128x128w8s3"), ("portable", "fused(dkdv64x128w8s3+dq128x64)")),
    ("softcap", dict(head_dim=128, features=frozenset({"softcap"})), "auto", H100,
     ("portable", "fwd128x128w8s3"), ("portable", "fused(dkdv64x128w8s3+dq128x64)")),
    ("dropout", dict(head_dim=128, features=frozenset({"dropout"})), "auto", H100,
     ("portable", "fwd128x128w8s3"), ("portable", "fused(dkdv64x128w8s3+dq128x64)")),
    # documents at D=128: covered both ways, 'auto' routes the forward only
    ("documents D128", dict(head_dim=128, mask_class="documents"), "auto", H100,
     ("hopper", "ws128x128s2opf"), ("portable", "fused(dkdv64x128w8s3+dq128x64)")),
    ("documents D64", dict(head_dim=64, mask_class="documents"), "auto", H100,
     ("portable", "fwd128x64w8s3"), ("portable", "dkdv64x64w4s3+dq128x64w4s3")),
    ("keep D128", dict(head_dim=128, mask_class="keep"), "auto", H100,
     ("portable", "fwd128x128w8s3"), ("portable", "fused(dkdv64x128w8s3+dq128x64)")),
    ("PATH=portable", dict(head_dim=128), "portable", H100,
     ("portable", "fwd128x128w8s3"), ("portable", "fused(dkdv64x128w8s3+dq128x64)")),
    ("PATH=hopper documents", dict(head_dim=128, mask_class="documents"), "hopper", H100,
     ("hopper", "ws128x128s2opf"), ("hopper", "wdkdvq128x64s2nhri")),
    ("PATH=hopper fp32", dict(head_dim=128, dtype="float32"), "hopper", H100,
     RAISES, RAISES),
    ("cc 8.0", dict(head_dim=128), "auto", A100,
     ("portable", "fwd128x128w8s3"), ("portable", "fused(dkdv64x128w8s3+dq128x64)")),
    ("PATH=hopper cc 8.0", dict(head_dim=128), "hopper", A100, RAISES, RAISES),
    ("interpreter", dict(head_dim=128), "auto", INTERPRETER,
     ("portable", "fwd128x128w8s3"), ("portable", "fused(dkdv64x128w8s3+dq128x64)")),
    # the dQ-inside backward while a (batch, kv head)'s key tiles fit in half the SMs
    ("Sk 8448 (66 tiles)", dict(head_dim=128, seq_k=8448), "auto", H100,
     ("hopper", "ws128x128s2opfPg"), ("hopper", "wdkdvq128x64s2nhrie")),
    ("Sk 8449 (67 tiles)", dict(head_dim=128, seq_k=8449), "auto", H100,
     ("hopper", "ws128x128s2opfPg"), ("hopper", "wdkdv128x64s2")),
    # the score modifiers the Hopper kernels compute: covered, taken under 'hopper' only
    ("PATH=hopper softcap D128", dict(head_dim=128, features=frozenset({"softcap"})),
     "hopper", H100, ("hopper", "ws128x128s2opfPg"), ("hopper", "wdkdvq128x64s2nhrie")),
    ("PATH=hopper softcap D64 causal", dict(head_dim=64, mask_class="band",
                                            features=frozenset({"softcap"})),
     "hopper", H100, ("hopper", "ws128x128s3opfPg"), ("hopper", "wdkdvq128x128s2nhtri")),
    ("PATH=hopper softcap D64", dict(head_dim=64, features=frozenset({"softcap"})),
     "hopper", H100, ("hopper", "ws192x128s3opf"), ("hopper", "wdkdvq128x128s2nhtrie")),
    ("PATH=hopper softcap Sk 8449", dict(head_dim=128, seq_k=8449,
                                         features=frozenset({"softcap"})),
     "hopper", H100, ("hopper", "ws128x128s2opfPg"), ("hopper", "wdkdv128x64s2")),
    # D=64 with ALiBi: the untransposed dQ-inside consumers (no spills; configs.py)
    ("PATH=hopper alibi D64", dict(head_dim=64, features=frozenset({"alibi", "sinks"})),
     "hopper", H100, ("hopper", "ws192x128s3opf"), ("hopper", "wdkdvq128x64s2nhri")),
    ("PATH=hopper alibi D64 causal", dict(head_dim=64, mask_class="band",
                                          features=frozenset({"alibi", "softcap"})),
     "hopper", H100, ("hopper", "ws128x128s3opfPg"), ("hopper", "wdkdvq128x64s2nhri")),
    ("PATH=hopper alibi D128", dict(head_dim=128, features=frozenset({"alibi"})),
     "hopper", H100, ("hopper", "ws128x128s2opfPg"), ("hopper", "wdkdvq128x64s2nhrie")),
    # ... with no array mask, and no other score feature
    ("PATH=hopper softcap documents", dict(head_dim=128, mask_class="documents",
                                           features=frozenset({"softcap"})),
     "hopper", H100, RAISES, RAISES),
    ("PATH=hopper bias", dict(head_dim=128, features=frozenset({"bias"})), "hopper", H100,
     RAISES, RAISES),
    ("PATH=hopper softcap+dropout", dict(head_dim=128,
                                         features=frozenset({"softcap", "dropout"})),
     "hopper", H100, RAISES, RAISES),
    ("softcap causal", dict(head_dim=128, mask_class="band", features=frozenset({"softcap"})),
     "auto", H100, ("portable", "fwd128x128w8s3"), ("portable", "fused(dkdv64x128w8s3+dq128x64)")),
    # score / mask functions: the plan's backward; capture gradients: two launches, dK/dV
    # with its own tile
    ("score function", dict(head_dim=128, features=frozenset({"score_mod"})), "auto", H100,
     ("portable", "fwd128x128w8s3"), ("portable", "fused(dkdv64x128w8s3+dq128x64)")),
    ("mask function", dict(head_dim=128, features=frozenset({"mask_mod"})), "auto", H100,
     ("portable", "fwd128x128w8s3"), ("portable", "fused(dkdv64x128w8s3+dq128x64)")),
    ("capture gradients", dict(head_dim=128, features=frozenset({"score_mod"}),
                               capture_grads=True), "auto", H100,
     ("portable", "fwd128x128w8s3"), ("portable", "dkdv32x128w8s3+dq128x64w8s3")),
]


@pytest.fixture
def heuristic(monkeypatch):
    """The GPU's settings: no interpreter (so the portable plans are the heuristic ones),
    no other Triton switch set."""
    for switch in settings.SWITCHES:
        if switch.name.startswith(("ANYATTN_TRITON_", "TRITON_")):
            monkeypatch.delenv(switch.name, raising=False)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_route_table(case, heuristic, monkeypatch):
    name, facts, path, device, want_fwd, want_bwd = case
    monkeypatch.setenv("ANYATTN_TRITON_PATH", path)
    problem = ROUTE.ProblemFacts(**dict(dict(batch=1, heads_q=4, heads_kv=4, seq_q=1024,
                                             seq_k=1024, dtype="bfloat16"), **facts))
    for direction, want in zip(ROUTE.DIRECTIONS, (want_fwd, want_bwd)):
        if want == RAISES:
            with pytest.raises(NotImplementedError,
                               match=f"ANYATTN_TRITON_PATH=hopper: the Hopper {direction}"):
                ROUTE.route(problem, direction, device)
            continue
        got = ROUTE.route(problem, direction, device)
        assert (got.path, got.config) == want, (name, direction, got.describe())
        assert len(got.reasons) == 2 and got.reasons[0].startswith(f"path: {got.path}")
        assert got.reasons[1].startswith(f"config: {got.config}")
        if got.hop:
            assert got.hopper.name == got.config
        else:
            assert got.hopper is None and got.plan is not None


def test_route_reasons_name_the_cause(heuristic):
    """Each decision's line names what decided it."""
    facts = dict(batch=1, heads_q=4, heads_kv=4, seq_q=1024, seq_k=1024, head_dim=128)
    fp32 = ROUTE.route(ROUTE.ProblemFacts(dtype="float32", **facts), "forward", H100)
    assert "dtype float32" in fp32.reasons[0] and "'f16x3'" in fp32.reasons[1]
    keep = ROUTE.route(ROUTE.ProblemFacts(dtype="bfloat16", mask_class="keep", **facts),
                       "forward", H100)
    assert "'auto' does not route mask class keep" in keep.reasons[0]
    d256 = ROUTE.route(ROUTE.ProblemFacts(dtype="bfloat16", **dict(facts, head_dim=256)),
                       "forward", H100)
    assert "head_dim 256 (never checked and timed on a GPU)" in d256.reasons[0]
    old = ROUTE.route(ROUTE.ProblemFacts(dtype="bfloat16", **facts), "forward", A100)
    assert "compute capability 8.0" in old.reasons[0]
    long = ROUTE.route(ROUTE.ProblemFacts(dtype="bfloat16", **dict(facts, seq_k=8449)),
                       "backward", H100)
    assert "67 key tiles per (batch, kv head) > 132 SMs // 2" in long.reasons[1]
    assert long.hopper == HCF.bwd_config_dkdv_only(128) and long.plan is not None


@pytest.mark.parametrize("feature", sorted(HCOV.MOD_FEATURES))
def test_route_holds_the_modifiers_back_from_auto(feature, heuristic, monkeypatch):
    """A modifier the Hopper kernels compute but no GPU run has checked: 'auto' keeps the
    portable kernels and says why; 'hopper' takes it; a feature outside the coverage
    raises under 'hopper' with the covered ones named."""
    facts = dict(batch=1, heads_q=4, heads_kv=4, seq_q=1024, seq_k=1024, head_dim=128,
                 dtype="bfloat16")
    problem = ROUTE.ProblemFacts(features=frozenset({feature}), **facts)
    for direction in ROUTE.DIRECTIONS:
        got = ROUTE.route(problem, direction, H100)
        assert not got.hop
        assert (f"'auto' does not route score features {feature} (covered, never checked"
                in got.reasons[0]), got.describe()
        assert "ANYATTN_TRITON_PATH=hopper takes it" in got.reasons[0]
    monkeypatch.setenv("ANYATTN_TRITON_PATH", "hopper")
    for direction in ROUTE.DIRECTIONS:
        got = ROUTE.route(problem, direction, H100)
        assert got.hop and "ANYATTN_TRITON_PATH=hopper; covered" in got.reasons[0]
        with pytest.raises(NotImplementedError, match="score features bias \\(the Hopper "
                           f"{direction} covers [a-z, ]*{feature}"):
            ROUTE.route(ROUTE.ProblemFacts(features=frozenset({feature, "bias"}), **facts),
                        direction, H100)
        with pytest.raises(NotImplementedError,
                           match="score features with mask class documents"):
            ROUTE.route(ROUTE.ProblemFacts(features=frozenset({feature}),
                                           mask_class="documents", **facts), direction, H100)


@pytest.mark.parametrize("feature", sorted(HCOV.MOD_FEATURES))
def test_d256_forward_covers_no_score_features(feature, heuristic, monkeypatch):
    """The Hopper D=256 forward was never compiled or checked with a modifier: even under
    ANYATTN_TRITON_PATH=hopper a call with one is refused, naming the head dim."""
    monkeypatch.setenv("ANYATTN_TRITON_PATH", "hopper")
    facts = dict(batch=1, heads_q=4, heads_kv=4, seq_q=1024, seq_k=1024, head_dim=256,
                 dtype="bfloat16")
    assert ROUTE.route(ROUTE.ProblemFacts(**facts), "forward", H100).hop
    with pytest.raises(NotImplementedError, match=f"score features {feature} \\(the Hopper "
                       "forward covers none at head_dim 256\\)"):
        ROUTE.route(ROUTE.ProblemFacts(features=frozenset({feature}), **facts), "forward",
                    H100)
    assert HCOV.COVERAGE["forward"].covered_features(128) == HCOV.MOD_FEATURES


def test_coverage_features_are_data():
    """Every direction covers the Hopper modifiers, routes none of them by default, and
    names only known features."""
    for direction, cov in HCOV.COVERAGE.items():
        assert cov.features == HCOV.MOD_FEATURES, direction
        assert cov.auto_features <= cov.features and not cov.auto_features
        assert set(cov.features) <= set(HCOV.FEATURES)
        assert cov.feature_mask_classes == {"none", "band"}
    for mc in ("none", "band"):       # D=64 ALiBi's backward: a listed config that fits
        cfg = HCF.bwd_config(64, mc, frozenset({"alibi"}))
        assert cfg in HCF.BWD_CONFIGS and not cfg.trans and cfg.smem_bytes(64) <= 227 * 1024
        assert HCOV.routed_by_default(direction, "none", 128)
        for f in HCOV.MOD_FEATURES:
            assert not HCOV.routed_by_default(direction, "none", 128, frozenset({f}))


def test_route_follows_the_settings(heuristic, monkeypatch):
    """The fixed test plan under ANYATTN_TRITON_CONFIG=fixed; an explicit plan keeps the
    portable path under 'auto' and is refused under 'hopper'."""
    from anyattn.backends.triton import configs

    problem = ROUTE.ProblemFacts(1, 4, 4, 1024, 1024, 128, "bfloat16")
    monkeypatch.setenv("ANYATTN_TRITON_CONFIG", "fixed")
    fixed = ROUTE.route(problem, "forward", INTERPRETER)
    assert fixed.plan.fwd == configs.fixed_plan().fwd and "fixed test plan" in fixed.reasons[1]
    monkeypatch.delenv("ANYATTN_TRITON_CONFIG")
    plan = configs.fixed_plan()
    explicit = ROUTE.route(problem, "forward", H100, plan=plan)
    assert not explicit.hop and explicit.plan is plan
    assert "explicit portable plan" in explicit.reasons[0]
    monkeypatch.setenv("ANYATTN_TRITON_PATH", "hopper")
    with pytest.raises(NotImplementedError, match="explicit portable plan"):
        ROUTE.route(problem, "forward", H100, plan=plan)


def test_route_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="direction 'sideways'"):
        ROUTE.route(ROUTE.ProblemFacts(1, 1, 1, 8, 8, 64, "bfloat16"), "sideways", H100)
    with pytest.raises(ValueError, match="unknown \\['gating'\\]"):
        ROUTE.ProblemFacts(1, 1, 1, 8, 8, 64, "bfloat16", features=frozenset({"gating"}))
    no_sms = ROUTE.DeviceFacts("cuda", (9, 0))
    with pytest.raises(ValueError, match="SM count"):
        ROUTE.route(ROUTE.ProblemFacts(1, 1, 1, 8, 8, 128, "bfloat16"), "backward", no_sms)


def test_info_route_prints_both_directions(capsys, heuristic):
    from anyattn.cli import main

    assert main(["info", "--route", "2,16,16,4096,4096,128", "--dtype", "bf16", "--mask",
                 "causal", "--cc", "9.0", "--sms", "132"]) == 0
    out = capsys.readouterr().out
    assert "forward: hopper ws128x128s2opfPg" in out
    assert "backward: hopper wdkdvq128x64s2nhri" in out
    assert main(["info", "--route", "1,4,4,64,64,128", "--dtype", "fp32", "--cc", "9.0"]) == 0
    out = capsys.readouterr().out
    assert "forward: portable" in out and "dtype float32" in out
    assert main(["info", "--route", "4,16,16,4096,4096,128", "--cc", "9.0", "--features",
                 "score_mod_grad"]) == 0
    out = capsys.readouterr().out
    assert "backward: portable dkdv32x128w8s3+dq128x64w8s3" in out     # the capture tile
    with pytest.raises(SystemExit):
        main(["info", "--route", "1,4,4,64,64,128"])          # no --cc
    assert "--route needs --cc" in capsys.readouterr().err
