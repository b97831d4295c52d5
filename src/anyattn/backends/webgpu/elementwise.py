"""The ``ew`` kernel and the buffers around it: element-wise gathers, casts, adds and
refinements of device arrays on the device, and new result buffers.

Used by the device-resident calls (resident.py) and by the backend's f16 casts
(backend.py).  ``Seq`` collects launches when no engine ``Call`` is at hand; a
``Call`` serves as well (both have ``run``, ``uni``, ``launches`` and
``uniform_buffer``).
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import numpy as np

from .device_array import HOME, DeviceArray, contiguous_strides
from .launch import Launch, ceil_div

__all__ = ["fresh_buffer", "buffer_bytes", "result_array", "shape4", "Seq", "ew",
           "gather_contig"]


def fresh_buffer(run, nbytes: int, label: str):
    """A new buffer for a result the caller keeps (zero-initialised by WebGPU)."""
    run.check_size(label, int(nbytes))
    usage = run.usage
    return run.device.create_buffer(label=label, size=max(16, -(-int(nbytes) // 16) * 16),
                                    usage=usage)


def buffer_bytes(count: int, dtype) -> int:
    """Bytes of ``count`` elements (f16 rounded up to whole vec4s: the kernels write
    f16 four at a time)."""
    if np.dtype(dtype) == np.float16:
        return 8 * ceil_div(count, 4)
    return 4 * count


def result_array(buf, shape, dtype, offset: int = 0) -> DeviceArray:
    """A C-contiguous device array over ``buf`` on anyattn's device."""
    return DeviceArray(buf, shape, dtype, contiguous_strides(shape), offset, HOME)


def shape4(x) -> Tuple[Tuple[int, ...], Tuple[int, ...]]:
    """Shape and element strides left-padded to 4 dims; size-1 dims get stride 0."""
    pad = 4 - x.ndim
    shape = (1,) * pad + tuple(x.shape)
    strides = (0,) * pad + tuple(x.strides)
    return shape, tuple(0 if n == 1 else s for n, s in zip(shape, strides))


class Seq:
    """A list of launches with their own uniform buffers (when no Call is at hand)."""

    def __init__(self, run, prefix: str = "ew_u"):
        self.run, self.prefix, self.launches, self.clears, self._n = run, prefix, [], [], 0
        self.copies = []
        self.uni: Dict[str, object] = {}

    def uniform_buffer(self, vals):
        buf = self.run.uniform(f"{self.prefix}{self._n}", vals)
        self._n += 1
        return buf

    def submit(self) -> None:
        self.run.run(self.launches, self.clears, self.copies)
        self.launches, self.clears, self.copies = [], [], []


def ew(seq, src, dst_buf, dst_off: int, *, dst16: bool = False, op: Optional[str] = None,
        src2=None, extra: Optional[Dict[str, int]] = None, shape=None, strides=None) -> None:
    """One ``ew`` launch: dst[dst_off + e] = op(src viewed as ``shape``/``strides``),
    e over the C order of the (4-D padded) shape."""
    run = seq.run
    sh, st = shape4(src)
    if shape is not None:
        sh = (1,) * (4 - len(shape)) + tuple(shape)
        st = (0,) * (4 - len(strides)) + tuple(strides)
        st = tuple(0 if n == 1 else s for n, s in zip(sh, st))
    n = int(np.prod(sh))
    if n == 0:
        return
    if dst16 and dst_off % 4:
        raise RuntimeError("ew: an f16 destination starts at a multiple of 4 elements")
    src16 = src.dtype == np.float16
    consts = {}
    if src16:
        consts["SRC16"] = 1
    if dst16:
        consts["DST16"] = 1
    if op == "add":
        consts["OP_ADD"] = 1
    elif op == "refine":
        consts["OP_REFINE"] = 1
    elem = "f16" if (src16 or dst16) else "f32"
    pipe = run.pipeline("ew", "ew", consts, elem)
    vals = dict(seq.uni, n_out=n, db_nb=sh[0], db_nh=sh[1], db_ni=sh[2], db_nj=sh[3],
                db_sb=st[0], db_sh=st[1], db_si=st[2], db_sj=st[3], o_off=src.offset,
                out2_off=dst_off)
    vals.update(extra or {})
    ubuf = seq.uniform_buffer(vals)
    s2 = src2 if src2 is not None else run.dummy
    seq.launches.append(Launch("ew", pipe, "ew", [ubuf, src.buffer, s2, dst_buf],
                               run.flat_grid(ceil_div(n, 4))))


def gather_contig(seq, x, role: str, dtype=None):
    """x copied on the device into the pooled scratch ``role``, C-contiguous, in
    ``dtype`` (default x's) -> the contiguous DeviceArray over that scratch."""
    dt = np.dtype(dtype or x.dtype)
    buf = seq.run.buffer(role, buffer_bytes(x.size, dt))
    ew(seq, x, buf, 0, dst16=dt == np.float16)
    return result_array(buf, x.shape, dt)
