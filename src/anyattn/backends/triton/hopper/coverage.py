"""What the Hopper path covers, as data, and the predicate that says why a call is not
covered.

Shape legend: B batch, H query heads, Sq / Sk queries / keys, D head dim.  A call the
table does not cover goes to the portable kernels (routing, documented in
docs/triton.md "Hopper path"); ANYATTN_TRITON_PATH=hopper on such a call raises with
the reason instead.
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


#: direction -> coverage (None: no Hopper kernel for that direction yet)
COVERAGE = {
    "forward": Coverage(capabilities=frozenset({(9, 0)}),
                        dtypes=frozenset({"float16", "bfloat16"}),
                        # D=64 compiles and passes too, but measured 0.79x / 0.80x the
                        # portable forward (H200 2026-12-03, B=4 H=32 S=4k, docs/perf/
                        # hopper-h200-2026-12-03.json); session 6 (hopper-fwd-h200-
                        # 2026-12-03-s6.json, S=2k/4k/8k): the best warp-specialised
                        # variant (3 consumers, ws192x128s3opfem) 0.99-1.06x portable
                        # without a mask but 0.63-0.97x causal, the 2-consumer one
                        # 0.89-0.98x: it stays portable until it wins on both.  Session 8
                        # (hopper-fwd-h200-2026-12-04-s8.json, bf16 S=2k / 8k): P in
                        # registers ('opf') wins on both, with the mask choosing the tile:
                        # ws192x128s3opf 1.15 / 1.23x portable without a mask (1.00 /
                        # 1.08x cuDNN), ws128x128s3opf 1.005 / 1.10x causal; not routed
                        # yet: no float64 GPU check of them finished, and configs key on
                        # (D, dtype), not on the mask
                        head_dims=frozenset({128}),
                        # Documents / KeepMask (session 7): the range table at the 128 x
                        # 128 tile, document key intervals / ids / keep bytes on edge tiles
                        # only (fwd_masks.py).  Routed by 'auto' where the H200 showed it
                        # faster than the portable forward: documents, causal or not
                        # (2026-12-04 01:06 UTC, B=4 H=16 S=4k D=128 bf16, device-only fwd
                        # 0.59-0.69x the portable's; docs/perf/masks-flex-h200-2026-12-04-
                        # s7.json); KeepMask classes covered, not timed: not routed
                        mask_classes=frozenset({"none", "band", "documents", "keep",
                                                "band+documents", "band+keep",
                                                "documents+keep", "band+documents+keep"}),
                        auto_mask_classes=frozenset({"none", "band", "documents",
                                                     "band+documents"})),
    # configs.bwd_config: the warp-specialised dK/dV kernel (bwd_ws_kernel.py); the delta
    # preprocess and dQ stay portable.  Routed by 'auto' at D=128: timed end to end on
    # the H200 (2026-12-04 01:04 UTC, docs/perf/hopper-bwd-h200-2026-12-04-s7.json, 3
    # rotated rounds) that route ran 1.05-1.09x the portable backward (S=2k / 8k, causal
    # and not, every round faster); at D=64 (S=4k) 0.995x / 1.004x, so D=64 stays
    # portable under 'auto' (ANYATTN_TRITON_PATH=hopper runs it).  Session 6's routes
    # (the fused dK/dV kernel: 0.94-0.99x; its in-kernel dQ 0.81-0.85x) stay variants
    "backward": Coverage(capabilities=frozenset({(9, 0)}),
                         dtypes=frozenset({"float16", "bfloat16"}),
                         head_dims=frozenset({64, 128}),
                         mask_classes=frozenset({"none", "band"}),
                         auto_head_dims=frozenset({128})),
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
    return ((mask_class is None or cov.auto_mask_classes is None
             or mask_class in cov.auto_mask_classes)
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
    if p.mask_class not in cov.mask_classes:
        return f"mask class {p.mask_class} (covers {sorted(cov.mask_classes)})"
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
