// Shared bindings and helpers of the tiled kernels (forward, dq, dkdv).
// Shape legend: B batch, HQ/HKV heads, SQ/SK queries/keys, D head dim;
// tiles BQ x BK; workgroup TY x TX threads, each owning an RM x 4 score micro-tile
// (rows ty*RM + r, columns tx + TX*c; RM = 4, or 8 in the wide backward) and RM (dQ,
// forward) or 4 (dK/dV) rows x NV vec4 output columns.
@group(0) @binding(0) var<uniform> U: Uni;
@group(0) @binding(1) var<storage, read> qb: array<TB>;
@group(0) @binding(2) var<storage, read> kb: array<TB>;
@group(0) @binding(3) var<storage, read> vb: array<TB>;
@group(0) @binding(4) var<storage, read> gb: array<TB>;
@group(0) @binding(5) var<storage, read> biasb: array<f32>;
@group(0) @binding(6) var<storage, read> aux: array<u32>;
@group(0) @binding(7) var<storage, read_write> stats: array<f32>;
//@ifn OUTB16
@group(0) @binding(8) var<storage, read_write> outb: array<f32>;
//@endif OUTB16
//@if OUTB16
@group(0) @binding(8) var<storage, read_write> outb: array<vec4<f16>>;   // f16 dQ (OUTB16)
//@endif OUTB16
//@ifn DSQ_OUT
//@ifn DSQ_IN
@group(0) @binding(9) var<storage, read_write> dsb: array<f32>;
//@endif DSQ_IN
//@endif DSQ_OUT
// the 5-product backward's dS scratch (variants *-dsq), in tile order: row i of head
// bh holds nkt tiles of BK keys; element 4*tx + c of tile kt is key kt*BK + tx + TX*c
// (one vec4 per invocation and row: [((bh - ds_bh0)*SQ + i)*nkt + kt]*TX + tx; ds_bh0: the
// first query-head row of a chunk of (batch, KV head) rows, engine.Call.dkdv)
//@if DSQ_OUT
@group(0) @binding(9) var<storage, read_write> dsb: array<vec4<f32>>;
//@endif DSQ_OUT
//@if DSQ_IN
@group(0) @binding(9) var<storage, read_write> dsb: array<vec4<f32>>;
//@endif DSQ_IN
//@if PROGS
// score / mask functions (SCOREMOD, MASKFN): their captures as 32-bit words, and the
// generated functions smod_v / smod_vd / mfn_all (backends/webgpu/programs.py)
@group(0) @binding(10) var<storage, read> capb: array<u32>;
//@progfns
//@endif PROGS

var<private> trips: u32;
//@if STAGE
const SOFF_Q: u32 = 0u;
const SOFF_K: u32 = BQ * RSQ;
const SOFF_G: u32 = (BQ + BK) * RSQ;
const SOFF_V: u32 = (2u * BQ + BK) * RSQ;
//@endif STAGE
//@if ALIAS
// ALIAS (variant wide): the updates' staged rows su at stg[0 .. IC*DS4), the dK/dV
// pass's st and the dQ pass's sp from SOFF_T on (over the idle S/dP staging tiles)
const SOFF_U: u32 = 0u;
const SOFF_T: u32 = IC * DS4;
const SOFF_P: u32 = SOFF_T;
//@endif ALIAS
var<workgroup> wg_code: u32;
//@ifn PAGED
//@define SKB U.SK
//@endif PAGED
//@if PAGED
// PAGED (the forward over a paged key/value cache, anyattn.paged): sequence b's record
// is aux[U.pg_off + 4b ..]: its key count, its band (lo, hi) as i32 bits (its mask
// resolved for that count; an open side as the clip value), the aux index of its
// block-table row.  Key j of sequence b is row j % U.pg_p of page
// aux[row + j / U.pg_p]; the k / v operands' batch stride is their page stride.
// Keys at or past the sequence's count (skb, the forward's) are never read.
//@define SKB skb
fn pg_len(b: u32) -> u32 { return aux[U.pg_off + 4u * b]; }
fn pg_band(b: u32, side: u32) -> i32 { return bitcast<i32>(aux[U.pg_off + 4u * b + side]); }
//@ifn PGSTART
// element offset of key j of sequence b from its head's base (page stride sp, row stride ss)
fn pg_row(b: u32, j: u32, sp: u32, ss: u32) -> u32 {
  let pg = aux[aux[U.pg_off + 4u * b + 3u] + j / U.pg_p];
  return pg * sp + (j % U.pg_p) * ss;
}
//@endif PGSTART
//@if PGSTART
//@# PGSTART (with PAGED: anyattn.Pages(starts=)): key j of sequence b is its position
//@# t = start + j, the start held in the aux word before its block-table row; its key
//@# count, band and ALiBi are those of its keys (key indices j), as without a start.
// element offset of key j (position aux[row - 1] + j) of sequence b from its head's base
fn pg_row(b: u32, j: u32, sp: u32, ss: u32) -> u32 {
  let row = aux[U.pg_off + 4u * b + 3u];
  let t = aux[row - 1u] + j;
  let pg = aux[row + t / U.pg_p];
  return pg * sp + (t % U.pg_p) * ss;
}
//@endif PGSTART
//@endif PAGED

// Keep rule of pair (i, j) of head h: band, documents, keep mask (NaN keeps).
fn keep_ij(b: u32, h: u32, i: u32, j: u32) -> bool {
  let f = U.flags;
  let dl = i32(j) - i32(i);
  var ok = true;
  //@ifn PAGED
  if ((f & F_HAS_LO) != 0u) { ok = ok && (dl >= U.band_lo); }
  if ((f & F_HAS_HI) != 0u) { ok = ok && (dl <= U.band_hi); }
  //@endif PAGED
  //@if PAGED
  if ((f & F_HAS_LO) != 0u) { ok = ok && (dl >= pg_band(b, 1u)); }
  if ((f & F_HAS_HI) != 0u) { ok = ok && (dl <= pg_band(b, 2u)); }
  //@endif PAGED
  if ((f & F_HAS_DOCS) != 0u) {
    ok = ok && (aux[U.qid_off + b * U.qid_sb + i] == aux[U.kid_off + b * U.kid_sb + j]);
  }
  if ((f & F_HAS_KEEP) != 0u) {
    let m = bitcast<f32>(aux[U.kp_off + b * U.kp_sb + h * U.kp_sh + i * U.kp_si + j * U.kp_sj]);
    ok = ok && !(m < 0.5);
  }
  //@if MASKFN
  ok = ok && mfn_all(b, h, i, j);
  //@endif MASKFN
  return ok;
}

fn bias_ij(b: u32, h: u32, i: u32, j: u32) -> f32 {
  return biasb[U.bi_off + b * U.bi_sb + h * U.bi_sh + i * U.bi_si + j * U.bi_sj];
}

// Sentinels: an excluded score and the max of a row that keeps no key are U.neg_inf
// (-inf from the uniform block, never a literal: compilers may fold infinities), and
// are recognised by their bits.  Every finite value, down to -FLT_MAX, is a score.
fn is_ninf(x: f32) -> bool { return bitcast<u32>(x) == 0xff800000u; }
const NEG_FLT_MAX: f32 = -3.40282346638528859812e38;

// The score of a mask-kept pair from its scaled dot product x: + bias.  A bias of
// -inf excludes the key (-> U.neg_inf, without arithmetic on the infinity); a finite
// bias is a number (torch semantics: a row of finfo.min attends uniformly), so a sum
// that overflows to -inf is clamped to -FLT_MAX.  Forward and backward share it, so
// both see the same score.  F_SEED_FLOOR (the seed ABI's kind 4): the seed starts its
// running max at -3.4e38, so a score below that weighs exp(-2e31) = 0: excluded.
fn biased(x: f32, b: u32, h: u32, i: u32, j: u32) -> f32 {
  if ((U.flags & F_HAS_BIAS) == 0u) { return x; }
  let bv = bias_ij(b, h, i, j);
  if (is_ninf(bv)) { return U.neg_inf; }
  let y = x + bv;
  if ((U.flags & F_SEED_FLOOR) != 0u && y < -3.4e38) { return U.neg_inf; }
  if (is_ninf(y) && !is_ninf(x)) { return NEG_FLT_MAX; }
  return y;
}

//@if SOFTCAP
// Soft-capping (SOFTCAP): the scaled score x becomes c·tanh(x / c); -> (c·tanh(y),
// 1 − tanh²(y)) with y = x / c (the backward multiplies dS by the second).  Not WGSL's
// tanh: on llvmpipe it is off by up to 3e-8 absolutely near 0 (6.9e-5 relative at
// |y| = 1e-3, any relative error below) and 6 ulp at 0.5.  |y| < 0.55: the odd Taylor
// series to y^17 (<= 0.73 ulp); else (1 − e)/(1 + e), e = exp(−2|y|), no
// cancellation there (<= 2.6 ulp), and 1 − tanh² = 4e/(1 + e)² without the
// cancellation of 1 − t·t near saturation.  Saturates to ±c (e = 0), never NaN
// unless x is NaN.
fn softcap_t(x: f32) -> vec2<f32> {
  let y = x / U.softcap;
  let a = abs(y);
  var t: f32;
  var d: f32;
  if (a < 0.55) {
    let z = a * a;
    var p = -0.00059002744094558598;     // y^17: 6404582/10854718875
    p = p * z + 0.0014558343870513183;   // y^15
    p = p * z - 0.0035921280365724810;   // y^13
    p = p * z + 0.0088632355299021966;   // y^11
    p = p * z - 0.021869488536155203;    // y^9
    p = p * z + 0.053968253968253968;    // y^7
    p = p * z - 0.13333333333333333;     // y^5
    p = p * z + 0.33333333333333333;     // y^3
    t = y - y * z * p;
    d = 1.0 - t * t;
  } else {
    let e = exp(-2.0 * a);
    let u = (1.0 - e) / (1.0 + e);
    t = select(-u, u, y >= 0.0);
    d = 4.0 * e / ((1.0 + e) * (1.0 + e));
  }
  return vec2<f32>(U.softcap * t, d);
}
//@endif SOFTCAP

// The modified score of a mask-kept pair from its scaled (and soft-capped) dot
// product x: + bias (biased), then ALiBi (ALIBI): − slope[b, h]·|i − j + alibi_diag|
// as one fma from indices (slopes in aux); a finite score stays finite (clamped to
// −FLT_MAX like a finite bias), an excluded one stays −inf.  Forward and backward
// share it.
fn score_ij(x: f32, b: u32, h: u32, i: u32, j: u32) -> f32 {
  var y = biased(x, b, h, i, j);
  //@if ALIBI
  if (!is_ninf(y)) {
    //@ifn PAGED
    let dist = f32(abs(i32(i) - i32(j) + U.alibi_diag));
    //@endif PAGED
    //@if PAGED
    // PAGED: U.alibi_diag is that of U.SK keys; sequence b's is shifted by its count
    let dist = f32(abs(i32(i) - i32(j) + U.alibi_diag + (i32(pg_len(b)) - i32(U.SK))));
    //@endif PAGED
    let slope = bitcast<f32>(aux[U.al_off + b * U.al_sb + h]);
    y = fma(-slope, dist, y);
    if (is_ninf(y)) { y = NEG_FLT_MAX; }
  }
  //@endif ALIBI
  return y;
}

//@if DROPOUT
// Dropout (DROPOUT; anyattn.dropout, bit for bit): keep[b, h, i, j] iff
// mix32(row ^ col) >= U.drop_t, row = word 0 of Philox4x32-10 with counter
// (i, h, b, 0), col = word 0 with counter (j, 0, 0, 1), key (U.drop_k0, U.drop_k1),
// i, j, b global positions.  WGSL has no 64-bit integers: the high half of a
// 32 x 32 product comes from 16-bit halves (every partial fits u32 exactly).
fn mulhi32(a: u32, b: u32) -> u32 {
  let a0 = a & 0xffffu;
  let a1 = a >> 16u;
  let b0 = b & 0xffffu;
  let b1 = b >> 16u;
  let p01 = a0 * b1;
  let p10 = a1 * b0;
  let mid = ((a0 * b0) >> 16u) + (p01 & 0xffffu) + (p10 & 0xffffu);
  return a1 * b1 + (p01 >> 16u) + (p10 >> 16u) + (mid >> 16u);
}

// One Philox4x32 round with key k; the caller bumps the key between rounds.
fn philox_round(c: vec4<u32>, k: vec2<u32>) -> vec4<u32> {
  let h0 = mulhi32(c.x, 0xD2511F53u);
  let h1 = mulhi32(c.z, 0xCD9E8D57u);
  return vec4<u32>(h1 ^ c.y ^ k.x, c.z * 0xCD9E8D57u, h0 ^ c.w ^ k.y, c.x * 0xD2511F53u);
}

// Word 0 of Philox4x32-10(counter c, key (U.drop_k0, U.drop_k1)); straight-line
// code (no loop: llvmpipe counts loop trips).
fn philox_w0(c0: vec4<u32>) -> u32 {
  var c = c0;
  var k = vec2<u32>(U.drop_k0, U.drop_k1);
  //@for rd 9
  c = philox_round(c, k);
  k += vec2<u32>(0x9E3779B9u, 0xBB67AE85u);
  //@end rd
  c = philox_round(c, k);
  return c.x;
}

// Row word of global batch b, query head h, local query i (q_offset added here).
fn drop_row(b: u32, h: u32, i: u32) -> u32 {
  return philox_w0(vec4<u32>(U.drop_qo + i, h, U.drop_b0 + b, 0u));
}

// Column word of local key j (k_offset added here).
fn drop_col(j: u32) -> u32 {
  return philox_w0(vec4<u32>(U.drop_ko + j, 0u, 0u, 1u));
}

// keep bit of a pair from its row and column words (the 32-bit finaliser).
fn drop_keep(rw: u32, cw: u32) -> bool {
  var x = rw ^ cw;
  x ^= x >> 16u;
  x *= 0x7FEB352Du;
  x ^= x >> 15u;
  x *= 0x846CA68Bu;
  x ^= x >> 16u;
  return x >= U.drop_t;
}
//@endif DROPOUT

// Tile code: 0 empty (skip), 1 partial (test every pair), 2 full (no test).
fn tile_code(b: u32, h: u32, qt: u32, kt: u32) -> u32 {
  if ((U.flags & F_TILEMAP) == 0u) { return 1u; }
  return aux[U.tm_off + b * U.tm_sb + h * U.tm_sh + qt * U.nkt + kt];
}

// NaN test on the bits (compilers may fold x != x away).
fn is_nan(x: f32) -> bool { return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u; }

//@if HALF
// f32 sum of the two lanes of a packed f16 partial
fn hsum(h: vec2<f16>) -> f32 { return f32(h.x) + f32(h.y); }
//@endif HALF

//@loaders
