"""The command line: info, check (pass and fail exit codes), errors."""
import subprocess
import sys
import os

import pytest

from anyattn.cli import build_mask, main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_info_lists_every_backend(capsys):
    assert main(["info"]) == 0
    text = capsys.readouterr().out
    for name in ("numpy", "triton", "webgpu", "reference"):
        assert name in text


def test_check_passes_on_reference(capsys):
    rc = main(["check", "--backend", "reference", "--shape", "1,2,1,9,13,8",
               "--mask", "documents:3", "--bias", "keys"])
    assert rc == 0
    assert "PASS" in capsys.readouterr().out


def test_check_reports_errors_with_exit_2(capsys):
    rc = main(["check", "--backend", "nonesuch", "--shape", "1,1,4,8"])
    assert rc == 2
    assert "unknown" in capsys.readouterr().err


def test_bad_mask_spec():
    import argparse
    import numpy as np

    with pytest.raises(argparse.ArgumentTypeError):
        build_mask("diagonal", 1, 4, 4, np.random.default_rng(0))


def test_module_entry_point_runs():
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    r = subprocess.run([sys.executable, "-m", "anyattn", "info"], capture_output=True,
                       text=True, env=env, timeout=120)
    assert r.returncode == 0 and "reference" in r.stdout
