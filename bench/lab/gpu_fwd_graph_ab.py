"""Hopper forward configs side by side in device time: each named config (configs'
FWD_VARIANTS / FWD_PERSIST_VARIANTS names) beside the routed one and SDPA-cuDNN, CUDA-graph replays
(triton.testing.do_bench_cudagraph), rounds in rotating order; outputs checked bitwise
against the routed config's (the same numerics by construction).

Shape legend: B batch, H heads, S = Sq = Sk, D head dim.  FLOPs: FlashAttention's
convention (4*B*H*S*S*D, causal half).

    python bench/lab/gpu_fwd_graph_ab.py --out OUT --configs ws128x128s2opfPg [--rounds 3]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))

#: name -> (B, H, S, D, causal)
CASES = {"d128n2k": (8, 16, 2048, 128, False), "d128c2k": (8, 16, 2048, 128, True),
         "d128n4k": (4, 16, 4096, 128, False), "d128c4k": (4, 16, 4096, 128, True),
         "d128n8k": (2, 16, 8192, 128, False), "d128c8k": (2, 16, 8192, 128, True)}


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--configs", required=True, help="comma-separated HopperConfig names")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    import torch
    import triton
    import triton.testing
    from torch.nn.attention import SDPBackend, sdpa_kernel

    import anyattn as aa
    from anyattn.backends.triton.hopper import configs as HC
    from anyattn.backends.triton.hopper import launch as HL
    from anyattn.problem import describe

    os.makedirs(a.out, exist_ok=True)
    pool = {c.name: c for d in (64, 128)
            for c in HC.FWD_VARIANTS[d] + HC.FWD_PERSIST_VARIANTS[d]}
    cfgs = [pool[n] for n in a.configs.split(",")]
    res = dict(meta=dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                         gpu=torch.cuda.get_device_name(), torch=torch.__version__,
                         triton=triton.__version__, flops="FA convention, causal half",
                         timing="do_bench_cudagraph medians, rounds rotated"), rows=[])
    for name in a.cases.split(","):
        B, H, S, D, causal = CASES[name]
        g = torch.Generator(device="cuda").manual_seed(5)
        q, k, v = (torch.randn(B, H, S, D, device="cuda", generator=g).to(torch.bfloat16)
                   for _ in range(3))
        p = describe(q, k, v, mask=aa.Causal() if causal else None)
        fns = {"routed": lambda: HL.forward(p, q, k, v)}
        for c in cfgs:
            fns[c.name] = lambda c=c: HL.forward(p, q, k, v, cfg=c)

        def cudnn():
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        fns["cudnn"] = cudnn
        ref = fns["routed"]()[0]
        bitwise = {n: bool(torch.equal(fns[n]()[0], ref)) for n in fns if n not in ("routed", "cudnn")}
        names = list(fns)
        per = {n: [] for n in names}
        for r in range(a.rounds):
            for n in names[r % len(names):] + names[:r % len(names)]:
                per[n].append(triton.testing.do_bench_cudagraph(fns[n], rep=100,
                                                                 return_mode="median"))
        fl = 4.0 * B * H * S * S * D * (0.5 if causal else 1.0)
        row = dict(case=name, B=B, H=H, S=S, D=D, causal=causal, bitwise=bitwise, rounds_ms=per,
                   tflops={n: round(fl / sorted(v)[len(v) // 2] / 1e9, 1) for n, v in per.items()})
        res["rows"].append(row)
        print(f"fwd {name}: " + " ".join(f"{n}={t}" for n, t in row["tflops"].items())
              + f" bitwise={bitwise} every-round: "
              + " ".join(f"{n}<routed:{max(per[n]) < min(per['routed'])}" for n in names[1:-1]),
              flush=True)
        with open(os.path.join(a.out, "fwd_graph_ab.json"), "w") as f:
            json.dump(res, f, indent=1)
        fns.clear()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
