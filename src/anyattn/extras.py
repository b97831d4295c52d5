"""Optional packages: whether one is installed (without importing it), and the messages
that name the extra of pyproject.toml to install it with.

The extras: ``torch`` (anyattn.torch, anyattn.distributed), ``triton`` (the triton
backend: torch and triton), ``webgpu`` (the webgpu backend and anyattn.webgpu: wgpu),
``transformers`` (anyattn.torch.transformers_backend: torch and transformers) and
``bench`` (plots of ``python -m anyattn bench``: matplotlib).
"""
from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Optional

__all__ = ["EXTRAS", "install_hint", "installed", "missing_message", "import_error", "require"]

#: the extras of pyproject.toml's [project.optional-dependencies] that users install
EXTRAS = ("torch", "triton", "webgpu", "transformers", "bench")


def install_hint(extra: str) -> str:
    """The command that installs ``extra``: ``pip install "anyattn[webgpu]"``."""
    if extra not in EXTRAS:
        raise ValueError(f"extra: {extra!r} is not one of anyattn's extras {EXTRAS}")
    return f'pip install "anyattn[{extra}]"'


def installed(package: str) -> bool:
    """Can ``package`` (a top-level name) be imported?  Decided from the import system's
    finders, without importing it (a package already imported counts as installed)."""
    if package in sys.modules:
        return sys.modules[package] is not None
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):      # a finder that refuses it, a broken entry
        return False


def _who(needed_by: Optional[str]) -> str:
    return f"{needed_by} needs" if needed_by else "needs"


def missing_message(package: str, extra: str, needed_by: Optional[str] = None) -> str:
    """'[needed_by] needs <package>, which is not installed: pip install "anyattn[extra]"'."""
    return f"{_who(needed_by)} {package}, which is not installed: {install_hint(extra)}"


def import_error(package: str, extra: str, err: ImportError,
                 needed_by: Optional[str] = None) -> ImportError:
    """The error to raise (``from err``) when importing ``package`` failed with ``err``:
    a ModuleNotFoundError naming the extra when the package is absent, else an
    ImportError saying the installed package failed to import."""
    absent = isinstance(err, ModuleNotFoundError) and \
        (err.name or "").split(".")[0] == package
    if absent:
        return ModuleNotFoundError(missing_message(package, extra, needed_by), name=package)
    return ImportError(f"{_who(needed_by)} {package}, which is installed but failed to import "
                       f"({type(err).__name__}: {err}); reinstall it: {install_hint(extra)}",
                       name=package)


def require(package: str, extra: str, needed_by: Optional[str] = None):
    """Import and return ``package``; if that fails, raise :func:`import_error`'s error
    (the original chained)."""
    try:
        return importlib.import_module(package)
    except ImportError as e:
        raise import_error(package, extra, e, needed_by) from e
