import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)                                   # tests/helpers.py
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "src"))  # the package, uninstalled

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
