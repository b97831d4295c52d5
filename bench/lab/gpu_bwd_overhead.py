"""The Hopper backward's fixed cost per program, from a line fit over the query length.

Shape legend: B batch, H heads (H = Hkv), Sq / Sk queries / keys, D head dim.

The routed backward runs one program per (key tile, b, kv head), each walking every query
tile: at a fixed Sk (so a fixed grid and fixed waves of programs) its time is
T(Sq) = a + b * Sq, the slope the per-query-tile work, the intercept each program's fixed
cost (prologue: barriers, the K / V loads; epilogue: dK / dV conversion and stores; the dQ
writer's drain) times the number of waves, plus the launch.  That intercept is what a
persistent backward could hide (docs/triton.md, "Next: a persistent backward").  This
script times, at every Sq of ``--sqs``, the routed kernel (``hopper.launch.backward_fused``
with the route (route.route): the dQ-inside kernel and its dq conversion) and the same
problem's dK/dV-only kernel (no dQ writer, no turns), each as the median of
``triton.testing.do_bench``, then fits the line per kernel and reports the intercept, the
per-program fixed cost (intercept / waves, waves = programs / SMs) and that cost as a
share of the step at Sq = Sk.  Checks first: dk / dv of both kernels against each other
at every Sq (the same dK / dV math) and the dQ-inside kernel bitwise repeatable.

    PYTHONPATH=src python3 bench/lab/gpu_bwd_overhead.py --out DIR [--sk 2048]
        [--sqs 512,1024,2048,4096,8192] [--bh 4,16] [--D 128] [--causal]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "src"))

import torch  # noqa: E402
import triton.testing  # noqa: E402

import anyattn as aa  # noqa: E402
from anyattn.backends.triton import launch as TL  # noqa: E402
from anyattn.backends.triton.hopper import configs as HCF  # noqa: E402
from anyattn.backends.triton.hopper import launch as HL  # noqa: E402
from anyattn.backends.triton import route  # noqa: E402
from anyattn.problem import describe  # noqa: E402

LOG2E = 1.4426950408889634


def case(B, H, Sq, Sk, D, causal, seed=0):
    """(p, q, k, v, dout, l2, delta) of one problem: the routed forward's out and row
    statistics, a random dout, the backward preprocess's l2 / delta computed in torch."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, H, Sq, D, device="cuda", generator=g).to(torch.bfloat16)
    k, v = (torch.randn(B, H, Sk, D, device="cuda", generator=g).to(torch.bfloat16)
            for _ in range(2))
    mask = aa.Causal(align="bottom_right") if causal else None
    pf = describe(q, k, v, mask=mask)
    out, rs = TL.forward(pf, q, k, v, None)
    dout = torch.randn(out.shape, device="cuda", generator=g).to(q.dtype)
    p = describe(q, k, v, mask=mask, dout=dout, wrt=("q", "k", "v"))
    delta = (out.float() * dout.float()).sum(-1).contiguous()
    mx = torch.where(rs.max == float("-inf"), float("inf"), rs.max)
    l2 = torch.stack([mx, rs.log_norm * LOG2E], 2).contiguous()
    return p, q, k, v, dout, l2, delta


def fit(xs, ys):
    """Least-squares line y = a + b x -> (a, b, max relative residual)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    a = my - b * mx
    res = max(abs(a + b * x - y) / y for x, y in zip(xs, ys))
    return a, b, res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--sk", type=int, default=2048)
    ap.add_argument("--sqs", default="512,1024,2048,4096,8192")
    ap.add_argument("--bh", default="4,16")
    ap.add_argument("--D", type=int, default=128)
    ap.add_argument("--causal", action="store_true",
                    help="bottom-right causal (every query tile of a key tile's range "
                         "still visited: the slope stays the per-tile work)")
    ap.add_argument("--rep", type=int, default=100, help="do_bench's rep (ms)")
    a = ap.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    B, H = (int(x) for x in a.bh.split(","))
    sqs = [int(x) for x in a.sqs.split(",")]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows, t0 = [], time.time()
    for Sq in sqs:
        p, q, k, v, dout, l2, delta = case(B, H, Sq, a.sk, a.D, a.causal)
        cfg = route.route_call(p, "backward").hopper
        kv_only = HCF.bwd_config_dkdv_only(a.D)
        if not cfg.dq:
            raise SystemExit(f"Sk={a.sk}: the routed config {cfg.name} is dK/dV-only (more "
                             "key tiles than half the SMs); choose a smaller --sk")
        full = lambda: HL.backward_fused(p, q, k, v, dout, l2, delta, cfg=cfg)  # noqa: E731
        dkdv = lambda: HL.dkdv(p, q, k, v, dout, l2, delta)  # noqa: E731
        r1, r2, (dk2, dv2) = full(), full(), dkdv()
        same_bits = all(torch.equal(x, y) for x, y in zip(r1, r2))
        kv_err = max(float((x.float() - y.float()).abs().max() / y.float().abs().max())
                     for x, y in ((r1[1], dk2), (r1[2], dv2)))
        ms_full = triton.testing.do_bench(full, rep=a.rep, return_mode="median")
        ms_kv = triton.testing.do_bench(dkdv, rep=a.rep, return_mode="median")
        programs = -(-a.sk // cfg.bn) * B * H
        rows.append(dict(Sq=Sq, ms_full=ms_full, ms_dkdv=ms_kv, cfg=cfg.name,
                         cfg_dkdv=kv_only.name, programs=programs, waves=programs / sms,
                         same_bits=same_bits, dkdv_vs_full_rel_err=kv_err))
        print(f"Sq={Sq:6d} full {ms_full:.4f} ms  dK/dV-only {ms_kv:.4f} ms  "
              f"bits {same_bits}  dkdv err {kv_err:.1e}", flush=True)
    res = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "gpu": torch.cuda.get_device_name(), "sms": sms, "B": B, "H": H, "Sk": a.sk,
           "D": a.D, "causal": a.causal, "rows": rows, "fits": {},
           "wall_s": round(time.time() - t0, 1)}
    at_sk = min(rows, key=lambda r: abs(r["Sq"] - a.sk))
    for kind in ("full", "dkdv"):
        a0, b0, worst = fit([r["Sq"] for r in rows], [r[f"ms_{kind}"] for r in rows])
        waves = rows[0]["waves"]
        res["fits"][kind] = dict(intercept_ms=a0, ms_per_1k_queries=b0 * 1e3,
                                 max_rel_residual=worst,
                                 fixed_us_per_program=a0 * 1e3 / waves,
                                 share_of_step_at_sq_eq_sk=a0 / at_sk[f"ms_{kind}"])
        f = res["fits"][kind]
        print(f"{kind}: intercept {a0 * 1e3:.1f} us, {f['fixed_us_per_program']:.2f} us per "
              f"program ({waves:.2f} waves), {f['share_of_step_at_sq_eq_sk']:.1%} of the "
              f"step at Sq={at_sk['Sq']}; fit residual <= {worst:.1%}", flush=True)
    with open(os.path.join(a.out, "bwd-overhead.json"), "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
