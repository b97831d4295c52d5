"""Worker processes of the rank-agreement tests: ranks that call ``ring_attention``
with arguments that differ, or never call it.

One spawn runs every scenario of :func:`scenarios` in order on one gloo group and
writes {scenario: {"type", "message", "seconds"}} per rank as JSON.  Scenarios that
leave the group unusable (a rank that never calls) come last.
"""
from __future__ import annotations

import json
import os
import time
import traceback
from datetime import timedelta

B, H, S_LOC, D = 1, 2, 16, 8
TIMEOUT = 3.0          # where a rank never calls: the others must give up after this
PATIENT = 120.0        # elsewhere: long enough for a slow rank on a loaded machine


def scenarios():
    """name -> {rank: changes to that rank's call}; "skip": the rank does not call."""
    return {
        "agree": {},
        "seq_len": {1: dict(s_loc=8)},
        "dtype": {2: dict(dtype="float64")},
        "same_bytes_other_shape": {1: dict(s_loc=D, d=S_LOC)},      # [.., 8, 16] vs [.., 16, 8]
        "heads": {0: dict(hkv=1)},
        "mask": {1: dict(mask="causal")},
        "mask_ids": {0: dict(mask="docs"), 1: dict(mask="docs"), 2: dict(mask="docs_other")},
        "scale": {1: dict(scale=0.5)},
        "sharding": {2: dict(sharding="zigzag")},
        "layout": {1: dict(layout="bshd")},
        "wrt": {1: dict(grad="")},
        "local_refusal": {1: dict(layout="sbhd")},                   # rank 1's own error
        "never_called": {2: "skip"},                                 # the others time out
    }


def _call(rank, world, change, timeout):
    import numpy as np
    import torch

    from anyattn import Causal, Documents
    from anyattn.distributed import ring_attention

    s_loc, d = change.get("s_loc", S_LOC), change.get("d", D)
    dt = getattr(torch, change.get("dtype", "float32"))
    g = torch.Generator().manual_seed(rank)
    q = torch.randn(B, H, s_loc, d, generator=g, dtype=dt)
    hkv = change.get("hkv", H)
    k = torch.randn(B, hkv, s_loc, d, generator=g, dtype=dt)
    v = torch.randn(B, hkv, s_loc, d, generator=g, dtype=dt)
    grad = change.get("grad", "qkv")
    for name, x in (("q", q), ("k", k), ("v", v)):
        x.requires_grad_(name in grad)
    layout = change.get("layout", "bhsd")
    if layout == "bshd":
        q, k, v = (x.detach().transpose(1, 2).requires_grad_(x.requires_grad)
                   for x in (q, k, v))
    S = S_LOC * world
    ids = np.repeat(np.arange(4), S // 4)
    mask = {None: None, "causal": Causal(), "docs": Documents(ids),
            "docs_other": Documents(ids[::-1].copy())}[change.get("mask")]
    out = ring_attention(q, k, v, mask=mask, sharding=change.get("sharding", "contiguous"),
                         scale=change.get("scale"), layout=layout, backend="numpy",
                         timeout=timeout)
    if out.requires_grad:
        out.sum().backward()


def _stay_until_the_others_wrote(rank, world, out_dir, cap=TIMEOUT + 4):
    """A rank that never calls stays in the group until the others have written their
    results (they time out waiting for it), at most ``cap`` seconds."""
    others = [os.path.join(out_dir, f"rank{r}.json") for r in range(world) if r != rank]
    end = time.monotonic() + cap
    while time.monotonic() < end and not all(os.path.exists(p) for p in others):
        time.sleep(0.05)


def run(rank, world, port, out_dir, which=None, pg_timeout=60.0):
    """mp.spawn entry: join a gloo group on loopback, run the scenarios, write JSON."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      ANYATTN_NUMPY_THREADS="1", OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=pg_timeout))
    results = {}
    try:
        for name, per_rank in scenarios().items():
            if which is not None and name not in which:
                continue
            change = per_rank.get(rank, {})
            t = time.perf_counter()
            if change == "skip":      # this rank failed before: it never calls ring_attention
                _stay_until_the_others_wrote(rank, world, out_dir)
                results[name] = {"type": "skipped", "message": "", "seconds": 0.0}
                break
            patient = not any(v == "skip" for v in per_rank.values())
            try:
                _call(rank, world, change, PATIENT if patient else TIMEOUT)
                r = {"type": None, "message": ""}
            except Exception as e:
                r = {"type": type(e).__name__, "message": str(e),
                     "trace": traceback.format_exc()[-3000:]}
            r["seconds"] = time.perf_counter() - t
            results[name] = r
            if any(v == "skip" for v in per_rank.values()):
                break                 # the group is not usable after a missed collective
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)


def run_default_timeout(rank, world, port, out_dir):
    """Rank 1 never calls; rank 0 calls with timeout=None on a group whose own timeout is
    TIMEOUT: that timeout applies.  (The world group has a long one, so that joining it
    never times out on a loaded machine.)"""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      ANYATTN_NUMPY_THREADS="1", OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    from anyattn.distributed import ring_attention

    dist.init_process_group("gloo", rank=rank, world_size=world,
                            timeout=timedelta(seconds=PATIENT))
    group = dist.new_group(list(range(world)), timeout=timedelta(seconds=TIMEOUT))
    r = {"type": None, "message": "", "seconds": 0.0}
    if rank == 0:
        import anyattn

        x = torch.zeros(B, H, S_LOC, D)
        anyattn.attention(x, x, x, backend="numpy")     # the backend's imports, up front
        with open(os.path.join(out_dir, "rank0.started"), "w") as f:
            f.write(repr(time.time()))              # timing an abort, should gloo abort
        t = time.perf_counter()
        try:
            ring_attention(x, x, x, backend="numpy", group=group)
        except Exception as e:
            r = {"type": type(e).__name__, "message": str(e)}
        r["seconds"] = time.perf_counter() - t
    else:
        _stay_until_the_others_wrote(rank, world, out_dir)
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(r, f)
