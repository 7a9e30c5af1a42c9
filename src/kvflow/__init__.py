"""kvflow: a readable LLM serving engine with vLLM's interface and a liveness contract.

`from kvflow import LLM, SamplingParams`. Heavy modules load lazily so `kvflow.core` stays
importable without torch.
"""

from __future__ import annotations

from kvflow.outputs import CompletionOutput, RequestOutput
from kvflow.sampling_params import SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from kvflow.engine.llm import LLM

        return LLM
    raise AttributeError(f"module 'kvflow' has no attribute {name!r}")
