"""TritonBackend: the contract on torch CUDA tensors through Triton kernels.

Shape legend: B batch, Hq/Hkv heads, Sq/Sk queries/keys, D head dim of q and k, Dv of v
(each 1..256 for every kernel, up to 1024 for the forward of decoding shapes: see
head_dims.py; Dv != D is the opt-in input ``value_dim``, on the portable kernels
only).  torch and triton are imported lazily, so ``import anyattn`` never needs them.
"""
from __future__ import annotations

from typing import List, Optional

from ...features import BUILTIN_MODIFIERS, DEFAULT_INPUTS, FUNCTION_MODIFIERS, GRADIENTS
from ... import settings
from ..base import Backend, Capabilities
# PAGED_MAX_SQ: read from here by anyattn.flash_attn
from .head_dims import MAX_HEAD_DIM, PAGED_MAX_SQ, WIDE_MAX_HEAD_DIM, wide_refusal  # noqa: F401

__all__ = ["TritonBackend"]


def _interpreting() -> bool:
    return settings.current().triton_interpret


class TritonBackend(Backend):
    """Forward with the row statistics (max, log_norm), backward as delta + dK/dV + dQ
    kernels (no atomics), every mask with block-sparse skipping, bias with dbias, GQA,
    fp16/bf16/fp32 (+ tf32 opt-in), the score modifiers softcap / ALiBi / sinks (+ dsinks)
    and attention dropout (anyattn.dropout's mask, regenerated in every kernel) inside the
    kernels, score / mask functions, and the gradients of score-function captures read
    at indices of b, h and one of q_idx - kv_idx, q_idx or kv_idx (capture_grads.py)."""

    name = "triton"

    def __init__(self):
        self._why: Optional[str] = None
        self._checked = False
        devices = {"cuda", "cpu"} if _interpreting() else {"cuda"}
        self.capabilities = Capabilities(
            array_kinds=frozenset({"torch"}), device_types=frozenset(devices),
            dtypes=frozenset({"float16", "bfloat16", "float32"}),
            precisions=frozenset({"highest", "tf32"}), max_head_dim=WIDE_MAX_HEAD_DIM,
            mask_terms=frozenset({"band", "documents", "keep", "mask_mod"}),
            modifiers=BUILTIN_MODIFIERS | FUNCTION_MODIFIERS,
            inputs=DEFAULT_INPUTS | {"value_dim", "paged_kv"},
            # capture gradients: for captures indexed by b, h and one of q_idx - kv_idx,
            # q_idx or kv_idx (capture_grads.py; the others are refused by extra_reasons)
            gradients=GRADIENTS)

    # -- availability ---------------------------------------------------------------
    def availability(self) -> Optional[str]:
        """The full check (imports torch and triton); ``anyattn.backends.triton.probe``
        is the one that imports nothing."""
        if self._checked:
            return self._why
        self._checked = True
        from ...extras import import_error
        from . import NO_DEVICE

        try:
            import torch
        except ImportError as e:
            self._why = str(import_error("torch", "triton", e))
            return self._why
        try:
            import triton  # noqa: F401
        except ImportError as e:
            self._why = str(import_error("triton", "triton", e))
            return self._why
        if not _interpreting() and not torch.cuda.is_available():
            self._why = f"no CUDA device (torch.cuda.is_available() is False) and {NO_DEVICE}"
            return self._why
        self._why = None
        return None

    def auto_eligible(self) -> bool:
        """The interpreter is for tests: automatic dispatch never picks it for CPU tensors."""
        return not _interpreting()

    def describe_device(self) -> str:
        import torch

        if _interpreting():
            return "Triton interpreter (TRITON_INTERPRET=1) on CPU tensors"
        return f"CUDA {torch.cuda.get_device_name()}"

    def extra_reasons(self, p) -> List[str]:
        why = []
        if p.bias_dtype is not None and p.bias_dtype not in ("float16", "bfloat16", "float32"):
            why.append(f"takes a float16/bfloat16/float32 bias, got {p.bias_dtype}")
        if ("bias" in p.wrt and (p.score_mod is not None or p.mask.mask_fns)
                and p.bias_shape is not None
                and tuple(p.bias_shape[2:]) != (p.seq_q, p.seq_k)):
            why.append("computes dbias with score / mask functions only for a bias full "
                       "over queries and keys ([.., Sq, Sk]); expand the bias or use "
                       "backend='numpy'")
        if p.capture_wrt and p.score_mod is not None:
            from .capture_grads import refusal

            bad = refusal(p.score_mod.program, p.capture_wrt)
            if bad:
                why.append(f"{bad}; index each read by one of those, or use backend='numpy'")
        if p.pages is not None and p.seq_q > PAGED_MAX_SQ:
            why.append(f"reads a paged cache (pages=) with at most {PAGED_MAX_SQ} queries "
                       f"per sequence (the split-key decode kernel), got Sq = {p.seq_q}; "
                       f"split the queries into chunks of <= {PAGED_MAX_SQ} or use "
                       "backend='numpy'")
        wide = wide_refusal(p.head_dim, p.head_dim_v, p.seq_q, bool(p.wrt), p.mask_class,
                            p.features)
        if wide is not None:
            why.append(wide)
        dev_type = p.device.split(":")[0]
        if dev_type == "cpu" and not _interpreting():
            why.append("needs CUDA tensors (CPU tensors only under TRITON_INTERPRET=1); "
                       "move the inputs with .cuda()")
        return why

    # -- work -------------------------------------------------------------------------
    def forward(self, p, q, k, v, bias, mods):
        from . import launch

        return launch.forward(p, q, k, v, bias, mods=mods)

    def forward_paged(self, p, q, k_pages, v_pages, mods):
        """The forward over a paged cache (anyattn.paged): the split-key kernel reading
        every key row through the block table (forward.forward_paged)."""
        from .forward import forward_paged

        return forward_paged(p, q, k_pages, v_pages, mods)

    def backward(self, p, q, k, v, dout, out, stats, bias, mods):
        from . import launch

        return launch.backward(p, q, k, v, dout, out, stats, bias, mods=mods)
