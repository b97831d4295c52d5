// S = Q_i K_j^T and (with DP) dP = dO_i V_j^T over D in chunks of DC:
// s[r][c], dp[r][c] for query i0 + ty*RM + r (r < RM: 4, or 8 in the wide backward),
// key j0 + tx + TX*c.
// Needs: qbase, gbase (row 0 of this head's q / dout), kbase, vbase, i0, j0.
// Workgroup tiles hold SV = 4 consecutive d values (vec4<f32>; vec4<f16> in HALF mode).
// HALF: products in packed f16 (vec2<f16> FMA, lanes = even/odd d) over runs of HC
// vec4 columns (2*HC products per lane), each run's partial added into f32 s / dp.
//@define SDP_D U.D
//@if VDIM
// VDIM (v's head dim U.DV differs from D): with DP the loop runs over max(D, DV), the
// loaders reading zeros past each operand's own dim (q, k past D; dO, v past DV).
//@if DP
//@define SDP_D max(U.D,U.DV)
//@endif DP
//@endif VDIM
//@if PREFETCH
// PREFETCH: the chunk at d0 + DC is read from global memory into registers (pq/pg,
// pk/pv: NEQ / NEK elements per invocation) before the products of chunk d0, so the
// loads' latency hides behind them; stored to the workgroup tiles after the barrier.
var pq: array<SV, NEQ>;
var pk: array<SV, NEK>;
//@if DP
var pg: array<SV, NEQ>;
var pv: array<SV, NEK>;
//@endif DP
let d00 = 0u;
//@define PF_D0 d00
//@include sdp_ld
//@endif PREFETCH
for (var d0 = 0u; d0 < $SDP_D$; d0 += DC) {
  TRIP
//@ifn PREFETCH
  for (var e = lid; e < BQ * DC4; e += NT) {
    TRIP
    let r = e / DC4;
    let c = e % DC4;
    let i = i0 + r;
    var a = SV();
    //@if DP
    var g4 = SV();
    //@endif DP
    if (i < U.SQ) {
      a = lds_q(qbase + i * U.q_ss, d0 + 4u * c);
      //@if DP
      g4 = lds_g(gbase + i * U.g_ss, d0 + 4u * c);
      //@endif DP
    }
    sq[r * RSQ + c] = a;
    //@if DP
    sg[r * RSQ + c] = g4;
    //@endif DP
  }
  for (var e = lid; e < BK * DC4; e += NT) {
    TRIP
    let r = e / DC4;
    let c = e % DC4;
    let j = j0 + r;
    var a = SV();
    //@if DP
    var v4 = SV();
    //@endif DP
    if (j < $SKB$) {
      //@ifn PAGED
      a = lds_k(kbase + j * U.k_ss, d0 + 4u * c);
      //@endif PAGED
      //@if PAGED
      a = lds_k(kbase + pgk[r], d0 + 4u * c);
      //@endif PAGED
      //@if DP
      v4 = lds_v(vbase + j * U.v_ss, d0 + 4u * c);
      //@endif DP
    }
    sk[r * RSQ + c] = a;
    //@if DP
    sv[r * RSQ + c] = v4;
    //@endif DP
  }
//@endif PREFETCH
//@if PREFETCH
  //@include sdp_st
  let d0n = d0 + DC;
  if (d0n < $SDP_D$) {
    //@define PF_D0 d0n
    //@include sdp_ld
  }
//@endif PREFETCH
  workgroupBarrier();
  //@ifn VDIM
//@include sdp_mul
  //@endif VDIM
  //@if VDIM
  //@ifn DP
//@include sdp_mul
  //@endif DP
  //@if DP
  // VDIM: a chunk both dims reach takes the S and dP products; past one of them only
  // the other's (the loaders give zeros there: the same sums, without the zero terms)
  if (d0 < min(U.D, U.DV)) {
//@include sdp_mul
  } else if (d0 < U.D) {
  //@undef DP
//@include sdp_mul
  //@define DP
  } else {
  //@define SDP_NO_S
//@include sdp_mul
  //@undef SDP_NO_S
  }
  //@endif DP
  //@endif VDIM
  workgroupBarrier();
}
