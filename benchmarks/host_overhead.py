"""Host time per engine step: what the CPU spends outside the model, side by side with a
baseline commit.

On a GPU the host is serial with the device: a decode step is schedule -> inputs -> forward
(graph replay) -> sampled ids back -> update -> detokenize, and the host parts cost the same
whatever the card does. This measures them on any machine with a tiny random-weight Llama
(2 layers, hidden 64, bfloat16, SmolLM2's tokenizer) so that the model's own time is small,
and splits every
`LLMEngine.step` of a decode-only batch into

    model   the model's forward, logits and the sampler (device work on a GPU)
    host    everything else: scheduler, runner inputs, update, output processing

    python benchmarks/host_overhead.py --baseline HEAD~3 [--batches 1,8,64,256] [--penalty]

Each tree runs in its own process (the baseline is `git archive`d into a temporary folder),
alternated `--repeats` times; the table gives medians and the current / baseline ratio.

    python benchmarks/host_overhead.py --device-ms 1.0,1.2,1.6,2.4

simulates a device instead: each step's model work also occupies a device timeline for that
many ms (per batch), which runs beside the host as a GPU stream does; the wait for a step's
sampled ids spins until its work there has ended. The current tree then runs with and without
async scheduling, and the table gives ms per step of each: with the host's work overlapped,
a step costs about max(host, device) instead of their sum.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(
    vocab_size=2048,  # ids SmolLM2's tokenizer decodes (bytes and common merges); small logits
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
)
PROMPT_LEN = 128


def worker(args: argparse.Namespace) -> None:
    """Runs inside the tree under test (its src first on sys.path); prints one JSON line."""
    sys.path.insert(0, args.src)
    import random

    import kvflow.worker.model_runner as model_runner
    from kvflow import LLM, SamplingParams

    llm = LLM(args.checkpoint, dtype="bfloat16", max_num_seqs=256, num_blocks=4096)
    engine = llm.engine
    engine.core.async_scheduling = args.async_scheduling
    runner, scheduler = engine.core.runner, engine.core.scheduler
    spent: dict[str, float] = {}

    def timed(owner, name: str, key: str) -> None:
        inner = getattr(owner, name)

        def wrapper(*a, **kw):
            t0 = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                spent[key] = spent.get(key, 0.0) + time.perf_counter() - t0

        setattr(owner, name, wrapper)

    timed(runner.model, "forward", "model")
    timed(runner.model, "compute_logits", "model")
    timed(model_runner, "sample", "model")
    timed(scheduler, "schedule", "schedule")
    if hasattr(runner, "launch"):  # the step's model work starts, then its ids are taken
        timed(runner, "launch", "runner")
        timed(runner, "_take", "runner")
    else:  # a baseline from before that split
        timed(runner, "execute", "runner")
    timed(scheduler, "update_from_output", "update")
    timed(engine.output_processor, "process", "output")
    device_s = dict(zip(args.batches, [ms / 1e3 for ms in args.device_ms], strict=False))
    device = dict(free_at=0.0, busy=0.0)
    if device_s:
        simulate_device(runner, device)

    gen = random.Random(0)
    penalty = 1.1 if args.penalty else 1.0
    results = []
    for batch in args.batches:
        device["busy"] = device_s.get(batch, 0.0)
        params = SamplingParams(
            temperature=0,
            max_tokens=args.warm + args.steps + 8,
            ignore_eos=True,
            repetition_penalty=penalty,
        )
        ids = [f"b{batch}-{i}" for i in range(batch)]
        for rid in ids:
            prompt = [gen.randrange(2, SHAPE["vocab_size"]) for _ in range(PROMPT_LEN)]
            engine.add_request(rid, prompt, params)
        while engine.core.last_step_tokens != batch or engine.core.scheduler.waiting:
            engine.step()
        for _ in range(args.warm):
            engine.step()
        steps, parts = [], []
        for _ in range(args.steps):
            spent.clear()
            t0 = time.perf_counter()
            engine.step()
            steps.append(time.perf_counter() - t0)
            parts.append(dict(spent))
        engine.abort_request(ids)
        median = {k: 1e3 * statistics.median(p.get(k, 0.0) for p in parts) for k in parts[0]}
        median["runner"] -= median["model"]  # the runner's own share: inputs and bookkeeping
        step = 1e3 * statistics.median(steps)
        host = statistics.median(1e3 * (s - p["model"]) for s, p in zip(steps, parts, strict=True))
        results.append(dict(batch=batch, step_ms=step, host_ms=host, parts_ms=median))
    print("RESULT " + json.dumps(results), flush=True)


def simulate_device(runner, device: dict[str, float]) -> None:
    """Each launch also queues `device["busy"]` seconds on a simulated device timeline; the
    wait for its ids spins until that work has ended (a spin: sleep overshoots by ~0.1 ms)."""
    inner = runner.launch

    def launch(sched):
        wait = inner(sched)
        end = device["free_at"] = max(device["free_at"], time.perf_counter()) + device["busy"]

        def wait_for_device():
            while time.perf_counter() < end:
                pass
            return wait()

        return wait_for_device

    runner.launch = launch


def run_tree(
    src: Path, checkpoint: Path, args: argparse.Namespace, async_scheduling: bool = False
) -> list[dict]:
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        "--src",
        str(src),
        "--checkpoint",
        str(checkpoint),
        "--batches",
        ",".join(map(str, args.batches)),
        "--steps",
        str(args.steps),
        "--warm",
        str(args.warm),
    ] + (["--penalty"] if args.penalty else [])
    cmd += ["--device-ms", ",".join(map(str, args.device_ms))] if args.device_ms else []
    cmd += ["--async-scheduling"] if async_scheduling else []
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode != 0 or line is None:
        raise SystemExit(f"worker failed for {src}:\n{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    return json.loads(line.removeprefix("RESULT "))


def export_baseline(ref: str, into: Path) -> Path:
    """The baseline's src/ from `git archive ref` (the working tree is not touched)."""
    archive = into / "baseline.tar"
    with archive.open("wb") as f:
        subprocess.run(["git", "-C", str(ROOT), "archive", ref, "src"], stdout=f, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into / "baseline", filter="data")
    return into / "baseline" / "src"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--baseline", help="a git ref to compare with (default: none)")
    p.add_argument("--batches", default="1,8,64,256")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--warm", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--penalty", action="store_true", help="repetition_penalty 1.1 on every row")
    p.add_argument("--device-ms", default="", help="simulated device ms per step, per batch")
    p.add_argument("--async-scheduling", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--src", help=argparse.SUPPRESS)
    p.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = p.parse_args()
    args.batches = [int(b) for b in str(args.batches).split(",")]
    args.device_ms = [float(ms) for ms in args.device_ms.split(",")] if args.device_ms else []
    if args.device_ms and len(args.device_ms) != len(args.batches):
        p.error("--device-ms needs one value per batch")
    if args.worker:
        return worker(args)

    with tempfile.TemporaryDirectory() as tmp:
        sys.path.insert(0, str(ROOT / "benchmarks"))
        from gpu_check import build_checkpoint

        checkpoint = Path(tmp) / "tiny-llama"
        build_checkpoint(SHAPE, checkpoint, "cpu", seed=0)
        from kvflow.model.loader import load_tokenizer, resolve_model

        load_tokenizer(resolve_model(None)).save_pretrained(checkpoint)  # a real BPE tokenizer
        trees = {"current": (ROOT / "src", False)}
        if args.device_ms:  # one tree, each step after the previous vs overlapped with it
            trees = {"sync": (ROOT / "src", False), "async": (ROOT / "src", True)}
        elif args.baseline:
            trees = {"baseline": (export_baseline(args.baseline, Path(tmp)), False), **trees}
        runs: dict[str, list[list[dict]]] = {name: [] for name in trees}
        for _ in range(args.repeats):  # alternated, so drift hits both trees alike
            for name, (src, async_scheduling) in trees.items():
                runs[name].append(run_tree(src, checkpoint, args, async_scheduling))
    report(runs, args)


def report(runs: dict[str, list[list[dict]]], args: argparse.Namespace) -> None:
    def med(name: str, i: int, key: str, part: str | None = None) -> float:
        rows = [r[i] for r in runs[name]]
        return statistics.median(r["parts_ms"][part] if part else r[key] for r in rows)

    names = list(runs)
    workload = "repetition_penalty 1.1" if args.penalty else "greedy"
    if args.device_ms:
        print(f"\nms per decode step, simulated device ({workload}, medians of {args.repeats})")
        print(
            "| batch | device ms | sync step | async step | async / sync |\n|---|---|---|---|---|"
        )
        for i, (batch, ms) in enumerate(zip(args.batches, args.device_ms, strict=True)):
            sync, overlapped = med("sync", i, "step_ms"), med("async", i, "step_ms")
            print(f"| {batch} | {ms} | {sync:.3f} | {overlapped:.3f} | {overlapped / sync:.2f}x |")
        return
    print(f"\nhost ms per decode step ({workload}, prompt {PROMPT_LEN}, medians of {args.repeats})")
    head = "| batch | " + " | ".join(f"{n} step | {n} host" for n in names)
    parts = ("schedule", "runner", "update", "output")
    head += " | " + " | ".join(f"{p} ({names[-1]})" for p in parts)
    head += " | host ratio |" if len(names) == 2 else " |"
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    for i, batch in enumerate(args.batches):
        cells = [str(batch)]
        for n in names:
            cells += [f"{med(n, i, 'step_ms'):.3f}", f"{med(n, i, 'host_ms'):.3f}"]
        cells += [f"{med(names[-1], i, '', p):.3f}" for p in parts]
        if len(names) == 2:
            cells.append(f"{med(names[1], i, 'host_ms') / med(names[0], i, 'host_ms'):.2f}x")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
