"""ring_attention on CUDA over NCCL (one GPU per rank, automatic backend = Triton),
float32 and bfloat16, against the float64 reference.  Needs >= 2 GPUs; not run in CI."""
from __future__ import annotations

import json
import os
import sys

import pytest

torch = pytest.importorskip("torch")
import torch.multiprocessing as mp  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _ring_worker  # noqa: E402
from test_ring_gloo import _free_port  # noqa: E402

TOL = {"float32": 1e-5, "bfloat16": 2e-2}
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2
    or not torch.distributed.is_nccl_available(), reason="needs >= 2 CUDA GPUs and NCCL")]

_runs = {}


def _results(tmp_path_factory):
    world = min(torch.cuda.device_count(), 4)
    if world not in _runs:
        out = tmp_path_factory.mktemp("nccl")
        mp.spawn(_ring_worker.run, args=(world, _free_port(), str(out), "nccl"), nprocs=world)
        _runs[world] = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    return _runs[world]


@pytest.mark.parametrize("case", [name for name, _ in _ring_worker.cases_gpu(2)])
def test_ring_nccl_matches_reference(case, tmp_path_factory):
    opts = dict(_ring_worker.cases_gpu(2))[case]
    tol = TOL[opts["dtype"]]
    for rank, res in enumerate(_results(tmp_path_factory)):
        r = res[case]
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
        for what in ("out", "lse", "dq", "dk", "dv"):
            assert r[what] <= tol, f"rank {rank}: {what} relative error {r[what]:.3g} > {tol:g}"
