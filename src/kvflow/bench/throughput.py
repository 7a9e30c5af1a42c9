"""`kvflow bench throughput`: the offline engine alone, optionally beside transformers' generate.

Prompts are random token ids of exactly `--input-len` tokens (sent as `prompt_token_ids`);
every request generates exactly `--output-len` tokens (greedy, `ignore_eos`). With
`--compare-transformers` the same prompts also go through `generate` (batched, padded left,
same dtype, greedy, min_new_tokens = max_new_tokens) in the same process, and the ratio is printed.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from kvflow.bench import candidate_token_ids, load_tokenizer


@dataclass(frozen=True)
class Timed:
    """One backend's run: wall seconds and the generated ids per prompt."""

    elapsed: float
    token_ids: list[list[int]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags named as `vllm bench throughput` names them where it has one."""
    parser.add_argument("--model", default=None, help="Model (default: kvflow's embedded one)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--num-blocks", type=int, default=None)
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-warmup", dest="warmup", action="store_false")
    parser.add_argument(
        "--compare-transformers", action="store_true", help="Also time transformers' generate"
    )
    parser.add_argument(
        "--hf-max-batch-size", type=int, default=None, help="transformers batch (default: all)"
    )
    parser.add_argument("--output-json", "--result-file", dest="output_json", default=None)
    parser.add_argument("--label", default=None)


def make_prompts(tokenizer: Any, num_prompts: int, input_len: int, seed: int) -> list[list[int]]:
    """`num_prompts` lists of `input_len` random, non-special token ids."""
    rng = random.Random(seed)
    candidates = candidate_token_ids(tokenizer)
    return [[rng.choice(candidates) for _ in range(input_len)] for _ in range(num_prompts)]


def _llm_kwargs(args: argparse.Namespace) -> dict[str, Any]:
    names = ("dtype", "max_model_len", "num_blocks", "block_size", "max_num_seqs")
    kwargs: dict[str, Any] = {"model": args.model}
    kwargs.update({n: getattr(args, n) for n in names if getattr(args, n) is not None})
    if args.max_num_batched_tokens is not None:
        kwargs["max_num_batched_tokens"] = args.max_num_batched_tokens
    return kwargs


def run_kvflow(args: argparse.Namespace, prompts: list[list[int]]) -> Timed:
    """Time one `LLM.generate` over every prompt (after a tiny untimed warm-up)."""
    from kvflow import LLM, SamplingParams

    llm = LLM(**_llm_kwargs(args))
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    if args.warmup:
        warm = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        llm.generate([{"prompt_token_ids": prompts[0]}], warm)
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": ids} for ids in prompts], params)
    elapsed = time.perf_counter() - start
    token_ids = [list(out.outputs[0].token_ids) for out in outputs]
    del llm, outputs
    gc.collect()
    return Timed(elapsed, token_ids)


def _torch_dtype(name: str) -> Any:
    import torch

    aliases = {"bf16": "bfloat16", "half": "float16", "fp16": "float16", "float": "float32"}
    name = aliases.get(name, name)
    return "auto" if name == "auto" else getattr(torch, name)


def _hf_generate(model: Any, batch: list[list[int]], output_len: int, pad: int) -> list[list[int]]:
    import torch

    width = max(len(ids) for ids in batch)
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in batch])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])
    with torch.inference_mode():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=mask,
            do_sample=False,
            max_new_tokens=output_len,
            min_new_tokens=output_len,
            pad_token_id=pad,
        )
    return [row[width:].tolist() for row in out]


def run_transformers(args: argparse.Namespace, tokenizer: Any, prompts: list[list[int]]) -> Timed:
    """Time transformers' greedy generate on the same prompts, batched and padded left."""
    from kvflow.model.loader import load_transformers_model, resolve_model

    path = str(resolve_model(args.model))
    model = load_transformers_model(path, _torch_dtype(args.dtype))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    size = args.hf_max_batch_size or len(prompts)
    if args.warmup:
        _hf_generate(model, prompts[:1], 4, pad)
    token_ids: list[list[int]] = []
    start = time.perf_counter()
    for i in range(0, len(prompts), size):
        token_ids.extend(_hf_generate(model, prompts[i : i + size], args.output_len, pad))
    elapsed = time.perf_counter() - start
    del model
    gc.collect()
    return Timed(elapsed, token_ids)


def _rates(timed: Timed, num_prompts: int, input_len: int) -> dict[str, float]:
    out_tokens = sum(len(ids) for ids in timed.token_ids)
    total = out_tokens + num_prompts * input_len
    seconds = max(timed.elapsed, 1e-9)
    return {
        "elapsed_time": timed.elapsed,
        "total_output_tokens": out_tokens,
        "total_num_tokens": total,
        "requests_per_second": num_prompts / seconds,
        "tokens_per_second": total / seconds,
        "request_throughput": num_prompts / seconds,
        "output_throughput": out_tokens / seconds,
        "total_token_throughput": total / seconds,
    }


def summarize(args: argparse.Namespace, kv: Timed, hf: Timed | None) -> dict[str, Any]:
    """The JSON result: vLLM's throughput keys plus the serve-style ones."""
    result: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "backend": "kvflow",
        "label": args.label,
        "model_id": args.model or "kvflow-default",
        "dtype": args.dtype,
        "num_prompts": args.num_prompts,
        "num_requests": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "max_num_seqs": args.max_num_seqs,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "total_input_tokens": args.num_prompts * args.input_len,
    }
    result.update(_rates(kv, args.num_prompts, args.input_len))
    if hf is not None:
        theirs = _rates(hf, args.num_prompts, args.input_len)
        same = sum(a == b for a, b in zip(kv.token_ids, hf.token_ids, strict=True))
        theirs["batch_size"] = args.hf_max_batch_size or args.num_prompts
        theirs["identical_outputs"] = same
        result["transformers"] = theirs
        result["output_throughput_ratio"] = result["output_throughput"] / max(
            theirs["output_throughput"], 1e-9
        )
    return result


def format_report(result: dict[str, Any]) -> str:
    lines = [
        f"kvflow: {result['elapsed_time']:.2f} s, {result['request_throughput']:.2f} req/s, "
        f"{result['output_throughput']:.1f} output tok/s, "
        f"{result['total_token_throughput']:.1f} total tok/s "
        f"({result['total_output_tokens']} output tokens)"
    ]
    expected = result["num_prompts"] * result["output_len"]
    if result["total_output_tokens"] != expected:
        lines.append(f"warning: expected {expected} output tokens")
    hf = result.get("transformers")
    if hf is not None:
        lines.append(
            f"transformers (batch {hf['batch_size']}): {hf['elapsed_time']:.2f} s, "
            f"{hf['output_throughput']:.1f} output tok/s; "
            f"kvflow / transformers = {result['output_throughput_ratio']:.2f}x; "
            f"identical outputs {hf['identical_outputs']}/{result['num_prompts']}"
        )
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    """Run the offline benchmark; prints a summary and writes `--output-json` if given."""
    tokenizer = load_tokenizer(args.model)
    prompts = make_prompts(tokenizer, args.num_prompts, args.input_len, args.seed)
    kv = run_kvflow(args, prompts)
    hf = run_transformers(args, tokenizer, prompts) if args.compare_transformers else None
    result = summarize(args, kv, hf)
    print(format_report(result))
    if args.output_json:
        path = Path(args.output_json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2) + "\n")
        print(f"Result written to {path}")
    return 0
