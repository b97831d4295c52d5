"""What the Hopper path covers, as data, and the predicate that says why a call is not
covered.  Score features: Coverage.features (covered) and Coverage.auto_features (of
those, what ANYATTN_TRITON_PATH=auto routes); the modifiers the kernels compute
(MOD_FEATURES) are covered with no mask or a band, and 'auto' keeps them on the
portable kernels until a GPU run has checked and timed them.

Shape legend: B batch, H query heads, Sq / Sk queries / keys, D head dim.  A call the
table does not cover goes to the portable kernels (backends/triton/route.py, which
reads this table); ANYATTN_TRITON_PATH=hopper on such a call raises with the reason
instead.  Everything here takes plain data (route.ProblemFacts / DeviceFacts), so it
runs without a GPU.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import FrozenSet, Optional, Tuple

__all__ = ["Coverage", "COVERAGE", "FEATURES", "MOD_FEATURES", "uncovered",
           "routed_by_default", "auto_reason", "tensor_reason", "layout_reason"]

#: the score features a problem may have (route.ProblemFacts.features); a direction
#: covers those of its Coverage.features
FEATURES = ("bias", "softcap", "alibi", "sinks", "dropout", "score_mod", "mask_mod")
#: the score modifiers the Hopper kernels compute (constexpr switches of the routed
#: no-mask / band kernels; the portable kernels' math): covered, not routed by 'auto'
#: until a GPU run has checked and timed them
MOD_FEATURES = frozenset({"softcap", "alibi", "sinks"})


@dataclass(frozen=True)
class Coverage:
    """One direction's coverage: compute capabilities, dtypes, head dims, mask classes,
    score features; every score feature not in ``features`` is outside."""

    capabilities: FrozenSet[Tuple[int, int]]
    dtypes: FrozenSet[str]
    head_dims: FrozenSet[int]
    mask_classes: FrozenSet[str]
    #: the mask classes ANYATTN_TRITON_PATH=auto routes here (None: every covered one);
    #: the others are covered but only ANYATTN_TRITON_PATH=hopper runs them
    auto_mask_classes: Optional[FrozenSet[str]] = None
    #: (head dim, mask classes) pairs: the mask classes covered at that head dim where
    #: fewer than ``mask_classes`` (head dims not listed: ``mask_classes``)
    mask_classes_by_head_dim: Tuple[Tuple[int, FrozenSet[str]], ...] = ()
    #: (head dim, mask classes) pairs: the mask classes 'auto' routes at that head dim
    #: (in place of ``auto_mask_classes`` there)
    auto_mask_classes_by_head_dim: Tuple[Tuple[int, FrozenSet[str]], ...] = ()
    #: the score features (FEATURES names) covered, with a mask of a class in
    #: ``feature_mask_classes`` only
    features: FrozenSet[str] = frozenset()
    #: the covered features 'auto' routes here; the others only ANYATTN_TRITON_PATH=hopper
    auto_features: FrozenSet[str] = frozenset()
    #: the mask classes a call with score features may have
    feature_mask_classes: FrozenSet[str] = frozenset({"none", "band"})
    #: (head dim, features) pairs: the score features covered at that head dim where
    #: fewer than ``features`` (head dims not listed: ``features``)
    features_by_head_dim: Tuple[Tuple[int, FrozenSet[str]], ...] = ()

    def covered_features(self, head_dim: Optional[int]) -> FrozenSet[str]:
        """The score features covered at ``head_dim`` (None: at every covered head dim)."""
        return dict(self.features_by_head_dim).get(head_dim, self.features)

    def covered_mask_classes(self, head_dim: Optional[int]) -> FrozenSet[str]:
        """The mask classes covered at ``head_dim`` (None: at every covered head dim)."""
        return dict(self.mask_classes_by_head_dim).get(head_dim, self.mask_classes)

    def auto_classes(self, head_dim: Optional[int]) -> Optional[FrozenSet[str]]:
        """The mask classes 'auto' routes at ``head_dim`` (None: every covered one)."""
        return dict(self.auto_mask_classes_by_head_dim).get(head_dim, self.auto_mask_classes)


#: direction -> coverage
COVERAGE = {
    # D=64: no mask and bands only (the array masks were never checked at D=64).  'auto'
    # routes every covered class but KeepMask (covered, never timed against the portable
    # forward).  D=256: no mask and bands without score features, covered; 'auto' routes
    # none of them until a GPU run has checked and timed them
    "forward": Coverage(capabilities=frozenset({(9, 0)}),
                        dtypes=frozenset({"float16", "bfloat16"}),
                        head_dims=frozenset({64, 128, 256}),
                        mask_classes_by_head_dim=((64, frozenset({"none", "band"})),
                                                  (256, frozenset({"none", "band"}))),
                        auto_mask_classes_by_head_dim=((64, frozenset({"none", "band"})),
                                                       (256, frozenset())),
                        mask_classes=frozenset({"none", "band", "documents", "keep",
                                                "band+documents", "band+keep",
                                                "documents+keep", "band+documents+keep"}),
                        auto_mask_classes=frozenset({"none", "band", "documents",
                                                     "band+documents"}),
                        features=MOD_FEATURES,
                        features_by_head_dim=((256, frozenset()),)),
    # Documents / KeepMask at D=128 only.  Not routed by 'auto': on the device faster
    # than the portable backward, but this route costs more host time per eager step and
    # an array-mask step cannot be graph-captured, so the user's eager step is slower at
    # moderate lengths; ANYATTN_TRITON_PATH=hopper takes it
    "backward": Coverage(capabilities=frozenset({(9, 0)}),
                         dtypes=frozenset({"float16", "bfloat16"}),
                         head_dims=frozenset({64, 128}),
                         mask_classes=frozenset({"none", "band", "documents", "keep",
                                                 "band+documents", "band+keep",
                                                 "documents+keep", "band+documents+keep"}),
                         mask_classes_by_head_dim=((64, frozenset({"none", "band"})),),
                         auto_mask_classes=frozenset({"none", "band"}),
                         auto_mask_classes_by_head_dim=((64, frozenset({"none", "band"})),),
                         features=MOD_FEATURES),
}


def routed_by_default(direction: str, mask_class: Optional[str] = None,
                      head_dim: Optional[int] = None, features=()) -> bool:
    """Whether ANYATTN_TRITON_PATH=auto sends covered calls of ``direction`` (with a mask
    of ``mask_class`` and head dim ``head_dim``; None: any; with the score features
    ``features``) to Hopper."""
    return auto_reason(direction, mask_class, head_dim, features) is None


def auto_reason(direction: str, mask_class: Optional[str] = None,
                head_dim: Optional[int] = None, features=()) -> Optional[str]:
    """None where ANYATTN_TRITON_PATH=auto routes a covered call of ``direction`` to
    Hopper (routed_by_default's arguments), else why not, in one line."""
    cov = COVERAGE[direction]
    auto_classes = cov.auto_classes(head_dim)
    if auto_classes is not None and not auto_classes and head_dim in cov.head_dims:
        return f"head_dim {head_dim} (never checked and timed on a GPU)"
    if not (mask_class is None or auto_classes is None or mask_class in auto_classes):
        return f"mask class {mask_class} at head_dim {head_dim}"
    held = [f for f in FEATURES if f in features and f not in cov.auto_features]
    if held:
        return (f"score features {', '.join(held)} (covered, never checked and timed on a "
                "GPU)")
    return None


def tensor_reason(name: str, x) -> Optional[str]:
    """None if the kernels can read tensor ``x`` through TMA, else why not."""
    if x.stride(-1) != 1 and x.shape[-1] > 1:
        return f"{name} has last-dim stride {x.stride(-1)} (TMA needs 1)"
    esz = x.element_size()
    for d, (n, s) in enumerate(zip(x.shape[:-1], x.stride()[:-1])):
        if n > 1 and s == 0:
            return f"{name} is broadcast along dim {d} (stride 0; TMA needs real strides)"
        if n > 1 and (s * esz) % 16:
            return f"{name} stride {s} of dim {d} is not a multiple of 16 bytes (TMA)"
    if x.data_ptr() % 16:
        return f"{name} is not 16-byte aligned (TMA)"
    return None


def layout_reason(tensors) -> Optional[str]:
    """None if every (name, tensor) pair can be read through TMA, else the first reason."""
    for name, x in tensors:
        why = tensor_reason(name, x)
        if why:
            return why
    return None


def uncovered(problem, direction: str, device) -> Optional[str]:
    """None if the Hopper path computes this call, else the reason it does not, in one
    line.  ``problem``: route.ProblemFacts; ``device``: route.DeviceFacts (plain data:
    no GPU is asked)."""
    cov = COVERAGE[direction]
    if device.interpreter:
        return "the Triton interpreter runs the portable kernels only"
    if device.kind != "cuda":
        return f"needs a CUDA device, got {device.kind}"
    if not device.gluon:
        return "needs triton.experimental.gluon (Triton >= 3.5)"
    cc = device.capability
    if tuple(cc) not in cov.capabilities:
        return f"compute capability {cc[0]}.{cc[1]} (covers {sorted(cov.capabilities)})"
    if problem.dtype not in cov.dtypes:
        return f"dtype {problem.dtype} (covers {sorted(cov.dtypes)})"
    if problem.value_dim != problem.head_dim:
        return (f"value head_dim {problem.value_dim} != head_dim {problem.head_dim} (the "
                "Hopper kernels take one head dim for q, k and v)")
    if problem.head_dim not in cov.head_dims:
        return f"head_dim {problem.head_dim} (covers {sorted(cov.head_dims)})"
    classes = cov.covered_mask_classes(problem.head_dim)
    if problem.mask_class not in classes:
        return (f"mask class {problem.mask_class} at head_dim {problem.head_dim} (covers "
                f"{sorted(classes)})")
    covered = cov.covered_features(problem.head_dim)
    feats = [f for f in FEATURES if f in problem.features and f not in covered]
    if feats:
        return (f"score features {', '.join(feats)} (the Hopper {direction} covers "
                f"{', '.join(f for f in FEATURES if f in covered) or 'none'} at head_dim "
                f"{problem.head_dim})")
    if problem.features and problem.mask_class not in cov.feature_mask_classes:
        return (f"score features with mask class {problem.mask_class} (covered with "
                f"{', '.join(sorted(cov.feature_mask_classes))} only)")
    if problem.empty:
        return "an empty problem"
    if problem.precision not in ("highest", "tf32"):
        return f"precision {problem.precision}"
    if problem.layout is not None:
        return problem.layout
    return None
