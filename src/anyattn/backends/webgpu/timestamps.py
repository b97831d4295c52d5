"""GPU timestamps of submissions (WebGPU "timestamp-query"): device time per call.

Benches set ``Runner.timestamps = Timestamps(run)``; while set, every ``Runner.submit``
marks the start of its first compute pass and the end of its last one (one query pair
per submission) and resolves the pair into a buffer in the same command buffer.
``read()`` returns the device time of each recorded submission in ns, in submission
order (WebGPU defines timestamp values in nanoseconds; wgpu converts the adapter's
ticks).  An adapter without the feature is refused with a clear message: no silent
wall-time stand-in.  Nothing here runs unless a bench asks for it.
"""
from __future__ import annotations

from typing import List, Optional

import numpy as np

__all__ = ["Timestamps", "FEATURE"]

#: the WebGPU feature (and the device feature device.py requests where offered)
FEATURE = "timestamp-query"
#: resolveQuerySet's destination offsets are multiples of 256 bytes (WebGPU)
STRIDE = 256


class Timestamps:
    """A query set of ``capacity`` submissions (2 timestamps each) and its resolve buffer."""

    #: WebGPU caps a query set at 4096 queries
    MAX = 2048

    def __init__(self, run, capacity: int = 2048):
        import wgpu

        if not 1 <= capacity <= self.MAX:
            raise ValueError(f"webgpu timestamps: capacity {capacity} outside [1, {self.MAX}] "
                             "(a query set holds at most 4096 timestamps)")
        if FEATURE not in run.ctx.features:
            raise NotImplementedError(
                f"webgpu: the adapter {run.ctx.name} offers no '{FEATURE}' feature, so "
                "device time per call cannot be measured on it (wall time only)")
        self.run, self.capacity = run, int(capacity)
        dev = run.device
        self.qs = dev.create_query_set(type="timestamp", count=2 * self.capacity)
        self.buf = dev.create_buffer(size=STRIDE * self.capacity,
                                     usage=wgpu.BufferUsage.QUERY_RESOLVE
                                     | wgpu.BufferUsage.COPY_SRC)
        self.n = 0
        self._pending: Optional[int] = None

    def marks(self, repeat: int) -> List[Optional[dict]]:
        """timestamp_writes per compute pass of one submission: the first pass writes the
        beginning, the last the end (one pass: both)."""
        if self.n >= self.capacity:
            raise RuntimeError(f"webgpu timestamps: all {self.capacity} query pairs used; "
                               "read() and reset() first")
        i = 2 * self.n
        self._pending = self.n
        self.n += 1
        if repeat == 1:
            return [dict(query_set=self.qs, beginning_of_pass_write_index=i,
                         end_of_pass_write_index=i + 1)]
        return ([dict(query_set=self.qs, beginning_of_pass_write_index=i)]
                + [None] * (repeat - 2) + [dict(query_set=self.qs, end_of_pass_write_index=i + 1)])

    def resolve(self, enc) -> None:
        """Resolve this submission's pair into the buffer (same command buffer)."""
        i = self._pending
        self._pending = None
        enc.resolve_query_set(self.qs, 2 * i, 2, self.buf, STRIDE * i)

    def read(self) -> np.ndarray:
        """Device ns per recorded submission (waits for the queue)."""
        if self.n == 0:
            return np.zeros(0)
        raw = np.frombuffer(self.run.device.queue.read_buffer(self.buf, 0, STRIDE * self.n),
                            np.uint64).reshape(self.n, STRIDE // 8)[:, :2]
        return (raw[:, 1].astype(np.int64) - raw[:, 0].astype(np.int64)).astype(np.float64)

    def reset(self) -> None:
        self.n = 0
