"""``anyattn.torch.attention``: the differentiable entry point for torch tensors.

Shape legend: B batch, Hq/Hkv query/key-value heads (G = Hq / Hkv), Sq/Sk
queries/keys, D head dim of q and k, Dv of v and out.  ``layout="bhsd"`` takes [B, H, S, D];
``layout="bshd"`` takes [B, S, H, D] and returns ``out`` in that layout.
"""
from __future__ import annotations

import contextlib
import numbers
import operator
from typing import Iterator, Optional

import numpy as np
import torch

from .. import arguments
from ..backends.registry import choose
from ..problem import describe
from . import eager, ops, programs
from .lowering import lower

__all__ = ["attention", "use_backend"]

#: the backend used when a call passes ``backend=None`` (None: automatic choice).
_default_backend: Optional[str] = None


@contextlib.contextmanager
def use_backend(name: Optional[str]) -> Iterator[None]:
    """Within the block, calls that pass no ``backend=`` use ``name`` (the SDPA drop-in
    and the transformers backend have no backend argument of their own)."""
    global _default_backend
    if name is not None and not isinstance(name, str):
        raise TypeError(f"use_backend: expected a backend name or None, got {type(name).__name__}")
    old, _default_backend = _default_backend, name
    try:
        yield
    finally:
        _default_backend = old


def _bhsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    return x if layout == "bhsd" else x.transpose(1, 2)


def _check_tensor(name: str, x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}; for NumPy "
                        "arrays use anyattn.attention")


def _offset(name: str, val) -> int:
    """An integer offset as a Python int (np.int64 and other integers accepted)."""
    if isinstance(val, bool):
        raise TypeError(f"{name}: expected an int, got bool")
    try:
        return operator.index(val)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(val).__name__}") from None


#: seeds drawn from a torch generator lie in [0, 2**63) (an int64 tensor carries them)
_SEED_HIGH = 2 ** 63 - 1


def _dropout_seed(dropout_p, generator, dropout_seed) -> Optional[torch.Tensor]:
    """-> a one-element int64 CPU tensor holding the seed, or None without dropout."""
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator: expected a torch.Generator or None, got "
                            f"{type(generator).__name__}")
        if dropout_seed is not None:
            raise ValueError("generator, dropout_seed: pass one of them (dropout_seed fixes "
                             "the seed, generator draws it), not both")
    if dropout_seed is None and type(dropout_p) is float and dropout_p == 0.0:
        return None        # what check_dropout answers for these, without the call
    from ..dropout import check_dropout

    p, seed = check_dropout(dropout_p, dropout_seed, need_seed=False)
    if p == 0.0:
        return None
    if seed is None and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise NotImplementedError(
            "dropout_p > 0 without dropout_seed under CUDA graph capture: the seed drawn "
            "now would be baked into the graph, so every replay would drop the same "
            "entries; pass dropout_seed=... (an int you vary by re-capturing), or run "
            "the call outside the graph")
    if seed is not None:
        if seed > _SEED_HIGH:
            raise ValueError(f"dropout_seed: {seed} >= 2**63; anyattn.torch carries seeds in "
                             "int64 (the core API takes any seed in [0, 2**64))")
        return torch.tensor([seed], dtype=torch.int64)
    dev = "cpu" if generator is None else generator.device
    return torch.randint(0, _SEED_HIGH, (1,), generator=generator, dtype=torch.int64,
                         device=dev).cpu()


def _needs_precheck(q, k, v, bias, softcap=None, alibi_slopes=None, sinks=None) -> bool:
    """True when the op could not validate the call itself (or would do so too late).

    The op runs the core API, which validates everything before any work with the
    same messages; the wrapper re-checks up front only where that is not enough
    (besides inputs that are not 4-D, checked first): tensors on different or
    meta devices (the dispatcher would pick one device's kernel, or the fake one),
    a bias that asks for its gradient (a backend without dbias must refuse now,
    not in ``loss.backward()``), and any score modifier (a backend that lacks it, or
    dsinks, must refuse now too).  Skipping the full check elsewhere saves Python work
    on every call (bench/torch_module_bench.py times it).
    """
    dev = q.device
    if dev.type == "meta":
        return True
    if k.device != dev or v.device != dev:
        return True
    if softcap is not None or alibi_slopes is not None or sinks is not None:
        return True                      # checked in full before any work
    return bias is not None and (bias.device != dev or bias.requires_grad)


def _refuse_trainable_slopes():
    raise ValueError("alibi_slopes: requires grad, but ALiBi slopes are not trainable "
                     "here (no gradient is computed for them); pass alibi_slopes.detach()")


def _validate_eagerly(q, k, v, mask, bias, scale, backend, precision, q_offset, k_offset,
                      softcap=None, alibi_slopes=None, sinks=None):
    """Every check of the core, with the gradients the backward will need."""
    wrt = None
    if torch.is_grad_enabled():
        wrt = [n for n, x in (("q", q), ("k", k), ("v", v), ("bias", bias), ("sinks", sinks))
               if x is not None and x.requires_grad] or None
    if alibi_slopes is not None and isinstance(alibi_slopes, torch.Tensor) \
            and alibi_slopes.requires_grad:
        _refuse_trainable_slopes()
    p = describe(q, k, v, mask=mask, bias=bias, scale=scale, precision=precision, wrt=wrt,
                 q_offset=q_offset, k_offset=k_offset, softcap=softcap,
                 alibi_slopes=alibi_slopes, sinks=sinks)
    choose(p, backend)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask=None,
              bias: Optional[torch.Tensor] = None, scale: Optional[float] = None,
              backend: Optional[str] = None, precision: Optional[str] = None,
              layout: str = "bhsd", q_offset: int = 0, k_offset: int = 0,
              return_lse: bool = False, softcap: Optional[float] = None,
              alibi_slopes: Optional[torch.Tensor] = None,
              sinks: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
              generator: Optional[torch.Generator] = None,
              dropout_seed: Optional[int] = None, score_mod=None):
    """Scaled dot-product attention on torch tensors, differentiable in q, k, v, bias
    and sinks.

    q [B, Hq, Sq, D], k [B, Hkv, Sk, D], v [B, Hkv, Sk, Dv] (Hq a multiple of Hkv;
    Dv may differ from D) -> out [B, Hq, Sq, Dv] in q's dtype; with ``return_lse=True``
    also lse [B, Hq, Sq]
    (float32; not differentiable).  ``mask``: Causal / Window / KeepMask /
    Documents composed with ``&``; ``bias``: additive, broadcastable to
    [B, Hq, Sq, Sk] (a -inf entry excludes that key).  A query that keeps no
    key gets out = 0 and zero gradients.  ``backend``: None picks ``numpy`` for
    CPU tensors and ``triton`` for CUDA tensors.  Works under
    ``torch.compile(fullgraph=True)``.

    Score modifiers (see :mod:`anyattn.modifiers`): ``softcap`` c > 0 (scores
    ``c·tanh(s / c)``), ``alibi_slopes`` [Hq] or [B, Hq] (not trainable), ``sinks`` [Hq]
    (trainable: a learnable term ``exp(sinks[h])`` in every softmax denominator).

    Dropout: ``dropout_p`` in [0, 1) drops with ``anyattn.dropout_mask`` (the same mask
    on every backend and device for one seed).  The seed is drawn from ``generator``
    (default: torch's CPU default generator, so ``torch.manual_seed`` reproduces a run)
    once per call and saved for the backward; ``dropout_seed`` (an int) fixes it instead.

    ``score_mod`` and mask functions (``MaskMod``, ``|`` of mask terms; see
    docs/programmable.md): CPU tensors, outside ``torch.compile``, through the core's
    backends; captured tensors that require grad get their gradients by autograd.
    """
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x)
    for name, x in (("bias", bias), ("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if x is not None:
            _check_tensor(name, x)
    arguments.check_layout(layout)
    arguments.check_flag("return_lse", return_lse)
    if backend is None:
        backend = _default_backend
    for name, val in (("backend", backend), ("precision", precision)):
        if val is not None and not isinstance(val, str):
            raise TypeError(f"{name}: expected a name (str) or None, got {type(val).__name__}")
    q_offset, k_offset = _offset("q_offset", q_offset), _offset("k_offset", k_offset)
    mods = (softcap, alibi_slopes, sinks)
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:  # raises, naming the argument
        _validate_eagerly(q, k, v, mask, bias, scale, backend, precision, q_offset, k_offset,
                          *mods)
    if programs.uses_functions(mask, score_mod):
        seed_t = _dropout_seed(dropout_p, generator, dropout_seed)
        return programs.attention(
            q, k, v, mask=mask, bias=bias, scale=scale, backend=backend, precision=precision,
            layout=layout, q_offset=q_offset, k_offset=k_offset, return_lse=return_lse,
            softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
            dropout_p=float(dropout_p) if seed_t is not None else 0.0,
            dropout_seed=ops.seed_value(seed_t), score_mod=score_mod)
    qb, kb, vb = _bhsd(q, layout), _bhsd(k, layout), _bhsd(v, layout)
    direct = eager.eligible(qb, kb, vb, bias, alibi_slopes, sinks)
    if qb.shape[-1] == 0 or (not direct and not torch.compiler.is_compiling()
                             and _needs_precheck(qb, kb, vb, bias, *mods)):
        # head_dim 0 raises here (the default scale 1/sqrt(D) below would divide by 0)
        _validate_eagerly(qb, kb, vb, mask, bias, scale, backend, precision, q_offset, k_offset,
                          *mods)
    B, Hq, Sq, D = qb.shape
    Sk = kb.shape[2]
    # the band before the offsets: the op hands them to the core, which shifts the band
    # and positions ALiBi with them
    band_lo, band_hi, q_ids, k_ids, keep = lower(mask, B, Hq, Sq, Sk, 0, 0,
                                                 device=qb.device)
    for term, t in (("KeepMask", keep), ("Documents", q_ids), ("Documents", k_ids)):
        # document ids may also stay on the host (docs/torch.md, packed sequences)
        if t is not None and t.device != qb.device and not (
                term == "Documents" and t.device.type == "cpu"):
            raise ValueError(f"mask: the {term} tensor is on {t.device} but q is on "
                             f"{qb.device}; move it with .to(q.device)"
                             + (" (document ids may also stay on the CPU)"
                                if term == "Documents" else ""))
    if scale is None:
        scale = D ** -0.5
    try:
        if isinstance(scale, (str, bytes, bool, np.bool_)):
            raise TypeError
        scale = float(scale)
    except (TypeError, ValueError):
        raise TypeError(f"scale: expected a float (default 1/sqrt(D)), got "
                        f"{type(scale).__name__}") from None
    if softcap is not None and (isinstance(softcap, bool)
                                or not isinstance(softcap, numbers.Real)):
        raise TypeError(f"softcap: expected a positive float or None, got "
                        f"{type(softcap).__name__}")
    if direct and isinstance(alibi_slopes, torch.Tensor) and alibi_slopes.requires_grad:
        _refuse_trainable_slopes()
    seed_t = _dropout_seed(dropout_p, generator, dropout_seed)
    if direct:   # the core itself validates everything, once (anyattn.torch.eager)
        out, row_max, log_norm = eager.attention(
            qb, kb, vb, bias, keep, q_ids, k_ids, band_lo, band_hi, scale, backend,
            precision, q_offset, k_offset, None if softcap is None else float(softcap),
            alibi_slopes, sinks, float(dropout_p) if seed_t is not None else 0.0,
            ops.seed_value(seed_t))
        out = _bhsd(out, layout)
        return (out, row_max + log_norm) if return_lse else out
    args = (qb, kb, vb, bias, keep, q_ids, k_ids, band_lo, band_hi, scale, backend, precision)
    if q_offset or k_offset or softcap is not None or alibi_slopes is not None \
            or sinks is not None or seed_t is not None:
        args += (q_offset, k_offset, None if softcap is None else float(softcap),
                 alibi_slopes, sinks)
    if seed_t is not None:
        args += (float(dropout_p), seed_t)
    out, row_max, log_norm = ops.attention_with_grad(*args)
    out = _bhsd(out, layout)
    return (out, row_max + log_norm) if return_lse else out
