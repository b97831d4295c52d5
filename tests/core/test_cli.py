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


def _run_cli(*args):
    env = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "src"))
    return subprocess.run([sys.executable, "-m", "anyattn", *args], capture_output=True,
                          text=True, env=env, timeout=120)


@pytest.mark.parametrize("spec", ["diagonal", "sliding:x", "window:-1", "keep:half"])
def test_unknown_mask_is_a_usage_error(spec):
    """argparse style: exit code 2, the last line names --mask, no traceback."""
    r = _run_cli("check", "--backend", "reference", "--shape", "1,1,4,8", "--mask", spec)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("anyattn check: error: argument --mask:") and repr(spec) in last


def test_unknown_mask_in_process_exits_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["check", "--backend", "reference", "--shape", "1,1,4,8", "--mask", "diagonal"])
    assert e.value.code == 2
    assert "argument --mask" in capsys.readouterr().err


def test_version():
    import anyattn

    r = _run_cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"anyattn {anyattn.__version__}"


def test_info_says_how_each_backend_is_dispatched(capsys):
    assert main(["info"]) == 0
    lines = {ln.split()[0]: ln for ln in capsys.readouterr().out.splitlines()[2:]}
    assert set(lines) == {"numpy", "triton", "webgpu", "reference"}
    if "unavailable" not in lines["numpy"]:
        assert "automatic for numpy" in lines["numpy"]
    assert "unavailable" in lines["reference"] or "only when named" in lines["reference"]
    if "unavailable" not in lines["webgpu"]:
        assert "only when named" in lines["webgpu"]


# -- the package: license, typing marker, extras ------------------------------------------

def test_package_metadata():
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        meta = tomllib.load(f)
    extras = meta["project"]["optional-dependencies"]
    assert {"torch", "triton", "webgpu", "transformers", "test"} <= set(extras)
    for name, reqs in extras.items():
        for req in reqs:
            assert "==" not in req.split(";")[0], f"extra {name!r} pins {req!r}: use a range"
    for pkg in ("pytest", "hypothesis", "torch", "wgpu", "transformers"):
        assert any(r.startswith(pkg) for r in extras["test"]), pkg
    assert "py.typed" in meta["tool"]["setuptools"]["package-data"]["anyattn"]
    assert os.path.isfile(os.path.join(ROOT, "src", "anyattn", "py.typed"))
    with open(os.path.join(ROOT, "LICENSE")) as f:
        text = f.read()
    assert "Apache License" in text and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_ci_runs_the_readme_test_command_with_mesa_egl():
    with open(os.path.join(ROOT, ".ci", "run")) as f:
        ci = f.read()
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    cmd = ci.split("# --- the README's test command (keep the two in step) ---\n")[1].strip()
    assert f"```bash\n{cmd}\n```" in readme
    for pkg in ("mesa-vulkan-drivers", "libvulkan1", "libegl1", "libegl-mesa0"):
        assert pkg in ci and pkg in readme.split("## Using it")[0]


def test_check_with_score_modifiers_and_dropout(capsys):
    rc = main(["check", "--backend", "reference", "--shape", "1,4,2,9,13,8", "--mask",
               "causal_br", "--softcap", "3", "--alibi", "--sinks", "--dropout", "0.2"])
    out = capsys.readouterr().out
    assert rc == 0 and "PASS" in out
    assert "softcap 3.0" in out and "dropout_p 0.2" in out and "dsinks" in out
