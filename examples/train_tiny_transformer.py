"""Train a tiny causal transformer on generated addition problems, with anyattn attention.

    PYTHONPATH=src python examples/train_tiny_transformer.py            # CPU, ~2 min on 2 cores
    PYTHONPATH=src python examples/train_tiny_transformer.py --device cuda --steps 2000

The data is made here (nothing is downloaded): lines like ``"317+85=402;"``, written
with the answer's digits reversed (``"317+85=204;"``) so that a left-to-right model can
carry.  Lines of different lengths are *packed* into fixed-length rows, and attention
is ``Causal() & Documents(line_ids)``: a token sees only earlier tokens of its own
line, never the previous problem, with no padding and no dense mask.

Prints a progress bar with the loss, evaluates exact-match accuracy of greedy answers
on held-out problems, and saves the loss curve as a PNG (``--out``).
Shape legend: B rows, S tokens per row, H heads, Hkv key/value heads, Dh head dim.
"""
from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time


def _early_threads(argv, default="1") -> str:
    """``--threads N`` read before torch/NumPy load: OpenMP and OpenBLAS fix their thread
    pools at load time.  The model is tiny; one thread avoids their spinning threads
    fighting over the cores of a shared machine (seen here: 10x slower with 2)."""
    for i, a in enumerate(argv):
        if a == "--threads" and i + 1 < len(argv):
            return argv[i + 1]
        if a.startswith("--threads="):
            return a.split("=", 1)[1]
    return default


for _var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "ANYATTN_NUMPY_THREADS"):
    os.environ.setdefault(_var, _early_threads(sys.argv[1:]))

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
import anyattn.torch as at  # noqa: E402
from anyattn import Causal, Documents  # noqa: E402

VOCAB = "0123456789+=;"
STOI = {c: i for i, c in enumerate(VOCAB)}
PAD = len(VOCAB)  # never attended across documents; only fills the tail of a row


# ------------------------------------------------------------------------------ data
def problem(rng: random.Random, digits: int) -> str:
    a, b = rng.randrange(10 ** rng.randint(1, digits)), rng.randrange(10 ** rng.randint(1, digits))
    return f"{a}+{b}={str(a + b)[::-1]};"


def packed_batch(rng: random.Random, rows: int, seq: int, digits: int):
    """-> tokens, doc ids, is_answer: [B, S+1] each; problems packed back to back.

    ``is_answer`` marks the answer digits and the closing ';' (the predictable part:
    the operands are random digits, whose loss can never go below log 10)."""
    toks = torch.full((rows, seq + 1), PAD, dtype=torch.long)
    docs = torch.zeros((rows, seq + 1), dtype=torch.long)
    answer = torch.zeros((rows, seq + 1), dtype=torch.bool)
    for r in range(rows):
        pos, d = 0, 0
        while pos < seq + 1:
            full = problem(rng, digits)
            line = full[: seq + 1 - pos]
            toks[r, pos:pos + len(line)] = torch.tensor([STOI[c] for c in line])
            docs[r, pos:pos + len(line)] = d
            eq = full.index("=") + 1
            answer[r, pos + eq:pos + len(line)] = True
            pos, d = pos + len(line), d + 1
    return toks, docs, answer


# ----------------------------------------------------------------------------- model
class Attention(nn.Module):
    def __init__(self, dim: int, heads: int, kv_heads: int):
        super().__init__()
        self.h, self.hkv, self.dh = heads, kv_heads, dim // heads
        self.q = nn.Linear(dim, dim, bias=False)
        self.kv = nn.Linear(dim, 2 * kv_heads * self.dh, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)

    def forward(self, x, mask, cos, sin):
        B, S, _ = x.shape
        q = rope(self.q(x).view(B, S, self.h, self.dh), cos, sin)          # [B, S, H, Dh]
        k, v = self.kv(x).view(B, S, 2, self.hkv, self.dh).unbind(2)     # [B, S, Hkv, Dh]
        y = at.attention(q, rope(k, cos, sin), v, mask=mask, layout="bshd")  # GQA, no repeat
        return self.o(y.reshape(B, S, -1))


def rope(x, cos, sin):
    """Rotary position embedding on [B, S, H, Dh] with cos/sin [S, Dh/2]."""
    x1, x2 = x.float().chunk(2, dim=-1)
    c, s = cos[None, :, None], sin[None, :, None]
    return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).type_as(x)


class Block(nn.Module):
    def __init__(self, dim, heads, kv_heads):
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(dim), nn.RMSNorm(dim)
        self.attn = Attention(dim, heads, kv_heads)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x, mask, cos, sin):
        x = x + self.attn(self.n1(x), mask, cos, sin)
        return x + self.mlp(self.n2(x))


class TinyLM(nn.Module):
    def __init__(self, dim=128, layers=2, heads=4, kv_heads=2, max_len=256):
        super().__init__()
        self.emb = nn.Embedding(len(VOCAB) + 1, dim)
        self.blocks = nn.ModuleList(Block(dim, heads, kv_heads) for _ in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, len(VOCAB) + 1, bias=False)
        dh = dim // heads
        inv = 1.0 / (10000 ** (torch.arange(0, dh, 2).float() / dh))
        ang = torch.arange(max_len).float()[:, None] * inv[None]               # [S, Dh/2]
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, tokens, docs=None):
        """tokens [B, S] -> logits [B, S, V]; docs [B, S] restricts attention to one line."""
        S = tokens.shape[1]
        mask = Causal() if docs is None else Causal() & Documents(docs)
        x = self.emb(tokens)
        for blk in self.blocks:
            x = blk(x, mask, self.cos[:S], self.sin[:S])
        return self.head(self.norm(x))


# ------------------------------------------------------------------------ train/eval
def progress(step, total, loss, answer_loss, t0, width=30):
    done = int(width * step / total)
    rate = step / max(time.time() - t0, 1e-9)
    eta = (total - step) / max(rate, 1e-9)
    sys.stdout.write(f"\r[{'#' * done}{'.' * (width - done)}] {step}/{total} "
                     f"loss {loss:.3f} (answers {answer_loss:.3f})  {rate:.1f} it/s  "
                     f"eta {eta:.0f}s ")
    sys.stdout.flush()


@torch.no_grad()
def accuracy(model, rng, digits, n, device):
    """Exact-match rate of greedy answers on ``n`` fresh problems (one problem per row)."""
    model.eval()
    lines = [problem(rng, digits) for _ in range(n)]
    prompts = [ln[: ln.index("=") + 1] for ln in lines]
    answers = [ln[ln.index("=") + 1:] for ln in lines]
    width = max(len(p) for p in prompts)
    # right-align the prompts; the pad prefix is its own document, so it is never seen
    toks = torch.full((n, width), PAD, dtype=torch.long)
    docs = torch.zeros((n, width), dtype=torch.long)
    for r, p in enumerate(prompts):
        toks[r, width - len(p):] = torch.tensor([STOI[c] for c in p])
        docs[r, width - len(p):] = 1
    toks, docs = toks.to(device), docs.to(device)
    outs = [""] * n
    for _ in range(digits + 2):
        nxt = model(toks, docs)[:, -1].argmax(-1)                             # [B]
        toks = torch.cat([toks, nxt[:, None]], 1)
        docs = torch.cat([docs, docs[:, -1:]], 1)
        for r, t in enumerate(nxt.tolist()):
            outs[r] += VOCAB[t] if t < len(VOCAB) else "?"
    model.train()
    good = sum(o[: len(a)] == a for o, a in zip(outs, answers))
    return good / n, prompts[0] + outs[0].split(";")[0] + ";"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--digits", type=int, default=3)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--backend", default=None, help="anyattn backend (default: automatic)")
    ap.add_argument("--out", default="tiny_transformer_loss.png")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="CPU threads of torch, OpenBLAS and the numpy backend (default 1)")
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    dev = torch.device(args.device)
    model = TinyLM(max_len=args.seq + 16).to(dev)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 50) * 0.5 * (1 + math.cos(math.pi * s / args.steps)))
    n_params = sum(p.numel() for p in model.parameters())
    print(f"device {dev}, {n_params / 1e3:.0f}k parameters, {args.steps} steps of "
          f"{args.batch}x{args.seq} packed tokens, attention: Causal() & Documents(ids)")

    losses, answer_losses, t0 = [], [], time.time()
    with at.use_backend(args.backend):
        for step in range(1, args.steps + 1):
            toks, docs, answer = (t.to(dev) for t in packed_batch(rng, args.batch, args.seq,
                                                                  args.digits))
            x, y = toks[:, :-1], toks[:, 1:].clone()
            y[docs[:, 1:] != docs[:, :-1]] = -100     # a line's first token is not predictable
            logits = model(x, docs[:, :-1])
            tok_loss = F.cross_entropy(logits.transpose(1, 2), y, ignore_index=-100,
                                       reduction="none")                        # [B, S]
            loss = tok_loss.sum() / (y != -100).sum()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            answer_losses.append(tok_loss[answer[:, 1:]].mean().item())
            if step % 10 == 0 or step == args.steps:
                progress(step, args.steps, sum(losses[-10:]) / len(losses[-10:]),
                         sum(answer_losses[-10:]) / len(answer_losses[-10:]), t0)
        print()
        acc, sample = accuracy(model, random.Random(args.seed + 1), args.digits, 200, dev)
    print(f"trained in {time.time() - t0:.0f}s; final loss {sum(losses[-20:]) / 20:.3f} "
          f"(answers {sum(answer_losses[-20:]) / 20:.3f}); held-out exact match {acc:.0%} "
          f"(answers reversed), e.g. {sample}")
    save_curve(losses, answer_losses, args.out)
    print(f"loss curve: {args.out}")


def save_curve(losses, answer_losses, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(xs, k=10):
        return [sum(xs[max(0, i - k):i + 1]) / len(xs[max(0, i - k):i + 1])
                for i in range(len(xs))]

    fig, ax = plt.subplots(figsize=(6, 3.5))
    for xs, name in ((losses, "all tokens"), (answer_losses, "answer tokens")):
        line, = ax.plot(smooth(xs), label=f"{name} (mean of 10 steps)")
        ax.plot(xs, alpha=0.25, color=line.get_color())
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats/token)")
    ax.set_ylim(bottom=0)
    ax.set_title("tiny transformer on packed additions (anyattn)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
