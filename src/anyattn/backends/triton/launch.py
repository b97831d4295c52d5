"""Launch code for the Triton kernels: layouts, strides, dtypes, mask tile lists, grids.

Shape legend: B batch, H = Hq query heads, Hkv kv heads, G = H / Hkv, Sq / Sk
queries / keys, D head dim, nQ / nK mask blocks along queries / keys.

Inputs may have any strides; a tensor whose last dim is not contiguous is copied
once (the kernels assume unit stride along D), every other layout (including
strided float32 views into an ABI arena) is read in place.  Outputs are fresh
contiguous [B, H, S, D] tensors.

Every tiled launch goes through ``_launch`` on a call signature's first call: a config
that needs more shared memory than the GPU has falls back to fewer stages / smaller
tiles (remembered per kernel signature); with ANYATTN_TRITON_AUTOTUNE=1 the candidates
of configs.py are timed once per key.  What a call derives from its shapes, layouts,
options and environment (routing, plan, flags, constexprs, grids, resolved configs) is
kept per call signature (``_Prepared``, keyed as prepared.py says), so a repeated call
only allocates its outputs, builds the argument tuple and launches.  Documents /
KeepMask problems use tile lists built on the GPU once per mask and cached on the mask
tensors' identity and version counter.
"""
from __future__ import annotations

import collections
import os
from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import torch

from ...dropout import keep_scale, threshold
from ...modifiers import NO_MODS, ScoreMods, alibi_diag
from ...rowstats import RowStats
from .device_ctx import on_device
from . import configs as C
from . import kernels as K
from . import mask_inputs as MI
from . import prepared as P

__all__ = ["forward", "backward", "tile_lists", "clear_caches", "set_mask_lowering"]

_BIG = 1 << 30            # an open band side


def _cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints (triton.cdiv is a constexpr function: ~10x the cost)."""
    return -(-a // b)


def _interpreter_compat() -> None:
    """Triton 3.6's interpreter converts scalar tensors (1-element arrays) to loop
    bounds with int(array), which NumPy >= 2.4 refuses for 1-D arrays; convert
    through .item() instead.  Only under TRITON_INTERPRET=1; idempotent."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    from triton.runtime import interpreter as I

    if getattr(I._patch_lang_tensor, "_anyattn_compat", False):
        return
    orig = I._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__",
                       lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._anyattn_compat = True
    I._patch_lang_tensor = patched


_interpreter_compat()


def _unit_last(x):
    """x with stride 1 along its last dim (a copy only when it is not)."""
    if x is None or x.shape[-1] <= 1 or x.stride(-1) == 1:
        return x
    return x.contiguous()


#: fp32 product scheme of the plan -> (PREC of the fwd / bwd kernels, parts per
#: operand).  'bf16x6' / 'bf16x3' split q, k, v, dout once here into bf16 parts
#: ('split6' / 'split3'); the '...r' variants split every tile in registers inside the
#: kernels instead; 'f16x3' / 'f16x1' store scaled fp16 parts (hi, lo / hi alone) and
#: multiply them in three / one fp16 products ('hsplit3' / 'hsplit1', kernels.py doc);
#: 'f16x31' three for the score products, one for the accumulating ones ('hsplit31').
_KERNEL_PREC = {"bf16x6": ("split6", 3), "bf16x3": ("split3", 2),
                "bf16x6r": ("bf16x6", 1), "bf16x3r": ("bf16x3", 1),
                "f16x3": ("hsplit3", 2), "f16x1": ("hsplit1", 1), "f16x31": ("hsplit31", 2)}
_SCALED = ("hsplit3", "hsplit1", "hsplit31")


def _kernel_prec(p, plan):
    """(PREC for the forward / backward kernels, parts per operand) of a problem."""
    if p.dtype == "float32" and plan.prec in _KERNEL_PREC:
        return _KERNEL_PREC[plan.prec]
    return plan.prec, 1


def _register_prec(prec: str) -> str:
    """The in-register form of a product scheme (for the kernel that takes fp32 tiles:
    the broadcast dbias reduction); the scaled fp16 schemes use the bf16 one of the
    same accuracy class there."""
    return {"bf16x6r": "bf16x6", "bf16x3r": "bf16x3", "f16x3": "bf16x6",
            "f16x1": "bf16x3", "f16x31": "bf16x3"}.get(prec, prec)


def _split_parts(x, n: int):
    """fp32 [B, H, S, D] -> contiguous bf16 [B, H, S, n * D] holding the parts of x side
    by side along the last dim: hi, mid (n = 2) and lo (n = 3), x ~= hi + mid + lo, each
    rounded as the kernels' in-register split rounds (to nearest on a GPU; Triton's
    interpreter truncates), so both give the same bits (n = 1: x itself)."""
    if n == 1:
        return x
    B, H, S, D = x.shape
    out = torch.empty((B, H, S, n * D), dtype=torch.bfloat16, device=x.device)
    bm = 32
    with on_device(x.device):
        K._split_kernel[(_cdiv(S, bm), B * H)](x, out, *_s3(x), H, S, D=D,
                                                      DP=C.padded_dim(D), NP=n, BM=bm)
    return out


def _row_stats(x):
    """Per row of x [B, H, S, D], over its finite entries: (max |x|, Euclidean norm), each
    [B, H, S] float64 (K._row_stats_kernel; float64 so that huge rows do not overflow)."""
    B, H, S, D = x.shape
    amax = torch.empty((B, H, S), dtype=torch.float32, device=x.device)
    rsq = torch.empty((B, H, S), dtype=torch.float32, device=x.device)
    bm = 32
    K._row_stats_kernel[(_cdiv(S, bm), B * H)](x, amax, rsq, *_s3(x), H, S, D=D,
                                                     DP=C.padded_dim(D), BM=bm)
    amax = amax.double()
    return amax, amax * rsq.double().sqrt()


def _group_max(t, B, Hkv):
    """[B, H, S] -> [B * Hkv]: the max over each kv head's query-head group and S
    (0 where that is empty)."""
    t = t.reshape(B * Hkv, -1)
    if t.shape[1] == 0:
        return torch.zeros(B * Hkv, dtype=t.dtype, device=t.device)
    return t.amax(dim=1)


#: |x * sigma| <= 2^SIGMA_EXP for every operand part; |dS * gamma| <= 2^GAMMA_EXP when p <= 1
SIGMA_EXP = 14
GAMMA_EXP = 10


def _pow2_scale(m, target_exp: int):
    """float64 m >= 0 -> the power of two 2^(target_exp - e) with m <= 2^e (m = 0 ->
    2^target_exp); e is clamped so that the scale is a normal fp32 (m below that range
    keeps fewer bits, as fp32 subnormals do)."""
    _, e = torch.frexp(m)
    e = torch.where(m > 0, e, torch.zeros_like(e)).clamp(target_exp - 126, target_exp + 126)
    return torch.ldexp(torch.ones_like(m), (target_exp - e).to(m.dtype))


def _f16_scales(p, q, k, v, dout=None, delta=None):
    """Scales of the scaled-fp16 schemes, all powers of two, per (batch, kv head):
    sigma of q, k, v, dout (from the finite max |x| over the kv head's group), gamma of
    dS (from max_i |dout_i| * max_j |v_j| + max |delta|, row norms; the bound of |dS|
    when p <= 1) and the table SC [B * Hkv, 8] fp32 of the factors the kernels apply
    (kernels.py doc), computed in float64.  Everything stays on the device (no host
    synchronisation).  Returns (SC, {name: sigma [B * Hkv] fp32})."""
    B, Hkv = p.batch, p.heads_kv
    st = {n: _row_stats(x) for n, x in (("q", q), ("k", k), ("v", v), ("do", dout))
          if x is not None}
    sig = {n: _pow2_scale(_group_max(a, B, Hkv), SIGMA_EXP) for n, (a, _) in st.items()}
    sc = torch.zeros((B * Hkv, 8), dtype=torch.float64, device=q.device)
    sc[:, 0] = 1.0 / (sig["q"] * sig["k"])
    sc[:, 3] = 1.0 / (sig["v"] * float(K.PS_FWD.value))
    if dout is not None:
        nrm = _group_max(st["do"][1], B, Hkv) * _group_max(st["v"][1], B, Hkv)
        dl = delta.double().abs()
        dl = _group_max(torch.where(dl < float("inf"), dl, torch.zeros_like(dl)), B, Hkv)
        gam = _pow2_scale(nrm + dl, GAMMA_EXP)
        sc[:, 1] = 1.0 / (sig["v"] * sig["do"])
        sc[:, 2] = gam
        sc[:, 4] = 1.0 / (sig["do"] * float(K.PS_BWD.value))
        sc[:, 5] = 1.0 / (gam * sig["q"])
        sc[:, 6] = 1.0 / (gam * sig["k"])
    return sc.float(), {n: s.float() for n, s in sig.items()}


def _split_half(x, sig, group: int, n: int):
    """fp32 [B, H, S, D] times sigma [B * Hkv] (per kv-head group of `group` heads) ->
    contiguous fp16 [B, H, S, n * D]: hi (n = 1) and lo (n = 2) of the scaled values,
    rounded to nearest (K._split_f16_kernel)."""
    B, H, S, D = x.shape
    out = torch.empty((B, H, S, n * D), dtype=torch.float16, device=x.device)
    bm = 32
    K._split_f16_kernel[(_cdiv(S, bm), B * H)](x, out, sig, *_s3(x), H, group, S, D=D,
                                                     DP=C.padded_dim(D), NP=n, BM=bm)
    return out


def _s3(x):
    """(batch, head, seq) strides of a [B, H, S, D] tensor."""
    return x.stride()[:3]


@dataclass
class _MaskArgs:
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
    mode: int                  # 0 in-kernel ranges, 1 tile lists, 2 block-range tables
    #: (q rows sorted, k rows sorted) of the kernels' document ids (mask_inputs.KernelIds)
    ids_sorted: tuple = (False, False)


#: one-element placeholders for absent operands, per (device, dtype): the kernels never
#: read or write them (their constexpr flag is off), so one per device serves every call
#: and a call launches no fill kernels for them.
_dummies: Dict[tuple, Any] = {}


def _dummy(device, dtype=torch.int32):
    key = (device, dtype)
    t = _dummies.get(key)
    if t is None:
        t = _dummies[key] = torch.zeros(1, dtype=dtype, device=device)
    return t


def _mask_args(p, q, bias) -> _MaskArgs:
    rm = p.mask
    dev = q.device
    B, H, Sq, Sk = p.batch, p.heads_q, p.seq_q, p.seq_k
    lo = -_BIG if rm.band_lo is None else int(rm.band_lo)
    hi = _BIG if rm.band_hi is None else int(rm.band_hi)
    lo, hi = max(lo, -_BIG), min(hi, _BIG)
    has_docs = rm.q_ids is not None
    if has_docs:
        ids = MI.kernel_ids(rm.q_ids, rm.k_ids, dev)
        qid, kid = ids.q.contiguous(), ids.k.contiguous()
        sqid_b = Sq if qid.shape[0] > 1 else 0
        skid_b = Sk if kid.shape[0] > 1 else 0
        ids_sorted = (ids.q_sorted, ids.k_sorted)
    else:
        qid = kid = _dummy(dev)
        sqid_b = skid_b = 0
        ids_sorted = (False, False)
    has_keep = rm.keep is not None
    if has_keep:
        km = MI.to_device(rm.keep, dev, torch.bool, keep=True).view(torch.uint8).expand(
            B, H, Sq, Sk)
        skm = tuple(km.stride())
    else:
        km, skm = _dummy(dev, torch.uint8), (0, 0, 0, 0)
    if bias is not None:
        bx = bias.expand(B, H, Sq, Sk)
        sb = tuple(bx.stride())
    else:
        bx, sb = _dummy(dev, torch.float32), (0, 0, 0, 0)
    return _MaskArgs(lo=lo, hi=hi, has_band=rm.has_band, qid=qid, kid=kid, sqid_b=sqid_b,
                     skid_b=skid_b, km=km, skm=skm, has_docs=has_docs, has_keep=has_keep,
                     bias=bx, sb=sb, has_bias=bias is not None, ids_sorted=ids_sorted,
                     mode=_ARRAY_MASK_MODE[_mask_lowering] if (has_docs or has_keep) else 0)


@dataclass
class _ModArgs:
    """The score modifiers as the kernels take them (anyattn.modifiers): constexpr flags,
    fp32 buffers (a 1-element dummy where absent) and scalars."""

    softcap: bool
    alibi: bool
    sinks: bool
    slopes: Any                # fp32 [Ba, H] contiguous
    sl_b: int                  # batch stride of slopes (0: one row for every batch)
    sink_t: Any                # fp32 [H]
    cap: float                 # c (1.0 unused)
    adiag: int                 # alibi_diag(p)
    dropout: bool = False      # anyattn.dropout's keep mask (constexpr DROPOUT)
    tanh_mode: int = 1         # softcap's tanh: 1 portable fp32, 2 tanh.approx (configs)
    drop: tuple = ()           # (DW words buffer, threshold as int32 bits, 1 / (1 - p))

    @property
    def scalars(self):
        return (self.sl_b, self.cap, self.adiag, *self.drop)

    @property
    def flags(self):
        return dict(SOFTCAP=self.tanh_mode if self.softcap else 0, ALIBI=self.alibi,
                    DROPOUT=self.dropout)


def _u32_bits(x: int) -> int:
    """A uint32 value as the int32 with its bits (every 32-bit kernel scalar is passed as
    int32, one signature whatever the value; the kernels bitcast it back)."""
    x = int(x)
    if not 0 <= x < 1 << 32:
        raise ValueError(f"{x} is not a 32-bit unsigned integer")
    return x - (1 << 32) if x >= 1 << 31 else x


def _drop_args(p, dev, draw: bool = True) -> tuple:
    """(DROPOUT, (DW, threshold, 1 / (1 - p))) of p's dropout (anyattn.dropout;
    p.dropout_p = 0: off).  DW int32 [Sk + B * H * Sq]: the premixed column words, then
    the row words of every (b, h), drawn once per call by K._drop_words_kernel (the seed
    halves and offsets travel as int32 bits, one kernel signature for every value).
    ``draw=False``: the flag only (placeholder scalars, nothing launched)."""
    if not p.has_dropout or not draw:
        return p.has_dropout and not draw, (_dummy(dev), 0, 1.0)
    B, H, Sq, Sk = p.batch, p.heads_q, p.seq_q, p.seq_k
    seed = int(p.dropout_seed)
    dw = torch.empty(Sk + B * H * Sq, dtype=torch.int32, device=dev)
    bl = 128
    with on_device(dev):
        K._drop_words_kernel[(_cdiv(max(Sq, Sk, 1), bl), 1 + B * H)](
            dw, H, Sq, Sk, _u32_bits(p.q_offset), _u32_bits(p.k_offset),
            _u32_bits(seed & 0xFFFFFFFF), _u32_bits(seed >> 32), BLOCK=bl)
    return True, (dw, _u32_bits(threshold(p.dropout_p)), float(keep_scale(p.dropout_p)))


def _mod_args(p, mods: Optional[ScoreMods], dev, draw: bool = True) -> _ModArgs:
    """``draw=False``: the flags and scalars without drawing the dropout words (for a
    prepared launch's constexprs)."""
    mods = NO_MODS if mods is None else mods
    if p.softcap is not None and not p.softcap > 0:
        raise ValueError(f"softcap {p.softcap}: expected c > 0")
    slopes, sl_b = _dummy(dev, torch.float32), 0
    if mods.alibi_slopes is not None:
        slopes = MI.to_device(mods.alibi_slopes, dev, torch.float32).reshape(-1, p.heads_q)
        slopes = slopes.contiguous()
        sl_b = p.heads_q if slopes.shape[0] > 1 else 0
    sink_t = _dummy(dev, torch.float32)
    if mods.sinks is not None:
        sink_t = MI.to_device(mods.sinks, dev, torch.float32).reshape(p.heads_q).contiguous()
    dropout, drop = _drop_args(p, dev, draw)
    return _ModArgs(softcap=p.softcap is not None, alibi=mods.alibi_slopes is not None,
                    sinks=mods.sinks is not None, slopes=slopes, sl_b=sl_b, sink_t=sink_t,
                    cap=float(p.softcap) if p.softcap is not None else 1.0,
                    adiag=int(alibi_diag(p)) if mods.alibi_slopes is not None else 0,
                    dropout=dropout, drop=drop,
                    tanh_mode=C.softcap_mode(p.dtype, dev) if p.softcap is not None else 1)


# ----------------------------------------------------------------------------- tile lists
#: how Documents / KeepMask masks reach the portable kernels (set_mask_lowering):
#: "lists" (MODE 1, the default) or "ranges" (MODE 2)
_mask_lowering = "lists"
_ARRAY_MASK_MODE = {"lists": 1, "ranges": 2}


def set_mask_lowering(name: Optional[str]) -> None:
    """Choose how Documents / KeepMask masks reach the portable kernels, process-wide:
    ``"lists"`` (None: the default) — per block row / column the sorted indices of its
    partial and of its full blocks; ``"ranges"`` — per block row / column one range of
    blocks holding every kept block, with the run of full blocks inside it unmasked
    (exact for sorted document ids, where the kept blocks of a row are contiguous; a
    range over a scattered KeepMask also visits the empty blocks between, masked).
    Forgets the tile lists and prepared launches built under the other choice."""
    global _mask_lowering
    name = "lists" if name is None else name
    if name not in _ARRAY_MASK_MODE:
        raise ValueError(f"set_mask_lowering: {name!r} is not a mask lowering; expected one "
                         f"of {sorted(_ARRAY_MASK_MODE)} (or None for the default 'lists')")
    if name != _mask_lowering:
        _mask_lowering = name
        clear_caches()


@dataclass
class TileLists:
    """Per mask-block row (queries) and column (keys): counts and sorted indices of
    partial and full blocks.  rows: cnt [Bm, Hm, nQ], idx [Bm, Hm, nQ, nK];
    cols: cnt [Bm, Hm, nK], idx [Bm, Hm, nK, nQ]; Bm, Hm are 1 where nothing varies.
    With ``mode == 2`` (block ranges) row_cnt / col_cnt hold instead the range tables
    int32 [Bm, Hm, nQ, 4] / [Bm, Hm, nK, 4] (first kept block, first and one past the
    last of the run of full blocks, one past the last kept block; the kernels read them
    in place of the counts) and the other fields are placeholders."""

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


def clear_caches() -> None:
    """Forget the tile lists, the mask arrays' kept copies and facts, and the prepared
    launches."""
    _list_cache.clear()
    MI.clear()
    _prepared.clear()


def _block_reduce(x, sb_q, sb_k):
    """any / all of a bool [Bx, Hx, Sq, Sk] over blocks -> two [Bx, Hx, nQ, nK]."""
    bx, hx, sq, sk = x.shape
    nq, nk = _cdiv(sq, sb_q), _cdiv(sk, sb_k)
    pq, pk = nq * sb_q - sq, nk * sb_k - sk
    xa = torch.nn.functional.pad(x, (0, pk, 0, pq), value=False) if (pq or pk) else x
    xl = torch.nn.functional.pad(x, (0, pk, 0, pq), value=True) if (pq or pk) else x
    shp = (bx, hx, nq, sb_q, nk, sb_k)
    return xa.reshape(shp).any(dim=5).any(dim=3), xl.reshape(shp).all(dim=5).all(dim=3)


def _doc_blocks(qid, kid, sb_q, sb_k, sorted_ids: bool):
    """any / all of q_ids[i] == k_ids[j] per block -> two bool [Bd, 1, nQ, nK].
    sorted_ids: every row of both id arrays is non-decreasing (mask_inputs.kernel_ids):
    the blocks' id intervals decide then, else the ids are compared pairwise."""
    bd = max(qid.shape[0], kid.shape[0])
    qid = qid.expand(bd, -1).to(torch.int64)
    kid = kid.expand(bd, -1).to(torch.int64)
    sq, sk = qid.shape[1], kid.shape[1]
    nq, nk = _cdiv(sq, sb_q), _cdiv(sk, sb_k)

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


def _build_lists(p, ma: _MaskArgs, sb_q, sb_k, device) -> TileLists:
    rm = p.mask
    Sq, Sk = p.seq_q, p.seq_k
    nq, nk = _cdiv(Sq, sb_q), _cdiv(Sk, sb_k)
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
        a, l = _doc_blocks(ma.qid, ma.kid, sb_q, sb_k, all(ma.ids_sorted))
        any_k, all_k = any_k & a, all_k & l
    if ma.has_keep:
        keep = MI.to_device(rm.keep, device, torch.bool, keep=True)
        bx, hx = keep.shape[0], keep.shape[1]
        a, l = _block_reduce(keep.expand(bx, hx, Sq, Sk), sb_q, sb_k)
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
        rr, cr = _block_ranges(part, full), _block_ranges(part.transpose(-1, -2),
                                                          full.transpose(-1, -2))
        z = _dummy(device)
        return TileLists(rr, z, z, z, cr, z, z, z, bm_, hm_, nq, nk, mode=2)
    rc, ri = lists(part)
    rfc, rfi = lists(full)
    cc, ci = lists(part.transpose(-1, -2))
    cfc, cfi = lists(full.transpose(-1, -2))
    return TileLists(rc, ri, rfc, rfi, cc, ci, cfc, cfi, bm_, hm_, nq, nk)


def _block_ranges(part, full):
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


def tile_lists(p, ma: _MaskArgs, sb_q: int, sb_k: int, device) -> TileLists:
    """The tile lists of p's mask at block size sb_q x sb_k, cached per mask contents
    (torch masks only; the cache holds the mask tensors so their memory stays theirs)."""
    rm = p.mask
    parts = [MI.tensor_key(rm.keep), MI.tensor_key(rm.q_ids), MI.tensor_key(rm.k_ids)]
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


def _no_lists(device):
    z = _dummy(device)
    return TileLists(z, z, z, z, z, z, z, z, 1, 1, 1, 1)


# ----------------------------------------------------------------------------- launching
_fallback_cache: Dict[tuple, C.KernelConfig] = {}


def _fallbacks(cfg: C.KernelConfig):
    """cfg, then cheaper variants (fewer stages, then smaller tiles) for when a config
    needs more shared memory than the GPU has (e.g. mask sub-tiling at large D)."""
    yield cfg
    if cfg.num_stages > 2:
        yield C.KernelConfig(cfg.bm, cfg.bn, cfg.num_warps, 2)
    if cfg.num_stages > 1:
        yield C.KernelConfig(cfg.bm, cfg.bn, cfg.num_warps, 1)
    if cfg.bm > 16:
        yield C.KernelConfig(cfg.bm // 2, cfg.bn, cfg.num_warps, 2)
        yield C.KernelConfig(cfg.bm // 2, cfg.bn, cfg.num_warps, 1)
    if cfg.bm > 16 and cfg.bn > 16:
        yield C.KernelConfig(cfg.bm // 2, cfg.bn // 2, 4, 1)


def _launch(kernel, grid_of, cfg: C.KernelConfig, args, kw, sig, tune_key=None):
    """kernel[grid_of(cfg)](*args, BM=, BN=, **kw) with the first config of
    _fallbacks(cfg) that fits the GPU's resources (remembered per signature).
    With ANYATTN_TRITON_AUTOTUNE=1 and a ``tune_key`` (kernel, DP, dtype, precision, mask
    class, bias, length bucket), the candidates of configs.candidates are timed once
    on these inputs and the fastest is used from then on."""
    from triton.runtime.errors import OutOfResources

    name = kernel.fn.__name__ if hasattr(kernel, "fn") else str(kernel)
    if tune_key is not None and C.autotune_enabled():
        sbq, sbk = kw.get("SBQ", 128), kw.get("SBK", 128)
        cands = [cfg] + [c for c in C.candidates(tune_key[0], kw["DP"], tune_key[2])
                         if sbq % c.bm == 0 and sbk % c.bn == 0 and c != cfg]

        def run(c):
            return lambda: kernel[grid_of(c)](*args, BM=c.bm, BN=c.bn, num_warps=c.num_warps,
                                              num_stages=c.num_stages, **kw)

        cfg = C.tune(tune_key + (sig,), cands, run)
    key = (name, cfg, sig)
    first = _fallback_cache.get(key)
    tries = [first] if first is not None else list(_fallbacks(cfg))
    err = None
    for c in tries:
        try:
            kernel[grid_of(c)](*args, BM=c.bm, BN=c.bn, num_warps=c.num_warps,
                               num_stages=c.num_stages, **kw)
            _fallback_cache[key] = c
            return c
        except OutOfResources as e:
            err = e
    raise err


def _tune_key(kernel: str, p, plan) -> tuple:
    return (kernel, C.padded_dim(p.head_dim), p.dtype, plan.prec, p.mask_class, p.has_bias,
            C.length_bucket(max(p.seq_q, p.seq_k)))


def _sig(**kw):
    return tuple(sorted(kw.items()))


# ----------------------------------------------------------------------------- plans
def _plan(p, plan: Optional[C.Plan]) -> C.Plan:
    if plan is not None:
        return plan
    return C.plan_for(C.padded_dim(p.head_dim), p.dtype, p.precision, p.mask_class,
                      p.has_bias, max(p.seq_q, p.seq_k))


def _lists_for(p, ma, plan, device):
    if ma.mode == 0:
        return _no_lists(device)
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise NotImplementedError(
            "a Documents / KeepMask mask under CUDA graph capture: its tile lists are "
            "built from the mask's contents with host synchronisation and cached outside "
            "the graph, so a replay would not follow new mask contents; capture calls "
            "with Causal / Window masks (or none), or run this call eagerly")
    return tile_lists(p, ma, plan.sbq, plan.sbk, device)


# ----------------------------------------------------------------------------- routing
def _use_hopper(p, direction: str, plan, tensors) -> bool:
    """Whether this call runs on the Hopper kernels (hopper/coverage.py's table, as data;
    'auto' only where the table's entry is routed by default; ANYATTN_TRITON_PATH=
    portable|hopper forces a path, and hopper on a call outside the table raises with the
    reason).  An explicit portable ``plan`` keeps the portable path."""
    from .hopper import coverage as HC

    setting = HC.path_setting()
    if setting == "portable":
        return False
    why = HC.supports(p, direction, tensors)
    if setting == "hopper":
        if plan is not None:
            why = why or "an explicit portable plan was passed"
        if why is not None:
            raise NotImplementedError(
                f"ANYATTN_TRITON_PATH=hopper: the Hopper {direction} path does not cover "
                f"this call: {why}; unset it (or set 'auto' / 'portable') for the "
                f"portable kernels")
        return True
    return why is None and plan is None and HC.routed_by_default(direction, p.mask_class,
                                                                 p.head_dim)


# ----------------------------------------------------------------------------- prepared
@dataclass
class _Prepared:
    """What one call signature's launches need besides its tensors (key: prepared.py):
    the routing, the plan, the operand scheme, the mask / modifier arguments and tile
    lists where they hold no per-call tensor (None: built on every call), the
    backward's decisions, and per tiled kernel its launch once the first call has
    resolved it through _launch (fallbacks, autotuning)."""

    hop: bool
    #: the Hopper forward's launch (hopper/launch.py FwdLaunch: config, grid, scalars,
    #: constexprs; its TMA descriptors are built per call on the call's tensors)
    hfwd: Any = None
    #: the Hopper backward's config (hopper/launch.py backward_config: it reads only
    #: Problem fields and the device's SM count), resolved on the signature's first call
    hcfg: Any = None
    plan: Optional[C.Plan] = None
    prec: str = ""
    nparts: int = 1
    ma: Optional[_MaskArgs] = None      # None: a bias, Documents or KeepMask (per call)
    md: Optional[_ModArgs] = None       # None: slopes, sinks or dropout (per call)
    tlists: Optional[TileLists] = None  # None: the mask's tile lists (their own cache)
    sc: Any = None                      # the fp32 placeholder of the scale table
    common: Optional[dict] = None       # the constexprs every backward kernel takes
    # backward: which gradients and which dbias route (see backward)
    want_ds: bool = False
    want_db: bool = False
    full_bias: bool = False
    owner_db: bool = False
    want_kv: bool = False
    want_q: bool = False
    #: on a CUDA device unless ANYATTN_TRITON_DIRECT_LAUNCH=0 (direct.enabled): repeats
    #: skip Triton's argument binding (direct.Site)
    direct: bool = False
    #: kernel name -> [grid, positional tail, keywords] of its resolved launch
    ready: Dict[str, list] = field(default_factory=dict)
    #: launch name -> its direct.Site (made on its first call through _site; the
    #: resolved launches' replays, the delta preprocess, the Hopper backward's kernels)
    sites: Dict[Any, Any] = field(default_factory=dict)


#: prepared launches, one per call signature (a training step of a model with a few
#: attention shapes needs a handful; 64 bounds what odd workloads keep)
_prepared = P.LRU(64)


def _prepare(direction: str, p, plan, mods, named, bias) -> _Prepared:
    """The prepared launch of this call (built on its signature's first call)."""
    key = P.call_key(direction, p, plan, mods, [x for _, x in named] + [bias])
    pr = _prepared.get(key)
    if pr is None:
        pr = _build(direction, p, plan, mods, named, bias)
        _prepared.put(key, pr)
    return pr


def _build(direction: str, p, plan, mods, named, bias) -> _Prepared:
    from . import direct as DL

    hop = _use_hopper(p, direction, plan, named)
    if hop and direction == "forward":
        from .hopper import launch as HL

        return _Prepared(hop=True, hfwd=HL.prepare_forward(
            p, direct=DL.enabled(named[0][1].device)))
    q = named[0][1]
    dev = q.device
    plan = _plan(p, plan)
    prec, nparts = _kernel_prec(p, plan)
    ma = _mask_args(p, q, bias)
    md = _mod_args(p, mods, dev, draw=False)
    per_call_md = md.alibi or md.sinks or md.dropout
    pr = _Prepared(hop=hop, plan=plan, prec=prec, nparts=nparts,
                   ma=None if (bias is not None or ma.mode) else ma,
                   md=None if per_call_md else md,
                   tlists=_no_lists(dev) if ma.mode == 0 else None,
                   sc=_dummy(dev, torch.float32),
                   direct=DL.enabled(q.device))
    if direction == "backward":
        B, H, Sq, Sk, D = p.batch, p.heads_q, p.seq_q, p.seq_k, p.head_dim
        pr.common = dict(D=D, DP=C.padded_dim(D), HAS_BAND=ma.has_band, HAS_DOCS=ma.has_docs,
                         HAS_KEEP=ma.has_keep, PREC=prec, **md.flags)
        pr.want_ds = "sinks" in p.wrt and md.sinks
        pr.want_db = "bias" in p.wrt and bias is not None
        pr.full_bias = pr.want_db and tuple(p.bias_shape) == (B, H, Sq, Sk)
        # broadcast over batch and/or heads only: the dq programs own and sum the dbias rows
        pr.owner_db = (pr.want_db and not pr.full_bias and tuple(p.bias_shape[2:]) == (Sq, Sk)
                       and os.environ.get("ANYATTN_TRITON_DBIAS") != "recompute")
        pr.want_kv = "k" in p.wrt or "v" in p.wrt
        pr.want_q = "q" in p.wrt or pr.full_bias or pr.owner_db
    return pr


def _run(pr: _Prepared, name: str, kernel, args, first) -> None:
    """kernel[grid](*args, **keywords) with the launch this signature resolved; on its
    first call ``first() -> (grid_of, cfg, kw, tune_key, operand dtype)`` goes through
    _launch (fallbacks, autotuning) and the result is kept."""
    ready = pr.ready.get(name)
    if ready is not None:
        _replay(pr, name, ready, kernel, args)
        return
    grid_of, cfg, kw, tune_key, dt = first()
    c = _launch(kernel, grid_of, cfg, args, kw, _sig(dt=dt, **kw), tune_key)
    pr.ready[name] = [grid_of(c), (), dict(kw, BM=c.bm, BN=c.bn, num_warps=c.num_warps,
                                           num_stages=c.num_stages)]


def _replay(pr: _Prepared, name: str, ready: list, kernel, args) -> None:
    """A resolved launch again: kernel[grid](*args, *tail, **keywords) through the
    launch's direct.Site: with pr.direct, the compiled kernel straight through its C
    launcher where the arguments show the facts it was compiled for."""
    grid, tail, kw = ready
    _site(pr, name, kernel)(grid, args + tail if tail else args, kw)


def _site(pr: _Prepared, name: str, kernel):
    """The direct.Site of launch ``name`` of this signature (made on its first call)."""
    site = pr.sites.get(name)
    if site is None:
        from . import direct as DL

        site = pr.sites[name] = DL.Site(kernel, pr.direct)
    return site


def clear_prepared() -> None:
    """Forget every prepared launch (tests; a changed kernel module)."""
    _prepared.clear()


# ----------------------------------------------------------------------------- forward
def forward(p, q, k, v, bias, plan: Optional[C.Plan] = None,
            mods: Optional[ScoreMods] = None):
    """-> out [B, H, Sq, D] (q's dtype), RowStats(max, log_norm) of [B, H, Sq] fp32
    (natural log; the kernel writes both planes of one [2, B, H, Sq] buffer).  ``mods``:
    the score modifiers (p.softcap, mods.alibi_slopes, mods.sinks), applied in the
    kernel; with sinks the statistics include the sink."""
    pr = _prepare("forward", p, plan, mods, (("q", q), ("k", k), ("v", v)), bias)
    if pr.hop:
        from .hopper import launch as HL

        return HL.forward(p, q, k, v, prepared=pr.hfwd)
    plan = pr.plan
    q, k, v = _unit_last(q), _unit_last(k), _unit_last(v)
    B, H, Sq, Sk, D = p.batch, p.heads_q, p.seq_q, p.seq_k, p.head_dim
    dev = q.device
    ma = pr.ma if pr.ma is not None else _mask_args(p, q, bias)
    md = pr.md if pr.md is not None else _mod_args(p, mods, dev)
    tlists = pr.tlists if pr.tlists is not None else _lists_for(p, ma, plan, dev)
    out = torch.empty((B, H, Sq, D), dtype=q.dtype, device=dev)
    stats = torch.empty((2, B, H, Sq), dtype=torch.float32, device=dev)
    prec, nparts = pr.prec, pr.nparts
    with on_device(dev):
        if prec in _SCALED:
            sc, sig = _f16_scales(p, q, k, v)
            q, k, v = (_split_half(x, sig[n], g, nparts)
                       for x, n, g in ((q, "q", p.group), (k, "k", 1), (v, "v", 1)))
        else:
            sc = pr.sc
            if nparts > 1:
                q, k, v = (_split_parts(x, nparts) for x in (q, k, v))
        args = (q, k, v, out, stats, ma.bias, ma.qid, ma.kid, ma.km,
                tlists.row_cnt, tlists.row_idx, tlists.row_fcnt, tlists.row_fidx, sc,
                md.slopes, md.sink_t,
                *_s3(q), *_s3(k), *_s3(v), *_s3(out), *ma.sb, ma.sqid_b, ma.skid_b, *ma.skm,
                *tlists.row_strides(),
                H, p.group, Sq, Sk, p.scale * K.LOG2E, p.scale, ma.lo, ma.hi, *md.scalars)

        def first():
            kw = dict(D=D, DP=C.padded_dim(D), SBQ=plan.sbq, SBK=plan.sbk, MODE=ma.mode,
                      HAS_BAND=ma.has_band, HAS_DOCS=ma.has_docs, HAS_KEEP=ma.has_keep,
                      HAS_BIAS=ma.has_bias, HAS_SINKS=md.sinks, PREC=prec, **md.flags)
            return (lambda c: (_cdiv(Sq, c.bm), B * H), plan.fwd, kw,
                    _tune_key("fwd", p, plan), str(args[0].dtype))

        _run(pr, "fwd", K._fwd_kernel, args, first)
    return out, RowStats(stats[0], stats[1])


# ----------------------------------------------------------------------------- backward
def _stat_plane(x, dev):
    """One row-statistics array as a contiguous fp32 [B, H, Sq] tensor on dev."""
    x = x if isinstance(x, torch.Tensor) else torch.as_tensor(x)
    return x.to(device=dev, dtype=torch.float32).contiguous()


def backward(p, q, k, v, dout, out, stats: RowStats, bias, plan: Optional[C.Plan] = None,
             mods: Optional[ScoreMods] = None) -> Dict[str, Any]:
    """-> {'dq', 'dk', 'dv', 'dbias', 'dsinks'}: dq [B, H, Sq, D], dk / dv [B, Hkv, Sk, D]
    summed over each kv head's query group, dbias in p.bias_shape summed over broadcast
    dims, dsinks [H] in the sinks' dtype (when p.wrt names 'sinks').
    ``stats`` (RowStats of [B, H, Sq]) define P = exp((s - max) - log_norm); a plain lse
    tensor is taken as RowStats.from_lse(lse), its literal meaning P = exp(s - lse).  With
    sinks the statistics include the sink (as the forward returns them): the score
    kernels need nothing more, and the delta kernel writes each row's term of dsinks,
    summed here over batch and queries in a fixed order (no atomics)."""
    # the Hopper path (pr.hop) computes dk / dv, and dq where its config says so
    # (hopper/configs.py); the delta preprocess stays portable, and so does a dq-only call
    pr = _prepare("backward", p, plan, mods, (("q", q), ("k", k), ("v", v), ("dout", dout)),
                  bias)
    plan = pr.plan
    q, k, v, dout, out = (_unit_last(x) for x in (q, k, v, dout, out))
    B, H, Hkv, Sq, Sk, D = p.batch, p.heads_q, p.heads_kv, p.seq_q, p.seq_k, p.head_dim
    dev = q.device
    ma = pr.ma if pr.ma is not None else _mask_args(p, q, bias)
    md = pr.md if pr.md is not None else _mod_args(p, mods, dev)
    want_ds, want_kv, want_q = pr.want_ds, pr.want_kv, pr.want_q
    full_bias, owner_db = pr.full_bias, pr.owner_db
    tlists = pr.tlists if pr.tlists is not None else _lists_for(p, ma, plan, dev)
    if not isinstance(stats, RowStats):
        stats = RowStats.from_lse(stats)
    mx, ln = _stat_plane(stats.max, dev), _stat_plane(stats.log_norm, dev)
    delta = torch.empty((B, H, Sq), dtype=torch.float32, device=dev)
    # per (b, h): max (+inf on empty rows) and log2(e) * log_norm side by side (kernels doc)
    l2 = torch.empty((B, H, 2, Sq), dtype=torch.float32, device=dev)
    ctx = on_device(dev)
    res: Dict[str, Any] = {"dq": None, "dk": None, "dv": None, "dbias": None, "dsinks": None}
    prec, nparts = pr.prec, pr.nparts
    dsr = (torch.empty((B, H, Sq), dtype=torch.float32, device=dev) if want_ds
           else pr.sc)
    with ctx:
        _site(pr, "pre", K._bwd_pre_kernel)(
            (_cdiv(Sq, plan.pre_bm), B * H),
            (out, dout, mx, ln, delta, l2, md.sink_t, dsr, *_s3(out), *_s3(dout), H, Sq),
            dict(D=D, DP=pr.common["DP"], BM=plan.pre_bm, HAS_SINKS=want_ds))
        if want_ds:   # torch's reduction: a fixed order, the same bits every run
            res["dsinks"] = dsr.sum(dim=(0, 2)).to(mods.sinks.dtype)
        if full_bias:
            dbias = torch.zeros((B, H, Sq, Sk), dtype=bias.dtype, device=dev)
            sdb = tuple(dbias.stride())
        else:
            dbias, sdb = pr.sc, (0, 0, 0, 0)
        dk = dv = dq = None
        if want_kv:
            dk = torch.empty((B, Hkv, Sk, D), dtype=q.dtype, device=dev)
            dv = torch.empty((B, Hkv, Sk, D), dtype=q.dtype, device=dev)
        if want_q:
            dq = torch.empty((B, H, Sq, D), dtype=q.dtype, device=dev)
        scalars = (H, Hkv, p.group, Sq, Sk, p.scale, ma.lo, ma.hi, *md.scalars)
        # the operands as the kernels read them (bf16 / scaled fp16 parts for the split
        # fp32 schemes); sc: the scaled schemes' factors (after delta: gamma needs it)
        if prec in _SCALED:
            sc, sig = _f16_scales(p, q, k, v, dout, delta)
            qo, ko, vo, doo = (_split_half(x, sig[n], g, nparts) for x, n, g in
                               ((q, "q", p.group), (k, "k", 1), (v, "v", 1),
                                (dout, "do", p.group)))
        else:
            sc = pr.sc
            qo, ko, vo, doo = q, k, v, dout
            if nparts > 1:
                qo, ko, vo, doo = (_split_parts(x, nparts) for x in (q, k, v, dout))
        if owner_db:
            if want_kv:
                _launch_dkdv(pr, p, plan, qo, ko, vo, doo, l2, delta, dk, dv, ma, md, tlists,
                             sc, scalars)
            res["dbias"] = _launch_dq_dbias(pr, p, plan, qo, ko, vo, doo, l2, delta, dq, bias,
                                            ma, md, tlists, sc, scalars)
        elif want_kv and want_q and plan.fused_bwd and not pr.hop:
            _launch_fused_bwd(pr, p, plan, qo, ko, vo, doo, l2, delta, dk, dv, dq, dbias, sdb,
                              ma, md, tlists, sc, scalars, full_bias)
        else:
            if want_kv and pr.hop:
                from .hopper import launch as HL

                hcfg = pr.hcfg
                if hcfg is None:
                    hcfg = pr.hcfg = HL.backward_config(p)
                sites = pr.sites if pr.direct else None
                if hcfg.dq and want_q:   # dk, dv and dq in one kernel
                    HL.backward_fused(p, qo, ko, vo, doo, l2, delta, dq, dk, dv, cfg=hcfg,
                                      sites=sites)
                    want_q = False
                else:                    # dk, dv; dq (if wanted) portable below
                    HL.dkdv(p, qo, ko, vo, doo, l2, delta, dk, dv, sites=sites)
            elif want_kv:
                _launch_dkdv(pr, p, plan, qo, ko, vo, doo, l2, delta, dk, dv, ma, md, tlists,
                             sc, scalars)
            if want_q:
                args = (qo, ko, vo, doo, l2, delta, dq, ma.bias, dbias, ma.qid, ma.kid, ma.km,
                        tlists.row_cnt, tlists.row_idx, tlists.row_fcnt, tlists.row_fidx, sc,
                        md.slopes, *_s3(qo), *_s3(ko), *_s3(vo), *_s3(doo), *_s3(dq), *ma.sb,
                        *sdb, ma.sqid_b, ma.skid_b, *ma.skm, *tlists.row_strides(),
                        scalars[0], *scalars[2:])   # (no Hkv)

                def first():
                    kw = dict(SBQ=plan.sbq, SBK=plan.sbk, MODE=ma.mode, HAS_BIAS=ma.has_bias,
                              WRITE_DB=full_bias, **pr.common)
                    return (lambda c: (_cdiv(Sq, c.bm), B * H), plan.dq, kw,
                            _tune_key("dq", p, plan), str(qo.dtype))

                _run(pr, "dq", K._dq_kernel, args, first)
        if want_kv:
            res["dk"], res["dv"] = dk, dv
        if "q" in p.wrt:
            res["dq"] = dq
        if full_bias:
            res["dbias"] = dbias
        elif pr.want_db and not owner_db:
            res["dbias"] = _dbias_broadcast(p, q, k, v, dout, l2, delta, bias, ma, md, plan)
    return res


def _launch_dkdv(pr, p, plan, q, k, v, dout, l2, delta, dk, dv, ma, md, tlists, sc, scalars):
    """dk, dv through K._dkdv_kernel (one program per key tile and kv head)."""
    args = (q, k, v, dout, l2, delta, dk, dv, ma.bias, ma.qid, ma.kid, ma.km,
            tlists.col_cnt, tlists.col_idx, tlists.col_fcnt, tlists.col_fidx, sc, md.slopes,
            *_s3(q), *_s3(k), *_s3(v), *_s3(dout), *_s3(dk), *_s3(dv),
            *ma.sb, ma.sqid_b, ma.skid_b, *ma.skm, *tlists.col_strides(), *scalars)

    def first():
        kw = dict(SBQ=plan.sbq, SBK=plan.sbk, MODE=ma.mode, HAS_BIAS=ma.has_bias, **pr.common)
        B, Hkv, Sk = p.batch, p.heads_kv, p.seq_k
        return (lambda c: (_cdiv(Sk, c.bn), B * Hkv), plan.dkdv, kw,
                _tune_key("dkdv", p, plan), str(q.dtype))

    _run(pr, "dkdv", K._dkdv_kernel, args, first)


def _launch_dq_dbias(pr, p, plan, q, k, v, dout, l2, delta, dq, bias, ma, md, tlists, sc,
                     scalars):
    """dq (kept when asked for) and dbias for a bias [Bb, Hb, Sq, Sk] broadcast over batch
    and/or heads, through K._dq_dbias_kernel: the programs of one (bias batch, bias head)
    run the dq of every (b, h) mapped onto it in turn and sum dS in place; the dbias
    starts at zero, so tiles a mask skips stay exact zeros."""
    B, H, Sq = p.batch, p.heads_q, p.seq_q
    bb, hb = p.bias_shape[0], p.bias_shape[1]
    red_b, red_h = bb == 1 and B > 1, hb == 1 and H > 1
    dev = q.device
    dbias = torch.zeros(tuple(p.bias_shape), dtype=bias.dtype, device=dev)
    st = dbias.stride()
    sdb = (0 if red_b else st[0], 0 if red_h else st[1], st[2], st[3])
    args = (q, k, v, dout, l2, delta, dq, ma.bias, dbias, ma.qid, ma.kid, ma.km,
            tlists.row_cnt, tlists.row_idx, tlists.row_fcnt, tlists.row_fidx, sc, md.slopes,
            *_s3(q), *_s3(k), *_s3(v), *_s3(dout), *_s3(dq), *ma.sb, *sdb,
            ma.sqid_b, ma.skid_b, *ma.skm, *tlists.row_strides(),
            B, H, *scalars[2:], hb)

    def first():
        kw = dict(SBQ=plan.sbq, SBK=plan.sbk, MODE=ma.mode, RED_B=red_b, RED_H=red_h,
                  **pr.common)
        return (lambda c: (_cdiv(Sq, c.bm), bb * hb), plan.dq, kw, _tune_key("dq", p, plan),
                str(q.dtype))

    _run(pr, "dq_dbias", K._dq_dbias_kernel, args, first)
    return dbias


def _fused_fallbacks(c1: C.KernelConfig, c2: C.KernelConfig):
    """(dK/dV config, dQ config) pairs for the fused launch, cheaper after the first;
    both halves share the first config's warps and stages."""
    for a in _fallbacks(c1):
        yield a, C.KernelConfig(c2.bm if a.bm == c1.bm else max(16, c2.bm // 2),
                                c2.bn if a.bn == c1.bn else max(16, c2.bn // 2),
                                a.num_warps, a.num_stages)


def _launch_fused_bwd(pr, p, plan, q, k, v, dout, l2, delta, dk, dv, dq, dbias, sdb, ma, md,
                      tlists, sc, scalars, full_bias):
    """dK/dV and dQ in one launch of K._bwd_kernel (plan.dkdv gives BM/BN, warps and
    stages; plan.dq gives BM2/BN2).  Falls back to cheaper configs on OutOfResources
    (remembered per signature); autotuned over config pairs with ANYATTN_TRITON_AUTOTUNE=1."""
    args = (q, k, v, dout, l2, delta, dk, dv, dq, ma.bias, dbias, ma.qid, ma.kid, ma.km,
            tlists.col_cnt, tlists.col_idx, tlists.col_fcnt, tlists.col_fidx,
            tlists.row_cnt, tlists.row_idx, tlists.row_fcnt, tlists.row_fidx, sc, md.slopes,
            *_s3(q), *_s3(k), *_s3(v), *_s3(dout), *_s3(dk), *_s3(dv), *_s3(dq),
            *ma.sb, *sdb, ma.sqid_b, ma.skid_b, *ma.skm,
            *tlists.col_strides(), *tlists.row_strides(), *scalars)
    ready = pr.ready.get("bwd")
    if ready is None:     # launches once, with the first config pair that fits
        pr.ready["bwd"] = list(_resolve_fused_bwd(p, plan, q, args, ma, pr.common,
                                                  full_bias))
        return
    _replay(pr, "bwd", ready, K._bwd_kernel, args)


def _resolve_fused_bwd(p, plan, q, args, ma, common, full_bias) -> tuple:
    """Launch K._bwd_kernel once with the first config pair that fits (autotuned with
    ANYATTN_TRITON_AUTOTUNE=1) -> (grid, positional tail, keywords) of that launch."""
    from triton.runtime.errors import OutOfResources

    B, Hkv, G, Sq, Sk = p.batch, p.heads_kv, p.group, p.seq_q, p.seq_k
    kw = dict(SBQ=plan.sbq, SBK=plan.sbk, MODE=ma.mode, HAS_BIAS=ma.has_bias,
              WRITE_DB=full_bias, **common)

    def resolved(pair):
        c1, c2 = pair
        nkv, nq = _cdiv(Sk, c1.bn), _cdiv(Sq, c2.bm)
        return ((nkv + G * nq, B * Hkv), (nkv, nq),
                dict(kw, BM=c1.bm, BN=c1.bn, BM2=c2.bm, BN2=c2.bn,
                     num_warps=c1.num_warps, num_stages=c1.num_stages))

    def launch(pair):
        grid, tail, kws = resolved(pair)
        K._bwd_kernel[grid](*args, *tail, **kws)

    c1 = plan.dkdv
    c2 = C.KernelConfig(plan.dq.bm, plan.dq.bn, c1.num_warps, c1.num_stages)
    sig = _sig(dt=str(q.dtype), **kw)
    if C.autotune_enabled():
        cands = [(c1, c2)] + [pair for pair in C.fused_candidates(kw["DP"], p.dtype)
                              if plan.sbq % pair[0].bm == 0 and plan.sbk % pair[0].bn == 0
                              and plan.sbq % pair[1].bm == 0 and plan.sbk % pair[1].bn == 0]
        c1, c2 = C.tune(_tune_key("bwd", p, plan) + (sig,), cands,
                        lambda pair: (lambda: launch(pair)))
    key = ("_bwd_kernel", c1, c2, sig)
    first = _fallback_cache.get(key)
    tries = [first] if first is not None else list(_fused_fallbacks(c1, c2))
    err = None
    for pair in tries:
        try:
            launch(pair)
            _fallback_cache[key] = pair
            return resolved(pair)
        except OutOfResources as e:
            err = e
    raise err


def _dbias_broadcast(p, q, k, v, dout, l2, delta, bias, ma, md, plan):
    from triton.runtime.errors import OutOfResources

    """dbias for a bias broadcast over some of [B, H, Sq, Sk]: one owner program per
    output tile sums dS over the broadcast dims (no atomics, no [B, H, Sq, Sk] scratch)."""
    B, H, Sq, Sk = p.batch, p.heads_q, p.seq_q, p.seq_k
    bb, hb, mb, nb = p.bias_shape
    red_b, red_h = bb == 1 and B > 1, hb == 1 and H > 1
    red_m, red_n = mb == 1 and Sq > 1, nb == 1 and Sk > 1
    c = plan.dbias
    dbias = torch.empty((bb, hb, mb, nb), dtype=bias.dtype, device=q.device)
    sdb = tuple(dbias.stride())
    err = None
    for cc in _fallbacks(c):   # the grid and NJ_OUT depend on the tile: no _launch here
        ni_o = 1 if red_m else _cdiv(Sq, cc.bm)
        nj_o = 1 if red_n else _cdiv(Sk, cc.bn)
        try:
            K._dbias_kernel[(ni_o * nj_o, bb * hb)](
                q, k, v, dout, l2, delta, ma.bias, dbias, ma.qid, ma.kid, ma.km, md.slopes,
                *_s3(q), *_s3(k), *_s3(v), *_s3(dout), *ma.sb, *sdb,
                ma.sqid_b, ma.skid_b, *ma.skm,
                B, H, p.group, Sq, Sk, p.scale, ma.lo, ma.hi, *md.scalars, nj_o, hb,
                D=p.head_dim, DP=C.padded_dim(p.head_dim), BM=cc.bm, BN=cc.bn,
                RED_B=red_b, RED_H=red_h, RED_M=red_m, RED_N=red_n,
                HAS_BAND=ma.has_band, HAS_DOCS=ma.has_docs, HAS_KEEP=ma.has_keep,
                PREC=_register_prec(plan.prec), num_warps=cc.num_warps, num_stages=cc.num_stages,
                **md.flags)
            return dbias
        except OutOfResources as e:
            err = e
    raise err
