"""LLMEngine: tokenizer + validation + EngineCore + OutputProcessor, synchronous.

The offline `LLM` and the server's `AsyncEngine` both drive one of these.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Any

from kvflow.config import EngineConfig
from kvflow.core.perf import ModelShape
from kvflow.core.request import Request, RequestStatus
from kvflow.core.snapshot import EngineSnapshot
from kvflow.engine.engine_core import EngineCore, EngineStats, KVEventSink, Runner
from kvflow.engine.output_processor import OutputProcessor
from kvflow.engine.pending_grammars import PendingGrammars
from kvflow.outputs import RequestOutput
from kvflow.sampling_params import SamplingParams, StructuredOutputsParams
from kvflow.structured.config import StructuredOutputsConfig

logger = logging.getLogger("kvflow.engine")


@dataclass
class EngineArgs:
    """Engine arguments with vLLM's names; `kvflow serve` flags map onto them one to one."""

    model: str | None = None  # None: the embedded default model
    served_model_name: str | None = None
    dtype: str = "auto"
    quantization: str | None = None  # gguf, int8, fp8, none; None: gguf for a .gguf on the CPU
    device: str = "cpu"
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
        self,
        config: EngineConfig,
        runner: Runner,
        tokenizer,
        model_name: str,
        eos_token_id: int | None,
        dtype_name: str = "float32",
        device: str = "cpu",
        log_steps: bool = False,
        generation_eos_ids: frozenset[int] = frozenset(),
        async_scheduling: bool = False,
        grammar: Any = None,
        model_shape: ModelShape | None = None,
        kv_events: KVEventSink | None = None,
        core: EngineCore | None = None,
    ) -> None:
        """`grammar`: what validates output constraints (None: requests with one are refused);
        a GrammarBackend also compiles them here, a ConstraintValidator over a RemoteCore leaves
        the compile to the engine process. `core`: the EngineCore to drive (default: one made over `runner`);
        an API server whose core runs in the engine process passes a `core_client.RemoteCore`."""
        self.config = config
        self.model_path = None  # the resolved model directory, set by the builder
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.eos_token_id = eos_token_id
        # the generation config's other EOS ids (Llama 3 lists three): they stop like stop_token_ids
        self.generation_eos_ids = generation_eos_ids - {eos_token_id}
        self.dtype_name = dtype_name
        self.device = device
        self.core = core or EngineCore(
            config,
            runner,
            log_steps,
            async_scheduling,
            model_shape=model_shape,
            kv_events=kv_events,
        )
        self.output_processor = OutputProcessor(tokenizer)
        self.grammar = grammar
        self.pending_grammars = PendingGrammars()

    @classmethod
    def from_args(cls, args: EngineArgs) -> LLMEngine:
        """Load the model and size the KV cache. Raises ValueError for an impossible geometry."""
        log_steps = args.log_engine_steps or os.environ.get("KVFLOW_LOG_ENGINE_STEPS") == "1"
        if args.tensor_parallel_size > 1:
            from kvflow.worker.tp_builder import build_tp_engine

            return build_tp_engine(cls, args, log_steps)
        from kvflow.worker.builder import build_engine  # torch lives below this line

        return build_engine(cls, args, log_steps)

    def close(self) -> None:
        """Release what outlives steps (the KV-event publisher's sockets and thread)."""
        sink, self.core.kv_events = self.core.kv_events, None
        close = getattr(sink, "close", None)
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
        """Raises ValueError naming what is wrong with an output constraint."""
        if self.grammar is None:
            raise ValueError("Structured outputs are not available: no grammar backend.")
        self.grammar.validate(so)

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        prompt: str | None = None,
    ) -> None:
        """Validate and queue a request (n choices share its prompt). Raises ValueError."""
        params = self.validate(prompt_token_ids, params)
        extra = self.generation_eos_ids.difference(params.stop_token_ids)
        if extra and not params.ignore_eos:  # as vLLM: reported with stop_reason = the id
            params = params.clone(stop_token_ids=[*params.stop_token_ids, *sorted(extra)])
        if self.output_processor.has_request(request_id):
            raise ValueError(f"request id {request_id!r} is already in use")
        compile = None
        compiles_here = getattr(self.grammar, "compile", None)
        if params.structured_outputs is not None and compiles_here is not None:
            compile = compiles_here(params.structured_outputs)
            if compile.done() and compile.exception() is not None:
                raise ValueError(str(compile.exception()))
        children = self.output_processor.add_request(request_id, prompt, prompt_token_ids, params)
        for i, child_id in enumerate(children):
            child = params
            if i and params.seed is not None:  # as vLLM: choice i draws from seed + i
                child = params.clone(seed=params.seed + i)
            request = Request(
                child_id,
                list(prompt_token_ids),
                params.max_tokens,
                sampling_params=child,
                eos_token_id=self.eos_token_id,
                stop_token_ids=frozenset(params.stop_token_ids),
                min_tokens=params.min_tokens,
                ignore_eos=params.ignore_eos,
                skip_reading_prefix_cache=params.prompt_logprobs is not None,
            )
            self.core.add_request(request)
            if compile is not None:
                self.pending_grammars.add(request, compile)

    def abort_request(self, request_ids: list[str]) -> list[RequestOutput]:
        return self._end(request_ids, RequestStatus.FINISHED_ABORTED, None)

    def fail_all(self, error: str) -> list[RequestOutput]:
        return self._end(
            self.output_processor.live_request_ids(), RequestStatus.FINISHED_ERROR, error
        )

    def _end(self, request_ids, status: RequestStatus, error: str | None) -> list[RequestOutput]:
        child_ids = [c for r in request_ids for c in self.output_processor.child_ids(r)]
        outputs, _ = self.output_processor.process(
            self.core.abort_requests(child_ids, status, error)
        )
        return outputs

    # ---- the step ----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step; delta outputs for every request that progressed or ended.

        With async scheduling they are the previous step's outputs, detokenized while this
        step runs on the device. A stop string then ends its request in the core while the
        step computes one more token for it, which the core drops."""
        pending = self.pending_grammars
        failed = pending.poll(self.core, block=not self.core.has_schedulable_work())
        outputs, stopped = self.output_processor.process(failed + self.core.step())
        if stopped:
            self.core.abort_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    def stats(self) -> EngineStats:
        """The core's counters with the output-constraint failures counted here (call it
        where the core steps: in-process, or in the engine process)."""
        return replace(self.core.stats(), num_grammar_failures=self.num_grammar_failures())

    def num_grammar_failures(self) -> int:
        """Requests failed by their output constraint so far: it did not compile, or it
        allowed no token (counted by the runner)."""
        runner_failures = getattr(self.core.runner, "num_grammar_failures", 0)
        return self.pending_grammars.num_failures + runner_failures

    def snapshot(self) -> EngineSnapshot:
        """The scheduler and KV pool as plain data; on the thread that steps, between steps."""
        return self.core.snapshot()
