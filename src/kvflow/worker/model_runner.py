"""ModelRunner: execute(SchedulerOutput) -> ModelRunnerOutput. One forward per step over every
scheduled token (prefill chunks and decodes packed together); never mutates request state."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvflow.attention.metadata import AttentionMetadata
from kvflow.core.messages import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from kvflow.sampling_params import SamplingParams
from kvflow.worker.cuda_graphs import DecodeGraphs
from kvflow.worker.sampler import SamplingMetadata, sample


@dataclass
class CachedRequestState:
    """The runner's copy of a request: what it needs to build inputs without being re-sent."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]
    params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    generator: torch.Generator | None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_slice(self, start: int, n: int) -> list[int]:
        """Tokens [start, start + n) of prompt + outputs, without concatenating the two."""
        p = len(self.prompt_token_ids)
        if start + n <= p:
            return self.prompt_token_ids[start : start + n]
        if start >= p:
            return self.output_token_ids[start - p : start - p + n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: start + n - p]


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        vocab_size: int,
        eos_token_id: int | None,
        device: str = "cpu",
        decode_graphs: DecodeGraphs | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.device = torch.device(device)
        self.requests: dict[str, CachedRequestState] = {}
        # Decode-only steps that fit its largest bucket run through it (CUDA graphs); None
        # (the CPU, --enforce-eager): every step is one eager forward.
        self.decode_graphs = decode_graphs

    def _update_states(self, sched: SchedulerOutput) -> None:
        for req_id in sched.finished_req_ids:
            self.requests.pop(req_id, None)
        for new in sched.new_reqs:
            params: SamplingParams = new.sampling_params
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(params.seed)
            self.requests[new.req_id] = CachedRequestState(
                new.prompt_token_ids,
                list(new.output_token_ids),
                params,
                list(new.block_ids),
                new.num_computed_tokens,
                gen,
            )
        for cached in sched.cached_reqs:
            state = self.requests[cached.req_id]
            state.block_ids.extend(cached.new_block_ids)
            state.num_computed_tokens = cached.num_computed_tokens

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        # Denormal floats make x86 float32 math crawl: measured 8x slower steps at batch 32
        # (SiLU 6 ms instead of 65 us). Flushing them changes nothing a token depends on. The
        # CPU flag is per thread and other code in the process may need IEEE denormals (e.g.
        # hypothesis refuses to run with them flushed), so it is set for the step only.
        flush = self.device.type == "cpu" and torch.set_flush_denormal(True)
        try:
            return self._execute(sched)
        finally:
            if flush:
                torch.set_flush_denormal(False)

    @torch.inference_mode()
    def _execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._update_states(sched)
        req_ids = list(sched.num_scheduled_tokens)
        states = [self.requests[r] for r in req_ids]
        query_lens = [sched.num_scheduled_tokens[r] for r in req_ids]
        computed = [s.num_computed_tokens for s in states]
        input_ids: list[int] = []
        positions: list[int] = []
        for s, n, c in zip(states, query_lens, computed, strict=True):
            input_ids.extend(s.token_slice(c, n))
            positions.extend(range(c, c + n))
        # Rows that complete their request's known tokens produce the next token. What the
        # sampler needs goes to the device before the forward is queued: on a GPU a host ->
        # device copy waits for the stream, so made after the forward it would stall the host
        # until the forward ended.
        sample_rows = [
            i
            for i, (s, n, c) in enumerate(zip(states, query_lens, computed, strict=True))
            if c + n == s.num_tokens
        ]
        sample_ids = [req_ids[i] for i in sample_rows]
        logit_rows = None  # every token's row is sampled (decode steps): no gather needed
        if sample_rows:
            if len(sample_rows) < len(input_ids):
                ends = torch.tensor(query_lens).cumsum(0) - 1
                logit_rows = ends[sample_rows].to(self.device)
            sampling = self._sampling_metadata(sample_ids)
        graphs = self.decode_graphs
        decode_only = len(input_ids) == len(req_ids)  # one token per request
        if graphs is not None and decode_only and graphs.fits(len(req_ids)):
            hidden = graphs.run(input_ids, positions, [s.block_ids for s in states])
        else:
            meta = AttentionMetadata.build(
                query_lens, computed, [s.block_ids for s in states], self.block_size, self.device
            )
            hidden = self.model(
                torch.tensor(input_ids, dtype=torch.long, device=self.device),
                torch.tensor(positions, dtype=torch.long, device=self.device),
                self.kv_caches,
                meta,
            )
        for s, n in zip(states, query_lens, strict=True):
            s.num_computed_tokens += n
        sampled: dict[str, list[int]] = {r: [] for r in req_ids}
        if not sample_rows:
            return ModelRunnerOutput(sampled)
        logits = self.model.compute_logits(hidden if logit_rows is None else hidden[logit_rows])
        return self._sample(logits, sample_ids, sampled, sampling)

    def _sampling_metadata(self, req_ids: list[str]) -> SamplingMetadata:
        states = [self.requests[r] for r in req_ids]
        return SamplingMetadata.build(
            [s.params for s in states],
            [s.prompt_token_ids for s in states],
            [s.output_token_ids for s in states],
            [s.generator for s in states],
            self.eos_token_id,
            self.vocab_size,
            self.device,
        )

    def _sample(
        self,
        logits: torch.Tensor,
        req_ids: list[str],
        sampled: dict[str, list[int]],
        meta: SamplingMetadata | None = None,
    ) -> ModelRunnerOutput:
        """Sample row i of `logits` for req_ids[i]; `meta` is built here when not given."""
        states = [self.requests[r] for r in req_ids]
        if meta is None:
            meta = self._sampling_metadata(req_ids)
        # The step's first device -> host copy (the sampled ids); bad rows and logprobs follow.
        out = sample(logits, meta)
        token_ids = out.sampled.tolist()
        failed = {}
        for row in out.bad_rows:
            failed[req_ids[row]] = "the model produced non-finite logits for this request"
        logprobs: dict[str, list[TokenLogprobs]] = {}
        for row, (req_id, state, token) in enumerate(zip(req_ids, states, token_ids, strict=True)):
            if req_id in failed:
                continue
            state.output_token_ids.append(token)
            sampled[req_id] = [token]
            if out.logprobs is not None and out.logprobs[row] is not None:
                logprobs[req_id] = [out.logprobs[row]]
        return ModelRunnerOutput(sampled, logprobs, failed)
