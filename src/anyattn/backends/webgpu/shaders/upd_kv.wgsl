// acc[j, :] += sum_i st[j][i] * SRC[i, dbase:dbase+DS] over the BQ rows of this
// query tile, in row chunks of IC staged through sg (dO) or sq (Q).
for (var ic = 0u; ic < BQ; ic += IC) {
  TRIP
  for (var e = lid; e < IC * DS4; e += NT) {
    TRIP
    let r = e / DS4;
    let c = e % DS4;
    let i = i0 + ic + r;
    var a = vec4<f32>(0.0);
    if (i < U.SQ) { a = ld4_$UPD_SRC$($UPD_SRC$base + i * U.$UPD_SRC$_ss, dbase + 4u * c); }
    s$UPD_SRC$[e] = a;
  }
  workgroupBarrier();
  //@for ii IC4
  {
    //@for r 4
    let p{r#} = st[(ty * 4u + {r}) * RSP + ic / 4u + {ii}];
    //@end r
    //@for w 4
    //@for v NV
    {
      let x = s$UPD_SRC$[({ii} * 4u + {w}) * DS4 + tx + {v} * TX];
      //@for r 4
      $UPD_ACC$[{r#} * NV + {v#}] += p{r#}[{w#}] * x;
      //@end r
    }
    //@end v
    //@end w
  }
  //@end ii
  workgroupBarrier();
}
