"""Served tokens/s with a model that costs nothing: what the host side of `kvflow serve`
(HTTP, tokenizer, scheduler, detokenizer, SSE, and the transport between processes) can carry.

Each server runs the real stack with `KVFLOW_NULL_RUNNER=S` (every step returns one fixed
token per request after S seconds of simulated device time, 0 by default), once with the engine
stepped on a thread of the API server process (`KVFLOW_ENGINE_PROCESS=0`: before) and once in
its own process (after), alternated `--repeats` times. `kvflow bench serve` streams
`/v1/completions` at each concurrency; the CPU time of each process (utime + stime from
/proc/<pid>/stat, every thread) is read before and after every level, so the table gives CPU
microseconds per output token per process (the load generator's too, as "client": its CPU while it sent the load, as it reports it). The engine process's own loop accounting (its
`loop_stats`: time stepping, applying commands, sending outputs, idle, and blocked on the socket
idle) is read from its log line at exit.

    python benchmarks/serve_host.py [--concurrency 1,8,64,256] [--output-len 128] [--step-ms 0]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]

# mode -> (KVFLOW_ENGINE_PROCESS, KVFLOW_MERGE_DELTAS); "today": the code before issue 22
MODES = {"today": ("0", "0"), "in-process": ("0", "1"), "engine-process": ("1", "1")}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def proc_cpu(pid: int) -> float:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children(pid: int) -> list[int]:
    pids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            pids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return pids


def start_server(mode: str, args: argparse.Namespace, log: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    blocks = max(args.concurrency_list) * -(-(args.input_len + args.output_len + 8) // 16) + 64
    env = {
        **os.environ,
        "KVFLOW_NULL_RUNNER": str(args.step_ms / 1000),
        "KVFLOW_ENGINE_PROCESS": MODES[mode][0],
        "KVFLOW_MERGE_DELTAS": MODES[mode][1],
        "PYTHONPATH": str(ROOT / "src"),
    }
    cmd = [sys.executable, "-m", "kvflow.server.api_server", "--port", str(port)]
    cmd += ["--dtype", "bfloat16", "--block-size", "16", "--num-blocks", str(blocks)]
    cmd += ["--max-num-seqs", str(max(args.concurrency_list)), "--uvicorn-log-level", "warning"]
    cmd += ["--disable-uvicorn-access-log", "--watchdog-timeout", "0"]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()[-2000:]
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, port
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not start")


def bench(port: int, c: int, args: argparse.Namespace, out: Path) -> dict:
    n = max(args.prompts_per_level * c, 16)
    cmd = [sys.executable, "-m", "kvflow.cli", "bench", "serve", "--port", str(port)]
    cmd += ["--input-len", str(args.input_len), "--output-len", str(args.output_len)]
    cmd += ["--num-prompts", str(n), "--max-concurrency", str(c), "--disable-tqdm"]
    cmd += ["--num-warmups", str(min(c, 8)), "--result-file", str(out)]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, timeout=1800)
    return json.loads(out.read_text())


def run_mode(mode: str, args: argparse.Namespace, tmp: Path) -> dict:
    log = tmp / f"{mode}.log"
    proc, port = start_server(mode, args, log)
    rows = {}
    try:
        engine_pids = children(proc.pid)
        for c in args.concurrency_list:
            pids = {"api": proc.pid, **({"engine": engine_pids[0]} if engine_pids else {})}
            before = {k: proc_cpu(p) for k, p in pids.items()}
            res = bench(port, c, args, tmp / f"{mode}-c{c}.json")
            after = {k: proc_cpu(p) for k, p in pids.items()}
            before["client"], after["client"] = 0.0, res["load_generator_cpu_s"]
            tokens = res["total_output_tokens"]
            rows[c] = {
                "tok_s": res["output_throughput"],
                "ttft_p50_ms": res.get("median_ttft_ms"),
                "errors": res["errors"],
                "load_avg_1m": os.getloadavg()[0],  # the host is shared: how busy it was
                "cpu_us_per_tok": {
                    k: (after[k] - v) / max(tokens, 1) * 1e6 for k, v in before.items()
                },
            }
            print(f"  {mode} c={c}: {res['output_throughput']:.0f} tok/s {rows[c]}", flush=True)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    match = re.search(r"engine loop: (.*)", log.read_text())
    loop = dict(kv.split("=") for kv in match.group(1).split()) if match else {}
    return {"rows": rows, "loop": loop}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--concurrency", default="1,8,64,256")
    p.add_argument("--input-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=128)
    # enough prompts that the ramp-up and the tail (the last requests holding the level open)
    # do not set the figure (RESULTS.md: too few prompts halve it)
    p.add_argument("--prompts-per-level", type=int, default=12, help="prompts = this x concurrency")
    p.add_argument("--step-ms", type=float, default=0.0, help="simulated device time per step")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--out", default=None, help="JSON of every run")
    args = p.parse_args()
    args.concurrency_list = [int(c) for c in args.concurrency.split(",")]
    runs: dict[str, list] = {m: [] for m in MODES}
    with tempfile.TemporaryDirectory() as tmp:
        for _ in range(args.repeats):
            for mode in MODES:
                runs[mode].append(run_mode(mode, args, Path(tmp)))
    print(table(runs, args.concurrency_list))
    if args.out:
        Path(args.out).write_text(json.dumps(runs, indent=2) + "\n")


def table(runs: dict[str, list], levels: list[int]) -> str:
    """Medians over the repeats: tok/s per mode, the ratio to today's, CPU us per token."""

    def med(mode: str, c: int, key: str, proc: str | None = None) -> float:
        values = []
        for run in runs[mode]:
            row = run["rows"][c]
            values.append(row[key] if proc is None else row[key].get(proc, 0.0))
        return sorted(values)[len(values) // 2]

    lines = [
        "| concurrency | today tok/s | in-process + merged deltas | engine process | "
        "engine process / today | CPU us/tok today | CPU us/tok engine process (API + engine) | "
        "load generator us/tok (today, engine process) |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for c in levels:
        base, merged, proc = (med(m, c, "tok_s") for m in MODES)
        cpu_base = med("today", c, "cpu_us_per_tok", "api")
        cpu_api = med("engine-process", c, "cpu_us_per_tok", "api")
        cpu_eng = med("engine-process", c, "cpu_us_per_tok", "engine")
        client = [med(m, c, "cpu_us_per_tok", "client") for m in ("today", "engine-process")]
        lines.append(
            f"| {c} | {base:,.0f} | {merged:,.0f} | {proc:,.0f} | {proc / base:.2f}x | "
            f"{cpu_base:.0f} | {cpu_api:.0f} + {cpu_eng:.0f} | {client[0]:.0f}, {client[1]:.0f} |"
        )
    lines.append(f"\nengine loop (last engine-process run): {runs['engine-process'][-1]['loop']}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
