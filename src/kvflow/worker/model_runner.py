"""ModelRunner: launch(SchedulerOutput) -> wait() -> ModelRunnerOutput. One forward per step over
every scheduled token (prefill chunks and decodes packed together); never mutates request state.
On a GPU `launch` only queues the work and the host is free until `wait()`."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvflow.attention.metadata import AttentionMetadata, token_positions
from kvflow.core.messages import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from kvflow.sampling_params import SamplingParams
from kvflow.worker.cuda_graphs import DecodeGraphs
from kvflow.worker.input_rows import InputRows
from kvflow.worker.sampler import SamplerOutput, SamplingMetadata, sample


@dataclass
class CachedRequestState:
    """The runner's copy of a request: what it needs to build inputs without being re-sent.
    Its tokens, block ids and counters live in its row of `InputRows`."""

    params: SamplingParams
    generator: torch.Generator | None
    row: int


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
        self.rows = InputRows()
        # Decode-only steps that fit its largest bucket run through it (CUDA graphs); None
        # (the CPU, --enforce-eager): every step is one eager forward.
        self.decode_graphs = decode_graphs

    def _update_states(self, sched: SchedulerOutput) -> None:
        rows = self.rows
        for req_id in sched.finished_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None:
                rows.remove(state.row)
        for new in sched.new_reqs:
            params: SamplingParams = new.sampling_params
            gen = None
            if params.seed is not None:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(params.seed)
            if new.req_id in self.requests:  # resumed without being forgotten: free the old row
                rows.remove(self.requests[new.req_id].row)
            row = rows.add(
                new.prompt_token_ids, new.output_token_ids, new.block_ids, new.num_computed_tokens
            )
            self.requests[new.req_id] = CachedRequestState(params, gen, row)
        for cached in sched.cached_reqs:
            row = self.requests[cached.req_id].row
            if cached.new_block_ids:
                rows.append_blocks(row, cached.new_block_ids)
            rows.num_computed[row] = cached.num_computed_tokens

    def launch(self, sched: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        """Start the step: inputs, the forward and the sampler are queued (on the CPU: done);
        the returned call waits for the sampled ids and returns the step's output. That call
        must come before the next `launch` (it appends the ids to the rows)."""
        # Denormal floats make x86 float32 math crawl: measured 8x slower steps at batch 32
        # (SiLU 6 ms instead of 65 us). Flushing them changes nothing a token depends on. The
        # CPU flag is per thread and other code in the process may need IEEE denormals (e.g.
        # hypothesis refuses to run with them flushed), so it is set for the step only.
        flush = self.device.type == "cpu" and torch.set_flush_denormal(True)
        try:
            return self._launch(sched)
        finally:
            if flush:
                torch.set_flush_denormal(False)

    @torch.inference_mode()
    def _launch(self, sched: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        self._update_states(sched)
        req_ids = list(sched.num_scheduled_tokens)
        num_reqs, rows = len(req_ids), self.rows
        index = np.fromiter((self.requests[r].row for r in req_ids), np.intp, num_reqs)
        q_lens = np.fromiter(sched.num_scheduled_tokens.values(), np.int64, num_reqs)
        computed = rows.num_computed[index]
        ends = computed + q_lens
        positions = token_positions(q_lens, computed)
        input_ids = rows.input_ids(index, q_lens, positions)
        num_blocks = rows.num_blocks[index]
        table = rows.block_table[index, : max(int(num_blocks.max()), 1)]
        # Rows that complete their request's known tokens produce the next token. What the
        # sampler needs goes to the device before the forward is queued: on a GPU a host ->
        # device copy waits for the stream, so made after the forward it would stall the host
        # until the forward ended.
        sample_rows = np.flatnonzero(ends == rows.num_tokens[index])
        decode_only = len(sample_rows) == num_reqs == len(input_ids)  # each request's newest
        sample_ids = [req_ids[i] for i in sample_rows.tolist()]
        logit_rows = None  # every token's row is sampled (decode steps): no gather needed
        if sample_ids:
            if not decode_only:
                logit_rows = torch.from_numpy(q_lens.cumsum()[sample_rows] - 1).to(self.device)
            sampling = self._sampling_metadata(sample_ids, index[sample_rows])
        graphs = self.decode_graphs
        if graphs is not None and decode_only and graphs.fits(num_reqs):
            hidden = graphs.run(input_ids, computed, table, num_blocks)
        else:
            meta = AttentionMetadata.from_table(
                q_lens, computed, table, num_blocks, self.block_size, self.device
            )
            hidden = self.model(
                torch.from_numpy(input_ids).to(self.device),
                torch.from_numpy(positions).to(self.device),
                self.kv_caches,
                meta,
            )
        rows.num_computed[index] = ends
        if not sample_ids:
            return lambda: ModelRunnerOutput({})
        logits = self.model.compute_logits(hidden if logit_rows is None else hidden[logit_rows])
        return self._sample(logits, sample_ids, sampling)

    def _sampling_metadata(self, req_ids: list[str], index: np.ndarray) -> SamplingMetadata:
        states = [self.requests[r] for r in req_ids]
        return SamplingMetadata.build(
            [s.params for s in states],
            self.rows.history(index),
            [s.generator for s in states],
            self.eos_token_id,
            self.vocab_size,
            self.device,
        )

    def _sample(
        self, logits: torch.Tensor, req_ids: list[str], meta: SamplingMetadata
    ) -> Callable[[], ModelRunnerOutput]:
        """Queue the sampler on `logits` (row i for req_ids[i]); the returned call reads the
        sampled ids (the step's first device -> host copy) and appends them to the requests."""
        out = sample(logits, meta)
        return lambda: self._take(out, req_ids)

    def _take(self, out: SamplerOutput, req_ids: list[str]) -> ModelRunnerOutput:
        token_ids = out.token_ids  # the step's wait for the device; logprobs copy after it
        failed = {
            req_ids[row]: "the model produced non-finite logits for this request"
            for row in out.bad_rows
        }
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprobs]] = {}
        kept_rows, kept_tokens = [], []
        for i, (req_id, token) in enumerate(zip(req_ids, token_ids, strict=True)):
            if req_id in failed:
                continue
            kept_rows.append(self.requests[req_id].row)
            kept_tokens.append(token)
            sampled[req_id] = [token]
            if out.logprobs is not None and out.logprobs[i] is not None:
                logprobs[req_id] = [out.logprobs[i]]
        self.rows.append_tokens(kept_rows, kept_tokens)
        return ModelRunnerOutput(sampled, logprobs, failed)
