"""Triton kernels (``@triton.jit`` only) for attention forward and backward.

Shape legend: B batch, H = Hq query heads, Hkv key/value heads, G = H / Hkv,
Sq queries, Sk keys, D head dim of q and k, DP = D padded to a power of two (>= 16),
VD head dim of v, out and dout (constexpr; VD = D unless v's head dim differs), VDP =
VD padded likewise (q.k contracts over DP, P.v and dout.v^T over VDP; dq and dk are
[.., DP] tiles, out and dv [.., VDP]), BM / BN the query / key tile of a kernel,
SBQ / SBK the mask-block size of the tile lists (a multiple of every BM / BN).

Row statistics, kept apart (anyattn.rowstats): the forward stores per row the largest
kept score ``max`` and ``log_norm = log sum_kept exp(s - max)`` (natural log, two fp32
planes [2, B * H * Sq]), never one rounded lse folded into the exponent (that loses
|lse| * 2^-24 absolutely, and a uniform bias of -1e30 absorbs log(Sk) entirely).
Scores are compared only in the units they were computed in, so that the largest one
gives exactly exp2(0) = 1:
  forward   with a bias the natural score ``s = fma(q.k, scale, bias)`` (the bias in
            fp32, never multiplied by log2(e): finfo.min stays finite), without one the
            raw product ``x = q.k`` (``fl(x * scale)`` is monotone in x, so the row's
            max score is ``fl(max x * scale)``); ``p = exp2((x - m) * c)`` with
            c = log2(e) resp. scale * log2(e) (no fused multiply can round x - m);
  backward  ``s = fma(q.k, scale, bias or 0)`` (an explicit fma: the compiler cannot
            contract the product into the subtraction), then
            ``p = exp2((s - max) * log2(e) - log_norm2)``: exact 0 at the row max, so a
            row attending to one key gets p = 1 exactly, whatever |s| is.
The backward preprocess writes, per (b, h), ``max`` (``+inf`` on empty rows, so that p
is 0 there and never NaN) and ``log_norm2 = log2(e) * log_norm`` side by side into
L2 [B * H, 2, Sq]; a plain lse given by a caller arrives as (max = lse, log_norm = 0),
its literal meaning p = exp(s - lse).

Key-tile iteration (forward, dQ) and query-tile iteration (dK/dV) come in two
modes (constexpr ``MODE``):
  0  band or no mask: tile ranges computed here from ``lo <= j - i <= hi``,
     split into masked edges and an unmasked middle;
  1  tile lists (documents / KeepMask, band folded in): per row of mask blocks
     a count and sorted indices of partial blocks and of full blocks, built
     once per mask on the GPU (tiles.py); full blocks load no mask.
No kernel uses atomics: every output element has one owner program, so
results are bitwise repeatable.

fp16 / bf16 tiles multiply on tensor cores with fp32 accumulation (PREC 'tf32', which
tl.dot ignores for 16-bit operands).  fp32 inputs run PREC 'hsplit3' ("scaled fp16
parts"): the launcher scales q, k, v and dout by powers of two sigma (one per batch and
kv-head group, from the finite max |x|, so that |x * sigma| <= 2^14) and stores fp16
parts of the scaled values side by side along the last dim, hi and lo ([.., S, 2 * D],
x * sigma ~= hi + lo to ~2^-22); every product sums three fp16 products (hi*hi + hi*lo
+ lo*hi: ~fp32 accuracy).  Operands travel as part pairs (hi, lo) through
``_load_op`` / ``_op_parts`` / ``_dotp`` (lo repeats hi for 16-bit inputs; the compiler
drops the repeat).  The computed tiles are split after a
power-of-two scaling too: p by PS_FWD / PS_BWD (p <= 1), dS by gamma = 2^10 /
bound(|dS|) from |dS| <= p (|dP| + |delta|) <= max|dout_i| max|v_j| + max|delta| (row
norms).  Every scale is undone exactly on the fp32 results through the per-(batch, kv
head) factors of SC [B * Hkv, 8] (see operands.f16_scales): 0 1/(sq sk) on scores,
1 1/(sv sdo) on dP, 2 gamma, 3 1/(PS_FWD sv) on out, 4 1/(PS_BWD sdo) on dv, 5 1/(gamma
sq) on dk, 6 1/(gamma sk) on dq.  The broadcast dbias reduction (dbias_kernel) takes the
fp32 tiles themselves: PREC 'bf16x6', six bf16 products of tiles split in registers.
"""
import triton
import triton.language as tl

from ... import settings

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
#: power-of-two scales of p before its fp16 split (forward: p <= 1; backward: p <= 1 for
#: the forward's own row statistics, and a given lse (max = lse, log_norm = 0) may
#: understate the row's log-sum-exp by up to ln 64 before p * PS_BWD overflows)
PS_FWD = tl.constexpr(16384.0)
PS_BWD = tl.constexpr(1024.0)
#: Triton 3.6's interpreter multiplies bfloat16 tiles as raw integers; under it the
#: dot operands are upcast to fp32 (after the usual rounding to the input dtype).  Read
#: at import, as Triton decides at import (jit decoration) whether it interprets; the
#: setting parses TRITON_INTERPRET as Triton does.
_INTERPRETED = tl.constexpr(settings.current().triton_interpret)


# ----------------------------------------------------------------------------- helpers
@triton.jit
def _dot16(a, b, acc):
    """acc + a @ b for bf16 tiles (upcast under the interpreter, see _INTERPRETED)."""
    if _INTERPRETED:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _split3(x):
    """fp32 tile -> three bf16 tiles with x ~= hi + mid + lo (24 mantissa bits)."""
    hi = x.to(tl.bfloat16)
    r = x - hi.to(tl.float32)
    mid = r.to(tl.bfloat16)
    lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
    return hi, mid, lo


@triton.jit
def _split2h(x):
    """fp32 tile (already scaled into fp16 range) -> two fp16 tiles, x ~= hi + lo
    (22 mantissa bits where lo is normal)."""
    hi = x.to(tl.float16)
    lo = (x - hi.to(tl.float32)).to(tl.float16)
    return hi, lo


@triton.jit
def _dot_bf16x6(a, b):
    """fp32 a [M, K] @ b [K, N] to ~fp32 accuracy with six bf16 tensor-core products
    (the terms below 2^-24 relative, mid*lo, lo*mid and lo*lo, are dropped)."""
    ah, am, al = _split3(a)
    bh, bm, bl = _split3(b)
    acc = tl.zeros([a.shape[0], b.shape[1]], dtype=tl.float32)
    acc = _dot16(al, bh, acc)           # smallest terms first
    acc = _dot16(ah, bl, acc)
    acc = _dot16(am, bm, acc)
    acc = _dot16(am, bh, acc)
    acc = _dot16(ah, bm, acc)
    acc = _dot16(ah, bh, acc)
    return acc


@triton.jit
def _dot(a, b, PREC: tl.constexpr):
    """a [M, K] @ b [K, N] with fp32 accumulation: for fp32 operands with PREC 'bf16x6'
    six bf16 split products (_dot_bf16x6); otherwise tl.dot (PREC its input_precision,
    ignored for 16-bit operands)."""
    if PREC == "bf16x6" and a.dtype == tl.float32:
        return _dot_bf16x6(a, b)
    else:
        if _INTERPRETED:
            return tl.dot(a.to(tl.float32), b.to(tl.float32))
        else:
            return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _dotp(a0, a1, b0, b1, PREC: tl.constexpr):
    """a @ b [M, N] from part pairs (see module doc): 'hsplit3' three products of the
    fp16 parts (lo*hi + hi*lo + hi*hi, smallest first); otherwise _dot(a0, b0, PREC)."""
    if PREC == "hsplit3":
        acc = tl.zeros([a0.shape[0], b0.shape[1]], dtype=tl.float32)
        acc = _dot16(a1, b0, acc)
        acc = _dot16(a0, b1, acc)
        acc = _dot16(a0, b0, acc)
        return acc
    else:
        return _dot(a0, b0, PREC)


@triton.jit
def _op_parts(x, f, like, PREC: tl.constexpr):
    """A computed fp32 tile (p, dS) as an operand part pair: x * f (f a power of two)
    split into fp16 for 'hsplit3' (f is ignored otherwise); else cast to the dtype of
    ``like``."""
    if PREC == "hsplit3":
        hi, lo = _split2h(x * f)
        return hi, lo
    else:
        y = x.to(like.dtype)
        return y, y


@triton.jit
def _scale_factors(SC, b, hk, H, G, scale):
    """The scaled fp16 schemes' factors of (batch b, kv head hk) from SC [B * Hkv, 8]
    (module doc) -> (scale * score factor, dP factor mvo, dS scale gamma, out factor,
    dv factor, scale * dk factor, scale * dq factor); a program loads only those it uses
    (the others are dead code).  The factors are powers of two: the score scale of the
    scaled products is the natural one times a power of two, in every kernel alike."""
    scp = SC + (b * (H // G) + hk) * 8
    return (scale * tl.load(scp), tl.load(scp + 1), tl.load(scp + 2), tl.load(scp + 3),
            tl.load(scp + 4), scale * tl.load(scp + 5), scale * tl.load(scp + 6))


@triton.jit
def _cdiv_pos(x, b):
    """ceil(x / b) for x of any sign, result clamped at 0."""
    return (tl.maximum(x, 0) + b - 1) // b


@triton.jit
def _div_pos(x, b):
    """floor(x / b) for x of any sign, result clamped at 0."""
    return tl.maximum(x, 0) // b


@triton.jit
def _key_tile_range(i0, Sq, Sk, lo, hi, BM: tl.constexpr, BN: tl.constexpr):
    """Key tiles of size BN seen by queries [i0, i0 + BM): all in [t0, t1),
    unmasked (fully kept and in bounds) in [f0, f1), t0 <= f0 <= f1 <= t1."""
    i1 = tl.minimum(i0 + BM, Sq)
    nk = (Sk + BN - 1) // BN
    t0 = _div_pos(i0 + lo, BN)
    jmax = i1 - 1 + hi                         # largest key any query may see
    t1 = tl.minimum(nk, _cdiv_pos(jmax + 1, BN))
    t1 = tl.maximum(t0, t1)
    f0 = _cdiv_pos(lo + i1 - 1, BN)            # j - i >= lo for the last query
    f1 = _div_pos(hi + i0 + 1, BN)             # j - i <= hi for the first query
    f1 = tl.minimum(f1, Sk // BN)              # in-bounds tiles only
    f1 = f0 + (f1 - f0) * (i0 + BM <= Sq).to(tl.int32)   # partial query tile: keep the masks
    f0 = tl.minimum(tl.maximum(f0, t0), t1)
    f1 = tl.minimum(tl.maximum(f1, f0), t1)
    return t0, f0, f1, t1


@triton.jit
def _query_tile_range(j0, Sq, Sk, lo, hi, BM: tl.constexpr, BN: tl.constexpr):
    """Query tiles of size BM that see keys [j0, j0 + BN): all in [s0, s1),
    unmasked in [g0, g1)."""
    j1 = tl.minimum(j0 + BN, Sk)
    nq = (Sq + BM - 1) // BM
    s0 = _div_pos(j0 - hi, BM)
    imax = j1 - 1 - lo                         # largest query that may see a key here
    s1 = tl.minimum(nq, _cdiv_pos(imax + 1, BM))
    s1 = tl.maximum(s0, s1)
    g0 = _cdiv_pos(j1 - 1 - hi, BM)            # j - i <= hi for the last key
    g1 = _div_pos(j0 - lo + 1, BM)             # j - i >= lo for the first key
    g1 = tl.minimum(g1, Sq // BM)
    g1 = g0 + (g1 - g0) * (j0 + BN <= Sk).to(tl.int32)
    g0 = tl.minimum(tl.maximum(g0, s0), s1)
    g1 = tl.minimum(tl.maximum(g1, g0), s1)
    return s0, g0, g1, s1


@triton.jit
def _keep(offs_m, offs_n, Sq, Sk, lo, hi, QID, KID, KM, skm_m, skm_n,
          HAS_BAND: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_KEEP: tl.constexpr):
    """Which pairs of a tile are kept: bool [BM, BN] (queries offs_m [BM], keys offs_n [BN])."""
    inb_m = offs_m < Sq
    inb_n = offs_n < Sk
    keep = inb_m[:, None] & inb_n[None, :]
    if HAS_BAND:
        dd = offs_n[None, :] - offs_m[:, None]
        keep = keep & (dd >= lo) & (dd <= hi)
    if HAS_DOCS:
        qd = tl.load(QID + offs_m, mask=inb_m, other=-1)
        kd = tl.load(KID + offs_n, mask=inb_n, other=-2)
        keep = keep & (qd[:, None] == kd[None, :])
    if HAS_KEEP:
        km = tl.load(KM + offs_m.to(tl.int64)[:, None] * skm_m + offs_n.to(tl.int64)[None, :] * skm_n,
                     mask=keep, other=0)
        keep = keep & (km != 0)
    return keep


@triton.jit
def _keep_t(offs_n, offs_m, Sq, Sk, lo, hi, QID, KID, KM, skm_m, skm_n,
            HAS_BAND: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_KEEP: tl.constexpr):
    """Transposed _keep: bool [BN, BM] (keys offs_n as rows, queries offs_m as columns)."""
    inb_m = offs_m < Sq
    inb_n = offs_n < Sk
    keep = inb_n[:, None] & inb_m[None, :]
    if HAS_BAND:
        dd = offs_n[:, None] - offs_m[None, :]
        keep = keep & (dd >= lo) & (dd <= hi)
    if HAS_DOCS:
        qd = tl.load(QID + offs_m, mask=inb_m, other=-1)
        kd = tl.load(KID + offs_n, mask=inb_n, other=-2)
        keep = keep & (kd[:, None] == qd[None, :])
    if HAS_KEEP:
        km = tl.load(KM + offs_m.to(tl.int64)[None, :] * skm_m + offs_n.to(tl.int64)[:, None] * skm_n,
                     mask=keep, other=0)
        keep = keep & (km != 0)
    return keep


@triton.jit
def _load_rows(ptr, start, stride_s, S, offs_r, offs_d, D: tl.constexpr, DP: tl.constexpr,
               CHECK_S: tl.constexpr):
    """Rows [start, start + R) of a [S, D] slice with row stride stride_s -> [R, DP]."""
    base = ptr + tl.cast(start, tl.int64) * stride_s
    p = base + offs_r[:, None] * stride_s + offs_d[None, :]
    if CHECK_S:
        if D == DP:
            x = tl.load(p, mask=(start + offs_r)[:, None] < S, other=0.0)
        else:
            x = tl.load(p, mask=((start + offs_r)[:, None] < S) & (offs_d[None, :] < D), other=0.0)
    else:
        if D == DP:
            x = tl.load(p)
        else:
            x = tl.load(p, mask=offs_d[None, :] < D, other=0.0)
    return x


@triton.jit
def _load_rows_t(ptr, start, stride_s, S, offs_r, offs_d, D: tl.constexpr, DP: tl.constexpr,
                 CHECK_S: tl.constexpr):
    """Transposed _load_rows -> [DP, R]."""
    base = ptr + tl.cast(start, tl.int64) * stride_s
    p = base + offs_r[None, :] * stride_s + offs_d[:, None]
    if CHECK_S:
        if D == DP:
            x = tl.load(p, mask=(start + offs_r)[None, :] < S, other=0.0)
        else:
            x = tl.load(p, mask=((start + offs_r)[None, :] < S) & (offs_d[:, None] < D), other=0.0)
    else:
        if D == DP:
            x = tl.load(p)
        else:
            x = tl.load(p, mask=offs_d[:, None] < D, other=0.0)
    return x


@triton.jit
def _load_op(ptr, start, stride_s, S, offs_r, offs_d, D: tl.constexpr, DP: tl.constexpr,
             CHECK_S: tl.constexpr, PREC: tl.constexpr, TRANS: tl.constexpr):
    """Rows of an operand as a part pair of [R, DP] tiles ([DP, R] with TRANS); for
    'hsplit3' the lo part sits at column D (see module doc)."""
    x0 = _load_part(ptr, start, stride_s, S, offs_r, offs_d, D, DP, CHECK_S, TRANS)
    x1 = x0
    if PREC == "hsplit3":
        x1 = _load_part(ptr + D, start, stride_s, S, offs_r, offs_d, D, DP, CHECK_S, TRANS)
    return x0, x1


@triton.jit
def _load_part(ptr, start, stride_s, S, offs_r, offs_d, D: tl.constexpr, DP: tl.constexpr,
               CHECK_S: tl.constexpr, TRANS: tl.constexpr):
    """_load_rows, or _load_rows_t with TRANS."""
    if TRANS:
        return _load_rows_t(ptr, start, stride_s, S, offs_r, offs_d, D, DP, CHECK_S)
    else:
        return _load_rows(ptr, start, stride_s, S, offs_r, offs_d, D, DP, CHECK_S)


@triton.jit
def _load_bias(BI, sb_m, sb_n, offs_m, offs_n, Sq, Sk, CHECK: tl.constexpr):
    """Bias tile [BM, BN] in fp32 (0 outside the problem)."""
    p = BI + offs_m.to(tl.int64)[:, None] * sb_m + offs_n.to(tl.int64)[None, :] * sb_n
    if CHECK:
        b = tl.load(p, mask=(offs_m[:, None] < Sq) & (offs_n[None, :] < Sk), other=0.0)
    else:
        b = tl.load(p)
    return b.to(tl.float32)


@triton.jit
def _load_bias_t(BI, sb_m, sb_n, offs_n, offs_m, Sq, Sk, CHECK: tl.constexpr):
    """Transposed bias tile [BN, BM] in fp32."""
    p = BI + offs_m.to(tl.int64)[None, :] * sb_m + offs_n.to(tl.int64)[:, None] * sb_n
    if CHECK:
        b = tl.load(p, mask=(offs_m[None, :] < Sq) & (offs_n[:, None] < Sk), other=0.0)
    else:
        b = tl.load(p)
    return b.to(tl.float32)


# ----------------------------------------------------------------------------- score modifiers
#: tanh(a) = a + a^3 (T3 + a^2 (T5 + ...)) for |a| < TANH_SMALL (Taylor, float32 Horner:
#: <= 2 ulp there); (1 - e) / (1 + e), e = exp(-2|a|), above (no cancellation there)
TANH_SMALL = tl.constexpr(0.4)
T3 = tl.constexpr(-0.3333333333333333)
T5 = tl.constexpr(0.13333333333333333)
T7 = tl.constexpr(-0.05396825396825397)
T9 = tl.constexpr(0.021869488536155203)
T11 = tl.constexpr(-0.008863235529902197)


@triton.jit
def _tanh_d(y):
    """-> (tanh y, 1 - tanh^2 y) in fp32, accurate to a few ulps everywhere: an odd
    polynomial near 0, exp-based beyond (one exp2 and one approximate division); it
    saturates to +-1 / 0 for huge |y| (e underflows to 0: no inf / inf), NaN stays NaN.
    1 - tanh^2 = 4 e / (1 + e)^2 keeps its relative accuracy as tanh -> 1."""
    a = tl.abs(y)
    e = tl.math.exp2(a * -2.8853900817779268)           # exp(-2a), in (0, 1]
    r = tl.math.fdiv(1.0, 1.0 + e)
    a2 = a * a
    poly = a + (a * a2) * (T3 + a2 * (T5 + a2 * (T7 + a2 * (T9 + a2 * T11))))
    small = a < TANH_SMALL
    t = tl.where(small, poly, (1.0 - e) * r)
    dt = tl.where(small, 1.0 - poly * poly, (4.0 * e) * (r * r))
    return tl.where(y < 0.0, -t, t), dt


@triton.jit
def _tanh_fast(y):
    """-> (tanh y, 1 - tanh^2 y) through the GPU's one-instruction approximation
    tanh.approx.f32 (sm_75+, max relative error ~2^-11; saturates to +-1, NaN stays NaN):
    the softcap of 16-bit inputs on CUDA (SOFTCAP == 2, chosen by configs.softcap_mode),
    one MUFU op where _tanh_d needs an exp2 and a reciprocal.  PTX: the interpreter
    cannot run it, so interpreter tests cover _tanh_d only (the GPU bench checks this
    path against float64)."""
    t = tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=f,f", [y], dtype=tl.float32,
                                  is_pure=True, pack=1)
    return t, 1.0 - t * t


@triton.jit
def gather_tile(p):
    """The values at the pointer tile p (a score or mask function's capture gather, any
    tile shape; every pointer in range: programs.py clamps the indices).  On CUDA a
    non-coherent load in the tile's own iteration, written as inline PTX: Triton's
    software pipeliner stages every tt.load of 32 or more bits that feeds a dot in
    shared memory beside K and V (an fp32 [128, 128] gather is 64 KiB per stage, over
    sm_90's 227 KiB at 3 stages), and inline PTX is not a load to it.  Elements of 32 or
    64 bits (narrower ones are below the pipeliner's 32-bit minimum, so callers use
    tl.load).  The captures are read-only while a kernel runs (capture gradients go
    elsewhere)."""
    if _INTERPRETED:
        return tl.load(p)
    elif p.dtype.element_ty.primitive_bitwidth == 64:
        bits = tl.inline_asm_elementwise("ld.global.nc.b64 $0, [$1];", "=l,l",
                                         [p.to(tl.int64, bitcast=True)],
                                         dtype=tl.int64, is_pure=True, pack=1)
        return bits.to(p.dtype.element_ty, bitcast=True)
    else:
        bits = tl.inline_asm_elementwise("ld.global.nc.b32 $0, [$1];", "=r,l",
                                         [p.to(tl.int64, bitcast=True)],
                                         dtype=tl.int32, is_pure=True, pack=1)
        return bits.to(p.dtype.element_ty, bitcast=True)


@triton.jit
def _alibi_dist(offs_m, offs_n, adiag, TRANS: tl.constexpr):
    """|i - j + adiag| of a tile as fp32, [BM, BN] (queries as rows) or with TRANS [BN, BM]:
    one exact fp32 subtraction per element of positions converted once per row / column
    (integers below 2^24 are exact in fp32; no per-element integer conversion)."""
    fi = (offs_m + adiag).to(tl.float32)
    fj = offs_n.to(tl.float32)
    if TRANS:
        return tl.abs(fi[None, :] - fj[:, None])
    else:
        return tl.abs(fi[:, None] - fj[None, :])


@triton.jit
def _raw_alibi(s, slope_raw, offs_m, offs_n, adiag, TRANS: tl.constexpr):
    """ALiBi alone (no softcap, no bias): applied to the raw products q.k, which the
    kernels keep in the plain kernels' units (module doc), with slope_raw = slope /
    (natural score scale); the natural score is then fl(s * scale) as without ALiBi."""
    return tl.fma(_alibi_dist(offs_m, offs_n, adiag, TRANS), -slope_raw, s)


@triton.jit
def _mod_scores(s, s_scale, bt, cap, slope, offs_m, offs_n, adiag,
                HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr,
                TRANS: tl.constexpr):
    """Raw products q.k of a tile -> natural scores with the score modifiers, in the
    contract's order: x = scale * q.k; softcap c * tanh(x / c); + bias (bt, fp32, or 0.0);
    ALiBi - slope * |i - j + adiag|.  [BM, BN] tiles (queries offs_m as rows), or with
    TRANS [BN, BM] (keys offs_n as rows).  Returns (scores, 1 - tanh^2) (the second is
    the scores again without SOFTCAP, unused).  Every kernel forms the scores with this
    one function, fused multiply-adds written out, so forward and backward agree."""
    if SOFTCAP:    # 1: the portable fp32-accurate tanh, 2: the hardware approximation
        if SOFTCAP == 2:
            th, dt = _tanh_fast(tl.fma(s, s_scale, 0.0) * (1.0 / cap))
        else:
            th, dt = _tanh_d(tl.fma(s, s_scale, 0.0) * (1.0 / cap))
        if HAS_BIAS:
            s = tl.fma(th, cap, bt)
        else:
            s = tl.fma(th, cap, 0.0)
    else:
        if HAS_BIAS:
            s = tl.fma(s, s_scale, bt)
        else:
            s = tl.fma(s, s_scale, 0.0)
        dt = s
    if ALIBI:
        s = tl.fma(_alibi_dist(offs_m, offs_n, adiag, TRANS), -slope, s)
    return s, dt


@triton.jit
def _load_slope(SLOPES, b, h, sl_b, s_scale, ALIBI: tl.constexpr, RAW: tl.constexpr):
    """The ALiBi slope of (batch b, head h) from fp32 SLOPES [Ba, H] (sl_b = H, or 0 when
    one row serves every batch), divided by the natural score scale s_scale with RAW
    (ALiBi alone, see _raw_alibi); 0.0 without ALiBi (never read)."""
    if ALIBI:
        if RAW:
            return tl.load(SLOPES + b * sl_b + h) / s_scale
        else:
            return tl.load(SLOPES + b * sl_b + h)
    else:
        return 0.0



# ----------------------------------------------------------------------------- dropout
#: anyattn.dropout's generator (module doc there), bit for bit: a row word per (b, h, i)
#: and a column word per j from Philox4x32-10, then per element mix32(row ^ col) >= t.
#: Every 32-bit scalar (seed halves k0 / k1, threshold t, position offsets) arrives as
#: an int32 holding the uint32's bits (operands._u32_bits) and is bitcast back here.
@triton.jit
def _bits(x):
    """An int32 kernel argument carrying uint32 bits -> uint32."""
    return tl.cast(x, tl.int32).to(tl.uint32, bitcast=True)


@triton.jit
def _philox_w0(c0, c1, c2, c3, k0, k1):
    """Word 0 of Philox4x32-10 (Salmon et al. 2011; anyattn.dropout.philox4x32): uint32
    counter tiles c0..c3 (one shape), uint32 scalar key (k0, k1)."""
    for _ in tl.static_range(10):
        hi0 = tl.umulhi(c0, 0xD2511F53)
        hi1 = tl.umulhi(c2, 0xCD9E8D57)
        lo0 = c0 * 0xD2511F53
        lo1 = c2 * 0xCD9E8D57
        c0 = hi1 ^ c1 ^ k0
        c1 = lo1
        c2 = hi0 ^ c3 ^ k1
        c3 = lo0
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0


@triton.jit
def _row_words(offs_m, q_off, h, b, sd0, sd1):
    """uint32 [BM]: the row words r of global rows q_off + offs_m of head h, batch b
    (counter (i, h, b, 0)), premixed as r ^ (r >> 16) (see _drop_keep); q_off, sd0, sd1
    as int32 bits."""
    i = offs_m.to(tl.uint32) + _bits(q_off)
    z = tl.zeros_like(i)
    r = _philox_w0(i, z + h.to(tl.uint32), z + b.to(tl.uint32), z, _bits(sd0), _bits(sd1))
    return r ^ (r >> 16)


@triton.jit
def _col_words(offs_n, k_off, sd0, sd1):
    """uint32 [BN]: the column words c of global keys k_off + offs_n (counter
    (j, 0, 0, 1)), premixed as c ^ (c >> 16) (see _drop_keep)."""
    j = offs_n.to(tl.uint32) + _bits(k_off)
    z = tl.zeros_like(j)
    c = _philox_w0(j, z, z, z + 1, _bits(sd0), _bits(sd1))
    return c ^ (c >> 16)


@triton.jit
def drop_words_kernel(DW, H, Sq, Sk, q_off, k_off, sd0, sd1, BLOCK: tl.constexpr):
    """Grid (cdiv(max(Sq, Sk), BLOCK), 1 + B * H): dropout's premixed words into int32 DW
    [Sk + B * H * Sq]: the column words of keys 0..Sk-1 first (program row 0), then the
    row words of each (b, h) (program row 1 + b * H + h), every Philox call made once per
    launch instead of once per tile visit."""
    r = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    if r == 0:
        w = _col_words(offs, k_off, sd0, sd1)
        tl.store(DW + offs, w.to(tl.int32, bitcast=True), mask=offs < Sk)
    else:
        bh = (r - 1).to(tl.int64)
        w = _row_words(offs, q_off, bh % H, bh // H, sd0, sd1)
        tl.store(DW + Sk + bh * Sq + offs, w.to(tl.int32, bitcast=True), mask=offs < Sq)


@triton.jit
def _load_words(ptr, offs, n):
    """uint32 words ptr[offs] (offs < n; 0 beyond) from the int32 DW buffer."""
    return tl.load(ptr + offs, mask=offs < n, other=0).to(tl.uint32, bitcast=True)


@triton.jit
def _drop_keep(rw, cw, thr, TRANS: tl.constexpr):
    """bool [BM, BN] (rows rw [BM], columns cw [BN], premixed), or with TRANS [BN, BM]:
    keep iff mix32(row ^ col) >= t (unsigned).  mix32's first step x ^= x >> 16 is linear
    over GF(2), so it distributes over row ^ col and is done once per row and column
    (_row_words, _col_words): per element remain one xor, two multiplies, two
    shift-xors and the compare."""
    if TRANS:
        x = cw[:, None] ^ rw[None, :]
    else:
        x = rw[:, None] ^ cw[None, :]
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    x = x ^ (x >> 16)
    return x >= _bits(thr)


# ----------------------------------------------------------------------------- operand split
@triton.jit
def _row_block(X, sx_b, sx_h, sx_s, H, S, D: tl.constexpr, DP: tl.constexpr,
               BM: tl.constexpr):
    """The rows [BM, DP] of program (row block, b * H + h) of fp32 X [B, H, S, D] (any
    batch / head / row strides, unit last stride; 0 outside) -> (x, b, h, row index of
    each row in a contiguous [B, H, S] (int64) [BM], offs_d [DP], in-bounds mask [BM, DP],
    in-bounds rows [BM])."""
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    offs_m = tl.program_id(0) * BM + tl.arange(0, BM)
    offs_d = tl.arange(0, DP)
    msk = (offs_m[:, None] < S) & (offs_d[None, :] < D)
    x = tl.load(X + b * sx_b + h * sx_h + offs_m.to(tl.int64)[:, None] * sx_s + offs_d[None, :],
                mask=msk, other=0.0).to(tl.float32)                              # [BM, DP]
    return x, b, h, bh.to(tl.int64) * S + offs_m.to(tl.int64), offs_d, msk, offs_m < S


@triton.jit
def split_f16_kernel(X, Y, SIG, sx_b, sx_h, sx_s, H, G, S, D: tl.constexpr,
                      DP: tl.constexpr, BM: tl.constexpr):
    """Grid (cdiv(S, BM), B * H): rows [BM, D] of fp32 X (unit last stride) times the
    power of two SIG[b * (H // G) + h // G] -> fp16 parts hi, lo side by side in
    contiguous Y [B, H, S, 2 * D], as _split2h."""
    x, b, h, row, offs_d, msk, inb = _row_block(X, sx_b, sx_h, sx_s, H, S, D, DP, BM)
    hi, lo = _split2h(x * tl.load(SIG + b * (H // G) + h // G))
    yp = Y + (row * (2 * D))[:, None] + offs_d[None, :]
    tl.store(yp, hi, mask=msk)
    tl.store(yp + D, lo, mask=msk)


@triton.jit
def row_stats_kernel(X, AMAX, RSQ, sx_b, sx_h, sx_s, H, S, D: tl.constexpr,
                      DP: tl.constexpr, BM: tl.constexpr):
    """Grid (cdiv(S, BM), B * H): per row of X [B, H, S, D] (unit last stride), over its
    finite entries (NaN / inf count as 0, so that they propagate through the products,
    not through the scales): a = max |x| -> AMAX and sum (x / a)^2 -> RSQ [B * H * S]
    (the row's norm is a * sqrt(RSQ), without overflow)."""
    x, b, h, row, offs_d, msk, inb = _row_block(X, sx_b, sx_h, sx_s, H, S, D, DP, BM)
    a = tl.abs(x)
    a = tl.where(a < float("inf"), a, 0.0)       # NaN compares false too
    amax = tl.max(a, 1)                                                           # [BM]
    r = a / tl.where(amax > 0.0, amax, 1.0)[:, None]
    tl.store(AMAX + row, amax, mask=inb)
    tl.store(RSQ + row, tl.sum(r * r, 1), mask=inb)


# ----------------------------------------------------------------------------- forward
@triton.jit
def _qk_chunks(q_rows, q_ok, Kh, start_n, sk_s, Sk, offs_nb, D: tl.constexpr,
               DC: tl.constexpr, MASKED: tl.constexpr, PREC: tl.constexpr):
    """Raw products q.k [BM, BN] of the query rows at pointers q_rows [BM] (unit stride
    along D; rows not q_ok read as 0) and the key tile at start_n, summed over the
    cdiv(D, DC) chunks of DC columns (unrolled; the last chunk masked where DC does not
    divide D), so that only a [BM, DC] query chunk and a [DC, BN] key chunk are live at
    a time.  The query chunks are re-read per key tile (from L1 / L2: a program's
    query rows are a few KB).  'hsplit3': the lo parts at column D, as _load_op's."""
    DPC: tl.constexpr = (D + DC - 1) // DC * DC
    s = tl.zeros([q_rows.shape[0], offs_nb.shape[0]], dtype=tl.float32)
    for c in tl.static_range(0, DPC // DC):
        offs_c = c * DC + tl.arange(0, DC)
        if D == DPC:
            qm = q_ok[:, None]
        else:
            qm = q_ok[:, None] & (offs_c[None, :] < D)
        qp = q_rows[:, None] + offs_c[None, :]
        q0 = tl.load(qp, mask=qm, other=0.0)                                 # [BM, DC]
        q1 = q0
        if PREC == "hsplit3":
            q1 = tl.load(qp + D, mask=qm, other=0.0)
        k0, k1 = _load_op(Kh, start_n, sk_s, Sk, offs_nb, offs_c, D, DPC, MASKED, PREC,
                          True)                                               # [DC, BN]
        s = s + _dotp(q0, q1, k0, k1, PREC)
    return s


@triton.jit
def _fwd_tile(acc, l_i, m_i, q0, q1, Kh, Vh, sk_s, sv_s, start_n, offs_m, offs_nb, offs_d,
              offs_dv, Sq, Sk, s_scale, qk_scale, lo, hi, cap, slope, adiag, dw, DWr, DW, dthr,
              drs, QID, KID, KM, skm_m, skm_n, BI, sb_m, sb_n,
              D: tl.constexpr, DP: tl.constexpr, VD: tl.constexpr, VDP: tl.constexpr,
              MASKED: tl.constexpr,
              HAS_BAND: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_KEEP: tl.constexpr,
              HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
              PREC: tl.constexpr, b, h, CAPS, SMOD: tl.constexpr, MMOD: tl.constexpr,
              DC: tl.constexpr = 0):
    """One key tile of the online softmax: acc [BM, VDP], l_i/m_i [BM] updated.  m_i is
    the running row max in the tile's units (module doc): natural scores with a bias or
    a score modifier (s_scale the natural score scale), raw products q.k without
    (qk_scale = s_scale * log2(e) takes them to base 2).

    DC > 0 (head dims above 256, fwd_split_kernel): q.k is summed over chunks of DC
    columns of D (_qk_chunks; q0 the query rows' pointers [BM], q1 which rows are
    valid [BM], offs_d unused), and offs_dv may be any VDP-bounded column range of v
    (acc [BM, len(offs_dv)]): v's columns are read where offs_dv says."""
    offs_n = start_n + offs_nb
    if DC == 0:
        kT0, kT1 = _load_op(Kh, start_n, sk_s, Sk, offs_nb, offs_d, D, DP,
                                 MASKED, PREC, True)  # [DP, BN]
    if HAS_BIAS:   # issued before the product, to overlap it
        bt = _load_bias(BI, sb_m, sb_n, offs_m, offs_n, Sq, Sk, MASKED)           # [BM, BN]
    else:
        bt = 0.0
    if MASKED:     # (its id / keep-mask loads too)
        keep = _keep(offs_m, offs_n, Sq, Sk, lo, hi, QID, KID, KM, skm_m, skm_n,
                     HAS_BAND, HAS_DOCS, HAS_KEEP)                                # [BM, BN]
        if MMOD is not None:   # a mask function (partial tiles only; programs.py)
            keep = MMOD(b, h, offs_m[:, None], offs_n[None, :], keep, CAPS)
    if DC == 0:
        s = _dotp(q0, q1, kT0, kT1, PREC)           # [BM, BN] raw q.k
    else:
        s = _qk_chunks(q0, q1, Kh, start_n, sk_s, Sk, offs_nb, D, DC, MASKED, PREC)
    if SMOD is not None:   # a score function on the natural scores (after softcap)
        s, _ = _mod_scores(s, s_scale, 0.0, cap, slope, offs_m, offs_n, adiag,
                           False, SOFTCAP, False, False)
        s = SMOD(s, b, h, offs_m[:, None], offs_n[None, :],
                 (offs_m < Sq)[:, None] & (offs_n < Sk)[None, :], CAPS)
        if HAS_BIAS:
            s = s + bt
        c = 1.4426950408889634
    elif SOFTCAP or (ALIBI and HAS_BIAS):   # natural scores with the modifiers, as the
        s, _ = _mod_scores(s, s_scale, bt, cap, slope, offs_m, offs_n, adiag,  # backward's
                           HAS_BIAS, SOFTCAP, ALIBI, False)
        c = 1.4426950408889634
    elif HAS_BIAS:
        s = tl.fma(s, s_scale, bt)           # natural scores, as the backward forms them
        c = 1.4426950408889634
    else:
        if ALIBI:
            s = _raw_alibi(s, slope, offs_m, offs_n, adiag, False)
        c = qk_scale
    if MASKED:
        s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))                                     # [BM]
    if MASKED or HAS_BIAS or ALIBI:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)   # rows with nothing kept yet
    elif SMOD is not None:
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = tl.math.exp2((s - m_use[:, None]) * c)     # [BM, BN]; exactly 1 at the row max
    alpha = tl.math.exp2((m_i - m_use) * c)                                   # [BM]
    l_i = l_i * alpha + tl.sum(p, 1)
    if DROPOUT:    # out = (P o keep).v / (1 - p) (scaled in the epilogue); l undropped
        p = tl.where(_drop_keep(dw, _load_words(DW, offs_n, Sk), dthr, False), p, 0.0)
    v0, v1 = _load_op(Vh, start_n, sv_s, Sk, offs_nb, offs_dv, VD, VDP,
                          MASKED, PREC, False)  # [BN, VDP]
    acc = acc * alpha[:, None]              # (rescaled before p is cast: the order
    p0, p1 = _op_parts(p, PS_FWD, v0, PREC)   #  the 16-bit kernel was tuned with)
    acc = acc + _dotp(p0, p1, v0, v1, PREC)
    return acc, l_i, m_new


@triton.jit
def _fwd_epilogue(acc, l_i, m_i, m_scale, out_mul, drs, O, LSE, SINKS, so_b, so_h, so_s, r0,
                  rows, offs_dv, offs_m, bh, H, Sq, VD: tl.constexpr, VDP: tl.constexpr,
                  MAX_SCALED: tl.constexpr, HAS_SINKS: tl.constexpr, DROPOUT: tl.constexpr,
                  SCALED: tl.constexpr):
    """The forward's output and row-statistics stores, shared by fwd_kernel and
    fwd_combine_kernel: acc [BM, VDP] fp32 (out unnormalised), l_i [BM] (the sums of
    exp(s - max)) and m_i [BM] (the row maxima: natural, or times m_scale where
    MAX_SCALED, the plain kernel's scores in units of the scale) of the rows offs_m [BM]
    of head h = bh % H of batch b = bh // H (grid axis 1: B * H).  Writes out = acc / l
    [BM, VD] (times out_mul where SCALED, the scaled fp16 schemes; times drs = 1 / (1 - p)
    under DROPOUT) to O + b * so_b + h * so_h + (r0 + rows) * so_s (r0 a scalar, rows
    [BM]: offs_m = r0 + rows, split as the caller's index arithmetic wants it), max [BM]
    to LSE[bh * Sq + offs_m] and log_norm [BM] (natural log) to LSE[B * H * Sq + bh * Sq
    + offs_m], rows offs_m >= Sq not stored.  Empty rows (l == 0): out 0, max -inf,
    log_norm 0; NaN rows stay NaN (both statistics).  HAS_SINKS: the sink SINKS[h] is
    one more term of the normaliser."""
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    empty = l_i == 0.0
    if MAX_SCALED:
        row_max = m_i * m_scale            # = the largest fl(q.k * scale) of the row
    else:
        row_max = m_i
    row_max = tl.where(empty, float("-inf"), row_max)
    if HAS_SINKS:
        # the sink is one more term of the normaliser (anyattn.modifiers.sink_terms):
        # max2 = max(max, sink), l2 = l e^(max - max2) + e^(sink - max2), out scaled by
        # e^(max - max2) / l2 in fp32; a row keeping no key: out 0, max = sink, l2 = 1;
        # a -inf sink changes nothing
        snk = tl.load(SINKS + h)
        mx2 = tl.maximum(row_max, snk)
        mx2s = tl.where(mx2 == float("-inf"), 0.0, mx2)
        alpha = tl.math.exp2((row_max - mx2s) * 1.4426950408889634)       # 0 on empty rows
        l_i = l_i * alpha + tl.math.exp2((snk - mx2s) * 1.4426950408889634)
        empty = l_i == 0.0
        l_safe = tl.where(empty, 1.0, l_i)
        if SCALED:
            out = tl.where(empty[:, None], 0.0, (acc * (out_mul * alpha)[:, None]) / l_safe[:, None])
        else:
            out = tl.where(empty[:, None], 0.0, (acc * alpha[:, None]) / l_safe[:, None])
        row_max = mx2
    else:
        l_safe = tl.where(empty, 1.0, l_i)
        if SCALED:
            out = tl.where(empty[:, None], 0.0, (acc * out_mul) / l_safe[:, None])
        else:
            out = tl.where(empty[:, None], 0.0, acc / l_safe[:, None])
    if DROPOUT:
        out = out * drs                    # 1 / (1 - p)
    row_max = tl.where(l_i == l_i, row_max, l_i)
    log_norm = tl.math.log2(l_safe) * 0.6931471805599453      # 0 exactly when l == 1
    o_ptrs = O + b * so_b + h * so_h + tl.cast(r0, tl.int64) * so_s + rows[:, None] * so_s \
        + offs_dv[None, :]
    inb = offs_m < Sq
    if VD == VDP:
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=inb[:, None])
    else:
        tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=inb[:, None] & (offs_dv[None, :] < VD))
    row = bh.to(tl.int64) * Sq + offs_m
    tl.store(LSE + row, row_max, mask=inb)
    tl.store(LSE + tl.num_programs(1).to(tl.int64) * Sq + row, log_norm, mask=inb)


@triton.jit
def fwd_kernel(Q, K, V, O, LSE, BIAS, QID, KID, KM, CNT, IDX, FCNT, FIDX, SC, SLOPES, SINKS,
                sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, so_b, so_h, so_s,
                sb_b, sb_h, sb_m, sb_n, sqid_b, skid_b, skm_b, skm_h, skm_m, skm_n,
                sc_b, sc_h, si_b, si_h, si_r,
                H, G, Sq, Sk, qk_scale, scale, lo, hi, sl_b, cap, adiag, DW, dthr, drs,
                D: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                VD: tl.constexpr, VDP: tl.constexpr,
                SBQ: tl.constexpr, SBK: tl.constexpr, MODE: tl.constexpr,
                HAS_BAND: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_KEEP: tl.constexpr,
                HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
                HAS_SINKS: tl.constexpr, PREC: tl.constexpr,
                CAPS=None, SMOD: tl.constexpr = None, MMOD: tl.constexpr = None):
    """Grid (cdiv(Sq, BM), B * H): out [BM, VD] and the row statistics of one query tile:
    max [BM] to LSE[row], log_norm [BM] to LSE[B * H * Sq + row] (natural log).  scale:
    the score scale, qk_scale = scale * log2(e) (both passed: kernel arguments cost no
    registers across the loop).  Score modifiers (constexpr flags; off, the kernel is
    the plain one): SOFTCAP cap c, ALIBI slopes SLOPES [Ba, H] fp32 (batch stride sl_b)
    with adiag = alibi_diag, HAS_SINKS sinks SINKS [H] fp32 folded into the statistics
    and out in the epilogue.  Score and mask functions (programs.py; None: the built-in
    kernel): SMOD applied to the natural scores, MMOD on the partial tiles of the tile
    lists, both reading the captures CAPS (a tuple of pointers)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    hk = h // G
    out_mul = 1.0
    s_scale = scale
    # the scaled fp16 schemes: undo the operand scales (module doc)
    if PREC == "hsplit3":
        s_scale, _, _, out_mul, _, _, _ = _scale_factors(SC, b, hk, H, G, scale)
        qk_scale = s_scale * 1.4426950408889634
    i0 = pid_m * BM
    offs_mb = tl.arange(0, BM)
    offs_m = i0 + offs_mb
    offs_nb = tl.arange(0, BN)
    offs_d = tl.arange(0, DP)
    offs_dv = tl.arange(0, VDP)
    Qh = Q + b * sq_b + h * sq_h
    Kh = K + b * sk_b + hk * sk_h
    Vh = V + b * sv_b + hk * sv_h
    BI = BIAS + b * sb_b + h * sb_h
    QIDb = QID + b * sqid_b
    KIDb = KID + b * skid_b
    KMb = KM + b * skm_b + h * skm_h
    slope = _load_slope(SLOPES, b, h, sl_b, s_scale, ALIBI, not (SOFTCAP or HAS_BIAS))
    if DROPOUT:    # dropout's row words (precomputed, drop_words_kernel): once per tile
        DWr = DW + Sk + (b * H + h) * Sq
        dw = _load_words(DWr, offs_m, Sq)
    else:
        DWr = DW
        dw = 0

    q0, q1 = _load_op(Qh, i0, sq_s, Sq, offs_mb, offs_d, D, DP, True, PREC, False)  # [BM, DP]
    acc = tl.zeros([BM, VDP], dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)

    if MODE == 0:
        t0, f0, f1, t1 = _key_tile_range(i0, Sq, Sk, lo, hi, BM, BN)
        for t in range(t0, f0):
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q0, q1,
                                      Kh, Vh, sk_s, sv_s, t * BN, offs_m, offs_nb,
                                      offs_d, offs_dv, Sq, Sk, s_scale, qk_scale, lo, hi, cap, slope, adiag, dw, DWr, DW, dthr, drs, QIDb, KIDb, KMb, skm_m,
                                      skm_n, BI, sb_m, sb_n, D, DP, VD, VDP, True, HAS_BAND, HAS_DOCS,
                                      HAS_KEEP, HAS_BIAS, SOFTCAP, ALIBI, DROPOUT, PREC,
                                      b, h, CAPS, SMOD, MMOD)
        for t in range(f0, f1):
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q0, q1,
                                      Kh, Vh, sk_s, sv_s, t * BN, offs_m, offs_nb,
                                      offs_d, offs_dv, Sq, Sk, s_scale, qk_scale, lo, hi, cap, slope, adiag, dw, DWr, DW, dthr, drs, QIDb, KIDb, KMb, skm_m,
                                      skm_n, BI, sb_m, sb_n, D, DP, VD, VDP, False, HAS_BAND, HAS_DOCS,
                                      HAS_KEEP, HAS_BIAS, SOFTCAP, ALIBI, DROPOUT, PREC,
                                      b, h, CAPS, SMOD, MMOD)
        for t in range(f1, t1):
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q0, q1,
                                      Kh, Vh, sk_s, sv_s, t * BN, offs_m, offs_nb,
                                      offs_d, offs_dv, Sq, Sk, s_scale, qk_scale, lo, hi, cap, slope, adiag, dw, DWr, DW, dthr, drs, QIDb, KIDb, KMb, skm_m,
                                      skm_n, BI, sb_m, sb_n, D, DP, VD, VDP, True, HAS_BAND, HAS_DOCS,
                                      HAS_KEEP, HAS_BIAS, SOFTCAP, ALIBI, DROPOUT, PREC,
                                      b, h, CAPS, SMOD, MMOD)
    else:
        # one flat loop per list over (block, sub-tile) pairs, so that it pipelines
        row = i0 // SBQ
        cb = b * sc_b + h * sc_h + row                     # sc_b / sc_h are 0 when broadcast
        ib = b * si_b + h * si_h + row * si_r
        NSUB = SBK // BN
        n_part = tl.load(CNT + cb)
        for t in range(0, n_part * NSUB):
            start_n = tl.load(IDX + ib + t // NSUB) * SBK + (t % NSUB) * BN
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q0, q1, Kh, Vh, sk_s, sv_s, start_n,
                                      offs_m, offs_nb, offs_d, offs_dv, Sq, Sk, s_scale, qk_scale, lo, hi, cap, slope, adiag, dw, DWr, DW, dthr, drs, QIDb,
                                      KIDb, KMb, skm_m, skm_n, BI, sb_m, sb_n, D, DP, VD, VDP, True,
                                      HAS_BAND, HAS_DOCS, HAS_KEEP, HAS_BIAS, SOFTCAP,
                                      ALIBI, DROPOUT, PREC,
                                      b, h, CAPS, SMOD, MMOD)
        n_full = tl.load(FCNT + cb)
        for t in range(0, n_full * NSUB):
            start_n = tl.load(FIDX + ib + t // NSUB) * SBK + (t % NSUB) * BN
            acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q0, q1, Kh, Vh, sk_s, sv_s, start_n,
                                      offs_m, offs_nb, offs_d, offs_dv, Sq, Sk, s_scale, qk_scale, lo, hi, cap, slope, adiag, dw, DWr, DW, dthr, drs, QIDb,
                                      KIDb, KMb, skm_m, skm_n, BI, sb_m, sb_n, D, DP, VD, VDP, False,
                                      HAS_BAND, HAS_DOCS, HAS_KEEP, HAS_BIAS, SOFTCAP,
                                      ALIBI, DROPOUT, PREC,
                                      b, h, CAPS, SMOD, MMOD)

    # m_i is in natural units where a bias, a softcap or a score function made the scores
    _fwd_epilogue(acc, l_i, m_i, s_scale, out_mul, drs, O, LSE, SINKS, so_b, so_h, so_s, i0,
                  offs_mb, offs_dv, offs_m, bh, H, Sq, VD, VDP,
                  not (HAS_BIAS or SOFTCAP or SMOD is not None), HAS_SINKS, DROPOUT,
                  PREC == "hsplit3")


# ----------------------------------------------------------------------------- split-key forward
@triton.jit
def _key_tile_range_all(Sq, Sk, lo, hi, BN: tl.constexpr):
    """Key tiles of size BN seen by queries [0, Sq): all in [t0, t1), unmasked (fully
    kept and in bounds for every one of those queries) in [f0, f1)."""
    nk = (Sk + BN - 1) // BN
    t0 = _div_pos(lo, BN)
    t1 = tl.maximum(t0, tl.minimum(nk, _cdiv_pos(Sq + hi, BN)))
    f0 = _cdiv_pos(lo + Sq - 1, BN)            # j - i >= lo for the last query
    f1 = tl.minimum(_div_pos(hi + 1, BN), Sk // BN)   # j - i <= hi for query 0; in bounds
    f0 = tl.minimum(tl.maximum(f0, t0), t1)
    f1 = tl.minimum(tl.maximum(f1, f0), t1)
    return t0, f0, f1, t1


@triton.jit
def _load_packed(ptr, rows_off, valid, offs_d, D: tl.constexpr, DP: tl.constexpr):
    """Rows at element offsets rows_off [BM] of a unit-stride-last tensor -> [BM, DP]
    (0 where not valid and in the padding of D)."""
    p = ptr + rows_off[:, None] + offs_d[None, :]
    if D == DP:
        return tl.load(p, mask=valid[:, None], other=0.0)
    else:
        return tl.load(p, mask=valid[:, None] & (offs_d[None, :] < D), other=0.0)


@triton.jit
def _tile_rows(Kh, Vh, sk_p, sk_s, sv_p, sv_s, PG, tab, kst, start_n, offs_nb, Sk,
               BN: tl.constexpr, PAGE: tl.constexpr, STARTS: tl.constexpr = False):
    """The key / value rows of the key tile at start_n (a multiple of BN below Sk) as
    _fwd_tile reads them: (Kh, Vh, sk_s, sv_s) unchanged without pages (PAGE 0).  With
    pages of PAGE positions key j is row j % PAGE of page PG[tab + j // PAGE] (the
    sequence's block table row; sk_p / sv_p the page strides): where PAGE is a multiple
    of BN the tile lies in one page, whose entry is loaded once (the row bases of the
    tile's first key, strides as they are); otherwise every key row looks up its page,
    returned as row pointers ([1, BN] for the transposed key load, [BN, 1] for the
    values) with row strides 0, keys j >= Sk (past the sequence) pointing at page 0
    (their table entries are not read; their loads are masked).  STARTS: key j is
    position t = kst + j of the sequence (row t % PAGE of page PG[tab + t // PAGE]),
    every key row looking up its page (a tile may straddle two pages)."""
    if PAGE > 0:
        if STARTS:
            jr = start_n + offs_nb
            t = kst + jr
            pg = tl.load(PG + tab + t // PAGE, mask=jr < Sk, other=0).to(tl.int64)
            r = (t % PAGE).to(tl.int64)
            return (Kh + pg * sk_p + r * sk_s)[None, :], (Vh + pg * sv_p + r * sv_s)[:, None], \
                0, 0
        elif PAGE % BN == 0:
            pg = tl.load(PG + tab + start_n // PAGE).to(tl.int64)
            r = tl.cast(start_n % PAGE - start_n, tl.int64)     # _fwd_tile adds start_n rows
            return Kh + pg * sk_p + r * sk_s, Vh + pg * sv_p + r * sv_s, sk_s, sv_s
        else:
            j = start_n + offs_nb
            pg = tl.load(PG + tab + j // PAGE, mask=j < Sk, other=0).to(tl.int64)
            r = (j % PAGE).to(tl.int64)
            return (Kh + pg * sk_p + r * sk_s)[None, :], (Vh + pg * sv_p + r * sv_s)[:, None], \
                0, 0
    else:
        return Kh, Vh, sk_s, sv_s


@triton.jit
def fwd_split_kernel(Q, K, V, PACC, PST, SC, SLOPES,
                     sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s,
                     H, G, HP, Sq, Sk, qk_scale, scale, lo, hi, sl_b, cap, adiag, lplane,
                     D: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     VD: tl.constexpr, VDP: tl.constexpr, HAS_BAND: tl.constexpr,
                     SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, PREC: tl.constexpr,
                     PG=None, PAGE: tl.constexpr = 0, STARTS: tl.constexpr = False,
                     DC: tl.constexpr = 0, DVC: tl.constexpr = 0):
    """Grid (B * Hkv * G / HP, NS): the partial forward of HP query heads of one kv head
    (GQA packing: row r of the BM-row tile is query r % Sq of head hk * G + g0 + r // Sq,
    HP * Sq <= BM; the kv head's keys are loaded once for all of them) over split ``s``
    of the key tiles.  The key tiles the queries [0, Sq) see, [t0, t1) (band or none),
    are cut into NS runs of cdiv(t1 - t0, NS) tiles (the last one shorter or empty);
    program s runs the online softmax over run s with fwd_kernel's _fwd_tile (each row's
    own query position for the band and ALiBi, its own head's ALiBi slope) and writes,
    unnormalised, acc [BM, VDP] fp32 (the scaled schemes' out factor applied) to PACC
    [B * H, NS, Sq, VDP] and the run's largest kept natural score (-inf where it keeps
    none) and its sum of exp(s - max) to the two planes of PST [2, lplane = B * H * NS *
    Sq].  fwd_combine_kernel merges the runs.

    PAGE > 0: K / V are a paged cache (anyattn.paged) of pages of PAGE positions, sk_b /
    sv_b their page strides; PG int32 holds a record per sequence b, (key count
    seqlens[b] - starts[b], band lo, band hi, offset in PG of its block table row),
    then the block table rows.  Sk, lo and hi are then sequence b's (its record), adiag
    is that of a sequence of no keys (sequence b adds its key count), and key j of b is
    read through _tile_rows.  STARTS (Pages(starts=)): the word before each table row
    holds the sequence's start, key j being its position start + j.

    DC > 0 (head dims above 256): grid (B * Hkv * G / HP, NS, cdiv(VD, DVC)); q.k is
    summed over chunks of DC columns of D (_fwd_tile's DC) and program (.., .., cv)
    computes the value columns [cv * DVC, (cv + 1) * DVC) of acc (its [BM, DVC]
    accumulator is what bounds the registers), writing those of PACC; every cv runs
    the same scores, so the statistics are equal bit for bit and cv = 0 stores them."""
    pid = tl.program_id(0)
    sp = tl.program_id(1)
    NS = tl.num_programs(1)
    NG = G // HP                                # programs per kv head
    Hkv = H // G
    b = (pid // (Hkv * NG)).to(tl.int64)
    hk = ((pid // NG) % Hkv).to(tl.int64)
    g0 = (pid % NG) * HP
    out_mul = 1.0
    s_scale = scale
    if PREC == "hsplit3":
        s_scale, _, _, out_mul, _, _, _ = _scale_factors(SC, b, hk, H, G, scale)
        qk_scale = s_scale * 1.4426950408889634
    rows = tl.arange(0, BM)
    valid = rows < HP * Sq
    hrow = hk * G + g0 + tl.where(valid, rows // Sq, 0)                   # [BM] heads
    offs_m = tl.where(valid, rows % Sq, Sq)     # query positions; Sq (none) on padding rows
    offs_nb = tl.arange(0, BN)
    offs_d = tl.arange(0, DP)
    if DC == 0:
        offs_dv = tl.arange(0, VDP)
    else:
        offs_dv = tl.program_id(2) * DVC + tl.arange(0, DVC)       # absolute v columns
    if PAGE > 0:
        rec = PG + b * 4
        Sk = tl.load(rec)
        lo = tl.load(rec + 1)
        hi = tl.load(rec + 2)
        tab = tl.load(rec + 3)
        adiag = adiag + Sk
        Kh = K + hk * sk_h
        Vh = V + hk * sv_h
    else:
        tab = 0
        Kh = K + b * sk_b + hk * sk_h
        Vh = V + b * sv_b + hk * sv_h
    kst = 0
    if STARTS:
        kst = tl.load(PG + tab - 1)             # the position of key 0
    if ALIBI:      # per row: its head's slope (divided as _load_slope does)
        slope = tl.load(SLOPES + b * sl_b + hrow, mask=valid, other=0.0)
        if not SOFTCAP:
            slope = slope / s_scale
        slope = slope[:, None]
    else:
        slope = 0.0
    q_off = b * sq_b + hrow * sq_h + offs_m.to(tl.int64) * sq_s
    if DC == 0:
        q0 = _load_packed(Q, q_off, valid, offs_d, D, DP)                      # [BM, DP]
        q1 = q0
        if PREC == "hsplit3":
            q1 = _load_packed(Q + D, q_off, valid, offs_d, D, DP)
        acc = tl.zeros([BM, VDP], dtype=tl.float32)
    else:          # the rows' pointers and validity: _qk_chunks reads q chunk by chunk
        q0 = Q + q_off
        q1 = valid
        acc = tl.zeros([BM, DVC], dtype=tl.float32)
    l_i = tl.zeros([BM], dtype=tl.float32)
    m_i = tl.full([BM], float("-inf"), dtype=tl.float32)
    t0, f0, f1, t1 = _key_tile_range_all(Sq, Sk, lo, hi, BN)
    per = (t1 - t0 + NS - 1) // NS
    u0 = tl.minimum(t0 + sp * per, t1)
    u1 = tl.minimum(u0 + per, t1)
    # the run [u0, u1) in fwd_kernel's three parts: masked edge, unmasked middle, edge
    # (padding rows: q = 0, masked out of every masked tile, never stored)
    for t in range(u0, tl.minimum(f0, u1)):
        Kt, Vt, skt, svt = _tile_rows(Kh, Vh, sk_b, sk_s, sv_b, sv_s, PG, tab, kst, t * BN,
                                      offs_nb, Sk, BN, PAGE, STARTS)
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q0, q1, Kt, Vt, skt, svt, t * BN, offs_m,
                                  offs_nb, offs_d, offs_dv, Sq, Sk, s_scale, qk_scale, lo, hi,
                                  cap, slope, adiag, 0, Q, Q, 0, 1.0, Q, Q, Q, 0, 0, Q, 0, 0,
                                  D, DP, VD, VDP, True, HAS_BAND, False, False, False,
                                  SOFTCAP, ALIBI, False, PREC, b, hk, None, None, None, DC)
    for t in range(tl.maximum(f0, u0), tl.minimum(f1, u1)):
        Kt, Vt, skt, svt = _tile_rows(Kh, Vh, sk_b, sk_s, sv_b, sv_s, PG, tab, kst, t * BN,
                                      offs_nb, Sk, BN, PAGE, STARTS)
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q0, q1, Kt, Vt, skt, svt, t * BN, offs_m,
                                  offs_nb, offs_d, offs_dv, Sq, Sk, s_scale, qk_scale, lo, hi,
                                  cap, slope, adiag, 0, Q, Q, 0, 1.0, Q, Q, Q, 0, 0, Q, 0, 0,
                                  D, DP, VD, VDP, False, HAS_BAND, False, False, False,
                                  SOFTCAP, ALIBI, False, PREC, b, hk, None, None, None, DC)
    for t in range(tl.maximum(f1, u0), u1):
        Kt, Vt, skt, svt = _tile_rows(Kh, Vh, sk_b, sk_s, sv_b, sv_s, PG, tab, kst, t * BN,
                                      offs_nb, Sk, BN, PAGE, STARTS)
        acc, l_i, m_i = _fwd_tile(acc, l_i, m_i, q0, q1, Kt, Vt, skt, svt, t * BN, offs_m,
                                  offs_nb, offs_d, offs_dv, Sq, Sk, s_scale, qk_scale, lo, hi,
                                  cap, slope, adiag, 0, Q, Q, 0, 1.0, Q, Q, Q, 0, 0, Q, 0, 0,
                                  D, DP, VD, VDP, True, HAS_BAND, False, False, False,
                                  SOFTCAP, ALIBI, False, PREC, b, hk, None, None, None, DC)
    if SOFTCAP:
        run_max = m_i                      # natural units already
    else:
        run_max = m_i * s_scale            # = the largest fl(q.k * scale) of the run
    run_max = tl.where(l_i == 0.0, float("-inf"), run_max)
    if PREC == "hsplit3":
        acc = acc * out_mul
    prow = ((b * H + hrow) * NS + sp) * Sq + offs_m                          # [BM]
    tl.store(PACC + prow[:, None] * VDP + offs_dv[None, :], acc, mask=valid[:, None])
    if DC == 0:
        tl.store(PST + prow, run_max, mask=valid)
        tl.store(PST + lplane + prow, l_i, mask=valid)
    else:
        first = valid & (tl.program_id(2) == 0)
        tl.store(PST + prow, run_max, mask=first)
        tl.store(PST + lplane + prow, l_i, mask=first)


@triton.jit
def fwd_combine_kernel(PACC, PST, O, LSE, SINKS, so_b, so_h, so_s, H, Sq, NS,
                       BM: tl.constexpr, VD: tl.constexpr, VDP: tl.constexpr,
                       HAS_SINKS: tl.constexpr):
    """Grid (cdiv(Sq, BM), B * H): merges the NS partials of fwd_split_kernel, in the
    order s = 0, 1, .., NS - 1 (the same bits for any schedule of the split programs),
    into out [BM, VD] and the row statistics with fwd_kernel's epilogue, _fwd_epilogue
    (max, log_norm natural, to LSE [2, B * H * Sq]; sinks folded in; empty rows out 0,
    max -inf, log_norm 0; NaN rows NaN): M = max_s m_s, l = sum_s l_s e^(m_s - M), out =
    sum_s acc_s e^(m_s - M) / l."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    offs_m = pid_m * BM + tl.arange(0, BM)
    offs_dv = tl.arange(0, VDP)
    inb = offs_m < Sq
    base = bh.to(tl.int64) * NS * Sq + offs_m                                 # [BM]
    lplane = tl.num_programs(1).to(tl.int64) * NS * Sq
    mx = tl.full([BM], float("-inf"), dtype=tl.float32)
    for s in range(0, NS):
        mx = tl.maximum(mx, tl.load(PST + base + s * Sq, mask=inb, other=float("-inf")))
    m_use = tl.where(mx == float("-inf"), 0.0, mx)
    l_i = tl.zeros([BM], dtype=tl.float32)
    acc = tl.zeros([BM, VDP], dtype=tl.float32)
    for s in range(0, NS):
        prow = base + s * Sq
        w = tl.math.exp2((tl.load(PST + prow, mask=inb, other=float("-inf")) - m_use)
                         * 1.4426950408889634)                    # 0 for an empty run
        l_i = l_i + tl.load(PST + lplane + prow, mask=inb, other=0.0) * w
        a = tl.load(PACC + prow[:, None] * VDP + offs_dv[None, :], mask=inb[:, None],
                    other=0.0)
        acc = acc + a * w[:, None]
    _fwd_epilogue(acc, l_i, mx, 1.0, 1.0, 1.0, O, LSE, SINKS, so_b, so_h, so_s, 0,
                  offs_m.to(tl.int64), offs_dv, offs_m, bh, H, Sq, VD, VDP, False, HAS_SINKS,
                  False, False)


@triton.jit
def page_records_kernel(PG, TABLE, SEQLENS, STARTS, st_b, st_m, B, M, lo0, lo_s, hi0, hi_s,
                        HAS_LO: tl.constexpr, HAS_HI: tl.constexpr, STARTS_ON: tl.constexpr,
                        BLOCK: tl.constexpr):
    """Grid (B,): fwd_split_kernel's PG buffer (PAGE > 0) from tables that stay on the
    device (Pages(on_device=True)).  Program b reads seqlens SEQLENS[b], the start
    STARTS[b] (STARTS_ON; else 0) and the table row TABLE[b, :M] (strides st_b, st_m; any
    integer dtype) and writes sequence b's record at PG[4 b:4 b + 4]: its key count n =
    seqlens - start, band lo = lo0 + lo_s * n (-BIG without HAS_LO), hi = hi0 + hi_s * n
    (BIG without HAS_HI), each clamped to [-BIG, BIG], and the offset of its table row,
    then that row (preceded by the start with STARTS_ON) at PG[4 B + b W + (W - M)], W =
    M (+ 1 with STARTS_ON): the layout forward.forward_paged uploads for host tables."""
    b = tl.program_id(0)
    big = 1073741824                                 # tiles.BIG
    extra = 1 if STARTS_ON else 0
    W = M + extra
    end = tl.load(SEQLENS + b).to(tl.int64)
    start = tl.zeros([], dtype=tl.int64)
    if STARTS_ON:
        start = tl.load(STARTS + b).to(tl.int64)
    n = end - start
    lo = tl.full([], -big, tl.int64)
    if HAS_LO:
        lo = tl.minimum(tl.maximum(lo0 + lo_s * n, -big), big)
    hi = tl.full([], big, tl.int64)
    if HAS_HI:
        hi = tl.minimum(tl.maximum(hi0 + hi_s * n, -big), big)
    row = (B * 4 + b * W).to(tl.int64)
    i4 = tl.arange(0, 4)
    rec = tl.where(i4 == 0, n, tl.where(i4 == 1, lo, tl.where(i4 == 2, hi, row + extra)))
    tl.store(PG + b * 4 + i4, rec.to(tl.int32))
    if STARTS_ON:
        tl.store(PG + row, start.to(tl.int32))
    cols = tl.arange(0, BLOCK)
    for m0 in range(0, M, BLOCK):
        c = m0 + cols
        t = tl.load(TABLE + b.to(tl.int64) * st_b + c.to(tl.int64) * st_m, mask=c < M, other=0)
        tl.store(PG + row + extra + c, t.to(tl.int32), mask=c < M)


# ----------------------------------------------------------------------------- backward
@triton.jit
def bwd_pre_kernel(O, DO, MX, LN, DELTA, L2, SINKS, DSR, so_b, so_h, so_s, sdo_b, sdo_h, sdo_s,
                    H, Sq, D: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr,
                    HAS_SINKS: tl.constexpr):
    """Grid (cdiv(Sq, BM), B * H): delta = <dout, out> [BM] to DELTA [B * H * Sq] (D, DP:
    out's and dout's head dim, v's, and its padding); the row
    statistics max MX and log_norm LN [B * H * Sq] to L2 [B * H, 2, Sq]: max (+inf where
    it is -inf, an empty row: p = 0 there) and log2(e) * log_norm, all fp32.  HAS_SINKS:
    each row's term of dsinks, -exp((sink - max) - log_norm) * delta (0 where max or the
    sink is -inf), to DSR [B * H * Sq] (summed by the launcher, in a fixed order)."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    i0 = pid_m * BM
    offs_mb = tl.arange(0, BM)
    offs_d = tl.arange(0, DP)
    o = _load_rows(O + b * so_b + h * so_h, i0, so_s, Sq, offs_mb, offs_d, D, DP, True)
    do = _load_rows(DO + b * sdo_b + h * sdo_h, i0, sdo_s, Sq, offs_mb, offs_d, D, DP, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)                   # [BM]
    offs_m = i0 + offs_mb
    inb = offs_m < Sq
    row = bh.to(tl.int64) * Sq + offs_m
    mx = tl.load(MX + row, mask=inb, other=0.0)
    ln = tl.load(LN + row, mask=inb, other=0.0)
    if HAS_SINKS:
        snk = tl.load(SINKS + h)                 # a -inf sink gives exp2(-inf) = 0
        fin = mx != float("-inf")
        ms = tl.where(fin, mx, 0.0)
        p_sink = tl.where(fin, tl.math.exp2(((snk - ms) - ln) * 1.4426950408889634), 0.0)
        tl.store(DSR + row, -(p_sink * delta), mask=inb)
    mx = tl.where(mx == float("-inf"), float("inf"), mx)
    ln2 = ln * 1.4426950408889634
    tl.store(DELTA + row, delta, mask=inb)
    l2p = L2 + bh.to(tl.int64) * (2 * Sq) + offs_m
    tl.store(l2p, mx, mask=inb)
    tl.store(l2p + Sq, ln2, mask=inb)


@triton.jit
def _dkdv_tile(dk, dv, cacc, k0, k1, v0, v1,
               Qh, DOh, sq_s, sdo_s, L2h, DLh, start_m, offs_n, offs_mb, offs_d, offs_dv,
               Sq, Sk, s_scale, mvo, gam, lo, hi, cap, slope, adiag, dw, DWr, DW, dthr, drs,
               QID, KID, KM, skm_m, skm_n, BI, sb_m, sb_n,
               D: tl.constexpr, DP: tl.constexpr, VD: tl.constexpr, VDP: tl.constexpr,
               MASKED: tl.constexpr,
               HAS_BAND: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_KEEP: tl.constexpr,
               HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
               PREC: tl.constexpr, b, h, CAPS, SMOD: tl.constexpr, MMOD: tl.constexpr,
               DCS=None, dslot=None, dcs_g=None, DCAP: tl.constexpr = None,
               BM: tl.constexpr = None, BN: tl.constexpr = None, NCP: tl.constexpr = 0):
    """One query tile's contribution to dk [BN, DP], dv [BN, VDP] of one key tile (L2h: this head's
    [2, Sq] row statistics, module doc).  DCAP (generated: programs.dcap_source): the
    tile's terms dS' * d score_mod / d capture, summed per read into slot
    dslot + start_m // BM of the read's region of DCS (one slot per (b, h, key tile,
    query tile): no slot is written twice), or, for a column read, into its column of
    cacc [BN, NCP] (fp64; returned, unchanged without DCAP)."""
    offs_m = start_m + offs_mb
    qT0, qT1 = _load_op(Qh, start_m, sq_s, Sq, offs_mb, offs_d, D, DP,
                             MASKED, PREC, True)  # [DP, BM]
    if MASKED:
        mx = tl.load(L2h + offs_m, mask=offs_m < Sq, other=float("inf"))       # [BM]
        ln2 = tl.load(L2h + Sq + offs_m, mask=offs_m < Sq, other=0.0)          # [BM]
    else:
        mx = tl.load(L2h + offs_m)
        ln2 = tl.load(L2h + Sq + offs_m)
    if HAS_BIAS:   # issued before the product, to overlap it
        bT = _load_bias_t(BI, sb_m, sb_n, offs_n, offs_m, Sq, Sk, MASKED)         # [BN, BM]
    else:
        bT = 0.0
    if MASKED:     # (its id / keep-mask loads too)
        keep = _keep_t(offs_n, offs_m, Sq, Sk, lo, hi, QID, KID, KM, skm_m, skm_n,
                       HAS_BAND, HAS_DOCS, HAS_KEEP)                              # [BN, BM]
        if MMOD is not None:   # a mask function (partial tiles only; programs.py)
            keep = MMOD(b, h, offs_m[None, :], offs_n[:, None], keep, CAPS)
    sT = _dotp(k0, k1, qT0, qT1, PREC)               # [BN, BM] raw
    if SMOD is not None:   # a score function and its derivative (programs.score_grad)
        sT, dtT = _mod_scores(sT, s_scale, 0.0, cap, slope, offs_m, offs_n, adiag,
                              False, SOFTCAP, False, True)
        s_in = sT                                             # the function's input
        sT, dsmT = SMOD(sT, b, h, offs_m[None, :], offs_n[:, None],
                        (offs_m < Sq)[None, :] & (offs_n < Sk)[:, None], CAPS)
        if HAS_BIAS:
            sT = sT + bT
    elif SOFTCAP or (ALIBI and HAS_BIAS):
        sT, dtT = _mod_scores(sT, s_scale, bT, cap, slope, offs_m, offs_n, adiag,
                              HAS_BIAS, SOFTCAP, ALIBI, True)
    elif HAS_BIAS:
        sT = tl.fma(sT, s_scale, bT)                          # natural scores
    else:
        if ALIBI:
            sT = _raw_alibi(sT, slope, offs_m, offs_n, adiag, True)
        sT = tl.fma(sT, s_scale, 0.0)    # (an fma: never contracted into the next line)
    pT = tl.math.exp2((sT - mx[None, :]) * 1.4426950408889634 - ln2[None, :])  # [BN, BM]
    if MASKED:
        pT = tl.where(keep, pT, 0.0)
    do0, do1 = _load_op(DOh, start_m, sdo_s, Sq, offs_mb, offs_dv, VD, VDP,
                             MASKED, PREC, False)  # [BM, VDP]
    if DROPOUT:    # dv = (P o keep)^T.dout / (1 - p) (scaled at the end)
        dkeep = _drop_keep(_load_words(DWr, offs_m, Sq), dw, dthr, True)
        pT0, pT1 = _op_parts(tl.where(dkeep, pT, 0.0), PS_BWD, do0, PREC)
    else:
        pT0, pT1 = _op_parts(pT, PS_BWD, do0, PREC)
    dv += _dotp(pT0, pT1, do0, do1, PREC)          # [BN, VDP]
    if MASKED:
        dlt = tl.load(DLh + offs_m, mask=offs_m < Sq, other=0.0)
    else:
        dlt = tl.load(DLh + offs_m)
    dpT = _dotp(v0, v1, tl.trans(do0), tl.trans(do1), PREC)  # [BN, BM]
    if PREC == "hsplit3":
        dpT = dpT * mvo
    if DROPOUT:    # dS = P o (dP o keep / (1 - p) - delta)
        dpT = tl.where(dkeep, dpT * drs, 0.0)
    dsT = pT * (dpT - dlt[None, :])
    if DCAP is not None:   # dsT: the gradient of the function's output (kept pairs only)
        if MASKED:
            dkept = keep
        else:
            dkept = (offs_m < Sq)[None, :] & (offs_n < Sk)[:, None]
        if start_m < Sq:   # (a mask block's last sub-tiles may lie past Sq: no slot)
            cacc = DCAP(dsT, s_in, b, h, offs_m[None, :], offs_n[:, None], dkept, CAPS, DCS,
                        dslot + start_m // BM, dcs_g, cacc, BN, BM, NCP)
    if SMOD is not None:
        if MASKED:   # (0, not 0 * inf, where the function's slope is not finite)
            dsT = tl.where(keep, dsT * dsmT, 0.0)             # through the score function
        else:
            dsT = dsT * dsmT
    if SOFTCAP:
        dsT = dsT * dtT                                       # through c tanh(x / c)
    ds0, ds1 = _op_parts(dsT, gam, qT0, PREC)
    dk += _dotp(ds0, ds1, tl.trans(qT0), tl.trans(qT1), PREC)  # [BN, DP]
    return dk, dv, cacc


@triton.jit
def _dkdv_program(pid_n, b, hk, Q, K, V, DO, L2, DELTA, DK, DV, BIAS, QID, KID, KM,
                  CNT, IDX, FCNT, FIDX, SC, SLOPES,
                  sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sdo_b, sdo_h, sdo_s,
                  sdk_b, sdk_h, sdk_s, sdv_b, sdv_h, sdv_s,
                  sb_b, sb_h, sb_m, sb_n, sqid_b, skid_b, skm_b, skm_h, skm_m, skm_n,
                  sc_b, sc_h, si_b, si_h, si_r,
                  H, G, Sq, Sk, scale, lo, hi, sl_b, cap, adiag, DW, dthr, drs,
                  D: tl.constexpr, DP: tl.constexpr, VD: tl.constexpr, VDP: tl.constexpr,
                  BM: tl.constexpr, BN: tl.constexpr,
                  SBQ: tl.constexpr, SBK: tl.constexpr, MODE: tl.constexpr,
                  HAS_BAND: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_KEEP: tl.constexpr,
                  HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
                  PREC: tl.constexpr, CAPS, SMOD: tl.constexpr, MMOD: tl.constexpr,
                  DCS=None, dcs_g=None, DCAP: tl.constexpr = None, DCOL=None,
                  NCP: tl.constexpr = 0, B0=0):
    """dk [BN, D], dv [BN, VD] of key tile pid_n of kv head hk in batch b (int64), summed over
    the G query heads of the group and over every query tile.  DCAP: capture gradient
    slots into DCS (regions of dcs_g = B * H * cdiv(Sk, BN) * cdiv(Sq, BM) slots times a
    slot width, capture_grads.py; _dkdv_tile) and, with NCP > 0, per query head the
    column reads' sums over every query tile into DCOL [B * H, Sk, NCP] (fp64); both
    indexed from batch B0 (a batch chunk's first: B there is the chunk's)."""
    mvo = 1.0
    gam = 1.0
    s_scale = scale
    dk_mul = scale
    dv_mul = 1.0
    # the scaled fp16 schemes: undo the operand scales (module doc)
    if PREC == "hsplit3":
        s_scale, mvo, gam, _, dv_mul, dk_mul, _ = _scale_factors(SC, b, hk, H, G, scale)
    j0 = pid_n * BN
    offs_nb = tl.arange(0, BN)
    offs_n = j0 + offs_nb
    offs_mb = tl.arange(0, BM)
    offs_d = tl.arange(0, DP)
    offs_dv = tl.arange(0, VDP)
    if DROPOUT:    # dropout's column words (precomputed): once per key tile
        dw = _load_words(DW, offs_n, Sk)
    else:
        dw = 0
    k0, k1 = _load_op(K + b * sk_b + hk * sk_h, j0, sk_s, Sk, offs_nb, offs_d, D, DP,
                          True, PREC, False)                                          # [BN, DP]
    v0, v1 = _load_op(V + b * sv_b + hk * sv_h, j0, sv_s, Sk, offs_nb, offs_dv, VD, VDP,
                          True, PREC, False)                                          # [BN, VDP]
    dk = tl.zeros([BN, DP], dtype=tl.float32)
    dv = tl.zeros([BN, VDP], dtype=tl.float32)
    QIDb = QID + b * sqid_b
    KIDb = KID + b * skid_b
    for g in range(0, G):
        h = hk * G + g
        Qh = Q + b * sq_b + h * sq_h
        DOh = DO + b * sdo_b + h * sdo_h
        bh = b * H + h
        L2h = L2 + bh * (2 * Sq)
        DLh = DELTA + bh * Sq
        BI = BIAS + b * sb_b + h * sb_h
        KMb = KM + b * skm_b + h * skm_h
        slope = _load_slope(SLOPES, b, h, sl_b, s_scale, ALIBI, not (SOFTCAP or HAS_BIAS))
        if DROPOUT:
            DWr = DW + Sk + bh * Sq                # this head's row words
        else:
            DWr = DW
        if DCAP is not None:                       # this (b, h, key tile)'s first slot
            bhc = (b - B0) * H + h                 # (b, h) within the batch chunk
            dslot = (bhc * ((Sk + BN - 1) // BN) + pid_n) * ((Sq + BM - 1) // BM)
        else:
            dslot = None
        if NCP > 0:                                # the column reads' sums of this head
            cacc = tl.zeros([BN, NCP], dtype=tl.float64)
        else:                                      # (passed through untouched)
            cacc = tl.zeros([1], dtype=tl.float32)
        if MODE == 0:
            s0, g0, g1, s1 = _query_tile_range(j0, Sq, Sk, lo, hi, BM, BN)
            for t in range(s0, g0):
                dk, dv, cacc = _dkdv_tile(dk, dv, cacc, k0, k1, v0, v1,
                                          Qh, DOh, sq_s, sdo_s, L2h, DLh, t * BM, offs_n,
                                          offs_mb, offs_d, offs_dv, Sq, Sk, s_scale, mvo, gam, lo, hi, cap, slope, adiag, dw, DWr, DW, dthr, drs, QIDb, KIDb, KMb,
                                          skm_m, skm_n, BI, sb_m, sb_n, D, DP, VD, VDP, True, HAS_BAND,
                                          HAS_DOCS, HAS_KEEP, HAS_BIAS, SOFTCAP, ALIBI, DROPOUT, PREC,
                                          b, h, CAPS, SMOD, MMOD, DCS, dslot, dcs_g, DCAP,
                                          BM, BN, NCP)
            for t in range(g0, g1):
                dk, dv, cacc = _dkdv_tile(dk, dv, cacc, k0, k1, v0, v1,
                                          Qh, DOh, sq_s, sdo_s, L2h, DLh, t * BM, offs_n,
                                          offs_mb, offs_d, offs_dv, Sq, Sk, s_scale, mvo, gam, lo, hi, cap, slope, adiag, dw, DWr, DW, dthr, drs, QIDb, KIDb, KMb,
                                          skm_m, skm_n, BI, sb_m, sb_n, D, DP, VD, VDP, False, HAS_BAND,
                                          HAS_DOCS, HAS_KEEP, HAS_BIAS, SOFTCAP, ALIBI, DROPOUT, PREC,
                                          b, h, CAPS, SMOD, MMOD, DCS, dslot, dcs_g, DCAP,
                                          BM, BN, NCP)
            for t in range(g1, s1):
                dk, dv, cacc = _dkdv_tile(dk, dv, cacc, k0, k1, v0, v1,
                                          Qh, DOh, sq_s, sdo_s, L2h, DLh, t * BM, offs_n,
                                          offs_mb, offs_d, offs_dv, Sq, Sk, s_scale, mvo, gam, lo, hi, cap, slope, adiag, dw, DWr, DW, dthr, drs, QIDb, KIDb, KMb,
                                          skm_m, skm_n, BI, sb_m, sb_n, D, DP, VD, VDP, True, HAS_BAND,
                                          HAS_DOCS, HAS_KEEP, HAS_BIAS, SOFTCAP, ALIBI, DROPOUT, PREC,
                                          b, h, CAPS, SMOD, MMOD, DCS, dslot, dcs_g, DCAP,
                                          BM, BN, NCP)
        else:
            # one flat loop per list over (block, sub-tile) pairs, so that it pipelines
            col = j0 // SBK
            cb = b * sc_b + h * sc_h + col
            ib = b * si_b + h * si_h + col * si_r
            NSUB = SBQ // BM
            n_part = tl.load(CNT + cb)
            for t in range(0, n_part * NSUB):
                start_m = tl.load(IDX + ib + t // NSUB) * SBQ + (t % NSUB) * BM
                dk, dv, cacc = _dkdv_tile(dk, dv, cacc, k0, k1, v0, v1,
                                          Qh, DOh, sq_s, sdo_s, L2h, DLh, start_m,
                                          offs_n, offs_mb, offs_d, offs_dv, Sq, Sk, s_scale, mvo, gam, lo, hi, cap, slope, adiag, dw, DWr, DW, dthr, drs, QIDb,
                                          KIDb, KMb, skm_m, skm_n, BI, sb_m, sb_n, D, DP, VD, VDP, True,
                                          HAS_BAND, HAS_DOCS, HAS_KEEP, HAS_BIAS, SOFTCAP,
                                          ALIBI, DROPOUT, PREC,
                                          b, h, CAPS, SMOD, MMOD, DCS, dslot, dcs_g, DCAP,
                                          BM, BN, NCP)
            n_full = tl.load(FCNT + cb)
            for t in range(0, n_full * NSUB):
                start_m = tl.load(FIDX + ib + t // NSUB) * SBQ + (t % NSUB) * BM
                dk, dv, cacc = _dkdv_tile(dk, dv, cacc, k0, k1, v0, v1,
                                          Qh, DOh, sq_s, sdo_s, L2h, DLh, start_m,
                                          offs_n, offs_mb, offs_d, offs_dv, Sq, Sk, s_scale, mvo, gam, lo, hi, cap, slope, adiag, dw, DWr, DW, dthr, drs, QIDb,
                                          KIDb, KMb, skm_m, skm_n, BI, sb_m, sb_n, D, DP, VD, VDP, False,
                                          HAS_BAND, HAS_DOCS, HAS_KEEP, HAS_BIAS, SOFTCAP,
                                          ALIBI, DROPOUT, PREC,
                                          b, h, CAPS, SMOD, MMOD, DCS, dslot, dcs_g, DCAP,
                                          BM, BN, NCP)
        if NCP > 0:
            _dcap_cols_store(DCOL, cacc, bhc, Sk, offs_n, NCP)
    if PREC == "hsplit3":
        dv = dv * dv_mul
    if DROPOUT:
        dv = dv * drs                      # 1 / (1 - p)
    dk = dk * dk_mul
    inb = offs_n < Sk
    dk_ptrs = DK + b * sdk_b + hk * sdk_h + j0.to(tl.int64) * sdk_s + offs_nb[:, None] * sdk_s + offs_d[None, :]
    dv_ptrs = DV + b * sdv_b + hk * sdv_h + j0.to(tl.int64) * sdv_s + offs_nb[:, None] * sdv_s + offs_dv[None, :]
    if D == DP:
        msk = inb[:, None]
    else:
        msk = inb[:, None] & (offs_d[None, :] < D)
    if VD == VDP:
        msk_v = inb[:, None]
    else:
        msk_v = inb[:, None] & (offs_dv[None, :] < VD)
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=msk)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=msk_v)


@triton.jit
def dkdv_kernel(Q, K, V, DO, L2, DELTA, DK, DV, BIAS, QID, KID, KM, CNT, IDX, FCNT, FIDX, SC,
                 SLOPES,
                 sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sdo_b, sdo_h, sdo_s,
                 sdk_b, sdk_h, sdk_s, sdv_b, sdv_h, sdv_s,
                 sb_b, sb_h, sb_m, sb_n, sqid_b, skid_b, skm_b, skm_h, skm_m, skm_n,
                 sc_b, sc_h, si_b, si_h, si_r,
                 H, HKV, G, Sq, Sk, scale, lo, hi, sl_b, cap, adiag, DW, dthr, drs,
                 D: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                 VD: tl.constexpr, VDP: tl.constexpr,
                 SBQ: tl.constexpr, SBK: tl.constexpr, MODE: tl.constexpr,
                 HAS_BAND: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_KEEP: tl.constexpr,
                 HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr,
                 PREC: tl.constexpr,
                 CAPS=None, SMOD: tl.constexpr = None, MMOD: tl.constexpr = None,
                 DCS=None, dcs_g=None, DCAP: tl.constexpr = None, DCOL=None,
                 NCP: tl.constexpr = 0, B0=0):
    """Grid (cdiv(Sk, BN), B * HKV): dk, dv of one key tile (no atomics); with DCAP also
    the capture gradient slots of its tiles and its column sums (_dkdv_program), for
    the batches B0, B0 + 1, ... (a batch chunk: the grid's B; its slots from 0)."""
    bhk = tl.program_id(1)
    b = (bhk // HKV).to(tl.int64)
    if DCAP is not None:
        b = b + B0
    _dkdv_program(tl.program_id(0), b, (bhk % HKV).to(tl.int64),
                  Q, K, V, DO, L2, DELTA, DK, DV, BIAS, QID, KID, KM, CNT, IDX, FCNT, FIDX, SC,
                  SLOPES,
                  sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sdo_b, sdo_h, sdo_s,
                  sdk_b, sdk_h, sdk_s, sdv_b, sdv_h, sdv_s,
                  sb_b, sb_h, sb_m, sb_n, sqid_b, skid_b, skm_b, skm_h, skm_m, skm_n,
                  sc_b, sc_h, si_b, si_h, si_r, H, G, Sq, Sk, scale, lo, hi, sl_b, cap, adiag, DW, dthr, drs,
                  D, DP, VD, VDP, BM, BN, SBQ, SBK, MODE, HAS_BAND, HAS_DOCS, HAS_KEEP,
                  HAS_BIAS, SOFTCAP, ALIBI, DROPOUT, PREC, CAPS, SMOD, MMOD, DCS, dcs_g, DCAP,
                  DCOL, NCP, B0)


@triton.jit
def _dq_tile(dq, q0, q1, do0, do1,
             mx, ln2, dlt, Kh, Vh, sk_s, sv_s, start_n, offs_m, offs_nb, offs_d, offs_dv,
             Sq, Sk, s_scale, mvo, gam, lo, hi, cap, slope, adiag, dw, DWr, DW, dthr, drs,
             QID, KID, KM, skm_m, skm_n, BI, sb_m, sb_n, DB, sdb_m, sdb_n,
             db_add,
             D: tl.constexpr, DP: tl.constexpr, VD: tl.constexpr, VDP: tl.constexpr,
             MASKED: tl.constexpr,
             HAS_BAND: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_KEEP: tl.constexpr,
             HAS_BIAS: tl.constexpr, WRITE_DB: tl.constexpr, DB_ACC: tl.constexpr,
             SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, PREC: tl.constexpr,
             b, h, CAPS, SMOD: tl.constexpr, MMOD: tl.constexpr):
    """One key tile's contribution to dq [BM, DP]; with WRITE_DB also dS to the dbias
    tile (DB_ACC: added to what is there when db_add != 0, a broadcast bias's sum)."""
    offs_n = start_n + offs_nb
    kT0, kT1 = _load_op(Kh, start_n, sk_s, Sk, offs_nb, offs_d, D, DP,
                             MASKED, PREC, True)  # [DP, BN]
    vT0, vT1 = _load_op(Vh, start_n, sv_s, Sk, offs_nb, offs_dv, VD, VDP,
                             MASKED, PREC, True)  # [VDP, BN]
    # loads that feed no product are issued first, so that they overlap the products
    if HAS_BIAS:
        bt = _load_bias(BI, sb_m, sb_n, offs_m, offs_n, Sq, Sk, MASKED)           # [BM, BN]
    else:
        bt = 0.0
    if WRITE_DB:
        db_ptrs = DB + offs_m.to(tl.int64)[:, None] * sdb_m + offs_n.to(tl.int64)[None, :] * sdb_n
        inb = (offs_m[:, None] < Sq) & (offs_n[None, :] < Sk)
        if DB_ACC:   # this program wrote the tile before (earlier batch / head): add to it
            db_old = tl.load(db_ptrs, mask=inb & (db_add != 0), other=0.0).to(tl.float32)
    if MASKED:
        keep = _keep(offs_m, offs_n, Sq, Sk, lo, hi, QID, KID, KM, skm_m, skm_n,
                     HAS_BAND, HAS_DOCS, HAS_KEEP)                                # [BM, BN]
        if MMOD is not None:   # a mask function (partial tiles only; programs.py)
            keep = MMOD(b, h, offs_m[:, None], offs_n[None, :], keep, CAPS)
    s = _dotp(q0, q1, kT0, kT1, PREC)               # [BM, BN] raw
    if SMOD is not None:   # a score function and its derivative (programs.score_grad)
        s, dt = _mod_scores(s, s_scale, 0.0, cap, slope, offs_m, offs_n, adiag,
                            False, SOFTCAP, False, False)
        s, dsm = SMOD(s, b, h, offs_m[:, None], offs_n[None, :],
                      (offs_m < Sq)[:, None] & (offs_n < Sk)[None, :], CAPS)
        if HAS_BIAS:
            s = s + bt
    elif SOFTCAP or (ALIBI and HAS_BIAS):
        s, dt = _mod_scores(s, s_scale, bt, cap, slope, offs_m, offs_n, adiag,
                            HAS_BIAS, SOFTCAP, ALIBI, False)
    elif HAS_BIAS:
        s = tl.fma(s, s_scale, bt)                            # natural scores
    else:
        if ALIBI:
            s = _raw_alibi(s, slope, offs_m, offs_n, adiag, False)
        s = tl.fma(s, s_scale, 0.0)      # (an fma: never contracted into the next line)
    p = tl.math.exp2((s - mx[:, None]) * 1.4426950408889634 - ln2[:, None])
    if MASKED:
        p = tl.where(keep, p, 0.0)
    dp = _dotp(do0, do1, vT0, vT1, PREC)            # [BM, BN]
    if PREC == "hsplit3":
        dp = dp * mvo
    if DROPOUT:    # dS = P o (dP o keep / (1 - p) - delta)
        dp = tl.where(_drop_keep(dw, _load_words(DW, offs_n, Sk), dthr, False), dp * drs, 0.0)
    ds = p * (dp - dlt[:, None])
    if WRITE_DB:
        db = ds
        if DB_ACC:
            db += db_old
        if MASKED:
            tl.store(db_ptrs, db.to(DB.dtype.element_ty), mask=inb)
        else:
            tl.store(db_ptrs, db.to(DB.dtype.element_ty))
    if SMOD is not None:
        if MASKED:   # (0, not 0 * inf, where the function's slope is not finite)
            ds = tl.where(keep, ds * dsm, 0.0)                # through the score function
        else:
            ds = ds * dsm
    if SOFTCAP:
        ds = ds * dt                                          # through c tanh(x / c)
    ds0, ds1 = _op_parts(ds, gam, kT0, PREC)
    dq += _dotp(ds0, ds1, tl.trans(kT0), tl.trans(kT1), PREC)  # [BM, DP]
    return dq


@triton.jit
def _dq_program(pid_m, b, h, Q, K, V, DO, L2, DELTA, DQ, BIAS, DB, QID, KID, KM,
                CNT, IDX, FCNT, FIDX, SC, SLOPES,
                sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sdo_b, sdo_h, sdo_s,
                sdq_b, sdq_h, sdq_s, sb_b, sb_h, sb_m, sb_n, sdb_b, sdb_h, sdb_m, sdb_n,
                sqid_b, skid_b, skm_b, skm_h, skm_m, skm_n, sc_b, sc_h, si_b, si_h, si_r,
                H, G, Sq, Sk, scale, lo, hi, sl_b, cap, adiag, DW, dthr, drs, db_add,
                D: tl.constexpr, DP: tl.constexpr, VD: tl.constexpr, VDP: tl.constexpr,
                BM: tl.constexpr, BN: tl.constexpr,
                SBQ: tl.constexpr, SBK: tl.constexpr, MODE: tl.constexpr,
                HAS_BAND: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_KEEP: tl.constexpr,
                HAS_BIAS: tl.constexpr, WRITE_DB: tl.constexpr, DB_ACC: tl.constexpr,
                SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, PREC: tl.constexpr,
                CAPS, SMOD: tl.constexpr, MMOD: tl.constexpr):
    """dq [BM, D] of query tile pid_m of head h in batch b (int64) over every key tile
    (and its dS rows into DB, see _dq_tile)."""
    hk = h // G
    bh = b * H + h
    mvo = 1.0
    gam = 1.0
    s_scale = scale
    dq_mul = scale
    # the scaled fp16 schemes: undo the operand scales (module doc)
    if PREC == "hsplit3":
        s_scale, mvo, gam, _, _, _, dq_mul = _scale_factors(SC, b, hk, H, G, scale)
    i0 = pid_m * BM
    offs_mb = tl.arange(0, BM)
    offs_m = i0 + offs_mb
    offs_nb = tl.arange(0, BN)
    offs_d = tl.arange(0, DP)
    offs_dv = tl.arange(0, VDP)
    q0, q1 = _load_op(Q + b * sq_b + h * sq_h, i0, sq_s, Sq, offs_mb, offs_d, D, DP,
                          True, PREC, False)                                          # [BM, DP]
    do0, do1 = _load_op(DO + b * sdo_b + h * sdo_h, i0, sdo_s, Sq, offs_mb, offs_dv, VD,
                             VDP, True, PREC, False)                                  # [BM, VDP]
    row = bh * Sq + offs_m
    l2p = L2 + bh * (2 * Sq) + offs_m
    mx = tl.load(l2p, mask=offs_m < Sq, other=float("inf"))                  # [BM]
    ln2 = tl.load(l2p + Sq, mask=offs_m < Sq, other=0.0)                      # [BM]
    dlt = tl.load(DELTA + row, mask=offs_m < Sq, other=0.0)
    if DROPOUT:    # dropout's row words (precomputed): once per query tile
        DWr = DW + Sk + bh * Sq
        dw = _load_words(DWr, offs_m, Sq)
    else:
        DWr = DW
        dw = 0
    Kh = K + b * sk_b + hk * sk_h
    Vh = V + b * sv_b + hk * sv_h
    BI = BIAS + b * sb_b + h * sb_h
    DBh = DB + b * sdb_b + h * sdb_h
    slope = _load_slope(SLOPES, b, h, sl_b, s_scale, ALIBI, not (SOFTCAP or HAS_BIAS))
    QIDb = QID + b * sqid_b
    KIDb = KID + b * skid_b
    KMb = KM + b * skm_b + h * skm_h
    dq = tl.zeros([BM, DP], dtype=tl.float32)
    if MODE == 0:
        t0, f0, f1, t1 = _key_tile_range(i0, Sq, Sk, lo, hi, BM, BN)
        for t in range(t0, f0):
            dq = _dq_tile(dq, q0, q1, do0, do1,
                          mx, ln2, dlt, Kh, Vh, sk_s, sv_s, t * BN, offs_m, offs_nb, offs_d, offs_dv,
                          Sq, Sk, s_scale, mvo, gam, lo, hi, cap, slope, adiag, dw, DWr, DW, dthr, drs, QIDb, KIDb, KMb, skm_m, skm_n, BI, sb_m, sb_n,
                          DBh, sdb_m, sdb_n, db_add, D, DP, VD, VDP, True, HAS_BAND, HAS_DOCS, HAS_KEEP,
                          HAS_BIAS, WRITE_DB, DB_ACC, SOFTCAP, ALIBI, DROPOUT, PREC,
                          b, h, CAPS, SMOD, MMOD)
        for t in range(f0, f1):
            dq = _dq_tile(dq, q0, q1, do0, do1,
                          mx, ln2, dlt, Kh, Vh, sk_s, sv_s, t * BN, offs_m, offs_nb, offs_d, offs_dv,
                          Sq, Sk, s_scale, mvo, gam, lo, hi, cap, slope, adiag, dw, DWr, DW, dthr, drs, QIDb, KIDb, KMb, skm_m, skm_n, BI, sb_m, sb_n,
                          DBh, sdb_m, sdb_n, db_add, D, DP, VD, VDP, False, HAS_BAND, HAS_DOCS, HAS_KEEP,
                          HAS_BIAS, WRITE_DB, DB_ACC, SOFTCAP, ALIBI, DROPOUT, PREC,
                          b, h, CAPS, SMOD, MMOD)
        for t in range(f1, t1):
            dq = _dq_tile(dq, q0, q1, do0, do1,
                          mx, ln2, dlt, Kh, Vh, sk_s, sv_s, t * BN, offs_m, offs_nb, offs_d, offs_dv,
                          Sq, Sk, s_scale, mvo, gam, lo, hi, cap, slope, adiag, dw, DWr, DW, dthr, drs, QIDb, KIDb, KMb, skm_m, skm_n, BI, sb_m, sb_n,
                          DBh, sdb_m, sdb_n, db_add, D, DP, VD, VDP, True, HAS_BAND, HAS_DOCS, HAS_KEEP,
                          HAS_BIAS, WRITE_DB, DB_ACC, SOFTCAP, ALIBI, DROPOUT, PREC,
                          b, h, CAPS, SMOD, MMOD)
    else:
        # one flat loop per list over (block, sub-tile) pairs, so that it pipelines
        rw = i0 // SBQ
        cb = b * sc_b + h * sc_h + rw
        ib = b * si_b + h * si_h + rw * si_r
        NSUB = SBK // BN
        n_part = tl.load(CNT + cb)
        for t in range(0, n_part * NSUB):
            start_n = tl.load(IDX + ib + t // NSUB) * SBK + (t % NSUB) * BN
            dq = _dq_tile(dq, q0, q1, do0, do1,
                          mx, ln2, dlt, Kh, Vh, sk_s, sv_s, start_n, offs_m, offs_nb,
                          offs_d, offs_dv, Sq, Sk, s_scale, mvo, gam, lo, hi, cap, slope, adiag, dw, DWr, DW, dthr, drs, QIDb, KIDb, KMb, skm_m, skm_n, BI,
                          sb_m, sb_n, DBh, sdb_m, sdb_n, db_add, D, DP, VD, VDP, True, HAS_BAND, HAS_DOCS,
                          HAS_KEEP, HAS_BIAS, WRITE_DB, DB_ACC, SOFTCAP, ALIBI, DROPOUT, PREC,
                          b, h, CAPS, SMOD, MMOD)
        n_full = tl.load(FCNT + cb)
        for t in range(0, n_full * NSUB):
            start_n = tl.load(FIDX + ib + t // NSUB) * SBK + (t % NSUB) * BN
            dq = _dq_tile(dq, q0, q1, do0, do1,
                          mx, ln2, dlt, Kh, Vh, sk_s, sv_s, start_n, offs_m, offs_nb,
                          offs_d, offs_dv, Sq, Sk, s_scale, mvo, gam, lo, hi, cap, slope, adiag, dw, DWr, DW, dthr, drs, QIDb, KIDb, KMb, skm_m, skm_n, BI,
                          sb_m, sb_n, DBh, sdb_m, sdb_n, db_add, D, DP, VD, VDP, False, HAS_BAND, HAS_DOCS,
                          HAS_KEEP, HAS_BIAS, WRITE_DB, DB_ACC, SOFTCAP, ALIBI, DROPOUT, PREC,
                          b, h, CAPS, SMOD, MMOD)
    dq = dq * dq_mul
    dq_ptrs = DQ + b * sdq_b + h * sdq_h + i0.to(tl.int64) * sdq_s + offs_mb[:, None] * sdq_s + offs_d[None, :]
    inb = offs_m < Sq
    if D == DP:
        tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=inb[:, None])
    else:
        tl.store(dq_ptrs, dq.to(DQ.dtype.element_ty), mask=inb[:, None] & (offs_d[None, :] < D))


@triton.jit
def dq_kernel(Q, K, V, DO, L2, DELTA, DQ, BIAS, DB, QID, KID, KM, CNT, IDX, FCNT, FIDX, SC,
               SLOPES,
               sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sdo_b, sdo_h, sdo_s,
               sdq_b, sdq_h, sdq_s, sb_b, sb_h, sb_m, sb_n, sdb_b, sdb_h, sdb_m, sdb_n,
               sqid_b, skid_b, skm_b, skm_h, skm_m, skm_n, sc_b, sc_h, si_b, si_h, si_r,
               H, G, Sq, Sk, scale, lo, hi, sl_b, cap, adiag, DW, dthr, drs,
               D: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
               VD: tl.constexpr, VDP: tl.constexpr,
               SBQ: tl.constexpr, SBK: tl.constexpr, MODE: tl.constexpr,
               HAS_BAND: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_KEEP: tl.constexpr,
               HAS_BIAS: tl.constexpr, WRITE_DB: tl.constexpr, SOFTCAP: tl.constexpr,
               ALIBI: tl.constexpr, DROPOUT: tl.constexpr, PREC: tl.constexpr,
               CAPS=None, SMOD: tl.constexpr = None, MMOD: tl.constexpr = None):
    """Grid (cdiv(Sq, BM), B * H): dq of one query tile."""
    bh = tl.program_id(1)
    _dq_program(tl.program_id(0), (bh // H).to(tl.int64), (bh % H).to(tl.int64),
                Q, K, V, DO, L2, DELTA, DQ, BIAS, DB, QID, KID, KM, CNT, IDX, FCNT, FIDX, SC,
                SLOPES,
                sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sdo_b, sdo_h, sdo_s,
                sdq_b, sdq_h, sdq_s, sb_b, sb_h, sb_m, sb_n, sdb_b, sdb_h, sdb_m, sdb_n,
                sqid_b, skid_b, skm_b, skm_h, skm_m, skm_n, sc_b, sc_h, si_b, si_h, si_r,
                H, G, Sq, Sk, scale, lo, hi, sl_b, cap, adiag, DW, dthr, drs, 0, D, DP, VD, VDP, BM, BN,
                SBQ, SBK, MODE,
                HAS_BAND, HAS_DOCS, HAS_KEEP, HAS_BIAS, WRITE_DB, False, SOFTCAP, ALIBI, DROPOUT, PREC,
                CAPS, SMOD, MMOD)


@triton.jit
def dq_dbias_kernel(Q, K, V, DO, L2, DELTA, DQ, BIAS, DB, QID, KID, KM, CNT, IDX, FCNT, FIDX,
                     SC, SLOPES,
                     sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sdo_b, sdo_h, sdo_s,
                     sdq_b, sdq_h, sdq_s, sb_b, sb_h, sb_m, sb_n, sdb_b, sdb_h, sdb_m, sdb_n,
                     sqid_b, skid_b, skm_b, skm_h, skm_m, skm_n, sc_b, sc_h, si_b, si_h, si_r,
                     B, H, G, Sq, Sk, scale, lo, hi, sl_b, cap, adiag, DW, dthr, drs, HB,
                     D: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                     VD: tl.constexpr, VDP: tl.constexpr,
                     SBQ: tl.constexpr, SBK: tl.constexpr, MODE: tl.constexpr,
                     RED_B: tl.constexpr, RED_H: tl.constexpr,
                     HAS_BAND: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_KEEP: tl.constexpr,
                     SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, PREC: tl.constexpr,
                     CAPS=None, SMOD: tl.constexpr = None, MMOD: tl.constexpr = None):
    """dq and the dbias of a bias broadcast over batch (RED_B) and/or heads (RED_H) but
    full over queries and keys, no atomics and no scratch.

    Grid (cdiv(Sq, BM), Bb * HB): a program owns the dbias rows [BM, Sk] of one
    (bias batch, bias head) and runs the dq program of every (b, h) that maps onto
    them, in order; the first writes dS, the later ones add theirs (sdb_b / sdb_h are 0
    on the reduced dims, so every (b, h) addresses the same rows)."""
    pid_m = tl.program_id(0)
    pbh = tl.program_id(1)
    bb = (pbh // HB).to(tl.int64)
    hb = (pbh % HB).to(tl.int64)
    nb_ = B if RED_B else 1
    nh_ = H if RED_H else 1
    for bi in range(0, nb_):
        for hi_ in range(0, nh_):
            if RED_B:
                b = tl.cast(bi, tl.int64)
            else:
                b = bb
            if RED_H:
                h = tl.cast(hi_, tl.int64)
            else:
                h = hb
            tl.debug_barrier()   # the previous (b, h)'s dbias stores are visible to all
            _dq_program(pid_m, b, h, Q, K, V, DO, L2, DELTA, DQ, BIAS, DB, QID, KID, KM,
                        CNT, IDX, FCNT, FIDX, SC, SLOPES,
                        sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sdo_b, sdo_h,
                        sdo_s, sdq_b, sdq_h, sdq_s, sb_b, sb_h, sb_m, sb_n, sdb_b, sdb_h,
                        sdb_m, sdb_n, sqid_b, skid_b, skm_b, skm_h, skm_m, skm_n,
                        sc_b, sc_h, si_b, si_h, si_r, H, G, Sq, Sk, scale, lo, hi,
                        sl_b, cap, adiag, DW, dthr, drs,
                        bi + hi_, D, DP, VD, VDP, BM, BN, SBQ, SBK, MODE, HAS_BAND, HAS_DOCS,
                        HAS_KEEP, True, True, True, SOFTCAP, ALIBI, DROPOUT, PREC,
                        CAPS, SMOD, MMOD)


@triton.jit
def bwd_kernel(Q, K, V, DO, L2, DELTA, DK, DV, DQ, BIAS, DB, QID, KID, KM,
                CCNT, CIDX, CFCNT, CFIDX, RCNT, RIDX, RFCNT, RFIDX, SC, SLOPES,
                sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sdo_b, sdo_h, sdo_s,
                sdk_b, sdk_h, sdk_s, sdv_b, sdv_h, sdv_s, sdq_b, sdq_h, sdq_s,
                sb_b, sb_h, sb_m, sb_n, sdb_b, sdb_h, sdb_m, sdb_n,
                sqid_b, skid_b, skm_b, skm_h, skm_m, skm_n,
                cc_b, cc_h, ci_b, ci_h, ci_r, rc_b, rc_h, ri_b, ri_h, ri_r,
                H, HKV, G, Sq, Sk, scale, lo, hi, sl_b, cap, adiag, DW, dthr, drs, NKV_TILES, NQ_TILES,
                D: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                VD: tl.constexpr, VDP: tl.constexpr,
                BM2: tl.constexpr, BN2: tl.constexpr,
                SBQ: tl.constexpr, SBK: tl.constexpr, MODE: tl.constexpr,
                HAS_BAND: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_KEEP: tl.constexpr,
                HAS_BIAS: tl.constexpr, WRITE_DB: tl.constexpr, SOFTCAP: tl.constexpr,
                ALIBI: tl.constexpr, DROPOUT: tl.constexpr, PREC: tl.constexpr,
                CAPS=None, SMOD: tl.constexpr = None, MMOD: tl.constexpr = None):
    """The whole backward after the delta pass in one launch (score / mask functions
    SMOD / MMOD over the captures CAPS as in dkdv_kernel and dq_kernel).

    Grid (NKV_TILES + G * NQ_TILES, B * HKV): programs [0, NKV_TILES) own a key tile
    (BN keys) of kv head hk and write its dk, dv (query tiles of BM); the rest own a
    query tile (BM2 queries) of one of the G query heads of hk and write its dq (key
    tiles of BN2).  Same results as dkdv_kernel + dq_kernel, bit for bit."""
    pid = tl.program_id(0)
    bhk = tl.program_id(1)
    b = (bhk // HKV).to(tl.int64)
    hk = (bhk % HKV).to(tl.int64)
    if pid < NKV_TILES:
        _dkdv_program(pid, b, hk, Q, K, V, DO, L2, DELTA, DK, DV, BIAS, QID, KID, KM,
                      CCNT, CIDX, CFCNT, CFIDX, SC, SLOPES,
                      sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sdo_b, sdo_h, sdo_s,
                      sdk_b, sdk_h, sdk_s, sdv_b, sdv_h, sdv_s,
                      sb_b, sb_h, sb_m, sb_n, sqid_b, skid_b, skm_b, skm_h, skm_m, skm_n,
                      cc_b, cc_h, ci_b, ci_h, ci_r, H, G, Sq, Sk, scale, lo, hi,
                      sl_b, cap, adiag, DW, dthr, drs,
                      D, DP, VD, VDP, BM, BN, SBQ, SBK, MODE, HAS_BAND, HAS_DOCS, HAS_KEEP,
                      HAS_BIAS, SOFTCAP, ALIBI, DROPOUT, PREC, CAPS, SMOD, MMOD)
    else:
        r = pid - NKV_TILES
        h = hk * G + r // NQ_TILES
        _dq_program(r % NQ_TILES, b, h, Q, K, V, DO, L2, DELTA, DQ, BIAS, DB, QID, KID, KM,
                    RCNT, RIDX, RFCNT, RFIDX, SC, SLOPES,
                    sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sdo_b, sdo_h, sdo_s,
                    sdq_b, sdq_h, sdq_s, sb_b, sb_h, sb_m, sb_n, sdb_b, sdb_h, sdb_m, sdb_n,
                    sqid_b, skid_b, skm_b, skm_h, skm_m, skm_n, rc_b, rc_h, ri_b, ri_h, ri_r,
                    H, G, Sq, Sk, scale, lo, hi, sl_b, cap, adiag, DW, dthr, drs, 0, D, DP, VD, VDP,
                    BM2, BN2, SBQ, SBK,
                    MODE, HAS_BAND, HAS_DOCS, HAS_KEEP, HAS_BIAS, WRITE_DB, False, SOFTCAP,
                    ALIBI, DROPOUT, PREC, CAPS, SMOD, MMOD)


@triton.jit
def dbias_kernel(Q, K, V, DO, L2, DELTA, BIAS, DB, QID, KID, KM, SLOPES,
                  sq_b, sq_h, sq_s, sk_b, sk_h, sk_s, sv_b, sv_h, sv_s, sdo_b, sdo_h, sdo_s,
                  sb_b, sb_h, sb_m, sb_n, sdb_b, sdb_h, sdb_m, sdb_n,
                  sqid_b, skid_b, skm_b, skm_h, skm_m, skm_n,
                  B, H, G, Sq, Sk, scale, lo, hi, sl_b, cap, adiag, DW, dthr, drs, NJ_OUT, HB,
                  D: tl.constexpr, DP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
                  VD: tl.constexpr, VDP: tl.constexpr,
                  RED_B: tl.constexpr, RED_H: tl.constexpr, RED_M: tl.constexpr,
                  RED_N: tl.constexpr,
                  HAS_BAND: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_KEEP: tl.constexpr,
                  SOFTCAP: tl.constexpr, ALIBI: tl.constexpr, DROPOUT: tl.constexpr, PREC: tl.constexpr):
    """dbias for a broadcast bias (shape [Bb, Hb, Mb, Nb], each 1 or full), no atomics.

    Grid (n_i_out * NJ_OUT, Bb * Hb): one program owns a [BM, BN] tile (or a [BN]
    row / [BM] column / scalar when Mb or Nb is 1) of dbias and sums dS over the
    broadcast dims (batch RED_B, heads RED_H, queries RED_M, keys RED_N),
    recomputing P and dP from q, k, v, dout, the row statistics L2 and delta.
    """
    pid = tl.program_id(0)
    pbh = tl.program_id(1)
    bb = (pbh // HB).to(tl.int64)
    hb = (pbh % HB).to(tl.int64)
    ti = pid // NJ_OUT
    tj = pid % NJ_OUT
    offs_mb = tl.arange(0, BM)
    offs_nb = tl.arange(0, BN)
    offs_d = tl.arange(0, DP)
    offs_dv = tl.arange(0, VDP)
    nb_ = B if RED_B else 1
    nh_ = H if RED_H else 1
    ni_ = (Sq + BM - 1) // BM if RED_M else 1
    nj_ = (Sk + BN - 1) // BN if RED_N else 1
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for bi in range(0, nb_):
        if RED_B:
            b = tl.cast(bi, tl.int64)
        else:
            b = bb
        for hi_ in range(0, nh_):
            if RED_H:
                h = tl.cast(hi_, tl.int64)
            else:
                h = hb
            hk = h // G
            bh = b * H + h
            Qh = Q + b * sq_b + h * sq_h
            DOh = DO + b * sdo_b + h * sdo_h
            Kh = K + b * sk_b + hk * sk_h
            Vh = V + b * sv_b + hk * sv_h
            BI = BIAS + b * sb_b + h * sb_h
            QIDb = QID + b * sqid_b
            KIDb = KID + b * skid_b
            KMb = KM + b * skm_b + h * skm_h
            slope = _load_slope(SLOPES, b, h, sl_b, scale, ALIBI, False)
            for it in range(0, ni_):
                if RED_M:
                    i0 = it * BM
                else:
                    i0 = ti * BM
                offs_m = i0 + offs_mb
                q = _load_rows(Qh, i0, sq_s, Sq, offs_mb, offs_d, D, DP, True)     # [BM, DP]
                do = _load_rows(DOh, i0, sdo_s, Sq, offs_mb, offs_dv, VD, VDP, True)  # [BM, VDP]
                l2p = L2 + bh * (2 * Sq) + offs_m
                mx = tl.load(l2p, mask=offs_m < Sq, other=float("inf"))           # [BM]
                ln2 = tl.load(l2p + Sq, mask=offs_m < Sq, other=0.0)               # [BM]
                dlt = tl.load(DELTA + bh * Sq + offs_m, mask=offs_m < Sq, other=0.0)
                if DROPOUT:
                    dw = _load_words(DW + Sk + bh * Sq, offs_m, Sq)
                else:
                    dw = 0
                for jt in range(0, nj_):
                    if RED_N:
                        j0 = jt * BN
                    else:
                        j0 = tj * BN
                    offs_n = j0 + offs_nb
                    kT = _load_rows_t(Kh, j0, sk_s, Sk, offs_nb, offs_d, D, DP, True)  # [DP, BN]
                    vT = _load_rows_t(Vh, j0, sv_s, Sk, offs_nb, offs_dv, VD, VDP, True)  # [VDP, BN]
                    bt = _load_bias(BI, sb_m, sb_n, offs_m, offs_n, Sq, Sk, True)
                    if SOFTCAP or ALIBI:
                        s, _ = _mod_scores(_dot(q, kT, PREC), scale, bt, cap, slope, offs_m,
                                           offs_n, adiag, True, SOFTCAP, ALIBI, False)
                    else:
                        s = tl.fma(_dot(q, kT, PREC), scale, bt)
                    p = tl.math.exp2((s - mx[:, None]) * 1.4426950408889634 - ln2[:, None])
                    keep = _keep(offs_m, offs_n, Sq, Sk, lo, hi, QIDb, KIDb, KMb, skm_m, skm_n,
                                 HAS_BAND, HAS_DOCS, HAS_KEEP)
                    p = tl.where(keep, p, 0.0)
                    dp = _dot(do, vT, PREC)
                    if DROPOUT:
                        dp = tl.where(_drop_keep(dw, _load_words(DW, offs_n, Sk), dthr, False),
                                      dp * drs, 0.0)
                    acc += p * (dp - dlt[:, None])                                # [BM, BN]
    DBh = DB + bb * sdb_b + hb * sdb_h
    if RED_M and RED_N:
        tot = tl.sum(tl.sum(acc, 1), 0)
        tl.store(DBh, tot.to(DB.dtype.element_ty))
    elif RED_M:
        col = tl.sum(acc, 0)                                                      # [BN]
        offs_n = tj * BN + offs_nb
        tl.store(DBh + offs_n.to(tl.int64) * sdb_n, col.to(DB.dtype.element_ty), mask=offs_n < Sk)
    elif RED_N:
        rowv = tl.sum(acc, 1)                                                     # [BM]
        offs_m = ti * BM + offs_mb
        tl.store(DBh + offs_m.to(tl.int64) * sdb_m, rowv.to(DB.dtype.element_ty), mask=offs_m < Sq)
    else:
        offs_m = ti * BM + offs_mb
        offs_n = tj * BN + offs_nb
        ptrs = DBh + offs_m.to(tl.int64)[:, None] * sdb_m + offs_n.to(tl.int64)[None, :] * sdb_n
        tl.store(ptrs, acc.to(DB.dtype.element_ty),
                 mask=(offs_m[:, None] < Sq) & (offs_n[None, :] < Sk))


# ----------------------------------------------------------------------------- mask functions
@triton.jit
def mask_blocks_kernel(ANY, ALL, CAPS, Sq, Sk, NQ, NK, HX, SBQ: tl.constexpr,
                       SBK: tl.constexpr, MMOD: tl.constexpr):
    """Grid (NQ, NK, BX * HX): whether mask block (iq, jk) of (b, h) keeps any / every
    in-bounds pair under the generated mask function MMOD (programs.py), as int8 into
    ANY / ALL [BX * HX, NQ, NK] (BX, HX: 1 where the functions do not read b / h)."""
    iq = tl.program_id(0)
    jk = tl.program_id(1)
    bh = tl.program_id(2)
    b = (bh // HX).to(tl.int64)
    h = (bh % HX).to(tl.int64)
    offs_m = iq * SBQ + tl.arange(0, SBQ)
    offs_n = jk * SBK + tl.arange(0, SBK)
    valid = (offs_m < Sq)[:, None] & (offs_n < Sk)[None, :]
    keep = MMOD(b, h, offs_m[:, None], offs_n[None, :], valid, CAPS)
    n_keep = tl.sum(tl.sum(keep.to(tl.int32), 1), 0)
    n_valid = tl.sum(tl.sum(valid.to(tl.int32), 1), 0)
    o = bh.to(tl.int64) * NQ * NK + iq * NK + jk
    tl.store(ANY + o, (n_keep > 0).to(tl.int8))
    tl.store(ALL + o, (n_keep == n_valid).to(tl.int8))


# ----------------------------------------------------------------------------- capture gradients
@triton.jit
def _dcap_store(OUT, e, BN: tl.constexpr, BM: tl.constexpr, DIAG: tl.constexpr):
    """A transposed tile e [BN, BM] (keys as rows) summed along its diagonals: the sum
    over t = ii - jj + BN - 1 to OUT[t] (t < BM + BN - 1); without DIAG its total to
    OUT[0].  Per chunk of BM diagonals a skew gather of e (an index tile of e's shape),
    then a sum over the keys: no atomics, one fixed order."""
    if DIAG:
        jj = tl.arange(0, BN)
        ii = tl.arange(0, BM)
        for c in tl.static_range((2 * BM + BN - 2) // BM):      # cdiv(BM + BN - 1, BM)
            src = c * BM + ii[None, :] + jj[:, None] - (BN - 1)                     # [BN, BM]
            ok = (src >= 0) & (src < BM)
            skew = tl.gather(e, tl.where(ok, src, 0), 1)        # [jj, t] = e[jj, t + jj - BN + 1]
            part = tl.sum(tl.where(ok, skew, 0.0), 0)                                # [BM]
            tl.store(OUT + c * BM + ii, part, mask=c * BM + ii < BM + BN - 1)
    else:
        tl.store(OUT, tl.sum(tl.sum(e, 1), 0))


@triton.jit
def _dcap_rows(OUT, e, BM: tl.constexpr):
    """A transposed tile e [BN, BM] summed over its keys: OUT[ii] for its BM queries."""
    tl.store(OUT + tl.arange(0, BM), tl.sum(e, 0))


@triton.jit
def _dcap_tile(OUT, e, BN: tl.constexpr, BM: tl.constexpr):
    """A transposed tile e [BN, BM] as it is (a pair read's terms, nothing summed):
    OUT[jj * BM + ii] = e[jj, ii]."""
    tl.store(OUT + tl.arange(0, BN)[:, None] * BM + tl.arange(0, BM)[None, :], e)


@triton.jit
def _dcap_cols(acc, e, k: tl.constexpr, NCP: tl.constexpr):
    """acc [BN, NCP] (fp64) plus, in its column k, a transposed tile e [BN, BM] summed
    over its queries (fp32 within the tile)."""
    col = tl.sum(e, 1).to(tl.float64)                                               # [BN]
    return acc + tl.where(tl.arange(0, NCP)[None, :] == k, col[:, None], 0.0)


@triton.jit
def _dcap_cols_store(DCOL, acc, bh, Sk, offs_n, NCP: tl.constexpr):
    """acc [BN, NCP] (keys offs_n of head row bh) to DCOL [B * H, Sk, NCP]."""
    kk = tl.arange(0, NCP)
    ptr = DCOL + (bh * Sk + offs_n[:, None]) * NCP + kk[None, :]
    tl.store(ptr, acc, mask=(offs_n < Sk)[:, None])


@triton.jit
def dcap_diag_kernel(DCS, DD, Sq, Sk, NK, NQ, BM: tl.constexpr, BN: tl.constexpr,
                     NM: tl.constexpr, BLOCK: tl.constexpr):
    """Grid (cdiv(Sq + Sk - 1, BLOCK), NG * B * H): the diagonal sums of the slots of
    dkdv_kernel's DCS [NG * B * H, NK, NQ, BM + BN - 1] (fp32) per diagonal d = u - (Sk - 1)
    to DD [NG * B * H, Sq + Sk - 1] (fp64): key tile n (in order) holds d in slot
    (n, m) at t = d + n * BN + BN - 1 - m * BM for the NM = cdiv(BM + BN - 1, BM) query
    tiles m whose diagonals reach d (in order).  A fixed order: bitwise repeatable."""
    pid = tl.program_id(0)
    row = tl.program_id(1).to(tl.int64)
    U = Sq + Sk - 1
    WD: tl.constexpr = BM + BN - 1
    u = pid * BLOCK + tl.arange(0, BLOCK)
    d = u - (Sk - 1)
    live = u < U
    base = DCS + row * NK * NQ * WD
    acc = tl.zeros([BLOCK], dtype=tl.float64)
    for n in range(0, NK):
        r = d + n * BN + (BN - 1)                  # start_m + t: >= 0 where n reaches d
        top = tl.where(r >= 0, r, 0) // BM
        for k in tl.static_range(NM):
            m = top - k
            t = r - m * BM
            ok = live & (r >= 0) & (m >= 0) & (m < NQ) & (t < WD)
            x = tl.load(base + (n * NQ + m).to(tl.int64) * WD + t, mask=ok, other=0.0)
            acc += x.to(tl.float64)
    tl.store(DD + row * U + u, acc, mask=live)


@triton.jit
def dcap_segment_kernel(V, PERM, OFFS, OUT, N, MAXLEN, EB: tl.constexpr, KB: tl.constexpr):
    """Grid (cdiv(N, EB),): OUT[e] = the sum of V[PERM[k]] (fp64) over k in [OFFS[e],
    OFFS[e + 1]) for EB elements e of a capture (its terms, sorted by element once on
    the host; MAXLEN the longest run): KB terms at a time in order, then one tree sum
    per element.  No atomics: bitwise repeatable."""
    e = tl.program_id(0) * EB + tl.arange(0, EB)
    live = e < N
    start = tl.load(OFFS + e, mask=live, other=0)
    end = tl.load(OFFS + e + 1, mask=live, other=0)
    acc = tl.zeros([EB, KB], dtype=tl.float64)
    for k0 in range(0, MAXLEN, KB):
        k = start[:, None] + k0 + tl.arange(0, KB)[None, :]                        # [EB, KB]
        ok = k < end[:, None]
        src = tl.load(PERM + k, mask=ok, other=0)
        acc += tl.load(V + src, mask=ok, other=0.0)
    tl.store(OUT + e, tl.sum(acc, 1), mask=live)
