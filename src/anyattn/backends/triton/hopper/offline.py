"""Compile the Hopper kernels for sm_90a without a GPU and count their Hopper-only
instructions (PTX: wgmma / cp.async.bulk.tensor / mbarrier; SASS via the cuobjdump that
Triton ships: HGMMA / UTMALDG / UTMASTG / SYNCS).

Shape legend: D head dim, BM / BN query / key tile.  Used by the CPU test (the kernels
compile and use the instructions they were written for) and by the GPU bench (the
counts beside the timings).  Host tensors stand in for device ones: a descriptor's
signature needs only shape, strides and dtype.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile
from typing import Dict

__all__ = ["compile_fwd", "compile_dkdv", "instruction_counts", "sass_of"]

SM90A = ("cuda", 90, 32)

_PTX_PATTERNS = {"wgmma": r"wgmma\.mma_async", "tma_load": r"cp\.async\.bulk\.tensor\.\dd\.shared",
                 "tma_store": r"cp\.async\.bulk\.tensor\.\dd\.global\.shared",
                 "mbarrier_wait": r"mbarrier\.try_wait"}
_PTX_PATTERNS["setmaxnreg"] = r"setmaxnreg\.(?:inc|dec)"
_SASS_PATTERNS = {"HGMMA": r"\bHGMMA\.", "UTMALDG": r"\bUTMALDG", "UTMASTG": r"\bUTMASTG",
                  "SYNCS": r"\bSYNCS\.", "HMMA": r"\bHMMA\.", "STL": r"\bSTL\b", "LDL": r"\bLDL\b"}


def compile_fwd(dtype: str = "bfloat16", D: int = 128, has_band: bool = False,
                cfg=None, docs: int = 0, keep: bool = False):
    """triton.compile of the forward kernel of ``cfg`` (fwd_kernel, fwd_ws_kernel when
    cfg.ws, fwd_persist_kernel when cfg.persist) for sm_90a -> CompiledKernel (asm: ptx,
    cubin).  ``docs`` / ``keep``: the warp-specialised kernel's Documents (1 ids, 2 key
    intervals) / KeepMask path (ARRAY).  ``cfg`` None: the routed config of that mask
    (configs.fwd_config of its mask class, as Problem.mask_class names it)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from . import configs as HC
    from .fwd_kernel import fwd_kernel
    from .launch import make_desc

    if cfg is None:
        parts = [n for n, on in (("band", has_band), ("documents", bool(docs)),
                                 ("keep", keep)) if on]
        cfg = HC.fwd_config(D, dtype, "+".join(parts) or "none")
    tdt = getattr(torch, dtype)
    x = torch.empty((2, 2, 256, D), dtype=tdt)
    qd = make_desc(x, cfg.bm // cfg.consumers if cfg.ws else cfg.bm)
    kd = make_desc(x, cfg.bn)
    arr = ["RT", "rt_b", "rt_h", "QID", "KID", "sqid_b", "skid_b", "KM", "skm_b", "skm_h",
           "skm_q", "skm_k"] if cfg.ws else []
    if (docs or keep) and not cfg.ws:
        raise ValueError(f"{cfg.name}: Documents / KeepMask run on the warp-specialised "
                         "forward only")
    names = ["q_desc", "k_desc", "v_desc", "o_desc", "LSE", "H", "G", "Sq", "Sk",
             "qk_scale", "scale", "lo", "hi"] + arr + ["HAS_BAND", "STAGES"]
    names += ["CONSUMER_REGS", "OVERLAP", "PINGPONG", "EXP_FMA"] if cfg.ws else ["OVERLAP"]
    names += ["num_warps"] + (["NC", "EDGES", "PSMEM", "ARRAY", "DOCS", "HAS_KEEP"]
                              if cfg.ws else [])
    types = [mangle_type(qd), mangle_type(kd), mangle_type(kd), mangle_type(qd), "*fp32",
             "i32", "i32", "i32", "i32", "fp32", "fp32", "i32", "i32"]
    if cfg.ws:
        types += ["*i32", "i32", "i32", "*i32", "*i32", "i32", "i32", "*u8", "i32", "i32",
                  "i32", "i32"]
    sig = dict(zip(names, types + ["constexpr"] * (len(names) - len(types))))
    warps = 4 if cfg.ws else cfg.num_warps
    vals = [has_band, cfg.stages]
    vals += ([cfg.consumer_regs, cfg.overlap, cfg.pingpong, cfg.exp_fma] if cfg.ws
             else [cfg.overlap])
    vals += [warps] + ([cfg.consumers, cfg.edges, cfg.p_smem, bool(docs or keep), int(docs), keep]
                       if cfg.ws else [])
    consts = {(len(types) + i,): x for i, x in enumerate(vals)}
    if cfg.persist:   # fwd_persist_kernel: + BH, SCH, no OVERLAP / EDGES / PSMEM
        from .fwd_persist_kernel import fwd_persist_kernel as kern

        names = names[:len(types)] + ["BH", "SCH", "HAS_BAND", "STAGES", "CONSUMER_REGS",
                                      "PINGPONG", "EXP_FMA", "num_warps", "ARRAY", "DOCS",
                                      "HAS_KEEP", "SCHED", "NC", "XOVER"]
        types = types + ["i32", "*i32"]
        if cfg.sched and (docs or keep):
            raise ValueError(f"{cfg.name}: the host-built schedule takes band masks only")
        # launch.FwdLaunch's rule: without a band the schedule is the kernel's own walk
        vals = [has_band, cfg.stages, cfg.consumer_regs, cfg.pingpong, cfg.exp_fma, warps,
                bool(docs or keep), int(docs), keep, cfg.sched and has_band, cfg.consumers,
                cfg.xover]
        sig = dict(zip(names, types + ["constexpr"] * (len(names) - len(types))))
        consts = {(len(types) + i,): x for i, x in enumerate(vals)}
    elif cfg.ws:
        from .fwd_ws_kernel import fwd_ws_kernel as kern
    else:
        kern = fwd_kernel
    src = GluonASTSource(kern, sig, constexprs=consts)
    return triton.compile(src, target=GPUTarget(*SM90A), options=dict(num_warps=warps))


def compile_dkdv(dtype: str = "bfloat16", D: int = 128, has_band: bool = False, cfg=None):
    """triton.compile of the backward kernel of ``cfg`` (bwd_kernel.dkdv_kernel, or
    bwd_fused_kernel.dkdvq_kernel when cfg.fused) for sm_90a -> CompiledKernel."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    from . import configs as HC
    from .bwd_kernel import dkdv_kernel
    from .launch import make_desc

    cfg = cfg or HC.dkdv_config(D)
    if cfg.ws:
        raise ValueError(f"{cfg.name}: a warp-specialised config; bwd_offline.compile_any "
                         "compiles those")
    tdt = getattr(torch, dtype)
    x = torch.empty((2, 2, 256, D), dtype=tdt)
    qd = mangle_type(make_desc(x, cfg.bm))
    pdt = {"bfloat16": "*bf16", "float16": "*fp16"}[dtype]
    if cfg.fused:
        from .bwd_fused_kernel import dkdvq_kernel
        from .launch import dqa_desc

        kd = mangle_type(make_desc(x, cfg.bn))
        ad = mangle_type(dqa_desc(torch.empty((4, 256, D), dtype=torch.float32), cfg.bm))
        names = ["q_desc", "k_desc", "v_desc", "do_desc", "dk_desc", "dv_desc", "dqa_desc",
                 "L2", "DELTA", "DQ", "DQA", "SEM", "H", "G", "Sq", "Sk", "scale", "lo", "hi",
                 "ORDER", "HAS_BAND", "WITH_DQ", "STAGES", "DEFER", "num_warps"]
        types = [qd, kd, kd, qd, kd, kd, ad, "*fp32", "*fp32", pdt, "*fp32", "*i32", "i32",
                 "i32", "i32", "i32", "fp32", "i32", "i32", "i32"] + ["constexpr"] * 5
        consts = {(20,): has_band, (21,): cfg.dq, (22,): cfg.stages, (23,): cfg.defer,
                  (24,): 8}
        src = GluonASTSource(dkdvq_kernel, dict(zip(names, types)), constexprs=consts)
        return triton.compile(src, target=GPUTarget(*SM90A), options=dict(num_warps=8))
    kd = mangle_type(make_desc(x, cfg.bn))
    names = ["q_desc", "k_desc", "v_desc", "do_desc", "dk_desc", "dv_desc", "L2", "DELTA",
             "H", "G", "Sq", "Sk", "scale", "lo", "hi", "HAS_BAND", "STAGES", "num_warps"]
    sig = dict(zip(names, [qd, kd, kd, qd, kd, kd, "*fp32", "*fp32", "i32", "i32", "i32",
                           "i32", "fp32", "i32", "i32", "constexpr", "constexpr",
                           "constexpr"]))
    consts = {(15,): has_band, (16,): cfg.stages, (17,): cfg.num_warps}
    src = GluonASTSource(dkdv_kernel, sig, constexprs=consts)
    return triton.compile(src, target=GPUTarget(*SM90A), options=dict(num_warps=cfg.num_warps))


def _cuobjdump(cubin: bytes, flag: str) -> str:
    """cuobjdump <flag> of a cubin through Triton's bundled tool ('' if it is missing)."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    if not os.path.exists(tool):
        return ""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        return subprocess.run([tool, flag, path], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(path)


def sass_of(cubin: bytes) -> str:
    """SASS text of a cubin ('' where Triton ships no cuobjdump)."""
    return _cuobjdump(cubin, "-sass")


def instruction_counts(compiled) -> Dict[str, int]:
    """Counts of the Hopper instructions in a compiled kernel's PTX and SASS, plus its
    registers / spills / shared memory where the metadata has them."""
    ptx = compiled.asm.get("ptx", "")
    out = {f"ptx_{k}": len(re.findall(p, ptx)) for k, p in _PTX_PATTERNS.items()}
    sass = sass_of(compiled.asm["cubin"]) if "cubin" in compiled.asm else ""
    out.update({f"sass_{k}": len(re.findall(p, sass)) for k, p in _SASS_PATTERNS.items()})
    out["shared_bytes"] = int(getattr(compiled.metadata, "shared", 0))
    res = _cuobjdump(compiled.asm["cubin"], "-res-usage") if "cubin" in compiled.asm else ""
    for key, name in (("REG", "registers"), ("LOCAL", "local_bytes"), ("STACK", "stack_bytes")):
        m = re.search(rf"\b{key}:(\d+)", res)
        if m:
            out[name] = int(m.group(1))
    return out
