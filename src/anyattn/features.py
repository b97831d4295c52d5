"""Every feature a problem can use, as one table: the single place that names them.

A *feature* is something a backend may or may not support: a lowered mask term
(``band``, ``documents``, ``keep``; see :data:`anyattn.masks.TERM_KINDS`), an input
(``bias``, ``gqa``, ``value_dim``), a gradient (``bias_grad``, ``sinks_grad``) or a
modifier of the scores or probabilities (``softcap``, ``alibi``, ``sinks``, ``dropout``,
and ``score_mod``, a user's score function; :data:`BUILTIN_MODIFIERS` are the others).
Each entry
holds its name, its kind, the words a refusal uses and the predicate that says
whether a :class:`~anyattn.problem.Problem` uses it.

``Problem.features`` is the set of names a problem uses;
:class:`~anyattn.backends.base.Capabilities` names what a backend supports as sets of
these names (one set per kind) and ``Backend.unsupported_reasons`` derives every
refusal message from this table.  A new feature is one entry here (mask terms: one
entry in ``TERM_KINDS``, which this table reads), one name in the declarations of
the backends that implement it, and its implementation in each of them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, FrozenSet, Tuple

from .masks import TERM_KINDS

__all__ = ["Feature", "FEATURES", "KINDS", "names_of", "features_of", "MASK_TERMS",
           "INPUTS", "DEFAULT_INPUTS", "GRADIENTS", "MODIFIERS", "BUILTIN_MODIFIERS",
           "FUNCTION_MODIFIERS"]

#: the kinds of feature, each one set of :class:`~anyattn.backends.base.Capabilities`
KINDS = ("mask_term", "input", "gradient", "modifier")


@dataclass(frozen=True)
class Feature:
    """One feature: ``name`` (unique), ``kind`` (one of :data:`KINDS`), ``refusal``
    (the sentence after "backend X ..." when a backend lacks it), ``used``
    (Problem -> bool) and ``opt_in``: an input that the default
    :class:`~anyattn.backends.base.Capabilities` leave out, so that only backends
    naming it support it (mask terms and modifiers are always named)."""

    name: str
    kind: str
    refusal: str
    used: Callable[[Any], bool]
    opt_in: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"Feature {self.name!r}: kind {self.kind!r} is not one of {KINDS}")


def _term(name: str) -> Feature:
    kind = TERM_KINDS[name]
    return Feature(name, "mask_term", kind.refusal, lambda p: kind.present(p.mask))


#: every feature, in the order refusals are listed
FEATURES: Tuple[Feature, ...] = tuple(_term(n) for n in TERM_KINDS) + (
    Feature("bias", "input", "does not support an additive bias", lambda p: p.has_bias),
    Feature("bias_grad", "gradient", "does not compute the bias gradient",
            lambda p: "bias" in p.wrt),
    Feature("gqa", "input", "does not support GQA/MQA (Hq != Hkv)", lambda p: p.group > 1),
    Feature("value_dim", "input", "does not support a value head dim different from the "
            "query/key head dim (v [B, Hkv, Sk, Dv] with Dv != D)",
            lambda p: p.head_dim_v != p.head_dim, opt_in=True),
    Feature("paged_kv", "input", "does not read paged key/value caches (pages=); gather the "
            "pages into k/v [B, Hkv, Sk, D] or use backend='numpy'",
            lambda p: p.pages is not None, opt_in=True),
    Feature("softcap", "modifier", "does not support softcap (logit soft-capping)",
            lambda p: p.softcap is not None),
    Feature("alibi", "modifier", "does not support alibi_slopes", lambda p: p.has_alibi),
    Feature("sinks", "modifier", "does not support sinks (attention sinks)",
            lambda p: p.has_sinks),
    Feature("sinks_grad", "gradient", "does not compute the sinks gradient (dsinks)",
            lambda p: "sinks" in p.wrt),
    Feature("dropout", "modifier", "does not support dropout_p > 0", lambda p: p.has_dropout),
    Feature("score_mod", "modifier", "does not support score_mod (score functions)",
            lambda p: p.score_mod is not None),
    Feature("score_mod_grad", "gradient",
            "does not compute gradients of score_mod captures (dcaptures)",
            lambda p: bool(p.capture_wrt)),
)

_BY_NAME: Dict[str, Feature] = {f.name: f for f in FEATURES}
if len(_BY_NAME) != len(FEATURES):  # pragma: no cover - a table error, caught by import
    raise ValueError("anyattn.features: two features share a name")


def names_of(kind: str) -> FrozenSet[str]:
    """The names of every feature of ``kind``."""
    if kind not in KINDS:
        raise ValueError(f"names_of: kind {kind!r} is not one of {KINDS}")
    return frozenset(f.name for f in FEATURES if f.kind == kind)


def features_of(p) -> FrozenSet[str]:
    """The names of the features problem ``p`` uses."""
    return frozenset(f.name for f in FEATURES if f.used(p))


def get(name: str) -> Feature:
    """The feature called ``name`` (ValueError naming the known ones otherwise)."""
    try:
        return _BY_NAME[name]
    except KeyError:
        raise ValueError(f"feature {name!r} is unknown; expected one of "
                         f"{sorted(_BY_NAME)}") from None


MASK_TERMS = names_of("mask_term")
INPUTS = names_of("input")
#: the inputs a backend supports unless it says otherwise (all but the opt-in ones)
DEFAULT_INPUTS = frozenset(f.name for f in FEATURES if f.kind == "input" and not f.opt_in)
GRADIENTS = names_of("gradient")
MODIFIERS = names_of("modifier")
#: the modifiers that are user functions (lowered per function, not a fixed formula)
FUNCTION_MODIFIERS = frozenset({"score_mod"})
#: the modifiers with a fixed formula (softcap, ALiBi, sinks, dropout): what a backend
#: that lowers no user function declares
BUILTIN_MODIFIERS = MODIFIERS - FUNCTION_MODIFIERS
