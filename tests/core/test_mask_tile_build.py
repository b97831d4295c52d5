"""The tile map of a mask function is exact: interval bounds over tiles and boxes,
sampled pairs and the pair-by-pair rest give the same empty / partial / full codes as
the dense keep pattern, for hand-written and random functions, ragged tiles, tiles
smaller than the box split, per-batch and per-head captures and a band term; and the
bounds spare the pair-by-pair work where they decide."""
import numpy as np
import pytest

import anyattn as aa
from anyattn.masks import TILE_CACHE, _tile_reduce, resolve
from anyattn.programs import bound as bound_mod
from anyattn.programs.tile_bounds import SparseRange


@pytest.fixture(autouse=True)
def _fresh_cache():
    TILE_CACHE.clear()
    yield
    TILE_CACHE.clear()


def _oracle(bp, band=None):
    """(any, all) per tile from the dense keep of the function (and band)."""
    _, _, Sq, Sk = bp.sizes
    keep = np.array(bp.keep_dense(0, Sq, 0, Sk))
    if band is not None:
        d = np.arange(Sk)[None, :] - np.arange(Sq)[:, None]
        if band[0] is not None:
            keep &= d >= band[0]
        if band[1] is not None:
            keep &= d <= band[1]
    return keep


def _check(mask_mod, sizes, bq, bk, band=None):
    bp = mask_mod.residual.bind(mask_mod.captures, sizes)
    got = bound_mod.mask_tile_parts(bp, bq, bk, band)
    want = _tile_reduce(_oracle(bp, band), bq, bk)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


def _cases(B, H, Sq, Sk, rng):
    doc = np.sort(rng.integers(0, 5, (B, Sk)), axis=1)
    shuffled = rng.integers(-3, 3, Sk)
    pre = rng.integers(0, Sk + 1, B)
    widths = rng.integers(1, 40, H)
    bits = rng.random((H, Sk)) < 0.5
    grid = rng.integers(-5, 5, (7, 9))
    return {
        "window_or_global": aa.MaskMod(lambda b, h, q, kv: (abs(q - kv) <= 5) | (kv < 3)
                                       | (q < 2)),
        "dilated": aa.MaskMod(lambda b, h, q, kv: ((q - kv) % 3 == 0)
                              & ((q - kv) // 3 <= 4)),
        "natten": aa.MaskMod(lambda b, h, q, kv: (abs(q // 6 - kv // 6) <= 1)
                             & (abs(q % 6 - kv % 6) <= 2)),
        "chunked": aa.MaskMod(lambda b, h, q, kv: q // 13 == kv // 13),
        "prefix": aa.MaskMod(lambda b, h, q, kv, pre: (kv <= q) | (kv < pre[b]), pre=pre),
        "sorted_docs": aa.MaskMod(lambda b, h, q, kv, doc: doc[b, q % Sk] == doc[b, kv],
                                  doc=doc),
        "unsorted_ids": aa.MaskMod(lambda b, h, q, kv, s: s[kv] >= s[q % Sk] - 1,
                                   s=shuffled),
        "head_width": aa.MaskMod(lambda b, h, q, kv, w: q - kv < w[h], w=widths),
        "bool_capture": aa.MaskMod(lambda b, h, q, kv, bits: bits[h, kv] | (q == kv),
                                   bits=bits),
        "two_axes_gather": aa.MaskMod(lambda b, h, q, kv, g: g[q % 7, kv % 9] > 0, g=grid),
        "negative_mod_div": aa.MaskMod(lambda b, h, q, kv: ((kv - q) % -4 > -2)
                                       ^ ((kv - 2 * q) // -5 > 1)),
        "where_minmax": aa.MaskMod(lambda b, h, q, kv: aa.math.where(
            q > 20, aa.math.minimum(q, kv + 4), aa.math.maximum(kv, 7)) >= kv - 1),
        "bits_sign_invert": aa.MaskMod(lambda b, h, q, kv: ((q & 12) == (kv & 12))
                                       | (aa.math.sign(q - kv - 9) == ~h + 2)),
        "constant": aa.MaskMod(lambda b, h, q, kv: (q >= 0) | (kv < 0)),
        "nothing": aa.MaskMod(lambda b, h, q, kv: q > Sq + 5),
    }


@pytest.mark.parametrize("sizes,bq,bk", [((2, 3, 61, 75), 16, 8), ((1, 2, 64, 64), 32, 32),
                                         ((2, 2, 37, 50), 4, 5), ((1, 1, 130, 97), 64, 128)])
@pytest.mark.parametrize("name", list(_cases(2, 3, 61, 75, np.random.default_rng(0))))
def test_function_tiles_equal_the_dense_pattern(name, sizes, bq, bk):
    B, H, Sq, Sk = sizes
    m = _cases(B, H, Sq, Sk, np.random.default_rng(1))[name]
    _check(m, sizes, bq, bk)
    _check(m, sizes, bq, bk, band=(-9, 0))            # a causal window band joins in


def _random_int(rng, depth, leaves):
    """A random integer expression over the traced indices (a closure of them)."""
    if depth == 0 or rng.random() < 0.25:
        pick = int(rng.integers(0, len(leaves) + 1))
        if pick == len(leaves):
            c = int(rng.integers(-20, 21))
            return lambda env: c
        name = leaves[pick]
        return lambda env: env[name]
    op = str(rng.choice(["add", "sub", "mulc", "div", "mod", "abs", "min", "max", "where",
                         "gather", "neg"]))
    x = _random_int(rng, depth - 1, leaves)
    y = _random_int(rng, depth - 1, leaves)
    c = int(rng.choice([-7, -3, -2, 2, 3, 5, 16]))
    if op == "add":
        return lambda env: x(env) + y(env)
    if op == "sub":
        return lambda env: x(env) - y(env)
    if op == "mulc":
        return lambda env: x(env) * c
    if op == "div":
        return lambda env: x(env) // c
    if op == "mod":
        return lambda env: x(env) % c
    if op == "abs":
        return lambda env: abs(x(env))
    if op == "neg":
        return lambda env: -x(env)
    if op == "min":
        return lambda env: aa.math.minimum(x(env), y(env))
    if op == "max":
        return lambda env: aa.math.maximum(x(env), y(env))
    if op == "gather":
        return lambda env: env["tab"][aa.math.clamp(x(env), 0, 40)]
    cond = _random_bool(rng, depth - 1, leaves)
    return lambda env: aa.math.where(cond(env), x(env), y(env))


def _random_bool(rng, depth, leaves):
    kind = str(rng.choice(["cmp", "cmp", "and", "or", "not", "xor"])) if depth else "cmp"
    if kind == "cmp":
        x, y = _random_int(rng, depth, leaves), _random_int(rng, depth, leaves)
        op = str(rng.choice(["<", "<=", ">", ">=", "==", "!="]))
        return {"<": lambda env: x(env) < y(env), "<=": lambda env: x(env) <= y(env),
                ">": lambda env: x(env) > y(env), ">=": lambda env: x(env) >= y(env),
                "==": lambda env: x(env) == y(env),
                "!=": lambda env: x(env) != y(env)}[op]
    a, b = _random_bool(rng, depth - 1, leaves), _random_bool(rng, depth - 1, leaves)
    if kind == "and":
        return lambda env: a(env) & b(env)
    if kind == "or":
        return lambda env: a(env) | b(env)
    if kind == "xor":
        return lambda env: a(env) ^ b(env)
    return lambda env: ~a(env)


@pytest.mark.parametrize("seed", range(40))
def test_random_functions_tiles_equal_the_dense_pattern(seed):
    """Random integer / bool expressions: sound bounds or the test fails."""
    rng = np.random.default_rng(seed)
    tab = rng.integers(-6, 6, 41)
    if seed % 3 == 0:
        tab = np.sort(tab)
    expr = _random_bool(rng, 3, ["b", "h", "q", "kv"])

    def fn(b, h, q_idx, kv_idx, tab):
        return expr({"b": b, "h": h, "q": q_idx, "kv": kv_idx, "tab": tab})

    m = aa.MaskMod(fn, tab=tab)
    if m.residual is None:                    # the whole function was a band
        return
    sizes = (2, 2, int(rng.integers(20, 90)), int(rng.integers(20, 90)))
    bq, bk = int(rng.integers(2, 33)), int(rng.integers(2, 33))
    _check(m, sizes, bq, bk)


def test_tile_map_of_split_mask_is_exact():
    """A band conjunct and the function's rest classify together: a tile where each is
    partial but no pair is kept by both is empty, not partial."""
    S = 64
    m = aa.MaskMod(lambda b, h, q, kv: (kv <= q) & (q - kv <= 3)
                   & (((q - kv) % 16 == 15) | (q == kv)))
    assert len(m.bands) == 2 and m.residual is not None
    codes = resolve(m, 1, 1, S, S).tile_map(16, 16)
    d = np.arange(S)[:, None] - np.arange(S)[None, :]
    dense = (d >= 0) & (d <= 3) & ((d % 16 == 15) | (d == 0))
    want = resolve(aa.KeepMask(dense), 1, 1, S, S).tile_map(16, 16)
    np.testing.assert_array_equal(codes, want)
    assert (np.diagonal(codes[0, 0], -1) == 0).all()     # band and function partial there


def test_sparse_range_answers_every_range():
    rng = np.random.default_rng(3)
    c = rng.integers(-50, 50, (3, 37))
    t = SparseRange(c, 1)
    lo, hi = np.triu_indices(37)
    rows = np.repeat(np.arange(3), lo.size)
    lo3, hi3 = np.tile(lo, 3), np.tile(hi, 3)
    mn, mx = t.query([rows], lo3, hi3)
    for r, a, b, x, y in zip(rows, lo3, hi3, mn, mx):
        assert (x, y) == (c[r, a:b + 1].min(), c[r, a:b + 1].max())


def test_bounds_spare_the_pairwise_work(monkeypatch):
    """A sliding window at S = 4096, 128 x 128 tiles: the pairs evaluated one by one are
    a small fraction of S² (the bounds decide every tile off the diagonal)."""
    counted = []
    real = bound_mod.evaluate

    def counting(outputs, env, *a, **k):
        counted.append(int(np.prod(np.broadcast_shapes(*(np.shape(v) for v in
                                                          env.values())))))
        return real(outputs, env, *a, **k)

    monkeypatch.setattr(bound_mod, "evaluate", counting)
    S = 4096
    m = aa.MaskMod(lambda b, h, q, kv: (abs(q - kv) <= 8) | (kv < 4))
    codes = resolve(m, 1, 1, S, S).tile_map(128, 128)
    assert sum(counted) < S * S // 100
    assert (codes == 1).sum() == 3 * (S // 128) - 2 + (S // 128) - 2


@pytest.mark.parametrize("op", ["add", "sub", "mul", "floordiv", "mod", "min", "max",
                                "abs", "neg", "sign", "invert", "bitand", "where"])
def test_interval_rules_hold_every_value(op):
    """Every value of ``q op kv`` over a box lies in the interval the rules give: boxes
    of small random ranges, negative values and zero divisors included."""
    from anyattn.programs.graph import ordered
    from anyattn.programs.tile_bounds import tile_intervals

    fns = {"add": lambda q, k: q + k, "sub": lambda q, k: q - k, "mul": lambda q, k: q * k,
           "floordiv": lambda q, k: q // k, "mod": lambda q, k: q % k,
           "min": aa.math.minimum, "max": aa.math.maximum, "abs": lambda q, k: abs(q - k),
           "neg": lambda q, k: -q, "sign": lambda q, k: aa.math.sign(q),
           "invert": lambda q, k: ~q, "bitand": lambda q, k: q & k,
           "where": lambda q, k: aa.math.where(q < k, q * 2, k - 3)}
    f = fns[op]
    m = aa.MaskMod(lambda b, h, q, kv: f(q, kv) == 12345)
    node = m.program.out.args[0]
    rng = np.random.default_rng(7)
    n = 4000
    lo = {"q": rng.integers(-20, 20, n), "kv": rng.integers(-20, 20, n)}
    if op == "bitand":
        lo = {k: np.abs(v) for k, v in lo.items()}
    width = {k: rng.integers(0, 7, n) for k in lo}
    boxes = {"b": (0.0, 0.0), "h": (0.0, 0.0),
             "q_idx": (lo["q"].astype(float), (lo["q"] + width["q"]).astype(float)),
             "kv_idx": (lo["kv"].astype(float), (lo["kv"] + width["kv"]).astype(float))}
    ilo, ihi = (np.broadcast_to(x, (n,)) for x in
                tile_intervals(node, ordered([node]), {}, {}, boxes))
    with np.errstate(divide="ignore"):
        for t in range(n):
            q = np.arange(lo["q"][t], lo["q"][t] + width["q"][t] + 1)[:, None]
            kv = np.arange(lo["kv"][t], lo["kv"][t] + width["kv"][t] + 1)[None, :]
            if op in ("floordiv", "mod") and (kv == 0).any():
                assert np.isinf(ilo[t]) and np.isinf(ihi[t])
                continue
            ev = {"add": np.add, "sub": np.subtract, "mul": np.multiply,
                  "floordiv": np.floor_divide, "mod": np.mod, "min": np.minimum,
                  "max": np.maximum, "abs": lambda a, b: np.abs(a - b),
                  "neg": lambda a, b: -a + 0 * b, "sign": lambda a, b: np.sign(a) + 0 * b,
                  "invert": lambda a, b: ~a + 0 * b, "bitand": np.bitwise_and,
                  "where": lambda a, b: np.where(a < b, a * 2, b - 3)}[op](q, kv)
            assert ilo[t] <= ev.min() and ev.max() <= ihi[t], (t, ilo[t], ihi[t])
