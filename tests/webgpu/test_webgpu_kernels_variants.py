"""webgpu kernel variants (launch.VARIANTS, ``TileConfig.variant``): ``prefetch`` (the
next staged chunk read into registers before the current chunk's products), ``staged``
(prefetch + one workgroup array for the staged tiles: update chunks of 2 x IC rows) and
``subgroups`` (staged + subgroup row reductions in the forward and the delta pass) and
``wide`` (staged with 8 query rows per invocation in the backward passes: BQ = 8*TY, the
P^T / dS tiles over the idle staging tiles; its forward is staged's).

* selection as data: the table (with its grid-fill column: ``wide`` only where its dQ
  grid fills the GPU), ``ANYATTN_WEBGPU_VARIANT``, refusals with the reason;
* ``rows8`` (f16 only: portable's kernels with 8 query rows per invocation in the
  backward) computes portable's bits;
* ``prefetch`` and ``staged`` compute what ``portable`` computes, bit for bit (same arithmetic, same
  order), forward and backward, masks / bias + dbias / GQA / odd sizes / f16, on the
  CPU adapter's 8x8 tiles and the GPU's 16x16 ones;
* ``subgroups`` against float64 (the contract's tolerances) with masks, bias + dbias,
  GQA, score modifiers, dropout, f16; where the subgroup has >= TX lanes the butterflies
  run (lse differs from portable's serial sums somewhere), else the workgroup fallback
  (forward bitwise portable's);
* ``wide``: the same sums in the same order as portable (f32: bitwise; f16: the same
  flush period and run length, bitwise too), and against float64 through the API with
  modifiers, dropout, empty rows;
* the loop-trip model (llvmpipe's 65,535 limit) bounds the variants' loops.
Small sizes: every distinct config compiles its own pipelines on lavapipe.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import numpy as np
import pytest

import anyattn as aa
from anyattn.backends.webgpu.launch import (ENV_VARIANT, VARIANTS, TileConfig, choose_config,
                                            pick_variant)

from helpers import assert_close, compare_with_reference, make_qkv
from wg_util import (GPU_TILE, assert_backward_trips_within_model, assert_bitwise_and_close,
                     backward_call, backward_from_float64, fwd_bwd, modifiers_case,
                     one_unit_loop_limit, run_probe)


def _needs_subgroups(be):
    if not be.context.has_subgroups:
        pytest.skip(f"adapter {be.context.name} has no 'subgroup' feature")


def _subgroup_size(be) -> int:
    """The subgroup size a 1-D compute dispatch gets on this adapter (probe kernel)."""
    import wgpu

    dev = be.context.device
    src = """
@group(0) @binding(0) var<storage, read_write> o: array<u32>;
@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(subgroup_size) s: u32,
        @builtin(subgroup_invocation_id) si: u32) {
  o[lid] = s;
  o[64u + lid] = u32(si == lid % s);
}"""
    pipe = dev.create_compute_pipeline(layout="auto", compute={
        "module": dev.create_shader_module(code=src), "entry_point": "main"})
    buf = dev.create_buffer(size=512, usage=wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC)
    r = np.frombuffer(run_probe(dev, pipe, [
        {"binding": 0, "resource": {"buffer": buf, "offset": 0, "size": 512}}], buf), np.uint32)
    assert r[64:].all(), "subgroup lanes are not consecutive local_invocation_index values"
    return int(r[0])


def _variant_cfg(base: TileConfig, variant: str) -> TileConfig:
    """``base`` as ``choose_config`` turns it into ``variant`` (staged: IC doubled, the
    flush period kept, where two tiles hold the rows)."""
    cfg = dataclasses.replace(base, variant=variant)
    if cfg.stage:
        wide = dataclasses.replace(cfg, IC=2 * cfg.IC, UC=cfg.uc)
        wide.check()
        cfg = wide
    return cfg


# ---------------------------------------------------------------- selection
def test_variant_selection(be, monkeypatch):
    ctx = be.context
    monkeypatch.delenv(ENV_VARIANT, raising=False)
    assert pick_variant(ctx) == "portable"          # lavapipe: a CPU adapter
    gpu = SimpleNamespace(is_cpu=False, has_subgroups=True, name="fake GPU")
    # the table (H200 2026-12-04 04:31): wide-dsq for f32 on GPUs, portable-dsq for f16 (its
    # first entries; choose_config takes them only where the dS scratch is known to fit)
    assert (pick_variant(gpu, "f32"), pick_variant(gpu, "f16")) == ("wide-dsq", "portable-dsq")
    assert choose_config(ctx, 64).variant == "portable"
    monkeypatch.setenv(ENV_VARIANT, "prefetch")
    assert choose_config(ctx, 64).variant == "prefetch"
    assert choose_config(ctx, 64, "f32", variant="portable").variant == "portable"
    monkeypatch.setenv(ENV_VARIANT, "tiled9000")
    with pytest.raises(ValueError, match="unknown webgpu kernel variant"):
        choose_config(ctx, 64)
    monkeypatch.setenv(ENV_VARIANT, "subgroups")
    no_sg = SimpleNamespace(is_cpu=True, has_subgroups=False, name="fake adapter",
                            limits=ctx.limits)
    with pytest.raises(NotImplementedError, match="'subgroup'.*fake adapter"):
        choose_config(no_sg, 64)
    if ctx.has_subgroups:
        assert choose_config(ctx, 64).variant == "subgroups"
    with pytest.raises(ValueError, match="inconsistent"):
        dataclasses.replace(GPU_TILE, variant="tiled9000").check()
    assert set(VARIANTS) == {"portable", "prefetch", "staged", "subgroups", "wide", "rows8",
                             "portable-dsq", "staged-dsq", "wide-dsq"}
    # the variant reaches the kernels as defines, nothing else changes
    c = dataclasses.replace(GPU_TILE, variant="prefetch").consts()
    assert c["PREFETCH"] == 1 and "SUBGROUPS" not in c and (c["NEQ"], c["NEK"], c["NEU"]) == (1, 1, 1)
    assert dataclasses.replace(GPU_TILE, variant="subgroups").consts()["SUBGROUPS"] == 1
    # staged: twice the update rows where two tiles hold them (f32 D=128 on a GPU: 8 -> 16)
    monkeypatch.setenv(ENV_VARIANT, "staged")
    st = choose_config(ctx, 128)
    assert st.variant == "staged" and st.stage and st.IC == 2 * choose_config(ctx, 128, "f32",
                                                                              variant="portable").IC
    assert st.consts()["STAGE"] == 1 and st.uc == st.IC // 2
    dataclasses.replace(GPU_TILE, IC=16, variant="staged").check()   # two tiles hold 16 rows
    with pytest.raises(ValueError, match="inconsistent"):   # 32 rows: past two tiles
        dataclasses.replace(GPU_TILE, IC=32, variant="staged").check()
    with pytest.raises(ValueError, match="inconsistent"):   # portable: one tile
        dataclasses.replace(GPU_TILE, IC=16).check()
    assert "PREFETCH" not in GPU_TILE.consts()


def test_variant_by_grid_fill(be, monkeypatch):
    """wide only where its dQ grid has WIDE_MIN_GROUPS workgroups (the table's column,
    data), else staged (bitwise the same results); the backend passes the problem's
    (B*HQ, SQ); a forced variant ignores the fill; rows8 is refused for f32."""
    from anyattn.backends.webgpu import launch

    monkeypatch.delenv(ENV_VARIANT, raising=False)
    gpu = SimpleNamespace(is_cpu=False, has_subgroups=False, name="fake GPU",
                          limits={"max-compute-workgroup-storage-size": 49152,
                                  "max-compute-invocations-per-workgroup": 1024})
    n = launch.WIDE_MIN_GROUPS

    def pick(bh, sq, D=128, backward=True, elem="f32"):
        return choose_config(gpu, D, elem, backward, rows=(bh, sq)).variant
    # B*HQ = 8: the wide dQ grid is 8 * ceil(SQ / 128); one slice up to D = 128
    assert pick(8, 128 * (n // 8)) == "wide" and pick(8, 128 * (n // 8) - 128) == "staged"
    assert pick(8, 512) == pick(8, 512, backward=False) == "staged"     # forward alike
    assert pick(64, 512) == "wide"                                      # more heads fill it
    assert pick(1, 4096, D=256) == ("wide" if 32 * 2 >= n else "staged")   # 2 column slices
    assert choose_config(gpu, 128, backward=True) == choose_config(
        gpu, 128, backward=True, rows=(8, 4096))                        # size unknown: first
    assert pick(8, 512, elem="f16") == "portable"
    monkeypatch.setenv(ENV_VARIANT, "wide")
    assert pick(1, 64) == "wide"
    monkeypatch.setenv(ENV_VARIANT, "rows8")
    with pytest.raises(NotImplementedError, match="rows8.*float16"):
        pick(8, 4096)
    assert choose_config(gpu, 128, "f16", True, rows=(1, 64)).RM == 8
    # the backend hands the sizes over
    seen = []
    real = launch.choose_config
    monkeypatch.setattr(launch, "choose_config",
                        lambda *a, **kw: seen.append(kw.get("rows")) or real(*a, **kw))
    monkeypatch.delenv(ENV_VARIANT)
    q, k, v, g = make_qkv(np.random.default_rng(52), 2, 3, 1, 5, 7, 8)
    aa.attention(q, k, v, backend="webgpu")
    assert seen == [(6, 5, 7, 3)]     # (B*HQ, SQ, SK, G): the *-dsq scratch's chunk


def test_forced_variant_runs_through_the_api(be, monkeypatch):
    """ANYATTN_WEBGPU_VARIANT reaches an API call (no config_override)."""
    q, k, v, g = make_qkv(np.random.default_rng(40), 1, 2, 1, 19, 23, 24)
    monkeypatch.setenv(ENV_VARIANT, "prefetch")
    compare_with_reference("webgpu", q, k, v, g, mask=aa.Causal())
    monkeypatch.setenv(ENV_VARIANT, "subgroups")
    if not be.context.has_subgroups:
        with pytest.raises(NotImplementedError, match="subgroup"):
            aa.attention(q, k, v, backend="webgpu")


# ---------------------------------------------------------------- prefetch, staged
@pytest.mark.parametrize("variant", ["prefetch", "staged"])
@pytest.mark.parametrize("tile", ["adapter", "gpu16"])
def test_prefetch_is_bitwise_portable(be, tile, variant):
    """Same arithmetic in the same order: every output bit equal, fp32 with a mask,
    a (1, H, Sq, Sk) bias + dbias, GQA, Sq != Sk not multiples of the tiles, D = 40 (two
    and a half D chunks)."""
    base = choose_config(be.context, 40) if tile == "adapter" else GPU_TILE
    r = np.random.default_rng(41)
    q, k, v, g = make_qkv(r, 2, 4, 2, 37, 70, 40)
    bias = r.standard_normal((1, 4, 37, 70)).astype(np.float32)
    mask = aa.Causal("bottom_right") & aa.Window(left=40)
    wrt = ("q", "k", "v", "bias")
    res = [fwd_bwd(be, q, k, v, g, _variant_cfg(base, var), mask, bias, wrt)
           for var in ("portable", variant)]
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dbias"), *res):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_staged_f16_is_bitwise_portable(be):
    """f16: the flush period UC stays when the staged chunk doubles: same f16 sums."""
    if not be.context.has_f16:
        pytest.skip("no shader-f16")
    q, k, v, g = make_qkv(np.random.default_rng(42), 1, 2, 1, 45, 70, 72, dtype="float16")
    base = choose_config(be.context, 72, "f16", backward=True)
    res = [fwd_bwd(be, q, k, v, g, _variant_cfg(base, var), aa.Causal())
           for var in ("portable", "staged")]
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), res[0][:5], res[1][:5]):
        np.testing.assert_array_equal(a, b, err_msg=name)


# ---------------------------------------------------------------- subgroups
SG_CASES = {
    "causal_gqa": dict(shape=(2, 4, 2, 37, 70, 40), kw=dict(mask=aa.Causal())),
    "bias_dbias_docs": dict(shape=(1, 2, 2, 33, 50, 24), bias=(1, 2, 33, 50),
                            kw=dict(mask=aa.Documents(np.repeat([0, 1, 2], 11),
                                                      np.repeat([0, 1], 25)))),
    "modifiers": dict(shape=(1, 4, 2, 29, 41, 16),
                      kw=dict(mask=aa.Causal(), softcap=5.0, sinks=np.float32([0.5, -1, 2, 0]),
                              alibi_slopes=np.float32([0.5, 0.25, 0.125, 0.0625]))),
    "dropout": dict(shape=(1, 2, 1, 30, 45, 32), kw=dict(dropout_p=0.2, dropout_seed=7)),
    "empty_rows": dict(shape=(1, 2, 2, 20, 30, 16),
                       kw=dict(mask=aa.Causal() & aa.KeepMask(np.arange(20)[:, None] % 6 != 2))),
}


@pytest.mark.parametrize("case", list(SG_CASES))
def test_subgroups_against_float64(be, monkeypatch, case):
    _needs_subgroups(be)
    c = SG_CASES[case]
    r = np.random.default_rng(43)
    q, k, v, g = make_qkv(r, *c["shape"])
    kw = dict(c["kw"])
    wrt = ("q", "k", "v")
    if "bias" in c:
        kw["bias"] = r.standard_normal(c["bias"]).astype(np.float32)
        wrt += ("bias",)
    if "sinks" in kw:
        wrt += ("sinks",)
    monkeypatch.setenv(ENV_VARIANT, "subgroups")
    compare_with_reference("webgpu", q, k, v, g, wrt=wrt, **kw)


def test_subgroups_f16_against_float64(be, monkeypatch):
    _needs_subgroups(be)
    if not be.context.has_f16:
        pytest.skip("no shader-f16")
    q, k, v, g = make_qkv(np.random.default_rng(44), 1, 2, 1, 45, 70, 72, dtype="float16")
    monkeypatch.setenv(ENV_VARIANT, "subgroups")
    compare_with_reference("webgpu", q, k, v, g, mask=aa.Causal())


@pytest.mark.parametrize("tile", ["adapter", "gpu16"])
def test_subgroups_paths(be, tile):
    """TX lanes within one subgroup: the butterflies run (the row sums' order differs from
    the serial loop somewhere); a subgroup smaller than TX: the workgroup fallback, whose
    forward is bitwise portable's.  Both within the fp32 tolerance of float64."""
    _needs_subgroups(be)
    base = choose_config(be.context, 32) if tile == "adapter" else GPU_TILE
    sgs = _subgroup_size(be)
    r = np.random.default_rng(45)
    q, k, v, g = make_qkv(r, 2, 2, 2, 61, 90, 32)
    pt = fwd_bwd(be, q, k, v, g, dataclasses.replace(base, variant="portable"))
    sg = fwd_bwd(be, q, k, v, g, _variant_cfg(base, "subgroups"))
    from anyattn import reference as R

    ro, rl = R.forward(q, k, v)
    rg = R.backward(q, k, v, g)
    for name, got, want in zip(("out", "lse", "dq", "dk", "dv"), sg, (ro, rl, rg.dq, rg.dk, rg.dv)):
        assert_close(got, want, "float32", name)
    if sgs >= base.TX:
        assert not np.array_equal(pt[1], sg[1]), "butterfly sums expected to differ somewhere"
    else:
        np.testing.assert_array_equal(pt[0], sg[0])
        np.testing.assert_array_equal(pt[1], sg[1])


# ---------------------------------------------------------------- wide
def _wide_pair(base: TileConfig):
    """(forward, backward) configs of the wide variant from ``base``: the forward is
    staged's kernel (RM = 4), the backward RM = 8 with staged's update rows."""
    st = _variant_cfg(base, "staged")
    return dataclasses.replace(st, variant="wide"), dataclasses.replace(st, variant="wide", RM=8)


def test_wide_configs(be):
    """RM = 8 only in the backward; its P^T / dS tiles fit the 48 KiB of the H200's Vulkan
    adapter; the forward kernel refuses RM = 8; RM = 8 needs the wide variant."""
    from anyattn.backends.webgpu.pipelines import KernelError, build_source

    fwd, bwd = _wide_pair(GPU_TILE)
    assert (fwd.RM, fwd.BQ, fwd.alias, bwd.RM, bwd.BQ, bwd.alias) == (4, 64, False, 8, 128, True)
    bwd.check()
    c = bwd.consts()
    assert c["ALIAS"] == 1 and c["NACC"] == 16 and c["NACK"] == 8 and c["NEQ"] == 2
    # su = stg[0, IC*DS4), st / sp above it: the larger of dK/dV's and dQ's
    assert c["STG"] == max(2 * 192 * 5, 16 * 32 + max(64 * 33, 128 * 17)) == 2688
    assert all(bwd.smem_bytes(k, dropout=True) <= 49152 for k in ("bwd_dq", "bwd_dkdv"))
    assert fwd.smem_bytes("forward") == _variant_cfg(GPU_TILE, "staged").smem_bytes("forward")
    gpu = SimpleNamespace(is_cpu=False, has_subgroups=False, name="fake GPU",
                          limits={"max-compute-workgroup-storage-size": 49152,
                                  "max-compute-invocations-per-workgroup": 1024})
    assert choose_config(gpu, 128, variant="wide", backward=True) == bwd
    assert choose_config(gpu, 128, variant="wide") == fwd
    h = choose_config(gpu, 128, "f16", backward=True, variant="wide")
    assert (h.RM, h.DC, h.half) == (8, 32, True) and h.smem_bytes("bwd_dq") <= 49152
    with pytest.raises(KernelError, match="backward-only"):
        build_source("forward", bwd.consts())
    with pytest.raises(ValueError, match="inconsistent"):
        dataclasses.replace(GPU_TILE, RM=8, variant="staged").check()


def test_wide_is_bitwise_portable(be):
    """8 query rows per invocation: the same products summed in the same order (S over
    D chunks; dK/dV over the query rows in order, dQ over the keys), so every bit equals
    portable's: mask, (1, H, Sq, Sk) bias + dbias, GQA, odd sizes, D = 40; the H200's
    tiles (the adapter's run in test_wide_against_float64 and the trip test; each wide
    config costs ~30-60 s of llvmpipe compile cold)."""
    base = GPU_TILE
    r = np.random.default_rng(48)
    q, k, v, g = make_qkv(r, 2, 4, 2, 37, 150, 40)
    bias = r.standard_normal((1, 4, 37, 150)).astype(np.float32)
    mask = aa.Causal("bottom_right") & aa.Window(left=90)
    wrt = ("q", "k", "v", "bias")
    fwd, bwd = _wide_pair(base)
    ref = fwd_bwd(be, q, k, v, g, dataclasses.replace(base, variant="portable"), mask, bias, wrt)
    got = fwd_bwd(be, q, k, v, g, fwd, mask, bias, wrt, cfg_b=bwd)
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv", "dbias"), ref, got):
        np.testing.assert_array_equal(a, b, err_msg=name)


def test_wide_against_float64(be, monkeypatch):
    """Through the API (ANYATTN_WEBGPU_VARIANT=wide), the adapter's tiles, one compile:
    causal GQA with empty rows, softcap + ALiBi + sinks (+ dsinks), dropout."""
    q, k, v, g, kw = modifiers_case(49, 24)
    monkeypatch.setenv(ENV_VARIANT, "wide")
    compare_with_reference("webgpu", q, k, v, g, wrt=("q", "k", "v", "sinks"), **kw)


def test_wide_f16(be):
    """f16 (HALF: packed products, f16 runs flushed into f32) with 8 query rows per
    invocation, against float64: causal GQA, D = 24.  The backward alone, from the float64
    reference's out / lse (an f16 forward at a new D costs one more ~40 s llvmpipe compile
    cold); small D chunks (DC = 16, IC = 16) for the same reason."""
    if not be.context.has_f16:
        pytest.skip("no shader-f16")
    from anyattn import reference as R

    q, k, v, g = make_qkv(np.random.default_rng(50), 1, 4, 2, 45, 70, 24, dtype="float16")
    st = choose_config(be.context, 24, "f16", backward=True, variant="staged")
    cfg = dataclasses.replace(st, DC=16, IC=16, RM=8, variant="wide")
    cfg.check()
    mask = aa.Causal()
    rg = R.backward(q, k, v, g, mask=mask)
    gr = backward_from_float64(be, q, k, v, g, cfg, mask)
    for name in ("dq", "dk", "dv"):
        assert_close(getattr(gr, name), getattr(rg, name), "float16", name)


def test_rows8_f16_is_bitwise_portable(be):
    """rows8 (f16 only): portable's kernels with 8 query rows per invocation in the
    backward: the same f16 runs and flushes in the same order, so every bit equals
    portable's at the same chunks (causal GQA, odd sizes, dk/dv/dq); the backward alone
    from float64 out / lse (one compile of the two rows8 kernels, ~30 s cold on llvmpipe)."""
    if not be.context.has_f16:
        pytest.skip("no shader-f16")
    q, k, v, g = make_qkv(np.random.default_rng(51), 1, 4, 2, 45, 70, 24, dtype="float16")
    base = choose_config(be.context, 24, "f16", backward=True)
    r8 = dataclasses.replace(base, RM=8, variant="rows8")
    r8.check()
    assert (r8.prefetch, r8.stage, r8.alias, r8.BQ) == (False, False, False, 8 * r8.TY)
    assert_bitwise_and_close(be, q, k, v, g, base, r8, aa.Causal())


# ---------------------------------------------------------------- loop trips
@pytest.mark.parametrize("variant", ["prefetch", "staged", "wide"])
def test_trip_model_bounds_the_variants(be, variant):
    """llvmpipe counts loop tests: the model must bound the variants' loops (the
    prefetch staging is unrolled: only the chunk loops remain)."""
    if variant == "subgroups":
        _needs_subgroups(be)
    q, k, v, g = make_qkv(np.random.default_rng(46), 1, 2, 1, 70, 90, 40)
    call = backward_call(be, q, k, v, g, choose_config(be.context, 40, variant=variant),
                         cfg_b=choose_config(be.context, 40, variant=variant, backward=True),
                         debug_trips=True)
    assert call.cfg.variant == variant
    assert_backward_trips_within_model(call, 40)


@pytest.mark.parametrize("variant", ["staged", "subgroups"])
def test_variants_split_launches_bitwise(be, monkeypatch, variant):
    """Launches split at the loop budget continue from stored f32 partials: bitwise one
    launch's results, for the variants as for portable (staged: also portable's)."""
    if variant == "subgroups":
        _needs_subgroups(be)
    r = np.random.default_rng(47)
    q, k, v, g = make_qkv(r, 1, 4, 2, 70, 300, 24)
    kw = dict(mask=aa.Causal("bottom_right"))
    monkeypatch.setenv(ENV_VARIANT, "portable")
    ref = fwd_bwd(be, q, k, v, g, **kw)
    monkeypatch.setenv(ENV_VARIANT, variant)
    one = fwd_bwd(be, q, k, v, g, **kw)
    be.loop_limit_override = one_unit_loop_limit(choose_config(be.context, 24), 24)
    split = fwd_bwd(be, q, k, v, g, **kw)
    assert be.last_pieces["bwd_dq"] > 1 and be.last_pieces["bwd_dkdv"] > 1
    for name, a, b, c in zip(("out", "lse", "dq", "dk", "dv"), one, split, ref):
        np.testing.assert_array_equal(a, b, err_msg=name)
        if variant == "staged":
            np.testing.assert_array_equal(a, c, err_msg=name)
