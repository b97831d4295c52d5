// dbias: sum dS [B, HQ, SQ, SK] (dsb) over the dims the bias broadcasts, in a fixed
// order (deterministic, no atomics).  One output element per invocation; the
// reduced combinations r in [t0, t1) (counts red_b/h/i/j, 1 where not reduced).
@group(0) @binding(0) var<uniform> U: Uni;
@group(0) @binding(1) var<storage, read> dsb: array<f32>;
@group(0) @binding(2) var<storage, read_write> outb: array<f32>;
var<private> trips: u32;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
  let e = (wid.y * nwg.x + wid.x) * 64u + lid;
  if (e >= U.n_out) { return; }
  let ej = e % U.db_nj;
  let ei = (e / U.db_nj) % U.db_ni;
  let eh = (e / (U.db_nj * U.db_ni)) % U.db_nh;
  let eb = e / (U.db_nj * U.db_ni * U.db_nh);
  var acc = 0.0;
  if ((U.flags & F_FIRST) == 0u) { acc = outb[e]; }
  for (var r = U.t0; r < U.t1; r++) {
    TRIP
    let rj = r % U.red_j;
    let ri = (r / U.red_j) % U.red_i;
    let rh = (r / (U.red_j * U.red_i)) % U.red_h;
    let rb = r / (U.red_j * U.red_i * U.red_h);
    let b = eb + rb;
    let h = eh + rh;
    let i = ei + ri;
    let j = ej + rj;
    acc += dsb[((b * U.HQ + h) * U.SQ + i) * U.SK + j];
  }
  outb[e] = acc;
  DEBUG_TRIPS1
}
