// Forward: one workgroup per (query tile qt, batch b x query head h, column slice).
// Online softmax over key tiles kt in [t0, t1):
//   m_i = running max, l_i = running sum, acc[i, :] = sum_j exp(s_ij - m_i) V[j, :]
// With F_LAST: out = acc / l (0 on an empty row), the row max m into stats[row] and
// the log-normaliser log(l) into stats[6n + row] (kept apart: DESIGN.md §1; an empty
// row: m = -inf, 0; a NaN row: NaN, NaN); otherwise acc (outb), m and l (stats[ml_wr + row],
// stats[ml_wr + n + row]) are stored for the next piece of a split launch, which
// reads them from ml_rd (two alternating sets: column slices read while slice 0 writes).
// Score modifiers (SOFTCAP, ALIBI: score_ij in common; SINKS: the epilogue) where
// compiled in.  DROPOUT: the P that multiplies V is P ∘ keep (row words of the tile's
// queries in drw, once; column words of each key tile in dcw), l stays undropped,
// and the last piece multiplies out by 1 / (1 − p).
//@include common
//@if VDIM
// VDIM: out and v have DV columns (the column slices are DV's), q and k have D.
//@endif VDIM
//@ifn STAGE
var<workgroup> sq: array<SV, BQ * RSQ>;   // Q chunk
var<workgroup> sk: array<SV, BK * RSQ>;   // K chunk (then V slice rows)
//@endif STAGE
//@if STAGE
// STAGE: one workgroup array for the staged tiles, sq | sk | sg | sv at SOFF_Q/K/G/V
// (the assembler rewrites sX[i] as stg[SOFF_X + i]); an update stages IC rows from
// its first tile's offset across the idle ones that follow (IC up to twice the rows
// one tile holds: half the update chunks, half their barriers)
var<workgroup> stg: array<SV, (BQ + BK) * RSQ>;
//@endif STAGE
var<workgroup> sp: array<SV, BQ * RSP2>;  // P [BQ][TX] (element m: keys m + TX*c)
var<workgroup> red: array<f32, BQ * TX>;         // per-row partials of max / sum
var<workgroup> rowm: array<f32, BQ>;
var<workgroup> rowl: array<f32, BQ>;
var<workgroup> rowa: array<f32, BQ>;
//@if PAGED
// PAGED: element offsets (pg_row) of the key tile's rows j0 + [0, BK) in k and v, from
// the block table once per tile (0 past the sequence's keys: never read)
var<workgroup> pgk: array<u32, BK>;
var<workgroup> pgv: array<u32, BK>;
//@endif PAGED
//@if DROPOUT
var<workgroup> drw: array<u32, BQ>;   // dropout row words of queries i0 + [0, BQ)
var<workgroup> dcw: array<u32, BK>;   // dropout column words of keys j0 + [0, BK)
//@endif DROPOUT

@compute @workgroup_size(NT)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>,
        //@if SUBGROUPS
        @builtin(subgroup_size) sgs: u32,
        //@endif SUBGROUPS
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
  //@ifn PAGED
  let kbase = U.k_off + b * U.k_sb + kvh * U.k_sh;
  let vbase = U.v_off + b * U.v_sb + kvh * U.v_sh;
  //@endif PAGED
  //@if PAGED
  // PAGED: the head's base in page 0; key rows at the offsets pgk / pgv of each key tile
  let kbase = U.k_off + kvh * U.k_sh;
  let vbase = U.v_off + kvh * U.v_sh;
  let skb = pg_len(b);
  //@endif PAGED
  let first = (U.flags & F_FIRST) != 0u;
  //@if SUBGROUPS
  // SUBGROUPS: the TX lanes of a thread row are one aligned run of consecutive subgroup
  // lanes (local_invocation_index order) when the subgroup has at least TX of them:
  // row max / sum by shuffle-xor butterflies, lane tx = 0 keeps rowm / rowl / rowa.
  // A smaller subgroup takes the workgroup round trip (red + a serial loop) instead.
  let sg_ok = sgs >= TX;
  var rmx: array<f32, 4>;
  var rsm: array<f32, 4>;
  //@endif SUBGROUPS
  var acc: array<vec4<f32>, 4 * NV>;
  if (lid < BQ) {
    let i = i0 + lid;
    var m = U.neg_inf;
    var l = 0.0;
    if (!first && i < U.SQ) {
      let row = bh * U.SQ + i;
      m = stats[U.ml_rd + row];
      l = stats[U.ml_rd + U.stat_n + row];
    }
    rowm[lid] = m;
    rowl[lid] = l;
    //@if DROPOUT
    drw[lid] = drop_row(b, h, i);
    //@endif DROPOUT
  }
  if (!first) {
    //@for r 4
    //@for v NV
    {
      let i = i0 + ty * 4u + {r};
      if (i < U.SQ) { acc[{r#} * NV + {v#}] = ld4_$VOUT$((bh * U.SQ + i) * $VD$, dbase + 4u * (tx + {v} * TX)); }
    }
    //@end v
    //@end r
  }
  for (var kt = U.t0; kt < U.t1; kt++) {
    TRIP
    //@if PAGED
    // (the previous tile's readers passed its last barrier; workgroupUniformLoad orders these)
    if (lid < BK) {
      let j = kt * BK + lid;
      var ok = 0u;
      var ov = 0u;
      if (j < skb) {
        ok = pg_row(b, j, U.k_sb, U.k_ss);
        ov = pg_row(b, j, U.v_sb, U.v_ss);
      }
      pgk[lid] = ok;
      pgv[lid] = ov;
    }
    //@endif PAGED
    if (lid == 0u) { wg_code = tile_code(b, h, qt, kt); }
    let code = workgroupUniformLoad(&wg_code);
    if (code == 0u) { continue; }
    let j0 = kt * BK;
    //@if DROPOUT
    if (lid < BK) { dcw[lid] = drop_col(j0 + lid); }   // read after sdp's barriers
    //@endif DROPOUT
    var s: array<vec4<f32>, 4>;
    //@undef DP
    //@include sdp
    // scores, masked to -inf; partial row maxima
    //@for r 4
    {
      let i = i0 + ty * 4u + {r};
      var mx = U.neg_inf;
      //@for c 4
      {
        let j = j0 + tx + {c} * TX;
        var x = U.neg_inf;
        if (i < U.SQ && j < $SKB$) {
          var kept = true;
          if (code == 1u) { kept = keep_ij(b, h, i, j); }
          if (kept) {
            //@ifn SCOREMOD
            //@ifn SOFTCAP
            x = score_ij(s[{r}][{c#}] * U.scale, b, h, i, j);
            //@endif SOFTCAP
            //@if SOFTCAP
            x = score_ij(softcap_t(s[{r}][{c#}] * U.scale).x, b, h, i, j);
            //@endif SOFTCAP
            //@endif SCOREMOD
            //@if SCOREMOD
            //@ifn SOFTCAP
            x = score_ij(smod_v(s[{r}][{c#}] * U.scale, b, h, i, j), b, h, i, j);
            //@endif SOFTCAP
            //@if SOFTCAP
            x = score_ij(smod_v(softcap_t(s[{r}][{c#}] * U.scale).x, b, h, i, j), b, h, i, j);
            //@endif SOFTCAP
            //@endif SCOREMOD
          }
        }
        s[{r}][{c#}] = x;
        mx = max(mx, x);
      }
      //@end c
      //@ifn SUBGROUPS
      red[(ty * 4u + {r}) * TX + tx] = mx;
      //@endif SUBGROUPS
      //@if SUBGROUPS
      rmx[{r}] = mx;
      //@endif SUBGROUPS
    }
    //@end r
    //@if SUBGROUPS
    if (sg_ok) {
      //@for r 4
      {
        var mx = rmx[{r}];
        //@include sg_bfly_max
        if (tx == 0u) {
          let il = ty * 4u + {r};
          let mo = rowm[il];
          let m = max(mo, mx);
          var a = 0.0;
          if (!is_ninf(mo)) { a = exp(mo - m); }
          rowa[il] = a;
          rowm[il] = m;
        }
      }
      //@end r
    } else {
      //@for r 4
      red[(ty * 4u + {r}) * TX + tx] = rmx[{r}];
      //@end r
      //@endif SUBGROUPS
    workgroupBarrier();
    if (lid < BQ) {
      let mo = rowm[lid];
      var m = mo;
      for (var t = 0u; t < TX; t++) {
        TRIP
        m = max(m, red[lid * TX + t]);
      }
      var a = 0.0;
      if (!is_ninf(mo)) { a = exp(mo - m); }
      rowa[lid] = a;
      rowm[lid] = m;
    }
    //@if SUBGROUPS
    }
    //@endif SUBGROUPS
    workgroupBarrier();
    //@if DROPOUT
    let cwd = vec4<u32>(dcw[tx], dcw[tx + TX], dcw[tx + 2u * TX], dcw[tx + 3u * TX]);
    //@endif DROPOUT
    //@for r 4
    {
      let m = rowm[ty * 4u + {r}];
      //@if DROPOUT
      let rwd = drw[ty * 4u + {r}];
      //@endif DROPOUT
      var sm = 0.0;
      var pr = vec4<f32>(0.0);
      //@for c 4
      {
        var pv = 0.0;
        let x = s[{r}][{c#}];
        // excluded scores (-inf) give 0; a kept one is finite (m >= x) or NaN, and
        // max() may drop a NaN score, so NaN reaches pv and propagates
        if (!is_ninf(x)) { pv = exp(x - m); }
        //@ifn DROPOUT
        pr[{c#}] = pv;
        //@endif DROPOUT
        //@if DROPOUT
        pr[{c#}] = select(0.0, pv, drop_keep(rwd, cwd[{c#}]));
        //@endif DROPOUT
        sm += pv;
      }
      //@end c
      sp[(ty * 4u + {r}) * RSP2 + tx] = SV(pr);
      //@ifn SUBGROUPS
      red[(ty * 4u + {r}) * TX + tx] = sm;
      //@endif SUBGROUPS
      //@if SUBGROUPS
      rsm[{r}] = sm;
      //@endif SUBGROUPS
      let a = rowa[ty * 4u + {r}];
      //@for v NV
      acc[{r#} * NV + {v#}] *= a;
      //@end v
    }
    //@end r
    //@if SUBGROUPS
    // (sg_ok: no barrier here: lane tx = 0 alone reads and writes its rows' rowl / rowa;
    // upd_q's staging barrier orders the sp stores before their readers)
    if (sg_ok) {
      //@for r 4
      {
        var sm = rsm[{r}];
        //@include sg_bfly_sum
        if (tx == 0u) {
          let il = ty * 4u + {r};
          rowl[il] = rowl[il] * rowa[il] + sm;
        }
      }
      //@end r
    } else {
      //@for r 4
      red[(ty * 4u + {r}) * TX + tx] = rsm[{r}];
      //@end r
    //@endif SUBGROUPS
    workgroupBarrier();
    if (lid < BQ) {
      var l = rowl[lid] * rowa[lid];
      for (var t = 0u; t < TX; t++) {
        TRIP
        l += red[lid * TX + t];
      }
      rowl[lid] = l;
    }
    //@if SUBGROUPS
    }
    //@endif SUBGROUPS
    //@define UPD_SRC v
    //@include upd_q
    //@undef UPD_SRC
  }
  workgroupBarrier();
  let last = (U.flags & F_LAST) != 0u;
  //@if SINKS
  // Sinks (with F_LAST): the sink t = sinks[h] joins the row statistics as one more
  // term of the normaliser: m2 = max(m, t), l2 = l·exp(m − m2) + exp(t − m2), and
  // out = acc·exp(m − m2) / l2 (rowa holds the factor).  A row keeping no key: m2 = t,
  // l2 = 1, out 0 (lse = t); a sink of −inf changes nothing; NaN stays NaN.
  if (last && lid < BQ) {
    let t = bitcast<f32>(aux[U.snk_off + h]);
    let m = rowm[lid];
    var a = 1.0;
    if (!is_ninf(t)) {
      let m2 = max(m, t);
      a = 0.0;
      if (!is_ninf(m)) { a = exp(m - m2); }
      rowm[lid] = m2;
      rowl[lid] = rowl[lid] * a + exp(t - m2);
    }
    rowa[lid] = a;
  }
  workgroupBarrier();
  //@endif SINKS
  //@for r 4
  {
    let il = ty * 4u + {r};
    let i = i0 + il;
    if (i < U.SQ) {
      let l = rowl[il];
      let o = (bh * U.SQ + i) * $VD$;
      //@for v NV
      {
        var a = acc[{r#} * NV + {v#}];
        if (last) {
          //@ifn SINKS
          if (l == 0.0) { a = vec4<f32>(0.0); } else { a = a / l; }
          //@endif SINKS
          //@if SINKS
          if (l == 0.0) { a = vec4<f32>(0.0); } else { a = (a * rowa[il]) / l; }
          //@endif SINKS
          //@if DROPOUT
          a = a * U.drop_rs;
          //@endif DROPOUT
        }
        st4_$VOUT$(o, dbase + 4u * (tx + {v} * TX), a);
      }
      //@end v
    }
  }
  //@end r
  if (lid < BQ && wid.z == 0u) {
    let i = i0 + lid;
    if (i < U.SQ) {
      let row = bh * U.SQ + i;
      let m = rowm[lid];
      let l = rowl[lid];
      if (last) {
        var mx = m;
        var ln = log(l);
        if (l == 0.0) { mx = U.neg_inf; ln = 0.0; }
        if (is_nan(l)) { mx = l; }
        stats[row] = mx;
        stats[6u * U.stat_n + row] = ln;
      } else {
        stats[U.ml_wr + row] = m;
        stats[U.ml_wr + U.stat_n + row] = l;
      }
    }
  }
  DEBUG_TRIPS
}
