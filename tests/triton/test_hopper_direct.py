"""Direct launches (backends/triton/direct.py) on the routed Hopper kernels: a call
signature's repeats replay the compiled kernel without Triton's argument binding (and
without its launcher's Python wrapper: c_launch.py), and give the bits of Triton's own
launches (direct.enabled off) on every route: the forward (per-tile and persistent), the
delta preprocess, the dQ-inside backward and its dQ conversion, the dK/dV-only
backward, and the Documents / KeepMask tables passed as keyword tensors.  Each call takes fresh tensors (new addresses, new descriptors), the
array masks fresh mask tensors.

Shape legend: B batch, H / Hkv heads, Sq / Sk queries / keys, D head dim.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import anyattn as aa  # noqa: E402
from anyattn.problem import describe  # noqa: E402

from tr_util import array_mask_cases, needs_sm90  # noqa: E402

#: name -> (B, H, Hkv, Sq, Sk, D, mask builder, ANYATTN_TRITON_PATH)
_DENSE = {
    "d128_none_gqa": (2, 4, 2, 1000, 1000, 128, lambda dev: None, "auto"),
    "d128_causal": (1, 4, 4, 1100, 1100, 128, lambda dev: aa.Causal(), "auto"),
    "d64_none": (2, 2, 2, 900, 900, 64, lambda dev: None, "auto"),
    "d64_causal_persistent": (1, 4, 2, 1300, 1300, 64, lambda dev: aa.Causal(), "auto"),
    "d128_window": (1, 2, 2, 1000, 1000, 128, lambda dev: aa.Causal() & aa.Window(left=200), "auto"),
    # more key tiles than half the SMs per (b, kv head): the dK/dV-only Hopper backward
    # and the portable dQ
    "d64_long_dkdv_only": (1, 1, 1, 256, 9000, 64, lambda dev: None, "auto"),
}


def _array_case(name):
    def build(dev):
        return array_mask_cases(dev, backward=True)[name][5]
    B, H, Hkv, Sq, Sk, _, _ = array_mask_cases("cpu", backward=True)[name]
    return (B, H, Hkv, Sq, Sk, 128, build, "hopper")


_CASES = dict(_DENSE, docs_batch_causal=_array_case("docs_batch_causal"),
              keep_heads_sparse=_array_case("keep_heads_sparse"))


def _step(case, seed):
    """One routed forward + backward on fresh tensors (and fresh mask tensors)."""
    from anyattn.backends.triton import launch as TL

    B, H, Hkv, Sq, Sk, D, mask_of, _ = case
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(B, h, s, D, device="cuda", generator=g).to(torch.bfloat16)
               for h, s in ((H, Sq), (Hkv, Sk), (Hkv, Sk)))
    mask = mask_of("cuda")
    p = describe(q, k, v, mask=mask)
    out, rs = TL.forward(p, q, k, v, None)
    dout = torch.randn(out.shape, device="cuda", generator=g).to(q.dtype)
    p = describe(q, k, v, mask=mask, dout=dout, wrt=("q", "k", "v"))
    res = TL.backward(p, q, k, v, dout, out, rs, None)
    return [out, rs.max, rs.log_norm, res["dq"], res["dk"], res["dv"]]


def _sites():
    """Every direct.Site of the prepared launches -> {label: Site}."""
    from anyattn.backends.triton import launch as TL

    found = {}
    for i, pr in enumerate(TL.prepared.PREPARED._d.values()):
        if pr.hfwd is not None:
            found[f"{i}:fwd"] = pr.hfwd.site
            if getattr(pr.hfwd, "per_tile", None) is not None:
                found[f"{i}:fwd_per_tile"] = pr.hfwd.per_tile.site
        for name, s in pr.sites.items():
            found[f"{i}:{name if isinstance(name, str) else name[0]}"] = s
    return found


@pytest.mark.gpu
@needs_sm90
@pytest.mark.parametrize("name", list(_CASES))
def test_gpu_direct_launches_give_the_bits_of_triton_launches(name, monkeypatch):
    from anyattn.backends.triton import direct as DL
    from anyattn.backends.triton import launch as TL

    case = _CASES[name]
    monkeypatch.setenv("ANYATTN_TRITON_PATH", case[7])
    TL.clear_prepared()
    with monkeypatch.context() as m:              # every launch through Triton's path
        m.setattr(DL, "enabled", lambda device: False)
        plain = [_step(case, s) for s in range(3)]
    assert all(s.hits == 0 for s in _sites().values())
    TL.clear_prepared()
    direct = [_step(case, s) for s in range(3)]
    sites = _sites()
    hop = {k: s for k, s in sites.items()
           if k.split(":")[1] in ("fwd", "pre", "dkdvq", "dq_convert", "dkdv")}
    assert hop, sites
    # every site launched at least its last call directly (a persistent band forward's
    # per-tile twin runs only under graph capture)
    missed = {k: (s.hits, s.tries, s.d) for k, s in sites.items()
              if s.hits == 0 and not k.endswith("fwd_per_tile")}
    assert not missed, missed
    # and through c_launch.CLaunch (the C launcher without Triton's wrapper; its tensor
    # maps kept per address), not CompiledKernel.run
    no_c = [k for k, s in sites.items() if s.d and s.d.cl is None]
    assert not no_c, no_c
    for s in range(3):
        for i, (a, b) in enumerate(zip(plain[s], direct[s])):
            assert torch.equal(a, b), (s, i)
    TL.clear_prepared()
