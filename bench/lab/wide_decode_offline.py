"""Compile the split-key forward of head dims above 256 (kernels.fwd_split_kernel with
DC / DVC: MLA decoding, D = 576 / Dv = 512) for sm_90a offline (no GPU needed) and
report what ptxas made of each launch: registers, spill bytes, shared memory, the MMA
instructions (wgmma / mma.sync) and the SASS's local-memory traffic (STL / LDL).

The launches are those of the tree's launch code (forward.py, route.py,
configs.wide_decode_config), recorded as bench/lab/portable_hashes.py records them
(CPU tensors, every kernel replaced by a recorder): B = 4, Hq = 16 over one kv head,
a 4k cache, Sq 1 and 4, bf16 and fp32, contiguous and paged (64-position pages).
``--sweep`` compiles the split kernel of the contiguous Sq 1 / Sq 4 launches over other
tiles too (rows BM, key tile BN, value chunk DVC, warps, stages), the evidence behind
wide_decode_config's choice.

    PYTHONPATH=src python3 bench/lab/wide_decode_offline.py [--sweep] [--out FILE.json]

Must run without TRITON_INTERPRET (the kernels must be jit functions).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import portable_hashes as PH  # noqa: E402

SHAPE = dict(B=4, Hq=16, Hkv=1, Sk=4096, D=576, Dv=512)
#: (BM, BN, DVC, warps, stages) of the sweep, per dtype and routed rows (BM)
SWEEP = {("bfloat16", 16): [(16, 32, 64, 4, 2), (16, 32, 128, 4, 2), (16, 32, 256, 4, 2),
                            (16, 64, 128, 4, 2), (16, 32, 512, 4, 2), (16, 32, 512, 8, 2),
                            (16, 32, 128, 4, 3), (32, 32, 128, 4, 2), (32, 32, 128, 8, 2)],
         ("bfloat16", 64): [(64, 32, 64, 4, 2), (64, 32, 64, 8, 2), (64, 32, 128, 8, 2),
                            (64, 64, 64, 8, 2), (64, 32, 256, 8, 2)],
         ("float32", 16): [(16, 32, 128, 4, 2), (16, 32, 64, 4, 2), (16, 32, 128, 4, 1),
                           (16, 16, 128, 4, 2)],
         ("float32", 32): [(64, 32, 128, 8, 2), (64, 32, 64, 8, 1), (64, 16, 64, 8, 2),
                           (32, 32, 64, 4, 1), (32, 32, 64, 4, 2), (32, 32, 128, 8, 1),
                           (32, 16, 64, 4, 2)]}


def record(dtype: str, sq: int, paged: bool):
    """The launches [(kernel name, args, kw)] of one wide decoding forward."""
    import numpy as np
    import torch

    import anyattn as aa
    from anyattn.backends.triton import forward as F
    from anyattn.backends.triton import launch as L
    from anyattn.modifiers import ScoreMods
    from anyattn.paged import describe_paged
    from anyattn.problem import describe

    s = SHAPE
    B, Hq, Hkv, Sk, D, Dv = s["B"], s["Hq"], s["Hkv"], s["Sk"], s["D"], s["Dv"]
    td = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, Hq, sq, D, generator=g).to(td)
    mask = aa.Causal(align="bottom_right")
    names = ("fwd_split_kernel", "fwd_combine_kernel", "split_f16_kernel", "row_stats_kernel")
    with PH.recording(names) as log:
        if paged:
            P = 64
            M = Sk // P
            kp = torch.randn(B * M, Hkv, P, D, generator=g).to(td)
            vp = torch.randn(B * M, Hkv, P, Dv, generator=g).to(td)
            pages = aa.Pages(np.arange(B * M).reshape(B, M), np.full(B, Sk))
            p = describe_paged(q, kp, vp, pages, mask=mask)
            F.forward_paged(p, q, kp, vp, ScoreMods())
        else:
            k = torch.randn(B, Hkv, Sk, D, generator=g).to(td)
            v = torch.randn(B, Hkv, Sk, Dv, generator=g).to(td)
            p = describe(q, k, v, mask=mask)
            L.forward(p, q, k, v, None, mods=ScoreMods())
    return [x for x in log if x[0] in ("fwd_split_kernel", "fwd_combine_kernel")]


def _ptxas(ptx: str):
    """(registers, spill store bytes, spill load bytes, shared bytes) of ptxas -v."""
    import subprocess
    import tempfile

    import triton

    exe = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as tmp:
        f = os.path.join(tmp, "k.ptx")
        with open(f, "w") as fh:
            fh.write(ptx)
        r = subprocess.run([exe, "-v", "-arch=sm_90a", f, "-o", os.path.join(tmp, "k.cubin")],
                           capture_output=True, text=True)
    log = r.stdout + r.stderr
    regs = re.search(r"Used (\d+) registers", log)
    sp = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    sm = re.search(r"(\d+) bytes smem", log)
    return (int(regs.group(1)) if regs else -1, int(sp.group(1)) if sp else -1,
            int(sp.group(2)) if sp else -1, int(sm.group(1)) if sm else 0)


def _one(item):
    from anyattn.backends.triton import kernels as K
    from sass_hashes import sass_of

    label, name, args, kw = item
    t = time.time()
    ck = PH._compile(getattr(K, name), args, kw)
    ptx = ck.asm["ptx"]
    sass = sass_of(ck.asm["cubin"])
    regs, st, ld, smem = _ptxas(ptx)
    return dict(label=label, kernel=name, regs=regs, spill_stores=st, spill_loads=ld,
                ptxas_smem=smem, shared=ck.metadata.shared,
                wgmma=len(re.findall(r"wgmma\.mma_async", ptx)),
                mma_sync=len(re.findall(r"\bmma\.sync", ptx)),
                STL=len(re.findall(r"\bSTL\b", sass)), LDL=len(re.findall(r"\bLDL\b", sass)),
                sass_lines=len(sass.splitlines()), seconds=round(time.time() - t, 1))


def _cfg(kw):
    return (f"BM{kw['BM']} BN{kw['BN']} DVC{kw.get('DVC', 0)} w{kw['num_warps']} "
            f"s{kw['num_stages']}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        ap.error("unset TRITON_INTERPRET: the kernels must be compiled, not interpreted")
    todo = []
    for dtype in ("bfloat16", "float32"):
        for sq in (1, 4):
            for paged in (False, True):
                for name, args, kw in record(dtype, sq, paged):
                    if paged and name == "fwd_combine_kernel":
                        continue           # the same combine as the contiguous call's
                    label = (f"{dtype} Sq{sq} {'paged' if paged else 'contiguous'} "
                             f"{name} {_cfg(kw) if 'BN' in kw else ''}(routed)")
                    todo.append((label, name, args, kw))
                    if a.sweep and name == "fwd_split_kernel" and not paged:
                        for bm, bn, dvc, w, s in SWEEP[(dtype, kw["BM"])]:
                            kw2 = dict(kw, BM=bm, BN=bn, DVC=dvc, num_warps=w,
                                       num_stages=s)
                            if kw2 != kw:
                                todo.append((f"{dtype} Sq{sq} sweep {_cfg(kw2)}", name,
                                             args, kw2))
    print(f"{len(todo)} compiles", flush=True)
    rows = []
    with ProcessPoolExecutor(a.jobs) as ex:
        for r in ex.map(_one, todo):
            rows.append(r)
            print(f"{r['label']:70s} regs {r['regs']:3d} spill {r['spill_stores']}/"
                  f"{r['spill_loads']} B STL/LDL {r['STL']}/{r['LDL']} smem {r['shared']:6d} "
                  f"wgmma {r['wgmma']} mma.sync {r['mma_sync']} ({r['seconds']} s)",
                  flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
