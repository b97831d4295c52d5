// PREFETCH (sdp): the registers pq/pk (pg/pv) -> the workgroup tiles sq/sk (sg/sv),
// the element order of sdp_ld (the previous chunk's readers passed its last barrier).
//@for n NEQ
{
  let e = lid + {n} * NT;
  if (e < BQ * DC4) {
    sq[(e / DC4) * RSQ + e % DC4] = pq[{n#}];
    //@if DP
    sg[(e / DC4) * RSQ + e % DC4] = pg[{n#}];
    //@endif DP
  }
}
//@end n
//@for n NEK
{
  let e = lid + {n} * NT;
  if (e < BK * DC4) {
    sk[(e / DC4) * RSQ + e % DC4] = pk[{n#}];
    //@if DP
    sv[(e / DC4) * RSQ + e % DC4] = pv[{n#}];
    //@endif DP
  }
}
//@end n
