"""Buffer clears: what a launch list zeroes before its kernels run.

A clears list holds :class:`Clear` entries (the first ``nbytes`` of a buffer) or whole
buffers; the runner (launch.py) encodes them, launch templates (templates.py) rebind
them to a later call's buffers with :func:`clear_map`.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Clear", "clear_map"]


@dataclass(frozen=True)
class Clear:
    """A clear of the first ``nbytes`` of ``buf`` (a pooled buffer can be larger than the
    call that clears it needs).  A clears list holds these or whole buffers."""
    buf: object
    nbytes: int


def clear_map(c, f):
    """The clear ``c`` (a ``Clear`` or a whole buffer) with its buffer replaced by f(buffer)."""
    return Clear(f(c.buf), c.nbytes) if isinstance(c, Clear) else f(c)
