"""A real LLMEngine over the scripted runner of tests/fakes.py: no model, steps of `delay` s,
and a switch that makes the next step raise (engine death)."""

from __future__ import annotations

import time

from kvflow.config import CacheConfig, EngineConfig, SchedulerConfig
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


def make_llm_engine(
    tokenizer=None, max_num_seqs: int = 8, max_model_len: int = 256
) -> tuple[LLMEngine, SlowRunner]:
    cache = CacheConfig(block_size=16, num_blocks=64)
    config = EngineConfig(cache, SchedulerConfig(max_model_len, 512, max_num_seqs))
    runner = SlowRunner(block_size=16, num_blocks=64)
    eos = getattr(tokenizer, "eos_token_id", 2)
    engine = LLMEngine(config, runner, tokenizer=tokenizer, model_name="fake", eos_token_id=eos)
    return engine, runner
