"""CUDA kernels in Triton, a file per job: PDL plumbing, the small fused ops, the one-row
projections, the greedy argmax, paged attention. Imported only where CUDA runs (triton is absent
from CPU installs)."""
