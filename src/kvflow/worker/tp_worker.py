"""One tensor-parallel rank: loads its shard, sizes and allocates its KV cache (its own KV
heads; the pool's block count is the minimum over the ranks) and runs a ModelRunner on each
step's SchedulerOutput.

Rank 0 takes the steps from its executor and broadcasts each to the other ranks over the gloo
CPU group (`TPGroup.broadcast_object`); every rank runs the same step (same collectives in the
same order) and samples from the same gathered logits with the same seeds, and rank 0 sends its
output back. Rank 0's messages (the executor's `ctl` callable answers them):

    start-up   ("ready", RankLoaded's fields as a dict) from every rank, or ("error", traceback)
               and exit 1
    a step     ("step", SchedulerOutput) -> ("output", ModelRunnerOutput) | ("error", traceback)
    the end    ("stop",): broadcast as None, every rank leaves its loop and exits 0

A rank whose parent process goes away exits within `ORPHAN_POLL_S` (no orphan outlives the
process that started it, even after a SIGKILL of that process).
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
from dataclasses import asdict, dataclass
from typing import Any

logger = logging.getLogger("kvflow.worker")

ORPHAN_POLL_S = 0.5
GIB = 1 << 30


@dataclass(frozen=True)
class RankSpec:
    """What a rank needs to start: plain values only (it crosses a process boundary)."""

    world_size: int
    init_method: str  # tcp://127.0.0.1:PORT; rank 0 hosts the store
    model_path: str
    dtype: str  # float32 | bfloat16 | float16
    device: str  # cpu | cuda
    block_size: int
    num_blocks: int | None
    kv_cache_memory: int | None  # bytes per rank
    gpu_memory_utilization: float
    max_num_batched_tokens: int
    max_num_seqs: int
    seed: int
    eos_token_id: int | None
    threads: int | None  # torch threads per rank; None: the CPUs divided by the ranks
    quantization: str = "none"  # resolved --quantization (model/quantize.py's METHODS)


@dataclass(frozen=True)
class RankLoaded:
    """What a rank reports once loaded: the pool's block count (the minimum over the ranks)
    and its quantized weights' bytes with the bytes of the weights they replace (0, 0
    without --quantization)."""

    num_blocks: int
    quantized_bytes: int
    replaced_bytes: int


def watch_parent(parent_pid: int) -> None:
    """Exit this process (status 1, at once) when its parent is gone."""

    def poll() -> None:
        while os.getppid() == parent_pid:
            time.sleep(ORPHAN_POLL_S)
        os._exit(1)

    threading.Thread(target=poll, name="kvflow-orphan-watch", daemon=True).start()


def rank_device(spec: RankSpec, rank: int) -> str:
    """cuda:RANK when this process sees every card (mp), else cuda:0 (a Ray actor sees the
    one card of its bundle); the CPU for the CPU."""
    if not spec.device.startswith("cuda"):
        return "cpu"
    import torch

    return f"cuda:{rank if rank < torch.cuda.device_count() else 0}"


class RankWorker:
    def __init__(self, spec: RankSpec, rank: int) -> None:
        import torch

        from kvflow.distributed.group import TPGroup
        from kvflow.structured.wire import GrammarReceiver

        self.spec, self.rank = spec, rank
        self.device = rank_device(spec, rank)
        threads = spec.threads or max(1, (os.cpu_count() or 1) // spec.world_size)
        if self.device == "cpu":
            torch.set_num_threads(threads)
        else:
            torch.cuda.set_device(self.device)
        torch.manual_seed(spec.seed)
        self.group = TPGroup.init(rank, spec.world_size, spec.init_method, self.device)
        self.runner: Any = None
        self.grammars = GrammarReceiver()

    def load(self) -> RankLoaded:
        """Load the shard, size and allocate the KV cache."""
        import torch

        from kvflow.model.loader import resolve_dtype
        from kvflow.model.tensor_parallel import kv_cache_shape_for_rank, load_shard
        from kvflow.worker.builder import attention_backend
        from kvflow.worker.model_runner import ModelRunner

        spec, device = self.spec, self.device
        dtype = resolve_dtype(spec.dtype, None, device)
        backend = attention_backend(device)
        model, hf_config, quantized = load_shard(
            spec.model_path, dtype, device, self.group, backend, spec.quantization
        )
        if device == "cpu":
            from kvflow.kernels.cpu.build import native_available
            from kvflow.kernels.cpu.host_memory import keep_freed_memory
            from kvflow.model.linear import prepack_for_cpu

            keep_freed_memory()
            prepack_for_cpu(model.inner)
            native_available()
        layers, kv_heads, head_dim = kv_cache_shape_for_rank(hf_config, self.group)
        per_block = 2 * layers * spec.block_size * kv_heads * head_dim * dtype.itemsize
        num_blocks = self.group.all_reduce_min(self._own_blocks(model, hf_config, per_block))
        shape = (2, num_blocks, spec.block_size, kv_heads, head_dim)
        kv_caches = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.runner = ModelRunner(
            model, kv_caches, spec.block_size, hf_config.vocab_size, spec.eos_token_id, device
        )
        # every rank's generator in the same state: their samplers draw the same tokens
        torch.manual_seed(spec.seed)
        return RankLoaded(num_blocks, *quantized)

    def _own_blocks(self, model: Any, hf_config: Any, per_block: int) -> int:
        """What this rank's memory allows: --num-blocks, else --kv-cache-memory (per rank, as
        vLLM's CPU KV-cache space is per worker), else the CPU default, or on CUDA what
        --gpu-memory-utilization leaves after the weights and one profiled step."""
        spec = self.spec
        if spec.num_blocks is not None:
            return spec.num_blocks
        if spec.kv_cache_memory is not None:
            return spec.kv_cache_memory // per_block
        if self.device == "cpu":
            from kvflow.worker.builder import cpu_kv_cache_memory

            return cpu_kv_cache_memory() // per_block
        import copy

        import torch

        from kvflow.model.tensor_parallel import kv_cache_shape_for_rank
        from kvflow.worker.builder import profile_step

        rank_config = copy.copy(hf_config)  # its throwaway KV cache: this rank's KV heads
        rank_config.num_key_value_heads = kv_cache_shape_for_rank(hf_config, self.group)[1]
        step = profile_step(
            model,
            rank_config,
            spec.max_num_batched_tokens,
            spec.max_num_seqs,
            spec.block_size,
            next(model.parameters()).dtype,
        )
        _, total = torch.cuda.mem_get_info()
        return max(int(total * spec.gpu_memory_utilization) - step, 0) // per_block

    def step(self, sched: Any) -> Any:
        """Run one step as the executor sent it (its grammars as `structured.wire` sends
        them)."""
        return self.runner.launch(self.grammars.decode(sched))()

    def follow(self) -> None:
        """A rank other than 0: run every broadcast step until the broadcast of None."""
        while (sched := self.group.broadcast_object()) is not None:
            self.step(sched)

    def lead(self, ctl: Any) -> None:
        """Rank 0: run the executor's steps (`ctl()` -> message, `ctl(reply)` sends) and
        broadcast each to the others, until ("stop",)."""
        while True:
            message = ctl()
            if message[0] == "timers":
                ctl(("timers", self.group.take_timers()))
                continue
            if message[0] != "step":
                self.group.broadcast_object(None)
                return
            sched = self.group.broadcast_object(message[1])
            try:
                start = time.perf_counter()
                output = self.step(sched)
                self.group.timers["step"] = self.group.timers.get("step", 0.0)
                self.group.timers["step"] += time.perf_counter() - start
                ctl(("output", output))
            except Exception:
                ctl(("error", traceback.format_exc()))
                raise


def fault_at_start(rank: int) -> None:
    """$KVFLOW_FAULT rankfail:R: rank R fails its start-up (the liveness tests' case)."""
    from kvflow.worker.faults import FaultPlan

    plan = FaultPlan.from_env()
    if plan is not None and plan.fail_rank == rank:
        raise RuntimeError(f"injected start-up failure of rank {rank} (KVFLOW_FAULT rankfail)")


def run_rank(spec: RankSpec, rank: int, ctl: Any) -> None:
    """A rank's whole life: start-up, then steps until stopped. `ctl()` receives from the
    executor and `ctl(message)` sends to it. Reports a failure as ("error", traceback) and
    re-raises it."""
    try:
        fault_at_start(rank)
        worker = RankWorker(spec, rank)
        ctl(("ready", asdict(worker.load())))  # plain: this module is __main__
    except BaseException:
        ctl(("error", traceback.format_exc()))
        raise
    if rank == 0:
        worker.lead(ctl)
    else:
        worker.follow()
    worker.group.destroy()


def main(argv: list[str] | None = None) -> None:
    """`python -m kvflow.worker.tp_worker --rank R --fd FD --parent PID`: a rank process
    started by `MultiprocExecutor`, talking to it over the socket FD (a multiprocessing
    Connection; the first message is the RankSpec). Exits 0 when stopped, 1 on a failure."""
    import argparse
    from multiprocessing.connection import Connection

    parser = argparse.ArgumentParser(prog="kvflow.worker.tp_worker")
    for flag in ("--rank", "--fd", "--parent"):
        parser.add_argument(flag, type=int, required=True)
    args = parser.parse_args(argv)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the process that started it ends it
    watch_parent(args.parent)
    logging.basicConfig(level=logging.WARNING, format=f"rank {args.rank} %(levelname)s %(message)s")
    conn = Connection(args.fd)

    def ctl(message: Any = None) -> Any:
        if message is None:
            return conn.recv()
        conn.send(message)
        return None

    try:
        run_rank(conn.recv(), args.rank, ctl)
    except BaseException:
        os._exit(1)
    os._exit(0)


if __name__ == "__main__":
    main()
