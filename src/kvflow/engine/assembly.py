"""The one engine assembly. A builder makes what depends on where the model runs (one device:
`builder.build_parts`; ranks: `tp_builder.build_tp_parts`), and `assemble` makes the EngineCore
and the EngineInfo a front end needs from those parts, the same way for both: the grammar
backend, the KV-event publisher, the perf counters' model shape, the generation config's EOS
ids and the null runner cannot be present on one path and missing on the other.

    EngineArgs ─► build_parts | build_tp_parts ─► EngineParts ─► assemble ─► EngineCore, EngineInfo
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any

import torch

from kvflow.core.perf import ModelShape
from kvflow.engine.core_wire import EngineInfo
from kvflow.engine.engine_core import EngineCore
from kvflow.kv_events import make_publisher
from kvflow.structured.backend import GrammarBackend
from kvflow.tokenizer_files import class_path
from kvflow.worker import null_runner
from kvflow.worker.builder import EngineParts, build_parts, generation_eos_ids
from kvflow.worker.tp_builder import build_tp_parts

logger = logging.getLogger("kvflow.engine")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


def resolve_device(device: str) -> str:
    """`auto`: CUDA where a card is visible, else the CPU."""
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return device


def assemble(args: Any) -> tuple[EngineCore, EngineInfo, Any]:
    """(the EngineCore, what a front end knows of it, the tokenizer) for `args`, an EngineArgs. Raises ValueError for a
    geometry or a flag the configuration cannot honour, RankError when a rank fails to start."""
    device = resolve_device(args.device)
    if args.tensor_parallel_size > 1:
        parts = build_tp_parts(args, device)
    else:
        parts = build_parts(args, device)
    try:
        return _assemble(args, parts)
    except BaseException:
        shutdown = getattr(parts.runner, "shutdown", None)
        if shutdown is not None:
            shutdown()
        raise


def _assemble(args: Any, parts: EngineParts) -> tuple[EngineCore, EngineInfo, Any]:
    tokenizer, hf_config = parts.tokenizer, parts.hf_config
    eos = tokenizer.eos_token_id
    grammar = grammar_backend(args, parts)
    shape = ModelShape.from_hf_config(hf_config, parts.dtype.itemsize)
    log_steps = args.log_engine_steps or os.environ.get("KVFLOW_LOG_ENGINE_STEPS") == "1"
    core = EngineCore(
        parts.config,
        null_runner.from_env(parts.runner, hf_config.vocab_size, eos),
        log_steps,
        parts.async_scheduling,
        model_shape=dataclasses.replace(shape, num_gpus=parts.num_gpus),
        kv_events=make_publisher(args.kv_events_config, args.block_size),
        grammar=grammar,
    )
    info = EngineInfo(
        model_path=str(parts.path),
        model_name=args.served_model_name or (args.model or DEFAULT_MODEL_NAME),
        config=parts.config,
        eos_token_id=eos,
        generation_eos_ids=sorted(generation_eos_ids(parts.path)),
        dtype_name=str(parts.dtype).removeprefix("torch."),
        device=parts.device,
        structured_outputs=None if grammar is None else grammar.config,
        tokenizer_class=class_path(tokenizer),
    )
    return core, info, tokenizer


def grammar_backend(args: Any, parts: EngineParts) -> GrammarBackend | None:
    """The xgrammar backend for output constraints, over the logits' vocabulary; None
    (constrained requests are refused) when the tokenizer is one xgrammar cannot read."""
    eos = parts.tokenizer.eos_token_id
    stops = sorted({*generation_eos_ids(parts.path), *([] if eos is None else [eos])})
    vocab = parts.hf_config.vocab_size
    try:
        return GrammarBackend(parts.tokenizer, vocab, stops, args.structured_outputs_config)
    except Exception:
        logger.exception("structured outputs are off: xgrammar cannot read this tokenizer")
        return None
