"""The command line: info, check (pass and fail exit codes), errors."""
import subprocess
import sys
import os

import numpy as np
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
    with pytest.raises(SystemExit) as e:
        main(["check", "--backend", "nonesuch", "--shape", "1,1,4,8"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --backend: invalid choice: 'nonesuch'" in err
    for name in ("numpy", "triton", "webgpu", "reference"):
        assert repr(name) in err


def test_bad_mask_spec():
    import argparse

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


# -- every bad argument: one line naming the flag and what it accepts, exit status 2 --------

_MASKS = "expected none, causal, causal_br, sliding:W, window:L[:R], documents:N or keep:P"

BAD_CHECK = [
    (["--shape", "1,8,0,64"], "--shape", "B,H,S,D or B,Hq,Hkv,Sq,Sk,D"),
    (["--shape", "1,8,-4,64"], "--shape", "positive integers"),
    (["--shape", "1,8,a,64"], "--shape", "positive integers"),
    (["--shape", "1,2,3"], "--shape", "B,H,S,D or B,Hq,Hkv,Sq,Sk,D"),
    (["--shape", "1,4,3,8,8,8"], "--shape", "must divide Hq=4"),
    (["--mask", "causal:3"], "--mask", "causal takes no argument; " + _MASKS),
    (["--mask", "causal_br:1"], "--mask", "causal_br takes no argument"),
    (["--mask", "none:x"], "--mask", "none takes no argument"),
    (["--mask", "keep:2"], "--mask", "must be in (0, 1]"),
    (["--mask", "keep:0"], "--mask", "must be in (0, 1]"),
    (["--mask", "keep:nan"], "--mask", "must be in (0, 1]"),
    (["--mask", "keep:"], "--mask", "nothing after ':'"),
    (["--mask", "sliding:"], "--mask", "nothing after ':'"),
    (["--mask", "sliding:-1"], "--mask", "integer >= 0"),
    (["--mask", "sliding:1.5"], "--mask", "integer >= 0"),
    (["--mask", "window"], "--mask", "window needs L"),
    (["--mask", "window:-1"], "--mask", "integer >= 0"),
    (["--mask", "window:1:x"], "--mask", "integer >= 0"),
    (["--mask", "window:1:2:3"], "--mask", "at most two numbers"),
    (["--mask", "documents:0"], "--mask", "integer >= 1"),
    (["--mask", "documents:x"], "--mask", "integer >= 1"),
    (["--mask", "diagonal"], "--mask", _MASKS),
    (["--backend", "nonesuch"], "--backend", "'numpy', 'reference'"),
    (["--seed", "-1"], "--seed", "[0, 2**64)"),
    (["--seed", str(2 ** 64)], "--seed", "[0, 2**64)"),
    (["--seed", "x"], "--seed", "[0, 2**64)"),
    (["--softcap", "0"], "--softcap", "c > 0"),
    (["--softcap", "-1"], "--softcap", "c > 0"),
    (["--softcap", "nan"], "--softcap", "c > 0"),
    (["--softcap", "inf"], "--softcap", "c > 0"),
    (["--dropout", "1"], "--dropout", "[0, 1)"),
    (["--dropout", "-0.1"], "--dropout", "[0, 1)"),
    (["--dropout", "nan"], "--dropout", "[0, 1)"),
    (["--dtype", "float8"], "--dtype", "'float16', 'float32', 'float64'"),
    (["--dtype", "bfloat16"], "--dtype", "--backend triton"),
    (["--dtype", "float64", "--backend", "webgpu"], "--dtype", "takes float16, float32"),
    (["--bias", "rows"], "--bias", "'none', 'full'"),
    (["--precision", "fast"], "--precision", "'highest', 'tf32'"),
    (["--precision", "tf32"], "--precision", "backend 'numpy' takes highest"),
]


@pytest.mark.parametrize("argv,flag,accepted", BAD_CHECK,
                         ids=[" ".join(a) for a, _, _ in BAD_CHECK])
def test_bad_check_argument_is_one_line_usage_error(argv, flag, accepted, capsys):
    with pytest.raises(SystemExit) as e:
        main(["check", "--shape", "1,1,4,8", *argv] if "--shape" not in argv
             else ["check", *argv])
    assert e.value.code == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    lines = cap.err.splitlines()
    assert len(lines) == 1, cap.err
    assert lines[0].startswith(f"anyattn check: error: argument {flag}: "), lines[0]
    assert accepted in lines[0]


BAD_BENCH = [
    (["--shapes", "1,8,0,64"], "--shapes", "four positive integers B,H,S,D"),
    (["--shapes", "1,8,a,64"], "--shapes", "four positive integers B,H,S,D"),
    (["--repeats", "0"], "--repeats", "integer >= 1"),
    (["--repeats", "x"], "--repeats", "integer >= 1"),
    (["--warmup", "-1"], "--warmup", "integer >= 0"),
    (["--seed", "-1"], "--seed", "[0, 2**64)"),
    (["--backend", "triton"], "--backend", "'webgpu', 'numpy', 'reference'"),
    (["--backend", "numpy", "numpy"], "--backend", "named twice"),
    (["--dtype", "float16"], "--dtype", "'float32', 'float64'"),
    (["--dtype", "float64", "--backend", "webgpu"], "--dtype", "takes float16, float32"),
    (["--causal", "maybe"], "--causal", "'both', 'only', 'off'"),
    (["--vs", "jax"], "--vs", "'torch'"),
    (["--json", "{missing}/x.json"], "--json", "does not exist"),
    (["--plot", "{missing}/x.png"], "--plot", "does not exist"),
    (["--json", "."], "--json", "is a directory"),
    (["--memory", "--vs", "torch"], "--vs", "--memory does not use it"),
    (["--memory", "--repeats", "2"], "--repeats", "--memory does not use it"),
    (["--memory", "--warmup", "0"], "--warmup", "--memory does not use it"),
]


@pytest.mark.parametrize("argv,flag,accepted", BAD_BENCH,
                         ids=[" ".join(a) for a, _, _ in BAD_BENCH])
def test_bad_bench_argument_is_one_line_usage_error(argv, flag, accepted, capsys, tmp_path):
    missing = tmp_path / "missing"
    with pytest.raises(SystemExit) as e:
        main(["bench", "--shapes", "1,1,8,8",
              *(a.format(missing=missing) for a in argv)])
    assert not missing.exists()                 # no directory is created
    assert e.value.code == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    lines = cap.err.splitlines()
    assert len(lines) == 1, cap.err
    assert lines[0].startswith(f"anyattn bench: error: argument {flag}: "), lines[0]
    assert accepted in lines[0]


def test_bad_arguments_exit_2_without_traceback_in_a_process(tmp_path):
    r = _run_cli("check", "--shape", "1,8,0,64")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and "argument --shape" in r.stderr
    missing = tmp_path / "missing" / "deeper"
    r = _run_cli("bench", "--shapes", "1,1,8,8", "--json", str(missing / "x.json"))
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.count("\n") == 1 and "argument --json" in r.stderr
    assert not (tmp_path / "missing").exists()              # no directory was created


@pytest.mark.parametrize("spec", ["none", "causal", "causal_br", "sliding", "sliding:2",
                                  "window:1", "window:0:2", "documents", "documents:2",
                                  "keep", "keep:1", "keep:0.7"])
def test_good_mask_specs_pass(spec, capsys):
    assert main(["check", "--backend", "reference", "--shape", "1,1,6,8", "--mask", spec]) == 0
    assert "PASS" in capsys.readouterr().out


def test_triton_without_cuda_says_what_a_cli_user_can_do(monkeypatch, capsys):
    """Not the Python API's '.cuda()': the GPU it needs and the interpreter's switch."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(SystemExit) as e:
        main(["check", "--backend", "triton", "--shape", "1,1,8,8"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert len(err.splitlines()) == 1 and err.startswith("anyattn check: error: argument "
                                                         "--backend: 'triton' cannot run here")
    assert "CUDA GPU" in err and "TRITON_INTERPRET=1" in err and "--backend numpy" in err
    assert ".cuda()" not in err


def test_missing_extra_is_named_as_a_pip_install(monkeypatch, capsys):
    from anyattn import extras

    real = extras.installed
    monkeypatch.setattr(extras, "installed",
                        lambda name: name != "wgpu" and real(name))
    with pytest.raises(SystemExit) as e:
        main(["check", "--backend", "webgpu", "--shape", "1,1,8,8"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "argument --backend: 'webgpu' cannot run here" in err
    assert "pip install 'anyattn[webgpu]'" in err


@pytest.mark.parametrize("backend", ["numpy", "reference"])
def test_check_claims_no_compilation_on_host_backends(backend, capsys):
    assert main(["check", "--backend", backend, "--shape", "1,1,8,8"]) == 0
    timing = [ln for ln in capsys.readouterr().out.splitlines() if "forward" in ln]
    assert len(timing) == 1
    assert "compil" not in timing[0] and "first call" not in timing[0]
    assert "warm-up" not in timing[0] and "one call each" in timing[0]


# -- bench: what the numbers mean, and their statistics ------------------------------------

def test_bench_says_what_the_numbers_mean(tmp_path, monkeypatch, capsys):
    import json

    from anyattn import extras

    real = extras.installed
    monkeypatch.setattr(extras, "installed",               # as on a machine without torch
                        lambda name: name != "torch" and real(name))
    js = tmp_path / "b.json"
    assert main(["bench", "--shapes", "1,1,16,8", "--causal", "off", "--repeats", "1",
                 "--warmup", "0", "--json", str(js)]) == 0
    out = capsys.readouterr().out
    head = out.splitlines()[0]
    for col in ("fwd ms med", "bwd ms med", "f+b ms med", "of GEMM"):
        assert col in head
    assert "median of 1 timed run(s)" in out and "yardstick: NumPy float32 matrix product" in out
    assert "pip install 'anyattn[torch]' and add --vs torch" in out
    rep = json.loads(js.read_text())
    assert rep["gemm_yardstick"]["gflops"] > 0 and rep["repeats"] == 1
    res = rep["results"][0]
    assert res["times_total_ms"] and res["total_ms"] == res["times_total_ms"][0]


def test_bench_vs_torch_without_torch_is_a_usage_error(monkeypatch, capsys):
    from anyattn import extras

    real = extras.installed
    monkeypatch.setattr(extras, "installed",
                        lambda name: name != "torch" and real(name))
    with pytest.raises(SystemExit) as e:
        main(["bench", "--vs", "torch", "--shapes", "1,1,8,8"])
    assert e.value.code == 2
    assert "argument --vs: torch is not installed: pip install 'anyattn[torch]'" in \
        capsys.readouterr().err


def test_bench_total_is_the_median_of_whole_runs(monkeypatch):
    """Three runs, fwd 1, 2, 6 ms and bwd 6, 1, 2 ms: whole runs 7, 3, 8 ms.  The total is
    their median, 7 ms; not the fastest run (3), a sum of minima (2) or of medians (4)."""
    from anyattn import bench

    class Clock:
        def __init__(self, ticks):
            self.ticks = iter(ticks)

        def perf_counter(self):
            return next(self.ticks)

        def sleep(self, seconds):
            pass

    ticks = []
    for run, (f, b) in enumerate([(1, 6), (2, 1), (6, 2)]):
        ticks += [run, run + f / 1e3, run + (f + b) / 1e3]

    class Nothing(bench._Impl):
        name = "nothing"

        def prepare(self, case, arrays):
            return None

        def fwd(self, st):
            return None

        def bwd(self, st, fo):
            return None

        def output(self, st, fo):
            return np.zeros(1)

    monkeypatch.setattr(bench, "time", Clock(ticks))
    monkeypatch.setattr(bench, "_progress", lambda msg: None)
    case = bench.Case(1, 1, 4, 2, False, "float32")
    (res,) = bench._time_case(case, [Nothing()], 3, 0, 0, [0], 3)
    assert res.total_ms == pytest.approx(7.0)
    assert res.fwd_ms == pytest.approx(2.0) and res.bwd_ms == pytest.approx(2.0)
    assert res.min_total_ms == pytest.approx(3.0)
    assert res.total_gflops == pytest.approx(
        bench.flops(1, 1, 4, 4, 2, False, "fwd+bwd") / 7.0 / 1e6)


def test_bench_memory_measures_every_named_backend(tmp_path, capsys):
    import json

    js = tmp_path / "m.json"
    assert main(["bench", "--memory", "--backend", "numpy", "reference", "--shapes",
                 "1,1,32,8", "--json", str(js)]) == 0
    mems = json.loads(js.read_text())["memory"]
    assert [m["backend"] for m in mems] == ["numpy", "reference"]


def test_closed_pipe_stops_quietly():
    """``anyattn info | head -1``: the reader goes away; no traceback, exit status 1."""
    import subprocess
    import sys

    src = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "src")
    env = dict(os.environ, PYTHONPATH=src)
    proc = subprocess.Popen([sys.executable, "-m", "anyattn", "info"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=env)
    proc.stdout.readline()
    proc.stdout.close()                     # the reader goes away after one line
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) in (0, 1)
    assert "Traceback" not in err and "BrokenPipeError" not in err, err
