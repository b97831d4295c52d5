"""Tile configurations of the Hopper kernels (frozen dataclasses, keyed on head dim).

Shape legend: D head dim, BM / BN query / key tile, STAGES depth of the K/V ring.
Shared memory per forward program: 2 bytes * D * (BM + 2 * STAGES * BN).
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["HopperConfig", "fwd_config", "FWD_VARIANTS"]


@dataclass(frozen=True)
class HopperConfig:
    """One Hopper kernel's launch shape."""

    bm: int
    bn: int
    stages: int
    num_warps: int = 8
    overlap: bool = False     # FA3's intra-warpgroup overlap (needs stages >= 3)

    def smem_bytes(self, d: int, elem: int = 2) -> int:
        return elem * d * (self.bm + 2 * self.stages * self.bn)


#: D -> forward config (two consumer warpgroups of 64 query rows each); D=128: 160 KiB,
#: D=64: 112 KiB of the 227 KiB an H100/H200 block may use
_FWD = {64: HopperConfig(128, 128, 3, 8), 128: HopperConfig(128, 128, 2, 8)}

#: variants the GPU bench times beside the defaults
FWD_VARIANTS = {64: [HopperConfig(128, 128, 3, 8, True)],
                128: [HopperConfig(128, 128, 3, 8, True), HopperConfig(128, 64, 4, 8, True)]}


def fwd_config(d: int) -> HopperConfig:
    return _FWD[d]
