// Element-wise pass of device arrays (anyattn.webgpu): 4 destination elements per
// invocation, dst[out2_off + e] for e in [0, n_out), e = ((b*db_nh + h)*db_ni + i)*db_nj + j
// over the logical shape [db_nb, db_nh, db_ni, db_nj].
//   gather (default): dst = src[o_off + b*db_sb + h*db_sh + i*db_si + j*db_sj]  (any
//     strides, 0 broadcasts; f16 <-> f32 conversion by SRC16 / DST16)
//   OP_ADD:    dst = gather(src) + src2[q_off + e]                   (lse = max + log_norm)
//   OP_REFINE: anyattn.rowstats.refine of a given lse g = gather(src) with the local
//     statistics m = src2[q_off + e], ln = src2[k_off + e] -> max into dst[out2_off + e],
//     log_norm into dst[v_off + e]
// SRC16: src is array<vec4<f16>> (element a at src[a / 4][a % 4]); DST16: dst likewise
// (out2_off a multiple of 4; elements past n_out in the last vec4 are written as 0).
@group(0) @binding(0) var<uniform> U: Uni;
//@if SRC16
@group(0) @binding(1) var<storage, read> src: array<vec4<f16>>;
//@endif SRC16
//@ifn SRC16
@group(0) @binding(1) var<storage, read> src: array<f32>;
//@endif SRC16
@group(0) @binding(2) var<storage, read> src2: array<f32>;
//@if DST16
@group(0) @binding(3) var<storage, read_write> dst: array<vec4<f16>>;
//@endif DST16
//@ifn DST16
@group(0) @binding(3) var<storage, read_write> dst: array<f32>;
//@endif DST16
var<private> trips: u32;

fn src_at(e: u32) -> f32 {
  let j = e % U.db_nj;
  let r = e / U.db_nj;
  let i = r % U.db_ni;
  let r2 = r / U.db_ni;
  let h = r2 % U.db_nh;
  let b = r2 / U.db_nh;
  let a = U.o_off + b * U.db_sb + h * U.db_sh + i * U.db_si + j * U.db_sj;
//@if SRC16
  return f32(src[a >> 2u][a & 3u]);
//@endif SRC16
//@ifn SRC16
  return src[a];
//@endif SRC16
}

fn finite(x: f32) -> bool { return (bitcast<u32>(x) & 0x7f800000u) != 0x7f800000u; }

// one element of the result (OP_REFINE writes its two results itself and returns 0)
fn value(e: u32) -> f32 {
//@if OP_ADD
  return src_at(e) + src2[U.q_off + e];
//@endif OP_ADD
//@if OP_REFINE
  let g = src_at(e);
  let m = src2[U.q_off + e];
  let ln = src2[U.k_off + e];
  let fl = finite(m);
  var ms = 0.0;
  if (fl) { ms = m; }
  let gap = g - ms;
  let diff = gap - ln;
  let tol = abs(g) * 1.1920929e-07 + abs(ln) * 1.1920929e-07;   // 2**-23
  let use_local = fl && finite(g);
  let same = use_local && abs(diff) <= tol;
  var nm = g;
  var nl = 0.0;
  if (use_local) { nm = m; nl = gap; }
  if (same) { nl = ln; }
  dst[U.out2_off + e] = nm;
  dst[U.v_off + e] = nl;
  return 0.0;
//@endif OP_REFINE
//@ifn OP_ADD
//@ifn OP_REFINE
  return src_at(e);
//@endif OP_REFINE
//@endif OP_ADD
}

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
  let t = (wid.y * nwg.x + wid.x) * 64u + lid;
  let e0 = 4u * t;
  if (e0 >= U.n_out) { return; }
  var r = vec4<f32>(0.0);
  for (var c = 0u; c < 4u; c++) {
    if (e0 + c < U.n_out) { r[c] = value(e0 + c); }
  }
//@if DST16
  dst[(U.out2_off >> 2u) + t] = vec4<f16>(r);
//@endif DST16
//@ifn DST16
//@ifn OP_REFINE
  for (var c = 0u; c < 4u; c++) {
    if (e0 + c < U.n_out) { dst[U.out2_off + e0 + c] = r[c]; }
  }
//@endif OP_REFINE
//@endif DST16
}
