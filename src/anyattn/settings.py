"""Every environment switch anyattn reads, in one table, read in one place.

``current()`` returns a frozen :class:`Settings` built from the environment.  It is
rebuilt only when one of the variables in :data:`SWITCHES` changed since the last
call (one dictionary lookup per variable), so a value set between two calls takes
effect on the next call, and a bad value raises ``ValueError`` naming the variable
and the accepted values at the next call (whichever backend makes it: one bad switch
is reported, not skipped).  No other module of the package reads ``os.environ`` for
its own switches (tests/core/test_settings.py checks that).

``python -m anyattn info --settings`` prints the table with the values in effect.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, fields
from typing import Callable, Dict, Optional, Tuple

__all__ = ["Switch", "SWITCHES", "TOOL_VARIABLES", "Settings", "current", "snapshot",
           "describe", "markdown_table", "unknown_variables"]


def _flag(default: bool) -> Callable[[str, str], bool]:
    def parse(name: str, raw: str) -> bool:
        v = raw.strip()
        if v == "":
            return default
        if v not in ("0", "1"):
            raise ValueError(f"{name}={raw!r}: expected 0 or 1 (unset: "
                             f"{int(default)})")
        return v == "1"
    return parse


#: the words Triton's own knobs read as true (triton.knobs.env_bool); every other value
#: is false there, so it is false here too (the variable is Triton's, not anyattn's)
_TRITON_TRUE = ("1", "true", "on", "yes", "y")


def _triton_bool(name: str, raw: str) -> bool:
    return raw.strip().lower() in _TRITON_TRUE


def _positive_int(name: str, raw: str) -> Optional[int]:
    if raw == "":
        return None
    try:
        n = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r}: expected an integer >= 1 (or unset)") from None
    if n < 1:
        raise ValueError(f"{name}={raw!r}: expected an integer >= 1 (or unset)")
    return n


def _choice(*choices: str, lower: bool = True) -> Callable[[str, str], str]:
    def parse(name: str, raw: str) -> str:
        v = raw.strip().lower() if lower else raw.strip()
        if v == "":
            return choices[0]
        if v not in choices:
            raise ValueError(f"{name}={raw!r}: expected one of {', '.join(choices)} "
                             f"(unset: {choices[0]})")
        return v
    return parse


def _text(name: str, raw: str) -> str:
    return raw.strip()


@dataclass(frozen=True)
class Switch:
    """One environment variable: its name, the Settings field it fills, the default as
    a user would write it, what it accepts and what it does."""

    name: str
    field: str
    default: str
    accepts: str
    effect: str
    parse: Callable[[str, str], object]


#: the table (also rendered in docs/settings.md and by ``anyattn info --settings``)
SWITCHES: Tuple[Switch, ...] = (
    # --- NumPy backend
    Switch("ANYATTN_NUMPY_THREADS", "numpy_threads", "CPUs this process may use",
           "integer >= 1", "worker threads of the NumPy backend's shared pool",
           _positive_int),
    Switch("ANYATTN_NUMPY_BLOCK_Q", "numpy_block_q", "per mask kind", "integer >= 1",
           "query rows per NumPy tile (forward and backward)", _positive_int),
    Switch("ANYATTN_NUMPY_BLOCK_K", "numpy_block_k", "per mask kind", "integer >= 1",
           "keys per NumPy tile (forward and backward)", _positive_int),
    Switch("ANYATTN_NUMPY_BLAS_LOCAL", "numpy_blas_local", "1", "0 or 1",
           "hold BLAS to one thread inside the NumPy workers (0: leave BLAS threads alone)",
           _flag(True)),
    # --- Triton backend
    Switch("TRITON_INTERPRET", "triton_interpret", "0",
           "as Triton reads it: 1, true, on, yes, y (any case) are on, anything else off",
           "Triton's own switch: run kernels in its interpreter on CPU tensors (tests)",
           _triton_bool),
    Switch("ANYATTN_TRITON_PATH", "triton_path", "auto", "auto, portable, hopper (any case)",
           "auto: the Hopper kernels where they cover the call and are routed by default; "
           "portable: never; hopper: wherever they cover it, raising where they do not",
           _choice("auto", "portable", "hopper")),
    Switch("ANYATTN_TRITON_CONFIG", "triton_config", "heuristic", "heuristic, fixed",
           "fixed: the small tile plan the interpreter always uses, on the GPU too",
           _choice("heuristic", "fixed", lower=False)),
    Switch("ANYATTN_TRITON_AUTOTUNE", "triton_autotune", "0", "0 or 1",
           "time the candidate tiles once per problem class and keep the fastest",
           _flag(False)),
    Switch("ANYATTN_TRITON_FN_CACHE", "triton_fn_cache", "a per-user folder in the temp dir",
           "a directory path", "where the Triton modules generated for score and mask "
           "functions are written", _text),
    # --- WebGPU backend
    Switch("ANYATTN_WGPU_ADAPTER", "wgpu_adapter", "the high-performance adapter",
           "words of the adapter's description, e.g. 'vulkan', 'lavapipe', 'opengl'",
           "which wgpu adapter the WebGPU backend opens", _text),
    Switch("ANYATTN_WEBGPU_VARIANT", "webgpu_variant", "per adapter",
           "a name of backends/webgpu VARIANTS", "force one WGSL kernel variant", _text),
    # --- paged caches and flash_attn_with_kvcache
    Switch("ANYATTN_CHECK_DEVICE_INPUTS", "check_device_inputs", "0", "0 or 1",
           "1: read the length, index and page-table tensors that stay on the device "
           "(flash_attn_with_kvcache on CUDA, Pages(on_device=True)) to the host on every "
           "call and check their values (one synchronisation per call, which rules out "
           "CUDA graph capture); 0: their values are trusted", _flag(False)),
)


#: ANYATTN_* variables read by the test suite and the benchmarks, never by the library
#: (docs/testing.md); every other ANYATTN_* name outside :data:`SWITCHES` is unknown
TOOL_VARIABLES = frozenset({"ANYATTN_EXHAUSTIVE", "ANYATTN_SUITE_BACKENDS",
                            "ANYATTN_TORCH_TEST_BACKEND", "ANYATTN_RING_CASES",
                            "ANYATTN_ABI_BACKEND", "ANYATTN_PRINT_MAGNITUDES",
                            "ANYATTN_BENCH_SRC"})


@dataclass(frozen=True)
class Settings:
    """The parsed values of :data:`SWITCHES` (field names as in the table)."""

    numpy_threads: Optional[int]
    numpy_block_q: Optional[int]
    numpy_block_k: Optional[int]
    numpy_blas_local: bool
    triton_interpret: bool
    triton_path: str
    triton_config: str
    triton_autotune: bool
    triton_fn_cache: str
    wgpu_adapter: str
    webgpu_variant: str
    check_device_inputs: bool


assert [s.field for s in SWITCHES] == [f.name for f in fields(Settings)]

#: os.environ's backing dict (bytes keys on POSIX): one dict lookup per variable,
#: where os.environ.get encodes the name on every call.  putenv / monkeypatch.setenv
#: write through it; where it has another form, os.environ itself is read.
_ENV_DATA = getattr(os.environ, "_data", None)
_FAST = os.name == "posix" and isinstance(_ENV_DATA, dict)
_KEYS = tuple(s.name.encode() if _FAST else s.name for s in SWITCHES)

_lock = threading.Lock()
_last: Tuple[Optional[tuple], Optional[Settings]] = (None, None)


def snapshot() -> tuple:
    """The raw values of every switch now (None where unset); equal snapshots give equal
    Settings, so a snapshot is a cheap cache key."""
    if _FAST:
        return tuple(map(_ENV_DATA.get, _KEYS))
    return tuple([os.environ.get(k) for k in _KEYS])


def _decode(raw) -> str:
    if raw is None:
        return ""
    return raw.decode("utf-8", "surrogateescape") if isinstance(raw, bytes) else raw


def unknown_variables() -> Tuple[str, ...]:
    """The ANYATTN_* variables set now that are neither a switch nor a tool's variable
    (a misspelling, or a switch this version does not have): they have no effect."""
    known = {s.name for s in SWITCHES} | TOOL_VARIABLES
    return tuple(sorted(n for n in os.environ if n.startswith("ANYATTN_") and n not in known))


_warned: set = set()


def _warn_unknown() -> None:
    fresh = [n for n in unknown_variables() if n not in _warned]
    if fresh:
        _warned.update(fresh)
        import warnings

        warnings.warn(f"{', '.join(fresh)}: not a switch of anyattn, ignored (the switches: "
                      "docs/settings.md or `python -m anyattn info --settings`)",
                      RuntimeWarning, stacklevel=3)


def current() -> Settings:
    """The settings in effect now (validated; rebuilt only when the environment changed).
    An ANYATTN_* variable that is no switch draws one RuntimeWarning per name, the first
    time settings are built after it was set with a switch changed, or at the first call."""
    global _last
    snap = snapshot()
    last_snap, last = _last
    if snap == last_snap and last is not None:
        return last
    _warn_unknown()
    values: Dict[str, object] = {}
    for switch, raw in zip(SWITCHES, snap):
        values[switch.field] = switch.parse(switch.name, _decode(raw))
    made = Settings(**values)
    with _lock:
        _last = (snap, made)
    return made


def describe() -> str:
    """The table with the value in effect of each switch (set ones marked), and the
    ANYATTN_* variables set that are no switch."""
    snap = snapshot()
    lines = []
    width = max(len(s.name) for s in SWITCHES)
    for switch, raw in zip(SWITCHES, snap):
        shown = _decode(raw) if raw is not None else f"(default: {switch.default})"
        lines.append(f"  {switch.name:<{width}}  {shown}\n  {'':<{width}}  "
                     f"{switch.effect}; accepts {switch.accepts}")
    unknown = unknown_variables()
    if unknown:
        lines.append(f"  not switches, ignored: {', '.join(unknown)}")
    return "\n".join(lines)


def markdown_table() -> str:
    """The table of docs/settings.md (tests/core/test_settings.py checks the doc holds it)."""
    rows = ["| variable | default | accepts | effect |", "| --- | --- | --- | --- |"]
    for s in SWITCHES:
        rows.append(f"| `{s.name}` | {s.default} | {s.accepts} | {s.effect} |")
    return "\n".join(rows)
