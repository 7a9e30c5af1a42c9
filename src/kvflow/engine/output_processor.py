"""Turns core outputs (token ids) into vLLM-shaped RequestOutputs: detokenization, stop strings,
logprobs and the fan-in of n > 1 choices. Outputs are deltas: only what is new this step."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvflow.core.messages import EngineCoreOutput, TokenLogprobs
from kvflow.engine.detokenizer import Decoder, IncrementalDetokenizer
from kvflow.outputs import CompletionOutput, Logprob, RequestOutput
from kvflow.sampling_params import SamplingParams


def child_request_ids(request_id: str, n: int) -> list[str]:
    """Each of the n choices runs as its own core request (they share the prompt's KV blocks)."""
    return [request_id] if n == 1 else [f"{i}_{request_id}" for i in range(n)]


@dataclass(slots=True)
class _Choice:
    index: int
    detok: IncrementalDetokenizer | None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None


@dataclass(slots=True)
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    choices: dict[str, _Choice] = field(default_factory=dict)
    # [None, then one entry per prompt token] while params.prompt_logprobs is set
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    prompt_logprobs_sent: bool = False
    num_finished: int = 0  # choices with a finish_reason

    @property
    def finished(self) -> bool:
        return self.num_finished == len(self.choices)


class OutputProcessor:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._decoder = Decoder(tokenizer)
        self._parents: dict[str, _Parent] = {}
        self._child_to_parent: dict[str, _Parent] = {}

    def add_request(
        self,
        request_id: str,
        prompt: str | None,
        prompt_token_ids: list[int],
        params: SamplingParams,
    ) -> list[str]:
        """Track a request; returns the child ids to add to the core."""
        parent = _Parent(request_id, prompt, prompt_token_ids, params)
        if params.prompt_logprobs is not None:
            parent.prompt_logprobs = [None]
        for i, child_id in enumerate(child_request_ids(request_id, params.n)):
            detok = None
            if params.detokenize:
                detok = IncrementalDetokenizer(
                    self.tokenizer, prompt_token_ids, params, self._decoder
                )
            parent.choices[child_id] = _Choice(i, detok)
            self._child_to_parent[child_id] = parent
        self._parents[request_id] = parent
        return list(parent.choices)

    def child_ids(self, request_id: str) -> list[str]:
        parent = self._parents.get(request_id)
        return [] if parent is None else list(parent.choices)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._parents

    def live_request_ids(self) -> list[str]:
        return list(self._parents)

    def process(
        self, core_outputs: list[EngineCoreOutput]
    ) -> tuple[list[RequestOutput], list[str]]:
        """Returns delta RequestOutputs (one per parent that progressed, in first-seen order) and
        the child ids that a stop string finished, which the caller must end in the core."""
        deltas: dict[str, tuple[_Parent, RequestOutput]] = {}
        stopped: list[str] = []
        for out in core_outputs:
            parent = self._child_to_parent.get(out.req_id)
            if parent is None:
                continue
            choice = parent.choices[out.req_id]
            if choice.finish_reason is not None:
                continue  # already ended by a stop string; this is the core catching up
            if out.new_prompt_logprobs and parent.prompt_logprobs is not None and not choice.index:
                decode = choice.detok.decode_token if choice.detok else None
                parent.prompt_logprobs += [_entry(lp, decode) for lp in out.new_prompt_logprobs]
            if not out.new_token_ids and out.finish_reason is None:
                continue  # a prompt chunk's logprobs: they go out with the first token
            completion = self._update_choice(parent, choice, out)
            if completion.finish_reason == "stop" and out.finish_reason is None:
                stopped.append(out.req_id)  # a stop string ended it; the core does not know yet
            delta = deltas.get(parent.request_id)
            if delta is None:
                ro = RequestOutput(
                    parent.request_id,
                    parent.prompt,
                    parent.prompt_token_ids,
                    [],
                    False,
                    num_cached_tokens=out.num_cached_tokens,
                )
                delta = deltas[parent.request_id] = (parent, ro)
            ro = delta[1]
            ro.outputs.append(completion)
            if out.first_scheduled_time is not None:
                ro.metrics.setdefault("first_scheduled_time", out.first_scheduled_time)
            if out.error:
                ro.metrics["error"] = out.error
            if out.num_preemptions:
                ro.metrics["num_preemptions"] = (
                    ro.metrics.get("num_preemptions", 0) + out.num_preemptions
                )
        for parent, ro in deltas.values():
            ro.finished = parent.finished
            if parent.prompt_logprobs is not None and not parent.prompt_logprobs_sent:
                if len(parent.prompt_logprobs) == len(parent.prompt_token_ids):  # complete
                    ro.prompt_logprobs, parent.prompt_logprobs_sent = parent.prompt_logprobs, True
            if ro.finished:
                self._drop(parent)
        return [ro for _, ro in deltas.values()], stopped

    def _update_choice(
        self, parent: _Parent, choice: _Choice, out: EngineCoreOutput
    ) -> CompletionOutput:
        finish_reason, stop_reason = out.finish_reason, out.stop_reason
        text = ""
        detok = choice.detok
        if detok is not None:
            if out.new_token_ids:
                stop_str = detok.update(out.new_token_ids, stop_terminated=finish_reason == "stop")
                if stop_str is not None:
                    finish_reason, stop_reason = "stop", stop_str
            text = detok.get_delta(finished=finish_reason is not None)
        if finish_reason is not None:
            choice.finish_reason = finish_reason
            parent.num_finished += 1
        num_logprobs = parent.params.logprobs
        logprobs = None
        if num_logprobs is not None and out.new_logprobs:
            logprobs = [self._logprob_entry(choice, lp) for lp in out.new_logprobs]
        return CompletionOutput(
            choice.index,
            text,
            out.new_token_ids,  # the core's list, made for this output
            choice.cumulative_logprob if num_logprobs is not None else None,
            logprobs,
            finish_reason,
            stop_reason,
        )

    def _logprob_entry(self, choice: _Choice, lp: TokenLogprobs) -> dict[int, Logprob]:
        choice.cumulative_logprob += lp.logprob
        return _entry(lp, choice.detok.decode_token if choice.detok else None)

    def _drop(self, parent: _Parent) -> None:
        self._parents.pop(parent.request_id, None)
        for child_id in parent.choices:
            self._child_to_parent.pop(child_id, None)


def _entry(lp: TokenLogprobs, decode: Callable[[int], str] | None) -> dict[int, Logprob]:
    """vLLM's logprobs entry: the token's own Logprob, then the top-n not already in it."""
    entry = {lp.token_id: Logprob(lp.logprob, lp.rank, decode(lp.token_id) if decode else None)}
    for rank, (tid, value) in enumerate(zip(lp.top_ids, lp.top_logprobs, strict=True), 1):
        if tid not in entry:
            entry[tid] = Logprob(value, rank, decode(tid) if decode else None)
    return entry
