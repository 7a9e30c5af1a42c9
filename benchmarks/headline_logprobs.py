"""The README's headline prompts on the embedded model: first-token logprobs per route against
transformers in float32 on the same weights (issue 38, part 2), and whether a greedy answer
changes with the batch it shares.

Prompts: "What is the capital of France?" rendered with the model's chat template (the README's
curl example) and "The capital of France is" (the Python API example). The reference is
transformers' float32 model of the same GGUF (`load_transformers_model`).
Routes are kvflow's offline `LLM` with the engine arguments below; a route this CPU cannot run
(AMX, VNNI) is named with the reason and skipped. Per route and prompt: the top-3 first tokens
with their logprobs, the top token's margin over the second, and the first greedy tokens.

With `--batch`, the chat prompt's greedy answer alone and beside 7 other requests (64 tokens),
for each route: whether the tokens differ, and where.

    .venv/bin/python benchmarks/headline_logprobs.py [--routes bf16,float32,...] [--batch]
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from kvflow import LLM, SamplingParams  # noqa: E402
from kvflow.model import load_tokenizer, quant_kernels, resolve_model  # noqa: E402
from kvflow.model.quant_format import from_gguf_blocks  # noqa: E402

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
COMPLETION = "The capital of France is"
GREEDY_TOKENS = 20
BATCH_TOKENS = 64
OTHERS = [  # the 7 requests the batch run puts beside the chat prompt
    "Write a haiku about the sea.",
    "List three uses of copper.",
    "Explain what a hash table is in two sentences.",
    "What is 17 times 23?",
    "Translate 'good morning' into Spanish.",
    "Name the largest planet in the solar system.",
    "Give me a recipe for pancakes.",
]

# route name -> (engine arguments, the kernel the route's linear layers take, or None)
ROUTES: dict[str, tuple[dict, str | None]] = {
    "bf16": ({}, None),
    "float32": ({"dtype": "float32"}, None),
    "gguf-float": ({"quantization": "gguf", "max_num_batched_tokens": 16}, "float"),
    "gguf-dequant": ({"quantization": "gguf"}, "dequant"),
    "gguf-f32": ({"quantization": "gguf", "dtype": "float32"}, "float"),
    "gguf-vnni": ({"quantization": "gguf", "max_num_batched_tokens": 4}, "vnni"),
    "gguf-amx": ({"quantization": "gguf", "max_num_batched_tokens": 16}, "amx"),
}


def prompts() -> dict[str, list[int]]:
    """Each headline prompt's token ids, as the server renders them (chat template)."""
    tokenizer = load_tokenizer(resolve_model(None))
    chat = tokenizer.apply_chat_template(
        CHAT, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    return {"chat": list(chat), "completion": tokenizer(COMPLETION).input_ids}


def reference(ids: dict[str, list[int]]) -> dict[str, tuple[torch.Tensor, list[int]]]:
    """transformers float32: (first-token logprobs, greedy tokens) per prompt."""
    from kvflow.model.loader import load_transformers_model

    model = load_transformers_model(resolve_model(None), torch.float32)
    out = {}
    with torch.inference_mode():
        for name, prompt in ids.items():
            tensor = torch.tensor([prompt])
            logprobs = model(tensor).logits[0, -1].float().log_softmax(-1)
            gen = model.generate(
                tensor, max_new_tokens=GREEDY_TOKENS, do_sample=False, pad_token_id=2
            )
            out[name] = (logprobs, gen[0, len(prompt) :].tolist())
    return out


def route_runs(kernel: str | None, dtype: str) -> str | None:
    """Why a route cannot run here (None: it can): its kernel must be what `quant_kernels.route`
    picks for its rows (Q4_1 codes, the embedded model's projections)."""
    if kernel is None:
        return None
    rows = 4 if kernel == "vnni" else 16 if kernel != "dequant" else 64
    weight = from_gguf_blocks(np.zeros((1, 20 * 2), np.uint8), "Q4_1", 64)
    picked = quant_kernels.route(rows, weight, getattr(torch, dtype))
    return None if picked == kernel else f"{rows} rows take {picked!r} on this CPU"


def measure(llm: LLM, ids: list[int]) -> tuple[dict[int, float], list[int]]:
    """(top-5 first-token logprobs, greedy tokens) of one prompt alone in the engine."""
    params = SamplingParams(temperature=0, max_tokens=GREEDY_TOKENS, logprobs=5)
    out = llm.generate({"prompt_token_ids": ids}, params)[0].outputs[0]
    return {t: lp.logprob for t, lp in out.logprobs[0].items()}, list(out.token_ids)


def row(route: str, top: dict[int, float], greedy: list[int], tokenizer) -> str:
    ranked = sorted(top.items(), key=lambda kv: -kv[1])[:3]
    cells = ", ".join(f"{tokenizer.decode([t])!r} {lp:.3f}" for t, lp in ranked)
    margin = ranked[0][1] - ranked[1][1]
    text = tokenizer.decode(greedy).replace("\n", "\\n")
    return f"| {route} | {cells} | {margin:.3f} | {text!r} |"


def batch_check(llm: LLM, tokenizer) -> str:
    """The chat prompt's greedy answer alone, then beside 7 other chat requests."""
    params = SamplingParams(temperature=0, max_tokens=BATCH_TOKENS, ignore_eos=True)
    render = [[{"role": "user", "content": c["content"]}] for c in CHAT] + [
        [{"role": "user", "content": text}] for text in OTHERS
    ]
    alone = llm.chat(render[0], params)[0].outputs[0].token_ids
    llm.engine.core.scheduler.kv.pool.reset_prefix_cache()
    batched = llm.chat(render, params)[0].outputs[0].token_ids
    if list(alone) == list(batched):
        return f"same {len(alone)} tokens"
    first = next(i for i, (a, b) in enumerate(zip(alone, batched, strict=True)) if a != b)
    return f"differ from token {first}: {tokenizer.decode(alone[first:first + 8])!r} alone, " \
        f"{tokenizer.decode(batched[first:first + 8])!r} batched"  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--routes", default=",".join(ROUTES))
    parser.add_argument("--batch", action="store_true", help="also the batch-invariance check")
    args = parser.parse_args()
    ids = prompts()
    tokenizer = load_tokenizer(resolve_model(None))
    for name in ids:
        print(f"{name}: {tokenizer.decode(ids[name])!r}")
    print("\n| prompt | route | top-3 first tokens (logprob) | margin | greedy answer |")
    print("|---|---|---|---|---|", flush=True)
    for name, (logprobs, greedy) in reference(ids).items():
        values, tokens = logprobs.topk(5)
        top = dict(zip(tokens.tolist(), values.tolist(), strict=True))
        print(f"| {name} " + row("transformers float32", top, greedy, tokenizer), flush=True)
    for route in args.routes.split(","):
        kwargs, kernel = ROUTES[route]
        why = route_runs(kernel, kwargs.get("dtype", "bfloat16"))
        if why is not None:
            print(f"| {route} | skipped: {why} |", flush=True)
            continue
        llm = LLM(None, num_blocks=256, block_size=16, **kwargs)
        for name, prompt in ids.items():
            print(f"| {name} " + row(route, *measure(llm, prompt), tokenizer), flush=True)
        if args.batch:
            print(f"| batch | {route} | {batch_check(llm, tokenizer)} |", flush=True)
        del llm
        gc.collect()


if __name__ == "__main__":
    main()
