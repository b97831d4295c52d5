"""The per-signature cache of prepared Triton launches (backends/triton/prepared.py):
the key changes with every input the launch depends on, never holds a tensor, stays
bounded, and a call after any number of cached calls gives the bits of the same call
with the cache emptied.

Runs on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1 where no GPU is
present) at tiny sizes.  Shape legend: B batch, H heads, S = Sq = Sk, D head dim.
"""
from __future__ import annotations

import dataclasses

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

import anyattn as aa  # noqa: E402
from anyattn import settings  # noqa: E402
from anyattn.backends.triton import configs as C  # noqa: E402
from anyattn.backends.triton import launch as L  # noqa: E402
from anyattn.backends.triton import prepared as P  # noqa: E402
from anyattn.modifiers import ScoreMods  # noqa: E402
from anyattn.problem import Problem, describe  # noqa: E402

from tr_util import DEV, needs_triton  # noqa: E402

B, H, S, D = 1, 2, 20, 16


def _qkv(seed=0, dtype=torch.float32, S_=S):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, S_, D, generator=g).to(device=DEV, dtype=dtype)
            for _ in range(4)]


# ----------------------------------------------------------------------------- the key
def test_key_holds_every_problem_field_but_mask_seed_and_matched_slopes():
    names = {f.name for f in dataclasses.fields(Problem)}
    q, k, v, _ = _qkv()
    P.problem_key(describe(q, k, v))
    assert set(P.PROBLEM_FIELDS) == names - {"mask", "dropout_seed", "matched_alibi"}


def test_key_changes_with_each_problem_field():
    q, k, v, _ = _qkv()
    p = describe(q, k, v, mask=aa.Causal())
    base = P.problem_key(p)
    changes = dict(batch=2, heads_q=4, heads_kv=1, seq_q=21, seq_k=22, head_dim=32,
                   dtype="bfloat16", array_kind="numpy", device="cuda:1", scale=0.5,
                   bias_shape=(1, 1, S, S), bias_dtype="float32", precision="tf32",
                   wrt=frozenset({"q"}), q_offset=3, k_offset=1, softcap=5.0,
                   alibi_shape=(1, H), alibi_dtype="float32", sinks_dtype="float32",
                   dropout_p=0.1, head_dim_v=24, pages=object(),
                   score_mod=describe(q, k, v, score_mod=lambda s, b, h, i, j: s * 2).score_mod)
    assert set(changes) == set(P.PROBLEM_FIELDS)   # a new field needs a case here
    for name, val in changes.items():
        p2 = dataclasses.replace(p, **{name: val})
        assert P.problem_key(p2) != base, name
    # the slopes of a spelled ALiBi are per-call data (the modifier's): not in the key
    assert P.problem_key(dataclasses.replace(p, matched_alibi=torch.ones(1, H))) == base
    # the dropout seed is a runtime argument: not in the key
    assert P.problem_key(dataclasses.replace(p, dropout_p=0.1, dropout_seed=1)) == \
        P.problem_key(dataclasses.replace(p, dropout_p=0.1, dropout_seed=2))
    # the mask: band sides and which tensor terms are present
    for mask in (None, aa.Window(left=3), aa.Window(left=0, right=2),
                 aa.Documents(torch.zeros(S, dtype=torch.int64)),
                 aa.KeepMask(torch.ones(S, S, dtype=torch.bool))):
        assert P.problem_key(describe(q, k, v, mask=mask)) != base, mask


def test_key_changes_with_layout_alignment_env_overrides_and_mods(monkeypatch):
    q, k, v, _ = _qkv()
    p = describe(q, k, v)

    def key(plan=None, mods=None, tensors=(q, k, v)):
        return P.call_key("forward", p, plan, mods, tensors)

    base = key()
    assert key() == base
    assert P.call_key("backward", p, None, None, (q, k, v)) != base
    assert key(plan=C.fixed_plan()) != base
    assert key(mods=ScoreMods(alibi_slopes=torch.ones(H))) != base
    assert key(mods=ScoreMods(sinks=torch.ones(H))) != base
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)          # other strides
    assert key(tensors=(qt, k, v)) != base
    flat = torch.zeros(q.numel() + 1, device=q.device)
    qm = flat[1:].view(q.shape)                                   # 4-byte offset
    assert key(tensors=(qm, k, v)) != base
    for name in [switch.name for switch in settings.SWITCHES]:
        with monkeypatch.context() as m:
            m.setenv(name, "some-other-value")
            assert key() != base, name
        assert key() == base, name
    C.set_override(16, "float32", "highest", pre_bm=16)
    try:
        assert key() != base
    finally:
        C.set_override(16, "float32", "highest")
    assert key() != base        # a new version: an override removed is a change too


def test_key_holds_no_tensor():
    q, k, v, _ = _qkv()
    ids = torch.zeros(S, dtype=torch.int64, device=q.device)
    p = describe(q, k, v, mask=aa.Documents(ids), bias=torch.zeros(1, H, S, S, device=q.device))
    key = P.call_key("forward", p, None, ScoreMods(sinks=torch.ones(H)), (q, k, v))

    def walk(x):
        assert not isinstance(x, torch.Tensor)
        if isinstance(x, (tuple, list, frozenset)):
            for y in x:
                walk(y)

    walk(key)


def test_lru_is_bounded():
    c = P.LRU(3)
    for i in range(5):
        c.put(i, str(i))
    assert len(c) == 3 and c.get(0) is None and c.get(4) == "4"
    c.get(2)
    c.put(5, "5")                       # 3 is now the least recently used
    assert c.get(3) is None and c.get(2) == "2"


def test_settings_snapshot_follows_the_environment(monkeypatch):
    monkeypatch.delenv("ANYATTN_TRITON_PATH", raising=False)
    a = settings.snapshot()
    monkeypatch.setenv("ANYATTN_TRITON_PATH", "portable")
    b = settings.snapshot()
    assert a != b
    monkeypatch.delenv("ANYATTN_TRITON_PATH")
    assert settings.snapshot() == a


# ----------------------------------------------------------------------------- end to end
def _call(q, k, v, g, wrt=("q", "k", "v"), **kw):
    """forward + backward through the core on the triton backend -> list of tensors."""
    out, lse = aa.attention(q, k, v, backend="triton", return_lse=True, **kw)
    gr = aa.attention_backward(q, k, v, g, out=out, lse=lse, backend="triton", wrt=wrt, **kw)
    return [out, lse] + [getattr(gr, "d" + n) for n in wrt]


def _variants():
    """name -> (tensors changer, call keywords): each differs from the base call in one
    input the launch depends on."""
    g = torch.Generator().manual_seed(7)
    bias_b = torch.randn(1, H, S, S, generator=g).to(DEV)
    ids = torch.tensor([0] * 7 + [1] * 13, device=DEV)
    keep = (torch.rand(1, H, S, S, generator=g) > 0.3).to(DEV)
    t = dict(
        base=dict(),
        causal=dict(mask=aa.Causal()),
        docs=dict(mask=aa.Documents(ids)),
        keep=dict(mask=aa.KeepMask(keep)),
        bias_bcast=dict(bias=bias_b, wrt=("q", "k", "v", "bias")),
        bias_k_only=dict(bias=bias_b, wrt=("k", "bias")),
        wrt_q=dict(wrt=("q",)),
        softcap=dict(softcap=3.0),
        alibi=dict(alibi_slopes=torch.tensor([0.5, 0.25], device=DEV)),
        sinks=dict(sinks=torch.tensor([0.3, -1.0], device=DEV), wrt=("q", "k", "v", "sinks")),
        dropout=dict(dropout_p=0.25, dropout_seed=11),
        dropout_seed=dict(dropout_p=0.25, dropout_seed=12),
        offsets=dict(mask=aa.Causal(), q_offset=3),
    )
    return t


@needs_triton
def test_cached_calls_give_the_bits_of_uncached_calls(monkeypatch):
    """Every variant runs after all the others were cached (a stale entry would be
    reused there), then alone with the cache emptied: the same bits; repeats of some
    (the prepared launch itself) too."""
    q, k, v, gd = _qkv()
    tensor_variants = {
        "bf16": [x.to(torch.bfloat16) for x in (q, k, v, gd)],
        "strided": [x.transpose(1, 2).contiguous().transpose(1, 2) for x in (q, k, v, gd)],
    }
    cases = [(n, (q, k, v, gd), kw) for n, kw in _variants().items()]
    cases += [(n, ts, {}) for n, ts in tensor_variants.items()]
    L.clear_prepared()
    cached = {}
    for name, ts, kw in cases:
        cached[name] = _call(*ts, **dict(kw))
    n_entries = len(L.prepared.PREPARED)
    assert n_entries >= len(cases) - 2     # (dropout seeds share one entry; so may bf16's)
    again = ("base", "causal", "docs", "bias_bcast", "sinks", "dropout_seed", "strided")
    repeat = {name: _call(*ts, **dict(kw))
              for name, ts, kw in cases if name in again}
    assert len(L.prepared.PREPARED) == n_entries   # repeats hit
    for name, ts, kw in cases:
        L.clear_prepared()
        fresh = _call(*ts, **dict(kw))
        for i, b in enumerate(fresh):
            assert torch.equal(cached[name][i], b), name
            assert name not in repeat or torch.equal(repeat[name][i], b), name
    assert not torch.equal(cached["dropout"][0], cached["dropout_seed"][0])


@needs_triton
def test_plan_override_and_explicit_plan_take_effect(monkeypatch):
    q, k, v, g = _qkv()
    p = describe(q, k, v)
    L.clear_prepared()
    L.forward(p, q, k, v, None)
    seen = []
    real = L.prepared.resolve_launch

    def spy(kernel, grid_of, cfg, *a, **kw):
        seen.append(cfg)
        return real(kernel, grid_of, cfg, *a, **kw)

    monkeypatch.setattr(L.prepared, "resolve_launch", spy)
    L.forward(p, q, k, v, None)
    assert seen == []                     # prepared: no second resolution
    C.set_override(16, "float32", "highest", pre_bm=16)
    try:
        L.forward(p, q, k, v, None)
    finally:
        C.set_override(16, "float32", "highest")
    assert len(seen) == 1                 # a new overrides version: prepared again
    small = C.KernelConfig(16, 16, 4, 1)
    plan = dataclasses.replace(C.fixed_plan(), fwd=small)
    out2, _ = L.forward(p, q, k, v, None, plan=plan)
    assert seen[-1] == small
    ref, _ = L.forward(p, q, k, v, None)
    n = len(seen)
    out, _ = L.forward(p, q, k, v, None)
    assert len(seen) == n                 # the plain call hits its own entry again
    assert torch.equal(out, ref) and torch.allclose(out2, ref, atol=1e-5)


def test_forced_hopper_path_raises_on_every_call(monkeypatch):
    """A call the Hopper path does not cover raises under ANYATTN_TRITON_PATH=hopper even
    when the same signature was prepared on the portable path before."""
    q, k, v, g = _qkv()
    p = describe(q, k, v)
    if DEV == "cuda" and torch.cuda.get_device_capability() == (9, 0):
        pytest.skip("an sm_90 GPU may cover the call")
    L.clear_prepared()
    L.forward(p, q, k, v, None)
    monkeypatch.setenv("ANYATTN_TRITON_PATH", "hopper")
    for _ in range(2):
        with pytest.raises(NotImplementedError, match="Hopper forward path"):
            L.forward(p, q, k, v, None)


# ----------------------------------------------------------------------------- direct
def test_direct_launch_matches_only_the_facts_it_was_compiled_for():
    """direct.Direct replays a compiled kernel only for arguments with the same scalar
    values and types and the same tensor dtypes and 16-byte alignment (Triton's
    specialisation facts), keywords included; anything else takes Triton's own launch."""
    from anyattn.backends.triton import direct as DL

    buf = torch.zeros(64)
    a, b = buf[:16], buf[16:32]                  # both 16-byte aligned
    args = (a, b, 16, 3, 0.5, 1)
    kw = dict(MODE=2, HAS_BAND=True, num_warps=4)
    d = DL.Direct(None, None, args, kw)
    assert d.matches((buf[32:48], torch.zeros(16), 16, 3, 0.5, 1), dict(kw))
    for other, okw in (((a, b, 17, 3, 0.5, 1), kw),            # a value
                       ((a, b, 16, 3, 0.25, 1), kw),           # a float value
                       ((a, b, 16, 3.0, 0.5, 1), kw),          # a type (int -> float)
                       ((a, buf[1:17], 16, 3, 0.5, 1), kw),    # alignment
                       ((a, b.double(), 16, 3, 0.5, 1), kw),   # dtype
                       ((a, b, 16, 3, 0.5), kw),               # arity
                       ((a, 16, b, 3, 0.5, 1), kw),            # a tensor slot, a scalar
                       (args, dict(kw, MODE=1)),               # a keyword's value
                       (args, dict(kw, HAS_BAND=1)),           # a keyword's type
                       (args, dict(kw, num_stages=3)),         # another keyword
                       (args, dict(MODE=2, HAS_BAND=True)),    # a keyword missing
                       (args, None)):
        assert not d.matches(other, okw), (other, okw)


def test_direct_launch_binds_in_signature_order():
    """Direct.values puts positional arguments, keywords and the defaults Triton bound
    in the kernel's signature order (what CompiledKernel.run takes), options such as
    num_warps left out; TMA descriptors are operands matched by dtype, block and
    layout, their address and shape free."""
    from anyattn.backends.triton import direct as DL
    from anyattn.backends.triton.hopper import launch as HL

    x = torch.zeros(2, 3, 256, 64, dtype=torch.bfloat16)
    desc = HL.make_desc(x, 64)
    bound = {"X": desc, "n": 5, "A": None, "MODE": 2, "B": 7, "FLAG": True}
    kw = dict(FLAG=True, MODE=2, num_warps=4)
    d = DL.Direct(None, None, (desc, 5), kw, bound)
    y = torch.zeros(2, 3, 512, 64, dtype=torch.bfloat16)
    dy = HL.make_desc(y, 64)
    vals = d.values((dy, 5), dict(MODE=2, FLAG=True, num_warps=4))
    assert vals == (dy, 5, None, 2, 7, True)
    assert d.values((HL.make_desc(y, 128), 5), kw) is None           # another block
    assert d.values((HL.make_desc(y.half(), 64), 5), kw) is None     # another dtype


def test_direct_launch_does_not_apply_to_the_interpreter():
    from anyattn.backends.triton import direct as DL
    from anyattn.backends.triton import kernels as K

    if DEV == "cuda":
        pytest.skip("runs where the kernels are interpreted (no GPU)")
    assert DL.resolve(K.fwd_kernel, (), {}) is False


@pytest.mark.gpu
@pytest.mark.skipif(DEV != "cuda", reason="direct launches call the CUDA launcher")
def test_direct_launch_gives_the_bits_of_triton_launches(monkeypatch):
    q, k, v, g = _qkv()
    cases = [dict(), dict(mask=aa.Causal()), dict(bias=torch.randn(1, H, S, S, device=DEV),
                                                   wrt=("q", "k", "v", "bias"))]
    from anyattn.backends.triton import direct as DL

    for kw in cases:
        L.clear_prepared()
        with monkeypatch.context() as m:          # every launch through Triton's path
            m.setattr(DL, "enabled", lambda device: False)
            plain = [_call(q, k, v, g, **dict(kw)) for _ in range(3)]
        L.clear_prepared()
        direct = [_call(q, k, v, g, **dict(kw)) for _ in range(3)]
        used = [s for pr in L.prepared.PREPARED._d.values() if pr.direct for s in pr.sites.values()]
        assert used and all(s.hits > 0 for s in used)
        for a, b in zip(plain[-1], direct[-1]):
            assert torch.equal(a, b)


def test_unresolved_direct_site_stops_paying_the_binder_twice(monkeypatch):
    """A site whose direct.resolve finds nothing (None) retries once, then takes
    Triton's path alone: resolve (a binder pass) is not repeated on every call."""
    from anyattn.backends.triton import direct as DL

    calls = {"resolve": 0, "launch": 0}

    def fake_resolve(kernel, args, kw):
        calls["resolve"] += 1
        return None

    class FakeKernel:
        def __getitem__(self, grid):
            def go(*a, **k):
                calls["launch"] += 1
            return go

    monkeypatch.setattr(DL, "resolve", fake_resolve)
    pr = L.prepared.Prepared(route=None, hop=False, direct=True)
    ready = [(1,), (), {}]
    for _ in range(6):
        L.prepared.replay(pr, "k", ready, FakeKernel(), (0,))
    assert calls["launch"] == 6
    assert calls["resolve"] == 2
    assert pr.sites["k"].d is False and pr.sites["k"].hits == 0


def test_direct_site_replays_the_resolved_kernel(monkeypatch):
    """A resolved site launches through the Direct while the facts hold, through
    Triton's path when they do not (and keeps the Direct), and never directly while
    Triton's launch hooks are set or when it is off."""
    from anyattn.backends.triton import direct as DL

    log = []

    class FakeKernel:
        def __getitem__(self, grid):
            return lambda *a, **k: log.append(("triton", grid, a))

    class FakeDirect(DL.Direct):
        def run(self, grid, vals):
            log.append(("direct", grid, vals))
            return True

    t = torch.zeros(16)
    monkeypatch.setattr(DL, "resolve", lambda kern, a, k: FakeDirect(kern, None, a, k))
    monkeypatch.setattr(DL, "hooks_set", lambda: False)
    site = DL.Site(FakeKernel(), True)
    site((2,), (t, 3), {"M": 1})                 # Triton's path, then resolved
    site((2,), (torch.ones(16), 3), {"M": 1})    # the same facts: direct
    site((2,), (t, 4), {"M": 1})                 # another value: Triton's path
    assert [e[0] for e in log] == ["triton", "direct", "triton"] and site.hits == 1
    monkeypatch.setattr(DL, "hooks_set", lambda: True)
    site((2,), (t, 3), {"M": 1})
    off = DL.Site(FakeKernel(), False)
    off((2,), (t, 3), {"M": 1})
    off((2,), (t, 3), {"M": 1})
    assert [e[0] for e in log[3:]] == ["triton"] * 3 and off.d is False


def test_launch_hooks_are_seen_only_when_set(monkeypatch):
    """Triton 3.6 keeps its launch hooks as HookChains that are never None: an empty
    chain is no hook (direct launches go ahead), a chain with a call is (Triton's path,
    which calls it); a plain callable or None (earlier versions) likewise."""
    from triton import knobs

    from anyattn.backends.triton import direct as DL

    assert not DL.hooks_set()
    hook = knobs.runtime.launch_enter_hook
    if hasattr(hook, "add"):
        fn = lambda *a: None  # noqa: E731
        hook.add(fn)
        try:
            assert DL.hooks_set()
        finally:
            hook.remove(fn)
        assert not DL.hooks_set()
    assert DL._hook_active(print) and not DL._hook_active(None)


def test_direct_launch_on_cuda_devices_only():
    from anyattn.backends.triton import direct as DL

    assert DL.enabled(torch.device("cuda", 0)) and not DL.enabled(torch.device("cpu"))
