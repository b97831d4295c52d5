"""Documents / KeepMask masks through the Hopper warp-specialised backward (bwd_ws_kernel,
bwd_ws_dq_kernel with ARRAY; launch.bwd_mask_tables): the tables the kernels walk,
checked on the CPU by replaying the kernels' walk in float64 (column range table at the
backward's 64 x 128 tile, masks only outside [g0, g1), the dQ partials added in the rank
table's order, that order free of waits in a cycle); an offline sm_90a compile; and the
kernels themselves vs float64 on an sm_90 GPU (both dQ routes: the ws dK/dV kernel +
the portable dQ, and dQ inside).

Shape legend: B batch, H / Hkv heads, G = H / Hkv, Sq / Sk queries / keys, D head dim,
nq / nkv query / key tiles (64 queries, 128 keys).
"""
from __future__ import annotations

import re

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import anyattn as aa  # noqa: E402
from anyattn import reference as R  # noqa: E402
from anyattn.problem import describe  # noqa: E402

from helpers import assert_close, np_mask  # noqa: E402

from tr_util import array_mask_cases, bwd_gpu_inputs, needs_gluon, needs_sm90, offline_facts  # noqa: E402

BM, BN = 64, 128     # the ws backward's query step and key tile


def _cases(device="cpu"):
    """name -> (B, H, Hkv, Sq, Sk, mask, DOCS mode expected): tr_util's, with the
    backward's extras."""
    return array_mask_cases(device, backward=True)


def _inputs(name, D=8, seed=7):
    B, H, Hkv, Sq, Sk, mask, docs = _cases()[name]
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Sq, D, generator=g, dtype=torch.float64)
    k, v = (torch.randn(B, Hkv, Sk, D, generator=g, dtype=torch.float64) for _ in range(2))
    dout = torch.randn(B, H, Sq, D, generator=g, dtype=torch.float64)
    return q, k, v, dout, mask, docs


def _walk(p, mask, q, k, v, dout, tabs):
    """float64 replay of the ws backward's walk with ARRAY: per (b, kv head, key tile)
    the query tiles [s0, s1) of the column table from index off on, for every head of the
    group; outside [g0, g1) bounds, band, documents and keep applied from the kernel's
    own arguments, inside no mask; dK / dV summed per key tile, the dQ partials of
    (b, h, query tile) summed in the rank table's order (ranks 0 .. n - 1 of its
    visitors, ordered by (visiting step, key tile)).  -> dq, dk, dv and the programs'
    visit lists [(b, hk, j) -> [(h, t, rank)]]."""
    kw = tabs.kw_dq
    B, H, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    G = H // Hkv
    nq, nkv = -(-Sq // BM), -(-Sk // BN)
    rm = p.mask
    lo = -(1 << 30) if rm.band_lo is None else int(rm.band_lo)
    hi = (1 << 30) if rm.band_hi is None else int(rm.band_hi)
    ct, rk = kw["CT"].flatten().tolist(), kw["RK"].flatten().tolist()
    iv, kid, km = kw["IV"].flatten(), kw["KID"].flatten(), kw["KM"]
    docs = kw["DOCS"]
    if rm.keep is not None:
        assert tuple(km.stride()) == (kw["skm_b"], kw["skm_h"], kw["skm_q"], kw["skm_k"])
    out, lse = R.forward(q.numpy(), k.numpy(), v.numpy(), mask=np_mask(mask))
    out, lse = torch.from_numpy(out), torch.from_numpy(lse)
    delta = (out * dout).sum(-1)                                       # [B, H, Sq]
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    parts, visits = {}, {}
    for b in range(B):
        for hk in range(Hkv):
            for j in range(nkv):
                r = 8 * (b * kw["ct_b"] + hk * kw["ct_h"] + j)
                s0, g0, g1, s1, off = ct[r:r + 5]
                assert s0 <= g0 <= g1 <= s1 <= nq and (s1 == s0 or 0 <= off < s1 - s0)
                n = s1 - s0
                keys = torch.arange(j * BN, min(Sk, j * BN + BN))
                vl = visits[(b, hk, j)] = []
                for hh in range(G):
                    h = hk * G + hh
                    for step in range(n):
                        t = s0 + (step + off) % n
                        rows = torch.arange(t * BM, min(Sq, t * BM + BM))
                        s = (q[b, h, rows] @ k[b, hk, keys].T) * p.scale       # [BM, BN]
                        lr = lse[b, h, rows][:, None]
                        pm = torch.where(torch.isinf(lr), 0.0, torch.exp(s - torch.where(
                            torch.isinf(lr), 0.0, lr)))
                        if g0 <= t < g1:          # unmasked: must be a full tile
                            assert len(rows) == BM and len(keys) == BN
                        else:
                            dd = keys[None, :] - rows[:, None]
                            keep = (dd >= lo) & (dd <= hi)
                            if docs == 2:
                                a = iv[b * kw["siv_b"] + rows].long()
                                e = iv[b * kw["siv_b"] + Sq + rows].long()
                                keep &= (keys[None, :] >= a[:, None]) & (keys[None, :] < e[:, None])
                            elif docs == 1:
                                keep &= (iv[b * kw["siv_b"] + rows][:, None]
                                         == kid[b * kw["skid_b"] + keys][None, :])
                            if rm.keep is not None:
                                keep &= km[b, h][rows][:, keys] != 0
                            pm = torch.where(keep, pm, 0.0)
                        dp = dout[b, h, rows] @ v[b, hk, keys].T
                        ds = pm * (dp - delta[b, h, rows][:, None])
                        dv[b, hk, keys] += pm.T @ dout[b, h, rows]
                        dk[b, hk, keys] += (ds.T @ q[b, h, rows]) * p.scale
                        rank = rk[b * kw["rk_b"] + hk * kw["rk_h"] + t * nkv + j]
                        parts.setdefault((b, h, t), []).append((rank, ds @ k[b, hk, keys]))
                        vl.append((h, t, rank))
    dq = torch.zeros_like(q)
    for (b, h, t), lst in parts.items():
        assert sorted(r for r, _ in lst) == list(range(len(lst))), (b, h, t)
        acc = None
        for _, part in sorted(lst, key=lambda x: x[0]):
            acc = part if acc is None else acc + part
        dq[b, h, t * BM: t * BM + acc.shape[0]] = acc * p.scale
    return dq, dk, dv, visits


def _tables(name, **kw):
    from anyattn.backends.triton.hopper import launch as HL

    q, k, v, dout, mask, docs = _inputs(name, **kw)
    p = describe(q, k, v, mask=mask)
    return p, mask, q, k, v, dout, HL.bwd_mask_tables(p, q, BM, BN), docs


@pytest.mark.parametrize("name", list(_cases()))
def test_backward_walk_over_tables_matches_float64(name):
    """The column table, the rank table and the mask arrays that bwd_mask_tables hands
    the kernels, walked as the kernels walk them, give the float64 reference's dq, dk,
    dv: every kept pair is visited, every tile of [g0, g1) is fully kept, the ranks of a
    query tile's visitors are 0 .. n - 1; DOCS intervals exactly when k ids are sorted."""
    p, mask, q, k, v, dout, tabs, docs = _tables(name)
    assert tabs.kw["DOCS"] == docs
    dq, dk, dv, _ = _walk(p, mask, q, k, v, dout, tabs)
    rg = R.backward(q.numpy(), k.numpy(), v.numpy(), dout.numpy(), mask=np_mask(mask))
    for n, got in (("dq", dq), ("dk", dk), ("dv", dv)):
        ref = getattr(rg, n)
        assert np.abs(got.numpy() - ref).max() <= 1e-10 * max(1.0, np.abs(ref).max()), n


def _seen_by_walk(visits, B, Hkv, nq):
    """bool [B, Hkv, nq]: the query tiles some program of (b, kv head) visits."""
    seen = torch.zeros(B, Hkv, nq, dtype=torch.bool)
    for (b, hk, _), vl in visits.items():
        for _, t, _ in vl:
            seen[b, hk, t] = True
    return seen


def _vis_of(tabs, B, H, nq) -> torch.Tensor:
    """The visits table as dq_convert_kernel reads it, per (b, query head, tile)."""
    kv = tabs.kw_visits
    flat = kv["VIS"].flatten()
    return torch.tensor([[[bool(flat[b * kv["vis_b"] + (h // kv["G"]) * kv["vis_h"] + t])
                           for t in range(nq)] for h in range(H)] for b in range(B)])


@pytest.mark.parametrize("name", list(_cases()))
def test_visits_table_is_the_walks_visited_tiles(name):
    """The visits table dq_convert_kernel reads (the accumulator is not zeroed) marks
    exactly the query tiles the programs visit, per (b, head) through its kv head."""
    p, mask, q, k, v, dout, tabs, _ = _tables(name)
    *_, visits = _walk(p, mask, q, k, v, dout, tabs)
    B, H, Sq, _ = q.shape
    Hkv, nq = k.shape[1], -(-Sq // BM)
    seen = _seen_by_walk(visits, B, Hkv, nq)
    assert torch.equal(_vis_of(tabs, B, H, nq), seen.repeat_interleave(H // Hkv, dim=1))


def test_dq_conversion_zeroes_the_unvisited_tiles_only():
    """dq_convert_kernel with VISITS on an accumulator whose never-stored rows hold NaN
    (no zeroing: a new mask reads nothing back from the device): the float64 reference's
    dq, zeros in the query tiles without keys ("docs_cross_br": q id 5 has no key)."""
    from anyattn.backends.triton.hopper.bwd_dq_convert import dq_convert_kernel

    from tr_util import DEV

    p, mask, q, k, v, dout, tabs, _ = _tables("docs_cross_br")
    dq, _, _, visits = _walk(p, mask, q, k, v, dout, tabs)
    B, H, Sq, D = q.shape
    nq = -(-Sq // BM)
    vis = _vis_of(tabs, B, H, nq)
    assert not bool(vis.all()) and bool(vis.any()), "the case needs both kinds of tile"
    rows = vis.repeat_interleave(BM, dim=2)[:, :, :Sq, None]          # [B, H, Sq, 1]
    acc = torch.where(rows, dq / p.scale, float("nan")).to(torch.float32)
    out = torch.full_like(acc, 7.0)
    n = acc.numel()
    kw = {key: (x.to(DEV) if isinstance(x, torch.Tensor) else x)
          for key, x in tabs.kw_visits.items()}
    dq_convert_kernel[(-(-n // 1024),)](acc.to(DEV), out_d := out.to(DEV), n, p.scale,
                                        Sq * D, Sq * D, PADDED=False, BLOCK=1024,
                                        H=H, D=D, **kw)
    got = out_d.cpu().double()
    rg = R.backward(q.numpy(), k.numpy(), v.numpy(), dout.numpy(), mask=np_mask(mask))
    assert not torch.isnan(got).any()
    assert bool((got[~rows.expand_as(got)] == 0).all())
    assert np.abs(got.numpy() - rg.dq).max() <= 1e-5 * max(1.0, np.abs(rg.dq).max())


@pytest.mark.parametrize("name", list(_cases()))
def test_dq_add_order_has_no_wait_cycle(name):
    """Replay of the writers' turn waits: each program walks its visits in order and adds
    to (b, h, query tile) only when the counter equals its rank; every program finishes
    (no cycle of waits between co-resident programs)."""
    p, mask, q, k, v, dout, tabs, _ = _tables(name)
    _, _, _, visits = _walk(p, mask, q, k, v, dout, tabs)
    pos = dict.fromkeys(visits, 0)
    cnt = {}
    moved = True
    while moved:
        moved = False
        for prog, vl in visits.items():
            while pos[prog] < len(vl):
                h, t, rank = vl[pos[prog]]
                key = (prog[0], h, t)
                if cnt.get(key, 0) != rank:
                    break
                cnt[key] = rank + 1
                pos[prog] += 1
                moved = True
    assert all(pos[x] == len(vl) for x, vl in visits.items()), "a wait cycle"


def test_rotation_spreads_equal_documents():
    """Equal 512-token documents (4 key tiles, 8 query tiles each): the key tiles of a
    document start at different query tiles (0, 2, 4, 6 of the document), so no two
    programs meet at a query tile in the same step (no turn waits in steady state)."""
    p, mask, q, k, v, dout, tabs, _ = _tables("docs_eq512_gqa")
    ct = tabs.ct.view(-1, 8)
    assert ct[:, 0].tolist() == [0, 0, 0, 0, 8, 8, 8, 8]
    assert ct[:, 4].tolist() == [0, 2, 4, 6, 0, 2, 4, 6]
    assert ct[:, 1].tolist() == ct[:, 0].tolist() and ct[:, 2].tolist() == ct[:, 3].tolist()


def test_walk_catches_a_table_one_tile_too_wide():
    """Mutation: a run of fully kept tiles one tile longer than the table's (a masked
    tile run unmasked) changes the gradients: the walk above would catch a wrong table."""
    p, mask, q, k, v, dout, tabs, _ = _tables("docs_rand")
    ct = tabs.ct.view(-1, 8)
    row = int(torch.nonzero((ct[:, 2] > ct[:, 1]) & (ct[:, 2] < ct[:, 3]))[0])
    ct[row, 2] += 1
    try:
        dq, dk, dv, _ = _walk(p, mask, q, k, v, dout, tabs)
    finally:
        ct[row, 2] -= 1
    rg = R.backward(q.numpy(), k.numpy(), v.numpy(), dout.numpy(), mask=np_mask(mask))
    assert np.abs(dk.numpy() - rg.dk).max() > 1e-3


def test_tables_cached_per_mask_tensor_version():
    """A repeated call with the same mask tensors reuses the tables; an in-place write to
    the ids rebuilds them."""
    from anyattn.backends.triton.hopper import launch as HL

    ids = torch.arange(600, dtype=torch.int32) // 300
    q = torch.zeros(1, 2, 600, 8, dtype=torch.float64)
    p = describe(q, q, q, mask=aa.Documents(ids))
    a = HL.bwd_mask_tables(p, q)
    assert HL.bwd_mask_tables(p, q) is a
    ids[:] = torch.arange(600, dtype=torch.int32) // 600
    b = HL.bwd_mask_tables(describe(q, q, q, mask=aa.Documents(ids)), q)
    assert b is not a
    assert a.ct.view(-1, 8)[0, 3] == 5 and b.ct.view(-1, 8)[0, 3] == 10


def test_transposed_configs_refuse_array_masks():
    from anyattn.backends.triton.hopper import configs as HCF, launch as HL

    q = torch.zeros(1, 2, 64, 128, dtype=torch.bfloat16)
    p = describe(q, q, q, mask=aa.Documents(torch.zeros(64, dtype=torch.int32)))
    l2 = torch.zeros(1, 2, 2, 64)
    delta = torch.zeros(1, 2, 64)
    with pytest.raises(NotImplementedError, match="trans"):
        HL.backward_fused(p, q, q, q, q, l2, delta, cfg=HCF.bwd_config(64, "band"))
    with pytest.raises(ValueError, match="rank"):
        HL.backward_fused(p, q, q, q, q, l2, delta, cfg=HCF.bwd_config(128, "documents"),
                          order=1)


def test_array_masks_covered_by_the_backward_not_routed():
    from anyattn.backends.triton.hopper import coverage as HCOV

    cov = HCOV.COVERAGE["backward"]
    for mc in ("documents", "keep", "band+documents", "band+keep", "documents+keep",
               "band+documents+keep"):
        assert mc in cov.covered_mask_classes(128)
        assert mc not in cov.covered_mask_classes(64)     # not timed at D=64
    # faster on the device, but the eager user path is host-bound there: covered, not
    # routed by 'auto'
    for mc in ("documents", "band+documents", "keep", "band+keep", "documents+keep",
               "band+documents+keep"):
        assert not HCOV.routed_by_default("backward", mc, 128)
    assert HCOV.routed_by_default("backward", "none", 128)
    assert HCOV.routed_by_default("backward", "band", 128)
    assert HCOV.routed_by_default("backward", "band", 64)
    assert HCOV.routed_by_default("backward", "none", 64)


# ----------------------------------------------------------------------------- offline
@needs_gluon
@pytest.mark.parametrize("dq", [False, True])
@pytest.mark.parametrize("docs,keep,band", [(2, False, True), (1, False, False),
                                            (0, True, True), (2, True, False)])
def test_array_backward_compiles_for_sm90a(dq, docs, keep, band):
    """The D=128 backward configs (dK/dV only; dQ inside, the routed config) compile
    for sm_90a with array masks: the dense configs' HGMMA counts (48 / 64), no HMMA, the
    bulk reduce-add of dQ inside; their local memory (spills on the masked edge tiles)
    is not asserted.  Compiled in a child process without
    TRITON_INTERPRET (tr_util.offline_facts says why)."""
    f = offline_facts("O.compile_bwd('bfloat16', 128, %r, cfg, %d, %r)" % (band, docs, keep),
                      "cfg = HCF.bwd_config(128, 'documents') if %r else "
                      "HCF.bwd_config_dkdv_only(128)" % dq)
    assert f["ptx_setmaxnreg"] > 0 and f["ptx_tma_load"] > 0, f
    if f["sass"]:
        assert f["sass_HGMMA"] == (64 if dq else 48) and f["sass_HMMA"] == 0, f
        if dq:
            assert re.search(r"\bUTMAREDG", f["sass"]), "no bulk reduce-add"


# ----------------------------------------------------------------------------- GPU
def _gpu_run(name, dtype, D, seed=3):

    B, H, Hkv, Sq, Sk, mask, _ = _cases("cuda")[name]
    g = torch.Generator(device="cuda").manual_seed(seed)
    dt = getattr(torch, dtype)
    q, k, v = (torch.randn(B, h, s, D, device="cuda", generator=g).to(dt)
               for h, s in ((H, Sq), (Hkv, Sk), (Hkv, Sk)))
    p, dout, l2, delta, rg = bwd_gpu_inputs(q, k, v, mask, g)
    return p, q, k, v, dout, l2, delta, rg


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("name", list(_cases()))
def test_gpu_backward_array_masks_match_float64(name, dtype):
    """D=128 (the head dim the array masks are covered at): dk / dv of the dK/dV-only
    kernel and dq / dk / dv of the routed dQ-inside config with ARRAY vs float64 into
    NaN-poisoned buffers (every element written; dq 0 on empty rows), two runs bitwise
    equal."""
    from anyattn.backends.triton.hopper import configs as HCF, launch as HL

    p, q, k, v, dout, l2, delta, rg = _gpu_run(name, dtype, 128)
    nan = lambda x: torch.full_like(x.contiguous(), float("nan"))  # noqa: E731
    runs = [HL.dkdv(p, q, k, v, dout, l2, delta, nan(k), nan(v)) for _ in range(2)]
    for i, n in enumerate(("dk", "dv")):
        assert torch.equal(runs[0][i], runs[1][i]), f"{n} dkdv"
        assert_close(runs[0][i], getattr(rg, n), dtype, f"{n} dkdv")
    cfg = HCF.bwd_config(128, p.mask_class)
    runs = [HL.backward_fused(p, q, k, v, dout, l2, delta, nan(q), nan(k), nan(v),
                              cfg=cfg) for _ in range(2)]
    for i, n in enumerate(("dq", "dk", "dv")):
        assert torch.equal(runs[0][i], runs[1][i]), f"{n} {cfg.name}"
        assert_close(runs[0][i], getattr(rg, n), dtype, f"{n} {cfg.name}")


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("name", ["docs_batch_causal", "keep_heads_sparse"])
def test_gpu_routed_backward_with_array_masks(name, monkeypatch):
    """ANYATTN_TRITON_PATH=hopper sends the array-mask backward through the Hopper route
    (route.route) and matches float64."""
    from anyattn.backends.triton import launch as TL
    from anyattn.backends.triton.hopper import configs as HCF

    monkeypatch.setenv("ANYATTN_TRITON_PATH", "hopper")
    TL.clear_prepared()
    p, q, k, v, dout, l2, delta, rg = _gpu_run(name, "bfloat16", 128)
    out, rs = TL.forward(p, q, k, v, None)
    res = TL.backward(p, q, k, v, dout, out, rs, None)
    for n in ("dq", "dk", "dv"):
        assert_close(res[n], getattr(rg, n), "bfloat16", f"{n} routed")
    assert HCF.bwd_config(128, p.mask_class).dq
    TL.clear_prepared()
