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


@pytest.fixture
def masks_seen(monkeypatch):
    """transformers-backend tests: every mask the transformers backend hands to
    anyattn.torch.attention, and (in ``masks_seen.built``) everything the registered
    mask builder returned."""
    from transformers.masking_utils import AttentionMaskInterface

    from anyattn.torch import transformers_backend as tb

    class Seen(list):
        built: list

    seen, inner = Seen(), tb.attention
    seen.built = []

    def spy(*args, **kwargs):
        seen.append(kwargs.get("mask"))
        return inner(*args, **kwargs)

    def builder(*args, **kwargs):
        seen.built.append(tb.anyattn_mask(*args, **kwargs))
        return seen.built[-1]

    monkeypatch.setattr(tb, "attention", spy)
    AttentionMaskInterface.register(tb.NAME, builder)
    yield seen
    AttentionMaskInterface.register(tb.NAME, tb.anyattn_mask)
