"""Kernels by device and job: `cpu/` (the C source, its build, ctypes wrappers over raw tensors),
`triton/` (CUDA kernels in Triton), `tuning` (choices measured at start-up) and `select` (which
fused ops run for given tensors, typed by the `FusedOps` protocol). Kernels take tensors and
plain values; they import nothing above this package (only `kvflow.paths`)."""
