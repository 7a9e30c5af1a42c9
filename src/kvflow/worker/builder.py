"""Builds an LLMEngine from EngineArgs: load the model, size the KV cache, resolve the geometry."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from kvflow.config import CacheConfig, EngineConfig, SchedulerConfig, resolve_max_model_len
from kvflow.model.layers import prepack_for_cpu
from kvflow.model.loader import (
    allocate_kv_caches,
    kv_cache_shape,
    load_model,
    load_tokenizer,
    resolve_dtype,
    resolve_model,
)
from kvflow.worker.faults import FaultPlan
from kvflow.worker.model_runner import ModelRunner

logger = logging.getLogger("kvflow.engine")

DEFAULT_CPU_KV_CACHE_MEMORY = 4 << 30  # bytes, like vLLM's CPU default
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


def kv_bytes_per_block(hf_config, block_size: int, dtype: torch.dtype) -> int:
    num_layers, num_kv_heads, head_dim = kv_cache_shape(hf_config)
    itemsize = torch.empty((), dtype=dtype).element_size()
    return 2 * num_layers * block_size * num_kv_heads * head_dim * itemsize


def resolve_num_blocks(args, hf_config, dtype: torch.dtype, device: str) -> int:
    if args.num_blocks is not None:
        return args.num_blocks
    per_block = kv_bytes_per_block(hf_config, args.block_size, dtype)
    if args.kv_cache_memory is not None:
        budget = args.kv_cache_memory
    elif device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info()
        budget = int(free - total * (1 - args.gpu_memory_utilization))
    else:
        budget = DEFAULT_CPU_KV_CACHE_MEMORY
    return max(budget // per_block, 0)


def model_context_len(hf_config) -> int:
    for name in ("max_position_embeddings", "n_positions", "max_seq_len"):
        value = getattr(hf_config, name, None)
        if value:
            return int(value)
    return 2048


def load_chat_template(tokenizer, chat_template: str | None) -> None:
    if chat_template is None:
        return
    path = Path(chat_template)
    tokenizer.chat_template = path.read_text() if path.is_file() else chat_template


def build_engine(cls, args, log_steps: bool):
    """Returns `cls(...)` (an LLMEngine). Raises ValueError naming the numbers and the fix when
    the KV pool cannot serve one request or an explicit --max-model-len exceeds it."""
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(args.seed)
    path = resolve_model(args.model)
    tokenizer = load_tokenizer(path)
    load_chat_template(tokenizer, args.chat_template)
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(path, local_files_only=True)
    dtype = resolve_dtype(args.dtype, hf_config, device)
    num_blocks = resolve_num_blocks(args, hf_config, dtype, device)
    cache = CacheConfig(args.block_size, num_blocks, args.enable_prefix_caching)
    requested = None if args.max_model_len in (None, -1) else args.max_model_len
    max_model_len = resolve_max_model_len(cache, model_context_len(hf_config), requested)
    faults = FaultPlan.from_env()  # None unless a test sets $KVFLOW_FAULT
    if faults is not None:
        max_model_len = faults.max_model_len(max_model_len)
    batched = args.max_num_batched_tokens or max(DEFAULT_MAX_NUM_BATCHED_TOKENS, 1)
    scheduler = SchedulerConfig(max_model_len, batched, args.max_num_seqs, args.max_num_queued_reqs)
    model, hf_config = load_model(path, dtype, device)
    if device == "cpu":
        prepack_for_cpu(model)
    kv_caches = allocate_kv_caches(hf_config, num_blocks, args.block_size, dtype, device)
    eos = tokenizer.eos_token_id
    runner = ModelRunner(model, kv_caches, args.block_size, hf_config.vocab_size, eos, device)
    if faults is not None:
        logger.warning("fault injection is on (KVFLOW_FAULT): %s", faults)
        runner = faults.wrap(runner)
    name = args.served_model_name or (args.model or "SmolLM2-135M-Instruct")
    logger.info(
        "KV cache: %d blocks x %d tokens = %d servable tokens; max_model_len %d; dtype %s; device %s",
        num_blocks,
        args.block_size,
        cache.servable_tokens,
        max_model_len,
        str(dtype).removeprefix("torch."),
        device,
    )
    return cls(
        EngineConfig(cache, scheduler),
        runner,
        tokenizer,
        name,
        eos,
        dtype_name=str(dtype).removeprefix("torch."),
        device=device,
        log_steps=log_steps,
    )
