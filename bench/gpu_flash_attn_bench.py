"""anyattn.flash_attn on CUDA: flash_attn_varlen_func fwd + bwd on a packed batch of
random lengths beside the same Documents mask through anyattn.torch.attention, Sq != Sk
per sequence, and flash_attn_with_kvcache decoding (Sq = 1) with equal and ragged cache
lengths.  Writes JSON (``--out``)."""
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--out", default="flash_attn_bench.json")
    args = ap.parse_args()
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
