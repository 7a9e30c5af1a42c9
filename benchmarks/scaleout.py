"""Scale-out benchmark (issue 23): one kvflow replica alone, two replicas behind vLLM's router
with `round_robin`, and two with `cache_aware`, in one run, on a workload of a few long shared
system prompts with many short questions at a fixed concurrency. Reports output tokens/s,
TTFT p50 and the prefix-cache hit rate read from the replicas' own /metrics
(vllm:prefix_cache_hits_total / vllm:prefix_cache_queries_total, deltas over the run).

Every configuration starts fresh replicas (empty prefix caches) on 127.0.0.1.

    python benchmarks/scaleout.py --requests 96 --concurrency 16
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
MODEL = "SmolLM2-135M-Instruct"
TOPICS = ["a shipping company", "a hospital", "a public library", "a bicycle repair shop",
          "a bakery", "a law firm", "a football club", "a museum", "a ferry line",
          "a dental clinic", "a bookshop", "a hotel", "a school", "a zoo", "a garden centre",
          "a train operator"]  # fmt: skip


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    log = tempfile.NamedTemporaryFile("w", prefix="scaleout-", suffix=".log", delete=False)
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)


def wait_http(url: str, proc: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args[:3]} exited with {proc.returncode}")
        try:
            if httpx.get(url, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url} did not come up")


def start_replica(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "kvflow.server.api_server", "--port", str(port),
           "--num-blocks", str(args.num_blocks), "--uvicorn-log-level", "warning",
           "--disable-log-stats", "--disable-uvicorn-access-log"]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    proc = start(cmd, env)
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/health", proc)
    return proc, url


def start_router(urls: list[str], policy: str) -> tuple[subprocess.Popen, str]:
    router = shutil.which("vllm-router") or str(Path(sys.executable).parent / "vllm-router")
    port = free_port()
    cmd = [router, "--host", "127.0.0.1", "--port", str(port), "--policy", policy,
           "--worker-urls", *urls, "--prometheus-port", str(free_port()),
           "--log-level", "warning"]  # fmt: skip
    proc = start(cmd, dict(os.environ))
    url = f"http://127.0.0.1:{port}"
    wait_http(f"{url}/v1/models", proc)
    return proc, url


def workload(num_requests: int, prompt_words: int, num_systems: int, seed: int) -> list[list[dict]]:
    rng = random.Random(seed)
    systems = []
    for topic in TOPICS[:num_systems]:
        rules = " ".join(
            f"Rule {i}: answer questions about {topic} politely, with facts, in short sentences."
            for i in range(prompt_words // 12)
        )
        systems.append(f"You are the assistant of {topic}. {rules}")
    questions = ["What are your opening hours?", "Who can I call?", "How much does it cost?",
                 "Where are you?", "Can I bring a friend?", "Do you work on Sundays?"]  # fmt: skip
    return [
        [
            {"role": "system", "content": rng.choice(systems)},
            {"role": "user", "content": f"{rng.choice(questions)} (#{i})"},
        ]  # fmt: skip
        for i in range(num_requests)
    ]


async def one(client: httpx.AsyncClient, url: str, messages, max_tokens: int) -> tuple[float, int]:
    body = {"model": MODEL, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "temperature": 0, "ignore_eos": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    start, ttft, tokens = time.perf_counter(), None, 0
    async with client.stream("POST", f"{url}/v1/chat/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                ttft = ttft if ttft is not None else time.perf_counter() - start
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    return ttft or 0.0, tokens


async def drive(url: str, prompts, concurrency: int, max_tokens: int) -> dict:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:

        async def limited(messages):
            async with sem:
                return await one(client, url, messages, max_tokens)

        start = time.perf_counter()
        results = await asyncio.gather(*(limited(m) for m in prompts))
        elapsed = time.perf_counter() - start
    return {
        "output_tok_s": sum(t for _, t in results) / elapsed,
        "ttft_p50_ms": 1000 * statistics.median(t for t, _ in results),
        "elapsed_s": elapsed,
    }


def cache_counts(urls: list[str]) -> tuple[float, float]:
    hits = queries = 0.0
    for url in urls:
        for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                hits += float(line.split()[-1])
            elif line.startswith("vllm:prefix_cache_queries_total"):
                queries += float(line.split()[-1])
    return hits, queries


def run_config(name: str, replicas: int, policy: str | None, args, prompts) -> dict:
    procs: list[subprocess.Popen] = []
    try:
        urls = []
        for _ in range(replicas):
            proc, url = start_replica(args)
            procs.append(proc)
            urls.append(url)
        target = urls[0]
        if policy is not None:
            router, target = start_router(urls, policy)
            procs.append(router)
        hits0, queries0 = cache_counts(urls)
        result = asyncio.run(drive(target, prompts, args.concurrency, args.max_tokens))
        hits1, queries1 = cache_counts(urls)
        result["prefix_hit_rate"] = (hits1 - hits0) / max(queries1 - queries0, 1)
        result["config"] = name
        print(json.dumps(result), flush=True)
        return result
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--prompt-words", type=int, default=400)
    parser.add_argument(
        "--systems", type=int, default=4, help=f"shared system prompts (<= {len(TOPICS)})"
    )
    parser.add_argument("--num-blocks", type=int, default=512)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    prompts = workload(args.requests, args.prompt_words, args.systems, seed=0)
    results = [
        run_config("1 replica", 1, None, args, prompts),
        run_config("2 replicas, round_robin", 2, "round_robin", args, prompts),
        run_config("2 replicas, cache_aware", 2, "cache_aware", args, prompts),
    ]
    print("| configuration | output tok/s | TTFT p50 | prefix-cache hit rate |")
    print("|---|---:|---:|---:|")
    for r in results:
        print(f"| {r['config']} | {r['output_tok_s']:.1f} | {r['ttft_p50_ms']:.0f} ms "
              f"| {100 * r['prefix_hit_rate']:.1f} % |")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
