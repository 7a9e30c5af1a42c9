"""Random-weight checkpoints written one tensor at a time: a GGUF (llama.cpp's names and keys,
quantized with the `gguf` package), bf16 safetensors shards, and Q4_K_M through llama.cpp's
`llama-quantize`. Each returns the bytes every tensor takes in the file, by name."""

from __future__ import annotations

import json
import math
import struct
import subprocess
from pathlib import Path

import gguf
import numpy as np
from checkpoint_plan import PHI3_ORIGINAL, Shape, TensorSpec, plan, rope_scaling, row_chunks
from checkpoint_vocab import add_tokenizer, save_hf_tokenizer, special_ids
from gguf import GGMLQuantizationType as Q

SHARD_BYTES = 2 * 10**9  # safetensors shards of at most 2 GB, as HF hub checkpoints are cut

# GGUF file type per format; which type each tensor takes is `gguf_type`.
GGUF_FILE_TYPES = {
    "gguf-q4_0": (Q.Q4_0, gguf.LlamaFileType.MOSTLY_Q4_0),
    "gguf-q8_0": (Q.Q8_0, gguf.LlamaFileType.MOSTLY_Q8_0),
    "gguf-f16": (Q.F16, gguf.LlamaFileType.MOSTLY_F16),  # llama-quantize's input
}


def gguf_type(spec: TensorSpec, weights: Q, tied: bool) -> Q:
    """Norms, biases and rope factors stay float32, as llama.cpp keeps them. The head (the `output`
    tensor, or the embedding when tied) is at least Q8_0: llama.cpp's Q4_0 files keep it at
    Q6_K, which the `gguf` package cannot write, and Q8_0 is the nearest type it can."""
    if spec.fill != "normal" or len(spec.shape) == 1:
        return Q.F32
    is_head = spec.role == "head" or (tied and spec.role == "embed")
    if is_head and weights == Q.Q4_0:
        return Q.Q8_0
    return weights


def _encode(block: np.ndarray, qtype: Q) -> np.ndarray:
    if qtype == Q.F32:
        return block.astype(np.float32)
    if qtype == Q.F16:
        return block.astype(np.float16).view(np.uint8)
    return gguf.quants.quantize(block, qtype)


def write_gguf(shape: Shape, fmt: str, out: Path, seed: int) -> dict[str, int]:
    """A GGUF of `shape` in `fmt`. Tensor infos go first, then each tensor's data is made,
    quantized a block of rows at a time into its final bytes, and written before the next."""
    weights, file_type = GGUF_FILE_TYPES[fmt]
    specs = plan(shape)
    types = [gguf_type(s, weights, shape.tied) for s in specs]
    writer = gguf.GGUFWriter(out, shape.arch)
    _add_metadata(writer, shape, file_type)
    sizes = {}
    for spec, qtype in zip(specs, types, strict=True):
        byte_shape = gguf.quants.quant_shape_to_byte_shape(spec.shape, qtype)
        if qtype == Q.F32:
            writer.add_tensor_info(
                spec.gguf, spec.shape, np.dtype(np.float32), 4 * math.prod(spec.shape)
            )
        else:
            writer.add_tensor_info(
                spec.gguf, byte_shape, np.dtype(np.uint8), math.prod(byte_shape), raw_dtype=qtype
            )
        sizes[spec.gguf] = 4 * math.prod(spec.shape) if qtype == Q.F32 else math.prod(byte_shape)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for index, (spec, qtype) in enumerate(zip(specs, types, strict=True)):
        parts = [_encode(b, qtype) for b in row_chunks(spec, shape, seed, index)]
        data = parts[0] if len(parts) == 1 else np.concatenate(parts)
        del parts
        writer.write_tensor_data(data)
        del data
    writer.close()
    return sizes


def _add_metadata(writer: gguf.GGUFWriter, shape: Shape, file_type: int) -> None:
    """llama.cpp's keys for the shape's architecture (llama's llama3 rope scaling is the
    `rope_freqs` tensor, as its converter writes it) and the padded embedded tokenizer."""
    writer.add_name(f"kvflow random {shape.name}")
    writer.add_context_length(shape.context)
    writer.add_embedding_length(shape.hidden)
    writer.add_block_count(shape.layers)
    writer.add_feed_forward_length(shape.intermediate)
    writer.add_head_count(shape.heads)
    writer.add_head_count_kv(shape.kv_heads)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_eps)
    writer.add_file_type(int(file_type))
    writer.add_vocab_size(shape.vocab)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_key_length(shape.head_dim)
    writer.add_value_length(shape.head_dim)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    if shape.arch == "phi3":  # LongRoPE, as llama.cpp's converter writes it for Phi-3-128k
        writer.add_rope_scaling_orig_ctx_len(PHI3_ORIGINAL)
        writer.add_rope_scaling_attn_factors(1.0)
    add_tokenizer(writer, shape.vocab)


def write_q4_k_m(shape: Shape, out: Path, seed: int, quantize_bin: str) -> dict[str, int]:
    """Q4_K_M by llama.cpp: an f16 GGUF written next to `out`, quantized, then removed."""
    f16 = out.with_name(out.stem + ".f16-tmp.gguf")
    try:
        write_gguf(shape, "gguf-f16", f16, seed)
        subprocess.run([quantize_bin, str(f16), str(out), "Q4_K_M"], check=True)
    finally:
        f16.unlink(missing_ok=True)
    reader = gguf.GGUFReader(out)
    return {t.name: int(t.n_bytes) for t in reader.tensors}


def write_safetensors(shape: Shape, out: Path, seed: int) -> dict[str, int]:
    """A bf16 HF checkpoint in `out`: shards of at most 2 GB (each header computed from the
    plan, then the tensors' bytes streamed in), their index, config, generation config and
    tokenizer. Values are rounded to bf16 by the `gguf` package (round to nearest even)."""
    out.mkdir(parents=True, exist_ok=True)
    indexed = [(i, s) for i, s in enumerate(plan(shape)) if s.hf]
    shards: list[list[tuple[int, TensorSpec]]] = [[]]
    size = 0
    for item in indexed:
        nbytes = 2 * math.prod(item[1].shape)
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(item)
        size += nbytes
    weight_map, sizes = {}, {}
    for n, shard in enumerate(shards, start=1):
        name = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        sizes.update(_write_shard(out / name, shard, shape, seed))
        weight_map.update({spec.hf: name for _, spec in shard})
    index = {"metadata": {"total_size": sum(sizes.values())}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    _write_configs(shape, out)
    save_hf_tokenizer(out, shape.vocab)
    return sizes


def _write_shard(
    path: Path, shard: list[tuple[int, TensorSpec]], shape: Shape, seed: int
) -> dict[str, int]:
    """One safetensors file: u64 header length, the JSON header (padded with spaces to 8
    bytes), then the tensors' bytes in header order."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for _, spec in shard:
        nbytes = 2 * math.prod(spec.shape)
        header[spec.hf] = {
            "dtype": "BF16",
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + nbytes],
        }
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for index, spec in shard:
            for block in row_chunks(spec, shape, seed, index):
                f.write(gguf.quants.quantize(block, Q.BF16).tobytes())
    return {spec.hf: 2 * math.prod(spec.shape) for _, spec in shard}


def _write_configs(shape: Shape, out: Path) -> None:
    ids = special_ids()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": shape.hidden,
        "intermediate_size": shape.intermediate,
        "num_hidden_layers": shape.layers,
        "num_attention_heads": shape.heads,
        "num_key_value_heads": shape.kv_heads,
        "head_dim": shape.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": shape.context,
        "rms_norm_eps": shape.rms_eps,
        "rope_theta": shape.rope_theta,
        "rope_scaling": rope_scaling(shape),
        "tie_word_embeddings": shape.tied,
        "vocab_size": shape.vocab,
        "attention_bias": False,
        "mlp_bias": False,
        "initializer_range": 0.02,
        "torch_dtype": "bfloat16",
        **ids,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n")
