"""A real LLMEngine over the scripted runner of tests/fakes.py: no model, steps of `delay` s,
and a switch that makes the next step raise (engine death). `make_llm_engine` drives its
EngineCore in this thread (as the offline `LLM`); `make_front_end` puts the same core on the
server's engine loop thread (`ThreadCore`), as `AsyncEngine` takes it."""

from __future__ import annotations

import time

from kvflow.config import CacheConfig, EngineConfig, SchedulerConfig
from kvflow.engine.core_client import ThreadCore
from kvflow.engine.core_wire import EngineInfo
from kvflow.engine.engine_core import EngineCore
from kvflow.engine.llm_engine import LLMEngine
from support.fakes import FakeRunner


class SlowRunner(FakeRunner):
    delay: float = 0.01
    boom: bool = False

    def execute(self, sched):
        if self.boom:
            raise RuntimeError("injected step failure")
        time.sleep(self.delay)
        return super().execute(sched)


def _parts(tokenizer, max_num_seqs: int, max_model_len: int):
    cache = CacheConfig(block_size=16, num_blocks=64)
    config = EngineConfig(cache, SchedulerConfig(max_model_len, 512, max_num_seqs))
    runner = SlowRunner(block_size=16, num_blocks=64)
    eos = getattr(tokenizer, "eos_token_id", 2)
    info = EngineInfo("", "fake", config, eos, [], "float32", "cpu")
    return EngineCore(config, runner), info, runner


def make_llm_engine(
    tokenizer=None, max_num_seqs: int = 8, max_model_len: int = 256
) -> tuple[LLMEngine, SlowRunner]:
    core, info, runner = _parts(tokenizer, max_num_seqs, max_model_len)
    return LLMEngine(info, tokenizer, core), runner


def make_front_end(
    tokenizer=None, max_num_seqs: int = 8, max_model_len: int = 256, watchdog_timeout=0.0
) -> tuple[LLMEngine, SlowRunner]:
    """The front end's LLMEngine over a ThreadCore (`engine.core`) whose EngineCore is
    `engine.core.core`; AsyncEngine and build_app take it."""
    core, info, runner = _parts(tokenizer, max_num_seqs, max_model_len)
    return LLMEngine(info, tokenizer, ThreadCore(core, info, watchdog_timeout)), runner
