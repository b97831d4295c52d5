"""Result buffers of device-array calls, reused once no returned array holds them.

A device-array forward/backward writes its results straight into buffers of this pool
and returns DeviceArrays over them (no copy, no createBuffer per call).  A buffer is
*held* from ``acquire`` until every root DeviceArray registered on it with ``hold`` has
died (a view keeps its root alive through ``DeviceArray.base``); only then can a later
``acquire`` hand it out again, so a result a caller still references is never
overwritten.  ``claim`` takes a buffer out of the pool for good (``from_buffer`` on a
result's buffer: the caller now owns that memory).

Free buffers are kept per byte size, at most ``MAX_FREE`` of each; reusing the same
buffers keeps the bind groups of a repeated call the cached ones (launch.Runner).
"""
from __future__ import annotations

import threading
import weakref
from typing import Dict, List, Sequence

__all__ = ["ResultPool"]


class _Entry:
    __slots__ = ("buf", "holders", "claimed")

    def __init__(self, buf):
        self.buf, self.holders, self.claimed = buf, 0, False


class ResultPool:
    """Result buffers by byte size: handed out only while no live array holds them."""

    #: free buffers kept per byte size (the rest are dropped: wgpu frees them)
    MAX_FREE = 4

    def __init__(self, device, usage):
        self.device, self.usage = device, usage
        self._free: Dict[int, List[object]] = {}
        self._entries: Dict[int, _Entry] = {}       # id(buffer) -> entry, held or free
        self._refs: Dict[int, object] = {}          # live weak refs to holders
        # a holder may die in any thread, or inside acquire (a collection): reentrant
        self._lock = threading.RLock()
        self.stats = {"reused": 0, "created": 0}

    def acquire(self, nbytes: int, label: str, prefer: Sequence[object] = ()):
        """A buffer of exactly ``nbytes`` (a multiple of 16, >= 16) that no live array
        holds; the first of ``prefer`` that is free if any (the buffers this result slot
        had before, latest first: their bind groups are the cached ones)."""
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self.stats["reused"] += 1
                for want in prefer:
                    for i, b in enumerate(free):
                        if b is want:
                            return free.pop(i)
                return free.pop()
            self.stats["created"] += 1
            buf = self.device.create_buffer(label=label, size=nbytes, usage=self.usage)
            self._entries[id(buf)] = _Entry(buf)
            return buf

    def hold(self, buf, owner) -> None:
        """``owner`` (a root DeviceArray) holds ``buf`` until it dies (a weak reference
        whose callback releases it; the pool keeps the reference alive until then)."""
        key = id(buf)
        refs = self._refs

        def gone(ref, key=key):
            refs.pop(id(ref), None)
            self._release(key)
        with self._lock:
            self._entries[key].holders += 1
            r = weakref.ref(owner, gone)
            refs[id(r)] = r

    def _release(self, key: int) -> None:
        with self._lock:
            e = self._entries.get(key)
            if e is None:
                return
            e.holders -= 1
            if e.holders == 0:
                self._give_back(key, e)

    def _give_back(self, key: int, e: _Entry) -> None:
        if e.claimed:
            del self._entries[key]
            return
        free = self._free.setdefault(e.buf.size, [])
        if len(free) < self.MAX_FREE:
            free.append(e.buf)
        else:
            del self._entries[key]

    def release_unheld(self, buf) -> None:
        """Back to the free list: ``buf`` was acquired but never handed to a caller (a
        call that failed before it returned)."""
        with self._lock:
            e = self._entries.get(id(buf))
            if e is not None and e.holders == 0 and not self.is_free(buf):
                self._give_back(id(buf), e)

    def claim(self, buf) -> None:
        """``buf`` leaves the pool for good (no-op for a buffer the pool does not know)."""
        with self._lock:
            e = self._entries.get(id(buf))
            if e is None:
                return
            e.claimed = True
            free = self._free.get(buf.size, [])
            if any(b is buf for b in free):
                free[:] = [b for b in free if b is not buf]
                del self._entries[id(buf)]

    def clear(self) -> None:
        """Drop the free buffers (held ones stay with their arrays)."""
        with self._lock:
            for bufs in self._free.values():
                for b in bufs:
                    self._entries.pop(id(b), None)
            self._free.clear()

    def owns(self, buf) -> bool:
        """``buf`` is one of this pool's result buffers, not claimed by ``from_buffer``
        (so no array but the ones the pool handed out reaches its bytes)."""
        e = self._entries.get(id(buf))
        return e is not None and e.buf is buf and not e.claimed

    def free_buffers(self) -> List[object]:
        return [b for bufs in self._free.values() for b in bufs]

    def is_free(self, buf) -> bool:
        return any(b is buf for b in self._free.get(buf.size, ()))
