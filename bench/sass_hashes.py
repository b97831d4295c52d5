"""sha256 of the offline sm_90a SASS of every Hopper backward config (no GPU needed).

Configs: configs.BWD_VARIANTS, WS_BWD_VARIANTS, WS_DQ_BWD_VARIANTS, WS_DQS_BWD_VARIANTS,
the defaults bwd_config(D, 'none' / 'band'), bwd_config_dkdv_only, PREV_BWD, dkdv_config;
D = 64 and 128; with and without a band; bf16 (and fp16 for the defaults).  Compiled via
hopper/bwd_offline.compile_any, SASS via offline.sass_of on the cubin.  A refactor of the
backward kernels that must not change any compiled kernel compares two runs:

    python3 bench/sass_hashes.py --out /tmp/sass_before.json      # before the edit
    python3 bench/sass_hashes.py --out /tmp/sass_after.json --compare /tmp/sass_before.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor


def cases():
    """[(key, cfg, dtype, D, has_band)] without repeats (key: 'name/D/band/dtype')."""
    from anyattn.backends.triton.hopper import configs as HC

    out, seen = [], set()

    def add(cfg, d, dtype):
        for band in (False, True):
            key = f"{cfg.name}/D{d}/{'band' if band else 'none'}/{dtype}"
            if key not in seen:
                seen.add(key)
                out.append((key, cfg, dtype, d, band))

    for d in (64, 128):
        defaults = [HC.bwd_config(d, "none"), HC.bwd_config(d, "band"),
                    HC.bwd_config_dkdv_only(d)]
        for cfg in defaults:
            add(cfg, d, "bfloat16")
            add(cfg, d, "float16")
        for cfg in (HC.BWD_VARIANTS[d] + HC.WS_BWD_VARIANTS[d] + HC.WS_DQ_BWD_VARIANTS[d]
                    + HC.WS_DQS_BWD_VARIANTS[d] + [HC.PREV_BWD[d], HC.dkdv_config(d)]):
            add(cfg, d, "bfloat16")
    return out


def _one(case):
    from anyattn.backends.triton.hopper.bwd_offline import compile_any
    from anyattn.backends.triton.hopper.offline import sass_of

    key, cfg, dtype, d, band = case
    t = time.time()
    sass = sass_of(compile_any(cfg, dtype, d, band).asm["cubin"])
    if not sass:
        raise RuntimeError(f"{key}: no SASS (cuobjdump missing?)")
    return key, hashlib.sha256(sass.encode()).hexdigest(), len(sass.splitlines()), time.time() - t


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--compare", help="a previous run's JSON: every hash must match")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--only", default="", help="substring filter on the keys")
    a = ap.parse_args()
    todo = [c for c in cases() if a.only in c[0]]
    res = {}
    with ProcessPoolExecutor(a.jobs) as ex:
        for key, h, n, dt in ex.map(_one, todo):
            res[key] = {"sha256": h, "sass_lines": n}
            print(f"{key:45s} {h[:16]} {n:6d} lines {dt:6.1f} s", flush=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1, sort_keys=True)
    print(f"{len(res)} configs -> {a.out}")
    if a.compare:
        with open(a.compare) as f:
            ref = json.load(f)
        bad = [k for k in res if k not in ref or ref[k]["sha256"] != res[k]["sha256"]]
        print(f"compared {len(res)}: {len(res) - len(bad)} identical, {len(bad)} differ")
        for k in bad:
            print("  DIFFERS:", k)
        return 1 if bad else 0
    return 0


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
    sys.exit(main())
