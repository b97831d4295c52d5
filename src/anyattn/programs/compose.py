"""Mask terms as one function: the lowering of ``|`` and of mask functions.

Every mask term has a function form (``Mask._fn``) built from the same graph
operations as a user's ``mask_mod``: a band is ``lo <= kv_idx - q_idx <= hi``, document
ids and keep arrays are captures read at the indices.  :func:`mask_program` traces a
mask object's form for one problem's sizes and position offsets into a
:class:`~.bound.BoundProgram` (captures named after their term, made unique).
"""
from __future__ import annotations

from typing import Any, Dict, Tuple

from .bound import BoundProgram, Program
from .graph import BOOL
from .trace import (CaptureSpec, Sym, Traced, check_result, capture_spec, index_syms,
                    new_context, proxy_of)

__all__ = ["FunctionContext", "mask_program"]


class FunctionContext:
    """What a mask term's function form sees: the symbolic ``b``, ``h``, ``q_idx``,
    ``kv_idx``, the problem's sizes ``(B, Hq, Sq, Sk)`` and offsets, and
    :meth:`capture` to read an array."""

    def __init__(self, name: str, sizes: Tuple[int, int, int, int], q_offset: int,
                 k_offset: int):
        self.ctx = new_context("mask_mod", name)
        self.b, self.h, self.q_idx, self.kv_idx = index_syms(self.ctx, "mask_mod")
        self.sizes, self.q_offset, self.k_offset = tuple(sizes), q_offset, k_offset
        self.specs: Dict[str, CaptureSpec] = {}
        self.arrays: Dict[str, Any] = {}

    def capture(self, hint: str, arr):
        """The proxy of ``arr`` under a unique name derived from ``hint``."""
        name, n = hint, 1
        while name in self.specs:
            name, n = f"{hint}_{n}", n + 1
        spec = self.specs[name] = capture_spec(name, arr, self.ctx.where_())
        self.arrays[name] = arr
        return proxy_of(spec, self.ctx)

    def const(self, value: bool) -> Sym:
        return Sym(self.ctx.bld.const(value, BOOL), self.ctx)

    def done(self, res) -> Program:
        out = check_result(res, self.ctx, BOOL)
        return Program(Traced("mask_mod", self.ctx.fname, out, self.ctx.bld,
                              dict(self.specs), dict(self.arrays)))


def mask_program(mask, sizes, q_offset: int = 0, k_offset: int = 0) -> BoundProgram:
    """``mask``'s function form for a problem of ``sizes`` (B, Hq, Sq, Sk), bound to its
    arrays (indices checked)."""
    fx = FunctionContext(repr(mask), sizes, q_offset, k_offset)
    prog = fx.done(mask._fn(fx))
    return prog.bind(fx.arrays, sizes)
