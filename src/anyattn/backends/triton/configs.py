"""Tile configurations for the Triton kernels: frozen dataclasses, a heuristic table
(_PLANS), an optional autotuner (cached per key), and a fixed small plan for tests.

Key of a plan: (padded head dim DP, dtype, mask class, bias?, length bucket).
``ANYATTN_TRITON_CONFIG=fixed`` (or ``TRITON_INTERPRET=1``) selects the fixed test
plan; ``ANYATTN_TRITON_AUTOTUNE=1`` times the candidates of each kernel once per key on
the first call and caches the fastest.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from ... import settings

__all__ = ["KernelConfig", "Plan", "plan_for", "fixed_plan", "autotune_enabled",
           "tune", "candidates", "fused_candidates", "padded_dim", "length_bucket",
           "overrides_version", "use_fixed", "softcap_mode", "decode_config", "COMBINE_BM",
           "wide_decode_config", "wide_grid", "wide_kw", "WIDE_DC"]


@dataclass(frozen=True)
class KernelConfig:
    """One kernel's launch shape: query tile bm, key tile bn, warps, pipeline stages;
    for the split-key forward of head dims above 256 (wide_decode_config) also the
    chunks dc of D that q.k sums over and dvc of Dv that one program accumulates (0:
    whole head dims, the kernels of D <= 256)."""

    bm: int
    bn: int
    num_warps: int = 4
    num_stages: int = 2
    dc: int = 0
    dvc: int = 0


@dataclass(frozen=True)
class Plan:
    """Every kernel's config for one problem class, plus the mask-block size of the
    tile lists (sbq x sbk, multiples of every bm / bn) and whether the backward runs
    dK/dV and dQ in one launch."""

    fwd: KernelConfig
    dkdv: KernelConfig
    dq: KernelConfig
    dbias: KernelConfig
    pre_bm: int = 64
    sbq: int = 128
    sbk: int = 128
    fused_bwd: bool = True      # dK/dV and dQ in one launch (dkdv's warps / stages)
    #: dK/dV's config where it also sums a score function's capture gradients (None:
    #: dkdv's): the slot sums add registers to the dK / dV accumulators
    dkdv_captures: Optional[KernelConfig] = None

    def check(self) -> "Plan":
        for c in (self.fwd, self.dq):
            assert self.sbq % c.bm == 0 and self.sbk % c.bn == 0, (self, c)
        for c in (self.dkdv, self.dkdv_captures or self.dkdv):
            assert self.sbq % c.bm == 0 and self.sbk % c.bn == 0, (self, c)
        return self


def padded_dim(d: int) -> int:
    """Head dim padded to a power of two, at least 16 (tl.dot's minimum)."""
    dp = 16
    while dp < d:
        dp *= 2
    return dp


def length_bucket(s: int) -> int:
    b = 128
    while b < s and b < 16384:
        b *= 2
    return b


def fixed_plan(fused_bwd: bool = True) -> Plan:
    """Small tiles for the interpreter and tests: several tiles even at S ~ 40, and
    mask blocks (32) larger than the tiles (16) so sub-tiling is exercised.
    ``fused_bwd=False``: the two-launch backward (dK/dV, then dQ) that the heuristic
    plans take at D <= 64 and for fp32 inputs."""
    return Plan(fwd=KernelConfig(32, 16, 4, 1), dkdv=KernelConfig(16, 32, 4, 1),
                dq=KernelConfig(32, 16, 4, 1), dbias=KernelConfig(16, 16, 4, 1),
                pre_bm=32, sbq=32, sbk=32, fused_bwd=fused_bwd).check()


def use_fixed() -> bool:
    env = settings.current()
    return env.triton_config == "fixed" or env.triton_interpret


def autotune_enabled() -> bool:
    return settings.current().triton_autotune and not use_fixed()


#: input dtypes whose softcap may use the hardware tanh.approx.f32 (max rel. error ~2^-11,
#: inside their 3e-3 / 2e-2 tolerances); fp32 keeps the fp32-accurate exp-based tanh
FAST_TANH_DTYPES = ("float16", "bfloat16")
FAST_TANH_MIN_CC = (7, 5)        # tanh.approx.f32: sm_75 and later


def softcap_mode(dtype: str, device) -> int:
    """The kernels' SOFTCAP constexpr for a softcap problem: 2 (tanh.approx.f32, one MUFU
    op) for 16-bit inputs on a CUDA device of compute capability >= 7.5, else 1 (the
    portable tanh of kernels._tanh_d: fp32 inputs, the interpreter, which cannot run
    inline PTX)."""
    if dtype not in FAST_TANH_DTYPES:
        return 1
    if settings.current().triton_interpret or getattr(device, "type", "cuda") != "cuda":
        return 1
    import torch

    return 2 if torch.cuda.get_device_capability(device) >= FAST_TANH_MIN_CC else 1


_plan_cache: Dict[tuple, Plan] = {}


def plan_for(dp: int, dtype: str, precision: str, mask_class: str, has_bias: bool,
             seq: int) -> Plan:
    """The heuristic plan for a problem class (the tiles that ran fastest on Hopper GPUs),
    memoised on its arguments, the settings (one settings.snapshot, a superset of what
    it reads) and the overrides' version (Plans are frozen).  ``precision`` selects the
    overrides of set_override only: 'highest' and 'tf32' multiply fp32 alike."""
    key = (dp, dtype, precision, mask_class, has_bias, seq, settings.snapshot(),
           _overrides_version)
    plan = _plan_cache.get(key)
    if plan is None:
        if len(_plan_cache) > 256:
            _plan_cache.clear()
        plan = _plan_cache[key] = _plan_for(dp, dtype, precision, mask_class, has_bias, seq)
    return plan


_K = KernelConfig
#: (padded head dim, fp32 inputs?) -> the heuristic plan: the tiles (BM x BN, warps,
#: stages of fwd, dK/dV, dQ, dBias) that ran fastest on Hopper GPUs.  fp32 inputs multiply
#: as three products of scaled fp16 parts (operands.py): 8-warp tiles, two backward
#: launches; 16-bit inputs fuse the backward into one launch above D=64.
_PLANS: Dict[Tuple[int, bool], Plan] = {
    # padded D 16 / 32
    (32, False): Plan(_K(64, 64, 4, 3), _K(64, 128, 8, 3), _K(128, 64, 4, 3), _K(64, 64, 4, 2),
                      fused_bwd=False),
    # D=64 exactly: a 128-row forward tile and a 64x64 dK/dV tile beat the wider ones
    (64, False): Plan(_K(128, 64, 8, 3), _K(64, 64, 4, 3), _K(128, 64, 4, 3), _K(64, 64, 4, 2),
                      fused_bwd=False),
    # capture gradients: 32-row query tiles (64 rows spill ~700 stores per dK/dV kernel
    # on sm_90 for a relative-position table; 32 rows none: bench/lab/gallery_sm90.py)
    (128, False): Plan(_K(128, 128, 8, 3), _K(64, 128, 8, 3), _K(128, 64, 8, 3),
                       _K(128, 64, 8, 2), dkdv_captures=_K(32, 128, 8, 3)),
    (256, False): Plan(_K(64, 64, 8, 2), _K(32, 64, 8, 2), _K(64, 32, 8, 2), _K(32, 32, 4, 2)),
    (64, True): Plan(_K(128, 64, 8, 2), _K(64, 128, 8, 2), _K(64, 64, 4, 2), _K(64, 64, 4, 2),
                     fused_bwd=False),
    # capture gradients of fp32 inputs: 32 query rows halve dK/dV's spills (~1000 -> ~480
    # stores offline, about the plain fp32 dK/dV's)
    (128, True): Plan(_K(128, 64, 8, 2), _K(64, 128, 8, 1), _K(128, 64, 8, 1),
                      _K(64, 64, 4, 2), fused_bwd=False, dkdv_captures=_K(32, 128, 8, 1)),
    (256, True): Plan(_K(32, 32, 4, 1), _K(16, 32, 4, 1), _K(32, 16, 4, 1), _K(32, 32, 4, 1),
                      fused_bwd=False),
}


def _plan_for(dp: int, dtype: str, precision: str, mask_class: str, has_bias: bool,
              seq: int) -> Plan:
    if use_fixed():
        return fixed_plan()
    wide = dtype == "float32"
    p = _PLANS[(32 if dp < 64 and not wide else max(dp, 64), wide)]   # fp32 D<64: D=64's
    override = _overrides.get((dp, dtype, precision))
    if override is not None:
        p = replace(p, **override)
    return p.check()


def decode_config(dp: int, dtype: str, rows: int) -> KernelConfig:
    """The split-key forward's tile (kernels.fwd_split_kernel; route.decode_splits picks
    the number of splits and the query heads packed per program): ``rows`` = packed
    heads * Sq query rows padded to a power of two >= 16 (tl.dot's least), a key tile of
    16 under the fixed test plan (several splits at tiny Sk) and of 64 on a GPU (32 for
    fp32 and D > 128).  Chosen from the kernel's shape, not yet timed on a GPU."""
    bm = 16
    while bm < rows:
        bm *= 2
    if use_fixed():
        return KernelConfig(bm, 16, 4, 1)
    if dp > 128 or dtype == "float32":
        return KernelConfig(bm, 32, 4, 2)
    return KernelConfig(bm, 64, 4, 3)


#: the chunk of D that q.k of a wide head dim sums over (a multiple of the MMA's K; 64
#: divides the common wide dims 320, 512 and 576, so no chunk is padding)
WIDE_DC = 64


def wide_decode_config(dv: int, dtype: str, rows: int) -> KernelConfig:
    """The split-key forward's tile for head dims above 256 (D or Dv; head_dims.py's
    MAX_HEAD_DIM and wide_refusal decide which calls take it): ``rows`` = packed heads
    * Sq padded to a power of two >= 16 (route.decode_pack: at most 64, 32 for fp32
    inputs), q.k summed over chunks of WIDE_DC columns of D, and the value columns
    split over programs in chunks of dvc (grid axis 2), so that a program holds a
    [BM, dvc] fp32 accumulator, a [BM, BN] score tile, a [BM, WIDE_DC] query chunk and
    a [WIDE_DC, BN] key chunk whatever D and Dv are.  Each value chunk's program
    recomputes the scores, so fewer, wider chunks trade registers for compute.  A key
    tile of 32 (16 under the fixed test plan), 4 warps at 16 rows and 8 above; 16-bit
    inputs: dvc 128 up to 32 rows, 64 at 64 rows, 2 stages; fp32 (three products of
    fp16 parts, twice the operands): dvc 64, 1 stage.  Chosen as the
    widest chunks whose sm_90a compiles spill nothing and fit the shared memory
    (bench/lab/wide_decode_offline.py --sweep); not yet timed on a GPU."""
    bm = 16
    while bm < rows:
        bm *= 2
    warps = 4 if bm <= 16 else 8
    if dtype == "float32":
        dvc, stages = 64, 1
    else:
        dvc, stages = (128 if bm <= 32 else 64), 2
    dvc = min(dvc, padded_dim(dv))
    if use_fixed():
        return KernelConfig(bm, 16, 4, 1, dc=WIDE_DC, dvc=dvc)
    return KernelConfig(bm, 32, warps, stages, dc=WIDE_DC, dvc=dvc)


def wide_grid(cfg: KernelConfig, dv: int) -> tuple:
    """The split kernel's third grid axis under a wide_decode_config, the cdiv(Dv, dvc)
    value chunks; () for the tiles of D <= 256 (a two-axis grid)."""
    return (-(-dv // cfg.dvc),) if cfg.dc else ()


def wide_kw(cfg: KernelConfig) -> dict:
    """The split kernel's chunk constexprs DC / DVC under a wide_decode_config; none for
    the tiles of D <= 256 (their launches and compiles stay as they were)."""
    return dict(DC=cfg.dc, DVC=cfg.dvc) if cfg.dc else {}


#: rows per program of the split forward's combine (kernels.fwd_combine_kernel)
COMBINE_BM = 16


#: (dp, dtype, precision) -> dict of Plan fields; set by set_override
_overrides: Dict[Tuple[int, str, str], dict] = {}
_overrides_version = 0


def set_override(dp: int, dtype: str, precision: str, **fields) -> None:
    """Replace plan fields for a class; no fields: drop its override.  A bench / test
    hook, not API: the GPU benches time other tiles through it; overrides_version is part
    of a prepared launch's key, so an override reaches the next call."""
    global _overrides_version
    if fields:
        _overrides[(dp, dtype, precision)] = fields
    else:
        _overrides.pop((dp, dtype, precision), None)
    _overrides_version += 1


def overrides_version() -> int:
    """A number that changes with every set_override (part of a prepared launch's key)."""
    return _overrides_version


def candidates(kernel: str, dp: int, dtype: str) -> List[KernelConfig]:
    """Configs the autotuner tries for one kernel (all tiles divide 128)."""
    wide = dtype == "float32"
    if kernel == "fwd":
        tiles = ([(128, 64), (128, 128), (64, 64)] if not wide
                 else [(64, 64), (128, 32), (64, 32), (128, 64)])
    elif kernel == "dkdv":
        tiles = ([(64, 128), (32, 128), (64, 64)] if not wide
                 else [(32, 64), (32, 128), (64, 64), (64, 128)])
    else:
        tiles = ([(128, 64), (128, 32), (64, 64)] if not wide
                 else [(64, 32), (64, 64), (64, 16), (128, 64)])
    if dp > 128:
        tiles = [(max(16, a // 2), max(16, b // 2)) for a, b in tiles]
    out = []
    for bm, bn in tiles:
        for w, s in ((8, 3), (4, 3), (8, 2)) if not wide else ((4, 2), (8, 2), (8, 1)):
            out.append(KernelConfig(bm, bn, w, s))
    return out


def fused_candidates(dp: int, dtype: str) -> List[Tuple[KernelConfig, KernelConfig]]:
    """(dK/dV, dQ) config pairs the autotuner tries for the fused backward launch
    (the pair shares the first config's warps and stages)."""
    out = []
    for a in candidates("dkdv", dp, dtype):
        for b in candidates("dq", dp, dtype):
            if (b.num_warps, b.num_stages) == (a.num_warps, a.num_stages):
                out.append((a, b))
    return out


_tuned: Dict[tuple, object] = {}


def tune(key: tuple, cands: Sequence[KernelConfig],
         run: Callable[[KernelConfig], Callable[[], None]],
         timer: Optional[Callable[[Callable[[], None]], float]] = None) -> KernelConfig:
    """The fastest config of ``cands`` for ``key`` (timed once, then cached).
    ``run(cfg)`` returns a zero-argument launch; configs that fail (e.g. out of shared
    memory) are skipped.  ``timer(fn) -> ms`` defaults to triton.testing.do_bench."""
    if key in _tuned:
        return _tuned[key]
    if timer is None:
        import triton.testing

        def timer(fn):
            return triton.testing.do_bench(fn, warmup=5, rep=20, return_mode="median")

    best, best_t = None, float("inf")
    for c in cands:
        try:
            fn = run(c)
            fn()
            t = timer(fn)
        except Exception:  # noqa: BLE001 - out of resources etc.: not a candidate
            continue
        if t < best_t:
            best, best_t = c, t
    if best is None:
        raise RuntimeError(f"triton autotune: no candidate config ran for {key}")
    _tuned[key] = best
    return best
