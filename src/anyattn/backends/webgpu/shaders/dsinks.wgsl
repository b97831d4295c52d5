// dsinks [HQ] on the device (anyattn.modifiers.sinks_grad): one invocation per query
// head h sums, over the rows r = (b, i) in [t0, t1) of B*SQ in order,
//   dsinks[h] -= exp((t - max) - log_norm) * delta      (0 where max or t is -inf)
// with t = sinks[h] (f32 bits in aux at snk_off), max = stats[row],
// delta = stats[n + row], log_norm = stats[k_off + row], row = (b*HQ + h)*SQ + i.
// F_FIRST starts from 0; later pieces (llvmpipe's loop budget) continue from dst.
@group(0) @binding(0) var<uniform> U: Uni;
@group(0) @binding(1) var<storage, read> stats: array<f32>;
@group(0) @binding(2) var<storage, read> aux: array<u32>;
@group(0) @binding(3) var<storage, read_write> dst: array<f32>;
var<private> trips: u32;

fn is_ninf(x: f32) -> bool { return bitcast<u32>(x) == 0xff800000u; }

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
  let h = (wid.y * nwg.x + wid.x) * 64u + lid;
  if (h >= U.HQ) { return; }
  let t = bitcast<f32>(aux[U.snk_off + h]);
  var acc = 0.0;
  if ((U.flags & F_FIRST) == 0u) { acc = dst[U.out2_off + h]; }
  for (var r = U.t0; r < U.t1; r++) {
    TRIP
    let b = r / U.SQ;
    let i = r % U.SQ;
    let row = (b * U.HQ + h) * U.SQ + i;
    let m = stats[row];
    if (!is_ninf(m) && !is_ninf(t)) {
      acc -= exp((t - m) - stats[U.k_off + row]) * stats[U.stat_n + row];
    }
  }
  dst[U.out2_off + h] = acc;
}
