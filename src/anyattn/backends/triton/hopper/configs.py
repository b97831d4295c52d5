"""Tile configurations of the Hopper kernels: one table entry per routed case.

Shape legend: D head dim, BM / BN query / key tile, STAGES depth of the K/V (forward)
or Q/dO (backward) ring.  Every forward config is warp-specialised (a TMA producer warp,
BM / 64 consumer warpgroups of 64 query rows) with FA3's intra-warpgroup overlap,
ping-pong turns between the consumers and the softmax exponent as one fma ('opf').
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Dict, List, Tuple

__all__ = ["HopperConfig", "HopperBwdConfig", "fwd_config", "bwd_config",
           "bwd_config_dkdv_only", "FWD_CONFIGS", "BWD_CONFIGS"]


@dataclass(frozen=True)
class HopperConfig:
    """One forward launch shape (fwd_ws_kernel; ``persist``: fwd_persist_kernel, one
    program per SM walking the host-built schedule of query tiles)."""

    bm: int
    bn: int
    stages: int
    consumer_regs: int = 240   # registers per consumer thread (setmaxnreg)
    persist: bool = False

    def __post_init__(self):
        if self.bm not in (128, 192):
            raise ValueError(f"{self}: the forward runs 2 or 3 consumer warpgroups of 64 "
                             "query rows (bm 128 or 192)")
        if self.persist and self.bm != 128:
            raise ValueError(f"{self}: the persistent forward runs 2 consumer warpgroups "
                             "(bm 128)")

    @property
    def consumers(self) -> int:
        """Consumer warpgroups, 64 query rows each."""
        return self.bm // 64

    def per_tile(self) -> "HopperConfig":
        """A persistent config's loop as one program per query tile (the same products in
        the same order per row: bitwise the same results)."""
        return dataclasses.replace(self, persist=False)

    @property
    def name(self) -> str:
        """e.g. 'ws128x128s2opf' / 'ws128x128s2opfPg' (persistent, scheduled)."""
        return f"ws{self.bm}x{self.bn}s{self.stages}opf{'Pg' if self.persist else ''}"

    def smem_bytes(self, d: int, elem: int = 2) -> int:
        """Shared memory: Q, the K/V ring and, persistent, the O staging buffer."""
        o = self.bm * d if self.persist else 0
        return elem * (d * (self.bm + 2 * self.stages * self.bn) + o)


@dataclass(frozen=True)
class HopperBwdConfig:
    """One backward launch shape: bn key rows per program (two consumer warpgroups of
    bn / 2), bm query rows per ring stage.  ``dq``: bwd_ws_dq_kernel (bwd_ws_t_kernel
    when ``trans``) computes dQ too, one partial per key tile added in a fixed order by
    a writer warp, the row statistics staged by the producer, the dQ staging rows
    interleaved ('nhri'); else bwd_ws_kernel computes dK / dV only (dQ portable).
    ``trans``: the consumers compute S^T / dP^T, keys as the wgmma rows.
    ``late_release``: the writer waits for a tile's adds a tile later ('e')."""

    bm: int
    stages: int = 2
    bn: int = 128
    consumer_regs: int = 240
    dq: bool = False
    trans: bool = False
    late_release: bool = False

    def __post_init__(self):
        if self.bn != 128 or self.bm not in ((64, 128) if self.trans else (64,)):
            raise ValueError(f"{self}: the backward runs bn 128 (two consumers of 64 key "
                             "rows), bm 64 (the transposed consumers: 64 or 128)")
        if (self.trans or self.late_release) and not self.dq:
            raise ValueError(f"{self}: trans and late_release are options of dq configs")

    @property
    def name(self) -> str:
        """e.g. 'wdkdv128x64s2' (dK/dV only) / 'wdkdvq128x64s2nhri' (dQ inside)."""
        if not self.dq:
            return f"wdkdv{self.bn}x{self.bm}s{self.stages}"
        return (f"wdkdvq{self.bn}x{self.bm}s{self.stages}nh{'t' if self.trans else ''}ri"
                f"{'e' if self.late_release else ''}")

    def smem_bytes(self, d: int, elem: int = 2) -> int:
        """Shared memory: K / V, the Q / dO ring, the P / dS buffers and, with dq, the
        fp32 staging, the shared dS halves and the staged row statistics."""
        base = elem * d * (2 * self.bn + 2 * self.stages * self.bm)
        pds = 2 * elem * self.bm * self.bn
        if not self.dq:
            return base + pds
        extra = pds + 4 * self.bm * d + elem * self.bm * self.bn + 16 * self.stages * self.bm
        if self.trans:   # no P buffers; the statistics staged once, not per consumer
            extra -= elem * self.bm * self.bn
        return base + extra


#: (D, mask class) -> forward config; reason
_FWD: Dict[Tuple[int, str], HopperConfig] = {
    # 3 consumers at 160 registers (FA3's hdim-64 tile): no band, so no ragged tails
    (64, "none"): HopperConfig(192, 128, 3, consumer_regs=160),
    # a band leaves 192-row tiles a ragged tail; persistent, longest tiles first
    (64, "band"): HopperConfig(128, 128, 3, persist=True),
    # persistent: the producer runs ahead into the next tile during a tile's epilogue
    (128, "none"): HopperConfig(128, 128, 2, persist=True),
    # persistent on the host-built schedule: uneven band loops dealt out greedily
    (128, "band"): HopperConfig(128, 128, 2, persist=True),
    # Q (64 KB) and a 2-stage ring of 64-key K/V tiles (128 KB) fill shared memory: no
    # room for the persistent kernel's O staging; 168 registers, no spills
    (256, "none"): HopperConfig(128, 64, 2),
    # as (256, 'none'): a band only shortens the key loop
    (256, "band"): HopperConfig(128, 64, 2),
}
#: D=128 Documents / KeepMask (every class with 'documents' or 'keep'): the per-tile
#: kernel, since their key ranges are per call and the host schedule needs them up front
_FWD_ARRAYS = HopperConfig(128, 128, 2)

#: (D, mask class) -> backward config; reason
_BWD: Dict[Tuple[int, str], HopperBwdConfig] = {
    # 128-row query tiles need the transposed consumers (S^T in registers)
    (64, "none"): HopperBwdConfig(128, dq=True, trans=True, late_release=True),
    # with a band the next adder of a query tile follows within a tile: no late release
    (64, "band"): HopperBwdConfig(128, dq=True, trans=True),
    # the writer's late release hides the bulk adds' completion
    (128, "none"): HopperBwdConfig(64, dq=True, late_release=True),
    # as (64, 'band'): the late release would delay the next adder
    (128, "band"): HopperBwdConfig(64, dq=True),
}
#: D=128 Documents / KeepMask: the band config's kernel over the mask's tables
_BWD_ARRAYS = _BWD[(128, "band")]
#: D=64 with ALiBi: the transposed consumers' 128-row tiles spill with ALiBi's
#: per-element distances (their sm_90a SASS: 70-400 local stores a kernel against 17
#: without); the untransposed 64-row consumers hold them in registers (none)
_BWD_ALIBI_64 = HopperBwdConfig(64, dq=True)
#: dQ portable: the dQ-inside kernels' waits need every key-tile program of a (batch,
#: kv head) resident (route.py decides), and a call without dq needs none
_BWD_DKDV_ONLY = HopperBwdConfig(64)


def fwd_config(d: int, mask_class: str) -> HopperConfig:
    """The forward's config for head dim d and the call's mask class (Problem.mask_class:
    'none', 'band', 'documents', ...); KeyError for a case the Hopper path does not
    cover (coverage.py)."""
    if d == 128 and ("documents" in mask_class or "keep" in mask_class):
        return _FWD_ARRAYS
    return _FWD[(d, mask_class)]


def bwd_config(d: int, mask_class: str, features=frozenset()) -> HopperBwdConfig:
    """The backward's config for head dim d, the call's mask class and score features
    (coverage.FEATURES names)."""
    if d == 128 and ("documents" in mask_class or "keep" in mask_class):
        return _BWD_ARRAYS
    cfg = _BWD[(d, mask_class)]
    if d == 64 and "alibi" in features:
        return _BWD_ALIBI_64
    return cfg


def bwd_config_dkdv_only(d: int) -> HopperBwdConfig:
    """The dK/dV-only config (dQ portable: no program waits for another)."""
    if d not in (64, 128):
        raise KeyError(d)
    return _BWD_DKDV_ONLY


#: every forward config that can be launched (the persistent ones' per-tile twins run
#: under CUDA-graph capture before a schedule exists)
FWD_CONFIGS: List[HopperConfig] = sorted(
    {c for c in _FWD.values()} | {c.per_tile() for c in _FWD.values()} | {_FWD_ARRAYS},
    key=lambda c: c.name)
#: every backward config that can be launched
BWD_CONFIGS: List[HopperBwdConfig] = sorted(set(_BWD.values()) | {_BWD_DKDV_ONLY},
                                            key=lambda c: c.name)
