"""Scheduler scenarios, scripted step by step with the fake runner."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvflow.config import CacheConfig, EngineConfig, SchedulerConfig
from kvflow.core.request import Request, RequestStatus
from kvflow.engine.engine_core import EngineCore
from support.fakes import FakeRunner, scripted_token


def make_engine(
    num_blocks=64,
    block_size=4,
    budget=64,
    max_seqs=8,
    max_model_len=None,
    caching=True,
    async_scheduling=False,
    runner=FakeRunner,
    **fake,
):
    cache = CacheConfig(block_size, num_blocks, caching)
    mml = max_model_len or cache.servable_tokens
    cfg = EngineConfig(cache, SchedulerConfig(mml, budget, max_seqs))
    fake_runner = runner(block_size, num_blocks, max_model_len=mml, **fake)
    return EngineCore(cfg, fake_runner, async_scheduling=async_scheduling)


both_modes = pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])


def add(engine, rid, prompt_len, max_tokens=4, start=0, **kw):
    req = Request(rid, list(range(start, start + prompt_len)), max_tokens, eos_token_id=2, **kw)
    engine.scheduler.add_request(req)
    return req


def run_to_end(engine, max_steps=10_000):
    outs: dict[str, list] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            outs.setdefault(o.req_id, []).append(o)
        engine.scheduler.kv.pool.check_invariants()
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.kv.usage == 0.0
    return outs


def tokens(outs, rid):
    return [t for o in outs[rid] for t in o.new_token_ids]


def test_chunked_prefill_at_budget_then_decode_shares_the_step():
    eng = make_engine(budget=16)
    add(eng, "a", 40, max_tokens=3)
    seen = []
    while eng.has_unfinished_requests():
        if len(seen) == 2:
            add(eng, "b", 20, max_tokens=2, start=500)
        eng.step()
        seen.append(dict(eng.runner.steps[-1].num_scheduled_tokens))
    assert seen == [
        {"a": 16},
        {"a": 16},
        {"a": 8, "b": 8},  # a's last chunk and b's first share the step
        {"a": 1, "b": 12},  # a decodes, b finishes its prefill
        {"a": 1, "b": 1},
    ]


def test_prefix_hit_skips_cached_blocks():
    eng = make_engine(block_size=4)
    add(eng, "a", 18, max_tokens=2)
    run_to_end(eng)
    b = add(eng, "b", 18, max_tokens=2)  # same prompt: 16 of 18 tokens cached (4 full blocks)
    eng.step()
    assert eng.runner.steps[-1].num_scheduled_tokens == {"b": 2}
    assert b.num_cached_tokens == 16
    c = add(eng, "c", 16, max_tokens=2)  # 16 tokens: the last block holds the last token
    eng.step()
    assert c.num_cached_tokens == 12
    run_to_end(eng)
    stats = eng.stats()
    assert stats.prefix_cache_queries == 18 + 18 + 16 and stats.prefix_cache_hits == 28


@both_modes
def test_preemption_takes_newest_and_outputs_are_unchanged(async_scheduling):
    alone = {}
    for rid, start in (("old", 0), ("new", 100)):
        eng = make_engine(num_blocks=64)
        add(eng, rid, 6, max_tokens=20, start=start)
        alone[rid] = tokens(run_to_end(eng), rid)
    eng = make_engine(
        async_scheduling=async_scheduling, num_blocks=9, block_size=4
    )  # 32 servable tokens: both can't fit at once
    old = add(eng, "old", 6, max_tokens=20)
    new = add(eng, "new", 6, max_tokens=20, start=100)
    outs = run_to_end(eng)
    assert old.num_preemptions == 0 and new.num_preemptions >= 1
    assert eng.stats().num_preemptions_total == new.num_preemptions
    assert tokens(outs, "old") == alone["old"] and tokens(outs, "new") == alone["new"]


@both_modes
def test_stop_conditions(async_scheduling):
    eng = make_engine(async_scheduling=async_scheduling, eos_at={"eos": 3, "early": 0})
    add(eng, "eos", 5, max_tokens=10)
    add(eng, "ign", 5, max_tokens=4, ignore_eos=True)
    add(eng, "minp", 5, max_tokens=10, min_tokens=3)
    eng.runner.eos_at["minp"] = 1  # EOS before min_tokens is not a stop
    eng.runner.eos_at["ign"] = 1
    add(eng, "early", 5, max_tokens=10, min_tokens=0)
    stop_tok = scripted_token("stoptok", 5 + 2)
    add(eng, "stoptok", 5, max_tokens=10, stop_token_ids=frozenset({stop_tok}))
    outs = run_to_end(eng)
    last = {rid: o[-1] for rid, o in outs.items()}
    assert len(tokens(outs, "eos")) == 4 and last["eos"].finish_reason == "stop"
    assert len(tokens(outs, "ign")) == 4 and last["ign"].finish_reason == "length"
    assert tokens(outs, "minp")[1] == 2 and last["minp"].finish_reason == "length"
    assert tokens(outs, "early") == [2] and last["early"].finish_reason == "stop"
    assert tokens(outs, "stoptok")[-1] == stop_tok and last["stoptok"].stop_reason == stop_tok
    assert len(tokens(outs, "stoptok")) == 3


@both_modes
def test_max_model_len_caps_and_admission(async_scheduling):
    eng = make_engine(
        async_scheduling=async_scheduling, num_blocks=5, block_size=4
    )  # C = 16 = max_model_len
    r = add(eng, "a", 10, max_tokens=100)
    assert r.max_tokens == 6
    outs = run_to_end(eng)
    assert len(tokens(outs, "a")) == 6 and outs["a"][-1].finish_reason == "length"
    with pytest.raises(ValueError, match="max_model_len - 1 = 15"):
        add(eng, "b", 16)
    with pytest.raises(ValueError):
        add(eng, "c", 0)


@both_modes
def test_abort_waiting_and_running_frees_blocks(async_scheduling):
    eng = make_engine(async_scheduling=async_scheduling, num_blocks=6, block_size=4, max_seqs=1)
    add(eng, "a", 8, max_tokens=50)
    add(eng, "b", 8, max_tokens=50)
    eng.step()
    assert eng.stats().num_running == 1 and eng.stats().num_waiting == 1
    outs = eng.abort_requests(["b", "a", "unknown"])
    assert [(o.req_id, o.finish_reason) for o in outs] == [("b", "abort"), ("a", "abort")]
    assert eng.scheduler.kv.usage == 0.0 and not eng.scheduler.has_unfinished_requests()
    add(eng, "c", 4)
    eng.step()  # the next step the runner executes tells it to forget both (it never had b)
    assert eng.runner.steps[-1].finished_req_ids == {"a", "b"} and "a" not in eng.runner.states


@both_modes
def test_failed_request_fails_alone(async_scheduling):
    eng = make_engine(async_scheduling=async_scheduling, fail={"bad"})
    add(eng, "bad", 5)
    add(eng, "good", 5, start=50)
    outs = run_to_end(eng)
    assert outs["bad"][-1].finish_reason == "error" and outs["bad"][-1].error
    assert outs["good"][-1].finish_reason == "length"


@both_modes
@pytest.mark.parametrize("fails", [False, True], ids=["ok", "failed"])
def test_blocks_of_a_request_failed_in_the_model_give_no_prefix_hit(async_scheduling, fails):
    """A request that fails in the model may leave non-finite K/V in its blocks: the same prompt
    later computes them again instead of reading them from the prefix cache (a healthy
    request's blocks are hits, as the control shows)."""
    eng = make_engine(async_scheduling=async_scheduling, fail={"first"} if fails else set())
    add(eng, "first", 9, max_tokens=1)  # two full blocks of 4, cached when allocated
    run_to_end(eng)
    again = add(eng, "again", 9, max_tokens=1)
    outs = run_to_end(eng)
    assert outs["again"][-1].finish_reason == "length"
    assert again.num_cached_tokens == (0 if fails else 8)


@both_modes
def test_stuck_head_is_failed_not_spun(caplog, async_scheduling):
    eng = make_engine(async_scheduling=async_scheduling, num_blocks=3, block_size=4)  # C = 8
    # Break the invariant on purpose: pretend the context is larger than the pool.
    eng.scheduler.max_model_len = 100
    add(eng, "big", 20, max_tokens=1)
    add(eng, "ok", 3, max_tokens=2, start=40)
    with caplog.at_level("ERROR", logger="kvflow.engine"):
        outs = run_to_end(eng, max_steps=20)
    assert (
        outs["big"][-1].finish_reason == "error" and "cannot be scheduled" in outs["big"][-1].error
    )
    assert "20 tokens" in caplog.text
    assert outs["ok"][-1].finish_reason == "length"
    assert eng.stats().num_stuck_failures == 1
    assert RequestStatus.FINISHED_ERROR.finished


def test_async_scheduling_launches_each_decode_before_the_token_is_known():
    eng = make_engine(async_scheduling=True)
    r = add(eng, "a", 6, max_tokens=3)
    assert eng.step() == []  # the prefill is in flight
    assert r.num_pending_tokens == 1 and eng.has_unfinished_requests()
    outs = eng.step()  # launches the decode of the pending token, then applies the prefill
    assert eng.runner.steps[-1].num_scheduled_tokens == {"a": 1}
    assert [o.new_token_ids for o in outs] == [[scripted_token("a", 6)]]
    assert r.num_pending_tokens == 1  # the decode's token
    eng.step()  # launches the last decode
    outs = eng.step()  # a's third token is pending: nothing to launch; applies it
    assert len(eng.runner.steps) == 3  # prefill + 2 decodes: no token past max_tokens
    assert outs[-1].finish_reason == "length" and r.num_output_tokens == 3
    assert not eng.has_unfinished_requests() and eng.scheduler.kv.usage == 0.0


def test_async_scheduling_drops_the_token_computed_after_eos():
    eng = make_engine(async_scheduling=True, eos_at={"a": 1})
    add(eng, "a", 6, max_tokens=10)
    outs = run_to_end(eng)
    assert tokens(outs, "a") == [scripted_token("a", 6), 2]
    assert outs["a"][-1].finish_reason == "stop"
    # the decode after EOS was launched before EOS was seen; its token went nowhere
    assert [s.num_scheduled_tokens for s in eng.runner.steps] == [{"a": 6}, {"a": 1}, {"a": 1}]


@dataclass
class ResumeCheckingRunner(FakeRunner):
    """Records how many tokens a request had when preempted, and when resumed."""

    at_preemption: dict[str, list[int]] = field(default_factory=dict)
    at_resume: dict[str, list[int]] = field(default_factory=dict)

    def execute(self, sched):
        for req_id in sched.preempted_req_ids:
            self.at_preemption.setdefault(req_id, []).append(len(self.states[req_id].tokens))
        for new in sched.new_reqs:
            if new.output_token_ids:
                n = len(new.prompt_token_ids) + len(new.output_token_ids)
                self.at_resume.setdefault(new.req_id, []).append(n)
        return super().execute(sched)


def test_async_scheduling_keeps_the_pending_token_of_a_preempted_request():
    """The newest request is preempted while its next token is being computed (async: every
    preemption is); it resumes with that token, not recomputing it."""
    eng = make_engine(
        async_scheduling=True, runner=ResumeCheckingRunner, num_blocks=9, block_size=4
    )
    add(eng, "old", 6, max_tokens=20)
    new = add(eng, "new", 6, max_tokens=20, start=100)
    outs = run_to_end(eng)
    assert new.num_preemptions >= 1
    assert eng.runner.at_resume["new"] == eng.runner.at_preemption["new"]
    assert len(tokens(outs, "new")) == 20


def test_async_scheduling_switched_off_with_a_step_in_flight_applies_it_first():
    """gpu_check times one engine both ways: the step left in flight is applied by the next
    synchronous step, and the outputs are those of an engine that never switched."""
    plain = make_engine()
    add(plain, "a", 6, max_tokens=8)
    expected = tokens(run_to_end(plain), "a")
    eng = make_engine(async_scheduling=True)
    add(eng, "a", 6, max_tokens=8)
    outs = [o for _ in range(3) for o in eng.step()]
    assert eng.has_unfinished_requests() and eng._in_flight is not None
    eng.async_scheduling = False
    rest = run_to_end(eng)
    assert [t for o in outs for t in o.new_token_ids] + tokens(rest, "a") == expected
