// PREFETCH (upd_q): pu <- the keys of staged rows $PF_R0$ + [0, IC) of $UPD_SRC$ (the
// order of upd_q: staged row jj*4 + w of chunk jc is key j0 + jc/4 + jj + w*TX),
// element n of invocation lid = staged element e = lid + n*NT; keys past SK and
// columns past D read as zeros.
//@for n NEU
{
  let e = lid + {n} * NT;
  let r = e / DS4;
  let j = j0 + $PF_R0$ / 4u + r / 4u + (r % 4u) * TX;
  pu[{n#}] = SV();
  //@ifn PAGED
  if (e < IC * DS4 && j < U.SK) { pu[{n#}] = lds_$UPD_SRC$($UPD_SRC$base + j * U.$UPD_SRC$_ss, dbase + 4u * (e % DS4)); }
  //@endif PAGED
  //@if PAGED
  if (e < IC * DS4 && j < $SKB$) { pu[{n#}] = lds_$UPD_SRC$($UPD_SRC$base + pg$UPD_SRC$[j - j0], dbase + 4u * (e % DS4)); }
  //@endif PAGED
}
//@end n
