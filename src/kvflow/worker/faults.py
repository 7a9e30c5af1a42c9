"""Fault injection for the liveness tests: break the engine on purpose, on demand.

Read once, when the engine is built, from `$KVFLOW_FAULT`. Unset (always, in production) it
changes nothing: `FaultPlan.from_env()` returns None and the builder wraps nothing.

    KVFLOW_FAULT=FAULT[,FAULT...]
      raise:T        a step that starts (or resumes) a request whose prompt contains token id T
                     raises: engine death (every request fails, /health 503, exit 1)
      sleep:T:S      such a step first sleeps S seconds: a hung step (the watchdog's case)
      nan:T          the logits of requests whose prompt contains T are NaN on every step:
                     a request that fails alone inside the model
      rankfail:R     tensor-parallel rank R raises during its start-up (after its process
                     started): start-up must end with that rank's error
      overcommit:N   advertise max_model_len N tokens beyond what the KV pool can serve: breaks
                     liveness point 1, so the stuck-head guard (point 4) must catch it

A marker token lets a test aim a fault at one request with a token-id prompt while the other
requests on the same server run normally.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvflow.core.messages import ModelRunnerOutput, SchedulerOutput

ENV = "KVFLOW_FAULT"


@dataclass(frozen=True)
class FaultPlan:
    raise_token: int | None = None
    sleep_token: int | None = None
    sleep_s: float = 0.0
    nan_token: int | None = None
    overcommit: int = 0
    fail_rank: int | None = None

    @classmethod
    def from_env(cls) -> FaultPlan | None:
        """The plan in $KVFLOW_FAULT, or None when it is unset or empty."""
        spec = os.environ.get(ENV, "").strip()
        return cls.parse(spec) if spec else None

    @classmethod
    def parse(cls, spec: str) -> FaultPlan:
        """Raises ValueError for a spec that is not in the grammar above."""
        fields: dict[str, Any] = {}
        for item in filter(None, (part.strip() for part in spec.split(","))):
            kind, *args = item.split(":")
            try:
                if kind == "raise" and len(args) == 1:
                    fields["raise_token"] = int(args[0])
                elif kind == "sleep" and len(args) == 2:
                    fields["sleep_token"], fields["sleep_s"] = int(args[0]), float(args[1])
                elif kind == "nan" and len(args) == 1:
                    fields["nan_token"] = int(args[0])
                elif kind == "overcommit" and len(args) == 1:
                    fields["overcommit"] = int(args[0])
                elif kind == "rankfail" and len(args) == 1:
                    fields["fail_rank"] = int(args[0])
                else:
                    raise ValueError(item)
            except ValueError:
                raise ValueError(
                    f"{ENV}: cannot parse {item!r}; expected raise:T, sleep:T:S, nan:T, "
                    "overcommit:N or rankfail:R, comma-separated"
                ) from None
        return cls(**fields)

    def max_model_len(self, resolved: int) -> int:
        """The advertised context: `resolved` plus the overcommit (a broken invariant)."""
        return resolved + self.overcommit

    def wrap(self, runner: Any) -> FaultyRunner:
        """`runner` with this plan's step faults; the nan fault patches its sampling entry."""
        if self.nan_token is not None:
            _poison_logits(runner, self.nan_token)
        return FaultyRunner(runner, self)


class FaultyRunner:
    """A runner that raises or sleeps in the steps that start a marked request."""

    def __init__(self, inner: Any, plan: FaultPlan) -> None:
        self.inner = inner
        self.plan = plan

    def launch(self, scheduler_output: SchedulerOutput) -> Callable[[], ModelRunnerOutput]:
        starting = {t for new in scheduler_output.new_reqs for t in new.prompt_token_ids}
        plan = self.plan
        if plan.sleep_token is not None and plan.sleep_token in starting:
            time.sleep(plan.sleep_s)
        if plan.raise_token is not None and plan.raise_token in starting:
            raise RuntimeError(f"injected step failure ({ENV} raise:{plan.raise_token})")
        return self.inner.launch(scheduler_output)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _poison_logits(runner: Any, token: int) -> None:
    """Make the logits of marked requests NaN just before the sampler sees them.

    Relies on ModelRunner's `_sample(logits, req_ids, ..., raw=)` (row i belongs to
    req_ids[i]), its `requests` states and their `rows`; fails loudly at start if those
    change."""
    sample: Callable[..., Any] | None = getattr(runner, "_sample", None)
    if sample is None or not hasattr(runner, "requests") or not hasattr(runner, "rows"):
        raise ValueError(f"{ENV} nan:{token} needs ModelRunner._sample, .requests and .rows")

    def marked(req_id: str) -> bool:
        row, rows = runner.requests[req_id].row, runner.rows
        return bool((rows.token_ids[row, : rows.prompt_len[row]] == token).any())

    def sample_poisoned(
        logits: Any, req_ids: list[str], *args: Any, raw: Any = None, **kwargs: Any
    ) -> Any:
        rows = [i for i, r in enumerate(req_ids) if marked(r)]
        if rows:  # (`raw`, a decode graph's greedy tokens, came from the clean logits)
            logits, raw = logits.clone(), None
            logits[rows] = float("nan")
        return sample(logits, req_ids, *args, raw=raw, **kwargs)

    runner._sample = sample_poisoned
