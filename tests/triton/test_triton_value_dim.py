"""v's head dim Dv != q's / k's D on the portable Triton kernels (interpreter on CPU
tensors): 16-bit inputs, score and mask functions, the broadcast-dbias reduction and the
two-launch backward, the Hopper route's refusal, bad shapes.  The contract suite
(tests/backends/test_contract.py, test_value_head_dim*) covers fp32 with every mask kind,
GQA, Sq != Sk, bias, softcap, ALiBi, sinks and dropout.

Shape legend: B batch, Hq/Hkv heads, Sq/Sk queries/keys, D head dim of q and k, Dv of v.
"""
import numpy as np
import pytest

from tr_util import DEV, T, needs_triton, torch, two_launch_backward

import anyattn as aa
from anyattn.backends.triton import route as ROUTE

from helpers import assert_close, make_qkv

H100 = ROUTE.DeviceFacts("cuda", (9, 0), 132)


def _rounded(x, dtype):
    """x as the backend sees it after the cast to ``dtype`` (the reference's input)."""
    return torch.from_numpy(x).to(getattr(torch, dtype)).double().numpy()


def _check(q, k, v, g, dtype, wrt=("q", "k", "v"), bias=None, sinks=None, **kw):
    """out, lse and the gradients of ``wrt`` on triton against float64 (DESIGN.md §4:
    the reference sees the inputs rounded to ``dtype``, the tolerance is the dtype's)."""
    td = getattr(torch, dtype)
    ref = [_rounded(x, dtype) for x in (q, k, v, g)]
    rb = None if bias is None else _rounded(bias, dtype)
    tb = None if bias is None else T(bias, td)
    ts = None if sinks is None else T(sinks)
    out, lse = aa.attention(T(q, td), T(k, td), T(v, td), bias=tb, sinks=ts, return_lse=True,
                            backend="triton", **kw)
    ro, rl = aa.attention(*ref[:3], bias=rb, sinks=sinks, return_lse=True,
                          backend="reference", **kw)
    assert tuple(out.shape) == ro.shape and out.dtype == td
    assert_close(out.float().cpu().numpy(), ro, dtype, "out")
    fin = np.isfinite(rl)
    np.testing.assert_array_equal(np.isfinite(lse.cpu().numpy()), fin)
    assert_close(lse.cpu().numpy()[fin], rl[fin], dtype, "lse")
    gr = aa.attention_backward(T(q, td), T(k, td), T(v, td), T(g, td), bias=tb, sinks=ts,
                               wrt=wrt, backend="triton", **kw)
    rg = aa.attention_backward(*ref, bias=rb, sinks=sinks, wrt=wrt, backend="reference",
                               **kw)
    for name in {"q": "dq", "k": "dk", "v": "dv", "bias": "dbias", "sinks": "dsinks"}.values():
        want = getattr(rg, name)
        if want is None:
            continue
        got = getattr(gr, name)
        assert tuple(got.shape) == want.shape, name
        assert_close(got.float().cpu().numpy(), want, dtype, name)


@needs_triton
@pytest.mark.parametrize("dims,dtype", [((40, 24), "bfloat16"), ((24, 40), "float16"),
                                        ((192, 128), "bfloat16")],
                         ids=["40-24-bf16", "24-40-fp16", "192-128-bf16"])
def test_value_dim_16bit_forward_and_gradients(dims, dtype):
    """16-bit q, k [.., D] and v [.., Dv] (odd dims: masked loads of both padded tiles),
    GQA 4 : 2, Sq != Sk, a window: out, lse, dq, dk, dv."""
    D, Dv = dims
    q, k, v, g = make_qkv(np.random.default_rng(D * Dv), 1, 4, 2, 9, 14, D, Dv=Dv)
    _check(q, k, v, g, dtype, mask=aa.Window(left=6, right=2))


@needs_triton
def test_value_dim_score_and_mask_functions():
    """A score function and a mask-function union with sinks (the dK/dV and dQ kernels
    with generated programs): out, dq, dk, dv, dsinks."""
    rng = np.random.default_rng(5)
    q, k, v, g = make_qkv(rng, 1, 2, 1, 11, 16, 40, Dv=24)
    sinks = rng.standard_normal(2).astype(np.float32)
    kw = dict(score_mod=lambda s, b, h, i, j: s * (1.0 + 0.5 * h) - 0.1 * abs(i - j),
              mask=aa.Causal("bottom_right") | aa.MaskMod(lambda b, h, i, j: j < 3))
    _check(q, k, v, g, "float32", wrt=("q", "k", "v", "sinks"), sinks=sinks, **kw)


@needs_triton
@pytest.mark.parametrize("bshape", [(1, 1, 1, 13), (2, 2, 1, 13)], ids=["11_K", "BH_K"])
def test_value_dim_broadcast_dbias_and_two_launch_backward(monkeypatch, bshape):
    """A bias broadcast over queries (dbias through the reduction kernel; a bias broadcast
    over keys only would have dbias = rowsum(dS) = 0, nothing to check) with
    dropout, and the backward as two launches (dK/dV, then dQ)."""
    two_launch_backward(monkeypatch)
    rng = np.random.default_rng(8)
    q, k, v, g = make_qkv(rng, 2, 2, 2, 9, 13, 24, Dv=40)
    bias = rng.standard_normal(bshape).astype(np.float32)
    _check(q, k, v, g, "float32", wrt=("q", "k", "v", "bias"), bias=bias,
           mask=aa.Causal(), dropout_p=0.25, dropout_seed=3)


@needs_triton
def test_value_dim_bad_shapes_raise_before_work():
    """A v head dim above the kernels' 1024 (above 256 only the decoding forward, see
    test_triton_mla_decode.py), a dout or out of q's head dim: one clear error each,
    before any launch."""
    q, k, v, g = (T(x) for x in make_qkv(np.random.default_rng(1), 1, 2, 2, 5, 7, 16, Dv=8))
    big = T(np.zeros((1, 2, 7, 1025), np.float32))
    with pytest.raises(NotImplementedError, match="value head dim <= 1024, got 1025"):
        aa.attention(q, k, big, backend="triton")
    with pytest.raises(ValueError, match=r"dout: shape \(1, 2, 5, 16\); expected \[B, Hq, Sq, Dv\]"):
        aa.attention_backward(q, k, v, q, backend="triton")
    with pytest.raises(ValueError, match=r"out: shape \(1, 2, 5, 16\); expected \[B, Hq, Sq, Dv\]"):
        aa.attention_backward(q, k, v, g, out=q, lse=T(np.zeros((1, 2, 5), np.float32)),
                              backend="triton")


def test_route_sends_value_dim_to_the_portable_kernels(monkeypatch):
    """Dv != D is outside the Hopper path's table: 'auto' routes it to the portable
    kernels with the reason, 'hopper' raises it; the plan is that of max(D, Dv)."""
    from anyattn import settings
    from anyattn.backends.triton import configs

    for switch in settings.SWITCHES:   # a GPU's settings: the heuristic plans
        if switch.name.startswith(("ANYATTN_TRITON_", "TRITON_")):
            monkeypatch.delenv(switch.name, raising=False)
    mla = ROUTE.ProblemFacts(1, 16, 16, 4096, 4096, 128, "bfloat16", head_dim_v=64)
    assert mla.value_dim == 64 and ROUTE.ProblemFacts(1, 1, 1, 8, 8, 64, "bfloat16").value_dim == 64
    for direction in ROUTE.DIRECTIONS:
        got = ROUTE.route(mla, direction, H100)
        assert got.path == "portable", got.describe()
        assert "value head_dim 64 != head_dim 128" in got.reasons[0]
        assert got.plan == configs.plan_for(128, "bfloat16", "highest", "none", False, 4096)
    wide = ROUTE.route(ROUTE.ProblemFacts(1, 16, 16, 4096, 4096, 64, "bfloat16",
                                          head_dim_v=256), "forward", H100)
    assert "padded max(D, Dv) 256" in wide.reasons[1]
    monkeypatch.setenv("ANYATTN_TRITON_PATH", "hopper")
    for direction in ROUTE.DIRECTIONS:
        with pytest.raises(NotImplementedError, match="value head_dim 64 != head_dim 128"):
            ROUTE.route(mla, direction, H100)


def test_info_route_prints_the_value_dim_reason(capsys):
    """``python -m anyattn info --route B,Hq,Hkv,Sq,Sk,D,Dv``: the seventh number is v's
    head dim, and the printed route says why the Hopper path does not take it."""
    from anyattn.cli import main

    assert main(["info", "--route", "1,16,16,4096,4096,192,128", "--cc", "9.0"]) == 0
    text = capsys.readouterr().out
    assert "head_dim_v=128" in text
    assert text.count("value head_dim 128 != head_dim 192") == 2
    with pytest.raises(SystemExit):
        main(["info", "--route", "1,16,16,4096,4096,192,0", "--cc", "9.0"])
    assert "six or seven integers" in capsys.readouterr().err


def test_autotune_candidates_follow_the_wider_head_dim(monkeypatch):
    """ANYATTN_TRITON_AUTOTUNE's candidates are those of the wider padded head dim of D
    and Dv (a D = 64, Dv = 256 launch gets the D = 256 tiles)."""
    from anyattn.backends.triton import configs, prepared

    seen = []

    def tune(key, cands, run):
        seen.append(list(cands))
        return cands[0]

    class Kernel:
        def __getitem__(self, grid):
            return lambda *args, **kw: None

    monkeypatch.setattr(configs, "autotune_enabled", lambda: True)
    monkeypatch.setattr(configs, "tune", tune)
    cfg = configs.KernelConfig(32, 32, 4, 1)
    for dp, vdp in ((64, 256), (256, 64), (64, 64)):
        prepared.resolve_launch(Kernel(), lambda c: (1, 1), cfg, (),
                                dict(DP=dp, VDP=vdp, SBQ=128, SBK=128), ("sig", dp, vdp),
                                ("fwd", None, "bfloat16"))
        want = [c for c in configs.candidates("fwd", max(dp, vdp), "bfloat16") if c != cfg]
        assert seen[-1] == [cfg] + want
    assert seen[0] != seen[2]
