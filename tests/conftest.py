import importlib.util
import os
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
EXHAUSTIVE_HOW = "pytest --exhaustive -m exhaustive (or ANYATTN_EXHAUSTIVE=1)"


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


def pytest_collection_modifyitems(config, items):
    import pytest

    if sys.modules["helpers"].exhaustive():
        return
    skip = pytest.mark.skip(reason=f"exhaustive: run with {EXHAUSTIVE_HOW}")
    for item in items:
        if item.get_closest_marker("exhaustive") is not None:
            item.add_marker(skip)
