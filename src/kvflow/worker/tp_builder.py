"""The tensor-parallel engine builder: the model on `tensor_parallel_size` ranks, returned as
EngineParts for the one assembly (`engine/assembly.py`). This process resolves the model (a
GGUF's directory is written here, once, before any rank starts; each rank reads the file in
place), the tokenizer and the geometry; the ranks load their shards, with their parts of the quantized
weights, and size their KV caches (see tp_worker.py); the executor (`mp`:
worker/executor.py, `ray`: worker/ray_executor.py) is the EngineCore's runner.

Steps are not overlapped with scheduling and CUDA graphs are not captured: every rank runs each
step eagerly, and `--async-scheduling` asked for explicitly is refused.
"""

from __future__ import annotations

import logging

import torch

from kvflow.config import CacheConfig, EngineConfig, SchedulerConfig, resolve_max_model_len
from kvflow.model.loader import load_config, load_tokenizer, resolve_dtype, resolve_model
from kvflow.model.parallel_layers import head_partition
from kvflow.model.quantize import describe, resolve_quantization
from kvflow.model.tensor_parallel import check_divisible
from kvflow.tokenizer_files import load_chat_template
from kvflow.worker.builder import (
    EngineParts,
    check_host_memory,
    cpu_kv_cache_memory,
    default_max_num_batched_tokens,
    kv_bytes_per_block,
    model_context_len,
)
from kvflow.worker.faults import FaultPlan
from kvflow.worker.kv_cache import kv_cache_shape
from kvflow.worker.tp_worker import RankSpec

logger = logging.getLogger("kvflow.engine")


def rank_spec(
    args, path, device: str, dtype: torch.dtype, batched: int, eos, quantization: str
) -> RankSpec:
    from kvflow.worker.executor import free_port

    return RankSpec(
        world_size=args.tensor_parallel_size,
        init_method=f"tcp://127.0.0.1:{free_port()}",
        model_path=str(path),
        dtype=str(dtype).removeprefix("torch."),
        device=device,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_batched_tokens=batched,
        max_num_seqs=args.max_num_seqs,
        seed=args.seed,
        eos_token_id=eos,
        threads=None,
        quantization=quantization,
    )


def start_executor(backend: str | None, spec: RankSpec):
    """The runner over the ranks: multiprocessing (default) or Ray actors."""
    if backend == "ray":
        from kvflow.worker.ray_executor import RayExecutor

        return RayExecutor(spec)
    from kvflow.worker.executor import MultiprocExecutor

    return MultiprocExecutor(spec)


def build_tp_parts(args, device: str) -> EngineParts:
    """The ranks started, the pool's geometry from their block count. Raises ValueError for a
    geometry, head split or flag that cannot serve, RankError when a rank fails to start."""
    world = args.tensor_parallel_size
    if args.async_scheduling:
        raise ValueError(
            "--async-scheduling is not available with --tensor-parallel-size above 1 "
            "(every rank runs each step eagerly)."
        )
    if device.startswith("cuda") and torch.cuda.device_count() < world:
        raise ValueError(
            f"tensor_parallel_size {world} needs {world} CUDA devices; "
            f"{torch.cuda.device_count()} visible."
        )
    path = resolve_model(args.model)
    tokenizer = load_tokenizer(path)
    load_chat_template(tokenizer, args.chat_template)
    hf_config = load_config(path)
    check_divisible(hf_config, world)
    dtype = resolve_dtype(args.dtype, hf_config, device)
    quantization = resolve_quantization(args.quantization, path, device, dtype)
    batched = args.max_num_batched_tokens or default_max_num_batched_tokens(device, args.offline)
    if device == "cpu":
        kv = ranks_kv_bytes(args, hf_config, dtype, world)
        check_host_memory(path, dtype, kv, quantization, ranks=world)
    eos = tokenizer.eos_token_id
    spec = rank_spec(args, path, device, dtype, batched, eos, quantization)
    runner = start_executor(args.distributed_executor_backend, spec)
    try:
        cache = CacheConfig(args.block_size, runner.num_blocks, args.enable_prefix_caching)
        requested = None if args.max_model_len in (None, -1) else args.max_model_len
        max_model_len = resolve_max_model_len(cache, model_context_len(hf_config), requested)
        faults = FaultPlan.from_env()
        if faults is not None:
            max_model_len = faults.max_model_len(max_model_len)
            logger.warning("fault injection is on (KVFLOW_FAULT): %s", faults)
            runner = faults.wrap(runner)
    except BaseException:
        runner.shutdown()  # (a FaultyRunner passes it on)
        raise
    scheduler = SchedulerConfig(max_model_len, batched, args.max_num_seqs, args.max_num_queued_reqs)
    _log_start(args, runner, max_model_len, device, quantization, dtype)
    config = EngineConfig(cache, scheduler)
    return EngineParts(runner, path, tokenizer, hf_config, config, dtype, device, False, world)


def ranks_kv_bytes(args, hf_config, dtype: torch.dtype, world: int) -> int:
    """The KV pools of `world` CPU ranks together, as each sizes its own (`tp_worker`):
    --num-blocks of its KV heads' blocks, else --kv-cache-memory or the CPU default, each."""
    if args.num_blocks is None:
        return world * (args.kv_cache_memory or cpu_kv_cache_memory())
    _, kv_heads, _ = kv_cache_shape(hf_config)
    heads = hf_config.num_attention_heads
    # the ranks' KV heads together: more than the model's where ranks share a replicated head
    held = sum(head_partition(heads, kv_heads, world, r).kv_count for r in range(world))
    whole = kv_bytes_per_block(hf_config, args.block_size, dtype)
    return args.num_blocks * whole * held // kv_heads


def _log_start(args, runner, max_model_len: int, device: str, quantization: str, dtype) -> None:
    """The start-up line: ranks, pool, and the weights' bytes summed over the ranks."""
    new = sum(r.quantized_bytes for r in runner.loaded)
    old = sum(r.replaced_bytes for r in runner.loaded)
    logger.info(
        "tensor parallel: %d ranks (%s); KV cache: %d blocks x %d tokens; max_model_len %d; "
        "device %s; %s",
        args.tensor_parallel_size,
        args.distributed_executor_backend or "mp",
        runner.num_blocks,
        args.block_size,
        max_model_len,
        device,
        describe(quantization, new, old, dtype) + (" (the ranks' sum)" if new else ""),
    )
