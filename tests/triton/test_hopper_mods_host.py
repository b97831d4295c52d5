"""Host side of the score modifiers on the Hopper path (softcap, ALiBi, sinks;
backends/triton/hopper/launch.py mod_kw): the launches the forward and the backward make
with each modifier, checked on the CPU with the Gluon kernels swapped for recorders
(nothing runs on a GPU; the backward's portable delta preprocess runs in Triton's
interpreter).  The kernels themselves are checked on an sm_90 GPU by
test_hopper_mods.py.

What is checked: the constexpr switches (off without a modifier: the plain kernel's
keywords exactly), the slopes / sinks tensors as the kernels read them (fp32, [Ba, H] /
[H]), the batch stride of the slopes, the cap, the ALiBi offset (Sk - Sq, bottom-right);
sinks reach the backward kernels not at all (the statistics carry them, the portable
preprocess writes dsinks); array masks and missing modifier tensors are refused.

Shape legend: B batch, H / Hkv heads, Sq / Sk queries / keys, D head dim.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
try:
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor  # noqa: F401
except ImportError:                                      # pragma: no cover
    pytest.skip("needs triton.experimental.gluon", allow_module_level=True)

import anyattn as aa  # noqa: E402
from anyattn.backends.triton import launch as triton_launch  # noqa: E402
from anyattn.backends.triton import route  # noqa: E402
from anyattn.backends.triton.hopper import coverage as hopper_coverage  # noqa: E402
from anyattn.backends.triton.hopper import launch as hopper_launch  # noqa: E402
from anyattn.modifiers import ScoreMods  # noqa: E402
from anyattn.problem import describe  # noqa: E402

from tr_util import needs_triton  # noqa: E402

pytestmark = needs_triton

#: the modifier keywords of the forward kernels (the backward's lack SINKS / HAS_SINKS)
FWD_MOD_KEYS = {"SOFTCAP", "ALIBI", "HAS_SINKS", "SLOPES", "sl_b", "cap", "adiag", "SINKS"}


class _Recorder:
    """Stands in for a kernel: kernel[grid](*args, **kw) records the call."""

    def __init__(self, calls, name):
        self.calls, self.name = calls, name

    def __getitem__(self, grid):
        return lambda *a, **kw: self.calls.append((self.name, grid, a, kw))


@pytest.fixture
def recorded(monkeypatch):
    """Both directions routed to Hopper under ANYATTN_TRITON_PATH=hopper on an sm_90
    device's facts (132 SMs), every Gluon kernel and the dq conversion a recorder, no
    CUDA-graph capture -> the list of recorded launches."""
    from anyattn import problem
    from anyattn.backends.triton.hopper import (bwd_dq_convert, bwd_ws_dq_kernel,
                                                bwd_ws_kernel, bwd_ws_t_kernel,
                                                fwd_persist_kernel, fwd_ws_kernel)

    problem.clear_cache()
    calls = []
    monkeypatch.setenv("ANYATTN_TRITON_PATH", "hopper")
    monkeypatch.setitem(route.SM_COUNTS, "cpu", 132)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    for mod, name in ((fwd_ws_kernel, "fwd_ws_kernel"), (fwd_persist_kernel,
                                                         "fwd_persist_kernel"),
                      (bwd_ws_dq_kernel, "dkdvq_ws_kernel"), (bwd_ws_t_kernel,
                                                              "dkdvq_ws_t_kernel"),
                      (bwd_ws_kernel, "dkdv_ws_kernel"), (bwd_dq_convert,
                                                          "dq_convert_kernel")):
        monkeypatch.setattr(mod, name, _Recorder(calls, name))
    monkeypatch.setattr(route, "device_facts", lambda dev, env=None: route.DeviceFacts(
        "cuda", (9, 0), route.SM_COUNTS[str(dev)]))
    triton_launch.clear_prepared()
    yield calls
    triton_launch.clear_prepared()


def _inputs(B=2, H=4, Hkv=2, Sq=40, Sk=72, D=128, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, Sq, D, generator=g).to(torch.bfloat16)
    k, v = (torch.randn(B, Hkv, Sk, D, generator=g).to(torch.bfloat16) for _ in range(2))
    return q, k, v


#: name -> (describe's keywords, ScoreMods) over _inputs' B=2, H=4
def _mod_cases():
    slopes_h = torch.tensor([0.5, 0.25, 0.125, 0.0625])
    slopes_bh = torch.arange(8, dtype=torch.float32).reshape(2, 4) / 16
    sinks = torch.tensor([0.5, -1.0, 2.0, float("-inf")])
    return {
        "softcap": (dict(softcap=30.0), ScoreMods()),
        "alibi": (dict(alibi_slopes=slopes_h), ScoreMods(alibi_slopes=slopes_h[None])),
        "alibi_per_batch": (dict(alibi_slopes=slopes_bh), ScoreMods(alibi_slopes=slopes_bh)),
        "sinks": (dict(sinks=sinks), ScoreMods(sinks=sinks)),
        "all": (dict(softcap=12.0, alibi_slopes=slopes_h, sinks=sinks),
                ScoreMods(alibi_slopes=slopes_h[None], sinks=sinks)),
    }


@pytest.mark.parametrize("mask", [None, aa.Causal(align="bottom_right")])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("case", list(_mod_cases()))
def test_forward_passes_the_modifiers(recorded, case, D, mask):
    """The routed forward kernel gets the modifiers' switches and arguments as the
    portable kernel reads them; repeated calls (the prepared launch) pass the call's own
    tensors."""
    kw_p, mods = _mod_cases()[case]
    for i in range(2):
        q, k, v = _inputs(D=D, seed=i)
        p = describe(q, k, v, mask=mask, **kw_p)
        recorded.clear()
        triton_launch.forward(p, q, k, v, None, mods=mods)
        ((name, grid, args, kw),) = recorded
        assert name in ("fwd_ws_kernel", "fwd_persist_kernel")
        assert kw["SOFTCAP"] is ("softcap" in kw_p)
        assert kw["ALIBI"] is ("alibi_slopes" in kw_p)
        assert kw["HAS_SINKS"] is ("sinks" in kw_p)
        assert kw["cap"] == kw_p.get("softcap", 1.0)
        assert kw["adiag"] == (72 - 40 if "alibi_slopes" in kw_p else 0)
        if "alibi_slopes" in kw_p:
            sl = kw_p["alibi_slopes"].float().reshape(-1, 4)
            assert kw["SLOPES"].dtype == torch.float32 and torch.equal(kw["SLOPES"], sl)
            assert kw["sl_b"] == (4 if sl.shape[0] > 1 else 0)
        if "sinks" in kw_p:
            assert torch.equal(kw["SINKS"], kw_p["sinks"].float())
            assert kw["SINKS"].dtype == torch.float32


def test_forward_without_modifiers_passes_none(recorded):
    """Without a modifier the kernels get none of the modifier keywords: their defaults
    (None / False) compile the plain kernel."""
    q, k, v = _inputs()
    for mask in (None, aa.Causal()):
        recorded.clear()
        triton_launch.forward(describe(q, k, v, mask=mask), q, k, v, None)
        ((_, _, _, kw),) = recorded
        assert not FWD_MOD_KEYS & set(kw)


def _stats(B=2, H=4, Sq=40):
    return aa.RowStats(torch.zeros(B, H, Sq), torch.zeros(B, H, Sq))


@pytest.mark.parametrize("seq_k", [72, 9000])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("case", list(_mod_cases()))
def test_backward_passes_the_modifiers(recorded, case, D, seq_k):
    """The routed backward kernel (dQ inside; dK/dV only past 66 key tiles, the portable
    dQ then) gets softcap's and ALiBi's switches and arguments, never sinks; the dq
    conversion follows the dQ-inside kernel."""
    kw_p, mods = _mod_cases()[case]
    q, k, v = _inputs(D=D, Sk=seq_k)
    do = torch.randn_like(q)
    # past 66 key tiles dK / dV only (dQ would be the portable kernel's, interpreted)
    p = describe(q, k, v, dout=do, wrt=("k", "v") if seq_k > 72 else ("q", "k", "v"),
                 **kw_p)
    triton_launch.backward(p, q, k, v, do, torch.randn_like(q), _stats(), None, mods=mods)
    kernels = [c for c in recorded if c[0] != "dq_convert_kernel"]
    ((name, _, _, kw),) = kernels
    assert [c[0] for c in recorded][1:] == ([] if seq_k > 72 else ["dq_convert_kernel"])
    # D=64: the transposed consumers, but with ALiBi (configs.bwd_config)
    assert name == ("dkdv_ws_kernel" if seq_k > 72 else
                    "dkdvq_ws_t_kernel" if D == 64 and "alibi_slopes" not in kw_p
                    else "dkdvq_ws_kernel")
    assert not {"SINKS", "HAS_SINKS"} & set(kw)
    if "softcap" in kw_p or "alibi_slopes" in kw_p:
        assert kw["SOFTCAP"] is ("softcap" in kw_p)
        assert kw["ALIBI"] is ("alibi_slopes" in kw_p)
        assert kw["cap"] == kw_p.get("softcap", 1.0)
        assert kw["adiag"] == (seq_k - 40 if "alibi_slopes" in kw_p else 0)
    else:                      # sinks alone: the plain kernel
        assert not FWD_MOD_KEYS & set(kw)


def test_backward_sinks_gradient_from_the_preprocess(recorded):
    """With sinks the Hopper backward's dsinks is the portable preprocess's: -sum over
    batch and queries of exp(sink - lse) * delta, against float64."""
    sinks = torch.tensor([0.5, -1.0, 2.0, float("-inf")])
    q, k, v = _inputs()
    g = torch.Generator().manual_seed(3)
    do = torch.randn(q.shape, generator=g).to(torch.bfloat16)
    out = torch.randn(q.shape, generator=g).to(torch.bfloat16)
    st = aa.RowStats(torch.randn(2, 4, 40, generator=g), torch.rand(2, 4, 40, generator=g))
    p = describe(q, k, v, dout=do, wrt=("q", "k", "v", "sinks"), sinks=sinks)
    res = triton_launch.backward(p, q, k, v, do, out, st, None, mods=ScoreMods(sinks=sinks))
    lse = (st.max + st.log_norm).double().numpy()
    delta = (out.double() * do.double()).sum(-1).numpy()
    want = -(np.exp(sinks.double().numpy()[None, :, None] - lse) * delta).sum((0, 2))
    np.testing.assert_allclose(res["dsinks"].double().numpy(), want, rtol=1e-5, atol=1e-6)
    assert [c[0] for c in recorded] == ["dkdvq_ws_kernel", "dq_convert_kernel"]


def test_modifiers_refused_with_array_masks_and_without_their_tensors(recorded):
    """mod_kw refuses what the kernels do not take, before any launch: a Documents /
    KeepMask call with a modifier, a problem with ALiBi or sinks whose ScoreMods lack the
    tensor."""
    q, k, v = _inputs()
    p = describe(q, k, v, mask=aa.Documents(torch.tensor([0] * 20 + [1] * 20),
                                            torch.tensor([0] * 36 + [1] * 36)),
                 softcap=20.0)
    with pytest.raises(NotImplementedError, match="no mask or a band only"):
        hopper_launch.mod_kw(p, ScoreMods(), q.device)
    with pytest.raises(NotImplementedError, match="score features with mask class"):
        triton_launch.forward(p, q, k, v, None)
    assert not recorded
    slopes = torch.ones(4)
    p = describe(q, k, v, alibi_slopes=slopes)
    with pytest.raises(ValueError, match="carry no alibi_slopes"):
        hopper_launch.mod_kw(p, ScoreMods(), q.device)
    p = describe(q, k, v, sinks=slopes)
    with pytest.raises(ValueError, match="carry no sinks"):
        hopper_launch.mod_kw(p, None, q.device)
    assert hopper_launch.mod_kw(p, ScoreMods(sinks=slopes), q.device, sinks=False) == {}
    assert hopper_coverage.MOD_FEATURES <= hopper_coverage.COVERAGE["forward"].features


def test_alibi_refused_past_its_exact_distances(recorded):
    """The kernels' ALiBi distances are exact below 2^22 (fwd_masks.alibi_dist): a call
    whose offsets reach past that raises before any launch, naming the remedy."""
    q, k, v = _inputs()
    slopes = torch.ones(4)
    ok = describe(q, k, v, alibi_slopes=slopes, q_offset=hopper_launch.ALIBI_MAX_DIST - 1024)
    assert hopper_launch.mod_kw(ok, ScoreMods(alibi_slopes=slopes[None]), q.device)["ALIBI"]
    far = describe(q, k, v, alibi_slopes=slopes, q_offset=hopper_launch.ALIBI_MAX_DIST)
    with pytest.raises(NotImplementedError, match="exact below 2\\^22.*portable"):
        triton_launch.forward(far, q, k, v, None, mods=ScoreMods(alibi_slopes=slopes[None]))
    assert not recorded

