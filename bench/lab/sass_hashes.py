"""sha256 of the sm_90a SASS (and PTX) of every routed Hopper kernel, compiled offline
(no GPU needed).

The cases are what the router can launch: configs.fwd_config(D, dtype, mask class)
for the covered mask classes (the persistent configs' per-tile twins too, which run
under CUDA-graph capture), configs.bwd_config(D, mask class), bwd_config_dkdv_only(D)
(the dQ-portable fallback and the dK/dV-only call), with the Documents / KeepMask
specialisations the D=128 route takes, and the dQ conversion kernel.  SASS is the criterion; the PTX hash (source locations
stripped) is reported beside it.  A refactor that
must not change any routed kernel compares two runs:

    PYTHONPATH=src python3 bench/lab/sass_hashes.py --out /tmp/sass_before.json
    PYTHONPATH=src python3 bench/lab/sass_hashes.py --out /tmp/sass_after.json \
        --compare /tmp/sass_before.json

Each kernel's signature is built by parameter name: constexprs a kernel no longer takes
(options whose only routed value became the code) are skipped, so the same case
compiles before and after such an edit.

The score-modifier variants (keys ending in /mods-softcap, /mods-alibi, /mods-sinks,
/mods-softcap+alibi+sinks; bf16, every routed no-mask / band config) are compiled too
(``--no-mods``: not); their records add the SASS's local-memory stores / loads (STL /
LDL: spills) and the registers it names.  A key the compared run lacks is reported as
new, not as a difference.
"""
from __future__ import annotations

import argparse
import hashlib
import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor

SM90A = ("cuda", 90, 32)
WRITER_REGS = 24          # the dQ writer warp's registers (hopper/launch.py)

_FWD_ARRAY_TYPES = dict(RT="*i32", rt_b="i32", rt_h="i32", QID="*i32", KID="*i32",
                        sqid_b="i32", skid_b="i32", KM="*u8", skm_b="i32", skm_h="i32",
                        skm_q="i32", skm_k="i32")
_BWD_ARRAY_TYPES = dict(CT="*i32", ct_b="i32", ct_h="i32", IV="*i32", KID="*i32",
                        siv_b="i32", skid_b="i32", KM="*u8", skm_b="i32", skm_h="i32",
                        skm_q="i32", skm_k="i32")
_ARRAY_CASES = [(band, docs, keep) for band in (False, True) for docs in (0, 1, 2)
                for keep in (False, True) if docs or keep]


def _mask_class(band, docs, keep):
    parts = [n for n, on in (("band", band), ("documents", docs), ("keep", keep)) if on]
    return "+".join(parts) or "none"


def _fwd_config(HC, d, dtype, cls):
    """configs.fwd_config of (D, mask class); a dtype argument where it takes one."""
    if "dtype" in inspect.signature(HC.fwd_config).parameters:
        return HC.fwd_config(d, dtype, cls)
    return HC.fwd_config(d, cls)


#: the score-modifier variants compiled (bf16; every routed no-mask / band config): the
#: modifiers one at a time and all together (sinks change the forward only)
MOD_CASES = (("softcap",), ("alibi",), ("sinks",), ("softcap", "alibi", "sinks"))


def cases(mods: bool = True):
    """[(key, kind, cfg, dtype, D, band, docs, keep, modifiers)] without repeats; ``mods``:
    with the score-modifier variants (keys ending in /mods-<names>)."""
    from anyattn.backends.triton.hopper import configs as HC

    out, seen = [], set()

    def add(kind, cfg, dtype, d, band, docs=0, keep=False, mod=()):
        key = (f"{kind}/{cfg.name}/D{d}/{dtype}/{'band' if band else 'noband'}"
               f"/docs{docs}/{'keep' if keep else 'nokeep'}")
        if mod:
            key += "/mods-" + "+".join(mod)
        if key not in seen:
            seen.add(key)
            out.append((key, kind, cfg, dtype, d, band, docs, keep, tuple(mod)))

    for dtype in ("bfloat16", "float16"):
        for d in (64, 128):
            for band in (False, True):
                cls = "band" if band else "none"
                cfg = _fwd_config(HC, d, dtype, cls)
                add("fwd", cfg, dtype, d, band)
                if cfg.persist and getattr(cfg, "sched", True) and band:
                    add("fwd", cfg.per_tile(), dtype, d, band)
                bcfg = HC.bwd_config(d, cls)
                add("bwd", bcfg, dtype, d, band)
                add("bwd", HC.bwd_config_dkdv_only(d), dtype, d, band)
                for mod in MOD_CASES if mods and dtype == "bfloat16" else ():
                    if mod != ("sinks",):        # the backward kernels take no sinks
                        bmod = tuple(m for m in mod if m != "sinks")
                        add("bwd", HC.bwd_config(d, cls, frozenset(bmod)), dtype, d, band,
                            mod=bmod)
                        add("bwd", HC.bwd_config_dkdv_only(d), dtype, d, band, mod=bmod)
                    add("fwd", cfg, dtype, d, band, mod=mod)
                    if cfg.persist and band:
                        add("fwd", cfg.per_tile(), dtype, d, band, mod=mod)
            for band, docs, keep in _ARRAY_CASES if d == 128 else ():
                cls = _mask_class(band, docs, keep)
                add("fwd", _fwd_config(HC, d, dtype, cls), dtype, d, band, docs, keep)
                add("bwd", HC.bwd_config(d, cls), dtype, d, band, docs, keep)
                add("bwd", HC.bwd_config_dkdv_only(d), dtype, d, band, docs, keep)
    return out


def _compile(fn, types, consts, num_warps, gluon=True):
    """triton.compile of fn for sm_90a with a signature built by parameter name: runtime
    parameters typed from ``types``, constexprs from ``consts`` (names fn lacks are
    skipped), any other parameter at its default (as a launch that omits it)."""
    import triton
    from triton.backends.compiler import GPUTarget

    sig, cx = {}, {}
    for i, name in enumerate(fn.arg_names):
        if name in types:
            sig[name] = types[name]
        elif name in consts or name == "num_warps":
            sig[name] = "constexpr"
            cx[(i,)] = num_warps if name == "num_warps" else consts[name]
        else:
            default = fn.params[i].default
            if default is fn.params[i]._param.empty:
                raise TypeError(f"{fn.__name__}: no value for parameter {name}")
            sig[name] = "constexpr"
            cx[(i,)] = default
    if gluon:
        from triton.experimental.gluon._runtime import GluonASTSource as Src
    else:
        from triton.compiler import ASTSource as Src
    src = Src(fn, sig, constexprs=cx)
    return triton.compile(src, target=GPUTarget(*SM90A), options=dict(num_warps=num_warps))


_MOD_TYPES = dict(SLOPES="*fp32", sl_b="i32", cap="fp32", adiag="i32")


def _mod_consts(mods) -> dict:
    return dict(SOFTCAP="softcap" in mods, ALIBI="alibi" in mods,
                HAS_SINKS="sinks" in mods)


def _compile_fwd(cfg, dtype, d, band, docs, keep, mods=()):
    import torch
    from triton.runtime.jit import mangle_type

    from anyattn.backends.triton.hopper.launch import make_desc

    x = torch.empty((2, 2, 256, d), dtype=getattr(torch, dtype))
    qd = mangle_type(make_desc(x, cfg.bm // cfg.consumers))
    kd = mangle_type(make_desc(x, cfg.bn))
    types = dict(q_desc=qd, k_desc=kd, v_desc=kd, o_desc=qd, LSE="*fp32", H="i32",
                 G="i32", Sq="i32", Sk="i32", qk_scale="fp32", scale="fp32", lo="i32",
                 hi="i32", **_FWD_ARRAY_TYPES)
    if mods:
        types.update(_MOD_TYPES, SINKS="*fp32")
    array = bool(docs or keep)
    consts = dict(HAS_BAND=band, STAGES=cfg.stages, CONSUMER_REGS=cfg.consumer_regs,
                  PINGPONG=getattr(cfg, "pingpong", True), EXP_FMA=getattr(cfg, "exp_fma", True),
                  NC=cfg.consumers,
                  ARRAY=array, DOCS=int(docs), HAS_KEEP=keep)
    if mods:
        consts.update(_mod_consts(mods))
    if getattr(cfg, "persist", False):
        from anyattn.backends.triton.hopper.fwd_persist_kernel import fwd_persist_kernel as fn

        types.update(BH="i32", SCH="*i32")
        consts.update(SCHED=bool(getattr(cfg, "sched", True) and band),
                      XOVER=getattr(cfg, "xover", False))
    else:
        from anyattn.backends.triton.hopper.fwd_ws_kernel import fwd_ws_kernel as fn

        consts.update(OVERLAP=getattr(cfg, "overlap", True), EDGES=getattr(cfg, "edges", False),
                      PSMEM=getattr(cfg, "p_smem", False))
    return _compile(fn, types, consts, 4)


def _compile_bwd(cfg, dtype, d, band, docs, keep, mods=()):
    import torch
    from triton.runtime.jit import mangle_type

    from anyattn.backends.triton.hopper import launch as HL

    x = torch.empty((2, 2, 256, d), dtype=getattr(torch, dtype))
    qd = mangle_type(HL.make_desc(x, cfg.bm))
    kd = mangle_type(HL.make_desc(x, cfg.bn // 2))
    array = bool(docs or keep)
    types = dict(q_desc=qd, k_desc=kd, v_desc=kd, do_desc=qd, dk_desc=kd, dv_desc=kd,
                 L2="*fp32", DELTA="*fp32", H="i32", G="i32", Sq="i32", Sk="i32",
                 scale="fp32", lo="i32", hi="i32")
    if array:
        types.update(_BWD_ARRAY_TYPES)
    consts = dict(HAS_BAND=band, STAGES=cfg.stages, CONSUMER_REGS=cfg.consumer_regs,
                  ARRAY=array, DOCS=int(docs), HAS_KEEP=keep)
    if mods:
        types.update(_MOD_TYPES)
        consts.update(SOFTCAP="softcap" in mods, ALIBI="alibi" in mods)
    if not getattr(cfg, "dq", False):
        from anyattn.backends.triton.hopper.bwd_ws_kernel import dkdv_ws_kernel as fn

        consts.update(PINGPONG=getattr(cfg, "pingpong", False))
        return _compile(fn, types, consts, 4)
    split = getattr(cfg, "split", True)
    acc = torch.empty((4, 256, d), dtype=torch.float32)
    if "swizzle" in inspect.signature(HL.dqa_desc).parameters:
        ad = HL.dqa_desc(acc, cfg.bm, d // 2 if split else None,
                         getattr(cfg, "dq_swizzle", 128), getattr(cfg, "dq_interleave", True))
    else:   # the routed form only: half the columns, interleaved rows
        ad = HL.dqa_desc(acc, cfg.bm, d // 2)
    ad = mangle_type(ad)
    types.update(dqa_desc=ad, SEM="*i32", NBH="i32", ORDER="i32")
    if array:
        types.update(RK="*i32", rk_b="i32", rk_h="i32")
    consts.update(WRITER_REGS=WRITER_REGS, PREFETCH=getattr(cfg, "prefetch", False),
                  CHAINS=getattr(cfg, "chains", 1), DIAG=0, SPLIT=split,
                  LAG=getattr(cfg, "lag", False), STATS=getattr(cfg, "stats", True),
                  DQ_FIRST=getattr(cfg, "dq_first", False),
                  DQ_IL=getattr(cfg, "dq_interleave", True),
                  LATE=getattr(cfg, "late_release", False))
    fn = HL._ws_dq_kernel(cfg)
    return _compile(fn, types, consts, 4)


def _compile_convert(dtype, padded, visits):
    from anyattn.backends.triton.hopper.bwd_dq_convert import dq_convert_kernel as fn

    pdt = {"bfloat16": "*bf16", "float16": "*fp16"}[dtype]
    types = dict(ACC="*fp32", DQ=pdt, N="i32", scale="fp32", SQD="i32", SQD_ACC="i32")
    if visits:
        types.update(VIS="*i8", vis_b="i32", vis_h="i32", H="i32", G="i32", D="i32",
                     BMQ="i32")
    return _compile(fn, types, dict(CHAINS=1, PADDED=padded, BLOCK=4096, VISITS=visits), 8,
                    gluon=False)


def cuobjdump(cubin: bytes, flag: str) -> str:
    """The output of the cuobjdump Triton ships, run with ``flag`` on a cubin."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
        path = f.name
    try:
        return subprocess.run([tool, flag, path], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(path)


def sass_of(cubin: bytes) -> str:
    """SASS text of a cubin."""
    return cuobjdump(cubin, "-sass")


def _ptx_code(ptx: str) -> str:
    """The PTX without its source locations (.file / .loc, the debug labels and the
    debug sections at the end): those name the source file and lines, not the code."""
    keep = []
    for line in ptx.splitlines():
        t = line.strip()
        if t.startswith(".section"):
            break
        if t.startswith((".file", ".loc", "$L__tmp", "$L__func")):
            continue
        keep.append(line)
    return "\n".join(keep)


def convert_cases():
    return [(f"convert/{dt}/{'padded' if p else 'dense'}/{'visits' if v else 'novisits'}",
             "convert", None, dt, 0, p, 0, v, ())
            for dt in ("bfloat16", "float16") for p in (False, True) for v in (False, True)]


def _one(case):
    key, kind, cfg, dtype, d, band, docs, keep, mods = case
    t = time.time()
    if kind == "fwd":
        ck = _compile_fwd(cfg, dtype, d, band, docs, keep, mods)
    elif kind == "bwd":
        ck = _compile_bwd(cfg, dtype, d, band, docs, keep, mods)
    else:
        ck = _compile_convert(dtype, band, keep)
    sass = sass_of(ck.asm["cubin"])
    if not sass.strip():
        raise RuntimeError(f"{key}: empty SASS")
    ptx = _ptx_code(ck.asm["ptx"])
    return (key, hashlib.sha256(sass.encode()).hexdigest(),
            hashlib.sha256(ptx.encode()).hexdigest(), len(sass.splitlines()),
            time.time() - t, len(re.findall(r"\bSTL\b", sass)),
            len(re.findall(r"\bLDL\b", sass)), _registers(sass))


def _registers(sass: str) -> int:
    """The registers the SASS names (highest R number + 1: the warp-specialised
    consumers' real use after setmaxnreg, where the metadata counts the entry's)."""
    regs = [int(r) for r in re.findall(r"\bR(\d+)\b", sass)]
    return max(regs) + 1 if regs else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--compare", help="a previous run's JSON: every SASS hash must match")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", default="", help="substring filter on the keys")
    ap.add_argument("--list", action="store_true", help="print the cases and stop")
    ap.add_argument("--no-mods", action="store_true",
                    help="without the score-modifier variants (/mods-...)")
    a = ap.parse_args()
    todo = [c for c in cases(not a.no_mods) + convert_cases() if a.only in c[0]]
    if a.list:
        for c in todo:
            print(c[0])
        print(len(todo), "cases")
        return 0
    res = {}
    with ProcessPoolExecutor(min(a.jobs, 2)) as ex:
        for key, h, hp, n, dt, stl, ldl, regs in ex.map(_one, todo):
            res[key] = {"sass_sha256": h, "ptx_sha256": hp, "sass_lines": n}
            if "/mods-" in key:       # the new variants: spills and registers too
                res[key].update(STL=stl, LDL=ldl, registers=regs)
            print(f"{key:70s} {h[:12]} {n:6d} lines {dt:6.1f} s  STL {stl} LDL {ldl} "
                  f"regs {regs}", flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1, sort_keys=True)
    print(f"{len(res)} cases -> {a.out}")
    if a.compare:
        with open(a.compare) as f:
            ref = json.load(f)
        new = [k for k in res if k not in ref]
        bad = [k for k in res if k in ref and ref[k]["sass_sha256"] != res[k]["sass_sha256"]]
        missing = [k for k in ref if k not in res and a.only in k
                   and not (a.no_mods and "/mods-" in k)]
        ptx = [k for k in res if k in ref and ref[k]["ptx_sha256"] != res[k]["ptx_sha256"]]
        print(f"compared {len(res) - len(new)}: {len(res) - len(new) - len(bad)} SASS "
              f"identical, {len(bad)} differ, {len(missing)} missing, {len(new)} new; PTX "
              f"differs in {len(ptx)}")
        for k in bad:
            print("  DIFFERS:", k)
        for k in missing:
            print("  MISSING:", k)
        return 1 if bad or missing else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
