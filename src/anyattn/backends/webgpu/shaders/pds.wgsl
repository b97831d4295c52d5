// P = exp(scale*s + bias - lse) on kept pairs, dS = P * (dP - delta), per micro-tile.
// Empty rows (lse = -inf): P = 0, or 1/SK for every key in the seed's quirk mode.
// Needs: b, h, i0, j0, code, s, dp; defines p[r], ds[r] (vec4 over c).
var p: array<vec4<f32>, 4>;
var ds: array<vec4<f32>, 4>;
//@for r 4
{
  let i = i0 + ty * 4u + {r};
  var lse = U.neg_inf;
  var dl = 0.0;
  if (i < U.SQ) {
    let row = (b * U.HQ + h) * U.SQ + i;
    lse = stats[row];
    dl = stats[U.stat_n + row];
  }
  let empty = lse <= -3.0e38;
  //@for c 4
  {
    let j = j0 + tx + {c} * TX;
    var pv = 0.0;
    if (i < U.SQ && j < U.SK) {
      if (empty) {
        if ((U.flags & F_QUIRK) != 0u) { pv = U.inv_sk; }
      } else {
        var x = s[{r}][{c#}] * U.scale;
        if ((U.flags & F_HAS_BIAS) != 0u) { x += bias_ij(b, h, i, j); }
        var kept = true;
        if (code == 1u) { kept = keep_ij(b, h, i, j); }
        if (kept) { pv = exp(x - lse); }
      }
    }
    p[{r}][{c#}] = pv;
    ds[{r}][{c#}] = pv * (dp[{r}][{c#}] - dl);
  }
  //@end c
}
//@end r
