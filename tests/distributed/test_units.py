"""In-process tests of the ring pieces: lse merge, sharding layouts, the pair plan,
the backends' out/lse contract the ring relies on, a ring of one rank, and errors."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
import torch.distributed as dist  # noqa: E402

from anyattn import Causal, Documents, KeepMask, Window, attention  # noqa: E402
from anyattn import reference  # noqa: E402
from anyattn.backends.registry import unavailable_reason  # noqa: E402
from anyattn.distributed import (chunk_ids, local_positions, ring_attention, shard,  # noqa: E402
                                 unshard_local)
from anyattn.distributed.blockmask import EMPTY, FULL, PARTIAL, GlobalMask  # noqa: E402
from anyattn.distributed.merge import merge_into  # noqa: E402
from anyattn.distributed.plan import RingPlan  # noqa: E402
from anyattn.distributed.sharding import Chunk  # noqa: E402


def _rand(rng, *shape, dtype=torch.float64):
    return torch.from_numpy(rng.standard_normal(shape)).to(dtype)


# ----------------------------------------------------------------------- merge
def test_merge_of_key_blocks_equals_full_attention():
    rng = np.random.default_rng(0)
    q, k, v = _rand(rng, 2, 3, 10, 8), _rand(rng, 2, 3, 24, 8), _rand(rng, 2, 3, 24, 8)
    mask = Causal(align="bottom_right") & Window(left=9, align="bottom_right")
    ref_o, ref_l = reference.forward(q, k, v, mask=mask)
    o_acc = torch.zeros(2, 3, 10, 8, dtype=torch.float64)
    l_acc = torch.full((2, 3, 10), float("-inf"), dtype=torch.float64)
    for j0 in range(0, 24, 8):   # global offsets place the band in each key block
        o, l = attention(q, k[:, :, j0:j0 + 8], v[:, :, j0:j0 + 8], backend="numpy",
                         mask=Causal() & Window(left=9), return_lse=True,
                         q_offset=14, k_offset=j0)
        merge_into(o_acc, l_acc, o, l)
    np.testing.assert_allclose(o_acc.numpy(), ref_o, rtol=0, atol=1e-12)
    np.testing.assert_allclose(l_acc.numpy(), ref_l, rtol=0, atol=1e-12)


def test_merge_empty_rows_stay_zero_and_nan_propagates():
    ninf = float("-inf")
    o_acc = torch.zeros(1, 1, 3, 2)
    l_acc = torch.full((1, 1, 3), ninf)
    merge_into(o_acc, l_acc, torch.zeros(1, 1, 3, 2), torch.full((1, 1, 3), ninf))
    assert torch.all(o_acc == 0) and torch.all(l_acc == ninf)
    o = torch.tensor([[[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]]])
    merge_into(o_acc, l_acc, o, torch.tensor([[[0.5, ninf, float("nan")]]]))
    assert torch.equal(o_acc[0, 0, 0], o[0, 0, 0]) and l_acc[0, 0, 0] == 0.5
    assert torch.all(o_acc[0, 0, 1] == 0) and l_acc[0, 0, 1] == ninf
    assert torch.isnan(o_acc[0, 0, 2]).all() and torch.isnan(l_acc[0, 0, 2])


def test_merge_of_row_statistics_at_large_logits():
    """Key blocks at logits of 2**20 merged in float32 through (max, log_norm): as exact
    as the block results (a merge through one rounded fp32 lse was off by 3e-2)."""
    from anyattn.api import forward_with_stats
    from anyattn.distributed.merge import merge_stats_into

    rng = np.random.default_rng(4)
    q = rng.integers(-1, 2, (1, 2, 6, 8)).astype(np.float32)
    k = rng.integers(-1, 2, (1, 2, 24, 8)).astype(np.float32)
    q[..., -1] = k[..., -1] = 2.0 ** 10                  # scores 2**20 + small integers
    v = rng.standard_normal((1, 2, 24, 8)).astype(np.float32)
    ref_o, ref_l = reference.forward(q, k, v, scale=1.0)
    o_acc = torch.zeros(1, 2, 6, 8)
    m_acc = torch.full((1, 2, 6), float("-inf"))
    ln_acc = torch.zeros(1, 2, 6)
    T = torch.from_numpy
    for j0 in range(0, 24, 8):
        o, st = forward_with_stats(T(q), T(k[:, :, j0:j0 + 8]), T(v[:, :, j0:j0 + 8]),
                                   scale=1.0, backend="reference")
        merge_stats_into(o_acc, m_acc, ln_acc, o, st.max, st.log_norm)
    assert np.abs(o_acc.numpy() - ref_o).max() <= 1e-6 * np.abs(ref_o).max()
    gap = m_acc.numpy() - 2.0 ** 20                       # the row max: an exact score
    assert np.all(ln_acc.numpy() >= 0) and np.array_equal(gap, np.round(gap))
    np.testing.assert_allclose((m_acc + ln_acc).numpy(), ref_l, rtol=1e-7)
    # rows empty on both sides stay (max -inf, log_norm 0, out 0)
    o2, m2, l2 = torch.zeros(1, 1, 2, 3), torch.full((1, 1, 2), float("-inf")), torch.zeros(1, 1, 2)
    merge_stats_into(o2, m2, l2, torch.zeros(1, 1, 2, 3), m2.clone(), l2.clone())
    assert torch.all(o2 == 0) and torch.all(m2 == float("-inf")) and torch.all(l2 == 0)


# ------------------------------------------------------------ rank agreement
def test_agreement_table_messages():
    from anyattn.distributed.agree import _MAGIC, FIELDS, check_table, failed_descriptor

    base = np.zeros((3, len(FIELDS)), np.int64)
    base[:, 0] = _MAGIC
    check_table(base, 0, ("contiguous", "zigzag"))             # all agree: no error
    t = base.copy()
    t[2, [i for i, (n, _) in enumerate(FIELDS) if n == "q2"][0]] = 5
    with pytest.raises(ValueError, match=r"q local length: 0 on ranks 0, 1; 5 on rank 2"):
        check_table(t, 1, ("contiguous", "zigzag"))
    t = base.copy()
    t[1] = failed_descriptor(3)
    with pytest.raises(ValueError, match="rank 1 of 3 refused their own arguments"):
        check_table(t, 0, ("contiguous", "zigzag"))
    t = base.copy()
    t[0, 0] = 7
    with pytest.raises(ValueError, match="rank 0 sent a descriptor of another anyattn"):
        check_table(t, 2, ("contiguous", "zigzag"))


def test_timeout_argument_errors():
    from datetime import timedelta

    from anyattn.distributed.agree import as_timeout

    assert as_timeout(None) is None and as_timeout(2) == timedelta(seconds=2)
    assert as_timeout(timedelta(milliseconds=500)) == timedelta(seconds=0.5)
    for bad, exc in ((0, ValueError), (-1.0, ValueError), (float("inf"), ValueError),
                     ("5", TypeError), (True, TypeError)):
        with pytest.raises(exc, match="timeout"):
            as_timeout(bad)
    q = torch.zeros(1, 2, 8, 4)
    with pytest.raises(ValueError, match="timeout"):
        ring_attention(q, q, q, timeout=0)


# -------------------------------------------------------------------- sharding
def test_zigzag_positions_and_chunks():
    assert chunk_ids(0, 2, "zigzag") == (0, 3)
    assert chunk_ids(1, 2, "zigzag") == (1, 2)
    assert local_positions(0, 2, 8, "zigzag") == [0, 1, 6, 7]
    assert local_positions(1, 2, 8, "zigzag") == [2, 3, 4, 5]
    assert local_positions(1, 2, 8, "contiguous") == [4, 5, 6, 7]


@pytest.mark.parametrize("sharding", ["contiguous", "zigzag"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shard_unshard_round_trip(sharding, world):
    x = torch.arange(2 * 3 * 24 * 2).reshape(2, 3, 24, 2)
    shards = [shard(x, r, world, sharding=sharding) for r in range(world)]
    assert torch.equal(unshard_local(shards, sharding=sharding), x)
    pos = sum((local_positions(r, world, 24, sharding) for r in range(world)), [])
    assert sorted(pos) == list(range(24))
    for r in range(world):
        assert torch.equal(shards[r][0, 0, :, 0] // 2, torch.tensor(
            local_positions(r, world, 24, sharding)))


def test_shard_rejects_indivisible_length():
    with pytest.raises(ValueError, match="not divisible by 8"):
        shard(torch.zeros(1, 1, 12, 2), 0, 4, sharding="zigzag")
    with pytest.raises(ValueError, match="sharding"):
        shard(torch.zeros(1, 1, 12, 2), 0, 4, sharding="striped")


# ------------------------------------------------------------------------ plan
def test_zigzag_balances_causal_work_and_skips_empty_pairs():
    N, S_loc = 4, 32
    g = GlobalMask(Causal(), N * S_loc, 1, 1)
    zig = [RingPlan(g, r, N, S_loc, "zigzag").work() for r in range(N)]
    con = [RingPlan(g, r, N, S_loc, "contiguous").work() for r in range(N)]
    assert len(set(zig)) == 1                  # every rank: the same work
    assert con == [(r + 0.5) * S_loc ** 2 for r in range(N)]   # r full blocks + a diagonal
    assert sum(zig) == sum(con)
    p0 = RingPlan(g, 0, N, S_loc, "contiguous")
    assert [len(p0.calls(t)) for t in range(N)] == [1, 0, 0, 0]
    # zig-zag: 2 full pairs at every step but the first (3: two diagonals + one full),
    # fused into one [2L x L] or [L x 2L] call without a mask
    unfused = RingPlan(g, 2, N, S_loc, "zigzag", fuse=False)
    assert [len(unfused.calls(t)) for t in range(N)] == [3, 2, 2, 2]
    pz = RingPlan(g, 2, N, S_loc, "zigzag")
    assert [len(pz.calls(t)) for t in range(N)] == [3, 1, 1, 1]
    assert pz.work() == unfused.work()
    for t in range(1, N):
        (c,) = pz.calls(t)
        assert c.full and c.mask is None
        assert sorted([c.q1 - c.q0, c.k1 - c.k0]) == [S_loc // 2, S_loc]
    # no mask: one call per step over the whole local shard
    pn = RingPlan(GlobalMask(None, N * S_loc, 1, 1), 1, N, S_loc, "zigzag")
    assert all(len(pn.calls(t)) == 1 and pn.calls(t)[0].q1 == S_loc for t in range(N))


def test_pair_states():
    S = 32
    a, b = Chunk(0, 0, 0, 8), Chunk(1, 8, 8, 8)
    g = GlobalMask(Causal(), S, 1, 1)
    assert (g.state(a, a), g.state(b, a), g.state(a, b)) == (PARTIAL, FULL, EMPTY)
    w = GlobalMask(Causal() & Window(left=3), S, 1, 1)
    assert w.state(Chunk(3, 24, 0, 8), a) == EMPTY
    ids = np.repeat([0, 1, 2, 3], 8)
    d = GlobalMask(Documents(ids), S, 1, 1)
    assert d.state(a, b) == EMPTY and d.state(a, a) == PARTIAL
    keep = np.ones((S, S), dtype=bool)
    km = GlobalMask(KeepMask(keep), S, 1, 1)
    assert km.state(a, b) == PARTIAL           # array masks are never assumed full
    pm = km.pair_mask(a, b, PARTIAL)
    assert pm.mask.shape == (1, 1, 8, 8)


def test_global_mask_errors():
    with pytest.raises(ValueError, match="GLOBAL ids"):
        GlobalMask(Documents(np.zeros(16, np.int32)), 32, 1, 1)
    with pytest.raises(ValueError, match="GLOBAL mask"):
        GlobalMask(KeepMask(np.ones((16, 16), bool)), 32, 1, 1)
    with pytest.raises(TypeError, match="mask"):
        GlobalMask("causal", 32, 1, 1)


# ------------------------------------------------- the backends' out/lse contract
# ------------------------------------------------------------ a ring of one rank
@pytest.fixture(scope="module")
def world1(tmp_path_factory):
    if not dist.is_gloo_available():
        pytest.skip("gloo is not available")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process")
    store = dist.FileStore(str(tmp_path_factory.mktemp("pg") / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("backend,dtype,tol", [("numpy", torch.float64, 1e-12),
                                               ("triton", torch.float32, 1e-5)])
@pytest.mark.parametrize("sharding", ["contiguous", "zigzag"])
def test_ring_of_one_rank(world1, sharding, backend, dtype, tol):
    if unavailable_reason(backend):
        pytest.skip(f"{backend}: {unavailable_reason(backend)}")
    rng = np.random.default_rng(5)
    q, g = _rand(rng, 1, 4, 32, 8, dtype=dtype), _rand(rng, 1, 4, 32, 8, dtype=dtype)
    k, v = _rand(rng, 1, 2, 32, 8, dtype=dtype), _rand(rng, 1, 2, 32, 8, dtype=dtype)
    ids = np.repeat([0, 1, 2], [5, 20, 7])
    mask = Causal() & Documents(ids)
    qq, kk, vv = (x.clone().requires_grad_() for x in (q, k, v))
    out = ring_attention(qq, kk, vv, mask=mask, sharding=sharding, backend=backend)
    out.backward(g)
    ro, _ = reference.forward(q, k, v, mask=mask)
    rg = reference.backward(q, k, v, g, mask=mask)
    for got, ref in ((out, ro), (qq.grad, rg.dq), (kk.grad, rg.dk), (vv.grad, rg.dv)):
        err = np.abs(got.detach().double().numpy() - ref).max() / np.abs(ref).max()
        assert err <= tol


def test_ring_argument_errors(world1):
    q = torch.zeros(1, 2, 6, 4)
    with pytest.raises(ValueError, match="odd"):
        ring_attention(torch.zeros(1, 2, 5, 4), torch.zeros(1, 2, 5, 4),
                       torch.zeros(1, 2, 5, 4), sharding="zigzag", backend="numpy")
    with pytest.raises(ValueError, match="GLOBAL ids"):
        ring_attention(q, q, q, mask=Documents(np.zeros(3, np.int32)), backend="numpy")
    with pytest.raises(ValueError, match="head"):
        ring_attention(q, torch.zeros(1, 3, 6, 4), torch.zeros(1, 3, 6, 4), backend="numpy")


def test_argument_errors_before_any_communication():
    q = torch.zeros(1, 2, 8, 4)
    with pytest.raises(TypeError, match="q: expected a torch.Tensor"):
        ring_attention(np.zeros((1, 2, 8, 4)), q, q)
    with pytest.raises(ValueError, match="sharding"):
        ring_attention(q, q, q, sharding="striped")
    with pytest.raises(ValueError, match="layout"):
        ring_attention(q, q, q, layout="sbhd")
    with pytest.raises(ValueError, match="k: local length"):
        ring_attention(q, torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4, 4))
    with pytest.raises(ValueError, match="4 dims"):
        ring_attention(q[0], q, q)
