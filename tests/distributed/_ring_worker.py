"""Worker processes of the gloo ring tests: one spawn per world size runs every case.

Each rank computes its shard with ``ring_attention`` (forward, lse and every
gradient) and compares it with its shard of the single-process float64
``anyattn.reference``; it writes {case: {quantity: relative error}} as JSON.
Shape legend: B batch, Hq/Hkv heads, S global length, D head dim.
"""
from __future__ import annotations

import json
import os
import time
import traceback
from datetime import timedelta

import numpy as np

B, HQ, HKV, S, D = 2, 4, 2, 64, 16


def cases(world: int):
    """(name, options) of every case run with ``world`` ranks."""
    out = []
    for sharding in ("contiguous", "zigzag"):
        for mask in ("none", "causal", "docs", "causal_docs", "causal_window"):
            for dtype in ("float32", "float64"):
                out.append((f"{sharding}-{mask}-{dtype}",
                            dict(sharding=sharding, mask=mask, dtype=dtype)))
    out += [
        ("zigzag-keep_empty_rows-float64", dict(sharding="zigzag", mask="keep", dtype="float64")),
        ("contiguous-docs_empty_rows-float64",
         dict(sharding="contiguous", mask="docs_qk", dtype="float64")),
        ("zigzag-causal-bshd-float32", dict(sharding="zigzag", mask="causal", dtype="float32",
                                            layout="bshd")),
        ("contiguous-causal-only_dq-float64", dict(sharding="contiguous", mask="causal",
                                                   dtype="float64", wrt="q")),
        ("zigzag-causal_docs-only_dkdv-float32", dict(sharding="zigzag", mask="causal_docs",
                                                      dtype="float32", wrt="kv")),
        ("zigzag-causal-mha-S128-float32", dict(sharding="zigzag", mask="causal",
                                                 dtype="float32", hkv=HQ, seq=128)),
        # a sub-group of the world: ranks (0,) for 2 processes, (1, 3) for 4
        ("subgroup-zigzag-causal-float64", dict(sharding="zigzag", mask="causal",
                                                dtype="float64", subgroup=True)),
        # bf16 inputs (the numpy backend computes them in fp32, rounds each block result)
        ("zigzag-causal-bfloat16", dict(sharding="zigzag", mask="causal", dtype="bfloat16")),
        ("contiguous-causal_docs-bfloat16", dict(sharding="contiguous", mask="causal_docs",
                                                 dtype="bfloat16")),
        # the Triton backend's kernels through its interpreter (CPU tensors): one problem
        # of a GQA group of two (the interpreter's time grows with batch x heads)
        ("triton-zigzag-causal_docs-float32", dict(sharding="zigzag", mask="causal_docs",
                                                   dtype="float32", backend="triton",
                                                   batch=1, hq=2, hkv=1)),
        ("triton-contiguous-causal_window-float32",
         dict(sharding="contiguous", mask="causal_window", dtype="float32", backend="triton",
              batch=1, hq=2, hkv=1)),
        # logits at any magnitude (DESIGN.md "Numerics at any magnitude"): every score is
        # 2**e plus a small integer, exact in the dtype, so the float64 reference is exact
        # and any error is the ring's (a merge through one rounded lse lost |lse|·eps)
        ("zigzag-causal-logits1e6-float32", dict(sharding="zigzag", mask="causal",
                                                  dtype="float32", logits=20)),
        ("contiguous-docs-logits1e3-float32", dict(sharding="contiguous", mask="causal_docs",
                                                   dtype="float32", logits=10)),
        ("contiguous-docs-logits1e3-reference-float32",
         dict(sharding="contiguous", mask="causal_docs", dtype="float32", logits=10,
              backend="reference")),
        ("zigzag-causal_window-logits1e12-float64",
         dict(sharding="zigzag", mask="causal_window", dtype="float64", logits=40)),
        # score modifiers: softcap and ALiBi in every block (ALiBi at global positions),
        # the sink counted once per row, dsinks summed over the group
        ("zigzag-causal-mods-reference-float64",
         dict(sharding="zigzag", mask="causal", dtype="float64", mods=True,
              backend="reference")),
        ("zigzag-causal_window-mods-float32",
         dict(sharding="zigzag", mask="causal_window", dtype="float32", mods=True)),
        # dropout: every block draws the shared mask at its global positions, so the
        # sharded run drops what the one-process reference with the same seed drops
        ("zigzag-causal-dropout-reference-float64",
         dict(sharding="zigzag", mask="causal", dtype="float64", dropout=True,
              backend="reference")),
        ("contiguous-causal_docs-dropout-float32",
         dict(sharding="contiguous", mask="causal_docs", dtype="float32", dropout=True)),
        # a value head dim of its own (Dv = 24 != D = 16): out and dv of v's head dim
        ("zigzag-causal_docs-value_dim-float32",
         dict(sharding="zigzag", mask="causal_docs", dtype="float32", dv=24)),
        ("contiguous-docs-mods-reference-float64",
         dict(sharding="contiguous", mask="causal_docs", dtype="float64", mods=True,
              backend="reference")),
    ]
    return out


def _large_logits(rng, q_shape, k_shape, e):
    """q, k of these shapes [B, H, S, D] whose scores at scale 1 are 2**e + an integer in
    [-(D-1), D-1]: entries in {-1, 0, 1} and a last column of 2**(e/2) in both."""
    q = rng.integers(-1, 2, q_shape).astype(np.float64)
    k = rng.integers(-1, 2, k_shape).astype(np.float64)
    q[..., -1] = k[..., -1] = 2.0 ** (e / 2)
    return q, k


def _mask(name, seq, rng, b=B):
    from anyattn import Causal, Documents, KeepMask, Window

    ids = np.repeat(np.arange(4), np.diff(np.r_[0, np.sort(rng.choice(np.arange(1, seq), 3,
                                                                      replace=False)), seq]))
    if name == "none":
        return None
    if name == "causal":
        return Causal()
    if name == "docs":
        return Documents(np.stack([ids, ids[::-1].copy()]).astype(np.int32))   # [B, S]
    if name == "causal_docs":
        return Causal() & Documents(ids)
    if name == "causal_window":
        return Causal() & Window(left=5)
    if name == "docs_qk":   # query ids 4 and 5 never appear among the keys: empty rows
        qi = ids.copy()
        qi[::7] = 4 + (np.arange(len(qi[::7])) % 2)
        return Documents(qi, ids)
    if name == "keep":      # random keep mask, with whole rows dropped
        keep = rng.random((b, 1, seq, seq)) < 0.3
        keep[:, :, ::5] = False
        return Causal() & KeepMask(keep)
    raise ValueError(name)


def _rel(got, ref):
    got = np.asarray(got, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if np.isnan(got).any():
        return float("nan")
    fin = np.isfinite(ref)
    if not np.array_equal(np.isfinite(got), fin) or not np.array_equal(got[~fin], ref[~fin]):
        return float("inf")     # -inf lse rows must match exactly
    if not fin.any():
        return 0.0
    scale = np.abs(ref[fin]).max()
    diff = np.abs(got[fin] - ref[fin]).max()
    return float(diff / scale) if scale else float(diff)


def cases_gpu(world: int):
    """Cases of the NCCL run (CUDA tensors, automatic backend: Triton)."""
    out = []
    for sharding in ("contiguous", "zigzag"):
        for mask in ("causal", "causal_docs", "none"):
            for dtype in ("float32", "bfloat16"):
                out.append((f"cuda-{sharding}-{mask}-{dtype}",
                            dict(sharding=sharding, mask=mask, dtype=dtype, backend=None,
                                 device="cuda", seq=256)))
    return out


def run_case(rank, world, opts):
    import torch
    import torch.distributed as dist

    from anyattn import reference
    from anyattn.backends.registry import unavailable_reason
    from anyattn.distributed import ring_attention, shard

    backend = opts.get("backend", "numpy")
    device = torch.device(opts.get("device", "cpu"), rank) if opts.get("device") == "cuda" \
        else torch.device("cpu")
    if backend is not None and unavailable_reason(backend):
        return {"skipped": f"{backend}: {unavailable_reason(backend)}"}

    seq = opts.get("seq", S)
    b, hq, hkv = opts.get("batch", B), opts.get("hq", HQ), opts.get("hkv", HKV)
    rng = np.random.default_rng(1234)     # the same on every rank
    dt = getattr(torch, opts["dtype"])
    dv = opts.get("dv", D)                # v's head dim (and dout's)
    q, dout = (torch.from_numpy(rng.standard_normal((b, hq, seq, d))).to(dt) for d in (D, dv))
    k, v = (torch.from_numpy(rng.standard_normal((b, hkv, seq, d))).to(dt) for d in (D, dv))
    scale = None
    if opts.get("logits"):
        qn, kn = _large_logits(rng, q.shape, k.shape, opts["logits"])
        q, k = torch.from_numpy(qn).to(dt), torch.from_numpy(kn).to(dt)
        scale = 1.0
    mask = _mask(opts["mask"], seq, rng, b)
    group, members = None, list(range(world))
    if opts.get("subgroup"):
        members = [0] if world == 2 else [1, 3]
        group = dist.new_group(members)         # every rank must take part in new_group
        if rank not in members:
            return None
    n, me = len(members), members.index(rank)
    sharding = opts["sharding"]
    wrt = opts.get("wrt", "qkv")

    mods, sinks = {}, None
    if opts.get("mods"):
        mods = dict(softcap=2.0, alibi_slopes=rng.uniform(0.05, 0.5, hq),
                    sinks=rng.standard_normal(hq))
    if opts.get("dropout"):
        mods.update(dropout_p=0.2, dropout_seed=2 ** 63 + 12345, softcap=4.0)
    ref_out, ref_lse = reference.forward(q, k, v, mask=mask, scale=scale, **mods)
    ref_g = reference.backward(q, k, v, dout, mask=mask, scale=scale,
                               wrt=("q", "k", "v") + (("sinks",) if "sinks" in mods else ()),
                               **mods)
    tmods = {}
    if "sinks" in mods:
        sinks = torch.from_numpy(mods["sinks"]).to(dt).to(device).requires_grad_()
        tmods = dict(softcap=mods["softcap"], sinks=sinks,
                     alibi_slopes=torch.from_numpy(mods["alibi_slopes"]).to(dt).to(device))
    elif mods:
        tmods = dict(mods)

    def loc(x):
        return shard(x, me, n, sharding=sharding)

    def cpu(x):
        return x.detach().float().cpu() if x.dtype == torch.bfloat16 else x.detach().cpu()

    ql, kl, vl = (loc(x).to(device).requires_grad_(name in wrt) for name, x in
                  (("q", q), ("k", k), ("v", v)))
    gl = loc(dout).to(device)
    layout = opts.get("layout", "bhsd")
    if layout == "bshd":
        qi, ki, vi = (x.detach().transpose(1, 2).contiguous().transpose(1, 2)
                      .requires_grad_(x.requires_grad) for x in (ql, kl, vl))
        ql, kl, vl = qi, ki, vi
        o, lse = ring_attention(ql.transpose(1, 2), kl.transpose(1, 2), vl.transpose(1, 2),
                                mask=mask, group=group, sharding=sharding, backend=backend,
                                layout="bshd", return_lse=True, scale=scale, **tmods)
        o = o.transpose(1, 2)
    else:
        o, lse = ring_attention(ql, kl, vl, mask=mask, group=group, sharding=sharding,
                                backend=backend, return_lse=True, scale=scale, **tmods)
    (o * gl).sum().backward()
    res = {"out": _rel(cpu(o), loc(torch.from_numpy(ref_out))),
           "lse": _rel(cpu(lse), loc(torch.from_numpy(ref_lse)[..., None])[..., 0])}
    for name, x, r in (("dq", ql, ref_g.dq), ("dk", kl, ref_g.dk), ("dv", vl, ref_g.dv)):
        if name[1] in wrt:
            res[name] = _rel(cpu(x.grad), loc(torch.from_numpy(r)))
        elif x.grad is not None:
            res[name] = float("nan")   # a gradient that was not asked for
    if sinks is not None:       # each rank holds its queries' share: sum over the group
        ds = sinks.grad.detach().clone()
        dist.all_reduce(ds, group=group)
        res["dsinks"] = _rel(cpu(ds), torch.from_numpy(ref_g.dsinks))
    res["dtype_out"] = str(o.dtype)
    if opts.get("logits"):   # the same backend on the whole sequence, in one process
        from anyattn.api import attention_backward, forward_with_stats

        qd, kd, vd, gd = (x.to(device) for x in (q, k, v, dout))
        so, st = forward_with_stats(qd, kd, vd, mask=mask, scale=scale, backend=backend)
        sg = attention_backward(qd, kd, vd, gd, out=so, lse=st, mask=mask, scale=scale,
                                backend=backend)
        single = {"out": (so, ref_out), "lse": (st.lse, ref_lse), "dq": (sg.dq, ref_g.dq),
                  "dk": (sg.dk, ref_g.dk), "dv": (sg.dv, ref_g.dv)}
        for name, (x, r) in single.items():
            res["single_" + name] = _rel(cpu(loc(x)), loc(torch.from_numpy(r)[..., None])[..., 0]
                                         if name == "lse" else loc(torch.from_numpy(r)))
    return res


def run(rank, world, port, out_dir, transport="gloo", names=None):
    """mp.spawn entry: join the group on loopback (gloo: CPU cases; nccl: one GPU per
    rank, the CUDA cases), run every case (or those in ``names``), write JSON."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      ANYATTN_NUMPY_THREADS="1", OMP_NUM_THREADS="1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    if transport == "nccl":
        torch.cuda.set_device(rank)
    else:
        os.environ.setdefault("TRITON_INTERPRET", "1")   # CPU tensors: Triton's interpreter
    dist.init_process_group(transport, rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    results = {}
    try:
        only = os.environ.get("ANYATTN_RING_CASES")      # a substring: run those cases only
        for name, opts in (cases(world) if transport == "gloo" else cases_gpu(world)):
            if (only and only not in name) or (names is not None and name not in names):
                continue
            t0 = time.perf_counter()
            try:
                r = run_case(rank, world, opts)
            except Exception:
                results[name] = {"error": traceback.format_exc()}
                raise                       # mp.spawn stops the other ranks
            if r is not None:
                r["seconds"] = time.perf_counter() - t0     # where a slow run spends its time
                results[name] = r
            dist.barrier()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()
