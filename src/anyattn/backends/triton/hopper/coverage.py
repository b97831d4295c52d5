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
    "forward": Coverage(capabilities=frozenset({(9, 0)}),
                        dtypes=frozenset({"float16", "bfloat16"}),
                        # D=64: routed without a mask only.  Sessions 4-6 measured every
                        # D=64 Hopper forward at 0.63-1.06x the portable one; session 8
                        # (hopper-fwd-h200-2026-12-04-s8.json, bf16 S=2k / 8k) the
                        # schedule with P in registers wins, the mask choosing the tile
                        # (configs.fwd_config): ws192x128s3opf 1.15 / 1.23x portable with
                        # no mask (1.00 / 1.08x cuDNN); with a causal band
                        # ws128x128s3opf 1.005 / 1.10x, even at S=2k.  Session 9 (H200
                        # 2026-12-04 09:55 UTC, hopper-fwd-h200-2026-12-04-s9.json): its
                        # loop in the persistent kernel on the host-built schedule
                        # (ws128x128s3opfPg) 1.10 / 1.12 / 1.14x portable causal at S=2k /
                        # 4k / 8k (fp16 4k 1.15x), every pass: bands routed.  Windows at
                        # D=64 take the same config, untimed.  The array masks
                        # (Documents / KeepMask) were never checked at D=64: not covered
                        head_dims=frozenset({64, 128}),
                        mask_classes_by_head_dim=((64, frozenset({"none", "band"})),),
                        auto_mask_classes_by_head_dim=((64, frozenset({"none", "band"})),),
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
    # launch.backward_config: since session 8 the warp-specialised kernel with dQ inside
    # (one partial per key tile, 'wdkdvq128x64s2nh'; the delta preprocess stays
    # portable), where a (batch, kv head) has at most half the SMs' worth of key tiles,
    # else session 7's warp-specialised dK/dV + portable dQ.  Routed by 'auto' at D=128
    # (H200 2026-12-04 05:16 UTC, 3 rotated rounds, every round faster: 1.13 / 1.14 /
    # 1.10 / 1.15x session 7's route at S=2k / 2k causal / 8k / 8k causal, 0.82-0.90x
    # cuDNN; docs/perf/hopper-bwd-h200-2026-12-04-s8c.json) and at D=64 with a band
    # (S=4k causal 1.12x; without a mask 0.93x the portable backward: D=64 without a band
    # stays portable; session 7's route there was even with it).  Session 10: D=64
    # without a mask routed too, to 'wdkdvq128x128s2nht' (the transposed consumers, query
    # tiles of 128 rows; configs._BWD_BY_MASK): 1.08-1.14x the portable backward at S=2k
    # / 4k / 8k in every rotated round (H200 2026-12-04 12:40 UTC,
    # docs/perf/hopper-bwd-h200-2026-12-04-s10-bm*.json).  Session 11: D=128 runs 'nhr'
    # ('nh' with the row statistics staged in shared memory by the producer; bitwise the
    # same results), 1.06-1.11x 'nh' (H200 2026-12-04 14:41 UTC, docs/perf/hopper-bwd-
    # h200-2026-12-04-s11.json); D=64, with a band or without, the 128-row transposed
    # consumers with the statistics staged the same way ('wdkdvq128x128s2nhtr'), 1.12x /
    # 1.06x the previous routes at S=4k / 4k causal (15:21 UTC, ...-s11-tr-d64.json)
    # Documents / KeepMask (session 9): the same kernels with the column range table,
    # the dQ rank table and the edge tiles' array masks (launch.bwd_mask_tables,
    # bwd_ws_parts.array_keep), checked vs float64 at D=128 and D=64 (GPU tests, H200
    # 2026-12-04 10:01 UTC); covered at D=128 only (D=64: arrays not timed, the forward
    # does not cover them there).  Not routed by 'auto': the device-only backward is
    # 0.85-0.97x the portable one in every round of all 8 document cases (H200 10:02
    # UTC, B=4 H=16 S=4k / 8k D=128 bf16, 3 rotated rounds; docs/perf/
    # masks-flex-bwd-h200-2026-12-04-s9.json), KeepMask 0.87x (10:23 UTC, 2 rounds), but
    # this route costs 0.4-0.6 ms more host time per eager step than the portable
    # backward, and a Documents / KeepMask step cannot be graph-captured: at S=4k the
    # user's eager step (host included) was 1.2-1.4x the portable route's, at 8k
    # 0.94-0.98x.  ANYATTN_TRITON_PATH=hopper takes it
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
