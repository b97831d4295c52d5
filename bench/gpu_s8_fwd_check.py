"""Session 8 (issue 15 forward): GPU checks of the Hopper forward configs that have not
been checked on a GPU yet, one phase per process (run each under ``timeout``: a hang
costs its timeout, not the run).

Phases:
  persist  the persistent forward (configs.FWD_PERSIST; FWD_PERSIST_SCHED on the band
           cases) on shapes with more query tiles than SMs, so that every program walks
           several tiles of different key-loop lengths (dense, causal, bottom-right
           causal with Sq != Sk and GQA, a window, fp16): poisoned buffers, two runs
           and the per-tile default bitwise equal (out, max, log_norm), out and lse vs
           float64.
  d64      D=64 variants (--d64 names, configs.FWD_VARIANTS[64]) vs float64 on odd
           sizes / GQA / every band kind / empty rows / a 2k causal case, bf16 and fp16:
           poisoned buffers, two runs bitwise equal.

Shape legend: B batch, H / Hkv heads, Sq / Sk queries / keys, D head dim.
Prints 'CASE <name> ok=<bool> ...' per case and 'PHASE <name> done'; writes
<out>/s8-check-<phase>.json; exit status 1 if a case failed.

    PYTHONPATH=src python3 bench/gpu_s8_fwd_check.py persist --out DIR
"""
from __future__ import annotations

import argparse
import json
import zlib
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

import torch  # noqa: E402

import anyattn as aa  # noqa: E402
from anyattn.problem import describe  # noqa: E402
from anyattn.backends.triton.hopper import configs as HCF  # noqa: E402
from anyattn.backends.triton.hopper import launch as HL  # noqa: E402

TOL = {"float16": 3e-3, "bfloat16": 2e-2}
ROWS: list = []
OPT: dict = {}


def log(*a):
    print(*a, flush=True)


def mask_and_keep(kind, Sq, Sk, dev):
    """-> (anyattn mask or None, bool keep [Sq, Sk])."""
    i = torch.arange(Sq, device=dev)[:, None]
    j = torch.arange(Sk, device=dev)[None, :]
    if kind == "none":
        return None, torch.ones(Sq, Sk, dtype=torch.bool, device=dev)
    if kind == "causal":
        return aa.Causal(), j <= i
    if kind == "causal_br":
        return aa.Causal(align="bottom_right"), j <= i + (Sk - Sq)
    if kind == "window2":
        return aa.Window(left=200, right=37), (i - j <= 200) & (j - i <= 37)
    raise ValueError(kind)


def ref64(q, k, v, keep, scale):
    """float64 out [B, H, Sq, D], lse [B, H, Sq] (-inf on empty rows)."""
    G = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)
    s = torch.einsum("bhid,bhjd->bhij", q.double(), kk) * scale
    s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.where(keep, torch.exp(s - torch.where(torch.isfinite(lse), lse, 0.0)[..., None]),
                    0.0)
    return torch.einsum("bhij,bhjd->bhid", p, vv), lse


def rel(a, b):
    a, b = a.double(), b.double()
    fin = torch.isfinite(b)
    den = b[fin].abs().max().item() if fin.any() else 1.0
    return (a[fin] - b[fin]).abs().max().item() / (den if den > 0 else 1.0)


def run(p, q, k, v, cfg):
    """(out, max, log_norm) of one config into NaN-poisoned buffers."""
    B, H, Sq, D = p.batch, p.heads_q, p.seq_q, p.head_dim
    out = torch.full((B, H, Sq, D), float("nan"), dtype=q.dtype, device=q.device)
    st = torch.full((2, B, H, Sq), float("nan"), dtype=torch.float32, device=q.device)
    o, rs = HL.forward(p, q, k, v, out=out, stats=st, cfg=cfg)
    torch.cuda.synchronize()
    return o, rs.max, rs.log_norm


def inputs(B, H, Hkv, Sq, Sk, D, dt, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    tdt = getattr(torch, dt)
    return tuple(torch.randn(B, h, s, D, device="cuda", generator=g).to(tdt)
                 for h, s in ((H, Sq), (Hkv, Sk), (Hkv, Sk)))


def check(name, cfgs, B, H, Hkv, Sq, Sk, D, dt, kind, against_default=False):
    """Each cfg twice vs float64 (and, against_default, bitwise vs the default config)."""
    t = time.time()
    q, k, v = inputs(B, H, Hkv, Sq, Sk, D, dt, zlib.crc32(name.encode()) % 2**31)
    mask, keep = mask_and_keep(kind, Sq, Sk, "cuda")
    p = describe(q, k, v, mask=mask)
    ro, rl = ref64(q, k, v, keep, p.scale)
    # the per-tile default (since session 12 the D=128 band / no-mask route is the
    # persistent FWD_PERSIST_SCHED itself: its per-tile twin, _FWD[128])
    base = (run(p, q, k, v, HCF.fwd_config(D, dt).per_tile()) if against_default
            else None)
    for cfg in cfgs:
        a, b2 = run(p, q, k, v, cfg), run(p, q, k, v, cfg)
        lse = a[1] + a[2]
        row = dict(case=name, cfg=cfg.name, B=B, H=H, Hkv=Hkv, Sq=Sq, Sk=Sk, D=D, dtype=dt,
                   mask=kind, tiles=-(-Sq // cfg.bm) * B * H,
                   nan=bool(torch.isnan(a[0]).any() or torch.isnan(a[1]).any()
                            or torch.isnan(a[2]).any()),
                   err_out=rel(a[0], ro), err_lse=rel(lse, rl),
                   empty_ok=bool(torch.equal(torch.isfinite(lse), torch.isfinite(rl))),
                   repeat=all(torch.equal(x, y) for x, y in zip(a, b2)))
        if base is not None:
            row["bitwise_vs_default"] = all(torch.equal(x, y) for x, y in zip(a, base))
            row["err_out_default"] = rel(base[0], ro)
        # bitwise_vs_default is reported apart: a different instruction schedule may
        # round differently and still be right (the float64 check decides)
        row["ok"] = (not row["nan"] and row["repeat"] and row["empty_ok"]
                     and row["err_out"] <= TOL[dt] and row["err_lse"] <= 10 * TOL[dt])
        row["s"] = round(time.time() - t, 1)
        ROWS.append(row)
        log("CASE " + " ".join(f"{k_}={v_}" for k_, v_ in row.items()))
        dump()                  # a phase cut by its timeout (SIGTERM) keeps its rows


def dump():
    with open(os.path.join(OPT["out"], f"s8-check-{OPT['phase']}.json"), "w") as f:
        json.dump(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                       date=time.strftime("%Y-%m-%d %H:%M"), rows=ROWS), f, indent=1)


def phase_persist():
    c = [HCF.FWD_PERSIST, HCF.FWD_PERSIST_SCHED]   # the scheduled walk: bands only
    check("dense2k", c[:1], 2, 16, 16, 2048, 2048, 128, "bfloat16", "none", True)
    check("causal2k", c, 2, 16, 16, 2048, 2048, 128, "bfloat16", "causal", True)
    check("gqa-br-odd", c, 1, 64, 16, 600, 777, 128, "bfloat16", "causal_br", True)
    check("window-odd", c, 1, 64, 16, 1000, 1000, 128, "bfloat16", "window2", True)
    check("fp16-causal2k", c, 2, 16, 16, 2048, 2048, 128, "float16", "causal", True)
    check("fp16-dense-gqa", c[:1], 1, 64, 8, 777, 1031, 128, "float16", "none", True)


def phase_d64(names):
    cfgs = [x for x in HCF.FWD_VARIANTS[64] if x.name in names]
    if not cfgs:
        raise ValueError(f"no D=64 variant named {names}")
    for dt in ("bfloat16", "float16"):
        for kind in ("none", "causal", "causal_br", "window2"):
            check(f"{dt[:4]}-d64-{kind}-gqa-odd", cfgs, 2, 4, 2, 257, 383, 64, dt, kind)
        check(f"{dt[:4]}-d64-emptyrows", cfgs, 1, 2, 1, 300, 200, 64, dt, "causal_br")
        check(f"{dt[:4]}-d64-causal2k", cfgs, 2, 8, 8, 2048, 2048, 64, dt, "causal")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("phase", choices=("persist", "d64"))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--d64", default="ws128x128s3opf,ws192x128s3opf")
    a = ap.parse_args()
    OPT.update(out=a.out, phase=a.phase)
    t = time.time()
    phase_persist() if a.phase == "persist" else phase_d64(a.d64.split(","))
    dump()
    bad = [f"{r['case']}:{r['cfg']}" for r in ROWS if not r["ok"]]
    nbit = [f"{r['case']}:{r['cfg']}" for r in ROWS if r.get("bitwise_vs_default") is False]
    log(f"PHASE {a.phase} done in {time.time() - t:.1f} s: {len(ROWS)} rows, failing {bad}, "
        f"not bitwise equal to the default {nbit}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
