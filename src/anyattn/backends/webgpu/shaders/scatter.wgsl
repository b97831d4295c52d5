// Seed ABI: copy a contiguous [B, H, R, D] f32 result (src) into the arena at the
// output's offset and strides (o_off, o_sb, o_sh, o_ss), writing nothing else;
// src starts at element q_off.
@group(0) @binding(0) var<uniform> U: Uni;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> arena: array<f32>;
var<private> trips: u32;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
  let e = (wid.y * nwg.x + wid.x) * 64u + lid;
  if (e >= U.n_out) { return; }
  let d = e % U.D;
  let r = (e / U.D) % U.SQ;
  let bh = e / (U.D * U.SQ);
  let b = bh / U.HQ;
  let h = bh % U.HQ;
  arena[U.o_off + b * U.o_sb + h * U.o_sh + r * U.o_ss + d] = src[U.q_off + e];
}
