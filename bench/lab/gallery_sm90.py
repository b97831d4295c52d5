"""The function gallery (examples/gallery.py) compiled offline for sm_90a beside each
entry's built-in spelling: per launch of the forward and the backward (wrt q, k, v and the
entry's float captures), the kernel's config (tile sizes, warps, stages), registers,
spilled bytes (STL / LDL instructions), shared memory and SASS instruction count.

    PYTHONPATH=src python3 bench/lab/gallery_sm90.py [--only alibi,softcap] [--json OUT]

D = 128, bf16 (--dtype), the gallery parameters of gpu_gallery_vs_flex.sizes(4096) (recorded at a
small B / H / S: the kernels do not specialise on S).  The launches are recorded with
portable_hashes.py's recorder (every kernel of kernels.py replaced, the real launch
code of the tree on PYTHONPATH) and compiled through Triton's compiler for sm_90a.
The softcap constexpr of 16-bit inputs is taken as on a GPU (portable_hashes._fast_tanh).
Must run without TRITON_INTERPRET.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, ".."))

import portable_hashes as ph  # noqa: E402

#: the recording's sizes (B, H, Hkv, S, D)
SHAPE = (2, 4, 4, 256, 128)
EXTRA_KERNELS = ("mask_blocks_kernel", "dcap_diag_kernel", "dcap_segment_kernel")
#: the most shared memory one block of an sm_90 GPU may take (227 KiB); Triton's
#: launcher raises OutOfResources above it and the launch code then tries
#: prepared.fallbacks(config) in turn
SM90_SMEM = 232448
#: the inputs' dtype (--dtype)
DTYPE = ["bfloat16"]
#: the constexprs / keywords that make a launch's config
CONFIG_KEYS = ("BM", "BN", "BM2", "BN2", "num_warps", "num_stages")


def _gallery():
    sys.path.insert(0, os.path.join(HERE, ".."))
    import gpu_gallery_vs_flex as gv   # noqa: E402  (imports torch, not CUDA)

    return gv.load_gallery(), gv.sizes


def _tensors(kw, torch):
    """The built-in spelling's arrays as CPU tensors."""
    return {n: (torch.as_tensor(x) if isinstance(x, np.ndarray) else x) for n, x in kw.items()}


def record(name, spelling):
    """[(kernel name, args, kw)] of one entry's forward + backward: ``spelling`` "function"
    (wrt q, k, v, as gpu_gallery_vs_flex times it), "function+dcap" (wrt the entry's
    float captures too) or "builtin" (the built-in spelling, wrt q, k, v)."""
    import torch

    from anyattn.backends.triton import launch as L
    from anyattn.arguments import score_mods
    from anyattn.problem import describe

    gallery, sizes = _gallery()
    B, H, Hkv, S, D = SHAPE
    make, _ = gallery.GALLERY[name]
    entry = make(B, H, S, S, np.random.default_rng(0), **sizes(4096).get(name, {}))
    g = torch.Generator().manual_seed(1)
    q, k, v, dout = (torch.randn(B, n, S, D, generator=g).to(getattr(torch, DTYPE[0]))
                     for n in (H, Hkv, Hkv, H))
    if spelling == "builtin":
        kw = _tensors(entry.builtin, torch)
    else:
        kw = dict(entry.kwargs)
    wrt = ("q", "k", "v") + (tuple(entry.wrt) if spelling == "function+dcap" else ())
    bias = kw.pop("bias", None)
    if bias is not None:
        bias = bias.to(getattr(torch, DTYPE[0]))
    # the modifiers as the API passes them (a function that spells ALiBi runs as the
    # built-in where its slopes are not differentiated: Problem.matched_alibi)
    slopes = kw.get("alibi_slopes")
    with ph.recording(ph.KERNEL_NAMES + EXTRA_KERNELS) as log:
        p = describe(q, k, v, bias=bias, **kw)
        out, st = L.forward(p, q, k, v, bias, mods=score_mods(p, slopes, None))
        pb = describe(q, k, v, dout=dout, out=out, lse=st.max, bias=bias, wrt=wrt, **kw)
        mods = score_mods(pb, slopes, None)
        L.backward(pb, q, k, v, dout, out, st, bias, mods=mods)
    return log


def _res_usage(cubin):
    from sass_hashes import cuobjdump

    return cuobjdump(cubin, "-res-usage")


#: the launches to compile, set before the worker processes fork (the generated device
#: functions in their constexprs do not pickle; forked workers inherit them)
_TODO: list = []


def facts(i):
    """Index into _TODO (launch key, kernel, args, kw) -> the compiled launch's facts;
    where the planned config needs more shared memory than sm_90 has, ``runs_as``: the
    facts of the first of prepared.fallbacks that fits (what the GPU will run)."""
    from anyattn.backends.triton import configs
    from anyattn.backends.triton import prepared

    lkey, name, args, kw = _TODO[i]
    f = _facts(name, args, kw)
    if f["shared"] > SM90_SMEM and "BM2" not in kw and "BM" in kw and "BN" in kw:
        cfg = configs.KernelConfig(kw["BM"], kw["BN"], kw["num_warps"], kw["num_stages"])
        for c in list(prepared.fallbacks(cfg))[1:]:
            g = _facts(name, args, dict(kw, BM=c.bm, BN=c.bn, num_warps=c.num_warps,
                                        num_stages=c.num_stages))
            if g["shared"] <= SM90_SMEM:
                f["runs_as"] = g
                break
    return lkey, f


def _facts(name, args, kw):
    from anyattn.backends.triton import kernels as K
    from sass_hashes import sass_of

    t = time.time()
    ck = ph._compile(getattr(K, name), args, kw)
    sass = sass_of(ck.asm["cubin"])
    instr = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+\S", ln)]
    res = _res_usage(ck.asm["cubin"])
    reg = re.search(r"\bREG:(\d+)", res)
    local = re.search(r"\bLOCAL:(\d+)", res)
    ptx = ck.asm.get("ptx", "")
    return dict(
        kernel=name,
        config={k: kw[k] for k in CONFIG_KEYS if k in kw},
        registers=int(reg.group(1)) if reg else None,
        local_bytes=int(local.group(1)) if local else None,
        stl=sum(" STL" in ln for ln in instr), ldl=sum(" LDL" in ln for ln in instr),
        shared=int(getattr(ck.metadata, "shared", 0)),
        sass_instr=len(instr),
        mufu=sum("MUFU" in ln for ln in instr),
        ptx_div=len(re.findall(r"\bdiv\.(?:rn|full|approx)", ptx)),
        compile_s=round(time.time() - t, 1))


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated gallery entry names")
    ap.add_argument("--json", default="")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    a = ap.parse_args()
    DTYPE[0] = a.dtype
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        ap.error("unset TRITON_INTERPRET: the kernels must be compiled, not interpreted")
    gallery, sizes = _gallery()
    names = [n for n in gallery.GALLERY if not a.only or n in a.only.split(",")]
    todo, rows = {}, []
    for name in names:
        make, _ = gallery.GALLERY[name]
        entry = make(*SHAPE[:2], SHAPE[3], SHAPE[3], np.random.default_rng(0),
                     **sizes(4096).get(name, {}))
        spellings = ("function",) + (("function+dcap",) if entry.wrt else ()) + \
            (("builtin",) if entry.builtin is not None else ())
        for spelling in spellings:
            launches = []
            for kname, args, kw in record(name, spelling):
                kw = ph._fast_tanh(kw, DTYPE[0])
                lkey = ph._launch_key(kname, args, kw)
                launches.append(lkey)
                todo.setdefault(lkey, (lkey, kname, args, kw))
            rows.append((name, spelling, launches))
    print(f"{len(todo)} distinct launches from {len(rows)} spellings", flush=True)
    done = {}
    _TODO[:] = list(todo.values())
    with ProcessPoolExecutor(a.jobs, mp_context=multiprocessing.get_context("fork")) as ex:
        for lkey, f in ex.map(facts, range(len(_TODO))):
            done[lkey] = f
            print(f"  compiled {lkey[:90]} in {f['compile_s']} s", flush=True)
    hdr = (f"{'entry':24s} {'spelling':13s} {'kernel':18s} {'config':24s} {'regs':>4s} "
           f"{'STL':>4s} {'LDL':>4s} {'smem':>6s} {'SASS':>6s} {'MUFU':>5s}")
    print(hdr)
    out = []
    for name, spelling, launches in rows:
        for lkey in launches:
            f = done[lkey]
            c = f["config"]
            cfg = f"{c.get('BM', '-')}x{c.get('BN', '-')}"
            if "BM2" in c:
                cfg += f"/{c['BM2']}x{c['BN2']}"
            cfg += f" w{c.get('num_warps', '-')} s{c.get('num_stages', '-')}"
            print(f"{name:24s} {spelling:13s} {f['kernel']:18s} {cfg:24s} {f['registers']:4d} "
                  f"{f['stl']:4d} {f['ldl']:4d} {f['shared']:6d} {f['sass_instr']:6d} "
                  f"{f['mufu']:5d}")
            r = f.get("runs_as")
            if r is not None:
                c = r["config"]
                print(f"{'':24s} {'':13s} {'  over 227 KiB, runs as':18s} "
                      f"{c['BM']}x{c['BN']} w{c['num_warps']} s{c['num_stages']}{'':10s} "
                      f"{r['registers']:4d} {r['stl']:4d} {r['ldl']:4d} {r['shared']:6d} "
                      f"{r['sass_instr']:6d} {r['mufu']:5d}")
            out.append(dict(entry=name, spelling=spelling, **f))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"meta": dict(target="sm_90a", dtype=DTYPE[0], D=SHAPE[4],
                                    recorded_shape=dict(zip("B H Hkv S D".split(), SHAPE)),
                                    params="gpu_gallery_vs_flex.sizes(4096)"),
                       "rows": out}, fh, indent=0)
        print("->", a.json)


if __name__ == "__main__":
    main()
