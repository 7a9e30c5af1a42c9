"""Property tests of the liveness invariant (DESIGN.md points 1-5) with the fake runner.

The step bound. Admission guarantees every request fits alone (prompt + max_tokens <= max_model_len
<= C), preemption takes the newest running request, and the running half gives the oldest request
the budget first. So the oldest live request gains at least one token per step and is never
preempted: once oldest, request i needs at most ceil((P_i + M_i) / B) prefill steps (a full
recompute) plus M_i decode steps. Summing over requests bounds the steps of the whole run:

    steps <= sum_i (ceil((P_i + M_i) / B) + M_i)      (B = max_num_batched_tokens)

The queue head. In every step that leaves a request waiting, the head waits for a reason: the
step preempted (the waiting half is skipped), the token budget or max_num_seqs is used up, or
its blocks (less its prefix hits) exceed the allocatable ones. `HeadCheckingRunner` checks this
at each step, when the scheduler's state is exactly what `schedule()` left.

Preemptions of a request R: R is preempted only when a request that is not younger than R lacks a
block, which cannot happen while R's elders hold nothing (R fits alone). So in every step that
preempts R some older request is running, and the oldest running one computes at least one token
in it. Hence R is preempted at most as often as its elders compute tokens:

    preemptions(R) <= sum over older j of num_tokens_j * (preemptions_j + 1)
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvflow.config import CacheConfig, EngineConfig, SchedulerConfig, resolve_max_model_len
from kvflow.core.kv_cache_manager import cdiv
from kvflow.core.messages import ModelRunnerOutput, SchedulerOutput
from kvflow.core.request import Request, RequestStatus
from kvflow.core.scheduler import Scheduler
from kvflow.engine.engine_core import EngineCore
from support.fakes import FakeGrammar, FakeRunner


@dataclass
class HeadCheckingRunner(FakeRunner):
    """The fake runner, plus: no step leaves the queue head waiting while it fits."""

    scheduler: Scheduler | None = None
    heads_checked: int = 0

    def execute(self, sched: SchedulerOutput) -> ModelRunnerOutput:
        self._check_head(sched)
        self._check_masks_are_current(sched)
        return super().execute(sched)

    def _check_masks_are_current(self, sched: SchedulerOutput) -> None:
        """A constrained request is never scheduled while an earlier step's token is still
        unknown (async scheduling applies that step first): its mask needs that token."""
        assert self.scheduler is not None
        for req_id in sched.num_scheduled_tokens:
            req = self.scheduler.requests[req_id]
            if req.grammar is not None:
                assert req.num_pending_tokens <= 1, f"{req_id}: masked with a token in flight"

    def _check_head(self, sched: SchedulerOutput) -> None:
        sch = self.scheduler
        assert sch is not None
        head = sch.first_ready_waiting()  # requests compiling their grammar wait aside
        if head is None or sched.num_preemptions:
            return
        left = sch.config.max_num_batched_tokens - sched.total_num_scheduled_tokens
        if left <= 0 or len(sch.running) >= sch.config.max_num_seqs:
            return
        hits, num_hit = sch.kv.get_computed_blocks(head)
        n = min(head.num_tokens - num_hit, left)
        need = cdiv(num_hit + n, self.block_size) - len(hits)
        allocatable = sch.kv.pool.num_free_blocks - sum(1 for b in hits if b.ref_cnt == 0)
        assert need > allocatable, f"{head.request_id} fits ({need} <= {allocatable}) but waits"
        self.heads_checked += 1


@st.composite
def grammars(draw):
    """(FakeGrammar, steps its compile takes, whether the compile fails)."""
    allowed = tuple(draw(st.lists(st.integers(3, 50), max_size=4, unique=True)))
    grammar = FakeGrammar(draw(st.integers(1, 30)), allowed)
    return grammar, draw(st.integers(0, 6)), draw(st.integers(0, 9)) == 0


@st.composite
def workloads(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    num_blocks = draw(st.integers(2, 24))
    cache = CacheConfig(block_size, num_blocks, draw(st.booleans()))
    if cache.servable_tokens < 2:
        num_blocks = 3
        cache = CacheConfig(block_size, num_blocks, cache.enable_prefix_caching)
    max_model_len = resolve_max_model_len(cache, 10_000, None)
    budget = draw(st.integers(1, 48))
    max_seqs = draw(st.integers(1, 6))
    prefixes = draw(
        st.lists(st.lists(st.integers(3, 50), min_size=1, max_size=20), min_size=1, max_size=3)
    )
    reqs = []
    for i in range(draw(st.integers(1, 10))):
        prefix = draw(st.sampled_from(prefixes))
        tail = draw(st.lists(st.integers(3, 50), max_size=20))
        prompt = (prefix + tail)[: max_model_len - 1]
        max_tokens = draw(st.integers(1, max_model_len - len(prompt)))
        arrive = draw(st.integers(0, 15))
        abort_at = draw(st.one_of(st.none(), st.integers(0, 40)))
        eos_at = draw(st.one_of(st.none(), st.integers(0, max_tokens)))
        grammar = draw(st.one_of(st.none(), grammars()))
        if grammar is not None:
            eos_at = None  # the grammar picks the tokens
        reqs.append((f"r{i}", prompt, max_tokens, arrive, abort_at, eos_at, grammar))
    return cache, SchedulerConfig(max_model_len, budget, max_seqs), reqs, draw(st.booleans())


def _bound(reqs, budget: int) -> int:
    return sum(-(-(len(p) + m) // budget) + m for _, p, m, *_ in reqs)


@settings(
    max_examples=int(os.environ.get("KVFLOW_PROPERTY_EXAMPLES", "2000")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(workloads())
def test_every_request_finishes_within_the_bound_and_nothing_leaks(workload):
    """Also with async scheduling (drawn): outputs then come a step late, and a request may be
    scheduled once more after its last token (before its EOS is seen), so the bound grows by
    one step per request plus the last step's output."""
    cache, sched_cfg, reqs, async_scheduling = workload
    eos = {rid: e for rid, _, _, _, _, e, _ in reqs if e is not None}
    grammar_of = {r[0]: r[6] for r in reqs if r[6] is not None}
    compile_at: dict[str, int] = {}
    runner = HeadCheckingRunner(
        cache.block_size, cache.num_blocks, eos_at=eos, max_model_len=sched_cfg.max_model_len
    )
    engine = EngineCore(EngineConfig(cache, sched_cfg), runner, async_scheduling=async_scheduling)
    runner.scheduler = engine.scheduler
    pool = engine.scheduler.kv.pool
    live: dict[str, Request] = {}
    finished: dict[str, str] = {}
    last_arrival = max(r[3] for r in reqs)
    bound = last_arrival + 1 + _bound(reqs, sched_cfg.max_num_batched_tokens)
    if async_scheduling:
        bound += len(reqs) + 1
    bound += sum(delay for _, delay, _ in grammar_of.values())  # all may be compiling
    idle_steps = 0  # consecutive steps that launched nothing while requests were live
    step = 0
    while step <= last_arrival or engine.has_unfinished_requests():
        for rid, prompt, max_tokens, arrive, abort_at, _, spec in reqs:
            if arrive == step:
                live[rid] = Request(
                    rid, list(prompt), max_tokens, eos_token_id=2, grammar_pending=bool(spec)
                )
                engine.scheduler.add_request(live[rid])
                if spec is not None:
                    compile_at[rid] = step + spec[1]
            if compile_at.get(rid) == step and rid not in finished:
                _compiled(engine, live[rid], spec, finished)
            if abort_at == step and rid in live and rid not in finished:
                for out in engine.abort_requests([rid]):
                    finished[out.req_id] = out.finish_reason
        live_before = engine.has_schedulable_work()
        for out in engine.step():
            if out.finished:
                finished[out.req_id] = out.finish_reason
        # Liveness point 5 / no spin: a step with live requests schedules something; with
        # async scheduling one may not, while the step in flight holds every next token.
        idle_steps = idle_steps + 1 if live_before and not engine.last_step_tokens else 0
        assert idle_steps <= int(async_scheduling)
        pool.check_invariants()
        step += 1
        assert step <= bound, f"run exceeded the derived bound of {bound} steps"
    assert set(finished) == set(live)
    for rid, reason in finished.items():
        spec = grammar_of.get(rid)
        may_fail = spec is not None and (spec[2] or not spec[0].allowed)
        assert reason in ("stop", "length", "abort", *(("error",) if may_fail else ())), rid
        if spec is not None and reason in ("stop", "length"):
            _check_constrained(live[rid], spec[0], reason, sched_cfg.max_model_len)
    assert engine.stats().num_stuck_failures == 0
    assert pool.num_free_blocks == cache.num_blocks - 1, "blocks held after every request ended"
    order = sorted(live.values(), key=lambda r: r.arrival_seq)
    for i, r in enumerate(order):
        elder_work = sum(o.num_tokens * (o.num_preemptions + 1) for o in order[:i])
        assert r.num_preemptions <= elder_work
    for r in order:
        if r.finish_reason == "length":
            assert r.num_output_tokens == r.max_tokens or r.num_tokens == sched_cfg.max_model_len


def _compiled(engine: EngineCore, req: Request, spec, finished: dict[str, str]) -> None:
    """The request's grammar compiled (or failed to) now, as `PendingGrammars` resolves it."""
    grammar, _, fails = spec
    if fails:
        for out in engine.abort_requests([req.request_id], RequestStatus.FINISHED_ERROR, "bad"):
            finished[out.req_id] = out.finish_reason
        return
    req.grammar, req.grammar_pending = grammar, False


def _check_constrained(req: Request, grammar: FakeGrammar, reason: str, max_model_len: int):
    """Every output token was allowed; the grammar's end stopped it, or a length limit came
    first."""
    assert all(t in grammar.allowed for t in req.output_token_ids), req.request_id
    assert req.num_output_tokens <= grammar.length
    if reason == "stop":
        assert req.num_output_tokens == grammar.length
    else:
        assert req.num_output_tokens == req.max_tokens or req.num_tokens == max_model_len
