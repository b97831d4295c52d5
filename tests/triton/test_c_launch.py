"""A direct launch's C launcher call without Triton's Python wrapper (backends/triton/
c_launch.py): the same arguments reach the compiled launch function as through Triton
3.6's CudaLauncher and its descriptor wrapper (``wrap_handle_tensordesc``), with each
descriptor slot's tensor-map expansion kept per value.  Checked on the CPU against
Triton's own wrapper code (the tensor-map encoding, a driver call, replaced by a
recording stand-in in both); on an H200 the direct-launch tests (test_hopper_direct.py)
compare the bits with Triton's launches.

Shape legend: [B, H, S, D] tensors under 4-D TMA descriptors with [1, 1, rows, D] blocks.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
nv = pytest.importorskip("triton.backends.nvidia.driver")

from anyattn.backends.triton import c_launch as CL  # noqa: E402

from tr_util import needs_gluon  # noqa: E402

#: a kernel's parameters as CudaLauncher sees them: two descriptors around plain ones
SIGNATURE = {"q_desc": "tensordesc<bf16[1,1,64,128]>", "L2": "*fp32", "n": "i32",
             "k_desc": "tensordesc<bf16[1,1,64,128]>", "scale": "fp32", "BM": "constexpr"}
META = [dict(swizzle=3, elem_size=2, elem_type=10, block_size=[1, 1, 64, 128],
             fp4_padded=False),
        dict(swizzle=3, elem_size=2, elem_type=10, block_size=[1, 1, 64, 128],
             fp4_padded=False)]


@pytest.fixture
def encodings(monkeypatch):
    """Tensor-map encodings made (make_tensordesc_arg stands in for the driver call)."""
    made = []

    def make_tensordesc_arg(arg, meta):
        made.append(arg.base.data_ptr())
        shape, strides = list(arg.shape), list(arg.strides)
        return [("map", arg.base.data_ptr(), tuple(shape), tuple(strides), arg.padding,
                 meta["swizzle"], tuple(meta["block_size"])), *shape, *strides]

    monkeypatch.setattr(nv, "make_tensordesc_arg", make_tensordesc_arg)
    return made


class _CFunction:
    """Stands in for the compiled launch function (a builtin: no Python code object)."""

    def __init__(self, calls):
        self.calls = calls

    def __call__(self, *args):
        self.calls.append(args)


def _launcher(calls, signature=SIGNATURE, meta=META, scratch=0):
    """A CudaLauncher as Triton builds it, its compiled C function a recorder."""
    launcher = object.__new__(nv.CudaLauncher)
    launcher.launch = nv.wrap_handle_tensordesc(_CFunction(calls), signature, meta)
    launcher.num_ctas = 1
    launcher.global_scratch_size = launcher.profile_scratch_size = scratch
    launcher.global_scratch_align = launcher.profile_scratch_align = 1
    launcher.launch_cooperative_grid, launcher.launch_pdl = False, True
    return launcher


def _descs(seed):
    from anyattn.backends.triton.hopper.launch import make_desc

    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 3, 200, 128, generator=g).to(torch.bfloat16)
    k = torch.randn(2, 3, 200, 128, generator=g).to(torch.bfloat16)
    return make_desc(q, 64), make_desc(k, 64)


@needs_gluon
def test_same_arguments_as_triton_wrapper(encodings):
    calls = []
    launcher = _launcher(calls)
    cl = CL.CLaunch.of(launcher)
    assert cl is not None and cl.positions == (0, 3)
    for seed in (0, 0, 1):
        qd, kd = _descs(seed)
        vals = (qd, torch.zeros(4), 77, kd, 0.125, 64)
        launcher(5, 6, 1, 1234, "fn", "packed", None, None, None, *vals)   # Triton's path
        cl((5, 6), 1234, "fn", "packed", vals)
        assert calls[-1] == calls[-2]
        assert len(calls[-1]) == 13 + 2 * (1 + 4 + 4) + 4


@needs_gluon
def test_tensor_maps_kept_per_value(encodings):
    launcher = _launcher([])
    cl = CL.CLaunch.of(launcher)
    qd, kd = _descs(0)
    vals = (qd, torch.zeros(4), 77, kd, 0.125, 64)
    for _ in range(3):
        cl((1,), 0, "fn", "packed", vals)
    assert len(encodings) == 2                       # one per slot, then kept
    qd2, kd2 = _descs(0)                              # new tensors: new addresses
    cl((1,), 0, "fn", "packed", (qd2, torch.zeros(4), 77, kd2, 0.125, 64))
    assert len(encodings) == 4
    small = qd.base[:, :, :100]                       # same address, other shape: new map
    from anyattn.backends.triton.hopper.launch import make_desc

    cl((1,), 0, "fn", "packed", (make_desc(small.contiguous(), 64), torch.zeros(4), 77,
                                 kd, 0.125, 64))
    assert len(encodings) == 5


@needs_gluon
def test_slot_cache_is_bounded(encodings, monkeypatch):
    monkeypatch.setattr(CL, "SLOT_CACHE", 3)
    cl = CL.CLaunch.of(_launcher([]))
    alive = [_descs(seed) for seed in range(6)]       # six distinct addresses per slot
    for qd, kd in alive:
        cl((1,), 0, "fn", "packed", (qd, torch.zeros(4), 77, kd, 0.125, 64))
    assert len(encodings) == 12
    assert all(len(s.kept) == 3 for s in cl.slots)


def test_forms_it_does_not_reproduce_are_refused(encodings):
    assert CL.CLaunch.of(_launcher([], scratch=256)) is None          # scratch memory
    assert CL.CLaunch.of(_launcher([], meta=None)) is None            # no metadata
    odd = _launcher([])
    odd.launch = lambda *a: None                                      # another wrapper
    assert CL.CLaunch.of(odd) is None
    assert CL.CLaunch.of(object()) is None


def test_kernel_without_descriptors_calls_the_c_function_directly():
    calls = []
    launcher = _launcher(calls, signature={"X": "*fp32", "n": "i32"}, meta=None)
    cl = CL.CLaunch.of(launcher)
    assert cl is not None and cl.positions == () and cl.raw is launcher.launch
    x = torch.zeros(3)
    launcher(2, 1, 1, 9, "fn", "packed", None, None, None, x, 5)
    cl((2,), 9, "fn", "packed", (x, 5))
    assert calls[0] == calls[1]
