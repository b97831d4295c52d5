"""Session 8, issue 17 round 2: a short H200 check of the 5-product backward's dS prefetch
(DSQ_PF) and its chunked scratch, WebGPU through Vulkan (bench/webgpu_s8_check.sh).

1. Bits (S=1024 D=128 f32, B=1 HQ=8; plain and causal GQA 8/2): wide-dsq with DSQ_PF ==
   wide-dsq without == wide, and wide-dsq over 2 (batch, KV head) chunks == unchunked.
2. Times (B=1 H=8 D=128 f32, device-resident plans, N submissions then a read-back, this
   process): S=4096 wide-dsq with DSQ_PF vs without (the session's measured kernel:
   8.21 ms, dQ 1.55 ms) and over 2 chunks (DSQ_MAX_BYTES = 256 MiB), per-pass ms; S=8192
   (scratch 2 GiB unchunked: the table takes wide-dsq over 2 chunks now, was wide) auto
   vs wide.  Every timed plan's results compared bitwise with the unchunked PF-off plan of
   the same size (checked against float64 in session 8's runs) or, for wide, within
   1e-5 relative.  FA FLOP convention: backward = 2.5 x 4 B H S^2 D.
Writes $OUT/webgpu-s8-check.json; prints one line per step.
"""
from __future__ import annotations

import json
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import webgpu_bench as WB  # noqa: E402

import anyattn as aa  # noqa: E402
from anyattn.backends.registry import get_backend  # noqa: E402
from anyattn.backends.webgpu import launch  # noqa: E402

T0 = time.time()
#: S8_CHECK_SMALL=1: tiny sizes (a smoke test of this script on lavapipe)
SMALL = bool(os.environ.get("S8_CHECK_SMALL"))
SB, DB, HB = (96, 32, 2) if SMALL else (1024, 128, 8)      # bits: S, D, heads
ST = (128, 192) if SMALL else (4096, 8192)                  # times: S (D = DB, H = HB)
RES = {"date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "bits": {},
       "timings": [], "errors": []}


def log(*a):
    print(f"[{time.time() - T0:5.1f} s]", *a, flush=True)


class knobs:
    """Within: the variant forced, DSQ_PREFETCH and DSQ_MAX_BYTES set."""

    def __init__(self, variant, pf=True, cap=None):
        self.v, self.pf, self.cap = variant, pf, cap

    def __enter__(self):
        self.old = (os.environ.get(launch.ENV_VARIANT), launch.DSQ_PREFETCH, launch.DSQ_MAX_BYTES)
        if self.v is None:
            os.environ.pop(launch.ENV_VARIANT, None)
        else:
            os.environ[launch.ENV_VARIANT] = self.v
        launch.DSQ_PREFETCH = self.pf
        if self.cap is not None:
            launch.DSQ_MAX_BYTES = self.cap

    def __exit__(self, *exc):
        env, launch.DSQ_PREFETCH, launch.DSQ_MAX_BYTES = self.old
        if env is None:
            os.environ.pop(launch.ENV_VARIANT, None)
        else:
            os.environ[launch.ENV_VARIANT] = env


def bits(be):
    r = np.random.default_rng(5)
    for tag, hk, mask in (("plain", 8, None), ("causal-gqa", 2, aa.Causal())):
        hk = min(hk, HB)
        q, g = (r.standard_normal((1, HB, SB, DB)).astype(np.float32) for _ in range(2))
        k, v = (r.standard_normal((1, hk, SB, DB)).astype(np.float32) for _ in range(2))
        got = {}
        for name, kw in (("wide", dict(variant="wide")),
                         ("dsq-nopf", dict(variant="wide-dsq", pf=False)),
                         ("dsq-pf", dict(variant="wide-dsq")),
                         ("dsq-pf-2chunks", dict(variant="wide-dsq",
                                                 cap=launch.dsq_bytes(HB, SB, SB) // 2))):
            with knobs(**kw):
                o, l = aa.attention(q, k, v, mask=mask, return_lse=True, backend="webgpu")
                gr = aa.attention_backward(q, k, v, g, out=o, lse=l, mask=mask, backend="webgpu")
            got[name] = [gr.dq, gr.dk, gr.dv]
        same = {n: all(np.array_equal(a, b) for a, b in zip(got["wide"], x))
                for n, x in got.items()}
        RES["bits"][tag] = same
        log("bits", tag, same)


def timed(be, S, name, kw, ref=None):
    B, H, D = 1, HB, DB
    rng = np.random.default_rng(12)
    q, k, v, g = (rng.standard_normal((B, H, S, D)).astype(np.float32) for _ in range(4))
    fl = WB.flops_bwd(B, H, S, S, D)
    with knobs(**kw):
        fwd, bwd, read_f, read_b = WB.wgpu_plan(be, q, k, v, g)
        fwd.submit(1)
        bwd.submit(1)
        gr = read_b()
        res = [np.asarray(gr[n]) for n in ("dq", "dk", "dv")]
        check = None
        if ref is not None:
            check = all(np.array_equal(a, b) for a, b in zip(res, ref)) if name != "wide" else \
                max(WB.rel(a, b) for a, b in zip(res, ref)) <= 1e-5
        tb, n = WB.time_plan(bwd, min_s=0.3)
        ks = WB.kernel_times(bwd, min_s=0.1) if S <= ST[0] else {}
    rec = dict(S=S, D=D, B=B, H=H, name=name, knobs={k_: str(v_) for k_, v_ in kw.items()},
               bwd_ms=tb * 1e3, bwd_tflops=fl / tb / 1e12, n=n, kernels_ms=ks, check_vs_ref=check)
    RES["timings"].append(rec)
    log(f"S={S} {name:16s} {tb * 1e3:8.3f} ms {fl / tb / 1e12:6.2f} TFLOP/s check={check} "
        + " ".join(f"{k_}={v_:.3f}" for k_, v_ in ks.items()))
    del fwd, bwd
    return res


def main():
    be = get_backend("webgpu")
    log("adapter", be.context.name)
    RES["adapter"] = be.context.name
    steps = [("bits", lambda: bits(be))]

    def s4096():
        S = ST[0]
        ref = timed(be, S, "wide-dsq-nopf", dict(variant="wide-dsq", pf=False))
        timed(be, S, "wide-dsq-pf", dict(variant="wide-dsq"), ref)
        timed(be, S, "wide-dsq-pf-2ch", dict(variant="wide-dsq",
                                            cap=launch.dsq_bytes(HB, S, S) // 2), ref)
        timed(be, S, "wide-dsq-nopf", dict(variant="wide-dsq", pf=False))   # order effects

    def s8192():
        ref = timed(be, ST[1], "auto", dict(variant=None))
        timed(be, ST[1], "wide", dict(variant="wide"), ref)
    steps += [("s4096", s4096), ("s8192", s8192)]
    for what, fn in steps:
        try:
            fn()
        except Exception as e:      # keep the other steps' numbers
            RES["errors"].append(f"{what}: {type(e).__name__}: {e}"[:1000])
            log("ERROR", what, type(e).__name__, str(e)[:300])
        with open(os.path.join(os.environ.get("OUT", "."), "webgpu-s8-check.json"), "w") as f:
            json.dump(RES, f, indent=1)
    log("done")


if __name__ == "__main__":
    main()
