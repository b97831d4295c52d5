"""FlashAttention 2's public functions over anyattn (``flash_attn.flash_attn_interface``).

Shape legend: B batch, Sq/Sk queries/keys, Hq/Hk query/key-value heads (Hk divides Hq),
D head dim (Dv of v), N sequences of a packed batch, Tq/Tk packed tokens.  Inputs are
in FlashAttention's layout: [B, S, H, D], packed [T, H, D].

Every function runs through :func:`anyattn.torch.attention` (CPU tensors on the NumPy
backend, CUDA tensors on Triton) and is differentiable where FlashAttention's is (all
but ``flash_attn_with_kvcache``).  Semantics are FlashAttention's: causal masks,
windows and ALiBi are aligned at the bottom right (query i sits at key position
``i + Sk - Sq``; per sequence in the varlen functions), ``window_size=(left, right)``
with -1 for an unbounded side, ``softcap <= 0`` is off.  docs/flash_attn.md lists
every difference.
"""
from __future__ import annotations

import dataclasses
import numbers
from typing import Optional

import numpy as np
import torch

from .. import settings
from ..api import attention as core_attention
from ..backends.registry import choose
from ..backends.triton.backend import PAGED_MAX_SQ
from ..masks import Documents
from ..paged import Pages, describe_paged
from ..problem import describe
from ..torch.functional import attention
from . import common
from .layers import rotary as rotary_mod
from .varlen import check_cu_seqlens, layout

__all__ = [
    "USE_TRITON_ROCM",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
]

#: FlashAttention's switch for its AMD Triton path; anyattn has no such path
USE_TRITON_ROCM = False

_BSHD = "(batch_size, seqlen, nheads, headdim)"
_THD = "(total_tokens, nheads, headdim)"


def _check_heads(q_name: str, hq: int, k_name: str, hk: int) -> None:
    if hk == 0 or hq % hk:
        raise ValueError(f"{k_name}: {hk} key/value heads do not divide {q_name}'s {hq} "
                         "query heads; MQA/GQA needs nheads to be a multiple of nheads_k")


def _check_qkv(names, q, k, v, seq_axis_batch: bool) -> None:
    """Shapes of q, k, v: [B, S, H, D] (``seq_axis_batch``) or packed [T, H, D]."""
    nq, nk, nv = names
    nd, what = (4, _BSHD) if seq_axis_batch else (3, _THD)
    hint = ("packed varlen tensors go to flash_attn_varlen_func" if seq_axis_batch
            else "padded batches go to flash_attn_func")
    for name, x in ((nq, q), (nk, k), (nv, v)):
        common.check_tensor(name, x, nd, what, hint)
    if seq_axis_batch:
        common.same(nq, q.shape[0], nk, k.shape[0], "batch size (dim 0)")
        common.same(nk, k.shape[0], nv, v.shape[0], "batch size (dim 0)")
    s = 1 if seq_axis_batch else 0
    common.same(nk, k.shape[s], nv, v.shape[s], f"number of keys (dim {s})")
    common.same(nk, k.shape[-2], nv, v.shape[-2], "number of heads (dim -2)")
    common.same(nq, q.shape[-1], nk, k.shape[-1], "head dim (dim -1)")
    _check_heads(nq, q.shape[-2], nk, k.shape[-2])


def _options(causal, window_size, softcap, deterministic, return_attn_probs,
             flag_name="return_attn_probs"):
    causal = common.flag("causal", causal)
    common.flag("deterministic", deterministic)     # the backward is always deterministic
    probs = common.flag(flag_name, return_attn_probs)
    left, right = common.window(window_size, causal)
    return left, right, common.softcap_value(softcap), probs


def _dense(names, q, k, v, dropout_p, softmax_scale, causal, window_size, softcap,
           alibi_slopes, deterministic, return_attn_probs):
    """flash_attn_func on [B, S, H, D] tensors (the packed variants pass views)."""
    _check_qkv(names, q, k, v, True)
    left, right, cap, probs = _options(causal, window_size, softcap, deterministic,
                                       return_attn_probs)
    scale = common.scale_value(softmax_scale, q.shape[-1])
    slopes = common.alibi(alibi_slopes, q.shape[2], q.shape[0])
    p, seed = common.dropout_seed(dropout_p)
    out, lse = attention(q, k, v, layout="bshd", mask=common.band_mask(left, right),
                         scale=scale, softcap=cap, alibi_slopes=slopes, dropout_p=p,
                         dropout_seed=seed, return_lse=True)
    if not probs:
        return out
    blocks = []
    b_count, sq, hq, _ = q.shape
    sk = k.shape[1]
    for b in range(b_count):
        row = None if slopes is None else (slopes if slopes.ndim == 1 else slopes[b])
        pb = common.probabilities(q[b], k[b], lse[b], scale, cap, row, left, right)
        keep = None if seed is None else common.dropout_keep(seed, p, b, hq, range(sq),
                                                             range(sk))
        blocks.append(common.encode_dropout(pb, keep))
    s_dmask = torch.stack(blocks).to(q.dtype) if blocks else q.new_zeros((0, hq, sq, sk))
    return out, lse, s_dmask


def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False,
                    window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                    deterministic=False, return_attn_probs=False):
    """Attention of q [B, Sq, Hq, D] over k [B, Sk, Hk, D], v [B, Sk, Hk, Dv]
    -> out [B, Sq, Hq, Dv]; with ``return_attn_probs`` also (softmax_lse [B, Hq, Sq]
    float32, S_dmask [B, Hq, Sq, Sk]).

    ``causal``: bottom-right aligned (query i sees keys j <= i + Sk - Sq; a row that
    sees none gets 0).  ``window_size=(left, right)``: keys in
    [i + Sk - Sq - left, i + Sk - Sq + right], -1 = unbounded side.  ``softcap`` > 0:
    scores ``softcap·tanh(s / softcap)``.  ``alibi_slopes`` [Hq] or [B, Hq]: adds
    ``-slope·|i + Sk - Sq - j|``.  ``dropout_p``: anyattn's dropout mask, seed drawn
    from torch's default generator.  ``deterministic``: accepted; the backward is
    always deterministic.  ``S_dmask``: the probabilities, negated where dropout dropped
    them (a dense recomputation, a testing aid).  Hk divides Hq (MQA/GQA: query head h
    reads key/value head h // (Hq / Hk)).
    """
    return _dense(("q", "k", "v"), q, k, v, dropout_p, softmax_scale, causal, window_size,
                  softcap, alibi_slopes, deterministic, return_attn_probs)


def flash_attn_kvpacked_func(q, kv, dropout_p=0.0, softmax_scale=None, causal=False,
                             window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                             deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_func` with kv [B, Sk, 2, Hk, D] (k = kv[:, :, 0], v = kv[:, :, 1]);
    the gradient of kv comes back packed."""
    common.check_tensor("q", q, 4, _BSHD)
    common.check_packed("kv", kv, 5, 2, 2, "(batch_size, seqlen, 2, nheads_k, headdim)")
    return _dense(("q", "kv[:, :, 0]", "kv[:, :, 1]"), q, kv[:, :, 0], kv[:, :, 1],
                  dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
                  deterministic, return_attn_probs)


def flash_attn_qkvpacked_func(qkv, dropout_p=0.0, softmax_scale=None, causal=False,
                              window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                              deterministic=False, return_attn_probs=False):
    """:func:`flash_attn_func` with qkv [B, S, 3, H, D] (q, k, v = qkv[:, :, 0 / 1 / 2]);
    the gradient of qkv comes back packed."""
    common.check_packed("qkv", qkv, 5, 2, 3, "(batch_size, seqlen, 3, nheads, headdim)")
    return _dense(("qkv[:, :, 0]", "qkv[:, :, 1]", "qkv[:, :, 2]"), qkv[:, :, 0],
                  qkv[:, :, 1], qkv[:, :, 2], dropout_p, softmax_scale, causal, window_size,
                  softcap, alibi_slopes, deterministic, return_attn_probs)


# ------------------------------------------------------------------------------ varlen

def _varlen(names, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes,
            deterministic, return_attn_probs, block_table=None,
            cu_names=("cu_seqlens_q", "cu_seqlens_k"),
            max_names=("max_seqlen_q", "max_seqlen_k")):
    """flash_attn_varlen_func on packed [T, H, D] tensors (see the module docstring)."""
    if block_table is not None:
        k, v = _varlen_pages(names, q, k, v, block_table, cu_names[1], cu_seqlens_k,
                             max_names[1], max_seqlen_k)
        names = (names[0], f"{names[1]} (its used pages)", f"{names[2]} (its used pages)")
    _check_qkv(names, q, k, v, False)
    left, right, cap, probs = _options(causal, window_size, softcap, deterministic,
                                       return_attn_probs)
    scale = common.scale_value(softmax_scale, q.shape[-1])
    lq = check_cu_seqlens(cu_names[0], cu_seqlens_q, q.shape[0], names[0], max_names[0],
                          max_seqlen_q, q.device)
    lk = check_cu_seqlens(cu_names[1], cu_seqlens_k, k.shape[0], names[1], max_names[1],
                          max_seqlen_k, q.device)
    if lq.size != lk.size:
        raise ValueError(f"{cu_names[1]}: has {lk.size + 1} entries but {cu_names[0]} has "
                         f"{lq.size + 1}; both are (batch_size + 1,)")
    n, hq = lq.size, q.shape[1]
    slopes = common.alibi(alibi_slopes, hq, n)
    p, seed = common.dropout_seed(dropout_p)
    band = common.band_mask(left, right)
    lay = layout(lq, lk, aligned=band is not None or slopes is not None,
                 per_sequence_slopes=slopes is not None and slopes.ndim == 2,
                 device=q.device)
    mask = Documents(lay.q_ids, lay.k_ids)
    if band is not None:
        mask = mask & band
    ql = lay.scatter(q, lay.q_rows, lay.tq)
    kl, vl = (lay.scatter(x, lay.k_rows, lay.tk) for x in (k, v))
    out, lse = attention(ql, kl, vl, layout="bshd", mask=mask, scale=scale, softcap=cap,
                         alibi_slopes=slopes, dropout_p=p, dropout_seed=seed,
                         return_lse=True)
    out, lse = lay.gather_out(out), lay.gather_lse(lse)
    if not probs:
        return out
    mq, mk = common.int_value(max_names[0], max_seqlen_q), common.int_value(max_names[1],
                                                                            max_seqlen_k)
    s_dmask = q.new_zeros((n, hq, mq, mk))
    cq = np.concatenate([[0], np.cumsum(lq)])
    ck = np.concatenate([[0], np.cumsum(lk)])
    for d in range(n):
        a, b = int(cq[d]), int(cq[d + 1])
        c, e = int(ck[d]), int(ck[d + 1])
        row = None if slopes is None else (slopes if slopes.ndim == 1 else slopes[d])
        pb = common.probabilities(q[a:b], k[c:e], lse[:, a:b], scale, cap, row, left, right)
        keep = None
        if seed is not None:
            batch = d if lay.kind == "padded" else 0
            q0 = int(lay.q_first[d]) - batch * lay.tq
            k0 = int(lay.k_first[d]) - batch * lay.tk
            keep = common.dropout_keep(seed, p, batch, hq, range(q0, q0 + b - a),
                                       range(k0, k0 + e - c))
        s_dmask[d, :, :b - a, :e - c] = common.encode_dropout(pb, keep).to(q.dtype)
    return out, lse, s_dmask


def _varlen_pages(names, q, k, v, block_table, cu_name, cu_seqlens_k, max_name,
                  max_seqlen_k):
    """Paged keys of the varlen functions: k / v [num_blocks, page, Hk, D], sequence d's
    keys at positions [0, lk_d) of the pages ``block_table[d]`` -> packed [Tk, Hk, D]
    copies (one gather of the used pages; differentiable into the pages)."""
    common.check_tensor("q", q, 3, _THD)
    what = "(num_blocks, page_block_size, nheads_k, headdim)"
    for name, x in zip(names[1:], (k, v)):
        common.check_tensor(name, x, 4, what, "block_table needs paged keys and values")
        if x.device != q.device:
            raise ValueError(f"{name}: is on {x.device} but q is on {q.device}; they must be "
                             "on one device")
    common.same(names[1], tuple(k.shape[:3]), names[2], tuple(v.shape[:3]),
                "(num_blocks, page_block_size, nheads_k)")
    page = k.shape[1]
    if page == 0 or page % 16:
        raise ValueError(f"{names[1]}: its page size (dim 1) is {page}; with block_table the "
                         "pages hold a multiple of 16 positions")
    if not isinstance(cu_seqlens_k, torch.Tensor):
        raise TypeError(f"{cu_name}: expected an int32 torch.Tensor (batch_size + 1,), got "
                        f"{type(cu_seqlens_k).__name__}")
    if cu_seqlens_k.ndim != 1 or cu_seqlens_k.numel() < 1:
        raise ValueError(f"{cu_name}: expected shape (batch_size + 1,), got "
                         f"{tuple(cu_seqlens_k.shape)}")
    end = int(cu_seqlens_k[-1])
    lk = check_cu_seqlens(cu_name, cu_seqlens_k, end, f"the keys' {end}", max_name,
                          max_seqlen_k, q.device)
    table = _block_table(block_table, lk.size, q.device)
    if (lk > table.shape[1] * page).any():
        d = int(np.argmax(lk > table.shape[1] * page))
        raise ValueError(f"block_table: sequence {d} has {lk[d]} keys but its "
                         f"{table.shape[1]} pages of {page} positions hold "
                         f"{table.shape[1] * page}; give block_table more pages")
    _check_pages(table, None, lk, page, k.shape[0])
    rows = [table[d, pos // page] * page + pos % page
            for d, pos in enumerate(np.arange(n) for n in lk)]
    flat = torch.from_numpy(np.concatenate(rows) if rows else np.zeros(0, np.int64))
    flat = flat.to(k.device)
    return tuple(x.reshape((-1,) + tuple(x.shape[2:])).index_select(0, flat) for x in (k, v))


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                           dropout_p=0.0, softmax_scale=None, causal=False,
                           window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    """Attention over N packed sequences: q [Tq, Hq, D], k [Tk, Hk, D], v [Tk, Hk, Dv];
    sequence d holds q[cu_seqlens_q[d]:cu_seqlens_q[d + 1]] and the keys
    k[cu_seqlens_k[d]:cu_seqlens_k[d + 1]] -> out [Tq, Hq, Dv]; with
    ``return_attn_probs`` also (softmax_lse [Hq, Tq] float32, S_dmask
    [N, Hq, max_seqlen_q, max_seqlen_k], zero beyond each sequence).

    ``cu_seqlens_*``: int32 (or int64) [N + 1], starting at 0, non-decreasing, ending at
    Tq / Tk; every length at most ``max_seqlen_*``: each checked before any work (a GPU
    tensor is read once; CPU tensors are accepted and cost no synchronisation).  Causal
    masks, windows and ALiBi are aligned at the bottom right of each sequence (its own
    lq and lk).  Other arguments as :func:`flash_attn_func`; ``alibi_slopes`` [Hq] or
    [N, Hq].  ``block_table`` [N, P] int32: k / v are then paged caches [num_blocks,
    page, Hk, D] (page a multiple of 16) and sequence d's keys are positions
    [0, lk_d) of the pages ``block_table[d]``; the used pages are gathered into one
    packed copy per call.
    """
    return _varlen(("q", "k", "v"), q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                   max_seqlen_k, dropout_p, softmax_scale, causal, window_size, softcap,
                   alibi_slopes, deterministic, return_attn_probs, block_table)


def flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p=0.0, softmax_scale=None,
                                    causal=False, window_size=(-1, -1), softcap=0.0,
                                    alibi_slopes=None, deterministic=False,
                                    return_attn_probs=False):
    """:func:`flash_attn_varlen_func` with kv [Tk, 2, Hk, D]."""
    common.check_tensor("q", q, 3, _THD)
    common.check_packed("kv", kv, 4, 1, 2, "(total_k, 2, nheads_k, headdim)")
    return _varlen(("q", "kv[:, 0]", "kv[:, 1]"), q, kv[:, 0], kv[:, 1], cu_seqlens_q,
                   cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale,
                   causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs)


def flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens, max_seqlen, dropout_p=0.0,
                                     softmax_scale=None, causal=False, window_size=(-1, -1),
                                     softcap=0.0, alibi_slopes=None, deterministic=False,
                                     return_attn_probs=False):
    """:func:`flash_attn_varlen_func` with qkv [T, 3, H, D] and one ``cu_seqlens``."""
    common.check_packed("qkv", qkv, 4, 1, 3, "(total, 3, nheads, headdim)")
    return _varlen(("qkv[:, 0]", "qkv[:, 1]", "qkv[:, 2]"), qkv[:, 0], qkv[:, 1],
                   qkv[:, 2], cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, dropout_p,
                   softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic,
                   return_attn_probs, cu_names=("cu_seqlens", "cu_seqlens"),
                   max_names=("max_seqlen", "max_seqlen"))


# ------------------------------------------------------------------- test-file helper

def _get_block_size_n(device, head_dim, is_dropout, is_causal):
    """The key block width of FlashAttention 2's forward kernel on an A100-class GPU for
    this head dim (FlashAttention's tests split scores by it to read its ``S_dmask``):
    128 up to head dim 64 (64 with dropout), 64 above 64 (32 with dropout from 97 to
    128).  ``device`` and ``is_causal`` are accepted for its signature.  anyattn's own
    ``S_dmask`` is the normalised probabilities in natural order (docs/flash_attn.md), so
    the width plays no part in anyattn."""
    hd = common.int_value("head_dim", head_dim)
    if not 0 < hd <= 256:
        raise ValueError(f"head_dim: is {hd}; FlashAttention's kernels take 1 to 256")
    common.flag("is_dropout", is_dropout)
    common.flag("is_causal", is_causal)
    if hd <= 64:
        return 64 if is_dropout else 128
    if 96 < hd <= 128 and is_dropout:
        return 32
    return 64


# ----------------------------------------------------------------------------- KV cache

def _index_tensor(name: str, x, b: int, device) -> Optional[torch.Tensor]:
    """An int tensor [B] on the CPU or q's device (type, dtype, shape and device
    checked; its values not read), or None."""
    if x is None:
        return None
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor of shape ({b},), dtype torch.int32, "
                        f"got {type(x).__name__}")
    if x.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: expected dtype torch.int32 (or int64), got {x.dtype}")
    if tuple(x.shape) != (b,):
        raise ValueError(f"{name}: expected shape (batch_size,) = ({b},), got "
                         f"{tuple(x.shape)}")
    if x.device.type != "cpu" and x.device != device:
        raise ValueError(f"{name}: is on {x.device} but q is on {device}; move it with "
                         ".to(q.device)")
    return x


def _table_tensor(block_table, bsz: int, device) -> torch.Tensor:
    """block_table [B, max_pages] int32 (or int64) on the CPU or q's device (its values
    not read)."""
    if not isinstance(block_table, torch.Tensor):
        raise TypeError(f"block_table: expected a torch.Tensor of shape (batch_size, "
                        f"max_num_blocks_per_seq), dtype torch.int32, got "
                        f"{type(block_table).__name__}")
    if block_table.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"block_table: expected dtype torch.int32 (or int64), got "
                        f"{block_table.dtype}")
    if block_table.ndim != 2 or block_table.shape[0] != bsz:
        raise ValueError(f"block_table: expected shape (batch_size, max_num_blocks_per_seq) "
                         f"with batch_size {bsz}, got {tuple(block_table.shape)}")
    if block_table.device.type != "cpu" and block_table.device != device:
        raise ValueError(f"block_table: is on {block_table.device} but q is on {device}; "
                         "move it with .to(q.device)")
    return block_table


def _block_table(block_table, bsz: int, device) -> np.ndarray:
    """block_table [B, max_pages] int32 (or int64) on the CPU or q's device -> int64 NumPy."""
    return _table_tensor(block_table, bsz, device).detach().cpu().numpy().astype(np.int64)


def _used_pages(starts: Optional[np.ndarray], ends: np.ndarray, page: int):
    """[first, stop) of the table columns entry b reads (and writes): the pages holding
    its positions [starts[b], ends[b]) (none where that range is empty)."""
    firsts = np.zeros_like(ends) if starts is None else starts
    stops = np.where(ends > firsts, -(-ends // page), 0)
    return np.minimum(firsts // page, stops), stops


def _check_pages(table: np.ndarray, starts: Optional[np.ndarray], ends: np.ndarray,
                 page: int, num_blocks: int) -> None:
    """The pages that hold positions [starts[b], ends[b]) of entry b (0 for no
    ``starts``; the only pages the call reads or writes) name blocks of the cache; the
    other entries of the table may hold anything."""
    lo, hi = _used_pages(starts, ends, page)
    for b in range(table.shape[0]):
        used = table[b, int(lo[b]):int(hi[b])]
        bad = np.flatnonzero((used < 0) | (used >= num_blocks))
        if bad.size:
            j = int(lo[b]) + int(bad[0])
            raise ValueError(f"block_table: entry [{b}, {j}] is {int(table[b, j])}, outside "
                             f"the cache's {num_blocks} blocks [0, {num_blocks}) "
                             "(k_cache.shape[0])")


def _rotary_positions(offsets: np.ndarray, count: int, same: bool) -> np.ndarray:
    """Rotary positions [B, count]: offsets[b] + i, or offsets[b] for every row (``same``)."""
    steps = np.zeros(count, dtype=np.int64) if same else np.arange(count, dtype=np.int64)
    return offsets[:, None] + steps[None, :]


def _reads_in_place(device_type: str, sq: int, paged: bool, leftpad: np.ndarray,
                    ends: np.ndarray) -> bool:
    """Whether flash_attn_with_kvcache reads the cache in place through the core's paged
    form (``Pages(table, ends, starts=leftpad)``): a paged cache, entries of different
    key counts or a cache_leftpad, on the CPU or with at most PAGED_MAX_SQ queries per
    entry (the Triton backend's paged kernel).  A contiguous cache whose entries all
    hold keys [0, end) with one end is one dense call over a slice of it instead."""
    if ends.size == 0:
        return False
    if not paged and not leftpad.any() and (ends == ends[0]).all():
        return False
    return device_type == "cpu" or sq <= PAGED_MAX_SQ


def _gather_pages(k_cache, v_cache, table: np.ndarray, starts: np.ndarray, ends: np.ndarray,
                  page: int):
    """A paged cache's pages in use (those holding positions [starts[b], ends[b])) ->
    contiguous copies [B, n_pages * page, Hk, D/Dv] (the fallback where the core's paged
    form does not serve; the other table entries are not read: block 0 stands there)."""
    bsz = table.shape[0]
    n_pages = -(-int(ends.max()) // page) if bsz else 0
    cols = np.arange(n_pages)[None, :]
    lo, hi = _used_pages(starts, ends, page)
    ids = np.where((cols >= lo[:, None]) & (cols < hi[:, None]), table[:, :n_pages], 0)
    sel = torch.from_numpy(ids.reshape(-1)).to(k_cache.device)
    return tuple(x.index_select(0, sel).reshape(bsz, n_pages * page, *x.shape[2:])
                 for x in (k_cache, v_cache))


def _dense_over_ranges(q, kc, vc, idx, leftpad, ends, mask, scale, cap, slopes):
    """The fallback where the core's paged form does not serve: one dense call over the
    rows ``idx`` of a contiguous cache, keys [leftpad[b], ends[b]) of row idx[b]; one
    call for the batch where every entry reads the same range, else one per entry."""
    bsz = q.shape[0]
    if (leftpad == leftpad[0]).all() and (ends == ends[0]).all() if bsz else True:
        lo, hi = (int(leftpad[0]), int(ends[0])) if bsz else (0, 0)
        if np.array_equal(idx, np.arange(kc.shape[0])):
            kk, vv = kc, vc
        else:
            sel = torch.from_numpy(idx).to(kc.device)
            kk, vv = kc.index_select(0, sel), vc.index_select(0, sel)
        return attention(q, kk[:, lo:hi], vv[:, lo:hi], layout="bshd", mask=mask,
                         scale=scale, softcap=cap, alibi_slopes=slopes, return_lse=True)
    outs, lses = [], []
    for b in range(bsz):
        i, lo, hi = int(idx[b]), int(leftpad[b]), int(ends[b])
        row = None if slopes is None else (slopes if slopes.ndim == 1 else slopes[b:b + 1])
        o, s = attention(q[b:b + 1], kc[i:i + 1, lo:hi], vc[i:i + 1, lo:hi], layout="bshd",
                         mask=mask, scale=scale, softcap=cap, alibi_slopes=row,
                         return_lse=True)
        outs.append(o)
        lses.append(s)
    return torch.cat(outs), torch.cat(lses)


def flash_attn_with_kvcache(q, k_cache, v_cache, k=None, v=None, rotary_cos=None,
                            rotary_sin=None, cache_seqlens=None, cache_batch_idx=None,
                            cache_leftpad=None, block_table=None, softmax_scale=None,
                            causal=False, window_size=(-1, -1), softcap=0.0,
                            rotary_interleaved=True, alibi_slopes=None, num_splits=0,
                            return_softmax_lse=False):
    """Attention of q [B, Sq, Hq, D] over a cache -> out [B, Sq, Hq, Dv] (and softmax_lse
    [B, Hq, Sq] float32 with ``return_softmax_lse``).  Not differentiable (as
    FlashAttention's).

    The cache is contiguous, k_cache [Bc, Sc, Hk, D] / v_cache [Bc, Sc, Hk, Dv], batch
    entry b reading row ``cache_batch_idx[b]`` (default b; then Bc == B); or paged with
    ``block_table`` [B, P] int32: k_cache / v_cache [num_blocks, page, Hk, D/Dv], page a
    multiple of 16, position t of entry b at block ``block_table[b, t // page]``, row
    ``t % page`` (capacity P · page); only the entries of the pages holding positions
    [cache_leftpad[b], cache_seqlens[b] + Snew) are read (they must name blocks), the
    others may hold anything (-1 padding).  ``k``, ``v`` [B, Snew, Hk, D/Dv]: written into the
    cache *in place* at positions [cache_seqlens[b], cache_seqlens[b] + Snew) before the
    attention (needs ``cache_seqlens``).  The keys of entry b are the cache positions
    [cache_leftpad[b], cache_seqlens[b] + Snew) (the whole cache without
    ``cache_seqlens``); causal masks, windows and ALiBi are aligned at their bottom
    right.  ``cache_seqlens``: an int or an int tensor [B].

    ``rotary_cos`` / ``rotary_sin`` [seqlen_ro, rotary_dim / 2] rotate the first
    rotary_dim channels of the new keys at their positions cache_seqlens[b] + i (the
    rotated keys are what the cache stores) and of q: query i at cache_seqlens[b] + i
    when ``causal`` or a window is set, every query at cache_seqlens[b] otherwise;
    ``rotary_interleaved`` picks GPT-J pairs (2i, 2i + 1) over GPT-NeoX halves.  The
    positions count cache positions from 0, a ``cache_leftpad`` included (as in
    FlashAttention).  The tables need ``k`` and ``v`` (FlashAttention rotates q only
    together with new keys).

    Lengths, indices and the page table on q's CUDA device are not read to the host (no
    synchronisation; a CUDA graph captures the call) with at most 16 queries per entry:
    the new keys are written with device indices, rotary positions gathered on the
    device, and the cache read in place as one core call
    (``anyattn.attention(..., pages=anyattn.Pages(table, cache_seqlens + Snew,
    starts=cache_leftpad, on_device=True))``; a contiguous cache: its rows
    ``cache_batch_idx`` as pages of seqlen_cache positions) on the Triton backend's
    paged kernel, whose grid and launch signature follow the shapes (the cache's
    capacity), never the lengths.  Their values (cache lengths, used pages, leftpad,
    cache_batch_idx, rotary table rows) are then checked only with
    ``ANYATTN_CHECK_DEVICE_INPUTS=1`` (a read to the host per call; anyattn.settings);
    unchecked, a value out of range is undefined behaviour (a device-side assert or
    a wrong result).  Shapes, dtypes and devices are always checked, and an int
    ``cache_seqlens`` too.

    Otherwise (CPU tensors; every length, index and table given on the CPU or as an int;
    more than 16 queries per entry on a GPU) they are read to the host (a GPU tensor
    once: a synchronisation) and every bound is checked before any work.  The cache is then
    read in place as one core call (``Pages`` with host tables) on CPU tensors, and on
    a GPU with at most 16 queries per entry: a paged cache, and a contiguous one whose
    entries have a ``cache_leftpad`` or hold different numbers of keys (its rows as
    pages).  With more queries on a GPU a paged cache's used pages are gathered into
    one contiguous copy per call, and a contiguous cache runs one dense call per key
    range.  ``num_splits`` may be 0 (choose) or 1: the backend's route decides whether
    the keys are split (the Triton paged and decode kernels split them for few
    programs over long caches, with a deterministic combine).
    """
    common.check_tensor("q", q, 4, _BSHD)
    splits = common.int_value("num_splits", num_splits)
    if splits < 0:
        raise ValueError(f"num_splits: is {splits}; expected 0 (choose) or a positive int")
    if splits > 1:
        raise NotImplementedError(
            f"num_splits: {splits} splits of the keys (split-KV decoding) are not implemented "
            "yet; pass num_splits=0 or 1")
    interleaved = common.flag("rotary_interleaved", rotary_interleaved)
    if not q.is_floating_point():
        raise TypeError(f"q: expected a floating-point tensor, got dtype {q.dtype}")
    paged = block_table is not None
    what = ("(num_blocks, page_block_size, nheads_k, headdim)" if paged
            else "(batch_size_cache, seqlen_cache, nheads_k, headdim)")
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        common.check_tensor(name, x, 4, what)
        if x.device != q.device:
            raise ValueError(f"{name}: is on {x.device} but q is on {q.device}; they must be "
                             "on one device")
        if x.dtype != q.dtype:
            raise TypeError(f"{name}: has dtype {x.dtype} but q has {q.dtype}; they must match")
    common.same("k_cache", tuple(k_cache.shape[:3]), "v_cache", tuple(v_cache.shape[:3]),
                what[:what.index(", headdim")] + ")")
    common.same("q", q.shape[-1], "k_cache", k_cache.shape[-1], "head dim (dim -1)")
    _check_heads("q", q.shape[2], "k_cache", k_cache.shape[2])
    bsz, sq, hq, _ = q.shape
    hk = k_cache.shape[2]
    if paged:
        page = k_cache.shape[1]
        if page == 0 or page % 16:
            raise ValueError(f"k_cache: its page size (dim 1) is {page}; with block_table the "
                             "pages hold a multiple of 16 positions")
        if cache_batch_idx is not None:
            raise NotImplementedError(
                "cache_batch_idx: is not supported with block_table (as in FlashAttention); "
                "order the rows of block_table instead")
        block_table = _table_tensor(block_table, bsz, q.device)
        b_cache, s_cache = bsz, block_table.shape[1] * page
        capacity = (f"the {block_table.shape[1]} pages of {page} positions that block_table "
                    "maps; give block_table more pages")
    else:
        b_cache, s_cache = k_cache.shape[:2]
        page = s_cache
        capacity = (f"the cache's {s_cache} positions (k_cache.shape[1]); allocate a longer "
                    "cache")
    if (k is None) != (v is None):
        raise ValueError("k, v: pass both new keys and new values, or neither")
    s_new = 0
    if k is not None:
        for name, x, cache in (("k", k, k_cache), ("v", v, v_cache)):
            common.check_tensor(name, x, 4, "(batch_size, seqlen_new, nheads_k, headdim)")
            if x.dtype != cache.dtype:
                raise TypeError(f"{name}: has dtype {x.dtype} but the cache has {cache.dtype}; "
                                "they must match (the cache is written in place)")
            want = (bsz, k.shape[1], hk, cache.shape[3])
            if tuple(x.shape) != want:
                raise ValueError(f"{name}: expected shape {want} (batch_size, seqlen_new, "
                                 f"nheads_k, headdim), got {tuple(x.shape)}")
            if x.device != cache.device:
                raise ValueError(f"{name}: is on {x.device} but the cache is on "
                                 f"{cache.device}")
        s_new = k.shape[1]
        if cache_seqlens is None:
            raise ValueError("cache_seqlens: is None but k and v are given; the new keys "
                             "are written at cache_seqlens[b], so pass it")
    idx_t = _index_tensor("cache_batch_idx", cache_batch_idx, bsz, q.device)
    if idx_t is None and b_cache != bsz:
        raise ValueError(f"k_cache: holds {b_cache} sequences but q has batch size {bsz}; "
                         "pass cache_batch_idx to pick the cache rows")
    if cache_seqlens is None or isinstance(cache_seqlens, torch.Tensor):
        lengths_t = _index_tensor("cache_seqlens", cache_seqlens, bsz, q.device)
        n_int = None if cache_seqlens is not None else s_cache
    elif isinstance(cache_seqlens, numbers.Integral) and not isinstance(cache_seqlens, bool):
        lengths_t, n_int = None, int(cache_seqlens)
    else:
        raise TypeError(f"cache_seqlens: expected an int or a torch.Tensor of shape ({bsz},), "
                        f"dtype torch.int32, got {type(cache_seqlens).__name__}")
    if n_int is not None:                  # a host int: checked for free
        _check_cache_values(None, b_cache, np.full(bsz, n_int, dtype=np.int64), s_new,
                            s_cache, capacity, None)
    leftpad_t = _index_tensor("cache_leftpad", cache_leftpad, bsz, q.device)
    if leftpad_t is not None and cache_seqlens is None:
        raise ValueError("cache_leftpad: needs cache_seqlens (the keys of entry b are "
                         "[cache_leftpad[b], cache_seqlens[b]))")
    causal = common.flag("causal", causal)
    left, right = common.window(window_size, causal)
    cap = common.softcap_value(softcap)
    lse_flag = common.flag("return_softmax_lse", return_softmax_lse)
    scale = common.scale_value(softmax_scale, q.shape[-1])
    slopes = common.alibi(alibi_slopes, hq, bsz)
    mask = common.band_mask(left, right)
    rotary = rotary_cos is not None or rotary_sin is not None
    if rotary:
        if rotary_cos is None or rotary_sin is None:
            raise ValueError("rotary_cos, rotary_sin: pass both rotary tables, or neither")
        if k is None:
            raise ValueError("rotary_cos, rotary_sin: rotate q together with the new keys k "
                             "(as in FlashAttention); pass k and v too, or rotate q "
                             "yourself (flash_attn.layers.rotary.apply_rotary_emb)")
        rotary_mod.check_tables(rotary_cos, rotary_sin, q.shape[-1],
                                ("rotary_cos", "rotary_sin"))
        for name, x in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin)):
            if x.device != q.device:
                raise ValueError(f"{name}: is on {x.device} but q is on {q.device}; move it "
                                 "with .to(q.device)")
    tensors = (lengths_t, idx_t, leftpad_t, block_table if paged else None)
    call = _KVCall(q, k_cache, v_cache, k, v, s_new, paged, page, b_cache, s_cache,
                   capacity, mask, scale, cap, slopes, rotary_cos if rotary else None,
                   rotary_sin if rotary else None, interleaved)
    if _values_on_device(q, tensors):
        out, lse = _kvcache_on_device(call, lengths_t, n_int, idx_t, leftpad_t,
                                      block_table if paged else None)
    else:
        out, lse = _kvcache_on_host(call, lengths_t, n_int, idx_t, leftpad_t,
                                    block_table if paged else None)
    return (out, lse) if lse_flag else out


#: the device types whose tensors flash_attn_with_kvcache reads on the host at no cost
#: (the CPU's): lengths, indices and tables elsewhere stay on their device
_HOST_DEVICE_TYPES = ("cpu",)


def _values_on_device(q, tensors) -> bool:
    """Whether flash_attn_with_kvcache keeps its length / index / table tensors on q's
    device (no host read; ``_kvcache_on_device``): q on a device outside
    _HOST_DEVICE_TYPES, one of them there, a batch, and at most PAGED_MAX_SQ queries
    per entry (the Triton backend's paged kernel, which reads the tables itself)."""
    bsz, sq = q.shape[0], q.shape[1]
    if q.device.type in _HOST_DEVICE_TYPES or bsz == 0 or sq > PAGED_MAX_SQ:
        return False
    return any(t is not None and t.device.type not in _HOST_DEVICE_TYPES for t in tensors)


@dataclasses.dataclass
class _KVCall:
    """The checked arguments of one flash_attn_with_kvcache call that both of its paths
    read (``page``: the page size, or the cache's length for a contiguous cache)."""

    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    k: Optional[torch.Tensor]
    v: Optional[torch.Tensor]
    s_new: int
    paged: bool
    page: int
    b_cache: int
    s_cache: int
    capacity: str
    mask: object
    scale: float
    cap: Optional[float]
    slopes: Optional[torch.Tensor]
    cos: Optional[torch.Tensor]
    sin: Optional[torch.Tensor]
    interleaved: bool


def _check_cache_values(idx: Optional[np.ndarray], b_cache: int, lengths: np.ndarray,
                        s_new: int, s_cache: int, capacity: str,
                        leftpad: Optional[np.ndarray]) -> None:
    """The values of cache_batch_idx (rows of the cache), cache_seqlens (>= 0, the new
    keys within the ``s_cache`` positions, ``capacity`` naming them) and cache_leftpad
    (in [0, cache_seqlens])."""
    if idx is not None and idx.size and (idx.min() < 0 or idx.max() >= b_cache):
        bad = int(idx[(idx < 0) | (idx >= b_cache)][0])
        raise ValueError(f"cache_batch_idx: holds {bad}, outside the cache's "
                         f"{b_cache} rows [0, {b_cache})")
    if (lengths < 0).any():
        raise ValueError(f"cache_seqlens: holds {int(lengths.min())}; lengths are >= 0")
    if (lengths + s_new > s_cache).any():
        b = int(np.argmax(lengths + s_new > s_cache))
        raise ValueError(f"cache_seqlens: entry {b} holds {lengths[b]} keys, and {s_new} new "
                         f"ones would end at {lengths[b] + s_new}, beyond {capacity}")
    if leftpad is not None and ((leftpad < 0) | (leftpad > lengths)).any():
        b = int(np.argmax((leftpad < 0) | (leftpad > lengths)))
        raise ValueError(f"cache_leftpad: entry {b} is {leftpad[b]}, outside [0, "
                         f"cache_seqlens[{b}] = {lengths[b]}]")


def _check_rotary_rows(c: _KVCall, lengths: np.ndarray) -> None:
    """The rotary tables hold a row for every position rotated (queries and new keys)."""
    q_pos = _rotary_positions(lengths, c.q.shape[1], same=c.mask is None)
    k_pos = _rotary_positions(lengths, c.s_new, same=False)
    top = max(int(q_pos.max()) if q_pos.size else -1, int(k_pos.max()) if k_pos.size else -1)
    if top >= c.cos.shape[0]:
        raise ValueError(f"rotary_cos: has {c.cos.shape[0]} rows but position {top} "
                         "is rotated (queries and new keys sit at cache_seqlens[b] + i); "
                         "pass longer rotary tables")


def _kvcache_on_host(c: _KVCall, lengths_t, n_int, idx_t, leftpad_t, table_t):
    """flash_attn_with_kvcache with its lengths, indices and table read to the host (CPU
    tensors, or where _values_on_device says no): every value checked, then the cache
    read in place through the core's paged form where it serves, else a gathered copy or
    dense calls over key ranges."""
    q, k_cache, v_cache, k, v = c.q, c.k_cache, c.v_cache, c.k, c.v
    bsz, sq = q.shape[0], q.shape[1]
    mask, scale, cap, slopes, s_new = c.mask, c.scale, c.cap, c.slopes, c.s_new

    def host(t):
        return None if t is None else t.detach().cpu().numpy().astype(np.int64)
    idx, leftpad = host(idx_t), host(leftpad_t)
    lengths = np.full(bsz, n_int, dtype=np.int64) if n_int is not None else host(lengths_t)
    _check_cache_values(idx, c.b_cache, lengths, s_new, c.s_cache, c.capacity, leftpad)
    if idx is None:
        idx = np.arange(bsz, dtype=np.int64)
    if leftpad is None:
        leftpad = np.zeros(bsz, dtype=np.int64)
    ends = lengths + s_new
    table, page = host(table_t), c.page
    if c.paged:
        _check_pages(table, leftpad, ends, page, k_cache.shape[0])
    if c.cos is not None:
        _check_rotary_rows(c, lengths)
    # The cache is read in place through the core's paged form (pages=, keys of entry b
    # the positions [cache_leftpad[b], ends[b]) of its pages): a paged cache as it is, a
    # contiguous one (entries of different key counts or a cache_leftpad) as pages of
    # s_cache positions (page b = cache row idx[b]), one call for the batch; on a GPU
    # while the queries per entry fit the Triton backend's paged kernel (PAGED_MAX_SQ).
    # Otherwise (more queries on a GPU; a contiguous cache whose entries all end alike)
    # a paged cache is gathered into one contiguous copy, and entries of different key
    # ranges run one dense call each.
    in_place = _reads_in_place(q.device.type, sq, c.paged, leftpad, ends)
    if in_place and not c.paged:
        table = idx[:, None]
    with torch.no_grad():
        if in_place and c.paged:
            kc = vc = None          # the pages are read where they are
        elif c.paged:
            kc, vc = _gather_pages(k_cache, v_cache, table, leftpad, ends, page)
        else:
            kc, vc = k_cache, v_cache
        if in_place:
            # the core's checks and a backend before the cache is written, so that a
            # refusal leaves it as it was
            pages = Pages(table, ends, leftpad if leftpad.any() else None)
            choose(describe_paged(q.transpose(1, 2), k_cache.transpose(1, 2),
                                  v_cache.transpose(1, 2), pages, mask=mask, scale=scale,
                                  softcap=cap, alibi_slopes=slopes))
        elif bsz:
            # the core's checks and a backend for these inputs before the cache is written,
            # so that a refusal leaves it as it was (key ranges differ only in length)
            kk, vv = (x[:1, :int(ends.max())].transpose(1, 2) for x in (kc, vc))
            choose(describe(q[:1].transpose(1, 2), kk, vv, mask=mask, scale=scale,
                            softcap=cap, alibi_slopes=None if slopes is None else
                            (slopes if slopes.ndim == 1 else slopes[:1])))
        if c.cos is not None:
            def turn(x, pos):
                where = torch.from_numpy(pos).to(x.device)
                return rotary_mod.rotate(x, c.cos[where], c.sin[where], c.interleaved)
            q = turn(q, _rotary_positions(lengths, sq, same=mask is None))
            if s_new:
                k = turn(k, _rotary_positions(lengths, s_new, same=False))
        if s_new:
            new_pos = lengths[:, None] + np.arange(s_new)
            if kc is not None:
                rows = torch.from_numpy(idx).to(k_cache.device)[:, None]          # [B, 1]
                pos = torch.from_numpy(new_pos).to(k_cache.device)
                kc.index_put_((rows, pos), k)
                vc.index_put_((rows, pos), v)
            if c.paged:
                blocks = np.take_along_axis(table, new_pos // page, axis=1)
                at = (torch.from_numpy(blocks).to(k_cache.device),
                      torch.from_numpy(new_pos % page).to(k_cache.device))
                k_cache.index_put_(at, k)
                v_cache.index_put_(at, v)
        if in_place:
            return core_attention(q, k_cache, v_cache, layout="bshd", pages=pages, mask=mask,
                                  scale=scale, softcap=cap, alibi_slopes=slopes,
                                  return_lse=True)
        return _dense_over_ranges(q, kc, vc, idx, leftpad, ends, mask, scale, cap, slopes)


def _kvcache_on_device(c: _KVCall, lengths_t, n_int, idx_t, leftpad_t, table_t):
    """flash_attn_with_kvcache with its lengths, indices and table left on q's device
    (CPU ones are copied there): no value is read to the host, so the call makes no
    synchronisation and a CUDA graph can capture it.  The new keys are written with
    device indices (positions cache_seqlens[b] + i), rotary positions are gathered on
    the device, and the cache is read in place through
    ``Pages(table, cache_seqlens + Snew, starts=cache_leftpad, on_device=True)`` (a
    contiguous cache: its rows cache_batch_idx as pages of seqlen_cache positions), the
    Triton backend's paged kernel sized from the table's width.  The values are checked
    only under ANYATTN_CHECK_DEVICE_INPUTS=1 (_check_on_host)."""
    q, k_cache, v_cache, k, v = c.q, c.k_cache, c.v_cache, c.k, c.v
    dev = q.device
    bsz = q.shape[0]
    s_new = c.s_new
    lengths_t, idx_t, leftpad_t, table_t = (None if t is None else t.to(dev)
                                            for t in (lengths_t, idx_t, leftpad_t, table_t))
    if settings.current().check_device_inputs:
        _check_on_host(c, lengths_t, n_int, idx_t, leftpad_t, table_t)
    if lengths_t is None:
        lengths_t = torch.full((bsz,), n_int, dtype=torch.int32, device=dev)
    ends_t = lengths_t + s_new if s_new else lengths_t
    if c.paged:
        table = table_t
    else:
        rows = idx_t if idx_t is not None else torch.arange(bsz, dtype=torch.int32, device=dev)
        table = rows[:, None]                          # each entry one page: its cache row
    with torch.no_grad():
        pages = Pages(table, ends_t, leftpad_t, on_device=True)
        # the core's checks and a backend before the cache is written, so that a refusal
        # leaves it as it was
        choose(describe_paged(q.transpose(1, 2), k_cache.transpose(1, 2),
                              v_cache.transpose(1, 2), pages, mask=c.mask, scale=c.scale,
                              softcap=c.cap, alibi_slopes=c.slopes))
        if c.cos is not None:
            q = _rotate_on_device(c, q, lengths_t, same=c.mask is None)
            if s_new:
                k = _rotate_on_device(c, k, lengths_t, same=False)
        if s_new:
            pos = lengths_t.long()[:, None] + torch.arange(s_new, device=dev)   # [B, Snew]
            if c.paged:
                at = (table.long().gather(1, pos // c.page), pos % c.page)
            else:
                at = (table.long(), pos)
            k_cache.index_put_(at, k)
            v_cache.index_put_(at, v)
        return core_attention(q, k_cache, v_cache, layout="bshd", pages=pages, mask=c.mask,
                              scale=c.scale, softcap=c.cap, alibi_slopes=c.slopes,
                              return_lse=True)


def _rotate_on_device(c: _KVCall, x, offsets_t, same: bool):
    """x [B, S, H, D] rotated at positions offsets_t[b] + i (offsets_t[b] for every row
    with ``same``), the table rows gathered on the device."""
    bsz, count = x.shape[0], x.shape[1]
    steps = (torch.zeros if same else torch.arange)(count, dtype=torch.int64, device=x.device)
    pos = (offsets_t.long()[:, None] + steps[None, :]).reshape(-1)
    cos = c.cos.index_select(0, pos).reshape(bsz, count, -1)
    sin = c.sin.index_select(0, pos).reshape(bsz, count, -1)
    return rotary_mod.rotate(x, cos, sin, c.interleaved)


def _check_on_host(c: _KVCall, lengths_t, n_int, idx_t, leftpad_t, table_t) -> None:
    """ANYATTN_CHECK_DEVICE_INPUTS=1: the device tensors read to the host in one copy
    (one synchronisation) and checked as _kvcache_on_host checks them."""
    bsz = c.q.shape[0]
    given = [t for t in (lengths_t, idx_t, leftpad_t, table_t) if t is not None]
    flat = torch.cat([t.reshape(-1).long() for t in given]).cpu().numpy()
    parts, at = [], 0
    for t in (lengths_t, idx_t, leftpad_t, table_t):
        if t is None:
            parts.append(None)
            continue
        parts.append(flat[at:at + t.numel()].reshape(tuple(t.shape)))
        at += t.numel()
    lengths, idx, leftpad, table = parts
    if lengths is None:
        lengths = np.full(bsz, n_int, dtype=np.int64)
    _check_cache_values(idx, c.b_cache, lengths, c.s_new, c.s_cache, c.capacity, leftpad)
    if c.paged:
        _check_pages(table, leftpad, lengths + c.s_new, c.page, c.k_cache.shape[0])
    if c.cos is not None:
        _check_rotary_rows(c, lengths)
