"""The Hopper path of the Triton backend: Gluon kernels (TMA + mbarrier rings, warpgroup
MMA) for sm_90, 16-bit inputs, chosen by the coverage table (coverage.py) as data;
everything else runs on the portable kernels beside it.

Modules: fwd_ws_kernel (the warp-specialised forward), fwd_kernel (the plain forward),
bwd_kernel (dK/dV) -- Gluon kernels only; launch (descriptors, grids), configs (tiles),
coverage (what is covered, why not, what 'auto' routes), offline (compile for sm_90a
without a GPU, count HGMMA / UTMALDG / setmaxnreg).  Importing this package imports
neither torch nor triton.
"""
__all__ = ["coverage", "configs"]
