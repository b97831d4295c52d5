// dQ pass: one workgroup per (query tile qt, batch b x query head h, column slice).
// Loops over key tiles kt in [t0, t1), recomputing S and dP:
//   dQ[i, :] += scale * sum_j dS[i, j] K[j, :]
// and, with F_WRITE_DS (column slice 0 only), stores dS into dsb [B, HQ, SQ, SK]
// for the dbias reduction.  Accumulators: rows i0 + ty*RM + r, vec4 columns
// dbase + 4*(tx + TX*v).  DROPOUT: dS = P ∘ (dP ∘ keep / (1 − p) − delta) (pds), with
// the row words of this query tile in drw (once) and each key tile's column words in dcw.
// DSQ_IN (variants *-dsq, the 5-product backward): dS is read from dsb [B, HQ, SQ, SK]
// (stored by the dK/dV pass, DSQ_OUT) instead of recomputing S and dP; only
// dQ += dS.K is computed (no F_WRITE_DS, no dropout words: dS already holds them).
//@include common
//@ifn STAGE
var<workgroup> sq: array<SV, BQ * RSQ>;   // Q chunk
var<workgroup> sk: array<SV, BK * RSQ>;   // K chunk (then K slice rows)
var<workgroup> sg: array<SV, BQ * RSQ>;   // dO chunk
var<workgroup> sv: array<SV, BK * RSQ>;   // V chunk
//@endif STAGE
//@if STAGE
// STAGE: one workgroup array for the staged tiles, sq | sk | sg | sv at SOFF_Q/K/G/V
// (the assembler rewrites sX[i] as stg[SOFF_X + i]); an update stages IC rows from
// its first tile's offset across the idle ones that follow (IC up to twice the rows
// one tile holds: half the update chunks, half their barriers)
var<workgroup> stg: array<SV, STG>;
//@endif STAGE
//@if ALIAS
// ALIAS (variant wide): sp (dS) is stg[SOFF_T ..], over the S/dP staging tiles (written
// after sdp's last barrier), past the update's staged rows at stg[0 .. IC*DS4)
//@endif ALIAS
var<workgroup> sp: array<SV, BQ * RSP2>;  // dS [BQ][TX] (element m: keys m + TX*c)
//@if DROPOUT
var<workgroup> drw: array<u32, BQ>;   // dropout row words of queries i0 + [0, BQ)
var<workgroup> dcw: array<u32, BK>;   // dropout column words of keys j0 + [0, BK)
//@endif DROPOUT

@compute @workgroup_size(NT)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
  let tx = lid % TX;
  let ty = lid / TX;
  let qt = wid.x;
  let bh = wid.y + U.bh0;
  let b = bh / U.HQ;
  let h = bh % U.HQ;
  let kvh = h / U.G;
  let dbase = wid.z * DS;
  let i0 = qt * BQ;
  let qbase = U.q_off + b * U.q_sb + h * U.q_sh;
  let gbase = U.g_off + b * U.g_sb + h * U.g_sh;
  let kbase = U.k_off + b * U.k_sb + kvh * U.k_sh;
  let vbase = U.v_off + b * U.v_sb + kvh * U.v_sh;
  let write_ds = (U.flags & F_WRITE_DS) != 0u && wid.z == 0u;
  var acc: array<vec4<f32>, RM * NV>;
  //@if DROPOUT
  if (lid < BQ) { drw[lid] = drop_row(b, h, i0 + lid); }   // read after sdp's barriers
  //@endif DROPOUT
  if ((U.flags & F_FIRST) == 0u) {
    //@for r RM
    //@for v NV
    {
      let i = i0 + ty * RM + {r};
      if (i < U.SQ) { acc[{r#} * NV + {v#}] = ld4_out((bh * U.SQ + i) * U.D, dbase + 4u * (tx + {v} * TX)); }
    }
    //@end v
    //@end r
  }
  //@if DSQ_PF
  // DSQ_PF: the next key tile's dS rows, loaded into registers before this tile's update
  // (their latency behind its arithmetic); used where that tile is the next one run
  var dpf: array<vec4<f32>, RM>;
  var dpf_kt = 0xffffffffu;
  //@endif DSQ_PF
  for (var kt = U.t0; kt < U.t1; kt++) {
    TRIP
    if (lid == 0u) { wg_code = tile_code(b, h, qt, kt); }
    let code = workgroupUniformLoad(&wg_code);
    if (code == 0u) { continue; }
    let j0 = kt * BK;
    //@if DSQ_IN
    //@ifn DSQ_PF
    //@for r RM
    {
      let i = i0 + ty * RM + {r};
      var d4 = vec4<f32>();   // dS[i][j0 + tx + TX*c], c < 4 (tile order, common.wgsl)
      if (i < U.SQ) { d4 = dsb[(((bh - U.ds_bh0) * U.SQ + i) * U.nkt + kt) * TX + tx]; }
      sp[(ty * RM + {r}) * RSP2 + tx] = SV(d4);
    }
    //@end r
    //@endif DSQ_PF
    //@if DSQ_PF
    let have = dpf_kt == kt;
    //@for r RM
    {
      let i = i0 + ty * RM + {r};
      var d4 = dpf[{r}];      // prefetched at the tile before, else loaded now
      if (!have) {
        d4 = vec4<f32>();
        if (i < U.SQ) { d4 = dsb[(((bh - U.ds_bh0) * U.SQ + i) * U.nkt + kt) * TX + tx]; }
      }
      sp[(ty * RM + {r}) * RSP2 + tx] = SV(d4);
    }
    //@end r
    if (kt + 1u < U.t1) {     // the next tile's rows (skipped tiles: loaded, never used)
      //@for r RM
      {
        let i = i0 + ty * RM + {r};
        dpf[{r}] = vec4<f32>();
        if (i < U.SQ) { dpf[{r}] = dsb[(((bh - U.ds_bh0) * U.SQ + i) * U.nkt + kt + 1u) * TX + tx]; }
      }
      //@end r
      dpf_kt = kt + 1u;
    }
    //@endif DSQ_PF
    //@endif DSQ_IN
    //@ifn DSQ_IN
    //@if DROPOUT
    if (lid < BK) { dcw[lid] = drop_col(j0 + lid); }   // read after sdp's barriers
    //@endif DROPOUT
    var s: array<vec4<f32>, RM>;
    var dp: array<vec4<f32>, RM>;
    //@define DP
    //@include sdp
    //@include pds
    //@for r RM
    {
      sp[(ty * RM + {r}) * RSP2 + tx] = SV(ds[{r}]);
      if (write_ds) {
        let i = i0 + ty * RM + {r};
        //@for c 4
        {
          let j = j0 + tx + {c} * TX;
          //@ifn DSCHAIN
          if (i < U.SQ && j < U.SK) { dsb[(bh * U.SQ + i) * U.SK + j] = ds[{r}][{c#}]; }
          //@endif DSCHAIN
          //@if DSCHAIN
          if (i < U.SQ && j < U.SK) { dsb[(bh * U.SQ + i) * U.SK + j] = dsr[{r}][{c#}]; }
          //@endif DSCHAIN
        }
        //@end c
      }
    }
    //@end r
    //@endif DSQ_IN
    workgroupBarrier();
    //@define UPD_SRC k
    //@include upd_q
    //@undef UPD_SRC
  }
  let last = (U.flags & F_LAST) != 0u;
  //@for r RM
  //@for v NV
  {
    let i = i0 + ty * RM + {r};
    if (i < U.SQ) {
      var a = acc[{r#} * NV + {v#}];
      if (last) { a = a * U.scale; }
      st4_out((bh * U.SQ + i) * U.D, dbase + 4u * (tx + {v} * TX), a);
    }
  }
  //@end v
  //@end r
  DEBUG_TRIPS
}
