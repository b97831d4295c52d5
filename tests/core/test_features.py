"""The feature table (anyattn.features): Problem.features, Capabilities as sets of
feature names, every refusal derived from the table."""
import dataclasses

import numpy as np
import pytest

import anyattn as aa
from anyattn import features
from anyattn.backends.base import Backend, Capabilities
from anyattn.paged import describe_paged
from anyattn.problem import describe

q = np.zeros((2, 4, 6, 8), np.float32)
kv = np.zeros((2, 2, 6, 8), np.float32)
ids = np.array([0, 0, 1, 1, 2, 2])

#: one problem per feature, using it and (as far as can be) nothing else
USES = {
    "band": dict(mask=aa.Causal()),
    "documents": dict(mask=aa.Documents(ids)),
    "keep": dict(mask=aa.KeepMask(np.ones((6, 6), bool))),
    "bias": dict(bias=np.zeros((6, 6), np.float32)),
    "bias_grad": dict(bias=np.zeros((6, 6), np.float32), dout=q, wrt=("bias",)),
    "gqa": dict(),
    "softcap": dict(softcap=2.0),
    "alibi": dict(alibi_slopes=np.ones(4, np.float32)),
    "sinks": dict(sinks=np.zeros(4, np.float32)),
    "sinks_grad": dict(sinks=np.zeros(4, np.float32), dout=q, wrt=("sinks",)),
    "dropout": dict(dropout_p=0.5, dropout_seed=1),
    "value_dim": dict(),
    "paged_kv": dict(),
    "mask_mod": dict(mask=aa.MaskMod(lambda b, h, i, j: (i + j) % 2 == 0)),
    "score_mod": dict(score_mod=lambda s, b, h, i, j: s - (i - j) ** 2),
    "score_mod_grad": dict(score_mod=aa.ScoreMod(lambda s, b, h, i, j, t: s + t[h],
                                                 t=np.zeros(4, np.float32)),
                           dout=q, wrt=("t",)),
}
#: what else those problems use of necessity
ALSO = {"bias_grad": {"bias"}, "sinks_grad": {"sinks"}, "score_mod_grad": {"score_mod"}}


class _Stub(Backend):
    name = "stub"

    def __init__(self, caps):
        self.capabilities = caps

    def forward(self, *a):  # pragma: no cover - never called
        raise AssertionError

    def backward(self, *a):  # pragma: no cover - never called
        raise AssertionError


def _problem(name):
    if name == "paged_kv":          # 3 pages of 4 positions, Hkv = Hq: no GQA
        pages = np.zeros((3, 4, 4, 8), np.float32)
        return describe_paged(q, pages, pages, aa.Pages(np.array([[0, 1], [2, 0]]),
                                                        np.array([6, 5])))
    k = q if name != "gqa" else kv
    v = np.zeros((2, 4, 6, 5), np.float32) if name == "value_dim" else k
    return describe(q, k, v, **USES[name])


def test_every_feature_has_a_problem_here_and_a_known_kind():
    assert set(USES) == {f.name for f in features.FEATURES}
    assert features.MASK_TERMS | features.INPUTS | features.GRADIENTS | features.MODIFIERS \
        == set(USES)


@pytest.mark.parametrize("name", sorted(USES))
def test_problem_features_name_exactly_what_it_uses(name):
    p = _problem(name)
    assert p.features == {name} | ALSO.get(name, set())
    assert describe(q, q, q).features == frozenset()


@pytest.mark.parametrize("name", sorted(USES))
def test_a_backend_without_a_feature_refuses_it_with_the_tables_words(name):
    f = features.get(name)
    full = Capabilities(array_kinds=frozenset({"numpy"}), device_types=frozenset({"cpu"}),
                        dtypes=frozenset({"float32"}), mask_terms=features.MASK_TERMS,
                        inputs=features.INPUTS, modifiers=features.MODIFIERS)
    field = {"mask_term": "mask_terms", "input": "inputs", "gradient": "gradients",
             "modifier": "modifiers"}[f.kind]
    lacking = dataclasses.replace(full, **{field: getattr(full, field) - {name}})
    p = _problem(name)
    assert _Stub(full).unsupported_reasons(p) == []
    assert _Stub(lacking).unsupported_reasons(p) == [f.refusal]
    assert not lacking.supports(name) and full.supports(name)


def test_capabilities_refuse_unknown_feature_names_and_plain_strings():
    base = dict(array_kinds=frozenset({"numpy"}), device_types=frozenset({"cpu"}),
                dtypes=frozenset({"float32"}))
    with pytest.raises(ValueError, match=r"modifiers=.*\['softkap'\].*anyattn.features"):
        Capabilities(**base, modifiers=frozenset({"softkap"}))
    with pytest.raises(ValueError, match="mask_terms"):
        Capabilities(**base, mask_terms=frozenset({"softcap"}))   # a modifier, not a term
    with pytest.raises(TypeError, match="expected a set"):
        Capabilities(**base, modifiers="softcap")
    with pytest.raises(ValueError, match="unknown"):
        Capabilities(**base).supports("dilated")


def test_every_backend_declares_known_features():
    from anyattn.backends.numpy_backend import NumpyBackend
    from anyattn.backends.reference_backend import ReferenceBackend

    for be in (NumpyBackend(), ReferenceBackend()):
        assert be.capabilities.features == {f.name for f in features.FEATURES}


def test_value_dim_is_opt_in():
    """The default Capabilities leave value_dim out: a backend that does not name it
    refuses v [B, Hkv, Sk, Dv] with Dv != D in the table's words."""
    caps = Capabilities(array_kinds=frozenset({"numpy"}), device_types=frozenset({"cpu"}),
                        dtypes=frozenset({"float32"}))
    assert caps.inputs == features.INPUTS - {"value_dim", "paged_kv"} == \
        features.DEFAULT_INPUTS
    assert not caps.supports("value_dim")
    assert _Stub(caps).unsupported_reasons(_problem("value_dim")) == \
        [features.get("value_dim").refusal]
    assert _Stub(caps).unsupported_reasons(_problem("gqa")) == []
