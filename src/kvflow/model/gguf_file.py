"""A GGUF file read in place: its key/value header and tensor infos parsed here, its tensor data
memory-mapped and handed out one tensor at a time, as stored (never a copy of the whole model).

Layout (little endian): magic "GGUF", u32 version, u64 tensor count, u64 kv count; per kv a
u64-length key, a u32 value type and the value; per tensor a u64-length name, u32 dims, u64
per dim (innermost first), u32 type, u64 offset into the data, which starts at the next
multiple of `general.alignment` (32 when unset). gguf's own GGUFReader parses every value of
the header into numpy objects (seconds for a tokenizer's 150k strings); this reads what it needs.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# GGUF value types with a fixed size: struct format per type id (8 = string, 9 = array).
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
FLOAT_KINDS = ("F32", "F16", "BF16")  # the GGML types that hold plain floats
_DEQUANTIZE_ROWS = 4096  # rows dequantized at once: the float32 scratch stays small


@dataclass(frozen=True)
class GgufTensor:
    name: str
    kind: str  # the GGML type's name: F32, F16, BF16, Q8_0, Q4_K, ...
    shape: tuple[int, ...]  # torch order: rows first, the stored innermost dimension last
    offset: int  # absolute, in the file
    nbytes: int

    @property
    def is_float(self) -> bool:
        return self.kind in FLOAT_KINDS

    @property
    def numel(self) -> int:
        n = 1
        for dim in self.shape:
            n *= dim
        return n


class GgufFile:
    """The header of `path` (scalars and strings; arrays are skipped) and its tensors, whose
    bytes `blocks` maps on demand."""

    def __init__(self, path: Path) -> None:
        import gguf  # numpy only; the type names and block sizes

        self.path = Path(path)
        self.metadata: dict[str, Any] = {}
        self.tensors: dict[str, GgufTensor] = {}
        with open(self.path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ValueError(f"{self.path} is not a GGUF file")
            _version, tensor_count, kv_count = struct.unpack("<IQQ", f.read(20))
            for _ in range(kv_count):
                key = _read_string(f)
                value = _read_value(f, struct.unpack("<I", f.read(4))[0])
                if value is not _SKIPPED:
                    self.metadata[key] = value
            infos = []
            for _ in range(tensor_count):
                name = _read_string(f)
                (n_dims,) = struct.unpack("<I", f.read(4))
                dims = struct.unpack(f"<{n_dims}Q", f.read(8 * n_dims))
                kind_id, offset = struct.unpack("<IQ", f.read(12))
                infos.append((name, dims, kind_id, offset))
            align = int(self.metadata.get("general.alignment", 32))
            start = -(-f.tell() // align) * align
        for name, dims, kind_id, offset in infos:
            kind = gguf.GGMLQuantizationType(kind_id)
            block, size = gguf.GGML_QUANT_SIZES[kind]
            count = 1
            for dim in dims:
                count *= dim
            shape = tuple(reversed(dims))
            self.tensors[name] = GgufTensor(
                name, kind.name, shape, start + offset, count // block * size
            )

    def blocks(self, name: str) -> np.ndarray:
        """Tensor `name`'s stored bytes, mapped, as [rows, bytes a row] (uint8); a float type
        comes back in its own dtype and shape. Each tensor is a mapping of its own, gone with
        the array: the file's pages a load has read stop counting as this process's memory
        once the tensor is repacked or dequantized."""
        info = self.tensors[name]
        raw = np.memmap(self.path, dtype=np.uint8, mode="r", offset=info.offset, shape=info.nbytes)
        if info.kind in ("F32", "F16"):
            return raw.view(np.float32 if info.kind == "F32" else np.float16).reshape(info.shape)
        if info.kind == "BF16":
            return raw.view(np.uint16).reshape(info.shape)
        rows = info.numel // info.shape[-1]
        return raw.reshape(rows, info.nbytes // rows)

    def dequantize(self, name: str, dtype: Any) -> Any:
        """Tensor `name` as a torch tensor of `dtype`, dequantized (gguf's reference numpy
        code) a few thousand rows at a time into the result."""
        import gguf
        import torch

        info = self.tensors[name]
        data = self.blocks(name)
        if info.kind == "BF16":
            return torch.from_numpy(np.array(data)).view(torch.bfloat16).to(dtype)
        if info.kind in ("F32", "F16"):
            return torch.from_numpy(np.array(data)).to(dtype)
        kind = gguf.GGMLQuantizationType[info.kind]
        out = torch.empty(data.shape[0], info.shape[-1], dtype=dtype)
        for start in range(0, data.shape[0], _DEQUANTIZE_ROWS):
            chunk = gguf.quants.dequantize(data[start : start + _DEQUANTIZE_ROWS], kind)
            out[start : start + chunk.shape[0]] = torch.from_numpy(chunk)
        return out.view(info.shape)


_SKIPPED = object()


def _read_string(f: Any) -> str:
    return f.read(struct.unpack("<Q", f.read(8))[0]).decode("utf-8", "replace")


def _read_value(f: Any, value_type: int) -> Any:
    """A scalar or a string; an array is skipped (_SKIPPED): the tokenizer's come through
    transformers, which the metadata directory is written with."""
    if value_type in _SCALARS:
        fmt = "<" + _SCALARS[value_type]
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]
    if value_type == _STRING:
        return _read_string(f)
    if value_type == _ARRAY:
        item_type, count = struct.unpack("<IQ", f.read(12))
        if item_type in _SCALARS:
            f.seek(count * struct.calcsize(_SCALARS[item_type]), os.SEEK_CUR)
        else:
            for _ in range(count):
                _read_value(f, item_type)
        return _SKIPPED
    raise ValueError(f"unknown GGUF value type {value_type}")
