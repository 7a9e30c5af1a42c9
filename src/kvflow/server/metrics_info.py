"""vLLM's information and compatibility metric families: the ones whose value is a constant or
a timestamp and whose meaning is in the labels (`vllm:cache_config_info`,
`vllm:lora_requests_info`, `vllm:engine_sleep_state`), with vLLM 0.32's label names, so
gateways and the production-stack router that read them find what they look for.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Gauge

from kvflow.config import EngineConfig

SLEEP_STATES = ("awake", "weights_offloaded", "discard_all")


def cache_config_labels(
    config: EngineConfig,
    gpu_memory_utilization: float,
    num_blocks_override: int | None = None,
    kv_cache_memory: int | None = None,
) -> dict[str, str]:
    """vLLM's CacheConfig fields as labels, with kvflow's values (what kvflow does not have,
    such as Mamba state or offloading, has vLLM's value for a model without it)."""
    cache = config.cache
    tokens = cache.servable_tokens
    return {
        "_block_size_resolved": "True",
        "block_size": str(cache.block_size),
        "cache_dtype": "auto",
        "cache_hit_alignment_tokens": "None",
        "effective_attention_block_size": str(cache.block_size),
        "enable_mamba_shared_prefix_checkpoint": "False",
        "enable_prefix_caching": str(cache.enable_prefix_caching),
        "engine": "0",
        "gpu_memory_utilization": str(gpu_memory_utilization),
        "hash_block_size": "None",
        "is_attention_free": "False",
        "kv_cache_dtype_skip_layers": "[]",
        "kv_cache_layout": "None",
        "kv_cache_max_concurrency": str(round(tokens / config.max_model_len, 2)),
        "kv_cache_memory_bytes": str(kv_cache_memory),
        "kv_cache_size_tokens": str(tokens),
        "kv_offloading_backend": "native",
        "kv_offloading_size": "None",
        "kv_sharing_fast_prefill": "False",
        "mamba_block_size": "None",
        "mamba_cache_dtype": "auto",
        "mamba_cache_mode": "none",
        "mamba_page_size_padded": "None",
        "mamba_ssm_cache_dtype": "float32",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": str(cache.num_blocks),
        "num_gpu_blocks_override": str(num_blocks_override),
        "prefix_cache_retention_interval": "0",
        "prefix_caching_hash_algo": "blake2b",
        "prefix_match_unit": "None",
        "replayssm_buffer_len": "16",
        "skip_page_size_padded": "None",
        "sliding_window": "None",
        "swa_bounded_replay": "True",
        "use_kda_recoverssm": "False",
        "use_replayssm": "False",
        "user_specified_block_size": "False",
    }


def register_cache_config(registry: CollectorRegistry, info: dict[str, str]) -> None:
    gauge = Gauge(
        "vllm:cache_config_info",
        "Information of the LLMEngine CacheConfig",
        list(info),
        registry=registry,
    )
    gauge.labels(**info).set(1)


class InfoMetrics:
    def __init__(
        self, registry: CollectorRegistry, labels: list[str], values: tuple[str, ...]
    ) -> None:
        self._lora = Gauge(
            "vllm:lora_requests_info",
            "Running stats on lora requests.",
            ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
            registry=registry,
        ).labels("0", "", "")  # no adapters: the series an endpoint picker looks for
        self._lora.set(time.time())
        sleep = Gauge(
            "vllm:engine_sleep_state",
            "Engine sleep state; awake = 0 means engine is sleeping; awake = 1 means engine "
            "is awake; weights_offloaded = 1 means sleep level 1; discard_all = 1 means "
            "sleep level 2.",
            [*labels, "sleep_state"],
            registry=registry,
        )
        for state in SLEEP_STATES:  # kvflow has no sleep mode: always awake
            sleep.labels(*values, state).set(1 if state == "awake" else 0)

    def touch(self) -> None:
        """vLLM sets the LoRA info gauge to the time of the latest stats."""
        self._lora.set(time.time())
