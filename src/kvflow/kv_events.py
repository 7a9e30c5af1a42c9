"""KV-cache events on the wire as vLLM publishes them (`--kv-events-config`), so KV-aware
routers (vllm-router's kv_aware policy, llm-d's indexer, NVIDIA Dynamo) can index kvflow's
prefix cache.

Encoding: msgspec msgpack of `KVEventBatch` as vLLM publishes it since its events became maps
(vLLM 0.26 on; vllm-router's kv_aware index and llm-d's decode it): the batch an array
`[ts, events, data_parallel_rank]`, each event a map tagged `"type": "BlockStored"` and so on
with vLLM's field names, block hashes as 64-bit unsigned ints (the last 8 bytes of kvflow's
block hash, as vLLM sends its hashes by default). kvflow's one KV-cache group is vLLM's group 0
of kind `full_attention`; `extra_keys` is one `None` a block (no LoRA, salt or media keys).
Transport: a ZeroMQ PUB socket sends `(topic, seq, payload)`
with `seq` an 8-byte big-endian counter; an optional ROUTER replay socket answers a request
`(identity, b"", start_seq)` with every buffered `(seq, payload)` from `start_seq` on and then
`(-1, b"")`. The engine thread only enqueues (never blocks); a full queue drops the batch and
counts it (`kvflow:kv_events_dropped_total`); one thread owns both sockets.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from typing import Any

import msgspec

from kvflow.core import kv_events as core_events
from kvflow.core.hashing import BlockHash

logger = logging.getLogger("kvflow.kv_events")

MEDIUM_GPU = "GPU"  # vLLM's name for the device tier (kvflow's pool, on CPU or GPU)
GROUP = 0  # kvflow's one KV-cache group
GROUP_KIND = "full_attention"
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """vLLM's base of the KV-cache events: maps tagged `"type": <class name>`."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def external_hash(block_hash: BlockHash) -> int:
    """The 64-bit id a subscriber sees for a block hash."""
    return int.from_bytes(block_hash[-8:], "big")


def to_wire(records: list[core_events.KVEvent], block_size: int) -> list[KVCacheEvent]:
    out: list[KVCacheEvent] = []
    for rec in records:
        if isinstance(rec, core_events.BlockStored):
            parent = None if rec.parent_hash is None else external_hash(rec.parent_hash)
            hashes = [external_hash(h) for h in rec.block_hashes]
            extra_keys: list[tuple[Any, ...] | None] = [None] * len(hashes)
            stored = BlockStored(hashes, parent, rec.token_ids, block_size, None, MEDIUM_GPU,
                                 None, extra_keys, GROUP, GROUP_KIND)  # fmt: skip
            out.append(stored)
        elif isinstance(rec, core_events.BlockRemoved):
            hashes = [external_hash(h) for h in rec.block_hashes]
            out.append(BlockRemoved(hashes, MEDIUM_GPU, GROUP))
        else:
            out.append(AllBlocksCleared())
    return out


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `--kv-events-config` JSON, same fields and defaults."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "null" or "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    topic: str = ""

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        """Raises ValueError naming what is wrong."""
        try:
            data = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-events-config is not JSON: {exc}") from None
        if not isinstance(data, dict):
            raise ValueError("--kv-events-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        if unknown := sorted(set(data) - known):
            raise ValueError(
                f"--kv-events-config: unknown field(s) {unknown}; known: {sorted(known)}"
            )
        config = cls(**data)
        if config.publisher not in ("null", "zmq"):
            raise ValueError(
                f"--kv-events-config: unknown publisher {config.publisher!r} (null, zmq)"
            )
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if not isinstance(getattr(config, name), int) or getattr(config, name) < 1:
                raise ValueError(f"--kv-events-config: {name} must be a positive integer")
        return config

    @property
    def active(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


class ZmqEventPublisher:
    """PUB socket plus an optional ROUTER replay socket, served by one thread."""

    def __init__(self, config: KVEventsConfig, block_size: int, data_parallel_rank: int = 0):
        import zmq

        self.block_size = block_size
        self.rank = data_parallel_rank
        self.num_dropped = 0  # batches; read by the engine's stats
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue(config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            if _binds(config.endpoint):
                self._pub.bind(config.endpoint)
            else:
                self._pub.connect(config.endpoint)
            if config.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"--kv-events-config: cannot open {config.endpoint}: {exc}") from None
        self._thread = threading.Thread(target=self._serve, name="kvflow-kv-events", daemon=True)
        self._thread.start()

    def publish(self, records: list[core_events.KVEvent]) -> None:
        """Queue one batch; never blocks (a full queue drops it and counts the drop)."""
        if not records:
            return
        batch = KVEventBatch(time.time(), to_wire(records, self.block_size), self.rank)
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self.num_dropped += 1

    def close(self, timeout: float = 2.0) -> None:
        """Send what is queued (for up to `timeout` s), then close the sockets."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        if not self._thread.is_alive():
            self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()

    def _serve(self) -> None:
        encoder = msgspec.msgpack.Encoder()
        seq = 0
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._answer_replay()
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            try:
                payload = encoder.encode(batch)
                self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
                self._buffer.append((seq, payload))
                seq += 1
            except Exception:
                logger.exception("publishing a KV event batch failed")

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("ignoring a KV-event replay request of %d frames", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))


def _binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host, ipc:// or inproc:// binds; a named host connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def make_publisher(config: KVEventsConfig | None, block_size: int) -> ZmqEventPublisher | None:
    if config is None or not config.active:
        return None
    return ZmqEventPublisher(config, block_size)
