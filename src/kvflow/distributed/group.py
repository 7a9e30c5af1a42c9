"""A tensor-parallel rank's process groups and the collectives the parallel layers call.

`TPGroup` is passed to every parallel layer explicitly (no global "current group"). With one
rank its collectives return their input, so a layer built for TP=1 runs unchanged. Two groups
exist per rank when there is more than one:

    device group  NCCL on CUDA, gloo on the CPU: the all-reduces and all-gathers of the forward
    cpu group     gloo always: each step's SchedulerOutput, broadcast from rank 0 as pickled bytes
"""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class TPGroup:
    rank: int = 0
    world_size: int = 1
    device_group: Any = None
    cpu_group: Any = None
    # seconds and calls in this rank's collectives since `take_timers` (benchmarks read them;
    # on CUDA the seconds are those of queueing, not of the transfer)
    timers: dict[str, float] = field(default_factory=dict)

    def _time(self, name: str, start: float) -> None:
        self.timers[name] = self.timers.get(name, 0.0) + time.perf_counter() - start
        self.timers[name + "_calls"] = self.timers.get(name + "_calls", 0) + 1

    def take_timers(self) -> dict[str, float]:
        timers, self.timers = self.timers, {}
        return timers

    @classmethod
    def init(
        cls, rank: int, world_size: int, init_method: str, device: str, timeout_s: float = 600.0
    ) -> TPGroup:
        """Join the rendezvous at `init_method` (tcp://host:port, rank 0 hosts it). Raises
        (torch's DistNetworkError / RuntimeError) when a peer does not come within `timeout_s`."""
        backend = "nccl" if device.startswith("cuda") else "gloo"
        timeout = timedelta(seconds=timeout_s)
        dist.init_process_group(
            backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout
        )
        world = list(range(world_size))
        cpu = dist.new_group(world, backend="gloo", timeout=timeout) if backend == "nccl" else None
        return cls(rank, world_size, dist.group.WORLD, cpu or dist.group.WORLD)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the ranks, in place, in x's dtype (gloo and NCCL both reduce
        bf16)."""
        if self.world_size > 1:
            start = time.perf_counter()
            dist.all_reduce(x, group=self.device_group)
            self._time("all_reduce", start)
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` (same shape on all) concatenated along the last dim, rank order."""
        if self.world_size == 1:
            return x
        start = time.perf_counter()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        self._time("all_gather", start)
        return torch.cat(parts, dim=-1)

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (others pass None), pickled over the gloo CPU group:
        one broadcast of the length, one of the bytes."""
        if self.world_size == 1:
            return obj
        start = time.perf_counter()
        if self.rank == 0:
            data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            size = torch.tensor([len(data)], dtype=torch.int64)
        else:
            size = torch.zeros(1, dtype=torch.int64)
        dist.broadcast(size, src=0, group=self.cpu_group)
        if self.rank == 0:
            buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        else:
            buf = torch.empty(int(size.item()), dtype=torch.uint8)
        dist.broadcast(buf, src=0, group=self.cpu_group)
        self._time("broadcast", start)
        return obj if self.rank == 0 else pickle.loads(buf.numpy().tobytes())

    def all_reduce_min(self, value: int) -> int:
        """The smallest of the ranks' `value` (the KV pool's block count)."""
        if self.world_size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.cpu_group)
        return int(t.item())

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise largest of the ranks' `x` (a CPU tensor), in place, over the gloo
        CPU group (start-up: a row-parallel layer's row maxima)."""
        if self.world_size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.cpu_group)
        return x

    def destroy(self) -> None:
        if self.world_size > 1 and dist.is_initialized():
            dist.destroy_process_group()
