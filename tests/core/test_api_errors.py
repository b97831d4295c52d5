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
    (dict(scale="0.5"), TypeError, ["scale", "str"]),       # float("0.5") took it
    (dict(scale=True), TypeError, ["scale", "bool"]),       # float(True) took it
    (dict(scale=np.bool_(True)), TypeError, ["scale", "bool"]),
    (dict(return_lse=1), TypeError, ["return_lse", "bool"]),  # any truthy value took it
    (dict(return_lse=None), TypeError, ["return_lse", "NoneType"]),
    (dict(return_lse="no"), TypeError, ["return_lse", "str"]),
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


# ------------------------------------------------ issue 12, item 5: every input, cheaply
@pytest.mark.parametrize("dtype,scale", [(np.float32, 1e39), (np.float32, -4e38),
                                         (np.float16, 1e39)])
def test_scale_overflowing_the_compute_dtype(dtype, scale):
    """1e39 is a finite Python float but inf in float32: numpy wrote NaN, webgpu raised an
    unnamed OverflowError.  Now a ValueError naming scale, for every backend."""
    q = Q.astype(dtype)
    with pytest.raises(ValueError, match=r"scale: .* overflows the float32"):
        aa.attention(q, K.astype(dtype), V.astype(dtype), scale=scale, backend="reference")
    with pytest.raises(ValueError, match="scale"):
        describe(q, K.astype(dtype), V.astype(dtype), scale=scale)


def test_large_scale_is_fine_in_float64():
    out = aa.attention(Q.astype(np.float64) * 0, K.astype(np.float64), V.astype(np.float64),
                       scale=1e39, backend="reference")
    assert np.isfinite(out).all()


@pytest.mark.parametrize("name", ["q", "k", "v", "bias"])
def test_big_endian_arrays_are_refused_with_a_true_message(name):
    """'>f4' was 'not a floating type' (untrue): now the byte order is named, with the fix."""
    args = dict(q=Q, k=K, v=V, bias=np.zeros((5, 6), np.float32))
    args[name] = args[name].astype(args[name].dtype.newbyteorder(">"))
    with pytest.raises(TypeError, match=rf"{name}: dtype >f4 is float32 in non-native "
                                        r"\(big-endian\) byte order; convert it with"):
        call(**args)


@pytest.mark.parametrize("name", ["q", "k", "v", "bias"])
def test_masked_arrays_are_refused(name):
    """np.ma arrays were accepted and their mask silently ignored."""
    args = dict(q=Q, k=K, v=V, bias=np.zeros((5, 6), np.float32))
    args[name] = np.ma.masked_array(args[name], mask=args[name] > 0.5)
    with pytest.raises(TypeError, match=rf"{name}: is a NumPy masked array; its mask would "
                                        "be ignored"):
        call(**args)


def test_masked_dout_out_lse_and_keep_mask_are_refused():
    out, lse = aa.attention(Q, K, V, return_lse=True, backend="reference")
    for name, kw in (("dout", {}), ("out", dict(out=np.ma.masked_array(out), lse=lse)),
                     ("lse", dict(out=out, lse=np.ma.masked_array(lse)))):
        g = np.ma.masked_array(G) if name == "dout" else G
        with pytest.raises(TypeError, match=f"{name}: is a NumPy masked array"):
            aa.attention_backward(Q, K, V, g, backend="reference", **kw)
    with pytest.raises(TypeError, match="KeepMask.*masked array"):
        aa.KeepMask(np.ma.masked_array(np.ones((5, 6), bool)))


def test_numpy_integer_offsets_are_accepted():
    """q_offset=np.int64(3) was a TypeError; it is an integer (operator.index)."""
    m = aa.Causal()
    want = aa.attention(Q, K, V, mask=m, q_offset=3, k_offset=1, backend="reference")
    got = aa.attention(Q, K, V, mask=m, q_offset=np.int64(3), k_offset=np.uint8(1),
                       backend="reference")
    np.testing.assert_array_equal(got, want)
    for bad in (True, np.float64(2.0), 2.0, "2"):
        with pytest.raises(TypeError, match="q_offset: expected an int"):
            aa.attention(Q, K, V, q_offset=bad, backend="reference")


def test_wrt_none_is_an_error_not_a_silent_no_op():
    """wrt=None returned Gradients of all None; now a TypeError naming wrt and the remedy."""
    with pytest.raises(TypeError, match=r"wrt=None: .*wrt=\('q', 'k', 'v'\)"):
        aa.attention_backward(Q, K, V, G, wrt=None, backend="reference")


@pytest.mark.parametrize("bias_dtype,q_dtype,want", [
    (np.float16, np.float32, "expected float32$"),
    (np.float64, np.float16, "expected q's dtype float16 or float32$"),
])
def test_bias_dtype_message_names_each_alternative_once(bias_dtype, q_dtype, want):
    """It said 'expected q's dtype float32 or float32'."""
    with pytest.raises(TypeError, match=want):
        aa.attention(Q.astype(q_dtype), K.astype(q_dtype), V.astype(q_dtype),
                     bias=np.zeros((5, 6), bias_dtype), backend="reference")


def test_broadcast_messages_name_each_alternative_once():
    """A dim that must be 1 said 'expected 1 or 1'."""
    q, k, v = Q[:1], K[:1], V[:1]
    with pytest.raises(ValueError, match=r"dim -4 is 2, expected 1\)") as ei:
        aa.attention(q, k, v, bias=np.zeros((2, 4, 5, 6), np.float32), backend="reference")
    assert "1 or 1" not in str(ei.value)
    with pytest.raises(ValueError, match=r"dim -4 is 2, expected 1\)"):
        aa.attention(q, k, v, mask=aa.KeepMask(np.ones((2, 1, 5, 6), bool)),
                     backend="reference")
    from anyattn.abi.params import _mask_strides

    with pytest.raises(ValueError, match=r"dim 0 is 2, expected 1 \("):
        _mask_strides((2, 1, 5, 6), (1, 1, 5, 6))


def test_big_endian_document_ids_are_converted():
    """'>i8' ids were refused as 'expected an integer dtype, got >i8' (untrue): ids are
    converted to native byte order (values unchanged; native ids are not copied)."""
    ids = np.array([0, 0, 1, 1, 1, 2])
    d = aa.Documents(ids.astype(">i8"), ids[:6].astype(">i4"))
    assert d.q_ids.dtype.isnative and d.k_ids.dtype.isnative
    np.testing.assert_array_equal(d.q_ids, ids)
    assert aa.Documents(ids).q_ids is ids
    k, v = K[:, :, :6], V[:, :, :6]
    want = aa.attention(Q[:, :, :5], k, v, mask=aa.Documents(ids[:5], ids), backend="reference")
    got = aa.attention(Q[:, :, :5], k, v, mask=aa.Documents(ids[:5].astype(">i4"),
                                                           ids.astype(">i8")),
                       backend="reference")
    np.testing.assert_array_equal(got, want)
    with pytest.raises(TypeError, match="Documents.*masked array"):
        aa.Documents(np.ma.masked_array(ids))


def test_numpy_scalars_stay_accepted_for_scale_and_return_lse():
    want, lse = aa.attention(Q, K, V, scale=0.5, return_lse=True, backend="reference")
    got, lse2 = aa.attention(Q, K, V, scale=np.float32(0.5), return_lse=np.bool_(True),
                             backend="reference")
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(lse2, lse)


# ------------------------------------------------------------- value head dim (Dv != D)
V5 = rng.standard_normal((2, 2, 6, 5)).astype(np.float32)      # Dv = 5, D = 8
G5 = rng.standard_normal((2, 4, 5, 5)).astype(np.float32)


@pytest.mark.parametrize("v, words", [
    (V5[:, :, :4], ["v: shape (2, 2, 4, 5)", "k's (2, 2, 6, 8)", "[2, 2, 6, Dv]"]),
    (V5[:, :1], ["v: shape (2, 1, 6, 5)", "k's (2, 2, 6, 8)", "[B, Hkv, Sk]"]),
    (V5[:1], ["v: shape (1, 2, 6, 5)", "[2, 2, 6, Dv]"]),
    (V5[..., :0], ["v: head_dim is 0", "(2, 2, 6, 0)", "at least 1"]),
])
def test_value_shape_errors_name_both_shapes(v, words):
    """v may differ from k in its head dim only; anything else raises one line naming
    v's and k's shapes, before any work."""
    for fn in (lambda: aa.attention(Q, K, v, backend="numpy"),
               lambda: aa.attention_backward(Q, K, v, G5, backend="numpy")):
        with pytest.raises(ValueError) as ei:
            fn()
        msg = str(ei.value)
        assert "\n" not in msg
        for w in words:
            assert w in msg, (w, msg)


def test_out_and_dout_must_have_the_value_head_dim():
    out, lse = aa.attention(Q, K, V5, return_lse=True, backend="numpy")
    assert out.shape == (2, 4, 5, 5)
    for kw, name in ((dict(dout=G), "dout"), (dict(dout=G5, out=out[..., :4]), "out"),
                     (dict(dout=G5[..., :4]), "dout")):
        d = kw.pop("dout")
        extra = dict(lse=lse) if "out" in kw else {}
        with pytest.raises(ValueError) as ei:
            aa.attention_backward(Q, K, V5, d, backend="numpy", **kw, **extra)
        msg = str(ei.value)
        assert msg.startswith(f"{name}: shape") and "[B, Hq, Sq, Dv] = [2, 4, 5, 5]" in msg \
            and "v (2, 2, 6, 5)" in msg, msg
    g = aa.attention_backward(Q, K, V5, G5, out=out, lse=lse, backend="numpy")
    assert g.dq.shape == Q.shape and g.dk.shape == K.shape and g.dv.shape == V5.shape


def test_value_head_dim_on_empty_problems():
    """Sq = 0 or Sk = 0: out [B, Hq, Sq, Dv] of zeros, gradients of their inputs' shapes."""
    for be in ("numpy", "reference"):
        out, lse = aa.attention(Q[:, :, :0], K, V5, return_lse=True, backend=be)
        assert out.shape == (2, 4, 0, 5) and lse.shape == (2, 4, 0)
        out = aa.attention(Q, K[:, :, :0], V5[:, :, :0], backend=be)
        assert out.shape == (2, 4, 5, 5) and np.all(out == 0)
        g = aa.attention_backward(Q, K[:, :, :0], V5[:, :, :0], G5, backend=be)
        assert g.dv.shape == (2, 2, 0, 5) and g.dq.shape == Q.shape and np.all(g.dq == 0)


def test_value_head_dim_in_torch_errors():
    torch = pytest.importorskip("torch")
    import anyattn.torch as at

    q, k = torch.from_numpy(Q), torch.from_numpy(K)
    with pytest.raises(ValueError, match=r"^v: shape \(2, 2, 4, 5\) does not match k's"):
        at.attention(q, k, torch.from_numpy(V5[:, :, :4]).requires_grad_())
    out = at.attention(q, k, torch.from_numpy(V5))
    assert tuple(out.shape) == (2, 4, 5, 5)
