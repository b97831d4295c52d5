"""Render every WGSL kernel specialisation the webgpu backend can build and hash its text.

Compares two source trees: run ``dump`` with PYTHONPATH at each tree's ``src`` and then
``compare`` the two JSON files.  A change that must leave the existing kernels alone
(e.g. a new define that only new specialisations take) shows no difference.

    git archive <base> src | tar -x -C /tmp/base
    PYTHONPATH=/tmp/base/src python3 bench/lab/wgsl_identity.py dump /tmp/base.json
    PYTHONPATH=src python3 bench/lab/wgsl_identity.py dump /tmp/head.json
    python3 bench/lab/wgsl_identity.py compare /tmp/base.json /tmp/head.json

Specialisations: tile configs of every variant (``launch._config``) for CPU and GPU
adapter classes over a grid of head dims, f32 and f16, forward / backward, with and
without dropout; each tiled kernel with every subset of the score-modifier defines, the
f16 epilogue (OUTB16), the 5-product backward's defines and debug trip counting; the
delta, vmean, scatter, reduce, dsinks and element-wise kernels with their defines.
No device is needed (the text only).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import sys

D_GRID = (1, 4, 8, 16, 24, 32, 40, 48, 64, 96, 128, 192, 256, 512)


def _contexts():
    from anyattn.backends.webgpu.device import Context

    cpu = Context(adapter=None, device=None, info={}, features=frozenset({"shader-f16"}),
                  limits={"max-compute-workgroup-storage-size": 32768,
                          "max-compute-invocations-per-workgroup": 256},
                  is_cpu=True, is_llvmpipe=True, loop_limit=65535)
    gpu = Context(adapter=None, device=None, info={},
                  features=frozenset({"shader-f16", "subgroup"}),
                  limits={"max-compute-workgroup-storage-size": 49152,
                          "max-compute-invocations-per-workgroup": 1024},
                  is_cpu=False, is_llvmpipe=False, loop_limit=None)
    return {"cpu": cpu, "gpu": gpu}


def _configs():
    """{consts key: (consts, cfg, backward, dropout)} over adapters, D, variants, dtypes."""
    from anyattn.backends.webgpu import launch

    out = {}
    for (_, ctx), D, var, elem, bwd, drop in itertools.product(
            _contexts().items(), D_GRID, launch.VARIANTS, ("f32", "f16"), (False, True),
            (False, True)):
        try:
            cfg = launch._config(ctx, D, elem, bwd, drop, var)
        except (ValueError, NotImplementedError):
            continue
        c = cfg.consts()
        key = (tuple(sorted(c.items())), elem, bwd, drop)
        out.setdefault(key, (c, cfg, elem, bwd, drop))
    return out


def _digest(text: str) -> str:
    return hashlib.sha1(text.encode()).hexdigest()


def dump(path: str) -> None:
    from anyattn.backends.webgpu.pipelines import build_source

    res = {}

    def put(name, kernel, consts, elem, debug=False):
        key = f"{kernel}|{elem}|{int(debug)}|" + ",".join(f"{k}={v}" for k, v in
                                                          sorted(consts.items()))
        res[key] = _digest(build_source(kernel, consts, elem, debug))

    for c, cfg, elem, bwd, drop in _configs().values():
        kernels = ("bwd_dq", "bwd_dkdv") if bwd else ("forward",)
        mods = ("SOFTCAP", "ALIBI") + (("DROPOUT",) if drop else ())
        for kernel in kernels:
            extra = [{}]
            if kernel == "forward":
                extra = [{}, {"SINKS": 1}]
            if elem == "f16" and kernel != "forward":
                extra.append({"OUTB16": 1})
            if cfg.dsq and kernel == "bwd_dkdv":
                extra.append({"DSQ_OUT": 1})
            if cfg.dsq and kernel == "bwd_dq":
                extra.append({"DSQ_IN": 1})
                if cfg.prefetch:
                    extra.append({"DSQ_IN": 1, "DSQ_PF": 1})
            for n in range(len(mods) + 1):
                for sub in itertools.combinations(mods, n):
                    for ex in extra:
                        consts = dict(c, **{m: 1 for m in sub}, **ex)
                        put("tile", kernel, consts, elem)
            put("tile", kernel, dict(c), elem, debug=True)
    for elem in ("f32", "f16"):
        put("delta", "delta", {}, elem)
        put("delta", "delta", {"SUBGROUPS": 1, "RL": 4}, elem)
        if elem == "f16":
            put("delta", "delta", {"OUT16": 1}, elem)
        put("vmean", "vmean", {}, elem)
        for n in range(5):
            for sub in itertools.combinations(("SRC16", "DST16", "OP_ADD", "OP_REFINE"), n):
                put("ew", "ew", {m: 1 for m in sub}, elem)
    for kernel in ("scatter", "reduce_dbias", "dsinks"):
        put(kernel, kernel, {}, "f32")
    with open(path, "w") as f:
        json.dump(res, f, indent=0, sort_keys=True)
    print(f"{len(res)} kernel texts -> {path}")


def compare(a: str, b: str) -> int:
    with open(a) as f:
        x = json.load(f)
    with open(b) as f:
        y = json.load(f)
    only_a = sorted(set(x) - set(y))
    only_b = sorted(set(y) - set(x))
    diff = sorted(k for k in set(x) & set(y) if x[k] != y[k])
    print(f"{len(x)} / {len(y)} texts; {len(set(x) & set(y))} in both; {len(diff)} differ; "
          f"{len(only_a)} only in {a}; {len(only_b)} only in {b}")
    for k in diff[:20] + only_a[:5] + only_b[:5]:
        print("  ", k)
    return 1 if diff or only_a or only_b else 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "dump":
        dump(sys.argv[2])
    elif len(sys.argv) == 4 and sys.argv[1] == "compare":
        sys.exit(compare(sys.argv[2], sys.argv[3]))
    else:
        sys.exit(__doc__)
