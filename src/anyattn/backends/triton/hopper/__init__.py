"""The Hopper path of the Triton backend: Gluon kernels (TMA + mbarrier rings, warpgroup
MMA) for sm_90, 16-bit inputs, chosen by the coverage table (coverage.py) as data;
everything else runs on the portable kernels beside it.

Modules: fwd_kernel (Gluon kernels only), launch (descriptors, grids), configs (tiles),
coverage (what is covered, why not), offline (compile for sm_90a without a GPU, count
HGMMA / UTMALDG).  Importing this package imports neither torch nor triton.
"""
__all__ = ["coverage", "configs"]
