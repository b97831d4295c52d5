"""The seed kernel's arena entry point (DESIGN.md §2) and its conveniences.

Shape legend: B batch, H heads, Sq/Sk queries/keys, D head dim, R the output's rows
(Sq for dQ, Sk for dK/dV).  Offsets and strides count f32 elements of the arena.

* :func:`attention_backward_arena`: computes what the seed computes (dQ, dK or
  dV into the arena), for any size, after validating every index it touches.
* :func:`arena_views`: Params + arena -> the logical views, the anyattn mask or
  bias, ``wrt`` and the rows where the seed attends uniformly (its quirk).
* :func:`seed_mask`: an anyattn mask/bias -> the seed's mask kind and values.
* :func:`pack_arena` / :func:`read_output`: test and user conveniences.

A host arena runs through :func:`anyattn.attention_backward`; a wgpu buffer arena
through the webgpu backend's ``backward_arena`` (looked up in the registry).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional, Tuple

import numpy as np

from ..arrays import array_kind
from .params import (LAYOUTS, MASK_BIAS, MASK_CAUSAL, MASK_CAUSAL_WINDOW, MASK_KEEP, MASK_NONE,
                     WRT_Q, Params, as_group, as_params, describe_region, validate_group)
from .regions import Region

__all__ = ["ArenaViews", "arena_views", "attention_backward_arena", "seed_mask", "pack_arena",
           "read_output"]


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
    params = as_params(params)
    kind = _arena_kind(arena)
    if kind == "wgpu":
        raise TypeError("arena_views: a wgpu buffer has no host views; read it back first")
    params.validate(_arena_len(arena, kind))
    return _views(arena, kind, params)


def _views(arena, kind: str, p: Params) -> ArenaViews:
    from ..masks import Causal, KeepMask, Window

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
    group = as_group(params)
    single = as_params(params) if group is None else None
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
        _validated(group, n, lambda n_: validate_group(group, n_))
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


def _run_webgpu(buffer, p) -> None:
    from ..backends.base import BackendUnavailable
    from ..backends.registry import get_backend, unavailable_reason

    why = unavailable_reason("webgpu")
    if why is not None:
        raise BackendUnavailable(f"backend='webgpu' (needed for a wgpu buffer arena) is not "
                                 f"available here: {why}")
    get_backend("webgpu").backward_arena(buffer, p)


def _run_host(arena, kind: str, group: Tuple[Params, ...], backend: Optional[str]) -> None:
    """The gradients of ``group`` (one Params or several sharing every input) from one
    anyattn backward, each written into its output region."""
    from ..api import attention_backward

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
    from ..arrays import to_numpy
    from ..masks import resolve

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
    # the seed's Params have one head_dim for q, k, v and dy (no value head dim of its own)
    for name, x, want in (("k", k, (B, H, Sk, D)), ("v", v, (B, H, Sk, D)),
                          ("dy", dy, (B, H, Sq, D))):
        if tuple(x.shape) != want:
            raise ValueError(f"{name}: shape {tuple(x.shape)}, expected {list(want)} (q "
                             f"{tuple(q.shape)}); the seed's ABI has one head_dim for q, k, v "
                             "and dy: for v with a head dim of its own (Dv != D) call "
                             "anyattn.attention_backward")
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
    p = as_params(params)
    kind = _arena_kind(arena)
    if kind == "wgpu":
        raise TypeError("read_output: read the wgpu buffer back into a NumPy array first")
    _arena_len(arena, kind, write=False)
    r = p.regions()["out"]
    ext = r.extent()
    if ext is not None and ext[1] >= arena.shape[0]:
        raise ValueError(f"Params {describe_region(p, r)}: past the arena's end")
    view = _view(arena, kind, r)
    return view.clone() if kind == "torch" else np.array(view)
