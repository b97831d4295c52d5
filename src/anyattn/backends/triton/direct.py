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
from typing import Any, Union

import torch
from triton import knobs
from triton.runtime import jit as J
from triton.runtime.driver import driver

__all__ = ["Direct", "resolve"]


def _facts(tensors) -> tuple:
    return tuple([(t.dtype, t.data_ptr() & 15 == 0) for t in tensors])


class Direct:
    """One compiled kernel and the argument facts it was specialised for."""

    def __init__(self, fn, ck, args: tuple, tail: tuple):
        self.fn, self.ck, self.tail = fn, ck, tail
        tpos = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
        spos = [i for i, a in enumerate(args) if not isinstance(a, torch.Tensor)]
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
