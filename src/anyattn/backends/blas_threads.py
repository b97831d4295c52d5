"""Keep OpenBLAS to one thread inside the NumPy backend's own worker threads.

When the backend runs its units on N Python threads, each BLAS call should
stay on its thread; letting OpenBLAS also fan every small GEMM out to all
cores oversubscribes them.  OpenBLAS >= 0.3.27 has a per-thread setting,
``openblas_set_num_threads_local``, which we call from each worker (no effect
on the caller's threads).  Where it is missing (other BLAS, older OpenBLAS)
this module does nothing, which is safe: only slower.

Found through the shared libraries this process has loaded (Linux
``/proc/self/maps``), so it needs no extra package.
"""
from __future__ import annotations

import ctypes
import threading
from typing import Callable, Optional

__all__ = ["limit_this_thread", "blas_library_path", "blas_core_name"]

_lock = threading.Lock()
_resolved = False
_set_local: Optional[Callable[[int], int]] = None
_path: Optional[str] = None
_core: Optional[str] = None


def _resolve() -> None:
    global _resolved, _set_local, _path, _core
    with _lock:
        if _resolved:
            return
        _resolved = True
        try:
            import numpy  # noqa: F401  (loads its BLAS)

            with open("/proc/self/maps") as f:
                paths = {line.split()[-1] for line in f if "openblas" in line.lower()}
        except OSError:
            return
        for path in sorted(paths):
            try:
                lib = ctypes.CDLL(path)
                fn = lib.openblas_set_num_threads_local
            except (OSError, AttributeError):
                continue
            fn.argtypes = [ctypes.c_int]
            fn.restype = ctypes.c_int
            _set_local, _path = fn, path
            for sym in ("scipy_openblas_get_corename64_", "scipy_openblas_get_corename",
                        "openblas_get_corename"):
                core = getattr(lib, sym, None)
                if core is not None:
                    core.restype = ctypes.c_char_p
                    _core = core().decode(errors="replace")
                    break
            return


def blas_library_path() -> Optional[str]:
    """The OpenBLAS library whose per-thread setting is used, or None."""
    _resolve()
    return _path


def blas_core_name() -> Optional[str]:
    """The CPU kernel family OpenBLAS picked at load ('Haswell', 'SkylakeX', ...), or None."""
    _resolve()
    return _core


def limit_this_thread(n: int = 1) -> bool:
    """Limit BLAS calls made from the *calling* thread to ``n`` threads; False if unsupported."""
    _resolve()
    if _set_local is None:
        return False
    _set_local(int(n))
    return True
