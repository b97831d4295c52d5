"""anyattn.bench on tiny shapes: table, JSON, plot, memory mode, argument errors."""
from __future__ import annotations

import argparse
import json

import pytest

from anyattn import bench


def _args(*argv):
    p = argparse.ArgumentParser()
    bench.add_arguments(p)
    return p.parse_args(list(argv))


def test_flops_convention():
    assert bench.flops(1, 8, 2048, 2048, 64, False, "fwd") == 4 * 8 * 2048 * 2048 * 64
    assert bench.flops(1, 1, 10, 10, 2, True, "bwd") == 2.5 * 4 * 100 * 2 / 2
    assert bench.flops(1, 1, 10, 10, 2, False, "fwd+bwd") == 3.5 * 4 * 100 * 2


def test_run_writes_json_and_plot(tmp_path, capsys):
    pytest.importorskip("torch")
    js, png = tmp_path / "r.json", tmp_path / "r.png"
    rc = bench.run(_args("--shapes", "1,2,64,16", "--repeats", "1", "--warmup", "0",
                         "--vs", "torch", "--json", str(js), "--plot", str(png)))
    assert rc == 0
    out = capsys.readouterr()
    assert "anyattn-numpy" in out.out and "torch-sdpa" in out.out and "GF/s" in out.out
    assert "[1/4]" in out.err                              # progress on stderr
    rep = json.loads(js.read_text())
    assert len(rep["results"]) == 4 and rep["convention"].startswith("FlashAttention")
    r0 = rep["results"][0]
    assert r0["ratio_vs_torch"] > 0 and r0["max_abs_diff_vs_torch"] < 1e-4
    pytest.importorskip("matplotlib")
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_memory_mode(tmp_path, capsys):
    js = tmp_path / "m.json"
    assert bench.run(_args("--memory", "--shapes", "1,1,512,16", "--json", str(js))) == 0
    m = json.loads(js.read_text())["memory"][0]
    assert m["dense_scores_bytes"] == 512 * 512 * 4 and m["peak_extra_bytes"] > 0


def test_bad_arguments(capsys):
    for argv in (("--shapes", "1,2,3"), ("--backend", "nope"), ("--repeats", "0")):
        with pytest.raises(SystemExit):
            _args(*argv)
    # checks across flags: run() refuses them too (one line on stderr, status 2)
    capsys.readouterr()
    assert bench.run(_args("--backend", "numpy", "numpy")) == 2
    assert capsys.readouterr().err.startswith("error: argument --backend:")
