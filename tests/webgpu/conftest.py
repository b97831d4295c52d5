import pytest

from anyattn.backends.registry import get_backend, unavailable_reason


@pytest.fixture(scope="session")
def be():
    why = unavailable_reason("webgpu")
    if why:
        pytest.skip(f"webgpu unavailable: {why}")
    b = get_backend("webgpu")
    yield b


@pytest.fixture(autouse=True)
def _reset(request):
    yield
    b = get_backend("webgpu") if unavailable_reason("webgpu") is None else None
    if b is not None:
        b.loop_limit_override = None
        b.debug_trips = False
        b.config_override = None
