"""CUDA tensors through the triton backend (GPU machines only)."""
import pytest
import torch
import torch.nn.functional as F

import anyattn.torch as at
from anyattn import Causal

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("causal", [False, True])
def test_matches_sdpa_on_cuda(dtype, tol, causal):
    q = torch.randn(2, 8, 300, 64, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(2, 2, 300, 64, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(2, 2, 300, 64, device="cuda", dtype=dtype, requires_grad=True)
    out = at.attention(q, k, v, mask=Causal() if causal else None)
    g = torch.randn_like(out)
    got = torch.autograd.grad(out, (q, k, v), g)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=causal, enable_gqa=True)
    want = torch.autograd.grad(ref, (q64, k64, v64), g.double())
    for a, b in zip((out, *got), (ref, *want)):
        err = float((a.double() - b).abs().max() / b.abs().max())
        assert err < tol


def test_compile_on_cuda():
    def f(q, k, v):
        return at.attention(q, k, v, mask=Causal())

    q = torch.randn(1, 4, 128, 64, device="cuda", requires_grad=True)
    out = torch.compile(f, fullgraph=True)(q, q, q)
    out.sum().backward()
    assert q.grad is not None and torch.isfinite(q.grad).all()


def test_dropout_mask_on_cuda_is_the_cpu_mask():
    """One seed, the same keep mask on the GPU (triton) as on the CPU (numpy)."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 4, 96, 32) for _ in "qkv")
    kw = dict(mask=Causal(), dropout_p=0.2, dropout_seed=2 ** 62 + 5, softcap=5.0)   # anyattn.torch: < 2**63
    cpu = at.attention(q, k, v, **kw)
    gpu = at.attention(q.cuda(), k.cuda(), v.cuda(), **kw).cpu()
    assert float((gpu - cpu).abs().max()) < 1e-5 * float(cpu.abs().max())


def test_bert_trains_with_dropout_on_cuda():
    pytest.importorskip("transformers")
    from transformers import BertConfig, BertForMaskedLM

    import anyattn.torch.transformers_backend  # noqa: F401

    cfg = BertConfig(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                     intermediate_size=128, attention_probs_dropout_prob=0.1)
    cfg._attn_implementation = "anyattn"
    model = BertForMaskedLM(cfg).cuda().train()
    ids = torch.randint(3, 64, (2, 32), device="cuda")
    torch.manual_seed(1)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all()
                                        for p in model.parameters() if p.grad is not None)


@pytest.mark.parametrize("ids_kind", ["cpu_tensor", "numpy", "int64_beyond_int32"])
def test_documents_ids_on_the_host_give_the_device_ids_results(ids_kind):
    """Document ids may stay on the host (a data loader's): the same out and gradients,
    bit for bit, as the same ids on the GPU."""
    from anyattn import Documents

    S = 700
    ids = (torch.arange(S) * 5 // S).to(torch.int32)
    host = {"cpu_tensor": ids, "numpy": ids.numpy(),
            "int64_beyond_int32": ids.to(torch.int64) * 2 ** 33}[ids_kind]
    q, k, v = (torch.randn(2, 4, S, 128, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    g = torch.randn(2, 4, S, 128, device="cuda", dtype=torch.bfloat16)
    res = []
    for m in (Documents(ids.cuda()) & Causal(), Documents(host) & Causal()):
        out = at.attention(q, k, v, mask=m)
        res.append((out, *torch.autograd.grad(out, (q, k, v), g)))
    for a, b in zip(*res):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dims", [(192, 128), (40, 24)], ids=["192-128", "40-24"])
def test_value_head_dim_on_cuda(dims):
    """Dv != D on CUDA tensors runs on the portable Triton kernels (the Hopper path does
    not take it): out and every gradient against float64 SDPA, bf16 and fp32, and the
    SDPA drop-in."""
    D, Dv = dims
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2e-2)):
        q = torch.randn(2, 8, 200, D, device="cuda", dtype=dtype, requires_grad=True)
        k = torch.randn(2, 2, 200, D, device="cuda", dtype=dtype, requires_grad=True)
        v = torch.randn(2, 2, 200, Dv, device="cuda", dtype=dtype, requires_grad=True)
        out = at.attention(q, k, v, mask=Causal())
        assert tuple(out.shape) == (2, 8, 200, Dv)
        g = torch.randn_like(out)
        got = torch.autograd.grad(out, (q, k, v), g)
        q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
        ref = F.scaled_dot_product_attention(q64, k64, v64, is_causal=True, enable_gqa=True)
        want = torch.autograd.grad(ref, (q64, k64, v64), g.double())
        for a, b in zip((out, *got), (ref, *want)):
            assert a.shape == b.shape
            assert float((a.double() - b).abs().max() / b.abs().max()) < tol
        drop_in = at.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        assert float((drop_in.double() - ref).abs().max() / ref.abs().max()) < tol
