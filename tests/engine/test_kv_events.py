"""KV-cache events: the block pool's records rebuild its prefix cache exactly, and the ZeroMQ
publisher sends them as vLLM's KVEventBatch, with a replay socket for late subscribers.

The engine is EngineCore with the scripted runner (no model); the sockets are real ZeroMQ
sockets on 127.0.0.1. The workload is random, on a pool small enough to evict."""

from __future__ import annotations

import random
import socket
import time

import msgspec
import pytest
import zmq

from kvflow.config import CacheConfig, EngineConfig, SchedulerConfig
from kvflow.core import kv_events as core
from kvflow.core.hashing import hash_block
from kvflow.core.request import Request
from kvflow.engine.engine_core import EngineCore
from kvflow.kv_events import KVEventsConfig, ZmqEventPublisher, external_hash
from support.fakes import FakeRunner

BLOCK = 4


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ListSink:
    def __init__(self) -> None:
        self.batches: list[list[core.KVEvent]] = []
        self.num_dropped = 0

    def publish(self, records: list) -> None:
        if records:
            self.batches.append(records)


def run_workload(engine: EngineCore, seed: int, num_requests: int = 60) -> None:
    """Requests sharing a few prefixes, arriving over time, some aborted: the pool (24 blocks)
    fills and evicts."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(5, 500) for _ in range(rng.choice((8, 12, 16)))] for _ in range(4)]
    pending = []
    for i in range(num_requests):
        prompt = rng.choice(prefixes) + [rng.randrange(5, 500) for _ in range(rng.randrange(1, 9))]
        pending.append(Request(f"r{i}", prompt, rng.randrange(1, 8), eos_token_id=2))
    step = 0
    while pending or engine.has_unfinished_requests():
        for _ in range(rng.randrange(0, 3)):
            if pending:
                engine.scheduler.add_request(pending.pop(0))
        if step % 7 == 3 and engine.scheduler.running:
            engine.abort_requests([engine.scheduler.running[-1].request_id])
        engine.step()
        step += 1
    engine.scheduler.kv.pool.check_invariants()


def make_engine(sink) -> EngineCore:
    cache = CacheConfig(BLOCK, 25)
    config = EngineConfig(cache, SchedulerConfig(96, 64, 8))
    return EngineCore(config, FakeRunner(BLOCK, 25), kv_events=sink)


def apply(cached: set, event) -> None:
    if isinstance(event, core.BlockStored):
        cached.update(event.block_hashes)
    elif isinstance(event, core.BlockRemoved):
        assert set(event.block_hashes) <= cached, "removed a block that was never stored"
        cached.difference_update(event.block_hashes)
    else:
        cached.clear()


def test_events_rebuild_the_prefix_cache_and_carry_the_blocks_tokens():
    sink = ListSink()
    engine = make_engine(sink)
    run_workload(engine, seed=1)
    cached: set = set()
    kinds = {"stored": 0, "removed": 0}
    for batch in sink.batches:
        for event in batch:
            apply(cached, event)
            if isinstance(event, core.BlockStored):
                kinds["stored"] += 1
                # the hashes are the chain of the event's own tokens on its parent
                parent = event.parent_hash or b""
                for i, block_hash in enumerate(event.block_hashes):
                    tokens = event.token_ids[i * BLOCK : (i + 1) * BLOCK]
                    assert hash_block(parent, tokens) == block_hash
                    parent = block_hash
            elif isinstance(event, core.BlockRemoved):
                kinds["removed"] += 1
    assert kinds["stored"] > 10 and kinds["removed"] > 10, kinds  # the workload evicted
    assert cached == engine.scheduler.kv.pool.cached_hashes
    pool = engine.scheduler.kv.pool
    pool.reset_prefix_cache()
    assert pool.take_events() == [core.AllBlocksCleared()]


def test_no_events_are_recorded_without_a_publisher():
    engine = make_engine(None)
    run_workload(engine, seed=2, num_requests=10)
    assert engine.scheduler.kv.pool.events is None
    assert engine.scheduler.kv.pool.take_events() == []


def _receive_all(sub: zmq.Socket, idle_s: float = 0.5) -> list[tuple[int, bytes]]:
    got = []
    while sub.poll(int(idle_s * 1000)):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv"
        got.append((int.from_bytes(seq, "big"), payload))
    return got


def _replay(ctx: zmq.Context, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    req = ctx.socket(zmq.DEALER)  # one request, many replies: a REQ socket keeps only one
    req.setsockopt(zmq.LINGER, 0)
    req.connect(endpoint)
    got = []
    try:
        req.send_multipart((b"", start.to_bytes(8, "big")))
        while True:
            assert req.poll(5000), "no replay answer"
            _, seq_bytes, payload = req.recv_multipart()
            seq = int.from_bytes(seq_bytes, "big", signed=True)
            if seq == -1:
                return got
            got.append((seq, payload))
    finally:
        req.close()


class _Batch(msgspec.Struct, array_like=True, forbid_unknown_fields=True):
    """vLLM's event structs as a subscriber declares them (vLLM 0.26 on: the batch an array, the
    events maps tagged by class name); unknown fields are refused, to pin the layout exactly."""

    ts: float
    events: list[_Stored | _Removed | _Cleared]
    data_parallel_rank: int | None = None


class _Event(msgspec.Struct, tag=True, forbid_unknown_fields=True):
    pass


class _Stored(_Event, tag="BlockStored"):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class _Removed(_Event, tag="BlockRemoved"):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class _Cleared(_Event, tag="AllBlocksCleared"):
    pass


_DECODER = msgspec.msgpack.Decoder(_Batch)


def _rebuild(payloads: list[bytes]) -> set[int]:
    """The cached block ids a subscriber rebuilds, decoding with vLLM's structs; the wire carries
    every field vLLM sends for a full-attention group (vllm-router reads the same layout)."""
    cached: set[int] = set()
    for payload in payloads:
        batch = _DECODER.decode(payload)
        assert batch.data_parallel_rank == 0
        assert abs(batch.ts - time.time()) < 600
        assert isinstance(msgspec.msgpack.decode(payload)[1][0], dict)  # events are maps
        for event in batch.events:
            if isinstance(event, _Stored):
                hashes, tokens = event.block_hashes, event.token_ids
                assert event.block_size == BLOCK and len(tokens) == BLOCK * len(hashes)
                assert event.lora_id is None and event.lora_name is None and event.medium == "GPU"
                assert event.extra_keys == [None] * len(hashes)
                assert (event.group_idx, event.kv_cache_spec_kind) == (0, "full_attention")
                cached.update(hashes)
            elif isinstance(event, _Removed):
                assert event.medium == "GPU" and event.group_idx == 0
                cached.difference_update(event.block_hashes)
            else:
                cached.clear()
    return cached


@pytest.fixture
def zmq_ctx():
    ctx = zmq.Context()
    yield ctx
    ctx.term()


def test_zmq_subscriber_and_a_late_replay_subscriber_rebuild_the_cache(zmq_ctx):
    pub_port, replay_port = free_port(), free_port()
    config = KVEventsConfig(
        enable_kv_cache_events=True,
        publisher="zmq",
        endpoint=f"tcp://*:{pub_port}",
        replay_endpoint=f"tcp://*:{replay_port}",
        topic="kv",
    )
    publisher = ZmqEventPublisher(config, BLOCK)
    sub = zmq_ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.LINGER, 0)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv")
    sub.connect(f"tcp://127.0.0.1:{pub_port}")
    try:
        time.sleep(0.3)  # the subscription reaches the publisher (what it misses, replay fills)
        engine = make_engine(publisher)
        run_workload(engine, seed=3)
        expected = {external_hash(h) for h in engine.scheduler.kv.pool.cached_hashes}
        live = _receive_all(sub)
        assert live, "the live subscriber got nothing"
        seqs = [seq for seq, _ in live]
        assert seqs == sorted(seqs) and seqs == list(range(seqs[0], seqs[-1] + 1))
        missed = _replay(zmq_ctx, f"tcp://127.0.0.1:{replay_port}", 0)[: seqs[0]]
        assert _rebuild([p for _, p in missed + live]) == expected
        late = _replay(zmq_ctx, f"tcp://127.0.0.1:{replay_port}", 0)
        assert [seq for seq, _ in late] == list(range(seqs[-1] + 1))
        assert _rebuild([p for _, p in late]) == expected
        assert engine.stats().kv_events_dropped == 0
    finally:
        sub.close()
        publisher.close()


def test_a_full_queue_drops_batches_and_counts_them():
    config = KVEventsConfig(True, "zmq", f"tcp://*:{free_port()}", max_queue_size=1)
    publisher = ZmqEventPublisher(config, BLOCK)
    try:
        event = core.BlockRemoved([b"x" * 16])
        start = time.monotonic()
        for _ in range(500):
            publisher.publish([event])
        assert time.monotonic() - start < 1.0  # never waits for the sending thread
        assert publisher.num_dropped > 0
    finally:
        publisher.close()


@pytest.mark.parametrize(
    "text, message",
    [
        ("{", "not JSON"),
        ('{"enable_kv_cache_events": true, "bogus": 1}', "unknown field"),
        ('{"publisher": "kafka"}', "unknown publisher"),
        ('{"max_queue_size": 0}', "positive"),
    ],
)
def test_config_errors_name_the_problem(text, message):
    with pytest.raises(ValueError, match=message):
        KVEventsConfig.from_json(text)
