"""A GGUF's quantized tensors repacked for the quantized kernels (`quant_format`), once.

The float conversion of a GGUF (`loader.convert_gguf`) holds the norms, the config and the
tokenizer; next to its safetensors, `quant_file` writes `kvflow-quant.sft` (safetensors): every
quantized GGUF tensor of a type the kernels run, repacked and named as the float checkpoint
names it, on first use (atomic under the conversion's lock, with a progress bar). Each repacked
tensor is checked against the float conversion, which transformers dequantized independently,
so a name or row-order mistake is an error at conversion time, not wrong text.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

from kvflow.model.quant_format import GGUF_TYPES, QuantizedWeight, from_gguf_blocks
from kvflow.paths import locked, scratch

QUANT_FILE = "kvflow-quant.sft"  # safetensors, named so that the float loader's glob skips it
FORMAT_VERSION = "2"  # 2: float16 scales and mins where exact
_FLOAT_TYPES = ("F32", "F16", "BF16")


def source_gguf(converted: Path) -> Path | None:
    """The GGUF a converted directory was made from (None: not a GGUF conversion)."""
    record = converted / "kvflow_source.json"
    if not record.is_file():
        return None
    try:
        gguf = Path(json.loads(record.read_text())["gguf"])
    except (OSError, ValueError, KeyError):
        return None
    return gguf if gguf.is_file() else None


class GgufWeights:
    """The quantized weights of the GGUF behind a conversion, by checkpoint tensor name, each
    read from the repacked file when asked for: a loader holds one whole tensor at a time
    beside the parts it keeps (a tensor-parallel rank keeps its slice of each)."""

    def __init__(self, converted: Path) -> None:
        from safetensors import safe_open

        self._file = safe_open(str(quant_file(converted)), framework="pt", device="cpu")
        self.kinds: dict[str, str] = json.loads(self._file.metadata()["kinds"])  # name -> type

    def get(self, name: str) -> QuantizedWeight | None:
        """Tensor `name`, read now (None: no quantized tensor of that name)."""
        kind = self.kinds.get(name)
        return (
            None if kind is None else QuantizedWeight.from_state(self._file.get_tensor, name, kind)
        )


def quant_file(converted: Path) -> Path:
    """`converted/QUANT_FILE`, written now on a miss (see the module doc)."""
    from safetensors import safe_open

    target = converted / QUANT_FILE
    with locked(converted.with_name(converted.name + ".lock")):
        if target.is_file():
            with safe_open(str(target), framework="pt") as f:
                if (f.metadata() or {}).get("version") == FORMAT_VERSION:
                    return target
        gguf = source_gguf(converted)
        if gguf is None:
            raise ValueError(f"{converted} is not a GGUF conversion: --quantization gguf needs one")
        fd, tmp = tempfile.mkstemp(dir=converted, suffix=".quant.tmp")
        os.close(fd)
        with scratch(Path(tmp)):
            _write(gguf, converted, Path(tmp))
            os.chmod(tmp, 0o644)
            os.replace(tmp, target)
    return target


def _write(gguf_path: Path, converted: Path, out: Path) -> None:
    from safetensors import safe_open
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    reader, names = _hf_names(gguf_path, converted)
    tensors: dict[str, torch.Tensor] = {}
    kinds: dict[str, str] = {}
    with safe_open(str(converted / "model.safetensors"), framework="pt") as floats:
        for tensor in tqdm(reader.tensors, desc=f"kvflow: repacking {gguf_path.name}"):
            kind = tensor.tensor_type.name
            name = names.get(tensor.name)
            if kind in _FLOAT_TYPES or name is None or name not in floats.keys():
                continue
            weight = from_gguf_blocks(np.asarray(tensor.data), kind, int(tensor.shape[0]))
            weight = _unpermute(weight, tensor.name, reader, converted)
            _check(weight, floats.get_slice(name), name)
            tensors.update(weight.state(name))
            kinds[name] = kind
    meta = {"version": FORMAT_VERSION, "kinds": json.dumps(kinds), "gguf": gguf_path.name}
    save_file(tensors, str(out), metadata=meta)


def _hf_names(gguf_path: Path, converted: Path) -> tuple[object, dict[str, str]]:
    """(the GGUF reader, GGUF tensor name -> the float checkpoint's name for it)."""
    import gguf
    from safetensors import safe_open

    reader = gguf.GGUFReader(gguf_path)
    arch_name = str(reader.fields["general.architecture"].contents())
    arch = next((a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch_name), None)
    if arch is None:
        raise ValueError(f"GGUF architecture {arch_name!r} is unknown to the gguf package")
    config = json.loads((converted / "config.json").read_text())
    name_map = gguf.get_tensor_name_map(arch, int(config["num_hidden_layers"]))
    names: dict[str, str] = {}
    with safe_open(str(converted / "model.safetensors"), framework="pt") as floats:
        for hf_name in floats.keys():  # noqa: SIM118 (safe_open is not a Mapping)
            base, _, suffix = hf_name.rpartition(".")
            gguf_base = name_map.get_name(base)
            if gguf_base is not None:
                names[f"{gguf_base}.{suffix}"] = hf_name
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if tensor.name in names and kind not in _FLOAT_TYPES and kind not in GGUF_TYPES:
            raise ValueError(
                f"GGUF tensor {tensor.name} is of type {kind}, which the quantized kernels do "
                f"not run (they run {', '.join(GGUF_TYPES)}); serve it with --quantization none"
            )
    return reader, names


def _unpermute(weight: QuantizedWeight, name: str, reader, converted: Path) -> QuantizedWeight:
    """llama.cpp stores Llama's q/k projection rows interleaved for its rotary layout; the
    checkpoint (and transformers' loader) has them as halves: the rows go back (exactly)."""
    arch = str(reader.fields["general.architecture"].contents())
    if arch != "llama" or not (".attn_q." in name or ".attn_k." in name):
        return weight
    config = json.loads((converted / "config.json").read_text())
    heads = int(config["num_attention_heads"])
    if ".attn_k." in name:
        heads = int(config.get("num_key_value_heads") or heads)
    rows = torch.arange(weight.out_features)
    half = weight.out_features // heads // 2
    index = rows.view(heads, half, 2).transpose(1, 2).reshape(-1)
    return weight.rows(index)


def _check(weight: QuantizedWeight, floats, name: str) -> None:
    """The first rows, dequantized, equal the float conversion's (float32 rounding apart)."""
    rows = min(8, weight.out_features)
    ours = weight.rows(torch.arange(rows)).dequantize(torch.float32)
    theirs = floats[:rows].to(torch.float32)
    if ours.shape != theirs.shape or not torch.allclose(ours, theirs, rtol=1e-5, atol=1e-6):
        raise ValueError(f"repacked GGUF tensor {name} does not match its dequantized conversion")
