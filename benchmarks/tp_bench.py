"""Tensor parallelism on this machine: decode steps at TP=1 against TP=2 (mp ranks), and where
a TP=2 step's time goes (rank 0's share: the step's broadcast, the all-reduces, the logits'
all-gather, the step itself), then the step's cost on two cards from those parts.

    PYTHONPATH=src python benchmarks/tp_bench.py [--dtype bfloat16] [--steps 20]

Not a test. A CPU host's TP=2 splits its cores between the ranks (OMP threads = cores / ranks).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

from kvflow import LLM, SamplingParams


def decode_step_ms(llm: LLM, batch: int, prompt_len: int, steps: int) -> float:
    """Median ms of `steps` engine steps once `batch` prompts of `prompt_len` tokens decode."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 64, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for i, req in enumerate(ids):
        engine.add_request(
            req, [1000 + (i * 31 + j * 7) % 30000 for j in range(prompt_len)], params
        )
    while engine.core.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.core.scheduler.running
    ):
        engine.step()
    engine.step()
    runner = engine.core.runner
    if hasattr(runner, "timers"):
        runner.timers()  # from here on
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append((time.perf_counter() - start) * 1e3)
    parts = runner.timers() if hasattr(runner, "timers") else {}
    engine.abort_request(ids)
    return statistics.median(times), {k: v / steps for k, v in parts.items()}


def tp_gpu_section(path: str, batches: tuple[int, ...] = (1, 8, 64)) -> dict:
    """gpu_check.py's TP section (two or more cards): greedy tokens of the checkpoint at
    `path` at TP=2 (NCCL, eager) against TP=1 (eager) in float32, then bf16 decode steps of
    both with rank 0's time in the collectives (seconds of queueing, not of transfer: CUDA
    collectives are asynchronous)."""
    prompts = [[1000 + 13 * i + j for j in range(8 + 5 * i)] for i in range(4)]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    out: dict = {"tokens_equal": None, "timing": []}
    tokens = {}
    for tp in (1, 2):
        llm = LLM(path, device="cuda", dtype="float32", tensor_parallel_size=tp, enforce_eager=True)
        tokens[tp] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        if tp > 1:
            llm.engine.core.runner.shutdown()
        del llm
    out["tokens_equal"] = tokens[1] == tokens[2]
    for tp in (1, 2):
        llm = LLM(
            path, device="cuda", dtype="bfloat16", tensor_parallel_size=tp, enforce_eager=True
        )
        for batch in batches:
            ms, parts = decode_step_ms(llm, batch, 128, 20)
            out["timing"].append({"tp": tp, "batch": batch, "step_ms": ms, **parts})
        if tp > 1:
            llm.engine.core.runner.shutdown()
        del llm
    return out


def _micro_rank(rank: int, port: int, batches: list[int], reps: int, out: dict) -> None:
    """Collectives alone on two gloo ranks: median us per call for each decode batch."""
    import torch

    from kvflow.core.messages import CachedRequestData, SchedulerOutput
    from kvflow.distributed.group import TPGroup

    torch.set_num_threads(1)
    group = TPGroup.init(rank, 2, f"tcp://127.0.0.1:{port}", "cpu")

    def median_us(fn) -> float:
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e6)
        return statistics.median(times)

    for batch in batches:
        hidden = torch.randn(batch, 576, dtype=torch.bfloat16)
        logits = torch.randn(batch, 49152 // 2)
        cached = CachedRequestData()
        for i in range(batch):
            cached.append(f"cmpl-{i:032x}-0", [], 128 + i)
        sched = SchedulerOutput([], cached, {r: 1 for r in cached.req_ids}, batch)
        row = {
            "batch": batch,
            "all_reduce_us": median_us(lambda h=hidden: group.all_reduce(h)),
            "all_gather_logits_us": median_us(lambda x=logits: group.all_gather_last(x)),
            "broadcast_step_us": median_us(lambda s=sched: group.broadcast_object(s)),
        }
        if rank == 0:
            out[batch] = row
    group.destroy()


def micro(batches: list[int], reps: int) -> list[dict]:
    import torch.multiprocessing as mp

    from kvflow.worker.executor import free_port

    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_micro_rank, args=(free_port(), batches, reps, out), nprocs=2)
        return [dict(out[b]) for b in batches]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--micro", action="store_true", help="collectives alone, then exit")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if args.micro:
        for row in micro(batches, reps=200):
            print(json.dumps({k: round(v, 1) for k, v in row.items()}), flush=True)
        return 0
    rows = []
    for tp in (1, 2):
        llm = LLM(dtype=args.dtype, num_blocks=512, tensor_parallel_size=tp)
        for batch in batches:
            ms, parts = decode_step_ms(llm, batch, args.prompt_len, args.steps)
            row = {"tp": tp, "batch": batch, "step_ms": round(ms, 2)}
            row.update(
                {k: round(v * 1e3, 3) if not k.endswith("_calls") else v for k, v in parts.items()}
            )
            rows.append(row)
            print(json.dumps(row), flush=True)
        if tp > 1:
            llm.engine.core.runner.shutdown()
        del llm
    return 0


if __name__ == "__main__":
    sys.exit(main())
