"""`kvflow serve` flags, spelled as vLLM spells them, and their mapping onto EngineArgs."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
from typing import TYPE_CHECKING

from kvflow.kv_events import KVEventsConfig
from kvflow.structured.config import StructuredOutputsConfig

if TYPE_CHECKING:  # the engine's modules load torch: `kvflow serve` parses its flags first
    from kvflow.engine.llm_engine import EngineArgs

ARGS_ENV = "KVFLOW_API_SERVER_ARGS"  # an API server's flags as JSON, set by the supervisor
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
    _add_chat_output_flags(parser)
    return parser


def _add_quantization_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quantization",
        "-q",
        default=None,
        choices=["gguf", "int8", "fp8", "none"],
        help="weights kept quantized: gguf (a .gguf's blocks, CPU), int8 (per-channel, CPU), "
        "fp8 (per-channel, CUDA), none (the model's dtype; the default)",
    )


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("model_tag", nargs="?", default=None, help="model (HF directory or .gguf)")
    p.add_argument("--model", default=None, help="same as the positional MODEL")
    p.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "float", "bfloat16", "float16", "half"],
    )
    _add_quantization_flag(p)
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
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
    p.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="ranks the model is split over, one process each (torch.distributed)",
    )
    p.add_argument(
        "--distributed-executor-backend",
        choices=["mp", "ray"],
        default=None,
        help="how tensor-parallel ranks start: local processes (mp, the default) or Ray actors",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--chat-template", default=None, help="a file or an inline Jinja template")
    _add_structured_outputs_flags(p)
    p.add_argument(
        "--log-engine-steps",
        action="store_true",
        default=os.environ.get("KVFLOW_LOG_ENGINE_STEPS") == "1",
        help="one log line per engine step (also KVFLOW_LOG_ENGINE_STEPS=1)",
    )


def _add_chat_output_flags(p: argparse.ArgumentParser) -> None:
    from kvflow.server.reasoning import REASONING_PARSER_NAMES
    from kvflow.server.tool_parsers import TOOL_PARSER_NAMES

    p.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help='let the model choose to call tools (tool_choice "auto"); needs --tool-call-parser',
    )
    p.add_argument(
        "--tool-call-parser",
        choices=TOOL_PARSER_NAMES,
        default=None,
        help="the format of the model's tool calls (xlam for the embedded SmolLM2)",
    )
    p.add_argument(
        "--reasoning-parser",
        choices=REASONING_PARSER_NAMES,
        default=None,
        help="split <think>...</think> reasoning into the response's `reasoning` field",
    )


def _add_structured_outputs_flags(p: argparse.ArgumentParser) -> None:
    """vLLM's spellings: the whole config as JSON, or its fields one by one (dotted)."""
    p.add_argument(
        "--structured-outputs-config",
        default=None,
        help='JSON, e.g. \'{"backend": "xgrammar", "disable_any_whitespace": true}\'; '
        "backend: auto (xgrammar) or xgrammar",
    )
    p.add_argument(
        "--structured-outputs-config.backend",
        dest="structured_outputs_backend",
        default=None,
        help="auto or xgrammar",
    )
    p.add_argument(
        "--structured-outputs-config.disable-any-whitespace",
        "--structured-outputs-config.disable_any_whitespace",
        dest="structured_outputs_disable_any_whitespace",
        action="store_true",
        default=None,
        help="JSON outputs without whitespace between tokens",
    )


def structured_outputs_config(args: argparse.Namespace) -> StructuredOutputsConfig:
    """The JSON flag, then the dotted ones over it. Raises ValueError."""
    config = StructuredOutputsConfig.parse(args.structured_outputs_config)
    changes = {}
    if args.structured_outputs_backend is not None:
        changes["backend"] = args.structured_outputs_backend
    if args.structured_outputs_disable_any_whitespace is not None:
        changes["disable_any_whitespace"] = True
    return dataclasses.replace(config, **changes) if changes else config


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
    p.add_argument(
        "--strict-request-fields",
        action="store_true",
        help="refuse a request with fields kvflow does not know (400 naming them); by default "
        "they are ignored and each name is logged once",
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
    _add_process_flags(p)
    _add_page_flags(p)
    _add_deployment_flags(p)


def _add_process_flags(p: argparse.ArgumentParser) -> None:
    """How many API server processes serve the port (each over the one engine process)."""
    p.add_argument(
        "--api-server-count",
        "-asc",
        type=_positive_int,
        default=1,
        help="API server processes on one port, all over one engine core process",
    )
    # Set by the --api-server-count supervisor for each API server process it starts.
    p.add_argument("--engine-address", default=None, help=argparse.SUPPRESS)
    p.add_argument("--api-server-index", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--listen-fd", type=int, default=None, help=argparse.SUPPRESS)


def _add_page_flags(p: argparse.ArgumentParser) -> None:
    """The page at / and the sampling defaults a first chat meets."""
    p.add_argument(
        "--generation-config",
        default="auto",
        help="request defaults from the model's generation_config.json: 'auto' (the model's; "
        "the embedded model gets temperature 0.2, top_p 0.9, max_new_tokens 512), 'vllm' (none), "
        "or a folder holding one",
    )
    p.add_argument(
        "--override-generation-config",
        default=None,
        help="JSON object over the generation config, e.g. '{\"temperature\": 0.5}'",
    )
    p.add_argument(
        "--disable-web-ui",
        action="store_true",
        help="serve no page at / (the chat playground and live engine view); the API is "
        "unchanged. Not vLLM's --disable-frontend-multiprocessing, which is about processes",
    )


def _add_deployment_flags(p: argparse.ArgumentParser) -> None:
    """What a deployment behind a proxy, a router or a gateway sets (vLLM's names)."""
    p.add_argument("--root-path", default=None, help="the path prefix a proxy serves under")
    p.add_argument("--allowed-origins", type=_json_list, default=["*"], help="CORS, JSON list")
    p.add_argument("--allowed-methods", type=_json_list, default=["*"], help="CORS, JSON list")
    p.add_argument("--allowed-headers", type=_json_list, default=["*"], help="CORS, JSON list")
    p.add_argument("--allow-credentials", action="store_true", help="CORS credentials")
    p.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this key ...")
    p.add_argument("--ssl-certfile", default=None, help="... and this certificate")
    p.add_argument("--ssl-ca-certs", default=None, help="CA certificates for client certs")
    p.add_argument("--enable-request-id-headers", action="store_true", help="X-Request-Id")
    p.add_argument("--disable-log-stats", action="store_true", help="no periodic stats log line")
    p.add_argument(
        "--max-log-len",
        type=int,
        default=None,
        help="with --enable-log-requests: log at most this many prompt characters and ids",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=parse_bytes,
        default=32 << 20,
        help="a larger request body gets a 413 (default 32MiB; 0: no limit)",
    )
    p.add_argument(
        "--kv-events-config",
        type=_kv_events_config,
        default=None,
        help='publish KV-cache events, vLLM\'s JSON: {"enable_kv_cache_events": true, '
        '"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": ..., "topic": ...}',
    )


def _json_list(text: str) -> list[str]:
    """vLLM takes the CORS flags as JSON lists (`'["*"]'`); a bare word is a one-item list."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return [text]
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {text!r}")
    return value


def _kv_events_config(text: str) -> KVEventsConfig:
    try:
        return KVEventsConfig.from_json(text)
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def args_from_env() -> argparse.Namespace | None:
    """An API server's flags when the --api-server-count supervisor started it, else None."""
    text = os.environ.get(ARGS_ENV)
    return None if text is None else argparse.Namespace(**json.loads(text))


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return value


def _non_negative(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def check_serve_args(args: argparse.Namespace) -> None:
    """What vLLM refuses before loading: auto tool choice without a parser."""
    if getattr(args, "enable_auto_tool_choice", False) and not args.tool_call_parser:
        raise ValueError("--enable-auto-tool-choice requires --tool-call-parser to be set")


def engine_args_from(args: argparse.Namespace) -> EngineArgs:
    from kvflow.engine.llm_engine import EngineArgs

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
        tensor_parallel_size=args.tensor_parallel_size,
        distributed_executor_backend=args.distributed_executor_backend,
        chat_template=args.chat_template,
        structured_outputs_config=structured_outputs_config(args),
        log_engine_steps=args.log_engine_steps,
        kv_events_config=args.kv_events_config,
    )
