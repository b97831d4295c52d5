"""The score / mask function gallery (examples/gallery.py) on Triton beside FlexAttention.

    python bench/gpu_gallery_vs_flex.py --out OUT_DIR [--seqs 4096,8192] [--dtype bfloat16]

Per gallery entry, at B = 4 (``--batch``), H = 16, D = 128 (entry sizes scaled to S: a
window of S/16, chunks of S/4, a grid of sqrt(S) columns), in one process:
  - anyattn: ``anyattn.attention`` (forward) and ``anyattn.attention_backward`` with
    wrt q, k, v (forward + backward) on the Triton backend with the entry's function;
    the first call (trace + compile + tile maps) is reported apart;
  - the entry's built-in spelling where it has one (``Entry.builtin``);
  - FlexAttention: ``torch.compile``d ``flex_attention`` with the same function written
    in torch (``FLEX`` below), q, k, v requiring grad for fwd + bwd; its
    ``create_block_mask`` is timed apart, as is anyattn's tile-map build (``tile_map_ms``:
    a forward with the tile-map cache cleared less a warm one).  anyattn's tile maps are
    cached per function and captured content, so its timed calls exclude their build, as
    Flex's exclude ``create_block_mask``.
Times are CUDA-synchronised medians over ``--reps`` calls; the forward outputs of both
are compared (``fwd_max_abs_diff_vs_flex``).  Writes gallery_vs_flex_DTYPE.json.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

import anyattn as aa  # noqa: E402
from anyattn.backends.triton import programs as tri_programs  # noqa: E402


def load_gallery():
    spec = importlib.util.spec_from_file_location("anyattn_gallery",
                                                  os.path.join(HERE, "..", "examples", "gallery.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["anyattn_gallery"] = mod
    spec.loader.exec_module(mod)
    return mod


def sizes(S):
    """Gallery parameters scaled to the sequence length."""
    width = int(math.isqrt(S))
    return {"t5_buckets": dict(n_buckets=32, max_distance=S // 8),
            "softcap": dict(cap=30.0),
            "sliding_global": dict(window=S // 16, n_global=16),
            "dilated": dict(dilation=4, reach=S // 16),
            "neighbourhood_2d": dict(width=width, radius=max(1, width // 8)),
            "chunked": dict(chunk=S // 4),
            "window_fn": dict(left=S // 16)}


def flex_spelling(name, entry, S, H, p, dev):
    """(score_mod, mask_mod) for Flex: the entry's function written with torch ops, over
    the entry's captures as CUDA tensors."""
    cap = {}
    for fn in (entry.kwargs.get("score_mod"),):
        if isinstance(fn, aa.ScoreMod):
            cap.update({n: torch.as_tensor(np.asarray(a), device=dev)
                        for n, a in fn.captures.items()})
    mask = entry.kwargs.get("mask")
    for term in _mask_mods(mask):
        cap.update({n: torch.as_tensor(np.asarray(a), device=dev) for n, a in term.captures.items()})
    causal = lambda b, h, q, kv: kv <= q  # noqa: E731
    if name == "relative_position_bias":
        t = cap["table"]
        return (lambda s, b, h, q, kv: s + t[h, q - kv + (S - 1)]), causal
    if name == "t5_buckets":
        bucket, t = cap["bucket"], cap["table"]
        return (lambda s, b, h, q, kv: s + t[h, bucket[kv - q + (S - 1)]]), None
    if name == "alibi":
        sl = cap["slopes"]
        return (lambda s, b, h, q, kv: s - sl[h] * (q - kv).abs()), causal
    if name == "softcap":
        c = p["cap"]
        return (lambda s, b, h, q, kv: c * torch.tanh(s / c)), None
    if name == "prefix_lm":
        pre = cap["prefix"]
        return None, (lambda b, h, q, kv: (kv <= q) | (kv < pre[b]))
    if name == "document_causal":
        doc = cap["doc"]
        return None, (lambda b, h, q, kv: (doc[b, q] == doc[b, kv]) & (kv <= q))
    if name == "sliding_global":
        w, g = p["window"], p["n_global"]
        return None, (lambda b, h, q, kv: ((q - kv).abs() <= w) | (kv < g) | (q < g))
    if name == "dilated":
        dl, r = p["dilation"], p["reach"]

        def dil(b, h, q, kv):
            d = q - kv
            return (d >= 0) & (d % dl == 0) & (d // dl <= r)
        return None, dil
    if name == "neighbourhood_2d":
        w, r = p["width"], p["radius"]
        return None, (lambda b, h, q, kv: ((q // w - kv // w).abs() <= r)
                      & ((q % w - kv % w).abs() <= r))
    if name == "chunked":
        c = p["chunk"]
        return None, (lambda b, h, q, kv: (q // c == kv // c) & (kv <= q))
    if name == "causal_fn":
        return None, causal
    if name == "window_fn":
        left = p["left"]
        return None, (lambda b, h, q, kv: (kv <= q) & (q - kv <= left))
    if name == "tanh_gate":
        temp = cap["temp"]
        return (lambda s, b, h, q, kv: torch.where(kv <= q, s * temp[h], -float("inf"))), None
    raise KeyError(name)


def _mask_mods(mask):
    if mask is None:
        return []
    if isinstance(mask, aa.MaskMod):
        return [mask]
    out = []
    for part in getattr(mask, "terms", ()):
        out += _mask_mods(part)
    return out


class _Skipped(Exception):
    """--no-flex: FlexAttention is not timed."""


def timed(fn, reps):
    fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def first_call(fn):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def alt_tile(spec, D, dtype, fwd, both, reps):
    """anyattn's times with one kernel's tile replaced (``KERNEL=BM,BN,WARPS,STAGES``,
    configs.set_override, dropped after); the forward is timed only for a fwd tile."""
    from anyattn.backends.triton import configs

    kernel, tile = spec.split("=")
    bm, bn, warps, stages = (int(x) for x in tile.split(","))
    field = {"fwd": "fwd", "dkdv": "dkdv", "dq": "dq"}[kernel]
    dp = configs.padded_dim(D)
    precisions = ("highest", "tf32")
    for prec in precisions:
        configs.set_override(dp, dtype, prec,
                             **{field: configs.KernelConfig(bm, bn, warps, stages)})
    try:
        out = {"fwd_ms": round(timed(fwd, reps), 3)} if kernel == "fwd" else {}
        out["fwd_bwd_ms"] = round(timed(both, reps), 3)
        return out
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}
    finally:
        for prec in precisions:
            configs.set_override(dp, dtype, prec)


def to_device(kw, dev):
    return {n: (torch.as_tensor(x, device=dev) if isinstance(x, np.ndarray) and n in
                ("bias", "alibi_slopes") else x) for n, x in kw.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seqs", default="4096,8192")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=4, help="B (0: 16k tokens, B = 16384 // S)")
    ap.add_argument("--only", default="", help="comma-separated entry names")
    ap.add_argument("--out", default=".")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--alt", action="append", default=[],
                    help="KERNEL=BM,BN,WARPS,STAGES (KERNEL: fwd, dkdv or dq; repeatable): "
                         "also time anyattn with that kernel's tile in place of the plan's "
                         "(row['alt'][spec] = {fwd_ms, fwd_bwd_ms}; at the first of --seqs)")
    ap.add_argument("--no-flex", action="store_true", help="time anyattn only")
    ap.add_argument("--device", default="cuda",
                    help="cpu: a dry run of the script (TRITON_INTERPRET=1, small --seqs)")
    a = ap.parse_args()
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    gallery = load_gallery()
    flex = torch.compile(flex_attention)
    dev, dt, H, D = a.device, getattr(torch, a.dtype), a.heads, a.dim
    if dev == "cpu":
        torch.cuda.synchronize = lambda: None
    os.makedirs(a.out, exist_ok=True)
    path = os.path.join(a.out, f"gallery_vs_flex_{a.dtype}.json")
    res = {"meta": dict(torch=torch.__version__, device=(torch.cuda.get_device_name() if dev == "cuda" else dev),
                        dtype=a.dtype, H=H, D=D, reps=a.reps,
                        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                        timing="CUDA-synchronised host medians, one process"),
           "rows": []}
    names = [n for n in gallery.GALLERY if not a.only or n in a.only.split(",")]
    first_seq = int(a.seqs.split(",")[0])
    for S in (int(s) for s in a.seqs.split(",")):
        B = a.batch or max(1, 16384 // S)
        g = torch.Generator(device="cpu").manual_seed(0)
        q, k, v, do = (torch.randn(B, H, S, D, generator=g).to(dev, dt) for _ in range(4))
        for name in names:
            make, _square = gallery.GALLERY[name]
            p = sizes(S).get(name, {})
            entry = make(B, H, S, S, np.random.default_rng(0), **p)
            row = dict(entry=name, B=B, H=H, S=S, D=D, params=p)
            try:
                kw = entry.kwargs
                fwd = lambda: aa.attention(q, k, v, backend="triton", **kw)  # noqa: E731
                both = lambda: aa.attention_backward(q, k, v, do, wrt=("q", "k", "v"),  # noqa: E731
                                                     backend="triton", **kw)
                row["first_fwd_s"] = round(first_call(fwd), 3)
                row["first_fwd_bwd_s"] = round(first_call(both), 3)
                row["fwd_ms"] = round(timed(fwd, a.reps), 3)
                row["fwd_bwd_ms"] = round(timed(both, a.reps), 3)
                if entry.kwargs.get("mask") is not None:
                    # the tile maps' build: a forward with the block cache cleared, less
                    # the warm forward (the maps are what the cache holds)
                    def cold():
                        tri_programs._block_cache.clear()
                        fwd()
                    row["tile_map_ms"] = round(timed(cold, 3) - row["fwd_ms"], 3)
                if a.alt and S == first_seq:
                    row["alt"] = {spec: alt_tile(spec, D, a.dtype, fwd, both, a.reps)
                                  for spec in a.alt}
                if entry.builtin is not None:
                    bkw = to_device(entry.builtin, dev)
                    row["builtin_fwd_ms"] = round(timed(
                        lambda: aa.attention(q, k, v, backend="triton", **bkw), a.reps), 3)
                    row["builtin_fwd_bwd_ms"] = round(timed(
                        lambda: aa.attention_backward(q, k, v, do, wrt=("q", "k", "v"),
                                                      backend="triton", **bkw), a.reps), 3)
            except Exception as exc:
                row["anyattn_error"] = f"{type(exc).__name__}: {exc}"[:300]
            try:
                if a.no_flex:
                    raise _Skipped
                smod, mmod = flex_spelling(name, entry, S, H, p, dev)
                bm = None
                if mmod is not None:
                    row["flex_block_mask_ms"] = round(timed(
                        lambda: create_block_mask(mmod, B, None, S, S, device=dev), 3), 3)
                    bm = create_block_mask(mmod, B, None, S, S, device=dev)
                qf, kf, vf = (x.detach().requires_grad_(True) for x in (q, k, v))

                def fx_fwd():
                    with torch.no_grad():
                        flex(qf, kf, vf, score_mod=smod, block_mask=bm)

                def fx_both():
                    o = flex(qf, kf, vf, score_mod=smod, block_mask=bm)
                    o.backward(do)

                row["flex_first_s"] = round(first_call(fx_both), 3)
                row["flex_fwd_ms"] = round(timed(fx_fwd, a.reps), 3)
                row["flex_fwd_bwd_ms"] = round(timed(fx_both, a.reps), 3)
                with torch.no_grad():
                    o_flex = flex(qf, kf, vf, score_mod=smod, block_mask=bm).float()
                if "fwd_ms" in row:
                    o_ours = torch.as_tensor(fwd()).float()
                    row["fwd_max_abs_diff_vs_flex"] = float((o_ours - o_flex).abs().max())
                    row["fwd_vs_flex"] = round(row["fwd_ms"] / row["flex_fwd_ms"], 3)
                    row["fwd_bwd_vs_flex"] = round(row["fwd_bwd_ms"] / row["flex_fwd_bwd_ms"], 3)
            except _Skipped:
                pass
            except Exception as exc:
                row["flex_error"] = f"{type(exc).__name__}: {exc}"[:300]
            res["rows"].append(row)
            print(json.dumps(row), flush=True)
            with open(path, "w") as f:
                json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
