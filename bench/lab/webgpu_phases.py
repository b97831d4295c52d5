"""Slow phases of the WebGPU kernels (issue 17): GPU-timestamped kernel times next to
nvidia-smi samples (SM / memory clock, power, temperature, utilisation, clock
throttle/event reasons), then what moves with the slow submissions.

python bench/lab/webgpu_phases.py --out DIR [--seconds 30] [--cases 512x64,4096x128]

Per case (B=1 H=8 f32, the table's variant) the device-resident backward plan is
submitted back to back, one submission at a time with a timestamp pair (device ms) and
its wall time; nvidia-smi samples every ``--smi-ms`` in a child process.  Output:
``webgpu-phases-<tag>.csv`` (wall s, case, device ms), ``webgpu-smi-<tag>.csv`` (the raw
samples) and ``webgpu-phases-<tag>.json``: per case the fastest / median device ms, the
slow submissions (> 1.3x the case's 5th percentile), and per smi field its values while
slow vs while fast (the samples within 0.5 s of the submissions).
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "bench"))

import webgpu_bench as WB  # noqa: E402  (the plan, its timing, timestamps on a runner)

#: nvidia-smi fields; the throttle reasons under both of their names (newer drivers call
#: them clocks_event_reasons); whichever set the driver accepts is used
SMI_BASE = ("timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu,utilization.gpu,"
            "utilization.memory,pstate")
REASONS = ("active", "gpu_idle", "applications_clocks_setting", "sw_power_cap", "hw_slowdown",
           "hw_thermal_slowdown", "hw_power_brake_slowdown", "sw_thermal_slowdown",
           "sync_boost")


def smi_fields() -> str:
    for prefix in ("clocks_throttle_reasons", "clocks_event_reasons"):
        q = SMI_BASE + "," + ",".join(f"{prefix}.{r}" for r in REASONS)
        r = subprocess.run(["nvidia-smi", f"--query-gpu={q}", "--format=csv,noheader"],
                           capture_output=True, text=True)
        if r.returncode == 0 and "Field" not in r.stdout:
            return q
    return SMI_BASE


def parse_smi(path: Path):
    """[(epoch s, {field: value})] of the samples (timestamps are the host's local time)."""
    import datetime

    rows = []
    with open(path) as f:
        rd = csv.reader(f)
        head = [h.strip() for h in next(rd)]
        for row in rd:
            if len(row) != len(head):
                continue
            d = {h: v.strip() for h, v in zip(head, row)}
            ts = d.get("timestamp")
            try:
                t = datetime.datetime.strptime(ts, "%Y/%m/%d %H:%M:%S.%f").timestamp()
            except (TypeError, ValueError):
                continue
            rows.append((t, d))
    return rows


def num(v: str):
    try:
        return float(v.split()[0])
    except (ValueError, IndexError, AttributeError):
        return v


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--tag", default="h200-s8-2026-12-04")
    ap.add_argument("--seconds", type=float, default=30.0, help="per case")
    ap.add_argument("--cases", default="512x64,4096x128")
    ap.add_argument("--smi-ms", type=int, default=100)
    a = ap.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    from anyattn.backends.registry import get_backend
    from anyattn.backends.webgpu.timestamps import Timestamps

    be = get_backend("webgpu")
    run = be.runner()
    smi_csv = out / f"webgpu-smi-{a.tag}.csv"
    import shutil

    has_smi = shutil.which("nvidia-smi") is not None     # none on a CPU adapter's host
    fields = smi_fields() if has_smi else None
    smi = subprocess.Popen(["nvidia-smi", f"--query-gpu={fields}", "--format=csv",
                            f"-lms={a.smi_ms}"], stdout=open(smi_csv, "w"),
                           stderr=subprocess.STDOUT) if has_smi else None
    rec = []            # (wall s at submit, case, device ms)
    summary = {"adapter": be.context.name, "smi_fields": fields, "cases": {}}
    try:
        time.sleep(1.0)
        for case in a.cases.split(","):
            S, D = (int(x) for x in case.split("x"))
            rng = np.random.default_rng(3)
            q, k, v, g = (rng.standard_normal((1, 8, S, D)).astype(np.float32) for _ in range(4))
            fwd, bwd, _, _ = WB.wgpu_plan(be, q, k, v, g)
            fwd.submit(1)
            t1 = WB.one_submission_s(bwd)
            batch = max(1, int(0.02 / t1))    # a wait every ~20 ms of GPU work: the
            walls = []                        # wall times stay within ~20 ms of the run
            t_end = time.time() + a.seconds
            with WB.timestamps_on(run, Timestamps(run)) as ts:
                while time.time() < t_end:
                    walls.append(time.time())
                    bwd.submit(1)
                    if len(walls) % batch == 0:
                        bwd.wait()
                    if ts.n == ts.capacity:
                        dev = ts.read() / 1e6
                        rec += [(w, case, float(x)) for w, x in zip(walls, dev)]
                        walls = []
                        ts.reset()
                dev = ts.read() / 1e6
                rec += [(w, case, float(x)) for w, x in zip(walls, dev)]
            del fwd, bwd
    finally:
        time.sleep(0.5)
        if smi is not None:
            smi.terminate()
            smi.wait()
    with open(out / f"webgpu-phases-{a.tag}.csv", "w") as f:
        f.write("wall_s,case,device_ms\n")
        for w, c, x in rec:
            f.write(f"{w:.4f},{c},{x:.5f}\n")
    samples = parse_smi(smi_csv) if has_smi else []
    st = np.array([t for t, _ in samples]) if samples else np.zeros(0)
    for case in a.cases.split(","):
        r = [(w, x) for w, c, x in rec if c == case]
        if not r:
            continue
        w = np.array([x[0] for x in r])
        d = np.array([x[1] for x in r])
        p5 = float(np.percentile(d, 5))
        slow = d > WB.SLOW_FACTOR * p5
        c = dict(n=len(d), min_ms=float(d.min()), p5_ms=p5, median_ms=float(np.median(d)),
                 max_ms=float(d.max()), slow=int(slow.sum()),
                 slow_spans=_spans(w, slow))
        if len(st):
            # each sample: the submissions within 0.5 s of it -> slow share
            per = {}
            for t, s in samples:
                near = np.abs(w - t) < 0.5
                if near.sum() < 3:
                    continue
                share = float(slow[near].mean())
                key = "slow" if share > 0.5 else "fast"
                for fld, val in s.items():
                    if fld == "timestamp":
                        continue
                    per.setdefault(fld, {"slow": [], "fast": []})[key].append(num(val))
            c["smi_slow_vs_fast"] = {fld: {k: _describe(v) for k, v in sf.items()}
                                     for fld, sf in per.items()}
        summary["cases"][case] = c
        print(case, json.dumps({k: v for k, v in c.items() if k != "smi_slow_vs_fast"}))
        for fld, sf in c.get("smi_slow_vs_fast", {}).items():
            print(f"   {fld}: slow {sf['slow']}  fast {sf['fast']}")
    (out / f"webgpu-phases-{a.tag}.json").write_text(json.dumps(summary, indent=1))


def _spans(w, slow, gap=0.2):
    """Wall-time spans (s from the case's first submission) of runs of slow submissions."""
    spans, start, last = [], None, None
    for t, s in zip(w, slow):
        if s:
            if start is None or t - last > gap:
                if start is not None:
                    spans.append((round(start - w[0], 3), round(last - w[0], 3)))
                start = t
            last = t
    if start is not None:
        spans.append((round(start - w[0], 3), round(last - w[0], 3)))
    return spans[:50]


def _describe(vals):
    if not vals:
        return None
    if all(isinstance(v, float) for v in vals):
        a = np.array(vals)
        return dict(n=len(a), median=float(np.median(a)), min=float(a.min()), max=float(a.max()))
    from collections import Counter

    return dict(Counter(map(str, vals)).most_common(4))


if __name__ == "__main__":
    main()
