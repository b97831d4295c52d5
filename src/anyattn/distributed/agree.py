"""Before the first exchange: do the ranks of a ring agree on the call?

Shape legend: N ranks, F fields of a descriptor (:data:`FIELDS`).

Every rank describes its call in a fixed-size int64 vector (shapes, dtype, mask
fingerprint, scale, sharding, layout, gradients asked for, ...) and all ranks
all-gather these N x F numbers in one small collective, so every rank sees the same
table and raises the same ``ValueError`` (naming each field that differs and which
ranks hold which value) instead of aborting in a size-mismatched transfer (SIGABRT)
or, when the byte counts happen to match, computing garbage without a word.

A rank whose own arguments fail its local checks still takes part, with its status
set: the others then raise at once, naming it, rather than waiting for it.  A rank
that never reaches ``ring_attention`` (its program failed earlier) leaves the others
waiting at most ``timeout`` (default: the process group's own timeout), after which
they raise ``TimeoutError``.
"""
from __future__ import annotations

import hashlib
import math
import struct
from datetime import timedelta
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

__all__ = ["FIELDS", "Descriptor", "describe_call", "failed_descriptor", "exchange_and_check",
           "as_timeout"]

_MAGIC = 0x616E79_0002           # 'any' + version 2 (score modifiers)
_DTYPES = ("float16", "bfloat16", "float32", "float64")

#: the descriptor's fields, in order: (name, how an error message calls it)
FIELDS: Tuple[Tuple[str, str], ...] = (
    ("magic", "anyattn ring protocol version"),
    ("status", "status"),
    ("world", "group size seen"),
    ("q0", "q batch"), ("q1", "q heads"), ("q2", "q local length"), ("q3", "q head_dim"),
    ("k0", "k batch"), ("k1", "k heads"), ("k2", "k local length"), ("k3", "k head_dim"),
    ("v0", "v batch"), ("v1", "v heads"), ("v2", "v local length"), ("v3", "v head_dim"),
    ("dtype", "dtype"),
    ("device", "device type"),
    ("scale", "scale"),
    ("sharding", "sharding"),
    ("layout", "layout"),
    ("wrt", "gradients asked for (q, k, v)"),
    ("mask_terms", "mask terms"),
    ("mask", "mask (fingerprint of its terms and their global ids / keep arrays)"),
    ("precision", "precision"),
    ("softcap", "softcap"),
    ("modifiers", "alibi_slopes (values) and sinks (shape, dtype)"),
    ("dropout_p", "dropout_p"),
    ("dropout_seed", "dropout_seed"),
)
_INDEX = {name: i for i, (name, _) in enumerate(FIELDS)}
_OK, _FAILED = 0, 1

Descriptor = List[int]


def _code(value: Optional[str], names: Sequence[str]) -> int:
    return names.index(value) + 1 if value in names else 0


def _hash64(*parts: bytes) -> int:
    h = hashlib.blake2b(digest_size=8)
    for p in parts:
        h.update(len(p).to_bytes(8, "little"))
        h.update(p)
    return int.from_bytes(h.digest(), "little", signed=True)


def _f64_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", float(x)))[0]


def _bits_f64(b: int) -> float:
    return struct.unpack("<d", struct.pack("<q", int(b)))[0]


def _array_fingerprint(x) -> bytes:
    """Shape, dtype and contents of an id/keep array (torch or NumPy), as bytes."""
    from ..arrays import to_numpy

    a = np.ascontiguousarray(to_numpy(x))
    return repr((tuple(a.shape), a.dtype.str)).encode() + a.tobytes()


def mask_fingerprint(gmask) -> int:
    """A 64-bit fingerprint of a :class:`~anyattn.distributed.blockmask.GlobalMask`:
    its band terms (kind, sides, alignment) and the bytes of its global ids / keep
    masks, in the order given."""
    parts = []
    for t in gmask.band:
        parts.append(repr((type(t).__name__, getattr(t, "left", None),
                           getattr(t, "right", None), t.align)).encode())
    for d in gmask.docs:
        parts.append(b"docs" + _array_fingerprint(d.q_ids) + _array_fingerprint(d.k_ids))
    for m in gmask.keeps:
        parts.append(b"keep" + _array_fingerprint(m))
    return _hash64(*parts) if parts else 0


_TERMS = ("Causal", "Window", "Documents", "KeepMask")


def mask_terms(gmask) -> int:
    """Which kinds of terms the mask has, as bits (Causal 1, Window 2, Documents 4,
    KeepMask 8): readable in an error message, unlike the fingerprint."""
    bits = 0
    for t in gmask.band:
        bits |= 1 << _TERMS.index(type(t).__name__)
    if gmask.docs:
        bits |= 4
    if gmask.keeps:
        bits |= 8
    return bits


def describe_call(*, world: int, q, k, v, scale: float, sharding: str, layout: str,
                  wrt: Tuple[bool, bool, bool], gmask, precision: Optional[str],
                  sharding_names: Sequence[str], softcap: Optional[float] = None,
                  alibi_slopes=None, sinks=None, dropout_p: float = 0.0,
                  dropout_seed: Optional[int] = None) -> Descriptor:
    """This rank's descriptor (q, k, v in the logical [B, H, S_loc, D] layout)."""
    d = [0] * len(FIELDS)
    d[_INDEX["magic"]] = _MAGIC
    d[_INDEX["status"]] = _OK
    d[_INDEX["world"]] = world
    for name, x in (("q", q), ("k", k), ("v", v)):
        for i, n in enumerate(x.shape):
            d[_INDEX[f"{name}{i}"]] = int(n)
    d[_INDEX["dtype"]] = _code(str(q.dtype).replace("torch.", ""), _DTYPES)
    d[_INDEX["device"]] = _code(q.device.type, ("cpu", "cuda")) or 99
    d[_INDEX["scale"]] = _f64_bits(scale)
    d[_INDEX["sharding"]] = _code(sharding, sharding_names)
    d[_INDEX["layout"]] = _code(layout, ("bhsd", "bshd"))
    d[_INDEX["wrt"]] = sum(1 << i for i, w in enumerate(wrt) if w)
    d[_INDEX["mask"]] = mask_fingerprint(gmask)
    d[_INDEX["mask_terms"]] = mask_terms(gmask)
    d[_INDEX["precision"]] = _code(precision or "highest", ("highest", "tf32"))
    d[_INDEX["softcap"]] = 0 if softcap is None else _f64_bits(softcap)
    parts = []
    if alibi_slopes is not None:
        parts.append(b"alibi" + _array_fingerprint(alibi_slopes))
    if sinks is not None:
        parts.append(b"sinks" + repr((tuple(sinks.shape), str(sinks.dtype))).encode())
    d[_INDEX["modifiers"]] = _hash64(*parts) if parts else 0
    d[_INDEX["dropout_p"]] = _f64_bits(dropout_p)
    # as a signed int64 (the all-gather's dtype): seeds in [0, 2**64) wrap around
    seed = -1 if dropout_seed is None else int(dropout_seed)
    d[_INDEX["dropout_seed"]] = seed - (1 << 64) if seed >= 1 << 63 else seed
    return d


def failed_descriptor(world: int) -> Descriptor:
    """The descriptor of a rank whose own arguments were refused."""
    d = [0] * len(FIELDS)
    d[_INDEX["magic"]] = _MAGIC
    d[_INDEX["status"]] = _FAILED
    d[_INDEX["world"]] = world
    return d


def as_timeout(timeout) -> Optional[timedelta]:
    """``timeout`` (seconds, a timedelta or None) -> a timedelta or None."""
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        sec = timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        sec = float(timeout)
    else:
        raise TypeError(f"timeout: expected seconds (a number), a datetime.timedelta or None, "
                        f"got {type(timeout).__name__}")
    if not (math.isfinite(sec) and sec > 0):
        raise ValueError(f"timeout: {sec} s; expected a positive, finite number of seconds "
                         "(None: the process group's own timeout)")
    return timedelta(seconds=sec)


def _transport_device(group, like) -> torch.device:
    """Where the descriptor tensor must live for the group's backend."""
    try:
        be = str(dist.get_backend(group)).lower()
    except Exception:   # pragma: no cover - an unusual group object
        be = ""
    if isinstance(like, torch.Tensor) and like.device.type == "cuda" and "nccl" in be:
        return like.device
    if "nccl" in be and "gloo" not in be and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _gather(ring, desc: Descriptor, like, timeout: Optional[timedelta]) -> np.ndarray:
    """All-gather every rank's descriptor -> [N, F] int64 (rank order of the group)."""
    dev = _transport_device(ring.group, like)
    mine = torch.tensor(desc, dtype=torch.int64, device=dev)
    bufs = [torch.empty_like(mine) for _ in range(ring.size)]
    work = dist.all_gather(bufs, mine, group=ring.group, async_op=True)
    try:
        if timeout is None:
            work.wait()
        else:
            work.wait(timeout=timeout)
    except Exception as e:
        limit = (f"timeout={timeout.total_seconds():g} s" if timeout is not None
                 else "the process group's timeout")
        raise TimeoutError(
            f"ring_attention: rank {ring.rank} waited for the call descriptors of the other "
            f"{ring.size - 1} rank(s) of the group and gave up after {limit} ({e}); a rank "
            "did not reach ring_attention (its program failed or took another path before). "
            "Every rank of the group must call ring_attention with the same arguments"
        ) from None
    return torch.stack(bufs).cpu().numpy()


def _show(name: str, value: int, sharding_names: Sequence[str]) -> str:
    if name == "dtype":
        return _DTYPES[value - 1] if 0 < value <= len(_DTYPES) else f"code {value}"
    if name == "device":
        return {1: "cpu", 2: "cuda"}.get(value, "other")
    if name in ("scale", "dropout_p"):
        return f"{_bits_f64(value)!r}"
    if name == "softcap":
        return "None" if value == 0 else f"{_bits_f64(value)!r}"
    if name == "dropout_seed":
        return "None" if value == -1 else str(value % (1 << 64))
    if name == "modifiers":
        return f"{value & 0xFFFFFFFFFFFFFFFF:016x}" if value else "None"
    if name == "sharding":
        return repr(sharding_names[value - 1]) if 0 < value <= len(sharding_names) else "?"
    if name == "layout":
        return {1: "'bhsd'", 2: "'bshd'"}.get(value, "?")
    if name == "precision":
        return {1: "'highest'", 2: "'tf32'"}.get(value, "?")
    if name == "wrt":
        return "(" + ", ".join(n for i, n in enumerate("qkv") if value >> i & 1) + ")"
    if name == "mask":
        return f"{value & 0xFFFFFFFFFFFFFFFF:016x}" if value else "None"
    if name == "mask_terms":
        return " & ".join(t for i, t in enumerate(_TERMS) if value >> i & 1) or "None"
    return str(value)


def _ranks(rs: List[int]) -> str:
    return ("rank " if len(rs) == 1 else "ranks ") + ", ".join(map(str, rs))


def check_table(table: np.ndarray, me: int, sharding_names: Sequence[str]) -> None:
    """Raise ValueError unless every row of ``table`` [N, F] agrees (same on every rank)."""
    n = table.shape[0]
    magic = table[:, _INDEX["magic"]]
    if (magic != _MAGIC).any():
        bad = [r for r in range(n) if magic[r] != _MAGIC]
        raise ValueError(f"ring_attention: {_ranks(bad)} sent a descriptor of another anyattn "
                         "version (or another collective ran on this group at the same time); "
                         "run the same anyattn on every rank")
    failed = [r for r in range(n) if table[r, _INDEX["status"]] == _FAILED]
    if failed:
        mine = " (this rank's own error is raised above this one)" if me in failed else ""
        raise ValueError(f"ring_attention: {_ranks(failed)} of {n} refused their own arguments "
                         f"before the first exchange{mine}; no rank started. That rank's error "
                         "says why")
    lines = []
    for name, label in FIELDS:
        col = table[:, _INDEX[name]]
        if (col == col[0]).all():
            continue
        groups: Dict[int, List[int]] = {}
        for r in range(n):
            groups.setdefault(int(col[r]), []).append(r)
        desc = "; ".join(f"{_show(name, val, sharding_names)} on {_ranks(rs)}"
                         for val, rs in sorted(groups.items(), key=lambda kv: kv[1][0]))
        lines.append(f"{label}: {desc}")
    if lines:
        raise ValueError("ring_attention: the ranks disagree before the first exchange "
                         f"(this is rank {me} of {n}); every rank must call it with the same "
                         "shapes and arguments:\n  " + "\n  ".join(lines))


def exchange_and_check(ring, desc: Descriptor, like, timeout: Optional[timedelta],
                       sharding_names: Sequence[str]) -> None:
    """All-gather the descriptors and raise on any disagreement (a collective)."""
    table = _gather(ring, desc, like, timeout)
    check_table(table, ring.rank, sharding_names)
