// PREFETCH (sdp): registers pq/pk (and pg/pv with DP) <- the Q/K (dO/V) chunk at
// d = $PF_D0$: element n of invocation lid is tile element e = lid + n*NT (row e / DC4,
// vec4 column e % DC4); rows past SQ / SK and columns past D read as zeros.
//@for n NEQ
{
  let e = lid + {n} * NT;
  let r = e / DC4;
  let i = i0 + r;
  if (e < BQ * DC4 && i < U.SQ) {
    pq[{n#}] = lds_q(qbase + i * U.q_ss, $PF_D0$ + 4u * (e % DC4));
    //@if DP
    pg[{n#}] = lds_g(gbase + i * U.g_ss, $PF_D0$ + 4u * (e % DC4));
    //@endif DP
  } else {
    pq[{n#}] = SV();
    //@if DP
    pg[{n#}] = SV();
    //@endif DP
  }
}
//@end n
//@for n NEK
{
  let e = lid + {n} * NT;
  let r = e / DC4;
  let j = j0 + r;
  if (e < BK * DC4 && j < $SKB$) {
    //@ifn PAGED
    pk[{n#}] = lds_k(kbase + j * U.k_ss, $PF_D0$ + 4u * (e % DC4));
    //@endif PAGED
    //@if PAGED
    pk[{n#}] = lds_k(kbase + pgk[r], $PF_D0$ + 4u * (e % DC4));
    //@endif PAGED
    //@if DP
    pv[{n#}] = lds_v(vbase + j * U.v_ss, $PF_D0$ + 4u * (e % DC4));
    //@endif DP
  } else {
    pk[{n#}] = SV();
    //@if DP
    pv[{n#}] = SV();
    //@endif DP
  }
}
//@end n
