"""anyattn.flash_attn on CUDA: flash_attn_varlen_func fwd + bwd on a packed batch of
random lengths beside the same Documents mask through anyattn.torch.attention, Sq != Sk
per sequence, and flash_attn_with_kvcache decoding (Sq = 1) with equal and ragged cache
lengths.  Writes JSON (``--out``).

``--decode``: instead, the decoding grid of issue 35 (Sq = 1, cache 4k-128k, B 1-32,
Hq = 32, Hkv = 8, D = 128, bf16) through anyattn.torch.attention ([B, H, S, D], GQA,
no mask: every cache key) beside SDPA's fastest backend on the same call
(enable_gqa=True; backends that refuse it are listed as such): milliseconds, GB/s of
K + V (+ q, out) read and written, and that as a fraction of the device's peak
memory bandwidth (from its memory clock and bus width, or ``--peak-gbps``); with the
route's key splits (route.decode_splits) of each shape."""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

import anyattn.flash_attn as fa  # noqa: E402
import anyattn.torch as at  # noqa: E402
from anyattn import Causal, Documents  # noqa: E402


def timed(fn, reps: int) -> float:
    """Milliseconds per call after 3 warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / reps * 1e3


#: peak memory bandwidth (GB/s) by device name, where the properties lack the memory clock
PEAK_GBPS = {"H100 80GB HBM3": 3352.0, "H100 PCIe": 2039.0, "H200": 4800.0,
             "A100-SXM4-80GB": 2039.0, "A100-SXM4-40GB": 1555.0}


def peak_gbps(given) -> float:
    """The device's peak memory bandwidth in GB/s: ``given``, else 2 * memory clock * bus
    width (HBM: two transfers a clock), else PEAK_GBPS by name."""
    if given:
        return float(given)
    props = torch.cuda.get_device_properties(0)
    clock_khz = getattr(props, "memory_clock_rate", 0)
    bus_bits = getattr(props, "memory_bus_width", 0)
    if clock_khz and bus_bits:
        return 2.0 * clock_khz * 1e3 * bus_bits / 8 / 1e9
    for name, gbps in PEAK_GBPS.items():
        if name in props.name:
            return gbps
    raise SystemExit(f"--peak-gbps: no peak bandwidth known for {props.name!r}; pass it")


def decode_grid(args) -> dict:
    """The --decode grid (module doc)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from anyattn.backends.triton import route as triton_route

    dev, dt, Hq, Hkv, D = "cuda", torch.bfloat16, 32, 8, 128
    peak = peak_gbps(args.peak_gbps)
    facts = triton_route.device_facts(torch.device(dev))
    res = {"device": torch.cuda.get_device_name(), "peak_GBps": peak, "Hq": Hq, "Hkv": Hkv,
           "head_dim": D, "dtype": "bfloat16", "cases": []}
    backends = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
                "cudnn": SDPBackend.CUDNN_ATTENTION}
    for L in args.caches:
        for B in args.batches:
            if 2 * B * Hkv * L * D * 2 > args.max_gib * 2 ** 30:
                continue
            k = torch.randn(B, Hkv, L, D, device=dev, dtype=dt)
            v = torch.randn_like(k)
            q = torch.randn(B, Hq, 1, D, device=dev, dtype=dt)
            moved = (2 * B * Hkv * L * D + 2 * B * Hq * D) * 2          # bytes: K, V, q, out
            problem = triton_route.ProblemFacts(batch=B, heads_q=Hq, heads_kv=Hkv, seq_q=1,
                                                seq_k=L, head_dim=D, dtype="bfloat16")
            ns, _, hp, why = triton_route.decode_splits(problem, facts)
            routed = triton_route.route(problem, "forward", facts)
            ours = at.attention(q, k, v, backend="triton")
            theirs = torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)
            ms = timed(lambda: at.attention(q, k, v, backend="triton"), args.reps)
            row = {"B": B, "L": L, "route": f"{routed.path} {routed.config}", "splits": ns,
                   "pack": hp, "why": why,
                   "max_abs_diff_vs_sdpa": float((ours.float() - theirs.float()).abs().max()),
                   "anyattn_ms": ms,
                   "anyattn_GBps": moved / ms / 1e6, "anyattn_peak": moved / ms / 1e6 / peak}
            for name, be in backends.items():
                try:
                    with sdpa_kernel([be]):
                        t = timed(lambda: torch.nn.functional.scaled_dot_product_attention(
                            q, k, v, enable_gqa=True), args.reps)
                except RuntimeError as e:                 # the backend refuses the call
                    row[f"sdpa_{name}"] = f"refused: {str(e).splitlines()[0][:120]}"
                    continue
                row[f"sdpa_{name}_ms"] = t
            times = {n: row[f"sdpa_{n}_ms"] for n in backends if f"sdpa_{n}_ms" in row}
            if times:
                best = min(times, key=times.get)
                row["sdpa_best"] = best
                row["sdpa_best_GBps"] = moved / times[best] / 1e6
                row["anyattn_vs_sdpa_best"] = times[best] / ms     # >= 1: anyattn faster
            print(json.dumps(row), flush=True)
            res["cases"].append(row)
            k = v = q = None                      # freed before the next shape
            torch.cuda.empty_cache()
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--out", default="flash_attn_bench.json")
    ap.add_argument("--decode", action="store_true",
                    help="the decoding grid instead (module doc)")
    ap.add_argument("--caches", type=int, nargs="+",
                    default=[4096, 16384, 32768, 131072], help="--decode: cache lengths")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 8, 16, 32],
                    help="--decode: batch sizes")
    ap.add_argument("--max-gib", type=float, default=40.0,
                    help="--decode: skip shapes whose K + V exceed this many GiB")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--peak-gbps", type=float, default=None,
                    help="--decode: the device's peak memory bandwidth (default: from its "
                    "properties)")
    args = ap.parse_args()
    if args.decode:
        res = decode_grid(args)
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
        return
    dev, dt, H, D = "cuda", torch.bfloat16, args.heads, args.head_dim
    rng = np.random.default_rng(0)
    lengths = []
    while sum(lengths) < args.tokens:
        lengths.append(int(rng.integers(128, 4096)))
    lengths[-1] -= sum(lengths) - args.tokens
    lq = np.array(lengths)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lq)]), dtype=torch.int32, device=dev)
    T, m = int(lq.sum()), int(lq.max())
    q, k, v = (torch.randn(T, H, D, device=dev, dtype=dt, requires_grad=True) for _ in range(3))
    g = torch.randn(T, H, D, device=dev, dtype=dt)
    ids = torch.from_numpy(np.repeat(np.arange(lq.size), lq))
    res = {"device": torch.cuda.get_device_name(), "lengths": lengths, "heads": H,
           "head_dim": D}

    def varlen():
        out = fa.flash_attn_varlen_func(q, k, v, cu, cu, m, m, causal=True)
        torch.autograd.grad(out, (q, k, v), g)

    def direct():
        out = at.attention(q[None], k[None], v[None], layout="bshd",
                           mask=Causal() & Documents(ids))
        torch.autograd.grad(out, (q, k, v), g[None])

    res["varlen_fwd_bwd_ms"] = timed(varlen, 10)
    res["direct_documents_fwd_bwd_ms"] = timed(direct, 10)
    lk = lq + rng.integers(0, 256, lq.size)
    cuk = torch.tensor(np.concatenate([[0], np.cumsum(lk)]), dtype=torch.int32, device=dev)
    k2, v2 = (torch.randn(int(lk.sum()), H, D, device=dev, dtype=dt, requires_grad=True)
              for _ in range(2))

    def slots():
        out = fa.flash_attn_varlen_func(q, k2, v2, cu, cuk, m, int(lk.max()), causal=True)
        torch.autograd.grad(out, (q, k2, v2), g)

    res["varlen_sq_ne_sk_fwd_bwd_ms"] = timed(slots, 10)
    for B, L in ((8, 4096), (8, 32768)):
        kc = torch.randn(B, L + 16, 8, D, device=dev, dtype=dt)
        vc = torch.randn_like(kc)
        qd = torch.randn(B, 1, 32, D, device=dev, dtype=dt)
        ms = timed(lambda: fa.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=L,
                                                      causal=True), 20)
        res[f"decode_B{B}_L{L}_ms"] = ms
        res[f"decode_B{B}_L{L}_GBps"] = 2 * B * L * 8 * D * 2 / ms / 1e6   # K and V read
        ragged = torch.full((B,), L, dtype=torch.int32, device=dev)
        ragged[0] -= 7
        res[f"decode_ragged_B{B}_L{L}_ms"] = timed(
            lambda: fa.flash_attn_with_kvcache(qd, kc, vc, cache_seqlens=ragged, causal=True),
            20)
    print(json.dumps(res, indent=1))
    with open(args.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
