"""Bad input to anyattn.torch.attention: raised before any work, naming the argument."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import anyattn.torch as at
from anyattn import Causal, Documents, KeepMask

q0, k0, v0 = torch.randn(2, 4, 9, 8), torch.randn(2, 2, 11, 8), torch.randn(2, 2, 11, 8)

BAD = {
    "q_not_tensor": (TypeError, "q", lambda: at.attention(q0.numpy(), k0, v0)),
    "integer_q": (TypeError, "q", lambda: at.attention(q0.long(), k0, v0)),
    "mixed_dtype": (TypeError, "k", lambda: at.attention(q0, k0.double(), v0)),
    "v_shape": (ValueError, "v", lambda: at.attention(q0, k0, v0[:, :, :5])),
    "heads": (ValueError, "k", lambda: at.attention(q0, k0[:, :1].expand(2, 3, 11, 8), v0[:, :1]
                                                    .expand(2, 3, 11, 8))),
    "three_dims": (ValueError, "q", lambda: at.attention(q0[0], k0[0], v0[0])),
    "two_dims_bshd": (ValueError, "q", lambda: at.attention(q0[0, 0], k0[0, 0], v0[0, 0],
                                                            layout="bshd")),
    "backend_type": (TypeError, "backend", lambda: at.attention(q0, k0, v0, backend=5)),
    "bias_shape": (ValueError, "bias", lambda: at.attention(q0, k0, v0, bias=torch.randn(9, 9))),
    "bias_integer": (TypeError, "bias", lambda: at.attention(
        q0, k0, v0, bias=torch.ones(9, 11, dtype=torch.int64))),
    "bias_float64": (TypeError, "bias", lambda: at.attention(q0, k0, v0, bias=torch.randn(
        9, 11, dtype=torch.float64))),
    "keep_shape": (ValueError, "KeepMask", lambda: at.attention(
        q0, k0, v0, mask=KeepMask(torch.ones(9, 9, dtype=torch.bool)))),
    "keep_float": (TypeError, "KeepMask", lambda: at.attention(
        q0, k0, v0, mask=KeepMask(torch.ones(9, 11)))),
    "doc_ids_float": (TypeError, "Documents", lambda: at.attention(
        q0, k0, v0, mask=Documents(torch.zeros(9), torch.zeros(11)))),
    "doc_ids_shape": (ValueError, "Documents", lambda: at.attention(
        q0, k0, v0, mask=Documents(torch.zeros(9, dtype=torch.long),
                                   torch.zeros(9, dtype=torch.long)))),
    "mask_is_tensor": (TypeError, "mask", lambda: at.attention(
        q0, k0, v0, mask=torch.ones(9, 11, dtype=torch.bool))),
    "layout": (ValueError, "layout", lambda: at.attention(q0, k0, v0, layout="sbhd")),
    "backend": (ValueError, "backend", lambda: at.attention(q0, k0, v0, backend="cuda")),
    "precision": (ValueError, "precision", lambda: at.attention(q0, k0, v0, precision="low")),
    "scale": (TypeError, "scale", lambda: at.attention(q0, k0, v0, scale="x")),
    # accepted before: float("0.5") and float(True) took them
    "scale_numeric_str": (TypeError, "scale", lambda: at.attention(q0, k0, v0, scale="0.5")),
    "scale_bool": (TypeError, "scale", lambda: at.attention(q0, k0, v0, scale=True)),
    # accepted before: any truthy value returned (out, lse)
    "return_lse_int": (TypeError, "return_lse", lambda: at.attention(q0, k0, v0,
                                                                     return_lse=1)),
    "return_lse_none": (TypeError, "return_lse", lambda: at.attention(q0, k0, v0,
                                                                      return_lse=None)),
    # accepted before: the generator was silently ignored
    "generator_and_seed": (ValueError, "generator", lambda: at.attention(
        q0, k0, v0, dropout_p=0.1, dropout_seed=3, generator=torch.Generator())),
    "generator_type": (TypeError, "generator", lambda: at.attention(q0, k0, v0,
                                                                    generator=5)),
    "meta_device": (ValueError, "k", lambda: at.attention(q0, k0.to("meta"), v0)),
    "keep_device": (ValueError, "mask", lambda: at.attention(
        q0, k0, v0, mask=KeepMask(torch.ones(9, 11, dtype=torch.bool, device="meta")))),
    "ids_device": (ValueError, "mask", lambda: at.attention(q0, k0, v0, mask=Documents(
        torch.zeros(9, dtype=torch.long, device="meta"),
        torch.zeros(11, dtype=torch.long, device="meta")))),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_names_the_argument(case):
    exc, name, call = BAD[case]
    with pytest.raises(exc) as err:
        call()
    assert str(err.value).startswith(name) or f"{name}:" in str(err.value) or \
        f"{name}=" in str(err.value), str(err.value)


def test_integer_tensor_cannot_ask_for_gradients():
    """torch refuses requires_grad on integer tensors itself; ids and keep masks carry none."""
    with pytest.raises(RuntimeError):
        torch.zeros(3, dtype=torch.long).requires_grad_()
    q = q0.clone().requires_grad_()
    out = at.attention(q, k0, v0, mask=Documents(torch.arange(9) // 3, torch.arange(11) // 4))
    out.sum().backward()
    assert q.grad is not None


def test_unsupported_combination_fails_before_any_work():
    """numpy has no TF32 mode: an explicit backend that cannot serve the call raises."""
    with pytest.raises(NotImplementedError) as err:
        at.attention(q0, k0, v0, backend="numpy", precision="tf32")
    assert "numpy" in str(err.value) and "precision" in str(err.value)


def test_dropout_and_error_classes_of_sdpa():
    with pytest.raises(RuntimeError, match="dropout_p"):        # torch's class
        at.scaled_dot_product_attention(q0, q0, q0, dropout_p=-0.5)
    with pytest.raises(ValueError, match="dropout_p"):          # and anyattn's
        at.scaled_dot_product_attention(q0, q0, q0, dropout_p=1.5)


def test_import_anyattn_does_not_import_torch():
    import anyattn

    src = os.path.dirname(os.path.dirname(os.path.abspath(anyattn.__file__)))
    code = "import sys, anyattn; assert 'torch' not in sys.modules, 'torch imported'"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       env={**os.environ, "PYTHONPATH": src})
    assert r.returncode == 0, r.stderr


def test_numpy_inputs_of_masks_are_accepted():
    out = at.attention(q0, k0, v0, mask=Causal() & KeepMask(np.ones((9, 11), dtype=bool)))
    assert out.shape == q0.shape


def test_subpackage_imports_the_real_torch():
    """``import torch`` inside anyattn/torch/ is absolute: it is PyTorch, not this package."""
    import anyattn.torch.ops as ops

    assert ops.torch is torch and hasattr(ops.torch, "library")
    assert "anyattn" not in torch.__file__


@pytest.mark.parametrize("layout", ["bhsd", "bshd"])
def test_head_dim_zero_is_a_value_error(layout):
    """D = 0 was a ZeroDivisionError from the default scale 1/sqrt(D)."""
    z = torch.zeros(1, 2, 3, 0)
    with pytest.raises(ValueError, match="q: head_dim is 0; expected at least 1"):
        at.attention(z, z, z, layout=layout)
    with pytest.raises(ValueError, match="head_dim is 0"):
        at.attention(z, z, z, scale=1.0)


def test_scale_overflowing_float32_is_a_value_error():
    q = q0.clone().requires_grad_()
    with pytest.raises(ValueError, match=r"scale: 1e\+39 overflows the float32"):
        at.attention(q, k0, v0, scale=1e39, backend="reference")


def test_numpy_integer_offsets_are_accepted():
    """np.int64 offsets reached the op schema (int) unconverted; now operator.index."""
    q = q0.clone().requires_grad_()
    want = at.attention(q0, k0, v0, mask=Causal(), q_offset=2, k_offset=1, backend="reference")
    got = at.attention(q, k0, v0, mask=Causal(), q_offset=np.int64(2), k_offset=np.int32(1),
                       backend="reference")
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    got.sum().backward()
    for bad in (True, 1.5, np.float64(1)):
        with pytest.raises(TypeError, match="q_offset: expected an int"):
            at.attention(q0, k0, v0, q_offset=bad, backend="reference")


def test_host_document_ids_for_a_gpu_call_are_lowered_to_a_cpu_copy():
    """NumPy ids of a call on a GPU stay on the host as a CPU tensor (copied: a view of
    the array would change without a version counter); CPU tensors stay as given."""
    import numpy as np

    from anyattn.torch.lowering import lower

    ids = np.arange(9) // 3
    _, _, qi, ki, _ = lower(Documents(ids), 1, 2, 9, 9, device=torch.device("cuda"))
    assert qi.device.type == "cpu" and qi.shape == (1, 9) and qi.tolist() == [ids.tolist()]
    ids[0] = 7
    assert int(qi[0, 0]) == 0                        # a copy
    t = torch.arange(9) // 3
    _, _, qt, _, _ = lower(Documents(t), 1, 2, 9, 9, device=torch.device("cuda"))
    assert qt.data_ptr() == t.data_ptr()


def test_boolean_tensor_in_and_is_a_keep_mask_term_on_either_side():
    """Causal() & tensor (and tensor & Causal()) was a bare TypeError; now the tensor is a
    KeepMask term, with the bits of the explicit KeepMask composition."""
    m = torch.rand(9, 11, generator=torch.Generator().manual_seed(2)) > 0.4
    want = at.attention(q0, k0, v0, mask=Causal() & KeepMask(m))
    for mask in (Causal() & m, m & Causal()):
        assert torch.equal(at.attention(q0, k0, v0, mask=mask), want)
    for build in (lambda: Causal() & m.float(), lambda: m.long() & Causal()):
        with pytest.raises(TypeError, match=r"dtype torch\.(float32|int64).*KeepMask"):
            build()
    union = at.attention(q0, k0, v0, mask=KeepMask(m | torch.ones(9, 11).tril().bool()))
    for mask in (Causal() | m, m | Causal()):          # | is the union (a mask function)
        torch.testing.assert_close(at.attention(q0, k0, v0, mask=mask), union)


def test_a_lowered_field_the_ops_cannot_carry_is_refused_not_dropped(monkeypatch):
    """A term kind whose fields have no op argument raises instead of vanishing."""
    from anyattn import masks
    from anyattn.torch.lowering import lower

    class Extra(masks.TermKind):
        name, fields = "extra", ("extra",)

        def fold(self, items, acc, ops, q_offset, k_offset):
            return {"extra": items[0] if items else None}

    class ExtraMask(masks.Mask):
        def _lower(self, acc):
            acc.add("extra", 3)

    monkeypatch.setitem(masks.TERM_KINDS, "extra", Extra())
    with pytest.raises(NotImplementedError, match=r"\['extra'\].*torch ops"):
        lower(ExtraMask() & Causal(), 1, 1, 4, 4)
    assert lower(Causal(), 1, 1, 4, 4)[:2] == (None, 0)
