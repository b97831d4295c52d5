"""What the Hopper path covers, as data, and the predicate that says why a call is not
covered.

Shape legend: B batch, H query heads, Sq / Sk queries / keys, D head dim.  A call the
table does not cover goes to the portable kernels (backends/triton/launch.py
_use_hopper); ANYATTN_TRITON_PATH=hopper on such a call raises with the reason
instead.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import FrozenSet, Optional, Tuple

__all__ = ["Coverage", "COVERAGE", "supports", "path_setting", "routed_by_default"]


@dataclass(frozen=True)
class Coverage:
    """One direction's coverage: compute capabilities, dtypes, head dims, mask classes;
    every score feature not listed (bias, softcap, ALiBi, sinks, dropout) is outside."""

    capabilities: FrozenSet[Tuple[int, int]]
    dtypes: FrozenSet[str]
    head_dims: FrozenSet[int]
    mask_classes: FrozenSet[str]
    #: whether ANYATTN_TRITON_PATH=auto routes covered calls here (False: the kernel is
    #: correct on what it covers but measured slower than the portable path; only
    #: ANYATTN_TRITON_PATH=hopper runs it)
    auto: bool = True
    #: the mask classes 'auto' routes here (None: every covered one); the others are
    #: covered but measured no faster than the portable path
    auto_mask_classes: Optional[FrozenSet[str]] = None
    #: the head dims 'auto' routes here (None: every covered one); the others likewise
    auto_head_dims: Optional[FrozenSet[int]] = None
    #: (head dim, mask classes) pairs: the mask classes covered at that head dim where
    #: fewer than ``mask_classes`` (head dims not listed: ``mask_classes``)
    mask_classes_by_head_dim: Tuple[Tuple[int, FrozenSet[str]], ...] = ()
    #: (head dim, mask classes) pairs: the mask classes 'auto' routes at that head dim
    #: (in place of ``auto_mask_classes`` there)
    auto_mask_classes_by_head_dim: Tuple[Tuple[int, FrozenSet[str]], ...] = ()

    def covered_mask_classes(self, head_dim: Optional[int]) -> FrozenSet[str]:
        """The mask classes covered at ``head_dim`` (None: at every covered head dim)."""
        return dict(self.mask_classes_by_head_dim).get(head_dim, self.mask_classes)

    def auto_classes(self, head_dim: Optional[int]) -> Optional[FrozenSet[str]]:
        """The mask classes 'auto' routes at ``head_dim`` (None: every covered one)."""
        return dict(self.auto_mask_classes_by_head_dim).get(head_dim, self.auto_mask_classes)


#: direction -> coverage (None: no Hopper kernel for that direction yet)
COVERAGE = {
    # D=64: no mask and bands only (the array masks were never checked at D=64).  'auto'
    # routes every covered class but KeepMask (covered, never timed against the portable
    # forward)
    "forward": Coverage(capabilities=frozenset({(9, 0)}),
                        dtypes=frozenset({"float16", "bfloat16"}),
                        head_dims=frozenset({64, 128}),
                        mask_classes_by_head_dim=((64, frozenset({"none", "band"})),),
                        auto_mask_classes_by_head_dim=((64, frozenset({"none", "band"})),),
                        mask_classes=frozenset({"none", "band", "documents", "keep",
                                                "band+documents", "band+keep",
                                                "documents+keep", "band+documents+keep"}),
                        auto_mask_classes=frozenset({"none", "band", "documents",
                                                     "band+documents"})),
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
                         auto_mask_classes_by_head_dim=((64, frozenset({"none", "band"})),)),
}

_PATHS = ("auto", "portable", "hopper")


def path_setting() -> str:
    """ANYATTN_TRITON_PATH: 'auto' (default: Hopper where covered), 'portable', 'hopper'
    (raise where not covered)."""
    v = os.environ.get("ANYATTN_TRITON_PATH", "auto").strip().lower() or "auto"
    if v not in _PATHS:
        raise ValueError(f"ANYATTN_TRITON_PATH={v!r}: expected one of {', '.join(_PATHS)}")
    return v


@functools.lru_cache(maxsize=None)
def _capability(device: str) -> Tuple[int, int]:
    import torch

    return tuple(torch.cuda.get_device_capability(device))


def routed_by_default(direction: str, mask_class: Optional[str] = None,
                      head_dim: Optional[int] = None) -> bool:
    """Whether ANYATTN_TRITON_PATH=auto sends covered calls of ``direction`` (with a mask
    of ``mask_class`` and head dim ``head_dim``; None: any) to Hopper."""
    cov = COVERAGE.get(direction)
    if cov is None or not cov.auto:
        return False
    auto_classes = cov.auto_classes(head_dim)
    return ((mask_class is None or auto_classes is None or mask_class in auto_classes)
            and (head_dim is None or cov.auto_head_dims is None
                 or head_dim in cov.auto_head_dims))


def _tensor_reason(name: str, x) -> Optional[str]:
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


def supports(p, direction: str, tensors=(), mods=None) -> Optional[str]:
    """None if the Hopper path computes this call, else the reason it does not.
    ``tensors``: (name, tensor) pairs the kernels would read through TMA."""
    cov = COVERAGE.get(direction)
    if cov is None:
        return f"no Hopper {direction} kernel yet"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "the Triton interpreter runs the portable kernels only"
    if not str(p.device).startswith("cuda"):
        return f"needs a CUDA device, got {p.device}"
    try:
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
    except ImportError:
        return "needs triton.experimental.gluon (Triton >= 3.5)"
    cc = _capability(str(p.device))
    if tuple(cc) not in cov.capabilities:
        return f"compute capability {cc[0]}.{cc[1]} (covers {sorted(cov.capabilities)})"
    if p.dtype not in cov.dtypes:
        return f"dtype {p.dtype} (covers {sorted(cov.dtypes)})"
    if p.head_dim not in cov.head_dims:
        return f"head_dim {p.head_dim} (covers {sorted(cov.head_dims)})"
    classes = cov.covered_mask_classes(p.head_dim)
    if p.mask_class not in classes:
        return (f"mask class {p.mask_class} at head_dim {p.head_dim} (covers "
                f"{sorted(classes)})")
    feats = [n for n, on in (("bias", p.has_bias), ("softcap", p.softcap is not None),
                             ("alibi", p.has_alibi), ("sinks", p.has_sinks),
                             ("dropout", p.has_dropout)) if on]
    if feats:
        return f"score features {', '.join(feats)} (the Hopper path has none)"
    if p.is_empty or min(p.batch, p.heads_q, p.seq_q, p.seq_k) == 0:
        return "an empty problem"
    if p.precision not in ("highest", "tf32"):
        return f"precision {p.precision}"
    for name, x in tensors:
        why = _tensor_reason(name, x)
        if why:
            return why
    return None
