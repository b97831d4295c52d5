"""Building a mask function's tile map: anyattn vs FlexAttention's ``create_block_mask``,
both on the CPU, in one process.

For every gallery mask (examples/gallery.py: sliding window + global tokens, dilated,
2-D neighbourhood, chunked, PrefixLM, document + causal) at B = 1, H = 1, and for the
masks that read the batch or head index a per-batch / per-head variant (PrefixLM and
document + causal with B = 4; a sliding window whose width is captured per head, H = 4):

* anyattn: ``anyattn.masks.resolve(mask, B, H, S, S).tile_map(128, 128)`` with
  ``TILE_CACHE`` cleared first (a cold build: the mask lowered and bound for the sizes,
  every capture index checked, the function's tiles classified);
* Flex: ``create_block_mask(mask_mod, B, H, S, S, device="cpu", BLOCK_SIZE=128)``
  (eager, torch CPU tensors); with ``--compiled`` also ``torch.compile(create_block_mask)``
  after one warm-up call (its compile time reported apart).

Median of ``--reps`` cold builds each.  The two must agree: per query block, anyattn's
partial and full tile counts equal Flex's ``kv_num_blocks`` and ``full_kv_num_blocks``
(the run stops on a mismatch).  Writes JSON and a PNG bar chart of the time ratio
anyattn / Flex per mask and S.

    PYTHONPATH=src python3 bench/mask_build_vs_flex.py --S 4096 16384 --reps 3 \
        --json dev/perf/mask-build-cpu.json --png dev/perf/mask-build-cpu.png
    PYTHONPATH=src python3 bench/mask_build_vs_flex.py --quick      # smoke test, seconds
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
import anyattn as aa  # noqa: E402
from anyattn.masks import TILE_CACHE, TILE_FULL, TILE_PARTIAL, resolve  # noqa: E402

BLOCK = 128


def _gallery():
    """examples/gallery.py as a module (kept in sys.modules as ``anyattn_gallery``, the
    name the tests load it under)."""
    mod = sys.modules.get("anyattn_gallery")
    if mod is None:
        spec = importlib.util.spec_from_file_location("anyattn_gallery",
                                                      ROOT / "examples" / "gallery.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["anyattn_gallery"] = mod
        spec.loader.exec_module(mod)
    return mod


def cases(B: int, H: int, S: int, seed: int = 0):
    """name -> (anyattn mask, Flex mask_mod over torch tensors): the gallery's masks, each
    spelled for Flex with the same captures."""
    import torch

    gal = _gallery()
    rng = np.random.default_rng(seed)
    out = {}

    e = gal.sliding_global(B, H, S, S, rng)
    w, g = 8, 4                                      # the gallery's defaults

    def sg(b, h, q, kv):
        return ((q - kv).abs() <= w) | (kv < g) | (q < g)
    out["sliding_global"] = (e.kwargs["mask"], sg)

    e = gal.dilated(B, H, S, S, rng)

    def dil(b, h, q, kv):
        d = q - kv
        return (d >= 0) & (d % 3 == 0) & (d // 3 <= 6)
    out["dilated"] = (e.kwargs["mask"], dil)

    e = gal.neighbourhood_2d(B, H, S, S, rng)

    def nat(b, h, q, kv):
        return ((q // 8 - kv // 8).abs() <= 2) & ((q % 8 - kv % 8).abs() <= 2)
    out["neighbourhood_2d"] = (e.kwargs["mask"], nat)

    e = gal.chunked(B, H, S, S, rng)

    def chk(b, h, q, kv):
        return (q // 16 == kv // 16) & (kv <= q)
    out["chunked"] = (e.kwargs["mask"], chk)

    e = gal.prefix_lm(B, H, S, S, rng)
    prefix = torch.from_numpy(e.kwargs["mask"].terms[1].captures["prefix"])

    def pre(b, h, q, kv):
        return (kv <= q) | (kv < prefix[b])
    out["prefix_lm"] = (e.kwargs["mask"], pre)

    e = gal.document_causal(B, H, S, S, rng)
    doc = torch.from_numpy(e.kwargs["mask"].terms[0].captures["doc"])

    def dc(b, h, q, kv):
        return (doc[b, q] == doc[b, kv]) & (kv <= q)
    out["document_causal"] = (e.kwargs["mask"], dc)
    return out


def head_window_case(H: int, S: int):
    """A sliding window whose width is captured per head (the mask reads h)."""
    import torch

    widths = (16 << np.arange(H)).astype(np.int64)      # 16, 32, 64, ...
    tw = torch.from_numpy(widths)

    def win(b, h, q_idx, kv_idx, widths):
        return (kv_idx <= q_idx) & (q_idx - kv_idx < widths[h])

    def flex(b, h, q, kv):
        return (kv <= q) & (q - kv < tw[h])
    return aa.MaskMod(win, widths=widths), flex


def anyattn_build(mask, B, H, S):
    TILE_CACHE.clear()
    return resolve(mask, B, H, S, S).tile_map(BLOCK, BLOCK)


def agree(codes: np.ndarray, bm, B: int, H: int) -> dict:
    """anyattn's partial / full counts per query block vs Flex's, for every (b, h)."""
    nq = codes.shape[2]
    c = np.broadcast_to(codes, (B, H) + codes.shape[2:])
    part = (c == TILE_PARTIAL).sum(-1)
    full = (c == TILE_FULL).sum(-1)
    f_part = bm.kv_num_blocks.numpy()[..., :nq]
    f_full = bm.full_kv_num_blocks.numpy()[..., :nq]
    ok = bool((part == f_part).all() and (full == f_full).all())
    return {"agree": ok, "partial": int(part.sum()), "full": int(full.sum()),
            "flex_partial": int(f_part.sum()), "flex_full": int(f_full.sum())}


def timed(fn, reps: int):
    ts, out = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        out = fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), ts, out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--S", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--flex-reps", type=int, default=None,
                    help="Flex builds per case (default: --reps)")
    ap.add_argument("--compiled", action="store_true",
                    help="also time torch.compile(create_block_mask) (compile excluded)")
    ap.add_argument("--only", nargs="*", default=None, help="case names to run")
    ap.add_argument("--no-variants", action="store_true", help="B = H = 1 only")
    ap.add_argument("--quick", action="store_true", help="S=512, one rep: a smoke test")
    ap.add_argument("--json", default=None)
    ap.add_argument("--png", default=None)
    args = ap.parse_args()
    if args.quick:
        args.S, args.reps = [512], 1
    flex_reps = args.flex_reps or args.reps

    import torch
    from torch.nn.attention.flex_attention import create_block_mask
    cbm_compiled = torch.compile(create_block_mask) if args.compiled else None

    rows = []
    for S in args.S:
        todo = [(name, 1, 1, m, f) for name, (m, f) in cases(1, 1, S).items()]
        if not args.no_variants:
            var = cases(4, 1, S)
            todo += [(name + " B=4", 4, 1) + var[name] for name in ("prefix_lm",
                                                                     "document_causal")]
            todo.append(("head_window H=4", 1, 4) + head_window_case(4, S))
        for name, B, H, mask, fmod in todo:
            if args.only and name.split(" ")[0] not in args.only:
                continue
            ta, ta_all, codes = timed(lambda: anyattn_build(mask, B, H, S), args.reps)
            tf, tf_all, bm = timed(lambda: create_block_mask(fmod, B, H, S, S, device="cpu",
                                                             BLOCK_SIZE=BLOCK), flex_reps)
            row = dict(mask=name, B=B, H=H, S=S, anyattn_s=ta, anyattn_all_s=ta_all,
                       flex_s=tf, flex_all_s=tf_all, ratio=ta / tf, **agree(codes, bm, B, H))
            if cbm_compiled is not None:
                torch._dynamo.reset()          # a fresh compile per case (no recompile cap)
                t0 = time.perf_counter()
                cbm_compiled(fmod, B, H, S, S, device="cpu", BLOCK_SIZE=BLOCK)
                row["flex_compiled_first_s"] = time.perf_counter() - t0
                tc, tc_all, _ = timed(lambda: cbm_compiled(fmod, B, H, S, S, device="cpu",
                                                           BLOCK_SIZE=BLOCK), flex_reps)
                row.update(flex_compiled_s=tc, flex_compiled_all_s=tc_all,
                           ratio_compiled=ta / tc)
            rows.append(row)
            line = (f"S={S:6d} {name:24s} anyattn {ta * 1e3:9.1f} ms  Flex {tf * 1e3:9.1f} ms"
                    f"  ratio {ta / tf:6.3f}")
            if cbm_compiled is not None:
                line += f"  Flex compiled {row['flex_compiled_s'] * 1e3:8.1f} ms"
            line += "  agree" if row["agree"] else (
                f"  MISMATCH partial {row['partial']} vs {row['flex_partial']}, full "
                f"{row['full']} vs {row['flex_full']}")
            print(line, flush=True)
    bad = [r["mask"] for r in rows if not r["agree"]]
    meta = dict(block=BLOCK, reps=args.reps, flex_reps=flex_reps, torch=torch.__version__,
                numpy=np.__version__, threads=torch.get_num_threads(), cpus=os.cpu_count(),
                machine=platform.machine(), processor=platform.processor(),
                load=os.getloadavg(),
                anyattn_call="anyattn.masks.resolve(mask, B, H, S, S).tile_map(128, 128), "
                             "TILE_CACHE cleared before each",
                flex_call="create_block_mask(mask_mod, B, H, S, S, device='cpu', "
                          "BLOCK_SIZE=128)")
    if args.json:
        Path(args.json).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1) + "\n")
    if args.png:
        plot(rows, args.png)
    if bad:
        raise SystemExit(f"tile maps disagree with Flex's block mask for {bad}")


def plot(rows, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted({r["S"] for r in rows})
    names = list(dict.fromkeys(r["mask"] for r in rows))
    fig, ax = plt.subplots(figsize=(9, 4))
    width = 0.8 / len(sizes)
    for k, S in enumerate(sizes):
        ys = [next((r["ratio"] for r in rows if r["mask"] == n and r["S"] == S), np.nan)
              for n in names]
        ax.bar(np.arange(len(names)) + k * width, ys, width, label=f"S={S}")
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks(np.arange(len(names)) + width * (len(sizes) - 1) / 2)
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("time anyattn / Flex (lower is better)")
    ax.set_title("tile-map build vs create_block_mask, CPU, block 128")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=80)


if __name__ == "__main__":
    main()
