"""Where the host time of the Hopper routes' launches goes, on a GPU machine: cProfile of
the backend's raw forward + backward calls (no autograd) at a shape so small that the
GPU never limits, for a dense and a Documents problem at D=128 bf16, plus µs per step
with Triton's launch path and with direct launches (ANYATTN_TRITON_DIRECT_LAUNCH=1),
interleaved in rounds (the host's speed swings between phases of a run).

Shape legend: B batch, H heads, S = Sq = Sk, D head dim.

    python bench/lab/hopper_launch_profile.py --out OUT_DIR [--shape 1,2,256,128] [--steps 300]
"""
from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

import torch  # noqa: E402

import anyattn as aa  # noqa: E402


def step_fn(shape, docs):
    B, H, S, D = shape
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v, do = (torch.randn(B, H, S, D, device="cuda", generator=g).to(torch.bfloat16)
                   for _ in range(4))
    mask = aa.Documents(torch.arange(S, device="cuda", dtype=torch.int32) // max(1, S // 4)) \
        if docs else None

    def step():      # RowStats passed back: no magnitude check (a plain lse syncs)
        out, st = aa.forward_with_stats(q, k, v, mask=mask, backend="triton")
        aa.attention_backward(q, k, v, do, mask=mask, out=out, lse=st, backend="triton")
    return step


def per_step_us(fn, steps, rounds=5):
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(steps):
            fn()
        torch.cuda.synchronize()
        ts.append((time.perf_counter() - t0) / steps * 1e6)
    return statistics.median(ts), ts


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=".")
    ap.add_argument("--shape", default="1,2,256,128")
    ap.add_argument("--steps", type=int, default=300)
    a = ap.parse_args()
    shape = tuple(int(x) for x in a.shape.split(","))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res = {"shape_BHSD": shape, "device": torch.cuda.get_device_name(), "us_per_step": {}}
    for docs in (False, True):
        name = "documents" if docs else "dense"
        fn = step_fn(shape, docs)
        rounds = {"0": [], "1": []}
        for r in range(6):          # the settings interleaved: the host's speed swings
            for direct in (("0", "1") if r % 2 == 0 else ("1", "0")):
                os.environ["ANYATTN_TRITON_DIRECT_LAUNCH"] = direct
                rounds[direct] += per_step_us(fn, a.steps, rounds=1)[1]
        for direct, ts in rounds.items():
            med = statistics.median(ts)
            res["us_per_step"][f"{name}-direct{direct}"] = {"median": med, "rounds": ts}
            print(f"{name} direct={direct}: {med:.1f} us per fwd+bwd step "
                  f"(rounds {min(ts):.0f}-{max(ts):.0f})", flush=True)
        os.environ["ANYATTN_TRITON_DIRECT_LAUNCH"] = "0"
        fn = step_fn(shape, docs)
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(a.steps):
            fn()
        torch.cuda.synchronize()
        pr.disable()
        buf = io.StringIO()
        st = pstats.Stats(pr, stream=buf)
        st.sort_stats("tottime").print_stats(40)
        st.sort_stats("cumulative").print_stats(50)
        (out / f"profile-{name}.txt").write_text(buf.getvalue())
    (out / "hopper_launch_profile.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
