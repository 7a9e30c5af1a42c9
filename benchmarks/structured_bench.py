"""Structured outputs' cost: output tokens/s with every request under a JSON schema beside the
same load unconstrained, at concurrency 1 and 8, against one kvflow server in one run (the
loads alternate, `--repeats` times, medians reported); and the mask's cost per step (fill the
bitmask of 8 constrained rows with one batched call and apply it to [8, V] logits), timed
offline on the same machine.

    python benchmarks/structured_bench.py --repeats 2 --out structured.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from kvflow.bench import serve as bench_serve  # noqa: E402
from support.serverproc import start_server  # noqa: E402

# An array of at least 50 records: the grammar cannot end before the output length (so both
# loads generate the same number of tokens), and the steps' masks come from every kind of grammar
# state (numbers, strings, keys, separators).
SCHEMA = {
    "type": "array",
    "minItems": 50,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 100000},
            "name": {"type": "string", "maxLength": 24},
            "score": {"type": "number"},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}},
            "active": {"type": "boolean"},
        },
        "required": ["id", "name", "score", "tags", "active"],
    },
}


def load(base_url: str, concurrency: int, constrained: bool, prompts: int, out_len: int) -> dict:
    parser = argparse.ArgumentParser()
    bench_serve.add_arguments(parser)
    argv = [
        "--base-url", base_url, "--max-concurrency", str(concurrency),
        "--num-prompts", str(prompts), "--input-len", "128", "--output-len", str(out_len),
        "--num-warmups", "1", "--disable-tqdm",
    ]  # fmt: skip
    if constrained:
        argv += ["--extra-body", json.dumps({"response_format": {
            "type": "json_schema", "json_schema": {"name": "records", "schema": SCHEMA}}})]  # fmt: skip
    return bench_serve.run(parser.parse_args(argv))


def mask_cost(rows: int = 8, steps: int = 200) -> dict:
    """Microseconds per step to fill and apply the bitmask of `rows` constrained rows."""
    from kvflow.model.loader import load_tokenizer, resolve_model
    from kvflow.sampling_params import StructuredOutputsParams
    from kvflow.structured.backend import GrammarBackend
    from kvflow.structured.bitmask import GrammarMasker, GrammarState, StepMask

    tokenizer = load_tokenizer(resolve_model(None))
    vocab = len(tokenizer)
    backend = GrammarBackend(tokenizer, vocab, [tokenizer.eos_token_id])
    compiled, _, _ = backend.compile(StructuredOutputsParams(json=SCHEMA)).result()
    text = '[{"id": 12, "name": "ab", "score": 1.5, "tags": ["x"], "active": true}, '
    states = [GrammarState(compiled) for _ in range(rows)]
    for i, state in enumerate(states):  # each row at a different point of the record
        for t in tokenizer.encode(text[: 10 + 7 * i], add_special_tokens=False):
            state.accept(t)
    masker = GrammarMasker(vocab, torch.device("cpu"))
    logits = torch.randn(rows, vocab)
    fill, apply = [], []
    for _ in range(steps):
        t0 = time.perf_counter()
        mask = StepMask(masker, list(range(rows)), states, rows, {})
        t1 = time.perf_counter()
        mask.apply(logits)
        fill.append(t1 - t0)
        apply.append(time.perf_counter() - t1)
    backend.close()
    return {
        "rows": rows,
        "fill_us_median": statistics.median(fill) * 1e6,
        "apply_us_median": statistics.median(apply) * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=16, help="per load and concurrency")
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    runs: dict[str, list[dict]] = {}
    server = start_server(geometry=["--num-blocks", "512"])
    try:
        for _ in range(args.repeats):
            for concurrency in (1, 8):
                for constrained in (False, True):
                    prompts = args.prompts if concurrency > 1 else max(2, args.prompts // 4)
                    r = load(server.url, concurrency, constrained, prompts, args.output_len)
                    key = f"c{concurrency}-{'schema' if constrained else 'free'}"
                    runs.setdefault(key, []).append(r)
                    print(key, f"{r['output_throughput']:.1f} tok/s", r["errors"], flush=True)
    finally:
        server.signal()
        server.wait_exit(30)
    summary = {
        key: {
            "output_tok_s_median": statistics.median(r["output_throughput"] for r in rs),
            "mean_output_tokens": statistics.mean(
                r["total_output_tokens"] / max(r["completed"], 1) for r in rs
            ),
            "errors": sum(r["errors"] for r in rs),
        }
        for key, rs in runs.items()
    }
    for c in (1, 8):
        free, schema = summary[f"c{c}-free"], summary[f"c{c}-schema"]
        summary[f"c{c}-ratio"] = schema["output_tok_s_median"] / free["output_tok_s_median"]
    summary["mask_cost"] = mask_cost()
    print(json.dumps(summary, indent=2))
    if args.out:
        Path(args.out).write_text(json.dumps({"summary": summary, "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
