"""How a global sequence is split across the ranks of a ring.

Shape legend: S global sequence length, N ranks, L chunk length.

* ``"contiguous"``: S is cut into N chunks of L = S/N; rank r holds chunk r.
* ``"zigzag"``: S is cut into 2N chunks of L = S/(2N); rank r holds chunks
  r and 2N-1-r, stored one after the other (chunk r first).  Under a causal
  mask every rank then does the same amount of work at every ring step.

A rank's local tensor is the concatenation of its chunks along the sequence
dimension; :func:`chunks_of` says which global positions each local chunk covers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

__all__ = ["SHARDINGS", "Chunk", "chunk_count", "chunks_of", "check_divisible",
           "chunk_ids", "local_positions", "shard", "unshard", "unshard_local"]

SHARDINGS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Chunk:
    """One chunk of a rank's shard: local rows [local, local+length) hold
    global positions [start, start+length); ``index`` is its global chunk number."""

    index: int
    start: int
    local: int
    length: int


def _check_sharding(sharding: str) -> None:
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding={sharding!r} is unknown; expected one of {SHARDINGS}")


def chunk_count(world: int, sharding: str) -> int:
    """Number of chunks the global sequence is cut into (N or 2N)."""
    _check_sharding(sharding)
    return world if sharding == "contiguous" else 2 * world


def check_divisible(seq: int, world: int, sharding: str, name: str = "q") -> None:
    """Raise unless a global length ``seq`` splits into equal chunks."""
    n = chunk_count(world, sharding)
    if seq % n:
        raise ValueError(f"{name}: global sequence length {seq} is not divisible by {n} "
                         f"(sharding={sharding!r} over {world} ranks cuts it into {n} equal "
                         "chunks); pad the sequence")


def chunk_ids(rank: int, world: int, sharding: str) -> Tuple[int, ...]:
    """Global chunk numbers held by ``rank``, in local order."""
    _check_sharding(sharding)
    if not 0 <= rank < world:
        raise ValueError(f"rank={rank} is outside [0, {world})")
    return (rank,) if sharding == "contiguous" else (rank, 2 * world - 1 - rank)


def chunks_of(rank: int, world: int, local_len: int, sharding: str) -> List[Chunk]:
    """The chunks of ``rank``'s shard, whose local length is ``local_len``."""
    ids = chunk_ids(rank, world, sharding)
    if local_len % len(ids):
        raise ValueError(f"local sequence length {local_len} is not divisible by "
                         f"{len(ids)} (sharding={sharding!r} holds {len(ids)} chunks per rank)")
    L = local_len // len(ids)
    return [Chunk(index=c, start=c * L, local=i * L, length=L) for i, c in enumerate(ids)]


def local_positions(rank: int, world: int, seq: int, sharding: str = "contiguous"):
    """Global positions (a list of ints, length S/N) of ``rank``'s tokens, e.g. for RoPE."""
    check_divisible(seq, world, sharding, "seq")
    out: List[int] = []
    for c in chunks_of(rank, world, seq // world, sharding):
        out.extend(range(c.start, c.start + c.length))
    return out


def shard(x, rank: int, world: int, *, dim: int = 2, sharding: str = "contiguous"):
    """``rank``'s shard of a global tensor ``x`` (a torch tensor) along ``dim``.

    [.., S, ..] -> [.., S/N, ..]; for zigzag the two chunks are concatenated.
    """
    import torch

    S = x.shape[dim]
    check_divisible(S, world, sharding, "x")
    L = S // chunk_count(world, sharding)
    parts = [x.narrow(dim, c * L, L) for c in chunk_ids(rank, world, sharding)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)


def unshard_local(shards, *, dim: int = 2, sharding: str = "contiguous"):
    """Inverse of :func:`shard`: the global tensor from every rank's shard (a list, rank order)."""
    import torch

    world = len(shards)
    n = chunk_count(world, sharding)
    pieces = [None] * n
    for r, x in enumerate(shards):
        for c in chunks_of(r, world, x.shape[dim], sharding):
            pieces[c.index] = x.narrow(dim, c.local, c.length)
    return torch.cat(pieces, dim=dim)


def unshard(x, *, dim: int = 2, sharding: str = "contiguous", group=None):
    """All-gather every rank's shard ``x`` and reassemble the global tensor (a collective)."""
    import torch
    import torch.distributed as dist

    world = dist.get_world_size(group)
    bufs = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(bufs, x.contiguous(), group=group)
    return unshard_local(bufs, dim=dim, sharding=sharding)
