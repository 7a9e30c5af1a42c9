"""Tensor-parallel layers: each rank holds a slice of a projection and the layers' collectives
make the ranks' outputs add up to the unsharded layer's.

    column-parallel  output rows split (q/k/v heads, gate | up, fc1): no communication
    row-parallel     input columns split (o_proj, down_proj, fc2): partial sums, one all-reduce
    vocab-parallel   embedding rows and LM-head rows split; lookups all-reduced, logits gathered

Each parameter's loader takes the whole checkpoint tensor, copies this rank's slice and returns
how many elements it copied (`load_weights` checks that every parameter was filled); quantized
weights are cut the same way (`quant_part`: a GGUF tensor's rows, or its input columns at whole
32-column blocks), and a row-parallel layer's int8 / fp8 codes are scaled by the max of the
whole row (`row_absmax`), so every rank holds the values one device holds. Splits
need not be even: ranks take whole KV-head groups (`head_partition`), so the embedded SmolLM2
(9 query heads in 3 groups) runs at TP=2 as 6 + 3 heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from kvflow.distributed.group import TPGroup
from kvflow.model import quant_kernels
from kvflow.model.layers import Embedding
from kvflow.model.linear import Linear, MergedLinear, linear
from kvflow.model.quant_format import QuantizedWeight


def split_evenly(total: int, parts: int, index: int) -> tuple[int, int]:
    """(start, count) of part `index` when `total` items are cut into `parts` contiguous runs
    whose sizes differ by at most one (the first `total % parts` runs get the extra one)."""
    base, extra = divmod(total, parts)
    return index * base + min(index, extra), base + (index < extra)


@dataclass(frozen=True)
class HeadShard:
    """A rank's attention heads: query heads [q_start, q_start + q_count) and KV heads
    [kv_start, kv_start + kv_count), every query head with its own KV head."""

    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


def head_partition(num_heads: int, num_kv_heads: int, world: int, rank: int) -> HeadShard:
    """Rank `rank`'s heads. With at least as many KV heads as ranks, the KV heads are split
    (as evenly as they go) and each takes its group of query heads. With fewer, each KV head is
    replicated on the ranks that share it, which split its group of query heads. Raises
    ValueError when some rank would get no query head."""
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} attention heads do not form {num_kv_heads} KV groups")
    group = num_heads // num_kv_heads
    if num_kv_heads >= world:
        kv_start, kv_count = split_evenly(num_kv_heads, world, rank)
        return HeadShard(kv_start * group, kv_count * group, kv_start, kv_count)
    kv_head = rank * num_kv_heads // world
    sharers = [r for r in range(world) if r * num_kv_heads // world == kv_head]
    if group < len(sharers):
        raise ValueError(
            f"tensor_parallel_size {world} is too large for {num_heads} attention heads in "
            f"{num_kv_heads} KV groups: every rank needs at least one query head"
        )
    q_start, q_count = split_evenly(group, len(sharers), sharers.index(rank))
    return HeadShard(kv_head * group + q_start, q_count, kv_head, 1)


def _copy_rows(param: nn.Parameter, loaded: torch.Tensor, start: int, count: int) -> int:
    """param[:count] = loaded[start : start + count], rows past the tensor's end zeroed (the
    vocabulary's padding); returns param's size: all of it is filled."""
    part = loaded[start : start + count]
    param.data[: part.shape[0]].copy_(part)
    if part.shape[0] < param.shape[0]:
        param.data[part.shape[0] :].zero_()
    return param.numel()


class ColumnParallelLinear(MergedLinear):
    """Output rows split: fused shard i of the checkpoint contributes rows
    [starts[i], starts[i] + counts[i]) of its own rows (shard_id None: one shard)."""

    def __init__(
        self, in_features: int, starts: list[int], counts: list[int], bias: bool = False
    ) -> None:
        super().__init__(in_features, counts, bias=bias)
        self.starts = list(starts)
        for param in self.parameters(recurse=False):
            param.weight_loader = self._load_part  # type: ignore[attr-defined]

    @classmethod
    def cut(cls, module: Linear, group: TPGroup) -> ColumnParallelLinear:
        """`module` (a Linear or MergedLinear, on any device) cut evenly by output rows."""
        sizes = getattr(module, "output_sizes", [module.out_features])
        parts = [split_evenly(size, group.world_size, group.rank) for size in sizes]
        starts, counts = [p[0] for p in parts], [p[1] for p in parts]
        return cls(module.in_features, starts, counts, module.bias is not None)

    def _load_part(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None
    ) -> int:
        shard = 0 if shard_id is None else shard_id
        offset = sum(self.output_sizes[:shard])
        target = param.data[offset : offset + self.output_sizes[shard]]
        return _copy_rows(target, loaded, self.starts[shard], self.output_sizes[shard])

    def quant_part(self, weight: QuantizedWeight, shard_id: int) -> QuantizedWeight:
        return weight.row_range(self.starts[shard_id], self.output_sizes[shard_id])


def qkv_parallel(module: MergedLinear, shard: HeadShard, head_dim: int) -> ColumnParallelLinear:
    """The fused q | k | v projection cut to this rank's query and KV heads."""
    q = (shard.q_start * head_dim, shard.q_count * head_dim)
    kv = (shard.kv_start * head_dim, shard.kv_count * head_dim)
    return ColumnParallelLinear(
        module.in_features, [q[0], kv[0], kv[0]], [q[1], kv[1], kv[1]], module.bias is not None
    )


class RowParallelLinear(Linear):
    """Input columns [start, start + count) of the checkpoint's weight; the ranks' partial
    products are all-reduced, then the bias (whole on every rank) is added once."""

    def __init__(
        self, start: int, count: int, out_features: int, bias: bool, group: TPGroup
    ) -> None:
        super().__init__(count, out_features, bias=bias)
        self.start = start
        self.group = group
        self.weight.weight_loader = self._load_columns  # type: ignore[attr-defined]

    @classmethod
    def cut(
        cls, module: Linear, group: TPGroup, columns: tuple[int, int] | None = None
    ) -> RowParallelLinear:
        """`module` cut by input columns: `columns` (start, count), else evenly."""
        start, count = columns or split_evenly(module.in_features, group.world_size, group.rank)
        return cls(start, count, module.out_features, module.bias is not None, group)

    def _load_columns(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None
    ) -> int:
        part = loaded[:, self.start : self.start + self.in_features]
        param.data.copy_(part)
        return part.numel()

    def quant_part(self, weight: QuantizedWeight, shard_id: int) -> QuantizedWeight:
        try:
            return weight.columns(self.start, self.in_features)
        except ValueError as e:
            raise ValueError(
                f"{e}, where tensor_parallel_size {self.group.world_size} splits its input "
                "(serve it with another --tensor-parallel-size or --quantization none)"
            ) from None

    def row_absmax(self) -> torch.Tensor:
        """The max over every rank's columns: one all-reduce (each rank calls it in turn)."""
        local = self.weight.abs().amax(dim=1).float().cpu()
        return self.group.all_reduce_max(local).to(self.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            partial = quant_kernels.apply(x, self.quant, None)
        else:
            partial = linear(x, self.weight, None, self.packed, self.native)
        out = self.group.all_reduce(partial)
        return out if self.bias is None else out + self.bias


def vocab_shard(vocab_size: int, group: TPGroup) -> tuple[int, int]:
    """(first row, rows per rank): the vocabulary padded to a multiple of the world size."""
    per_rank = -(-vocab_size // group.world_size)
    return group.rank * per_rank, per_rank


class VocabParallelEmbedding(Embedding):
    """Rows [start, start + per_rank) of the table (zero past the vocabulary); a token looked up
    on another rank reads zeros here, and the all-reduce sums the one real row."""

    def __init__(self, vocab_size: int, dim: int, group: TPGroup) -> None:
        self.vocab_start, per_rank = vocab_shard(vocab_size, group)
        super().__init__(per_rank, dim)
        self.group = group
        self.weight.weight_loader = self._load_rows  # type: ignore[attr-defined]

    def _load_rows(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None
    ) -> int:
        return _copy_rows(param, loaded, self.vocab_start, self.num_embeddings)

    def quant_part(self, weight: QuantizedWeight, shard_id: int) -> QuantizedWeight:
        return weight.row_range(self.vocab_start, self.num_embeddings)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = super().forward(local.masked_fill(outside, 0))  # quantized rows where quantized
        return self.group.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0))


class ParallelLMHead(Linear):
    """An untied LM head's rows [start, start + per_rank) (zero past the vocabulary)."""

    def __init__(self, hidden: int, vocab_size: int, group: TPGroup) -> None:
        self.vocab_start, per_rank = vocab_shard(vocab_size, group)
        super().__init__(hidden, per_rank)
        self.weight.weight_loader = self._load_rows  # type: ignore[attr-defined]

    def _load_rows(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None
    ) -> int:
        return _copy_rows(param, loaded, self.vocab_start, self.out_features)

    def quant_part(self, weight: QuantizedWeight, shard_id: int) -> QuantizedWeight:
        return weight.row_range(self.vocab_start, self.out_features)
