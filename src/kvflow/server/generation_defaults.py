"""`--generation-config` and `--override-generation-config`: the request defaults a model's
creator recommends, applied as vLLM applies them.

`auto` reads the model's `generation_config.json`; `vllm` uses none; a folder reads the one
in that folder. Of that file only the sampling fields vLLM takes count (temperature, top_p,
top_k, min_p, repetition_penalty; `max_new_tokens` becomes a cap on `max_tokens`), as
transformers' `to_diff_dict` reports them. A request's own value always wins; the defaults
fill the fields it leaves out. The embedded SmolLM2-135M-Instruct GGUF carries no generation
config, so `auto` gives it kvflow's: its model card's sampling (temperature 0.2, top_p 0.9) and
`max_new_tokens` 512, since a 135M model can repeat itself until its context is full (a list
question ran to 3,437 tokens): every request left at its defaults ends. One more is kvflow's
own: `constrained_repetition_penalty` 1.2 stands for `repetition_penalty` in a request with an
output constraint that sets none. The model never sees the schema, and held to JSON it repeats
a string's words or a list's items until the cap (`parse()` got 1 of 18 lists); at 1.2 it
closes them (17 of 18), where in free text 1.2 lengthens the answers (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

logger = logging.getLogger("kvflow.server")

SAMPLING_FIELDS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")
CONSTRAINED = "constrained_repetition_penalty"  # kvflow's: see the module's docstring
# Sampling from the model card of HuggingFaceTB/SmolLM2-135M-Instruct (its transformers
# example); the cap on output is kvflow's (see the module's docstring).
EMBEDDED_MODEL_DEFAULTS: dict[str, Any] = {
    "temperature": 0.2,
    "top_p": 0.9,
    "max_new_tokens": 512,
    "constrained_repetition_penalty": 1.2,
}
# vLLM's values for the fields a generation config leaves out (its SamplingParams' defaults).
VLLM_SAMPLING = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


def parse_override(text: str | None) -> dict[str, Any]:
    """`--override-generation-config '{"temperature": 0.5}'`: a JSON object, else ValueError."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"--override-generation-config is not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise ValueError("--override-generation-config must be a JSON object")
    return value


def _is_embedded(model: str | None) -> bool:
    if model is None:
        return True
    from kvflow.embedded_model import default_gguf_path

    try:
        return Path(model).expanduser().resolve() == default_gguf_path().resolve()
    except ValueError:  # the embedded model is not installed
        return False


def _read_folder(folder: Path) -> dict[str, Any]:
    """The fields `folder/generation_config.json` sets, as transformers reads them ({} when
    there is no such file, as vLLM)."""
    if not (folder / "generation_config.json").is_file():
        return {}
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(folder, local_files_only=True).to_diff_dict()
    except (OSError, ValueError) as exc:
        logger.warning("cannot read %s/generation_config.json: %s", folder, exc)
        return {}


def _model_config(generation_config: str, model: str | None) -> dict[str, Any]:
    if generation_config == "vllm":
        return {}
    if generation_config != "auto":
        folder = Path(generation_config).expanduser()
        if not folder.is_dir():
            raise ValueError(f"--generation-config {generation_config!r} is not a folder")
        return _read_folder(folder)
    if _is_embedded(model):
        return dict(EMBEDDED_MODEL_DEFAULTS)
    path = Path(model).expanduser()  # type: ignore[arg-type]
    return _read_folder(path) if path.is_dir() else {}


def default_sampling_params(
    generation_config: str, model: str | None, override: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The defaults for requests' sampling fields (vLLM's `default_sampling_params`): the
    generation config's sampling fields, then `override`; `max_new_tokens` as `max_tokens`."""
    config = {**_model_config(generation_config, model), **(override or {})}
    defaults = {k: config[k] for k in (*SAMPLING_FIELDS, CONSTRAINED) if config.get(k) is not None}
    if config.get("max_new_tokens") is not None:
        defaults["max_tokens"] = int(config["max_new_tokens"])
    return defaults


def request_defaults(defaults: dict[str, Any], constrained: bool) -> dict[str, Any]:
    """The defaults one request takes: with an output constraint, `CONSTRAINED` stands for
    repetition_penalty where the generation config sets it."""
    if constrained and CONSTRAINED in defaults:
        return {**defaults, "repetition_penalty": defaults[CONSTRAINED]}
    return defaults


def describe(defaults: dict[str, Any], max_model_len: int) -> str:
    """The start-up log's account of what a request that sets nothing gets, for any model."""
    sampling = {**VLLM_SAMPLING, **{k: v for k, v in defaults.items() if k != "max_tokens"}}
    cap = defaults.get("max_tokens")
    chat = (
        f"at most {cap} (the generation config's max_new_tokens, which caps every request's)"
        if cap is not None
        else f"the rest of the {max_model_len}-token context"
    )
    completions = min(16, cap) if cap is not None else 16
    fields = ", ".join(f"{k}={v}" for k, v in sorted(sampling.items()))
    source = "the generation config" if defaults else "vLLM's defaults, no generation config"
    return (
        f"request defaults: max_tokens {chat} for chat, {completions} for completions; "
        f"{fields} ({source}; a request's own values win)"
    )
