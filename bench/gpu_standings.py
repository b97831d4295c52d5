"""Dense standings on one CUDA GPU: anyattn beside SDPA-cuDNN, SDPA-flash and FlexAttention.

    python bench/gpu_standings.py --out OUT_DIR                     # bf16, the full grid
    python bench/gpu_standings.py --out OUT_DIR --dtypes bf16,fp16 --no-flex
    python bench/gpu_standings.py --plot OUT_DIR/standings.json     # the PNG (no GPU needed)

One process, every implementation on the same inputs: 16k tokens (B = 16384 / S),
H = 2048 / D, D in {64, 128}, S in {2k, 4k, 8k}, causal and not.  Each implementation is
timed two ways, both with ``triton.testing.do_bench`` medians:
  eager  the user's call: ``anyattn.torch.attention`` (forward) and
         ``torch.autograd.grad`` of its output (backward), host work included;
  graph  the same two calls captured in a CUDA graph and replayed, so host work is
         gone and the time is the device's (an implementation that cannot be captured
         has no graph column).
FLOPs by the FlashAttention convention: forward 4*B*H*S*S*D, backward 2.5x, causal 1/2.
Writes standings.json (after every case) and standings.png (if matplotlib is there).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

DTYPES = {"bf16": "bfloat16", "fp16": "float16"}


def fa_flops(b, h, s, d, causal):
    f = 4.0 * b * h * s * s * d
    return f / 2 if causal else f


def implementations(no_flex: bool):
    """name -> (make(causal, S) -> attn(q, k, v))."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import anyattn
    import anyattn.torch as aat

    def ours(causal, s):
        mask = anyattn.Causal() if causal else None
        return lambda q, k, v: aat.attention(q, k, v, mask=mask)

    def sdpa(backend):
        def make(causal, s):
            def attn(q, k, v):
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            return attn
        return make

    impls = {"anyattn": ours, "sdpa-cudnn": sdpa(SDPBackend.CUDNN_ATTENTION),
             "sdpa-flash": sdpa(SDPBackend.FLASH_ATTENTION)}
    if not no_flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        torch._dynamo.config.recompile_limit = 10_000
        flex = torch.compile(flex_attention, dynamic=False)

        def make_flex(causal, s):
            bm = (create_block_mask(lambda b, h, i, j: j <= i, None, None, s, s, device="cuda")
                  if causal else None)
            return lambda q, k, v: flex(q, k, v, block_mask=bm)
        impls["flex"] = make_flex
    return impls


def time_eager(attn, q, k, v, g):
    import torch
    import triton

    fwd = triton.testing.do_bench(lambda: attn(q, k, v), warmup=15, rep=60, return_mode="median")
    o = attn(q, k, v)
    bwd = triton.testing.do_bench(lambda: torch.autograd.grad(o, (q, k, v), g, retain_graph=True),
                                  warmup=15, rep=60, return_mode="median")
    return fwd, bwd


def time_graph(attn, q, k, v, g):
    """(forward ms, backward ms) of CUDA-graph replays of the forward and of the backward."""
    import torch
    import triton

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):            # warm up outside the capture
        for _ in range(2):
            o = attn(q, k, v)
            torch.autograd.grad(o, (q, k, v), g)
    torch.cuda.current_stream().wait_stream(side)
    gf = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gf):
        o = attn(q, k, v)
    gb = torch.cuda.CUDAGraph()
    with torch.cuda.graph(gb):
        torch.autograd.grad(o, (q, k, v), g, retain_graph=True)
    fwd = triton.testing.do_bench(gf.replay, warmup=15, rep=60, return_mode="median")
    bwd = triton.testing.do_bench(gb.replay, warmup=15, rep=60, return_mode="median")
    return fwd, bwd


def run(args):
    import torch

    impls = implementations(args.no_flex)
    os.makedirs(args.out, exist_ok=True)
    path = os.path.join(args.out, "standings.json")
    doc = {"meta": dict(torch=torch.__version__, device=torch.cuda.get_device_name(),
                        cudnn=torch.backends.cudnn.version(),
                        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                        flops="FA convention: fwd 4*B*H*S*S*D, bwd 2.5x fwd, causal 1/2",
                        timing="do_bench medians; eager = host included, graph = CUDA-graph replay"),
           "rows": []}
    for dname in args.dtypes.split(","):
        dt = getattr(torch, DTYPES[dname])
        for d in (int(x) for x in args.dims.split(",")):
            h = 2048 // d
            for s in (int(x) for x in args.seqs.split(",")):
                b = max(1, 16384 // s)
                gen = torch.Generator(device="cuda").manual_seed(s + d)
                q, k, v, g = (torch.randn(b, h, s, d, device="cuda", generator=gen,
                                          dtype=torch.float32).to(dt) for _ in range(4))
                q, k, v = (x.requires_grad_(True) for x in (q, k, v))
                for causal in (False, True):
                    ff = fa_flops(b, h, s, d, causal)
                    for name, make in impls.items():
                        row = dict(impl=name, dtype=dname, D=d, S=s, B=b, H=h, causal=causal)
                        try:
                            attn = make(causal, s)
                            for mode, timer in (("eager", time_eager), ("graph", time_graph)):
                                try:
                                    fwd, bwd = timer(attn, q, k, v, g)
                                except Exception as exc:  # a capture failure is a result
                                    row[f"{mode}_error"] = f"{type(exc).__name__}: {exc}"[:200]
                                    continue
                                row.update({f"{mode}_fwd_ms": round(fwd, 4),
                                            f"{mode}_bwd_ms": round(bwd, 4),
                                            f"{mode}_fwd_tflops": round(ff / fwd / 1e9, 1),
                                            f"{mode}_bwd_tflops": round(2.5 * ff / bwd / 1e9, 1)})
                        except Exception as exc:
                            row["error"] = f"{type(exc).__name__}: {exc}"[:200]
                        doc["rows"].append(row)
                        print(json.dumps(row), flush=True)
                        with open(path, "w") as f:
                            json.dump(doc, f, indent=1)
                del q, k, v, g
                torch.cuda.empty_cache()
    plot(path)


def plot(path):
    """standings.png beside the JSON: cuDNN's time over anyattn's per case (above 1: faster),
    forward and backward, eager and graph."""
    try:
        import matplotlib
    except ImportError:
        print("matplotlib not installed: no PNG")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    doc = json.load(open(path))
    rows = doc["rows"]
    key = lambda r: (r["dtype"], r["D"], r["S"], r["causal"])  # noqa: E731
    ours = {key(r): r for r in rows if r["impl"] == "anyattn"}
    ref = {key(r): r for r in rows if r["impl"] == "sdpa-cudnn"}
    cases = [c for c in ours if c in ref]
    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for ax, part in zip(axes, ("fwd", "bwd")):
        for i, mode in enumerate(("eager", "graph")):
            vals = [ref[c].get(f"{mode}_{part}_ms", float("nan"))
                    / ours[c].get(f"{mode}_{part}_ms", float("nan")) for c in cases]
            ax.bar([x + (i - 0.5) * 0.4 for x in range(len(cases))], vals, width=0.4, label=mode)
        ax.axhline(1.0, color="k", lw=0.8)
        ax.axhline(1.05, color="g", lw=0.8, ls="--")
        ax.set_xticks(range(len(cases)),
                      [f"{c[0]} D{c[1]} {c[2] // 1024}k{' c' if c[3] else ''}" for c in cases],
                      rotation=60, fontsize=7)
        ax.set_title(f"{'forward' if part == 'fwd' else 'backward'}: cuDNN time / anyattn time",
                     fontsize=10)
    axes[0].legend(fontsize=8)
    fig.suptitle(f"{doc['meta']['device']}, {doc['meta']['date']} (dashed: 1.05x)", fontsize=9)
    fig.tight_layout()
    png = os.path.join(os.path.dirname(path), "standings.png")
    fig.savefig(png, dpi=110)
    print(f"wrote {png}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--dtypes", default="bf16")
    ap.add_argument("--dims", default="64,128")
    ap.add_argument("--seqs", default="2048,4096,8192")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--plot", metavar="JSON", help="only draw the PNG of an earlier run")
    args = ap.parse_args()
    if args.plot:
        plot(args.plot)
    else:
        run(args)


if __name__ == "__main__":
    main()
