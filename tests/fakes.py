"""A scripted runner for scheduler and engine tests: no model, but a simulated KV cache.

It plays the runner's side of the protocol (new requests once, diffs after, forget on finish)
and checks what a real model would silently get wrong: every token of a request's context must
be readable through its block table at the slot where it was written.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from kvflow.core.messages import ModelRunnerOutput, SchedulerOutput

NO_TOKEN = "the output constraint allows no next token here"


@dataclass(frozen=True)
class FakeGrammar:
    """A constraint for the fake runner: output token k must be one of `allowed`, and the
    grammar ends (the request stops) with output token `length` - 1. No allowed token: the
    mask is empty and the request fails."""

    length: int
    allowed: tuple[int, ...]


def scripted_token(req_id: str, position: int) -> int:
    """Deterministic 'model': the token at `position` depends on the request and position only."""
    return 3 + (hash((req_id, position)) % 1000)


@dataclass
class _State:
    tokens: list[int]
    prompt_len: int
    block_ids: list[int]
    num_computed: int
    grammar: FakeGrammar | None = None

    @property
    def num_outputs(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclass
class FakeRunner:
    block_size: int
    num_blocks: int
    eos_at: dict[str, int] = field(default_factory=dict)  # req_id -> output index that is EOS
    eos_token_id: int = 2
    fail: set[str] = field(default_factory=set)  # req_ids whose step "raises" (non-finite logits)
    states: dict[str, _State] = field(default_factory=dict)
    kv: dict[int, tuple[int, int]] = field(default_factory=dict)  # slot -> (position, token)
    steps: list[SchedulerOutput] = field(default_factory=list)
    max_model_len: int | None = None  # if set: no token is computed at or past it
    grammar_steps: int = 0  # constrained rows sampled (masked)

    def launch(self, sched: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        output = self.execute(sched)
        return lambda: output

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self.steps.append(sched)
        for req_id in sched.finished_req_ids | sched.preempted_req_ids:
            self.states.pop(req_id, None)
        for new in sched.new_reqs:
            assert new.req_id not in self.states, "runner sent a request it already has"
            tokens = new.prompt_token_ids + new.output_token_ids
            grammar = new.grammar
            if grammar is not None:  # a resumed request's matcher replays its kept tokens
                assert len(new.output_token_ids) < grammar.length, "ran past its grammar's end"
                assert all(t in grammar.allowed for t in new.output_token_ids), "off-grammar"
            self.states[new.req_id] = _State(
                tokens,
                len(new.prompt_token_ids),
                list(new.block_ids),
                new.num_computed_tokens,
                grammar,
            )
        cached = sched.cached_reqs
        for req_id, new_block_ids, num_computed in zip(
            cached.req_ids, cached.new_block_ids, cached.num_computed_tokens, strict=True
        ):
            st = self.states[req_id]
            assert st.num_computed == num_computed, "computed counter diverged"
            st.block_ids.extend(new_block_ids)
        sampled: dict[str, list[int]] = {}
        failed = {r: "injected failure" for r in self.fail if r in sched.num_scheduled_tokens}
        stopped: set[str] = set()
        for req_id, n in sched.num_scheduled_tokens.items():
            sampled[req_id] = self._run_one(req_id, n)
            grammar = self.states[req_id].grammar
            if grammar is None or not sampled[req_id]:
                continue
            self.grammar_steps += 1
            if not grammar.allowed:
                failed[req_id] = NO_TOKEN
            elif self.states[req_id].num_outputs == grammar.length:
                stopped.add(req_id)
        return ModelRunnerOutput(
            sampled, failed=failed, stopped=stopped, num_masked_rows=self.grammar_steps
        )

    def _slot(self, st: _State, pos: int) -> int:
        block = st.block_ids[pos // self.block_size]
        assert 0 < block < self.num_blocks, f"bad block id {block}"
        return block * self.block_size + pos % self.block_size

    def _run_one(self, req_id: str, n: int) -> list[int]:
        st = self.states[req_id]
        start, end = st.num_computed, st.num_computed + n
        assert end <= len(st.tokens), "scheduled past the known tokens"
        assert self.max_model_len is None or end <= self.max_model_len, "past max_model_len"
        assert len(st.block_ids) * self.block_size >= end, "not enough blocks for the tokens"
        for pos in range(start, end):  # write this step's KV
            self.kv[self._slot(st, pos)] = (pos, st.tokens[pos])
        for pos in range(end):  # read the whole context back through the block table
            assert self.kv.get(self._slot(st, pos)) == (pos, st.tokens[pos]), (
                f"{req_id}: KV at position {pos} is not the token computed there"
            )
        st.num_computed = end
        if end < len(st.tokens):
            return []  # a prefill chunk: no token yet
        out_index = len(st.tokens) - st.prompt_len
        token = (
            self.eos_token_id
            if self.eos_at.get(req_id) == out_index
            else scripted_token(req_id, end)
        )
        if st.grammar is not None and st.grammar.allowed:  # the masked draw
            token = st.grammar.allowed[token % len(st.grammar.allowed)]
        st.tokens.append(token)
        return [token]
