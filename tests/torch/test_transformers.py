"""attn_implementation="anyattn" in transformers: loss and gradients match "eager" (CPU, fp32).

Tiny models from configs with random weights (nothing is downloaded): Llama with GQA,
Mistral with a sliding window, Qwen2, T5; Gemma 2 (logit soft-capping), Gemma 3 (text,
alternating sliding layers, with and without soft-capping) and gpt-oss (attention sinks,
sliding layers, MoE); padded batches (right and left padding).  The mask builder is
checked against transformers' own ``sdpa_mask``.
"""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
import anyattn.torch.transformers_backend  # noqa: E402,F401  (registers "anyattn")
import anyattn.torch as at  # noqa: E402

from hf_util import assert_structure_equals, dense_masks, rel  # noqa: E402

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             attention_dropout=0.0)


def _configs():
    return {
        "llama": transformers.LlamaConfig(**SMALL),
        "mistral_sliding": transformers.MistralConfig(**SMALL, sliding_window=6),
        "qwen2": transformers.Qwen2Config(**SMALL),
    }


def _pair(cfg, build=None):
    """(eager model, anyattn model) with the same weights; ``build(cfg, attn_implementation=)``
    makes one (default: AutoModelForCausalLM.from_config)."""
    build = build or transformers.AutoModelForCausalLM.from_config
    torch.manual_seed(0)
    eager = build(copy.deepcopy(cfg), attn_implementation="eager")
    ours = build(copy.deepcopy(cfg), attn_implementation="anyattn")
    ours.load_state_dict(eager.state_dict())
    assert ours.config._attn_implementation == "anyattn"
    assert eager.config._attn_implementation == "eager"
    return eager, ours


def _batch(padding):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (3, 21), generator=g)
    am = torch.ones_like(ids)
    if padding == "right":
        am[1, 15:] = 0
        am[2, 9:] = 0
    elif padding == "left":
        am[1, :6] = 0
        am[2, :11] = 0
    # A label is predicted from the previous position: with left padding the first real
    # token is predicted from a pad query, whose row keeps no key (eager then averages
    # every value, anyattn gives 0).  Neither is meaningful, so that label is ignored.
    prev_pad = torch.zeros_like(am)
    prev_pad[:, 1:] = am[:, :-1] == 0
    labels = ids.masked_fill((am == 0) | (prev_pad == 1), -100)
    return dict(input_ids=ids, attention_mask=am, labels=labels)


def _loss_and_grads(model, batch):
    model.zero_grad()
    out = model(**batch)
    out.loss.backward()
    return out.loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()
                               if p.grad is not None}


@pytest.mark.parametrize("arch", ["llama", "mistral_sliding", "qwen2"])
@pytest.mark.parametrize("padding", ["none", "right", "left"])
def test_matches_eager(arch, padding):
    eager, ours = _pair(_configs()[arch])
    batch = _batch(padding)
    le, ge = _loss_and_grads(eager, batch)
    lo, go = _loss_and_grads(ours, batch)
    assert torch.allclose(lo, le, rtol=1e-5, atol=1e-6), (lo.item(), le.item())
    assert ge.keys() == go.keys()
    for name in ge:
        scale = ge[name].abs().max().clamp_min(1e-12)
        err = float((go[name] - ge[name]).abs().max() / scale)
        assert err < 1e-4, f"{name}: relative gradient error {err:.2g}"


def test_generate_runs_with_a_kv_cache():
    """Decoding (Sq = 1 with a cache; the prefill has Sq > 1) gives eager's tokens."""
    eager, ours = _pair(_configs()["llama"])
    ids = torch.randint(0, 97, (2, 7), generator=torch.Generator().manual_seed(2))
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(eager.generate(ids, **kw), ours.generate(ids, **kw))


def test_generate_with_a_static_cache():
    """generate prepares the masks before the forward when the cache is static; the
    prepared StructuredMask passes through the model's own mask call (its ``ndim`` is
    not 2) and decoding gives eager's tokens from a left-padded batch."""
    eager, ours = _pair(_configs()["llama"])
    ids = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(2))
    am = torch.ones_like(ids)
    am[1, :3] = 0
    kw = dict(attention_mask=am, max_new_tokens=4, do_sample=False, pad_token_id=0,
              cache_implementation="static")
    assert torch.equal(eager.generate(ids, **kw), ours.generate(ids, **kw))


def test_bad_dropout_raises():
    from anyattn.torch.transformers_backend import anyattn_attention_forward

    q = torch.randn(1, 2, 4, 8)
    for bad in (1.0, -0.1, "0.1"):
        with pytest.raises(ValueError, match="dropout"):
            anyattn_attention_forward(torch.nn.Module(), q, q, q, None, dropout=bad)


def test_compiles_fullgraph_with_padding():
    """torch.compile(fullgraph=True) of a whole model using attn_implementation="anyattn"."""
    torch._dynamo.reset()
    _, ours = _pair(_configs()["llama"])
    batch = _batch("right")
    ref = ours(**batch)
    ref.loss.backward()
    ref_grad = ours.model.embed_tokens.weight.grad.clone()
    ours.zero_grad()
    out = torch.compile(ours, fullgraph=True)(**batch)
    out.loss.backward()
    assert torch.allclose(out.logits, ref.logits, atol=1e-5)
    assert torch.allclose(ours.model.embed_tokens.weight.grad, ref_grad, atol=1e-5, rtol=1e-4)


# -- every argument honoured or refused (issue 12, item 6) ------------------------------

def test_unknown_arguments_raise_and_known_ones_pass():
    from anyattn.torch.transformers_backend import IGNORED_KWARGS, anyattn_attention_forward

    q = torch.randn(1, 2, 5, 8)
    mod = torch.nn.Module()
    with pytest.raises(NotImplementedError, match=r"^indices=<tensor \(5,\) int64>"):
        anyattn_attention_forward(mod, q, q, q, None, indices=torch.arange(5))
    with pytest.raises(NotImplementedError, match="^output_attentions=True"):
        anyattn_attention_forward(mod, q, q, q, None, output_attentions=True)
    ref, _ = anyattn_attention_forward(mod, q, q, q, None)
    given = {n: torch.arange(5)[None] if n == "position_ids" else True for n in IGNORED_KWARGS}
    out, _ = anyattn_attention_forward(mod, q, q, q, None, dropout=0.0, scaling=None,
                                       softcap=None, s_aux=None, position_bias=None,
                                       sliding_window=None, some_future_flag=None, **given)
    assert torch.equal(out, ref)


def _eager_formula(q, k, v, keep=None, bias=None, scale=None, softcap=None, sinks=None):
    """HF's eager attention: scores (soft-capped: Gemma 2/3) + (0 | finfo.min) (+ bias),
    softmax (with a sink column: gpt-oss), @ v."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = q @ k.transpose(-1, -2) * scale
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if bias is not None:
        s = s + bias
    if keep is not None:
        s = s + torch.zeros_like(s).masked_fill(~keep, torch.finfo(s.dtype).min)
    if sinks is None:
        return (s.softmax(-1) @ v).transpose(1, 2)
    s = torch.cat([s, sinks.reshape(1, -1, 1, 1).expand(*s.shape[:3], 1)], dim=-1)
    return (s.softmax(-1)[..., :-1] @ v).transpose(1, 2)


def _grads(fn, *xs):
    xs = [x.detach().clone().requires_grad_(True) for x in xs]
    out = fn(*xs)
    out.backward(torch.randn(out.shape, generator=torch.Generator().manual_seed(5)))
    return [out.detach()] + [x.grad for x in xs]


def _assert_all_close(got, want, tol=1e-5):
    for g, w in zip(got, want):
        scale = w.abs().max().clamp_min(1e-12)
        assert float((g - w).abs().max() / scale) < tol


@pytest.mark.parametrize("window", [3, 12])
def test_sliding_window_without_a_mask_is_applied(window):
    from anyattn.torch.transformers_backend import anyattn_attention_forward

    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4 if i == 0 else 2, 10, 8, generator=g) for i in range(3))
    i, j = torch.arange(10)[:, None], torch.arange(10)[None]
    keep = (j <= i) & (j > i - window)                       # HF's sliding-window pattern
    got = _grads(lambda a, b, c: anyattn_attention_forward(
        torch.nn.Module(), a, b, c, None, sliding_window=window)[0], q, k, v)
    _assert_all_close(got, _grads(lambda a, b, c: _eager_formula(a, b, c, keep), q, k, v))
    with pytest.raises(NotImplementedError, match="^sliding_window=3"):
        anyattn_attention_forward(torch.nn.Module(), q, k, v, None, is_causal=False,
                                  sliding_window=3)


def test_position_bias_is_added_with_its_gradient():
    """T5-style relative position bias [1, H, Sq, Sk] with a padding mask (bool)."""
    from anyattn.torch.transformers_backend import anyattn_attention_forward

    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(2, 4, 7, 8, generator=g) for _ in range(3))
    pb = torch.randn(1, 4, 7, 7, generator=g)
    keep = torch.ones(2, 1, 7, 7, dtype=torch.bool)
    keep[1, ..., :2] = False
    got = _grads(lambda a, b, c, d: anyattn_attention_forward(
        torch.nn.Module(), a, b, c, keep, scaling=1.0, position_bias=d)[0], q, k, v, pb)
    want = _grads(lambda a, b, c, d: _eager_formula(a, b, c, keep, d, 1.0), q, k, v, pb)
    _assert_all_close(got, want)


def test_packed_sequences_from_cu_seq_lens():
    """cu_seq_lens_q/k (flash-attention packing kwargs) become a Documents mask."""
    from anyattn.torch.transformers_backend import anyattn_attention_forward

    g = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 2, 9, 8, generator=g) for _ in range(3))
    cu = torch.tensor([0, 4, 6, 9], dtype=torch.int32)
    doc = torch.tensor([0, 0, 0, 0, 1, 1, 2, 2, 2])
    keep = (doc[:, None] == doc[None]) & torch.ones(9, 9, dtype=torch.bool).tril()
    got, _ = anyattn_attention_forward(torch.nn.Module(), q, k, v, None, cu_seq_lens_q=cu,
                                       cu_seq_lens_k=cu, max_length_q=4, max_length_k=4)
    _assert_all_close([got], [_eager_formula(q, k, v, keep)])
    with pytest.raises(ValueError, match="cu_seq_lens_q"):
        anyattn_attention_forward(torch.nn.Module(), q, k, v, None, cu_seq_lens_q=cu[:-1])


def test_rows_without_keys_attend_uniformly_like_eager():
    """A bool mask row that keeps no key (a left-pad query) gives eager's uniform average
    of the values and eager's gradients (sdpa gives 0 there)."""
    from anyattn.torch.transformers_backend import anyattn_attention_forward

    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, 2, 6, 8, generator=g) for _ in range(3))
    keep = torch.ones(6, 6, dtype=torch.bool).tril().expand(2, 1, 6, 6).clone()
    keep[1, ..., :3] = False                                  # 3 left pads in batch row 1
    got = _grads(lambda a, b, c: anyattn_attention_forward(
        torch.nn.Module(), a, b, c, keep)[0], q, k, v)
    _assert_all_close(got, _grads(lambda a, b, c: _eager_formula(a, b, c, keep), q, k, v))


@pytest.mark.parametrize("arch", ["llama", "mistral_sliding"])
def test_left_padded_training_step_matches_eager(arch):
    """One training step on a left-padded batch with the usual labels (pads -> -100,
    nothing else dropped: the first real token is predicted from a pad query, whose
    row keeps no key): loss and every gradient as eager's."""
    eager, ours = _pair(_configs()[arch])
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 97, (3, 21), generator=g)
    am = torch.ones_like(ids)
    am[1, :6] = 0
    am[2, :11] = 0
    batch = dict(input_ids=ids, attention_mask=am, labels=ids.masked_fill(am == 0, -100))
    le, ge = _loss_and_grads(eager, batch)
    lo, go = _loss_and_grads(ours, batch)
    assert torch.allclose(lo, le, rtol=1e-5, atol=1e-6), (lo.item(), le.item())
    for name in ge:
        scale = ge[name].abs().max().clamp_min(1e-12)
        err = float((go[name] - ge[name]).abs().max() / scale)
        assert err < 1e-4, f"{name}: relative gradient error {err:.2g}"


def test_t5_position_bias_matches_eager():
    """T5 passes its relative position bias as position_bias (trainable in layer 0)."""
    cfg = transformers.T5Config(vocab_size=97, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                num_heads=4, dropout_rate=0.0, decoder_start_token_id=0,
                                pad_token_id=0)
    eager, ours = _pair(cfg, transformers.T5ForConditionalGeneration._from_config)
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(1, 97, (2, 9), generator=g)
    am = torch.ones_like(ids)
    am[1, 6:] = 0
    batch = dict(input_ids=ids, attention_mask=am,
                 labels=torch.randint(1, 97, (2, 5), generator=g))
    le, ge = _loss_and_grads(eager, batch)
    lo, go = _loss_and_grads(ours, batch)
    assert torch.allclose(lo, le, rtol=1e-5, atol=1e-6), (lo.item(), le.item())
    for name in ge:
        scale = ge[name].abs().max().clamp_min(1e-12)
        assert float((go[name] - ge[name]).abs().max() / scale) < 1e-4, name


# The SDPA drop-in follows the same rule (its own suite is test_sdpa.py): an argument
# torch would reject, or one it does not implement, is refused, never ignored.
@pytest.mark.parametrize("kw, exc, text", [
    (dict(dropout_p=1.0), ValueError, r"dropout_p=1\.0"),     # 0 < p < 1 is honoured
    (dict(dropout_p=float("nan")), ValueError, "dropout_p=nan"),
    (dict(is_causal=1), TypeError, "'is_causal' must be bool"),
    (dict(is_causal=None), TypeError, "'is_causal' must be bool"),
    (dict(enable_gqa=1), TypeError, "'enable_gqa' must be bool"),
])
def test_sdpa_drop_in_refuses_what_it_does_not_honour(kw, exc, text):
    from anyattn.torch import scaled_dot_product_attention

    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(exc, match=text):
        scaled_dot_product_attention(q, q, q, **kw)
    with pytest.raises(TypeError):
        scaled_dot_product_attention(q, q, q, softcap=30.0)   # not an SDPA argument


# -- Gemma 2 / Gemma 3 (softcap) and gpt-oss (sinks); masks as structure ----------------

MODS = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=64, attention_dropout=0.0, sliding_window=4,
            layer_types=["sliding_attention", "full_attention"])


def _modifier_configs():
    # Gemma scales by query_pre_attn_scalar**-0.5; 16 (= head_dim) and Gemma 2's larger
    # initial weights give O(1) scores, where a soft-cap of 2 is far from linear.
    return {
        "gemma2": transformers.Gemma2Config(**MODS, query_pre_attn_scalar=16,
                                            attn_logit_softcapping=2.0, initializer_range=0.2),
        "gemma3": transformers.Gemma3TextConfig(**MODS, query_pre_attn_scalar=16),
        "gemma3_softcap": transformers.Gemma3TextConfig(**MODS, query_pre_attn_scalar=16,
                                                        attn_logit_softcapping=2.0),
        "gpt_oss": transformers.GptOssConfig(**MODS, num_local_experts=4, num_experts_per_tok=2),
    }


def _padded_batch(padding):
    """3 rows of 12 tokens; pads are labelled -100 and nothing else is dropped, so with
    left padding the first real token is predicted from a pad query that keeps no key,
    and with right padding a sliding layer (window 4) has such rows past a short row."""
    g = torch.Generator().manual_seed(11)
    ids = torch.randint(1, 97, (3, 12), generator=g)
    am = torch.ones_like(ids)
    if padding == "right":
        am[1, 9:] = 0
        am[2, 5:] = 0
    else:
        am[1, :3] = 0
        am[2, :7] = 0
    return dict(input_ids=ids, attention_mask=am, labels=ids.masked_fill(am == 0, -100))


def _without(model, arch):
    """A copy of ``model`` without its score modifier (soft-cap off, sinks at -inf)."""
    model = copy.deepcopy(model)
    for mod in model.modules():
        if hasattr(mod, "attn_logit_softcapping"):
            mod.attn_logit_softcapping = None
        if arch == "gpt_oss" and hasattr(mod, "sinks"):
            with torch.no_grad():
                mod.sinks.fill_(float("-inf"))
    return model


@pytest.mark.parametrize("arch", ["gemma2", "gemma3", "gemma3_softcap", "gpt_oss"])
@pytest.mark.parametrize("padding", ["right", "left"])
def test_modifier_models_train_like_eager(arch, padding, masks_seen):
    """One training step: loss, logits (pad positions included) and every parameter
    gradient (gpt-oss's sinks included) as eager's; the masks reach anyattn as structure
    (no KeepMask that varies over queries)."""
    eager, ours = _pair(_modifier_configs()[arch])
    batch = _padded_batch(padding)
    eager.zero_grad()
    out_e = eager(**batch)
    out_e.loss.backward()
    ours.zero_grad()
    out_o = ours(**batch)
    out_o.loss.backward()
    assert rel(out_o.loss, out_e.loss) <= 1e-5, (out_o.loss.item(), out_e.loss.item())
    assert rel(out_o.logits, out_e.logits) <= 1e-5
    grads_e = {n: p.grad for n, p in eager.named_parameters() if p.grad is not None}
    grads_o = {n: p.grad for n, p in ours.named_parameters() if p.grad is not None}
    assert grads_o.keys() == grads_e.keys()
    assert arch != "gpt_oss" or any(n.endswith("sinks") for n in grads_e)
    for name in grads_e:
        err = rel(grads_o[name], grads_e[name])
        assert err <= 1e-4, f"{name}: relative gradient error {err:.2g}"
    assert len(masks_seen) >= 2 and not any(m is not None and dense_masks(m)
                                            for m in masks_seen)
    if arch != "gemma3":
        # the modifier is not negligible here: without it eager's logits move.  Except in
        # Gemma 3: transformers 5.17's Gemma3Attention keeps attn_logit_softcapping but
        # passes no softcap to the attention function, eager's or ours.
        with torch.no_grad():
            plain = _without(eager, arch)(**batch).logits
        assert (rel(plain, out_e.logits) > 1e-2) == (arch != "gemma3_softcap")


@pytest.mark.parametrize("arch", ["gemma2", "gemma3_softcap", "gpt_oss"])
def test_modifier_models_generate_like_eager(arch):
    """Greedy decoding from a left-padded batch past the sliding window (the sliding
    layers' cache drops keys: the mask's key offset moves) gives eager's tokens."""
    eager, ours = _pair(_modifier_configs()[arch])
    ids = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(12))
    am = torch.ones_like(ids)
    am[1, :3] = 0
    kw = dict(attention_mask=am, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(eager.generate(ids, **kw), ours.generate(ids, **kw))


def _hf_cases():
    from transformers import masking_utils as mu

    fns = {"causal": mu.causal_mask_function,
           "sliding4": mu.sliding_window_causal_mask_function(4),
           "bidirectional": mu.bidirectional_mask_function,
           "sliding_bidirectional2": mu.sliding_window_bidirectional_mask_function(2)}
    # (Sq, Sk, q_offset, kv_offset): no cache, decoding, a full sliding cache, chunks
    sizes = [(10, 10, 0, 0), (1, 11, 10, 0), (1, 4, 10, 7), (3, 6, 3, 0), (2, 5, 8, 5)]
    return [(f, pad, size) for f in fns for pad in ("none", "right", "left", "all")
            for size in sizes], fns


@pytest.mark.parametrize("fn, padding, size", _hf_cases()[0])
def test_mask_builder_gives_structure_equal_to_sdpa_mask(fn, padding, size):
    """The "anyattn" mask builder returns structure (no dense tensor) that keeps exactly
    what transformers' sdpa_mask keeps, and lists exactly the rows that keep no key."""
    from transformers import masking_utils as mu

    from anyattn.masks import KeepMask
    from anyattn.torch.transformers_backend import anyattn_mask

    Sq, Sk, qo, ko = size
    B = 3
    am = None
    if padding != "none":
        am = torch.ones(B, max(qo + Sq, ko + Sk), dtype=torch.bool)
        if padding == "right":
            am[1, -3:] = False
            am[2, -7:] = False
        elif padding == "left":
            am[1, :3] = False
            am[2, :7] = False
        else:
            am[2] = False                                  # a row of nothing but pads
    mask_function = _hf_cases()[1][fn]
    got = anyattn_mask(B, Sq, Sk, qo, ko, mask_function=mask_function, attention_mask=am)
    want = mu.sdpa_mask(batch_size=B, q_length=Sq, kv_length=Sk, q_offset=qo, kv_offset=ko,
                        mask_function=mask_function, attention_mask=am,
                        allow_is_causal_skip=False).expand(B, 1, Sq, Sk)
    assert_structure_equals(got, want)
    terms = getattr(got.mask, "terms", (got.mask,))
    padded = am is not None and not bool(am[:, ko:ko + Sk].all())
    assert any(isinstance(t, KeepMask) for t in terms) == padded   # key padding [B,1,1,Sk]


def test_mask_builder_falls_back_to_the_dense_mask_only_where_it_must():
    """A mask function the tracer refuses and a caller that asks for the tensor get
    transformers' dense bool mask, unchanged; packed sequences become Documents."""
    from transformers import masking_utils as mu

    from anyattn.masks import Documents
    from anyattn.torch.transformers_backend import StructuredMask, anyattn_mask

    globals_ = torch.tensor([1, 4])

    def untraceable(batch_idx, head_idx, q_idx, kv_idx):
        return torch.isin(kv_idx, globals_)          # not an elementwise function

    fn = mu.or_masks(mu.causal_mask_function, untraceable)
    got = anyattn_mask(1, 6, 6, mask_function=fn)
    want = mu.sdpa_mask(batch_size=1, q_length=6, kv_length=6, mask_function=fn,
                        allow_is_causal_skip=False)
    assert bool(want[0, 0, 0, 4])
    assert isinstance(got, torch.Tensor) and torch.equal(got, want)
    # the caller asks for the tensor (both skips off: Falcon then adds ALiBi onto it)
    am = torch.tensor([[True] * 6, [False] * 2 + [True] * 4])
    got = anyattn_mask(2, 6, 6, attention_mask=am, allow_is_causal_skip=False)
    want = mu.sdpa_mask(batch_size=2, q_length=6, kv_length=6, attention_mask=am,
                        allow_is_causal_skip=False)
    assert isinstance(got, torch.Tensor) and torch.equal(got, want)
    assert isinstance(anyattn_mask(2, 6, 6, attention_mask=am), StructuredMask)
    # transformers turns the skip off for packed sequences too: they stay structure
    ids = torch.tensor([[0, 0, 1, 1, 1, 2]])
    fn = mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(ids))
    got = anyattn_mask(1, 6, 6, mask_function=fn, allow_is_causal_skip=False)
    assert isinstance(got, StructuredMask)
    assert any(isinstance(t, Documents) for t in got.mask.terms)
    want = mu.sdpa_mask(batch_size=1, q_length=6, kv_length=6, mask_function=fn,
                        allow_is_causal_skip=False)
    assert torch.equal(got.to_dense(), want) and got.empty_rows is None


@pytest.mark.parametrize("dense", [False, True])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_softcap_and_sinks_through_a_structured_mask(with_sinks, dense):
    """anyattn_attention_forward with the builder's mask (sliding window, left padding:
    rows without keys), softcap and s_aux: eager's output and gradients, s_aux's too;
    the same through the dense bool mask (the builder's fallback)."""
    from transformers import masking_utils as mu

    from anyattn.torch.transformers_backend import anyattn_attention_forward, anyattn_mask

    g = torch.Generator().manual_seed(13)
    q = torch.randn(2, 4, 9, 8, generator=g) * 2
    k, v = (torch.randn(2, 2, 9, 8, generator=g) * 2 for _ in range(2))
    sinks = torch.randn(4, generator=g)
    am = torch.ones(2, 9, dtype=torch.bool)
    am[1, :4] = False
    fn = mu.sliding_window_causal_mask_function(3)
    sm = anyattn_mask(2, 9, 9, mask_function=fn, attention_mask=am)
    assert sm.empty_rows is not None
    keep = mu.sdpa_mask(batch_size=2, q_length=9, kv_length=9, mask_function=fn,
                        attention_mask=am, allow_is_causal_skip=False)
    xs = (q, k, v) + ((sinks,) if with_sinks else ())
    given = keep if dense else sm
    got = _grads(lambda a, b, c, *d: anyattn_attention_forward(
        torch.nn.Module(), a, b, c, given, softcap=1.5, s_aux=d[0] if d else None)[0], *xs)
    want = _grads(lambda a, b, c, *d: _eager_formula(
        a, b, c, keep, softcap=1.5, sinks=d[0] if d else None), *xs)
    _assert_all_close(got, want)


def test_packed_position_ids_become_documents(masks_seen):
    """Sequences packed into one row (position_ids restart, no attention mask): the
    mask reaches anyattn as Causal() & Documents, and the step matches eager."""
    from anyattn.masks import Documents

    eager, ours = _pair(_configs()["llama"])
    ids = torch.randint(0, 97, (1, 12), generator=torch.Generator().manual_seed(14))
    pos = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3]])
    batch = dict(input_ids=ids, position_ids=pos, labels=ids, use_cache=False)  # no cache: packed
    le, ge = _loss_and_grads(eager, batch)
    lo, go = _loss_and_grads(ours, batch)
    assert rel(lo, le) <= 1e-5
    for name in ge:
        assert rel(go[name], ge[name]) <= 1e-4, name
    assert masks_seen and all(any(isinstance(t, Documents) for t in m.terms)
                              for m in masks_seen)


# ------------------------------------------------------------------ attention dropout
def _bert(seed=0):
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=64, max_position_embeddings=32,
                     attention_probs_dropout_prob=0.1, hidden_dropout_prob=0.0)
    cfg._attn_implementation = "anyattn"
    torch.manual_seed(seed)
    model = BertForMaskedLM(cfg)
    assert model.config._attn_implementation == "anyattn"
    return model


def _bert_step(model, backend, seed):
    """One training step with dropout on: (loss, {name: grad})."""
    ids = torch.arange(2 * 12).view(2, 12) % 61 + 3
    am = torch.ones(2, 12, dtype=torch.long)
    am[1, 9:] = 0                                     # right padding
    labels = torch.where(am.bool(), ids, torch.full_like(ids, -100))
    model.train()
    model.zero_grad()
    torch.manual_seed(seed)
    with at.use_backend(backend):
        loss = model(input_ids=ids, attention_mask=am, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


def test_bert_trains_with_attention_dropout_and_the_same_mask_on_every_backend():
    """A BERT-style model (attention dropout 0.1) trains one step: torch.manual_seed
    fixes the mask, numpy and the float64 reference draw the same one (same loss and
    gradients), another seed or eval mode gives another loss."""
    model = _bert()
    loss_np, g_np = _bert_step(model, "numpy", 7)
    loss_ref, g_ref = _bert_step(model, "reference", 7)
    again, _ = _bert_step(model, "numpy", 7)
    other, _ = _bert_step(model, "numpy", 8)
    assert torch.isfinite(loss_np) and torch.equal(loss_np, again)
    assert abs(float(loss_np - loss_ref)) <= 1e-5 * abs(float(loss_ref))
    for name, g in g_ref.items():
        scale = float(g.abs().max())
        assert float((g_np[name] - g).abs().max()) <= 1e-4 * max(scale, 1e-6), name
    assert float(loss_np) != float(other)
    model.eval()
    with torch.no_grad():
        ids = torch.arange(24).view(2, 12) % 61 + 3
        no_drop = model(input_ids=ids, labels=ids).loss
    assert float(no_drop) != float(loss_np)


def test_deepseek_v3_mla_value_dim_trains_and_generates_like_eager(monkeypatch):
    """DeepSeek-V3's multi-head latent attention hands the attention function
    q/k of qk_nope_head_dim + qk_rope_head_dim = 24 and v of v_head_dim = 12: one
    training step's loss and gradients and greedy decoding from a left-padded batch
    equal eager's (CPU, through the NumPy backend)."""
    cfg = transformers.DeepseekV3Config(
        vocab_size=97, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, n_group=1,
        topk_group=1, first_k_dense_replace=1, q_lora_rank=None, kv_lora_rank=32,
        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, max_position_embeddings=64,
        attention_dropout=0.0)
    eager, ours = _pair(cfg)
    import anyattn.torch.transformers_backend as tb

    dims = set()
    inner = tb.attention

    def spy(q, k, v, **kw):
        dims.add((q.shape[-1], k.shape[-1], v.shape[-1]))
        return inner(q, k, v, **kw)

    monkeypatch.setattr(tb, "attention", spy)
    batch = _batch("right")
    le, ge = _loss_and_grads(eager, batch)
    lo, go = _loss_and_grads(ours, batch)
    assert dims == {(24, 24, 12)}
    assert torch.allclose(lo, le, rtol=1e-5, atol=1e-6), (lo.item(), le.item())
    assert ge.keys() == go.keys() and len(ge) > 10
    for name in ge:
        scale = ge[name].abs().max().clamp_min(1e-12)
        err = float((go[name] - ge[name]).abs().max() / scale)
        assert err < 1e-4, f"{name}: relative gradient error {err:.2g}"
    ids = torch.randint(1, 97, (2, 7), generator=torch.Generator().manual_seed(12))
    am = torch.ones_like(ids)
    am[1, :3] = 0
    kw = dict(attention_mask=am, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(eager.generate(ids, **kw), ours.generate(ids, **kw))
