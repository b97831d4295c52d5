"""Shared checks and set-ups of the webgpu tests."""
import dataclasses

import numpy as np

import anyattn as aa
from anyattn.backends.webgpu.launch import TileConfig, choose_config

from helpers import assert_close, make_qkv

GPU_TILE = TileConfig(16, 16, 16, 8, 2)     # the H200's fp32 config, run on lavapipe


def run_probe(dev, pipe, entries, out_buffer, groups: int = 1):
    """Bind `entries` (group 0) to the compute pipeline `pipe`, dispatch `groups`
    workgroups, wait, and return the bytes of `out_buffer` (a probe kernel's whole run)."""
    bg = dev.create_bind_group(layout=pipe.get_bind_group_layout(0), entries=entries)
    enc = dev.create_command_encoder()
    cp = enc.begin_compute_pass()
    cp.set_pipeline(pipe)
    cp.set_bind_group(0, bg)
    cp.dispatch_workgroups(groups)
    cp.end()
    dev.queue.submit([enc.finish()])
    return dev.queue.read_buffer(out_buffer)


#: the masks of the dropout and modifier case tables, by name: name -> f(Sq, Sk, rng)
CASE_MASKS = {
    None: lambda Sq, Sk, r: None,
    "causal": lambda Sq, Sk, r: aa.Causal(),
    "causal_br": lambda Sq, Sk, r: aa.Causal("bottom_right"),
    "window": lambda Sq, Sk, r: aa.Window(left=5, right=3),
    "docs": lambda Sq, Sk, r: aa.Documents(np.sort(r.integers(0, 3, Sq)),
                                            np.sort(r.integers(0, 3, Sk))),
    "docs_b_causal": lambda Sq, Sk, r: aa.Causal() & aa.Documents(
        np.sort(r.integers(0, 4, (2, Sq)), axis=1), np.sort(r.integers(0, 4, (2, Sk)), axis=1)),
    "keep": lambda Sq, Sk, r: aa.KeepMask(r.random((Sq, Sk)) < 0.6),
}


def bshd_strided_qkv(r, B, Hq, Hkv, Sq, Sk, D):
    """q, k, v, g (``make_qkv`` draws from ``r``) in the bshd layout [B, S, H, D], k a
    strided view (every other column of a doubled array)."""
    q, k, v, g = make_qkv(r, B, Hq, Hkv, Sq, Sk, D)
    q, k, v, g = (np.ascontiguousarray(x.swapaxes(1, 2)) for x in (q, k, v, g))
    k = np.concatenate([k, k], axis=-1)[..., ::2]
    return q, k, v, g


def bind_whole(*bufs):
    """Bind-group entries: each buffer whole, at bindings 0, 1, ... in order."""
    return [{"binding": i, "resource": {"buffer": b, "offset": 0, "size": b.size}}
            for i, b in enumerate(bufs)]


def assert_backward_trips_within_model(call, head_dim: int) -> None:
    """Run a backward Call's dQ and dK/dV launches (built with ``debug_trips``) and check
    every invocation's counted loop trips against ``TileConfig.trips_per_unit``: at most
    the model (the llvmpipe loop limit is budgeted on it), at least half of it.
    ``head_dim``: the problem's D."""
    for lch in call.launches:
        if lch.kernel in ("bwd_dq", "bwd_dkdv"):
            call.run.run([lch])
            n = call.trip_count if lch.kernel == "bwd_dq" else \
                lch.grid[0] * lch.grid[1] * lch.grid[2] * call.cfg.NT
            got = int(call.run.read(lch.buffers[9], n).max())
            model = call.cfg.trips_per_unit(lch.kernel, head_dim) * \
                (call.nkt if lch.kernel == "bwd_dq" else call.nqt * 2)
            assert 0.5 * model <= got <= model, (lch.kernel, got, model)


# ------------------------------------------------------------ backward set-ups (variants, dsq)
def fwd_bwd(be, q, k, v, g, cfg=None, mask=None, bias=None, wrt=("q", "k", "v"), cfg_b=None):
    """Forward with the config ``cfg``, backward with ``cfg_b`` (default ``cfg``; None:
    the backend's choice), through the API: [out, lse, dq, dk, dv, dbias]."""
    be.config_override = cfg
    try:
        out, lse = aa.attention(q, k, v, mask=mask, bias=bias, return_lse=True, backend="webgpu")
        be.config_override = cfg_b or cfg
        gr = aa.attention_backward(q, k, v, g, out=out, lse=lse, mask=mask, bias=bias, wrt=wrt,
                                   backend="webgpu")
    finally:
        be.config_override = None
    return [out, lse] + [getattr(gr, n) for n in ("dq", "dk", "dv", "dbias")]


def grads(be, q, k, v, g, cfg, mask=None, bias=None, wrt=("q", "k", "v"), cfg_f=None):
    """Forward (``cfg_f`` or ``cfg``) then backward with ``cfg``: [dq, dk, dv, dbias]."""
    return fwd_bwd(be, q, k, v, g, cfg_f or cfg, mask, bias, wrt, cfg_b=cfg)[2:]


def assert_same(a, b, names=("dq", "dk", "dv", "dbias")):
    """Every bit equal, result by result (a pair of Nones passes)."""
    for name, x, y in zip(names, a, b):
        if x is None and y is None:
            continue
        np.testing.assert_array_equal(x, y, err_msg=name)


def base_and_dsq(be, D, elem="f32", base="portable"):
    """(the adapter's ``base`` config at head dim D, its ``*-dsq`` twin): the pair every
    5-product test compares (backward configs for f16)."""
    cfg = choose_config(be.context, D, elem, backward=elem == "f16", variant=base)
    return cfg, dataclasses.replace(cfg, variant=base + "-dsq")


def backward_call(be, q, k, v, g, cfg, mask=None, bias=None, cfg_b=None, debug_trips=False):
    """The backward's engine Call (built, not submitted) after a forward with ``cfg``; the
    backward with ``cfg_b`` (default ``cfg``), ``debug_trips``: a trip-counting build."""
    from anyattn.problem import describe

    be.config_override = cfg
    try:
        o, l = aa.attention(q, k, v, mask=mask, bias=bias, return_lse=True, backend="webgpu")
        p = describe(q, k, v, dout=g, mask=mask, bias=bias, wrt=("q", "k", "v"))
        be.config_override = cfg_b or cfg
        be.debug_trips = debug_trips
        call, _ = be._build_backward(p, q, k, v, g, o, aa.RowStats.from_lse(l), bias)
    finally:
        be.config_override = None
    return call


def one_unit_loop_limit(cfg, head_dim: int) -> int:
    """A loop budget of one unit of the costliest kernel: every kernel's launches split."""
    per = max(cfg.trips_per_unit(kn, head_dim) for kn in ("forward", "bwd_dq", "bwd_dkdv"))
    return TileConfig.FIXED_TRIPS + per


def modifiers_case(seed: int, head_dim: int):
    """(q, k, v, g, kw) of the float64 check with every modifier: causal GQA (4 / 2 heads,
    Sq 29, Sk 41) with empty rows, softcap, ALiBi, sinks, dropout; for
    ``compare_with_reference("webgpu", q, k, v, g, wrt=("q", "k", "v", "sinks"), **kw)``."""
    q, k, v, g = make_qkv(np.random.default_rng(seed), 1, 4, 2, 29, 41, head_dim)
    kw = dict(mask=aa.Causal() & aa.KeepMask(np.arange(29)[:, None] % 6 != 2), softcap=5.0,
              sinks=np.float32([0.5, -1, 2, 0]),
              alibi_slopes=np.float32([0.5, 0.25, 0.125, 0.0625]), dropout_p=0.2,
              dropout_seed=7)
    return q, k, v, g, kw


def backward_from_float64(be, q, k, v, g, cfg, mask):
    """The backward alone with ``cfg`` from float64's out (in q's dtype) and lse (f32): an
    f16 check without an f16 forward's compile.  -> the API's gradients."""
    from anyattn import reference as R

    ro, rl = R.forward(q, k, v, mask=mask)
    be.config_override = cfg
    try:
        return aa.attention_backward(q, k, v, g, out=ro.astype(q.dtype),
                                     lse=rl.astype(np.float32), mask=mask, backend="webgpu")
    finally:
        be.config_override = None


def assert_bitwise_and_close(be, q, k, v, g, base, cfg, mask):
    """``cfg``'s backward (from float64's out / lse) gives ``base``'s dq, dk, dv bit for bit,
    within float64's tolerance for q's dtype."""
    from anyattn import reference as R

    rg = R.backward(q, k, v, g, mask=mask)
    res = [backward_from_float64(be, q, k, v, g, c, mask) for c in (base, cfg)]
    for name in ("dq", "dk", "dv"):
        np.testing.assert_array_equal(getattr(res[0], name), getattr(res[1], name), name)
        assert_close(getattr(res[1], name), getattr(rg, name), str(q.dtype), name)
