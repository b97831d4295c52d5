"""Gradients of captures read at one element per score-matrix pair (``t[h, q_idx,
kv_idx]``: capture_reads' "pair" reads) on the portable Triton backward (interpreter on
CPU tensors): the read analysis (which reads are pair reads, the refusal of the others
naming the read, WebGPU's words for a pair read), the gradients against the float64
reference (fp32 and bf16; GQA, Sq != Sk, a causal mask with empty rows, captures larger
than the region read, reads with and without b / h, a b / h index that is not
injective, q_idx and kv_idx in either order, mixed with a diagonal read of another
capture and of the same one), two runs bitwise equal, and anyattn.torch's autograd.
The backward gets out and the row statistics from the NumPy backend and asks for dk
and the captures: the dK/dV launch computes both, so no test pays for the dQ kernel.

Shape legend: B batch, Hq/Hkv heads, Sq/Sk queries/keys, D head dim."""
import re

import numpy as np
import pytest

from tr_util import T, grad_inputs, needs_triton, torch

import anyattn as aa
from anyattn.programs.capture_reads import PAIR, classify, pair_index, refusal
from anyattn.rowstats import RowStats

from helpers import assert_close

pytestmark = needs_triton

B, HQ, HKV, SQ, SK, D = 2, 4, 2, 56, 40, 16


def _inputs(seed, dtype="float32", B=B, Hq=HQ, Hkv=HKV, Sq=SQ, Sk=SK):
    return grad_inputs(seed, B, Hq, Hkv, Sq, Sk, D, dtype)


def _backward(q, k, v, g, wrt, dtype="float32", **kw):
    """attention_backward on Triton, out / statistics from the NumPy backend."""
    td = getattr(torch, dtype)
    out, st = aa.forward_with_stats(q, k, v, backend="numpy", **kw)
    return aa.attention_backward(*(T(x, td) for x in (q, k, v, g)), out=T(out, td),
                                 lse=RowStats(T(st.max), T(st.log_norm)), wrt=wrt,
                                 backend="triton", **kw)


def _reference(q, k, v, g, wrt, **kw):
    sm = kw["score_mod"]
    kw = dict(kw, score_mod=aa.ScoreMod(sm.fn, **{n: x.astype(np.float64)
                                                   for n, x in sm.captures.items()}))
    return aa.attention_backward(*(x.astype(np.float64) for x in (q, k, v, g)), wrt=wrt,
                                 backend="reference", **kw)


def _program(fn, **caps):
    return aa.ScoreMod(fn, **caps).program


# ---------------------------------------------------------------- the read analysis
@pytest.mark.parametrize("fn, shape, want", [
    (lambda s, b, h, i, j, t: s + t[h, i, j], (4, 8, 8), (1, 0, 2, 0, (0,))),
    (lambda s, b, h, i, j, t: s * t[b, h, i, j], (2, 4, 8, 8), (2, 0, 3, 0, (0, 1))),
    (lambda s, b, h, i, j, t: s + t[j + 1, i + 2], (9, 10), (1, 2, 0, 1, ())),
    (lambda s, b, h, i, j, t: s + t[i, h // 2, j - 0], (8, 2, 8), (0, 0, 2, 0, (1,))),
])
def test_reads_of_q_idx_and_kv_idx_each_in_an_index_of_its_own_are_pair_reads(fn, shape,
                                                                                want):
    prog = _program(fn, t=np.zeros(shape, np.float32))
    ((r, kind, why),) = classify(prog, {"t"})
    assert (kind, why) == (PAIR, None)
    p = pair_index(r.node)
    assert (p.q_axis, p.q_const, p.kv_axis, p.kv_const, p.bh_axes) == want


@pytest.mark.parametrize("fn, shape, index", [
    (lambda s, b, h, i, j, t: s + t[i // 2, j], (4, 8),
     r"t\[\(q_idx // 2\), kv_idx\], whose indices \(q_idx // 2\) and kv_idx together "
     r"depend on q_idx and kv_idx otherwise than through q_idx - kv_idx"),
    (lambda s, b, h, i, j, t: s + t[i, i, j], (8, 8, 8),
     r"t\[q_idx, q_idx, kv_idx\], whose indices q_idx and kv_idx together depend"),
    (lambda s, b, h, i, j, t: s + t[i + h, j], (12, 8),
     r"t\[\(q_idx \+ h\), kv_idx\], whose indices \(q_idx \+ h\) and kv_idx together"),
    (lambda s, b, h, i, j, t: s + t[2 * i, j], (15, 8),
     r"t\[\(2 \* q_idx\), kv_idx\], whose indices"),
])
def test_other_reads_of_q_idx_and_kv_idx_stay_refused_naming_the_read(fn, shape, index):
    prog = _program(fn, t=np.zeros(shape, np.float32))
    ((_, kind, _),) = classify(prog, {"t"})
    assert kind is None
    assert re.search(r"capture 't' is read at " + index, refusal(prog, {"t"}))


def test_a_pair_read_beside_a_diagonal_read_is_accepted():
    """capture_reads.refusal (every backward that sums capture reads) accepts a pair read
    next to a diagonal read."""
    prog = _program(lambda s, b, h, i, j, t, w: s + t[h, i, j] + w[h, i - j + 7],
                    t=np.zeros((2, 8, 8), np.float32), w=np.zeros((2, 15), np.float32))
    assert refusal(prog, {"t", "w"}) is None
    assert refusal(prog, {"w"}) is None


# ---------------------------------------------------------------- gradients
#: name -> (function, {capture: shape} of (Hq, Sq, Sk)); every shape at least as large as
#: the region read, most larger
CASES = {
    # per head (summed over the batch), offset and larger than the region read
    "per_head": (lambda s, b, h, i, j, t: s + t[h, i + 1, j],
                 lambda H, Sq, Sk: {"t": (H, Sq + 3, Sk + 2)}),
    # per batch and head: one writer per element
    "per_batch_head": (lambda s, b, h, i, j, t: s * t[b, h, i, j],
                       lambda H, Sq, Sk: {"t": (2, H, Sq, Sk)}),
    # shared by every (b, h), times a per-head weight (a total read)
    "shared_times_head": (lambda s, b, h, i, j, t, w: s + t[i, j] * w[h],
                          lambda H, Sq, Sk: {"t": (Sq, Sk + 1), "w": (H,)}),
    # keys first; heads mapped two to one slice (a b / h index that is not injective)
    "keys_first_head_pairs": (lambda s, b, h, i, j, t: s + t[h // 2, j + 2, i],
                              lambda H, Sq, Sk: {"t": (H // 2, Sk + 2, Sq)}),
    # mixed with a diagonal read of another capture and of the same one
    "with_diagonal_reads": (lambda s, b, h, i, j, t, rel:
                            s + t[h, i, j] * rel[h, i - j + SK - 1]
                            + 0.5 * t[h, 0, i - j + SK - 1],
                            lambda H, Sq, Sk: {"t": (H, Sq, Sq + Sk - 1),
                                               "rel": (H, Sq + Sk - 1)}),
}


def _case(name):
    fn, shapes = CASES[name]
    rng = np.random.default_rng(len(name))
    caps = {n: rng.standard_normal(s).astype(np.float32)
            for n, s in shapes(HQ, SQ, SK).items()}
    return aa.ScoreMod(fn, **caps), caps


@pytest.mark.parametrize("name, dtype", [(n, "float32") for n in CASES]
                         + [("per_head", "bfloat16"), ("with_diagonal_reads", "bfloat16")])
def test_pair_read_gradients_match_the_float64_reference(name, dtype):
    """dk and the capture gradients (the capture's shape and dtype; elements no kept
    pair reads are exact zeros) against the float64 reference: GQA 4 : 2, two batches,
    Sq = 56 > Sk = 40 (not multiples of the tiles, several of each) under a bottom-right
    causal mask (its first 16 query rows are empty)."""
    sm, caps = _case(name)
    q, k, v, g = _inputs(len(name), dtype)
    kw = dict(score_mod=sm, mask=aa.Causal("bottom_right"))
    wrt = ("k",) + tuple(caps)
    gr = _backward(q, k, v, g, wrt, dtype, **kw)
    rg = _reference(q, k, v, g, wrt, **kw)
    assert_close(gr.dk.float().cpu().numpy(), rg.dk, dtype, f"{name} dk")
    for n in caps:
        got = gr.dcaptures[n]
        assert tuple(got.shape) == caps[n].shape and got.dtype == torch.float32
        got = got.cpu().numpy()
        assert_close(got, rg.dcaptures[n], dtype, f"{name} d{n}")
    if name == "per_head":   # no kept pair reads these elements: exact zeros
        i, j = np.meshgrid(np.arange(SQ), np.arange(SK), indexing="ij")
        unread = np.ones(caps["t"].shape, bool)
        unread[:, 1:SQ + 1, :SK] = ~(j <= i - (SQ - SK))
        assert (gr.dcaptures["t"].cpu().numpy()[unread] == 0).all()


def test_pair_read_gradients_alone_with_a_mask_function_and_repeats_bitwise_equal():
    """wrt naming the captures only (the dK/dV launch runs for them), tile lists from a
    mask union with softcap and dropout, a pair read per batch and head and one shared:
    against the reference, and a second run gives the same bits."""
    q, k, v, g = _inputs(5)
    rng = np.random.default_rng(2)
    t = rng.standard_normal((B, HQ, SQ, SK)).astype(np.float32)
    u = rng.standard_normal((SQ, SK)).astype(np.float32)
    sm = aa.ScoreMod(lambda s, b, h, i, j, t, u: s * 0.5 + t[b, h, i, j] - u[i, j] * s,
                     t=t, u=u)
    kw = dict(score_mod=sm, softcap=2.0, dropout_p=0.2, dropout_seed=3,
              mask=aa.Causal() | aa.MaskMod(lambda b, h, i, j: j < 3))
    runs = [_backward(q, k, v, g, ("t", "u"), **kw) for _ in range(2)]
    rg = _reference(q, k, v, g, ("t", "u"), **kw)
    assert runs[0].dk is None and runs[0].dq is None
    for n in ("t", "u"):
        assert_close(runs[0].dcaptures[n].cpu().numpy(), rg.dcaptures[n], "float32", f"d{n}")
        assert torch.equal(runs[0].dcaptures[n], runs[1].dcaptures[n])


def test_pair_slots_past_their_budget_run_per_batch_chunk(monkeypatch):
    """Where the pair reads' slots pass capture_grads.PAIR_SLOT_BYTES, dK/dV runs per batch
    chunk (here one batch each of three, with b-dependent pair, diagonal and column
    reads): dk bit for bit and the capture gradients as without chunks, and as the
    reference."""
    from anyattn.backends.triton import capture_grads

    rng = np.random.default_rng(8)
    sq, sk = 24, 20
    shapes = {"t": (3, HQ, sq, sk), "u": (HQ, sq, sk), "rel": (3, sq + sk - 1),
              "kb": (3, sk)}
    caps = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    sm = aa.ScoreMod(lambda s, b, h, i, j, t, u, rel, kb:
                     s * 0.5 + t[b, h, i, j] - u[h, i, j] * s + rel[b, i - j + sk - 1]
                     + kb[b, j], **caps)
    q, k, v, g = _inputs(9, B=3, Sq=sq, Sk=sk)
    kw = dict(score_mod=sm, mask=aa.Causal("bottom_right"))
    wrt = ("k",) + tuple(caps)
    launches = []
    real = capture_grads.CaptureGrads.scratch

    def scratch(self, bm, bn, b0=0, batches=None):
        launches.append((b0, batches))
        return real(self, bm, bn, b0, batches)
    monkeypatch.setattr(capture_grads.CaptureGrads, "scratch", scratch)
    whole = _backward(q, k, v, g, wrt, **kw)
    assert launches == [(0, 3)]
    monkeypatch.setattr(capture_grads, "PAIR_SLOT_BYTES", 1)
    chunked = _backward(q, k, v, g, wrt, **kw)
    assert launches[1:] == [(0, 1), (1, 1), (2, 1)]
    rg = _reference(q, k, v, g, wrt, **kw)
    assert torch.equal(chunked.dk, whole.dk)
    for n in caps:
        got = chunked.dcaptures[n].cpu().numpy()
        np.testing.assert_allclose(got, whole.dcaptures[n].cpu().numpy(), rtol=1e-6, atol=1e-7)
        assert_close(got, rg.dcaptures[n], "float32", f"d{n}")


def test_the_triton_backward_refuses_a_non_injective_read_before_any_work(monkeypatch):
    """t[q_idx // 2, kv_idx] is refused by the backend choice, naming the capture and its
    read and the forms supported (the pair form among them); no kernel runs."""
    from anyattn.backends.triton import launch

    def no_kernels(*a, **kw):
        raise AssertionError("a kernel launched")

    monkeypatch.setattr(launch, "backward", no_kernels)
    monkeypatch.setattr(launch, "forward", no_kernels)
    q, k, v, g = _inputs(1, Sq=16, Sk=16)
    sm = aa.ScoreMod(lambda s, b, h, i, j, t: s + t[i // 2, j],
                     t=np.zeros((8, 16), np.float32))
    with pytest.raises(NotImplementedError,
                       match=r"indexed by b, h and one of q_idx - kv_idx, q_idx or kv_idx, "
                             r"or by b, h, q_idx and kv_idx with q_idx and kv_idx each an "
                             r"index of its own plus an integer constant "
                             r"\(t\[h, q_idx, kv_idx\]\): capture 't' is read at "
                             r"t\[\(q_idx // 2\), kv_idx\], whose indices \(q_idx // 2\) "
                             r"and kv_idx together depend on q_idx and kv_idx otherwise "
                             r"than through q_idx - kv_idx"):
        aa.attention_backward(*(T(x) for x in (q, k, v, g)), wrt=("q", "t"),
                              backend="triton", score_mod=sm)


def test_torch_autograd_reaches_the_pair_read_gradient():
    """anyattn.torch.attention with backend='triton': a per-head pair table that requires
    grad gets the Triton backward's gradient (the NumPy backend's within fp32's
    tolerance)."""
    import anyattn.torch as at

    S = 16
    q, k, v, _ = (T(x) for x in _inputs(7, B=1, Hq=2, Hkv=1, Sq=S, Sk=S))
    t0 = torch.from_numpy(np.random.default_rng(3).standard_normal((2, S, S))
                          .astype(np.float32))
    grads = {}
    for be in ("triton", "numpy"):
        t = t0.clone().requires_grad_()
        out = at.attention(q, k, v, backend=be, mask=aa.Causal(),
                           score_mod=aa.ScoreMod(lambda s, b, h, i, j, t: s + t[h, i, j], t=t))
        (out * out).sum().backward()
        grads[be] = t.grad
    assert_close(grads["triton"].numpy(), grads["numpy"].double().numpy(), "float32", "dt")
