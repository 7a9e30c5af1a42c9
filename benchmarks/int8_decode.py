"""The int8 kernel's ("vnni": AVX512-VNNI's, or AVX2's) rate at decode rows on 4-bit weights of
the Llama-3.2-1B or Llama-3.1-8B shape, in GB/s of the weight bytes GGUF's Q4_0 stores (18 a
block of 32), against the rate this host streams memory at, in one run.

The weights are random Q4_0-like parts (float16 scales, mins -8 x scale) of a decoder layer's
seven projections, in as many layers as make more than the L3 (8 layers of the 1B shape, 274 MB;
2 of the 8B, 245 MB), each call reading the next projection as a decode step does. Two forms of
the same weights alternate step by step (their ratio holds when the machine's speed drifts):
the mins read ("mins") and made from the scales ("offset" 8, what `QuantizedWeight.offset`
routes Q4_0 to). The stream rate: torch summing 1 GiB of int64 on the same threads.

    .venv/bin/python benchmarks/int8_decode.py [--shape 1b|8b] [--rows 1] [--steps 20]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

import torch  # noqa: E402

from kvflow.kernels.cpu import quant  # noqa: E402

SHAPES = {  # hidden, intermediate, KV width, layers rotated
    "1b": (2048, 8192, 512, 8),
    "8b": (4096, 14336, 1024, 2),
}


def weight(n: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=gen)
    scales = (torch.rand(n, k // 32, generator=gen) * 0.01).half()
    return codes, scales, (scales * -8).half()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    p.add_argument("--rows", type=int, default=1, help="activation rows (a decode batch)")
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    if not quant.vnni_available():
        sys.exit("the int8 kernel is not built here (no AVX512-VNNI and no AVX2)")
    hidden, inner, kv, layers = SHAPES[args.shape]
    projections = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden)]
    projections += [(inner, hidden), (inner, hidden), (hidden, inner)]
    gen = torch.Generator().manual_seed(0)
    weights = [weight(n, k, gen) for _ in range(layers) for n, k in projections]
    stored = sum(c.numel() + s.numel() * 2 for c, s, _ in weights)  # Q4_0's bytes
    xs = {k: torch.randn(args.rows, k).bfloat16() for k in (hidden, inner)}

    def step(offset: int) -> float:
        start = time.perf_counter()
        for codes, scales, mins in weights:
            x = xs[codes.shape[1] * 2]
            quant.linear_int8("vnni", x, codes, scales, mins, 4, 32, None, offset=offset)
        return time.perf_counter() - start

    times: dict[int, list[float]] = {0: [], 8: []}
    for _ in range(args.steps):
        for offset in times:
            times[offset].append(step(offset))
    block = torch.ones(2**27, dtype=torch.int64)  # 1 GiB
    streams = []
    for _ in range(5):
        start = time.perf_counter()
        block.sum()
        streams.append(block.nbytes / (time.perf_counter() - start))
    stream = statistics.median(streams) / 1e9
    print(
        f"{args.shape}: {stored / 1e6:.0f} MB of Q4_0 a step, {args.rows} row(s), "
        f"{torch.get_num_threads()} threads; this host streams {stream:.1f} GB/s (torch sum)"
    )
    for offset, name in ((0, "mins"), (8, "offset")):
        rate = stored / statistics.median(times[offset]) / 1e9
        print(f"  {name:6s} {rate:5.1f} GB/s of Q4_0 bytes ({rate / stream:.2f}x the stream)")
    ratios = sorted(a / b for a, b in zip(times[0], times[8], strict=True))
    print(f"  mins / offset time, median of {args.steps} pairs: {statistics.median(ratios):.3f}")


if __name__ == "__main__":
    main()
