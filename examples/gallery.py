"""A gallery of programmable attention: score and mask functions, FlexAttention style.

    PYTHONPATH=src python examples/gallery.py          # runs every entry, checks it

Each entry builds the arguments of ``anyattn.attention`` for a problem of size
(B, Hq, Sq, Sk): a ``score_mod`` (a function of the scaled score and the indices
``b, h, q_idx, kv_idx``, maybe reading captured arrays) and / or a mask (``MaskMod``
terms composed with the built-ins by ``&`` and ``|``).  ``wrt`` names the float captures
whose gradients ``attention_backward`` can return (``Gradients.dcaptures``), and
``builtin`` the same problem spelled with anyattn's built-in arguments where one exists.

Shape legend: B batch, Hq query heads, Sq queries, Sk keys.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Optional, Tuple

import numpy as np

import anyattn as aa
from anyattn import math as am


@dataclass
class Entry:
    """One gallery entry for a problem size: ``kwargs`` of attention (score_mod / mask),
    ``wrt`` the float captures with gradients, ``builtin`` the built-in spelling or None."""

    name: str
    kwargs: Dict[str, Any]
    wrt: Tuple[str, ...] = ()
    builtin: Optional[Dict[str, Any]] = None
    note: str = ""


def relative_position_bias(B, Hq, Sq, Sk, rng) -> Entry:
    """A learnable bias per head and relative position (Shaw et al., Swin), causal."""
    table = (0.5 * rng.standard_normal((Hq, Sq + Sk - 1))).astype(np.float32)

    def rel_bias(score, b, h, q_idx, kv_idx, table):
        return score + table[h, q_idx - kv_idx + (Sk - 1)]

    i, j = np.arange(Sq)[:, None], np.arange(Sk)[None, :]
    dense = np.ascontiguousarray(table[:, i - j + (Sk - 1)][None])   # [1, Hq, Sq, Sk]
    return Entry("relative position bias", dict(score_mod=aa.ScoreMod(rel_bias, table=table),
                                                mask=aa.Causal()), wrt=("table",),
                 builtin=dict(bias=dense, mask=aa.Causal()))


def t5_buckets(B, Hq, Sq, Sk, rng, n_buckets=16, max_distance=64) -> Entry:
    """T5's bucketed relative bias: a fixed integer bucket per relative position (a
    capture read at the traced distance), a learnable bias per (head, bucket)."""
    rel = np.arange(-(Sq - 1), Sk)                      # kv_idx - q_idx
    half = n_buckets // 2
    exact = half // 2
    n = np.abs(rel)
    big = exact + (np.log(np.maximum(n, 1) / exact) / math.log(max_distance / exact)
                   * (half - exact)).astype(np.int64)
    bucket = np.where(n < exact, n, np.minimum(big, half - 1)) + np.where(rel > 0, half, 0)
    bucket = bucket.astype(np.int32)                    # [Sq + Sk - 1] in [0, n_buckets)
    table = (0.5 * rng.standard_normal((Hq, n_buckets))).astype(np.float32)

    def t5(score, b, h, q_idx, kv_idx, bucket, table):
        return score + table[h, bucket[kv_idx - q_idx + (Sq - 1)]]

    return Entry("T5 buckets", dict(score_mod=aa.ScoreMod(t5, bucket=bucket, table=table)),
                 wrt=("table",))


def alibi(B, Hq, Sq, Sk, rng) -> Entry:
    """ALiBi as a function (bottom-right aligned positions, as the built-in)."""
    slopes = (2.0 ** -np.arange(1, Hq + 1)).astype(np.float32)

    def alibi_fn(score, b, h, q_idx, kv_idx, slopes):
        return score - slopes[h] * abs(q_idx - kv_idx + (Sk - Sq))

    return Entry("ALiBi", dict(score_mod=aa.ScoreMod(alibi_fn, slopes=slopes),
                               mask=aa.Causal("bottom_right")),
                 wrt=("slopes",),
                 builtin=dict(alibi_slopes=slopes, mask=aa.Causal("bottom_right")))


def softcap(B, Hq, Sq, Sk, rng, cap=5.0) -> Entry:
    """Gemma 2's logit soft-capping, with a NumPy ufunc."""
    def softcap_fn(score, b, h, q_idx, kv_idx):
        return cap * np.tanh(score / cap)

    return Entry("softcap", dict(score_mod=softcap_fn), builtin=dict(softcap=cap))


def prefix_lm(B, Hq, Sq, Sk, rng) -> Entry:
    """PrefixLM: a bidirectional prefix (its length per batch row) and causal after it."""
    lengths = rng.integers(1, Sk + 1, size=B).astype(np.int64)

    def prefix_fn(b, h, q_idx, kv_idx, prefix):
        return kv_idx < prefix[b]

    return Entry("PrefixLM", dict(mask=aa.Causal() | aa.MaskMod(prefix_fn, prefix=lengths)))


def document_causal(B, Hq, Sq, Sk, rng) -> Entry:
    """Packed documents, causal inside each (Sq == Sk)."""
    ids = np.sort(rng.integers(0, 4, size=(B, Sq)), axis=1)

    def same_doc(b, h, q_idx, kv_idx, doc):
        return doc[b, q_idx] == doc[b, kv_idx]

    return Entry("document + causal", dict(mask=aa.MaskMod(same_doc, doc=ids) & aa.Causal()),
                 builtin=dict(mask=aa.Documents(ids) & aa.Causal()))


def sliding_global(B, Hq, Sq, Sk, rng, window=8, n_global=4) -> Entry:
    """A sliding window plus global tokens that see and are seen by every token."""
    def local_global(b, h, q_idx, kv_idx):
        return (abs(q_idx - kv_idx) <= window) | (kv_idx < n_global) | (q_idx < n_global)

    return Entry("sliding window + global tokens", dict(mask=aa.MaskMod(local_global)))


def dilated(B, Hq, Sq, Sk, rng, dilation=3, reach=6) -> Entry:
    """A causal dilated window: every ``dilation``-th key within ``reach`` steps."""
    def dilated_fn(b, h, q_idx, kv_idx):
        d = q_idx - kv_idx
        return (d >= 0) & (d % dilation == 0) & (d // dilation <= reach)

    return Entry("dilated", dict(mask=aa.MaskMod(dilated_fn)))


def neighbourhood_2d(B, Hq, Sq, Sk, rng, width=8, radius=2) -> Entry:
    """NATTEN-style 2-D neighbourhood on a grid of ``width`` columns (Sq == Sk)."""
    def natten(b, h, q_idx, kv_idx):
        return ((abs(q_idx // width - kv_idx // width) <= radius)
                & (abs(q_idx % width - kv_idx % width) <= radius))

    return Entry("2-D neighbourhood", dict(mask=aa.MaskMod(natten)))


def chunked(B, Hq, Sq, Sk, rng, chunk=16) -> Entry:
    """Llama 4's chunked attention: causal inside fixed chunks."""
    def chunked_fn(b, h, q_idx, kv_idx):
        return (q_idx // chunk == kv_idx // chunk) & (kv_idx <= q_idx)

    ids_q, ids_k = np.arange(Sq) // chunk, np.arange(Sk) // chunk
    return Entry("chunked (Llama 4)", dict(mask=aa.MaskMod(chunked_fn)),
                 builtin=dict(mask=aa.Causal() & aa.Documents(ids_q, ids_k)))


def causal_fn(B, Hq, Sq, Sk, rng) -> Entry:
    """Causal as a mask function (top-left, as Causal())."""
    return Entry("causal as MaskMod", dict(mask=aa.MaskMod(lambda b, h, q_idx, kv_idx:
                                                          kv_idx <= q_idx)),
                 builtin=dict(mask=aa.Causal()))


def window_fn(B, Hq, Sq, Sk, rng, left=8) -> Entry:
    """A causal sliding window as a mask function."""
    def window(b, h, q_idx, kv_idx):
        return (kv_idx <= q_idx) & (q_idx - kv_idx <= left)

    return Entry("sliding window as MaskMod", dict(mask=aa.MaskMod(window)),
                 builtin=dict(mask=aa.Causal() & aa.Window(left=left)))


def tanh_gate(B, Hq, Sq, Sk, rng) -> Entry:
    """A score function that uses the score nonlinearly and reads a learnable per-head
    temperature (a capture with a gradient through both uses)."""
    temp = (1.0 + 0.2 * rng.standard_normal(Hq)).astype(np.float32)

    def gate(score, b, h, q_idx, kv_idx, temp):
        return am.where(kv_idx <= q_idx + (Sk - Sq), score * temp[h], -math.inf)

    return Entry("per-head temperature", dict(score_mod=aa.ScoreMod(gate, temp=temp)),
                 wrt=("temp",))


#: every entry and the sizes it needs (True: Sq must equal Sk)
GALLERY: Dict[str, Tuple[Callable[..., Entry], bool]] = {
    "relative_position_bias": (relative_position_bias, False),
    "t5_buckets": (t5_buckets, False),
    "alibi": (alibi, False),
    "softcap": (softcap, False),
    "prefix_lm": (prefix_lm, False),
    "document_causal": (document_causal, True),
    "sliding_global": (sliding_global, False),
    "dilated": (dilated, False),
    "neighbourhood_2d": (neighbourhood_2d, True),
    "chunked": (chunked, False),
    "causal_fn": (causal_fn, False),
    "window_fn": (window_fn, False),
    "tanh_gate": (tanh_gate, False),
}


def main() -> None:
    rng = np.random.default_rng(0)
    B, Hq, Hkv, S, D = 2, 4, 2, 64, 16
    q = rng.standard_normal((B, Hq, S, D)).astype(np.float32)
    k, v = (rng.standard_normal((B, Hkv, S, D)).astype(np.float32) for _ in range(2))
    dout = rng.standard_normal(q.shape).astype(np.float32)
    for key, (make, _) in GALLERY.items():
        e = make(B, Hq, S, S, rng)
        out = aa.attention(q, k, v, **e.kwargs)
        f64 = [x.astype(np.float64) for x in (q, k, v, dout)]
        ref = aa.attention(*f64[:3], backend="reference", **e.kwargs)
        g = aa.attention_backward(q, k, v, dout, wrt=("q", "k", "v") + e.wrt, **e.kwargs)
        err = float(np.abs(out - ref).max() / np.abs(ref).max())
        line = f"{e.name:32s} out rel err {err:.1e}"
        if e.wrt:
            line += "  d" + ", d".join(f"{n} {tuple(g.dcaptures[n].shape)}" for n in e.wrt)
        if e.builtin is not None:
            b = aa.attention(q, k, v, **e.builtin)
            line += f"  vs built-in {float(np.abs(out - b).max()):.1e}"
        print(line)


if __name__ == "__main__":
    main()
