"""`kvflow serve | generate | chat | bench serve | bench throughput`."""

from __future__ import annotations

import argparse
import sys


def _add_engine_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="HF directory or .gguf file (default: embedded)")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16", "float", "half"],
    )
    p.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="default: the model's generation config's max_new_tokens (the embedded model: 512), "
        "else the rest of the context",
    )
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)


def _generate(args: argparse.Namespace, chat: bool) -> int:
    from kvflow import LLM, SamplingParams
    from kvflow.server.generation_defaults import default_sampling_params

    llm = LLM(args.model, dtype=args.dtype, device=args.device, max_model_len=args.max_model_len)
    max_tokens = args.max_tokens or default_sampling_params("auto", args.model).get("max_tokens")
    params = SamplingParams(max_tokens=max_tokens, temperature=args.temperature, seed=args.seed)
    if chat:
        out = llm.chat([{"role": "user", "content": args.prompt}], params)
    else:
        out = llm.generate(args.prompt, params)
    print(out[0].outputs[0].text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvflow", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    from kvflow.server.args import add_serve_arguments

    add_serve_arguments(sub.add_parser("serve", help="serve the OpenAI-compatible API"))
    for name, help_text in (("generate", "complete a prompt"), ("chat", "answer one chat message")):
        p = sub.add_parser(name, help=help_text)
        p.add_argument("prompt")
        _add_engine_arguments(p)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    from kvflow.bench import serve as bench_serve
    from kvflow.bench import throughput as bench_throughput

    bench_serve.add_arguments(bench.add_parser("serve", help="load an OpenAI-compatible server"))
    bench_throughput.add_arguments(bench.add_parser("throughput", help="the offline engine alone"))
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "serve":
        from kvflow.server.listen import bind_or_exit

        sock = bind_or_exit(args)  # before the heavy imports: a busy port fails at once
        from kvflow.server.api_server import run

        return run(args, sock)
    try:
        if args.command in ("generate", "chat"):
            return _generate(args, chat=args.command == "chat")
        from kvflow.bench import serve as bench_serve
        from kvflow.bench import throughput as bench_throughput

        return (bench_serve if args.bench == "serve" else bench_throughput).main(args)
    except (ValueError, OSError) as exc:  # a value the user can fix: one line, as serve does
        name = " ".join(filter(None, [parser.prog, args.command, getattr(args, "bench", None)]))
        print(f"{name}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
