"""A safetensors checkpoint read in place: its files (for a sharded checkpoint, exactly those
its `model.safetensors.index.json` names), each file's header, and each tensor as a view of a
mapping of its own bytes, which a parameter's loader copies straight into the model.

A mapping per tensor, gone with the tensor, keeps the file's pages a load has read from
counting as this process's memory past that tensor: one mapping of a whole file (as
`safetensors.safe_open` makes) holds every page read so far until the file is closed, a second
copy of the model in resident memory by the last tensor. The header is read with the standard
library alone (`memory_fit` sizes a checkpoint from it before anything is loaded); numpy and
torch are imported when a tensor is read."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

INDEX = "model.safetensors.index.json"
# safetensors dtype -> (numpy dtype of the stored bytes, torch dtype they are viewed as)
_DTYPES = {
    "F64": ("float64", "float64"),
    "F32": ("float32", "float32"),
    "F16": ("float16", "float16"),
    "BF16": ("int16", "bfloat16"),
    "F8_E4M3": ("uint8", "float8_e4m3fn"),
    "F8_E5M2": ("uint8", "float8_e5m2"),
    "I64": ("int64", "int64"),
    "I32": ("int32", "int32"),
    "I16": ("int16", "int16"),
    "I8": ("int8", "int8"),
    "U8": ("uint8", "uint8"),
    "BOOL": ("bool", "bool"),
}


def checkpoint_files(path: Path) -> list[Path]:
    """The checkpoint's files in `path`: those its index names (another `.safetensors` beside
    them, such as a consolidated copy, is not the checkpoint's), else every `*.safetensors`.
    ValueError when a named shard is missing or there is no file."""
    index = path / INDEX
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [name for name in names if not (path / name).is_file()]
        if missing:
            raise ValueError(f"{index} names shards that are not in {path}: {', '.join(missing)}")
        return [path / name for name in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(
            f"No *.safetensors files in {path} (kvflow loads safetensors, or a .gguf file)."
        )
    return files


def read_header(file: Path) -> tuple[dict[str, dict], int]:
    """({tensor name: {"dtype", "shape", "data_offsets"}}, where the tensors' bytes start): the
    8-byte header length and the JSON that follows; no tensor is read."""
    with open(file, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return header, 8 + length


def checkpoint_elements(path: Path) -> int:
    """The number of weight elements in `path`'s checkpoint, from its headers alone."""
    total = 0
    for file in checkpoint_files(path):
        for entry in read_header(file)[0].values():
            count = 1
            for dim in entry["shape"]:
                count *= dim
            total += count
    return total


def checkpoint_tensors(path: Path) -> Iterator[tuple[str, Callable[[], Any]]]:
    """(name, read() -> the tensor, a view of its mapped bytes) for every tensor of `path`'s
    checkpoint, file by file in the order the files store them."""
    for file in checkpoint_files(path):
        header, start = read_header(file)
        for name, entry in header.items():
            yield name, partial(_mapped, file, start, entry)


def _mapped(file: Path, start: int, entry: dict) -> Any:
    import numpy as np
    import torch

    stored, dtype = _DTYPES[entry["dtype"]]
    shape = tuple(entry["shape"])
    begin, end = entry["data_offsets"]
    if end == begin:  # numpy cannot map zero bytes
        return torch.empty(shape, dtype=getattr(torch, dtype))
    # copy-on-write: writable for torch.from_numpy, and never written, so never copied
    raw = np.memmap(file, dtype=np.uint8, mode="c", offset=start + begin, shape=end - begin)
    return torch.from_numpy(raw.view(stored)).view(getattr(torch, dtype)).reshape(shape)
