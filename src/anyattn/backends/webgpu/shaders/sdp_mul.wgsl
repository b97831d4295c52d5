//@# sdp's products of one staged D chunk (included by sdp): S += Q K^T and, with DP,
//@# dP += dO V^T; SDP_NO_S (VDIM, chunks past D): the dP products alone.
  //@ifn HALF
  //@for c DC4
  {
    //@for x 4
    //@ifn SDP_NO_S
    let k{x#} = sk[(tx + {x#}u * TX) * RSQ + {c}];
    //@endif SDP_NO_S
    //@if DP
    let v{x#} = sv[(tx + {x#}u * TX) * RSQ + {c}];
    //@endif DP
    //@end x
    //@for r RM
    {
      //@ifn SDP_NO_S
      let a = sq[(ty * RM + {r}) * RSQ + {c}];
      s[{r}] += vec4<f32>(dot(a, k0), dot(a, k1), dot(a, k2), dot(a, k3));
      //@endif SDP_NO_S
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
    //@ifn SDP_NO_S
    var hs: array<vec2<f16>, 4 * RM>;
    //@endif SDP_NO_S
    //@if DP
    var hp: array<vec2<f16>, 4 * RM>;
    //@endif DP
    //@for ci HC
    {
      //@for x 4
      //@ifn SDP_NO_S
      let k{x#} = sk[(tx + {x#}u * TX) * RSQ + {cr} * HC + {ci}];
      //@endif SDP_NO_S
      //@if DP
      let v{x#} = sv[(tx + {x#}u * TX) * RSQ + {cr} * HC + {ci}];
      //@endif DP
      //@end x
      //@for r RM
      {
        //@ifn SDP_NO_S
        let a = sq[(ty * RM + {r}) * RSQ + {cr} * HC + {ci}];
        //@endif SDP_NO_S
        //@if DP
        let g4 = sg[(ty * RM + {r}) * RSQ + {cr} * HC + {ci}];
        //@endif DP
        //@for x 4
        //@ifn SDP_NO_S
        hs[{r#} * 4 + {x#}] = fma(a.zw, k{x#}.zw, fma(a.xy, k{x#}.xy, hs[{r#} * 4 + {x#}]));
        //@endif SDP_NO_S
        //@if DP
        hp[{r#} * 4 + {x#}] = fma(g4.zw, v{x#}.zw, fma(g4.xy, v{x#}.xy, hp[{r#} * 4 + {x#}]));
        //@endif DP
        //@end x
      }
      //@end r
    }
    //@end ci
    //@for r RM
    //@ifn SDP_NO_S
    s[{r}] += vec4<f32>(hsum(hs[{r#} * 4]), hsum(hs[{r#} * 4 + 1]), hsum(hs[{r#} * 4 + 2]),
                        hsum(hs[{r#} * 4 + 3]));
    //@endif SDP_NO_S
    //@if DP
    dp[{r}] += vec4<f32>(hsum(hp[{r#} * 4]), hsum(hp[{r#} * 4 + 1]), hsum(hp[{r#} * 4 + 2]),
                         hsum(hp[{r#} * 4 + 3]));
    //@endif DP
    //@end r
  }
  //@end cr
  //@endif HALF