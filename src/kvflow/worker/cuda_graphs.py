"""Decode-only steps at a few fixed batch sizes, replayed as CUDA graphs.

A decode-only step (every scheduled request adds exactly one token) of B requests runs at the
smallest *bucket* >= B out of 1, 2, 4, ..., 256 (capped by max_num_seqs). Rows B .. bucket-1 are
padding aimed at the null block, which the block pool never hands to a request:

    row         input_id  position  slot_mapping            block_tables row     seq_len
    real b      its token c_b       block(c_b) * bs + off   its blocks, then 0   c_b + 1
    padding     0         0         0 (block 0, offset 0)   all 0                1

so a padded row writes its K/V into block 0 and attends over that one slot only: it never
reads or writes a real request's KV. Its hidden state is garbage and is dropped (rows >= B).

Static buffers, allocated once and shared by every bucket (a graph reads fixed addresses):

    _longs   int64 [3 * max_batch]   bucket b uses [0, b) ids | [b, 2b) positions | [2b, 3b) slots
    _seq_lens int32 [max_batch], _block_tables int32 [max_batch, max_blocks_per_seq]
    _query_start_loc int32 [max_batch + 1] = 0, 1, 2, ...  (every row has one query: constant)

Per step the rows are laid out on the host (numpy over pinned staging buffers) and go to the
device in two copies; the block table goes only `bucket x widest row` entries wide (the full
width, max_model_len / block_size columns, would be megabytes per step). Columns at or past
the widest row are kept all-zero (zeroed when the widest row shrinks), so every padded row of
the bucket being run is all zeros.

Attention metadata and its memo: `AttentionMetadata.memo` caches per-step tensors that backends
derive from the metadata (the reference's masks; the Triton backend's tile map, which it builds
for varlen steps only: its decode path, taken here, needs none). A graph must not keep values
from the step it was captured in, so each forward builds a fresh metadata object over the
static buffers: during capture the memo is filled by device ops *inside* the graph, which
therefore recompute it from the static buffers at every replay; warm-up runs use their own
objects. `max_seq_len` is the bound max_model_len, not the step's maximum, so one graph is valid
for any context length (the Triton backend reads lengths from `seq_lens` on the device and does
not use max_seq_len; the torch reference gathers up to it, which is correct, only slower).

A graph holds the whole step up to the sampler: the forward, the logits head (float32 logits
of every row) and `greedy.raw_argmax` of them (greedy tokens and bad-row flags). An all-greedy
batch without penalties samples exactly those, so its step launches one graph and one copy of
the ids; any other batch samples from the graph's logits. Launched after the graph, the head
and the argmax would cost the host three Triton launches and the Python around them a step.

On CUDA (`capture` left True) `capture()` warms each bucket up and captures one graph per bucket,
largest first, into one shared memory pool; `run()` replays. With `capture=False` (and always on
the CPU) `run()` executes the same padded forward eagerly: this is how the CPU tests check the
padding, and how the GPU check compares graph replay with eager execution. The CPU's own
replay (`cpu_replay.CpuDecodeReplay`) is a subclass at exact batch sizes: no padding rows,
`_hidden` replaced by recorded kernel calls.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from kvflow.attention.metadata import AttentionMetadata, pack_block_ids
from kvflow.worker.greedy import RawArgmax, raw_argmax

logger = logging.getLogger("kvflow.engine")

BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_WARMUP_RUNS = 2  # eager runs per bucket before its capture (Triton compiles, cuBLAS picks)


def decode_buckets(max_num_seqs: int) -> list[int]:
    """The batch sizes that get a graph: BUCKETS below max_num_seqs, then the cap itself
    (max_num_seqs, or 256 when it is larger; bigger decode batches run eagerly)."""
    cap = max(1, min(max_num_seqs, BUCKETS[-1]))
    return [b for b in BUCKETS if b < cap] + [cap]


def pack_inputs(
    input_ids: list[int], positions: list[int], block_ids: list[list[int]]
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """`DecodeGraphs.run`'s arguments from lists (callers without persistent rows)."""
    table, num_blocks = pack_block_ids(block_ids)
    return np.asarray(input_ids, dtype=np.int64), np.asarray(positions, np.int64), table, num_blocks


class DecodeOutput(NamedTuple):
    """A decode step's rows as a graph leaves them: final hidden states [B, hidden], logits
    [B, V] (float32 on CUDA; on the CPU the head's dtype, which the sampler widens only for rows
    that need more than the argmax), and `greedy.raw_argmax` of those logits (what an all-greedy
    batch samples)."""

    hidden: torch.Tensor
    logits: torch.Tensor
    raw: RawArgmax

    def rows(self, n: int) -> DecodeOutput:
        """The first n rows (views)."""
        argmax, bad, block = self.raw
        raw = (argmax[:n], bad[:n], None if block is None else block[:, :n])
        return DecodeOutput(self.hidden[:n], self.logits[:n], raw)


class DecodeGraphs:
    """Padded decode forwards at fixed batch sizes; graphs on CUDA, eager otherwise."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
        device: torch.device | str,
        capture: bool = True,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.device = torch.device(device)
        self.use_graphs = capture and self.device.type == "cuda"
        self.buckets = decode_buckets(max_num_seqs)
        self.max_batch = self.buckets[-1]
        self.max_blocks = -(-max_model_len // block_size)
        self.steps: Counter[int] = Counter()  # bucket -> decode steps run at it
        batch, width = self.max_batch, self.max_blocks
        on = {"device": self.device}
        self._longs = torch.zeros(3 * batch, dtype=torch.int64, **on)
        self._seq_lens = torch.ones(batch, dtype=torch.int32, **on)
        self._block_tables = torch.zeros(batch, width, dtype=torch.int32, **on)
        self._query_start_loc = torch.arange(batch + 1, dtype=torch.int32, **on)
        # int32 landing area for seq_lens | block table rows, laid out for one step at a time
        self._landing = torch.zeros(batch * (1 + width), dtype=torch.int32, **on)
        self._table_width = 0  # columns >= this are zero in every row of _block_tables
        pin = self.device.type == "cuda"
        self._host_longs = torch.zeros(3 * batch, dtype=torch.int64, pin_memory=pin)
        self._host_ints = torch.zeros(batch * (1 + width), dtype=torch.int32, pin_memory=pin)
        self._host_longs_np = self._host_longs.numpy()
        self._host_ints_np = self._host_ints.numpy()
        # Recorded after each step's host -> device copies: the staging buffers are not
        # rewritten before the copies that read them have run (non_blocking copies).
        self._copied = torch.cuda.Event() if pin else None
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, DecodeOutput]] = {}

    def fits(self, num_reqs: int) -> bool:
        return 0 < num_reqs <= self.max_batch

    def bucket_for(self, num_reqs: int) -> int:
        return next(b for b in self.buckets if b >= num_reqs)

    def run(
        self,
        input_ids: np.ndarray,
        positions: np.ndarray,
        block_table: np.ndarray,
        num_blocks: np.ndarray,
        fill_ids: Callable[[torch.Tensor], None] | None = None,
    ) -> DecodeOutput:
        """The step's `DecodeOutput` for B decode tokens: request b's token `input_ids[b]`
        at position `positions[b]` (its context before this step), its `num_blocks[b]` blocks
        in row b of `block_table` [B, W] (then zeros; `pack_block_ids` makes one from lists).
        `fill_ids`, if given, is called with the ids on the device before the forward, to
        write ids that are still on the device (async scheduling).

        The result holds views into the graph's outputs, valid until the next call.
        """
        num_reqs = len(input_ids)
        if not self.fits(num_reqs):
            raise ValueError(f"{num_reqs} requests do not fit the largest bucket {self.max_batch}")
        bucket = self.bucket_for(num_reqs)
        self._load(bucket, input_ids, positions, block_table, num_blocks)
        if fill_ids is not None:
            fill_ids(self._longs[:bucket])
        self.steps[bucket] += 1
        if self.use_graphs:
            if bucket not in self._graphs:
                raise RuntimeError("DecodeGraphs.capture() must run before the first step")
            graph, out = self._graphs[bucket]
            graph.replay()
        else:
            out = self._forward(bucket)
        return out.rows(num_reqs)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture one graph per bucket, largest first, into one memory pool (CUDA only; a
        no-op otherwise). Runs on padding rows only, so it writes nothing but block 0."""
        if not self.use_graphs:
            return
        start = time.monotonic()
        pool = torch.cuda.graph_pool_handle()
        for bucket in reversed(self.buckets):
            self._load(bucket, *pack_inputs([], [], []))
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                for _ in range(_WARMUP_RUNS):
                    self._forward(bucket)
            torch.cuda.current_stream().wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = self._forward(bucket)
            self._graphs[bucket] = (graph, out)
        torch.cuda.synchronize()
        logger.info(
            "CUDA graphs: captured decode batch sizes %s in %.1f s",
            ",".join(map(str, self.buckets)),
            time.monotonic() - start,
        )

    def _forward(self, bucket: int) -> DecodeOutput:
        """The padded forward of `bucket` rows over the static buffers (fresh metadata, see
        the module docstring), then the logits and their greedy tokens: the graph covers the
        step up to the sampler, whose greedy path then launches nothing."""
        meta = AttentionMetadata(
            slot_mapping=self._longs[2 * bucket : 3 * bucket],
            query_start_loc=self._query_start_loc[: bucket + 1],
            seq_lens=self._seq_lens[:bucket],
            block_tables=self._block_tables[:bucket],
            max_query_len=1,
            max_seq_len=self.max_model_len,
            block_size=self.block_size,
        )
        hidden = self._hidden(bucket, meta)
        logits = self.model.compute_logits(hidden, float32=self.device.type == "cuda")
        return DecodeOutput(hidden, logits, raw_argmax(logits))

    def _hidden(self, bucket: int, meta: AttentionMetadata) -> torch.Tensor:
        """The final hidden states of the bucket's rows (ids and positions from the buffers)."""
        ids, positions = self._longs[: 2 * bucket].view(2, bucket).unbind(0)
        return self.model(ids, positions, self.kv_caches, meta)

    def _load(
        self,
        bucket: int,
        input_ids: np.ndarray,
        positions: np.ndarray,
        block_table: np.ndarray,
        num_blocks: np.ndarray,
    ) -> None:
        """Lay the step out on the host (real rows, then padding) and copy it to the device."""
        num_reqs, bs = len(input_ids), self.block_size
        pos = np.asarray(positions, dtype=np.int64).reshape(num_reqs)
        width = max(int(num_blocks.max()) if num_reqs else 0, 1)
        if width > self.max_blocks or np.any(pos // bs >= num_blocks):
            raise ValueError(
                f"decode rows need blocks for their positions, at most {self.max_blocks} each "
                f"(positions {pos.tolist()}, block counts {num_blocks.tolist()})"
            )
        if self._copied is not None:
            self._copied.synchronize()
        longs = self._host_longs_np[: 3 * bucket].reshape(3, bucket)
        ints = self._host_ints_np[: bucket * (1 + width)]
        seq_lens, table = ints[:bucket], ints[bucket:].reshape(bucket, width)
        table[:num_reqs] = block_table[:, :width]
        table[num_reqs:] = 0
        rows = np.arange(num_reqs)
        longs[:, num_reqs:] = 0
        longs[0, :num_reqs] = input_ids
        longs[1, :num_reqs] = pos
        longs[2, :num_reqs] = table[rows, pos // bs].astype(np.int64) * bs + pos % bs
        seq_lens[:num_reqs] = pos + 1
        seq_lens[num_reqs:] = 1
        self._upload(bucket, width)

    def _upload(self, bucket: int, width: int) -> None:
        num_longs, num_ints = 3 * bucket, bucket * (1 + width)
        self._longs[:num_longs].copy_(self._host_longs[:num_longs], non_blocking=True)
        landing = self._landing[:num_ints]
        landing.copy_(self._host_ints[:num_ints], non_blocking=True)
        self._seq_lens[:bucket].copy_(landing[:bucket])
        if width < self._table_width:  # keep every column past the widest row zero
            self._block_tables[:, width : self._table_width].zero_()
        self._table_width = width
        self._block_tables[:bucket, :width].copy_(landing[bucket:].view(bucket, width))
        if self._copied is not None:
            self._copied.record()
