"""ring_attention refuses calls on which the ranks disagree, on every rank, before the
first exchange (gloo on CPU, 3 processes): before, a size mismatch aborted a rank
(SIGABRT) and a same-byte-count mismatch returned garbage without a word.  A rank that
never calls leaves the others waiting no longer than the documented timeout."""
from __future__ import annotations

import json
import os
import socket
import sys
import time

import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import _agree_worker as W  # noqa: E402

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(),
                                reason="torch.distributed with gloo is not available")

WORLD = 3


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(fn, args, tmp):
    err = None
    try:
        mp.spawn(fn, args=args, nprocs=args[0], join=True)
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    out = []
    for r in range(args[0]):
        p = tmp / f"rank{r}.json"
        out.append(json.loads(p.read_text()) if p.exists() else None)
    assert all(x is not None for x in out), f"a rank wrote nothing ({err})"
    return out


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("agree")
    return _spawn(W.run, (WORLD, _free_port(), str(tmp)), tmp)


def _all(results, name):
    return [res[name] for res in results]


def test_agreeing_ranks_run(results):
    for r, res in enumerate(_all(results, "agree")):
        assert res["type"] is None, res.get("trace")


@pytest.mark.parametrize("name,words", [
    ("seq_len", ["q local length: 16 on ranks 0, 2; 8 on rank 1",
                 "k local length", "v local length"]),
    ("dtype", ["dtype: float32 on ranks 0, 1; float64 on rank 2"]),
    ("same_bytes_other_shape", ["q local length: 16 on ranks 0, 2; 8 on rank 1",
                                "q head_dim: 8 on ranks 0, 2; 16 on rank 1"]),
    ("heads", ["k heads: 1 on rank 0; 2 on ranks 1, 2"]),
    ("mask", ["mask terms: None on ranks 0, 2; Causal on rank 1",
              "mask (fingerprint of its terms and their global ids / keep arrays): None on "
              "ranks 0, 2;"]),
    ("mask_ids", ["mask (fingerprint", "on ranks 0, 1;", "on rank 2"]),
    ("scale", ["scale: 0.3535", "on ranks 0, 2; 0.5 on rank 1"]),
    ("sharding", ["sharding: 'contiguous' on ranks 0, 1; 'zigzag' on rank 2"]),
    ("layout", ["layout: 'bhsd' on ranks 0, 2; 'bshd' on rank 1"]),
    ("wrt", ["gradients asked for (q, k, v): (q, k, v) on ranks 0, 2; () on rank 1"]),
])
def test_every_rank_names_what_differs(results, name, words):
    for r, res in enumerate(_all(results, name)):
        assert res["type"] == "ValueError", (r, res)
        msg = res["message"]
        assert "the ranks disagree before the first exchange" in msg, (r, msg)
        for w in words:
            assert w in msg, (r, w, msg)


def test_a_rank_refusing_its_arguments_stops_the_others_at_once(results):
    res = _all(results, "local_refusal")
    assert res[1]["type"] == "ValueError" and "layout='sbhd' is unknown" in res[1]["message"]
    for r in (0, 2):
        assert res[r]["type"] == "ValueError", res[r]
        assert "rank 1 of 3 refused their own arguments" in res[r]["message"]


def test_a_rank_that_never_calls_stops_the_others_within_the_timeout(results):
    res = _all(results, "never_called")
    assert res[2]["type"] == "skipped"
    for r in (0, 1):
        assert res[r]["type"] == "TimeoutError", res[r]
        assert "did not reach ring_attention" in res[r]["message"]
        assert W.TIMEOUT - 0.5 <= res[r]["seconds"] < W.TIMEOUT + 20, res[r]["seconds"]


def test_default_timeout_is_the_process_groups(tmp_path):
    # With timeout=None the wait ends when the group's own timeout (TIMEOUT; the world
    # group's is PATIENT) fires.  Python then sees our TimeoutError, or gloo aborts the
    # waiting process itself ("terminate called without an active exception", SIGABRT;
    # docs/distributed.md says so).  Either way the wait must end at the group's timeout:
    # for an abort that is timed from the rank's start mark to the parent seeing the exit.
    tmp = tmp_path
    err = None
    try:
        mp.spawn(W.run_default_timeout, args=(2, _free_port(), str(tmp)), nprocs=2, join=True)
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    ended = time.time()
    done = tmp / "rank0.json"
    if done.exists():
        res = json.loads(done.read_text())
        assert res["type"] == "TimeoutError", res
        assert "the process group's timeout" in res["message"]
        seconds = res["seconds"]
    else:
        assert err is not None and "SIGABRT" in err, f"rank 0 wrote nothing ({err})"
        seconds = ended - float((tmp / "rank0.started").read_text())
    assert W.TIMEOUT - 0.5 <= seconds < W.TIMEOUT + 20, seconds
