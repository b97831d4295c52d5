"""Documents / KeepMask masks through the Hopper warp-specialised forward (hopper/
fwd_masks.py, launch.mask_arrays): the arguments the kernel walks, checked on the CPU by
replaying the kernel's tile walk in float64 (range table at its 128 x 128 tile, masks
only outside [f0, f1)); an offline sm_90a compile (no spills with document intervals);
and the kernel itself vs float64 on an sm_90 GPU.

Shape legend: B batch, H / Hkv heads, Sq / Sk queries / keys, D head dim.
"""
from __future__ import annotations


import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import anyattn as aa  # noqa: E402
from anyattn import reference as R  # noqa: E402
from anyattn.problem import describe  # noqa: E402

from helpers import TOL, assert_close, np_mask, to_np  # noqa: E402

from tr_util import array_mask_cases, needs_gluon, needs_sm90, sorted_ids  # noqa: E402


def _cases(device="cpu"):
    """name -> (B, H, Hkv, Sq, Sk, mask, DOCS mode expected): tr_util's."""
    return array_mask_cases(device)


def _walk(p, q, k, v, marr, bm, bn, scale):
    """float64 replay of fwd_ws_kernel's walk with ARRAY: per (b, h, query tile) the key
    tiles [t0, t1) of the range table; outside [f0, f1) bounds, band, documents and keep
    applied from the kernel's own arguments; inside no mask at all.  -> out [B, H, Sq, D]."""
    RT, rt_b, rt_h, QID, KID, sqid_b, skid_b, KM, skm_b, skm_h, skm_q, skm_k, docs = marr
    B, H, Sq, D = q.shape
    Sk, G = k.shape[2], p.group
    rm = p.mask
    lo = -(1 << 30) if rm.band_lo is None else int(rm.band_lo)
    hi = (1 << 30) if rm.band_hi is None else int(rm.band_hi)
    rt, qid, kid = RT.flatten().tolist(), QID.flatten(), KID.flatten()
    assert tuple(KM.stride()) == (skm_b, skm_h, skm_q, skm_k) or KM.numel() == 1
    out = torch.zeros(B, H, Sq, D, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            for pid in range(-(-Sq // bm)):
                r = b * rt_b + h * rt_h + pid
                t0, f0, f1, t1 = rt[4 * r: 4 * r + 4]
                i = torch.arange(pid * bm, min(Sq, pid * bm + bm))
                s = torch.full((len(i), Sk), float("-inf"), dtype=torch.float64)
                for t in range(t0, t1):
                    j = torch.arange(t * bn, min(Sk, t * bn + bn))
                    st = (q[b, h, i] @ k[b, h // G, j].T) * scale
                    if f0 <= t < f1:             # unmasked: must be a full tile
                        assert len(i) == bm and len(j) == bn
                        s[:, j] = st
                        continue
                    dd = j[None, :] - i[:, None]
                    keep = (dd >= lo) & (dd <= hi)
                    if docs == 2:
                        a = qid[b * sqid_b + i].long()
                        e = qid[b * sqid_b + Sq + i].long()
                        keep &= (j[None, :] >= a[:, None]) & (j[None, :] < e[:, None])
                    elif docs == 1:
                        keep &= qid[b * sqid_b + i][:, None] == kid[b * skid_b + j][None, :]
                    if rm.keep is not None:
                        keep &= KM[b, h][i][:, j] != 0
                    s[:, j] = torch.where(keep, st, torch.tensor(float("-inf"),
                                                                 dtype=torch.float64))
                m = s.max(1, keepdim=True).values
                pe = torch.exp(s - torch.where(torch.isinf(m), 0.0, m))
                den = pe.sum(1, keepdim=True)
                out[b, h, i] = torch.where(den > 0, pe @ v[b, h // G] / torch.where(
                    den > 0, den, 1.0), 0.0)
    return out


@pytest.mark.parametrize("name", list(_cases()))
def test_kernel_walk_over_mask_arrays_matches_float64(name):
    """The table, the document intervals / ids and the keep bytes that mask_arrays hands
    the kernel, walked as the kernel walks them, give the float64 reference's out: every
    kept key is inside [t0, t1), every tile of [f0, f1) is fully kept, and the DOCS mode
    is intervals exactly when the k ids are sorted."""
    from anyattn.backends.triton.hopper import configs as HCF, launch as HL

    B, H, Hkv, Sq, Sk, mask, docs_mode = _cases()[name]
    g = torch.Generator().manual_seed(7)
    q = torch.randn(B, H, Sq, 8, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, Sk, 8, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, Sk, 8, generator=g, dtype=torch.float64)
    p = describe(q, k, v, mask=mask)
    cfg = HCF.fwd_config(128, p.mask_class)   # the array masks' route
    assert not cfg.persist, cfg.name
    marr = HL.mask_arrays(p, q, cfg)
    assert marr[-1] == docs_mode
    got = _walk(p, q, k, v, marr, cfg.bm, cfg.bn, p.scale)
    ro, _ = R.forward(q.numpy(), k.numpy(), v.numpy(), mask=np_mask(mask))
    assert np.abs(got.numpy() - ro).max() < 1e-12


def test_walk_catches_a_table_one_tile_too_wide():
    """Mutation: a run of full tiles one tile longer than the table's (a masked tile run
    unmasked) changes out: the walk above would catch a wrong table."""
    from anyattn.backends.triton.hopper import configs as HCF, launch as HL

    B, H, Hkv, Sq, Sk, mask, _ = _cases()["docs_rand"]
    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(B, h, s, 8, generator=g, dtype=torch.float64)
               for h, s in ((H, Sq), (Hkv, Sk), (Hkv, Sk)))
    p = describe(q, k, v, mask=mask)
    marr = list(HL.mask_arrays(p, q, HCF.fwd_config(128, p.mask_class)))
    rt = marr[0].clone().view(-1, 4)
    row = int(torch.nonzero((rt[:, 2] > rt[:, 1]) & (rt[:, 2] < rt[:, 3]))[0])
    rt[row, 2] += 1
    marr[0] = rt.view(marr[0].shape)
    got = _walk(p, q, k, v, marr, 128, 128, p.scale)
    ro, _ = R.forward(q.numpy(), k.numpy(), v.numpy(), mask=np_mask(mask))
    assert np.abs(got.numpy() - ro).max() > 1e-3


def test_array_masks_are_covered_and_routed_only_where_measured():
    from anyattn.backends.triton.hopper import coverage as HCOV

    cov = HCOV.COVERAGE["forward"]
    for mc in ("documents", "keep", "band+documents", "band+keep", "documents+keep",
               "band+documents+keep"):
        assert mc in cov.mask_classes
    assert HCOV.routed_by_default("forward", "none")
    assert HCOV.routed_by_default("forward", "band")
    # measured faster than the portable forward
    assert HCOV.routed_by_default("forward", "documents")
    assert HCOV.routed_by_default("forward", "band+documents")
    assert not HCOV.routed_by_default("forward", "keep")
    for mc in cov.mask_classes - cov.auto_mask_classes:
        assert not HCOV.routed_by_default("forward", mc)


def test_persistent_config_refuses_array_masks(monkeypatch):
    """The host-built schedule takes band masks only: a persistent config refuses a
    Documents / KeepMask call instead of walking a wrong range."""
    from anyattn.backends.triton import route as ROUTE
    from anyattn.backends.triton.hopper import configs as HCF, launch as HL

    monkeypatch.setitem(ROUTE.SM_COUNTS, "cpu", 132)
    q = torch.zeros(1, 2, 8, 128, dtype=torch.bfloat16)
    for mask in (aa.Documents(torch.zeros(8, dtype=torch.int32)),
                 aa.KeepMask(torch.ones(1, 1, 8, 8, dtype=torch.bool))):
        with pytest.raises(NotImplementedError, match="band masks only"):
            HL.FwdLaunch(describe(q, q, q, mask=mask), HCF.fwd_config(128, "band"))


@needs_gluon
@pytest.mark.parametrize("docs,keep,band,spills", [(2, False, True, False),
                                                   (1, False, False, True),
                                                   (0, True, True, True)])
def test_compiles_for_sm90a(docs, keep, band, spills):
    """The default forward with array masks (hopper_offline.compile_fwd's default: the route of
    the mask class, the per-tile ws128x128s2opf: 6 UTMALDG, the persistent kernel has 8)
    compiles for sm_90a with its HGMMA / UTMALDG; document intervals (DOCS 2) add no
    local memory; the per-key id / keep loads do (spills on the masked edge tiles:
    correct, slower)."""
    from test_hopper import _compile_counts

    n = _compile_counts(f"O.compile_fwd('bfloat16', 128, {band}, docs={docs}, keep={keep})")
    assert n["ptx_wgmma"] > 0 and n["ptx_tma_load"] > 0, n
    if not n["has_sass"]:
        return
    assert n["sass_HGMMA"] == 64 and n["sass_UTMALDG"] == 6 and n["sass_HMMA"] == 0, n
    if not spills:
        assert n["sass_STL"] == 0 and n["sass_LDL"] == 0, n


# ----------------------------------------------------------------------------- GPU
def _gpu_qkv(B, H, Hkv, Sq, Sk, D, dtype, seed):
    """q [B, H, Sq, D], k / v [B, Hkv, Sk, D] on the GPU, standard normal in ``dtype``."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = getattr(torch, dtype)
    return tuple(torch.randn(B, h, s, D, device="cuda", generator=g).to(dt)
                 for h, s in ((H, Sq), (Hkv, Sk), (Hkv, Sk)))


def _forward_poisoned(p, q, k, v, cfgs):
    """HL.forward of each config in ``cfgs`` (None: the default) into NaN-filled out /
    stats buffers -> [(out, RowStats)]."""
    from anyattn.backends.triton.hopper import launch as HL

    B, H, Sq, D = q.shape
    res = []
    for cfg in cfgs:
        out = torch.full((B, H, Sq, D), float("nan"), dtype=q.dtype, device=q.device)
        st = torch.full((2, B, H, Sq), float("nan"), device=q.device)
        res.append(HL.forward(p, q, k, v, out=out, stats=st, cfg=cfg))
    return res


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", list(_cases()))
def test_gpu_forward_array_masks_match_float64(dtype, name):
    """fwd_ws_kernel with ARRAY (the route of the array masks) vs float64: out within
    tolerance, lse -inf exactly on empty rows, every element written (poisoned buffers),
    two runs bitwise equal."""
    cfg = None

    B, H, Hkv, Sq, Sk, mask, _ = _cases("cuda")[name]
    q, k, v = _gpu_qkv(B, H, Hkv, Sq, Sk, 128, dtype, seed=3)
    p = describe(q, k, v, mask=mask)
    (o, rs), (o2, rs2) = _forward_poisoned(p, q, k, v, (cfg, cfg))
    assert torch.equal(o, o2) and torch.equal(rs.max, rs2.max)
    assert torch.equal(rs.log_norm, rs2.log_norm)
    qr, kr, vr = (to_np(x).astype(np.float64) for x in (q, k, v))
    ro, rl = R.forward(qr, kr, vr, mask=np_mask(mask))
    assert_close(o, ro, dtype, "out")
    lse = to_np(rs.max + rs.log_norm).astype(np.float64)
    assert np.array_equal(np.isfinite(lse), np.isfinite(rl)), "lse -inf exactly on empty rows"
    fin = np.isfinite(rl)
    assert np.abs(lse[fin] - rl[fin]).max() <= 10 * TOL[dtype] * max(1.0, np.abs(rl[fin]).max())


def _gpu_masks(Sq, Sk):
    g = torch.Generator().manual_seed(5)
    ids = sorted_ids(g, Sq, 6).cuda()
    return {"none": None, "causal": aa.Causal(), "causal_br": aa.Causal(align="bottom_right"),
            "window": aa.Window(left=200, right=37),
            "docs_causal": (aa.Causal() & aa.Documents(ids)) if Sq == Sk else None}


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("kind", ["none", "causal", "causal_br", "window", "docs_causal"])
@pytest.mark.parametrize("Sq,Sk", [(600, 600), (520, 777)])
def test_gpu_persistent_forward_walks_many_tiles(dtype, kind, Sq, Sk):
    """The persistent forward with more query tiles (H=64: 5 x 64 = 320) than programs
    (one per SM), so every program walks two or three tiles of different key-loop
    lengths: out within tolerance of float64, every element written, bitwise repeatable,
    and bitwise equal to the per-tile kernel of the same loop; the routed config is the
    persistent one (on the schedule with a band, its own walk without), the per-tile one
    with documents."""
    mask = _gpu_masks(Sq, Sk)[kind]
    if kind == "docs_causal" and mask is None:
        pytest.skip("documents case: Sq == Sk only")
    B, H, Hkv = 1, 64, 16
    q, k, v = _gpu_qkv(B, H, Hkv, Sq, Sk, 128, dtype, seed=11)
    p = describe(q, k, v, mask=mask)
    from anyattn.backends.triton.hopper import configs as HCF

    per_tile = HCF.fwd_config(128, "band").per_tile()
    routed = HCF.fwd_config(128, p.mask_class)
    assert routed.persist is (kind != "docs_causal"), routed.name
    (o, rs), (o2, rs2), (od, rsd) = _forward_poisoned(p, q, k, v, (None, None, per_tile))
    assert torch.equal(o, o2) and torch.equal(rs.max, rs2.max)
    assert torch.equal(o, od) and torch.equal(rs.max, rsd.max)
    assert torch.equal(rs.log_norm, rsd.log_norm)
    qr, kr, vr = (to_np(x).astype(np.float64) for x in (q, k, v))
    ro, rl = R.forward(qr, kr, vr, mask=np_mask(mask))
    assert_close(o, ro, dtype, "out")
    lse = to_np(rs.max + rs.log_norm).astype(np.float64)
    assert np.array_equal(np.isfinite(lse), np.isfinite(rl)), "lse -inf exactly on empty rows"


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("kind", ["causal", "causal_br", "window"])
def test_gpu_d64_band_forward_is_the_per_tile_loop_bitwise(dtype, kind):
    """D=64 with a band routes the persistent kernel on the host-built schedule
    (configs.fwd_config): bitwise the per-tile kernel of the same loop, within
    tolerance of float64, every element written (poisoned), GQA, Sq != Sk."""
    from anyattn.backends.triton.hopper import configs as HCF

    Sq, Sk = 520, 777
    mask = _gpu_masks(Sq, Sk)[kind]
    B, H, Hkv = 2, 8, 2
    q, k, v = _gpu_qkv(B, H, Hkv, Sq, Sk, 64, dtype, seed=13)
    p = describe(q, k, v, mask=mask)
    cfg = HCF.fwd_config(64, p.mask_class)
    assert cfg.persist, cfg.name
    per_tile = cfg.per_tile()
    (o, rs), (ot, rst) = _forward_poisoned(p, q, k, v, (None, per_tile))
    assert torch.equal(o, ot) and torch.equal(rs.max, rst.max)
    assert torch.equal(rs.log_norm, rst.log_norm)
    qr, kr, vr = (to_np(x).astype(np.float64) for x in (q, k, v))
    ro, rl = R.forward(qr, kr, vr, mask=np_mask(mask))
    assert_close(o, ro, dtype, "out")


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("D,kind", [(128, "none"), (128, "causal"), (64, "causal")])
@pytest.mark.parametrize("S", [128, 300])
def test_gpu_persistent_routes_with_one_head(D, kind, S):
    """The routed persistent forwards (D=128 without a mask / causal, D=64 causal) at
    B = H = 1: BH = 1 is not specialised to a constant (the epilogue's BH.to(int64)
    needs a tensor); within tolerance of float64, every element
    written (poisoned), and the per-tile kernel's bits."""
    from anyattn.backends.triton.hopper import configs as HCF

    mask = _gpu_masks(S, S)[kind]
    q, k, v = _gpu_qkv(1, 1, 1, S, S, D, "bfloat16", seed=29)
    p = describe(q, k, v, mask=mask)
    cfg = HCF.fwd_config(D, p.mask_class)
    assert cfg.persist, cfg.name
    (o, rs), (ot, rst) = _forward_poisoned(p, q, k, v, (None, cfg.per_tile()))
    assert torch.equal(o, ot) and torch.equal(rs.max, rst.max)
    assert torch.equal(rs.log_norm, rst.log_norm)
    qr, kr, vr = (to_np(x).astype(np.float64) for x in (q, k, v))
    ro, rl = R.forward(qr, kr, vr, mask=np_mask(mask))
    assert_close(o, ro, "bfloat16", "out")


def _captured(call):
    """-> (a CUDA graph of call() captured on a side stream, call()'s result there)."""
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        with torch.cuda.graph(graph):
            res = call()
    torch.cuda.current_stream().wait_stream(s)
    return graph, res


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_scheduled_forward_under_graph_capture_without_warmup(D):
    """A scheduled persistent forward (the causal route at D=64 and D=128) captured at a shape never run before (its schedule cannot be copied to the
    device inside the capture) runs the per-tile loop there: the replay's bits are the
    eager call's."""
    from anyattn.backends.triton.hopper import launch as HL

    Sq = 999
    g = torch.Generator(device="cuda").manual_seed(17)
    q, k, v = (torch.randn(1, 4, Sq, D, device="cuda", generator=g).to(torch.bfloat16)
               for _ in range(3))
    p = describe(q, k, v, mask=aa.Causal())
    prep = HL.prepare_forward(p)
    assert prep.cfg.persist, prep.cfg.name
    HL.forward(p, q, k, v, cfg=prep.per_tile.cfg)   # compiled outside the capture
    torch.cuda.synchronize()
    HL._sched_cache.clear()
    assert prep.sched is not None and not HL.schedule_ready(*prep.sched, device=q.device)
    graph, (o_cap, st_cap) = _captured(lambda: HL.forward(p, q, k, v, prepared=prep))
    graph.replay()
    torch.cuda.synchronize()
    o, st = HL.forward(p, q, k, v, prepared=prep)      # eager: the scheduled kernel
    assert HL.schedule_ready(*prep.sched, device=q.device)
    assert torch.equal(o_cap, o) and torch.equal(st_cap.max, st.max)
    assert torch.equal(st_cap.log_norm, st.log_norm)


@pytest.mark.gpu
@needs_sm90
def test_gpu_captured_schedule_outlives_the_cache(monkeypatch):
    """A graph captured with a scheduled persistent forward (D=128, causal) keeps reading
    its schedule's device memory at every replay: the capture pins it
    (launch._sched_pinned), so evicting it from the schedule cache (more new shapes than
    _SCHED_CACHE, here 1) and allocating over the freed memory leave the replay's bits
    the eager call's."""
    from anyattn.backends.triton.hopper import launch as HL

    monkeypatch.setattr(HL, "_SCHED_CACHE", 1)
    g = torch.Generator(device="cuda").manual_seed(23)
    q, k, v = (torch.randn(2, 4, 1500, 128, device="cuda", generator=g).to(torch.bfloat16)
               for _ in range(3))
    p = describe(q, k, v, mask=aa.Causal())
    prep = HL.prepare_forward(p)
    assert prep.cfg.persist, prep.cfg.name
    o, st = HL.forward(p, q, k, v, prepared=prep)      # compiled, schedule built
    torch.cuda.synchronize()
    graph, (o_cap, st_cap) = _captured(lambda: HL.forward(p, q, k, v, prepared=prep))
    key = tuple(prep.sched) + (str(q.device),)
    assert key in HL._sched_pinned
    for sq in (700, 900, 1100):    # other schedules evict this one from the cache
        HL.persist_schedule(sq, sq, -(1 << 30), 0, 128, 128, 8, 132, device=q.device)
    assert not HL.schedule_ready(*prep.sched, device=q.device)
    junk = [torch.full((1 << 16,), -1, dtype=torch.int32, device="cuda") for _ in range(64)]
    graph.replay()
    torch.cuda.synchronize()
    del junk
    assert torch.equal(o_cap, o) and torch.equal(st_cap.max, st.max)
    assert torch.equal(st_cap.log_norm, st.log_norm)


def test_persist_schedule_deals_the_per_tile_order_greedily():
    """persist_schedule: every tile exactly once; each program's walk in the per-tile
    grid's launch order (head by head, longest query tile first); the busiest program's
    load that of greedy dispatch (within one tile of the mean plus the longest tile);
    rows of empty query tiles (a window past the keys) still walked; cached."""
    from anyattn.backends.triton.hopper import launch as HL

    for Sq, Sk, lo, hi, BH, P in ((2048, 2048, -(1 << 30), 0, 128, 132),
                                  (600, 777, -(1 << 30), 177, 64, 132),
                                  (1000, 1000, -200, 37, 3, 8),
                                  (300, 100, 250, 1 << 30, 4, 5)):
        sch = HL.persist_schedule(Sq, Sk, lo, hi, 128, 128, BH, P).numpy()
        assert HL.persist_schedule(Sq, Sk, lo, hi, 128, 128, BH, P) is \
            HL.persist_schedule(Sq, Sk, lo, hi, 128, 128, BH, P)
        n_m = -(-Sq // 128)
        offs, tiles = sch[:P + 1], sch[P + 1:]
        assert offs[0] == 0 and offs[-1] == len(tiles) == n_m * BH
        assert sorted(tiles.tolist()) == list(range(n_m * BH))
        launch_pos = {bh * n_m + (n_m - 1 - x): bh * n_m + x
                      for bh in range(BH) for x in range(n_m)}
        n = HL._band_key_tiles(Sq, Sk, lo, hi, 128, 128)
        i = np.arange(Sq)[:, None]
        j = np.arange(Sk)[None, :]
        keep = (j - i >= lo) & (j - i <= hi)
        for m in range(n_m):       # every kept key of the tile's rows inside its range
            cols = np.nonzero(keep[m * 128:(m + 1) * 128].any(0))[0]
            assert len(cols) == 0 or n[m] >= cols[-1] // 128 - cols[0] // 128 + 1
        loads = []
        for w in range(P):
            walk = tiles[offs[w]:offs[w + 1]].tolist()
            assert [launch_pos[t] for t in walk] == sorted(launch_pos[t] for t in walk)
            loads.append(sum(int(n[t % n_m]) + 1 for t in walk))
        assert max(loads) <= sum(loads) / P + int(n.max()) + 1


@needs_gluon
@pytest.mark.parametrize("band", [False, True])
def test_persistent_forward_compiles_for_sm90a_without_spills(band):
    """fwd_persist_kernel (the D=128 route without a mask: its own walk; with a band:
    the host-built schedule) compiles for sm_90a: 64 HGMMA per consumer, Q loads for the
    first and the next tile (8 UTMALDG), no local memory (its producer walks tiles at 32
    registers)."""
    from test_hopper import _compile_counts

    n = _compile_counts("O.compile_fwd('bfloat16', 128, %s)" % band)
    assert n["ptx_wgmma"] > 0 and n["ptx_setmaxnreg"] > 0, n
    if n["has_sass"]:
        assert n["sass_HGMMA"] == 64 and n["sass_UTMALDG"] == 8 and n["sass_HMMA"] == 0, n
        assert n["sass_STL"] == 0 and n["sass_LDL"] == 0, n


def test_mask_arrays_cached_per_mask_tensor_version():
    """A repeated call with the same mask tensors reuses the arrays; an in-place write
    to the ids (a new version) rebuilds them, with the new contents."""
    from anyattn.backends.triton.hopper import configs as HCF, launch as HL

    ids = torch.arange(300, dtype=torch.int32) // 100
    q = torch.zeros(1, 2, 300, 8, dtype=torch.float64)
    p = describe(q, q, q, mask=aa.Documents(ids))
    cfg = HCF.fwd_config(128, p.mask_class)
    a = HL.mask_arrays(p, q, cfg)
    assert HL.mask_arrays(p, q, cfg) is a
    ids[:] = torch.arange(300, dtype=torch.int32) // 150
    b = HL.mask_arrays(describe(q, q, q, mask=aa.Documents(ids)), q, cfg)
    assert b is not a
    assert b[3][0, 1].tolist()[:2] == [150, 150]     # row 0..: interval end 150
    assert a[3][0, 1].tolist()[:2] == [100, 100]
