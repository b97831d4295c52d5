"""Which (backend, mask term, modifier, dtype class) combinations the contract tests run.

Runs pytest on the given paths (default: the contract suite, ``tests/backends``) with a
plugin that wraps ``anyattn.attention`` and ``anyattn.attention_backward`` and records,
for every call a test makes, one combination:

    backend | op | dtype | mask terms | bias | modifiers | shape class

* op: ``fwd`` or ``bwd[wrt]``;
* mask terms: the terms of the mask (``Causal:tl``, ``Window:br``, ``KeepMask:b1qk``,
  ``Documents:2d``, ...), ``-`` for none;
* bias: its broadcast pattern (``bhqk``, ``1hqk``, ``b11k``, ``qk``, ...), ``-`` for none;
* modifiers: softcap, alibi[h] / alibi[bh], sinks, offsets, dropout, scale, given out/lse,
  layout bshd;
* shape class: Sq vs Sk (``sq<sk``, ``sq=sk``, ``sq>sk``), heads (``mha``, ``gqa``,
  ``mqa``), ``b>1`` where the batch has several problems.

Sizes are deliberately not part of a combination: a suite that proves the same code
path at a smaller size keeps its combination.  The listing (sorted, one combination a
line) goes to ``--out``; ``--compare A B`` prints what one listing has and the other
lacks and exits 1 where they differ.

    python3 bench/lab/contract_coverage.py --out /tmp/cov.txt            # tests/backends
    python3 bench/lab/contract_coverage.py --out /tmp/cov.txt -- -m exhaustive tests/backends
    python3 bench/lab/contract_coverage.py --compare before.txt after.txt
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _shape(x):
    return tuple(int(n) for n in getattr(x, "shape", ()))


def _dtype(x):
    return str(getattr(x, "dtype", "?")).replace("torch.", "")


def _pattern(shape, full):
    """Broadcast pattern of an array against [B, H, Sq, Sk]: 'b' 'h' 'q' 'k' where the
    axis is full, '1' where it broadcasts."""
    shape = (1,) * (4 - len(shape)) + tuple(shape) if len(shape) <= 4 else shape
    if len(shape) != 4:
        return f"rank{len(shape)}"
    return "".join(n if s == f and f != 1 else ("1" if s == 1 else n)
                   for n, s, f in zip("bhqk", shape, full))


def _mask_terms(mask, full):
    if mask is None:
        return ("-",)
    terms = getattr(mask, "terms", None) or (mask,)
    out = []
    for t in terms:
        kind = type(t).__name__
        if kind in ("Causal", "Window"):
            tag = "br" if getattr(t, "align", "top_left") == "bottom_right" else "tl"
            if kind == "Window":
                tag += ":" + ("l" if t.left is not None else "") + ("r" if t.right is not None else "")
            out.append(f"{kind}:{tag}")
        elif kind == "KeepMask":
            s = _shape(t.mask)
            out.append(f"KeepMask:{len(s)}d:{_pattern(s, full)}")
        elif kind == "Documents":
            out.append(f"Documents:{len(_shape(t.q_ids))}d:{_dtype(t.q_ids)}")
        else:
            out.append(kind)
    return tuple(sorted(out))


def _bshd(x, layout):
    s = _shape(x)
    return (s[0], s[2], s[1], s[3]) if layout == "bshd" and len(s) == 4 else s


def describe(op, args, kw):
    q, k = args[0], args[1]
    layout = kw.get("layout", "bhsd")
    B, Hq, Sq, _ = _bshd(q, layout)
    _, Hkv, Sk, _ = _bshd(k, layout)
    full = (B, Hq, Sq, Sk)
    mods = []
    if kw.get("softcap") is not None:
        mods.append("softcap")
    if kw.get("alibi_slopes") is not None:
        mods.append("alibi[bh]" if len(_shape(kw["alibi_slopes"])) == 2 else "alibi[h]")
    if kw.get("sinks") is not None:
        mods.append("sinks")
    if kw.get("q_offset", 0) or kw.get("k_offset", 0):
        mods.append("offsets")
    if kw.get("dropout_p", 0.0):
        mods.append("dropout")
    if kw.get("scale") is not None:
        mods.append("scale")
    if kw.get("out") is not None or kw.get("lse") is not None:
        mods.append("given_out_lse")
    if layout != "bhsd":
        mods.append(f"layout:{layout}")
    bias = kw.get("bias")
    if op == "bwd":
        op = "bwd[" + ",".join(kw.get("wrt", ("q", "k", "v"))) + "]"
    heads = "mha" if Hq == Hkv else ("mqa" if Hkv == 1 else "gqa")
    rel = "sq<sk" if Sq < Sk else ("sq>sk" if Sq > Sk else "sq=sk")
    shape = f"{rel} {heads}" + (" b>1" if B > 1 else "")
    return " | ".join([
        str(kw.get("backend")), op, _dtype(q), "&".join(_mask_terms(kw.get("mask"), full)),
        "-" if bias is None else _pattern(_shape(bias), full),
        ",".join(mods) or "-", shape])


class Recorder:
    """Records the combinations of the calls made by tests whose name contains none of
    ``skip`` (Hypothesis tests draw their problems at random: what they reach is
    exploration, counted apart)."""

    def __init__(self, skip=("hypothesis",)):
        self.seen = set()
        self.skip = tuple(skip)
        self.current = ""

    def pytest_runtest_setup(self, item):
        self.current = item.name

    def pytest_sessionstart(self, session):
        import anyattn

        for name, op in (("attention", "fwd"), ("attention_backward", "bwd")):
            fn = getattr(anyattn, name)

            @functools.wraps(fn)
            def wrapped(*args, _fn=fn, _op=op, **kw):
                result = _fn(*args, **kw)   # record what ran and returned (not what raised)
                if not any(s in self.current for s in self.skip):
                    self.seen.add(describe(_op, args, kw))
                return result

            setattr(anyattn, name, wrapped)


def _compare(a, b):
    sa = set(open(a).read().splitlines())
    sb = set(open(b).read().splitlines())
    for line in sorted(sa - sb):
        print(f"only in {a}: {line}")
    for line in sorted(sb - sa):
        print(f"only in {b}: {line}")
    print(f"{a}: {len(sa)} combinations; {b}: {len(sb)}; "
          f"{'equal' if sa == sb else 'DIFFERENT'}")
    return 0 if sa == sb else 1


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="write the sorted listing here (default: stdout)")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"),
                    help="compare two listings instead of running the tests")
    ap.add_argument("--skip-tests", default="hypothesis",
                    help="comma-separated substrings of test names not counted "
                         "(default: hypothesis; '' counts every test)")
    ap.add_argument("pytest_args", nargs="*", help="after --: pytest arguments "
                    "(default: -q -p no:cacheprovider tests/backends)")
    ns = ap.parse_args(argv)
    if ns.compare:
        return _compare(*ns.compare)
    os.chdir(ROOT)
    sys.path.insert(0, os.path.join(ROOT, "src"))
    import pytest

    rec = Recorder([t for t in ns.skip_tests.split(",") if t])
    args = ns.pytest_args or ["-q", "-p", "no:cacheprovider", "tests/backends"]
    rc = pytest.main(args, plugins=[rec])
    text = "\n".join(sorted(rec.seen)) + "\n"
    if ns.out:
        with open(ns.out, "w") as f:
            f.write(text)
        print(f"{len(rec.seen)} combinations -> {ns.out}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return int(rc)


if __name__ == "__main__":
    sys.exit(main())
