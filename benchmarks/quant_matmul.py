"""Linear layers of the embedded model's shapes at decode batch sizes: the bf16 kernel on packed
weights against the quantized kernels (float32 widening, AMX-INT8, dequantize then torch's bf16
matmul), side by side in one run.

Each cell is the best of `--calls` calls (microseconds), the kernels alternated per shape and row
count so that drift shows in all of them. Weights are random blocks of the given GGUF type (or
`int8`: per-channel scales), in as many copies as make `--cold-mib` of bf16, a call reading the
next copy: a decode step reads every layer once, so no layer's weights are in L2 when it runs
(a large L3 may still hold them all: the embedded model's 269 MB of bf16 fit in 480 MiB).

    .venv/bin/python benchmarks/quant_matmul.py [--threads 1] [--rows 1,2,4,8,16,32,64]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "model"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from test_quant_kernels import gguf_tensor  # noqa: E402

from kvflow.kernels.cpu import linear, quant  # noqa: E402
from kvflow.model import quant_kernels  # noqa: E402
from kvflow.model.quant_format import (  # noqa: E402
    QuantizedWeight,
    from_gguf_blocks,
    quantize_int8,
)

SHAPES = {  # name: (N, K) of SmolLM2-135M
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "head": (49152, 576),
}


def best_us(fn, calls: int, copies: int) -> float:
    """Best time of `calls` calls, each on the next of `copies` weights (out of the caches)."""
    fn(0)
    best = float("inf")
    for i in range(calls):
        t0 = time.perf_counter()
        fn(i % copies)
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def make_weight(kind: str, n: int, k: int, seed: int) -> QuantizedWeight:
    if kind == "int8":
        return quantize_int8(torch.randn(n, k, generator=torch.Generator().manual_seed(seed)))
    return from_gguf_blocks(gguf_tensor(kind, n, k, seed), kind, k)


def kernels(weights: list[QuantizedWeight], packed: list[torch.Tensor], n: int):
    """name -> (x, copy) -> y for each way to run the layer."""
    out = {
        "bf16": lambda x, i: linear.bf16_linear(x, packed[i], None, n),
        "float32 widen": lambda x, i: quant_kernels.kernel_linear(x, weights[i], None),
        "dequant+bf16": lambda x, i: F.linear(x, quant_kernels.dequantize(weights[i], x.dtype)),
    }
    if quant.amx_available():
        out["amx int8"] = lambda x, i: quant_kernels.kernel_linear(x, weights[i], None, "amx")
    if quant.vnni_available():
        out["vnni int8"] = lambda x, i: quant_kernels.kernel_linear(x, weights[i], None, "vnni")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rows", default="1,2,4,8,16,32,64")
    p.add_argument("--kinds", default="Q4_1,Q8_0,Q6_K")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--cold-mib", type=int, default=64, help="bf16 bytes the copies add up to")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    print(f"threads {args.threads}; best of {args.calls} calls, microseconds; weights rotated")
    print(f"over copies of {args.cold_mib} MiB of bf16 (beyond the L2 cache) per shape")
    for kind in args.kinds.split(","):
        for shape in args.shapes.split(","):
            n, k = SHAPES[shape]
            copies = max(1, (args.cold_mib << 20) // (2 * n * k))
            weights = [make_weight(kind, n, k, seed) for seed in range(copies)]
            packed = [linear.pack_linear_weight(w.dequantize(torch.bfloat16)) for w in weights]
            table = kernels(weights, packed, n)
            print(f"\n{kind} {shape} {n}x{k}\n| rows | " + " | ".join(table) + " |")
            for m in rows:
                x = torch.randn(m, k).bfloat16()
                cells = [
                    best_us(lambda i, f=f, x=x: f(x, i), args.calls, copies) for f in table.values()
                ]
                print(f"| {m} | " + " | ".join(f"{c:.0f}" for c in cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
