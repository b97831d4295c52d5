"""attn_implementation="anyattn" in transformers: loss and gradients match "eager" (CPU, fp32).

Tiny models from configs with random weights (nothing is downloaded): Llama with GQA,
Mistral with a sliding window, Qwen2; padded batches (right and left padding).
"""
import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")
import anyattn.torch.transformers_backend  # noqa: E402,F401  (registers "anyattn")

SMALL = dict(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
             attention_dropout=0.0)


def _configs():
    return {
        "llama": transformers.LlamaConfig(**SMALL),
        "mistral_sliding": transformers.MistralConfig(**SMALL, sliding_window=6),
        "qwen2": transformers.Qwen2Config(**SMALL),
    }


def _pair(cfg):
    torch.manual_seed(0)
    eager = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                                          attn_implementation="eager")
    ours = transformers.AutoModelForCausalLM.from_config(copy.deepcopy(cfg),
                                                         attn_implementation="anyattn")
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


def test_dropout_raises():
    from anyattn.torch.transformers_backend import anyattn_attention_forward

    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(NotImplementedError, match="dropout"):
        anyattn_attention_forward(torch.nn.Module(), q, q, q, None, dropout=0.1)


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
