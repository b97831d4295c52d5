"""The Hopper path of the Triton backend: Gluon kernels (TMA + mbarrier rings, warpgroup
MMA) for sm_90, 16-bit inputs, chosen by the coverage table (coverage.py) as data;
everything else runs on the portable kernels beside it.

Modules: fwd_ws_kernel (the warp-specialised forward, one program per query tile),
fwd_persist_kernel (the same loop, one program per SM on a host-built schedule),
fwd_masks (the forward's tile softmax and array masks), bwd_ws_kernel (dK/dV),
bwd_ws_dq_kernel / bwd_ws_t_kernel (dK, dV and dQ inside; bwd_ws_parts /
bwd_ws_t_parts their partitions), bwd_dq_convert (dq from the fp32 accumulator),
tile_ranges (which tiles a program visits), dq_turns (the fixed dQ add order) -- Gluon /
Triton kernels only; launch (descriptors, grids), configs (the routed tiles), coverage
(what is covered, why not, what 'auto' routes).  Importing this package imports
neither torch nor triton.
"""
__all__ = ["coverage", "configs"]
