"""`kvflow bench serve`: a streaming load generator for any OpenAI-compatible server.

Prompts are random token ids made token-exact: decoded, re-encoded and adjusted until each
tokenizes to exactly `--input-len` tokens. Every request streams, so TTFT and inter-token
latency are measured per chunk. Failed requests (HTTP status, SSE error event, connection error,
no output) are counted and reported, never raised.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

try:  # the `bench` extra; without it the flags still parse and `main` says what to install
    import aiohttp
    import httpx
except ImportError:
    aiohttp = httpx = None  # type: ignore[assignment]

from kvflow.bench import PERCENTILES, build_prompts, latency_stats, load_tokenizer

_MAX_ERROR_MESSAGES = 5
_SUMMARY_ROWS = (
    ("Successful requests:", "completed"),
    ("Failed requests:", "errors"),
    ("Maximum request concurrency:", "max_concurrency"),
    ("Benchmark duration (s):", "duration"),
    ("Total input tokens:", "total_input_tokens"),
    ("Total generated tokens:", "total_output_tokens"),
    ("Request throughput (req/s):", "request_throughput"),
    ("Output token throughput (tok/s):", "output_throughput"),
    ("Total token throughput (tok/s):", "total_token_throughput"),
)


@dataclass(frozen=True)
class LoadSpec:
    """One load run: where to send it and how."""

    base_url: str
    endpoint: str
    model: str
    input_len: int
    output_len: int
    max_concurrency: int | None = None
    request_rate: float = math.inf
    seed: int = 0
    temperature: float = 0.0
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    disable_tqdm: bool = False
    request_timeout: float = 3600.0
    label: str | None = None
    tokenizer_id: str = ""


@dataclass
class RequestResult:
    """What one request measured; times are seconds from its send."""

    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    chunks: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itls: list[float] = field(default_factory=list)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags named as `vllm bench serve` names them where it has one."""
    parser.add_argument("--base-url", default=None, help="Server URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--endpoint", default="/v1/completions")
    parser.add_argument("--model", default=None, help="Served model name (default: GET /v1/models)")
    parser.add_argument("--tokenizer", default=None, help="HF tokenizer dir (default: kvflow's)")
    for name in ("input", "output"):
        flags = (f"--{name}-len", f"--random-{name}-len")
        parser.add_argument(*flags, dest=f"{name}_len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=100)
    parser.add_argument("--max-concurrency", type=int, default=None)
    parser.add_argument("--request-rate", type=float, default=math.inf, help="Poisson, req/s")
    parser.add_argument("--num-warmups", type=int, default=0, help="Untimed requests first")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false")
    parser.add_argument("--extra-body", default=None, help="JSON merged into every request body")
    parser.add_argument("--request-timeout", type=float, default=3600.0)
    parser.add_argument("--disable-tqdm", action="store_true")
    parser.add_argument("--save-result", action="store_true")
    parser.add_argument("--save-detailed", action="store_true", help="Per-request lists in JSON")
    parser.add_argument("--result-dir", default=".")
    parser.add_argument("--result-file", "--result-filename", dest="result_file", default=None)
    parser.add_argument("--label", default=None)


def _payload(spec: LoadSpec, prompt: str) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": spec.model,
        "max_tokens": spec.output_len,
        "temperature": spec.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if spec.ignore_eos:
        body["ignore_eos"] = True
    if spec.endpoint.rstrip("/").endswith("chat/completions"):
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    body.update(spec.extra_body)
    return body


def _sse_error(obj: Any) -> str | None:
    """The message of an error event, else None."""
    if not isinstance(obj, dict):
        return f"unexpected event: {obj!r}"[:300]
    err = obj.get("error")
    if err is None and obj.get("object") == "error":
        err = obj
    if err is None:
        return None
    message = err.get("message", err) if isinstance(err, dict) else err
    return f"SSE error: {message}"[:300]


def _chunk_has_token(choice: dict[str, Any]) -> bool:
    """Completions: every chunk but a closing one (empty text + finish_reason) carries a token.
    Chat: only chunks with content do (the first one often carries just the role)."""
    delta = choice.get("delta")
    if delta is not None:
        return bool(delta.get("content") or delta.get("reasoning_content"))
    return bool(choice.get("text")) or choice.get("finish_reason") is None


def _on_event(data: str, event: str, start: float, last: float, res: RequestResult) -> float:
    """Fold one SSE data payload into `res`; returns the time of the latest token chunk."""
    if event == "error":
        res.error = f"SSE error: {data}"[:300]
        return last
    obj = json.loads(data)
    message = _sse_error(obj)
    if message is not None:
        res.error = message
        return last
    now = time.perf_counter()
    choices = obj.get("choices") or []
    if choices and _chunk_has_token(choices[0]):
        if res.chunks == 0:
            res.ttft = now - start
        else:
            res.itls.append(now - last)
        res.chunks += 1
        last = now
    usage = obj.get("usage")
    if usage:
        res.prompt_tokens = int(usage.get("prompt_tokens") or 0)
        res.output_tokens = int(usage.get("completion_tokens") or 0)
    return last


async def _stream(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> RequestResult:
    res = RequestResult()
    start = last = time.perf_counter()
    async with session.post(url, json=body) as resp:
        if resp.status != 200:
            text = (await resp.read()).decode(errors="replace")
            res.error = f"HTTP {resp.status}: {text}"[:300]
            return res
        event = "message"
        async for raw in resp.content:  # one line (bytes) at a time
            line = raw.decode().strip()
            if line.startswith("event:"):
                event = line[6:].strip()
                continue
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            last = _on_event(data, event, start, last, res)
            event = "message"
            if res.error:
                return res
    res.e2e = time.perf_counter() - start
    if not res.output_tokens:
        res.output_tokens = res.chunks
    res.ok = res.output_tokens > 0 and res.chunks > 0
    if not res.ok:
        res.error = "no output tokens"
    return res


async def send_request(
    session: aiohttp.ClientSession, url: str, body: dict[str, Any]
) -> RequestResult:
    """One streamed request; every failure comes back as a result with `ok=False`."""
    try:
        return await _stream(session, url, body)
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError, OSError, ValueError) as exc:
        return RequestResult(error=f"{type(exc).__name__}: {exc}"[:300])


def _session(spec: LoadSpec, connections: int) -> aiohttp.ClientSession:
    """aiohttp, as vLLM's bench client: its C parser keeps the load generator's CPU per token
    well below the server's (httpx's pure-Python stack cost more than the server it measured).
    A connection a request: a server may close a kept-alive one as the next request is written
    (llama-server did, 5 of 16 requests at concurrency 8 failing "Can not write request
    body"), and a new local connection costs well under a millisecond."""
    return aiohttp.ClientSession(
        timeout=aiohttp.ClientTimeout(total=spec.request_timeout, connect=30.0),
        connector=aiohttp.TCPConnector(limit=connections, force_close=True),
    )


async def _gather(spec: LoadSpec, prompts: list[str], progress: bool) -> list[RequestResult]:
    from tqdm.auto import tqdm

    url = spec.base_url.rstrip("/") + spec.endpoint
    limit = spec.max_concurrency or len(prompts)
    semaphore = asyncio.Semaphore(limit)
    rng = random.Random(spec.seed)
    bar = tqdm(total=len(prompts), disable=not progress or spec.disable_tqdm)

    async def limited(session: aiohttp.ClientSession, prompt: str) -> RequestResult:
        async with semaphore:
            result = await send_request(session, url, _payload(spec, prompt))
        bar.update(1)
        return result

    async with _session(spec, max(1, limit)) as session:
        tasks = []
        for i, prompt in enumerate(prompts):
            if i and math.isfinite(spec.request_rate) and spec.request_rate > 0:
                await asyncio.sleep(rng.expovariate(spec.request_rate))
            tasks.append(asyncio.create_task(limited(session, prompt)))
        results = list(await asyncio.gather(*tasks))
    bar.close()
    return results


async def run_load(
    spec: LoadSpec, prompts: list[str], warmups: list[str] | None = None
) -> tuple[list[RequestResult], float]:
    """Send `warmups` (untimed; distinct prompts, so no prefix-cache hits), then `prompts`.

    Returns the timed requests' results and their wall duration in seconds.
    """
    if warmups:
        await _gather(spec, warmups, progress=False)
    start = time.perf_counter()
    results = await _gather(spec, prompts, progress=True)
    return results, time.perf_counter() - start


def summarize(
    spec: LoadSpec, results: list[RequestResult], duration: float, detailed: bool = False
) -> dict[str, Any]:
    """The JSON result, keys named as vLLM's (plus `errors`, `error_messages`; `run` adds
    `load_generator_cpu_s`)."""
    done = [r for r in results if r.ok]
    failed = [r for r in results if not r.ok]
    total_in = sum(r.prompt_tokens or spec.input_len for r in done)
    total_out = sum(r.output_tokens for r in done)
    rate = spec.request_rate if math.isfinite(spec.request_rate) else "inf"
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "openai-chat" if "chat" in spec.endpoint else "openai",
        "label": spec.label,
        "base_url": spec.base_url,
        "endpoint": spec.endpoint,
        "model_id": spec.model,
        "tokenizer_id": spec.tokenizer_id,
        "num_prompts": len(results),
        "request_rate": rate,
        "max_concurrency": spec.max_concurrency,
        "input_len": spec.input_len,
        "output_len": spec.output_len,
        "duration": duration,
        "completed": len(done),
        "errors": len(failed),
        "error_messages": [r.error for r in failed[:_MAX_ERROR_MESSAGES]],
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(done) / duration if duration > 0 else 0.0,
        "output_throughput": total_out / duration if duration > 0 else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration > 0 else 0.0,
    }
    tpots = [(r.e2e - r.ttft) / (r.output_tokens - 1) * 1e3 for r in done if r.output_tokens > 1]
    result.update(latency_stats("ttft", [r.ttft * 1e3 for r in done]))
    result.update(latency_stats("tpot", tpots))
    result.update(latency_stats("itl", [x * 1e3 for r in done for x in r.itls]))
    result.update(latency_stats("e2el", [r.e2e * 1e3 for r in done]))
    if detailed:
        result["input_lens"] = [r.prompt_tokens for r in results]
        result["output_lens"] = [r.output_tokens for r in results]
        result["ttfts"] = [r.ttft for r in results]
        result["itls"] = [r.itls for r in results]
        result["errors_all"] = [r.error for r in results]
    return result


def base_url_of(args: argparse.Namespace) -> str:
    return (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")


def fetch_model_name(base_url: str, timeout: float = 30.0) -> str:
    """The first model id that GET /v1/models lists."""
    with httpx.Client(timeout=timeout, trust_env=False) as client:
        resp = client.get(base_url + "/v1/models")
        resp.raise_for_status()
        return str(resp.json()["data"][0]["id"])


def spec_from_args(args: argparse.Namespace, model: str) -> LoadSpec:
    return LoadSpec(
        base_url=base_url_of(args),
        endpoint=args.endpoint,
        model=model,
        input_len=args.input_len,
        output_len=args.output_len,
        max_concurrency=args.max_concurrency,
        request_rate=args.request_rate,
        seed=args.seed,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        extra_body=json.loads(args.extra_body) if args.extra_body else {},
        disable_tqdm=args.disable_tqdm,
        request_timeout=args.request_timeout,
        label=args.label,
        tokenizer_id=args.tokenizer or "kvflow-default",
    )


def run(args: argparse.Namespace) -> dict[str, Any]:
    """Build prompts, run the load, return the result dict (prints and saves nothing)."""
    model = args.model or fetch_model_name(base_url_of(args))
    spec = spec_from_args(args, model)
    total = args.num_prompts + args.num_warmups
    prompts = build_prompts(load_tokenizer(args.tokenizer), total, args.input_len, args.seed)
    timed, warmups = prompts[: args.num_prompts], prompts[args.num_prompts :]
    cpu = time.process_time()
    results, duration = asyncio.run(run_load(spec, timed, warmups))
    result = summarize(spec, results, duration, detailed=args.save_detailed)
    # this process's CPU while it sent the load (warm-ups included): what measuring cost
    result["load_generator_cpu_s"] = time.process_time() - cpu
    return result


def format_report(result: dict[str, Any]) -> str:
    """A fixed-width table in the shape of vLLM's serving report."""
    rows: list[str] = ["{:=^60}".format(" Serving Benchmark Result ")]

    def row(name: str, value: Any) -> None:
        text = f"{value:.2f}" if isinstance(value, float) else str(value)
        rows.append(f"{name:<44}{text:>16}")

    for name, key in _SUMMARY_ROWS:
        row(name, result[key])
    titles = {
        "ttft": ("Time to First Token", "TTFT"),
        "tpot": ("Time per Output Token (excl. 1st token)", "TPOT"),
        "itl": ("Inter-token Latency", "ITL"),
        "e2el": ("End-to-end Latency", "E2EL"),
    }
    for key, (title, short) in titles.items():
        rows.append(f"{' ' + title + ' ':-^60}")
        row(f"Mean {short} (ms):", result[f"mean_{key}_ms"])
        row(f"Median {short} (ms):", result[f"median_{key}_ms"])
        for p in PERCENTILES:
            row(f"P{p} {short} (ms):", result[f"p{p}_{key}_ms"])
    rows.append("=" * 60)
    rows.extend(f"error: {message}" for message in result["error_messages"])
    return "\n".join(rows)


def result_path(args: argparse.Namespace, result: dict[str, Any]) -> Path | None:
    """Where to write the JSON: --result-file, else a dated name under --result-dir."""
    if args.result_file:
        path = Path(args.result_file)
        return path if path.is_absolute() else Path(args.result_dir) / path
    if not args.save_result:
        return None
    tag = args.label or "kvflow-bench"
    name = f"{tag}-c{result['max_concurrency']}-{result['date']}.json"
    return Path(args.result_dir) / name


def main(args: argparse.Namespace) -> int:
    """Run the benchmark; 0 when every request succeeded, 1 when any failed, 2 if unreachable
    or the `bench` extra is not installed."""
    if aiohttp is None or httpx is None:
        print(
            "kvflow bench serve: needs the bench extra: pip install 'kvflow[bench]'",
            file=sys.stderr,
        )
        return 2
    try:
        result = run(args)
    except httpx.HTTPError as exc:
        print(f"Cannot reach the server at {base_url_of(args)}: {exc}")
        return 2
    print(format_report(result))
    path = result_path(args, result)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"Result written to {path}")
    return 0 if result["errors"] == 0 else 1
