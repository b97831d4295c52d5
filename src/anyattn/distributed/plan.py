"""Which blocks a rank computes at each ring step.

Shape legend: N ranks, r this rank, t ring step (0..N-1), L chunk length.

At step t rank r holds the key/value shard of rank ``(r - t) mod N``.  For
every (query chunk of r) x (key chunk of that shard) pair that the mask does
not exclude entirely, the plan lists a :class:`BlockCall`: local row ranges,
global offsets and the sliced core mask.  Pairs that keep every entry (FULL)
and sit next to each other in local rows are fused into one call with no mask
(with zig-zag + causal every step but the first is then a single
[2L x L] or [L x 2L] call, straight on the local tensors, no copy).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from ..masks import Mask
from .blockmask import EMPTY, FULL, GlobalMask
from .sharding import chunks_of

__all__ = ["BlockCall", "RingPlan"]


@dataclass(frozen=True)
class BlockCall:
    """One core call: local query rows [q0, q1) against local key rows [k0, k1) of the
    visiting shard, at global offsets q_offset/k_offset, with ``mask`` (None: all kept)."""

    q0: int
    q1: int
    k0: int
    k1: int
    q_offset: int
    k_offset: int
    mask: Optional[Mask]
    full: bool           # every pair kept (the call carries no mask)
    diagonal: bool       # a chunk against itself (causal: half the entries)

    @property
    def q_rows(self) -> slice:
        return slice(self.q0, self.q1)

    @property
    def k_rows(self) -> slice:
        return slice(self.k0, self.k1)


def _fuse(calls: List[BlockCall]) -> List[BlockCall]:
    """Fuse FULL calls that share their key rows and have adjacent query rows (or the
    converse), repeatedly; other calls are kept as they are."""
    calls = list(calls)
    changed = True
    while changed:
        changed = False
        for i, a in enumerate(calls):
            for j, b in enumerate(calls):
                if i == j or not (a.full and b.full):
                    continue
                if (a.k0, a.k1) == (b.k0, b.k1) and a.q1 == b.q0:
                    m = BlockCall(a.q0, b.q1, a.k0, a.k1, 0, 0, None, True, False)
                elif (a.q0, a.q1) == (b.q0, b.q1) and a.k1 == b.k0:
                    m = BlockCall(a.q0, a.q1, a.k0, b.k1, 0, 0, None, True, False)
                else:
                    continue
                calls = [c for n, c in enumerate(calls) if n not in (i, j)] + [m]
                changed = True
                break
            if changed:
                break
    return sorted(calls, key=lambda c: (c.q0, c.k0))


class RingPlan:
    """The per-step block calls of one rank (built once per call, used by fwd and bwd)."""

    def __init__(self, gmask: GlobalMask, rank: int, world: int, local_len: int,
                 sharding: str, fuse: bool = True):
        self.rank, self.world, self.sharding = rank, world, sharding
        q_chunks = chunks_of(rank, world, local_len, sharding)
        self.steps: List[Tuple[int, List[BlockCall]]] = []
        for t in range(world):
            src = (rank - t) % world
            calls = []
            for qc in q_chunks:
                for kc in chunks_of(src, world, local_len, sharding):
                    st = gmask.state(qc, kc)
                    if st == EMPTY:
                        continue
                    calls.append(BlockCall(
                        qc.local, qc.local + qc.length, kc.local, kc.local + kc.length,
                        qc.start, kc.start, gmask.pair_mask(qc, kc, st), st == FULL,
                        qc.index == kc.index))
            self.steps.append((src, _fuse(calls) if fuse else calls))

    def calls(self, t: int) -> List[BlockCall]:
        return self.steps[t][1]

    def work(self) -> float:
        """This rank's score entries, counting a masked diagonal block as half and any
        other masked block as whole: for load-balance checks and benchmarks."""
        w = 0.0
        for _, calls in self.steps:
            for c in calls:
                half = c.diagonal and not c.full
                w += (c.q1 - c.q0) * (c.k1 - c.k0) * (0.5 if half else 1.0)
        return w
