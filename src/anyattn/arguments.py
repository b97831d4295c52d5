"""Argument checks and views shared by the core API (``anyattn.api``) and the torch
wrapper (``anyattn.torch``): one place, so both raise the same messages and hand the
backends the same views."""
from __future__ import annotations

import numpy as np

from .modifiers import ScoreMods
from .problem import Problem

__all__ = ["LAYOUTS", "check_layout", "check_flag", "bias_4d", "score_mods"]

#: the memory layouts the entry points take: [B, H, S, D] and [B, S, H, D]
LAYOUTS = ("bhsd", "bshd")


def check_layout(layout):
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is unknown; expected one of {LAYOUTS}")


def check_flag(name, val):
    """A bool argument: Python's bool or NumPy's (1, None, 'yes' are refused, as torch
    refuses them for its bool arguments)."""
    if not isinstance(val, (bool, np.bool_)):
        raise TypeError(f"{name}: expected a bool (True or False), got {type(val).__name__}")


def bias_4d(bias, p: Problem):
    """The bias as a 4-D view (left-padded with size-1 dims)."""
    if bias is None or bias.ndim == 4:
        return bias
    return bias.reshape(p.bias_shape)


def score_mods(p: Problem, alibi_slopes, sinks) -> ScoreMods:
    """The validated modifier arrays; slopes as a [Ba, Hq] view (those of a score
    function that spelled ALiBi where the call gave none: ``Problem.matched_alibi``)."""
    if alibi_slopes is None:
        alibi_slopes = p.matched_alibi
    if alibi_slopes is not None and alibi_slopes.ndim == 1:
        alibi_slopes = alibi_slopes.reshape(p.alibi_shape)
    return ScoreMods(alibi_slopes=alibi_slopes, sinks=sinks)
