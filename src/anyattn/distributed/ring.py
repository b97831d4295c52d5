"""Point-to-point steps around a ring of ranks, on torch.distributed (gloo or NCCL).

Rank i of the group sends to rank i+1 and receives from rank i-1 (mod N).
Every exchange is posted as one ``batch_isend_irecv`` and waited on later, so
the transfer overlaps whatever the caller computes in between.
"""
from __future__ import annotations

from typing import List, Sequence

import torch
import torch.distributed as dist

__all__ = ["Ring", "Exchange"]


class Exchange:
    """An exchange in flight: ``wait()`` -> the received tensors."""

    def __init__(self, reqs, recv: List[torch.Tensor], sent: Sequence[torch.Tensor]):
        self._reqs, self._recv, self._sent = reqs, recv, list(sent)

    def wait(self) -> List[torch.Tensor]:
        for r in self._reqs:
            r.wait()
        self._reqs, self._sent = [], []   # the send buffers may be reused now
        return self._recv


class Ring:
    """The ring of a process group: ``size``, ``rank`` (group ranks), neighbours."""

    def __init__(self, group=None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("group: torch.distributed is not initialized; call "
                               "torch.distributed.init_process_group('nccl' or 'gloo') first")
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError("group: this process is not a member of the given group")
        self.next_global = self._global((self.rank + 1) % self.size)
        self.prev_global = self._global((self.rank - 1) % self.size)

    def _global(self, group_rank: int) -> int:
        if self.group is None:
            return group_rank
        return dist.get_global_rank(self.group, group_rank)

    def exchange(self, send: Sequence[torch.Tensor], tag: int = 0) -> Exchange:
        """Post: send ``send`` to the next rank, receive same-shaped tensors from the previous.

        Tensor i of an exchange travels with tag ``tag + i`` (gloo matches on
        tags; NCCL matches in posting order, which every rank shares).
        """
        if self.size == 1:
            raise RuntimeError("Ring.exchange: a ring of one rank has no one to talk to")
        send = [t.contiguous() for t in send]
        recv = [torch.empty_like(t) for t in send]
        ops = []
        for i, (s, r) in enumerate(zip(send, recv)):
            ops.append(dist.P2POp(dist.isend, s, self.next_global, self.group, tag + i))
            ops.append(dist.P2POp(dist.irecv, r, self.prev_global, self.group, tag + i))
        reqs = dist.batch_isend_irecv(ops) if ops else []
        return Exchange(reqs, recv, send)
