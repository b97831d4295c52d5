"""A compiled kernel's C launcher called without Triton's Python wrapper around it, the
TMA tensor maps kept per value.

Triton 3.6's CUDA launcher (``triton.backends.nvidia.driver.CudaLauncher``) wraps the
compiled C launch function of a kernel that takes TMA descriptors in a Python loop
(``wrap_handle_tensordesc``'s ``inner``): over every argument, and for each descriptor
an encoding of its tensor map (``make_tensordesc_arg``: ``fill_tma_descriptor``, a
driver call) and the expansion into (map, shape..., strides...).  That costs tens of
microseconds of host time per launch of the Hopper kernels (7 descriptors in the
backward), on every launch: the descriptors are new objects each call, over tensors that
the caching allocator mostly hands back at the same addresses step after step.

``CLaunch`` does the same work for a direct launch (direct.Direct, after Triton's own
path resolved the kernel): the arguments are spliced around the descriptor slots found
once, and each slot keeps the expansion Triton's own ``make_tensordesc_arg`` gave for a
descriptor's values (address, shape, strides, padding: everything the encoding reads
besides the slot's fixed metadata), so a repeated address costs a dictionary lookup.
A tensor map is a value (the launch copies it into the kernel's parameters), so a kept
one is the one Triton would encode again.  Where the launcher is not of the form this
was written against (another Triton version, a kernel with global or profile scratch)
``CLaunch.of`` gives None and the direct launch calls ``CompiledKernel.run`` as before.
"""
from __future__ import annotations

from typing import Any, Optional

__all__ = ["CLaunch"]

#: expansions kept per descriptor slot of a kernel (addresses the allocator cycles through)
SLOT_CACHE = 64

#: CudaLauncher.launch's arguments before the kernel's (grid x, y, z, stream, function,
#: cooperative, pdl, global scratch, profile scratch, packed metadata, launch metadata,
#: enter hook, exit hook): triton.backends.nvidia.driver._BASE_ARGS_FORMAT
_BASE_ARGS = 13


class _Slot:
    """One descriptor parameter of a kernel: its metadata and kept expansions."""

    __slots__ = ("meta", "expand", "kept")

    def __init__(self, meta, expand):
        self.meta, self.expand, self.kept = meta, expand, {}

    def __call__(self, d) -> list:
        # per address: the shape, strides and padding it was encoded with, and the
        # expansion (a prepared signature's descriptors differ in their address alone)
        ptr = d.base.data_ptr()
        hit = self.kept.get(ptr)
        if hit is not None and hit[0] == d.shape and hit[1] == d.strides and \
                hit[2] == d.padding:
            return hit[3]
        exp = self.expand(d, self.meta)             # Triton's make_tensordesc_arg
        if hit is None and len(self.kept) >= SLOT_CACHE:
            self.kept.pop(next(iter(self.kept)))
        self.kept[ptr] = (list(d.shape), list(d.strides), d.padding, exp)
        return exp


class CLaunch:
    """``launch(grid, stream, function, packed_metadata, vals)``: what
    ``CompiledKernel.run(gx, gy, gz, stream, function, packed_metadata, None, None, None,
    *vals)`` does (no launch hooks, no scratch), descriptors expanded through the slots.
    ``expanded(vals)``: the kernel's part of the C launcher's arguments."""

    def __init__(self, raw, coop, pdl, positions, slots):
        self.raw, self.coop, self.pdl = raw, coop, pdl
        self.positions, self.slots = tuple(positions), tuple(slots)

    @classmethod
    def of(cls, launcher) -> Optional["CLaunch"]:
        """The CLaunch of a CompiledKernel's ``run`` (a CudaLauncher), or None where it is
        not the form this module reproduces."""
        if type(launcher).__name__ != "CudaLauncher" or \
                type(launcher).__module__ != "triton.backends.nvidia.driver":
            return None
        if getattr(launcher, "global_scratch_size", 1) or \
                getattr(launcher, "profile_scratch_size", 1):
            return None
        try:
            from triton.backends.nvidia import driver as nv
        except ImportError:
            return None
        if getattr(nv, "_BASE_ARGS_FORMAT_LEN", None) != _BASE_ARGS:
            return None
        fn = launcher.launch
        coop, pdl = launcher.launch_cooperative_grid, launcher.launch_pdl
        code = getattr(fn, "__code__", None)
        if code is None:                   # the C function itself: no descriptors
            return cls(fn, coop, pdl, (), ())
        if code is not nv.wrap_handle_tensordesc(lambda *a: a, {0: "tensordesc<x>"},
                                                 None).__code__:
            return None                    # a wrapper of another form
        cells = dict(zip(code.co_freevars, (c.cell_contents for c in fn.__closure__)))
        if set(cells) != {"launcher", "tensordesc_indices", "tensordesc_meta"}:
            return None
        meta = list(cells["tensordesc_meta"])
        if any(m is None for m in meta):   # frontend-decomposed descriptors
            return None
        positions = sorted(cells["tensordesc_indices"])
        return cls(cells["launcher"], coop, pdl, positions,
                   [_Slot(m, nv.make_tensordesc_arg) for m in meta])

    def expanded(self, vals: tuple) -> list:
        out: list = []
        prev = 0
        for i, slot in zip(self.positions, self.slots):
            out += vals[prev:i]
            out += slot(vals[i])
            prev = i + 1
        out += vals[prev:]
        return out

    def __call__(self, grid, stream: int, function: Any, packed_metadata: Any,
                 vals: tuple) -> None:
        self.raw(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                 stream, function, self.coop, self.pdl, None, None, packed_metadata, None,
                 None, None, *self.expanded(vals))
