"""Every error path of the public API: raised before any work, naming the argument."""
import numpy as np
import pytest

import anyattn as aa
from anyattn.backends.registry import choose, describe_backends
from anyattn.problem import describe

rng = np.random.default_rng(0)
Q = rng.standard_normal((2, 4, 5, 8)).astype(np.float32)
K = rng.standard_normal((2, 2, 6, 8)).astype(np.float32)
V = rng.standard_normal((2, 2, 6, 8)).astype(np.float32)
G = rng.standard_normal((2, 4, 5, 8)).astype(np.float32)


def call(**kw):
    args = dict(q=Q, k=K, v=V)
    args.update(kw)
    return aa.attention(args.pop("q"), args.pop("k"), args.pop("v"), backend="reference", **args)


@pytest.mark.parametrize("kw, exc, words", [
    (dict(q=Q[0]), ValueError, ["q", "4 dims"]),
    (dict(k=K[:, :, :, :4]), ValueError, ["k", "head_dim"]),
    (dict(v=V[:, :, :5]), ValueError, ["v", "shape"]),
    (dict(k=K[:1], v=V[:1]), ValueError, ["k", "batch"]),
    (dict(k=np.concatenate([K, K[:, :1]], 1), v=np.concatenate([V, V[:, :1]], 1)),
     ValueError, ["heads", "multiple"]),
    (dict(q=Q.astype(np.int32)), TypeError, ["q", "int32"]),
    (dict(k=K.astype(np.float64)), TypeError, ["k", "dtype"]),
    (dict(q=Q.tolist()), TypeError, ["q", "list"]),
    (dict(bias=np.zeros((3, 5, 6), np.float32)), ValueError, ["bias", "broadcast"]),
    (dict(bias=np.zeros((1, 1, 1, 1, 5, 6), np.float32)), ValueError, ["bias", "4 dims"]),
    (dict(bias=np.zeros((5, 6), np.int8)), TypeError, ["bias", "dtype"]),
    (dict(mask=np.ones((5, 6), bool)), TypeError, ["mask", "KeepMask"]),
    (dict(mask=aa.KeepMask(np.ones((4, 6), bool))), ValueError, ["KeepMask", "broadcast"]),
    (dict(scale=float("nan")), ValueError, ["scale"]),
    (dict(scale="big"), TypeError, ["scale"]),
    (dict(precision="fp8"), ValueError, ["precision"]),
    (dict(layout="sbhd"), ValueError, ["layout"]),
])
def test_forward_errors(kw, exc, words):
    with pytest.raises(exc) as ei:
        call(**kw)
    for w in words:
        assert w in str(ei.value), (w, str(ei.value))


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend='cudnn' is unknown"):
        aa.attention(Q, K, V, backend="cudnn")
    with pytest.raises(TypeError, match="backend"):
        aa.attention(Q, K, V, backend=3)


def test_explicit_backend_refusal_explains():
    """An explicit backend that cannot serve raises with its reason (numpy has no tf32)."""
    why = dict(describe_backends())["numpy"]
    if why is not None:
        pytest.skip(f"numpy backend unavailable: {why}")
    p = describe(Q, K, V, precision="tf32")
    with pytest.raises(NotImplementedError, match="numpy.*precision"):
        choose(p, "numpy")


def test_backward_errors():
    with pytest.raises(ValueError, match="wrt"):
        aa.attention_backward(Q, K, V, G, wrt=("x",), backend="reference")
    with pytest.raises(ValueError, match="wrt.*empty"):
        aa.attention_backward(Q, K, V, G, wrt=(), backend="reference")
    with pytest.raises(ValueError, match="bias"):
        aa.attention_backward(Q, K, V, G, wrt=("bias",), backend="reference")
    with pytest.raises(ValueError, match="dout"):
        aa.attention_backward(Q, K, V, G[:, :, :4], backend="reference")
    with pytest.raises(TypeError, match="dout"):
        aa.attention_backward(Q, K, V, None, backend="reference")
    out, lse = aa.attention(Q, K, V, return_lse=True, backend="reference")
    with pytest.raises(ValueError, match="out and lse"):
        aa.attention_backward(Q, K, V, G, out=out, backend="reference")
    with pytest.raises(ValueError, match="lse"):
        aa.attention_backward(Q, K, V, G, out=out, lse=lse[:, :, :3], backend="reference")
    with pytest.raises(TypeError, match="lse"):
        aa.attention_backward(Q, K, V, G, out=out, lse=lse.astype(np.float16),
                              backend="reference")


def test_offsets_must_be_ints():
    with pytest.raises(TypeError, match="q_offset"):
        aa.attention(Q, K, V, q_offset=1.5, backend="reference")


def test_zero_length_inputs_give_empty_or_zero_results():
    q = np.zeros((1, 2, 0, 8), np.float32)
    out, lse = aa.attention(q, K[:1], V[:1], return_lse=True, backend="reference")
    assert out.shape == (1, 2, 0, 8) and lse.shape == (1, 2, 0)
    k0 = np.zeros((1, 2, 0, 8), np.float32)
    out, lse = aa.attention(Q[:1], k0, k0, return_lse=True, backend="reference")
    assert np.all(out == 0) and np.all(lse == -np.inf)
