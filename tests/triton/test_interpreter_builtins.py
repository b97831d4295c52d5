"""tests/conftest.py's cache of the builtin names Triton's interpreter patches: it patches
the same members of every namespace as the interpreter's own ``_patch_builtin``."""
import os

import pytest

pytest.importorskip("triton")


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="Triton's interpreter is in use only without a CUDA GPU")
def test_cached_names_patch_what_the_interpreter_patches(pytestconfig):
    import triton
    import triton.language as tl
    from triton.runtime import interpreter

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                        "conftest.py")
    conftest = next(m for m in pytestconfig.pluginmanager.get_plugins()
                    if os.path.abspath(getattr(m, "__file__", None) or "") == path)
    if not triton.__version__.startswith(conftest.INTERPRETER_RELEASE):
        pytest.skip(f"the cache is installed for Triton {conftest.INTERPRETER_RELEASE}x only")
    conftest.pytest_runtest_setup(None)
    cached = interpreter._patch_builtin
    assert hasattr(cached, "real"), "the cache is installed once the interpreter is loaded"

    def patched(fn, space):
        scope = interpreter._LangPatchScope()
        fn(space, interpreter.interpreter_builder, scope)
        names = sorted(name for _, name, _ in scope._changes)
        scope.restore()
        return names

    for space in (tl, tl.core, tl.math, tl.tensor, tl.core.tensor_descriptor_base):
        want = patched(cached.real, space)
        assert want, space
        assert patched(cached, space) == want, space
