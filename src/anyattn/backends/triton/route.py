"""The Triton route: which kernels a call runs (the Hopper path or the portable one) and
with which config, decided by one function over plain data.

Shape legend: B batch, Hq / Hkv query / kv heads, Sq / Sk queries / keys, D head dim of
q and k, Dv of v (and out).

``route(problem, direction, device, env, plan)`` takes a :class:`ProblemFacts` (dtype,
head dims, mask class, score features, lengths, the tensors' TMA verdict), a
:class:`DeviceFacts` (device kind, compute capability, SM count, interpreter, Gluon)
and the settings (``anyattn.settings``), and returns a :class:`Route`: the path, the
config's name and object, and one line of reason per decision.  Nothing in it asks a
GPU, so it is tested as a table on the CPU (tests/triton/test_route.py) and printed by
``python -m anyattn info --route B,Hq,Hkv,Sq,Sk,D --dtype bf16 --mask causal --cc 9.0``.

The decisions, in order:

1. path: ANYATTN_TRITON_PATH=portable keeps the portable kernels; otherwise the Hopper
   path where hopper/coverage.py's table covers the call (its reason where not: e.g. a
   value head dim Dv != D, which only the portable kernels take) and,
   under 'auto', routes it by default; 'hopper' raises NotImplementedError where the
   table does not cover the call.  An explicit portable ``plan`` keeps the portable path.
2. config: Hopper forward: hopper/configs.fwd_config(D, mask class).  Hopper backward:
   hopper/configs.bwd_config(D, mask class) (dQ inside the kernel) while a (batch, kv
   head)'s key tiles fit in half the SMs, else the dK/dV-only config with the portable
   dQ: the dQ-inside kernel's programs wait for each other's add turns and need all key
   tiles of a (batch, kv head) resident, and half the SMs keeps that true while other
   streams' kernels (collectives) hold SMs too.  Portable (and the Hopper backward's
   portable preprocess / dQ): the explicit plan, else configs.plan_for of the larger
   padded head dim of D and Dv (the fixed test plan under TRITON_INTERPRET=1 or
   ANYATTN_TRITON_CONFIG=fixed).
Checked before both, for a forward: split-key decoding (``decode_splits``: few queries
over many keys and too few programs for the SMs) takes the portable split kernels
(kernels.fwd_split_kernel + fwd_combine_kernel) unless ANYATTN_TRITON_PATH=hopper or an
explicit plan asks otherwise; a decoding-sized forward (Sq <= DECODE_MAX_SQ) that stays
unsplit says why in its last reason line.
Checked before all of these: a head dim (D or Dv) above head_dims.MAX_HEAD_DIM runs only
the split kernel with q.k and the value columns in chunks (``_wide_route``,
configs.wide_decode_config; one split where decode_splits does not split), for what
head_dims.wide_refusal accepts (the decoding forward), NotImplementedError otherwise.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, Optional, Tuple

from ... import settings
from . import configs
from .head_dims import MAX_HEAD_DIM, wide_refusal
from .hopper import configs as hopper_configs
from .hopper import coverage

__all__ = ["ProblemFacts", "DeviceFacts", "Route", "route", "route_call", "paged_route", "device_facts",
           "wide", "split_config",
           "sm_count", "SM_COUNTS", "DIRECTIONS", "plan_name", "decode_splits",
           "decode_pack", "DECODE_MAX_SQ", "DECODE_MAX_ROWS", "DECODE_MIN_TILES",
           "DECODE_WAVES", "DECODE_MAX_SPLITS", "WIDE_FP32_MAX_ROWS", "NO_GPU_SMS",
           "SPLIT_FEATURES", "SPLIT_MASKS"]

DIRECTIONS = ("forward", "backward")


@dataclass(frozen=True)
class ProblemFacts:
    """What the route reads of a call.  ``features``: the score features present (names
    of hopper/coverage.FEATURES); ``layout``: why the tensors cannot be read through TMA
    (hopper/coverage.layout_reason), None where they can; ``head_dim_v``: v's head dim
    Dv (None: D, the same as q's and k's); ``capture_grads``: the backward sums a score
    function's capture gradients."""

    batch: int
    heads_q: int
    heads_kv: int
    seq_q: int
    seq_k: int
    head_dim: int
    dtype: str
    mask_class: str = "none"
    features: FrozenSet[str] = frozenset()
    precision: str = "highest"
    layout: Optional[str] = None
    head_dim_v: Optional[int] = None
    capture_grads: bool = False

    def __post_init__(self):
        unknown = set(self.features) - set(coverage.FEATURES)
        if unknown:
            raise ValueError(f"ProblemFacts.features: unknown {sorted(unknown)}; expected "
                             f"names of {coverage.FEATURES}")

    @property
    def value_dim(self) -> int:
        """Dv: v's head dim (D where head_dim_v is None)."""
        return self.head_dim if self.head_dim_v is None else self.head_dim_v

    @property
    def empty(self) -> bool:
        return 0 in (self.batch, self.heads_q, self.seq_q, self.seq_k)

    @classmethod
    def of(cls, p, tensors=()) -> "ProblemFacts":
        """The facts of Problem p; ``tensors``: the (name, tensor) pairs the Hopper
        kernels would read through TMA."""
        feats = frozenset(n for n, on in (("bias", p.has_bias),
                                          ("softcap", p.softcap is not None),
                                          ("alibi", p.has_alibi), ("sinks", p.has_sinks),
                                          ("dropout", p.has_dropout),
                                          ("score_mod", p.score_mod is not None),
                                          ("mask_mod", bool(p.mask.mask_fns))) if on)
        return cls(batch=p.batch, heads_q=p.heads_q, heads_kv=p.heads_kv, seq_q=p.seq_q,
                   seq_k=p.seq_k, head_dim=p.head_dim, dtype=p.dtype,
                   mask_class=p.mask_class, features=feats, precision=p.precision,
                   layout=coverage.layout_reason(tensors),
                   head_dim_v=None if p.head_dim_v == p.head_dim else p.head_dim_v,
                   capture_grads=bool(p.capture_wrt))


@dataclass(frozen=True)
class DeviceFacts:
    """What the route reads of the device: its kind ('cuda', 'cpu'), compute capability
    and SM count (CUDA), whether Triton interprets (TRITON_INTERPRET) and whether this
    Triton has Gluon (the Hopper kernels' language)."""

    kind: str
    capability: Optional[Tuple[int, int]] = None
    sm_count: Optional[int] = None
    interpreter: bool = False
    gluon: bool = True


@dataclass(frozen=True)
class Route:
    """One direction's route: ``path`` 'hopper' or 'portable'; ``config`` the name of the
    config that runs (``hopper``: the HopperConfig / HopperBwdConfig on the Hopper path;
    ``plan``: the portable plan, also on the Hopper backward for its portable preprocess
    and dQ; None on the Hopper forward); ``reasons``: one line per decision."""

    direction: str
    path: str
    config: str
    reasons: Tuple[str, ...]
    hopper: Any = None
    plan: Optional[configs.Plan] = None
    #: the split-key forward (portable): its number of key splits (1: unsplit) and tile
    splits: int = 1
    split: Optional[configs.KernelConfig] = None
    #: query heads of a kv head packed into one split program (GQA packing)
    pack: int = 1

    @property
    def hop(self) -> bool:
        return self.path == "hopper"

    def describe(self) -> str:
        return "\n".join([f"{self.direction}: {self.path} {self.config}"]
                         + [f"  {r}" for r in self.reasons])


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _kernel(c: configs.KernelConfig) -> str:
    chunks = f"d{c.dc}v{c.dvc}" if c.dc else ""
    return f"{c.bm}x{c.bn}w{c.num_warps}s{c.num_stages}{chunks}"


def plan_name(plan: configs.Plan, direction: str, captures: bool = False) -> str:
    """A portable plan's tiles in one word, BMxBN, warps and stages per kernel: e.g.
    'fwd128x128w8s3', 'dkdv64x128w8s1+dq128x64w8s1' (two backward launches) or
    'fused(dkdv64x128w8s3+dq128x64)' (one launch: dQ's tiles, dK/dV's warps and
    stages).  With ``captures`` (a score function's capture gradients) the backward is
    two launches, dK/dV with plan.dkdv_captures where set."""
    if direction == "forward":
        return f"fwd{_kernel(plan.fwd)}"
    if plan.fused_bwd and not captures:
        return f"fused(dkdv{_kernel(plan.dkdv)}+dq{plan.dq.bm}x{plan.dq.bn})"
    dkdv = (plan.dkdv_captures if captures else None) or plan.dkdv
    return f"dkdv{_kernel(dkdv)}+dq{_kernel(plan.dq)}"


def _plan_name(plan: configs.Plan, direction: str, problem: "ProblemFacts") -> str:
    return plan_name(plan, direction, problem.capture_grads)


def _portable_plan(problem: ProblemFacts, plan: Optional[configs.Plan]) -> Tuple[configs.Plan, str]:
    if plan is not None:
        return plan, "the explicit plan passed by the caller"
    dp = configs.padded_dim(max(problem.head_dim, problem.value_dim))
    got = configs.plan_for(dp, problem.dtype, problem.precision,
                     problem.mask_class, "bias" in problem.features,
                     max(problem.seq_q, problem.seq_k))
    if configs.use_fixed():
        why = "the fixed test plan (TRITON_INTERPRET=1 or ANYATTN_TRITON_CONFIG=fixed)"
    elif problem.value_dim != problem.head_dim:
        why = (f"configs.plan_for: padded max(D, Dv) {dp}, {problem.dtype}, mask class "
               f"{problem.mask_class}")
    else:
        why = (f"configs.plan_for: padded D {dp}, "
               f"{problem.dtype}, mask class {problem.mask_class}")
    if problem.dtype == "float32":
        why += "; fp32 as three products of scaled fp16 parts ('f16x3')"
    return got, why


# ----------------------------------------------------------------------------- split-key decoding
#: The split-key decoding rule's constants (decode_splits), in one place to retune: not
#: yet timed on a GPU.
#: queries per (batch, head) at most (decoding: one token, or a few speculative ones)
DECODE_MAX_SQ = 16
#: key tiles (of configs.decode_config's BN) each split keeps at least
DECODE_MIN_TILES = 4
#: the split grid aims at this many waves of the SMs
DECODE_WAVES = 2
#: splits at most (the combine reads every split's partial rows)
DECODE_MAX_SPLITS = 128
#: query rows (packed heads * Sq) of one split program at most
DECODE_MAX_ROWS = 64
#: ... for fp32 inputs above head_dims.MAX_HEAD_DIM (configs.wide_decode_config: 64 rows
#: of fp16 part pairs spill registers whatever the chunks)
WIDE_FP32_MAX_ROWS = 32
#: the SM count assumed where no GPU is asked (the interpreter, a CPU device)
NO_GPU_SMS = 8
#: the score features the split kernel takes (others keep fwd_kernel)
SPLIT_FEATURES = frozenset({"softcap", "alibi", "sinks"})
#: the mask classes it takes (in-kernel band ranges; the tile lists keep fwd_kernel)
SPLIT_MASKS = frozenset({"none", "band"})


def decode_pack(group: int, seq_q: int, most: int = DECODE_MAX_ROWS) -> int:
    """The query heads of a kv head one split program takes (GQA packing): the largest
    divisor HP of the group G with HP * Sq <= ``most`` rows (DECODE_MAX_ROWS; see
    _pack)."""
    return max(hp for hp in range(1, group + 1)
               if group % hp == 0 and hp * seq_q <= max(most, seq_q))


def _pack(problem: ProblemFacts) -> int:
    """decode_pack of a problem: at most WIDE_FP32_MAX_ROWS rows for fp32 inputs above
    MAX_HEAD_DIM, DECODE_MAX_ROWS otherwise."""
    most = (WIDE_FP32_MAX_ROWS if wide(problem) and problem.dtype == "float32"
            else DECODE_MAX_ROWS)
    return decode_pack(problem.heads_q // problem.heads_kv, problem.seq_q, most)


def wide(problem: ProblemFacts) -> bool:
    """Is a head dim (D or Dv) above head_dims.MAX_HEAD_DIM?  (Then only the split-key
    forward of decoding shapes runs the call: head_dims.wide_refusal.)"""
    return max(problem.head_dim, problem.value_dim) > MAX_HEAD_DIM


def split_config(problem: ProblemFacts, pack: int) -> configs.KernelConfig:
    """The split kernel's tile for ``pack`` query heads x Sq rows: configs.decode_config
    of the padded larger head dim, or above MAX_HEAD_DIM configs.wide_decode_config
    (q.k and the value columns in chunks)."""
    rows = pack * problem.seq_q
    if wide(problem):
        return configs.wide_decode_config(problem.value_dim, problem.dtype, rows)
    return configs.decode_config(configs.padded_dim(max(problem.head_dim, problem.value_dim)),
                                 problem.dtype, rows)


def decode_splits(problem: ProblemFacts, device: DeviceFacts
                  ) -> Tuple[int, Optional[configs.KernelConfig], int, str]:
    """(number of key splits NS, the split kernel's tile, the query heads packed per
    program HP, one line of reason) of a forward: NS = 1 (unsplit, fwd_kernel) unless
    the call is decoding-shaped, in the manner of FlashAttention's num_splits heuristic
    (with its GQA packing): Sq <= DECODE_MAX_SQ, the split kernel's grid without splits,
    B * Hkv * G / HP programs (HP query heads of a kv head share one program's key
    loads), is smaller than the device's SM count, and Sk holds at least 2 *
    DECODE_MIN_TILES key tiles; then NS fills about DECODE_WAVES waves of SMs with every
    split keeping >= DECODE_MIN_TILES tiles (at most DECODE_MAX_SPLITS)."""
    if problem.empty:
        return 1, None, 1, "split: no (an empty problem)"
    extra = sorted(set(problem.features) - SPLIT_FEATURES)
    if extra:
        return 1, None, 1, f"split: no (the split kernel lacks {', '.join(extra)})"
    if problem.mask_class not in SPLIT_MASKS:
        return 1, None, 1, (f"split: no (mask class {problem.mask_class}: tile lists, "
                            "which only the unsplit kernel reads)")
    if problem.seq_q > DECODE_MAX_SQ:
        return 1, None, 1, f"split: no (Sq {problem.seq_q} > {DECODE_MAX_SQ} queries)"
    group = problem.heads_q // problem.heads_kv
    hp = _pack(problem)
    cfg = split_config(problem, hp)
    if device.sm_count is not None:
        sms, where = device.sm_count, "SMs"
    else:
        sms, where = NO_GPU_SMS, "SMs (NO_GPU_SMS: no GPU asked)"
    programs = problem.batch * problem.heads_kv * (group // hp)
    grid = f"B*Hkv*G/HP = {programs} programs ({hp} query heads x Sq {problem.seq_q} rows each)"
    if programs >= sms:
        return 1, None, hp, f"split: no ({grid} fill {sms} {where})"
    tiles = _cdiv(problem.seq_k, cfg.bn)
    most = min(tiles // DECODE_MIN_TILES, DECODE_MAX_SPLITS)
    if most < 2:
        return 1, None, hp, (f"split: no (Sk {problem.seq_k}: {tiles} key tiles of {cfg.bn}, "
                             f"fewer than 2 splits of >= {DECODE_MIN_TILES})")
    ns = min(_cdiv(DECODE_WAVES * sms, programs), most)
    return ns, cfg, hp, (f"split: {ns} key splits ({grid} < {sms} {where}; "
                         f"~{DECODE_WAVES} waves, >= {DECODE_MIN_TILES} key tiles of "
                         f"{cfg.bn} per split; {tiles} tiles)")


def paged_route(problem: ProblemFacts, device: DeviceFacts) -> Route:
    """The route of a forward over a paged cache (anyattn.paged; seq_k the longest
    sequence's key count): always the portable split kernel (the one kernel that reads
    pages), with decode_splits' splits where it splits and one split (the unsplit
    forward, no combine of partials beyond the epilogue) where it does not; its tile and
    head packing as decode_splits'.  NotImplementedError for what the split kernel
    does not take: Sq > DECODE_MAX_SQ, score features beyond SPLIT_FEATURES."""
    if problem.seq_q > DECODE_MAX_SQ:
        raise NotImplementedError(
            f"pages: the Triton backend reads a paged cache with at most {DECODE_MAX_SQ} "
            f"queries per sequence (the split-key decode kernel), got Sq = "
            f"{problem.seq_q}; split the queries into chunks of <= {DECODE_MAX_SQ} or use "
            "backend='numpy'")
    extra = sorted(set(problem.features) - SPLIT_FEATURES)
    if extra:
        raise NotImplementedError(f"pages: the Triton backend's paged forward lacks "
                                  f"{', '.join(extra)}; use backend='numpy'")
    ns, cfg, hp, why = decode_splits(problem, device)
    if ns == 1:
        hp = _pack(problem)
        cfg = split_config(problem, hp)
    name = f"paged-split{_kernel(cfg)}x{ns}"
    return Route("forward", "portable", name,
                 ("path: portable split-key forward over pages (the kernel that reads a "
                  "paged cache)", f"config: {name} = configs.decode_config (rows {hp} x "
                  f"Sq {problem.seq_q}) x {ns} splits", why),
                 splits=ns, split=cfg, pack=hp)


def route(problem: ProblemFacts, direction: str, device: DeviceFacts,
          env: Optional[settings.Settings] = None, plan: Optional[configs.Plan] = None) -> Route:
    """The route of one direction of a call (module doc).  ``env``: the settings
    (default: settings.current()); ``plan``: an explicit portable plan (None: the
    heuristic one).  NotImplementedError under ANYATTN_TRITON_PATH=hopper where the
    Hopper path does not cover the call."""
    if direction not in DIRECTIONS:
        raise ValueError(f"direction {direction!r}: expected one of {DIRECTIONS}")
    env = settings.current() if env is None else env
    setting = env.triton_path
    if wide(problem):
        return _wide_route(problem, direction, device, setting, plan)
    no_split = None    # why a decoding-sized forward (Sq <= DECODE_MAX_SQ) is unsplit
    if direction == "forward" and problem.seq_q <= DECODE_MAX_SQ:
        if setting == "hopper":
            no_split = "split: no (ANYATTN_TRITON_PATH=hopper)"
        elif plan is not None:
            no_split = "split: no (an explicit plan names the unsplit kernel's tiles)"
        else:
            ns, cfg, hp, no_split = decode_splits(problem, device)
            if ns > 1:
                portable, _ = _portable_plan(problem, None)
                name = f"split{_kernel(cfg)}x{ns}"
                return Route(direction, "portable", name,
                             (f"path: portable split-key forward (ANYATTN_TRITON_PATH="
                              f"{setting}; decoding-shaped)",
                              f"config: {name} = configs.decode_config (rows {hp} x Sq "
                              f"{problem.seq_q}) x {ns} splits", no_split),
                             plan=portable, splits=ns, split=cfg, pack=hp)
    reasons = []
    hop = False
    if setting == "portable":
        reasons.append("path: portable (ANYATTN_TRITON_PATH=portable)")
    else:
        why = coverage.uncovered(problem, direction, device)
        if setting == "hopper":
            why = why or ("an explicit portable plan was passed" if plan is not None
                          else None)
            if why is not None:
                raise NotImplementedError(
                    f"ANYATTN_TRITON_PATH=hopper: the Hopper {direction} path does not "
                    f"cover this call: {why}; unset it (or set 'auto' / 'portable') for "
                    f"the portable kernels")
            hop = True
            reasons.append("path: hopper (ANYATTN_TRITON_PATH=hopper; covered)")
        elif why is not None:
            reasons.append(f"path: portable (not covered by the Hopper path: {why})")
        elif plan is not None:
            reasons.append("path: portable (an explicit portable plan was passed)")
        elif (held := coverage.auto_reason(direction, problem.mask_class, problem.head_dim,
                                           problem.features)) is not None:
            reasons.append(f"path: portable (covered, but 'auto' does not route {held}: "
                           "hopper/coverage.py; ANYATTN_TRITON_PATH=hopper takes it)")
        else:
            hop = True
            reasons.append("path: hopper (ANYATTN_TRITON_PATH=auto; covered and routed "
                           "by default)")
    if hop and direction == "forward":
        cfg = hopper_configs.fwd_config(problem.head_dim, problem.mask_class)
        reasons.append(f"config: {cfg.name} = hopper/configs.fwd_config({problem.head_dim}, "
                       f"{problem.mask_class!r})")
        reasons += [no_split] if no_split else []
        return Route(direction, "hopper", cfg.name, tuple(reasons), hopper=cfg)
    portable, why_plan = _portable_plan(problem, plan)
    if not hop:
        name = _plan_name(portable, direction, problem)
        reasons.append(f"config: {name} = {why_plan}")
        reasons += [no_split] if no_split else []
        return Route(direction, "portable", name, tuple(reasons), plan=portable)
    cfg = hopper_configs.bwd_config(problem.head_dim, problem.mask_class, problem.features)
    tiles = _cdiv(problem.seq_k, cfg.bn)
    if device.sm_count is None:
        raise ValueError("DeviceFacts.sm_count: the Hopper backward's config needs the "
                         "device's SM count")
    if tiles > device.sm_count // 2:
        cfg = hopper_configs.bwd_config_dkdv_only(problem.head_dim)
        reasons.append(f"config: {cfg.name}, dQ portable ({_plan_name(portable, direction, problem)}"
                       f"): {tiles} key tiles per (batch, kv head) > {device.sm_count} SMs "
                       "// 2")
    else:
        feats = f", {sorted(problem.features)}" if problem.features else ""
        reasons.append(f"config: {cfg.name} = hopper/configs.bwd_config({problem.head_dim}, "
                       f"{problem.mask_class!r}{feats}), dQ inside: {tiles} key tiles per "
                       f"(batch, kv head) <= {device.sm_count} SMs // 2")
    return Route(direction, "hopper", cfg.name, tuple(reasons), hopper=cfg, plan=portable)


def _wide_route(problem: ProblemFacts, direction: str, device: DeviceFacts, setting: str,
                plan: Optional[configs.Plan]) -> Route:
    """The route of a call with a head dim above MAX_HEAD_DIM: the split-key forward
    (decode_splits' splits, one where it does not split, as paged_route), its q.k and
    value columns in chunks (configs.wide_decode_config).  NotImplementedError for what
    head_dims.wide_refusal refuses (the backend's capability check says it first), for
    ANYATTN_TRITON_PATH=hopper and for an explicit plan (the unsplit kernel's tiles)."""
    why = wide_refusal(problem.head_dim, problem.value_dim, problem.seq_q,
                       direction == "backward", problem.mask_class, problem.features)
    if why is not None:
        raise NotImplementedError(f"the Triton backend {why}")
    if setting == "hopper":
        raise NotImplementedError(
            f"ANYATTN_TRITON_PATH=hopper: the Hopper forward path does not cover head dims "
            f"above {MAX_HEAD_DIM} (D = {problem.head_dim}, Dv = {problem.value_dim}); "
            "unset it (or set 'auto' / 'portable') for the portable split-key forward")
    if plan is not None:
        raise NotImplementedError(
            f"plan: an explicit plan names the unsplit kernel's tiles, which take head dims "
            f"<= {MAX_HEAD_DIM} (D = {problem.head_dim}, Dv = {problem.value_dim}); pass "
            "plan=None for the split-key forward of wide head dims")
    ns, cfg, hp, why = decode_splits(problem, device)
    if ns == 1:
        hp = _pack(problem)
        cfg = split_config(problem, hp)
    name = f"wide-split{_kernel(cfg)}x{ns}"
    return Route(direction, "portable", name,
                 (f"path: portable split-key forward (head dims D = {problem.head_dim}, "
                  f"Dv = {problem.value_dim} above {MAX_HEAD_DIM}: q.k in chunks of "
                  f"{cfg.dc}, the value columns in chunks of {cfg.dvc} per program)",
                  f"config: {name} = configs.wide_decode_config (rows {hp} x Sq "
                  f"{problem.seq_q}) x {ns} splits", why),
                 splits=ns, split=cfg, pack=hp)


# ----------------------------------------------------------------------------- facts of a device
#: device name -> SM count (asked once per device)
SM_COUNTS: Dict[str, int] = {}


def sm_count(device: str) -> int:
    """The CUDA device's SM count (cached per device name)."""
    if device not in SM_COUNTS:
        import torch

        SM_COUNTS[device] = int(torch.cuda.get_device_properties(device).multi_processor_count)
    return SM_COUNTS[device]


@functools.lru_cache(maxsize=None)
def _capability(device: str) -> Tuple[int, int]:
    import torch

    return tuple(torch.cuda.get_device_capability(device))


@functools.lru_cache(maxsize=None)
def _has_gluon() -> bool:
    try:
        from triton.experimental.gluon.language.nvidia import hopper  # noqa: F401
    except ImportError:
        return False
    return True


def device_facts(device, env: Optional[settings.Settings] = None) -> DeviceFacts:
    """The facts of a torch device (a CUDA device is asked its capability and SM count
    once; a CPU device and the interpreter are asked nothing)."""
    env = settings.current() if env is None else env
    kind = getattr(device, "type", str(device).split(":")[0])
    if kind != "cuda" or env.triton_interpret:
        return DeviceFacts(kind=kind, interpreter=env.triton_interpret)
    name = str(device)
    if not _has_gluon():
        return DeviceFacts(kind=kind, sm_count=sm_count(name), gluon=False)
    return DeviceFacts(kind=kind, capability=_capability(name), sm_count=sm_count(name))


def route_call(p, direction: str, plan: Optional[configs.Plan] = None, tensors=()) -> Route:
    """The route of one call of Problem p (the launch code's entry): its facts, its
    device's facts and the settings in effect, through route()."""
    env = settings.current()
    if env.triton_path == "portable":   # nothing of the tensors is read; of the device
        facts = ProblemFacts.of(p)      # only the SM count of a decoding-sized forward
        kind = getattr(p.device, "type", str(p.device).split(":")[0])
        sms = None
        if (direction == "forward" and p.seq_q <= DECODE_MAX_SQ and kind == "cuda"
                and not env.triton_interpret):
            sms = sm_count(str(p.device))
        return route(facts, direction, DeviceFacts(kind="unasked", sm_count=sms), env, plan)
    return route(ProblemFacts.of(p, tensors), direction, device_facts(p.device, env), env,
                 plan)
