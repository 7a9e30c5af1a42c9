"""LLMEngine: the front end's synchronous half over a core: tokenize, validate, build the core
requests (n > 1 fan-out), turn core outputs into vLLM-shaped RequestOutputs.

The core is an EngineCore in this process, which the offline `LLM` steps (`step()`), or the
server's core client (`core_client`: the core on a thread or in the engine process), whose
outputs `AsyncEngine` hands to `process_outputs`. Both take the same EngineCoreRequests.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from kvflow.core.messages import EngineCoreOutput
from kvflow.core.request import RequestStatus
from kvflow.engine.core_wire import EngineInfo
from kvflow.engine.engine_core import EngineCoreRequest, EngineStats
from kvflow.engine.output_processor import OutputProcessor
from kvflow.outputs import RequestOutput
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams
from kvflow.structured.config import StructuredOutputsConfig
from kvflow.structured.verdicts import EngineVerdicts

logger = logging.getLogger("kvflow.engine")


@dataclass
class EngineArgs:
    """Engine arguments with vLLM's names; `kvflow serve` flags map onto them one to one."""

    model: str | None = None  # None: the embedded default model
    served_model_name: str | None = None
    dtype: str = "auto"
    quantization: str | None = None  # gguf, int8, fp8, none; None: gguf for a .gguf on the CPU
    device: str = "auto"  # auto: CUDA where a card is visible, else the CPU
    max_model_len: int | None = None  # None or -1: auto-fit to the model and the KV pool
    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None  # bytes
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None  # None: `builder.default_max_num_batched_tokens`
    max_num_queued_reqs: int | None = None
    enable_prefix_caching: bool = True
    enforce_eager: bool = False  # no CUDA graphs, no CPU replays (cpu_replay): every step eager
    # Schedule the next step while this one runs (EngineCore); None: on for CUDA, off for CPU
    async_scheduling: bool | None = None
    seed: int = 0
    tensor_parallel_size: int = 1  # ranks, one process each (worker/executor.py)
    distributed_executor_backend: str | None = None  # mp (None) | ray
    chat_template: str | None = None
    # vLLM's --structured-outputs-config (a StructuredOutputsConfig, its dict or JSON text)
    structured_outputs_config: Any = None
    log_engine_steps: bool = False
    kv_events_config: Any = None  # kvflow.kv_events.KVEventsConfig (--kv-events-config)
    offline: bool = False  # made by `LLM` (vLLM's LLM_CLASS usage context), not a server

    def __post_init__(self) -> None:
        """Refuse what vLLM's config refuses, with the flag's name, before anything loads."""
        for name in (
            "block_size",
            "max_num_seqs",
            "max_num_batched_tokens",
            "tensor_parallel_size",
        ):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be at least 1, got {value}.")
        if not isinstance(self.structured_outputs_config, StructuredOutputsConfig):
            self.structured_outputs_config = StructuredOutputsConfig.parse(
                self.structured_outputs_config
            )
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}."
            )
        if self.distributed_executor_backend not in (None, "mp", "ray"):
            raise ValueError(
                "distributed_executor_backend must be mp or ray, got "
                f"{self.distributed_executor_backend!r}."
            )


class LLMEngine:
    def __init__(
        self, info: EngineInfo, tokenizer: Any, core: Any, parse_constraints: bool = True
    ) -> None:
        """`core` takes `add_request(EngineCoreRequest)` and `abort_requests(ids, status,
        error)`: an EngineCore, or a core client (whose outputs come back later).
        `parse_constraints`: output constraints are parsed here, with xgrammar (False: an API
        server over the engine process, which keeps the engine's verdicts and loads no torch)."""
        self.info = info
        self.config = info.config
        self.tokenizer = tokenizer
        self.model_name = info.model_name
        self.eos_token_id = info.eos_token_id
        # the generation config's other EOS ids (Llama 3 lists three): they stop like stop_token_ids
        self.generation_eos_ids = frozenset(info.generation_eos_ids) - {info.eos_token_id}
        self.dtype_name = info.dtype_name
        self.device = info.device
        self.core = core
        self.output_processor = OutputProcessor(tokenizer)
        so = info.structured_outputs
        self.validator = None if so is None else _validator(so, parse_constraints)

    @classmethod
    def from_args(cls, args: EngineArgs) -> LLMEngine:
        """Load the model and size the KV cache (`engine.assembly`). Raises ValueError for an
        impossible geometry or a flag this configuration cannot honour."""
        from kvflow.engine.assembly import assemble  # torch lives below this line

        core, info, tokenizer = assemble(args)
        return cls(info, tokenizer, core)

    def close(self) -> None:
        """Release what outlives steps (an in-process core's event publisher, ranks)."""
        close = getattr(self.core, "close", None)
        if close is not None:
            close()

    @property
    def max_model_len(self) -> int:
        return self.config.max_model_len

    # ---- requests ----------------------------------------------------------------------------

    def tokenize_prompt(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        vocab = len(self.tokenizer)
        if any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt token ids must be in [0, {vocab}).")
        return list(prompt)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> SamplingParams:
        """Liveness point 2, with vLLM's wording: refuse what could never be served, and fill in
        max_tokens (unset means the rest of the context). Returns the params to run with."""
        m, p = self.max_model_len, len(prompt_token_ids)
        if p == 0:
            raise ValueError("The prompt cannot be empty.")
        if params.structured_outputs is not None:
            self.validate_structured_outputs(params.structured_outputs)
        if params.logit_bias:
            vocab = len(self.tokenizer)
            if bad := [t for t in params.logit_bias if not 0 <= t < vocab]:
                raise ValueError(
                    f"token_id(s) {bad} in logit_bias contain out-of-vocab token ids. "
                    f"Vocabulary size: {vocab}"
                )
        if p >= m:
            raise ValueError(
                f"This model's maximum context length is {m} tokens. However, your request has "
                f"{p} input tokens. Please reduce the length of the input messages."
            )
        if params.max_tokens is None:
            return params.clone(max_tokens=m - p, min_tokens=min(params.min_tokens, m - p))
        if params.max_tokens > m - p:
            t = params.max_tokens
            raise ValueError(
                f"'max_tokens' or 'max_completion_tokens' is too large: {t}. This model's maximum "
                f"context length is {m} tokens and your request has {p} input tokens "
                f"({t} > {m} - {p})."
            )
        return params

    def validate_structured_outputs(self, so: StructuredOutputsParams) -> None:
        """Raises ValueError naming what is wrong with an output constraint (over the engine
        process: one the engine has refused, `EngineVerdicts`)."""
        if self.validator is None:
            raise ValueError("Structured outputs are not available: no grammar backend.")
        self.validator.validate(so)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
        arrival_time: float | None = None,
    ) -> SamplingParams:
        """Validate a request (`validate`), then send it (`send_request`). Returns the params it
        runs with. Raises ValueError."""
        params = self.validate(prompt_token_ids, params)
        return self.send_request(request_id, prompt_token_ids, params, prompt, arrival_time)

    def send_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None,
        arrival_time: float | None,
    ) -> SamplingParams:
        """Send a request's choices to the core (n share its prompt); `params` are what
        `validate` returned for this prompt, so nothing is checked twice. Returns the params it
        runs with (the generation config's other EOS ids added). Raises ValueError for a
        request id in use, or a request the core refuses."""
        extra = self.generation_eos_ids.difference(params.stop_token_ids)
        if extra and not params.ignore_eos:  # as vLLM: reported with stop_reason = the id
            params = params.clone(stop_token_ids=[*params.stop_token_ids, *sorted(extra)])
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        children = self.output_processor.add_request(request_id, prompt, prompt_token_ids, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        for i, child_id in enumerate(children):
            child = params
            if i and params.seed is not None:  # as vLLM: choice i draws from seed + i
                child = params.clone(seed=params.seed + i)
            new = EngineCoreRequest(
                child_id,
                list(prompt_token_ids),
                params.max_tokens,
                child,
                self.eos_token_id,
                sorted(params.stop_token_ids),
                params.min_tokens,
                params.ignore_eos,
                params.prompt_logprobs is not None,
                arrival,
            )
            try:
                self.core.add_request(new)
            except ValueError:
                self._end([request_id], RequestStatus.FINISHED_ABORTED, None)
                raise
        return params

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        return self._end(request_ids, RequestStatus.FINISHED_ABORTED, None)

    def fail_all(self, error: str) -> list[RequestOutput]:
        return self._end(
            self.output_processor.live_request_ids(), RequestStatus.FINISHED_ERROR, error
        )

    def _end(self, request_ids, status: RequestStatus, error: str | None) -> list[RequestOutput]:
        child_ids = [c for r in request_ids for c in self.output_processor.child_ids(r)]
        return self.process_outputs(self.core.abort_requests(child_ids, status, error))

    # ---- outputs -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One step of an in-process EngineCore; delta outputs for every request that progressed
        or ended.

        With async scheduling they are the previous step's outputs, detokenized while this
        step runs on the device. A stop string then ends its request in the core while the
        step computes one more token for it, which the core drops."""
        return self.process_outputs(self.core.step())

    def process_outputs(self, core_outputs: list[EngineCoreOutput]) -> list[RequestOutput]:
        """Core outputs as delta RequestOutputs; a choice a stop string ended here is ended in
        the core (its tokens made meanwhile are dropped)."""
        outputs, stopped = self.output_processor.process(core_outputs)
        if stopped:
            self.core.abort_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def stats(self) -> EngineStats:
        """An in-process EngineCore's counters (a server's come up in its Steps)."""
        return self.core.stats()


def _validator(config: StructuredOutputsConfig, parse_here: bool) -> Any:
    """A ConstraintValidator (xgrammar, and with it torch), or the engine's verdicts."""
    if not parse_here:
        return EngineVerdicts(config)
    from kvflow.structured.backend import ConstraintValidator

    return ConstraintValidator(config)
