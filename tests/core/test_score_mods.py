"""Programmable attention in the core: tracing, the graph, its derivatives, index checks,
the float64 reference against independent oracles, and every refusal.

Shape legend: B batch, H heads, Sq/Sk queries/keys, D head dim."""
import math

import numpy as np
import pytest

import anyattn as aa
from anyattn import math as am
from anyattn.masks import TILE_CACHE, resolve
from anyattn.problem import describe
from anyattn.programs.bound import Program
from anyattn.programs.evaluate import evaluate
from anyattn.programs.graph import render
from anyattn.programs.trace import trace

B, H, SQ, SK, D = 2, 3, 11, 13, 8


def _qkv(seed=0, sq=SQ, sk=SK, dt=np.float64):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal(s).astype(dt) for s in
                 ((B, H, sq, D), (B, H, sk, D), (B, H, sk, D), (B, H, sq, D)))


def _grids(sq=SQ, sk=SK):
    return (np.arange(B)[:, None, None, None], np.arange(H)[None, :, None, None],
            np.arange(sq)[None, None, :, None], np.arange(sk)[None, None, None, :])


# ------------------------------------------------------------------- tracing
def test_operators_ufuncs_and_helpers_trace_with_python_dtype_rules():
    t = trace(lambda s, b, h, i, j: s + (i - j) // 2 + (i % 3) / 2 + abs(i - j) ** 2,
              "score_mod")
    assert t.out.dtype == "f"
    assert render(t.out) == ("(((score + tofloat(((q_idx - kv_idx) // 2))) + (tofloat((q_idx % "
                             "3)) / 2.0)) + tofloat((abs((q_idx - kv_idx)) ** 2)))")
    m = trace(lambda b, h, i, j: ~((i < j) | (b == 1)) & np.logical_not(h > 0), "mask_mod")
    assert m.out.dtype == "b"
    f = trace(lambda s, b, h, i, j: np.where(i >= j, np.tanh(s) * am.exp(s), -np.inf)
              + np.clip(s, -1, 1) + am.clamp(s, 0.0) + np.minimum(s, i) + am.sign(s),
              "score_mod")
    assert {"tanh", "exp", "where", "minimum", "maximum", "sign"} <= set(
        n.op for n in __import__("anyattn.programs.graph", fromlist=["x"]).ordered([f.out]))


def test_math_helpers_compute_on_plain_arrays():
    x = np.array([-2.0, 0.5, 3.0])
    np.testing.assert_array_equal(am.clamp(x, -1, 1), [-1, 0.5, 1])
    np.testing.assert_array_equal(am.where(x > 0, x, 0.0), [0, 0.5, 3])
    assert am.tanh(0.0) == 0.0 and am.maximum(2, 3) == 3


def test_equal_functions_share_a_structural_key_and_others_do_not():
    k1 = Program(trace(lambda s, b, h, i, j: s * 2 - (i - j), "score_mod")).key
    k2 = Program(trace(lambda score, bb, hh, q, kv: score * 2 - (q - kv), "score_mod")).key
    k3 = Program(trace(lambda s, b, h, i, j: s * 3 - (i - j), "score_mod")).key
    assert k1 == k2 != k3


def test_closure_and_global_arrays_become_named_captures():
    table = np.arange(6.0).reshape(2, 3)

    def fn(s, b, h, i, j):
        return s + table[h % 2, j % 3] + GLOBAL_TABLE[i % 4]

    sm = aa.ScoreMod(fn)
    assert sorted(sm.captures) == ["GLOBAL_TABLE", "table"]
    assert sm.captures["table"] is table
    assert sm.program.specs["table"].shape == (2, 3)


GLOBAL_TABLE = np.ones(4)


def _doc_factory(ids):
    def same_doc(b, h, i, j):
        return ids[b, i] == ids[b, j]
    return same_doc


def test_arrays_of_functions_a_function_calls_become_captures():
    """A mask function calling helpers built by a factory (closures over arrays, one
    level or two deep, or read as a global) traces them with their arrays as captures;
    one array reached twice is one capture, two arrays of one name get unique names."""
    ids = np.array([[0, 0, 1, 1, 2]])
    other = np.array([[0, 1, 1, 1, 1]])
    same, same_other = _doc_factory(ids), _doc_factory(other)

    def shifted(b, h, i, j):                 # placed by offsets, as a cache does
        return same(b, h, i + 1, j + 1) & same(b, h, i, j)

    m = aa.MaskMod(shifted)
    assert list(m.captures) == ["ids"] and m.captures["ids"] is ids
    want = ids[0, 1:, None] == ids[0, None, 1:]
    want &= ids[0, :4, None] == ids[0, None, :4]
    np.testing.assert_array_equal(resolve(m, 1, 1, 4, 4).dense_keep(1, 1)[0, 0], want)
    outer = (lambda f: lambda b, h, i, j: f(b, h, i, j) | same_other(b, h, i, j))(shifted)
    m2 = aa.MaskMod(outer)
    assert sorted(m2.captures) == ["ids", "ids_1"]
    want2 = want | (other[0, :4, None] == other[0, None, :4])
    np.testing.assert_array_equal(resolve(m2, 1, 1, 4, 4).dense_keep(1, 1)[0, 0], want2)
    g = aa.MaskMod(lambda b, h, i, j: GLOBAL_SAME(b, h, i, j))
    assert list(g.captures) == ["ids"]


GLOBAL_SAME = _doc_factory(np.array([[0, 1, 1, 2]]))


@pytest.mark.parametrize("mode", [None, "floor", "trunc"])
def test_torch_div_with_a_rounding_mode_traces_as_torch_computes_it(mode):
    torch = pytest.importorskip("torch")
    fn = (lambda s, b, h, i, j: s + torch.div(i - j, 3, rounding_mode=mode)
          + torch.div(s - 7.5, 2.0, rounding_mode=mode))
    t = trace(fn, "score_mod")
    i, j = np.arange(-2, 9)[:, None], np.arange(0, 9)[None, :]
    s = np.linspace(-20, 20, 99).reshape(11, 9)
    got, = evaluate([t.out], {"score": s, "b": 0, "h": 0, "q_idx": i, "kv_idx": j}, {},
                    np.dtype(np.float64))
    ti, ts = torch.tensor(i) - torch.tensor(j), torch.tensor(s)
    want = (ts + torch.div(ti.double(), 3, rounding_mode=mode)
            + torch.div(ts - 7.5, 2.0, rounding_mode=mode))
    np.testing.assert_array_equal(got, want.numpy())
    with pytest.raises(TypeError, match=r"rounding_mode='round'\): expected None"):
        trace(lambda s, b, h, i, j: s + torch.div(i, 2, rounding_mode="round"), "score_mod")


def test_a_0d_array_returned_is_a_constant():
    """``lambda *args: torch.tensor(True)`` (a transformers or-mask keeping everything)
    and a 0-d NumPy float from a score function are constants of the right dtype."""
    torch = pytest.importorskip("torch")
    keep_all = (lambda f: lambda b, h, i, j: f(b, h, i, j))(lambda *a: torch.tensor(True))
    assert render(trace(keep_all, "mask_mod").out) == "True"
    assert resolve(aa.Causal() | aa.MaskMod(keep_all), 1, 1, 3, 3).dense_keep(1, 1).all()
    with pytest.raises(TypeError, match="returned a bool expression; a score_mod"):
        trace(lambda s, b, h, i, j: np.array(True), "score_mod")
    assert render(trace(lambda s, b, h, i, j: np.array(2.5), "score_mod").out) == "2.5"


def test_a_tensor_that_is_not_a_capture_indexed_by_a_symbol_is_refused_by_name():
    torch = pytest.importorskip("torch")
    holder = {"t": torch.arange(4)}
    with pytest.raises(TypeError, match="torch tensor that is not a capture indexed by a "
                                        "traced value"):
        aa.MaskMod(lambda b, h, i, j: holder["t"][i] > 0)


def test_captures_bind_by_parameter_name_and_array_defaults():
    t = np.ones(3)
    sm = aa.ScoreMod(lambda s, b, h, i, j, tab, other=t: s + tab[h] + other[h], tab=t * 2)
    assert sorted(sm.captures) == ["other", "tab"]


# ------------------------------------------------------------------ refusals
def _no_if(s, b, h, i, j):
    if i > j:
        return s
    return s - 1.0


def _no_while(s, b, h, i, j):
    while s > 0:
        s = s - 1
    return s


@pytest.mark.parametrize("fn, match", [
    (_no_if, r"score_mod '_no_if': data-dependent Python control flow"),
    (_no_while, r"score_mod '_no_while': data-dependent Python control flow"),
    (lambda s, b, h, i, j: s if bool(i) else s, "data-dependent Python control flow"),
    (lambda s, b, h, i, j: (i > j) and s, "data-dependent Python control flow"),
    (lambda s, b, h, i, j: max(s, 0.0), "data-dependent Python control flow"),
    (lambda s, b, h, i, j: i - j, "returned an integer expression; a score_mod returns "
                                  "a float"),
    (lambda s, b, h, i, j: i > j, "returned a bool expression; a score_mod returns a float"),
    (lambda s, b, h, i, j: (s, s), "returned a tuple"),
    (lambda s, b, h, i, j: np.zeros((2, 2)), r"returned a ndarray of shape \(2, 2\)"),
    (lambda s, b, h, i, j: None, "returned NoneType"),
    (lambda s, b, h, i, j: math.exp(s), r"float\(\) of a traced value"),
    (lambda s, b, h, i, j: np.sort(s), "np.sort is not supported"),
    (lambda s, b, h, i, j: np.arctan2(s, s), "np.arctan2 is not supported"),
    (lambda s, b, h, i, j: np.add.reduce(s), r"np.add.reduce\(...\) is not traced"),
    (lambda s, b, h, i, j: s + np.ones(3), r"an array of shape \(3,\) that is not a capture"),
    (lambda s, b, h, i, j: s.sum(), r"attribute .sum of a traced value"),
    (lambda s, b, h, i, j: s + (1.5 & i), "& of a float expression"),
    (lambda s, b, h: s, r"takes 3 positional argument\(s\); expected 5"),
])
def test_untraceable_score_functions_are_refused_naming_the_construct(fn, match):
    with pytest.raises(TypeError, match=match):
        aa.ScoreMod(fn)


@pytest.mark.parametrize("fn, match", [
    (lambda b, h, i, j: (i - j) * 1.0, "returned a float expression; a mask_mod returns a "
                                       "bool"),
    (lambda b, h, i, j: i - j, "returned an integer expression; a mask_mod returns a bool"),
    (lambda b, h, i, j: i > j if i else i, "data-dependent Python control flow"),
])
def test_untraceable_mask_functions_are_refused(fn, match):
    with pytest.raises(TypeError, match="mask_mod '.*<lambda>': " + match):
        aa.MaskMod(fn)


def test_capture_indexing_refusals_name_the_capture_and_axis():
    t = np.zeros((3, 5))
    for fn, match in [
        (lambda s, b, h, i, j, t: s + t[h, s], r"capture 't' axis 1: float index expression"),
        (lambda s, b, h, i, j, t: s + t[h, i / 2], "axis 1: float index expression"),
        (lambda s, b, h, i, j, t: s + t[h, 1.5], r"axis 1: float or bool index 1.5"),
        (lambda s, b, h, i, j, t: s + t[h], r"indexed with 1 item\(s\); index all 2 axes"),
        (lambda s, b, h, i, j, t: s + t[h, :], "no slices"),
        (lambda s, b, h, i, j, t: s + t, r"capture 't' of shape \(3, 5\) used as a value"),
    ]:
        with pytest.raises(TypeError, match=match):
            aa.ScoreMod(fn, t=t)


def test_capture_parameters_must_match_the_captures():
    t = np.zeros(3)
    with pytest.raises(TypeError, match="parameter 'tab' has no capture"):
        aa.ScoreMod(lambda s, b, h, i, j, tab: s + tab[h])
    with pytest.raises(TypeError, match=r"captures \['other'\] are not parameters"):
        aa.ScoreMod(lambda s, b, h, i, j, tab: s + tab[h], tab=t, other=t)
    with pytest.raises(ValueError, match=r"capture name\(s\) \['bias'\] are reserved"):
        aa.ScoreMod(lambda s, b, h, i, j, bias: s + bias[h], bias=t)
    with pytest.raises(TypeError, match="has dtype complex128; captures are float, integer"):
        aa.ScoreMod(lambda s, b, h, i, j, c: s + c[h], c=np.zeros(3, complex))
    with pytest.raises(TypeError, match="score_mod: expected a function"):
        describe(*_qkv()[:3], score_mod=3)
    with pytest.raises(TypeError, match="a MaskMod goes in mask="):
        describe(*_qkv()[:3], score_mod=aa.MaskMod(lambda b, h, i, j: i >= j))


def test_out_of_bounds_gathers_are_refused_before_any_work():
    q, k, v, _ = _qkv()
    t = np.zeros((H, SQ + SK - 2))                 # one too short for i - j + SK - 1
    sm = aa.ScoreMod(lambda s, b, h, i, j, t: s + t[h, i - j + (SK - 1)], t=t)
    msg = (r"score_mod '[\w.<>]*<lambda>': capture 't' \(shape \(3, 22\)\) axis 1 is indexed by "
           r"\(\(q_idx - kv_idx\) \+ 12\), which takes values in \[0, 22\] over b < 2, "
           r"h < 3, q_idx < 11, kv_idx < 13, outside \[0, 21\]; .*clamp")
    with pytest.raises(ValueError, match=msg):
        describe(q, k, v, score_mod=sm)
    with pytest.raises(ValueError, match=msg):
        aa.attention(q, k, v, score_mod=sm)
    # a clamped index always passes; a gather of an int capture uses its values' range
    ok = aa.ScoreMod(lambda s, b, h, i, j, t: s + t[h, am.clamp(i - j + SK - 1, 0, 21)], t=t)
    describe(q, k, v, score_mod=ok)
    idx = np.array([0, 5, 40])
    bad = aa.ScoreMod(lambda s, b, h, i, j, t, idx: s + t[h, idx[j % 3]], t=t, idx=idx)
    with pytest.raises(ValueError, match=r"capture 't' .* axis 1 .* values in \[0, 40\]"):
        describe(q, k, v, score_mod=bad)
    mm = aa.MaskMod(lambda b, h, i, j, n: j < n[b], n=np.array([3]))   # B = 2
    with pytest.raises(ValueError, match=r"mask_mod '.*<lambda>': capture 'n' .* axis 0 .* "
                                         r"\[0, 1\]"):
        aa.attention(q, k, v, mask=mm)


def test_wrt_names_float_captures_only():
    q, k, v, g = _qkv()
    sm = aa.ScoreMod(lambda s, b, h, i, j, t, n: s + t[h] * n[h], t=np.ones(H),
                     n=np.ones(H, np.int64))
    with pytest.raises(ValueError, match=r"wrt: \['u'\] not understood; expected a subset of "
                                         r"\('q', 'k', 'v', 'bias', 'sinks', 't'\)"):
        aa.attention_backward(q, k, v, g, score_mod=sm, wrt=("q", "u"))
    with pytest.raises(ValueError, match=r"capture\(s\) \['n'\] are not float arrays"):
        aa.attention_backward(q, k, v, g, score_mod=sm, wrt=("n",))


def test_score_mod_with_alibi_is_not_implemented_and_other_devices_are_refused():
    q, k, v, _ = _qkv()
    with pytest.raises(NotImplementedError, match="write the ALiBi term inside the score"):
        aa.attention(q, k, v, score_mod=lambda s, b, h, i, j: s,
                     alibi_slopes=np.ones(H))
    torch = pytest.importorskip("torch")
    t = torch.zeros(H, device="meta")
    with pytest.raises(ValueError, match="capture 't' is on meta but q is on cpu"):
        aa.attention(q, k, v, score_mod=aa.ScoreMod(lambda s, b, h, i, j, t: s + t[h], t=t))


def test_backends_without_a_lowering_refuse_with_the_feature_words():
    from anyattn.backends.registry import get_backend

    q, k, v, _ = _qkv()
    for kw, words in ((dict(score_mod=lambda s, b, h, i, j: s * 2),
                       "does not support score_mod (score functions)"),
                      (dict(mask=aa.MaskMod(lambda b, h, i, j: (i + j) % 2 == 0)),
                       "does not support mask functions (MaskMod, or | of mask terms)"),
                      (dict(mask=aa.Causal() | aa.Window(left=2)),
                       "does not support mask functions")):
        p = describe(q, k, v, **kw)
        # Triton lowers both (its reasons here are only about the NumPy arrays)
        assert not any(words in r for r in get_backend("triton").unsupported_reasons(p))
        for name in ("numpy", "reference"):
            assert get_backend(name).unsupported_reasons(p) == []
        # webgpu lowers the functions (generated WGSL) and the capture gradients of
        # reads at b, h and one of q_idx - kv_idx, q_idx, kv_idx, or of pair reads
        # (t[q_idx, kv_idx]); other reads of both it refuses
        assert not any("score_mod" in r or "mask functions" in r
                       for r in get_backend("webgpu").unsupported_reasons(p))
    for read in (lambda s, b, h, i, j, t: s + t[h, 0],
                 lambda s, b, h, i, j, t: s + t[i, 0],
                 lambda s, b, h, i, j, t: s + t[i, j]):
        sm = aa.ScoreMod(read, t=np.ones((q.shape[2], k.shape[2]), np.float32))
        p = describe(q, k, v, dout=q, wrt=("q", "t"), score_mod=sm)
        assert not any("score_mod" in r for r in get_backend("webgpu").unsupported_reasons(p))
    sm = aa.ScoreMod(lambda s, b, h, i, j, t: s + t[i // 2, j],
                     t=np.ones((q.shape[2], k.shape[2]), np.float32))
    p = describe(q, k, v, dout=q, wrt=("q", "t"), score_mod=sm)
    assert any("computes the gradient of a score_mod capture only where each read of it "
               "is indexed by b, h and one of q_idx - kv_idx, q_idx or kv_idx" in r
               for r in get_backend("webgpu").unsupported_reasons(p))


# ----------------------------------------------------------- derivatives
_UNARY = {"exp": np.exp, "exp2": np.exp2, "log": np.log, "log2": np.log2,
          "log1p": np.log1p, "expm1": np.expm1, "tanh": np.tanh, "sqrt": np.sqrt,
          "square": np.square, "sin": np.sin, "cos": np.cos, "abs": np.abs}


@pytest.mark.parametrize("name", sorted(_UNARY))
def test_every_derivative_rule_matches_central_differences(name):
    """d/ds of f(s)·s / 3 + min / max / where / pow / div of s: the symbolic derivative at
    points away from kinks agrees with central differences in float64."""
    f = _UNARY[name]
    fn = (lambda s, b, h, i, j: f(s) * s / 3.0 + np.maximum(s, 1.1) - np.minimum(s, 0.7)
          + am.where(s > 2.0, s * s, s) + s ** 1.5 + 2.0 ** s)
    prog = Program(trace(fn, "score_mod"))
    dsc, _ = prog.grad_nodes(frozenset())
    x = np.array([0.3, 0.9, 1.3, 2.7])
    dt = np.dtype(np.float64)
    env = {"b": 0, "h": 0, "q_idx": 0, "kv_idx": 0}
    got, = evaluate([dsc], dict(env, score=x), {}, dt)
    e = 1e-6
    hi, = evaluate([prog.out], dict(env, score=x + e), {}, dt)
    lo, = evaluate([prog.out], dict(env, score=x - e), {}, dt)
    np.testing.assert_allclose(got, (hi - lo) / (2 * e), rtol=1e-6)


def test_reference_matches_torch_autograd_with_capture_gradients():
    """rel-pos table and a per-head temperature used through tanh, causal, Sq != Sk,
    float64: out and every gradient, the capture ones included, to 1e-12."""
    torch = pytest.importorskip("torch")
    q, k, v, g = _qkv(1)
    rng = np.random.default_rng(2)
    tab = rng.standard_normal((H, SQ + SK - 1))
    temp = rng.standard_normal(H)

    def fn(s, b, h, i, j, tab, temp):
        return s * temp[h] + tab[h, i - j + SK - 1] * np.tanh(s) - 0.5 * am.square(s)

    sm = aa.ScoreMod(fn, tab=tab, temp=temp)
    kw = dict(score_mod=sm, mask=aa.Causal("bottom_right"), backend="reference")
    out = aa.attention(q, k, v, **kw)
    gr = aa.attention_backward(q, k, v, g, wrt=("q", "k", "v", "tab", "temp"), **kw)
    tq, tk, tv, tt, tp = (torch.tensor(x, requires_grad=True) for x in (q, k, v, tab, temp))
    s = tq @ tk.transpose(-1, -2) / math.sqrt(D)
    i, j = torch.arange(SQ)[:, None], torch.arange(SK)[None, :]
    s = s * tp[None, :, None, None] + tt[:, i - j + SK - 1] * torch.tanh(s) - 0.5 * s * s
    s = s.masked_fill(j > i + SK - SQ, -torch.inf)
    ref = torch.softmax(s, -1) @ tv
    ref.backward(torch.tensor(g))
    np.testing.assert_allclose(out, ref.detach().numpy(), atol=1e-12)
    for mine, theirs in ((gr.dq, tq), (gr.dk, tk), (gr.dv, tv), (gr.dcaptures["tab"], tt),
                         (gr.dcaptures["temp"], tp)):
        np.testing.assert_allclose(mine, theirs.grad.numpy(), atol=1e-11)


def test_reference_score_function_equals_its_dense_bias():
    """A score function that adds f(b, h, i, j) gives the reference's result with the
    dense bias f evaluated by NumPy itself (the function runs on plain arrays too)."""
    q, k, v, g = _qkv(3)
    tab = np.random.default_rng(4).standard_normal((B, H, 7))

    def fn(s, b, h, i, j, tab):
        return s + tab[b, h, (i * 3 + j) % 7] - am.sqrt(am.abs(i - j) * 1.0)

    bias = fn(0.0, *_grids(), tab)
    sm = aa.ScoreMod(fn, tab=tab)
    kw = dict(backend="reference", mask=aa.Causal())
    np.testing.assert_allclose(aa.attention(q, k, v, score_mod=sm, **kw),
                               aa.attention(q, k, v, bias=bias, **kw), atol=1e-13)
    a = aa.attention_backward(q, k, v, g, score_mod=sm, wrt=("q", "k", "tab"), **kw)
    b_ = aa.attention_backward(q, k, v, g, bias=bias, wrt=("q", "k", "bias"), **kw)
    np.testing.assert_allclose(a.dq, b_.dq, atol=1e-13)
    want = np.zeros_like(tab)                      # dbias scattered by hand
    bi, hi, ii, ji = np.broadcast_arrays(*_grids())
    np.add.at(want, (bi, hi, (ii * 3 + ji) % 7), b_.dbias)
    np.testing.assert_allclose(a.dcaptures["tab"], want, atol=1e-13)


# ------------------------------------------------------------------- masks
@pytest.mark.parametrize("case", ["prefix_or_causal", "modulo_and_window", "keep_or_docs"])
def test_mask_functions_and_unions_equal_their_dense_keep(case):
    rng = np.random.default_rng(5)
    q, k, v, g = _qkv(6)
    b, h, i, j = _grids()
    if case == "prefix_or_causal":
        pre = np.array([2, 9])
        mask = aa.Causal() | aa.MaskMod(lambda b, h, i, j, pre: j < pre[b], pre=pre)
        dense = (j <= i) | (j < pre[b])
    elif case == "modulo_and_window":
        mask = aa.MaskMod(lambda b, h, i, j: (i + j + h) % 3 != 0) & aa.Window(left=4)
        dense = ((i + j + h) % 3 != 0) & (i - j <= 4)
    else:
        keep = rng.random((SQ, SK)) < 0.3
        ids_q, ids_k = np.sort(rng.integers(0, 3, (B, SQ))), np.sort(rng.integers(0, 3, SK))
        mask = aa.KeepMask(keep) | aa.Documents(ids_q, ids_k)
        dense = keep | (ids_q[:, None, :, None] == ids_k[None, None, None, :])
    dense = np.broadcast_to(dense, (B, H, SQ, SK))
    kw = dict(backend="reference")
    np.testing.assert_allclose(aa.attention(q, k, v, mask=mask, **kw),
                               aa.attention(q, k, v, mask=aa.KeepMask(dense), **kw),
                               atol=1e-14)
    rm = resolve(mask, B, H, SQ, SK)
    np.testing.assert_array_equal(np.broadcast_to(rm.dense_keep(B, H), dense.shape), dense)
    ref_map = resolve(aa.KeepMask(dense), B, H, SQ, SK).tile_map(4, 5)
    got = np.broadcast_to(rm.tile_map(4, 5), ref_map.shape)
    if len(rm.terms) == 1:                          # one function term: exact
        np.testing.assert_array_equal(got, ref_map)
    else:                                           # terms ANDed per tile: never wrong
        assert ((got != 0) | (ref_map == 0)).all() and ((got != 2) | (ref_map == 2)).all()


def test_mask_tile_maps_are_cached_by_content():
    ids = np.array([0, 0, 1, 1, 1, 2, 2, 2, 2, 3, 3])

    def same(b, h, i, j, ids):
        return ids[i] == ids[j]

    TILE_CACHE.clear()
    resolve(aa.MaskMod(same, ids=ids), 1, 1, 11, 11).tile_map(4, 4)
    assert (TILE_CACHE.builds, TILE_CACHE.hits) == (1, 0)
    resolve(aa.MaskMod(same, ids=ids.copy()), 1, 1, 11, 11).tile_map(4, 4)  # same content
    assert (TILE_CACHE.builds, TILE_CACHE.hits) == (1, 1)
    resolve(aa.MaskMod(same, ids=ids[::-1].copy()), 1, 1, 11, 11).tile_map(4, 4)
    assert TILE_CACHE.builds == 2


def test_union_with_bad_array_terms_names_the_term():
    with pytest.raises(ValueError, match=r"KeepMask\(mask=...\): shape \(4, 4\) does not "
                                         "broadcast"):
        resolve(aa.Causal() | aa.KeepMask(np.ones((4, 4), bool)), 1, 1, 5, 5)
    with pytest.raises(ValueError, match=r"Documents\(q_ids=...\): shape \(1, 4\) does not fit"):
        resolve(aa.Causal() | aa.Documents(np.zeros(4, int)), 1, 1, 5, 5)


def test_torch_functions_trace_and_unknown_ones_are_refused():
    torch = pytest.importorskip("torch")
    t = trace(lambda s, b, h, i, j: torch.where(i >= j, torch.clamp(s, min=-3.0),
                                                torch.tanh(s) * torch.exp(s)), "score_mod")
    assert render(t.out) == "where((q_idx >= kv_idx), maximum(score, -3.0), (tanh(score) * " \
                            "exp(score)))"
    with pytest.raises(TypeError, match="torch.softmax is not supported"):
        aa.ScoreMod(lambda s, b, h, i, j: torch.softmax(s, 0))


def _random_expr(rng, depth):
    """A random expression builder over (s, b, h, i, j): a function that works on traced
    values and on NumPy arrays alike, float-valued."""
    if depth == 0:
        leaf = int(rng.integers(0, 6))
        c = float(rng.integers(-3, 4)) / 2
        return [lambda s, b, h, i, j: s, lambda s, b, h, i, j: i * 1.0,
                lambda s, b, h, i, j: (j - i) * 0.5, lambda s, b, h, i, j: h + c,
                lambda s, b, h, i, j: (i // (h + 1)) % 3 - b,
                lambda s, b, h, i, j: s * c][leaf]
    x, y = _random_expr(rng, depth - 1), _random_expr(rng, depth - 1)
    op = int(rng.integers(0, 11))
    return [lambda *a: x(*a) + y(*a), lambda *a: x(*a) - y(*a), lambda *a: x(*a) * y(*a),
            lambda *a: x(*a) / (abs(y(*a)) + 1.0), lambda *a: x(*a) // (abs(y(*a)) + 1.0),
            lambda *a: x(*a) % (abs(y(*a)) + 1.5), lambda *a: np.tanh(x(*a)) - abs(y(*a)),
            lambda *a: np.where((x(*a) > y(*a)) | (a[3] < a[4]), x(*a), y(*a)),
            lambda *a: np.minimum(x(*a), y(*a)) + np.maximum(x(*a), -y(*a)),
            lambda *a: am.clamp(x(*a), -2.0, 2.0) * np.exp(am.clamp(y(*a), -3.0, 3.0)),
            lambda *a: am.where(~(x(*a) >= 0.5) & (a[1] == 0), -x(*a), am.sqrt(abs(y(*a))))
            ][op]


@pytest.mark.parametrize("seed", range(40))
def test_random_expressions_evaluate_as_numpy_computes_them(seed):
    """The traced graph, evaluated in float64, equals the same function run by NumPy on
    the index arrays (dtype rules, floor division, modulo, where / min / max)."""
    rng = np.random.default_rng(seed)
    body = _random_expr(rng, 3)
    sm = aa.ScoreMod(lambda s, b, h, i, j: body(s, b, h, i, j) + s * 0.0)
    s = np.random.default_rng(seed + 100).standard_normal((B, H, SQ, SK))
    want = np.broadcast_to(body(s, *_grids()) + s * 0.0, s.shape)
    got = sm.bind((B, H, SQ, SK)).score_dense(s)
    np.testing.assert_allclose(got, want, rtol=1e-13, atol=1e-13)


def test_t5_buckets_computed_in_the_function_equal_a_bucket_capture():
    """T5's log buckets written with anyattn.math (log, to_int, clamp) give the bucket
    table's result; without the clamp the float-derived index is refused."""
    n_buckets, max_d, exact = 8, 32, 2
    table = np.random.default_rng(7).standard_normal((H, n_buckets))

    def bucket_of(rel):                          # rel = kv_idx - q_idx, works on arrays too
        n = abs(rel)
        big = exact + am.to_int(am.log(am.maximum(n, 1) / exact) / math.log(max_d / exact)
                                * (n_buckets // 2 - exact))
        small = am.where(n < exact, n, am.minimum(big, n_buckets // 2 - 1))
        return am.clamp(small + am.where(rel > 0, n_buckets // 2, 0), 0, n_buckets - 1)

    rel = np.arange(-(SQ - 1), SK)
    buckets = bucket_of(rel)
    fn_in = aa.ScoreMod(lambda s, b, h, i, j, table: s + table[h, bucket_of(j - i)],
                        table=table)
    fn_cap = aa.ScoreMod(lambda s, b, h, i, j, table, bk: s + table[h, bk[j - i + SQ - 1]],
                         table=table, bk=buckets)
    q, k, v, g = _qkv(8)
    kw = dict(backend="reference", wrt=("q", "table"))
    a = aa.attention_backward(q, k, v, g, score_mod=fn_in, **kw)
    c = aa.attention_backward(q, k, v, g, score_mod=fn_cap, **kw)
    np.testing.assert_allclose(a.dq, c.dq, atol=1e-14)
    np.testing.assert_allclose(a.dcaptures["table"], c.dcaptures["table"], atol=1e-14)
    unclamped = aa.ScoreMod(lambda s, b, h, i, j, table:
                            s + table[h, am.to_int(am.log((abs(j - i) + 1) * 1.0))],
                            table=table)
    with pytest.raises(ValueError, match=r"axis 1 .* values in \[-inf, inf\]"):
        describe(q, k, v, score_mod=unclamped)


def test_index_arithmetic_is_int32_only_where_every_value_fits():
    small = aa.ScoreMod(lambda s, b, h, i, j: s + (i - j) * 1.0).bind((B, H, SQ, SK))
    assert small.idt == np.int32
    big = 3_000_000_000
    wide = aa.ScoreMod(lambda s, b, h, i, j: s + ((i * big + j) % 7) * 1.0)
    bound = wide.bind((B, H, SQ, SK))
    assert bound.idt == np.int64
    q, k, v, g = _qkv(9)
    i, j = _grids()[2:]
    want = aa.attention(q, k, v, bias=((i * big + j) % 7) * 1.0, backend="reference")
    for be in ("reference", "numpy"):
        np.testing.assert_allclose(aa.attention(q, k, v, score_mod=wide, backend=be), want,
                                   atol=1e-12)


@pytest.mark.parametrize("fn, terms, lo, hi", [
    (lambda b, h, i, j: j <= i, ("band",), None, 0),
    (lambda b, h, i, j: (j <= i) & (i - j <= 8), ("band",), -8, 0),
    (lambda b, h, i, j: abs(i - j) < 3, ("band",), -2, 2),
    (lambda b, h, i, j: j == i + 3, ("band",), 3, 3),
    (lambda b, h, i, j: i > j, ("band",), None, -1),
    (lambda b, h, i, j: (j - 1 >= i - 4) & (i % 2 == 0), ("band", "mask_mod"), -3, None),
    (lambda b, h, i, j: 2 * j - i <= 0, ("mask_mod",), None, None),
    (lambda b, h, i, j: (j <= i) | (j < 2), ("mask_mod",), None, None),
])
def test_band_shaped_conjuncts_of_a_mask_function_lower_to_the_band(fn, terms, lo, hi):
    """Conjuncts comparing kv_idx - q_idx with a constant become the band term (the
    built-ins' tile ranges); the indices stay local whatever the offsets."""
    rm = resolve(aa.MaskMod(fn), B, H, SQ, SK, q_offset=5, k_offset=2)
    assert rm.terms == terms and (rm.band_lo, rm.band_hi) == (lo, hi)
    want = np.broadcast_to(fn(*_grids()), (B, H, SQ, SK))
    np.testing.assert_array_equal(np.broadcast_to(rm.dense_keep(B, H), want.shape), want)


def test_a_mask_function_spelling_causal_is_causal():
    q, k, v, g = _qkv(11)
    assert resolve(aa.MaskMod(lambda b, h, i, j: j <= i), B, H, SQ, SK).terms == ("band",)
    np.testing.assert_array_equal(
        aa.attention(q, k, v, mask=aa.MaskMod(lambda b, h, i, j: j <= i)),
        aa.attention(q, k, v, mask=aa.Causal()))


_IDS = np.sort(np.random.default_rng(5).integers(0, 3, size=(B, max(SQ, SK) + 4)), axis=1)


@pytest.mark.parametrize("fn, ids, terms", [
    (lambda b, h, i, j, d: d[b, i] == d[b, j], _IDS, ("documents",)),
    (lambda b, h, i, j, d: d[j] == d[i], _IDS[0], ("documents",)),      # either side first
    (lambda b, h, i, j, d: (d[b, i] == d[b, j]) & (j <= i) & ((i + j) % 3 != 0), _IDS,
     ("band", "documents", "mask_mod")),
    # not the Documents term: ids too short for the problem (the function checks its
    # reads), float ids, ids of different rows, a shifted read
    (lambda b, h, i, j, d: d[b, i] == d[b, j], _IDS[:, :SQ - 1], None),
    (lambda b, h, i, j, d: d[i] == d[j], _IDS[0].astype(np.float32), ("mask_mod",)),
    (lambda b, h, i, j, d: d[0, i] == d[b, j], _IDS, ("mask_mod",)),
    (lambda b, h, i, j, d: d[b, i] == d[b, j + 1], _IDS, ("mask_mod",)),
])
def test_a_mask_function_comparing_ids_lowers_to_documents(fn, ids, terms):
    """``ids[q_idx] == ids[kv_idx]`` (or with ``b`` first) of one integer capture is the
    Documents term of those ids, cut to the problem's lengths; the rest of the function
    stays (bands to the band term); where the ids do not fit, the function runs and
    reports its out-of-bounds read."""
    m = aa.MaskMod(fn, d=ids)
    if terms is None:
        with pytest.raises(ValueError, match="capture 'd'"):
            resolve(m, B, H, SQ, SK)
        return
    rm = resolve(m, B, H, SQ, SK, q_offset=5, k_offset=2)
    assert rm.terms == terms
    i, j = _grids()[2:]
    b = np.arange(B)[:, None, None, None]
    d = ids if ids.ndim == 2 else ids[None]
    want = np.broadcast_to(fn(b, 0, i, j, d if ids.ndim == 2 else ids), (B, H, SQ, SK))
    np.testing.assert_array_equal(np.broadcast_to(rm.dense_keep(B, H), want.shape), want)
    if terms == ("documents",):
        q, k, v, g = _qkv(13)
        np.testing.assert_array_equal(
            aa.attention(q, k, v, mask=m, backend="numpy"),
            aa.attention(q, k, v, backend="numpy",
                         mask=aa.Documents(d[:, :SQ], d[:, :SK])))


@pytest.mark.parametrize("fn, terms", [
    (lambda b, h, i, j: (i // 4 == j // 4) & (j <= i), ("band", "documents")),  # Llama 4
    (lambda b, h, i, j: j // 3 == i // 3, ("documents",)),                # either side first
    # not the Documents term: different chunks, a shifted index, a zero or negative chunk
    (lambda b, h, i, j: i // 4 == j // 2, ("mask_mod",)),
    (lambda b, h, i, j: (i + 1) // 4 == j // 4, ("mask_mod",)),
    (lambda b, h, i, j: i // -4 == j // -4, ("mask_mod",)),
])
def test_a_mask_function_comparing_chunks_lowers_to_documents(fn, terms):
    """``q_idx // C == kv_idx // C`` (C a positive integer constant) is the Documents
    term of the ids ``pos // C``, made for the problem's Sq and Sk (local indices)."""
    m = aa.MaskMod(fn)
    rm = resolve(m, B, H, SQ, SK, q_offset=5, k_offset=2)
    assert rm.terms == terms
    want = np.broadcast_to(fn(*_grids()), (B, H, SQ, SK))
    np.testing.assert_array_equal(np.broadcast_to(rm.dense_keep(B, H), want.shape), want)
    if "documents" in terms:
        q, k, v, g = _qkv(17)
        np.testing.assert_array_equal(
            aa.attention(q, k, v, mask=m, backend="numpy"),
            aa.attention(q, k, v, backend="numpy",
                         mask=aa.MaskMod(lambda b, h, i, j: fn(b, h, i, j) | (i < 0))))


def _float32_qkv(Sq=16, Sk=16):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((1, 2, Sq, 8)).astype(np.float32)
    k = rng.standard_normal((1, 2, Sk, 8)).astype(np.float32)
    return q, k, k.copy()


def test_describe_runs_a_spelled_softcap_as_the_builtin_on_every_backend():
    q, k, v = _float32_qkv()
    p = describe(q, k, v, score_mod=lambda s, b, h, i, j: 30.0 * np.tanh(s / 30.0))
    assert p.score_mod is None and p.softcap == 30.0
    assert "score_mod" not in p.features and "softcap" in p.features
    # not where a softcap is set: the function applies after it
    p = describe(q, k, v, softcap=5.0,
                 score_mod=lambda s, b, h, i, j: 30.0 * np.tanh(s / 30.0))
    assert p.score_mod is not None and p.softcap == 5.0
    # a near miss stays a function
    p = describe(q, k, v, score_mod=lambda s, b, h, i, j: 30.0 * np.tanh(s / 20.0))
    assert p.score_mod is not None and p.softcap is None


def test_describe_moves_a_where_band_into_the_mask_band_term():
    q, k, v = _float32_qkv(12, 20)
    p = describe(q, k, v, score_mod=lambda s, b, h, i, j: np.where(j <= i, s * 2.0, -np.inf))
    assert (p.mask.band_lo, p.mask.band_hi) == (None, 0)
    assert p.score_mod is not None and "band" in p.features
    ref = aa.attention(q, k, v, mask=aa.Causal(), score_mod=lambda s, b, h, i, j: s * 2.0,
                       backend="numpy")
    got = aa.attention(q, k, v, score_mod=lambda s, b, h, i, j: np.where(j <= i, s * 2.0,
                                                                      -np.inf),
                       backend="numpy")
    np.testing.assert_array_equal(got, ref)
    # the band meets the mask's own band (a window inside a causal mask): both hold
    p = describe(q, k, v, mask=aa.Causal(),
                 score_mod=lambda s, b, h, i, j: np.where(j >= i - 3, s, -np.inf))
    assert (p.mask.band_lo, p.mask.band_hi) == (-3, 0) and p.score_mod is None


def test_describe_runs_a_spelled_alibi_as_the_builtin_unless_its_slopes_want_a_gradient():
    q, k, v = _float32_qkv()
    slopes = np.array([0.5, 0.25], np.float64)

    def alibi(s, b, h, i, j, slopes):
        return s - slopes[h] * abs(i - j)

    p = describe(q, k, v, mask=aa.Causal(), score_mod=aa.ScoreMod(alibi, slopes=slopes))
    assert p.score_mod is None and p.alibi_shape == (1, 2) and "alibi" in p.features
    assert p.matched_alibi.dtype == np.float32
    np.testing.assert_array_equal(p.matched_alibi, slopes[None].astype(np.float32))
    got = aa.attention(q, k, v, mask=aa.Causal(), score_mod=aa.ScoreMod(alibi, slopes=slopes),
                       backend="numpy")
    want = aa.attention(q, k, v, mask=aa.Causal(), alibi_slopes=slopes.astype(np.float32),
                        backend="numpy")
    np.testing.assert_array_equal(got, want)
    # the slopes' gradient: the built-in has none, the function stays
    g = np.ones_like(q)
    p = describe(q, k, v, dout=g, wrt=("q", "slopes"),
                 score_mod=aa.ScoreMod(alibi, slopes=slopes))
    assert p.score_mod is not None and p.matched_alibi is None
    # another diagonal (Sq != Sk: the built-in is bottom-right aligned) stays a function
    q2 = q[:, :, :10]
    p = describe(q2, k, v, score_mod=aa.ScoreMod(alibi, slopes=slopes))
    assert p.score_mod is not None and p.matched_alibi is None


def test_a_spelled_alibi_on_torch_tensors_gets_its_slopes_as_a_tensor():
    torch = pytest.importorskip("torch")
    q, k, v = (torch.from_numpy(x) for x in _float32_qkv())
    slopes = torch.tensor([0.5, 0.25])
    p = describe(q, k, v, score_mod=aa.ScoreMod(
        lambda s, b, h, i, j, sl: s - sl[h] * abs(i - j), sl=slopes))
    assert isinstance(p.matched_alibi, torch.Tensor) and p.matched_alibi.shape == (1, 2)
    got = aa.attention(q, k, v, score_mod=aa.ScoreMod(
        lambda s, b, h, i, j, sl: s - sl[h] * abs(i - j), sl=slopes), backend="numpy")
    want = aa.attention(q, k, v, alibi_slopes=slopes, backend="numpy")
    assert torch.equal(got, want)
