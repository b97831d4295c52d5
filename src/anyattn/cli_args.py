"""Argument types and checks shared by the command line's subcommands (``anyattn.cli``
and ``anyattn.bench``): each raises ``argparse.ArgumentTypeError`` with one line naming
what the flag accepts."""
from __future__ import annotations

import argparse
import os
from typing import Optional

from . import settings

__all__ = ["seed_arg", "int_at_least", "out_path", "backend_unavailable"]


def seed_arg(text: str) -> int:
    """argparse type of ``--seed``: an int in [0, 2**64), the range of a dropout seed."""
    try:
        seed = int(text)
    except ValueError:
        seed = -1
    if not 0 <= seed < 2 ** 64:
        raise argparse.ArgumentTypeError(f"{text!r}: expected an integer in [0, 2**64)")
    return seed


def int_at_least(low: int):
    """argparse type: an int >= ``low``."""
    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = low - 1
        if n < low:
            raise argparse.ArgumentTypeError(f"{text!r}: expected an integer >= {low}")
        return n
    return parse


def out_path(text: str) -> str:
    """argparse type of a file to write: its directory must exist (none is created)."""
    folder = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory; expected a file path")
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(
            f"{text!r}: directory {folder!r} does not exist; create it first or give a "
            "path in an existing directory")
    return text


def backend_unavailable(name: str) -> Optional[str]:
    """None if backend ``name`` runs here, else why not and what a command-line user can do."""
    from .backends.registry import unavailable_reason
    from .extras import installed

    packages = {"triton": ("torch", "triton"), "webgpu": ("wgpu",)}.get(name, ())
    missing = [m for m in packages if not installed(m)]
    if missing:
        return (f"it needs {' and '.join(missing)}, not installed: "
                f"pip install 'anyattn[{name}]'")
    if name == "triton" and not settings.current().triton_interpret:
        import torch

        if not torch.cuda.is_available():
            return ("it needs a CUDA GPU and this machine has none; Triton's interpreter "
                    "runs it on the CPU (slowly) when the environment sets TRITON_INTERPRET=1 "
                    "(e.g. TRITON_INTERPRET=1 python -m anyattn check --backend triton), "
                    "or use --backend numpy")
    return unavailable_reason(name)
