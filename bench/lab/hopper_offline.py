"""Compile the routed Hopper kernels for sm_90a without a GPU and count their Hopper-only
instructions (PTX: wgmma / cp.async.bulk.tensor / mbarrier / setmaxnreg; SASS through
the cuobjdump Triton ships: HGMMA / UTMALDG / UTMASTG / SYNCS / STL / LDL).

Shape legend: D head dim.  Host tensors stand in for device ones: a descriptor's
signature needs only shape, strides and dtype.  The compiles are sass_hashes.py's (the
same signatures); the CPU tests and the GPU bench read the counts.
"""
from __future__ import annotations

import os
import re
import sys
from typing import Dict

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from sass_hashes import SM90A, _compile_bwd, _compile_fwd, cuobjdump, sass_of  # noqa: E402

__all__ = ["SM90A", "compile_fwd", "compile_bwd", "instruction_counts", "sass_of",
           "ws_facts"]

_PTX_PATTERNS = {"wgmma": r"wgmma\.mma_async",
                 "tma_load": r"cp\.async\.bulk\.tensor\.\dd\.shared",
                 "tma_store": r"cp\.async\.bulk\.tensor\.\dd\.global\.shared",
                 "mbarrier_wait": r"mbarrier\.try_wait",
                 "setmaxnreg": r"setmaxnreg\.(?:inc|dec)"}
_SASS_PATTERNS = {"HGMMA": r"\bHGMMA\.", "UTMALDG": r"\bUTMALDG", "UTMASTG": r"\bUTMASTG",
                  "SYNCS": r"\bSYNCS\.", "HMMA": r"\bHMMA\.", "STL": r"\bSTL\b",
                  "LDL": r"\bLDL\b"}


def _mask_class(has_band, docs, keep):
    parts = [n for n, on in (("band", has_band), ("documents", bool(docs)), ("keep", keep))
             if on]
    return "+".join(parts) or "none"


def compile_fwd(dtype: str = "bfloat16", D: int = 128, has_band: bool = False, cfg=None,
                docs: int = 0, keep: bool = False):
    """The forward of ``cfg`` (default: the routed configs.fwd_config of that mask) for
    sm_90a -> CompiledKernel.  ``docs`` / ``keep``: the Documents (1 ids, 2 key
    intervals) / KeepMask specialisation."""
    from anyattn.backends.triton.hopper import configs as HC

    if cfg is None:
        cfg = HC.fwd_config(D, _mask_class(has_band, docs, keep))
    return _compile_fwd(cfg, dtype, D, has_band, docs, keep)


def compile_bwd(dtype: str = "bfloat16", D: int = 128, has_band: bool = False, cfg=None,
                docs: int = 0, keep: bool = False):
    """The backward kernel of ``cfg`` (default: the routed configs.bwd_config of that
    mask; a config without dq: the dK/dV kernel) for sm_90a -> CompiledKernel."""
    from anyattn.backends.triton.hopper import configs as HC

    if cfg is None:
        cfg = HC.bwd_config(D, _mask_class(has_band, docs, keep))
    return _compile_bwd(cfg, dtype, D, has_band, docs, keep)


def instruction_counts(compiled) -> Dict[str, int]:
    """Counts of the Hopper instructions in a compiled kernel's PTX and SASS, plus its
    registers / local / stack bytes and shared memory."""
    ptx = compiled.asm.get("ptx", "")
    out = {f"ptx_{k}": len(re.findall(p, ptx)) for k, p in _PTX_PATTERNS.items()}
    sass = sass_of(compiled.asm["cubin"])
    out.update({f"sass_{k}": len(re.findall(p, sass)) for k, p in _SASS_PATTERNS.items()})
    out["shared_bytes"] = int(getattr(compiled.metadata, "shared", 0))
    res = cuobjdump(compiled.asm["cubin"], "-res-usage")
    for key, name in (("REG", "registers"), ("LOCAL", "local_bytes"), ("STACK", "stack_bytes")):
        m = re.search(rf"\b{key}:(\d+)", res)
        if m:
            out[name] = int(m.group(1))
    return out


def ws_facts(compiled) -> Dict[str, object]:
    """instruction_counts plus WARPGROUP.DEPBAR / BAR counts, the setmaxnreg values (PTX)
    and the highest register number named in SASS (the consumers' real use: the
    metadata's count is the one at entry)."""
    out: Dict[str, object] = dict(instruction_counts(compiled))
    sass = sass_of(compiled.asm["cubin"])
    out["sass_DEPBAR"] = len(re.findall(r"WARPGROUP\.DEPBAR", sass))
    out["sass_BAR"] = len(re.findall(r"\bBAR\.(?:SYNC|ARV)", sass))
    regs = [int(r) for r in re.findall(r"\bR(\d+)\b", sass)]
    out["max_reg"] = max(regs) if regs else -1
    out["setmaxnreg"] = sorted(set(re.findall(
        r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32 (\d+)", compiled.asm.get("ptx", ""))))
    return out
