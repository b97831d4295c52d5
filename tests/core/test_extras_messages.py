"""Messages about a missing optional package name the extra that installs it
(``pip install "anyattn[torch]"`` and so on, from pyproject.toml's extras).

Each check runs in a fresh interpreter whose import system refuses the package (a
meta-path finder installed first), as on a machine without it.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

import anyattn
from anyattn.extras import EXTRAS, install_hint, installed, missing_message

SRC = os.path.dirname(os.path.dirname(os.path.abspath(anyattn.__file__)))

#: argv[1]: the top-level packages to refuse (comma separated); argv[2]: "absent"
#: (ModuleNotFoundError, as for a package that is not installed) or "broken" (ImportError
#: from the package's own import)
BLOCKER = r"""
import sys
class _Blocker:
    def __init__(self, names, broken):
        self.names, self.broken = names, broken
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in self.names:
            if self.broken:
                raise ImportError(f"{name} is broken (blocked)", name=name)
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None
sys.meta_path.insert(0, _Blocker(set(sys.argv[1].split(",")), sys.argv[2] == "broken"))
import json
def report(fn):
    try:
        fn()
    except BaseException as e:
        c = e.__cause__
        print(json.dumps({"type": type(e).__name__, "msg": str(e),
                          "import_error": isinstance(e, ImportError),
                          "cause": None if c is None else [type(c).__name__, c.name]}))
    else:
        print(json.dumps({"type": None}))
"""


def _run(blocked: str, code: str, broken: bool = False, **env_extra) -> dict:
    env = dict(os.environ, PYTHONPATH=SRC)
    env.pop("TRITON_INTERPRET", None)
    env.update(env_extra)
    r = subprocess.run([sys.executable, "-c", BLOCKER + textwrap.dedent(code), blocked,
                        "broken" if broken else "absent"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 0, f"{r.stdout[-2000:]}\n{r.stderr[-3000:]}"
    return json.loads(r.stdout.strip().splitlines()[-1])


def _needs(*packages):
    for package in packages:
        if importlib.util.find_spec(package) is None:
            pytest.skip(f"{package} is not installed")


@pytest.mark.parametrize("module", ["anyattn.torch", "anyattn.distributed"])
def test_torch_modules_without_torch(module):
    res = _run("torch", f"""
        import importlib
        report(lambda: importlib.import_module({module!r}))
        """)
    assert res["import_error"] and res["type"] == "ModuleNotFoundError", res
    assert res["msg"] == (f'{module} needs torch, which is not installed: '
                          'pip install "anyattn[torch]"')
    assert res["cause"] == ["ModuleNotFoundError", "torch"]     # the original, chained


def test_torch_that_fails_to_import():
    res = _run("torch", """
        report(lambda: __import__("anyattn.torch"))
        """, broken=True)
    assert res["type"] == "ImportError", res
    assert res["msg"].startswith("anyattn.torch needs torch, which is installed but failed "
                                 "to import (ImportError: torch is broken (blocked))")
    assert res["msg"].endswith('reinstall it: pip install "anyattn[torch]"')
    assert res["cause"] == ["ImportError", "torch"]


def test_transformers_backend_without_transformers():
    _needs("torch")
    res = _run("transformers", """
        report(lambda: __import__("anyattn.torch.transformers_backend"))
        """)
    assert res["import_error"], res
    assert res["msg"] == ('anyattn.torch.transformers_backend needs transformers, which is not '
                          'installed: pip install "anyattn[transformers]"')
    assert res["cause"][1].split(".")[0] == "transformers"


def test_describe_and_info_without_torch():
    res = _run("torch", """
        import anyattn
        from anyattn.cli import main
        why = dict(anyattn.describe_backends())
        main(["info"])
        print(json.dumps(why))
        """)
    assert res["triton"] == 'needs torch, which is not installed: pip install "anyattn[triton]"'


def test_triton_backend_without_triton():
    """torch present, triton refused: describe and an explicit backend='triton' call
    (CPU tensors under the interpreter) both name the extra."""
    _needs("torch")
    res = _run("triton", """
        import torch
        import anyattn
        why = dict(anyattn.describe_backends())["triton"]
        q = torch.zeros(1, 1, 4, 8)
        def call():
            try:
                anyattn.attention(q, q, q, backend="triton")
            except anyattn.BackendUnavailable as e:
                raise RuntimeError(f"{why}|{e}")
        report(call)
        """, TRITON_INTERPRET="1")
    described, raised = res["msg"].split("|")
    hint = 'needs triton, which is not installed: pip install "anyattn[triton]"'
    assert described == hint
    assert raised == f"backend='triton' is not available here: {hint}"


def test_cli_check_triton_without_torch():
    res = _run("torch", """
        import contextlib, io
        from anyattn.cli import main
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                rc = main(["check", "--backend", "triton", "--shape", "1,1,4,8"])
            except SystemExit as e:         # argparse's error path: one line, exit 2
                rc = e.code
        print(json.dumps({"rc": rc, "err": err.getvalue()}))
        """)
    assert res["rc"] == 2
    assert "argument --backend: 'triton'" in res["err"]
    assert "needs torch" in res["err"] and "anyattn[triton]" in res["err"]
    assert "Traceback" not in res["err"]


def test_webgpu_without_wgpu():
    res = _run("wgpu", """
        import numpy as np
        import anyattn, anyattn.webgpu
        from anyattn.backends.registry import unavailable_reason
        q = np.zeros((1, 1, 4, 8), np.float32)
        out = {"described": dict(anyattn.describe_backends())["webgpu"],
               "checked": unavailable_reason("webgpu")}
        for name, fn in (("call", lambda: anyattn.attention(q, q, q, backend="webgpu")),
                         ("asarray", lambda: anyattn.webgpu.asarray(q)),
                         ("device", anyattn.webgpu.device)):
            try:
                fn()
            except Exception as e:
                out[name] = [type(e).__name__, str(e)]
        print(json.dumps(out))
        """)
    hint = 'needs wgpu, which is not installed: pip install "anyattn[webgpu]"'
    assert res["described"] == hint and res["checked"] == hint
    assert res["call"] == ["BackendUnavailable", f"backend='webgpu' is not available here: {hint}"]
    assert res["asarray"] == ["ModuleNotFoundError", f"anyattn.webgpu.asarray {hint}"]
    assert res["device"] == ["RuntimeError", hint]


def test_bench_without_torch_or_matplotlib():
    res = _run("torch,matplotlib", """
        import contextlib, io
        from anyattn import bench
        from anyattn.cli import main
        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            try:
                rc = main(["bench", "--vs", "torch", "--shapes", "1,1,8,8"])
            except SystemExit as e:         # argparse's error path: one line, exit 2
                rc = e.code
            plotted = bench._plot([], "unused.png", "t")
        print(json.dumps({"rc": rc, "plotted": plotted, "err": err.getvalue()}))
        """)
    assert res["rc"] == 2 and res["plotted"] is False
    assert "argument --vs" in res["err"] and "anyattn[torch]" in res["err"]
    assert ('no plot written: needs matplotlib, which is not installed: '
            'pip install "anyattn[bench]"') in res["err"]


def test_extras_match_pyproject():
    tomllib = pytest.importorskip("tomllib")
    with open(os.path.join(os.path.dirname(SRC), "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert set(EXTRAS) <= set(extras)
    assert install_hint("webgpu") == 'pip install "anyattn[webgpu]"'
    with pytest.raises(ValueError, match="extra"):
        install_hint("wgpu")
    assert missing_message("wgpu", "webgpu", "x") == \
        'x needs wgpu, which is not installed: pip install "anyattn[webgpu]"'
    assert installed("numpy") and not installed("anyattn_no_such_package")


def test_no_install_hint_without_the_extra():
    """Every 'pip install' in the package names one of anyattn's extras."""
    import re

    for root, _, files in os.walk(os.path.join(SRC, "anyattn")):
        for fn in files:
            if fn.endswith(".py"):
                text = open(os.path.join(root, fn), encoding="utf-8").read()
                for m in re.finditer(r"pip install[^\n]*", text):
                    assert "anyattn[" in m.group(0), f"{fn}: {m.group(0)}"
