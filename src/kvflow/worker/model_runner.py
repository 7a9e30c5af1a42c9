"""ModelRunner: launch(SchedulerOutput) -> wait() -> ModelRunnerOutput. One forward per step over
every scheduled token (prefill chunks and decodes packed together); never mutates request state.
On a GPU `launch` only queues the work and the host is free until `wait()`.

With async scheduling the next `launch` comes before that wait: a request's newest token is
then still on the device, a placeholder in its row. The launch copies it, on the device, from
the previous step's sampled ids into the inputs (and into the penalties' history), and the
wait writes the ids into the rows."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from kvflow.attention.metadata import AttentionMetadata, token_positions
from kvflow.core.messages import ModelRunnerOutput, SchedulerOutput, TokenLogprobs
from kvflow.sampling_params import SamplingParams
from kvflow.structured.bitmask import GrammarMasker, GrammarState, StepMask, blocked_ids
from kvflow.transfer import to_device
from kvflow.worker.cuda_graphs import DecodeGraphs
from kvflow.worker.greedy import RawArgmax
from kvflow.worker.input_rows import InputRows
from kvflow.worker.sampler import (
    SamplerOutput,
    SamplingMetadata,
    compute_logprobs,
    sample,
)

_PROMPT_LOGPROBS_CHUNK = 256  # prompt positions whose logits are materialised at once


@dataclass(slots=True)
class CachedRequestState:
    """The runner's copy of a request: what it needs to build inputs without being re-sent.
    Its tokens, block ids and counters live in its row of `InputRows`; a preempted request has
    no row (-1) and keeps its generator, so that a seed gives the same tokens however often
    the request is preempted."""

    params: SamplingParams
    generator: torch.Generator | None
    row: int
    num_prompt_logprobs: int = 0  # prompt positions whose next-token logprobs were computed
    grammar: GrammarState | None = None  # the output constraint's matcher, if any


@dataclass(slots=True)
class _StepInputs:
    """One step's inputs, gathered from the rows (b: the b-th scheduled request)."""

    req_ids: list[str]
    states: list[CachedRequestState]
    index: np.ndarray  # b -> its row
    q_lens: np.ndarray
    computed: np.ndarray
    ends: np.ndarray  # computed + q_lens
    positions: np.ndarray  # every scheduled token's
    input_ids: np.ndarray  # (placeholders for ids still on the device)
    feed: tuple[np.ndarray, np.ndarray] | None  # see `_feed_from_device`
    num_blocks: np.ndarray
    table: np.ndarray
    sample_rows: np.ndarray  # the b that sample
    sample_ids: list[str]
    sample_states: list[CachedRequestState]
    decode_only: bool


@dataclass(frozen=True)
class _Sampled:
    """A launched step's sampled ids, on the device until its wait reads them. Element i is
    the token of row `rows[i]` at `positions[i]` (a placeholder until then), if the row still
    has epoch `epochs[i]` (see InputRows)."""

    ids: torch.Tensor  # int64 [S]
    states: list[CachedRequestState]
    rows: np.ndarray
    epochs: np.ndarray
    positions: np.ndarray


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
        self._in_flight: _Sampled | None = None  # the latest launch's ids, until its wait
        self._prompt_logprobs_due: set[str] = set()  # requests still owed prompt logprobs
        self._masker: GrammarMasker | None = None  # made for the first constrained request
        self.num_grammar_failures = 0  # requests failed by their constraint (no token allowed)

    def _update_states(self, sched: SchedulerOutput) -> None:
        rows = self.rows
        for req_id in sched.finished_req_ids:
            state = self.requests.pop(req_id, None)
            if state is not None and state.row >= 0:
                rows.remove(state.row)
            self._prompt_logprobs_due.discard(req_id)
        for req_id in sched.preempted_req_ids:
            state = self.requests.get(req_id)
            if state is not None and state.row >= 0:
                rows.remove(state.row)
                state.row = -1
        for new in sched.new_reqs:
            row = rows.add(
                new.prompt_token_ids, new.output_token_ids, new.block_ids, new.num_computed_tokens
            )
            state = self.requests.get(new.req_id)  # a preempted request resumes
            if state is None:
                params: SamplingParams = new.sampling_params
                gen = None
                if params.seed is not None:
                    gen = torch.Generator(device=self.device)
                    gen.manual_seed(params.seed)
                state = CachedRequestState(params, gen, row)
                if new.grammar is not None:
                    start = tuple(params.reasoning_end_ids or ())
                    state.grammar = GrammarState(new.grammar, start)
                self.requests[new.req_id] = state
                if params.prompt_logprobs is not None:
                    self._prompt_logprobs_due.add(new.req_id)
            else:
                state.row = row
            if state.grammar is not None:  # a resumed request's matcher: its kept tokens
                state.grammar.sync(new.output_token_ids)
        cached = sched.cached_reqs
        for req_id, new_block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            row = self.requests[req_id].row
            if new_block_ids:
                rows.append_blocks(row, new_block_ids)
            rows.num_computed[row] = num_computed

    def launch(self, sched: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        """Start the step: inputs, the forward and the sampler are queued (on the CPU: done);
        the returned call waits for the sampled ids and returns the step's output. The next
        `launch` may come before that call (async scheduling), but not a second one."""
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
        """The step's named parts: the runner's copy of the requests updated, the inputs
        gathered from the rows, the sampler's inputs queued, the forward, then the sampler."""
        self._update_states(sched)
        step = self._gather_inputs(sched)
        # Every host -> device copy goes through `to_device`, which queues instead of waiting
        # for the stream, so the sampler's inputs are queued before the forward at no stall.
        logit_rows, sampling = self._sampling_inputs(step)
        mask = self._step_mask(step.sample_states) if step.sample_ids else None
        hidden, logits, raw = self._forward(step)
        self.rows.num_computed[step.index] = step.ends
        prompt_logprobs = {}
        if self._prompt_logprobs_due:
            prompt_logprobs = self._prompt_logprobs(
                step.req_ids, step.index, step.q_lens, step.computed, hidden
            )
        if not step.sample_ids:
            self._in_flight = None
            return lambda: ModelRunnerOutput({}, prompt_logprobs=self._live(prompt_logprobs))
        if logits is None:
            logits = self.model.compute_logits(hidden if logit_rows is None else hidden[logit_rows])
        return self._sample(
            logits,
            step.sample_ids,
            step.sample_states,
            sampling,
            prompt_logprobs,
            raw=raw,
            mask=mask,
        )

    def _gather_inputs(self, sched: SchedulerOutput) -> _StepInputs:
        """The scheduled requests' ids, positions and block tables from their rows; which rows
        sample (those that complete their request's tokens, a placeholder included)."""
        req_ids = list(sched.num_scheduled_tokens)
        num_reqs, rows = len(req_ids), self.rows
        states = [self.requests[r] for r in req_ids]
        index = np.fromiter((s.row for s in states), np.intp, num_reqs)
        q_lens = np.fromiter(sched.num_scheduled_tokens.values(), np.int64, num_reqs)
        computed = rows.num_computed[index]
        ends = computed + q_lens
        positions = token_positions(q_lens, computed)
        input_ids = rows.input_ids(index, q_lens, positions)
        num_blocks = rows.num_blocks[index]
        table = rows.block_table[index, : max(int(num_blocks.max()), 1)]
        sample_rows = np.flatnonzero(ends == rows.num_tokens[index])
        sample_ids, sample_states = req_ids, states
        if len(sample_rows) < num_reqs:
            sample_ids = [req_ids[i] for i in sample_rows.tolist()]
            sample_states = [states[i] for i in sample_rows.tolist()]
        return _StepInputs(
            req_ids, states, index, q_lens, computed, ends, positions, input_ids,
            self._feed_from_device(index), num_blocks, table, sample_rows, sample_ids,
            sample_states,
            decode_only=len(sample_rows) == num_reqs == len(input_ids),  # each one's newest
        )  # fmt: skip

    def _sampling_inputs(
        self, step: _StepInputs
    ) -> tuple[torch.Tensor | None, SamplingMetadata | None]:
        """(the hidden rows whose logits are sampled, None: every row, as in a decode step;
        the sampler's metadata), None for a step that samples nothing."""
        if not step.sample_ids:
            return None, None
        logit_rows = None
        if not step.decode_only:
            at = step.q_lens.cumsum()[step.sample_rows] - 1
            logit_rows = to_device(at, torch.int64, self.device)
        sampling = self._sampling_metadata(
            step.sample_states, step.index, step.sample_rows, step.feed
        )
        return logit_rows, sampling

    def _forward(
        self, step: _StepInputs
    ) -> tuple[torch.Tensor, torch.Tensor | None, RawArgmax | None]:
        """(hidden states, logits and greedy argmax where the decode graph made them): through
        the decode graphs for a decode-only step that fits them, else one eager forward. The
        newest token of a request the in-flight step is still sampling is copied in on the
        device."""
        feed, q_lens = step.feed, step.q_lens
        fill_ids = None if feed is None else (lambda ids: self._copy_fed(ids, feed, q_lens))
        graphs = self.decode_graphs
        if graphs is not None and step.decode_only and graphs.fits(len(step.req_ids)):
            return graphs.run(step.input_ids, step.computed, step.table, step.num_blocks, fill_ids)
        meta = AttentionMetadata.from_table(
            q_lens, step.computed, step.table, step.num_blocks, self.block_size, self.device
        )
        ids = to_device(step.input_ids, torch.int64, self.device)
        if fill_ids is not None:
            fill_ids(ids)
        positions = to_device(step.positions, torch.int64, self.device)
        return self.model(ids, positions, self.kv_caches, meta), None, None

    def _step_mask(self, states: list[CachedRequestState]) -> StepMask | None:
        """The token bitmask of the constrained rows among `states` (the sampled rows)."""
        rows = [i for i, s in enumerate(states) if s.grammar is not None]
        if not rows:
            return None
        if self._masker is None:
            self._masker = GrammarMasker(self.vocab_size, self.device)
        grammars = [states[i].grammar for i in rows]
        blocked = {}
        for i, g in zip(rows, grammars, strict=True):
            if ids := blocked_ids(states[i].params, g.num_accepted, self.eos_token_id):
                blocked[i] = ids
        return StepMask(self._masker, rows, grammars, len(states), blocked)

    def _prompt_logprobs(
        self,
        req_ids: list[str],
        index: np.ndarray,
        q_lens: np.ndarray,
        computed: np.ndarray,
        hidden: torch.Tensor,
    ) -> dict[str, tuple[CachedRequestState, list[TokenLogprobs]]]:
        """Logprobs of the prompt tokens that this step's positions predict (position p: token
        p + 1), for the requests that ask for them, each position once even across preemption.
        Read back now, so such a step waits for the device: they are rare."""
        starts = np.cumsum(q_lens) - q_lens
        spans: list[tuple[str, CachedRequestState, int, int]] = []  # req, state, first, end
        hidden_rows: list[np.ndarray] = []
        targets: list[np.ndarray] = []
        for b, req_id in enumerate(req_ids):
            if req_id not in self._prompt_logprobs_due:
                continue
            state, row = self.requests[req_id], index[b]
            last = int(self.rows.prompt_len[row]) - 1  # the last prompt position predicts output
            first = state.num_prompt_logprobs
            end = min(int(computed[b] + q_lens[b]), last)
            if end >= last:
                self._prompt_logprobs_due.discard(req_id)
            if first >= end:
                continue
            if first < computed[b]:  # positions skipped (a prefix hit): entries would shift
                raise RuntimeError(f"{req_id}: prompt logprobs from {first}, step at {computed[b]}")
            hidden_rows.append(starts[b] + np.arange(first, end) - computed[b])
            targets.append(self.rows.token_ids[row, first + 1 : end + 1].astype(np.int64))
            spans.append((req_id, state, first, end))
            state.num_prompt_logprobs = end
        if not spans:
            return {}
        at = to_device(np.concatenate(hidden_rows), torch.int64, self.device)
        token_ids = np.concatenate(targets)
        target = to_device(token_ids, torch.int64, self.device)
        top = max(state.params.prompt_logprobs for _, state, _, _ in spans)
        own, rank, top_ids, top_lps = [], [], [], []
        for i in range(0, len(at), _PROMPT_LOGPROBS_CHUNK):  # [rows, vocab] floats at a time
            chunk = slice(i, i + _PROMPT_LOGPROBS_CHUNK)
            logits = self.model.compute_logits(hidden[at[chunk]])
            for acc, part in zip(
                (own, rank, top_ids, top_lps),
                compute_logprobs(logits, target[chunk], top),
                strict=True,
            ):
                acc.extend(part.tolist())
        return _per_request(spans, token_ids, own, rank, top_ids, top_lps)

    def _live(
        self, prompt_logprobs: dict[str, tuple[CachedRequestState, list[TokenLogprobs]]]
    ) -> dict[str, list[TokenLogprobs]]:
        """Those of requests that have not ended since the launch."""
        return {r: e for r, (s, e) in prompt_logprobs.items() if self.requests.get(r) is s}

    def _feed_from_device(self, index: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
        """The requests (positions b in `index`) whose newest token the in-flight step is
        still sampling, and where it is in that step's ids; None if there are none."""
        prev = self._in_flight
        if prev is None:
            return None
        live = self.rows.epoch[prev.rows] == prev.epochs
        source = np.full(len(self.rows.epoch), -1, dtype=np.int64)
        source[prev.rows[live]] = np.flatnonzero(live)
        src = source[index]
        fed = np.flatnonzero(src >= 0)
        return (fed, src[fed]) if len(fed) else None

    def _copy_fed(
        self, target: torch.Tensor, feed: tuple[np.ndarray, np.ndarray], q_lens: np.ndarray
    ) -> None:
        """Input ids on the device: the last token of each fed request from the step in flight."""
        fed, src = feed
        self._copy_ids(target, q_lens.cumsum()[fed] - 1, src)

    def _copy_ids(self, target: torch.Tensor, dst: np.ndarray, src: np.ndarray) -> None:
        """target.view(-1)[dst] = the in-flight step's ids[src], queued on the device."""
        assert self._in_flight is not None
        ids, flat = self._in_flight.ids, target.view(-1)
        n = len(dst)
        if n == len(ids) and np.array_equal(dst, src) and np.array_equal(src, np.arange(n)):
            flat[:n].copy_(ids)  # the steady decode batch: same requests, same order
            return
        pairs = to_device(np.stack((dst, src)), torch.int64, self.device)
        flat.index_copy_(0, pairs[0], ids.index_select(0, pairs[1]))

    def _sampling_metadata(
        self,
        states: list[CachedRequestState],
        index: np.ndarray,
        sample_rows: np.ndarray,
        feed: tuple[np.ndarray, np.ndarray] | None,
    ) -> SamplingMetadata:
        rows = index[sample_rows]
        meta = SamplingMetadata.build(
            [s.params for s in states],
            self.rows.history(rows),
            [s.generator for s in states],
            self.eos_token_id,
            self.vocab_size,
            self.device,
        )
        if feed is not None and meta.output_token_ids is not None:
            # the penalties' history ends with the fed token: copy it there too
            fed, src = feed
            at = np.searchsorted(sample_rows, fed)  # fed requests always sample
            last = self.rows.num_tokens[index[fed]] - 1 - self.rows.prompt_len[index[fed]]
            self._copy_ids(meta.output_token_ids, at * meta.output_token_ids.shape[1] + last, src)
        return meta

    def _sample(
        self,
        logits: torch.Tensor,
        req_ids: list[str],
        states: list[CachedRequestState],
        meta: SamplingMetadata,
        prompt_logprobs: dict[str, tuple[CachedRequestState, list[TokenLogprobs]]],
        raw: RawArgmax | None = None,
        mask: StepMask | None = None,
    ) -> Callable[[], ModelRunnerOutput]:
        """Queue the sampler on `logits` (row i for req_ids[i]; `raw`: their `raw_argmax`, if
        made) and append placeholders for its ids; the returned call reads them (the step's
        first device -> host copy). `mask` applies first: before penalties, temperature and
        logprobs, as in vLLM."""
        if mask is not None:
            logits = logits.float()
            mask.apply(logits)
            raw = None  # the graph's argmax was of the unmasked logits
        out = sample(logits, meta, raw)
        out.to_host()
        rows = np.fromiter((s.row for s in states), np.intp, len(states))
        positions = self.rows.append_tokens(rows)
        launched = _Sampled(out.sampled, states, rows, self.rows.epoch[rows], positions)
        self._in_flight = launched
        return lambda: self._take(out, req_ids, launched, prompt_logprobs, mask)

    def _take(
        self,
        out: SamplerOutput,
        req_ids: list[str],
        launched: _Sampled,
        prompt_logprobs: dict[str, tuple[CachedRequestState, list[TokenLogprobs]]],
        mask: StepMask | None = None,
    ) -> ModelRunnerOutput:
        """The step's tokens into the rows (those not freed since the launch) and the output
        (requests not ended since: a preempted one keeps its token). Constrained requests'
        matchers take their tokens; one whose grammar ended stops."""
        token_ids = out.token_ids  # the step's wait for the device; logprobs copy after it
        if self._in_flight is launched:
            self._in_flight = None
        tokens = np.asarray(token_ids, dtype=np.int64)
        self.rows.fill(launched.rows, launched.epochs, launched.positions, tokens)
        bad = set(out.bad_rows)
        sampled: dict[str, list[int]] = {}
        logprobs: dict[str, list[TokenLogprobs]] = {}
        failed: dict[str, str] = {}
        requests, row_logprobs = self.requests, out.logprobs
        live = [requests.get(r) is s for r, s in zip(req_ids, launched.states, strict=True)]
        ended, grammar_failed = set(), {}
        if mask is not None:
            ended, grammar_failed = mask.advance(token_ids, live)
            self.num_grammar_failures += len(grammar_failed)
        for i, req_id in enumerate(req_ids):
            if not live[i]:
                continue  # ended since the launch (its id may even be in use again)
            if grammar_failed and i in grammar_failed:
                failed[req_id] = grammar_failed[i]
                continue
            if bad and i in bad:
                failed[req_id] = "the model produced non-finite logits for this request"
                continue
            sampled[req_id] = [token_ids[i]]
            if row_logprobs is not None and row_logprobs[i] is not None:
                logprobs[req_id] = [row_logprobs[i]]
        stopped = {req_ids[i] for i in ended}
        masked = 0 if mask is None else len(mask.rows)
        return ModelRunnerOutput(
            sampled, logprobs, self._live(prompt_logprobs), failed, stopped, masked
        )


def _per_request(
    spans: list[tuple[str, CachedRequestState, int, int]],
    token_ids: np.ndarray,
    own: list,
    rank: list,
    top_ids: list,
    top_lps: list,
) -> dict[str, tuple[CachedRequestState, list[TokenLogprobs]]]:
    """The prompt logprobs of consecutive positions, cut back into each span's request (its
    `prompt_logprobs` top entries each)."""
    out, i = {}, 0
    for req_id, state, first, end in spans:
        n = state.params.prompt_logprobs
        out[req_id] = (
            state,
            [
                TokenLogprobs(int(token_ids[j]), own[j], rank[j], top_ids[j][:n], top_lps[j][:n])
                for j in range(i, i + end - first)
            ],
        )
        i += end - first
    return out
