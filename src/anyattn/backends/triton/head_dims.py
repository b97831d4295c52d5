"""The Triton backend's head-dim rule, in one place: the largest head dim every kernel
takes, the bound of the wide decoding forward, and ``wide_refusal``, which the
capability check (backend.py) and the route (route.py) both ask.  Imports neither
torch nor Triton, nor any module of the backend's launch path.

Shape legend: D head dim of q and k, Dv of v, Sq queries.
"""
from __future__ import annotations

from typing import FrozenSet, Optional

from ...features import GRADIENTS, MASK_TERMS

__all__ = ["MAX_HEAD_DIM", "WIDE_MAX_HEAD_DIM", "PAGED_MAX_SQ", "WIDE_MASK_CLASSES",
           "WIDE_FEATURES", "wide_refusal"]

#: the largest head dim (D, and Dv) every kernel takes: forward and backward, every mask
#: and modifier, the Hopper path
MAX_HEAD_DIM = 256
#: the largest head dim the forward of decoding shapes takes (the split-key kernel
#: summing q.k over chunks of D and accumulating out in chunks of Dv: DeepSeek's
#: absorbed MLA decoding, D = 576 / Dv = 512, and the like)
WIDE_MAX_HEAD_DIM = 1024
#: the most queries per sequence of a paged forward (route.DECODE_MAX_SQ, the split
#: kernel's; not imported here, so that the capability check imports no Triton), and of
#: a forward above MAX_HEAD_DIM
PAGED_MAX_SQ = 16
#: the mask classes and score features (route.SPLIT_MASKS / SPLIT_FEATURES) the split
#: kernel takes, so those of a forward above MAX_HEAD_DIM
WIDE_MASK_CLASSES = frozenset({"none", "band"})
WIDE_FEATURES = frozenset({"softcap", "alibi", "sinks"})


def wide_refusal(head_dim: int, head_dim_v: int, seq_q: int, backward: bool,
                 mask_class: str, features: FrozenSet[str]) -> Optional[str]:
    """The one rule for head dims above MAX_HEAD_DIM (up to WIDE_MAX_HEAD_DIM, checked
    by the capabilities): they run the forward of decoding shapes only, Sq <=
    PAGED_MAX_SQ queries per sequence, no mask or a band (causal, window), the score
    modifiers softcap / ALiBi / sinks, contiguous or paged caches, GQA / MQA.  None
    where the call fits (or the head dims are <= MAX_HEAD_DIM), else the refusal
    (a sentence after "backend 'triton' ...").  ``features``: the names of
    anyattn.features (or of hopper/coverage.FEATURES) the call uses."""
    if max(head_dim, head_dim_v) <= MAX_HEAD_DIM:
        return None
    lacks = []
    if backward:
        lacks.append("a backward")
    if seq_q > PAGED_MAX_SQ:
        lacks.append(f"Sq = {seq_q} queries")
    if mask_class not in WIDE_MASK_CLASSES:
        lacks.append(f"a {mask_class} mask")
    extra = sorted(set(features) - WIDE_FEATURES - MASK_TERMS - GRADIENTS
                   - {"gqa", "value_dim", "paged_kv"})
    if extra:
        lacks.append(", ".join(extra))
    if not lacks:
        return None
    return (f"runs head dims above {MAX_HEAD_DIM} (here D = {head_dim}, Dv = "
            f"{head_dim_v}) only in the forward of decoding shapes (Sq <= {PAGED_MAX_SQ}, "
            "no mask or a causal / window band, softcap / ALiBi / sinks), not with "
            f"{' and '.join(lacks)}; use backend='numpy' (or 'reference') for it")
