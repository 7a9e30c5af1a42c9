"""Benchmarks: `kvflow bench serve` (a load generator for any OpenAI-compatible server) and
`kvflow bench throughput` (the offline engine alone).

This module holds what they, the benchmark scripts and the tests share: token-exact random
prompts, latency statistics, and a server subprocess that is always stopped.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_MAX_ADJUST = 16
PERCENTILES = (90, 99)


def load_tokenizer(path: str | None) -> Any:
    """A HF tokenizer from a local directory or .gguf file, or from kvflow's embedded model when
    None; never from a hub (`model.loader.load_tokenizer`)."""
    from kvflow.model.loader import load_tokenizer as load_local
    from kvflow.model.loader import resolve_model

    if path is None or path.endswith(".gguf"):
        path = str(resolve_model(path))
    return load_local(path)


def candidate_token_ids(tokenizer: Any) -> list[int]:
    """Non-special ids that decode alone to printable, non-blank text."""
    special = set(tokenizer.all_special_ids)
    texts = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return [
        i
        for i, text in enumerate(texts)
        if i not in special and text.strip() and text.isprintable() and "\ufffd" not in text
    ]


def exact_prompt(tokenizer: Any, candidates: list[int], n: int, rng: random.Random) -> str:
    """A random text that the tokenizer (special tokens included) encodes to exactly n ids."""
    added = len(tokenizer.encode("a")) - len(tokenizer.encode("a", add_special_tokens=False))
    want = n - added
    if want < 1:
        raise ValueError(f"--input-len {n} is too short: the tokenizer adds {added} token(s).")
    for _ in range(_MAX_ADJUST):
        ids = [rng.choice(candidates) for _ in range(want)]
        for _ in range(_MAX_ADJUST):
            text = tokenizer.decode(ids)
            ids = tokenizer.encode(text, add_special_tokens=False)
            if len(ids) == want:
                return text
            if len(ids) > want:
                ids = ids[:want]
            else:
                ids += [rng.choice(candidates) for _ in range(want - len(ids))]
    raise RuntimeError(f"Could not make a prompt of exactly {n} tokens.")


def build_prompts(tokenizer: Any, num_prompts: int, input_len: int, seed: int) -> list[str]:
    """`num_prompts` token-exact prompts, reproducible for a given seed."""
    rng = random.Random(seed)
    candidates = candidate_token_ids(tokenizer)
    return [exact_prompt(tokenizer, candidates, input_len, rng) for _ in range(num_prompts)]


def latency_stats(name: str, values_ms: list[float]) -> dict[str, float]:
    """mean/median/std/p90/p99 in ms; 0.0 when nothing completed (as vLLM reports it)."""
    import numpy as np

    arr = np.asarray(values_ms or [0.0], dtype=float)
    out = {
        f"mean_{name}_ms": float(arr.mean()),
        f"median_{name}_ms": float(np.median(arr)),
        f"std_{name}_ms": float(arr.std()),
    }
    for p in PERCENTILES:
        out[f"p{p}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def stop_process(proc: subprocess.Popen[bytes], grace: float = 30.0) -> None:
    """SIGTERM the process group `proc` leads, then SIGKILL it after `grace` seconds."""
    if proc.poll() is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def wait_ready(proc: subprocess.Popen[bytes], url: str, timeout: float, log: Path) -> None:
    """Poll `url` until it answers 200; raise with the log's tail if the process exits first."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = log.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"server exited with {proc.returncode}; log {log}:\n{tail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=5.0, trust_env=False).status_code == 200:
                return
        time.sleep(0.5)
    tail = log.read_text(errors="replace")[-3000:]
    raise TimeoutError(f"no answer from {url} within {timeout:.0f} s; log {log}:\n{tail}")


@contextlib.contextmanager
def running_server(
    argv: list[str],
    port: int,
    log: Path,
    *,
    timeout: float = 300.0,
    ready_path: str = "/v1/models",
    env: dict[str, str] | None = None,
) -> Iterator[tuple[str, int]]:
    """Start `argv` (own process group, output appended to `log`), wait until GET `ready_path`
    on 127.0.0.1:`port` answers 200, and yield (the base URL, the process id); the server is
    stopped however the block ends."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("ab") as sink:
        proc = subprocess.Popen(
            argv,
            stdout=sink,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url + ready_path, timeout, log)
        yield url, proc.pid
    finally:
        stop_process(proc)


def resident_bytes(pid: int) -> int:
    """The memory a process and its descendants hold: the sum of their proportional set sizes
    (Pss: a page shared by n of them counts 1/n in each), 0 for processes gone meanwhile."""
    total, todo = 0, [pid]
    while todo:
        at = todo.pop()
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{at}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
                    break
            for task in Path(f"/proc/{at}/task").iterdir():
                todo += [int(p) for p in (task / "children").read_text().split()]
    return total
