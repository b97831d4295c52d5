import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # np_util.py


@pytest.fixture
def np_config():
    """Set the registered numpy backend's NumpyConfig for one test, then restore it."""
    from anyattn.backends.registry import get_backend

    be = get_backend("numpy")
    old = be.config

    def set_config(**kw):
        from anyattn.backends.numpy_backend import NumpyConfig

        be.config = NumpyConfig(**kw)
        return be

    yield set_config
    be.config = old
