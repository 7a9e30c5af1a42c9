"""The GPU attention backend: `torch_ref.paged_attention`'s contract over the Triton kernels
(kvflow.kernels.triton), with the step's metadata turned into their tensors and tile choices.

- Decode-only steps (max_query_len 1): one kernel (`attention_decode`) stores the step's K/V,
  rotates q and k when `rotary` is given (this backend `fuses_rotary`), and attends; with fewer
  (request, KV head) pairs than the card has SMs, each pair's keys are split among programs and
  merged (`_decode_splits`).
- Other steps: q rotated in place (`rotary_`), the step's K/V stored (`write_kv`, k rotated as
  it is stored), then one varlen kernel (`attention_prefill`) over a tile map built once per
  step and kept in `meta.memo` for every layer.
"""

from __future__ import annotations

import torch

from kvflow.attention.metadata import AttentionMetadata
from kvflow.kernels.triton.attention_common import TileShape, tile_shape
from kvflow.kernels.triton.attention_decode import decode_attention
from kvflow.kernels.triton.attention_prefill import query_tiles, varlen_attention
from kvflow.kernels.triton.device import sm_count
from kvflow.kernels.triton.kv_write import write_kv
from kvflow.kernels.triton.ops import rotary_

__all__ = ["triton_paged_attention", "write_kv"]


def triton_paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    *,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    tile: tuple[int, int] | None = None,
    splits: int | None = None,
) -> torch.Tensor:
    """Drop-in for `torch_ref.paged_attention`: q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D].
    `rotary` (cos, sin [T, 1, D]): q and k are not rotated yet (q may be rotated in place).
    `tile` (BLOCK_N keys, warps) and `splits` (programs per request and KV head of a decode
    step) override `_key_tile`'s and `_decode_splits`' choices (tests and benchmarks)."""
    decode = meta.max_query_len == 1
    if not decode:
        if rotary is not None:
            rotary_(q, *rotary)
        write_kv(k, v, kv_cache, meta.slot_mapping, rotary)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if meta.num_reqs == 0 or q.shape[0] == 0:
        return out
    _check(q, kv_cache, sliding_window, decode)
    if q.stride(-1) != 1:
        q = q.contiguous()
    shape = tile_shape(q.shape[1], kv_cache.shape[3], q.shape[2], meta.max_query_len)
    if decode:
        pairs = meta.num_reqs * kv_cache.shape[3]
        key_tile = tile or _key_tile(q.device, True, pairs, shape.head_pad)
        split = _split_buffers(meta, q.device, pairs, shape, splits)
        decode_attention(
            q, k, v, out, kv_cache, meta.block_tables, meta.seq_lens, meta.slot_mapping,
            scale, sliding_window, rotary, shape, key_tile, split,
        )  # fmt: skip
        return out
    tiles = _query_tiles(meta, q.shape[0], shape.block_q)
    key_tile = tile or _key_tile(q.device, False, 0, shape.head_pad)
    varlen_attention(
        q, out, kv_cache, meta.block_tables, meta.query_start_loc, meta.seq_lens, tiles,
        scale, sliding_window, shape, key_tile,
    )  # fmt: skip
    return out


triton_paged_attention.fuses_rotary = True  # type: ignore[attr-defined]  # see `rotary`


def _check(
    q: torch.Tensor, kv_cache: torch.Tensor, sliding_window: int | None, decode: bool
) -> None:
    num_heads, num_kv_heads = q.shape[1], kv_cache.shape[3]
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} KV heads")
    if sliding_window is not None and sliding_window < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    if kv_cache.stride(-1) != 1:
        raise ValueError("kv_cache must be contiguous in the head dimension")
    if decode and kv_cache.stride(1) != kv_cache.shape[2] * kv_cache.stride(2):
        raise ValueError("kv_cache's blocks must be packed (a decode stores k/v at slot rows)")


def _query_tiles(meta: AttentionMetadata, num_tokens: int, block_q: int) -> tuple:
    """`attention_prefill.query_tiles`, once per step and tile size (kept in `meta.memo`)."""
    key = ("triton_query_tiles", block_q)
    if key not in meta.memo:
        meta.memo[key] = query_tiles(meta.query_start_loc, meta.num_reqs, num_tokens, block_q)
    return meta.memo[key]


def _key_tile(device: torch.device, decode: bool, programs: int, head_pad: int) -> tuple:
    """(BLOCK_N, warps): keys per iteration of a program's walk over its context. A decode step
    with fewer programs than the card has SMs (batch 1: one per KV head) is a chain of
    dependent loads per program, so its programs take longer key tiles: 256 keys for head dims
    up to 64, twice the usual tile above (measured: benchmarks/RESULTS.md)."""
    block_n = 32 if head_pad > 128 else 64
    if decode and device.type == "cuda" and programs < sm_count(device):
        block_n *= 4 if head_pad <= 64 else 2
    return block_n, 4


_MAX_SPLITS = 16


def _decode_splits(device: torch.device, programs: int) -> int:
    """Programs per (request, KV head) of a decode step: with fewer (request, KV head) pairs
    than the card has SMs, each pair's keys are cut into up to SMs / pairs chunks (at most 16,
    whole key tiles each), attended in parallel and merged. A context of one key tile or less
    stays one program, so short contexts pay nothing."""
    if device.type != "cuda" or programs >= sm_count(device):
        return 1
    return max(1, min(_MAX_SPLITS, sm_count(device) // programs))


def _split_buffers(
    meta: AttentionMetadata,
    device: torch.device,
    pairs: int,
    shape: TileShape,
    splits: int | None,
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(splits, counters, partial max/sum, partial outputs) for a split decode, or None: one
    program per pair. The partials are one pair of buffers per step, shared by the layers (one
    kernel at a time)."""
    splits = _decode_splits(device, pairs) if splits is None else splits
    if splits <= 1:
        return None
    counters = _split_counters(device, pairs)
    if counters is None:  # not allocated yet, inside a graph capture
        return None
    parts = pairs * splits
    key = ("triton_split_parts", parts, shape.block_m, shape.head_pad)
    if key not in meta.memo:
        on = {"dtype": torch.float32, "device": device}
        meta.memo[key] = (
            torch.empty(parts, 2, shape.block_m, **on),
            torch.empty(parts, shape.block_m, shape.head_pad, **on),
        )
    return (splits, counters, *meta.memo[key])


_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}


def _split_counters(device: torch.device, pairs: int) -> torch.Tensor | None:
    """int32 zeros, one per (request, KV head) pair, that the split programs count on and the
    merging one sets back to 0; allocated per device outside any CUDA graph capture (a graph
    must not own them) and never freed (a captured graph keeps their address). None: too few,
    and a capture is running (no splitting then)."""
    held = _COUNTERS.setdefault(device, [])
    if not held or held[-1].numel() < pairs:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        held.append(torch.zeros(max(pairs, 4096), dtype=torch.int32, device=device))
    return held[-1]
