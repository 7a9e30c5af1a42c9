"""EngineCore.snapshot(): the KV pool block by block, the requests, why the queue waits, and
the events, scripted step by step with the fake runner."""

from __future__ import annotations

from kvflow.config import CacheConfig, EngineConfig, SchedulerConfig
from kvflow.core.request import Request
from kvflow.engine.engine_core import EngineCore
from support.fakes import FakeRunner


def make_engine(num_blocks=32, block_size=4, budget=64, max_seqs=8, max_model_len=None):
    cache = CacheConfig(block_size, num_blocks, True)
    mml = max_model_len or cache.servable_tokens
    cfg = EngineConfig(cache, SchedulerConfig(mml, budget, max_seqs))
    return EngineCore(cfg, FakeRunner(block_size, num_blocks, max_model_len=mml))


def add(engine, rid, prompt, max_tokens=4):
    engine.scheduler.add_request(
        Request(rid, list(prompt), max_tokens, eos_token_id=2, ignore_eos=True)
    )


def run_to_end(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def test_held_blocks_belong_to_their_request_and_end_free_or_cached():
    eng = make_engine()
    add(eng, "a", range(100, 110), max_tokens=2)  # 10 prompt tokens: 3 blocks of 4
    snap = eng.snapshot()
    assert snap.blocks == "n" + "." * 31
    assert [r.request_id for r in snap.waiting] == ["a"] and snap.waiting_by_reason == {"new": 1}
    eng.step()
    snap = eng.snapshot()
    (a,) = snap.running
    assert a.request_id == "a" and a.num_output_tokens == 1 and a.num_computed_tokens == 10
    assert len(a.block_ids) == 3
    assert [snap.blocks[b] for b in a.block_ids] == ["h", "h", "h"]
    assert snap.blocks.count("h") == 3 and snap.blocks[0] == "n" and not snap.waiting
    run_to_end(eng)
    snap = eng.snapshot()
    assert not snap.running and "h" not in snap.blocks
    # the two full blocks stay in the prefix cache; the partial one is plain free
    assert [snap.blocks[b] for b in a.block_ids] == ["c", "c", "."]


def test_a_shared_prefix_shows_as_shared():
    eng = make_engine()
    add(eng, "a", [*range(100, 108), 1, 2], max_tokens=20)
    eng.step()
    add(eng, "b", [*range(100, 108), 3, 4], max_tokens=20)  # the same two full blocks first
    eng.step()
    snap = eng.snapshot()
    a, b = snap.running
    assert a.block_ids[:2] == b.block_ids[:2]
    assert [snap.blocks[i] for i in a.block_ids[:2]] == ["s", "s"]
    assert snap.blocks[a.block_ids[2]] == "h" and snap.blocks[b.block_ids[2]] == "h"


def test_waiting_reason_max_num_seqs_then_new():
    eng = make_engine(max_seqs=1)
    add(eng, "a", range(100, 105), max_tokens=10)
    add(eng, "b", range(200, 205))
    eng.step()
    add(eng, "c", range(300, 305))  # arrives after the schedule: not judged yet
    snap = eng.snapshot()
    assert [r.request_id for r in snap.running] == ["a"]
    assert [(r.request_id, r.wait_reason) for r in snap.waiting] == [
        ("b", "max_num_seqs"),
        ("c", "new"),
    ]
    assert snap.waiting_by_reason == {"max_num_seqs": 1, "new": 1}


def test_waiting_reason_budget():
    eng = make_engine(budget=8)
    add(eng, "a", range(100, 112))  # 12 prompt tokens: a chunk of 8 spends the budget
    add(eng, "b", range(200, 205))
    eng.step()
    snap = eng.snapshot()
    assert snap.running[0].num_computed_tokens == 8
    assert snap.waiting_by_reason == {"budget": 1}


def test_waiting_reason_capacity_and_preemption_events():
    # 8 usable blocks of 4 tokens: two requests growing to 26 tokens cannot both fit
    eng = make_engine(num_blocks=9, max_model_len=32)
    add(eng, "old", range(100, 106), max_tokens=20)
    add(eng, "new", range(200, 206), max_tokens=20)
    reasons = set()
    while eng.has_unfinished_requests():
        eng.step()
        reasons.update(eng.snapshot().waiting_by_reason)
    snap = eng.snapshot()
    assert "capacity" in reasons
    assert snap.num_preemptions_total >= 1
    preempted = [e for e in snap.events if e.kind == "preempted"]
    assert len(preempted) == snap.num_preemptions_total
    assert {e.request_id for e in preempted} == {"new"}
    assert [e.seq for e in snap.events] == sorted(e.seq for e in snap.events)
    assert snap.blocks.count("h") == 0


def test_stuck_failure_is_an_event():
    # max_model_len above what the pool serves (a broken invariant): the head can never run
    eng = make_engine(num_blocks=4, max_model_len=64)
    add(eng, "big", range(100, 130))
    eng.step()
    snap = eng.snapshot()
    assert snap.num_stuck_failures == 1 and not snap.waiting
    (event,) = snap.events
    assert (
        event.kind == "stuck"
        and event.request_id == "big"
        and "cannot be scheduled" in (event.message)
    )
