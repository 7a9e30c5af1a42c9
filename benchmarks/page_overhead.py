"""What the live page costs the engine: step time and output tokens/s at concurrency 8 with
the page closed, with a client polling /v1/engine/snapshot at the page's rate, and with the
page open in headless Chromium, alternated on one server in one run.

Step time comes from the server's own per-second history (the step seconds over the steps of
the phase's seconds), read once after each phase; tokens/s from `kvflow bench serve`.

    python benchmarks/page_overhead.py --repeats 2 [--model ...] [--out page_overhead.json]

Headless Chromium runs on the same cores as the server here: the "browser" phase counts the
browser's own rendering too, which a person's laptop would not put on the server.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

POLL_S = 0.5  # the page's polling interval (static/app.js POLL_MS)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_server(extra: list[str]) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(Path(tempfile.gettempdir()) / "kvflow-page-overhead.log", "w")  # noqa: SIM115
    cmd = [sys.executable, "-m", "kvflow.server.api_server", "--port", str(port), *extra]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        time.sleep(0.5)
    proc.kill()
    raise SystemExit("server did not start")


def bench(
    url: str, num_prompts: int, seed: int, input_len: int = 128, output_len: int = 128
) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable,
            "-m",
            "kvflow.cli",
            "bench",
            "serve",
            "--base-url",
            url,
            "--max-concurrency",
            "8",
            "--num-prompts",
            str(num_prompts),
            "--input-len",
            str(input_len),
            "--output-len",
            str(output_len),
            "--seed",
            str(seed),
            "--disable-tqdm",
            "--save-result",
            "--result-dir",
            out,
            "--result-file",
            "r.json",
        ]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode not in (0, 1):  # 1: some request failed, counted in "errors"
            raise SystemExit(f"bench failed:\n{done.stdout}\n{done.stderr}")
        return json.loads((Path(out) / "r.json").read_text())


def step_time_ms(url: str, start: float, end: float) -> tuple[float, int]:
    body = httpx.get(f"{url}/v1/engine/snapshot", params={"history_s": 600}, timeout=30).json()
    fields = body["history_fields"]
    t, steps, step_s = (fields.index(k) for k in ("t", "steps", "step_s"))
    rows = [r for r in body["history"] if start <= r[t] < int(end)]
    n = sum(r[steps] for r in rows)
    return (1000 * sum(r[step_s] for r in rows) / n if n else float("nan")), n


class Poller:
    """What the page's script does to the server: one snapshot every POLL_S seconds."""

    def __init__(self, url: str) -> None:
        self.url, self.stop_event = url, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Poller:
        self.thread.start()
        return self

    def _run(self) -> None:
        with httpx.Client(timeout=30) as client:
            while not self.stop_event.wait(POLL_S):
                client.get(f"{self.url}/v1/engine/snapshot", params={"history_s": 300})

    def __exit__(self, *exc: object) -> None:
        self.stop_event.set()
        self.thread.join()


class Browser:
    """The page itself, open in headless Chromium."""

    def __init__(self, url: str) -> None:
        self.url = url

    def __enter__(self) -> Browser:
        from playwright.sync_api import sync_playwright

        self._pw = sync_playwright().start()
        chromium = shutil.which("chromium") or "/usr/bin/chromium"
        args = ["--headless", "--no-sandbox", "--disable-gpu", "--no-first-run"]
        self._browser = self._pw.chromium.launch(executable_path=chromium, args=args)
        self._page = self._browser.new_page(viewport={"width": 1400, "height": 900})
        self._page.goto(f"{self.url}/")
        self._page.wait_for_function("document.getElementById('kv-free').textContent !== '0'")
        return self

    def __exit__(self, *exc: object) -> None:
        self._browser.close()
        self._pw.stop()


class Closed:
    def __init__(self, url: str) -> None:
        self.url = url

    def __enter__(self) -> Closed:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


MODES = {"closed": Closed, "polled": Poller, "browser": Browser}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--modes", default="closed,polled,browser")
    parser.add_argument("--out", default=None)
    parser.add_argument("server_args", nargs="*", help="extra `kvflow serve` flags (after --)")
    args = parser.parse_args()
    proc, url = start_server(args.server_args)
    modes = args.modes.split(",")
    results: dict[str, list[dict]] = {m: [] for m in modes}
    try:
        warm = bench(url, 8, 99, args.input_len, args.output_len)
        print("warm-up:", warm["completed"], "completed,", warm["errors"], "failed", flush=True)
        for repeat in range(args.repeats):
            order = modes if repeat % 2 == 0 else modes[::-1]
            for mode in order:
                with MODES[mode](url):
                    start = time.time()
                    result = bench(url, args.num_prompts, repeat, args.input_len, args.output_len)
                    end = time.time()
                ms, steps = step_time_ms(url, start + 1, end)
                row = {
                    "tok_s": result["output_throughput"],
                    "step_ms": ms,
                    "steps": steps,
                    "errors": result["errors"],
                }
                results[mode].append(row)
                print(mode, repeat, row, flush=True)
    finally:
        proc.terminate()
        proc.wait(30)
    print("\n| page | output tok/s (median) | mean step time ms (median) | ratio to closed |")
    print("|---|---:|---:|---:|")
    base = statistics.median(r["step_ms"] for r in results[modes[0]])
    for mode in modes:
        tok = statistics.median(r["tok_s"] for r in results[mode])
        ms = statistics.median(r["step_ms"] for r in results[mode])
        print(f"| {mode} | {tok:.1f} | {ms:.2f} | {ms / base:.3f} |")
    if args.out:
        meta = {"cpus": os.cpu_count(), "time": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=2))


if __name__ == "__main__":
    main()
