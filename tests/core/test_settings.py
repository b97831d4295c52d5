"""anyattn.settings: every environment switch in one table, read in one place.

- no module but settings.py reads os.environ for a switch (the exceptions as data);
- every switch is read somewhere (no dead row) and documented in docs/settings.md;
- a bad value raises ValueError naming the variable and what it accepts;
- current() follows the environment between calls and is one object while it is
  unchanged.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from anyattn import settings

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "src" / "anyattn"

#: (file under src/anyattn, text of the line) -> why it may touch os.environ itself
ENV_ALLOWED = {
    ("settings.py", "_ENV_DATA = getattr(os.environ"):
        "the one reader",
    ("settings.py", "return tuple([os.environ.get(k) for k in _KEYS])"):
        "the one reader",
    ("settings.py", 'return tuple(sorted(n for n in os.environ if n.startswith("ANYATTN_")'):
        "the one reader: names no switch has",
    ("bench.py", 'info["env"] = {k: os.environ[k] for k'):
        "reports the variables that shaped a benchmark run, acts on none",
    ("bench.py", '"ANYATTN_NUMPY_THREADS") if k in os.environ}'):
        "the same report",
    ("backends/webgpu/device.py", 'if not os.environ.get("XDG_RUNTIME_DIR"):'):
        "the Vulkan loader's variable, set for it on headless machines",
    ("backends/webgpu/device.py", 'os.environ["XDG_RUNTIME_DIR"] = path'):
        "the same",
    ("backends/triton/__init__.py", 'os.environ.get("SystemRoot"'):
        "Windows' own variable: where its driver DLL lives",
}
ENV_NAMES = ("environ", "getenv", "putenv", "unsetenv", "environb", "getenvb")


def _env_lines():
    """(file, line number, line) of every use of os.environ / os.getenv / ... in src
    (found with ast: docstrings and comments do not count)."""
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        text = path.read_text()
        lines = text.splitlines()
        found = set()
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Attribute) and node.attr in ENV_NAMES
                    and isinstance(node.value, ast.Name) and node.value.id == "os"):
                found.add(node.lineno)
            elif isinstance(node, ast.ImportFrom) and node.module == "os" and any(
                    a.name in ENV_NAMES for a in node.names):
                found.add(node.lineno)
        for n in sorted(found):
            yield rel, n, lines[n - 1].strip()


def test_only_settings_reads_the_environment():
    used = set()
    stray = []
    for rel, n, line in _env_lines():
        hit = [key for key in ENV_ALLOWED if key[0] == rel and key[1] in line]
        if hit:
            used.update(hit)
        else:
            stray.append(f"src/anyattn/{rel}:{n}: {line}")
    assert not stray, ("read the switch through anyattn.settings.current() (add it to "
                       "settings.SWITCHES):\n" + "\n".join(stray))
    assert used == set(ENV_ALLOWED), f"stale exceptions: {set(ENV_ALLOWED) - used}"


def test_every_switch_is_read_and_documented():
    text = "\n".join(p.read_text() for p in SRC.rglob("*.py") if p.name != "settings.py")
    dead = [s.name for s in SWITCHES if not re.search(rf"\.{s.field}\b", text)]
    assert not dead, f"switches no module reads: {dead}"
    doc = (ROOT / "docs" / "settings.md").read_text()
    assert settings.markdown_table() in doc, ("docs/settings.md: paste "
                                              "anyattn.settings.markdown_table()")


SWITCHES = settings.SWITCHES
#: a value each switch refuses (TRITON_INTERPRET refuses none: Triton reads any value;
#: the free-text switches are checked where they are used)
BAD = {s.name: "bogus" for s in SWITCHES}
BAD.update(ANYATTN_NUMPY_THREADS="0", ANYATTN_NUMPY_BLOCK_Q="-4", ANYATTN_NUMPY_BLOCK_K="x",
           ANYATTN_TRITON_CONFIG="Fixed")
FREE = {"TRITON_INTERPRET", "ANYATTN_WGPU_ADAPTER", "ANYATTN_WEBGPU_VARIANT",
        "ANYATTN_TRITON_FN_CACHE"}


@pytest.mark.parametrize("switch", [s for s in SWITCHES if s.name not in FREE],
                         ids=lambda s: s.name)
def test_bad_value_names_the_variable_and_what_it_accepts(switch, monkeypatch):
    monkeypatch.setenv(switch.name, BAD[switch.name])
    with pytest.raises(ValueError) as err:
        settings.current()
    msg = str(err.value)
    assert msg.startswith(f"{switch.name}={BAD[switch.name]!r}: expected"), msg
    for word in re.findall(r"[a-z0-9]+", switch.accepts.split("(")[0]):
        if word not in ("or", "integer"):
            assert word in msg, (word, msg)
    monkeypatch.delenv(switch.name)
    settings.current()                       # unset again: accepted


@pytest.mark.parametrize("raw, value", [("1", True), ("true", True), ("YES", True),
                                        ("on", True), ("0", False), ("false", False),
                                        ("2", False), ("", False)])
def test_triton_interpret_reads_as_triton_does(raw, value, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", raw)
    assert settings.current().triton_interpret is value


def test_values_and_defaults(monkeypatch):
    for s in SWITCHES:
        monkeypatch.delenv(s.name, raising=False)
    env = settings.current()
    assert (env.numpy_threads, env.triton_path, env.triton_config, env.triton_autotune,
            env.numpy_blas_local) == (None, "auto", "heuristic", False, True)
    monkeypatch.setenv("ANYATTN_NUMPY_THREADS", " 3")
    monkeypatch.setenv("ANYATTN_TRITON_PATH", " Hopper ")
    monkeypatch.setenv("ANYATTN_TRITON_AUTOTUNE", "1")
    monkeypatch.setenv("ANYATTN_TRITON_CONFIG", "fixed")
    env = settings.current()
    assert (env.numpy_threads, env.triton_path, env.triton_autotune,
            env.triton_config) == (3, "hopper", True, "fixed")


def test_current_follows_the_environment_and_is_cached(monkeypatch):
    monkeypatch.delenv("ANYATTN_TRITON_CONFIG", raising=False)
    a = settings.current()
    assert settings.current() is a           # unchanged: the same object
    snap = settings.snapshot()
    monkeypatch.setenv("ANYATTN_TRITON_CONFIG", "fixed")
    assert settings.snapshot() != snap
    assert settings.current().triton_config == "fixed"
    monkeypatch.delenv("ANYATTN_TRITON_CONFIG")
    assert settings.current().triton_config == "heuristic" and settings.snapshot() == snap


def test_info_settings_prints_every_switch(capsys, monkeypatch):
    from anyattn.cli import main

    monkeypatch.setenv("ANYATTN_TRITON_PATH", "portable")
    assert main(["info", "--settings"]) == 0
    out = capsys.readouterr().out
    for s in SWITCHES:
        assert s.name in out
    assert re.search(r"ANYATTN_TRITON_PATH\s+portable\b", out)
    assert re.search(r"ANYATTN_TRITON_CONFIG\s+\(default: heuristic\)", out)


def test_an_unknown_variable_warns_once_and_is_listed(monkeypatch):
    """A misspelt or removed ANYATTN_* switch is not silently ignored: one RuntimeWarning
    naming it, and `info --settings` lists it; a tool's variable draws none."""
    monkeypatch.setenv("ANYATTN_TRITON_FUSED_BWD", "0")        # a switch that is gone
    monkeypatch.setenv("ANYATTN_EXHAUSTIVE", "0")              # the test suite's
    monkeypatch.setattr(settings, "_warned", set())
    monkeypatch.setattr(settings, "_last", (None, None))
    with pytest.warns(RuntimeWarning, match="ANYATTN_TRITON_FUSED_BWD: not a switch") as got:
        settings.current()
    assert not any("ANYATTN_EXHAUSTIVE" in str(w.message) for w in got)
    assert "not switches, ignored: ANYATTN_TRITON_FUSED_BWD" in settings.describe()
    monkeypatch.setenv("ANYATTN_NUMPY_THREADS", "1")           # a rebuild: no second warning
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        settings.current()
