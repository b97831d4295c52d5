import importlib.util
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))  # the package, uninstalled

# tests/ itself must not be on sys.path: its folders torch/, triton/, webgpu/ would
# shadow the real packages, and where one is not installed `import torch` would then
# "succeed" as a namespace package (tests/torch) instead of raising ImportError.
# pytest's default import mode puts the folder of this conftest there; take it off
# again and load the shared helpers (tests/helpers.py) by path instead.
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
if "helpers" not in sys.modules:
    _spec = importlib.util.spec_from_file_location("helpers", os.path.join(HERE, "helpers.py"))
    _helpers = importlib.util.module_from_spec(_spec)
    sys.modules["helpers"] = _helpers
    _spec.loader.exec_module(_helpers)

# Without a CUDA GPU, the Triton backend runs through Triton's interpreter on CPU
# tensors (set before triton is first imported).
if "TRITON_INTERPRET" not in os.environ:
    try:
        import torch

        if not torch.cuda.is_available():
            os.environ["TRITON_INTERPRET"] = "1"
    except ImportError:
        pass


#: the one switch for the larger cases: ``pytest --exhaustive`` or ANYATTN_EXHAUSTIVE=1
#: runs the tests marked ``exhaustive`` (add ``-m exhaustive`` to run only those) and
#: the Hypothesis tests at their full example counts (the ``anyattn-exhaustive`` profile).
EXHAUSTIVE_HOW = ("pytest --exhaustive (or ANYATTN_EXHAUSTIVE=1); "
                  "pytest --exhaustive -m exhaustive runs only these")


def pytest_addoption(parser):
    parser.addoption("--exhaustive", action="store_true", default=False,
                     help="run the tests marked exhaustive (larger sizes, every "
                          "parametrisation) and Hypothesis at full example counts; "
                          "same as ANYATTN_EXHAUSTIVE=1")


def pytest_configure(config):
    if config.getoption("--exhaustive"):
        os.environ["ANYATTN_EXHAUSTIVE"] = "1"
    try:
        from hypothesis import settings
    except ImportError:      # the Hypothesis tests import it themselves and say so
        return
    # Example counts are set per test through helpers.examples(default, exhaustive);
    # the profiles set the rest (and the count of a test that names none).
    settings.register_profile("anyattn", max_examples=20, deadline=None)
    settings.register_profile("anyattn-exhaustive", max_examples=200, deadline=None)
    settings.load_profile("anyattn-exhaustive" if sys.modules["helpers"].exhaustive()
                          else "anyattn")


#: tests whose parametrisations are run as a covering set by default (every value of
#: every parameter at least once, see _covering_set), all of them with --exhaustive:
#: the Hopper compile-only checks (PTX for sm_90a on any machine, tens of seconds each).
COVERING_SET = re.compile(r"^test_\w*compiles?_\w*sm90a")


def _covering_set(items):
    """The items (of one test function) to keep: greedily, the one that adds the most
    (parameter, value) pairs not yet covered, until every pair is covered; ties go to
    the first in collection order."""
    def pairs(item):
        cs = getattr(item, "callspec", None)
        return {(k, repr(v)) for k, v in (cs.params.items() if cs else ())}

    todo = set().union(*(pairs(i) for i in items)) if items else set()
    keep = []
    while todo:
        best = max(items, key=lambda i: len(pairs(i) & todo))
        keep.append(best)
        todo -= pairs(best)
    return keep or items[:1]


def pytest_collection_modifyitems(config, items):
    import pytest

    groups = {}
    for item in items:
        name = getattr(item, "originalname", item.name)
        if COVERING_SET.match(name):
            groups.setdefault((item.path, name), []).append(item)
    for group in groups.values():
        keep = _covering_set(group)
        for item in group:
            if item not in keep:
                item.add_marker(pytest.mark.exhaustive)
    if sys.modules["helpers"].exhaustive():
        return
    skip = pytest.mark.skip(reason=f"exhaustive: run with {EXHAUSTIVE_HOW}")
    for item in items:
        if item.get_closest_marker("exhaustive") is not None:
            item.add_marker(skip)


# ------------------------------------------------------- Triton's interpreter, faster
#: the Triton release whose interpreter internals _cache_builtin_names was written against
INTERPRETER_RELEASE = "3.6."


def _cache_builtin_names(interpreter):
    """Triton's interpreter re-patches ``triton.language`` on every call of a jit'd device
    function: for each patched namespace it lists all its members (``inspect.getmembers``)
    to find the builtins still unpatched, a third of the interpreted suite's time.  The
    builtins of a namespace are fixed, so list their names once (here, between tests,
    where no launch holds a patch) and look only those up on each call: the same members
    are patched, in the same way, through the interpreter's own ``_patch_attr``."""
    import inspect

    import triton.language as tl

    real = interpreter._patch_builtin
    spaces = (tl, tl.core, tl.math, tl.tensor, tl.core.tensor, tl.core.tensor_descriptor_base)
    names = {id(ns): (ns, tuple(n for n, m in inspect.getmembers(ns) if tl.core.is_builtin(m)))
             for ns in spaces}

    def patch_builtin(pkg, builder, scope):
        known = names.get(id(pkg))
        if known is None or known[0] is not pkg:
            return real(pkg, builder, scope)
        for name in known[1]:
            member = getattr(pkg, name)
            if tl.core.is_builtin(member):
                interpreter._patch_attr(pkg, name, member, builder, scope)

    patch_builtin.real = real
    interpreter._patch_builtin = patch_builtin


def pytest_runtest_setup(item):
    """Once Triton's interpreter is loaded (by the first test that runs a Triton kernel on
    the CPU), and where it is the release checked, cache its builtin names."""
    interpreter = sys.modules.get("triton.runtime.interpreter")
    if (interpreter is None or os.environ.get("TRITON_INTERPRET") != "1"
            or hasattr(interpreter._patch_builtin, "real")):
        return
    import triton

    if triton.__version__.startswith(INTERPRETER_RELEASE):
        _cache_builtin_names(interpreter)
