"""Offline sm_90a compile of the warp-specialised backward kernels (bwd_ws_kernel,
bwd_ws_dq_kernel), and the SASS facts the backward's notes quote: HGMMA / UTMALDG / STL /
LDL / WARPGROUP.DEPBAR counts, the highest register a region uses (after setmaxnreg),
the setmaxnreg values and ptxas's warnings.

Shape legend: D head dim.  Host tensors stand in for device ones (offline.py's rule).
``compile_any(cfg)`` dispatches on the config: ws -> here, the others -> offline.py.
"""
from __future__ import annotations

import re
from typing import Dict

from .offline import SM90A, compile_dkdv, instruction_counts, sass_of

__all__ = ["compile_dkdv_ws", "compile_dkdvq_ws", "compile_any", "ws_facts"]


def compile_dkdv_ws(dtype: str = "bfloat16", D: int = 128, has_band: bool = False, cfg=None):
    """triton.compile of bwd_ws_kernel.dkdv_ws_kernel for ``cfg`` (a ws HopperBwdConfig)
    for sm_90a -> CompiledKernel."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from .bwd_ws_kernel import dkdv_ws_kernel
    from .launch import make_desc

    if cfg is None or not cfg.ws:
        raise ValueError(f"compile_dkdv_ws needs a ws config, got {cfg}")
    x = torch.empty((2, 2, 256, D), dtype=getattr(torch, dtype))
    qd = mangle_type(make_desc(x, cfg.bm))
    kd = mangle_type(make_desc(x, cfg.bn // 2))
    names = ["q_desc", "k_desc", "v_desc", "do_desc", "dk_desc", "dv_desc", "L2", "DELTA",
             "H", "G", "Sq", "Sk", "scale", "lo", "hi", "HAS_BAND", "STAGES",
             "CONSUMER_REGS", "PINGPONG", "num_warps"]
    types = [qd, kd, kd, qd, kd, kd, "*fp32", "*fp32", "i32", "i32", "i32", "i32", "fp32",
             "i32", "i32"]
    vals = [has_band, cfg.stages, cfg.consumer_regs, cfg.pingpong, 4]
    sig = dict(zip(names, types + ["constexpr"] * len(vals)))
    consts = {(len(types) + i,): v for i, v in enumerate(vals)}
    src = GluonASTSource(dkdv_ws_kernel, sig, constexprs=consts)
    return triton.compile(src, target=GPUTarget(*SM90A), options=dict(num_warps=4))


def compile_dkdvq_ws(dtype: str = "bfloat16", D: int = 128, has_band: bool = False,
                     cfg=None, writer_regs: int = None):
    """triton.compile of bwd_ws_dq_kernel.dkdvq_ws_kernel (a ws config with dq; trans:
    bwd_ws_t_kernel.dkdvq_ws_t_kernel) for sm_90a -> CompiledKernel."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from .launch import WS_DQ_WRITER_REGS, _ws_dq_kernel, dqa_desc, make_desc

    if cfg is None or not (cfg.ws and cfg.dq):
        raise ValueError(f"compile_dkdvq_ws needs a ws config with dq, got {cfg}")
    x = torch.empty((2, 2, 256, D), dtype=getattr(torch, dtype))
    qd = mangle_type(make_desc(x, cfg.bm))
    kd = mangle_type(make_desc(x, cfg.bn // 2))
    ad = mangle_type(dqa_desc(torch.empty((4, 256, D), dtype=torch.float32), cfg.bm,
                              D // 2 if cfg.split else None, cfg.dq_swizzle,
                              cfg.dq_interleave))
    names = ["q_desc", "k_desc", "v_desc", "do_desc", "dk_desc", "dv_desc", "dqa_desc", "L2",
             "DELTA", "SEM", "NBH", "H", "G", "Sq", "Sk", "scale", "lo", "hi", "ORDER",
             "HAS_BAND", "STAGES", "CONSUMER_REGS", "WRITER_REGS", "PREFETCH", "CHAINS",
             "DIAG", "SPLIT", "LAG", "num_warps"]
    types = [qd, kd, kd, qd, kd, kd, ad, "*fp32", "*fp32", "*i32", "i32", "i32", "i32", "i32",
             "i32", "fp32", "i32", "i32", "i32"]
    vals = [has_band, cfg.stages, cfg.consumer_regs,
            WS_DQ_WRITER_REGS if writer_regs is None else writer_regs, cfg.prefetch,
            cfg.chains, False, cfg.split, cfg.lag, 4]
    sig = dict(zip(names, types + ["constexpr"] * len(vals)))
    consts = {(len(types) + i,): v for i, v in enumerate(vals)}
    fn = _ws_dq_kernel(cfg)
    extra = {"STATS": cfg.stats, "DQ_FIRST": cfg.dq_first, "DQ_IL": cfg.dq_interleave,
             "LATE": cfg.late_release}
    if any(extra.values()):   # constexprs further down the parameter list: the ones
        # before them at their defaults (None / False / 0, as a launch without ARRAY
        # passes them)
        last = max(fn.arg_names.index(n) for n, v in extra.items() if v)
        for i in range(len(names), last + 1):
            sig[fn.arg_names[i]] = "constexpr"
            consts[(i,)] = extra.get(fn.arg_names[i], fn.params[i].default)
    src = GluonASTSource(fn, sig, constexprs=consts)
    return triton.compile(src, target=GPUTarget(*SM90A), options=dict(num_warps=4))


def compile_any(cfg, dtype: str = "bfloat16", D: int = 128, has_band: bool = False):
    """The backward kernel of any HopperBwdConfig, compiled for sm_90a."""
    if cfg.ws and cfg.dq:
        return compile_dkdvq_ws(dtype, D, has_band, cfg)
    if cfg.ws:
        return compile_dkdv_ws(dtype, D, has_band, cfg)
    return compile_dkdv(dtype, D, has_band, cfg)


def ws_facts(compiled) -> Dict[str, object]:
    """instruction_counts plus WARPGROUP.DEPBAR / BAR.SYNC counts, the setmaxnreg values
    (PTX) and the highest register number named in SASS (the consumers' real use: the
    metadata's count is the one at entry)."""
    out: Dict[str, object] = dict(instruction_counts(compiled))
    sass = sass_of(compiled.asm["cubin"]) if "cubin" in compiled.asm else ""
    out["sass_DEPBAR"] = len(re.findall(r"WARPGROUP\.DEPBAR", sass))
    out["sass_BAR"] = len(re.findall(r"\bBAR\.(?:SYNC|ARV)", sass))
    regs = [int(r) for r in re.findall(r"\bR(\d+)\b", sass)]
    out["max_reg"] = max(regs) if regs else -1
    out["setmaxnreg"] = sorted(set(re.findall(r"setmaxnreg\.(?:inc|dec)\.sync\.aligned\.u32 (\d+)",
                                              compiled.asm.get("ptx", ""))))
    return out
