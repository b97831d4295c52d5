// acc[i, :] (rows ty*RM + r) += sum_j sp[i][j] * SRC[j, dbase:dbase+DS] over the BK keys of this key
// tile (SRC = V in the forward, K in the dQ pass), in key chunks of IC staged through
// sk (STAGE: from sq's offset on, i.e. stg[0..]).  sp row i holds P or dS as SV
// elements m in [0, TX): element m = keys (m, m + TX, m + 2TX, m + 3TX) (the 4
// columns of thread tx = m), so staged row jj*4 + w of chunk jc is key jc/4 + jj + w*TX.
// HALF: the IC products of a chunk are summed in f16 (vec4<f16> FMA) as two chains
// (even / odd blocks of 4 rows) of UC/2 products, added in f16 and into the f32
// accumulator every UC rows (UC divides IC).
//@define UPD_BUF sk
//@if STAGE
//@define UPD_BUF sq
//@endif STAGE
//@if PREFETCH
// PREFETCH: the next chunk's rows are read into registers pu (NEU per invocation)
// before this chunk's products; stored to the workgroup tile after its last barrier.
var pu: array<SV, NEU>;
//@define PF_R0 0u
//@include upd_q_ld
//@endif PREFETCH
for (var jc = 0u; jc < BK; jc += IC) {
  TRIP
  //@ifn PREFETCH
  for (var e = lid; e < IC * DS4; e += NT) {
    TRIP
    let r = e / DS4;
    let c = e % DS4;
    let j = j0 + jc / 4u + r / 4u + (r % 4u) * TX;
    var a = SV();
    //@ifn PAGED
    if (j < U.SK) { a = lds_$UPD_SRC$($UPD_SRC$base + j * U.$UPD_SRC$_ss, dbase + 4u * c); }
    //@endif PAGED
    //@if PAGED
    if (j < $SKB$) { a = lds_$UPD_SRC$($UPD_SRC$base + pg$UPD_SRC$[j - j0], dbase + 4u * c); }
    //@endif PAGED
    $UPD_BUF$[e] = a;
  }
  //@endif PREFETCH
  //@if PREFETCH
  //@for n NEU
  if (lid + {n} * NT < IC * DS4) { $UPD_BUF$[lid + {n} * NT] = pu[{n#}]; }
  //@end n
  let jcn = jc + IC;
  if (jcn < BK) {
    //@define PF_R0 jcn
    //@include upd_q_ld
  }
  //@endif PREFETCH
  workgroupBarrier();
  //@if HALF
  var hacc: array<vec4<f16>, 2 * NACC>;
  //@endif HALF
  //@for jo NUC
  {
  //@for ji UC4
    {
      //@for r RM
      let p{r#} = sp[(ty * RM + {r}) * RSP2 + jc / 4u + ({jo} * UC4 + {ji})];
      //@end r
      //@for w 4
      //@for v NV
      {
        let x = $UPD_BUF$[(({jo} * UC4 + {ji}) * 4u + {w}) * DS4 + tx + {v} * TX];
        //@for r RM
        //@ifn HALF
        acc[{r#} * NV + {v#}] += p{r#}[{w#}] * x;
        //@endif HALF
        //@if HALF
        hacc[({ji} % 2u) * NACC + {r#} * NV + {v#}] = fma(vec4<f16>(p{r#}[{w#}]), x, hacc[({ji} % 2u) * NACC + {r#} * NV + {v#}]);
        //@endif HALF
        //@end r
      }
      //@end v
      //@end w
    }
  //@end ji
    //@if HALF
    //@for a NACC
    acc[{a#}] += vec4<f32>(hacc[{a#}] + hacc[NACC + {a#}]);
    //@end a
    hacc = array<vec4<f16>, 2 * NACC>();
    //@endif HALF
  }
  //@end jo
  workgroupBarrier();
}
