"""Run a CPU-sized subset of FlashAttention's own tests/test_flash_attn.py against
anyattn.flash_attn on torch CPU tensors.

    PYTHONPATH=<worktree>/src:<dir with einops> python3 bench/lab/fa_testfile_cpu.py \
        /path/to/test_flash_attn.py [--max-seqlen 256] [--max-d 64] [--sample 400] \
        [--seed 0] [-- extra pytest args]

The test file is read from the given path (nothing is fetched), copied into a temporary
folder with its ``"cuda"`` devices turned into ``"cpu"``, next to a conftest that calls
``anyattn.flash_attn.install()`` and answers FlashAttention's ``torch.cuda`` capability
queries (an sm80 with 80 GiB).  Cases whose sequence lengths or head dim exceed the limits
are deselected, then ``--sample`` of the rest are kept (seeded).  The pytest summary is the
result: pass / fail / skip counts per test function are printed at the end.
"""
import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

CONFTEST = r'''
import os
import random
import types

import pytest
import torch

import anyattn.flash_attn

anyattn.flash_attn.install()
torch.cuda.get_device_capability = lambda device=None: (8, 0)
torch.cuda.get_device_properties = lambda device=None: types.SimpleNamespace(
    total_memory=80 * 2 ** 30, name="cpu")
torch.cuda.synchronize = lambda device=None: None

MAX_SEQ = int(os.environ["FA_CPU_MAX_SEQLEN"])
MAX_D = int(os.environ["FA_CPU_MAX_D"])
SAMPLE = int(os.environ["FA_CPU_SAMPLE"])
SEED = int(os.environ["FA_CPU_SEED"])


def _too_big(item):
    params = getattr(getattr(item, "callspec", None), "params", {})
    for name, val in params.items():
        if name.startswith("seqlen") and isinstance(val, int) and val > MAX_SEQ:
            return True
        if name == "d" and isinstance(val, int) and val > MAX_D:
            return True
    return False


def pytest_collection_modifyitems(config, items):
    keep = [it for it in items if not _too_big(it)]
    drop = [it for it in items if _too_big(it)]
    if SAMPLE and len(keep) > SAMPLE:
        rng = random.Random(SEED)
        chosen = set(rng.sample(range(len(keep)), SAMPLE))
        drop += [it for i, it in enumerate(keep) if i not in chosen]
        keep = [it for i, it in enumerate(keep) if i in chosen]
    config.hook.pytest_deselected(items=drop)
    items[:] = keep
'''


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("test_file")
    ap.add_argument("--max-seqlen", type=int, default=256)
    ap.add_argument("--max-d", type=int, default=64)
    ap.add_argument("--sample", type=int, default=400, help="0 keeps every small case")
    ap.add_argument("--seed", type=int, default=0)
    argv = sys.argv[1:]
    cut = argv.index("--") if "--" in argv else len(argv)
    args = ap.parse_args(argv[:cut])
    args.pytest_args = argv[cut + 1:]
    with open(args.test_file) as f:
        text = f.read()
    text = re.sub(r"""(['"])cuda\1""", '"cpu"', text)
    tmp = tempfile.mkdtemp(prefix="fa_cpu_")
    with open(os.path.join(tmp, "test_fa_cpu.py"), "w") as f:
        f.write(text)
    with open(os.path.join(tmp, "conftest.py"), "w") as f:
        f.write(CONFTEST)
    env = dict(os.environ, FA_CPU_MAX_SEQLEN=str(args.max_seqlen), FA_CPU_MAX_D=str(args.max_d),
               FA_CPU_SAMPLE=str(args.sample), FA_CPU_SEED=str(args.seed))
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
           "--tb=line", os.path.join(tmp, "test_fa_cpu.py")] + args.pytest_args
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True)
    counts = collections.defaultdict(collections.Counter)
    for line in proc.stdout.splitlines():
        m = re.match(r"(PASSED|FAILED|ERROR|SKIPPED) \S*::(\w+)", line)
        if m:
            counts[m.group(2)][m.group(1)] += 1
    print("\n".join(ln for ln in proc.stdout.splitlines()
                    if ln.startswith(("FAILED", "ERROR", "/tmp")) or " in " in ln)[-8000:])
    print(proc.stderr[-2000:])
    for name, c in sorted(counts.items()):
        print(f"{name}: {dict(c)}")
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
