"""Random-weight checkpoints of real models' shapes, for measuring speed without a download
(issue 44, part 4).

    python benchmarks/make_checkpoints.py --shape llama-3.2-1b --format gguf-q4_0
    python benchmarks/make_checkpoints.py --shape llama-3.1-8b --format safetensors-bf16 \\
        --out /tmp/kvflow-shapes/8b-bf16

Formats: gguf-q4_0 and gguf-q8_0 (the `gguf` package's quantizers), gguf-q4_k_m (llama.cpp's
`llama-quantize`, given with --llama-quantize, found on PATH or built by compare.py's
`llama-server` entry; skipped without it) and
safetensors-bf16 (a directory). Tensors are made and written one at a time, so the peak memory is
about one tensor, not the model. The tokenizer is the embedded model's padded to the shape's
vocabulary. Random weights produce noise: serve them with `ignore_eos` (`kvflow bench serve`
sets it). The bytes a decode token reads are the real model's.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

from checkpoint_plan import SHAPES, Shape, parameter_count, plan
from checkpoint_writers import write_gguf, write_q4_k_m, write_safetensors

FORMATS = ("gguf-q4_0", "gguf-q8_0", "gguf-q4_k_m", "safetensors-bf16")
DEFAULT_DIR = Path("/tmp/kvflow-shapes")
HERE = Path(__file__).resolve().parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), required=True)
    parser.add_argument("--format", choices=FORMATS, required=True)
    parser.add_argument("--out", type=Path, help=f"default: {DEFAULT_DIR}/SHAPE-FORMAT[.gguf]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--llama-quantize", help="llama.cpp's llama-quantize (gguf-q4_k_m)")
    return parser.parse_args(argv)


def default_out(shape: str, fmt: str) -> Path:
    name = f"{shape}-{fmt.split('-', 1)[1]}"
    return DEFAULT_DIR / (name + ".gguf" if fmt.startswith("gguf") else name)


def decode_bytes(shape: Shape, sizes: dict[str, int]) -> int:
    """Weight bytes one decode step reads: every tensor once, except that an untied model's
    embedding table is one row (its head is a tensor of its own). Rope factors are not weights."""
    total = 0
    for spec in plan(shape):
        nbytes = sizes.get(spec.gguf, sizes.get(spec.hf, 0))
        if spec.fill == "rope":
            continue
        if spec.role == "embed" and not shape.tied:
            nbytes //= shape.vocab
        total += nbytes
    return total


def peak_rss_bytes() -> int:
    """This process's peak resident memory (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


def path_bytes(path: Path) -> int:
    if path.is_dir():
        return sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    return path.stat().st_size


def make(shape: Shape, fmt: str, out: Path, seed: int, quantize_bin: str | None) -> dict | None:
    """Write the checkpoint; its tensor sizes by name, or None when Q4_K_M is skipped."""
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "safetensors-bf16":
        if shape.arch != "llama":
            raise SystemExit(f"{shape.name}: GGUF only (its safetensors config is Llama's)")
        return write_safetensors(shape, out, seed)
    if fmt == "gguf-q4_k_m":
        if quantize_bin is None:
            print("gguf-q4_k_m skipped: no llama-quantize on PATH (or give --llama-quantize)")
            return None
        return write_q4_k_m(shape, out, seed, quantize_bin)
    return write_gguf(shape, fmt, out, seed)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    shape = SHAPES[args.shape]
    out = args.out or default_out(args.shape, args.format)
    built = HERE / ".peers" / "llama-server" / "build" / "bin" / "llama-quantize"  # compare.py's
    quantize_bin = args.llama_quantize or shutil.which("llama-quantize")
    quantize_bin = quantize_bin or (str(built) if built.is_file() else None)
    start = time.perf_counter()
    sizes = make(shape, args.format, out, args.seed, quantize_bin)
    if sizes is None:
        return 0
    elapsed = time.perf_counter() - start
    mib = 2**20
    print(f"wrote {out}")
    print(f"  shape {shape.name}, format {args.format}, seed {args.seed}")
    print(f"  file size         {path_bytes(out) / mib:,.1f} MiB")
    print(f"  parameters        {parameter_count(plan(shape)):,}")
    per_token = decode_bytes(shape, sizes)
    print(f"  bytes per token   {per_token:,} ({per_token / mib:,.1f} MiB: the weights read once)")
    print(f"  time              {elapsed:.1f} s")
    print(f"  peak RSS (VmHWM)  {peak_rss_bytes() / mib:,.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
