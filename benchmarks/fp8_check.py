"""The `fp8` section of benchmarks/gpu_check.py: `--quantization fp8` on a card.

1. Projections of the Llama-3.2-1B shape at 1, 16, 256 and 2048 rows: bf16 F.linear (cuBLAS),
   FP8 through the matrix units (torch._scaled_mm, row-wise scales) and the Triton kernel that
   decodes the FP8 weight (`fp8_weight_linear`), device time by CUDA events; each FP8 result
   against the float64 product of the values the weight holds.
2. The engine on the random-weight 1B checkpoint: batch-1 and batch-32 decode step times and
   greedy agreement of fp8 against bf16 over the first 32 tokens, and the weights' bytes.
"""

from __future__ import annotations

import functools
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

SHAPES = {  # name: (out_features, in_features) of the 1B shape's projections
    "qkv": (3072, 2048),
    "o": (2048, 2048),
    "gate_up": (16384, 2048),
    "down": (2048, 8192),
    "head": (128256, 2048),
}
ROWS = [1, 16, 256, 2048]


def _device_ms(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def kernel_rows(smoke: bool) -> list[dict[str, Any]]:
    from kvflow.model.fp8_linear import fp8_weight_linear, quantize_fp8, scaled_mm

    rows_out = []
    shapes = {"o": (256, 256)} if smoke else SHAPES
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda") / k**0.5
        w_bf16 = w.bfloat16()
        q = quantize_fp8(w)
        w64 = q.dequantize(torch.float64)
        for m in [1, 16] if smoke else ROWS:
            x = torch.randn(m, k, device="cuda").bfloat16()
            ref = x.double() @ w64.T
            scale = ref.abs().max().item()
            row: dict[str, Any] = dict(proj=name, rows=m, N=n, K=k)
            reps = 3 if smoke else 50
            row["bf16_ms"] = _device_ms(functools.partial(F.linear, x, w_bf16), reps)
            for label, fn in (("scaled_mm", scaled_mm), ("triton", fp8_weight_linear)):
                try:
                    out = fn(x, q, None)
                    row[f"{label}_ms"] = _device_ms(functools.partial(fn, x, q, None), reps)
                    row[f"{label}_max_err"] = (out.double() - ref).abs().max().item() / scale
                except Exception as e:  # an older card or torch: reported, not fatal
                    row[f"{label}_error"] = repr(e)[:200]
            row["fp8_weight_MB"] = q.nbytes / 1e6
            row["bf16_weight_MB"] = n * k * 2 / 1e6
            rows_out.append(row)
    return rows_out


def engine_rows(path: Path, smoke: bool, decode_ms, greedy) -> dict[str, Any]:
    """bf16 against fp8 on the checkpoint at `path`: step times and greedy agreement."""
    from kvflow import LLM

    out: dict[str, Any] = {}
    prompts = [[(7 * i + j) % 500 + 3 for j in range(16)] for i in range(8)]
    tokens: dict[str, list] = {}
    for method in ("none", "fp8"):
        t0 = time.monotonic()
        llm = LLM(str(path), device="cuda", quantization=method, max_num_batched_tokens=2048)
        load_s = time.monotonic() - t0
        entry: dict[str, Any] = dict(load_s=load_s)
        for batch in [1, 4] if smoke else [1, 32]:
            step_ms, runner_ms, _, device_ms = decode_ms(llm, batch, 128, 3, 5 if smoke else 30, 1)
            entry[f"batch{batch}_step_ms"] = step_ms
            entry[f"batch{batch}_device_ms"] = device_ms
        tokens[method] = greedy(llm, prompts, 32)
        out[method] = entry
        del llm
        torch.cuda.empty_cache()
    pairs = zip(tokens["fp8"], tokens["none"], strict=True)
    same = sum(a == b for x, y in pairs for a, b in zip(x, y, strict=True))
    out["greedy_agreement"] = same / sum(len(t) for t in tokens["none"])
    return out


def section_fp8(args, device: str, report: dict, workdir: Path, build_checkpoint, shapes,
                decode_ms, greedy, log) -> None:  # fmt: skip
    """Fills report["fp8"]; on a card only (the CPU run of gpu_check skips it)."""
    if device != "cuda":
        report["fp8"] = {"skipped": "no card"}
        return
    section: dict[str, Any] = {}
    report["fp8"] = section
    section["kernels"] = kernel_rows(args.smoke)
    for row in section["kernels"]:
        log(f"fp8 {row['proj']} rows {row['rows']}: bf16 {row['bf16_ms']:.3f} ms, "
            f"scaled_mm {row.get('scaled_mm_ms', float('nan')):.3f} ms, "
            f"triton {row.get('triton_ms', float('nan')):.3f} ms")  # fmt: skip
    name = "llama-1b-shape"
    path = workdir / "fp8-checkpoint"
    build_checkpoint(shapes[name], path, device, seed=3)
    torch.cuda.empty_cache()
    section["engine"] = engine_rows(path, args.smoke, decode_ms, greedy)
    log(f"fp8 engine: {section['engine']}")
