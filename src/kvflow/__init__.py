"""kvflow: a readable LLM serving engine with vLLM's interface and a liveness contract.

`from kvflow import LLM, SamplingParams`. Heavy modules load lazily so `kvflow.core` stays
importable without torch.
"""

from __future__ import annotations

import os

# torch's OpenMP threads spin while they wait for work by default. When another thread or
# process wants the same cores (the HTTP thread, a client on the machine), a spinning or
# descheduled team member stalls every parallel region: measured 2.2x fewer tokens/s at
# concurrency 1 and 2.6x at 8 on 2 cores (benchmarks/RESULTS.md). Sleeping waits cost
# microseconds per region instead. Read when torch first loads, so set here; $OMP_WAIT_POLICY wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

from kvflow.outputs import CompletionOutput, RequestOutput
from kvflow.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from kvflow.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'kvflow' has no attribute {name!r}")
