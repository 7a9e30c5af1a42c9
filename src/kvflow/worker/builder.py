"""The single-device engine builder: load the model, size the KV cache, resolve the geometry, make
the runner; returns them as EngineParts for the one assembly (`engine/assembly.py`)."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvflow.attention import AttentionBackend, AttentionMetadata, token_positions
from kvflow.attention.cpu import cpu_paged_attention
from kvflow.config import CacheConfig, EngineConfig, SchedulerConfig, resolve_max_model_len
from kvflow.kernels.cpu.build import native_available
from kvflow.kernels.cpu.host_memory import keep_freed_memory
from kvflow.memory_fit import OVERHEAD, check_fits, peak_resident
from kvflow.model.gguf_dir import source_gguf
from kvflow.model.gguf_file import GgufFile
from kvflow.model.linear import prepack_for_cpu
from kvflow.model.loader import (
    build_model,
    load_config,
    load_tokenizer,
    load_weights,
    model_context_len,
    resolve_dtype,
    resolve_model,
)
from kvflow.model.quantize import describe, resolve_quantization
from kvflow.model.safetensors_file import checkpoint_elements
from kvflow.sampling_params import SamplingParams
from kvflow.tokenizer_files import load_chat_template
from kvflow.worker.cpu_replay import CpuDecodeReplay
from kvflow.worker.cuda_graphs import DecodeGraphs
from kvflow.worker.faults import FaultPlan
from kvflow.worker.kv_cache import allocate_kv_caches, kv_cache_shape
from kvflow.worker.model_runner import ModelRunner
from kvflow.worker.sampler import SamplingMetadata, TokenHistory, sample

logger = logging.getLogger("kvflow.engine")

DEFAULT_CPU_KV_CACHE_MEMORY = 4 << 30  # bytes, like vLLM's CPU default
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
GIB = 1 << 30


def cpu_kv_cache_memory() -> int:
    """The CPU KV cache's bytes when neither --num-blocks nor --kv-cache-memory is given:
    VLLM_CPU_KVCACHE_SPACE GiB where it is set to a positive whole number (vLLM's CPU
    setting), else 4 GiB."""
    value = os.environ.get("VLLM_CPU_KVCACHE_SPACE", "").strip()
    try:
        gib = int(value) if value else 0
    except ValueError:
        raise ValueError(
            f"VLLM_CPU_KVCACHE_SPACE must be a whole number of GiB, got {value!r}"
        ) from None
    if gib < 0:
        raise ValueError(f"VLLM_CPU_KVCACHE_SPACE must not be negative, got {gib}")
    return gib * GIB if gib else DEFAULT_CPU_KV_CACHE_MEMORY


def kv_bytes_per_block(hf_config, block_size: int, dtype: torch.dtype) -> int:
    num_layers, num_kv_heads, head_dim = kv_cache_shape(hf_config)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


def default_max_num_batched_tokens(device: str, offline: bool) -> int:
    """A step's token budget when --max-num-batched-tokens is not given: 2048 on the CPU, and
    on CUDA vLLM's per-card defaults (`batched_tokens_for_card`)."""
    if not device.startswith("cuda"):
        return DEFAULT_MAX_NUM_BATCHED_TOKENS
    props = torch.cuda.get_device_properties(torch.device(device))
    return batched_tokens_for_card(props.total_memory, props.name, offline)


def batched_tokens_for_card(total_memory: int, name: str, offline: bool) -> int:
    """vLLM's defaults: 16384 on cards of 160 GiB or more; on other cards of 70 GiB or more
    except an A100 (H100, H200) 16384 offline (`LLM`) and 8192 served; elsewhere 8192 offline
    and 2048 served. A prefill step runs eagerly, a few hundred kernel launches whatever its
    size: a bigger budget means fewer of them per prompt."""
    if total_memory >= 160 * GIB:
        return 16384
    if total_memory >= 70 * GIB and "a100" not in name.lower():
        return 16384 if offline else 8192
    return 8192 if offline else 2048


def needs_profile(args, device: str) -> bool:
    """Whether the KV pool is sized from --gpu-memory-utilization (and so needs `profile_step`)."""
    return device.startswith("cuda") and args.num_blocks is None and args.kv_cache_memory is None


def resolve_num_blocks(
    args, hf_config, dtype: torch.dtype, device: str, step_bytes: int | None = None
) -> int:
    """--num-blocks; else --kv-cache-memory; else on CUDA what --gpu-memory-utilization leaves
    of the device after `step_bytes` (`profile_step`); else the CPU default."""
    if args.num_blocks is not None:
        return args.num_blocks
    per_block = kv_bytes_per_block(hf_config, args.block_size, dtype)
    if args.kv_cache_memory is not None:
        budget = args.kv_cache_memory
    elif device.startswith("cuda"):
        assert step_bytes is not None, "profile_step first"
        _, total = torch.cuda.mem_get_info()
        budget = int(total * args.gpu_memory_utilization) - step_bytes
        logger.info(
            "GPU memory: %.2f GiB x utilization %.2f - %.2f GiB for weights, one step and "
            "memory outside torch = %.2f GiB for the KV cache",
            total / GIB,
            args.gpu_memory_utilization,
            step_bytes / GIB,
            budget / GIB,
        )
    else:
        budget = cpu_kv_cache_memory()
    return max(budget // per_block, 0)


def profile_step(
    model: torch.nn.Module, hf_config, num_tokens: int, num_seqs: int, block_size: int, dtype
) -> int:
    """Bytes of device memory that are not the KV cache at the worst step (CUDA).

    Runs one step of `num_tokens` tokens (max_num_batched_tokens) split over min(num_seqs,
    num_tokens) requests on a throwaway KV cache, then their logits and the costliest sampler
    path (penalties, top-k + top-p sort, logprobs). The result is torch's peak allocation (the
    weights included) less that throwaway cache, plus what the device holds outside torch's
    allocator (CUDA context, other processes), measured afterwards.
    """
    device = next(model.parameters()).device
    num_reqs = max(1, min(num_seqs, num_tokens))
    q_lens = [num_tokens // num_reqs + (i < num_tokens % num_reqs) for i in range(num_reqs)]
    blocks, next_block = [], 1  # block 0 is the null block, as in the real pool
    for q in q_lens:
        count = -(-q // block_size)
        blocks.append(list(range(next_block, next_block + count)))
        next_block += count
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    kv_caches = allocate_kv_caches(hf_config, next_block, block_size, dtype, device)
    cache_bytes = sum(c.numel() * c.element_size() for c in kv_caches)
    computed = [0] * num_reqs
    params = SamplingParams(
        temperature=1.0, top_k=50, top_p=0.9, repetition_penalty=1.1, logprobs=20
    )
    with torch.inference_mode():
        meta = AttentionMetadata.build(q_lens, computed, blocks, block_size, device)
        positions = torch.from_numpy(token_positions(q_lens, computed)).to(device)
        ids = torch.zeros(num_tokens, dtype=torch.long, device=device)
        hidden = model(ids, positions, kv_caches, meta)
        ends = torch.tensor(q_lens, device=device).cumsum(0) - 1
        logits = model.compute_logits(hidden[ends])
        sampling = SamplingMetadata.build(
            [params] * num_reqs,
            TokenHistory.from_lists([[0] * q for q in q_lens], [[] for _ in q_lens]),
            [None] * num_reqs,
            None,
            hf_config.vocab_size,
            device,
        )
        sample(logits, sampling).sampled.tolist()
        del hidden, logits, meta, kv_caches
    peak = torch.cuda.max_memory_allocated(device) - cache_bytes
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    outside_torch = max(total - free - torch.cuda.memory_reserved(device), 0)
    logger.info(
        "profiled a %d-token step of %d requests: peak %.2f GiB allocated (weights included), "
        "%.2f GiB outside torch",
        num_tokens,
        num_reqs,
        peak / GIB,
        outside_torch / GIB,
    )
    return peak + outside_torch


def attention_backend(device: str) -> AttentionBackend:
    """The Triton kernel on CUDA (imported here: triton is absent from CPU installs), the CPU
    backend on the CPU."""
    if device.startswith("cuda"):
        from kvflow.attention.triton_attn import triton_paged_attention

        return triton_paged_attention
    return cpu_paged_attention


def load_quantized(path: Path, dtype: torch.dtype, device: str, backend, quantization: str):
    """`load_model` with `quantization`'s weights; logs the choice and the bytes."""
    model, hf_config = build_model(path, dtype, device, attn_backend=backend)
    new, old = load_weights(model, path, quantization)
    logger.info("%s", describe(quantization, new, old, dtype))
    return model, hf_config


@dataclass
class EngineParts:
    """What a builder makes, for the assembly: everything that depends on where the model
    runs (one device here, ranks in `tp_builder`)."""

    runner: Any  # the EngineCore's Runner: a ModelRunner, or an executor over ranks
    path: Path  # the resolved model directory
    tokenizer: Any
    hf_config: Any
    config: EngineConfig
    dtype: torch.dtype
    device: str
    async_scheduling: bool
    num_gpus: int = 1  # devices the model is split over (the perf counters are per device)


def build_parts(args, device: str) -> EngineParts:
    """The model on one device (`device` resolved: cpu or cuda[:N]) with its KV pool and
    runner. Raises ValueError naming the numbers and the fix when the KV pool cannot serve one
    request or an explicit --max-model-len exceeds it."""
    torch.manual_seed(args.seed)
    path = resolve_model(args.model)
    tokenizer = load_tokenizer(path)
    load_chat_template(tokenizer, args.chat_template)
    hf_config = load_config(path)
    dtype = resolve_dtype(args.dtype, hf_config, device)
    batched = args.max_num_batched_tokens or default_max_num_batched_tokens(device, args.offline)
    model, hf_config, cache, max_model_len = _model_and_pool(
        args, path, hf_config, dtype, device, batched
    )
    scheduler = SchedulerConfig(max_model_len, batched, args.max_num_seqs, args.max_num_queued_reqs)
    eos = tokenizer.eos_token_id
    runner = _runner(args, model, hf_config, dtype, device, cache, max_model_len, eos)
    if device == "cpu":
        weights = resident_bytes(model)
        kv = cache.num_blocks * kv_bytes_per_block(hf_config, args.block_size, dtype)
        logger.info(
            "memory at start-up: weights %.2f GiB, KV cache %.2f GiB, peak resident %.2f GiB "
            "(VmHWM; bound 1.2 x weights + KV cache + %.2f GiB fixed overhead = %.2f GiB)",
            weights / GIB,
            kv / GIB,
            peak_resident() / GIB,
            OVERHEAD / GIB,
            (1.2 * weights + kv + OVERHEAD) / GIB,
        )
    logger.info(
        "KV cache: %d blocks x %d tokens = %d servable tokens; max_model_len %d; dtype %s; device %s",
        cache.num_blocks,
        args.block_size,
        cache.servable_tokens,
        max_model_len,
        str(dtype).removeprefix("torch."),
        device,
    )
    on_cuda = device.startswith("cuda")
    return EngineParts(
        runner,
        path,
        tokenizer,
        hf_config,
        EngineConfig(cache, scheduler),
        dtype,
        device,
        on_cuda if args.async_scheduling is None else args.async_scheduling,
    )


def _model_and_pool(args, path: Path, hf_config, dtype: torch.dtype, device: str, batched: int):
    """(model, its config, the KV pool's CacheConfig, max_model_len): on a device whose pool
    gets what the weights and one step leave, the model is loaded and a step profiled first."""
    backend = attention_backend(device)
    quantization = resolve_quantization(args.quantization, path, device, dtype)
    model = step_bytes = None
    if needs_profile(args, device):
        model, hf_config = load_quantized(path, dtype, device, backend, quantization)
        step_bytes = profile_step(
            model, hf_config, batched, args.max_num_seqs, args.block_size, dtype
        )
    num_blocks = resolve_num_blocks(args, hf_config, dtype, device, step_bytes)
    cache = CacheConfig(args.block_size, num_blocks, args.enable_prefix_caching)
    requested = None if args.max_model_len in (None, -1) else args.max_model_len
    max_model_len = resolve_max_model_len(cache, model_context_len(hf_config), requested)
    faults = FaultPlan.from_env()  # None unless a test sets $KVFLOW_FAULT
    if faults is not None:
        max_model_len = faults.max_model_len(max_model_len)
    if model is None:
        if device == "cpu":
            kv = num_blocks * kv_bytes_per_block(hf_config, args.block_size, dtype)
            check_host_memory(path, dtype, kv, quantization)
        model, hf_config = load_quantized(path, dtype, device, backend, quantization)
    return model, hf_config, cache, max_model_len


def resident_bytes(model: torch.nn.Module) -> int:
    """The bytes of the tensors the model serves from: its parameters and buffers, and the
    tensors its modules hold beside them (packings, quantized blocks, and what those cache),
    each storage once (a released weight's placeholder is one element)."""
    storages: dict[int, int] = {}

    def visit(value: Any, depth: int) -> None:
        if isinstance(value, torch.Tensor):
            storage = value.untyped_storage()
            storages[storage.data_ptr()] = storage.nbytes()
        elif isinstance(value, dict):
            for item in value.values():
                visit(item, depth)
        elif depth and hasattr(value, "__dict__") and not isinstance(value, torch.nn.Module):
            for item in vars(value).values():
                visit(item, depth - 1)

    for module in model.modules():
        for value in vars(module).values():
            visit(value, 2)
    return sum(storages.values())


def check_host_memory(
    path: Path, dtype: torch.dtype, kv_bytes: int, quantization: str, ranks: int = 1
) -> None:
    """Refuse, before the load, a model whose weights and KV pool the host cannot hold: a
    GGUF's blocks count as stored where `--quantization gguf` serves them so, every other
    weight at the dtype's size (int8 is made from the loaded floats). `ranks` above 1: the
    tensor-parallel ranks on this host, whose shards add up to the weights, `kv_bytes` their
    pools together, and each an interpreter of its own beside this process's."""
    size = torch.empty((), dtype=dtype).element_size()
    name = str(dtype).removeprefix("torch.")
    gguf = source_gguf(path)
    hint = "Lower --kv-cache-memory or --num-blocks, or serve a smaller model."
    if gguf is None:
        label, weights = f"weights in {name}", checkpoint_elements(path) * size
    else:
        tensors = GgufFile(gguf).tensors.values()
        stored = sum(t.numel * size if t.is_float else t.nbytes for t in tensors)
        if quantization == "gguf":
            label, weights = "weights (as stored)", stored
        else:
            label, weights = (
                f"weights (dequantized to {name})",
                sum(t.numel for t in tensors) * size,
            )
            hint += (
                f" Served as stored (--quantization gguf) its weights take {stored / GIB:.2f} GiB."
            )
    parts = {label: weights, "KV cache": kv_bytes}
    if ranks > 1:
        parts[f"{ranks} ranks' fixed overhead"] = ranks * OVERHEAD
        hint = hint.replace("serve a smaller model", "serve a smaller model or on fewer ranks")
    check_fits(f"Serving {path.name} in {name}", parts, hint)


def _runner(args, model, hf_config, dtype, device: str, cache, max_model_len: int, eos):
    """The ModelRunner over `model` with its KV tensors and, unless --enforce-eager, its decode
    graphs (CUDA) or recorded decode steps (the CPU, `cpu_replay`); on the CPU malloc is set to
    keep freed memory (`host_memory`), the weights are packed and the native kernels built (not
    on the first request)."""
    if device == "cpu":
        keep_freed_memory()
        prepack_for_cpu(model)
        native = native_available()
        logger.info("native CPU kernels: %s", "on" if native else "off (torch paths)")
    kv_caches = allocate_kv_caches(hf_config, cache.num_blocks, args.block_size, dtype, device)
    graphs = None
    if device.startswith("cuda") and not args.enforce_eager:
        graphs = DecodeGraphs(
            model, kv_caches, args.block_size, max_model_len, args.max_num_seqs, device
        )
        graphs.capture()
    elif device == "cpu" and not args.enforce_eager and CpuDecodeReplay.applies(model, dtype):
        graphs = CpuDecodeReplay(
            model, kv_caches, args.block_size, max_model_len, args.max_num_seqs
        )
    runner = ModelRunner(
        model, kv_caches, args.block_size, hf_config.vocab_size, eos, device, graphs
    )
    faults = FaultPlan.from_env()
    if faults is not None:
        logger.warning("fault injection is on (KVFLOW_FAULT): %s", faults)
        runner = faults.wrap(runner)
    return runner


def generation_eos_ids(path: Path) -> frozenset[int]:
    """The EOS ids listed in the model's generation_config.json (an int or a list), if any."""
    file = path / "generation_config.json"
    if not file.is_file():
        return frozenset()
    ids = json.loads(file.read_text()).get("eos_token_id")
    return frozenset([ids] if isinstance(ids, int) else ids or [])
