"""The seed kernel's ``Params`` (DESIGN.md §2): its fields, packing and validation.

Shape legend: B batch (``batch``), H heads (``heads``; the seed has one head
count, so K/V are per query head), Sq/Sk queries/keys, D ``head_dim``, R the
output's rows (Sq for dQ, Sk for dK/dV).  Offsets and strides count f32
elements of the arena; the last (D) dim of every tensor has stride 1.

:class:`Params` holds the seed's 38 little-endian u32 (152 bytes), same names and
order; ``pack()`` / ``Params.unpack()``; ``Params.for_layout(...)`` builds one for
[B, H, S, D] or [B, S, H, D] tensors placed in an arena; ``Params.validate`` checks
every index a launch touches (geometry in :mod:`anyattn.abi.regions`).  This module
is the ABI's data: the entry point (:mod:`anyattn.abi.entry`) and the WebGPU bridge
both read it, and it imports neither.
"""
from __future__ import annotations

import math
import struct
from dataclasses import MISSING, dataclass, fields
from typing import Any, Dict, Optional, Tuple

import numpy as np

from .regions import Region, Undecided, first_common, first_duplicate

__all__ = [
    "Params", "FIELD_NAMES", "PARAMS_NBYTES",
    "MASK_NONE", "MASK_CAUSAL", "MASK_KEEP", "MASK_CAUSAL_WINDOW", "MASK_BIAS", "MASK_KINDS",
    "WRT_Q", "WRT_K", "WRT_V", "WRT_NAMES", "LAYOUTS",
    "f32_bits", "bits_f32", "layout_strides", "describe_region", "as_params", "as_group",
    "validate_group",
]

# Mask kinds (the host's numbering, DESIGN.md §2)
MASK_NONE, MASK_CAUSAL, MASK_KEEP, MASK_CAUSAL_WINDOW, MASK_BIAS = 0, 1, 2, 3, 4
MASK_KINDS = {MASK_NONE: "none", MASK_CAUSAL: "causal", MASK_KEEP: "keep",
              MASK_CAUSAL_WINDOW: "causal_window", MASK_BIAS: "bias"}
# Which gradient the launch writes
WRT_Q, WRT_K, WRT_V = 0, 1, 2
WRT_NAMES = {WRT_Q: "q", WRT_K: "k", WRT_V: "v"}

_U32 = 1 << 32
_F32_MAX = float(np.finfo(np.float32).max)
LAYOUTS = ("bhsd", "bshd")


def f32_bits(x: float) -> int:
    """The u32 bit pattern of ``x`` rounded to float32 (what ``scale_bits`` holds)."""
    return struct.unpack("<I", struct.pack("<f", float(x)))[0]


def bits_f32(bits: int) -> float:
    """The float32 value of a u32 bit pattern, as a Python float (exact)."""
    return struct.unpack("<f", struct.pack("<I", int(bits)))[0]


def _check_u32(name: str, val: Any) -> int:
    if isinstance(val, (bool, np.bool_)) or not isinstance(val, (int, np.integer)):
        raise TypeError(f"Params.{name}={val!r}: expected an int (a u32), got "
                        f"{type(val).__name__}")
    val = int(val)
    if not 0 <= val < _U32:
        raise ValueError(f"Params.{name}={val}: out of the u32 range 0..{_U32 - 1}")
    return val


@dataclass(frozen=True, kw_only=True, init=False)
class Params:
    """The seed's uniform: 38 u32 fields, in its order (152 bytes little-endian).

    Required: sizes, offsets, ``wrt`` and the q/k/v/o strides.  Optional (0):
    the mask fields, ``window`` and the ``_pad`` fields.  ``scale`` (a float)
    may be given instead of ``scale_bits``; with neither, 1/sqrt(head_dim).
    ``seq_q_stride``/``seq_k_stride`` are the MASK's row/column strides; ``dy``
    uses q's strides; the output uses the o strides over R rows.
    """

    batch: int
    heads: int
    seq_q: int
    seq_k: int
    head_dim: int
    q_off: int
    k_off: int
    v_off: int
    dy_off: int
    out_off: int
    mask_off: int = 0
    mask_kind: int = MASK_NONE
    scale_bits: Optional[int] = None
    window: int = 0
    wrt: int
    seq_q_stride: int = 0
    seq_k_stride: int = 0
    mask_batch_stride: int = 0
    mask_head_stride: int = 0
    _pad_mask_0: int = 0
    _pad_mask_1: int = 0
    _pad_mask_2: int = 0
    q_batch_stride: int
    q_head_stride: int
    q_seq_stride: int
    _pad_q: int = 0
    k_batch_stride: int
    k_head_stride: int
    k_seq_stride: int
    _pad_k: int = 0
    v_batch_stride: int
    v_head_stride: int
    v_seq_stride: int
    _pad_v: int = 0
    o_batch_stride: int
    o_head_stride: int
    o_seq_stride: int
    _pad_o: int = 0

    def __init__(self, *, scale: Optional[float] = None, **values):
        """Keyword fields as in the seed; ``scale`` (a float) instead of ``scale_bits``."""
        unknown = sorted(set(values) - set(FIELD_NAMES))
        if unknown:
            raise TypeError(f"Params: unknown field(s) {unknown}; the fields are "
                            f"{list(FIELD_NAMES)}")
        missing = [f.name for f in fields(Params)
                   if f.name not in values and f.default is MISSING]
        if missing:
            raise TypeError(f"Params: missing required field(s) {missing}")
        for f in fields(Params):
            object.__setattr__(self, f.name, values.get(f.name, f.default))
        if scale is not None:
            if self.scale_bits is not None:
                raise ValueError("Params: give scale or scale_bits, not both")
            try:
                scale = float(scale)
            except (TypeError, ValueError):
                raise TypeError(f"Params.scale={scale!r}: expected a float") from None
            if not math.isfinite(scale) or abs(scale) > _F32_MAX:
                raise ValueError(f"Params.scale={scale!r}: not a finite float32 (|scale| <= "
                                 f"{_F32_MAX:.6g}); the seed's scale_bits hold a float32")
            object.__setattr__(self, "scale_bits", f32_bits(scale))
        elif self.scale_bits is None:
            hd = self.head_dim
            ok = isinstance(hd, (int, np.integer)) and not isinstance(hd, bool) and hd > 0
            object.__setattr__(self, "scale_bits", f32_bits(1.0 / math.sqrt(hd)) if ok else 0)
        for f in fields(Params):
            object.__setattr__(self, f.name, _check_u32(f.name, getattr(self, f.name)))

    @property
    def scale(self) -> float:
        """The float32 scale that ``scale_bits`` encodes."""
        return bits_f32(self.scale_bits)

    # ----------------------------------------------------------------- bytes
    def pack(self) -> bytes:
        """The 152-byte little-endian uniform the seed binds."""
        return struct.pack(f"<{len(FIELD_NAMES)}I", *(getattr(self, n) for n in FIELD_NAMES))

    @classmethod
    def unpack(cls, data) -> "Params":
        """Inverse of :meth:`pack` (bytes, bytearray, memoryview or a u32 array)."""
        if isinstance(data, np.ndarray):
            data = np.ascontiguousarray(data).tobytes()
        try:
            raw = bytes(data)
        except TypeError:
            raise TypeError(f"Params.unpack: expected {PARAMS_NBYTES} bytes, got "
                            f"{type(data).__name__}") from None
        if len(raw) != PARAMS_NBYTES:
            raise ValueError(f"Params.unpack: expected {PARAMS_NBYTES} bytes (38 u32), got "
                             f"{len(raw)}")
        vals = struct.unpack(f"<{len(FIELD_NAMES)}I", raw)
        return cls(**dict(zip(FIELD_NAMES, vals)))

    # ------------------------------------------------------------- meanings
    @property
    def out_rows(self) -> int:
        """R: seq_q for dQ, seq_k for dK/dV."""
        return self.seq_q if self.wrt == WRT_Q else self.seq_k

    @property
    def wrt_name(self) -> str:
        """'q', 'k' or 'v' (KeyError-free: '?' for an invalid wrt)."""
        return WRT_NAMES.get(self.wrt, "?")

    @property
    def mask_kind_name(self) -> str:
        return MASK_KINDS.get(self.mask_kind, "?")

    def regions(self) -> Dict[str, Region]:
        """Every arena region the launch reads (q, k, v, dy, mask for kinds 2/4) and 'out'."""
        B, H, Sq, Sk, D = self.batch, self.heads, self.seq_q, self.seq_k, self.head_dim

        def reg(name, off_field, shape, strides, stride_fields):
            return Region(name, getattr(self, off_field), shape, strides,
                          (off_field,) + stride_fields)

        qs = ("q_batch_stride", "q_head_stride", "q_seq_stride")
        q_str = (self.q_batch_stride, self.q_head_stride, self.q_seq_stride, 1)
        out = {
            "q": reg("q", "q_off", (B, H, Sq, D), q_str, qs),
            "k": reg("k", "k_off", (B, H, Sk, D),
                     (self.k_batch_stride, self.k_head_stride, self.k_seq_stride, 1),
                     ("k_batch_stride", "k_head_stride", "k_seq_stride")),
            "v": reg("v", "v_off", (B, H, Sk, D),
                     (self.v_batch_stride, self.v_head_stride, self.v_seq_stride, 1),
                     ("v_batch_stride", "v_head_stride", "v_seq_stride")),
            "dy": reg("dy", "dy_off", (B, H, Sq, D), q_str, qs),
        }
        if self.mask_kind in (MASK_KEEP, MASK_BIAS):
            out["mask"] = reg("mask", "mask_off", (B, H, Sq, Sk),
                              (self.mask_batch_stride, self.mask_head_stride,
                               self.seq_q_stride, self.seq_k_stride),
                              ("mask_batch_stride", "mask_head_stride", "seq_q_stride",
                               "seq_k_stride"))
        out["out"] = reg("out", "out_off", (B, H, self.out_rows, D),
                         (self.o_batch_stride, self.o_head_stride, self.o_seq_stride, 1),
                         ("o_batch_stride", "o_head_stride", "o_seq_stride"))
        return out

    def validate(self, arena_len: int) -> None:
        """Raise ValueError (naming the field and the bound) unless the launch is safe
        on an arena of ``arena_len`` f32 elements: kinds known, head_dim >= 1, every
        index read or written inside the arena, no output element written twice,
        the output disjoint from every input."""
        _validate(self, int(arena_len))

    # -------------------------------------------------------------- layouts
    @classmethod
    def for_layout(cls, *, batch: int, heads: int, seq_q: int, seq_k: int, head_dim: int,
                   wrt: int, q_off: int, k_off: int, v_off: int, dy_off: int, out_off: int,
                   layout: str = "bhsd", mask_kind: int = MASK_NONE, mask_off: int = 0,
                   mask_shape: Optional[Tuple[int, ...]] = None, window: int = 0,
                   scale: Optional[float] = None) -> "Params":
        """Params for contiguous tensors at the given offsets.

        ``layout``: memory order of q/dy, k, v and the output: 'bhsd' ([B, H, S, D])
        or 'bshd' ([B, S, H, D]).  ``mask_shape`` (kinds 2/4): the stored mask's
        shape, broadcastable to [B, H, Sq, Sk] and contiguous; its size-1 dims
        get stride 0 (default: the full [B, H, Sq, Sk]).
        """
        rows = seq_q if wrt == WRT_Q else seq_k
        qs = layout_strides(layout, heads, seq_q, head_dim)
        ks = layout_strides(layout, heads, seq_k, head_dim)
        os_ = layout_strides(layout, heads, rows, head_dim)
        ms = (0, 0, 0, 0)
        if mask_kind in (MASK_KEEP, MASK_BIAS):
            ms = _mask_strides(mask_shape, (batch, heads, seq_q, seq_k))
        return cls(batch=batch, heads=heads, seq_q=seq_q, seq_k=seq_k, head_dim=head_dim,
                   q_off=q_off, k_off=k_off, v_off=v_off, dy_off=dy_off, out_off=out_off,
                   mask_off=mask_off, mask_kind=mask_kind, window=window, wrt=wrt,
                   scale=scale,
                   mask_batch_stride=ms[0], mask_head_stride=ms[1],
                   seq_q_stride=ms[2], seq_k_stride=ms[3],
                   q_batch_stride=qs[0], q_head_stride=qs[1], q_seq_stride=qs[2],
                   k_batch_stride=ks[0], k_head_stride=ks[1], k_seq_stride=ks[2],
                   v_batch_stride=ks[0], v_head_stride=ks[1], v_seq_stride=ks[2],
                   o_batch_stride=os_[0], o_head_stride=os_[1], o_seq_stride=os_[2])


FIELD_NAMES: Tuple[str, ...] = tuple(f.name for f in fields(Params))
PARAMS_NBYTES = 4 * len(FIELD_NAMES)


def layout_strides(layout: str, heads: int, seq: int, head_dim: int) -> Tuple[int, int, int]:
    """(batch, head, seq) strides of a contiguous tensor: 'bhsd' or 'bshd' memory order."""
    if layout == "bhsd":
        return heads * seq * head_dim, seq * head_dim, head_dim
    if layout == "bshd":
        return seq * heads * head_dim, head_dim, heads * head_dim
    raise ValueError(f"layout={layout!r} is unknown; expected one of {LAYOUTS}")


def _mask_strides(shape, full) -> Tuple[int, int, int, int]:
    """Strides of a contiguous mask of ``shape`` read as [B, H, Sq, Sk] (0 on size-1 dims)."""
    shape = tuple(full) if shape is None else tuple(int(s) for s in shape)
    if len(shape) > 4:
        raise ValueError(f"mask_shape={shape}: expected at most 4 dims")
    shape = (1,) * (4 - len(shape)) + shape
    for ax, (have, want) in enumerate(zip(shape, full)):
        if have not in (1, want):
            raise ValueError(f"mask_shape={shape}: dim {ax} is {have}, expected "
                             + ("1 " if want == 1 else f"1 or {want} ") +
                             f"(broadcastable to [B, H, Sq, Sk] = {list(full)})")
    strides, acc = [0] * 4, 1
    for ax in range(3, -1, -1):
        strides[ax] = acc if shape[ax] > 1 else 0
        acc *= shape[ax]
    return tuple(strides)


# ----------------------------------------------------------------------------- validation
def describe_region(p: Params, r: Region) -> str:
    placed = ", ".join(f"{f}={getattr(p, f)}" for f in r.fields)
    dims = {"q": "[B,H,Sq,D]", "dy": "[B,H,Sq,D]", "k": "[B,H,Sk,D]", "v": "[B,H,Sk,D]",
            "mask": "[B,H,Sq,Sk]", "out": "[B,H,R,D]"}[r.name]
    return f"{r.name} ({placed}; {dims} = {list(r.shape)})"


def _validate(p: Params, n: int) -> None:
    if p.head_dim < 1:
        raise ValueError(f"Params.head_dim={p.head_dim}: expected >= 1")
    if p.mask_kind not in MASK_KINDS:
        raise ValueError(f"Params.mask_kind={p.mask_kind}: expected 0..4 (0 none, 1 causal, "
                         "2 keep-mask, 3 causal+window, 4 additive bias)")
    if p.wrt not in WRT_NAMES:
        raise ValueError(f"Params.wrt={p.wrt}: expected 0 (dQ), 1 (dK) or 2 (dV)")
    if not math.isfinite(p.scale):
        raise ValueError(f"Params.scale_bits={p.scale_bits:#010x}: encodes {p.scale}, "
                         "expected a finite float32 scale")
    regs = p.regions()
    for r in regs.values():
        ext = r.extent()
        if ext is not None and ext[1] >= n:
            verb = "written" if r.name == "out" else "read"
            raise ValueError(
                f"Params {describe_region(p, r)}: the last element {verb} is at index "
                f"{ext[1]}, past the arena's end (it holds {n} elements, last index {n - 1}); "
                "lower the offset or strides, or grow the arena")
    out = regs["out"]
    try:
        dup = first_duplicate(out)
    except Undecided:
        raise ValueError(
            f"Params {describe_region(p, out)}: the output strides interleave in a way the "
            "check cannot prove free of repeated writes within its budget; use strides "
            "that nest (o_seq_stride >= head_dim, o_head_stride >= R*o_seq_stride, ...)"
        ) from None
    if dup is not None:
        raise ValueError(
            f"Params {describe_region(p, out)}: element {dup} would be written more than "
            "once; output rows must not overlap (e.g. o_seq_stride >= head_dim, "
            "o_head_stride >= R*o_seq_stride)")
    for name, r in regs.items():
        if name == "out":
            continue
        try:
            hit = first_common(out, r)
        except Undecided:
            raise ValueError(
                f"Params {describe_region(p, out)}: the output interleaves with the input "
                f"{describe_region(p, r)} in a way the check cannot prove disjoint within "
                "its budget; place the output (out_off, o_*_stride) apart from every input"
            ) from None
        if hit is not None:
            raise ValueError(
                f"Params {describe_region(p, out)}: the output overlaps the input "
                f"{describe_region(p, r)} at element {hit}; place the output (out_off, "
                "o_*_stride) apart from every input")


def as_params(params) -> Params:
    if isinstance(params, Params):
        return params
    if isinstance(params, (bytes, bytearray, memoryview)):
        return Params.unpack(params)
    raise TypeError(f"params: expected anyattn.abi.Params or its {PARAMS_NBYTES} packed bytes, "
                    f"got {type(params).__name__}")


#: Params fields a group's members may differ in (the output's placement and ``wrt``);
#: the ``_pad`` fields carry nothing and are not compared
_GROUP_FREE = frozenset({"wrt", "out_off", "o_batch_stride", "o_head_stride", "o_seq_stride"})


def as_group(params) -> Optional[Tuple[Params, ...]]:
    """A list/tuple of Params (or packed bytes) -> a tuple of Params; None for one Params."""
    if not isinstance(params, (list, tuple)):
        return None
    if not params:
        raise ValueError("params: an empty group; pass one Params or a non-empty list of them")
    out = []
    for i, x in enumerate(params):
        try:
            out.append(as_params(x))
        except TypeError as e:
            raise TypeError(f"params[{i}]: {e}") from None
    return tuple(out)


def validate_group(group: Tuple[Params, ...], n: int) -> None:
    """Each member valid on the arena; one ``wrt`` each; every input field shared; the
    outputs pairwise disjoint (ValueError naming the member and the field)."""
    for i, p in enumerate(group):
        try:
            p.validate(n)
        except ValueError as e:
            raise ValueError(f"params[{i}]: {e}") from None
    if len(group) > len(WRT_NAMES):
        raise ValueError(f"params: {len(group)} Params in a group; at most one per gradient "
                         f"(dQ, dK, dV)")
    first = group[0]
    seen = {first.wrt: 0}
    for i, p in enumerate(group[1:], 1):
        if p.wrt in seen:
            raise ValueError(f"params[{i}].wrt={p.wrt} ({WRT_NAMES[p.wrt]}) repeats "
                             f"params[{seen[p.wrt]}].wrt; a group computes each gradient once")
        seen[p.wrt] = i
        for name in FIELD_NAMES:
            if name in _GROUP_FREE or name.startswith("_pad"):
                continue
            a, b = getattr(first, name), getattr(p, name)
            if a != b:
                raise ValueError(f"params[{i}].{name}={b} differs from params[0].{name}={a}; "
                                 "a group shares every input field (sizes, q/k/v/dy/mask "
                                 "offsets and strides, mask kind, window, scale) and differs "
                                 "only in wrt and the output's placement: make separate "
                                 "calls for other launches")
    outs = [p.regions()["out"] for p in group]
    for i in range(len(group)):
        for j in range(i):
            try:
                hit = first_common(outs[i], outs[j])
            except Undecided:
                raise ValueError(
                    f"params[{i}] {describe_region(group[i], outs[i])}: interleaves with "
                    f"the output of params[{j}] in a way the check cannot prove disjoint "
                    "within its budget; place the outputs apart") from None
            if hit is not None:
                raise ValueError(
                    f"params[{i}] {describe_region(group[i], outs[i])}: overlaps the output "
                    f"of params[{j}] ({describe_region(group[j], outs[j])}) at element "
                    f"{hit}; the outputs of a group must be disjoint")
