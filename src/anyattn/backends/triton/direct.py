"""A resolved Triton launch replayed without Triton's per-argument binding.

``kernel[grid](*args, **kw)`` on a @triton.jit / @gluon.jit function binds every argument
and specialises each one (its type, whether an int is 1 or a multiple of 16, whether a
pointer is 16-byte aligned, a TMA descriptor's dtype, block and shared layout) before it
looks up the compiled kernel and calls the C launcher: ~1 us per argument on a 2-core
CPU, 40-60 us for kernels with 40-60 arguments (bench/triton_launcher_cost.py), four
launches per training step on the Hopper routes.  ``Direct`` keeps, from a launch that
went through that path, the compiled kernel Triton chose and the facts its choice rests
on: the value and type of every argument that is neither a tensor nor a TMA descriptor
(keywords included: constexprs, num_warps), the dtype and 16-byte alignment of every
tensor, the dtype, block shape and layout of every descriptor.  A later launch whose
arguments show the same facts gets the same compiled kernel by Triton's own rules, so it
calls the C launcher directly (c_launch.py: the compiled launch function without
Triton's Python wrapper, each descriptor slot keeping its encoded tensor maps per
address; ``CompiledKernel.run`` where that does not apply);
any other launch, or any launch while Triton's launch hooks are set (a profiler), goes
through ``kernel[grid]`` as before.

``Site`` is one launch site of one prepared call signature (prepared.py's prepared
launches, hopper/launch.py's): Triton's path until Triton's cache holds the kernel, then
the Direct.  On for CUDA devices.
"""
from __future__ import annotations

import operator
from typing import Any, Optional, Union

import torch

__all__ = ["Direct", "Site", "resolve", "enabled", "hooks_set"]


def enabled(device) -> bool:
    """Whether launches on ``device`` replay resolved kernels: CUDA devices."""
    return getattr(device, "type", device) == "cuda"


def _is_desc(x) -> bool:
    """A Gluon host-side TMA descriptor (the Hopper kernels' operands)."""
    return hasattr(x, "block_shape") and hasattr(x, "base") and hasattr(x, "layout")


def _is_operand(x) -> bool:
    return isinstance(x, torch.Tensor) or _is_desc(x)


def _fact(x) -> tuple:
    """What Triton specialises on: a tensor's dtype and 16-byte alignment; a TMA
    descriptor's dtype, block shape and shared layout (its shape and strides are launch
    values: the launcher encodes the tensor map from them at every launch)."""
    if isinstance(x, torch.Tensor):
        return (x.dtype, not x.data_ptr() & 15)
    return (x.base.dtype, x.block_shape, x.layout)


def _getter(idx):
    """operator.itemgetter returning a tuple for any number of indices."""
    if len(idx) == 0:
        return lambda a: ()
    if len(idx) == 1:
        i = idx[0]
        return lambda a: (a[i],)
    return operator.itemgetter(*idx)


class Direct:
    """One compiled kernel and the argument facts it was specialised for.

    ``args`` / ``kw``: the launch it was resolved from; ``bound``: Triton's binding of
    it (every kernel parameter in signature order, defaults included).  A call is
    described by ``cat = args + kw values`` (kw in this launch's key order); the
    kernel's parameters are ``cat + defaults`` permuted (``_order``)."""

    def __init__(self, fn, ck, args: tuple, kw: dict, bound: Optional[dict] = None,
                 device: Any = None):
        self.fn, self.ck, self.device = fn, ck, device
        #: the C launcher without Triton's wrapper (c_launch.py), None: ck.run
        self.cl = _c_launch(ck)
        self.nargs = len(args)
        self.kwnames = tuple(kw)
        self._kw = _getter(self.kwnames) if self.kwnames else (lambda d: ())
        cat = tuple(args) + self._kw(kw)
        names = list(bound) if bound is not None else []
        # parameter -> its index in cat + defaults (defaults: parameters passed neither
        # way, taken as bound)
        where = {n: i for i, n in enumerate(names[:self.nargs])}
        for j, n in enumerate(self.kwnames):
            if bound is not None and n in bound:
                where.setdefault(n, self.nargs + j)
        self.defaults = tuple(bound[n] for n in names if n not in where)
        k = len(cat)
        for n in names:
            if n not in where:
                where[n] = k
                k += 1
        self._order = _getter([where[n] for n in names]) if names else None
        tpos = [i for i, a in enumerate(cat) if _is_operand(a)]
        spos = [i for i, a in enumerate(cat) if not _is_operand(a)]
        self._tensors, self._scalars = _getter(tpos), _getter(spos)
        self.tfacts = tuple([_fact(t) for t in self._tensors(cat)])
        self.svals = self._scalars(cat)
        self.stypes = tuple(map(type, self.svals))

    def values(self, args: tuple, kw: Optional[dict] = None):
        """The kernel's parameters in signature order for this call when it shows the
        facts the kernel was compiled for, else None."""
        if len(args) != self.nargs:
            return None
        if kw:
            if len(kw) != len(self.kwnames):
                return None
            try:
                cat = args + self._kw(kw)
            except KeyError:
                return None
        elif self.kwnames:
            return None
        else:
            cat = args
        try:
            s = self._scalars(cat)
            if s != self.svals or tuple(map(type, s)) != self.stypes:
                return None
            if tuple([_fact(t) for t in self._tensors(cat)]) != self.tfacts:
                return None
        except (AttributeError, RuntimeError, TypeError):   # a slot holds another kind
            return None
        return self._order(cat + self.defaults) if self._order is not None else cat

    def matches(self, args: tuple, kw: Optional[dict] = None) -> bool:
        return self.values(args, kw) is not None

    def run(self, grid, vals: tuple) -> bool:
        """Launch the compiled kernel on ``vals`` (``values()``'s) on the current
        stream -> True; False (nothing launched) where the current device is not the
        one it was compiled on."""
        get_device, get_stream = _driver_queries()
        dev = get_device()
        if self.device is not None and dev != self.device:
            return False
        stream = get_stream(dev)
        ck = self.ck
        if self.cl is not None:
            self.cl(grid, stream, ck.function, ck.packed_metadata, vals)
        else:
            ck.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1,
                   stream, ck.function, ck.packed_metadata, None, None, None, *vals)
        return True


def _c_launch(ck):
    """c_launch.CLaunch of a compiled kernel's launcher, or None (ck.run is called: a
    launcher of another form than c_launch reproduces)."""
    if ck is None:
        return None
    from .c_launch import CLaunch

    return CLaunch.of(ck.run)


#: triton.runtime.driver.driver and triton.knobs.runtime, imported once
_driver_config = None
_runtime_knobs = None


def _driver_queries():
    """(current device, current stream) queries of Triton's active driver."""
    global _driver_config
    dc = _driver_config
    if dc is None:
        from triton.runtime.driver import driver

        dc = _driver_config = driver
    act = dc.active
    return act.get_current_device, act.get_current_stream


def _hook_active(hook) -> bool:
    """A launch hook that would be called: Triton 3.6 keeps each as a HookChain (never
    None; active when it holds calls), earlier versions as a callable or None."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return bool(calls) if calls is not None else True


def hooks_set() -> bool:
    """Whether Triton's launch hooks are set (a profiler): then every launch takes
    Triton's own path, which calls them."""
    global _runtime_knobs
    rk = _runtime_knobs
    if rk is None:
        from triton import knobs

        rk = _runtime_knobs = knobs.runtime
    return _hook_active(rk.launch_enter_hook) or _hook_active(rk.launch_exit_hook)


def resolve(kernel, args: tuple, kw: dict) -> Union[Direct, None, bool]:
    """The Direct of ``kernel`` launched on ``args`` / ``kw`` on the current device, from
    Triton's own binder and kernel cache; None where Triton has not compiled it for these
    facts yet (ask again after a launch), False where it never applies (the interpreter,
    a kernel with pre-run hooks, an argument Triton binds to another object)."""
    from triton import knobs
    from triton.runtime import jit as J
    from triton.runtime.driver import driver

    if not isinstance(kernel, J.JITFunction) or kernel.pre_run_hooks:
        return False
    dev = driver.active.get_current_device()
    caches = kernel.device_caches.get(dev)
    if caches is None:
        return None
    kernel_cache, key_cache, _target, _backend, binder = caches
    kw2 = dict(kw)
    kw2["debug"] = kw2.get("debug", kernel.debug) or knobs.runtime.debug
    kw2["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    bound, spec, options = binder(*args, **kw2)
    ck: Any = kernel_cache.get(J.compute_cache_key(key_cache, spec, options))
    if ck is None or hasattr(ck, "result"):
        return None
    if "debug" in kw or "instrumentation_mode" in kw:
        return False
    d = Direct(kernel, ck, tuple(args), kw, dict(bound), dev)
    vals = d.values(tuple(args), kw)
    if vals is None or len(vals) != len(bound) or any(
            a is not b for a, b in zip(vals, bound.values())):
        return False
    return d


class Site:
    """One launch site of one prepared call signature: ``site(grid, args, kw)`` is
    ``kernel[grid](*args, **kw)``, through the resolved Direct when the call shows its
    facts.  Resolution is tried after each of the first two launches through Triton's
    path (the first may still be compiling), then never again (``d`` False), so a site
    pays Triton's binder twice at most twice.  ``hits``: launches that went direct."""

    __slots__ = ("kernel", "on", "d", "tries", "hits")

    def __init__(self, kernel, on: bool):
        self.kernel, self.on = kernel, bool(on)
        self.d: Union[Direct, None, bool] = None if on else False
        self.tries = 0
        self.hits = 0

    def __call__(self, grid, args: tuple, kw: dict) -> None:
        d = self.d
        if d and not hooks_set():
            vals = d.values(args, kw)
            if vals is not None and d.run(grid, vals):
                self.hits += 1
                return
        self.kernel[grid](*args, **kw)
        if d is None:
            r = resolve(self.kernel, args, kw)
            self.tries += 1
            self.d = r if r is not None else (False if self.tries >= 2 else None)
