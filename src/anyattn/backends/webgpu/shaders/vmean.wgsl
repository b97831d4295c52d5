// Seed quirk helper: vmean[(b*H + h)*D + d] = mean over all SK keys of V[b, h, :, d]
// (summed over keys [t0, t1) per piece; F_LAST divides by SK).
@group(0) @binding(0) var<uniform> U: Uni;
@group(0) @binding(1) var<storage, read> vb: array<T>;
@group(0) @binding(2) var<storage, read_write> outb: array<f32>;
var<private> trips: u32;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
  let e = (wid.y * nwg.x + wid.x) * 64u + lid;
  if (e >= U.n_out) { return; }
  let d = e % U.D;
  let bh = e / U.D;
  let b = bh / U.HKV;
  let h = bh % U.HKV;
  let base = U.v_off + b * U.v_sb + h * U.v_sh + d;
  var acc = 0.0;
  if ((U.flags & F_FIRST) == 0u) { acc = outb[e]; }
  for (var j = U.t0; j < U.t1; j++) {
    TRIP
    acc += f32(vb[base + j * U.v_ss]);
  }
  if ((U.flags & F_LAST) != 0u) { acc *= U.inv_sk; }
  outb[e] = acc;
  DEBUG_TRIPS1
}
