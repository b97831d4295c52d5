"""The seed kernel's arena ABI (DESIGN.md §2): ``Params`` and the arena entry point.

Shape legend: B batch (``batch``), H heads (``heads``; the seed has one head
count, so K/V are per query head), Sq/Sk queries/keys, D ``head_dim``, R the
output's rows (Sq for dQ, Sk for dK/dV).  Offsets and strides count f32
elements of the arena; the last (D) dim of every tensor has stride 1.

* :class:`Params`: the seed's 38 little-endian u32 (152 bytes), same names and
  order; ``pack()`` / ``Params.unpack()``; ``Params.for_layout(...)`` builds one
  for [B, H, S, D] or [B, S, H, D] tensors placed in an arena.
* :func:`attention_backward_arena`: computes what the seed computes (dQ, dK or
  dV into the arena), for any size, after validating every index it touches.
* :func:`arena_views`: Params + arena -> the logical views, the anyattn mask or
  bias, ``wrt`` and the rows where the seed attends uniformly (its quirk).
* :func:`seed_mask`: an anyattn mask/bias -> the seed's mask kind and values.
* :func:`pack_arena` / :func:`read_output`: test and user conveniences.

Geometry checks (bounds, duplicate writes, overlaps) live in ``abi_regions``.
"""
from __future__ import annotations

import math
import struct
from collections import OrderedDict
from dataclasses import MISSING, dataclass, fields
from typing import Any, Dict, Optional, Tuple

import numpy as np

from .abi_regions import Region, Undecided, first_common, first_duplicate
from .arrays import array_kind

__all__ = [
    "Params", "FIELD_NAMES", "PARAMS_NBYTES",
    "MASK_NONE", "MASK_CAUSAL", "MASK_KEEP", "MASK_CAUSAL_WINDOW", "MASK_BIAS", "MASK_KINDS",
    "WRT_Q", "WRT_K", "WRT_V", "WRT_NAMES",
    "f32_bits", "bits_f32", "layout_strides", "seed_mask",
    "ArenaViews", "arena_views", "attention_backward_arena", "pack_arena", "read_output",
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
def _describe_region(p: Params, r: Region) -> str:
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
                f"Params {_describe_region(p, r)}: the last element {verb} is at index "
                f"{ext[1]}, past the arena's end (it holds {n} elements, last index {n - 1}); "
                "lower the offset or strides, or grow the arena")
    out = regs["out"]
    try:
        dup = first_duplicate(out)
    except Undecided:
        raise ValueError(
            f"Params {_describe_region(p, out)}: the output strides interleave in a way the "
            "check cannot prove free of repeated writes within its budget; use strides "
            "that nest (o_seq_stride >= head_dim, o_head_stride >= R*o_seq_stride, ...)"
        ) from None
    if dup is not None:
        raise ValueError(
            f"Params {_describe_region(p, out)}: element {dup} would be written more than "
            "once; output rows must not overlap (e.g. o_seq_stride >= head_dim, "
            "o_head_stride >= R*o_seq_stride)")
    for name, r in regs.items():
        if name == "out":
            continue
        try:
            hit = first_common(out, r)
        except Undecided:
            raise ValueError(
                f"Params {_describe_region(p, out)}: the output interleaves with the input "
                f"{_describe_region(p, r)} in a way the check cannot prove disjoint within "
                "its budget; place the output (out_off, o_*_stride) apart from every input"
            ) from None
        if hit is not None:
            raise ValueError(
                f"Params {_describe_region(p, out)}: the output overlaps the input "
                f"{_describe_region(p, r)} at element {hit}; place the output (out_off, "
                "o_*_stride) apart from every input")


# ----------------------------------------------------------------------------- arenas
def _arena_kind(arena) -> str:
    kind = array_kind(arena)
    if kind is not None:
        return kind
    if type(arena).__module__.startswith("wgpu") and hasattr(arena, "size") \
            and hasattr(arena, "usage"):
        return "wgpu"
    raise TypeError(f"arena: expected a 1-D float32 NumPy array, torch tensor or wgpu "
                    f"buffer, got {type(arena).__name__}")


def _arena_len(arena, kind: str, write: bool = True) -> int:
    """Element count of a valid arena (TypeError / ValueError otherwise)."""
    if kind == "wgpu":
        if arena.size % 4:
            raise ValueError(f"arena: wgpu buffer of {arena.size} bytes is not a whole number "
                             "of f32 elements")
        return arena.size // 4
    if kind == "numpy" and arena.dtype.kind == "f" and not arena.dtype.isnative:
        raise TypeError(f"arena: dtype {arena.dtype.str} is float32 in non-native (big-endian) "
                        "byte order; the seed's arena is little-endian f32: convert it with "
                        "arena.astype('<f4') and read the output from the converted array")
    dt = str(arena.dtype).replace("torch.", "")
    if dt != "float32":
        raise TypeError(f"arena: dtype {dt}; expected float32 (the seed's arena is f32)")
    if arena.ndim != 1:
        raise ValueError(f"arena: shape {tuple(arena.shape)}; expected 1-D (flatten it with "
                         "reshape(-1))")
    n = int(arena.shape[0])
    if kind == "numpy":
        if n > 1 and arena.strides[0] != arena.itemsize:
            raise ValueError(f"arena: stride {arena.strides[0]} bytes; expected a contiguous "
                             "array (np.ascontiguousarray)")
        if write and not arena.flags.writeable:
            raise ValueError("arena: the array is read-only; the output is written into it")
    else:
        if n > 1 and arena.stride(0) != 1:
            raise ValueError(f"arena: stride {arena.stride(0)}; expected a contiguous tensor "
                             "(.contiguous())")
    return n


def _as_params(params) -> Params:
    if isinstance(params, Params):
        return params
    if isinstance(params, (bytes, bytearray, memoryview)):
        return Params.unpack(params)
    raise TypeError(f"params: expected anyattn.abi.Params or its {PARAMS_NBYTES} packed bytes, "
                    f"got {type(params).__name__}")


def _view(arena, kind: str, r: Region, shape=None, writeable: bool = False):
    """A strided view of ``r`` (optionally with ``shape`` overriding sizes)."""
    shape = tuple(r.shape if shape is None else shape)
    if kind == "numpy":
        es = arena.itemsize
        if 0 in shape:
            return np.zeros(shape, dtype=arena.dtype)
        return np.lib.stride_tricks.as_strided(arena[r.off:], shape=shape,
                                               strides=tuple(s * es for s in r.strides),
                                               writeable=writeable)
    import torch

    base = arena.detach()
    if 0 in shape:
        return torch.zeros(shape, dtype=arena.dtype, device=arena.device)
    return torch.as_strided(base, shape, r.strides, base.storage_offset() + r.off)


@dataclass(frozen=True, eq=False)
class ArenaViews:
    """The high-level meaning of a launch: views into the arena plus anyattn arguments.

    q, dy [B, H, Sq, D]; k, v [B, H, Sk, D] (read-only views); out [B, H, R, D]
    (writeable).  ``mask``: the anyattn mask (kinds 1-3) or None; ``bias``: a
    view [B|1, H|1, Sq|1, Sk|1] (kind 4; stride-0 dims become size 1).
    ``uniform_rows``: NumPy bool [B|1, H|1, Sq], the rows that keep no key under
    kinds 1-3 and so attend uniformly to all Sk keys in the seed; None if none.
    """

    q: Any
    k: Any
    v: Any
    dy: Any
    out: Any
    mask: Any
    bias: Any
    scale: float
    wrt: str
    uniform_rows: Optional[np.ndarray]


def arena_views(arena, params) -> ArenaViews:
    """Params + arena -> :class:`ArenaViews` (validates first, like the entry point)."""
    params = _as_params(params)
    kind = _arena_kind(arena)
    if kind == "wgpu":
        raise TypeError("arena_views: a wgpu buffer has no host views; read it back first")
    params.validate(_arena_len(arena, kind))
    return _views(arena, kind, params)


def _views(arena, kind: str, p: Params) -> ArenaViews:
    from .masks import Causal, KeepMask, Window

    regs = p.regions()
    q, k, v, dy = (_view(arena, kind, regs[n]) for n in ("q", "k", "v", "dy"))
    out = _view(arena, kind, regs["out"], writeable=True)
    mask = bias = uniform = None
    if p.mask_kind in (MASK_KEEP, MASK_BIAS):
        m = regs["mask"].distinct()        # stride-0 dims -> size 1: [B|1, H|1, Sq|1, Sk|1]
        mv = _view(arena, kind, m, m.shape)
        if p.mask_kind == MASK_BIAS:
            bias = mv
        else:
            keep = ~(mv < 0.5)             # NaN compares False: kept, as in the seed
            mask = KeepMask(keep)
            if p.seq_k > 0:
                empty = ~keep.any(-1)      # [B|1, H|1, Sq|1]
                empty = empty.cpu().numpy() if kind == "torch" else np.asarray(empty)
                if empty.any():
                    uniform = np.broadcast_to(empty, empty.shape[:2] + (p.seq_q,))
    elif p.mask_kind == MASK_CAUSAL:
        mask = Causal()                    # key 0 is always kept: no empty row
    elif p.mask_kind == MASK_CAUSAL_WINDOW:
        mask = Causal() & Window(left=p.window)
        first_empty = p.seq_k + p.window   # qi - window > Sk - 1 keeps no key
        if p.seq_k > 0 and first_empty < p.seq_q:
            uniform = np.zeros((1, 1, p.seq_q), dtype=bool)
            uniform[..., first_empty:] = True
    return ArenaViews(q=q, k=k, v=v, dy=dy, out=out, mask=mask, bias=bias, scale=p.scale,
                      wrt=p.wrt_name, uniform_rows=uniform)


# ----------------------------------------------------------------------------- the quirk
class _Ops:
    """The few array operations the uniform-row correction needs, for NumPy and torch."""

    def __init__(self, kind: str, like=None):
        self.torch = kind == "torch"
        self.device = getattr(like, "device", None)

    def f64(self, x, copy: bool = False):
        if self.torch:
            import torch

            return x.to(torch.float64, copy=copy)
        return np.array(x, dtype=np.float64, copy=copy or None)

    def mean_rows(self, x):          # [..., S, D] -> [..., 1, D]
        return x.mean(dim=-2, keepdim=True) if self.torch else x.mean(axis=-2, keepdims=True)

    def sum_rows(self, x):
        return x.sum(dim=-2, keepdim=True) if self.torch else x.sum(axis=-2, keepdims=True)

    def t(self, x):                  # swap the last two dims
        return x.transpose(-1, -2) if self.torch else np.swapaxes(x, -1, -2)

    def index(self, rows: np.ndarray):
        if self.torch:
            import torch

            return torch.as_tensor(rows, device=self.device)
        return rows


def _add_uniform_rows(g, views: ArenaViews, ops: _Ops):
    """Add the seed's contribution of the uniform rows to ``g`` (float64, in place).

    For a row i that keeps no key the seed uses P[i, :] = 1/Sk, so with
    a_ij = dy_i·(v_j - v̄) (v̄ the mean of v over keys):
      dS_ij = a_ij / Sk;  dq_i = scale/Sk · Σ_j a_ij k_j;
      dk_j += scale/Sk · Σ_i a_ij q_i;  dv_j += 1/Sk · Σ_i dy_i.
    Cost O(E·Sk·D) for E uniform rows.
    """
    pat = views.uniform_rows                 # [Bm, Hm, Sq]
    sk = views.k.shape[2]
    c = 1.0 / sk
    Bm, Hm, _ = pat.shape
    for bm in range(Bm):
        for hm in range(Hm):
            rows = np.nonzero(pat[bm, hm])[0]
            if rows.size == 0:
                continue
            bs = slice(bm, bm + 1) if Bm > 1 else slice(None)
            hs = slice(hm, hm + 1) if Hm > 1 else slice(None)
            ri = ops.index(rows)
            dy = ops.f64(views.dy[bs, hs][:, :, ri])         # [b, h, E, D]
            if views.wrt == "v":
                g[bs, hs] += c * ops.sum_rows(dy)            # [b, h, 1, D] onto every key
                continue
            vv = ops.f64(views.v[bs, hs])                    # [b, h, Sk, D]
            kk = ops.f64(views.k[bs, hs])
            a = dy @ ops.t(vv - ops.mean_rows(vv))           # [b, h, E, Sk]
            if views.wrt == "q":
                g[bs, hs, ri] += (views.scale * c) * (a @ kk)          # [b, h, E, D]
            else:
                q = ops.f64(views.q[bs, hs][:, :, ri])                 # [b, h, E, D]
                g[bs, hs] += (views.scale * c) * (ops.t(a) @ q)        # [b, h, Sk, D]
    return g


# ----------------------------------------------------------------------------- entry point
def attention_backward_arena(arena, params, backend: Optional[str] = None) -> None:
    """Compute the seed kernel's output (dQ, dK or dV per ``params.wrt``) into ``arena``.

    ``arena``: a 1-D contiguous float32 NumPy array or torch tensor (CPU or
    CUDA), or a wgpu buffer (delegated to the webgpu backend's
    ``backward_arena``).  ``params``: :class:`Params` (or its 152 bytes).
    Validates first (ValueError naming the field and the bound; TypeError for
    a wrong arena); then writes exactly the B·H·R·D output elements.
    ``backend``: the anyattn backend for the gradient (None: automatic; a torch
    CPU arena then runs on NumPy views of the same memory, so the choice is the
    one made for NumPy arrays).  With a name, a torch arena gives that backend
    torch views.

    Grouped form: ``params`` a list or tuple of Params (e.g. ``[p_dq, p_dk, p_dv]``)
    that share every input field (sizes, q/k/v/dy/mask offsets and strides, mask kind,
    window, scale) and differ in ``wrt`` (each at most once) and the output placement
    (``out_off``, ``o_*_stride``), the outputs disjoint from each other.  One call then
    computes all of them from one set of row statistics (on WebGPU: the forward and
    delta passes once, one dK/dV pass for both), with the results of the separate
    calls.  Anything else is refused (``ValueError`` naming the field and the Params
    index) before any work.
    """
    group = _as_group(params)
    single = _as_params(params) if group is None else None
    kind = _arena_kind(arena)
    if backend is not None and not isinstance(backend, str):
        raise TypeError(f"backend: expected a backend name or None, got "
                        f"{type(backend).__name__}")
    if kind == "wgpu" and backend not in (None, "webgpu"):
        raise ValueError(f"backend={backend!r}: a wgpu buffer arena runs on backend='webgpu' "
                         "only; read the buffer back into a NumPy array for other backends")
    n = _arena_len(arena, kind)
    if group is None:
        _validated(single, n, single.validate)
    else:
        _validated(group, n, lambda n_: _validate_group(group, n_))
    if kind == "wgpu":
        return _run_webgpu(arena, single if group is None else group)
    if kind == "torch" and backend is None and arena.device.type == "cpu":
        arena, kind = arena.detach().numpy(), "numpy"   # same memory, NumPy views
    _run_host(arena, kind, (single,) if group is None else group, backend)


#: (Params or group, arena length) pairs that passed validation, most recent last: the
#: checks are a pure function of the pair (a runtime repeats the same launches), so a
#: repeat skips them (≈ 0.1 ms per Params); failures are never remembered
_VALID: "OrderedDict[tuple, bool]" = OrderedDict()
_MAX_VALID = 256


def _validated(what, n: int, check) -> None:
    """``check(n)`` unless (what, n) passed before (``what``: a Params or a tuple of them,
    frozen and hashable by value)."""
    key = (what, n)
    if key in _VALID:
        _VALID.move_to_end(key)
        return
    check(n)
    _VALID[key] = True
    while len(_VALID) > _MAX_VALID:
        _VALID.popitem(last=False)


#: Params fields a group's members may differ in (the output's placement and ``wrt``);
#: the ``_pad`` fields carry nothing and are not compared
_GROUP_FREE = frozenset({"wrt", "out_off", "o_batch_stride", "o_head_stride", "o_seq_stride"})


def _as_group(params) -> Optional[Tuple[Params, ...]]:
    """A list/tuple of Params (or packed bytes) -> a tuple of Params; None for one Params."""
    if not isinstance(params, (list, tuple)):
        return None
    if not params:
        raise ValueError("params: an empty group; pass one Params or a non-empty list of them")
    out = []
    for i, x in enumerate(params):
        try:
            out.append(_as_params(x))
        except TypeError as e:
            raise TypeError(f"params[{i}]: {e}") from None
    return tuple(out)


def _validate_group(group: Tuple[Params, ...], n: int) -> None:
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
                    f"params[{i}] {_describe_region(group[i], outs[i])}: interleaves with "
                    f"the output of params[{j}] in a way the check cannot prove disjoint "
                    "within its budget; place the outputs apart") from None
            if hit is not None:
                raise ValueError(
                    f"params[{i}] {_describe_region(group[i], outs[i])}: overlaps the output "
                    f"of params[{j}] ({_describe_region(group[j], outs[j])}) at element "
                    f"{hit}; the outputs of a group must be disjoint")


def _run_webgpu(buffer, p) -> None:
    from .backends.base import BackendUnavailable
    from .backends.registry import get_backend, unavailable_reason

    why = unavailable_reason("webgpu")
    if why is not None:
        raise BackendUnavailable(f"backend='webgpu' (needed for a wgpu buffer arena) is not "
                                 f"available here: {why}")
    get_backend("webgpu").backward_arena(buffer, p)


def _run_host(arena, kind: str, group: Tuple[Params, ...], backend: Optional[str]) -> None:
    """The gradients of ``group`` (one Params or several sharing every input) from one
    anyattn backward, each written into its output region."""
    from .api import attention_backward

    views = [_views(arena, kind, p) for p in group]
    views = [vw for vw in views if 0 not in vw.out.shape]
    if not views:
        return
    p = group[0]
    if p.seq_q == 0 or p.seq_k == 0:        # no query or no key: the seed writes zeros
        for vw in views:
            vw.out[...] = 0
        return
    v0 = views[0]
    res = attention_backward(v0.q, v0.k, v0.v, v0.dy, mask=v0.mask, bias=v0.bias,
                             scale=v0.scale, wrt=tuple(vw.wrt for vw in views),
                             backend=backend)
    for vw in views:
        g = getattr(res, "d" + vw.wrt)       # [B, H, R, D]
        if kind == "torch":
            import torch

            g = torch.as_tensor(g, device=arena.device)
        if vw.uniform_rows is not None:
            ops = _Ops(kind, arena)
            g = _add_uniform_rows(ops.f64(g, copy=True), vw, ops)
        if kind == "torch":
            with torch.no_grad():
                vw.out.copy_(g)
        else:
            vw.out[...] = g


# ----------------------------------------------------------------------------- conveniences
def seed_mask(mask=None, bias=None, *, batch: int, heads: int, seq_q: int,
              seq_k: int) -> Tuple[int, int, Optional[np.ndarray]]:
    """An anyattn mask/bias -> the seed's (mask_kind, window, stored values or None).

    ``Causal()`` -> kind 1; ``Causal() & Window(left=w)`` -> kind 3, window w;
    any other mask (KeepMask, Documents, other bands) -> kind 2 with its dense
    keep pattern as 1.0/0.0 [B|1, H|1, Sq, Sk]; a ``bias`` -> kind 4, with the
    mask (if any) folded in as -inf.  Beware the seed's quirk: under kinds 1-3 a
    row that keeps no key attends uniformly instead of giving zeros, so a
    problem with empty rows keeps the contract only as kind 4.
    """
    from .arrays import to_numpy
    from .masks import resolve

    r = resolve(mask, batch, heads, seq_q, seq_k)
    if bias is not None:
        b = np.asarray(to_numpy(bias), dtype=np.float32)
        b = b.reshape((1,) * (4 - b.ndim) + b.shape)
        if not r.is_empty_mask:
            b = np.where(r.dense_keep(batch, heads), b, np.float32(-np.inf))
        return MASK_BIAS, 0, b.astype(np.float32)
    if r.is_empty_mask:
        return MASK_NONE, 0, None
    band_only = r.q_ids is None and r.keep is None
    if band_only and r.band_hi == 0 and r.band_lo is None:
        return MASK_CAUSAL, 0, None
    if band_only and r.band_hi == 0 and r.band_lo is not None and r.band_lo <= 0:
        return MASK_CAUSAL_WINDOW, -r.band_lo, None
    return MASK_KEEP, 0, r.dense_keep(batch, heads).astype(np.float32)


def pack_arena(q, k, v, dy, *, wrt: int, mask_kind: int = MASK_NONE, mask=None,
               window: int = 0, scale: Optional[float] = None, layout: str = "bhsd",
               gap: int = 0, fill: float = float("nan")) -> Tuple[np.ndarray, Params]:
    """Place [B, H, S, D] arrays in a fresh float32 arena -> (arena, params).

    q, dy [B, H, Sq, D]; k, v [B, H, Sk, D]; ``mask`` (kinds 2/4): a float
    array broadcastable to [B, H, Sq, Sk], stored in its own (left-padded)
    shape so its size-1 dims get stride 0.  ``layout``: memory order 'bhsd' or
    'bshd' of every tensor.  Regions come in the order q, k, v, dy, mask, out,
    ``gap`` elements apart; every element that is not an input (the output,
    the gaps) holds ``fill``.
    """
    q, k, v, dy = (np.asarray(x, dtype=np.float32) for x in (q, k, v, dy))
    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    rows = Sq if wrt == WRT_Q else Sk
    m = None
    if mask_kind in (MASK_KEEP, MASK_BIAS):
        if mask is None:
            raise ValueError(f"mask: required for mask_kind={mask_kind}")
        m = np.asarray(mask, dtype=np.float32)
        m = m.reshape((1,) * (4 - m.ndim) + m.shape)

    def stored(x):                     # [B, H, S, D] -> memory order of the layout
        return x if layout == "bhsd" else np.swapaxes(x, 1, 2)

    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is unknown; expected one of {LAYOUTS}")
    parts = [stored(q), stored(k), stored(v), stored(dy)]
    sizes = [x.size for x in parts] + [0 if m is None else m.size, B * H * rows * D]
    offs, pos = [], gap
    for s in sizes:
        offs.append(pos)
        pos += s + gap
    arena = np.full(pos, fill, dtype=np.float32)
    for x, off in zip(parts + ([m] if m is not None else []), offs):
        arena[off:off + x.size] = x.reshape(-1)
    p = Params.for_layout(batch=B, heads=H, seq_q=Sq, seq_k=Sk, head_dim=D, wrt=wrt,
                          q_off=offs[0], k_off=offs[1], v_off=offs[2], dy_off=offs[3],
                          out_off=offs[5], layout=layout, mask_kind=mask_kind,
                          mask_off=offs[4], mask_shape=None if m is None else m.shape,
                          window=window, scale=scale)
    return arena, p


def read_output(arena, params) -> Any:
    """A copy of the output region as [B, H, R, D] (NumPy or torch, like the arena)."""
    p = _as_params(params)
    kind = _arena_kind(arena)
    if kind == "wgpu":
        raise TypeError("read_output: read the wgpu buffer back into a NumPy array first")
    _arena_len(arena, kind, write=False)
    r = p.regions()["out"]
    ext = r.extent()
    if ext is not None and ext[1] >= arena.shape[0]:
        raise ValueError(f"Params {_describe_region(p, r)}: past the arena's end")
    view = _view(arena, kind, r)
    return view.clone() if kind == "torch" else np.array(view)
