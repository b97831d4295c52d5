"""Tile configurations of the Hopper kernels (frozen dataclasses, keyed on head dim).

Shape legend: D head dim, BM / BN query / key tile, STAGES depth of the K/V ring.
Shared memory per forward program: 2 bytes * D * (BM + 2 * STAGES * BN).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

__all__ = ["HopperConfig", "HopperBwdConfig", "fwd_config", "bwd_config", "bwd_config_dkdv_only",
           "dkdv_config",
           "FWD_VARIANTS", "FWD_PERSIST", "FWD_PERSIST_SCHED", "FWD_PERSIST_D64_NC3", "FWD_PERSIST_D64_X",
           "FWD_PERSIST_VARIANTS", "BWD_VARIANTS", "WS_BWD_VARIANTS",
           "PREV_BWD", "WS_DQ_BWD_VARIANTS", "WS_DQS_BWD_VARIANTS", "WS_DQT_BWD_VARIANTS"]


@dataclass(frozen=True)
class HopperConfig:
    """One Hopper kernel's launch shape."""

    bm: int
    bn: int
    stages: int
    num_warps: int = 8
    overlap: bool = False     # FA3's intra-warpgroup overlap (plain kernel: stages >= 3)
    ws: bool = False          # warp-specialised (fwd_ws_kernel: producer warp + 2 consumers)
    consumer_regs: int = 240  # ws: registers per consumer thread (setmaxnreg)
    pingpong: bool = False    # ws + overlap: the consumers take turns to issue products
    exp_fma: bool = False     # ws: softmax exponent as one fma, s * c - m * c
    edges: bool = False       # ws + overlap: masked edge tiles in loops of their own
    p_smem: bool = False      # edges: P through shared memory (2 stages), not registers
    persist: bool = False     # ws + overlap: one program per SM walking query tiles
                              # (fwd_persist_kernel; 2 or 3 consumers, + bm * D * 2 B for O)
    sched: bool = False       # persist: each program walks a host-built schedule (the
                              # per-tile grid's order dealt out greedily by loop length)
    xover: bool = False       # persist: a tile's last P.V issued with the next tile's
                              # first S, the epilogue after (Q double-buffered)

    def __post_init__(self):
        if self.pingpong and not (self.ws and self.overlap):
            raise ValueError(f"{self}: pingpong needs ws=True and overlap=True (the turns "
                             "order the overlapped pair of products)")
        if self.overlap and not self.ws and self.stages < 3:
            raise ValueError(f"{self}: the plain kernel's overlapped loop needs stages >= 3")
        if self.exp_fma and not self.ws:
            raise ValueError(f"{self}: exp_fma is a warp-specialised kernel option")
        if self.edges and not (self.ws and self.overlap):
            raise ValueError(f"{self}: edges needs ws=True and overlap=True (the edge "
                             "loops run the overlapped schedule)")
        if self.p_smem and not self.edges:
            raise ValueError(f"{self}: p_smem needs edges=True (the edge loops' option)")
        if self.persist and not (self.ws and self.overlap and not self.edges
                                 and self.bm in (128, 192)):
            raise ValueError(f"{self}: persist runs the overlapped ws loop with 2 or 3 "
                             "consumers (ws=True, overlap=True, edges=False, bm=128 / 192)")
        if self.sched and not self.persist:
            raise ValueError(f"{self}: sched is the persistent kernel's walk (persist=True)")
        if self.xover and not (self.persist and self.bm == 128):
            raise ValueError(f"{self}: xover overlaps the persistent kernel's tile "
                             "boundaries (persist=True, 2 consumers: bm=128)")
        if self.ws and (self.bm % 64 or self.bm // 64 not in (2, 3)):
            raise ValueError(f"{self}: the warp-specialised kernel runs 2 or 3 consumer "
                             "warpgroups of 64 query rows (bm 128 or 192)")

    @property
    def consumers(self) -> int:
        """ws: consumer warpgroups, 64 query rows each."""
        return self.bm // 64

    def per_tile(self) -> "HopperConfig":
        """A persistent config's loop as one program per query tile (the same products
        in the same order per row: bitwise the same results)."""
        return dataclasses.replace(self, persist=False, sched=False, xover=False)

    @property
    def name(self) -> str:
        """e.g. 'ws128x128s2' / '128x128s3o' / 'ws128x128s2opfem' (bench and LOG labels)."""
        return (f"{'ws' if self.ws else ''}{self.bm}x{self.bn}s{self.stages}"
                f"{'o' if self.overlap else ''}{'p' if self.pingpong else ''}"
                f"{'f' if self.exp_fma else ''}{'e' if self.edges else ''}"
                f"{'m' if self.p_smem else ''}{'P' if self.persist else ''}"
                f"{'g' if self.sched else ''}{'x' if self.xover else ''}")

    def smem_bytes(self, d: int, elem: int = 2) -> int:
        p = 2 * self.bm * self.bn if self.p_smem else 0
        o = self.bm * d if self.persist else 0          # the persistent kernel's O buffer
        o += self.bm * d if self.xover else 0           # its second Q buffer
        return elem * (d * (self.bm + 2 * self.stages * self.bn) + p + o)


#: D -> forward config.  D=128: the warp-specialised kernel (fwd_ws_kernel, 2 stages,
#: 160 KiB) with FA3's intra-warpgroup overlap, ping-pong turns and the fma exponent
#: ('ws128x128s2opf'): 604 / 479 / 628 / 589 TFLOP/s at S=2k / 2k causal / 8k / 8k causal,
#: 0.92-1.06x cuDNN, +15-23 % over the simple ws loop (H200 2026-12-03, docs/perf/
#: hopper-fwd-h200-2026-12-03.json; 'op' without the fma 620 / 469 / 609 / 567, 3 stages
#: 599 / 464 / 616 / 563); session 6 (hopper-fwd-h200-2026-12-03-s6.json): the edge loops
#: 'opfe' 0-5 % and with P through shared memory 'opfem' 6-11 % under it in every row,
#: bf16 and fp16.  D=64 (session 8, H200 2026-12-04, docs/perf/hopper-fwd-h200-2026-12-04-
#: s8.json, bf16 TFLOP/s at S=2k / 2k causal / 8k / 8k causal): with a band the
#: 2-consumer schedule with P in registers, 3 stages ('ws128x128s3opf': 401 / 305 / 445 /
#: 410 vs portable 389 / 304 / 408 / 372), without a mask 3 consumers (_FWD_BY_MASK)
#: Session 12 (2026-12-04): D=128 without a mask or with a band runs this config's loop
#: in the persistent kernel (FWD_PERSIST_SCHED, 'ws128x128s2opfPg', _FWD_BY_MASK below;
#: session 11's device-time numbers in the comment above FWD_PERSIST_VARIANTS); _FWD[128]
#: stays the per-tile kernel of Documents / KeepMask calls (the host-built schedule takes
#: band masks only) and is the persistent route's per-tile twin (HopperConfig.per_tile:
#: bitwise the same results; FwdLaunch runs it under CUDA-graph capture before the
#: schedule of a shape is built)
_FWD = {64: HopperConfig(128, 128, 3, ws=True, overlap=True, pingpong=True, exp_fma=True),
        128: HopperConfig(128, 128, 2, ws=True, overlap=True, pingpong=True, exp_fma=True)}
#: (D, mask class) exceptions to _FWD: D=64 without a mask, 3 consumer warpgroups of 64
#: query rows at 160 registers ('ws192x128s3opf': 448 / 503 TFLOP/s at S=2k / 8k, bf16,
#: vs portable 389 / 408 and cuDNN 449 / 465; with a causal band it drops to 204 / 385,
#: the tail of its 192-row tiles, hence the mask in the key)
#: with a band (session 9, H200 2026-12-04 09:55 UTC, docs/perf/hopper-fwd-h200-
#: 2026-12-04-s9.json): the band default's loop in the persistent kernel walking the
#: host-built schedule ('ws128x128s3opfPg', longest tiles first), causal TFLOP/s at S=2k /
#: 4k / 8k 334 / 389 / 420 (fp16 4k 388) vs the per-tile 'ws128x128s3opf' 305 / 367 /
#: 407 and portable 305 / 348 / 368: faster than both in every rotated pass (cuDNN 376 /
#: 404 / 427)
_FWD_D64_BAND = HopperConfig(128, 128, 3, ws=True, overlap=True, pingpong=True, exp_fma=True,
                             persist=True, sched=True)
_FWD_BY_MASK = {(64, "none"): HopperConfig(192, 128, 3, consumer_regs=160, ws=True,
                                           overlap=True, pingpong=True, exp_fma=True),
                (64, "band"): _FWD_D64_BAND}
#: (D, dtype) exceptions to _FWD (none now).  fp16 at D=128 runs the bf16 default since
#: session 6: float64 checks of ws128x128s2opf in fp16 on every mask kind (none, causal
#: both alignments, two windows, empty rows, [B, S, H, D] strides; GQA, odd sizes) within
#: tolerance with the portable kernel's errors (2.6e-4-4.2e-4), bitwise repeatable; fp16
#: TFLOP/s 576 / 450 / 640 / 562 at S=2k / 2k causal / 8k / 8k causal vs the plain
#: kernel's 456 / 367 / 489 / 439, cuDNN 597 / 484 / 611 / 547 (H200 2026-12-03 21:17,
#: docs/perf/hopper-fwd-h200-2026-12-03-s6.json)
_FWD_BY_DTYPE: dict = {}

#: variants the GPU bench times beside the defaults: the plain kernel of D=128 (two
#: warpgroups meeting at a CTA barrier per key tile) and its FA3 overlapped loop stay
#: for A/B; the warp-specialised kernel with the simple loop (the D=128 default until the
#: 2026-12-03 18:35 UTC run), with FA3's intra-warpgroup overlap ('o') and with the
#: ping-pong turns between its consumers ('op'), 2 and 3 stages; the edge loops ('e':
#: masked tiles in loops of their own, no mask branch in the hot loop) with P in
#: registers or through shared memory ('m'); at D=64 three consumers (bm 192) too, and
#: (session 8) the D=128 default's schedule with P in registers ('opf': at D=128 6-11 %
#: over 'opfem'; D=64 had timed only 'opfem'), 2 consumers / 3 stages and 3 consumers
#: (sm_90a: no STL / LDL either way)
_OPFE = dict(ws=True, overlap=True, pingpong=True, exp_fma=True, edges=True)
_OPF = dict(ws=True, overlap=True, pingpong=True, exp_fma=True)
FWD_VARIANTS = {64: [HopperConfig(128, 128, 3, ws=True), HopperConfig(128, 128, 4, ws=True),
                     HopperConfig(128, 128, 4, p_smem=True, **_OPFE),
                     HopperConfig(192, 128, 3, consumer_regs=160, p_smem=True, **_OPFE),
                     HopperConfig(128, 128, 3, **_OPF),
                     HopperConfig(192, 128, 3, consumer_regs=160, **_OPF)],
                128: [HopperConfig(128, 128, 2, 8), HopperConfig(128, 128, 3, ws=True),
                      HopperConfig(128, 128, 3, 8, True),
                      HopperConfig(128, 128, 2, ws=True, overlap=True),
                      HopperConfig(128, 128, 3, ws=True, overlap=True),
                      HopperConfig(128, 128, 2, ws=True, overlap=True, pingpong=True),
                      HopperConfig(128, 128, 3, ws=True, overlap=True, pingpong=True),
                      HopperConfig(128, 128, 2, ws=True),
                      HopperConfig(128, 128, 2, ws=True, overlap=True, pingpong=True,
                                   exp_fma=True),
                      HopperConfig(128, 128, 2, **_OPFE),
                      HopperConfig(128, 128, 2, p_smem=True, **_OPFE)]}

#: session 7: the D=128 default's schedule, persistent (fwd_persist_kernel: one program
#: per SM walking query tiles).  Session 8 (H200 2026-12-04, docs/perf/hopper-fwd-h200-
#: 2026-12-04-s8.json): its session-7 hang fixed (a tile's last V stage never released);
#: bf16 dense / causal / bottom-right GQA Sq != Sk / window with 3-4 tiles per program
#: bitwise equal to the per-tile default and within tolerance of float64; TFLOP/s vs the
#: default 600 / 416 / 631 / 533 vs 579 / 462 / 633 / 593 (S=2k, 2k causal, 8k, 8k
#: causal): with a band its across-heads order misses L2.  Not a default, kept out of
#: FWD_VARIANTS (fp16, array masks and its pytest tests not yet run on a GPU)
FWD_PERSIST = HopperConfig(128, 128, 2, ws=True, overlap=True, pingpong=True, exp_fma=True,
                           persist=True)
#: session 8: FWD_PERSIST walking a host-built schedule (launch.persist_schedule: the
#: per-tile grid's launch order dealt out greedily by key loop length, so that live
#: programs share heads in L2 as the per-tile kernel's do; without a band every loop is
#: as long and the kernel walks its own head-major order, the same walk).  Routed at
#: D=128 for mask classes 'none' and 'band' since session 12 (_FWD_BY_MASK below)
FWD_PERSIST_SCHED = HopperConfig(128, 128, 2, ws=True, overlap=True, pingpong=True,
                                 exp_fma=True, persist=True, sched=True)
#: D -> the persistent forward configs the bench may name (not in FWD_VARIANTS).  Session
#: 9: D=64's band config (_FWD_BY_MASK; sm_90a offline: 48 HGMMA, no STL / LDL, 168
#: registers, 131.5 KB shared, band or not).  D=128's scheduled walk at S=2k / 8k (H200
#: 2026-12-04 09:55 UTC, bf16 and fp16): +2-3 % at S=2k, -1 to +1 % at 8k, passes mixed
#: with the per-tile default's: not routed.  Session 11 in device time (H200 2026-12-04
#: 15:22 UTC, docs/perf/hopper-fwd-h200-2026-12-04-s11-graph.json, CUDA-graph replays, 3
#: rotated rounds, bf16, outputs bitwise the per-tile kernel's): 570 / 458 / 594 / 524 /
#: 610 / 559 TFLOP/s at S=2k / 2k causal / 4k / 4k causal / 8k / 8k causal vs the routed
#: per-tile 558 / 442 / 586 / 507 / 605 / 558 (faster in every round but at 8k causal, a
#: tie) and cuDNN 567 / 455 / 584 / 496 / 594 / 530.  Routed in session 12 (2026-12-04,
#: on these numbers; _FWD_BY_MASK[(128, 'none' / 'band')]): without a mask and with a
#: band (causal, windows, bottom-right), bf16 and fp16 (fp16 timed in session 9 only);
#: Documents / KeepMask stay on the per-tile _FWD[128] (the schedule takes band masks
#: only).  The host-side tests pin the per-tile config where they are about it and check
#: the persistent launch (SM count monkeypatched) where about the route; the GPU suite
#: is to be re-run on the new route by the lead
#: Session 10: D=64 with three consumers (bm 192, 160 registers: the per-tile D=64
#: no-mask default's loop) persistent on the schedule, FA3's hdim-64 query tile.  H200
#: 2026-12-04 ~11:58 UTC (docs/perf/hopper-fwd-h200-2026-12-04-s10-lead1.json, bf16
#: TFLOP/s at S=2k / 4k / 8k): 432 / 446 / 495 vs the routed per-tile 437 / 473 / 497,
#: causal 177 / 266 / 368 vs the routed 336 / 388 / 408 (192-row tiles lose with a band in
#: both kernels): not routed
FWD_PERSIST_D64_NC3 = HopperConfig(192, 128, 3, consumer_regs=160, ws=True, overlap=True,
                                   pingpong=True, exp_fma=True, persist=True, sched=True)
#: Session 10: the D=64 band default with the tile boundaries overlapped (xover).  H200
#: 2026-12-04 ~12:36 UTC (docs/perf/hopper-fwd-h200-2026-12-04-s10-lead3.json, bf16 causal
#: TFLOP/s at S=2k / 4k / 8k): 330 / 388 / 411 vs the routed 342 / 390 / 409: not routed
FWD_PERSIST_D64_X = HopperConfig(128, 128, 3, ws=True, overlap=True, pingpong=True,
                                 exp_fma=True, persist=True, sched=True, xover=True)
FWD_PERSIST_VARIANTS = {64: [_FWD_D64_BAND, FWD_PERSIST_D64_NC3, FWD_PERSIST_D64_X],
                        128: [FWD_PERSIST, FWD_PERSIST_SCHED]}
#: session 12: the D=128 routes without a mask and with a band (see above)
_FWD_BY_MASK[(128, "none")] = FWD_PERSIST_SCHED
_FWD_BY_MASK[(128, "band")] = FWD_PERSIST_SCHED


def fwd_config(d: int, dtype: str = "bfloat16", mask_class: str = "band") -> HopperConfig:
    """The forward's default config for head dim d, input dtype ('bfloat16' / 'float16')
    and the call's mask class (Problem.mask_class: 'none', 'band', 'documents', ...)."""
    return _FWD_BY_DTYPE.get((d, dtype)) or _FWD_BY_MASK.get((d, mask_class)) or _FWD[d]


@dataclass(frozen=True)
class HopperBwdConfig:
    """The backward kernel's launch shape: bn key rows per program (16 per warp; 64 per
    warpgroup in the fused kernel), bm query rows per ring stage.  Kernels: the dK/dV
    kernel (bwd_kernel, the transposed form); ``fused``: bwd_fused_kernel (two
    warpgroups, P and dS through shared memory, 8 warps); ``dq``: the fused kernel
    computes dQ too (deterministic in-kernel adds), else dQ stays portable.  Shared
    memory: 2 bytes * D * (2 * bn + 2 * stages * bm) (+ 4 * bm * bn for P, dS: fused;
    + 4 * bm * D for the staged fp32 dQ partial: dq)."""

    bn: int
    bm: int
    stages: int
    num_warps: int = 8
    fused: bool = False
    dq: bool = False
    #: dq: a tile's turn wait and bulk add issued at the next tile's start, under its
    #: S / dP products (bwd_fused_kernel module doc), not right after its dQ product
    defer: bool = False
    #: warp-specialised dK/dV (bwd_ws_kernel: a TMA producer warp, two consumer
    #: warpgroups of bn / 2 key rows at ``consumer_regs`` registers); ``pingpong``: the
    #: consumers take turns to issue their S / dP pair
    ws: bool = False
    consumer_regs: int = 240
    pingpong: bool = False
    #: ws with dq (bwd_ws_dq_kernel): the next tile's row statistics loaded under the
    #: current S / dP (False, 'n': each tile's own once S is done; fewer registers)
    prefetch: bool = True
    #: ws with dq: 1 accumulator (consumer 1's add after consumer 0's is complete) or 2
    #: (one per consumer, adds back to back, completion waited a tile later; 'c2')
    chains: int = 1
    #: ws with dq: one partial per key tile ('h'): the consumers' dS halves meet in shared
    #: memory and each computes half of the partial's columns (D / 2) from both
    split: bool = False
    #: split: the dQ products of a tile issued in the next tile ('l': a tile of slack
    #: between the consumers instead of lockstep; dS in three slots)
    lag: bool = False
    #: split: the consumers compute S^T / dP^T (keys as the wgmma rows) so that P^T and
    #: dS^T stay in registers as the A operand of dV / dK ('t'; bwd_ws_t_kernel)
    trans: bool = False
    #: ws with dq, not prefetch: the producer stages each tile's row statistics in
    #: shared memory beside Q / dO ('r'; no global load on a consumer's tile path; with
    #: trans one copy replaces the consumers' own staging)
    stats: bool = False
    #: ws with dq: the swizzle (bytes) of the fp32 dQ staging buffers and their bulk
    #: reduce-adds; 32 ('z') makes the consumers' 8-byte stores of the wgmma accumulator
    #: free of bank conflicts (128: two rows of each half-warp share banks)
    dq_swizzle: int = 128
    #: split without lag or trans: a tile's dQ products issued before its dK product,
    #: the dQ staging beside dK ('q')
    dq_first: bool = False
    #: split without lag, 128-byte swizzle: the staging buffers' rows interleaved in each
    #: group of 8 (row 4 * b1 + b0 at 2 * b0 + b1; the bulk copies' 5-D box undoes it,
    #: launch.dqa_desc) so that each half-warp's 8-byte stores of the wgmma accumulator
    #: meet 4 rows in 4 distinct bank groups ('i'; no conflicts, the same bulk copies)
    dq_interleave: bool = False
    #: split: the dQ writer waits for a tile's bulk adds to complete (and releases the
    #: query tile's counter to the next adder) a tile later, after the next tile's first
    #: half is staged, instead of before it takes the next tile ('e')
    late_release: bool = False

    def __post_init__(self):
        if self.dq and not (self.fused or self.ws):
            raise ValueError(f"{self.name}: only the fused and the warp-specialised kernels "
                             "compute dq")
        if self.defer and not (self.dq and self.fused):
            raise ValueError(f"{self.name}: defer schedules the fused kernel's in-kernel dq "
                             "(fused=True, dq=True)")
        if self.ws and (self.fused or self.bn != 128
                        or self.bm not in ((64, 128) if self.trans else (64,))):
            raise ValueError(f"{self.name}: the warp-specialised kernels run bn 128 "
                             "(two consumers of 64 key rows), bm 64 (the transposed "
                             "consumers: 64, or 128 at D=64), not fused")
        if not self.prefetch and not (self.ws and self.dq):
            raise ValueError(f"{self.name}: prefetch=False is an option of the "
                             "warp-specialised kernel with dq (ws=True, dq=True)")
        if self.chains not in (1, 2) or (self.chains == 2 and not (self.ws and self.dq)):
            raise ValueError(f"{self.name}: chains is 1, or 2 for the warp-specialised "
                             "kernel with dq (ws=True, dq=True)")
        if self.split and not (self.ws and self.dq and self.chains == 1):
            raise ValueError(f"{self.name}: split is an option of the warp-specialised "
                             "kernel with dq and one accumulator (ws=True, dq=True, chains=1)")
        if self.lag and not self.split:
            raise ValueError(f"{self.name}: lag is an option of split")
        if self.trans and not (self.split and not self.lag):
            raise ValueError(f"{self.name}: trans is an option of split without lag")
        if self.stats and not (self.ws and self.dq and not self.prefetch):
            raise ValueError(f"{self.name}: stats is an option of the warp-specialised "
                             "kernel with dq, without prefetch")
        if self.dq_swizzle not in (32, 128) or (self.dq_swizzle != 128
                                                 and not (self.ws and self.dq)):
            raise ValueError(f"{self.name}: dq_swizzle is 128, or 32 for the "
                             "warp-specialised kernel with dq")
        if self.dq_interleave and not (self.split and not self.lag
                                       and self.dq_swizzle == 128):
            raise ValueError(f"{self.name}: dq_interleave is an option of split configs "
                             "without lag at dq_swizzle 128 (the forms checked on a GPU)")
        if self.late_release and not self.split:
            raise ValueError(f"{self.name}: late_release is an option of split")
        if self.dq_first and not (self.split and not self.lag and not self.trans):
            raise ValueError(f"{self.name}: dq_first is an option of split without lag "
                             "or trans")
        if self.pingpong and not (self.ws and not self.dq):
            raise ValueError(f"{self.name}: pingpong orders the warp-specialised dK/dV "
                             "kernel's consumers (ws=True, dq=False)")

    @property
    def name(self) -> str:
        """e.g. 'dkdv128x32s2' (dK/dV) / 'fdkdvq128x64s2' (fused, with dQ; 'd': defer) /
        'wdkdv128x64s2p' (warp-specialised, 'p': ping-pong) / 'wdkdvq128x64s2'
        (warp-specialised with dq: bwd_ws_dq_kernel; 'h': split, one partial a key tile)."""
        return (f"{'f' if self.fused else ''}{'w' if self.ws else ''}dkdv"
                f"{'q' if self.dq else ''}{self.bn}x{self.bm}s{self.stages}"
                f"{'d' if self.defer else ''}{'p' if self.pingpong else ''}"
                f"{'' if self.prefetch else 'n'}{'c2' if self.chains == 2 else ''}"
                f"{'h' if self.split else ''}{'l' if self.lag else ''}"
                f"{'t' if self.trans else ''}{'r' if self.stats else ''}"
                f"{'z' if self.dq_swizzle == 32 else ''}{'q' if self.dq_first else ''}"
                f"{'i' if self.dq_interleave else ''}{'e' if self.late_release else ''}")

    def smem_bytes(self, d: int, elem: int = 2) -> int:
        extra = 2 * elem * self.bm * self.bn if (self.fused or self.ws) else 0
        # the staged fp32 dQ partial (ws: one per consumer; split: half the columns each,
        # and dS double-buffered)
        extra += (2 if self.ws else 1) * 4 * self.bm * d if self.dq and not self.split else 0
        extra += 4 * self.bm * d + elem * self.bm * self.bn if self.split else 0
        extra += elem * self.bm * self.bn if self.lag else 0     # a third dS slot
        # trans: no P buffers; the statistics staged (3 x 4 x bm fp32)
        extra -= elem * self.bm * self.bn - 48 * self.bm if self.trans else 0
        extra += 16 * self.stages * self.bm if self.stats else 0   # 4 fp32 a row a stage
        extra -= 48 * self.bm if self.stats and self.trans else 0  # not the consumers' copies
        return elem * d * (2 * self.bn + 2 * self.stages * self.bm) + extra


#: D -> the dK/dV kernel's config (bwd_kernel, the transposed form)
#: (sm_90a offline compile, 2026-12-03: D=128 bm=64 spills, 255
#: registers + 128-248 stack bytes; bm=32 230-253 registers, none; D=64 bm=64 217-237).
#: H200 (hopper-h200-2026-12-03b.json), TFLOP/s on dK/dV's 4 products: D=128 bm=32 s2
#: 364-425 / s3 348-438 / bm=64 s2 248-322; D=64 bm=64 s2 340-367, s3 336-371
_DKDV = {64: HopperBwdConfig(128, 64, 2, 8), 128: HopperBwdConfig(128, 32, 2, 8)}

#: the warp-specialised dK/dV configs (bwd_ws_kernel; 'w', 'p': ping-pong turns), D ->
#: its variants; the bench times them side by side (bench/gpu_hopper_bwd.py)
WS_BWD_VARIANTS = {d: [HopperBwdConfig(128, 64, 2, ws=True),
                       HopperBwdConfig(128, 64, 2, ws=True, pingpong=True),
                       HopperBwdConfig(128, 64, 3, ws=True, pingpong=True)] for d in (64, 128)}

#: D -> the warp-specialised dK/dV config (dQ and the delta preprocess stay portable),
#: the backward's default of session 7 and its route where _BWD's is not.  Session 7 (H200 2026-12-04 01:04 UTC,
#: docs/perf/hopper-bwd-h200-2026-12-04-s7.json, B=8 H=16 S=2k / B=2 H=16 S=8k, D=64 B=4
#: H=32 S=4k; TFLOP/s on dK/dV's 0.8 of the backward's FLOPs): the warp-specialised
#: kernel 'wdkdv128x64s2' 573 / 433 / 537 / 556 (S=2k, 2k causal, 8k, 8k causal) vs the
#: fused kernel's 431 / 391 / 459 / 465; D=64 419 / 398 vs the dK/dV kernel's 357 / 303.
#: Its route end to end (median of 3 rotated rounds) 382 / 304 / 409 / 380 vs the
#: portable backward's 350 / 289 / 383 / 359 (1.05-1.09x; every round faster), D=64
#: 327 / 290 vs 329 / 289 (1.0x: not routed by 'auto').  Ping-pong turns ('p') 0-11 %
#: slower, 3 stages 1-4 % slower.  Before (session 6): D=128 the fused kernel
#: (bwd_fused_kernel, its route 0.94-0.99x portable), D=64 the dK/dV kernel
_BWD_DKDV_ONLY = {64: WS_BWD_VARIANTS[64][0], 128: WS_BWD_VARIANTS[128][0]}

#: session 8: the warp-specialised kernel with dQ inside (bwd_ws_dq_kernel: per-consumer
#: partials dS_w.K_w staged in fp32 shared memory, a dQ-writer warp adding them in a
#: fixed order), D -> its variants; launch.backward_fused runs them.  Correct (float64,
#: both add orders, bitwise repeatable) but slower than the default's route: H200
#: 2026-12-04 (docs/perf/hopper-bwd-h200-2026-12-04-s8a/b.json), route TFLOP/s at D=128
#: S=2k / 2k causal / 8k / 8k causal 'n' 340-343 / 280 / 364-367 / 338-343, prefetch
#: 342-346 / 267-271 / 370-373 / 323-325, 'c2' 324 / 249 / 355 / 309 vs the default's
#: 372-379 / 305-307 / 412-417 / 373-382; D=64 S=4k 'n' 280 / 268 vs 324 / 284.  Not
#: routed; only 'n' is in BWD_VARIANTS (the GPU test grid), tests/triton/
#: test_hopper_bwd_dq.py checks all three
WS_DQ_BWD_VARIANTS = {d: [HopperBwdConfig(128, 64, 2, ws=True, dq=True),
                          HopperBwdConfig(128, 64, 2, ws=True, dq=True, prefetch=False),
                          HopperBwdConfig(128, 64, 2, ws=True, dq=True, prefetch=False,
                                          chains=2)]
                      for d in (64, 128)}

#: session 8, round 2: one dQ partial per key tile ('h': each consumer half of the
#: columns from both dS halves; bwd_ws_dq_kernel's SPLIT), 'n' (row statistics after S)
#: and prefetch, 'nhl' (the dQ products a tile late); 'nh' is the default (_BWD below),
#: 'nhl' measured 0.74-0.90x it at D=128, 'h' untimed (LOG "session 8, issue 15
#: backward, round 2" and "session 8, lead")
WS_DQS_BWD_VARIANTS = {d: [HopperBwdConfig(128, 64, 2, ws=True, dq=True, prefetch=False,
                                           split=True),
                           HopperBwdConfig(128, 64, 2, ws=True, dq=True, split=True),
                           HopperBwdConfig(128, 64, 2, ws=True, dq=True, prefetch=False,
                                           split=True, lag=True)]
                       for d in (64, 128)}

#: session 9: the transposed consumers of the dQ-inside kernel (bwd_ws_t_kernel: S^T and
#: dP^T with the consumer's keys as rows, P^T / dS^T from registers into dV / dK; FA3's
#: layout for D=128), D -> its variants; not routed until timed.  Offline sm_90a
#: (2026-12-04, bf16): 64 / 48 HGMMA at D=128 / 64, 200,256 B shared at D=128 (no P
#: buffers: 13 KB under 'nh'), consumer loops 3-6 STL / 16-21 LDL at D=128 (band 0-5 /
#: 13-15), none at D=64 (the queries' statistics are per column now, 16 registers a
#: vector: staged through shared memory a tile ahead, bwd_ws_t_parts).  H200 2026-12-04
#: 10:06 UTC (docs/perf/hopper-bwd-h200-2026-12-04-s9-trans2*.json, 3 rotated rounds),
#: route TFLOP/s vs 'nh' (the default) in the same rounds: D=128 S=2k / 2k causal / 8k /
#: 8k causal 415 / 360 / 451 / 449 vs 424 / 352 / 459 / 448; D=64 S=4k 333 vs 305 (the ws
#: dK/dV route used there: 332), causal 309 vs 322.  Correct (float64, both orders,
#: bitwise repeatable); not routed
WS_DQT_BWD_VARIANTS = {d: [HopperBwdConfig(128, 64, 2, ws=True, dq=True, prefetch=False,
                                           split=True, trans=True)]
                       for d in (64, 128)}
#: session 10 (helper "bm"): D=64 with query tiles of 128 rows ('wdkdvq128x128s2nht', FA3's
#: hdim-64 tile: S^T / dP^T [64 keys, 128 queries] a consumer); numbers: LOG "session 10,
#: the transposed backward with 128-row query tiles"
WS_DQT_BWD_VARIANTS[64] = WS_DQT_BWD_VARIANTS[64] + [
    HopperBwdConfig(128, 128, 2, ws=True, dq=True, prefetch=False, split=True, trans=True)]
#: session 11: the transposed consumers with the producer staging the queries' statistics
#: ('r', one copy for both consumers), D -> [64-row tiles (, 128-row at D=64)]
for _d in (64, 128):
    WS_DQT_BWD_VARIANTS[_d] = WS_DQT_BWD_VARIANTS[_d] + [
        dataclasses.replace(c, stats=True) for c in WS_DQT_BWD_VARIANTS[_d]]

#: session 11: 'nh' with the row statistics staged in shared memory by the producer ('r':
#: no global load on a consumer's tile path; the Nsight Compute profile of 'nh' at D=128
#: S=8k put ~9 % of the consumers' stall samples on those loads, the dP issue behind them)
#: and / or the dQ staging buffers swizzled at 32 bytes ('z': the profile counted 4-way
#: conflicts on the staging stores, 69 M excess wavefronts vs cuDNN's 1 M), D -> variants;
#: results bitwise those of 'nh'.  H200 2026-12-04 14:41 UTC (docs/perf/hopper-bwd-h200-
#: 2026-12-04-s11.json, 3 rotated rounds), route TFLOP/s at D=128 S=2k / 2k causal / 8k /
#: 8k causal: 'nhr' 469 / 393 / 505 / 492 vs 'nh' 424 / 372 / 463 / 460 (+6-11 %; faster
#: in every round but one outlier at 8k) and cuDNN 481 / 393 / 534 / 490 (0.95-1.00x):
#: routed at D=128 (_BWD).  'z' is SLOWER (380 / 337 / 401 / 398: four times the bulk
#: reduce-adds, 8 columns each, cost more than the conflicts they remove) and 'nhrz'
#: too; D=64 S=4k causal 'nhr' 331 vs 'nh' 336 (0.99x): D=64 keeps 'nh' 
WS_DQR_BWD_VARIANTS = {d: [dataclasses.replace(WS_DQS_BWD_VARIANTS[d][0], stats=True),
                           dataclasses.replace(WS_DQS_BWD_VARIANTS[d][0], dq_swizzle=32),
                           dataclasses.replace(WS_DQS_BWD_VARIANTS[d][0], stats=True,
                                               dq_swizzle=32)]
                       for d in (64, 128)}
#: D=64: 'nhr' with a third Q / dO stage (the producer's statistics loads a stage
#: further ahead; shared memory allows it at D=64 only)
WS_DQR_BWD_VARIANTS[64] = WS_DQR_BWD_VARIANTS[64] + [
    dataclasses.replace(WS_DQR_BWD_VARIANTS[64][0], stages=3)]
#: 'nhr' with the dQ products first ('q': dQ staged while dK runs), D -> (s2[, s3 at D=64])
for _d in (64, 128):
    WS_DQR_BWD_VARIANTS[_d] = WS_DQR_BWD_VARIANTS[_d] + [
        dataclasses.replace(c, dq_first=True) for c in WS_DQR_BWD_VARIANTS[_d]
        if c.stats and c.dq_swizzle == 128]

#: session 12: the routed dQ-inside configs with the staging rows interleaved ('i',
#: HopperBwdConfig.dq_interleave: a half-warp's 8-byte stores of the wgmma accumulator
#: in 4 distinct bank groups instead of 2, the bulk copies' 5-D box restoring the order),
#: D -> [the D=128 route 'nhr' + 'i', the D=64 route 'nhtr' (128-row tiles) + 'i'];
#: results bitwise those without it
WS_DQI_BWD_VARIANTS = {128: [dataclasses.replace(WS_DQR_BWD_VARIANTS[128][0],
                                                 dq_interleave=True)],
                       64: [dataclasses.replace(WS_DQT_BWD_VARIANTS[64][3],
                                                dq_interleave=True)]}
#: session 12: the no-add diagnostic of 'nhri' ran 595 vs 465 TFLOP/s at D=128 S=8k
#: (B=2 H=16; causal 566 vs 505; docs/perf/hopper-bwd-h200-2026-12-04-s12-diag.json):
#: the writer waited for each tile's adds to complete before taking the next tile.  'e'
#: (late_release) waits for them a tile later; D -> ['i' + 'e']
for _d in (64, 128):
    WS_DQI_BWD_VARIANTS[_d] = WS_DQI_BWD_VARIANTS[_d] + [
        dataclasses.replace(WS_DQI_BWD_VARIANTS[_d][0], late_release=True)]
#: session 12: at D=128 the 64-row transposed consumers ('nhtr', a tie with 'nhr' in
#: session 11) with 'i', and with 'i' + 'e'
WS_DQI_BWD_VARIANTS[128] = WS_DQI_BWD_VARIANTS[128] + [
    dataclasses.replace(WS_DQT_BWD_VARIANTS[128][1], dq_interleave=True),
    dataclasses.replace(WS_DQT_BWD_VARIANTS[128][1], dq_interleave=True, late_release=True)]

#: D -> the backward's config since session 8: the warp-specialised kernel with dQ
#: inside, one partial per key tile ('wdkdvq128x64s2nh'), routed at D=128 and, with a
#: band, at D=64 (coverage.py).  H200 2026-12-04 05:16 UTC (docs/perf/hopper-bwd-h200-
#: 2026-12-04-s8c.json, 3 rotated rounds, every round faster than every round of the
#: previous route): D=128 TFLOP/s 428 / 351 / 457 / 435 at S=2k / 2k causal / 8k / 8k
#: causal vs the previous route (ws dK/dV + portable dQ) 378 / 308 / 416 / 377 and cuDNN
#: 521 / 403 / 530 / 485; D=64 S=4k causal 322 vs 288 (portable 290), without a mask 305
#: vs 326, so D=64 without a band keeps the previous route.  Its programs wait for each
#: other's dQ turns: launch.backward_config keeps the previous route where a (batch, kv
#: head) has more key tiles than half the SMs (HopperBwdConfig.dq)
#: Session 11: D=128 runs 'nhr' ('nh' with the row statistics staged by the producer,
#: WS_DQR_BWD_VARIANTS above), the same results bit for bit, 6-11 % faster
#: Session 12: D=128 runs 'nhri' ('nhr' with the dQ staging rows interleaved,
#: WS_DQI_BWD_VARIANTS), the same results bit for bit: H200 2026-12-04 17:29 UTC
#: (docs/perf/hopper-bwd-h200-2026-12-04-s12.json, 3 rotated rounds, route TFLOP/s at
#: S=2k / 2k causal / 8k / 8k causal) 473 / 409 / 498 / 504 vs 'nhr' 457 / 394 / 501 /
#: 483 (faster in every round but at 8k without a mask, a tie) and cuDNN 484 / 395 / 535
#: / 489
_BWD = {64: _BWD_DKDV_ONLY[64], 128: WS_DQI_BWD_VARIANTS[128][0]}
#: (D, mask class) exceptions to _BWD.  Session 10 (helper "bm"): D=64 without a mask
#: runs the transposed consumers with 128-row query tiles ('wdkdvq128x128s2nht'): H200
#: 2026-12-04 12:40 UTC (docs/perf/hopper-bwd-h200-2026-12-04-s10-bm*.json, 3 rotated
#: rounds, every round faster), route TFLOP/s at S=2k / 4k / 8k (B=8 / 4 / 2, H=32)
#: 346 / 368 / 383 vs the portable backward 308 / 325 / 336 (the route 'auto' took
#: there), the ws dK/dV route 308 / 326 / 331, 'nht' 315 / 332 / 344, cuDNN 401 / 435 /
#: 434 (0.84-0.88x).  Causal it ties or loses to 'nh' at 2k / 4k (290 / 335 vs 293 /
#: 334; 8k 365 vs 333): the band keeps 'nh'
#: Session 11: D=64 with a band runs 'nhr' with three stages ('wdkdvq128x64s3nhr'): H200
#: 2026-12-04 14:47 UTC (docs/perf/hopper-bwd-h200-2026-12-04-s11-d64b.json, 3 rotated
#: rounds, every round faster), S=4k causal 347 vs 'nh' 335 (cuDNN 378); without a mask
#: it ties the 128-row 'nht' (373 vs 367, 1.01x): that route stays
#: Later in session 11: D=64 runs the transposed consumers with 128-row tiles and the
#: producer-staged statistics ('wdkdvq128x128s2nhtr', WS_DQT_BWD_VARIANTS[64][3]), with a
#: band or without: H200 2026-12-04 15:21 UTC (docs/perf/hopper-bwd-h200-2026-12-04-s11-
#: tr-d64.json, 3 rotated rounds, every round faster, bitwise 'nht''s results), S=4k 413
#: vs 'nht' 368, causal 363 vs 'nhr' s3 342 (cuDNN 428 / 375)
#: Session 12: D=64, band or not, runs 'nhtri' (the same with the dQ staging rows
#: interleaved, WS_DQI_BWD_VARIANTS; bitwise the same results): S=4k 434 / 396 TFLOP/s
#: without a mask / causal vs 'nhtr' 420 / 363, faster in every round (cuDNN 428 / 381;
#: docs/perf/hopper-bwd-h200-2026-12-04-s12-d64.json)
#: Session 12, without a mask: 'e' on top (the writer's late release, WS_DQI_BWD_VARIANTS
#: [d][1]; bitwise the same results): H200 2026-12-04 17:41 UTC (docs/perf/hopper-bwd-
#: h200-2026-12-04-s12-late*.json, 3 rotated rounds, route TFLOP/s) D=128 S=2k / 8k 491 /
#: 530 vs 'nhri' 483 / 496, D=64 S=4k 449 vs 'nhtri' 433, faster in every round (cuDNN
#: 492 / 541, 436).  With a band 'e' LOSES (D=128 2k / 8k causal 340 / 436 vs 412 / 508,
#: D=64 4k causal 378 vs 396: there the next adder of a query tile follows within a
#: tile, and the late release delays it): bands keep 'i' alone
_BWD_BY_MASK = {(64, "band"): WS_DQI_BWD_VARIANTS[64][0],
                (64, "none"): WS_DQI_BWD_VARIANTS[64][1],
                (128, "none"): WS_DQI_BWD_VARIANTS[128][1]}

#: backward variants the GPU tests check beside the defaults: the fused kernel with its
#: in-kernel dQ (deferred turn wait 'd', 312 / 257 / 324 / 300 at D=128, and without,
#: 300 / 258 / 309 / 297 on the whole backward's FLOPs; session 6), the fused kernel
#: without dQ (the D=128 default of sessions 5-6), the dK/dV kernel, and the other
#: warp-specialised configs (session 8: with dq too)
BWD_VARIANTS = {64: [HopperBwdConfig(128, 64, 2, fused=True, dq=True, defer=True),
                     HopperBwdConfig(128, 64, 2, fused=True),
                     HopperBwdConfig(128, 64, 2, fused=True, dq=True), _DKDV[64]]
                + WS_BWD_VARIANTS[64][1:] + WS_DQ_BWD_VARIANTS[64][1:2],
                128: [HopperBwdConfig(128, 64, 2, fused=True, dq=True, defer=True),
                      HopperBwdConfig(128, 64, 2, fused=True, dq=True), _DKDV[128],
                      HopperBwdConfig(128, 64, 2, fused=True)]
                + WS_BWD_VARIANTS[128][1:] + WS_DQ_BWD_VARIANTS[128][1:2]}

#: D -> the default before session 7 (the bench times it beside the new one)
PREV_BWD = {64: _DKDV[64], 128: HopperBwdConfig(128, 64, 2, fused=True)}


def bwd_config(d: int, mask_class: str = "band") -> HopperBwdConfig:
    """The backward's default config for head dim d and the call's mask class
    (Problem.mask_class)."""
    return _BWD_BY_MASK.get((d, mask_class)) or _BWD[d]


def bwd_config_dkdv_only(d: int) -> HopperBwdConfig:
    """The warp-specialised dK/dV config (dQ portable: no program waits for another),
    the backward's route where the dQ-inside config's waits are not safe."""
    return _BWD_DKDV_ONLY[d]


def dkdv_config(d: int) -> HopperBwdConfig:
    """The dK/dV kernel's default config for head dim d (bwd_kernel)."""
    return _DKDV[d]
