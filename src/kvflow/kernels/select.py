"""Which kernels run for given tensors: the fused small ops and the one-row projections, typed
by the protocols they implement (a module of functions satisfies them)."""

from __future__ import annotations

from typing import Protocol

import torch


class FusedOps(Protocol):
    """The fused small ops, rounded as transformers' eager ops round (see kernels.triton.ops)."""

    def rms_norm(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor: ...

    def rotary_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor: ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor: ...


class OneRowOps(FusedOps, Protocol):
    """FusedOps plus the one-row projections of a batch-1 decode step (kernels.triton.gemv)."""

    def gemv(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        config: dict | None = None,
        out_dtype: torch.dtype | None = None,
        gated: bool = False,
    ) -> torch.Tensor: ...

    def rms_norm_gemv(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        config: dict | None = None,
        gated: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


def fused_ops(*tensors: torch.Tensor) -> FusedOps | None:
    """The fused small ops (`rms_norm`, `rotary_`, `silu_mul`) for these tensors: the Triton
    kernels on CUDA, the native kernels for bf16 on the CPU; None: torch's ops."""
    if tensors[0].is_cuda:
        from kvflow.kernels.triton import ops  # triton is only installed with CUDA

        return ops
    from kvflow.kernels.cpu import ops as cpu_ops

    return cpu_ops if cpu_ops.applies(*tensors) else None


def one_row_ops(x: torch.Tensor) -> OneRowOps | None:
    """The Triton kernels for one row on CUDA (a decode step at batch 1), whose one-row
    projections (`gemv`, and `rms_norm_gemv` with the norm inside) may beat cuBLAS; else None."""
    if not (x.is_cuda and x.shape[0] == 1):
        return None
    from kvflow.kernels.triton import gemv

    return gemv
