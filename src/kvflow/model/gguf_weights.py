"""A GGUF model's weights read in place, by the checkpoint (transformers) names the model's
loaders take: quantized blocks repacked for the quantized kernels (`quant_format`) as stored,
or any tensor dequantized to a float dtype, one tensor at a time from the file's memory map.

llama.cpp stores a Llama's q/k projection rows interleaved for its rotary layout; both ways out
put them back in the checkpoint's order (exactly: a row permutation). Each repacked tensor's
first rows are checked against gguf's own dequantizer, so a name or row-order mistake is an
error at load time, not wrong text.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import torch

from kvflow.model.gguf_dir import source_gguf
from kvflow.model.gguf_file import GgufFile
from kvflow.model.quant_format import GGUF_TYPES, QuantizedWeight, from_gguf_blocks


class GgufWeights:
    """The tensors of the GGUF behind `model_dir` (a `gguf_dir` directory)."""

    def __init__(self, model_dir: Path) -> None:
        import gguf

        path = source_gguf(model_dir)
        if path is None:
            raise ValueError(f"{model_dir} is not a GGUF model's directory")
        self.file = GgufFile(path)
        self.arch = str(self.file.metadata.get("general.architecture"))
        arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == self.arch), None)
        if arch is None:
            raise ValueError(f"GGUF architecture {self.arch!r} is unknown to the gguf package")
        config = json.loads((model_dir / "config.json").read_text())
        self._heads = int(config["num_attention_heads"])
        self._kv_heads = int(config.get("num_key_value_heads") or self._heads)
        self._names = gguf.get_tensor_name_map(arch, int(config["num_hidden_layers"]))
        self._candidates: dict[str, list[str]] = {}  # GGUF base name -> checkpoint base names
        for key, (_, gguf_name) in self._names.mapping.items():
            self._candidates.setdefault(gguf_name, []).append(key)

    def gguf_name(self, name: str) -> str | None:
        """The GGUF tensor holding checkpoint tensor `name` (None: the file has none)."""
        base, _, suffix = name.rpartition(".")
        gguf_base = self._names.get_name(base)
        tensor = f"{gguf_base}.{suffix}" if gguf_base is not None else None
        return tensor if tensor in self.file.tensors else None

    def checkpoint_names(self, takes: Callable[[str], bool]) -> Iterator[tuple[str, str]]:
        """(GGUF name, checkpoint name) for every tensor of the file whose checkpoint name the
        model `takes`; a tensor no name of which it takes is left out (its loader names any
        parameter left unfilled)."""
        for tensor in self.file.tensors:
            base, _, suffix = tensor.rpartition(".")
            for candidate in self._candidates.get(base, ()):
                if takes(f"{candidate}.{suffix}"):
                    yield tensor, f"{candidate}.{suffix}"
                    break

    def quantized(self, name: str) -> QuantizedWeight | None:
        """Checkpoint tensor `name`'s blocks repacked, as stored (None: the file holds it as
        floats, or not at all). ValueError for a block type the kernels do not run."""
        tensor = self.gguf_name(name)
        if tensor is None:
            return None
        info = self.file.tensors[tensor]
        if info.is_float:
            return None
        if info.kind not in GGUF_TYPES:
            raise ValueError(
                f"GGUF tensor {tensor} is of type {info.kind}, which the quantized kernels do "
                f"not run (they run {', '.join(GGUF_TYPES)}); serve it with --quantization none"
            )
        blocks = np.asarray(self.file.blocks(tensor))
        weight = from_gguf_blocks(blocks, info.kind, info.shape[-1])
        order = self._row_order(tensor, weight.out_features)
        if order is not None:
            weight = weight.rows(order)
        self._check(weight, tensor, order)
        return weight

    def dequantized(self, tensor: str, dtype: torch.dtype) -> torch.Tensor:
        """GGUF tensor `tensor` in `dtype`, its rows in the checkpoint's order."""
        weight = self.file.dequantize(tensor, dtype)
        order = self._row_order(tensor, weight.shape[0])
        return weight if order is None else weight[order]

    def _row_order(self, tensor: str, rows: int) -> torch.Tensor | None:
        """The checkpoint's row i is the file's row order[i] (None: the same order)."""
        if self.arch != "llama" or not (".attn_q." in tensor or ".attn_k." in tensor):
            return None
        heads = self._kv_heads if ".attn_k." in tensor else self._heads
        half = rows // heads // 2
        return torch.arange(rows).view(heads, half, 2).transpose(1, 2).reshape(-1)

    def _check(self, weight: QuantizedWeight, tensor: str, order: torch.Tensor | None) -> None:
        """The first rows, dequantized, equal gguf's dequantization of the same rows."""
        import gguf

        rows = min(8, weight.out_features)
        index = torch.arange(rows) if order is None else order[:rows]
        blocks = np.asarray(self.file.blocks(tensor))[index.numpy()]
        kind = gguf.GGMLQuantizationType[self.file.tensors[tensor].kind]
        theirs = torch.from_numpy(gguf.quants.dequantize(blocks, kind))
        ours = weight.rows(torch.arange(rows)).dequantize(torch.float32)
        if ours.shape != theirs.shape or not torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6):
            raise ValueError(f"repacked GGUF tensor {tensor} does not match its dequantization")
