"""``ring_attention``: context-parallel attention over a ring of ranks, with autograd.

Shape legend: B batch, Hq/Hkv query/key-value heads, N ranks, S global
sequence length, S_loc = S/N local length, L chunk length (S_loc or S_loc/2),
D head dim.  Local tensors are [B, H, S_loc, D] (``layout="bhsd"``) or
[B, S_loc, H, D] (``layout="bshd"``).

Forward, on rank r: N steps; at step t the rank holds the key/value shard of
rank (r - t) mod N, posts the exchange that passes it on (next rank) and
brings the following one (previous rank), computes its chunk pairs with the
core ``anyattn.api.forward_with_stats(..., q_offset, k_offset)`` and merges
each partial into float32 accumulators through its row statistics (row max
and log-normaliser kept apart: ``merge.py``), so the result does not depend on
where the logits sit (|s| up to 1e6, finite biases down to finfo.min).

Backward: the same ring of K/V; each block pair runs
``anyattn.attention_backward`` with the FINAL merged out and row statistics
of its rows (``lse=RowStats(max, log_norm)``), which makes the blockwise
gradients exact (P_block = exp((s - max_final) - log_norm_final),
delta = rowsum(dout * out_final)).  dq accumulates locally; dk/dv partials
for the visiting shard are added to the sums that arrived with it and sent on,
so after N hops each shard's dk/dv is back at its owner.  The returned lse is
max + log_norm.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch.autograd.function import once_differentiable

from ..api import attention_backward, forward_with_stats
from ..backends.registry import choose
from ..masks import Mask
from ..problem import describe
from ..rowstats import RowStats
from .agree import as_timeout, describe_call, exchange_and_check, failed_descriptor
from .blockmask import GlobalMask
from ..modifiers import fold_sinks, sinks_grad
from .merge import merge_stats_into
from .plan import RingPlan
from .ring import Ring
from .sharding import SHARDINGS, chunk_count

__all__ = ["ring_attention"]

_TAG_KV, _TAG_DKV = 0, 2


@dataclass
class _Setup:
    """Everything a call needs besides the tensors."""

    ring: Ring
    plan: RingPlan
    scale: Optional[float]
    backend: Optional[str]
    precision: Optional[str]
    softcap: Optional[float] = None
    alibi_slopes: Optional[torch.Tensor] = None
    dropout_p: float = 0.0
    dropout_seed: Optional[int] = None

    def block_mods(self):
        """The per-block score modifiers and dropout (sinks are folded once, after the
        merge); each block draws dropout at its global positions."""
        return dict(softcap=self.softcap, alibi_slopes=self.alibi_slopes,
                    dropout_p=self.dropout_p, dropout_seed=self.dropout_seed)


def _acc_dtype(dt: torch.dtype) -> torch.dtype:
    return torch.float64 if dt == torch.float64 else torch.float32


# --------------------------------------------------------------------- forward
def _forward(s: _Setup, q, k, v, sinks=None):
    """-> (out [B,Hq,S_loc,Dv] in q's dtype, RowStats of [B,Hq,S_loc] float32/float64).
    ``sinks`` [Hq]: counted once, folded into the merged statistics at the end."""
    B, Hq, S_loc, _ = q.shape
    acc = _acc_dtype(q.dtype)
    o_acc = torch.zeros((B, Hq, S_loc, v.shape[-1]), dtype=acc, device=q.device)
    m_acc = torch.full((B, Hq, S_loc), float("-inf"), dtype=acc, device=q.device)
    ln_acc = torch.zeros((B, Hq, S_loc), dtype=acc, device=q.device)
    kv = [k.contiguous(), v.contiguous()]
    N = s.ring.size
    for t in range(N):
        ex = s.ring.exchange(kv, _TAG_KV) if t < N - 1 else None   # overlaps the compute
        kt, vt = kv
        for c in s.plan.calls(t):
            o, st = forward_with_stats(q[:, :, c.q_rows], kt[:, :, c.k_rows],
                                       vt[:, :, c.k_rows], mask=c.mask, scale=s.scale,
                                       backend=s.backend, precision=s.precision,
                                       q_offset=c.q_offset, k_offset=c.k_offset,
                                       **s.block_mods())
            r = c.q_rows
            merge_stats_into(o_acc[:, :, r], m_acc[:, :, r], ln_acc[:, :, r], o,
                             st.max, st.log_norm)
        if ex is not None:
            kv = ex.wait()
    stats = RowStats(m_acc, ln_acc)
    if sinks is not None:
        o_acc, stats = fold_sinks(o_acc, stats, sinks)
    return o_acc.to(q.dtype), stats


# -------------------------------------------------------------------- backward
def _backward(s: _Setup, q, k, v, out, stats: RowStats, dout, want):
    """-> (dq, dk, dv), None where ``want`` (flags for q, k, v) is False.  ``stats``: the
    merged row statistics of the forward (each block's P = exp((s - max) - log_norm))."""
    want_q, want_k, want_v = want
    acc = _acc_dtype(q.dtype)
    wrt = tuple(n for n, w in zip("qkv", want) if w)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device) if want_q else None
    kv = [k.contiguous(), v.contiguous()]
    dout = dout.contiguous()
    N = s.ring.size
    dkv_ex = None
    dkv = None
    for t in range(N):
        kv_ex = s.ring.exchange(kv, _TAG_KV) if t < N - 1 else None
        kt, vt = kv
        dk_t = torch.zeros(k.shape, dtype=acc, device=k.device) if want_k else None
        dv_t = torch.zeros(v.shape, dtype=acc, device=v.device) if want_v else None
        for c in s.plan.calls(t):
            qr, kr = c.q_rows, c.k_rows
            g = attention_backward(q[:, :, qr], kt[:, :, kr], vt[:, :, kr], dout[:, :, qr],
                                   out=out[:, :, qr], lse=stats.select((slice(None),
                                                                        slice(None), qr)),
                                   mask=c.mask,
                                   scale=s.scale, wrt=wrt, backend=s.backend,
                                   precision=s.precision, q_offset=c.q_offset,
                                   k_offset=c.k_offset, **s.block_mods())
            if want_q:
                dq[:, :, qr] += g.dq
            if want_k:
                dk_t[:, :, kr] += g.dk
            if want_v:
                dv_t[:, :, kr] += g.dv
        mine = [x for x in (dk_t, dv_t) if x is not None]
        if mine:
            if N == 1:
                dkv = mine
            else:
                if dkv_ex is not None:           # sums of the ranks before us for this shard
                    for x, y in zip(mine, dkv_ex.wait()):
                        x += y
                dkv_ex = s.ring.exchange(mine, _TAG_DKV)
        if kv_ex is not None:
            kv = kv_ex.wait()
    if dkv_ex is not None:
        dkv = dkv_ex.wait()                      # the last hop brings our own shard's sums
    it = iter(dkv or [])
    dk = next(it).to(k.dtype) if want_k else None
    dv = next(it).to(v.dtype) if want_v else None
    return (dq.to(q.dtype) if want_q else None), dk, dv


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, sinks, setup: _Setup):
        out, st = _forward(setup, q, k, v, sinks)
        lse = st.lse
        ctx.setup = setup
        ctx.save_for_backward(q, k, v, out, st.max, st.log_norm, sinks)
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    @once_differentiable
    def backward(ctx, dout, _dlse):
        q, k, v, out, row_max, log_norm, sinks = ctx.saved_tensors
        want = tuple(bool(x) for x in ctx.needs_input_grad[:3])
        stats = RowStats(row_max, log_norm)
        dq = dk = dv = dsinks = None
        if any(want):
            dq, dk, dv = _backward(ctx.setup, q, k, v, out, stats, dout, want)
        if sinks is not None and ctx.needs_input_grad[3]:
            # this rank's queries only: summed over the group like every parameter's
            # gradient under context parallelism
            dsinks = sinks_grad(dout, out, stats, sinks)
        return dq, dk, dv, dsinks, None


# ---------------------------------------------------------------------- public
def _check(name, x):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor (this rank's shard), got "
                        f"{type(x).__name__}")
    if x.ndim != 4:
        raise ValueError(f"{name}: expected 4 dims [B, H, S_loc, D] (or [B, S_loc, H, D] with "
                         f"layout='bshd'), got shape {tuple(x.shape)}")


def _local_checks(q, k, v, sharding, layout):
    """Checks that need no process group -> q, k, v in the [B, H, S_loc, D] layout."""
    if layout not in ("bhsd", "bshd"):
        raise ValueError(f"layout={layout!r} is unknown; expected 'bhsd' or 'bshd'")
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check(name, x)
    if sharding not in SHARDINGS:
        raise ValueError(f"sharding={sharding!r} is unknown; expected one of {SHARDINGS}")
    if layout == "bshd":
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"k: local length {k.shape[2]} differs from q's {q.shape[2]}; ring "
                         "attention shards q, k and v of one sequence the same way")
    return q, k, v


def _ring_checks(ring: Ring, q, k, v, mask, sharding, scale, backend, precision,
                 softcap=None, alibi_slopes=None, sinks=None, dropout_p=0.0,
                 dropout_seed=None):
    """Checks that need the ring's size -> (GlobalMask, the validated probe Problem)."""
    N = ring.size
    S_loc = q.shape[2]
    per_rank = chunk_count(N, sharding) // N
    if S_loc % per_rank:
        raise ValueError(f"q: local length {S_loc} is odd; sharding='zigzag' holds two equal "
                         "chunks per rank")
    S = S_loc * N
    gmask = GlobalMask(mask, S, q.shape[0], q.shape[1])
    L = S_loc // per_rank
    if alibi_slopes is not None and alibi_slopes.requires_grad:
        raise ValueError("alibi_slopes: requires grad, but ALiBi slopes are not trainable "
                         "here; pass alibi_slopes.detach()")
    probe = describe(q[:, :, :L], k[:, :, :L], v[:, :, :L], mask=None, scale=scale,
                     precision=precision, softcap=softcap, alibi_slopes=alibi_slopes,
                     sinks=sinks, dropout_p=dropout_p, dropout_seed=dropout_seed,
                     q_offset=0, k_offset=S - L)   # dropout: the last global position fits
    choose(probe, backend)  # raises early if the backend cannot serve these blocks
    return gmask, probe


def ring_attention(q, k, v, *, mask: Optional[Mask] = None, group=None,
                   sharding: str = "contiguous", scale: Optional[float] = None,
                   backend: Optional[str] = None, precision: Optional[str] = None,
                   layout: str = "bhsd", return_lse: bool = False, timeout=None,
                   check_ranks: bool = True, softcap: Optional[float] = None,
                   alibi_slopes: Optional[torch.Tensor] = None,
                   sinks: Optional[torch.Tensor] = None, dropout_p: float = 0.0,
                   dropout_seed: Optional[int] = None):
    """Attention over a sequence sharded across the ranks of ``group``, differentiable.

    q [B, Hq, S_loc, D], k/v [B, Hkv, S_loc, D]: this rank's shard of a global
    sequence of length S = N * S_loc, laid out by ``sharding`` ("contiguous":
    rank r holds positions [r*S_loc, (r+1)*S_loc); "zigzag": rank r holds chunks
    r and 2N-1-r of 2N, in that order; see ``anyattn.distributed.shard``).
    ``mask``: None, Causal, Window, Documents (GLOBAL ids, length S, the same on
    every rank), KeepMask (GLOBAL, broadcastable to [B, Hq, S, S]) or a ``&`` of
    these.  -> out [B, Hq, S_loc, D] (and lse [B, Hq, S_loc], not differentiable,
    with ``return_lse=True``).  ``backend``/``precision``/``scale``: as in
    ``anyattn.attention`` (used for every block pair).  ``softcap``, ``alibi_slopes``
    ([Hq] or [B, Hq]; positions are global) and ``sinks`` ([Hq], counted once per row;
    differentiable): as in ``anyattn.attention``.  The sinks' gradient on each rank covers
    that rank's queries; sum it over the group as for every other parameter.
    ``dropout_p`` with ``dropout_seed`` (required, the same int on every rank): each
    block draws ``anyattn.dropout_mask`` at its global positions, so the sharded run
    drops exactly what the unsharded call with that seed drops.

    Every rank of the group must call it with the same shapes and arguments.  Before
    the first exchange the ranks all-gather a small descriptor of their call (shapes,
    dtype, device type, scale, sharding, layout, gradients asked for, a fingerprint of
    the mask, precision) and each raises the same ``ValueError`` naming what differs
    on which ranks; a rank whose own arguments are refused takes part with a failure
    flag, so the others raise at once instead of waiting.  ``timeout`` (seconds or a
    ``datetime.timedelta``; None: the process group's own timeout) bounds that wait:
    if some rank never reaches the call, the others raise ``TimeoutError`` after it.
    ``check_ranks=False`` skips the descriptor exchange (one small all-gather and, on
    CUDA, a host sync per call) once a program is known to be consistent.
    """
    tmo = as_timeout(timeout)
    err: Optional[BaseException] = None
    try:
        q, k, v = _local_checks(q, k, v, sharding, layout)
    except (TypeError, ValueError, NotImplementedError) as e:
        err = e
    try:
        ring = Ring(group)
    except Exception:
        if err is not None:
            raise err from None
        raise
    gmask = probe = None
    if err is None:
        try:
            gmask, probe = _ring_checks(ring, q, k, v, mask, sharding, scale, backend,
                                        precision, softcap, alibi_slopes, sinks, dropout_p,
                                        dropout_seed)
        except Exception as e:          # refused here: tell the other ranks, then raise
            err = e
    if check_ranks and ring.size > 1:
        if err is not None:
            try:
                exchange_and_check(ring, failed_descriptor(ring.size), q, tmo, SHARDINGS)
            except (ValueError, TimeoutError):
                pass                    # this rank's own error says more
            raise err
        grad = torch.is_grad_enabled()
        desc = describe_call(world=ring.size, q=q, k=k, v=v, scale=probe.scale,
                             sharding=sharding, layout=layout,
                             wrt=tuple(grad and x.requires_grad for x in (q, k, v)),
                             gmask=gmask, precision=precision, sharding_names=SHARDINGS,
                             softcap=softcap, alibi_slopes=alibi_slopes, sinks=sinks,
                             dropout_p=probe.dropout_p, dropout_seed=probe.dropout_seed)
        exchange_and_check(ring, desc, q, tmo, SHARDINGS)
    elif err is not None:
        raise err
    # ALiBi and dropout need every block at its own global offsets: blocks stay unfused
    plan = RingPlan(gmask, ring.rank, ring.size, q.shape[2], sharding,
                    fuse=alibi_slopes is None and not probe.has_dropout)
    setup = _Setup(ring=ring, plan=plan, scale=scale, backend=backend, precision=precision,
                   softcap=probe.softcap, alibi_slopes=alibi_slopes,
                   dropout_p=probe.dropout_p, dropout_seed=probe.dropout_seed)
    out, lse = _RingAttention.apply(q, k, v, sinks, setup)
    if layout == "bshd":
        out = out.transpose(1, 2)
    return (out, lse) if return_lse else out
