"""Backends: one contract (DESIGN.md §1), several machines.  See registry.py: which
arrays each backend could take is plain data there, checked before a backend (and
torch, triton or wgpu) is imported; automatic dispatch never moves host arrays to a GPU."""
