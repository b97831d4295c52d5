"""The operands of the portable kernels besides the mask: layouts (unit stride along D),
the fp32 product scheme (scaled fp16 parts split once per call, their scale tables) and
the score modifiers' arguments (softcap, ALiBi, sinks, dropout words).

Shape legend: B batch, H = Hq query heads, Hkv kv heads, Sq / Sk queries / keys, D head
dim.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from ... import settings
from ...dropout import keep_scale, threshold
from ...modifiers import NO_MODS, ScoreMods, alibi_diag
from . import configs, kernels, mask_inputs, tiles
from .device_ctx import on_device
from .tiles import cdiv

__all__ = ["unit_last", "s3", "SCALED", "kernel_prec", "register_prec", "f16_scales",
           "forward_operands", "f16_scales_paged", "split_half", "SIGMA_EXP", "GAMMA_EXP",
           "ModArgs", "mod_args", "interpreter_compat"]


def interpreter_compat() -> None:
    """Triton 3.6's interpreter converts scalar tensors (1-element arrays) to loop
    bounds with int(array), which NumPy >= 2.4 refuses for 1-D arrays; convert
    through .item() instead.  Only under TRITON_INTERPRET=1; idempotent."""
    if not settings.current().triton_interpret:
        return
    from triton.runtime import interpreter

    if getattr(interpreter._patch_lang_tensor, "_anyattn_compat", False):
        return
    orig = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__",
                       lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._anyattn_compat = True
    interpreter._patch_lang_tensor = patched


interpreter_compat()


def unit_last(x):
    """x with stride 1 along its last dim (a copy only when it is not)."""
    if x is None or x.shape[-1] <= 1 or x.stride(-1) == 1:
        return x
    return x.contiguous()


#: the kernels' PREC of fp32 inputs (both precisions): q, k, v, dout scaled by powers of
#: two and stored as fp16 parts (hi, lo) side by side, three fp16 products per product
#: (kernels.py doc); 16-bit inputs multiply as they are (PREC 'tf32', unused there)
SCALED = "hsplit3"


def kernel_prec(p) -> str:
    """The PREC of the forward / backward kernels for a problem."""
    return SCALED if p.dtype == "float32" else "tf32"


def register_prec(p) -> str:
    """The PREC of the kernel that takes fp32 tiles (the broadcast dbias reduction):
    six bf16 products of the tiles split in registers for fp32 inputs."""
    return "bf16x6" if p.dtype == "float32" else "tf32"


def _row_stats(x):
    """Per row of x [B, H, S, D], over its finite entries: (max |x|, Euclidean norm), each
    [B, H, S] float64 (kernels.row_stats_kernel; float64 so that huge rows do not overflow)."""
    B, H, S, D = x.shape
    amax = torch.empty((B, H, S), dtype=torch.float32, device=x.device)
    rsq = torch.empty((B, H, S), dtype=torch.float32, device=x.device)
    bm = 32
    kernels.row_stats_kernel[(cdiv(S, bm), B * H)](x, amax, rsq, *s3(x), H, S, D=D,
                                                     DP=configs.padded_dim(D), BM=bm)
    amax = amax.double()
    return amax, amax * rsq.double().sqrt()


def _group_max(t, B, Hkv):
    """[B, H, S] -> [B * Hkv]: the max over each kv head's query-head group and S
    (0 where that is empty)."""
    t = t.reshape(B * Hkv, -1)
    if t.shape[1] == 0:
        return torch.zeros(B * Hkv, dtype=t.dtype, device=t.device)
    return t.amax(dim=1)


#: |x * sigma| <= 2^SIGMA_EXP for every operand part; |dS * gamma| <= 2^GAMMA_EXP when p <= 1
SIGMA_EXP = 14


GAMMA_EXP = 10


def _pow2_scale(m, target_exp: int):
    """float64 m >= 0 -> the power of two 2^(target_exp - e) with m <= 2^e (m = 0 ->
    2^target_exp); e is clamped so that the scale is a normal fp32 (m below that range
    keeps fewer bits, as fp32 subnormals do)."""
    _, e = torch.frexp(m)
    e = torch.where(m > 0, e, torch.zeros_like(e)).clamp(target_exp - 126, target_exp + 126)
    return torch.ldexp(torch.ones_like(m), (target_exp - e).to(m.dtype))


def forward_operands(p, q, k, v, prec, sc):
    """A forward's (q, k, v, SC): under the scaled-fp16 scheme (``prec`` SCALED) the
    split fp16 parts of q, k, v and their scale table (:func:`f16_scales`); else the
    inputs and the prepared ``sc``."""
    if prec != SCALED:
        return q, k, v, sc
    sc, sig = f16_scales(p, q, k, v)
    q, k, v = (split_half(x, sig[n], g)
               for x, n, g in ((q, "q", p.group), (k, "k", 1), (v, "v", 1)))
    return q, k, v, sc


def f16_scales(p, q, k, v, dout=None, delta=None):
    """Scales of the scaled-fp16 schemes, all powers of two, per (batch, kv head):
    sigma of q, k, v, dout (from the finite max |x| over the kv head's group), gamma of
    dS (from max_i |dout_i| * max_j |v_j| + max |delta|, row norms; the bound of |dS|
    when p <= 1) and the table SC [B * Hkv, 8] fp32 of the factors the kernels apply
    (kernels.py doc), computed in float64.  Everything stays on the device (no host
    synchronisation).  Returns (SC, {name: sigma [B * Hkv] fp32})."""
    B, Hkv = p.batch, p.heads_kv
    st = {n: _row_stats(x) for n, x in (("q", q), ("k", k), ("v", v), ("do", dout))
          if x is not None}
    sig = {n: _pow2_scale(_group_max(a, B, Hkv), SIGMA_EXP) for n, (a, _) in st.items()}
    sc = torch.zeros((B * Hkv, 8), dtype=torch.float64, device=q.device)
    sc[:, 0] = 1.0 / (sig["q"] * sig["k"])
    sc[:, 3] = 1.0 / (sig["v"] * float(kernels.PS_FWD.value))
    if dout is not None:
        nrm = _group_max(st["do"][1], B, Hkv) * _group_max(st["v"][1], B, Hkv)
        dl = delta.double().abs()
        dl = _group_max(torch.where(dl < float("inf"), dl, torch.zeros_like(dl)), B, Hkv)
        gam = _pow2_scale(nrm + dl, GAMMA_EXP)
        sc[:, 1] = 1.0 / (sig["v"] * sig["do"])
        sc[:, 2] = gam
        sc[:, 4] = 1.0 / (sig["do"] * float(kernels.PS_BWD.value))
        sc[:, 5] = 1.0 / (gam * sig["q"])
        sc[:, 6] = 1.0 / (gam * sig["k"])
    return sc.float(), {n: s.float() for n, s in sig.items()}


def f16_scales_paged(p, q, k_pages, v_pages):
    """f16_scales of a forward over a paged cache (anyattn.paged): q's sigma per (batch,
    kv head) as there; k's and v's per kv head, from the finite max |x| over every page
    of the cache (positions no sequence reads included).  Returns (SC [B * Hkv, 8] fp32,
    (sigma of q [B * Hkv], {'k', 'v': sigma [N * Hkv] of the pages, for split_half}))."""
    B, Hkv = p.batch, p.heads_kv
    N = k_pages.shape[0]
    sig_q = _pow2_scale(_group_max(_row_stats(q)[0], B, Hkv), SIGMA_EXP)
    per_head = {}
    for n, x in (("k", k_pages), ("v", v_pages)):
        amax = _row_stats(x)[0]                                       # [N, Hkv, P]
        per_head[n] = _pow2_scale(amax.permute(1, 0, 2).reshape(Hkv, -1).amax(dim=1),
                                  SIGMA_EXP)                          # [Hkv]
    sc = torch.zeros((B * Hkv, 8), dtype=torch.float64, device=q.device)
    sc[:, 0] = 1.0 / (sig_q * per_head["k"].repeat(B))
    sc[:, 3] = 1.0 / (per_head["v"].repeat(B) * float(kernels.PS_FWD.value))
    return sc.float(), (sig_q.float(), {n: s.repeat(N).float() for n, s in per_head.items()})


def split_half(x, sig, group: int):
    """fp32 [B, H, S, D] times sigma [B * Hkv] (per kv-head group of `group` heads) ->
    contiguous fp16 [B, H, S, 2 * D]: hi and lo of the scaled values side by side,
    rounded to nearest (kernels.split_f16_kernel)."""
    B, H, S, D = x.shape
    out = torch.empty((B, H, S, 2 * D), dtype=torch.float16, device=x.device)
    bm = 32
    kernels.split_f16_kernel[(cdiv(S, bm), B * H)](x, out, sig, *s3(x), H, group, S, D=D,
                                                     DP=configs.padded_dim(D), BM=bm)
    return out


def s3(x):
    """(batch, head, seq) strides of a [B, H, S, D] tensor."""
    return x.stride()[:3]


@dataclass
class ModArgs:
    """The score modifiers as the kernels take them (anyattn.modifiers): constexpr flags,
    fp32 buffers (a 1-element dummy where absent) and scalars."""

    softcap: bool
    alibi: bool
    sinks: bool
    slopes: Any                # fp32 [Ba, H] contiguous
    sl_b: int                  # batch stride of slopes (0: one row for every batch)
    sink_t: Any                # fp32 [H]
    cap: float                 # c (1.0 unused)
    adiag: int                 # alibi_diag(p)
    dropout: bool = False      # anyattn.dropout's keep mask (constexpr DROPOUT)
    tanh_mode: int = 1         # softcap's tanh: 1 portable fp32, 2 tanh.approx (configs)
    drop: tuple = ()           # (DW words buffer, threshold as int32 bits, 1 / (1 - p))

    @property
    def scalars(self):
        return (self.sl_b, self.cap, self.adiag, *self.drop)

    @property
    def flags(self):
        return dict(SOFTCAP=self.tanh_mode if self.softcap else 0, ALIBI=self.alibi,
                    DROPOUT=self.dropout)


def _u32_bits(x: int) -> int:
    """A uint32 value as the int32 with its bits (every 32-bit kernel scalar is passed as
    int32, one signature whatever the value; the kernels bitcast it back)."""
    x = int(x)
    if not 0 <= x < 1 << 32:
        raise ValueError(f"{x} is not a 32-bit unsigned integer")
    return x - (1 << 32) if x >= 1 << 31 else x


def _drop_args(p, dev, draw: bool = True) -> tuple:
    """(DROPOUT, (DW, threshold, 1 / (1 - p))) of p's dropout (anyattn.dropout;
    p.dropout_p = 0: off).  DW int32 [Sk + B * H * Sq]: the premixed column words, then
    the row words of every (b, h), drawn once per call by kernels.drop_words_kernel (the seed
    halves and offsets travel as int32 bits, one kernel signature for every value).
    ``draw=False``: the flag only (placeholder scalars, nothing launched)."""
    if not p.has_dropout or not draw:
        return p.has_dropout and not draw, (tiles.dummy(dev), 0, 1.0)
    B, H, Sq, Sk = p.batch, p.heads_q, p.seq_q, p.seq_k
    seed = int(p.dropout_seed)
    dw = torch.empty(Sk + B * H * Sq, dtype=torch.int32, device=dev)
    bl = 128
    with on_device(dev):
        kernels.drop_words_kernel[(cdiv(max(Sq, Sk, 1), bl), 1 + B * H)](
            dw, H, Sq, Sk, _u32_bits(p.q_offset), _u32_bits(p.k_offset),
            _u32_bits(seed & 0xFFFFFFFF), _u32_bits(seed >> 32), BLOCK=bl)
    return True, (dw, _u32_bits(threshold(p.dropout_p)), float(keep_scale(p.dropout_p)))


def mod_args(p, mods: Optional[ScoreMods], dev, draw: bool = True) -> ModArgs:
    """``draw=False``: the flags and scalars without drawing the dropout words (for a
    prepared launch's constexprs)."""
    mods = NO_MODS if mods is None else mods
    if p.softcap is not None and not p.softcap > 0:
        raise ValueError(f"softcap {p.softcap}: expected c > 0")
    slopes, sl_b = tiles.dummy(dev, torch.float32), 0
    if mods.alibi_slopes is not None:
        slopes = mask_inputs.to_device(mods.alibi_slopes, dev, torch.float32).reshape(-1, p.heads_q)
        slopes = slopes.contiguous()
        sl_b = p.heads_q if slopes.shape[0] > 1 else 0
    sink_t = tiles.dummy(dev, torch.float32)
    if mods.sinks is not None:
        sink_t = mask_inputs.to_device(mods.sinks, dev, torch.float32).reshape(p.heads_q)
        sink_t = sink_t.contiguous()
    dropout, drop = _drop_args(p, dev, draw)
    return ModArgs(softcap=p.softcap is not None, alibi=mods.alibi_slopes is not None,
                    sinks=mods.sinks is not None, slopes=slopes, sl_b=sl_b, sink_t=sink_t,
                    cap=float(p.softcap) if p.softcap is not None else 1.0,
                    adiag=int(alibi_diag(p)) if mods.alibi_slopes is not None else 0,
                    dropout=dropout, drop=drop,
                    tanh_mode=configs.softcap_mode(p.dtype, dev) if p.softcap is not None else 1)
