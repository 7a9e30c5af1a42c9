"""kvflow: a readable LLM serving engine with vLLM's interface and a liveness contract.

`from kvflow import LLM, SamplingParams`. Heavy modules load lazily so `kvflow.core` stays
importable without torch.
"""

from __future__ import annotations

import os

# Between two parallel regions torch's OpenMP threads (libgomp) spin for a while, then sleep.
# A step runs ~200 regions, so each one that finds the other thread asleep waits for a
# wake-up, which makes a decode step far slower than with spinning (benchmarks/RESULTS.md). A
# bounded spin (about half a millisecond) avoids that, and an idle engine's threads still sleep.
# libgomp reads this when torch first loads, so it is set here; the environment's value wins.
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", "30000")

from kvflow.outputs import CompletionOutput, RequestOutput
from kvflow.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from kvflow.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'kvflow' has no attribute {name!r}")
