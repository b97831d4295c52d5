"""The integer cdiv of hopper/launch.py against triton.cdiv (the code before 301c80b), in
one process, 30 rounds alternating (cross-process runs of host_overhead.py --compare
vary by +-10 us on a shared 2-core CPU): us per raw Hopper-route step, kernels no-op.

    python bench/lab/hopper_cdiv_ab.py B,H,S,D [causal]
"""
import os
import sys, time, statistics
shape = sys.argv[1]; causal = len(sys.argv) > 2
sys.argv = ['x', '--shape', shape, '--hopper']
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import host_overhead as HO
import torch, anyattn, triton
from anyattn.backends.triton import launch as L
from anyattn.backends.triton.hopper import launch as HL
from anyattn.problem import describe
HO._stub_kernels(False); HO._route_hopper(True, True, False)
B, H, S, D = map(int, shape.split(','))
q = torch.randn(B,H,S,D,dtype=torch.bfloat16); k=torch.randn_like(q); v=torch.randn_like(q); g=torch.randn_like(q)
mask = anyattn.Causal() if causal else None
pf = describe(q,k,v,mask=mask); pb = describe(q,k,v,dout=g,mask=mask,wrt=("q","k","v"))
out, st = L.forward(pf,q,k,v,None)
new_cdiv = HL._cdiv
def raw(): L.forward(pf,q,k,v,None); L.backward(pb,q,k,v,g,out,st,None)
res = {"old": [], "new": []}
for r in range(30):
    for tag in (("old", "new") if r % 2 else ("new", "old")):
        HL._cdiv = triton.cdiv if tag == "old" else new_cdiv
        for _ in range(20): raw()
        t = time.perf_counter()
        for _ in range(200): raw()
        res[tag].append((time.perf_counter() - t) / 200 * 1e6)
d = statistics.median(b - a for a, b in zip(res["old"], res["new"]))
print(shape, "causal" if causal else "", {t: round(statistics.median(x), 1) for t, x in res.items()}, "paired diff", round(d, 1))
