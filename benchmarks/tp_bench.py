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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--prompt-len", type=int, default=128)
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
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
