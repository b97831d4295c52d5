"""The per-signature cache of prepared Triton launches: the key of a call, a bounded LRU.

Shape legend: B batch, H query heads, Sq / Sk queries / keys, D head dim.

A training step calls the backend again and again with the same shapes, layouts and
options; what the launch code derives from them (the Hopper routing, the plan, the mask
and modifier flags, the constexpr dicts, the grids, the configs that fit the GPU) is then
the same every time, and only the tensors' addresses and the per-call scalars (the
dropout seed, the tensors of a Documents / KeepMask mask, of a bias, of ALiBi slopes or
sinks) change.  ``prepare`` keeps that derived part (a :class:`Prepared`) in an entry
of this cache under a key that holds everything it depends on:

- every field of the Problem but the dropout seed (a runtime argument of the kernels)
  and the mask, of which the band and which terms are present (the tensors of a
  Documents / KeepMask mask are read on every call; their tile lists have their own
  cache keyed on the tensors' identity and version);
- the direction, the explicit plan (or None), which score-modifier arrays are passed;
- each tensor's strides and whether its address is 16-byte aligned (the Hopper path's
  TMA rules read both);
- one snapshot of the environment switches (``anyattn.settings.snapshot``: every
  switch, a superset of what the launch path reads) and the version of the plan overrides
  (``configs.set_override``), so a setting changed between calls takes effect on the
  next call.

The first call of a signature also resolves each tiled launch (``resolve_launch``: a
config that needs more shared memory than the GPU has falls back to fewer stages /
smaller tiles, remembered per kernel signature; with ANYATTN_TRITON_AUTOTUNE=1 the
candidates of configs.py are timed once per key); the repeats replay it (``run``,
``replay``, through direct.Site).

A key never holds a tensor (no memory is kept alive), and an entry is only ever
written by the call that built it from the same key (tests/triton/test_launch_cache.py
changes each field in turn and compares with an uncached call).
"""
from __future__ import annotations

import collections
import dataclasses
import operator
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch

from ... import settings
from . import configs, direct, operands, route, tiles

__all__ = ["PROBLEM_FIELDS", "problem_key", "layout_key", "call_key", "LRU", "Prepared",
           "PREPARED", "prepare", "build", "run", "replay", "site", "resolve_launch",
           "fallbacks", "FALLBACK_CACHE", "tuning_key", "signature", "clear_prepared"]

#: the Problem fields of a key: all but the mask (keyed by ``_mask_key``), the
#: dropout seed (a per-call scalar) and the slopes of a score function that spelled
#: ALiBi (per-call data, passed as the ALiBi modifier; alibi_shape / alibi_dtype key
#: it); derived from the dataclass, so a field added to Problem joins the key without
#: an edit here
PROBLEM_FIELDS: tuple = ()
_fields_of = None      # operator.attrgetter(*PROBLEM_FIELDS): one C call per key


def _problem_fields() -> tuple:
    from ...problem import Problem

    return tuple(f.name for f in dataclasses.fields(Problem)
                 if f.name not in ("mask", "dropout_seed", "matched_alibi"))


def _mask_key(m) -> tuple:
    """The band and which tensor terms are present (their contents are per call)."""
    return (m.band_lo, m.band_hi, m.q_ids is not None, m.k_ids is not None,
            m.keep is not None, m.mask_fns)


def problem_key(p) -> tuple:
    global PROBLEM_FIELDS, _fields_of
    if _fields_of is None:
        PROBLEM_FIELDS = _problem_fields()
        _fields_of = operator.attrgetter(*PROBLEM_FIELDS)
    return _fields_of(p) + _mask_key(p.mask)


def layout_key(x) -> Any:
    """(strides, 16-byte aligned?) of a tensor, None for None."""
    if x is None:
        return None
    return x.stride(), x.data_ptr() % 16 == 0


def call_key(direction: str, p, plan, mods, tensors) -> tuple:
    """The key of one backend call: see the module doc.  ``tensors``: the tensors whose
    layouts matter, in a fixed order per direction."""
    has_slopes = mods is not None and mods.alibi_slopes is not None
    has_sinks = mods is not None and mods.sinks is not None
    return (direction, problem_key(p), plan, has_slopes, has_sinks,
            tuple([layout_key(x) for x in tensors]), settings.snapshot(),
            configs.overrides_version())


class LRU:
    """A bounded mapping that drops its least recently used entry when full."""

    def __init__(self, size: int):
        self.size = size
        self._d: "collections.OrderedDict[tuple, Any]" = collections.OrderedDict()

    def get(self, key) -> Optional[Any]:
        v = self._d.get(key)
        if v is not None:
            try:
                self._d.move_to_end(key)
            except KeyError:     # dropped by another thread meanwhile: still a hit
                pass
        return v

    def put(self, key, value) -> None:
        self._d[key] = value
        try:
            while len(self._d) > self.size:
                self._d.popitem(last=False)
        except KeyError:         # emptied by another thread meanwhile
            pass

    def clear(self) -> None:
        self._d.clear()

    def __len__(self) -> int:
        return len(self._d)


FALLBACK_CACHE: Dict[tuple, configs.KernelConfig] = {}


def fallbacks(cfg: configs.KernelConfig):
    """cfg, then cheaper variants (fewer stages, then smaller tiles) for when a config
    needs more shared memory than the GPU has (e.g. mask sub-tiling at large D)."""
    yield cfg
    if cfg.num_stages > 2:
        yield configs.KernelConfig(cfg.bm, cfg.bn, cfg.num_warps, 2)
    if cfg.num_stages > 1:
        yield configs.KernelConfig(cfg.bm, cfg.bn, cfg.num_warps, 1)
    if cfg.bm > 16:
        yield configs.KernelConfig(cfg.bm // 2, cfg.bn, cfg.num_warps, 2)
        yield configs.KernelConfig(cfg.bm // 2, cfg.bn, cfg.num_warps, 1)
    if cfg.bm > 16 and cfg.bn > 16:
        yield configs.KernelConfig(cfg.bm // 2, cfg.bn // 2, 4, 1)


def resolve_launch(kernel, grid_of, cfg: configs.KernelConfig, args, kw, sig, tune_key=None):
    """kernel[grid_of(cfg)](*args, BM=, BN=, **kw) with the first config of
    fallbacks(cfg) that fits the GPU's resources (remembered per signature).
    With ANYATTN_TRITON_AUTOTUNE=1 and a ``tune_key`` (kernel, DP, dtype, mask
    class, bias, length bucket), the candidates of configs.candidates are timed once
    on these inputs and the fastest is used from then on."""
    from triton.runtime.errors import OutOfResources

    name = kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel)
    if tune_key is not None and configs.autotune_enabled():
        sbq, sbk = kw.get("SBQ", 128), kw.get("SBK", 128)
        dp = max(kw["DP"], kw.get("VDP", kw["DP"]))      # the wider of q/k's and v's tiles
        cands = [cfg] + [c for c in configs.candidates(tune_key[0], dp, tune_key[2])
                         if sbq % c.bm == 0 and sbk % c.bn == 0 and c != cfg]

        def run(c):
            return lambda: kernel[grid_of(c)](*args, BM=c.bm, BN=c.bn, num_warps=c.num_warps,
                                              num_stages=c.num_stages, **kw)

        cfg = configs.tune(tune_key + (sig,), cands, run)
    key = (name, cfg, sig)
    first = FALLBACK_CACHE.get(key)
    tries = [first] if first is not None else list(fallbacks(cfg))
    err = None
    for c in tries:
        try:
            kernel[grid_of(c)](*args, BM=c.bm, BN=c.bn, num_warps=c.num_warps,
                               num_stages=c.num_stages, **kw)
            FALLBACK_CACHE[key] = c
            return c
        except OutOfResources as e:
            err = e
    raise err


def tuning_key(kernel: str, p) -> tuple:
    dims = configs.padded_dim(p.head_dim)
    if p.head_dim_v != p.head_dim:
        dims = (dims, configs.padded_dim(p.head_dim_v))
    return (kernel, dims, p.dtype, p.mask_class, p.has_bias,
            configs.length_bucket(max(p.seq_q, p.seq_k)))


def signature(**kw):
    return tuple(sorted(kw.items()))


@dataclass
class Prepared:
    """What one call signature's launches need besides its tensors (key: call_key): the
    route, the plan, the operand scheme, the mask / modifier arguments and tile
    lists where they hold no per-call tensor (None: built on every call), the
    backward's decisions, and per tiled kernel its launch once the first call has
    resolved it through resolve_launch (fallbacks, autotuning)."""

    #: the call's route (route.route_call: path, config, reasons)
    route: Any
    hop: bool
    #: the Hopper forward's launch (hopper/launch.py FwdLaunch: config, grid, scalars,
    #: constexprs; its TMA descriptors are built per call on the call's tensors)
    hfwd: Any = None
    #: the Hopper backward's config (the route's: it reads only Problem fields and the
    #: device's SM count)
    hcfg: Any = None
    plan: Optional[configs.Plan] = None
    prec: str = ""
    ma: Optional[tiles.MaskArgs] = None      # None: a bias, Documents or KeepMask (per call)
    md: Optional[operands.ModArgs] = None       # None: slopes, sinks or dropout (per call)
    tlists: Optional[tiles.TileLists] = None  # None: the mask's tile lists (their own cache)
    sc: Any = None                      # the fp32 placeholder of the scale table
    common: Optional[dict] = None       # the constexprs every backward kernel takes
    # backward: which gradients and which dbias route (see backward)
    want_ds: bool = False
    want_db: bool = False
    full_bias: bool = False
    owner_db: bool = False
    want_kv: bool = False
    want_q: bool = False
    #: on a CUDA device (direct.enabled): repeats skip Triton's argument binding
    #: (direct.Site)
    direct: bool = False
    #: kernel name -> [grid, positional tail, keywords] of its resolved launch
    ready: Dict[str, list] = field(default_factory=dict)
    #: launch name -> its direct.Site (made on its first call through site; the
    #: resolved launches' replays, the delta preprocess, the Hopper backward's kernels)
    sites: Dict[Any, Any] = field(default_factory=dict)


#: prepared launches, one per call signature (a training step of a model with a few
#: attention shapes needs a handful; 64 bounds what odd workloads keep)
PREPARED = LRU(64)


def prepare(direction: str, p, plan, mods, named, bias) -> Prepared:
    """The prepared launch of this call (built on its signature's first call)."""
    key = call_key(direction, p, plan, mods, [x for _, x in named] + [bias])
    pr = PREPARED.get(key)
    if pr is None:
        pr = build(direction, p, plan, mods, named, bias)
        PREPARED.put(key, pr)
    return pr


def build(direction: str, p, plan, mods, named, bias) -> Prepared:
    """A call signature's prepared launch: its route (route.route_call), then what the
    portable kernels need."""
    chosen = route.route_call(p, direction, plan, named)
    dev = named[0][1].device
    direct_on = direct.enabled(dev)
    if chosen.hop and direction == "forward":
        from .hopper import launch as hopper_launch

        return Prepared(route=chosen, hop=True, hfwd=hopper_launch.prepare_forward(
            p, chosen.hopper, direct=direct_on))
    q = named[0][1]
    plan = chosen.plan
    prec = operands.kernel_prec(p)
    ma = tiles.mask_args(p, q, bias)
    md = operands.mod_args(p, mods, dev, draw=False)
    per_call_md = md.alibi or md.sinks or md.dropout
    pr = Prepared(route=chosen, hop=chosen.hop, hcfg=chosen.hopper, plan=plan, prec=prec,
                  ma=None if (bias is not None or ma.mode) else ma,
                  md=None if per_call_md else md,
                  tlists=tiles.no_lists(dev) if ma.mode == 0 else None,
                  sc=tiles.dummy(dev, torch.float32), direct=direct_on)
    if direction == "backward":
        B, H, Sq, Sk, D = p.batch, p.heads_q, p.seq_q, p.seq_k, p.head_dim
        Dv = p.head_dim_v
        pr.common = dict(D=D, DP=configs.padded_dim(D), VD=Dv, VDP=configs.padded_dim(Dv),
                         HAS_BAND=ma.has_band,
                         HAS_DOCS=ma.has_docs, HAS_KEEP=ma.has_keep, PREC=prec, **md.flags)
        pr.want_ds = "sinks" in p.wrt and md.sinks
        pr.want_db = "bias" in p.wrt and bias is not None
        pr.full_bias = pr.want_db and tuple(p.bias_shape) == (B, H, Sq, Sk)
        # broadcast over batch and/or heads only: the dq programs own and sum the dbias rows
        pr.owner_db = (pr.want_db and not pr.full_bias
                       and tuple(p.bias_shape[2:]) == (Sq, Sk))
        pr.want_kv = "k" in p.wrt or "v" in p.wrt
        pr.want_q = "q" in p.wrt or pr.full_bias or pr.owner_db
    return pr


def run(pr: Prepared, name: str, kernel, args, first) -> None:
    """kernel[grid](*args, **keywords) with the launch this signature resolved; on its
    first call ``first() -> (grid_of, cfg, kw, tune_key, operand dtype)`` goes through
    resolve_launch (fallbacks, autotuning) and the result is kept."""
    ready = pr.ready.get(name)
    if ready is not None:
        replay(pr, name, ready, kernel, args)
        return
    grid_of, cfg, kw, tune_key, dt = first()
    # score / mask functions' captures: tensors, keyed by dtype only
    sig_kw = {n: (tuple(t.dtype for t in x) if n == "CAPS" else x) for n, x in kw.items()}
    c = resolve_launch(kernel, grid_of, cfg, args, kw, signature(dt=dt, **sig_kw), tune_key)
    pr.ready[name] = [grid_of(c), (), dict(kw, BM=c.bm, BN=c.bn, num_warps=c.num_warps,
                                           num_stages=c.num_stages)]


def replay(pr: Prepared, name: str, ready: list, kernel, args) -> None:
    """A resolved launch again: kernel[grid](*args, *tail, **keywords) through the
    launch's direct.Site: with pr.direct, the compiled kernel straight through its C
    launcher where the arguments show the facts it was compiled for."""
    grid, tail, kw = ready
    site(pr, name, kernel)(grid, args + tail if tail else args, kw)


def site(pr: Prepared, name: str, kernel):
    """The direct.Site of launch ``name`` of this signature (made on its first call)."""
    found = pr.sites.get(name)
    if found is None:
        found = pr.sites[name] = direct.Site(kernel, pr.direct)
    return found


def clear_prepared() -> None:
    """Forget every prepared launch (tests; a changed kernel module)."""
    PREPARED.clear()
