"""transformers' composed mask functions reach anyattn as structure, never a dense mask.

Tiny random-weight models against "eager" (CPU, fp32; one training step's loss and
gradients, greedy generate): Llama 4 (chunked attention, ``chunked_causal_mask_function``
with left padding), Gemma 3 with image tokens (``token_type_ids``: ``or_masks(causal,
blockwise_overlay)``, and ``and`` a sliding window on the sliding layers) and PaliGemma
(prefix-LM through ``block_sequence_ids``); Gemma 3 text with bidirectional attention
(EmbeddingGemma: ``or_masks(causal, lambda *args: torch.tensor(True))``).  The mask builder is checked against
transformers' own ``sdpa_mask`` for or/and compositions, chunked, blockwise and packed
masks with padding and cache offsets, including the rows that keep no key.
"""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
import anyattn.torch.transformers_backend  # noqa: E402,F401  (registers "anyattn")

from anyattn.masks import KeepMask, OrMask  # noqa: E402
from anyattn.programs.mods import MaskMod  # noqa: E402

from hf_util import assert_structure_equals, dense_masks, rel, terms  # noqa: E402


def _functions(mask):
    """The mask-function terms (MaskMod, | of terms) of ``mask``."""
    return [t for t in terms(mask) if isinstance(t, (MaskMod, OrMask))]


def _pair(cfg, cls):
    torch.manual_seed(0)
    eager = cls._from_config(copy.deepcopy(cfg), attn_implementation="eager")
    ours = cls._from_config(copy.deepcopy(cfg), attn_implementation="anyattn")
    ours.load_state_dict(eager.state_dict())
    return eager, ours


def _step(model, batch):
    model.zero_grad()
    out = model(**batch)
    out.loss.backward()
    return out, {n: p.grad.detach().clone() for n, p in model.named_parameters()
                 if p.grad is not None}


def _check_step(eager, ours, batch):
    """Loss, logits and every gradient as eager's (relative 1e-5 / 1e-4, as
    test_transformers.py).  A key projection's bias has gradient 0 in exact arithmetic
    (softmax ignores a shift shared by a row): there both are rounding noise, held to
    1e-6 of the largest gradient instead."""
    out_e, ge = _step(eager, batch)
    out_o, go = _step(ours, batch)
    assert rel(out_o.loss, out_e.loss) <= 1e-5, (out_o.loss.item(), out_e.loss.item())
    assert rel(out_o.logits, out_e.logits) <= 1e-5
    assert ge.keys() == go.keys()
    scale = max(float(g.abs().max()) for g in ge.values())
    for name in ge:
        if name.endswith("k_proj.bias"):
            assert float((go[name] - ge[name]).abs().max()) <= 1e-6 * scale, name
            continue
        err = rel(go[name], ge[name])
        assert err <= 1e-4, f"{name}: relative gradient error {err:.2g}"


def _check_structured(masks, want_functions):
    """The builder returned structure every time (never transformers' dense mask) and
    every text-attention mask has no dense term; ``want_functions``: some hold a mask
    function (a traced MaskMod or a | of terms)."""
    from anyattn.torch.transformers_backend import StructuredMask

    assert masks.built and all(isinstance(m, StructuredMask) for m in masks.built)
    text = [m for m in masks if m is not None]
    assert text and not any(dense_masks(m) for m in text)
    assert any(_functions(m) for m in text) == want_functions
    masks.clear()
    masks.built.clear()


VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
              num_attention_heads=2, image_size=8, patch_size=2)


def test_llama4_chunked_attention_trains_and_generates_like_eager(masks_seen):
    """Llama 4 text with attention_chunk_size 5 (binds within 12 tokens), left and right
    padding: the chunked layers' mask (chunks start after each row's left padding) is
    Causal() & a traced chunk function & key padding."""
    cfg = transformers.Llama4TextConfig(
        vocab_size=97, hidden_size=32, intermediate_size=64, intermediate_size_mlp=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        max_position_embeddings=64, attention_chunk_size=5, num_local_experts=2,
        no_rope_layers=[1, 0], attn_temperature_tuning=False)
    assert cfg.layer_types == ["chunked_attention", "full_attention"]
    eager, ours = _pair(cfg, transformers.Llama4ForCausalLM)
    ids = torch.randint(1, 97, (3, 12), generator=torch.Generator().manual_seed(1))
    am = torch.ones_like(ids)
    am[1, :3] = 0
    am[2, 9:] = 0
    _check_step(eager, ours, dict(input_ids=ids, attention_mask=am,
                                  labels=ids.masked_fill(am == 0, -100)))
    _check_structured(masks_seen, True)
    kw = dict(attention_mask=am[:2, :7], max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(eager.generate(ids[:2, :7], **kw), ours.generate(ids[:2, :7], **kw))
    _check_structured(masks_seen, True)


def test_gemma3_image_tokens_train_and_generate_like_eager(masks_seen):
    """Gemma3ForConditionalGeneration with an image (token_type_ids): image tokens see
    each other both ways (``or_masks(causal, blockwise_overlay)``), the sliding layers
    ``and`` their window onto that; left padding."""
    text = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=64, sliding_window=4, query_pre_attn_scalar=16,
                layer_types=["sliding_attention", "full_attention"])
    cfg = transformers.Gemma3Config(text_config=text, vision_config=VISION,
                                    mm_tokens_per_image=4, image_token_index=90,
                                    boi_token_index=91, eoi_token_index=92)
    eager, ours = _pair(cfg, transformers.Gemma3ForConditionalGeneration)
    ids = torch.randint(1, 89, (2, 14), generator=torch.Generator().manual_seed(1))
    ids[:, 1], ids[:, 2:6], ids[:, 6] = 91, 90, 92           # <boi> 4 image tokens <eoi>
    am = torch.ones_like(ids)
    am[1, :1] = 0
    pixels = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    inputs = dict(input_ids=ids, attention_mask=am, pixel_values=pixels,
                  token_type_ids=(ids == 90).long())
    _check_step(eager, ours, dict(inputs, labels=ids.masked_fill(am == 0, -100)))
    # the image block is bidirectional (image token 2 sees image token 5), <boi> is not
    dense = [m.to_dense()[0, 0] for m in masks_seen.built]
    assert all(bool(d[2, 5]) and not bool(d[1, 5]) for d in dense)
    _check_structured(masks_seen, True)
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(eager.generate(**inputs, **kw), ours.generate(**inputs, **kw))
    _check_structured(masks_seen, True)


def test_embedding_gemma_bidirectional_masks_train_like_eager(masks_seen):
    """Gemma 3 text with use_bidirectional_attention (EmbeddingGemma): the full layers
    or ``lambda *args: torch.tensor(True)`` onto causal (every key: only the key padding
    is left), the sliding layers a bidirectional window; padded both ways."""
    text = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=64, sliding_window=6, query_pre_attn_scalar=16,
                layer_types=["sliding_attention", "full_attention"],
                use_bidirectional_attention=True)
    eager, ours = _pair(transformers.Gemma3TextConfig(**text), transformers.Gemma3TextModel)
    ids = torch.randint(1, 97, (3, 12), generator=torch.Generator().manual_seed(1))
    am = torch.ones_like(ids)
    am[1, 9:] = 0
    am[2, :4] = 0
    # a random projection of the real tokens' embeddings (a sum of squares would see
    # nothing but the final RMSNorm's weight)
    proj = torch.randn(32, generator=torch.Generator().manual_seed(3))
    outs, grads = [], []
    for model in (eager, ours):
        model.zero_grad()
        hidden = model(input_ids=ids, attention_mask=am).last_hidden_state
        ((hidden @ proj) * am).sum().backward()
        outs.append(hidden)
        grads.append({n: p.grad for n, p in model.named_parameters() if p.grad is not None})
    assert rel(outs[1], outs[0]) <= 1e-5
    scale = max(float(g.abs().max()) for g in grads[0].values())
    for name, g in grads[0].items():
        if name.endswith("k_proj.bias"):
            assert float((grads[1][name] - g).abs().max()) <= 1e-6 * scale, name
        else:
            assert rel(grads[1][name], g) <= 1e-4, name
    # the full layer keeps every key but the padding: nothing but the KeepMask is left
    assert any(terms(m) and all(isinstance(t, KeepMask) for t in terms(m))
               for m in masks_seen if m is not None)
    _check_structured(masks_seen, True)


def test_paligemma_prefix_lm_trains_and_generates_like_eager(masks_seen):
    """PaliGemmaForConditionalGeneration: image and prompt (token_type_ids 0) are one
    bidirectional prefix, the suffix is causal (``block_sequence_ids``); right padding."""
    text = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                max_position_embeddings=64)
    cfg = transformers.PaliGemmaConfig(text_config=text, vision_config=VISION,
                                       image_token_index=90, projection_dim=32)
    eager, ours = _pair(cfg, transformers.PaliGemmaForConditionalGeneration)
    ids = torch.randint(1, 89, (2, 24), generator=torch.Generator().manual_seed(1))
    ids[:, :16] = 90                                          # 16 image tokens
    tt = torch.zeros_like(ids)
    tt[:, 20:] = 1                                            # suffix
    am = torch.ones_like(ids)
    am[1, -3:] = 0
    pixels = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    inputs = dict(input_ids=ids, attention_mask=am, pixel_values=pixels, token_type_ids=tt)
    _check_step(eager, ours, dict(inputs, labels=ids.masked_fill(am == 0, -100)))
    _check_structured(masks_seen, True)
    inputs = dict(input_ids=ids[:, :20], attention_mask=am[:, :20], pixel_values=pixels,
                  token_type_ids=tt[:, :20])
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(eager.generate(**inputs, **kw), ours.generate(**inputs, **kw))
    _check_structured(masks_seen, True)


# -- the mask builder against sdpa_mask ----------------------------------------------------

B = 3


def _padding(kind, n):
    if kind == "none":
        return None
    am = torch.ones(B, n, dtype=torch.bool)
    if kind == "right":
        am[1, -3:] = False
        am[2, -7:] = False
    elif kind == "left":
        am[1, :3] = False
        am[2, :7] = False
    else:
        am[2] = False                                      # a row of nothing but pads
    return am


def _mask_functions(n, am):
    from transformers import masking_utils as mu

    g = torch.Generator().manual_seed(0)
    types = torch.randint(0, 3, (B, n), generator=g)
    image = types == 1
    blocks = torch.where(image, torch.cumsum(image, 1) // 4, -1)
    packed = torch.cumsum(torch.rand(B, n, generator=g) < 0.2, 1)
    left = ((am.cumsum(-1) == 0).sum(-1) if am is not None
            else torch.zeros(B, dtype=torch.long))
    causal = mu.causal_mask_function
    from transformers.models.nemotron_asr_streaming import modeling_nemotron_asr_streaming
    limited = modeling_nemotron_asr_streaming.chunked_limited_mask_function(5, 2)  # torch.div
    return {
        "chunked_limited": mu.and_masks(mu.bidirectional_mask_function, limited),
        "image_blocks": mu.or_masks(causal, mu.blockwise_overlay(blocks)),
        "sliding_image_blocks": mu.and_masks(mu.or_masks(causal, mu.blockwise_overlay(blocks)),
                                             mu.sliding_window_overlay(3)),
        "prefix_lm": mu.or_masks(causal, mu.blockwise_overlay(torch.where(types == 0, 0, -1))),
        "chunked": mu.chunked_causal_mask_function(4, left),
        "packed": mu.and_masks(causal, mu.packed_sequence_mask_function(packed)),
        "or_bidirectional": mu.or_masks(causal, mu.bidirectional_mask_function),
        "or_constant_true": mu.or_masks(causal, lambda *args: torch.tensor(True)),
        "or_bidirectional_window": mu.or_masks(mu.sliding_window_causal_mask_function(3),
                                               mu.sliding_window_bidirectional_overlay(2)),
    }


#: (Sq, Sk, q_offset, kv_offset): no cache, decoding, a full sliding cache, chunks, and
#: one size of several tiles of the empty-row search (128)
SIZES = [(10, 10, 0, 0), (1, 11, 10, 0), (1, 4, 10, 7), (3, 6, 3, 0), (2, 5, 8, 5),
         (300, 300, 0, 0)]


@pytest.mark.parametrize("size", SIZES)
@pytest.mark.parametrize("padding", ["none", "right", "left", "all"])
@pytest.mark.parametrize("fn", list(_mask_functions(4, None)))
def test_composed_masks_are_structure_equal_to_sdpa_mask(fn, padding, size):
    """Or/and compositions, chunked, blockwise and packed masks (with padding and cache
    offsets) become structure with no dense term that keeps exactly what sdpa_mask
    keeps, and the rows that keep no key are listed exactly."""
    from transformers import masking_utils as mu

    from anyattn.torch.transformers_backend import anyattn_mask

    Sq, Sk, qo, ko = size
    am = _padding(padding, max(qo + Sq, ko + Sk))
    mask_function = _mask_functions(max(qo + Sq, ko + Sk), am)[fn]
    # transformers turns the causal skip off for every composition; the chunked layer
    # mask keeps it on (off, for one of its plain layer masks, asks for the tensor)
    got = anyattn_mask(B, Sq, Sk, qo, ko, mask_function=mask_function, attention_mask=am,
                       allow_is_causal_skip=fn == "chunked")
    want = mu.sdpa_mask(batch_size=B, q_length=Sq, kv_length=Sk, q_offset=qo, kv_offset=ko,
                        mask_function=mask_function, attention_mask=am,
                        allow_is_causal_skip=False).expand(B, 1, Sq, Sk)
    assert_structure_equals(got, want)


def test_untraceable_function_and_a_request_for_the_tensor_get_the_dense_mask():
    """A function the tracer refuses (``torch.isin``) or-ed onto causal and a plain layer
    mask with both skips off (the caller edits the tensor) get sdpa_mask's dense mask;
    the same layer mask with an or-function on top (transformers turned the skip off for
    it) stays structure."""
    from transformers import masking_utils as mu

    from anyattn.torch.transformers_backend import StructuredMask, anyattn_mask

    globals_ = torch.tensor([1, 4])
    fn = mu.or_masks(mu.causal_mask_function,
                     lambda b, h, q_idx, kv_idx: torch.isin(kv_idx, globals_))
    got = anyattn_mask(1, 6, 6, mask_function=fn, allow_is_causal_skip=False)
    want = mu.sdpa_mask(batch_size=1, q_length=6, kv_length=6, mask_function=fn,
                        allow_is_causal_skip=False)
    assert isinstance(got, torch.Tensor) and torch.equal(got, want)
    chunked = mu.chunked_causal_mask_function(2, torch.zeros(1, dtype=torch.long))
    got = anyattn_mask(1, 6, 6, mask_function=chunked, allow_is_causal_skip=False)
    assert isinstance(got, torch.Tensor)
    assert isinstance(anyattn_mask(1, 6, 6, mask_function=chunked), StructuredMask)
    blocks = torch.tensor([[-1, 0, 0, -1, -1, -1]])
    got = anyattn_mask(1, 6, 6, mask_function=mu.or_masks(chunked, mu.blockwise_overlay(blocks)),
                       allow_is_causal_skip=False)
    assert isinstance(got, StructuredMask) and _functions(got.mask)
