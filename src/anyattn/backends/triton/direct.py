"""A resolved Triton launch replayed without Triton's per-argument binding (opt-in).

``kernel[grid](*args, **kw)`` on a @triton.jit function binds every argument and
specialises each one (its type, whether an int is 1 or a multiple of 16, whether a
pointer is 16-byte aligned) before it looks up the compiled kernel and calls the C
launcher: ~1 us per argument on a 2-core CPU, 40-60 us for kernels with 60 arguments
(bench/triton_launcher_cost.py).  ``Direct`` keeps, from a launch that went through
that path, the compiled kernel Triton chose and the facts its choice rests on: the
value and type of every non-tensor argument, and the dtype and 16-byte alignment of
every tensor.  A later launch whose arguments show the same facts gets the same
compiled kernel by Triton's own rules, so it calls the C launcher directly
(``CompiledKernel.run``, as ``CompiledKernel[grid]`` does); any other launch, or any
launch while Triton's launch hooks are set, goes through ``kernel[grid]`` as before.

Switched on by ANYATTN_TRITON_DIRECT_LAUNCH=1 (off by default until it has been checked
on a GPU against the plain launches; launch.py reads it through configs.env_snapshot).
"""
from __future__ import annotations

import operator
import os
from typing import Any, Union

import torch
from triton import knobs
from triton.runtime import jit as J
from triton.runtime.driver import driver

__all__ = ["Direct", "resolve", "launch"]


def _is_desc(x) -> bool:
    """A Gluon TMA descriptor (host side) of the Hopper kernels."""
    return type(x).__name__ == "TensorDescriptor" and hasattr(x, "block_shape")


def _fact(x) -> tuple:
    """A tensor's dtype and 16-byte alignment; a TMA descriptor's whole description but
    its base address (dtype, alignment, shape, strides, block shape, layout, padding):
    a later launch reuses the compiled kernel only where all of it is the same."""
    if isinstance(x, torch.Tensor):
        return (x.dtype, x.data_ptr() & 15 == 0)
    b = x.base
    return ("desc", b.dtype, b.data_ptr() & 15 == 0, tuple(x.shape), tuple(x.strides),
            tuple(x.block_shape), x.layout, x.padding)


def _facts(tensors) -> tuple:
    return tuple([_fact(t) for t in tensors])


def _is_operand(x) -> bool:
    return isinstance(x, torch.Tensor) or _is_desc(x)


class Direct:
    """One compiled kernel and the argument facts it was specialised for (tensors and,
    for the Hopper kernels, TMA descriptors by _fact; every other argument by value and
    type)."""

    def __init__(self, fn, ck, args: tuple, tail: tuple):
        self.fn, self.ck, self.tail = fn, ck, tail
        tpos = [i for i, a in enumerate(args) if _is_operand(a)]
        spos = [i for i, a in enumerate(args) if not _is_operand(a)]
        # itemgetter of one index returns the item, not a 1-tuple: keep tuples
        self._tensors = operator.itemgetter(*tpos) if len(tpos) > 1 else \
            (lambda a: tuple(a[i] for i in tpos))
        self._scalars = operator.itemgetter(*spos) if len(spos) > 1 else \
            (lambda a: tuple(a[i] for i in spos))
        self.n = len(args)
        self.tfacts = _facts(self._tensors(args))
        self.svals = self._scalars(args)
        self.stypes = tuple(map(type, self.svals))

    def matches(self, args: tuple) -> bool:
        if len(args) != self.n:
            return False
        s = self._scalars(args)
        return (s == self.svals and tuple(map(type, s)) == self.stypes
                and _facts(self._tensors(args)) == self.tfacts)

    def __call__(self, grid, args: tuple) -> None:
        dev = driver.active.get_current_device()
        stream = driver.active.get_current_stream(dev)
        ck = self.ck
        ck.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
               stream, ck.function, ck.packed_metadata, None, None, None, *args, *self.tail)


def hooks_set() -> bool:
    """Whether Triton's launch hooks are set (a profiler): then every launch takes
    Triton's own path, which calls them."""
    return (knobs.runtime.launch_enter_hook is not None
            or knobs.runtime.launch_exit_hook is not None)


def resolve(kernel, args: tuple, kw: dict) -> Union[Direct, None, bool]:
    """The Direct of ``kernel`` launched on ``args`` / ``kw`` on the current device, from
    Triton's own binder and kernel cache; None where Triton has not compiled it for these
    facts yet (ask again after a launch), False where it never applies (the interpreter,
    a kernel with pre-run hooks)."""
    if not isinstance(kernel, J.JITFunction) or kernel.pre_run_hooks:
        return False
    dev = driver.active.get_current_device()
    caches = kernel.device_caches.get(dev)
    if caches is None:
        return None
    kernel_cache, key_cache, _target, _backend, binder = caches
    kw = dict(kw)
    kw["debug"] = kw.get("debug", kernel.debug) or knobs.runtime.debug
    kw["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    bound, spec, options = binder(*args, **kw)
    ck: Any = kernel_cache.get(J.compute_cache_key(key_cache, spec, options))
    if ck is None or hasattr(ck, "result"):
        return None
    values = tuple(bound.values())
    if len(values) < len(args) or any(a is not b for a, b in zip(values, args)):
        return False
    return Direct(kernel, ck, tuple(args), values[len(args):])


#: launch sites of launch() -> Direct, or False where direct launches never apply
_sites: dict = {}
_SITES = 256


def launch(kernel, grid, args: tuple, kw: dict) -> None:
    """``kernel[grid](*args, **kw)``; with ANYATTN_TRITON_DIRECT_LAUNCH=1 a launch whose
    arguments show the facts of an earlier one at the same site (kernel, grid, keywords)
    calls that compiled kernel directly (the Hopper launches: their TMA descriptors are
    arguments too).  Keywords must be constants (constexprs, num_warps): a call with a
    tensor among them always takes Triton's path."""
    if os.environ.get("ANYATTN_TRITON_DIRECT_LAUNCH") != "1" or any(
            _is_operand(v) for v in kw.values()):
        kernel[grid](*args, **kw)
        return
    key = (id(kernel), grid, tuple(sorted(kw.items())))
    d = _sites.get(key)
    if d and not hooks_set() and d.matches(args):
        d(grid, args)
        return
    kernel[grid](*args, **kw)
    if d is None:
        d = resolve(kernel, args, kw)
        if d is not None:
            if len(_sites) >= _SITES:
                _sites.clear()
            _sites[key] = d
