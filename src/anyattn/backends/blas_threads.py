"""Keep BLAS to one thread inside the NumPy backend's own worker threads.

When the backend runs its units on N Python threads, each BLAS call should
stay on its thread; letting BLAS also fan every small GEMM out to all cores
oversubscribes them (N workers x all-core BLAS).  The BLAS libraries this
process has loaded are found through `threadpoolctl
<https://github.com/joblib/threadpoolctl>`_ (a required dependency of anyattn;
OpenBLAS, MKL, BLIS, FlexiBLAS; any platform), then one of three modes
(:func:`mode`) applies:

* ``"per-thread"``: every loaded BLAS has a setting that changes only the
  calling thread (MKL's ``mkl_set_num_threads_local``); each worker calls it for
  itself (:func:`limit_this_thread`) and the caller's own threads keep their
  BLAS threads.  OpenBLAS's ``openblas_set_num_threads_local`` is not one: in its
  pthreads builds (NumPy's wheels) it sets the process-wide count and only returns
  the previous one, so OpenBLAS takes the next mode;
* ``"process-wide"``: :func:`limited` lowers the process-wide BLAS thread count
  through threadpoolctl while at least one backend call runs workers, and
  restores it when the last such call ends (counted, so concurrent calls do not
  restore it under each other);
* ``"fallback"``: threadpoolctl cannot be imported (an install without its
  dependencies) or finds no BLAS it can control.  Nothing can be limited, so the
  backend runs its units without a pool of its own, on the calling thread, where
  BLAS keeps its threads (``python -m anyattn info`` shows this mode).
"""
from __future__ import annotations

import contextlib
import ctypes
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional

__all__ = ["limit_this_thread", "limited", "per_thread_supported", "blas_library_path",
           "blas_core_name", "threadpoolctl_available", "mode", "blas_info",
           "unavailable_reason", "MODES"]

#: the values of :func:`mode`
MODES = ("per-thread", "process-wide", "fallback")

_lock = threading.Lock()
_resolved = False
_controller: Any = None                 # threadpoolctl.ThreadpoolController or None
_import_error: Optional[str] = None     # why threadpoolctl could not be imported
_set_local: List[Callable[[int], Any]] = []
_path: Optional[str] = None
_core: Optional[str] = None

# process-wide limit, counted over the calls that need it
_users = 0
_limiter: Any = None

#: thread-local thread-count setters by threadpoolctl's ``internal_api``
_LOCAL_SYMBOLS = {"mkl": "mkl_set_num_threads_local"}


def _resolve() -> None:
    global _resolved, _controller, _path, _core, _import_error
    if _resolved:
        return
    with _lock:
        if _resolved:
            return
        try:
            import numpy  # noqa: F401  (loads its BLAS)
            from threadpoolctl import ThreadpoolController
        except ImportError as e:
            _import_error = str(e) or "ImportError"
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


def mode() -> str:
    """How BLAS threads are limited inside the backend's workers: one of :data:`MODES`."""
    if per_thread_supported():
        return "per-thread"
    return "process-wide" if threadpoolctl_available() else "fallback"


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
    last one to leave restores what was there.  Yields False (a no-op) in the
    ``"fallback"`` mode, where the backend uses no worker pool."""
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


def blas_info() -> List[Dict[str, Any]]:
    """What threadpoolctl reports of every BLAS it found (name, version, path, core,
    threading layer, current thread count); [] in the ``"fallback"`` mode."""
    _resolve()
    if _controller is None:
        return []
    out = []
    for lc in _controller.lib_controllers:
        info = lc.info()
        out.append({"name": info.get("internal_api") or info.get("prefix"),
                    "version": info.get("version"), "path": info.get("filepath"),
                    "core": info.get("architecture"),
                    "threading_layer": info.get("threading_layer"),
                    "threads": info.get("num_threads")})
    return out


def unavailable_reason() -> str:
    """Why the ``"fallback"`` mode applies (empty in the other modes)."""
    _resolve()
    if _controller is None:
        return f"threadpoolctl cannot be imported ({_import_error})" if _import_error \
            else "threadpoolctl cannot inspect this process's libraries"
    if not _controller.lib_controllers:
        return "threadpoolctl finds no BLAS library it can control"
    return ""
