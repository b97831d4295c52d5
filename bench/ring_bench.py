"""Ring (context-parallel) attention on N devices: tokens/s and scaling efficiency.

    torchrun --nproc_per_node 8 bench/ring_bench.py --out dev/perf/ring_8gpu.json
    python bench/ring_bench.py --nprocs 8 ...            # the same, through mp.spawn
    python bench/ring_bench.py --nprocs 2 --device cpu --dtype float32 --backend numpy \\
        --seqs 256,512 --heads 2 --head-dim 16           # CPU/gloo smoke run

For each global length S (default 32k ... 512k; D=128, bf16, causal, zig-zag):
  * ring forward and forward+backward over N ranks (NCCL on GPUs, gloo on CPUs);
    a step's time is the slowest rank's (all-reduce MAX);
  * the single-device kernel (``anyattn.attention``, the same backend) at the
    per-device shard size S/N, causal, run on every rank at once (no communication);
  * with ``--strong``, the single-device kernel at the full S too (if it fits).

FLOPs by the FlashAttention convention: forward 4*B*H*S^2*D, backward 2.5x,
forward+backward 3.5x, a causal mask halves them.  Per-device TFLOP/s of the
ring = FLOPs(S) / N / time.  ``efficiency`` = ring per-device TFLOP/s over the
single-device kernel's TFLOP/s at the shard size S/N (the issue's target:
>= 0.90 from 1 to 8 GPUs at S = 128k causal); ``strong_efficiency`` =
time_1(S) / (N * time_N(S)).  Every timing is the median of ``--iters`` runs
after ``--warmup`` runs.  ``--check`` first compares the ring with the single-device
kernel on the gathered sequence at a small S (relative max-abs error).
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import os
import socket
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))


def _parse_len(s: str) -> int:
    s = s.strip().lower()
    return int(s[:-1]) * 1024 if s.endswith("k") else int(s)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nprocs", type=int, default=None,
                    help="spawn this many ranks (omit under torchrun)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default=None,
                    help="default: cuda if available")
    ap.add_argument("--seqs", default="32k,64k,128k,256k,512k", help="global lengths S")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=None)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--mask", choices=("causal", "none"), default="causal")
    ap.add_argument("--sharding", choices=("zigzag", "contiguous"), default="zigzag")
    ap.add_argument("--backend", default=None, help="anyattn backend (default: automatic)")
    ap.add_argument("--modes", default="fwd,fwd+bwd")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--strong", action="store_true",
                    help="also time one device at the full S (strong scaling)")
    ap.add_argument("--check", action="store_true", help="correctness check at a small S first")
    ap.add_argument("--check-seq", type=int, default=8192)
    ap.add_argument("--out", default=None, help="JSON path (rank 0 writes it)")
    ap.add_argument("--png", default=None, help="plot of efficiency vs S (rank 0)")
    return ap.parse_args(argv)


def flops(B, H, S, D, causal, mode):
    f = 4.0 * B * H * S * S * D * (0.5 if causal else 1.0)
    return f * {"fwd": 1.0, "fwd+bwd": 3.5}[mode]


# ------------------------------------------------------------------------ timing
def _sync(dev):
    import torch

    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time(fn, dev, warmup, iters, group_max=True):
    """Median seconds of ``fn()``; across ranks the slowest rank's time each run."""
    import torch
    import torch.distributed as dist

    for _ in range(warmup):
        fn()
    _sync(dev)
    ts = []
    for _ in range(iters):
        dist.barrier()
        _sync(dev)
        t0 = time.perf_counter()
        fn()
        _sync(dev)
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64,
                         device=dev if dist.get_backend() == "nccl" else "cpu")
        if group_max:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        ts.append(float(t.item()))
    return statistics.median(ts)


def _all_ok(flag: bool, dev) -> bool:
    """True iff every rank's flag is True (keeps ranks in step after an OOM)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([0 if flag else 1], device=dev if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item()) == 0


def _attempt(fn, dev):
    """(ok, value): run ``fn``; an out-of-memory error on any rank -> ok False on all."""
    import torch

    try:
        val, ok = fn(), True
    except torch.cuda.OutOfMemoryError:
        val, ok = None, False
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return (True, val) if _all_ok(ok, dev) else (False, None)


# ----------------------------------------------------------------------- the work
def _inputs(args, S, dev, dt, requires_grad, seed=0):
    import torch

    g = torch.Generator(device=dev).manual_seed(seed)
    hkv = args.kv_heads or args.heads
    shp_q = (args.batch, args.heads, S, args.head_dim)
    shp_k = (args.batch, hkv, S, args.head_dim)
    mk = lambda shp: torch.randn(shp, generator=g, device=dev, dtype=dt).requires_grad_(
        requires_grad)
    return mk(shp_q), mk(shp_k), mk(shp_k), torch.randn(shp_q, generator=g, device=dev, dtype=dt)


def _ring_step(args, mask, q, k, v, dout, mode):
    from anyattn.distributed import ring_attention

    def fwd():
        import torch

        with torch.no_grad():
            ring_attention(q, k, v, mask=mask, sharding=args.sharding, backend=args.backend)

    def fwdbwd():
        for x in (q, k, v):
            x.grad = None
        out = ring_attention(q, k, v, mask=mask, sharding=args.sharding, backend=args.backend)
        out.backward(dout)

    return fwd if mode == "fwd" else fwdbwd


def _single_step(args, mask, q, k, v, dout, mode):
    import anyattn
    import torch

    def fwd():
        anyattn.attention(q.detach(), k.detach(), v.detach(), mask=mask, backend=args.backend)

    def fwdbwd():
        out, lse = anyattn.attention(q.detach(), k.detach(), v.detach(), mask=mask,
                                     backend=args.backend, return_lse=True)
        anyattn.attention_backward(q.detach(), k.detach(), v.detach(), dout, out=out, lse=lse,
                                   mask=mask, backend=args.backend)

    return fwd if mode == "fwd" else fwdbwd


def _check(args, rank, world, dev, dt, mask):
    """Ring vs the single-device kernel on the gathered sequence: rel. max-abs errors."""
    import anyattn
    import torch
    from anyattn.distributed import ring_attention, shard

    S = args.check_seq
    q, k, v, g = _inputs(args, S, dev, dt, False, seed=1)
    loc = lambda x: shard(x, rank, world, sharding=args.sharding)
    ql, kl, vl = (loc(x).clone().requires_grad_() for x in (q, k, v))
    out = ring_attention(ql, kl, vl, mask=mask, sharding=args.sharding, backend=args.backend)
    out.backward(loc(g))
    q32, k32, v32, g32 = (x.float() for x in (q, k, v, g))
    ro, rl = anyattn.attention(q32, k32, v32, mask=mask, return_lse=True, backend=args.backend)
    rg = anyattn.attention_backward(q32, k32, v32, g32, out=ro, lse=rl, mask=mask,
                                    backend=args.backend)
    err = {}
    for name, got, ref in (("out", out, ro), ("dq", ql.grad, rg.dq), ("dk", kl.grad, rg.dk),
                           ("dv", vl.grad, rg.dv)):
        r = loc(ref).float()
        err[name] = float((got.detach().float() - r).abs().max() / r.abs().max())
    t = torch.tensor([err[n] for n in ("out", "dq", "dk", "dv")], dtype=torch.float64,
                     device=dev if torch.distributed.get_backend() == "nccl" else "cpu")
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return {"seq": S, "reference": "single-device anyattn, float32 inputs",
            **dict(zip(("out", "dq", "dk", "dv"), (float(x) for x in t.tolist())))}


def bench(args, rank, world, dev):
    import torch
    from anyattn import Causal

    dt = getattr(torch, args.dtype)
    mask = Causal() if args.mask == "causal" else None
    causal = args.mask == "causal"
    modes = [m for m in args.modes.split(",") if m]
    res = {"date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
           "world": world, "device": (torch.cuda.get_device_name(dev) if dev.type == "cuda"
                                      else "cpu"),
           "torch": torch.__version__, "args": vars(args), "flop_convention":
           "FA: fwd 4*B*H*S^2*D, fwd+bwd 3.5x, causal 1/2", "cases": []}
    if args.check:
        res["check"] = _check(args, rank, world, dev, dt, mask)
        if rank == 0:
            print("check", res["check"], flush=True)
    for S in (_parse_len(s) for s in args.seqs.split(",")):
        if S % (2 * world if args.sharding == "zigzag" else world):
            continue
        S_loc = S // world
        for mode in modes:
            case = {"S": S, "S_per_device": S_loc, "mode": mode}
            ok, tens = _attempt(lambda: _inputs(args, S, dev, dt, mode != "fwd"), dev)
            if ok:
                from anyattn.distributed import shard

                q, k, v, g = (shard(x, rank, world, sharding=args.sharding).detach()
                              .clone() for x in tens)
                del tens
                for x in (q, k, v):
                    x.requires_grad_(mode != "fwd")
                ok, t_ring = _attempt(lambda: _time(_ring_step(args, mask, q, k, v, g, mode),
                                                    dev, args.warmup, args.iters), dev)
                ok1, t_one = _attempt(lambda: _time(_single_step(args, mask, q, k, v, g, mode),
                                                    dev, args.warmup, args.iters), dev)
                del q, k, v, g
            if not ok:
                case["ring"] = "out of memory"
                res["cases"].append(case)
                continue
            f = flops(args.batch, args.heads, S, args.head_dim, causal, mode)
            f_loc = flops(args.batch, args.heads, S_loc, args.head_dim, causal, mode)
            case.update({
                "ring_s": t_ring, "tokens_per_s": args.batch * S / t_ring,
                "tokens_per_s_per_device": args.batch * S / t_ring / world,
                "ring_tflops_per_device": f / world / t_ring / 1e12,
            })
            if ok1:
                case.update({"single_shard_s": t_one,
                             "single_shard_tflops": f_loc / t_one / 1e12,
                             "efficiency": (f / world / t_ring) / (f_loc / t_one)})
            if args.strong:
                okf, tens = _attempt(lambda: _inputs(args, S, dev, dt, False), dev)
                t_full = None
                if okf:
                    qf, kf, vf, gf = tens
                    okf, t_full = _attempt(lambda: _time(_single_step(args, mask, qf, kf, vf, gf,
                                                                      mode), dev, args.warmup,
                                                         args.iters), dev)
                    del qf, kf, vf, gf, tens
                if okf:
                    case.update({"single_full_s": t_full,
                                 "strong_efficiency": t_full / (world * t_ring)})
                else:
                    case["single_full_s"] = "out of memory"
            res["cases"].append(case)
            if rank == 0:
                print(json.dumps(case), flush=True)
    return res


def _plot(res, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for mode in sorted({c["mode"] for c in res["cases"]}):
        pts = [(c["S"], c["efficiency"]) for c in res["cases"]
               if c["mode"] == mode and "efficiency" in c]
        if pts:
            ax.plot([p[0] / 1024 for p in pts], [p[1] for p in pts], "o-", label=mode)
    ax.axhline(0.9, color="grey", ls=":", label="target 0.90")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("global S (k tokens)")
    ax.set_ylabel("per-device TFLOP/s / single-device at S/N")
    ax.set_title(f"ring attention, {res['world']} x {res['device']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(rank, world, args, port=None):
    import torch
    import torch.distributed as dist

    if port is not None:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                          WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    use_cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    local = int(os.environ.get("LOCAL_RANK", rank))
    if use_cuda:
        torch.cuda.set_device(local)
        dev = torch.device("cuda", local)
    else:
        dev = torch.device("cpu")
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world,
                            **({"device_id": dev} if use_cuda else {}))
    try:
        res = bench(args, rank, world, dev)
        if rank == 0 and args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(res, f, indent=1)
        if rank == 0 and args.png:
            _plot(res, args.png)
    finally:
        dist.destroy_process_group()


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    a = parse_args()
    if a.nprocs:
        import torch.multiprocessing as mp

        mp.spawn(main, args=(a.nprocs, a, _free_port()), nprocs=a.nprocs)
    else:   # torchrun
        main(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), a)
