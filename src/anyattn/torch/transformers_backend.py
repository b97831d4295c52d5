"""``attn_implementation="anyattn"`` for Hugging Face transformers models.

Shape legend: B batch, H/Hkv query/key-value heads, Sq/Sk queries/keys, D head dim
of query and key, Dv of value and the output (DeepSeek's MLA: Dv != D).

Importing this module registers two things under the name ``"anyattn"``: the
attention function (:func:`anyattn_attention_forward`) with
``transformers.AttentionInterface`` and the mask builder (:func:`anyattn_mask`) with
``transformers.masking_utils.AttentionMaskInterface``.  Then::

    import anyattn.torch.transformers_backend  # noqa: F401
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="anyattn")

Results follow the ``"eager"`` implementation, Gemma 2/3 logit soft-capping and
gpt-oss attention sinks included; GQA runs natively (K/V are never repeated).

**Masks as structure.**  transformers describes a layer's mask by a mask function
(``causal_mask_function``, ``sliding_window_causal_mask_function(w)``, ...), the
positions of the first query and key (``q_offset``, ``kv_offset``: from the cache)
and the 2-D padding mask, and hands them to the registered builder once per forward
and layer type.  :func:`anyattn_mask` returns a :class:`StructuredMask` of anyattn
mask terms, with no dense [B, 1, Sq, Sk] tensor:

- causal layers: ``Causal()``; sliding layers: ``Causal() & Window(left=w - 1)``
  (transformers keeps ``j > i - w``); ``sliding_window_bidirectional_mask_function(w)``:
  ``Window(left=w, right=w)``; all placed by the cache positions (anyattn's
  ``q_offset``/``k_offset``), so decoding with a (sliding-window) cache needs nothing
  dense either;
- ``and_masks`` / ``or_masks`` compositions (``and_mask_function``,
  ``or_mask_function``, ``block_sequence_ids``): ``&`` / ``|`` of their parts' terms;
- packed sequences (found by transformers from ``position_ids``), with or without
  padding or a cache: ``Documents``;
- any other mask function (chunked attention's ``chunked_overlay``, image tokens'
  ``blockwise_overlay``, a model's own): traced into a ``MaskMod`` (the tensors it
  closes over become captures), called with transformers' positions
  ``q_idx + q_offset``, ``kv_idx + kv_offset`` and head index 0, as ``sdpa_mask`` does;
  one that traces to the constant True (EmbeddingGemma's
  ``lambda *args: torch.tensor(True)``) keeps every key;
- padding: a key-padding ``KeepMask`` [B, 1, 1, Sk] (left out when nothing is padded);
- rows that keep no key -- the pad queries of a left-padded batch, in a sliding layer
  the pad queries ``w`` or more past the end of a right-padded sequence -- are found by
  the builder (band masks: from prefix sums of the padding, [B, Sq + Sk] work; masks
  with functions or documents: from the mask's tile map, evaluating only the partial
  tiles of query tiles that have no full key tile, one tile at a time) and given
  eager's result: eager adds ``finfo.min`` to every masked score, so such a row attends
  to *every* key uniformly (``sdpa`` returns 0 there instead).  The attention function
  computes just those query rows again, over every key with a ``finfo.min`` bias, and
  adds them to the structured result, which is exactly 0 on them.  With sinks (gpt-oss)
  nothing is added: eager's sink then takes all the weight, which is anyattn's empty
  row (out 0, no gradient).

The builder returns transformers' dense bool mask (its ``sdpa_mask``; a ``KeepMask``
here, its empty rows given eager's result per call) only where structure is
impossible:

- a mask function the tracer refuses (data-dependent Python such as ``.item()``, a
  call it does not know such as ``torch.isin``), or one whose capture indices the
  bounds analysis cannot prove in range;
- one of transformers' plain layer masks (causal, sliding, chunked, bidirectional, with
  nothing composed onto it) with both ``allow_is_causal_skip`` and
  ``allow_is_bidirectional_skip`` False: transformers' convention for a caller that
  asks for the tensor itself because it edits it (Falcon adds ALiBi onto it, T5Gemma 2
  concatenates two, Longformer slices it), and what ``create_causal_mask`` passes when
  decoding with a static (compileable) cache;
- while tracing (``torch.compile``, ``torch.export``): dynamo cannot read a mask
  function's closure, and which rows are empty is data (transformers' own ``sdpa``
  mask is dense under tracing too);
- cache positions given as tensors that cannot be read as ints.

A 4-D mask passed in by the caller is used as given (bool: a KeepMask; float: added to
the scores as a bias).  The builder runs once per forward and layer type; off the CPU
its ``.all()``/``.any()`` checks synchronise with the device, as transformers' own
``sdpa_mask`` does.

Every argument transformers passes is honoured or refused (transformers 5.x
calling convention: ``attention_interface(module, q, k, v, attention_mask,
dropout=, scaling=, [is_causal=, sliding_window=, softcap=, s_aux=,
position_bias=], **kwargs)`` with the model's ``TransformersKwargs``):

- honoured: ``attention_mask`` (a :class:`StructuredMask`, or a bool or float 4-D
  tensor), ``scaling``, ``is_causal``, ``sliding_window`` (the masks transformers builds
  contain the window; without a mask it is applied where it can bind, see
  :func:`anyattn_attention_forward`), ``softcap`` (Gemma 2/3 logit soft-capping:
  anyattn's ``softcap=``), ``s_aux`` (gpt-oss attention sinks [H], in the model dtype
  or float32: anyattn's ``sinks=``, with their gradient), ``position_bias`` (added to
  the scores, with its gradient), ``cu_seq_lens_q`` / ``cu_seq_lens_k`` and ``seq_idx``
  (packed sequences: a Documents mask), ``deterministic`` (anyattn's backward is always
  deterministic), ``dropout`` (attention dropout in training mode: anyattn's
  ``dropout_p=`` with ``anyattn.dropout_mask``, the seed drawn from torch's default
  generator per call, so ``torch.manual_seed`` reproduces a step on any backend; the
  mask is not eager's, which draws torch's own. Rows that keep no key, which eager
  makes attend uniformly, are recomputed without dropout: they are padding queries whose
  output reaches no real token);
- accepted, without effect on attention: ``position_ids`` (rotary embeddings are
  applied before; packing reaches us through the mask built from them),
  ``max_length_q`` / ``max_length_k``, ``use_cache``, ``cache_position``,
  ``output_hidden_states``, ``output_router_logits``, ``num_items_in_batch``,
  ``return_dict``; ``output_attentions=False``;
- refused with NotImplementedError naming the argument: ``output_attentions=True``, and
  any other keyword argument that is not None.
"""
from __future__ import annotations

import functools
import numbers
import operator
from dataclasses import dataclass
from typing import Optional, Tuple

import numpy as np
import torch

from ..masks import (TERM_KINDS, TILE_FULL, TILE_PARTIAL, AndMask, Causal, Documents,
                     KeepMask, Mask, Window, resolve)
from ..programs.mods import MaskMod
from ..programs.trace import fn_name
from .functional import attention

__all__ = ["anyattn_attention_forward", "anyattn_mask", "StructuredMask", "register", "NAME",
           "IGNORED_KWARGS"]

NAME = "anyattn"

#: keyword arguments that reach the attention function but do not change attention.
IGNORED_KWARGS = frozenset({
    "position_ids", "max_length_q", "max_length_k", "use_cache", "cache_position",
    "output_hidden_states", "output_router_logits", "num_items_in_batch", "return_dict",
    "deterministic",
})


def _summary(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"<tensor {tuple(x.shape)} {str(x.dtype).replace('torch.', '')}>"
    return repr(x)


def _refuse(name: str, value, why: str) -> NotImplementedError:
    return NotImplementedError(f"{name}={_summary(value)}: {why}")


def _doc_ids(name: str, cu: torch.Tensor, n: int, batch: int) -> torch.Tensor:
    """cu_seq_lens [docs + 1] (cumulative, from 0 to n) -> document id per token [n]."""
    if batch != 1 or cu.ndim != 1 or cu.numel() < 2:
        raise _refuse(name, cu, "packed sequences need batch size 1 and cumulative lengths "
                      f"[documents + 1]; got batch {batch}")
    if not torch.compiler.is_compiling() and int(cu[-1]) != n:
        raise ValueError(f"{name}: the packed lengths end at {int(cu[-1])} but the sequence "
                         f"has {n} tokens")
    pos = torch.arange(n, device=cu.device, dtype=cu.dtype)
    return torch.bucketize(pos, cu[1:], right=True)


def _packed(query, key, cu_seq_lens_q, cu_seq_lens_k, seq_idx):
    """A Documents term from the packed-sequence arguments, or None."""
    B, Sq, Sk = query.shape[0], query.shape[2], key.shape[2]
    terms = []
    if cu_seq_lens_q is not None or cu_seq_lens_k is not None:
        cq = cu_seq_lens_q if cu_seq_lens_q is not None else cu_seq_lens_k
        ck = cu_seq_lens_k if cu_seq_lens_k is not None else cu_seq_lens_q
        terms.append(Documents(_doc_ids("cu_seq_lens_q", cq, Sq, B),
                               _doc_ids("cu_seq_lens_k", ck, Sk, B)))
    if seq_idx is not None:
        if (seq_idx.ndim != 2 or seq_idx.shape[0] not in (1, B) or seq_idx.shape[1] != Sq
                or Sq != Sk):
            raise _refuse("seq_idx", seq_idx, f"expected sequence ids [B, S] for {Sq} queries "
                          f"over as many keys (got {Sk} keys)")
        terms.append(Documents(seq_idx))
    out = None
    for t in terms:
        out = t if out is None else out & t
    return out


def _window_without_mask(sliding_window, causal: bool, Sq: int, Sk: int):
    """The Window term for ``sliding_window`` when no mask carries it (None: it cannot bind)."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) \
            or sliding_window < 1:
        raise ValueError(f"sliding_window={sliding_window!r}: expected a positive int or None")
    if causal:
        # HF: key j is kept iff j > i - sliding_window (top-left, as the Causal term)
        return Window(left=sliding_window - 1) if Sq > sliding_window else None
    if max(Sq, Sk) <= sliding_window:
        return None          # no query is sliding_window keys away from any key
    raise _refuse("sliding_window", sliding_window,
                  f"without an attention mask, for {Sq} queries over {Sk} keys in a "
                  "non-causal call, where the window's alignment would be a guess; pass "
                  "the mask transformers builds (attn_implementation='anyattn' does)")


def _empty_rows_like_eager(keep: torch.Tensor, dtype: torch.dtype):
    """A bias [B, 1, Sq, 1]: finfo.min on the rows of ``keep`` that keep no key, else 0.

    Eager adds finfo.min to every masked score, so a row masked everywhere attends to
    all keys uniformly; such rows then keep every key with that bias.  The bias is
    left out where no row is empty, checked only where that costs no device sync
    (CPU tensors outside torch.compile)."""
    empty = ~keep.any(dim=-1, keepdim=True)                       # [B, h, Sq, 1]
    if keep.device.type == "cpu" and not torch.compiler.is_compiling() \
            and not bool(empty.any()):
        return keep, None
    bias = torch.zeros(empty.shape, dtype=dtype, device=keep.device)
    bias = bias.masked_fill(empty, torch.finfo(dtype).min)
    return keep | empty, bias


# -- the mask builder: transformers' mask description -> anyattn mask terms ------------

@dataclass(frozen=True, eq=False)
class StructuredMask:
    """One layer type's mask as anyattn terms; what :func:`anyattn_mask` returns.

    ``mask``: the terms (Causal, Window, a key-padding KeepMask [B, 1, 1, Sk],
    Documents, traced MaskMods and ``|`` of terms; None keeps every key); ``q_offset`` / ``k_offset``: the positions of
    query 0 and key 0, which place the Causal and Window terms (passed on as
    ``anyattn.torch.attention``'s arguments of those names); ``shape``: (B, 1, Sq, Sk),
    the shape of the dense mask it stands for; ``empty_rows``: None, or
    (rows [B, n] int64, valid [B, n] bool), the query rows that keep no key (entries
    with ``valid`` False only fill a batch row's list up to n).
    """

    mask: Optional[Mask]
    q_offset: int
    k_offset: int
    shape: Tuple[int, int, int, int]
    empty_rows: Optional[Tuple[torch.Tensor, torch.Tensor]] = None

    #: transformers asks a prepared mask for ``ndim`` (a 2-D padding mask is rebuilt)
    ndim = 4

    def to_dense(self) -> torch.Tensor:
        """The mask as the dense bool [B, 1, Sq, Sk] it stands for (True = attend), on
        the CPU; for tests and inspection."""
        B, _, Sq, Sk = self.shape
        r = resolve(self.mask, B, 1, Sq, Sk, q_offset=self.q_offset, k_offset=self.k_offset)
        dense = torch.from_numpy(r.dense_keep(B, 1))
        return dense.expand(B, 1, Sq, Sk).clone()

    def __repr__(self) -> str:
        n = 0 if self.empty_rows is None else self.empty_rows[0].shape[1]
        return (f"StructuredMask({self.mask!r}, q_offset={self.q_offset}, "
                f"k_offset={self.k_offset}, shape={self.shape}, empty rows <= {n} per batch)")


@functools.lru_cache(maxsize=None)
def _known_codes():
    """Code objects of the transformers mask-function factories the builder reads."""
    from transformers import masking_utils as mu

    one = torch.ones(1, 1, dtype=torch.bool)
    return {
        "and": mu.and_masks(mu.causal_mask_function).__code__,
        "or": mu.or_masks(mu.causal_mask_function).__code__,
        "sliding": mu.sliding_window_overlay(1).__code__,
        "sliding_bidirectional": mu.sliding_window_bidirectional_overlay(1).__code__,
        "chunked": mu.chunked_overlay(1, one).__code__,
        "packed": mu.packed_sequence_mask_function(one).__code__,
    }


_MISSING = object()
#: a mask function that keeps every pair (``bidirectional_mask_function``)
_ALL = object()


def _cell(fn, name: str):
    """The value ``fn`` closes over under ``name`` (_MISSING if none: a transformers
    version whose factory closes over other names is then traced instead)."""
    names = fn.__code__.co_freevars
    if name not in names or fn.__closure__ is None:
        return _MISSING
    return fn.__closure__[names.index(name)].cell_contents


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _parts(fn, kind: str):
    """The mask functions of an ``and_masks`` / ``or_masks`` composition, or None."""
    if getattr(fn, "__code__", None) is not _known_codes()[kind]:
        return None
    parts = _cell(fn, "mask_functions")
    return parts if isinstance(parts, tuple) and parts else None


def _is_base(fn) -> bool:
    """Is ``fn`` one of the layer masks transformers starts from (causal, sliding,
    chunked, bidirectional, bidirectional sliding), with no ``or_mask_function`` /
    ``and_mask_function`` / packed sequences / ``block_sequence_ids`` on top?"""
    from transformers import masking_utils as mu

    if fn is mu.causal_mask_function or fn is mu.bidirectional_mask_function:
        return True
    parts, known = _parts(fn, "and"), _known_codes()
    if parts is None or len(parts) != 2:
        return False
    overlay, base = parts
    return (base in (mu.causal_mask_function, mu.bidirectional_mask_function)
            and getattr(overlay, "__code__", None) in (
                known["sliding"], known["chunked"], known["sliding_bidirectional"]))


def _traced(fn, q_offset: int, k_offset: int):
    """``fn`` (transformers' convention: global positions, head index 0) traced into a
    MaskMod of local indices; _ALL for a function that is the constant True
    (EmbeddingGemma's ``lambda *args: torch.tensor(True)``); None where it cannot be
    traced."""

    def placed(batch_idx, head_idx, q_idx, kv_idx):
        # transformers evaluates its masks for one head (index 0) and broadcasts them
        return fn(batch_idx, 0, q_idx + q_offset, kv_idx + k_offset)

    placed.__qualname__ = placed.__name__ = fn_name(fn)
    try:
        mod = MaskMod(placed)
    except TypeError:             # the tracer's refusals (TraceError is a TypeError)
        return None
    out = mod.program.out
    return _ALL if out.op == "const" and out.attr is True else mod


def _term(fn, q_offset: int, k_offset: int, Sq: int, Sk: int):
    """The anyattn mask term of a transformers mask function: a Mask, _ALL (keeps
    everything) or None (neither read nor traceable: the dense fallback)."""
    from transformers import masking_utils as mu

    if fn is mu.causal_mask_function:              # kv_idx <= q_idx
        return Causal()
    if fn is mu.bidirectional_mask_function:       # every key
        return _ALL
    known = _known_codes()
    for kind in ("and", "or"):
        parts = _parts(fn, kind)
        if parts is None:
            continue
        terms = [_term(f, q_offset, k_offset, Sq, Sk) for f in parts]
        if any(t is None for t in terms):
            return None
        if kind == "and":
            terms = [t for t in terms if t is not _ALL]
            return functools.reduce(operator.and_, terms) if terms else _ALL
        if any(t is _ALL for t in terms):
            return _ALL
        return functools.reduce(operator.or_, terms)
    code = getattr(fn, "__code__", None)
    if code is known["sliding"]:                   # kv_idx > q_idx - w
        w = _cell(fn, "sliding_window")
        if _is_int(w) and w >= 1:
            return Window(left=int(w) - 1)
    elif code is known["sliding_bidirectional"]:   # |q_idx - kv_idx| <= w
        w = _cell(fn, "sliding_window")
        if _is_int(w) and w >= 0:
            return Window(left=int(w), right=int(w))
    elif code is known["packed"]:                  # ids[b, q_idx] == ids[b, kv_idx]
        ids = _cell(fn, "packed_sequence_mask")
        if (isinstance(ids, torch.Tensor) and ids.ndim == 2 and not ids.is_floating_point()
                and ids.shape[1] >= max(q_offset + Sq, k_offset + Sk)):
            return Documents(ids[:, q_offset:q_offset + Sq], ids[:, k_offset:k_offset + Sk])
    # chunked overlays, blockwise image tokens, a model's own functions: traced
    return _traced(fn, q_offset, k_offset)


def _listed(empty: torch.Tensor):
    """empty [B, Sq] bool -> (rows [B, n], valid [B, n]), or None where no row is empty."""
    if not bool(empty.any()):
        return None
    n = int(empty.sum(1).max())
    rows = torch.argsort((~empty).to(torch.int8), dim=1, stable=True)[:, :n]  # empty first
    return rows, empty.gather(1, rows)


def _empty_rows(band_lo, band_hi, keys: Optional[torch.Tensor], B: int, Sq: int, Sk: int,
                device):
    """(rows [B, n], valid [B, n]) of the queries that keep no key under the band
    ``band_lo <= j - i <= band_hi`` and the key padding ``keys`` [B, Sk], or None."""
    i = torch.arange(Sq, device=device)
    first = (i + band_lo).clamp(0, Sk) if band_lo is not None else torch.zeros_like(i)
    stop = (i + band_hi + 1).clamp(0, Sk) if band_hi is not None else torch.full_like(i, Sk)
    stop = torch.maximum(stop, first)                               # [Sq] key range
    if keys is None:
        empty = (stop == first)[None].expand(B, Sq)
    else:
        kept = torch.nn.functional.pad(keys.to(torch.int32).cumsum(1), (1, 0))  # [B, Sk + 1]
        empty = kept[:, stop] == kept[:, first]                     # [B, Sq]
    return _listed(empty)


#: tile edge of the empty-row search of a mask with functions or documents
EMPTY_ROW_TILE = 128


def _empty_rows_by_tiles(mask: Mask, B: int, Sq: int, Sk: int, q_offset: int,
                         k_offset: int, device):
    """(rows [B, n], valid [B, n]) of the queries that keep no key under any mask, or
    None: from the mask's tile map (a query tile with a full key tile has no empty
    row; one with only empty key tiles has nothing but empty rows), then evaluating
    only the partial tiles of the remaining query tiles, one tile at a time."""
    rm = resolve(mask, B, 1, Sq, Sk, q_offset=q_offset, k_offset=k_offset)
    bq, bk = min(EMPTY_ROW_TILE, Sq), min(EMPTY_ROW_TILE, Sk)
    nq, nk = -(-Sq // bq), -(-Sk // bk)
    codes = np.broadcast_to(rm.tile_map(bq, bk)[:, 0], (B, nq, nk))  # [B, nQ, nK]
    has_full = (codes == TILE_FULL).any(-1)                            # [B, nQ]
    partial = codes == TILE_PARTIAL
    empty = np.zeros((B, Sq), dtype=bool)
    for t in range(nq):
        if has_full[:, t].all():
            continue
        i0, i1 = t * bq, min(Sq, (t + 1) * bq)
        kept = np.broadcast_to(has_full[:, t, None], (B, i1 - i0)).copy()
        for u in np.nonzero(partial[:, t].any(0))[0]:
            j0, j1 = u * bk, min(Sk, (u + 1) * bk)
            keep = np.ones((1, 1, i1 - i0, j1 - j0), dtype=bool)
            for name in rm.terms:
                keep = keep & TERM_KINDS[name].keep_block(rm, i0, i1, j0, j1)
            kept |= np.broadcast_to(keep, (B, keep.shape[1], i1 - i0, j1 - j0))[:, 0].any(-1)
        empty[:, i0:i1] = ~kept
    return _listed(torch.from_numpy(empty).to(device))


def _is_band(mask: Optional[Mask]) -> bool:
    terms = mask.terms if isinstance(mask, AndMask) else (mask,)
    return all(t is None or isinstance(t, (Causal, Window)) for t in terms)


def _structure(B: int, Sq: int, Sk: int, q_offset: int, k_offset: int, mask_function,
               attention_mask: Optional[torch.Tensor], device) -> Optional[StructuredMask]:
    """The StructuredMask for transformers' description, or None where it cannot be one."""
    from transformers import masking_utils as mu

    term = _term(mask_function, q_offset, k_offset, Sq, Sk)
    if term is None:
        return None
    term = None if term is _ALL else term
    keys = None
    if attention_mask is not None:
        # as sdpa_mask: padding_mask[b, kv_offset + j], zero-padded to the cache's length
        pad = mu.prepare_padding_mask(attention_mask, Sk, k_offset)
        if pad.ndim != 2 or pad.shape[0] != B:
            return None
        keys = pad[:, k_offset:k_offset + Sk].to(device=device, dtype=torch.bool)
        if keys.shape[1] != Sk:
            return None
        if bool(keys.all()):
            keys = None
    terms = [] if term is None else [term]
    if keys is not None:
        terms.append(KeepMask(keys[:, None, None, :]))
    mask = functools.reduce(operator.and_, terms) if terms else None
    if _is_band(term):
        band = resolve(term, B, 1, Sq, Sk, q_offset=q_offset, k_offset=k_offset)
        empty = _empty_rows(band.band_lo, band.band_hi, keys, B, Sq, Sk, device)
    else:
        try:
            empty = _empty_rows_by_tiles(mask, B, Sq, Sk, q_offset, k_offset, device)
        except ValueError:
            # a traced function's capture index that the bounds analysis cannot prove
            # in range (it ignores correlations): transformers' mask decides
            return None
    return StructuredMask(mask, q_offset, k_offset, (B, 1, Sq, Sk), empty)


def _as_int(x) -> Optional[int]:
    if _is_int(x):
        return int(x)
    if isinstance(x, torch.Tensor) and x.numel() == 1 and not x.is_floating_point():
        return int(x)
    return None


def anyattn_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
                 mask_function=None, attention_mask: Optional[torch.Tensor] = None,
                 local_size: Optional[int] = None, allow_is_causal_skip: bool = True,
                 allow_is_bidirectional_skip: bool = False, use_vmap: bool = False,
                 device="cpu", **kwargs):
    """The ``"anyattn"`` mask builder (``AttentionMaskInterface``; transformers'
    ``sdpa_mask`` signature): the layer's mask as a :class:`StructuredMask`, or, where
    structure is impossible (see the module docstring), transformers' dense bool mask
    [B, 1, Sq, Sk] (True = attend), never None.

    The structure is never skipped (never None); ``allow_is_causal_skip`` and
    ``allow_is_bidirectional_skip`` both False for one of transformers' layer masks as
    it is (causal, sliding, chunked, bidirectional) is read as a request for the tensor
    itself (transformers' convention for callers that edit the mask), answered with the
    dense mask; with an or/and mask function, packed sequences or ``block_sequence_ids``
    on top (transformers turns the skip off for those) the mask stays structure.
    ``local_size`` only reaches the dense fallback.
    """
    from transformers import masking_utils as mu
    from transformers.utils.import_utils import is_tracing

    if isinstance(attention_mask, StructuredMask):
        return attention_mask           # prepared before (generate), as a 4-D mask would be
    if mask_function is None:
        mask_function = mu.causal_mask_function
    # Both skips off for one of transformers' layer masks as it is: the caller wants the
    # tensor itself (Falcon adds ALiBi onto it, T5Gemma 2 concatenates two, Longformer
    # slices it), or transformers turned the skip off for decoding with a static cache.
    # Where an or/and mask function, packed sequences or block_sequence_ids were added,
    # transformers turned the skip off for those: the mask stays structure.
    materialize = (not allow_is_causal_skip and not allow_is_bidirectional_skip
                   and _is_base(mask_function))
    if not is_tracing(attention_mask) and not materialize:
        qo, ko = _as_int(q_offset), _as_int(kv_offset)
        if qo is not None and ko is not None:
            built = _structure(batch_size, q_length, kv_length, qo, ko, mask_function,
                               attention_mask, device)
            if built is not None:
                return built
    return mu.sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                        q_offset=q_offset, kv_offset=kv_offset, mask_function=mask_function,
                        attention_mask=attention_mask, local_size=local_size,
                        allow_is_causal_skip=False, allow_is_bidirectional_skip=False,
                        use_vmap=use_vmap, device=device, **kwargs)


def _eager_empty_rows(out, query, key, value, rows, valid, bias, scaling, softcap):
    """``out`` [B, H, Sq, Dv] (0 on the rows that keep no key) with eager's result on
    those rows: every key, uniformly (scores + finfo.min), with eager's gradients."""
    B, H, _, D = query.shape
    Dv = value.shape[-1]
    n = rows.shape[1]
    index = rows[:, None, :, None]                                  # [B, 1, n, 1]
    q_rows = query.gather(2, index.expand(B, H, n, D))               # [B, H, n, D]
    if bias is None:
        low = torch.full((1, 1, 1, 1), torch.finfo(torch.float32).min, dtype=torch.float32,
                         device=query.device)
    else:
        while bias.ndim < 4:
            bias = bias[None]
        Sk = key.shape[2]
        if bias.shape[2] != 1:
            bias = bias.expand(B, -1, -1, -1).gather(
                2, index.expand(B, bias.shape[1], n, Sk))            # [B, Hb, n, Sk|1]
        low = bias + torch.finfo(bias.dtype).min                    # rounds to finfo.min
    out_rows = attention(q_rows, key, value, bias=low, scale=scaling, softcap=softcap)
    out_rows = torch.where(valid[:, None, :, None], out_rows, out_rows.new_zeros(()))
    return out.scatter_add(2, index.expand(B, H, n, Dv), out_rows)


def anyattn_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                              value: torch.Tensor, attention_mask=None,
                              dropout: float = 0.0, scaling: Optional[float] = None,
                              is_causal: Optional[bool] = None,
                              sliding_window: Optional[int] = None,
                              softcap: Optional[float] = None,
                              s_aux: Optional[torch.Tensor] = None,
                              position_bias: Optional[torch.Tensor] = None,
                              output_attentions: Optional[bool] = False,
                              cu_seq_lens_q: Optional[torch.Tensor] = None,
                              cu_seq_lens_k: Optional[torch.Tensor] = None,
                              seq_idx: Optional[torch.Tensor] = None,
                              **kwargs) -> Tuple[torch.Tensor, None]:
    """query [B, H, Sq, D], key [B, Hkv, Sk, D], value [B, Hkv, Sk, Dv] -> (out
    [B, Sq, H, Dv], None).

    ``attention_mask``: a :class:`StructuredMask` (from :func:`anyattn_mask`), a 4-D
    bool (True = attend) or float (added) tensor broadcastable to [B, H, Sq, Sk], or
    None.  ``softcap``: scores ``c·tanh(s / c)`` before the mask; ``s_aux``: sinks [H].
    Which arguments are honoured, accepted or refused: see the module docstring.
    ``sliding_window`` without ``attention_mask``: in a causal call it is applied as
    ``Causal() & Window(left=sliding_window - 1)`` (HF's ``j > i - sliding_window``)
    where it can bind; a non-causal call where it could bind is refused.
    """
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) \
            or not 0.0 <= dropout < 1.0:
        raise ValueError(f"dropout={dropout!r}: expected the attention dropout probability "
                         "in [0, 1)")
    if output_attentions:
        raise _refuse("output_attentions", output_attentions, "anyattn never forms the "
                      "attention weights; use attn_implementation='eager' for them")
    for name, val in kwargs.items():
        if name not in IGNORED_KWARGS and val is not None:
            raise _refuse(name, val, "the anyattn backend does not implement this argument "
                          "of transformers' attention interface (use attn_implementation="
                          "'eager' or 'sdpa')")
    if s_aux is not None:
        if not isinstance(s_aux, torch.Tensor):
            raise TypeError(f"s_aux: expected the attention sinks as a tensor [H], got "
                            f"{type(s_aux).__name__}")
        if s_aux.dtype not in (query.dtype, torch.float32):
            s_aux = s_aux.to(query.dtype)
    B, Sq, Sk = query.shape[0], query.shape[2], key.shape[2]
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    # As transformers' sdpa backend: no mask means the plain causal (or full) pattern.
    is_causal = Sq > 1 and attention_mask is None and is_causal
    mask = bias = empty = None
    q_offset = k_offset = 0
    if isinstance(attention_mask, StructuredMask):
        sm = attention_mask
        if (sm.shape[0], sm.shape[2], sm.shape[3]) != (B, Sq, Sk):
            raise ValueError(f"attention_mask: {sm!r} was built for batch {sm.shape[0]}, "
                             f"{sm.shape[2]} queries and {sm.shape[3]} keys, but the call has "
                             f"batch {B}, {Sq} queries and {Sk} keys")
        mask, q_offset, k_offset, empty = sm.mask, sm.q_offset, sm.k_offset, sm.empty_rows
    elif attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor):
            raise TypeError(f"attention_mask: expected a StructuredMask (from anyattn_mask), a "
                            f"tensor or None, got {type(attention_mask).__name__}")
        if attention_mask.dtype == torch.bool:
            keep, bias = _empty_rows_like_eager(attention_mask, torch.float32)
            mask = KeepMask(keep)
        else:
            bias = attention_mask
    else:
        window = _window_without_mask(sliding_window, is_causal, Sq, Sk)
        if is_causal:
            mask = Causal() if window is None else Causal() & window
    docs = _packed(query, key, cu_seq_lens_q, cu_seq_lens_k, seq_idx)
    if docs is not None:
        mask = docs if mask is None else mask & docs
    if position_bias is not None:
        bias = position_bias if bias is None else position_bias + bias
    if bias is not None and bias.dtype not in (query.dtype, torch.float32):
        bias = bias.to(query.dtype)
    out = attention(query, key, value, mask=mask, bias=bias, scale=scaling,
                    q_offset=q_offset, k_offset=k_offset, softcap=softcap, sinks=s_aux,
                    dropout_p=float(dropout))
    if empty is not None and s_aux is None:
        out = _eager_empty_rows(out, query, key, value, *empty, bias, scaling, softcap)
    return out.transpose(1, 2).contiguous(), None


def register() -> None:
    """Register ``"anyattn"`` with transformers (idempotent)."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        from ..extras import import_error

        raise import_error("transformers", "transformers", e,
                           "anyattn.torch.transformers_backend") from e

    AttentionInterface.register(NAME, anyattn_attention_forward)
    AttentionMaskInterface.register(NAME, anyattn_mask)


register()
