"""Summaries of Nsight Compute reports exported as CSV (an `ncu` run of bench/lab/gpu_profile_target.py exported as
``<case>_<call>.raw.csv`` / ``.source.csv``): a table of each main kernel's headline
metrics (tensor-pipe activity, issue, shared-memory wavefronts and bank conflicts, local
memory instructions), and for one kernel the warp-stall samples per SASS instruction
(the top ones, and totals per address range: the warp-specialised partitions).

    python3 bench/lab/ncu_summary.py table DIR
    python3 bench/lab/ncu_summary.py stalls DIR/<case>_<call>.source.csv KERNEL [--ranges a,b,.. --names x,y,..]
"""
from __future__ import annotations

import argparse
import csv
import glob
import os

#: (raw metric, column title)
METRICS = [("gpu__time_duration.sum", "time"),
           ("sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active", "tensor%"),
           ("smsp__issue_active.avg.pct_of_peak_sustained_active", "issue%"),
           ("l1tex__data_pipe_lsu_wavefronts_mem_shared.sum", "smem wf"),
           ("l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum", "st confl"),
           ("l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum", "ld confl"),
           ("sass__inst_executed_local_loads", "LDL"),
           ("sass__inst_executed_local_stores", "STL"),
           ("smsp__inst_executed.sum", "inst"),
           ("launch__grid_size", "grid")]
#: kernels that are not the attention kernel itself (pre / post passes, fills)
AUX = ("elementwise", "pre_kernel", "convert", "dot_do_o")


def num(x: str) -> float:
    try:
        return float(x.replace(",", ""))
    except ValueError:
        return float("nan")


def fmt(x: float) -> str:
    if x != x:
        return "?"
    return f"{x / 1e6:.1f}M" if abs(x) >= 1e6 else (f"{x:.1f}" if abs(x) < 1e4 else f"{x:.0f}")


def table(folder: str) -> None:
    print("case".ljust(22), " ".join(t.rjust(9) for _, t in METRICS))
    for f in sorted(glob.glob(os.path.join(folder, "*.raw.csv"))):
        rows = list(csv.reader(open(f)))
        hdr = rows[0]
        for d in rows[2:]:
            name = d[hdr.index("Kernel Name")]
            if any(a in name for a in AUX):
                continue
            vals = [fmt(num(d[hdr.index(m)])) if m in hdr else "?" for m, _ in METRICS]
            print(os.path.basename(f)[:-8].ljust(22), " ".join(v.rjust(9) for v in vals),
                  name[:40])


def kernels(f: str) -> dict:
    """{kernel name: [row dict per SASS instruction]} of a source-page CSV."""
    out, cur, hdr = {}, None, None
    for row in csv.reader(open(f)):
        if not row:
            continue
        if row[0] == "Kernel Name":
            cur, hdr = row[1], None
            out[cur] = []
        elif row[0] == "Address":
            hdr = row
        else:
            out[cur].append(dict(zip(hdr, row)))
    return out


def stalls(f: str, kernel: str, ranges=None, names=None, top: int = 25) -> None:
    rows = [r for k, v in kernels(f).items() if kernel in k for r in v]
    if not rows:
        raise SystemExit(f"no kernel matching {kernel!r} in {f}")
    all_ = "Warp Stall Sampling (All Samples)"
    reasons = [h for h in rows[0] if h.startswith("stall_") and "Not Issued" not in h]
    tot = sum(num(r[all_]) for r in rows)
    exc = sum(num(r["L1 Wavefronts Shared Excessive"]) for r in rows)
    print(f"{len(rows)} instructions, {tot:.0f} samples, {exc:.0f} excess shared wavefronts")
    if ranges:
        starts = [int(x, 16) for x in ranges.split(",")]
        labels = names.split(",") if names else [hex(s) for s in starts]
        groups = {n: [] for n in labels}
        for r in rows:
            a = int(r["Address"][-5:], 16)
            i = max([j for j, s in enumerate(starts) if a >= s] or [0])
            groups[labels[i]].append(r)
        for n, rs in groups.items():
            s = sum(num(r[all_]) for r in rs)
            if s:
                agg = sorted(((sum(num(r[h]) for r in rs), h[6:]) for h in reasons), reverse=True)
                print(f"  {n}: {s / tot * 100:.1f} % of samples; "
                      + " ".join(f"{h}={v / s * 100:.0f}%" for v, h in agg if v / s > 0.02))
    for r in sorted(rows, key=lambda r: -num(r[all_]))[:top]:
        why = max(((num(r[h]), h[6:]) for h in reasons))[1]
        print(f"  {r['Address'][-5:]} {num(r[all_]) / tot * 100:5.2f} % {why:10s} "
              f"{r['Source'].strip()[:70]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    t = sub.add_parser("table")
    t.add_argument("folder")
    s = sub.add_parser("stalls")
    s.add_argument("csv")
    s.add_argument("kernel")
    s.add_argument("--ranges")
    s.add_argument("--names")
    s.add_argument("--top", type=int, default=25)
    a = ap.parse_args()
    if a.cmd == "table":
        table(a.folder)
    else:
        stalls(a.csv, a.kernel, a.ranges, a.names, a.top)


if __name__ == "__main__":
    main()
