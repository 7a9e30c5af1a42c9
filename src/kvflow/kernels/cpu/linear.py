"""The native bf16 linear kernel over weights packed for it (see csrc/cpu_kernels.c)."""

from __future__ import annotations

import torch

from kvflow.kernels.cpu.build import library, native_available

COLUMN_TILE = 32  # NB in csrc/cpu_kernels.c


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The native kernel's layout of a bf16 CPU weight [N, K] (see csrc/cpu_kernels.c):
    [ceil(N / 32), K / 2, 32, 2], output columns zero-padded to a multiple of 32. None where the
    kernel does not apply (another dtype or device, odd K, or no native library)."""
    out_features, in_features = weight.shape
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or in_features % 2:
        return None
    if not native_available():
        return None
    tiles = -(-out_features // COLUMN_TILE)
    padded = weight.new_zeros(tiles * COLUMN_TILE, in_features)
    padded[:out_features] = weight
    packed = padded.view(tiles, COLUMN_TILE, in_features // 2, 2).transpose(1, 2)
    return packed.contiguous()


def packed_rows(packed: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Rows `ids` of the weight `packed` holds (`pack_linear_weight`'s layout), as [*ids.shape,
    K]: a tied embedding's lookups read the logits head's packing, the one copy kept."""
    flat = ids.reshape(-1)
    rows = packed[flat // COLUMN_TILE, :, flat % COLUMN_TILE]  # [n, K / 2, 2]
    return rows.reshape(*ids.shape, -1)


def bf16_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None,
    out_features: int,
    out_dtype: torch.dtype = torch.bfloat16,
) -> torch.Tensor:
    """x [M, K] @ weight.T (+ bias) -> [M, out_features], bf16 on the CPU, through the weight
    packed by `pack_linear_weight`. `out_dtype` float32: the float32 sums as they are, unrounded
    (the logits head's)."""
    lib = library()
    assert lib is not None, "pack_linear_weight returns None without the library"
    x = x.contiguous()
    rows, inner = x.shape
    out = torch.empty(rows, out_features, dtype=out_dtype)
    kernel = lib.kvflow_bf16_linear_f32 if out_dtype == torch.float32 else lib.kvflow_bf16_linear
    kernel(
        x.data_ptr(),
        packed.data_ptr(),
        None if bias is None else bias.data_ptr(),
        out.data_ptr(),
        rows,
        out_features,
        inner,
    )
    return out
