"""What the portable kernels (and the Hopper path's array masks) are told about a call's
mask and bias: the mask arguments (band bounds, document ids, KeepMask, bias strides) and
the tile lists of Documents / KeepMask masks, built on the device once per mask and cached
on the mask tensors' identity and version counter.

Shape legend: B batch, H query heads, Sq / Sk queries / keys, nQ / nK mask blocks along
queries / keys.
"""
from __future__ import annotations

import collections
from dataclasses import dataclass
from typing import Any, Dict

import torch

from . import mask_inputs

__all__ = ["BIG", "cdiv", "MaskArgs", "mask_args", "dummy", "TileLists", "tile_lists",
           "no_lists", "lists_for", "block_ranges", "doc_blocks", "clear"]

BIG = 1 << 30            # an open band side


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints (triton.cdiv is a constexpr function: ~10x the cost)."""
    return -(-a // b)


@dataclass
class MaskArgs:
    """Everything the kernels need about mask and bias, ready to pass."""

    lo: int
    hi: int
    has_band: bool
    qid: Any
    kid: Any
    sqid_b: int
    skid_b: int
    km: Any
    skm: tuple                 # (b, h, m, n) strides, 0 where broadcast
    has_docs: bool
    has_keep: bool
    bias: Any                  # expanded [B, H, Sq, Sk] view or a dummy
    sb: tuple                  # bias strides (b, h, m, n), 0 where broadcast
    has_bias: bool
    mode: int                  # 0 in-kernel ranges, 1 tile lists (2: the Hopper path's
    #                            block-range tables, TileLists)
    #: (q rows sorted, k rows sorted) of the kernels' document ids (mask_inputs.KernelIds)
    ids_sorted: tuple = (False, False)


#: one-element placeholders for absent operands, per (device, dtype): the kernels never
#: read or write them (their constexpr flag is off), so one per device serves every call
#: and a call launches no fill kernels for them.
_dummies: Dict[tuple, Any] = {}


def dummy(device, dtype=torch.int32):
    key = (device, dtype)
    t = _dummies.get(key)
    if t is None:
        t = _dummies[key] = torch.zeros(1, dtype=dtype, device=device)
    return t


def mask_args(p, q, bias) -> MaskArgs:
    rm = p.mask
    dev = q.device
    B, H, Sq, Sk = p.batch, p.heads_q, p.seq_q, p.seq_k
    lo = -BIG if rm.band_lo is None else int(rm.band_lo)
    hi = BIG if rm.band_hi is None else int(rm.band_hi)
    lo, hi = max(lo, -BIG), min(hi, BIG)
    has_docs = rm.q_ids is not None
    if has_docs:
        ids = mask_inputs.kernel_ids(rm.q_ids, rm.k_ids, dev)
        qid, kid = ids.q.contiguous(), ids.k.contiguous()
        sqid_b = Sq if qid.shape[0] > 1 else 0
        skid_b = Sk if kid.shape[0] > 1 else 0
        ids_sorted = (ids.q_sorted, ids.k_sorted)
    else:
        qid = kid = dummy(dev)
        sqid_b = skid_b = 0
        ids_sorted = (False, False)
    has_keep = rm.keep is not None
    if has_keep:
        km = mask_inputs.to_device(rm.keep, dev, torch.bool, keep=True).view(torch.uint8).expand(
            B, H, Sq, Sk)
        skm = tuple(km.stride())
    else:
        km, skm = dummy(dev, torch.uint8), (0, 0, 0, 0)
    if bias is not None:
        bx = bias.expand(B, H, Sq, Sk)
        sb = tuple(bx.stride())
    else:
        bx, sb = dummy(dev, torch.float32), (0, 0, 0, 0)
    return MaskArgs(lo=lo, hi=hi, has_band=rm.has_band, qid=qid, kid=kid, sqid_b=sqid_b,
                     skid_b=skid_b, km=km, skm=skm, has_docs=has_docs, has_keep=has_keep,
                     bias=bx, sb=sb, has_bias=bias is not None, ids_sorted=ids_sorted,
                     mode=1 if (has_docs or has_keep or rm.mask_fns) else 0)


def clear() -> None:
    """Forget the cached tile lists."""
    _list_cache.clear()


@dataclass
class TileLists:
    """Per mask-block row (queries) and column (keys): counts and sorted indices of
    partial and full blocks.  rows: cnt [Bm, Hm, nQ], idx [Bm, Hm, nQ, nK];
    cols: cnt [Bm, Hm, nK], idx [Bm, Hm, nK, nQ]; Bm, Hm are 1 where nothing varies.
    With ``mode == 2`` (block ranges) row_cnt / col_cnt hold instead the range tables
    int32 [Bm, Hm, nQ, 4] / [Bm, Hm, nK, 4] (first kept block, first and one past the
    last of the run of full blocks, one past the last kept block; the Hopper kernels
    read them, hopper/launch.py) and the other fields are placeholders."""

    row_cnt: Any
    row_idx: Any
    row_fcnt: Any
    row_fidx: Any
    col_cnt: Any
    col_idx: Any
    col_fcnt: Any
    col_fidx: Any
    bm: int
    hm: int
    nq: int
    nk: int
    mode: int = 1                # 1 lists, 2 range tables (see above)

    def row_strides(self):
        """(sc_b, sc_h, si_b, si_h, si_r) for the row lists (0 on broadcast dims)."""
        return (self.hm * self.nq if self.bm > 1 else 0, self.nq if self.hm > 1 else 0,
                self.hm * self.nq * self.nk if self.bm > 1 else 0,
                self.nq * self.nk if self.hm > 1 else 0, self.nk)

    def col_strides(self):
        return (self.hm * self.nk if self.bm > 1 else 0, self.nk if self.hm > 1 else 0,
                self.hm * self.nq * self.nk if self.bm > 1 else 0,
                self.nq * self.nk if self.hm > 1 else 0, self.nq)


_CACHE_SIZE = 16


_list_cache: "collections.OrderedDict[tuple, tuple]" = collections.OrderedDict()


def _block_reduce(x, sb_q, sb_k):
    """any / all of a bool [Bx, Hx, Sq, Sk] over blocks -> two [Bx, Hx, nQ, nK]."""
    bx, hx, sq, sk = x.shape
    nq, nk = cdiv(sq, sb_q), cdiv(sk, sb_k)
    pq, pk = nq * sb_q - sq, nk * sb_k - sk
    xa = torch.nn.functional.pad(x, (0, pk, 0, pq), value=False) if (pq or pk) else x
    xl = torch.nn.functional.pad(x, (0, pk, 0, pq), value=True) if (pq or pk) else x
    shp = (bx, hx, nq, sb_q, nk, sb_k)
    return xa.reshape(shp).any(dim=5).any(dim=3), xl.reshape(shp).all(dim=5).all(dim=3)


def doc_blocks(qid, kid, sb_q, sb_k, sorted_ids: bool):
    """any / all of q_ids[i] == k_ids[j] per block -> two bool [Bd, 1, nQ, nK].
    sorted_ids: every row of both id arrays is non-decreasing (mask_inputs.kernel_ids):
    the blocks' id intervals decide then, else the ids are compared pairwise."""
    bd = max(qid.shape[0], kid.shape[0])
    qid = qid.expand(bd, -1).to(torch.int64)
    kid = kid.expand(bd, -1).to(torch.int64)
    sq, sk = qid.shape[1], kid.shape[1]
    nq, nk = cdiv(sq, sb_q), cdiv(sk, sb_k)

    def pad_rep(x, n):  # repeat the last id: neutral for min / max
        extra = n - x.shape[1]
        return torch.cat([x, x[:, -1:].expand(-1, extra)], 1) if extra else x

    if sorted_ids:
        qp = pad_rep(qid, nq * sb_q).reshape(bd, nq, sb_q)
        kp = pad_rep(kid, nk * sb_k).reshape(bd, nk, sb_k)
        qmin, qmax = qp.min(2).values, qp.max(2).values        # [bd, nQ]
        kmin, kmax = kp.min(2).values, kp.max(2).values        # [bd, nK]
        # sorted ids: a block pair can match only where the id intervals overlap
        a = (qmin[:, :, None] <= kmax[:, None, :]) & (kmin[:, None, :] <= qmax[:, :, None])
        l = ((qmin == qmax)[:, :, None] & (kmin == kmax)[:, None, :]
             & (qmin[:, :, None] == kmin[:, None, :]))
        return a[:, None], l[:, None]
    a_parts, l_parts = [], []
    rows = max(sb_q, (1 << 24) // max(1, sk) // sb_q * sb_q)
    for r0 in range(0, sq, rows):
        eq = qid[:, r0:r0 + rows, None] == kid[:, None, :]      # [bd, rows, Sk]
        a, l = _block_reduce(eq[:, None], sb_q, sb_k)
        a_parts.append(a)
        l_parts.append(l)
    return torch.cat(a_parts, 2), torch.cat(l_parts, 2)


def _build_lists(p, ma: MaskArgs, sb_q, sb_k, device) -> TileLists:
    rm = p.mask
    Sq, Sk = p.seq_q, p.seq_k
    nq, nk = cdiv(Sq, sb_q), cdiv(Sk, sb_k)
    any_k = torch.ones(1, 1, nq, nk, dtype=torch.bool, device=device)
    all_k = torch.ones(1, 1, nq, nk, dtype=torch.bool, device=device)
    if rm.has_band:
        i0 = torch.arange(nq, device=device) * sb_q
        i1 = torch.clamp(i0 + sb_q, max=Sq) - 1
        j0 = torch.arange(nk, device=device) * sb_k
        j1 = torch.clamp(j0 + sb_k, max=Sk) - 1
        dmin = j0[None, :] - i1[:, None]                      # [nQ, nK]
        dmax = j1[None, :] - i0[:, None]
        any_k = any_k & ((dmax >= ma.lo) & (dmin <= ma.hi))
        all_k = all_k & ((dmin >= ma.lo) & (dmax <= ma.hi))
    if ma.has_docs:
        a, l = doc_blocks(ma.qid, ma.kid, sb_q, sb_k, all(ma.ids_sorted))
        any_k, all_k = any_k & a, all_k & l
    if ma.has_keep:
        keep = mask_inputs.to_device(rm.keep, device, torch.bool, keep=True)
        bx, hx = keep.shape[0], keep.shape[1]
        a, l = _block_reduce(keep.expand(bx, hx, Sq, Sk), sb_q, sb_k)
        any_k, all_k = any_k & a, all_k & l
    if rm.mask_fns:
        # mask functions: classified on the device by the generated mask function
        # (every pair evaluated once; cached by the graphs' keys, the captures' digest,
        # the sizes and the block size)
        from . import programs

        a, l = programs.mask_blocks(rm.mask_fns, (p.batch, p.heads_q, Sq, Sk), sb_q, sb_k,
                                    device)
        any_k, all_k = any_k & a, all_k & l
    # blocks that cross the problem's edge keep the bounds checks of a partial block
    if Sq % sb_q:
        all_k[:, :, -1, :] = False
    if Sk % sb_k:
        all_k[:, :, :, -1] = False
    bm_, hm_ = max(any_k.shape[0], all_k.shape[0]), max(any_k.shape[1], all_k.shape[1])
    full = all_k.expand(bm_, hm_, nq, nk)
    part = (any_k & ~all_k).expand(bm_, hm_, nq, nk)

    def lists(m):  # m bool [..., n] -> count [...] and indices of the True entries first
        cnt = m.sum(-1, dtype=torch.int32).contiguous()
        idx = torch.argsort((~m).to(torch.int8), dim=-1, stable=True).to(torch.int32).contiguous()
        return cnt, idx

    if ma.mode == 2:
        rr, cr = block_ranges(part, full), block_ranges(part.transpose(-1, -2),
                                                          full.transpose(-1, -2))
        z = dummy(device)
        return TileLists(rr, z, z, z, cr, z, z, z, bm_, hm_, nq, nk, mode=2)
    rc, ri = lists(part)
    rfc, rfi = lists(full)
    cc, ci = lists(part.transpose(-1, -2))
    cfc, cfi = lists(full.transpose(-1, -2))
    return TileLists(rc, ri, rfc, rfi, cc, ci, cfc, cfi, bm_, hm_, nq, nk)


def block_ranges(part, full):
    """Range table of each row of a block map: bool [Bm, Hm, n, m] (partial, full) ->
    int32 [Bm, Hm, n, 4] = (t0, f0, f1, t1): every kept block of the row lies in
    [t0, t1); [f0, f1) is its first run of full blocks (t0 <= f0 <= f1 <= t1); a row
    without kept blocks gets (0, 0, 0, 0).  Blocks of [t0, t1) outside [f0, f1) are
    visited masked, so the table is right for any map (exact where the kept blocks are
    contiguous and the full ones one run, as for sorted document ids)."""
    kept = part | full
    m = kept.shape[-1]
    j = torch.arange(m, device=kept.device, dtype=torch.int32)
    big = torch.full((), m, dtype=torch.int32, device=kept.device)
    zero = torch.zeros((), dtype=torch.int32, device=kept.device)
    t0 = torch.where(kept, j, big).amin(-1)                           # [Bm, Hm, n]
    t1 = torch.where(kept, j + 1, zero).amax(-1)
    f0 = torch.where(full, j, big).amin(-1)
    # the first non-full block after f0 ends the run
    f1 = torch.where(~full & (j > f0[..., None]), j, big).amin(-1)
    f1 = torch.minimum(f1, t1)
    has_full = f0 < m
    f0 = torch.where(has_full, f0, t0)
    f1 = torch.where(has_full, f1, t0)
    t0 = torch.where(t1 > 0, t0, zero)                                 # empty row: 0s
    f0, f1 = torch.where(t1 > 0, f0, zero), torch.where(t1 > 0, f1, zero)
    return torch.stack([t0, f0, f1, t1], -1).to(torch.int32).contiguous()


def tile_lists(p, ma: MaskArgs, sb_q: int, sb_k: int, device) -> TileLists:
    """The tile lists of p's mask at block size sb_q x sb_k, cached per mask contents
    (torch masks only; the cache holds the mask tensors so their memory stays theirs)."""
    rm = p.mask
    if rm.mask_fns:      # programs.mask_blocks caches the functions' block maps by content
        return _build_lists(p, ma, sb_q, sb_k, device)
    parts = [mask_inputs.tensor_key(rm.keep), mask_inputs.tensor_key(rm.q_ids),
             mask_inputs.tensor_key(rm.k_ids)]
    if any(k is None for k in parts):
        return _build_lists(p, ma, sb_q, sb_k, device)
    key = (tuple(parts), ma.lo, ma.hi, p.batch, p.heads_q, p.seq_q, p.seq_k, sb_q, sb_k,
           str(device), ma.mode)
    hit = _list_cache.get(key)
    if hit is not None:
        _list_cache.move_to_end(key)
        return hit[0]
    tl_ = _build_lists(p, ma, sb_q, sb_k, device)
    _list_cache[key] = (tl_, (rm.keep, rm.q_ids, rm.k_ids))
    while len(_list_cache) > _CACHE_SIZE:
        _list_cache.popitem(last=False)
    return tl_


def no_lists(device):
    z = dummy(device)
    return TileLists(z, z, z, z, z, z, z, z, 1, 1, 1, 1)


def lists_for(p, ma, plan, device):
    if ma.mode == 0:
        return no_lists(device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise NotImplementedError(
            "a Documents / KeepMask mask under CUDA graph capture: its tile lists are "
            "built from the mask's contents with host synchronisation and cached outside "
            "the graph, so a replay would not follow new mask contents; capture calls "
            "with Causal / Window masks (or none), or run this call eagerly")
    return tile_lists(p, ma, plan.sbq, plan.sbk, device)
