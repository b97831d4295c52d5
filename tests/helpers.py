"""Shared test utilities: seeded problems, error measures, tolerances, backend harnesses.

Shape legend: B batch, Hq/Hkv heads, Sq/Sk queries/keys, D head dim.
"""
from __future__ import annotations

import os
import zlib
from dataclasses import dataclass
from typing import Optional

import numpy as np

#: relative max-abs error allowed vs the float64 reference, by dtype (DESIGN.md §4).
TOL = {"float64": 1e-12, "float32": 1e-5, "tf32": 3e-4, "float16": 3e-3, "bfloat16": 2e-2}


def stable_seed(*parts) -> int:
    """A seed from test ids that is the same in every process (``hash`` of a str is
    salted per process, so a seed from it draws other inputs on every run)."""
    return zlib.crc32(repr(parts).encode())


def rel_err(got, ref) -> float:
    """max|got - ref| / max|ref| over finite reference entries (0-size -> 0)."""
    got = np.asarray(to_np(got), dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    if ref.size == 0:
        return 0.0
    scale = np.max(np.abs(ref))
    diff = np.max(np.abs(got - ref))
    if scale == 0:
        return float(diff)
    return float(diff / scale)


def assert_close(got, ref, dtype: str, what: str = "", tol: Optional[float] = None,
                 magnitude=None):
    """Relative max-abs error vs the float64 reference within the dtype's tolerance.

    ``magnitude``: optional float64 array of the summed absolute terms behind each
    entry (see ``term_magnitudes``); the error is then measured against
    max(max|ref|, max magnitude), the standard scale for rounding in a sum whose
    terms cancel (e.g. dq with a single key is exactly 0).
    """
    tol = TOL[dtype] if tol is None else tol
    g = to_np(got)
    assert not np.isnan(g).any(), f"{what}: NaN in result"
    e = rel_err(g, ref)
    if magnitude is not None and e > tol:
        denom = max(float(np.max(np.abs(ref))) if np.size(ref) else 0.0,
                    float(np.max(magnitude)) if np.size(magnitude) else 0.0)
        if denom > 0:
            e = float(np.max(np.abs(np.asarray(g, np.float64) - ref)) / denom)
    assert e <= tol, f"{what}: relative error {e:.3g} > {tol:.1g} ({dtype})"


def term_magnitudes(q, k, v, g, *, mask=None, bias=None, scale=None, q_offset=0, k_offset=0,
                    softcap=None, alibi_slopes=None, sinks=None, dropout_p=0.0,
                    dropout_seed=None):
    """Sum of |terms| behind out, dq, dk, dv, dbias, dsinks (float64): the rounding scale.

    With Pd = P∘keep/(1 − p) (P without dropout): out_i = Σ_j Pd_ij v_j -> Σ_j Pd_ij |v_j|;
    dS = Pd∘dP − P∘δ -> Pd·|dP| + P·|δ|; dq = scale·dS·(1 − tanh²)·k -> the same with
    |dS|, |k|; dk likewise with q (summed over each query group); dv = Pdᵀg -> Pdᵀ|g|;
    dsinks = −Σ P_sink·δ with δ = <g, out> -> Σ P_sink·Σ_d |g|·|out|'s scale.
    """
    from anyattn import reference as R

    q, k, v, g = (np.asarray(to_np(x), np.float64) for x in (q, k, v, g))
    b = None if bias is None else np.asarray(to_np(bias), np.float64)
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = 1.0 / np.sqrt(D) if scale is None else scale
    s, _, kexp, vexp, th = R._scores(q, k, v, mask, b, scale, q_offset, k_offset, softcap,
                                     None if alibi_slopes is None else to_np(alibi_slopes))
    sk = None if sinks is None else np.asarray(to_np(sinks), np.float64)
    p, row_max, log_norm = R._softmax_stats(s, sk)
    pd = R._dropped(p, dropout_p, dropout_seed, q_offset, k_offset)
    out = np.einsum("bhij,bhjd->bhid", pd, vexp)
    dp = np.einsum("bhid,bhjd->bhij", g, vexp)
    delta = np.sum(g * out, axis=-1, keepdims=True)
    ads = pd * np.abs(dp) + p * np.abs(delta)
    adx = ads if th is None else ads * (1.0 - th * th)
    mag_out = np.einsum("bhij,bhjd->bhid", pd, np.abs(vexp))
    res = {
        "out": mag_out,
        "dq": scale * np.einsum("bhij,bhjd->bhid", adx, np.abs(kexp)),
        "dk": (scale * np.einsum("bhij,bhid->bhjd", adx, np.abs(q))).reshape(
            B, Hkv, G, Sk, D).sum(2),
        "dv": np.einsum("bhij,bhid->bhjd", pd, np.abs(g)).reshape(B, Hkv, G, Sk,
                                                                   v.shape[-1]).sum(2),
    }
    if b is not None:
        res["dbias"] = R.reduce_to_shape(ads, b.shape)
    if sk is not None:
        t = sk[None, :, None]
        with np.errstate(invalid="ignore", over="ignore"):
            p_sink = np.where(np.isfinite(row_max) & np.isfinite(t),
                              np.exp((t - row_max) - log_norm), 0.0)
        res["dsinks"] = (p_sink * np.sum(np.abs(g) * mag_out, axis=-1)).sum(axis=(0, 2))
    return res


def to_np(x):
    if x is None:
        return None
    if isinstance(x, np.ndarray):
        return x
    if type(x).__module__.startswith("torch"):
        x = x.detach().cpu()
        if str(x.dtype) == "torch.bfloat16":
            x = x.float()
        return x.numpy()
    return np.asarray(x)


def compare_with_reference(backend, q, k, v, g, *, mask=None, bias=None,
                           wrt=("q", "k", "v"), layout="bhsd", **mods):
    """``backend``'s forward + backward on NumPy inputs vs the float64 reference; every
    result within the dtype's tolerance (relative to max|ref| or the terms' magnitude,
    as the contract suite), dtypes as the contract says; with dropout, lse is the
    undropped one.  ``mods``: softcap, alibi_slopes, sinks, q_offset, k_offset,
    dropout_p, dropout_seed.  -> (out, lse, grads)."""
    import anyattn as aa
    from anyattn import reference as R

    dtype = str(q.dtype)
    out, lse = aa.attention(q, k, v, mask=mask, bias=bias, return_lse=True, layout=layout,
                            backend=backend, **mods)
    gr = aa.attention_backward(q, k, v, g, mask=mask, bias=bias, wrt=wrt, layout=layout,
                               backend=backend, **mods)
    if layout == "bshd":
        q, k, v, g = (x.swapaxes(1, 2) for x in (q, k, v, g))
        out = out.swapaxes(1, 2)
    ro, rl = R.forward(q, k, v, mask=mask, bias=bias, **mods)
    rg = R.backward(q, k, v, g, mask=mask, bias=bias, wrt=wrt, **mods)
    if mods.get("dropout_p"):           # lse is that of the undropped softmax
        plain = {n: x for n, x in mods.items() if not n.startswith("dropout")}
        np.testing.assert_array_equal(rl, R.forward(q, k, v, mask=mask, bias=bias, **plain)[1])
    mag = term_magnitudes(q, k, v, g, mask=mask, bias=bias, **mods)
    assert out.dtype == q.dtype and lse.dtype == np.float32
    assert_close(out, ro, dtype, "out", magnitude=mag["out"])
    fin = np.isfinite(rl)
    assert np.array_equal(np.isfinite(lse), fin), "lse: -inf exactly where the reference's"
    if fin.any():
        err = np.max(np.abs(lse[fin] - rl[fin]))
        assert err <= 10 * TOL[dtype] * max(1.0, np.abs(rl[fin]).max()), f"lse: {err:.3g}"
    for n in ("dq", "dk", "dv", "dbias", "dsinks"):
        ref, got = getattr(rg, n), getattr(gr, n)
        if ref is None:
            assert got is None, f"{n} computed though not requested"
            continue
        if layout == "bshd" and n in ("dq", "dk", "dv"):
            got = got.swapaxes(1, 2)
        want_dt = {"dbias": None if bias is None else bias.dtype,
                   "dsinks": None if mods.get("sinks") is None else mods["sinks"].dtype
                   }.get(n, q.dtype)
        assert got.shape == ref.shape and got.dtype == want_dt, (n, got.shape, got.dtype)
        assert_close(got, ref, dtype, n, magnitude=mag.get(n))
    return out, lse, gr


def np_mask(m):
    """The same mask with NumPy arrays (the float64 reference runs on NumPy)."""
    import anyattn as aa

    if m is None:
        return None
    if isinstance(m, aa.KeepMask):
        return aa.KeepMask(to_np(m.mask))
    if isinstance(m, aa.Documents):
        return aa.Documents(to_np(m.q_ids), to_np(m.k_ids))
    if hasattr(m, "terms"):
        out = None
        for t in m.terms:
            out = np_mask(t) if out is None else out & np_mask(t)
        return out
    return m


def torch_on(x, device, dtype=None):
    """A NumPy array as a torch tensor on ``device`` (optionally cast); None stays None."""
    import torch

    if x is None:
        return None
    t = torch.from_numpy(np.ascontiguousarray(x)).to(device)
    return t if dtype is None else t.to(dtype)


def make_qkv(rng, B, Hq, Hkv, Sq, Sk, D, dtype="float32", scale_v=1.0, Dv=None):
    """q, k [.., D] and v, dout [.., Dv] (Dv = D unless given)."""
    Dv = D if Dv is None else Dv
    q = rng.standard_normal((B, Hq, Sq, D))
    k = rng.standard_normal((B, Hkv, Sk, D))
    v = rng.standard_normal((B, Hkv, Sk, Dv)) * scale_v
    g = rng.standard_normal((B, Hq, Sq, Dv))
    return tuple(x.astype(dtype) for x in (q, k, v, g))


def exhaustive() -> bool:
    """True where the larger cases run: ``pytest --exhaustive`` or ANYATTN_EXHAUSTIVE=1
    (tests/conftest.py; docs/testing.md)."""
    return os.environ.get("ANYATTN_EXHAUSTIVE") == "1"


def examples(default: int, full: int) -> int:
    """A Hypothesis test's max_examples: ``default`` in the default run, ``full`` in the
    exhaustive one."""
    return full if exhaustive() else default


@dataclass
class Harness:
    """How a backend takes test inputs: array library, device, dtypes, sizes."""

    name: str
    kind: str            # 'numpy' | 'torch'
    device: str          # 'cpu' | 'cuda'
    dtypes: tuple        # float dtypes exercised by the suite
    small: bool          # interpreted / emulated: keep sizes tiny

    def put(self, x):
        if x is None or self.kind == "numpy":
            return x
        import torch

        if isinstance(x, np.ndarray) and x.dtype == bool:
            return torch.from_numpy(x).to(self.device)
        return torch.from_numpy(np.ascontiguousarray(x)).to(self.device)

    def put_mask(self, m):
        """Mask arrays live where the inputs live."""
        return self.put(m)


def harness_for(name: str) -> Harness:
    if name == "numpy":
        return Harness("numpy", "numpy", "cpu", ("float32", "float64"), small=False)
    if name == "reference":
        return Harness("reference", "numpy", "cpu", ("float32", "float64"), small=False)
    if name == "triton":
        import torch

        dev = "cuda" if torch.cuda.is_available() else "cpu"
        small = dev == "cpu" or os.environ.get("TRITON_INTERPRET") == "1"
        return Harness("triton", "torch", dev, ("float32",), small=small)
    if name == "webgpu":
        small = True
        try:
            from anyattn.backends.registry import get_backend

            be = get_backend("webgpu")
            small = bool(getattr(be, "is_cpu_adapter", lambda: True)())
        except Exception:
            pass
        return Harness("webgpu", "numpy", "cpu", ("float32",), small=small)
    raise KeyError(name)


# ------------------------------------------------ numerics at any magnitude (oracle)
def magnitude_oracle(q, k, v, g, bias, scale, keep):
    """Dense forward + backward in np.longdouble -> (results, magnitudes) in float64.

    Magnitudes: the largest sum of absolute terms behind an entry of each result (the
    rounding scale of a sum whose terms cancel)."""
    L = np.longdouble
    q, k, v, g = (x.astype(L) for x in (q, k, v, g))
    G = q.shape[1] // k.shape[1]
    ke, ve = np.repeat(k, G, axis=1), np.repeat(v, G, axis=1)
    s = np.einsum("bhid,bhjd->bhij", q, ke) * L(scale)
    if bias is not None:
        s = s + bias.astype(L)
    s = np.where(keep, s, L(-np.inf))
    m = s.max(axis=-1, keepdims=True)
    empty = ~np.isfinite(m)
    ms = np.where(empty, L(0), m)
    e = np.exp(s - ms)
    tot = e.sum(axis=-1, keepdims=True)
    p = np.where(empty, L(0), e / np.where(empty, L(1), tot))
    out = np.einsum("bhij,bhjd->bhid", p, ve)
    lse = np.where(empty, L(-np.inf), ms + np.log(np.where(empty, L(1), tot)))[..., 0]
    dp = np.einsum("bhid,bhjd->bhij", g, ve)
    delta = (g * out).sum(-1, keepdims=True)
    ds = p * (dp - delta)
    B, Hkv, Sk, D = k.shape
    res = dict(out=out, lse=lse,
               dq=L(scale) * np.einsum("bhij,bhjd->bhid", ds, ke),
               dk=(L(scale) * np.einsum("bhij,bhid->bhjd", ds, q)).reshape(
                   B, Hkv, G, Sk, D).sum(2),
               dv=np.einsum("bhij,bhid->bhjd", p, g).reshape(B, Hkv, G, Sk, D).sum(2))
    ads = p * (np.abs(dp) + np.abs(delta))
    mag = dict(out=np.einsum("bhij,bhjd->bhid", p, np.abs(ve)),
               lse=np.abs(np.where(np.isfinite(lse), lse, L(0))),
               dq=L(scale) * np.einsum("bhij,bhjd->bhid", ads, np.abs(ke)),
               dk=L(scale) * np.einsum("bhij,bhid->bhjd", ads, np.abs(q)),
               dv=np.einsum("bhij,bhid->bhjd", p, np.abs(g)))
    if bias is not None:
        red = tuple(a for a in range(4) if bias.shape[a] == 1)
        res["dbias"] = ds.sum(axis=red, keepdims=True)
        mag["dbias"] = ads.sum(axis=red, keepdims=True)
    return ({n: x.astype(np.float64) for n, x in res.items()},
            {n: float(np.max(x)) if x.size else 0.0 for n, x in mag.items()})


def torch_math_sdpa(q, k, v, g, bias, scale, keep):
    """PyTorch's math SDPA in the inputs' precision -> dict of float64 arrays."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    tq, tk, tv = (torch.from_numpy(x.copy()).requires_grad_() for x in (q, k, v))
    mask = torch.zeros(keep.shape, dtype=tq.dtype).masked_fill(
        torch.from_numpy(~keep), float("-inf"))
    tb = None
    if bias is not None:
        tb = torch.from_numpy(bias.copy()).requires_grad_()
        mask = mask + tb
    G = q.shape[1] // k.shape[1]
    with sdpa_kernel(SDPBackend.MATH):
        out = torch.nn.functional.scaled_dot_product_attention(
            tq, tk, tv, attn_mask=mask, scale=scale, enable_gqa=G > 1)
    out.backward(torch.from_numpy(g.copy()))
    ke = tk.detach().repeat_interleave(G, 1)
    s = (tq.detach() @ ke.transpose(-1, -2)) * scale + mask.detach()
    res = dict(out=out, lse=torch.logsumexp(s, -1), dq=tq.grad, dk=tk.grad, dv=tv.grad)
    if bias is not None:
        res["dbias"] = tb.grad
    return {n: x.detach().double().numpy() for n, x in res.items()}


def rel_to_terms(got, ref, magnitude: float = 0.0) -> float:
    """max|got - ref| / max(max|ref|, magnitude) over entries where ref is finite;
    got must be -inf exactly where ref is (empty rows' lse)."""
    got = np.asarray(got, np.float64)
    ref = np.asarray(ref, np.float64)
    fin = np.isfinite(ref)
    if not np.array_equal(np.isfinite(got) | np.isnan(got), fin | np.isnan(got)) or \
            not np.array_equal(got[~fin], ref[~fin]):
        return float("inf")
    if not fin.any():
        return 0.0
    d = np.max(np.abs(got[fin] - ref[fin]))
    if np.isnan(d):
        return float("inf")
    scale = max(float(np.max(np.abs(ref[fin]))), magnitude)
    return float(d / scale) if scale > 0 else float(d)


def load_gallery():
    """examples/gallery.py as a module (loaded once per process, kept in sys.modules
    as ``anyattn_gallery``): the score / mask function gallery every backend's tests run."""
    import importlib.util
    import sys

    mod = sys.modules.get("anyattn_gallery")
    if mod is None:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples",
                            "gallery.py")
        spec = importlib.util.spec_from_file_location("anyattn_gallery", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["anyattn_gallery"] = mod
        spec.loader.exec_module(mod)
    return mod
