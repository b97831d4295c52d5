"""The per-signature cache of prepared Triton launches: the key of a call, a bounded LRU.

Shape legend: B batch, H query heads, Sq / Sk queries / keys, D head dim.

A training step calls the backend again and again with the same shapes, layouts and
options; what the launch code derives from them (the Hopper routing, the plan, the mask
and modifier flags, the constexpr dicts, the grids, the configs that fit the GPU) is then
the same every time, and only the tensors' addresses and the per-call scalars (the
dropout seed, the tensors of a Documents / KeepMask mask, of a bias, of ALiBi slopes or
sinks) change.  ``launch.py`` keeps that derived part in an entry of this cache under a
key that holds everything it depends on:

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

A key never holds a tensor (no memory is kept alive), and an entry is only ever
written by the call that built it from the same key (tests/triton/test_launch_cache.py
changes each field in turn and compares with an uncached call).
"""
from __future__ import annotations

import collections
import dataclasses
import operator
from typing import Any, Optional

from ... import settings
from . import configs as C

__all__ = ["PROBLEM_FIELDS", "problem_key", "layout_key", "call_key", "LRU"]

#: the Problem fields of a key: all but the mask (keyed by ``_mask_key``) and the
#: dropout seed (a per-call scalar); derived from the dataclass, so a field added to
#: Problem joins the key without an edit here
PROBLEM_FIELDS: tuple = ()
_fields_of = None      # operator.attrgetter(*PROBLEM_FIELDS): one C call per key


def _problem_fields() -> tuple:
    from ...problem import Problem

    return tuple(f.name for f in dataclasses.fields(Problem)
                 if f.name not in ("mask", "dropout_seed"))


def _mask_key(m) -> tuple:
    """The band and which tensor terms are present (their contents are per call)."""
    return (m.band_lo, m.band_hi, m.q_ids is not None, m.k_ids is not None,
            m.keep is not None)


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
            C.overrides_version())


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
