"""Backends: one contract (DESIGN.md §1), several machines.  See registry.py."""
