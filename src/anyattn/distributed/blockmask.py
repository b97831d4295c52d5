"""A global mask cut into the chunk pairs of a ring.

Shape legend: B batch, Hq query heads, S global sequence length, L chunk length.

The user gives one mask for the whole sequence.  Band terms (``Causal``,
``Window``) are position rules: they travel unchanged and the chunk pair's
global offsets (``q_offset``/``k_offset``) place them.  Array terms are
global too (``Documents`` ids of length S, ``KeepMask`` broadcastable to
[B, Hq, S, S]) and are sliced to each chunk pair, because the core indexes
array masks locally.

Each chunk pair is classified once on the host: ``EMPTY`` (no kept pair: the
block is skipped), ``FULL`` (every pair kept: called with no mask at all) or
``PARTIAL``.
"""
from __future__ import annotations

from typing import Optional, Tuple

import numpy as np

from ..arrays import to_numpy
from ..masks import AndMask, Causal, Documents, KeepMask, Mask, Window, resolve
from .sharding import Chunk

__all__ = ["EMPTY", "PARTIAL", "FULL", "GlobalMask"]

EMPTY, PARTIAL, FULL = "empty", "partial", "full"


def _terms(mask: Optional[Mask]) -> Tuple[Mask, ...]:
    if mask is None:
        return ()
    if not isinstance(mask, Mask):
        raise TypeError(f"mask: expected None, Causal, Window, Documents, KeepMask or their "
                        f"& composition, got {type(mask).__name__}")
    return mask.terms if isinstance(mask, AndMask) else (mask,)


def _and(terms) -> Optional[Mask]:
    terms = tuple(terms)
    if not terms:
        return None
    return terms[0] if len(terms) == 1 else AndMask(terms)


class GlobalMask:
    """The user's mask over global length ``seq``, cut per chunk pair."""

    def __init__(self, mask: Optional[Mask], seq: int, batch: int, heads_q: int):
        self.seq = seq
        self.band = []
        self.docs = []
        self.keeps = []
        for t in _terms(mask):
            if isinstance(t, (Causal, Window)):
                self.band.append(t)
            elif isinstance(t, Documents):
                for name in ("q_ids", "k_ids"):
                    ids = getattr(t, name)
                    if ids.shape[-1] != seq or (ids.ndim == 2 and ids.shape[0] not in (1, batch)):
                        raise ValueError(
                            f"mask: Documents({name}=...) has shape {tuple(ids.shape)}; ring "
                            f"attention takes the GLOBAL ids, shape [{seq}] or [{batch}, {seq}] "
                            "(the same on every rank)")
                self.docs.append(t)
            elif isinstance(t, KeepMask):
                m = t.mask
                shp = (1,) * (4 - m.ndim) + tuple(m.shape)
                target = (batch, heads_q, seq, seq)
                if any(h not in (1, w) for h, w in zip(shp, target)):
                    raise ValueError(
                        f"mask: KeepMask has shape {tuple(m.shape)}; ring attention takes the "
                        f"GLOBAL mask, broadcastable to [B, Hq, S, S] = {list(target)}")
                self.keeps.append(m.reshape(shp))
            else:
                raise TypeError(f"mask: term {t!r} is not supported by ring attention; "
                                "expected Causal, Window, Documents or KeepMask terms")
        self._doc_np = [(_ids2(to_numpy(d.q_ids)), _ids2(to_numpy(d.k_ids))) for d in self.docs]

    @property
    def is_none(self) -> bool:
        return not (self.band or self.docs or self.keeps)

    # ------------------------------------------------------------------ per pair
    def _band_state(self, qc: Chunk, kc: Chunk) -> str:
        if not self.band:
            return FULL
        r = resolve(_and(self.band), 1, 1, qc.length, kc.length,
                    q_offset=qc.start, k_offset=kc.start)
        dmin, dmax = -(qc.length - 1), kc.length - 1          # j - i over the pair
        lo = -np.inf if r.band_lo is None else r.band_lo
        hi = np.inf if r.band_hi is None else r.band_hi
        if dmax < lo or dmin > hi:
            return EMPTY
        return FULL if (dmin >= lo and dmax <= hi) else PARTIAL

    def _docs_disjoint(self, qc: Chunk, kc: Chunk) -> bool:
        """True if, in every batch row, no query id of qc appears among kc's key ids."""
        for qd, kd in self._doc_np:
            nb = max(qd.shape[0], kd.shape[0])
            for b in range(nb):
                qa = qd[min(b, qd.shape[0] - 1), qc.start:qc.start + qc.length]
                ka = kd[min(b, kd.shape[0] - 1), kc.start:kc.start + kc.length]
                if np.intersect1d(qa, ka).size:
                    break
            else:
                return True
        return False

    def state(self, qc: Chunk, kc: Chunk) -> str:
        """EMPTY, PARTIAL or FULL for queries of chunk ``qc`` against keys of ``kc``."""
        band = self._band_state(qc, kc)
        if band == EMPTY or self._docs_disjoint(qc, kc):
            return EMPTY
        if band == FULL and not self.docs and not self.keeps:
            return FULL
        return PARTIAL

    def pair_mask(self, qc: Chunk, kc: Chunk, state: str) -> Optional[Mask]:
        """The core mask for one chunk pair (use with q_offset=qc.start, k_offset=kc.start)."""
        if state == FULL:
            return None
        qs, ks = slice(qc.start, qc.start + qc.length), slice(kc.start, kc.start + kc.length)
        terms = [] if self._band_state(qc, kc) == FULL else list(self.band)
        for d in self.docs:
            terms.append(Documents(d.q_ids[..., qs], d.k_ids[..., ks]))
        for m in self.keeps:
            mq = qs if m.shape[2] > 1 else slice(None)
            mk = ks if m.shape[3] > 1 else slice(None)
            terms.append(KeepMask(m[:, :, mq, mk]))
        return _and(terms)


def _ids2(ids: np.ndarray) -> np.ndarray:
    return ids if ids.ndim == 2 else ids[None]
