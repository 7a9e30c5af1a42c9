"""Architecture name (config.json "architectures") -> model class, imported only when asked for.

A model class provides `__init__(config, attn_backend=None)`, `forward(input_ids, positions,
kv_caches, attn_metadata) -> hidden [T, H]`, `compute_logits(hidden [N, H], float32=True) ->
[N, V]` (float32, or with float32=False the head's own dtype), `packed_modules` (fused
parameter -> checkpoint tensors, in shard order) and `checkpoint_name(name) -> str | None`
(checkpoint tensor -> parameter name, None to skip).
"""

from __future__ import annotations

import importlib
from typing import Any

from torch import nn

_MODELS: dict[str, str] = {
    "LlamaForCausalLM": "kvflow.model.llama:LlamaForCausalLM",
    "MistralForCausalLM": "kvflow.model.llama:MistralForCausalLM",
    "Qwen2ForCausalLM": "kvflow.model.llama:Qwen2ForCausalLM",
    "Qwen3ForCausalLM": "kvflow.model.llama:Qwen3ForCausalLM",
    "OPTForCausalLM": "kvflow.model.opt:OPTForCausalLM",
    "Phi3ForCausalLM": "kvflow.model.llama:Phi3ForCausalLM",
}


def supported_architectures() -> list[str]:
    """Sorted architecture names kvflow can run."""
    return sorted(_MODELS)


def get_model_class(architecture: str) -> type[nn.Module]:
    """The kvflow class for `architecture`; ValueError listing the supported ones if unknown."""
    target = _MODELS.get(architecture)
    if target is None:
        raise ValueError(
            f"Model architecture {architecture!r} is not supported by kvflow. "
            f"Supported architectures: {', '.join(supported_architectures())}."
        )
    module_name, class_name = target.split(":")
    return getattr(importlib.import_module(module_name), class_name)


def resolve_model_class(hf_config: Any) -> type[nn.Module]:
    """The class for a config's first supported entry of `architectures`; ValueError if none."""
    architectures = list(getattr(hf_config, "architectures", None) or [])
    for name in architectures:
        if name in _MODELS:
            return get_model_class(name)
    shown = ", ".join(architectures) if architectures else "none listed in config.json"
    raise ValueError(
        f"Model architectures ({shown}) are not supported by kvflow. "
        f"Supported architectures: {', '.join(supported_architectures())}."
    )
