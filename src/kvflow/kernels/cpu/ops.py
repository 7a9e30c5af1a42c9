"""The native fused small ops on the CPU (bf16): add + RMSNorm, rotary in place, SiLU-and-mul;
and the greedy tokens of float32 logits."""

from __future__ import annotations

import torch

from kvflow.kernels.cpu import build
from kvflow.kernels.cpu.build import library


def applies(*tensors: torch.Tensor) -> bool:
    """Whether the native small ops apply: every tensor bf16 on the CPU and the library loaded."""
    ok = all(t.dtype == torch.bfloat16 and t.device.type == "cpu" for t in tensors)
    return ok and build.native_available()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm over the last dim of x [..., D] as transformers rounds it; with `residual`
    (contiguous, x's shape), normalises x + residual and stores that sum into `residual`."""
    lib = library()
    assert lib is not None, "check applies() first"
    x = x.contiguous()
    out = torch.empty_like(x)
    res = None if residual is None else residual.data_ptr()
    dim = x.shape[-1]
    lib.kvflow_rms_norm(
        x.data_ptr(), res, weight.data_ptr(), eps, out.data_ptr(), x.numel() // dim, dim
    )
    return out


def rotary_(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [T, H, D] in place (rows may be strided, heads packed); cos/sin [T, 1, D] bf16,
    rows may be strided too (`RotaryEmbedding` gives views of one [T, 2, D] block: no copy)."""
    lib = library()
    assert lib is not None, "check applies() first"
    assert x.stride(2) == 1 and x.stride(1) == x.shape[2], "heads must be packed"
    tokens, heads, dim = x.shape
    cos, sin = (t.reshape(tokens, dim) for t in (cos, sin))
    cos, sin = (t if t.stride(1) == 1 else t.contiguous() for t in (cos, sin))
    lib.kvflow_rotary(
        x.data_ptr(), x.stride(0), tokens, heads, dim,
        cos.data_ptr(), cos.stride(0), sin.data_ptr(), sin.stride(0),
    )  # fmt: skip
    return x


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2I] (gate | up) -> [T, I], rounded as torch does."""
    lib = library()
    assert lib is not None, "check applies() first"
    gate_up = gate_up.contiguous()
    tokens, width = gate_up.shape
    out = gate_up.new_empty(tokens, width // 2)
    lib.kvflow_silu_mul(gate_up.data_ptr(), out.data_ptr(), tokens, width // 2)
    return out


def row_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(argmax int64 [B], max float32 [B]) of each row of float32 or bf16 logits [B, V] on the
    CPU: the first index of the row's maximum, a NaN counting as the maximum (torch.argmax's
    answer)."""
    lib = library()
    assert lib is not None, "check build.native_available() first"
    assert logits.dtype in (torch.float32, torch.bfloat16), logits.dtype
    logits = logits.contiguous()
    batch, vocab = logits.shape
    argmax = torch.empty(batch, dtype=torch.int64)
    row_max = torch.empty(batch, dtype=torch.float32)
    bf16 = int(logits.dtype == torch.bfloat16)
    lib.kvflow_row_argmax(
        logits.data_ptr(), batch, vocab, bf16, argmax.data_ptr(), row_max.data_ptr()
    )
    return argmax, row_max
