"""Decode steps of the embedded model, its GGUF blocks served as stored (`--quantization gguf`)
against the same weights dequantized to bf16 (`none`), side by side at each batch size.

Per method and batch: the median engine step (decode only), the part of it spent in the
native kernels (every ctypes call of kernels/cpu, timed around the call) and
the rest (Python: the model's modules, the runner, the scheduler, the sampler), the weight bytes
a step reads, and those bytes over the step time against the machine's copy bandwidth measured
in the same run.

    .venv/bin/python benchmarks/quant_decode.py [--steps 64] [--repeats 3] [--batch 1,8,32]
        [--threads 1]
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch  # noqa: E402

from kvflow import LLM, SamplingParams  # noqa: E402
from kvflow.kernels.cpu import attention, ops, quant  # noqa: E402
from kvflow.model import linear  # noqa: E402  (it calls bf16_linear by its own name)

NATIVE = {
    linear: ["bf16_linear"],
    attention: ["paged_attention"],
    ops: ["rms_norm", "rotary_", "silu_mul"],
    quant: ["linear", "linear_int8", "dequantize"],
}


class NativeTimer:
    """Sums the seconds spent inside the native kernel wrappers while active."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.saved: list[tuple] = []

    def __enter__(self) -> NativeTimer:
        for module, names in NATIVE.items():
            for name in names:
                inner = getattr(module, name)
                self.saved.append((module, name, inner))
                setattr(module, name, self._timed(inner))
        return self

    def _timed(self, inner):
        @functools.wraps(inner)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - t0

        return timed

    def __exit__(self, *exc) -> None:
        for module, name, inner in self.saved:
            setattr(module, name, inner)


def copy_bandwidth() -> float:
    """Bytes per second of a 512 MiB copy (read + write counted), best of 5."""
    src = torch.ones(512 << 20, dtype=torch.uint8)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() / best


def weight_bytes(llm: LLM) -> int:
    """Bytes of the weights one decode step reads: every projection and the logits head."""
    model = llm.engine.core.runner.model
    total = 0
    for module in model.modules():
        weight = getattr(module, "quant", None)
        if weight is not None and hasattr(module, "in_features"):
            total += weight.nbytes
        elif getattr(module, "native", None) is not None:
            total += module.native.numel() * module.native.element_size()
    head = getattr(model, "head_quant", None)
    if head is not None:
        total += head.nbytes
    elif getattr(model, "head_native", None) is not None:
        total += model.head_native.numel() * model.head_native.element_size()
    return total


def decode_steps(llm: LLM, steps: int, batch: int) -> tuple[list[float], list[float]]:
    """(step seconds, native seconds) of `steps` decode steps of `batch` requests."""
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=steps + 8, ignore_eos=True)
    ids = [f"bench-{i}" for i in range(batch)]
    for i, request_id in enumerate(ids):
        prompt = engine.tokenizer(f"{i}. The history of the city begins")["input_ids"]
        engine.add_request(request_id, prompt, params)
    for _ in range(3):  # the prompts, then every request decoding
        engine.step()
    times, native = [], []
    for _ in range(steps):
        with NativeTimer() as timer:
            t0 = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - t0)
        native.append(timer.seconds)
    engine.abort_request(ids)
    return times, native


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--batch", default="1", help="comma-separated decode batch sizes")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args()
    if args.threads:  # one thread: no OpenMP barrier waits for a core another process holds
        torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batch.split(",")]
    # eager steps: a replayed step (worker/cpu_replay.py) calls the kernels without the wrappers
    engines = {
        m: LLM(quantization=m, max_model_len=2048, enforce_eager=True) for m in ("gguf", "none")
    }
    rows: dict[tuple[str, int], list] = {(m, b): [] for b in batches for m in engines}
    for _ in range(args.repeats):  # alternated, so that drift shows in both
        for batch in batches:
            for method, llm in engines.items():
                rows[method, batch].append(decode_steps(llm, args.steps, batch))
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write)")
    print(
        "| weights | batch | step ms | native ms | Python ms | weight MB/step | GB/s of weights |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for (method, batch), runs in rows.items():
        step = statistics.median(t for times, _ in runs for t in times)
        native = statistics.median(n for _, ns in runs for n in ns)
        size = weight_bytes(engines[method])
        print(
            f"| {method} | {batch} | {1e3 * step:.2f} | {1e3 * native:.2f} "
            f"| {1e3 * (step - native):.2f} | {size / 1e6:.1f} | {size / step / 1e9:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
