"""`kvflow serve` flags, spelled as vLLM spells them, and their mapping onto EngineArgs."""

from __future__ import annotations

import argparse
import os
import re

from kvflow.engine.llm_engine import EngineArgs

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?)(b?)\s*$", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_bytes(text: str) -> int:
    """`4294967296`; `4G`, `4GiB`, `4gib` binary; `4g`, `4GB` decimal (vLLM's convention)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (e.g. 2G, 512MiB, 1000000)")
    number, unit, binary, suffix_b = match.groups()
    if not unit:
        return int(float(number))
    is_binary = bool(binary) or (unit.isupper() and not suffix_b)
    return int(float(number) * (1024 if is_binary else 1000) ** _POWERS[unit.lower()])


def parse_max_model_len(text: str) -> int:
    """An int, `-1` or `auto` (fit the KV pool), or `2k`-style (k = 1000, K = 1024)."""
    value = text.strip()
    if value.lower() == "auto" or value == "-1":
        return -1
    match = re.fullmatch(r"(\d+)([kKmM]?)", value)
    if not match:
        raise argparse.ArgumentTypeError(f"invalid --max-model-len {text!r}: an int, -1 or auto")
    number, unit = int(match.group(1)), match.group(2)
    scale = {"": 1, "k": 1000, "K": 1024, "m": 1000**2, "M": 1024**2}[unit]
    return number * scale


def add_serve_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `kvflow serve` flags (vLLM's spellings) on `parser`; returns it."""
    _add_engine_flags(parser)
    _add_server_flags(parser)
    return parser


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", default=None, help="model (HF directory or .gguf)")
    p.add_argument("--model", default=None, help="same as the positional MODEL")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float", "bfloat16", "float16", "half"],
    )
    p.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=["gguf", "int8", "fp8", "none"],
        help="weights kept quantized: gguf (a .gguf's blocks, CPU; the default for a .gguf), "
        "int8 (per-channel, CPU), fp8 (per-channel, CUDA), none (the model's dtype)",
    )
    p.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    p.add_argument("--max-model-len", type=parse_max_model_len, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", "--num-gpu-blocks-override", dest="num_blocks", type=int)
    p.add_argument(
        "--kv-cache-memory",
        "--kv-cache-memory-bytes",
        dest="kv_cache_memory",
        type=parse_bytes,
        default=None,
        help="KV cache size in bytes (suffixes: 2G, 512MiB)",
    )
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="CUDA: run every step eagerly (no CUDA graphs for decode batches)",
    )
    p.add_argument(
        "--async-scheduling",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="schedule each step while the previous one runs on the device, its sampled ids "
        "fed to the next on the device (default: on for CUDA, off for the CPU)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat-template", default=None, help="a file or an inline Jinja template")
    p.add_argument(
        "--log-engine-steps",
        action="store_true",
        default=os.environ.get("KVFLOW_LOG_ENGINE_STEPS") == "1",
        help="one log line per engine step (also KVFLOW_LOG_ENGINE_STEPS=1)",
    )


def _add_server_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--api-key", default=None, help="guards /v1/* (also $VLLM_API_KEY)")
    p.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="render a chat template sent with a request (refused otherwise, as vLLM does)",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=_non_negative,
        default=0.0,
        help="on SIGTERM, drain in-flight requests for this many seconds (0: abort at once)",
    )
    p.add_argument("--enable-log-requests", action="store_true")
    p.add_argument("--disable-log-requests", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--max-num-queued-reqs", type=int, default=None, help="503 beyond this")
    p.add_argument(
        "--watchdog-timeout",
        type=float,
        default=60.0,
        help="warn and answer /health 503 while an engine step runs longer (0: off)",
    )
    p.add_argument(
        "--request-timeout", type=float, default=None, help="abort requests after N seconds"
    )
    p.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug", "trace"],
    )
    p.add_argument("--disable-uvicorn-access-log", action="store_true")


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    model = args.model or args.model_tag
    if args.model and args.model_tag and args.model != args.model_tag:
        raise ValueError(
            f"two models given: positional {args.model_tag!r} and --model {args.model!r}"
        )
    dtype = {"half": "float16", "float": "float32"}.get(args.dtype, args.dtype)
    names = args.served_model_name
    return EngineArgs(
        model=model,
        served_model_name=names[0] if names else None,
        dtype=dtype,
        quantization=args.quantization,
        device=args.device,
        max_model_len=args.max_model_len,
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        kv_cache_memory=args.kv_cache_memory,
        gpu_memory_utilization=args.gpu_memory_utilization,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_queued_reqs=args.max_num_queued_reqs,  # enforced at admission by AsyncEngine
        enable_prefix_caching=args.enable_prefix_caching,
        enforce_eager=args.enforce_eager,
        async_scheduling=args.async_scheduling,
        seed=args.seed,
        chat_template=args.chat_template,
        log_engine_steps=args.log_engine_steps,
    )
