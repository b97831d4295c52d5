// S = Q_i K_j^T and (with DP) dP = dO_i V_j^T over D in chunks of DC:
// s[r][c], dp[r][c] for query i0 + ty*4 + r, key j0 + tx + TX*c.
// Needs: qbase, gbase (row 0 of this head's q / dout), kbase, vbase, i0, j0.
for (var d0 = 0u; d0 < U.D; d0 += DC) {
  TRIP
  for (var e = lid; e < BQ * DC4; e += NT) {
    TRIP
    let r = e / DC4;
    let c = e % DC4;
    let i = i0 + r;
    var a = vec4<f32>(0.0);
    //@if DP
    var g4 = vec4<f32>(0.0);
    //@endif DP
    if (i < U.SQ) {
      a = ld4_q(qbase + i * U.q_ss, d0 + 4u * c);
      //@if DP
      g4 = ld4_g(gbase + i * U.g_ss, d0 + 4u * c);
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
    var a = vec4<f32>(0.0);
    //@if DP
    var v4 = vec4<f32>(0.0);
    //@endif DP
    if (j < U.SK) {
      a = ld4_k(kbase + j * U.k_ss, d0 + 4u * c);
      //@if DP
      v4 = ld4_v(vbase + j * U.v_ss, d0 + 4u * c);
      //@endif DP
    }
    sk[r * RSQ + c] = a;
    //@if DP
    sv[r * RSQ + c] = v4;
    //@endif DP
  }
  workgroupBarrier();
  //@for c DC4
  {
    //@for x 4
    let k{x#} = sk[(tx + {x#}u * TX) * RSQ + {c}];
    //@if DP
    let v{x#} = sv[(tx + {x#}u * TX) * RSQ + {c}];
    //@endif DP
    //@end x
    //@for r 4
    {
      let a = sq[(ty * 4u + {r}) * RSQ + {c}];
      s[{r}] += vec4<f32>(dot(a, k0), dot(a, k1), dot(a, k2), dot(a, k3));
      //@if DP
      let g4 = sg[(ty * 4u + {r}) * RSQ + {c}];
      dp[{r}] += vec4<f32>(dot(g4, v0), dot(g4, v1), dot(g4, v2), dot(g4, v3));
      //@endif DP
    }
    //@end r
  }
  //@end c
  workgroupBarrier();
}
