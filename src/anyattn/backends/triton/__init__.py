"""The ``triton`` backend: fused attention forward and backward for torch CUDA tensors
(and CPU tensors under ``TRITON_INTERPRET=1``).

kernels.py  @triton.jit kernels only
launch.py   layouts, strides, dtypes, mask tile lists, grids
configs.py  frozen tile configs, heuristics, autotuning, the fixed test plan
backend.py  TritonBackend: capabilities, availability, refusals, dispatch

Nothing here imports torch or triton at package import time; backend.py does so lazily.
"""
