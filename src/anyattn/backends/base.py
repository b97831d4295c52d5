"""What a backend is: capabilities as data, refusals with reasons, forward/backward.

Shape legend: B batch, Hq/Hkv query/key-value heads, Sq/Sk queries/keys, D head dim
of q and k, Dv head dim of v (and of out / dout).
Tensors reach a backend in the logical layout [B, H, S, D] with any strides; a
bias arrives as a 4-D view broadcastable to [B, Hq, Sq, Sk].
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, List, Optional, Tuple

from .. import features
from ..arrays import array_kind
from ..modifiers import ScoreMods
from ..problem import Problem
from ..rowstats import RowStats, needs_refine, refine

__all__ = ["Capabilities", "Backend", "BackendUnavailable", "Probe"]


class BackendUnavailable(RuntimeError):
    """An explicitly requested backend cannot run on this machine."""


@dataclass(frozen=True)
class Probe:
    """What a backend's package says about it without importing the backend's libraries
    (its ``probe()``, read by the registry).

    state: ``"unavailable"`` (``detail``: why, e.g. a package that is not installed),
    ``"installed"`` (its packages are installed but not loaded; ``detail``: what is
    known and what is checked at first use) or ``"loaded"`` (its libraries and device
    are loaded already: asking the backend itself imports nothing more).
    """

    state: str
    detail: str = ""

    def __post_init__(self):
        if self.state not in ("unavailable", "installed", "loaded"):
            raise ValueError(f"Probe.state: expected 'unavailable', 'installed' or 'loaded', "
                             f"got {self.state!r}")


@dataclass(frozen=True)
class Capabilities:
    """What a backend accepts; checked by Backend.unsupported_reasons.

    The feature sets name entries of :data:`anyattn.features.FEATURES`, one set per
    kind: ``mask_terms`` (lowered mask terms), ``inputs`` (bias, GQA, value_dim), ``gradients``
    (bias_grad, sinks_grad) and ``modifiers`` (softcap, alibi, sinks, dropout).  A
    problem using a feature outside them is refused with that feature's words.
    ``mask_terms`` and ``modifiers`` start empty and ``inputs`` holds the inputs that are
    not opt-in (:data:`anyattn.features.DEFAULT_INPUTS`): a backend names what it
    implements, so a term, modifier or opt-in input (``value_dim``) added to the table is
    refused by every backend that does not.
    """

    array_kinds: FrozenSet[str]            # {'numpy'} or {'torch'}
    device_types: FrozenSet[str]           # {'cpu'}, {'cuda'}, ...
    dtypes: FrozenSet[str]
    precisions: FrozenSet[str] = frozenset({"highest"})
    max_head_dim: Optional[int] = None
    mask_terms: FrozenSet[str] = frozenset()   # each backend names the terms it implements
    inputs: FrozenSet[str] = features.DEFAULT_INPUTS   # opt-in inputs must be named
    gradients: FrozenSet[str] = features.GRADIENTS
    modifiers: FrozenSet[str] = frozenset()    # ... and the modifiers
    auto: bool = True                      # may auto-dispatch pick it?

    def __post_init__(self):
        for kind in features.KINDS:
            field_name = _FIELD_OF_KIND[kind]
            given = getattr(self, field_name)
            if isinstance(given, str) or not isinstance(given, (set, frozenset)):
                raise TypeError(f"Capabilities({field_name}=...): expected a set of feature "
                                f"names, got {type(given).__name__}")
            unknown = set(given) - features.names_of(kind)
            if unknown:
                raise ValueError(f"Capabilities({field_name}=...): {sorted(unknown)} are not "
                                 f"{kind} features; expected a subset of "
                                 f"{sorted(features.names_of(kind))} (anyattn.features)")
            object.__setattr__(self, field_name, frozenset(given))

    @property
    def features(self) -> FrozenSet[str]:
        """Every feature name this backend supports, of all kinds."""
        return frozenset().union(*(getattr(self, f) for f in _FIELD_OF_KIND.values()))

    def supports(self, name: str) -> bool:
        """Does this backend support the feature called ``name``?"""
        return name in getattr(self, _FIELD_OF_KIND[features.get(name).kind])


#: the Capabilities field holding each kind of feature
_FIELD_OF_KIND = {"mask_term": "mask_terms", "input": "inputs", "gradient": "gradients",
                  "modifier": "modifiers"}


class Backend(ABC):
    """Base of every backend.  Subclasses set ``name`` and ``capabilities``."""

    name: str = "?"
    capabilities: Capabilities

    # -- availability and refusals ------------------------------------------------
    def availability(self) -> Optional[str]:
        """None when the backend can run here, else the reason it cannot."""
        return None

    def auto_eligible(self) -> bool:
        """May automatic dispatch pick this backend here?  (An emulated device, such
        as a CPU WebGPU adapter, answers False: it stays available on request.)"""
        return self.capabilities.auto

    def unsupported_reasons(self, p: Problem) -> List[str]:
        """Why this backend cannot compute ``p`` (empty list: it can)."""
        c = self.capabilities
        why = []
        if p.array_kind not in c.array_kinds:
            why.append(f"takes {sorted(c.array_kinds)} arrays, got {p.array_kind}")
        dev_type = p.device.split(":")[0]
        if dev_type not in c.device_types:
            why.append(f"runs on {sorted(c.device_types)} devices, the inputs are on {p.device}")
        if p.dtype not in c.dtypes:
            why.append(f"supports dtypes {sorted(c.dtypes)}, got {p.dtype}")
        if p.precision not in c.precisions:
            why.append(f"supports precision {sorted(c.precisions)}, got {p.precision!r}")
        if c.max_head_dim is not None and p.head_dim > c.max_head_dim:
            why.append(f"supports head_dim <= {c.max_head_dim}, got {p.head_dim}")
        if c.max_head_dim is not None and p.head_dim_v > c.max_head_dim:
            why.append(f"supports a value head dim <= {c.max_head_dim}, got {p.head_dim_v}")
        used = p.features
        why += [f.refusal for f in features.FEATURES
                if f.name in used and not c.supports(f.name)]
        return why + self.extra_reasons(p)

    def extra_reasons(self, p: Problem) -> List[str]:
        """Backend-specific refusals beyond the capability table."""
        return []

    # -- work ---------------------------------------------------------------------
    @abstractmethod
    def forward(self, p: Problem, q, k, v, bias, mods: ScoreMods) -> Tuple[Any, RowStats]:
        """-> (out [B, Hq, Sq, Dv] in q's dtype, RowStats of [B, Hq, Sq] float32/float64).

        The statistics keep the row maximum and the log-normaliser apart (see
        :mod:`anyattn.rowstats`); their lse is what the public API returns.  With
        sinks (``mods.sinks``) the statistics include the sink; ``p.softcap`` and
        ``mods.alibi_slopes`` [Ba, Hq] modify the scores (:mod:`anyattn.modifiers`).
        """

    @abstractmethod
    def backward(self, p: Problem, q, k, v, dout, out, stats: RowStats,
                 bias, mods: ScoreMods) -> Dict[str, Any]:
        """-> {'dq', 'dk', 'dv', 'dbias', 'dsinks'} for the names in ``p.wrt`` (others
        None or absent).

        ``stats`` define ``P = exp((s - stats.max) - stats.log_norm)`` (P = 0 where
        ``stats.max`` is -inf); the bias is added to ``s`` before ``max`` is subtracted.

        dq [B, Hq, Sq, D]; dk [B, Hkv, Sk, D], dv [B, Hkv, Sk, Dv] (summed over each kv head's
        query group); dbias in ``p.bias_shape`` (summed over broadcast dims); dsinks
        [Hq] in the sinks' dtype.  With sinks, ``stats`` include the sink.
        """

    def forward_paged(self, p: Problem, q, k_pages, v_pages,
                      mods: ScoreMods) -> Tuple[Any, RowStats]:
        """The forward over a paged cache (``p.pages``, :mod:`anyattn.paged`): k_pages
        [N, Hkv, P, D], v_pages [N, Hkv, P, Dv] (any strides), results as
        :meth:`forward`'s.  Only backends whose capabilities name the ``paged_kv`` input
        are asked."""
        raise NotImplementedError(f"backend {self.name!r}: declares paged_kv but has no "
                                  "forward_paged")

    # -- results without kernels: empty problems, a given lse ----------------------
    # The public API (anyattn.api) asks the chosen backend for these instead of building
    # arrays itself: only the backend knows its array kinds.  The defaults serve NumPy
    # arrays and torch tensors; a backend with arrays of its own overrides them (webgpu).
    def zeros_like(self, x, shape=None):
        """A new zero array like ``x``: same array kind, device and dtype, ``x``'s shape
        or ``shape`` (the output and gradients of an empty problem; its output is
        [B, Hq, Sq, Dv], q's shape only where Dv == D)."""
        kind = array_kind(x)
        shape = tuple(x.shape) if shape is None else tuple(shape)
        if kind == "torch":
            import torch

            return torch.zeros(shape, dtype=x.dtype, device=x.device)
        if kind == "numpy":
            import numpy as np

            return np.zeros(shape, dtype=x.dtype)
        raise NotImplementedError(f"backend {self.name!r}: zeros_like of {kind} arrays is "
                                  "not implemented; a backend taking them overrides it")

    def empty_stats(self, p: Problem, q, mods: ScoreMods) -> RowStats:
        """Statistics of rows that keep no key (``p.is_empty``), [B, Hq, Sq] in q's array
        kind and on its device, float32 (float64 for float64 inputs): max = -inf (the
        row's sink with ``mods.sinks``), log_norm = 0."""
        kind = array_kind(q)
        shape = (p.batch, p.heads_q, p.seq_q)
        if kind == "torch":
            import torch

            dt = torch.float64 if p.dtype == "float64" else torch.float32
            mx = torch.full(shape, float("-inf"), dtype=dt, device=q.device)
            if mods.sinks is not None:
                mx = mods.sinks.to(dt).reshape(1, -1, 1).expand(shape).clone()
            return RowStats(mx, torch.zeros(shape, dtype=dt, device=q.device))
        if kind == "numpy":
            import numpy as np

            dt = np.float64 if p.dtype == "float64" else np.float32
            mx = np.full(shape, -np.inf, dtype=dt)
            if mods.sinks is not None:
                mx[...] = mods.sinks.astype(dt).reshape(1, -1, 1)
            return RowStats(mx, np.zeros(shape, dtype=dt))
        raise NotImplementedError(f"backend {self.name!r}: empty_stats of {kind} arrays is "
                                  "not implemented; a backend taking them overrides it")

    def stats_from_lse(self, p: Problem, q, k, v, bias, mods: ScoreMods, lse) -> RowStats:
        """Statistics for a plain lse [B, Hq, Sq] given to the backward (the arguments
        are the backward's, as :meth:`forward` takes them).

        The lse keeps its literal meaning ``P = exp(s - lse)``
        (:meth:`RowStats.from_lse`); one whose finite entries reach
        :data:`anyattn.rowstats.REFINE_ABOVE` in magnitude is refined against
        statistics recomputed by one :meth:`forward` (:func:`anyattn.rowstats.refine`).
        The default reads that magnitude on the host (NumPy arrays, torch tensors: one
        flag read back from a GPU)."""
        if needs_refine(lse):
            return refine(lse, self.forward(p, q, k, v, bias, mods)[1])
        return RowStats.from_lse(lse)

    def backward_arena(self, arena, params) -> None:  # pragma: no cover - optional
        """Seed-ABI entry on this backend's own arena type (see anyattn.abi)."""
        raise NotImplementedError(f"backend {self.name!r} has no arena entry point")

    def __repr__(self) -> str:
        return f"<anyattn backend {self.name}>"
