// dK/dV pass: one workgroup per (key tile kt, batch b x kv head, column slice).
// Loops over units u in [t0, t1) = (query head g of the kv group, query tile qt),
// recomputing S and dP, and accumulates in registers (no atomics):
//   dV[j, :] += sum_i P[i, j] dO[i, :]        dK[j, :] += scale * sum_i dS[i, j] Q[i, :]
// Accumulators: rows j0 + ty*4 + r, vec4 columns dbase + 4*(tx + TX*v).
// DSQ_OUT (variants *-dsq): dS [B, HQ, SQ, SK] also stored into dsb for the dQ pass.
// DROPOUT: P ∘ keep into dV (times 1 / (1 − p) at the end), dS = P ∘ (dP ∘ keep /
// (1 − p) − delta) (pds), with this key tile's column words in dcw (once) and each
// unit's row words in drw.
//@# DCAP (capture gradients, with SCOREMOD; backends/webgpu/capture_grads.py): per unit,
//@# pds stores each pair's terms dS · d s' / d g of the DCNG capture reads into sdc
//@# [DCNG][BQ][BK]; the column slice 0 then sums each of the tile's W = BQ + BK - 1
//@# diagonals t = ii - jj + BK - 1 (jj ascending: one fixed order) into this unit's
//@# own slot of dcs [DCNG, B*HQ, nkt, nqt, W] (f32; cleared before the launch, so a
//@# skipped tile's slot holds 0).  DCRC (reads of q_idx or kv_idx alone too): the
//@# row reads' slots hold the tile's BQ row sums, the column reads' its BK column
//@# sums, after the diagonal reads' regions.  DCPR (pair reads): dcap_put stores each
//@# pair's term of a pair read itself into its region [B*HQ, SQ, SK] after the slots
//@# (column slice 0; one writer per element); DCPO (pair reads only): no sdc, no sums.
//@# No atomics: bitwise repeatable.
//@include common
//@ifn STAGE
var<workgroup> sq: array<SV, BQ * RSQ>;   // Q chunk [BQ][DC] (then Q slice rows)
var<workgroup> sk: array<SV, BK * RSQ>;   // K chunk [BK][DC]
var<workgroup> sg: array<SV, BQ * RSQ>;   // dO chunk [BQ][DC] (then dO slice rows)
var<workgroup> sv: array<SV, BK * RSQ>;   // V chunk [BK][DC]
//@endif STAGE
//@if STAGE
// STAGE: one workgroup array for the staged tiles, sq | sk | sg | sv at SOFF_Q/K/G/V
// (the assembler rewrites sX[i] as stg[SOFF_X + i]); an update stages IC rows from
// its first tile's offset across the idle ones that follow (IC up to twice the rows
// one tile holds: half the update chunks, half their barriers)
var<workgroup> stg: array<SV, STG>;
//@endif STAGE
//@ifn ALIAS
var<workgroup> st: array<SV, BK * RSP>;   // P^T or dS^T [BK][BQ], vec4 along i
//@endif ALIAS
//@if ALIAS
// ALIAS (variant wide): st (P^T / dS^T) is stg[SOFF_T ..], over the S/dP staging tiles
// (written after sdp's last barrier), past the update's staged rows su = stg[0 .. IC*DS4)
//@endif ALIAS
//@if DCAP
@group(0) @binding(11) var<storage, read_write> dcs: array<f32>;
//@ifn DCPO
var<workgroup> sdc: array<f32, DCNG * BQ * BK>;   // capture gradient terms [DCNG][BQ][BK]
//@endif DCPO
//@endif DCAP
//@if DROPOUT
var<workgroup> drw: array<u32, BQ>;   // dropout row words of queries i0 + [0, BQ)
var<workgroup> dcw: array<u32, BK>;   // dropout column words of keys j0 + [0, BK)
//@endif DROPOUT

@compute @workgroup_size(NT)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
  let tx = lid % TX;
  let ty = lid / TX;
  let kt = wid.x;
  let bh = wid.y + U.bh0;
  let b = bh / U.HKV;
  let kvh = bh % U.HKV;
  let dbase = wid.z * DS;
  let j0 = kt * BK;
  let kbase = U.k_off + b * U.k_sb + kvh * U.k_sh;
  let vbase = U.v_off + b * U.v_sb + kvh * U.v_sh;
  //@ifn VDIM
  let want_dk = (U.flags & F_WANT_DK) != 0u;
  let want_dv = (U.flags & F_WANT_DV) != 0u;
  //@endif VDIM
  //@if VDIM
  // VDIM: dK has D columns, dV DV (stride DV from out2_off on); a column slice past one
  // of them skips that update (the grid covers the larger)
  let want_dk = (U.flags & F_WANT_DK) != 0u && dbase < U.D;
  let want_dv = (U.flags & F_WANT_DV) != 0u && dbase < U.DV;
  //@endif VDIM
  var adk: array<vec4<f32>, 4 * NV>;
  var adv: array<vec4<f32>, 4 * NV>;
  //@if DROPOUT
  if (lid < BK) { dcw[lid] = drop_col(j0 + lid); }   // read after sdp's barriers
  //@endif DROPOUT
  if ((U.flags & F_FIRST) == 0u) {   // continue a split launch: reload the partial sums
    //@for r 4
    //@for v NV
    {
      let j = j0 + ty * 4u + {r};
      let d = dbase + 4u * (tx + {v} * TX);
      if (j < U.SK) {
        let o = (bh * U.SK + j) * U.D;
        adk[{r#} * NV + {v#}] = ld4_out(o, d);
        //@ifn VDIM
        adv[{r#} * NV + {v#}] = ld4_out(U.out2_off + o, d);
        //@endif VDIM
        //@if VDIM
        adv[{r#} * NV + {v#}] = ld4_vout(U.out2_off + (bh * U.SK + j) * U.DV, d);
        //@endif VDIM
      }
    }
    //@end v
    //@end r
  }
  for (var u = U.t0; u < U.t1; u++) {
    TRIP
    let g = u / U.nqt;
    let qt = u % U.nqt;
    let h = kvh * U.G + g;
    if (lid == 0u) { wg_code = tile_code(b, h, qt, kt); }
    let code = workgroupUniformLoad(&wg_code);
    if (code == 0u) { continue; }
    let i0 = qt * BQ;
    //@if DROPOUT
    // the previous unit's readers passed upd_kv's barriers; read after sdp's
    if (lid < BQ) { drw[lid] = drop_row(b, h, i0 + lid); }
    //@endif DROPOUT
    let qbase = U.q_off + b * U.q_sb + h * U.q_sh;
    let gbase = U.g_off + b * U.g_sb + h * U.g_sh;
    var s: array<vec4<f32>, RM>;
    var dp: array<vec4<f32>, RM>;
    //@define DP
    //@include sdp
    //@include pds
    //@if DSQ_OUT
    // the 5-product backward: dS of this (query tile, key tile) for the dQ pass (column
    // slice 0 only), one vec4 per row in tile order (common.wgsl); keys past SK are
    // stored as computed (what the recomputing dQ pass would use), rows past SQ not
    if (wid.z == 0u) {
      //@for r RM
      {
        let i = i0 + ty * RM + {r};
        if (i < U.SQ) { dsb[((((b * U.HQ + h) - U.ds_bh0) * U.SQ + i) * U.nkt + kt) * TX + tx] = ds[{r}]; }
      }
      //@end r
    }
    //@endif DSQ_OUT
    //@if DCAP
    //@ifn DCPO
    workgroupBarrier();
    if (wid.z == 0u) {
      //@ifn DCRC
      //@for m DCM
      {
        let t = lid + {m} * NT;
        if (t < BQ + BK - 1u) {
          // diagonal t: ii = jj + t - (BK - 1), both inside the tile
          let jlo = select(0u, BK - 1u - t, t < BK - 1u);
          let jhi = min(BK, BQ + BK - 1u - t);
          let slot = ((b * U.HQ + h) * U.nkt + kt) * U.nqt + qt;
          //@for k DCNG
          {
            var acc = 0.0;
            for (var jj = jlo; jj < jhi; jj++) {
              TRIP
              acc += sdc[({k} * BQ + jj + t + 1u - BK) * BK + jj];
            }
            dcs[(({k} * U.B * U.HQ * U.nkt * U.nqt) + slot) * (BQ + BK - 1u) + t] = acc;
          }
          //@end k
        }
      }
      //@end m
      //@endif DCRC
      //@if DCRC
      //@# DCRC: sdc holds the DCND diagonal (and total) reads' blocks, then the DCNR row
      //@# reads', then the DCNC column reads'; dcs their regions in that order, each
      //@# [B*HQ, nkt, nqt, width]: W diagonals as above, BQ row sums (jj ascending), BK
      //@# column sums (ii ascending).  DCM / DCMR / DCMC are 0 where a kind has no read.
      let slot = ((b * U.HQ + h) * U.nkt + kt) * U.nqt + qt;
      let nslot = U.B * U.HQ * U.nkt * U.nqt;
      //@for m DCM
      {
        let t = lid + {m} * NT;
        if (t < BQ + BK - 1u) {
          let jlo = select(0u, BK - 1u - t, t < BK - 1u);
          let jhi = min(BK, BQ + BK - 1u - t);
          //@for k DCND
          {
            var acc = 0.0;
            for (var jj = jlo; jj < jhi; jj++) {
              TRIP
              acc += sdc[({k} * BQ + jj + t + 1u - BK) * BK + jj];
            }
            dcs[({k} * nslot + slot) * (BQ + BK - 1u) + t] = acc;
          }
          //@end k
        }
      }
      //@end m
      //@for m DCMR
      {
        let t = lid + {m} * NT;
        if (t < BQ) {
          // query row t of the tile
          //@for k DCNR
          {
            var acc = 0.0;
            for (var jj = 0u; jj < BK; jj++) {
              TRIP
              acc += sdc[((DCND + {k}) * BQ + t) * BK + jj];
            }
            dcs[nslot * DCND * (BQ + BK - 1u) + ({k} * nslot + slot) * BQ + t] = acc;
          }
          //@end k
        }
      }
      //@end m
      //@for m DCMC
      {
        let t = lid + {m} * NT;
        if (t < BK) {
          // key column t of the tile
          //@for k DCNC
          {
            var acc = 0.0;
            for (var ii = 0u; ii < BQ; ii++) {
              TRIP
              acc += sdc[((DCND + DCNR + {k}) * BQ + ii) * BK + t];
            }
            dcs[nslot * (DCND * (BQ + BK - 1u) + DCNR * BQ) + ({k} * nslot + slot) * BK + t] = acc;
          }
          //@end k
        }
      }
      //@end m
      //@endif DCRC
    }
    workgroupBarrier();
    //@endif DCPO
    //@endif DCAP
    if (want_dv) {
      //@for c 4
      //@for q RM4
      st[(tx + {c} * TX) * RSP + ty * RM4 + {q}] = SV(vec4<f32>(p[4 * {q#}][{c#}], p[4 * {q#} + 1][{c#}], p[4 * {q#} + 2][{c#}], p[4 * {q#} + 3][{c#}]));
      //@end q
      //@end c
      workgroupBarrier();
      //@define UPD_SRC g
      //@define UPD_BUF sg
      //@if ALIAS
      //@define UPD_BUF su
      //@endif ALIAS
      //@define UPD_ACC adv
      //@include upd_kv
      //@undef UPD_SRC
      //@undef UPD_ACC
      //@undef UPD_BUF
    }
    if (want_dk) {
      //@for c 4
      //@for q RM4
      st[(tx + {c} * TX) * RSP + ty * RM4 + {q}] = SV(vec4<f32>(ds[4 * {q#}][{c#}], ds[4 * {q#} + 1][{c#}], ds[4 * {q#} + 2][{c#}], ds[4 * {q#} + 3][{c#}]));
      //@end q
      //@end c
      workgroupBarrier();
      //@define UPD_SRC q
      //@define UPD_BUF sq
      //@if ALIAS
      //@define UPD_BUF su
      //@endif ALIAS
      //@define UPD_ACC adk
      //@include upd_kv
      //@undef UPD_SRC
      //@undef UPD_ACC
      //@undef UPD_BUF
    }
  }
  let last = (U.flags & F_LAST) != 0u;
  //@for r 4
  //@for v NV
  {
    let j = j0 + ty * 4u + {r};
    let d = dbase + 4u * (tx + {v} * TX);
    if (j < U.SK) {
      let o = (bh * U.SK + j) * U.D;
      var k4 = adk[{r#} * NV + {v#}];
      if (last) { k4 = k4 * U.scale; }
      if (want_dk) { st4_out(o, d, k4); }
      //@ifn DROPOUT
      //@ifn VDIM
      if (want_dv) { st4_out(U.out2_off + o, d, adv[{r#} * NV + {v#}]); }
      //@endif VDIM
      //@if VDIM
      if (want_dv) { st4_vout(U.out2_off + (bh * U.SK + j) * U.DV, d, adv[{r#} * NV + {v#}]); }
      //@endif VDIM
      //@endif DROPOUT
      //@if DROPOUT
      var v4 = adv[{r#} * NV + {v#}];
      if (last) { v4 = v4 * U.drop_rs; }
      //@ifn VDIM
      if (want_dv) { st4_out(U.out2_off + o, d, v4); }
      //@endif VDIM
      //@if VDIM
      if (want_dv) { st4_vout(U.out2_off + (bh * U.SK + j) * U.DV, d, v4); }
      //@endif VDIM
      //@endif DROPOUT
    }
  }
  //@end v
  //@end r
  DEBUG_TRIPS
}
