"""Attention dropout that every backend draws identically.

Shape legend: B batch, Hq query heads, Sq/Sk queries/keys.

The contract (DESIGN.md §1 "Dropout"): with ``dropout_p = p > 0`` and a seed,
``out = (P ∘ keep / (1 − p))·v``; lse is that of the undropped softmax; the backward
regenerates ``keep`` instead of storing it, and ``δ = <dout, out>`` still holds.

``keep[b, h, i, j]`` is a pure function of (seed, b, h, i, j) — the *global*
positions ``i = q_offset + local i`` and ``j = k_offset + local j`` — never of tiling,
launch order or device.  The generator, which every backend implements bit for bit:

1. key: ``k0 = seed mod 2³²``, ``k1 = seed >> 32`` (seed an int in [0, 2⁶⁴)).
2. a row word per (b, h, i): word 0 of Philox4x32-10 (Salmon et al., SC'11; the
   Random123 reference) with counter ``(i, h, b, 0)`` and key (k0, k1);
   a column word per j: word 0 of Philox4x32-10 with counter ``(j, 0, 0, 1)``.
3. per element: ``x = mix32(row ^ col)`` with the 32-bit finaliser
   ``x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16``
   (all mod 2³²; a bijection with full avalanche).
4. ``keep = x >= t`` with ``t = min(round(p·2³²), 2³² − 1)`` (:func:`threshold`).

Why not one Philox call per element: the row and column words carry the keyed
Philox randomness (O(Sq + Sk) calls per head), and the per-element cost is seven
32-bit integer operations — cheap enough for NumPy, WGSL (no 64-bit integers) and the
GPU kernels alike.  Positions must lie in [0, 2³²).
"""
from __future__ import annotations

import numbers
from typing import Optional, Sequence, Tuple

import numpy as np

__all__ = ["dropout_mask", "threshold", "keep_scale", "philox4x32", "row_words",
           "col_words", "mix32", "check_dropout"]

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = 0x9E3779B9, 0xBB67AE85
_LO = np.uint64(0xFFFFFFFF)
_32 = np.uint64(32)
U32_LIMIT = 1 << 32


def philox4x32(c0, c1, c2, c3, k0: int, k1: int, rounds: int = 10):
    """Philox4x32-R: four uint32 counter words (arrays broadcast together) and a
    two-word key -> the four output words (uint32 arrays)."""
    c0, c1, c2, c3 = (np.asarray(c, np.uint64) & _LO for c in (c0, c1, c2, c3))
    k0, k1 = int(k0) & 0xFFFFFFFF, int(k1) & 0xFFFFFFFF
    for _ in range(rounds):
        p0 = c0 * _M0                      # 32 x 32 -> 64 bits, exact in uint64
        p1 = c2 * _M1
        c0, c1, c2, c3 = ((p1 >> _32) ^ c1 ^ np.uint64(k0), p1 & _LO,
                          (p0 >> _32) ^ c3 ^ np.uint64(k1), p0 & _LO)
        k0, k1 = (k0 + _W0) & 0xFFFFFFFF, (k1 + _W1) & 0xFFFFFFFF
    return tuple(c.astype(np.uint32) for c in (c0, c1, c2, c3))


def _key(seed: int) -> Tuple[int, int]:
    return seed & 0xFFFFFFFF, seed >> 32


def row_words(seed: int, batch: Sequence[int], heads: Sequence[int],
              rows: Sequence[int]) -> np.ndarray:
    """uint32 [len(batch), len(heads), len(rows)]: Philox word 0 of counter
    (i, h, b, 0) for global row positions ``rows``."""
    k0, k1 = _key(seed)
    b = np.asarray(batch, np.uint64)[:, None, None]
    h = np.asarray(heads, np.uint64)[None, :, None]
    i = np.asarray(rows, np.uint64)[None, None, :]
    return philox4x32(i, h, b, np.uint64(0), k0, k1)[0]


def col_words(seed: int, cols: Sequence[int]) -> np.ndarray:
    """uint32 [len(cols)]: Philox word 0 of counter (j, 0, 0, 1) for global key
    positions ``cols``."""
    k0, k1 = _key(seed)
    j = np.asarray(cols, np.uint64)
    return philox4x32(j, np.uint64(0), np.uint64(0), np.uint64(1), k0, k1)[0]


def mix32(x: np.ndarray) -> np.ndarray:
    """The per-element finaliser on uint32 (in place where ``x`` is writable uint32)."""
    x = np.asarray(x, np.uint32)
    x ^= x >> np.uint32(16)
    x *= np.uint32(0x7FEB352D)
    x ^= x >> np.uint32(15)
    x *= np.uint32(0x846CA68B)
    x ^= x >> np.uint32(16)
    return x


def threshold(p: float) -> int:
    """The uint32 cut: an element is kept iff its draw is >= this."""
    return min(int(round(float(p) * U32_LIMIT)), U32_LIMIT - 1)


def keep_scale(p: float) -> float:
    """1 / (1 − p): the factor on kept probabilities."""
    return 1.0 / (1.0 - float(p))


def check_dropout(p, seed, *, need_seed: bool = True) -> Tuple[float, Optional[int]]:
    """Validate ``dropout_p`` and ``dropout_seed`` -> (p as float, seed as int or None).
    p in [0, 1); with p > 0 a seed in [0, 2⁶⁴) is required."""
    if isinstance(p, bool) or not isinstance(p, numbers.Real):
        raise TypeError(f"dropout_p: expected a float in [0, 1), got {type(p).__name__}")
    p = float(p)
    if not (0.0 <= p < 1.0):
        raise ValueError(f"dropout_p: {p} is outside [0, 1); 0 disables dropout")
    if seed is None:
        if p > 0 and need_seed:
            raise ValueError("dropout_seed: dropout_p > 0 needs a seed, an int in [0, 2**64) "
                             "(the same seed gives the same mask on every backend)")
        return p, None
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"dropout_seed: expected an int in [0, 2**64), got "
                        f"{type(seed).__name__}")
    seed = int(seed)
    if not (0 <= seed < 1 << 64):
        raise ValueError(f"dropout_seed: {seed} is outside [0, 2**64)")
    return p, seed


def dropout_mask(shape, p: float, seed: int, *, q_offset: int = 0,
                 k_offset: int = 0) -> np.ndarray:
    """The keep mask every backend applies: bool [B, Hq, Sq, Sk] (``shape``), True = kept.

    Rows are global query positions ``q_offset + i``, columns global key positions
    ``k_offset + j`` (both must lie in [0, 2³²)); ``p`` in [0, 1); seed in [0, 2⁶⁴).
    Memory: one uint32 per element (this is the dense form, for tests and tools).
    """
    p, seed = check_dropout(p, seed)
    B, H, Sq, Sk = (int(n) for n in shape)
    rows = _positions("q_offset", q_offset, Sq)
    cols = _positions("k_offset", k_offset, Sk)
    if p == 0.0:
        return np.ones((B, H, Sq, Sk), dtype=bool)
    x = row_words(seed, range(B), range(H), rows)[..., None] ^ col_words(seed, cols)
    return mix32(x) >= np.uint32(threshold(p))


def _positions(name: str, offset: int, n: int) -> np.ndarray:
    if offset < 0 or offset + n > U32_LIMIT:
        raise ValueError(f"{name}: positions {offset}..{offset + n - 1} leave [0, 2**32); "
                         "dropout counts positions as 32-bit unsigned integers")
    return np.arange(offset, offset + n, dtype=np.uint64)
