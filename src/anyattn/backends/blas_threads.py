"""Keep BLAS to one thread inside the NumPy backend's own worker threads.

When the backend runs its units on N Python threads, each BLAS call should
stay on its thread; letting BLAS also fan every small GEMM out to all cores
oversubscribes them.  The BLAS libraries this process has loaded are found
through `threadpoolctl <https://github.com/joblib/threadpoolctl>`_ (OpenBLAS,
MKL, BLIS, FlexiBLAS; any platform), then:

* where the library has a per-thread setting (OpenBLAS >= 0.3.27:
  ``openblas_set_num_threads_local``; MKL: ``mkl_set_num_threads_local``), each
  worker calls it for itself (:func:`limit_this_thread`): the caller's own
  threads keep their BLAS threads;
* otherwise :func:`limited` lowers the process-wide BLAS thread count through
  threadpoolctl while at least one backend call runs workers, and restores it
  when the last such call ends (counted, so concurrent calls do not restore it
  under each other).

threadpoolctl is optional (numpy stays the only required dependency): without
it both functions are documented no-ops that leave the BLAS threads as they
are — correct, only possibly slower through oversubscription.
"""
from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Any, Callable, Iterator, List, Optional

__all__ = ["limit_this_thread", "limited", "per_thread_supported", "blas_library_path",
           "blas_core_name", "threadpoolctl_available"]

_lock = threading.Lock()
_resolved = False
_controller: Any = None                 # threadpoolctl.ThreadpoolController or None
_set_local: List[Callable[[int], Any]] = []
_path: Optional[str] = None
_core: Optional[str] = None

# process-wide limit, counted over the calls that need it
_users = 0
_limiter: Any = None

_LOCAL_SYMBOLS = {"openblas": "openblas_set_num_threads_local",
                  "mkl": "mkl_set_num_threads_local"}


def _resolve() -> None:
    global _resolved, _controller, _path, _core
    if _resolved:
        return
    with _lock:
        if _resolved:
            return
        try:
            import numpy  # noqa: F401  (loads its BLAS)
            from threadpoolctl import ThreadpoolController
        except ImportError:
            _resolved = True
            return
        try:
            ctl = ThreadpoolController().select(user_api="blas")
        except Exception:  # pragma: no cover - a library threadpoolctl cannot inspect
            _resolved = True
            return
        _controller = ctl
        for lc in ctl.lib_controllers:
            info = lc.info()
            if _path is None:
                _path = info.get("filepath")
                arch = info.get("architecture")
                _core = str(arch) if arch else None
            sym = _LOCAL_SYMBOLS.get(info.get("internal_api", ""))
            lib = getattr(lc, "dynlib", None)
            fn = getattr(lib, sym, None) if (sym and lib is not None) else None
            if fn is not None:
                fn.argtypes = [ctypes.c_int]
                fn.restype = ctypes.c_int
                _set_local.append(fn)
        # per-thread only when every BLAS found has it; else the counted global limit
        if len(_set_local) != len(ctl.lib_controllers):
            _set_local.clear()
        _resolved = True


def threadpoolctl_available() -> bool:
    """True when threadpoolctl is importable and found the process's BLAS."""
    _resolve()
    return _controller is not None and len(_controller.lib_controllers) > 0


def per_thread_supported() -> bool:
    """True when every loaded BLAS has a per-thread thread-count setting."""
    _resolve()
    return bool(_set_local)


def limit_this_thread(n: int = 1) -> bool:
    """Limit BLAS calls made from the *calling* thread to ``n`` threads.

    Returns False (and changes nothing) where no per-thread setting exists."""
    _resolve()
    if not _set_local:
        return False
    for fn in _set_local:
        fn(int(n))
    return True


@contextlib.contextmanager
def limited(n: int = 1) -> Iterator[bool]:
    """Process-wide BLAS limit of ``n`` threads while the block runs (threadpoolctl).

    Nested and concurrent uses are counted: the first one lowers the limit, the
    last one to leave restores what was there.  Yields False (a no-op) without
    threadpoolctl."""
    global _users, _limiter
    _resolve()
    if _controller is None:
        yield False
        return
    with _lock:
        if _users == 0:
            _limiter = _controller.limit(limits=n)
        _users += 1
    try:
        yield True
    finally:
        with _lock:
            _users -= 1
            if _users == 0 and _limiter is not None:
                _limiter.restore_original_limits()
                _limiter = None


def blas_library_path() -> Optional[str]:
    """The first BLAS library threadpoolctl found, or None."""
    _resolve()
    return _path


def blas_core_name() -> Optional[str]:
    """The CPU kernel family the BLAS picked at load ('Haswell', 'SkylakeX', ...), or None."""
    _resolve()
    return _core
