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
    if (j < U.SK) {
      a = lds_k(kbase + j * U.k_ss, d0 + 4u * c);
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
  //@ifn HALF
  //@for c DC4
  {
    //@for x 4
    let k{x#} = sk[(tx + {x#}u * TX) * RSQ + {c}];
    //@if DP
    let v{x#} = sv[(tx + {x#}u * TX) * RSQ + {c}];
    //@endif DP
    //@end x
    //@for r RM
    {
      let a = sq[(ty * RM + {r}) * RSQ + {c}];
      s[{r}] += vec4<f32>(dot(a, k0), dot(a, k1), dot(a, k2), dot(a, k3));
      //@if DP
      let g4 = sg[(ty * RM + {r}) * RSQ + {c}];
      dp[{r}] += vec4<f32>(dot(g4, v0), dot(g4, v1), dot(g4, v2), dot(g4, v3));
      //@endif DP
    }
    //@end r
  }
  //@end c
  //@endif HALF
  //@if HALF
  //@for cr NHC
  {
    // hs[r*4 + x]: f16 partial of s[r][x] over the HC columns of this run (2 lanes)
    var hs: array<vec2<f16>, 4 * RM>;
    //@if DP
    var hp: array<vec2<f16>, 4 * RM>;
    //@endif DP
    //@for ci HC
    {
      //@for x 4
      let k{x#} = sk[(tx + {x#}u * TX) * RSQ + {cr} * HC + {ci}];
      //@if DP
      let v{x#} = sv[(tx + {x#}u * TX) * RSQ + {cr} * HC + {ci}];
      //@endif DP
      //@end x
      //@for r RM
      {
        let a = sq[(ty * RM + {r}) * RSQ + {cr} * HC + {ci}];
        //@if DP
        let g4 = sg[(ty * RM + {r}) * RSQ + {cr} * HC + {ci}];
        //@endif DP
        //@for x 4
        hs[{r#} * 4 + {x#}] = fma(a.zw, k{x#}.zw, fma(a.xy, k{x#}.xy, hs[{r#} * 4 + {x#}]));
        //@if DP
        hp[{r#} * 4 + {x#}] = fma(g4.zw, v{x#}.zw, fma(g4.xy, v{x#}.xy, hp[{r#} * 4 + {x#}]));
        //@endif DP
        //@end x
      }
      //@end r
    }
    //@end ci
    //@for r RM
    s[{r}] += vec4<f32>(hsum(hs[{r#} * 4]), hsum(hs[{r#} * 4 + 1]), hsum(hs[{r#} * 4 + 2]),
                        hsum(hs[{r#} * 4 + 3]));
    //@if DP
    dp[{r}] += vec4<f32>(hsum(hp[{r#} * 4]), hsum(hp[{r#} * 4 + 1]), hsum(hp[{r#} * 4 + 2]),
                         hsum(hp[{r#} * 4 + 3]));
    //@endif DP
    //@end r
  }
  //@end cr
  //@endif HALF
  workgroupBarrier();
}
