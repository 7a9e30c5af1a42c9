"""CPU kernels: the C source (csrc/), its build and cache (build.py), and ctypes wrappers over
raw tensors by job (linear, attention, ops)."""
