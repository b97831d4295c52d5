"""Shared fixtures of the torch-integration tests (CPU; GPU tests are marked ``gpu``)."""
import os

import pytest

torch = pytest.importorskip("torch")

from anyattn.backends.registry import unavailable_reason  # noqa: E402

#: the backend the CPU tests run on: numpy when it is there (named, so that a test never
#: depends on the dispatch rule; auto-dispatch never picks the interpreted Triton backend
#: that the root conftest's TRITON_INTERPRET=1 enables for CPU tensors);
#: ANYATTN_TORCH_TEST_BACKEND=reference forces the reference.
CPU_BACKEND = os.environ.get("ANYATTN_TORCH_TEST_BACKEND") or (
    "numpy" if unavailable_reason("numpy") is None else "reference")


@pytest.fixture(autouse=True)
def _test_backend(request):
    """CPU tests: CPU_BACKEND by name.  Tests marked ``gpu``: automatic dispatch (the
    triton backend for CUDA tensors)."""
    import anyattn.torch as at

    torch.manual_seed(0)
    name = None if request.node.get_closest_marker("gpu") is not None else CPU_BACKEND
    with at.use_backend(name):
        yield
