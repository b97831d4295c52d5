// acc[j, :] += sum_i st[j][i] * SRC[i, dbase:dbase+DS] over the BQ rows of this
// query tile, in row chunks of IC staged through UPD_BUF: sg (dO) or sq (Q); su
// (stg[0 ..]) in the wide variant.
// HALF: the IC products of a chunk are summed in f16 (vec4<f16> FMA) as two chains
// (even / odd blocks of 4 rows) of UC/2 products, added in f16 and into the f32
// accumulator every UC rows (UC divides IC).
//@if PREFETCH
// PREFETCH: the next chunk's rows are read into registers pu (NEU per invocation)
// before this chunk's products; stored to the workgroup tile after its last barrier.
var pu: array<SV, NEU>;
//@define PF_R0 0u
//@include upd_kv_ld
//@endif PREFETCH
for (var ic = 0u; ic < BQ; ic += IC) {
  TRIP
  //@ifn PREFETCH
  for (var e = lid; e < IC * DS4; e += NT) {
    TRIP
    let r = e / DS4;
    let c = e % DS4;
    let i = i0 + ic + r;
    var a = SV();
    if (i < U.SQ) { a = lds_$UPD_SRC$($UPD_SRC$base + i * U.$UPD_SRC$_ss, dbase + 4u * c); }
    $UPD_BUF$[e] = a;
  }
  //@endif PREFETCH
  //@if PREFETCH
  //@for n NEU
  if (lid + {n} * NT < IC * DS4) { $UPD_BUF$[lid + {n} * NT] = pu[{n#}]; }
  //@end n
  let icn = ic + IC;
  if (icn < BQ) {
    //@define PF_R0 icn
    //@include upd_kv_ld
  }
  //@endif PREFETCH
  workgroupBarrier();
  //@if HALF
  var hacc: array<vec4<f16>, 2 * NACK>;
  //@endif HALF
  //@for jo NUC
  {
  //@for ji UC4
    {
      //@for r 4
      let p{r#} = st[(ty * 4u + {r}) * RSP + ic / 4u + ({jo} * UC4 + {ji})];
      //@end r
      //@for w 4
      //@for v NV
      {
        let x = $UPD_BUF$[(({jo} * UC4 + {ji}) * 4u + {w}) * DS4 + tx + {v} * TX];
        //@for r 4
        //@ifn HALF
        $UPD_ACC$[{r#} * NV + {v#}] += p{r#}[{w#}] * x;
        //@endif HALF
        //@if HALF
        hacc[({ji} % 2u) * NACK + {r#} * NV + {v#}] = fma(vec4<f16>(p{r#}[{w#}]), x, hacc[({ji} % 2u) * NACK + {r#} * NV + {v#}]);
        //@endif HALF
        //@end r
      }
      //@end v
      //@end w
    }
  //@end ji
    //@if HALF
    //@for a NACK
    $UPD_ACC$[{a#}] += vec4<f32>(hacc[{a#}] + hacc[NACK + {a#}]);
    //@end a
    hacc = array<vec4<f16>, 2 * NACK>();
    //@endif HALF
  }
  //@end jo
  workgroupBarrier();
}
