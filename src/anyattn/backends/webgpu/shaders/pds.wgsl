// P = exp((x - max) - log_norm) on kept pairs, x = biased(scale*s) (the bias is added
// before the max is subtracted; never one combined lse: DESIGN.md §1),
// dS = P * (dP - delta), per micro-tile.  Row statistics: max in stats[row],
// delta in stats[n + row], log_norm in stats[6n + row].
// Empty rows (max = -inf): P = 0, or 1/SK for every key in the seed's quirk mode.
// Needs: b, h, i0, j0, code, s, dp; defines p[r], ds[r] (r < RM query rows, vec4 over c).
// SOFTCAP: ds is dS·(1 − tanh²) (what the dQ/dK products take) and dsr the plain dS
// (dbias).
//@# SCOREMOD: ds also times d score_mod / d score (DSCHAIN: SOFTCAP or SCOREMOD).
// DROPOUT (needs drw/dcw: the row words of this query tile, the column words of this
// key tile): p is P ∘ keep (the dK/dV pass scales dV by 1 / (1 − p) at the end) and
// dS = P ∘ (dP ∘ keep / (1 − p) − delta).
//@# DCAP (the dK/dV pass with capture gradients; SCOREMOD): every pair's terms
//@# dS · d s' / d g of the capture reads into the workgroup tile sdc (dcap_put,
//@# programs.dcap_source; 0 for a pair not kept or outside SQ x SK); DCPR: the pair
//@# reads' terms straight into dcs (column slice 0; each element of a tile run once).
var p: array<vec4<f32>, RM>;
var ds: array<vec4<f32>, RM>;
//@if DSCHAIN
var dsr: array<vec4<f32>, RM>;
//@endif DSCHAIN
//@if DROPOUT
let cwd = vec4<u32>(dcw[tx], dcw[tx + TX], dcw[tx + 2u * TX], dcw[tx + 3u * TX]);
//@endif DROPOUT
//@for r RM
{
  let i = i0 + ty * RM + {r};
  //@if DROPOUT
  let rwd = drw[ty * RM + {r}];
  //@endif DROPOUT
  var mx = U.neg_inf;
  var ln = 0.0;
  var dl = 0.0;
  if (i < U.SQ) {
    let row = (b * U.HQ + h) * U.SQ + i;
    mx = stats[row];
    dl = stats[U.stat_n + row];
    ln = stats[6u * U.stat_n + row];
  }
  let empty = is_ninf(mx);
  //@for c 4
  {
    let j = j0 + tx + {c} * TX;
    var pv = 0.0;
    //@if DSCHAIN
    var dth = 1.0;
    //@endif DSCHAIN
    //@if DCAP
    var dcx = 0.0;
    var dck = false;
    //@endif DCAP
    if (i < U.SQ && j < U.SK) {
      if (empty) {
        if ((U.flags & F_QUIRK) != 0u) { pv = U.inv_sk; }
      } else {
        //@ifn SCOREMOD
        //@ifn SOFTCAP
        let x = score_ij(s[{r}][{c#}] * U.scale, b, h, i, j);
        //@endif SOFTCAP
        //@if SOFTCAP
        let tc = softcap_t(s[{r}][{c#}] * U.scale);
        dth = tc.y;
        let x = score_ij(tc.x, b, h, i, j);
        //@endif SOFTCAP
        //@endif SCOREMOD
        //@if SCOREMOD
        //@ifn SOFTCAP
        let sm = smod_vd(s[{r}][{c#}] * U.scale, b, h, i, j);
        //@if DCAP
        dcx = s[{r}][{c#}] * U.scale;
        //@endif DCAP
        //@endif SOFTCAP
        //@if SOFTCAP
        let tc = softcap_t(s[{r}][{c#}] * U.scale);
        let sm = smod_vd(tc.x, b, h, i, j);
        dth = tc.y;
        //@if DCAP
        dcx = tc.x;
        //@endif DCAP
        //@endif SOFTCAP
        dth *= sm.y;
        let x = score_ij(sm.x, b, h, i, j);
        //@endif SCOREMOD
        var kept = !is_ninf(x);
        if (kept && code == 1u) { kept = keep_ij(b, h, i, j); }
        if (kept) { pv = exp((x - mx) - ln); }
        //@if DCAP
        dck = kept;
        //@endif DCAP
      }
    }
    //@ifn DROPOUT
    p[{r}][{c#}] = pv;
    ds[{r}][{c#}] = pv * (dp[{r}][{c#}] - dl);
    //@endif DROPOUT
    //@if DROPOUT
    let kp = drop_keep(rwd, cwd[{c#}]);
    p[{r}][{c#}] = select(0.0, pv, kp);
    ds[{r}][{c#}] = pv * (select(0.0, dp[{r}][{c#}] * U.drop_rs, kp) - dl);
    //@endif DROPOUT
    //@if DSCHAIN
    dsr[{r}][{c#}] = ds[{r}][{c#}];
    //@if DCAP
    //@ifn DCPR
    dcap_put(ty * RM + {r}, tx + {c} * TX, dck, ds[{r}][{c#}], dcx, b, h, i, j);
    //@endif DCPR
    //@if DCPR
    //@# pair reads: stored by dcap_put itself, by the column slice 0 only
    dcap_put(ty * RM + {r}, tx + {c} * TX, dck, ds[{r}][{c#}], dcx, b, h, i, j, wid.z == 0u);
    //@endif DCPR
    //@endif DCAP
    //@if SCOREMOD
    //@# a dropped pair gives 0, whatever d score_mod / d score is there
    if (pv == 0.0) { dth = 1.0; }
    //@endif SCOREMOD
    ds[{r}][{c#}] *= dth;
    //@endif DSCHAIN
  }
  //@end c
}
//@end r
