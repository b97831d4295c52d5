// delta pass: delta[row] = <dO[row, :], out[row, :]> into stats[n + row], one row
// per invocation (row = (b*HQ + h)*SQ + i).  Seed quirk (F_QUIRK): a row with
// max = -inf (no kept key) attends uniformly, so out is the mean of V over all keys (vmean).
// OUT16 (f16 inputs): out in f16, bound where it lies, each element widened exactly to
// f32 (the products and the sum are those of an f32 copy of it: no gather launch).
@group(0) @binding(0) var<uniform> U: Uni;
@group(0) @binding(1) var<storage, read> gb: array<T>;
//@ifn OUT16
@group(0) @binding(2) var<storage, read> ob: array<f32>;
//@endif OUT16
//@if OUT16
@group(0) @binding(2) var<storage, read> ob: array<f16>;
//@endif OUT16
@group(0) @binding(3) var<storage, read_write> stats: array<f32>;
@group(0) @binding(4) var<storage, read> vmean: array<f32>;
var<private> trips: u32;

fn is_ninf(x: f32) -> bool { return bitcast<u32>(x) == 0xff800000u; }

//@ifn SUBGROUPS
@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
  let row = (wid.y * nwg.x + wid.x) * 64u + lid;
  if (row >= U.stat_n) { return; }
  let i = row % U.SQ;
  let bh = row / U.SQ;
  let b = bh / U.HQ;
  let h = bh % U.HQ;
  let gbase = U.g_off + b * U.g_sb + h * U.g_sh + i * U.g_ss;
  let obase = U.o_off + b * U.o_sb + h * U.o_sh + i * U.o_ss;
  let uni = (U.flags & F_QUIRK) != 0u && is_ninf(stats[row]);
  var acc = 0.0;
  for (var d = 0u; d < U.D; d++) {
    TRIP
    var o = f32(ob[obase + d]);
    if (uni) { o = vmean[bh * U.D + d]; }
    acc += f32(gb[gbase + d]) * o;
  }
  stats[U.stat_n + row] = acc;
  DEBUG_TRIPS1
}
//@endif SUBGROUPS
//@if SUBGROUPS
// SUBGROUPS: RL consecutive lanes per row (RL <= 4 <= WebGPU's smallest subgroup), lane
// r sums d = r, r + RL, ... (the RL lanes read RL consecutive elements: coalesced),
// then a shuffle-xor butterfly; lane 0 stores.  No early return: every lane of a
// subgroup takes part in the shuffles (rows past the end sum nothing).
@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
  let t = (wid.y * nwg.x + wid.x) * 64u + lid;
  let row = t / RL;
  let lane = t % RL;
  let live = row < U.stat_n;
  let i = row % U.SQ;
  let bh = row / U.SQ;
  let b = bh / U.HQ;
  let h = bh % U.HQ;
  let gbase = U.g_off + b * U.g_sb + h * U.g_sh + i * U.g_ss;
  let obase = U.o_off + b * U.o_sb + h * U.o_sh + i * U.o_ss;
  var uni = false;
  var dn = 0u;
  if (live) {
    uni = (U.flags & F_QUIRK) != 0u && is_ninf(stats[row]);
    dn = U.D;
  }
  var acc = 0.0;
  for (var d = lane; d < dn; d += RL) {
    TRIP
    var o = f32(ob[obase + d]);
    if (uni) { o = vmean[bh * U.D + d]; }
    acc += f32(gb[gbase + d]) * o;
  }
  if (RL > 2u) { acc = acc + subgroupShuffleXor(acc, 2u); }
  if (RL > 1u) { acc = acc + subgroupShuffleXor(acc, 1u); }
  if (live && lane == 0u) { stats[U.stat_n + row] = acc; }
  DEBUG_TRIPS1
}
//@endif SUBGROUPS
