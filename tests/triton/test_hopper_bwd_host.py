"""Host side of the Hopper backward route (launch.backward -> hopper/launch.py
route.route -> backward_fused): the launches it makes, checked on
the CPU with the Gluon kernel and the dq conversion swapped for recorders (nothing runs;
the portable delta preprocess runs in Triton's interpreter) and the SM count set.

What is checked: the routed config per mask class and SM count, the grids, every
scalar (the dQ add order from the SM count, the band clipped), the keywords, the
descriptors over the call's own tensors; the same on repeated calls of one signature
(the config resolved once and kept with the prepared launch) as on a fresh one.

Shape legend: B batch, H / Hkv heads, S = Sq = Sk, D head dim.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
try:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
except ImportError:                                      # pragma: no cover
    pytest.skip("needs triton.experimental.gluon", allow_module_level=True)

import anyattn as aa  # noqa: E402
from anyattn.backends.triton import launch as L  # noqa: E402
from anyattn.backends.triton import route as ROUTE  # noqa: E402
from anyattn.backends.triton.hopper import configs as HCF  # noqa: E402
from anyattn.backends.triton.hopper import launch as HL  # noqa: E402
from anyattn.problem import describe  # noqa: E402

from tr_util import needs_triton  # noqa: E402

pytestmark = needs_triton


class _Recorder:
    """Stands in for a kernel: kernel[grid](*args, **kw) records the call."""

    def __init__(self, calls, name):
        self.calls, self.name = calls, name

    def __getitem__(self, grid):
        return lambda *a, **kw: self.calls.append((self.name, grid, a, kw))


@pytest.fixture
def recorded(monkeypatch):
    """The backward routed to Hopper, its Gluon kernels and dq_convert_kernel recorders,
    an SM count of 132; -> the list of recorded launches."""
    from anyattn import problem
    from anyattn.backends.triton.hopper import (bwd_dq_convert, bwd_ws_dq_kernel,
                                                bwd_ws_kernel, bwd_ws_t_kernel)

    problem.clear_cache()
    calls = []
    monkeypatch.setitem(ROUTE.SM_COUNTS, "cpu", 132)
    monkeypatch.setattr(bwd_ws_dq_kernel, "dkdvq_ws_kernel", _Recorder(calls, "ws_dq"))
    monkeypatch.setattr(bwd_ws_t_kernel, "dkdvq_ws_t_kernel", _Recorder(calls, "ws_dq_t"))
    monkeypatch.setattr(bwd_ws_kernel, "dkdv_ws_kernel", _Recorder(calls, "ws_dkdv"))
    monkeypatch.setattr(bwd_dq_convert, "dq_convert_kernel", _Recorder(calls, "convert"))
    # the device's facts as an sm_90 GPU's: the route sends the backward to Hopper
    monkeypatch.setattr(ROUTE, "device_facts", lambda dev, env=None: ROUTE.DeviceFacts(
        "cuda", (9, 0), ROUTE.SM_COUNTS[str(dev)]))
    L.clear_prepared()
    yield calls
    L.clear_prepared()


def _expected(p, cfg, sms):
    """The launches of the ws-dq route for Problem p and config cfg, written out from
    the kernels' argument lists: (name, grid, scalars, keywords) of the kernel, then of
    the conversion (grid, scalars after dqa / dq, keywords)."""
    B, H, Hkv, S, D = p.batch, p.heads_q, p.heads_kv, p.seq_q, p.head_dim
    big = 1 << 30
    lo = -big if p.mask.band_lo is None else max(int(p.mask.band_lo), -big)
    hi = big if p.mask.band_hi is None else min(int(p.mask.band_hi), big)
    nkv = -(-S // cfg.bn)
    order = 1 if nkv <= sms else 0
    kw = dict(HAS_BAND=bool(p.mask.has_band), STAGES=cfg.stages,
              CONSUMER_REGS=cfg.consumer_regs, WRITER_REGS=HL.WS_DQ_WRITER_REGS,
              num_warps=4)
    if cfg.late_release:
        kw["LATE"] = True
    sq_acc = -(-S // 8) * 8
    n = B * H * S * D
    kernel = ("ws_dq_t" if cfg.trans else "ws_dq", (nkv, B * Hkv),
              (B * H, H, p.group, S, S, p.scale, lo, hi, order), kw)
    convert = ((-(-n // 4096),), (n, p.scale, S * D, sq_acc * D),
               dict(PADDED=sq_acc != S, BLOCK=4096, num_warps=8))
    return kernel, convert, sq_acc


@pytest.mark.parametrize("mask", [None, aa.Causal(), aa.Window(40, 7)])
@pytest.mark.parametrize("S", [256, 200])
def test_backward_route_launches(recorded, mask, S):
    """Repeated launch.backward calls of one signature on new tensors make the launches
    the route's definition gives (the config resolved on the first call and kept)."""
    B, H, D = 1, 2, 128
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        q, k, v, do = (torch.randn(B, H, S, D, generator=g).to(torch.bfloat16)
                       for _ in range(4))
        p = describe(q, k, v, dout=do, mask=mask, wrt=("q", "k", "v"))
        cfg = HCF.bwd_config(D, p.mask_class)
        assert ROUTE.route_call(p, "backward").hopper == cfg and cfg.dq
        out = torch.randn_like(q)
        st = aa.RowStats(torch.zeros(B, H, S), torch.zeros(B, H, S))
        recorded.clear()
        res = L.backward(p, q, k, v, do, out, st, None)
        (name, grid, args, kw), (cname, cgrid, cargs, ckw) = recorded
        (want_name, want_grid, scalars, want_kw), (wcgrid, wcscal, wckw), sq_acc = \
            _expected(p, cfg, 132)
        assert (name, grid, kw) == (want_name, want_grid, want_kw)
        descs, (l2, delta, sem), tail = args[:7], args[7:10], args[10:]
        assert tail == scalars
        rn = cfg.bn // 2
        for d, x, rows in zip(descs[:6], (q, k, v, do, res["dk"], res["dv"]),
                              (cfg.bm, rn, rn, cfg.bm, rn, rn)):
            assert d.base is x and list(d.block_shape) == [1, 1, rows, D]
        dqa = descs[6].base
        assert dqa.shape == (B * H, sq_acc, D) and dqa.dtype == torch.float32
        assert l2.shape == (B, H, 2, S) and delta.shape == (B, H, S)
        nq = -(-S // cfg.bm)
        assert sem.shape == (B * H * nq,) and not sem.any()
        assert (cname, cgrid, ckw) == ("convert", wcgrid, wckw)
        assert cargs[0] is dqa and cargs[1] is res["dq"] and cargs[2:] == wcscal
        assert res["dq"].shape == q.shape and res["dk"].shape == k.shape
    prs = [pr for key, pr in L.prepared.PREPARED._d.items() if key[0] == "backward"]
    assert len(prs) == 1 and prs[0].hop and prs[0].hcfg == cfg


def test_backward_route_config_follows_the_sm_count(recorded, monkeypatch):
    """Where a (batch, kv head) has more key tiles than half the SMs, the route is the
    dK/dV-only kernel with the portable dQ (route.route), per signature."""
    monkeypatch.setitem(ROUTE.SM_COUNTS, "cpu", 2)      # 256 keys = 2 tiles > 2 // 2
    q, k, v, do = (torch.randn(1, 2, 256, 128).to(torch.bfloat16) for _ in range(4))
    p = describe(q, k, v, dout=do, wrt=("q", "k", "v"))
    assert ROUTE.route_call(p, "backward").hopper == HCF.bwd_config_dkdv_only(128)
    st = aa.RowStats(torch.zeros(1, 2, 256), torch.zeros(1, 2, 256))
    L.backward(p, q, k, v, do, torch.randn_like(q), st, None)
    assert [c[0] for c in recorded] == ["ws_dkdv"]
    pr, = [pr for key, pr in L.prepared.PREPARED._d.items() if key[0] == "backward"]
    assert pr.hcfg == HCF.bwd_config_dkdv_only(128)


def test_repeats_go_direct_on_fresh_tensors(recorded, monkeypatch):
    """With direct launches on (a CUDA device's default; here put in), a signature's
    first call resolves each launch site and its repeats on fresh tensors replay them:
    the delta preprocess, the dQ-inside kernel and the dq conversion all go direct (the
    real launch hooks, empty, do not stop them)."""
    from anyattn.backends.triton import direct as DL

    direct = []

    class RecordedDirect(DL.Direct):
        def run(self, grid, vals):
            direct.append((getattr(self.fn, "name", "pre"), grid))
            return True

    monkeypatch.setattr(DL, "enabled", lambda dev: True)
    monkeypatch.setattr(DL, "resolve", lambda kern, a, k: RecordedDirect(kern, None, a, k))
    B, H, S, D = 1, 2, 200, 128
    for i in range(3):
        g = torch.Generator().manual_seed(i)
        q, k, v, do = (torch.randn(B, H, S, D, generator=g).to(torch.bfloat16)
                       for _ in range(4))
        p = describe(q, k, v, dout=do, mask=aa.Causal(), wrt=("q", "k", "v"))
        st = aa.RowStats(torch.zeros(B, H, S), torch.zeros(B, H, S))
        recorded.clear()
        direct.clear()
        L.backward(p, q, k, v, do, torch.randn_like(q), st, None)
        if i == 0:
            assert [c[0] for c in recorded] == ["ws_dq", "convert"] and not direct
        else:
            assert not recorded and sorted(d[0] for d in direct) == ["convert", "pre", "ws_dq"]
