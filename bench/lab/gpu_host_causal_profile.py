"""cProfile of one-thread training steps of ``anyattn.torch.attention`` (module) and of the
backend's raw calls (kernel), without a mask and causal, at a small shape on a GPU
machine: where the module's extra host time with a causal mask goes (session 12 on the
H200: 885 vs 605 µs per step, the raw calls 369 vs 335).

    python bench/lab/gpu_host_causal_profile.py --out DIR [--small 1,1,128,128] [--n 200]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import torch_host_profile as THP  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--small", default="1,1,128,128")
    ap.add_argument("--n", type=int, default=200)
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    small = tuple(int(x) for x in a.small.split(","))
    for causal in (False, True):
        tag = "causal" if causal else "none"
        fns = THP.steps(small, causal, torch.bfloat16, THP.DEV)
        for name in ("module", "kernel"):
            fn = THP._Setting(fns[name], threads=False)
            for _ in range(20):
                fn()
            THP._sync()
            text = THP.profile_text(fn, a.n, top=60)   # own time, then cumulative
            (out / f"profile-{name}-{tag}-one-thread.txt").write_text(text)
            print(f"{tag} {name}: {text.splitlines()[0].strip()}", flush=True)


if __name__ == "__main__":
    main()
