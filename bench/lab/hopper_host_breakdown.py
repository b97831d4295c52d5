"""Per-piece host us of the Hopper routes' raw step on the CPU (bench/lab/host_overhead.py's
setup: kernels no-op, or with --launcher Triton's launcher front for sm_90), each piece
timed alone at the step's own arguments, B=4 H=16 S=2048 D=128 bf16; medians of 7 rounds.
CPU torch.empty of a 32 MB tensor is an mmap (~13 us), not the CUDA caching allocator.

    python bench/lab/hopper_host_breakdown.py [--causal] [--launcher]
"""
import os, sys, time, statistics, timeit
sys.argv = ['x'] + sys.argv[1:]
causal = '--causal' in sys.argv
launcher = '--launcher' in sys.argv
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import host_overhead as HO
import torch, anyattn, triton
from anyattn.backends.triton import launch as L
from anyattn.backends.triton.backward import stat_plane
from anyattn.backends.triton.device_ctx import on_device
from anyattn.backends.triton.operands import unit_last
from anyattn.backends.triton.hopper import launch as HL
from anyattn.problem import describe
HO._stub_kernels(launcher)
HO._route_hopper(True, True, launcher)
B,H,S,D = 4,16,2048,128
q = torch.randn(B,H,S,D,dtype=torch.bfloat16); k=torch.randn_like(q); v=torch.randn_like(q); g=torch.randn_like(q)
mask = anyattn.Causal() if causal else None
pf = describe(q,k,v,mask=mask); pb = describe(q,k,v,dout=g,mask=mask,wrt=("q","k","v"))
out, st = L.forward(pf,q,k,v,None)
L.backward(pb,q,k,v,g,out,st,None)
pr = L.prepared.prepare("forward", pf, None, None, (("q", q), ("k", k), ("v", v)), None)
fl = pr.hfwd
cfg = L.prepared.prepare("backward", pb, None, None, (("q", q), ("k", k), ("v", v), ("dout", g)), None).hcfg
dk = torch.empty_like(k); dv = torch.empty_like(v); dq = torch.empty_like(q)
l2 = torch.empty((B,H,2,S)); delta = torch.empty((B,H,S))
def T(name, fn, n=2000):
    for _ in range(50): fn()
    r = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(n): fn()
        r.append((time.perf_counter() - t) / n * 1e6)
    print(f"{name:45s} {statistics.median(r):7.2f} us")
T("raw step (L.forward + L.backward)", lambda: (L.forward(pf,q,k,v,None), L.backward(pb,q,k,v,g,out,st,None)), 300)
T("L.forward", lambda: L.forward(pf,q,k,v,None), 500)
T("L.backward", lambda: L.backward(pb,q,k,v,g,out,st,None), 500)
T("  _prepare fwd", lambda: L.prepared.prepare("forward", pf, None, None, (("q", q), ("k", k), ("v", v)), None))
T("  _prepare bwd", lambda: L.prepared.prepare("backward", pb, None, None, (("q", q), ("k", k), ("v", v), ("dout", g)), None))
T("  FwdLaunch.__call__", lambda: fl(q,k,v,p=pf), 500)
T("  FwdLaunch.mask_args", lambda: fl.mask_args(q, pf))
T("  make_desc", lambda: HL.make_desc(q, 64))
T("  desc_key", lambda: HL.desc_key(q, 64))
T("  torch.empty 32MB bf16", lambda: torch.empty((B,H,S,D), dtype=torch.bfloat16), 500)
T("  torch.empty stats", lambda: torch.empty((2,B,H,S)), 500)
T("  torch.zeros sem", lambda: torch.zeros((B*H*16,), dtype=torch.int32), 500)
T("  RowStats(stats[0], stats[1])", lambda: (out, out[0], out[1]))
T("  triton.cdiv", lambda: triton.cdiv(S, 64))
T("  backward_config", lambda: L.prepared.prepare("backward", pb, None, None, (("q", q), ("k", k), ("v", v), ("dout", g)), None).hcfg)
T("  dq_order", lambda: HL.dq_order(pb, 128, 64))
T("  _bwd_checks", lambda: HL._bwd_checks(pb, q, l2, delta, dk, dv, dq, True))
T("  _dq_tiles_all_visited", lambda: HL._dq_tiles_all_visited(S,S,0,2**30,64,128))
T("  backward_fused", lambda: HL.backward_fused(pb, q,k,v,g,l2,delta,dq,dk,dv,cfg=cfg), 500)
T("  _stat_plane", lambda: stat_plane(st.max, q.device))
T("  _unit_last", lambda: unit_last(q))
T("  on_device(cpu)", lambda: on_device(q.device))
if launcher:
    recs = []
    orig = HO._LauncherFront._front
    def rec(self, *a, **kw):
        recs.append((self, a, dict(kw)))
        return orig(self, *a, **kw)
    HO._LauncherFront._front = rec
    L.forward(pf,q,k,v,None); L.backward(pb,q,k,v,g,out,st,None)
    HO._LauncherFront._front = orig
    tot = 0
    for self, a, kw in recs:
        name = self.fn.fn.__name__ if hasattr(self.fn, 'fn') else str(self.fn)
        for _ in range(100): orig(self, *a, **dict(kw))
        r=[]
        for _ in range(7):
            t=time.perf_counter()
            for _ in range(2000): orig(self, *a, **dict(kw))
            r.append((time.perf_counter()-t)/2000*1e6)
        m = statistics.median(r); tot += m
        nd = sum(type(x).__name__ == 'TensorDescriptor' for x in a)
        print(f"  launcher front {name:22s} {len(a):3d} pos ({nd} descs) {len(kw):2d} kw {m:7.2f} us")
    print(f"  launcher fronts per step {tot:.1f} us")
    # binder alone vs key
    from triton.runtime import jit as J
    self, a, kw = max(recs, key=lambda r: len(r[1]))
    kw2 = dict(kw); kw2["debug"] = False; kw2["instrumentation_mode"] = J.knobs.compilation.instrumentation_mode
    T("  binder alone (largest)", lambda: self.binder(*a, **kw2))
    b, spec, opts = self.binder(*a, **kw2)
    T("  compute_cache_key (largest)", lambda: J.compute_cache_key(self.key_cache, spec, opts))
    T("  tuple(spec) hash", lambda: hash((tuple(spec), str(opts))))
    T("  str(options)", lambda: str(opts))
    print(len(spec), opts)
