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


def pytest_collection_modifyitems(config, items):
    import pytest

    if os.environ.get("ANYATTN_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow: set ANYATTN_SLOW=1 to run larger sizes")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)
