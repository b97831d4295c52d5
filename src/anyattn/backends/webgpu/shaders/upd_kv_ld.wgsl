// PREFETCH (upd_kv): pu <- rows i0 + $PF_R0$ + [0, IC) of $UPD_SRC$ (columns dbase + [0, DS)),
// element n of invocation lid = staged element e = lid + n*NT (row e / DS4, vec4
// column e % DS4); rows past SQ and columns past D read as zeros.
//@for n NEU
{
  let e = lid + {n} * NT;
  let i = i0 + $PF_R0$ + e / DS4;
  pu[{n#}] = SV();
  if (e < IC * DS4 && i < U.SQ) { pu[{n#}] = lds_$UPD_SRC$($UPD_SRC$base + i * U.$UPD_SRC$_ss, dbase + 4u * (e % DS4)); }
}
//@end n
