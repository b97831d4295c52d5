"""GPU: the Hopper forward at D = 256 (covered, not routed by 'auto') beside the portable
Triton forward and SDPA's cuDNN and flash backends, one process.

    PYTHONUNBUFFERED=1 python bench/lab/hopper_d256_fwd.py --json OUT.json

bf16, H = 16, B·S = 16k tokens, no mask and causal.  Each anyattn row first checks its
output against the float64 reference at (1, 2, 300, 257) (relative error over the
largest magnitude) and against SDPA's at the timed shape.  Forward only, do_bench
medians; FLOPs 4·B·H·S²·D, causal 1/2.  The rows say whether 'auto' should route
D = 256 forwards to Hopper (hopper faster than portable, and ≥ 1.0× the best SDPA).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "src"))
sys.path.insert(0, os.path.join(HERE, ".."))

from gpu_harness import log, rel  # noqa: E402

D = 256
SHAPES = [(4, 16, 4096), (2, 16, 8192)]


def _path_call(path):
    import anyattn as aa
    from anyattn.backends.triton import launch as triton_launch

    def call(q, k, v, causal):
        os.environ["ANYATTN_TRITON_PATH"] = path
        return aa.attention(q, k, v, mask=aa.Causal() if causal else None, backend="triton")
    triton_launch.clear_prepared()
    return call


def _sdpa(backend):
    import torch
    from torch.nn.attention import sdpa_kernel

    def call(q, k, v, causal):
        with sdpa_kernel([backend]):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return call


def main():
    import torch
    import triton
    from torch.nn.attention import SDPBackend

    import anyattn as aa
    from anyattn import reference

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    args = ap.parse_args()
    impls = {"hopper": _path_call("hopper"), "portable": _path_call("portable"),
             "sdpa-cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION),
             "sdpa-flash": _sdpa(SDPBackend.FLASH_ATTENTION)}
    res = {"meta": {"device": torch.cuda.get_device_name(), "D": D, "dtype": "bfloat16",
                    "torch": torch.__version__, "triton": triton.__version__},
           "check": [], "bench": []}

    def save():
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)

    gen = torch.Generator(device="cuda").manual_seed(0)
    for causal in (False, True):
        q, k, v = (torch.randn(1, 2, n, D, device="cuda", generator=gen).bfloat16()
                   for n in (300, 257, 257))
        ro, _ = reference.forward(*(x.double().cpu().numpy() for x in (q, k, v)),
                                  mask=aa.Causal() if causal else None)
        for name in ("hopper", "portable"):
            try:
                got = impls[name](q, k, v, causal)
                err = rel(got, torch.from_numpy(ro).cuda())
            except Exception as exc:              # recorded, the run goes on
                err = f"{type(exc).__name__}: {exc}"[:300]
            res["check"].append(dict(impl=name, causal=causal, rel_err_vs_f64=err))
            log("CHECK", res["check"][-1])
    save()
    for b, h, s in SHAPES:
        for causal in (False, True):
            q, k, v = (torch.randn(b, h, s, D, device="cuda", generator=gen).bfloat16()
                       for _ in range(3))
            flops = 4.0 * b * h * s * s * D / (2 if causal else 1)
            ref = impls["sdpa-cudnn"](q, k, v, causal)
            for name, fn in impls.items():
                row = dict(impl=name, B=b, H=h, S=s, causal=causal)
                try:
                    out = fn(q, k, v, causal)
                    row["rel_vs_cudnn"] = rel(out, ref)
                    ms = triton.testing.do_bench(lambda: fn(q, k, v, causal), warmup=10,
                                                 rep=50, return_mode="median")
                    row.update(ms=round(ms, 4), tflops=round(flops / ms / 1e9, 1))
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                res["bench"].append(row)
                log("BENCH", json.dumps(row))
                save()
    os.environ.pop("ANYATTN_TRITON_PATH", None)


if __name__ == "__main__":
    main()
