"""kvflow replicas behind vLLM's router (`vllm-router`, PyPI), all real processes on
127.0.0.1: completions and chat, streaming and not, through the router with the openai client;
both replicas serve (each one's own /metrics says so); a replica SIGKILLed under load; its
restart rejoins.

One module, one pair of replicas and one router (round_robin, so that "both served" is
certain), shared by the tests in order."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import httpx
import openai
import pytest

from support.serverproc import ServerProcess, free_port, launch, scrape, wait_for

ROUTER = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
MODEL = "SmolLM2-135M-Instruct"
ARGS = ["--dtype", "float32", "--num-blocks", "256", "--block-size", "16",
        "--uvicorn-log-level", "warning", "--disable-log-stats"]  # fmt: skip

pytestmark = pytest.mark.skipif(not os.path.exists(ROUTER), reason="vllm-router not installed")


def start_replica(port: int | None = None, events_port: int | None = None) -> ServerProcess:
    args = ARGS if port is None else [*ARGS, "--port", str(port)]
    if events_port is not None:
        config = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://*:{events_port}"}  # fmt: skip
        args = [*args, "--kv-events-config", json.dumps(config)]
    proc, chosen, log = launch(args, dict(os.environ), "kvflow-replica-")
    if port is not None:  # launch's own --port comes first; the later one wins
        chosen = port
    replica = ServerProcess(proc, chosen, log)
    replica.events_port = events_port
    return replica


class Router:
    def __init__(
        self, workers: list[str], policy: str, extra: tuple[str, ...] = (), log_level="warning"
    ) -> None:
        self.port = free_port()
        fd, name = tempfile.mkstemp(prefix="vllm-router-", suffix=".log")
        os.close(fd)
        self.log_path = Path(name)
        cmd = [
            ROUTER, "--host", "127.0.0.1", "--port", str(self.port), "--policy", policy,
            "--worker-urls", *workers,
            "--prometheus-port", str(free_port()),
            "--health-check-interval-secs", "1", "--health-failure-threshold", "2",
            "--health-success-threshold", "1", "--worker-startup-check-interval", "1",
            "--retry-max-retries", "3", "--retry-initial-backoff-ms", "50",
            "--cb-failure-threshold", "2", "--cb-timeout-duration-secs", "2",
            "--log-level", log_level, *extra,
        ]  # fmt: skip
        with open(name, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key="x", max_retries=0, timeout=120)

    def wait_ready(self) -> None:
        def ready() -> bool:
            assert self.proc.poll() is None, self.log_path.read_text()[-3000:]
            try:
                return httpx.get(f"{self.url}/v1/models", timeout=5).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(ready, timeout=120, interval=0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


def served(replica: ServerProcess) -> float:
    return scrape(replica).value("vllm:request_success_total")


@pytest.fixture(scope="module")
def cluster():
    replicas = [start_replica(events_port=free_port()), start_replica(events_port=free_port())]
    router = None
    try:
        for replica in replicas:
            replica.wait_healthy()
        router = Router([r.url for r in replicas], "round_robin")
        router.wait_ready()
        yield router, replicas
    finally:
        if router is not None:
            router.stop()
        for replica in replicas:
            replica.kill()


def test_completions_and_chat_streaming_and_not_through_the_router(cluster):
    router, replicas = cluster
    before = [served(r) for r in replicas]
    client = router.client()
    for _ in range(2):
        out = client.completions.create(model=MODEL, prompt="The capital of France is",
                                        max_tokens=8, temperature=0)  # fmt: skip
        assert out.choices[0].text and out.usage.completion_tokens == 8
        chat = client.chat.completions.create(  # greedy: a sampled first end-of-text is no text
            model=MODEL,
            messages=[{"role": "user", "content": "Say hi"}],
            max_tokens=8,
            temperature=0,
        )
        assert chat.choices[0].message.content
        chunks = list(client.completions.create(model=MODEL, prompt="Once upon a time",
                                                max_tokens=8, stream=True, temperature=0))  # fmt: skip
        assert "".join(c.choices[0].text for c in chunks if c.choices)
        assert chunks[-1].choices[0].finish_reason == "length"
        stream = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Count to three"}],
            max_tokens=8,
            stream=True,
            temperature=0,
        )
        deltas = [c.choices[0].delta.content or "" for c in stream if c.choices]
        assert "".join(deltas)
    after = [served(r) for r in replicas]
    gained = [a - b for a, b in zip(after, before, strict=True)]
    assert sum(gained) == 8 and all(g >= 2 for g in gained), gained  # round robin: both


def test_kv_aware_routing_indexes_the_replicas_kv_events(cluster):
    """vllm-router's kv_aware policy subscribes to each replica's KV-cache events and credits
    a request with the prefix tokens a replica already holds: kvflow's events decode and
    index there."""
    _, replicas = cluster
    sources = []
    for r in replicas:
        sources += ["--kv-event-source", f"{r.url}=tcp://127.0.0.1:{r.events_port}"]
    router = Router([r.url for r in replicas], "kv_aware",
                    (*sources, "--kv-event-block-size", "16", "--kv-event-model", MODEL),
                    log_level="debug")  # fmt: skip
    try:
        router.wait_ready()
        client = router.client()
        prompt = "A shared preamble about the rivers and bridges of Paris, " * 6
        credited = re.compile(r"credited_prefix_tokens=(\d+)")

        def credited_prefix() -> bool:
            client.completions.create(model=MODEL, prompt=prompt, max_tokens=1)
            log = re.sub(r"\x1b\[[0-9;]*m", "", router.log_path.read_text())
            return max((int(n) for n in credited.findall(log)), default=0) >= 48

        wait_for(credited_prefix, timeout=60, interval=0.5)
        log = router.log_path.read_text()
        assert "decode batch" not in log, log[-2000:]  # no event it could not read
    finally:
        router.stop()


STREAM_TOKENS = 96


def _stream_tokens(client: openai.OpenAI, progress: list, results: list, index: int) -> None:
    try:
        stream = client.completions.create(model=MODEL, prompt=f"Story {index}:",
                                           max_tokens=STREAM_TOKENS, stream=True,
                                           extra_body={"ignore_eos": True})  # fmt: skip
        finish = None
        for chunk in stream:
            if chunk.choices:
                progress[index] += 1
                finish = chunk.choices[0].finish_reason or finish
        results[index] = ("complete", progress[index], finish)
    except (openai.APIError, httpx.HTTPError) as exc:
        results[index] = ("error", progress[index], type(exc).__name__)


def test_failover_kill_a_replica_under_load_then_restart_it(cluster):
    router, replicas = cluster
    client = router.client()
    victim = replicas[1]
    progress, results = [0] * 4, [None] * 4
    threads = [
        threading.Thread(target=_stream_tokens, args=(client, progress, results, i), daemon=True)
        for i in range(4)
    ]
    for t in threads:
        t.start()
    wait_for(lambda: min(progress) >= 1, timeout=120)  # every stream is under way
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(10)
    # non-streaming requests sent now: the router retries a failed one on the live replica
    for i in range(6):  # ignore_eos: a sampled end-of-text first would answer no text
        out = client.completions.create(model=MODEL, prompt=f"Question {i}?", max_tokens=4,
                                        extra_body={"ignore_eos": True})  # fmt: skip
        assert out.usage.completion_tokens == 4 and out.choices[0].finish_reason == "length"
    for t in threads:
        t.join(300)
    assert None not in results, (progress, results)
    cut = [r for r in results if r[0] == "error"]
    whole = [r for r in results if r[0] == "complete"]
    # streams on the killed replica end with an error the client sees, mid-way
    assert cut and all(0 < r[1] < STREAM_TOKENS for r in cut), results
    assert whole and all(r[2] == "length" for r in whole), results  # ran to max_tokens
    # the replica comes back on its port and the router sends it work again
    reborn = start_replica(victim.port, victim.events_port)
    replicas[1] = reborn
    reborn.wait_healthy()

    def rejoined() -> bool:
        client.completions.create(model=MODEL, prompt="ping", max_tokens=1)
        return served(reborn) >= 1

    wait_for(rejoined, timeout=60, interval=0.5)
