"""A runner that costs nothing: the host-side benchmark's stand-in for the model.

    KVFLOW_NULL_RUNNER=S     every step takes S seconds of simulated device time (0: none)

Unset (always, in production) nothing changes. Set, the builder swaps the loaded model's
runner for a `NullRunner`: each step returns one fixed token for every request whose prompt
(or chunk) this step completes, as the model runner would, after sleeping S seconds outside
the GIL as a device step would. Everything else (tokenizer, scheduler, KV accounting,
detokenizer, HTTP) is the real server's, so what a benchmark measures is the host's cost.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from typing import Any

from kvflow.core.messages import ModelRunnerOutput, SchedulerOutput

ENV = "KVFLOW_NULL_RUNNER"
logger = logging.getLogger("kvflow.engine")


def from_env(runner: Any, vocab_size: int, eos_token_id: int | None) -> Any:
    """`runner`, or a NullRunner when $KVFLOW_NULL_RUNNER is set."""
    spec = os.environ.get(ENV, "").strip()
    if not spec:
        return runner
    try:
        step_s = float(spec)
    except ValueError:
        raise ValueError(f"{ENV}: expected seconds per step, got {spec!r}") from None
    logger.warning("%s=%s: the model is not run; every token is a fixed id", ENV, spec)
    return NullRunner(vocab_size, eos_token_id, step_s)


class NullRunner:
    """Emits `token` for each request whose scheduled tokens reach the end of its sequence.

    It follows each request's length as the model runner does: a new (or resumed) request
    brings its prompt and outputs, each sampled token adds one."""

    def __init__(self, vocab_size: int, eos_token_id: int | None, step_s: float = 0.0) -> None:
        token = min(1000, vocab_size - 1)
        self.token = token if token != eos_token_id else token - 1
        self.step_s = step_s
        self._num_tokens: dict[str, int] = {}  # tokens the request has (prompt + outputs)
        self._computed: dict[str, int] = {}

    def launch(self, sched: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        for req_id in sched.finished_req_ids | sched.preempted_req_ids:
            self._num_tokens.pop(req_id, None)
            self._computed.pop(req_id, None)
        for new in sched.new_reqs:
            self._num_tokens[new.req_id] = len(new.prompt_token_ids) + len(new.output_token_ids)
            self._computed[new.req_id] = new.num_computed_tokens
        sampled: dict[str, list[int]] = {}
        token, num_tokens, computed = self.token, self._num_tokens, self._computed
        for req_id, n in sched.num_scheduled_tokens.items():
            done = computed[req_id] + n
            computed[req_id] = done
            if done >= num_tokens[req_id]:
                sampled[req_id] = [token]
                num_tokens[req_id] += 1
            else:
                sampled[req_id] = []
        started = time.monotonic()

        def wait() -> ModelRunnerOutput:
            left = self.step_s - (time.monotonic() - started)
            if left > 0:
                time.sleep(left)
            return ModelRunnerOutput(sampled)

        return wait
