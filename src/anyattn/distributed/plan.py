"""Which chunk pairs a rank computes at each ring step.

Shape legend: N ranks, r this rank, t ring step (0..N-1).

At step t rank r holds the key/value shard of rank ``(r - t) mod N``.  For
every (query chunk of r) x (key chunk of that shard) pair that the mask does
not exclude entirely, the plan lists one :class:`PairCall`: local row ranges,
global offsets and the sliced core mask.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from ..masks import Mask
from .blockmask import EMPTY, FULL, GlobalMask
from .sharding import Chunk, chunks_of

__all__ = ["PairCall", "RingPlan"]


@dataclass(frozen=True)
class PairCall:
    """One core call: queries of chunk ``qc`` against keys of chunk ``kc``."""

    qc: Chunk
    kc: Chunk
    mask: Optional[Mask]
    full: bool           # every pair kept (the call carries no mask)

    @property
    def q_rows(self) -> slice:
        return slice(self.qc.local, self.qc.local + self.qc.length)

    @property
    def k_rows(self) -> slice:
        return slice(self.kc.local, self.kc.local + self.kc.length)


class RingPlan:
    """The per-step pair calls of one rank (built once per call, used by fwd and bwd)."""

    def __init__(self, gmask: GlobalMask, rank: int, world: int, local_len: int,
                 sharding: str):
        self.rank, self.world, self.sharding = rank, world, sharding
        q_chunks = chunks_of(rank, world, local_len, sharding)
        self.steps: List[Tuple[int, List[PairCall]]] = []
        for t in range(world):
            src = (rank - t) % world
            calls = []
            for qc in q_chunks:
                for kc in chunks_of(src, world, local_len, sharding):
                    st = gmask.state(qc, kc)
                    if st != EMPTY:
                        calls.append(PairCall(qc, kc, gmask.pair_mask(qc, kc, st), st == FULL))
            self.steps.append((src, calls))

    def calls(self, t: int) -> List[PairCall]:
        return self.steps[t][1]

    def work(self) -> float:
        """Chunk-pair work of this rank in units of one full L x L pair (causal-diagonal = 1/2,
        other partial pairs counted as 1): for load-balance checks and benchmarks."""
        w = 0.0
        for _, calls in self.steps:
            for c in calls:
                diag = c.qc.index == c.kc.index and not c.full
                w += 0.5 if diag else 1.0
        return w
