"""Shared setup of the triton-backend tests: where tensors live, whether the backend can
run here, and the gradient names.

On a machine without a GPU, tests/conftest.py sets TRITON_INTERPRET=1, so the kernels
run on CPU tensors through Triton's interpreter.  Importing this module skips the
importing test module where torch or triton is missing.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from anyattn.backends.registry import unavailable_reason  # noqa: E402

from helpers import torch_on  # noqa: E402

__all__ = ["DEV", "GRAD", "HAS_CUDA", "HAS_GLUON", "RUNNABLE", "SM90", "T", "needs_gluon",
           "needs_sm90", "needs_triton", "sorted_ids", "array_mask_cases", "bwd_gpu_inputs",
           "offline_facts", "hopper_facts", "route_to_hopper", "two_launch_backward",
           "grad_inputs"]

HAS_CUDA = torch.cuda.is_available()
DEV = "cuda" if HAS_CUDA else "cpu"
RUNNABLE = unavailable_reason("triton") is None
needs_triton = pytest.mark.skipif(not RUNNABLE, reason=f"triton: {unavailable_reason('triton')}")
HAS_GLUON = True
try:
    from triton.experimental.gluon.language.nvidia import hopper as _h  # noqa: F401
except ImportError:
    HAS_GLUON = False
needs_gluon = pytest.mark.skipif(not HAS_GLUON, reason="needs triton.experimental.gluon")
#: an sm_90 GPU (H100 / H200): the Hopper path's kernels can run
SM90 = HAS_CUDA and torch.cuda.get_device_capability() == (9, 0)
needs_sm90 = pytest.mark.skipif(not SM90,
                                reason="needs an sm_90 GPU (H100 / H200) for the Hopper path")
#: argument name -> the Grads field holding its gradient
GRAD = {"q": "dq", "k": "dk", "v": "dv", "bias": "dbias", "sinks": "dsinks"}


def grad_inputs(seed, B, Hq, Hkv, Sq, Sk, D, dtype="float32"):
    """q, k, v and dout as float32 NumPy arrays from ``seed``; for bfloat16 rounded to
    bfloat16 first, so that the float64 reference sees the inputs the kernels do."""
    import numpy as np

    rng = np.random.default_rng(seed)
    q, g = (rng.standard_normal((B, Hq, Sq, D)).astype(np.float32) for _ in range(2))
    k, v = (rng.standard_normal((B, Hkv, Sk, D)).astype(np.float32) for _ in range(2))
    if dtype == "bfloat16":
        q, k, v, g = (torch.from_numpy(x).to(torch.bfloat16).float().numpy()
                      for x in (q, k, v, g))
    return q, k, v, g


def T(x, dtype=None):
    """A NumPy array as a torch tensor on DEV (dtype: a torch dtype or None)."""
    return torch_on(x, DEV, dtype)


def sorted_ids(gen, n, docs):
    """Document ids [n] int32, sorted, ``docs`` documents of random lengths."""
    cuts = torch.sort(torch.randperm(n - 1, generator=gen)[:docs - 1] + 1).values
    ids = torch.zeros(n, dtype=torch.int64)
    ids[cuts] = 1
    return torch.cumsum(ids, 0).to(torch.int32)


def array_mask_cases(device="cpu", backward=False):
    """The Hopper kernels' Documents / KeepMask cases: name -> (B, H, Hkv, Sq, Sk, mask,
    DOCS mode expected).  ``backward``: the backward's extras (a key tile empty for one
    head in the per-head keep mask; equal documents over a GQA group of 4)."""
    import anyattn as aa

    g = torch.Generator().manual_seed(1)
    dv = dict(device=device)
    s700 = sorted_ids(g, 700, 5)
    bvar = torch.stack([sorted_ids(g, 700, 3), sorted_ids(g, 700, 7)])
    q300 = torch.sort(torch.randint(0, 6, (300,), generator=g)).values.to(torch.int32)
    k700 = torch.sort(torch.randint(0, 5, (700,), generator=g)).values.to(torch.int32)
    unsorted = torch.randint(0, 4, (700,), generator=g).to(torch.int32)
    keep = torch.rand(1, 1, 700, 700, generator=g) < 0.3
    keep_h = torch.rand(2, 4, 300, 700, generator=g) < 0.05
    keep_h[:, :, 5] = False                                  # empty rows
    if backward:
        keep_h[0, 1, :, 128:256] = False                     # a key tile empty for one head
    cases = {
        "docs_rand": (1, 2, 2, 700, 700, aa.Documents(s700.to(**dv)), 2),
        "docs_batch_causal": (2, 4, 2, 700, 700, aa.Causal() & aa.Documents(bvar.to(**dv)), 2),
        # Sq != Sk, bottom-right causal; q id 5 has no key: empty rows
        "docs_cross_br": (1, 2, 1, 300, 700, aa.Causal(align="bottom_right")
                          & aa.Documents(q300.to(**dv), k700.to(**dv)), 2),
        "docs_unsorted": (1, 2, 2, 700, 700, aa.Documents(unsorted.to(**dv)), 1),
        "keep_causal": (1, 2, 2, 700, 700, aa.Causal() & aa.KeepMask(keep.to(**dv)), 0),
        # per-head keep over a GQA group of 2, Sq != Sk, empty rows
        "keep_heads_sparse": (2, 4, 2, 300, 700, aa.KeepMask(keep_h.to(**dv)), 0),
        "docs_keep": (1, 2, 2, 700, 700, aa.Documents(s700.to(**dv))
                      & aa.KeepMask(keep.to(**dv)), 2),
    }
    if backward:
        eq = (torch.arange(1024) // 512).to(torch.int32)
        cases["docs_eq512_gqa"] = (1, 4, 1, 1024, 1024, aa.Documents(eq.to(**dv)), 2)
    return cases


def bwd_gpu_inputs(q, k, v, mask, gen):
    """The Hopper backward kernels' inputs for q, k, v (CUDA) under ``mask``: the portable
    forward's out and statistics, a random dout from ``gen``, the float64 reference's
    gradients and the kernels' l2 [B, H, 2, Sq] / delta [B, H, Sq] -> (p with dout and
    wrt q, k, v, dout, l2, delta, reference grads)."""
    import numpy as np

    from anyattn import reference as R
    from anyattn.backends.triton import launch as TL
    from anyattn.problem import describe

    from helpers import np_mask, to_np

    p = describe(q, k, v, mask=mask)
    out, rs = TL.forward(p, q, k, v, None)
    dout = torch.randn(out.shape, device=q.device, generator=gen).to(q.dtype)
    p = describe(q, k, v, mask=mask, dout=dout, wrt=("q", "k", "v"))
    f64 = lambda x: to_np(x).astype(np.float64)  # noqa: E731
    rg = R.backward(f64(q), f64(k), f64(v), f64(dout), mask=np_mask(mask), out=f64(out),
                    stats=type(rs)(f64(rs.max), f64(rs.log_norm)))
    delta = (out.float() * dout.float()).sum(-1).contiguous()
    mx = torch.where(rs.max == float("-inf"), float("inf"), rs.max)
    l2 = torch.stack([mx, rs.log_norm * 1.4426950408889634], 2).contiguous()
    return p, dout, l2, delta, rg


def offline_facts(call: str, setup: str = "", timeout: int = 600) -> dict:
    """Compile ``call`` (a Python expression giving a CompiledKernel for sm_90a, e.g.
    ``O.compile_bwd('bfloat16', 128, False, cfg)`` after ``setup`` statements; ``O``:
    bench/lab/hopper_offline.py) in a fresh interpreter WITHOUT TRITON_INTERPRET ->
    hopper_offline.ws_facts plus ``shared``
    (bytes) and ``sass`` (text, '' where cuobjdump is missing).  tests/conftest.py sets
    TRITON_INTERPRET=1 where no GPU is present; Gluon kernels compiled inside that
    process, after the interpreted suite, failed in 3 of 5 fresh-clone runs ("'ir.value'
    object has no attribute 'dtype'" in tile_ranges.key_tile_program), never alone —
    test_hopper.py's compile tests have always used a child process for that reason."""
    import json
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    root = os.path.dirname(os.path.dirname(here))
    env["PYTHONPATH"] = os.pathsep.join(
        [here, os.path.dirname(here), os.path.join(root, "src"),
         os.path.join(root, "bench", "lab"), env.get("PYTHONPATH", "")])
    code = ("import json\n"
            "import hopper_offline as O\n"
            "from anyattn.backends.triton.hopper import configs as HCF\n"
            f"{setup}\n"
            f"c = {call}\n"
            "f = dict(O.ws_facts(c), shared=c.metadata.shared,\n"
            "         sass=O.sass_of(c.asm['cubin']) if 'cubin' in c.asm else '')\n"
            "print('FACTS' + json.dumps(f, default=str))\n")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       timeout=timeout, cwd=here)
    lines = [x for x in r.stdout.splitlines() if x.startswith("FACTS")]
    assert r.returncode == 0 and lines, r.stderr[-3000:]
    return json.loads(lines[-1][len("FACTS"):])


def hopper_facts(device, sms=None):
    """route.DeviceFacts of an sm_90 GPU with the SM count route.SM_COUNTS holds for
    ``device`` (``sms`` where given): what the route reads of a Hopper device, on the CPU."""
    from anyattn.backends.triton import route

    return route.DeviceFacts("cuda", (9, 0), route.SM_COUNTS.get(str(device), 132)
                             if sms is None else sms)


def route_to_hopper(monkeypatch, direction: str) -> None:
    """Route every call of ``direction`` to the Hopper path here (CPU tensors, the
    kernels swapped for recorders by the caller): route.route_call with the facts of an
    sm_90 device and ANYATTN_TRITON_PATH=hopper (a call the path does not cover raises);
    the other direction keeps its real route."""
    import dataclasses

    from anyattn import settings
    from anyattn.backends.triton import route

    real = route.route_call

    def routed(p, d, plan=None, tensors=()):
        if d != direction:
            return real(p, d, plan, tensors)
        env = dataclasses.replace(settings.current(), triton_path="hopper")
        return route.route(route.ProblemFacts.of(p, tensors), d, hopper_facts(p.device),
                           env, plan)

    monkeypatch.setattr(route, "route_call", routed)


def two_launch_backward(monkeypatch) -> None:
    """Run every later backward call through the two-launch portable backward (dK/dV,
    then dQ: the heuristic plans' backward at D <= 64 and for fp32 inputs) with the fixed
    test plan's tiles, where the interpreter's fixed plan launches one kernel: the launch
    entry gets that plan as its explicit ``plan``."""
    import functools

    from anyattn.backends.triton import configs, launch

    monkeypatch.setattr(launch, "backward", functools.partial(
        launch.backward, plan=configs.fixed_plan(fused_bwd=False)))
