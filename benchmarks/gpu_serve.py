"""kvflow served through HTTP on one GPU, beside its offline engine, in one command; and the
offline decode step of the Llama-3.1-8B shape against its weight floor.

    python benchmarks/gpu_serve.py --out gpu_serve.json          # one GPU, ~5 minutes
    python benchmarks/gpu_serve.py --smoke --out /tmp/smoke.json # tiny shapes, CPU or GPU

(a) served   random-weight checkpoints of the Llama-3.2-1B and SmolLM2-135M shapes (bfloat16,
             built as gpu_check.py builds them). Offline first: `LLM.generate` of 256 prompts of
             128 tokens, 128 new tokens each (ignore_eos): the engine's tokens/s at batch 256.
             Then a real `kvflow serve` of the same checkpoint (the engine core in its own
             process) driven by `kvflow bench serve` (streaming /v1/completions, ignore_eos) at
             concurrency 1, 8, 64, 256: served output tokens/s, TTFT, and the CPU time per output
             token of the API server process and of the engine process (/proc/<pid>/stat).
             Target: served tokens/s at 256 at least 80 % of the offline engine's.
(b) 8B       the Llama-3.1-8B shape (weights made here, on the device, not carried), bfloat16:
             the offline engine's decode step at batch 1 and 64 (CUDA graphs), beside the floor:
             the bytes a step must read (weights, plus the batch's KV) over the device-to-device
             copy bandwidth measured in the same run. Target: batch 1 at most 1.2x the floor
             (vLLM reaches about 77 % of the bandwidth roofline at batch 1 on an 8B model).

The report (`--out`) is written after every measurement, so a run cut short keeps what it did.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
import gpu_check as gc_  # noqa: E402  (sets up sys.path for kvflow, imports torch)
import torch  # noqa: E402
from gpu_liveness import end_under_load  # noqa: E402
from serve_host import children, free_port, proc_cpu  # noqa: E402

from kvflow import LLM, SamplingParams  # noqa: E402

LLAMA_8B = dict(
    gc_.LLAMA_1B,
    hidden_size=4096,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    intermediate_size=14336,
)
# Offline engine and server each take this share of the card (256 x 256 tokens of KV fit with
# room to spare), so that neither depends on what the other left behind in this process.
MEMORY = {"gpu_memory_utilization": 0.4} if torch.cuda.is_available() else {}
# src/ first, then the caller's path (a card run's carried wheels are there)
PYTHONPATH = os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))
# how each served model's server ends, in FULL_SHAPES' order (gpu_liveness.py)
ENDINGS = ("sigterm", "engine_killed")
SMOKE_8B = dict(gc_.SMOKE_SHAPES["llama-1b-shape"], hidden_size=256, head_dim=32)


def log(msg: str) -> None:
    print(f"[gpu_serve {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def free_device() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def build(shape: dict, path: Path, device: str) -> None:
    hf = gc_.build_checkpoint(shape, path, device, seed=0)
    del hf
    free_device()


def offline_tps(path: Path, device: str, num: int, prompt_len: int, new: int) -> float:
    llm = LLM(str(path), dtype="bfloat16", device=device, max_num_seqs=num, **MEMORY)
    vocab = llm.engine.core.runner.vocab_size
    prompts = gc_.make_prompts(vocab, [prompt_len] * num, seed=1)
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    llm.generate(prompts[: min(num, 8)], SamplingParams(max_tokens=4, ignore_eos=True))  # warm
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    took = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    del llm, outs
    free_device()
    return tokens / took


def start_server(path: Path, device: str, max_seqs: int, log_path: Path):
    port = free_port()
    cmd = [sys.executable, "-m", "kvflow.server.api_server", str(path), "--port", str(port)]
    cmd += ["--dtype", "bfloat16", "--device", device, "--max-num-seqs", str(max_seqs)]
    cmd += ["--uvicorn-log-level", "warning", "--disable-uvicorn-access-log"]
    if device == "cpu":
        cmd += ["--num-blocks", "512"]
    else:
        cmd += ["--gpu-memory-utilization", str(MEMORY["gpu_memory_utilization"])]
    env = {**os.environ, "PYTHONPATH": PYTHONPATH, "KVFLOW_ENGINE_PROCESS": "1"}
    with open(log_path, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited {proc.returncode}: {log_path.read_text()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, port
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not become healthy")


def bench_serve(port: int, c: int, prompt_len: int, new: int, out: Path, tokenizer: Path) -> dict:
    cmd = [sys.executable, "-m", "kvflow.cli", "bench", "serve", "--port", str(port)]
    cmd += ["--input-len", str(prompt_len), "--output-len", str(new), "--disable-tqdm"]
    cmd += ["--num-prompts", str(max(2 * c, 8)), "--max-concurrency", str(c)]
    cmd += ["--num-warmups", str(min(c, 8)), "--result-file", str(out)]
    cmd += ["--tokenizer", str(tokenizer)]
    env = {**os.environ, "PYTHONPATH": PYTHONPATH}
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, timeout=600)
    return json.loads(out.read_text())


def served(name: str, path: Path, args, workdir: Path, entry: dict, save, ending: str) -> None:
    """The levels of `kvflow bench serve` on one server, which then ends under load as `ending`
    says (gpu_liveness.py): the server's last act is the liveness trial."""
    proc, port = start_server(path, args.device, max(args.levels), workdir / f"{name}.log")
    try:
        pids = {"api": proc.pid, "engine": children(proc.pid)[0]}
        for c in args.levels:
            before = {k: proc_cpu(p) for k, p in pids.items()}
            res = bench_serve(
                port, c, args.prompt_len, args.new, workdir / f"{name}-{c}.json", path
            )
            after = {k: proc_cpu(p) for k, p in pids.items()}
            tokens = max(res["total_output_tokens"], 1)
            row = {
                "concurrency": c,
                "tok_s": res["output_throughput"],
                "ttft_p50_ms": res.get("median_ttft_ms"),
                "errors": res["errors"],
                "cpu_us_per_tok": {k: (after[k] - before[k]) / tokens * 1e6 for k in pids},
            }
            entry["served"].append(row)
            log(f"{name} served c={c}: {row}")
            save()
        clients, max_tokens = (4, 1500) if args.smoke else (64, 4096)
        entry["liveness"] = end_under_load(proc, port, pids["engine"], ending, clients, max_tokens)
        log(f"{name} liveness: {entry['liveness']}")
        save()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(60)


def section_served(args, workdir: Path, report: dict, save) -> None:
    shapes = gc_.SMOKE_SHAPES if args.smoke else gc_.FULL_SHAPES
    for index, (name, shape) in enumerate(shapes.items()):
        if args.models and name not in args.models.split(","):
            continue
        path = workdir / name
        build(shape, path, args.device)
        entry: dict = {"model": name, "served": []}
        report["served"].append(entry)
        batch = max(args.levels)
        entry["offline_tok_s"] = offline_tps(path, args.device, batch, args.prompt_len, args.new)
        log(f"{name} offline batch {batch}: {entry['offline_tok_s']:,.0f} tok/s")
        save()
        served(name, path, args, workdir, entry, save, ENDINGS[index % len(ENDINGS)])
        top = entry["served"][-1]["tok_s"]
        entry["served_over_offline"] = top / entry["offline_tok_s"]
        target = args.smoke or entry["served_over_offline"] >= 0.8
        entry["ok"] = bool(target and entry["liveness"]["ok"])
        save()


def section_8b(args, workdir: Path, report: dict, save) -> None:
    """The 8B shape's decode step in bfloat16 against its floor, then with its weights quantized
    (fp8 on a card; int8, the CPU's method, in a dry run): the step's speed-up at each batch and
    greedy agreement with bfloat16 over 8 prompts x 32 tokens."""
    path = workdir / "llama-8b-shape"
    build(SMOKE_8B if args.smoke else LLAMA_8B, path, args.device)
    prompt_len, warm, steps = (8, 1, 3) if args.smoke else (128, 3, 20)
    batches = (1, 4) if args.smoke else (1, 64)
    prompts = [[(7 * i + j) % 500 + 3 for j in range(16)] for i in range(8)]
    greedy: dict[str, list] = {}
    rows = report["llama_8b"] = []
    quantized = report["llama_8b_quantized"] = {
        "method": "fp8" if args.device == "cuda" else "int8",
        "rows": [],
    }
    for method in ("none", quantized["method"]):
        t0 = time.monotonic()
        llm = LLM(str(path), dtype="bfloat16", device=args.device, max_num_seqs=64,
                  quantization=method, **MEMORY)  # fmt: skip
        load_s = time.monotonic() - t0
        runner = llm.engine.core.runner
        if method == "none":
            bandwidth = gc_.copy_bandwidth(args.device, args.smoke)
            report["copy_bandwidth_gbs"] = bandwidth / 1e9
            weight_bytes = sum(p.numel() * p.element_size() for p in runner.model.parameters())
            per_token_kv = sum(c[:, 0, 0].numel() * c.element_size() for c in runner.kv_caches)
            report["llama_8b_load_s"] = load_s
        else:
            quantized["load_s"] = load_s
        for batch in batches:
            step_ms, runner_ms, other, device_ms = gc_.engine_decode_ms(
                llm, batch, prompt_len, warm, steps, seed=batch
            )
            row = dict(batch=batch, step_ms=step_ms, runner_ms=runner_ms, device_ms=device_ms)
            row["other_steps"] = other
            if method == "none":
                kv = batch * (prompt_len + warm + steps // 2) * per_token_kv
                row["floor_ms"] = 1e3 * (weight_bytes + kv) / bandwidth  # as gpu_check counts
                row["over_floor"] = step_ms / row["floor_ms"]
                rows.append(row)
            else:
                (bf16,) = [r for r in rows if r["batch"] == batch]
                row["speedup_over_bf16"] = bf16["step_ms"] / step_ms
                quantized["rows"].append(row)
            log(f"8B shape {method} decode batch {batch}: {row}")
            save()
        greedy[method] = gc_.kvflow_greedy(llm, prompts, 32)
        del llm, runner
        free_device()
    pairs = zip(greedy[quantized["method"]], greedy["none"], strict=True)
    same = sum(a == b for x, y in pairs for a, b in zip(x, y, strict=True))
    quantized["greedy_agreement"] = same / sum(len(t) for t in greedy["none"])
    save()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true", help="tiny shapes; numbers mean nothing")
    p.add_argument("--out", default=None)
    p.add_argument("--skip-served", action="store_true")
    p.add_argument("--skip-8b", action="store_true")
    p.add_argument("--models", default=None, help="comma-separated: served only these shapes")
    args = p.parse_args(argv)
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    args.levels = [1, 4] if args.smoke else [1, 8, 64, 256]
    args.prompt_len, args.new = (8, 8) if args.smoke else (128, 128)
    report: dict = {"smoke": args.smoke, "device": args.device, "served": []}
    if torch.cuda.is_available():
        report["card"] = torch.cuda.get_device_name()

    def save() -> None:
        if args.out:
            Path(args.out).write_text(json.dumps(report, indent=2) + "\n")

    with tempfile.TemporaryDirectory(prefix="kvflow-gpu-serve-") as tmp:
        if not args.skip_served:
            section_served(args, Path(tmp), report, save)
        if not args.skip_8b:
            section_8b(args, Path(tmp), report, save)
    report["table"] = table(report)
    save()
    print(report["table"])
    served_ok = all(e.get("ok") for e in report["served"])
    return 0 if served_ok else 1


def table(report: dict) -> str:
    lines = [
        "| model | offline tok/s (batch 256) | served tok/s c=1 / 8 / 64 / 256 | served / offline "
        "| CPU us/tok at top c (API + engine) |",
        "|---|---:|---:|---:|---:|",
    ]
    for e in report["served"]:
        rows = e["served"]
        tps = " / ".join(f"{r['tok_s']:,.0f}" for r in rows)
        cpu = rows[-1]["cpu_us_per_tok"] if rows else {}
        lines.append(
            f"| {e['model']} | {e.get('offline_tok_s', 0):,.0f} | {tps} | "
            f"{e.get('served_over_offline', 0):.2f} | "
            f"{cpu.get('api', 0):.0f} + {cpu.get('engine', 0):.0f} |"
        )
    for r in report.get("llama_8b", []):
        lines.append(
            f"\n8B shape batch {r['batch']}: {r['step_ms']:.2f} ms/step, floor "
            f"{r['floor_ms']:.2f} ms, {r['over_floor']:.2f}x"
        )
    quantized = report.get("llama_8b_quantized", {})
    for r in quantized.get("rows", []):
        lines.append(
            f"\n8B shape {quantized['method']} batch {r['batch']}: {r['step_ms']:.2f} ms/step, "
            f"{r['speedup_over_bf16']:.2f}x bf16's step"
        )
    if "greedy_agreement" in quantized:
        lines.append(
            f"\n{quantized['method']} greedy agreement: {quantized['greedy_agreement']:.3f}"
        )
    for e in report["served"]:
        if "liveness" in e:
            live = e["liveness"]
            lines.append(
                f"\n{e['model']} ended by {live['how']}: exit {live['exit_code']} after "
                f"{live['exit_s']:.2f} s, answers {live['answers']}, "
                f"{'PASS' if live['ok'] else 'FAIL'}"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
