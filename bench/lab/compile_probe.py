"""Compile the Triton kernels for a GPU target offline (no GPU needed) and report what
the compiler made of them: registers, spills, shared memory, and which tensor-core
instructions the dots became (wgmma = Hopper warp-group MMA, mma.sync = the older
warp MMA).  A cheap check before spending GPU time on a variant.

    python bench/lab/compile_probe.py --kernel dkdv --dtype float32 --prec bf16x6 \
        --bm 32 --bn 64 --warps 4 --stages 2 [--d 128] [--arch 90] [--dump DIR]
"""
from __future__ import annotations

import argparse
import inspect
import json
import os
import re
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))

_FLOAT_PTRS = {"Q", "K", "V", "DO", "O", "DK", "DV", "DQ", "BIAS", "DB"}
_F32_PTRS = {"L2", "DELTA", "LSE", "SC"}
_F32_SCALARS = {"qk_scale", "scale"}
_INT_SCALARS = {"B", "H", "HKV", "G", "HB", "NKV_TILES", "NQ_TILES", "NJ_OUT"}
_TT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def _signature(fn, dtype: str, constexprs: dict):
    """(signature, attrs) for triton.compiler.ASTSource from the kernel's argument names."""
    sig, attrs = {}, {}
    names = list(inspect.signature(fn.fn if hasattr(fn, "fn") else fn).parameters)
    for i, n in enumerate(names):
        if n in constexprs:
            sig[n] = "constexpr"
        elif n in _FLOAT_PTRS:
            sig[n] = "*" + _TT[dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif n in _F32_PTRS:
            sig[n] = "*fp32"
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif n == "KM":
            sig[n] = "*i8"
        elif n.isupper() and n not in _INT_SCALARS:
            sig[n] = "*i32"
        elif n in _F32_SCALARS:
            sig[n] = "fp32"
        else:
            sig[n] = "i32"
            if re.fullmatch(r"s[a-z0-9]*_[bhs]", n):      # batch / head / row strides
                attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, attrs


def _ptxas_usage(ptx: str, arch: int):
    """(registers, spill store bytes, spill load bytes) from ptxas -v on the PTX."""
    import subprocess
    import tempfile

    import triton

    exe = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    sm = f"sm_{arch}a" if arch >= 90 else f"sm_{arch}"
    with tempfile.TemporaryDirectory() as tmp:
        f = os.path.join(tmp, "k.ptx")
        with open(f, "w") as fh:
            fh.write(ptx)
        r = subprocess.run([exe, "-v", f"-arch={sm}", f, "-o", os.path.join(tmp, "k.cubin")],
                           capture_output=True, text=True)
    log = r.stdout + r.stderr
    regs = re.search(r"Used (\d+) registers", log)
    sp = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    return (int(regs.group(1)) if regs else -1,
            int(sp.group(1)) if sp else -1, int(sp.group(2)) if sp else -1)


def probe(kernel: str, dtype: str, prec: str, d: int, bm: int, bn: int, warps: int,
          stages: int, arch: int = 90, bm2: int = 0, bn2: int = 0, mode: int = 0,
          bias: bool = False, dump: str = "") -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from anyattn.backends.triton import configs as C
    from anyattn.backends.triton import kernels as K

    fn = {"fwd": K.fwd_kernel, "dkdv": K.dkdv_kernel, "dq": K.dq_kernel,
          "bwd": K.bwd_kernel}[kernel]
    dp = C.padded_dim(d)
    ce = dict(D=d, DP=dp, BM=bm, BN=bn, SBQ=128, SBK=128, MODE=mode, HAS_BAND=False,
              HAS_DOCS=False, HAS_KEEP=False, HAS_BIAS=bias, PREC=prec)
    names = inspect.signature(fn.fn).parameters
    if "WRITE_DB" in names:
        ce["WRITE_DB"] = False
    if "BM2" in names:
        ce["BM2"], ce["BN2"] = bm2 or bm, bn2 or bn
    ce = {k: v for k, v in ce.items() if k in names}
    sig, attrs = _signature(fn, dtype, ce)
    src = ASTSource(fn=fn, signature=sig, constexprs=ce, attrs=attrs)
    c = triton.compile(src, target=GPUTarget("cuda", arch, 32),
                       options={"num_warps": warps, "num_stages": stages})
    ptx = c.asm["ptx"]
    ttgir = c.asm["ttgir"]
    if dump:
        os.makedirs(dump, exist_ok=True)
        for k in ("ttgir", "ptx"):
            with open(os.path.join(dump, f"{kernel}.{k}"), "w") as f:
                f.write(c.asm[k])
    regs, spill_st, spill_ld = _ptxas_usage(ptx, arch)
    return dict(kernel=kernel, dtype=dtype, prec=prec, d=d, bm=bm, bn=bn, warps=warps,
                stages=stages, regs=regs, spill_stores=spill_st, spill_loads=spill_ld,
                shared=c.metadata.shared,
                wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
                mma_sync=len(re.findall(r"\bmma\.sync", ptx)),
                local_alloc=ttgir.count("ttg.local_alloc"),
                async_copy=ttgir.count("ttg.async_copy_global_to_local"))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernel", default="dkdv", choices=["fwd", "dkdv", "dq", "bwd"])
    ap.add_argument("--dtype", default="float32", choices=list(_TT))
    ap.add_argument("--prec", default="bf16x6")
    ap.add_argument("--d", type=int, default=128)
    ap.add_argument("--bm", type=int, default=64)
    ap.add_argument("--bn", type=int, default=64)
    ap.add_argument("--bm2", type=int, default=0)
    ap.add_argument("--bn2", type=int, default=0)
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--stages", type=int, default=2)
    ap.add_argument("--mode", type=int, default=0)
    ap.add_argument("--bias", action="store_true")
    ap.add_argument("--arch", type=int, default=90)
    ap.add_argument("--dump", default="")
    a = ap.parse_args(argv)
    print(json.dumps(probe(a.kernel, a.dtype, a.prec, a.d, a.bm, a.bn, a.warps, a.stages,
                           a.arch, a.bm2, a.bn2, a.mode, a.bias, a.dump)))


if __name__ == "__main__":
    main()
