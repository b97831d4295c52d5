"""The float64 dense reference as a backend: exact, slow, O(Sq*Sk) memory.

Never chosen automatically; ask for it with ``backend="reference"``.
"""
from __future__ import annotations

import numpy as np

from .. import paged, reference
from ..arrays import to_numpy
from ..rowstats import RowStats
from ..features import INPUTS, MODIFIERS
from ..masks import TERM_KINDS, resolve
from .base import Backend, Capabilities

__all__ = ["ReferenceBackend"]


class ReferenceBackend(Backend):
    name = "reference"
    capabilities = Capabilities(
        array_kinds=frozenset({"numpy", "torch"}), device_types=frozenset({"cpu"}),
        dtypes=frozenset({"float16", "bfloat16", "float32", "float64"}),
        precisions=frozenset({"highest", "tf32"}), mask_terms=frozenset(TERM_KINDS),
        inputs=INPUTS, modifiers=MODIFIERS, auto=False)

    # NaN/Inf inputs propagate into the results; the inf - inf and 0·inf they meet on
    # the way are not reported as NumPy RuntimeWarnings (np.errstate below)
    def forward(self, p, q, k, v, bias, mods):
        with np.errstate(all="ignore"):
            return self._forward(p, q, k, v, bias, mods)

    def backward(self, p, q, k, v, dout, out, stats, bias, mods):
        with np.errstate(all="ignore"):
            return self._backward(p, q, k, v, dout, out, stats, bias, mods)

    def forward_paged(self, p, q, k_pages, v_pages, mods):
        """Each sequence's keys (positions [starts[b], seqlens[b]) of its pages) gathered
        into a dense copy, then the dense reference."""
        with np.errstate(all="ignore"):
            return self._forward_paged(p, q, k_pages, v_pages, mods)

    def _forward_paged(self, p, q, k_pages, v_pages, mods):
        pk = p.pages
        B, Hq, Sq = p.batch, p.heads_q, p.seq_q
        out = np.zeros((B, Hq, Sq, p.head_dim_v))
        mx = np.full((B, Hq, Sq), -np.inf)
        ln = np.zeros((B, Hq, Sq))
        sinks = mods.sinks
        if sinks is not None:
            mx[...] = to_numpy(sinks).astype(np.float64).reshape(1, Hq, 1)
        for b in range(B):
            if pk.counts[b] == 0:
                continue
            kb, vb = (paged.gather_sequence(x, pk, b) for x in (k_pages, v_pages))
            slopes = mods.alibi_slopes
            if slopes is not None and slopes.shape[0] > 1:
                slopes = slopes[b:b + 1]
            mask = resolve(pk.mask, 1, Hq, Sq, int(pk.counts[b]), p.q_offset, p.k_offset)
            o, st = reference.forward_stats(q[b:b + 1], kb, vb, mask=mask, scale=p.scale,
                                            softcap=p.softcap, alibi_slopes=slopes,
                                            sinks=sinks, q_offset=p.q_offset,
                                            k_offset=p.k_offset)
            out[b], mx[b], ln[b] = o[0], st.max[0], st.log_norm[0]
        return _cast(out, p.dtype, p), RowStats(_cast(mx, "float64", p),
                                                _cast(ln, "float64", p))

    def _forward(self, p, q, k, v, bias, mods):
        out, st = reference.forward_stats(q, k, v, mask=p.mask, bias=bias,
                                          scale=p.scale, **_mod_args(p, mods))
        # the statistics stay float64: the backward recomputes s in float64, and a
        # max rounded to float32 would shift P by |s|·2⁻²⁴ (the API rounds the lse)
        return _cast(out, p.dtype, p), RowStats(_cast(st.max, "float64", p),
                                                _cast(st.log_norm, "float64", p))

    def _backward(self, p, q, k, v, dout, out, stats, bias, mods):
        g = reference.backward(q, k, v, dout, mask=p.mask, bias=bias, scale=p.scale,
                               wrt=tuple(p.wrt), out=out, stats=stats, **_mod_args(p, mods))
        res = {}
        for name in ("dq", "dk", "dv"):
            x = getattr(g, name)
            res[name] = None if x is None else _cast(x, p.dtype, p)
        res["dbias"] = None if g.dbias is None else _cast(g.dbias, p.bias_dtype, p)
        res["dsinks"] = None if g.dsinks is None else _cast(g.dsinks, p.sinks_dtype, p)
        if g.dcaptures is not None:
            res["dcaptures"] = {n: _cast(x, str(p.score_mod.arrays[n].dtype), p)
                                for n, x in g.dcaptures.items()}
        return res


def _mod_args(p, mods):
    """The score modifiers as reference keyword arguments (offsets included: ALiBi and
    dropout take them; ``p.mask`` has them applied already and is taken as it is)."""
    return dict(softcap=p.softcap, alibi_slopes=mods.alibi_slopes, sinks=mods.sinks,
                q_offset=p.q_offset, k_offset=p.k_offset, dropout_p=p.dropout_p,
                dropout_seed=p.dropout_seed, score_mod=p.score_mod)


def _cast(x: np.ndarray, dtype: str, p):
    """float64 result -> the caller's dtype and array library."""
    if p.array_kind == "torch":
        import torch

        return torch.from_numpy(np.ascontiguousarray(x)).to(getattr(torch, dtype))
    return x.astype(dtype)
