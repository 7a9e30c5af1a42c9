"""Quantized weights in the layout the native quantized kernels read (csrc/quant_kernels.c).

A weight [N, K] is cut along K in groups of `group` columns; w[n, k] = scales[n, g] * code[n, k]
+ mins[n, g] with g = k // group, scales and mins float32, or both float16 where every one of
them is exact in float16 (GGUF's Q8_0, Q4_0 and Q4_1 store theirs so: fewer bytes a decode step
reads, the same values). `bits` 8: one int8 code per column;
`bits` 4: two unsigned codes a byte, each 32 columns c.. in 16 bytes (byte i: column c + i low,
c + 16 + i high), which is how GGUF's Q4_0 and Q4_1 blocks hold them already.

GGUF block types map onto it exactly (every scale and min is a float16 times a small integer,
exact in float32): Q8_0 -> 8 bits, group 32; Q4_0, Q4_1, Q4_K -> 4 bits, group 32; Q5_0, Q5_1,
Q5_K -> 8 bits, group 32; Q6_K -> 8 bits, group 16. (llama.cpp's K-quant files hold Q5_0, Q5_1 or
Q8_0 tensors where a row is not whole 256-column super-blocks.) `quantize_int8` makes the int8 weight-only format of
`--quantization int8`: one group per row (per-output-channel scales), no offset.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

GGUF_TYPES = ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")


@dataclass
class QuantizedWeight:
    codes: torch.Tensor  # uint8 [N, K // 2] (bits 4) or [N, K] (bits 8: int8 bit patterns)
    scales: torch.Tensor  # float32 or float16 [N, K // group]
    mins: torch.Tensor  # scales' dtype [N, K // group]
    bits: int
    group: int
    in_features: int
    kind: str  # where it came from: a GGUF type name or "int8"

    def __post_init__(self) -> None:
        dtypes = (self.scales.dtype, self.mins.dtype)
        if dtypes not in ((torch.float32,) * 2, (torch.float16,) * 2):
            raise ValueError(f"scales and mins must be both float32 or both float16, got {dtypes}")

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @functools.cached_property
    def has_mins(self) -> bool:
        """Whether any offset is nonzero (Q8_0, Q6_K and int8 have none)."""
        return bool(self.mins.any())

    @functools.cached_property
    def offset(self) -> int:
        """8 where every min is -8 x its scale (GGUF's Q4_0: w = scale x (code - 8)), else 0:
        the int8 kernel then reads the scales alone."""
        return 8 if self.bits == 4 and torch.equal(self.mins, self.scales * -8) else 0

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales, self.mins))

    def int_codes(self) -> torch.Tensor:
        """The codes as int16 [N, K] (unpacked)."""
        if self.bits == 8:
            return self.codes.view(torch.int8).to(torch.int16)
        n, k = self.out_features, self.in_features
        packed = self.codes.view(n, k // 32, 16).to(torch.int16)
        return torch.cat((packed & 15, packed >> 4), dim=2).reshape(n, k)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The weight [N, K] (computed in float64, then rounded once to `dtype`)."""
        codes = self.int_codes().double()
        scales = self.scales.double().repeat_interleave(self.group, dim=1)
        mins = self.mins.double().repeat_interleave(self.group, dim=1)
        return (codes * scales + mins).to(dtype)

    def widened(self, bits: int, group: int) -> QuantizedWeight:
        """The same values with `bits` >= self.bits and a `group` dividing self.group."""
        if bits < self.bits or self.group % group:
            raise ValueError(f"cannot hold {self.bits}-bit/{self.group} as {bits}-bit/{group}")
        codes = self.codes
        if bits != self.bits:
            codes = self.int_codes().to(torch.int8).view(torch.uint8)
        repeat = self.group // group
        scales = self.scales.repeat_interleave(repeat, dim=1)
        mins = self.mins.repeat_interleave(repeat, dim=1)
        return QuantizedWeight(codes, scales, mins, bits, group, self.in_features, self.kind)

    def rows(self, index: torch.Tensor) -> QuantizedWeight:
        """Rows `index` of the weight, in that order."""
        pick = [t.index_select(0, index).contiguous() for t in (self.codes, self.scales, self.mins)]
        return QuantizedWeight(*pick, self.bits, self.group, self.in_features, self.kind)

    def row_range(self, start: int, count: int) -> QuantizedWeight:
        """Rows [start, start + count), those past the weight's end zero (codes, scales and mins
        zero: the value 0, as a padded vocabulary shard's rows are). Copies: the whole weight's
        memory is not held by the part."""
        parts = []
        for t in (self.codes, self.scales, self.mins):
            part = t[start : start + count]
            padding = t.new_zeros((count - part.shape[0], t.shape[1]))
            parts.append(torch.cat((part, padding)))
        return QuantizedWeight(*parts, self.bits, self.group, self.in_features, self.kind)

    def columns(self, start: int, count: int) -> QuantizedWeight:
        """Input columns [start, start + count): the same values, cut at whole groups and whole
        32-column blocks (the 4-bit codes' unit and every kernel's K). A GGUF K-quant's
        256-column super-block needs no boundary here: repacking folds its scale into each
        32-column group's. ValueError naming the type and the split otherwise."""
        unit = math.lcm(32, self.group)
        if start % unit or count % unit or start + count > self.in_features:
            raise ValueError(
                f"{self.kind} weight: columns {start}..{start + count} of {self.in_features} "
                f"do not fall on its {unit}-column blocks"
            )
        per_byte = 2 if self.bits == 4 else 1
        first, last = start // self.group, (start + count) // self.group
        parts = (
            self.codes[:, start // per_byte : (start + count) // per_byte],
            self.scales[:, first:last],
            self.mins[:, first:last],
        )  # copied: the whole weight's memory is not held by the part
        codes, scales, mins = (t.clone(memory_format=torch.contiguous_format) for t in parts)
        return QuantizedWeight(codes, scales, mins, self.bits, self.group, count, self.kind)

    @staticmethod
    def cat(parts: list[QuantizedWeight]) -> QuantizedWeight:
        """The parts stacked along the output dim (a fused q|k|v or gate|up): each widened to
        the most bits and the smallest group among them, which holds every value exactly."""
        if len({p.in_features for p in parts}) != 1:
            raise ValueError("fused quantized weights need one input size")
        bits, group = max(p.bits for p in parts), min(p.group for p in parts)
        parts = [p.widened(bits, group) for p in parts]
        kinds = sorted({p.kind for p in parts})
        half = all(p.scales.dtype == torch.float16 for p in parts)
        dtype = torch.float16 if half else torch.float32
        codes = torch.cat([p.codes for p in parts])
        scales, mins = (
            torch.cat([getattr(p, f).to(dtype) for p in parts]) for f in ("scales", "mins")
        )
        return QuantizedWeight(
            codes, scales, mins, bits, group, parts[0].in_features, "+".join(kinds)
        )


def quantize_int8(weight: torch.Tensor, row_max: torch.Tensor | None = None) -> QuantizedWeight:
    """Symmetric int8 with one float32 scale per output row: max |w| of the row maps to 127.
    `row_max` [N]: each row's max |w| when `weight` holds only some of the row's columns (a
    row-parallel shard), so that the codes and scales are those of the whole weight."""
    w = weight.detach().float()
    n, k = w.shape
    if k % 32:
        raise ValueError(f"int8 quantization needs an input size divisible by 32, got {k}")
    amax = w.abs().amax(dim=1, keepdim=True) if row_max is None else row_max.float().view(n, 1)
    scale = amax / 127.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(w / scale).clamp_(-127, 127).to(torch.int8).view(torch.uint8)
    return QuantizedWeight(codes, scale, torch.zeros_like(scale), 8, k, k, "int8")


def _f16(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def _pack4(codes: np.ndarray) -> np.ndarray:
    """Codes [N, K] in 0..15 -> [N, K // 2] bytes in the 32-column nibble layout."""
    n, k = codes.shape
    c = codes.reshape(n, k // 32, 2, 16).astype(np.uint8)
    return (c[:, :, 0] | (c[:, :, 1] << 4)).reshape(n, k // 2)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The 8 six-bit (scale, min) pairs of a Q4_K/Q5_K super-block from its 12 bytes [..., 12]."""
    s = s.astype(np.uint8)
    sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], -1)
    mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], -1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _q8_0(b: np.ndarray, n: int) -> tuple:
    d = _f16(b[..., 0:2])
    return b[..., 2:].view(np.int8).reshape(n, -1).view(np.uint8), d, np.zeros_like(d), 8, 32


def _q4_0(b: np.ndarray, n: int) -> tuple:
    d = _f16(b[..., 0:2])
    return b[..., 2:].reshape(n, -1), d, -8.0 * d, 4, 32


def _q4_1(b: np.ndarray, n: int) -> tuple:
    return b[..., 4:].reshape(n, -1), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 4, 32


def _q5_codes(b: np.ndarray, n: int) -> np.ndarray:
    """Q5_0/Q5_1's 5-bit codes (0..31) [n, K] from a block's 4 bytes of high bits (bit j of a
    little-endian uint32: column j's) and 16 of low nibbles (byte i: columns i and i + 16)."""
    qh = np.ascontiguousarray(b[..., :4]).view("<u4")  # [n, blocks, 1]
    high = (qh >> np.arange(32, dtype=np.uint32)) & 1  # [n, blocks, 32]
    qs = b[..., 4:]
    low = np.concatenate([qs & 15, qs >> 4], axis=-1)
    return (low | (high.astype(np.uint8) << 4)).reshape(n, -1)


def _q5_0(b: np.ndarray, n: int) -> tuple:
    d = _f16(b[..., 0:2])
    codes = (_q5_codes(b[..., 2:], n).astype(np.int16) - 16).astype(np.int8).view(np.uint8)
    return codes, d, np.zeros_like(d), 8, 32


def _q5_1(b: np.ndarray, n: int) -> tuple:
    return _q5_codes(b[..., 4:], n), _f16(b[..., 0:2]), _f16(b[..., 2:4]), 8, 32


def _k_common(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    sc, mn = _k_scales(b[..., 4:16])
    d, dmin = _f16(b[..., 0:2])[..., None], _f16(b[..., 2:4])[..., None]
    n = b.shape[0]
    return (d * sc).reshape(n, -1), (-(dmin * mn)).reshape(n, -1)


def _q4_k(b: np.ndarray, n: int) -> tuple:
    qs = b[..., 16:144].reshape(n, -1, 4, 1, 32)
    codes = np.concatenate([qs & 15, qs >> 4], axis=3).reshape(n, -1)
    return (_pack4(codes), *_k_common(b), 4, 32)


def _q5_k(b: np.ndarray, n: int) -> tuple:
    qh = b[..., 16:48].reshape(n, -1, 1, 1, 32)
    qs = b[..., 48:176].reshape(n, -1, 4, 1, 32)
    shift = (2 * np.arange(4)).reshape(1, 1, 4, 1, 1).astype(np.uint8)
    lo = (qs & 15) | (((qh >> shift) & 1) << 4)
    hi = (qs >> 4) | (((qh >> (shift + 1)) & 1) << 4)
    codes = np.concatenate([lo, hi], axis=3).reshape(n, -1)
    return (codes.astype(np.uint8), *_k_common(b), 8, 32)


def _q6_k(b: np.ndarray, n: int) -> tuple:
    ql = b[..., 0:128].reshape(n, -1, 2, 2, 32)  # [half][first|second 32 bytes]
    qh = b[..., 128:192].reshape(n, -1, 2, 1, 32)
    shift = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(1, 1, 1, 4, 1)
    low = np.concatenate([ql & 15, ql >> 4], axis=3)  # columns 0, 32, 64, 96 of a half
    codes = (low | (((qh >> shift) & 3) << 4)).astype(np.int16) - 32
    scales = b[..., 192:208].view(np.int8).astype(np.float32) * _f16(b[..., 208:210])[..., None]
    codes = codes.astype(np.int8).reshape(n, -1).view(np.uint8)
    return codes, scales.reshape(n, -1), np.zeros((n, scales.size // n), np.float32), 8, 16


_PARSERS = {
    "Q8_0": (34, 32, _q8_0),
    "Q4_0": (18, 32, _q4_0),
    "Q4_1": (20, 32, _q4_1),
    "Q5_0": (22, 32, _q5_0),
    "Q5_1": (24, 32, _q5_1),
    "Q4_K": (144, 256, _q4_k),
    "Q5_K": (176, 256, _q5_k),
    "Q6_K": (210, 256, _q6_k),
}


def from_gguf_blocks(raw: np.ndarray, kind: str, in_features: int) -> QuantizedWeight:
    """A GGUF tensor's blocks (uint8 [N, bytes per row], as gguf's reader gives them) of block
    type `kind` -> the kernels' layout, holding exactly the values the blocks hold."""
    if kind not in _PARSERS:
        raise ValueError(
            f"GGUF tensor type {kind} is not supported by the quantized kernels (supported: "
            f"{', '.join(GGUF_TYPES)}); serve it with --quantization none (dequantized)"
        )
    block_bytes, block_cols, parse = _PARSERS[kind]
    if in_features % block_cols:
        raise ValueError(f"{kind} rows of {in_features} columns are not whole blocks")
    n = raw.shape[0]
    blocks = np.ascontiguousarray(raw, dtype=np.uint8).reshape(n, -1, block_bytes)
    codes, scales, mins, bits, group = parse(blocks, n)
    scales, mins = _narrowest(
        np.ascontiguousarray(scales, np.float32).reshape(n, -1),
        np.ascontiguousarray(mins, np.float32).reshape(n, -1),
    )
    tensors = (torch.from_numpy(np.ascontiguousarray(a)) for a in (codes, scales, mins))
    return QuantizedWeight(*tensors, bits, group, in_features, kind)


def _narrowest(scales: np.ndarray, mins: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Both as float16 when every value survives the round trip (finite and exact), else both
    float32: the kernels read either, and the narrower is fewer bytes a step."""
    with np.errstate(over="ignore"):
        narrow = [a.astype(np.float16) for a in (scales, mins)]
    exact = all(
        np.array_equal(h.astype(np.float32), a) for h, a in zip(narrow, (scales, mins), strict=True)
    )
    return tuple(narrow) if exact else (scales, mins)
