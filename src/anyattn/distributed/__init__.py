"""Context parallelism: attention over a sequence sharded across ranks (torch.distributed).

- ``ring_attention(q, k, v, *, mask=None, group=None, sharding="contiguous", ...)``:
  differentiable; K/V shards travel around the ring of ranks (gloo on CPU,
  NCCL on GPU), partial results merge through their lse, dK/dV travel back.
- ``shard`` / ``unshard`` / ``unshard_local`` / ``local_positions``: the
  sequence layouts ("contiguous", "zigzag").

Importing this module imports torch (``import anyattn`` alone does not).
See docs/distributed.md.
"""
from ..extras import require

require("torch", "torch", "anyattn.distributed")
del require

from .attention import ring_attention  # noqa: E402
from .sharding import (SHARDINGS, chunk_ids, local_positions, shard, unshard,  # noqa: E402
                       unshard_local)

__all__ = ["ring_attention", "shard", "unshard", "unshard_local", "local_positions",
           "chunk_ids", "SHARDINGS"]
