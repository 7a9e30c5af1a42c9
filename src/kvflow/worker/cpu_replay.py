"""Decode steps on the CPU replayed as recorded native kernel calls.

A decode step of the embedded model at batch 1 spends about a quarter of its time in Python
around the layers' ~270 kernel calls (modules, wrappers, their checks: benchmarks/RESULTS.md).
With the native kernels, the Llama family's layers at a decode step are kernel calls and tensor
views only (`LlamaModel.run_layers`), and every argument of those calls is an address or a size
fixed by the batch size: the step's values (tokens, positions, block tables, context lengths)
reach the kernels through tensors. So, per batch size B up to `MAX_BATCH`:

- the first decode step at B runs the layers eagerly over static inputs (`DecodeGraphs`'s
  buffers, sized exactly B: no padding rows) while `record` notes every kernel call (the
  function and its arguments) and keeps every tensor the forward allocates; those tensors
  then move into one arena that all batch sizes share (a step runs one size at a time), each
  call's addresses inside them rewritten as offsets into it (`Recording.relocate`);
- every later step at B copies its embeddings and rotary rows into those inputs and issues the
  same calls (`Recording.replay`), then the head and the sampler run as before.

The guard: a torch dispatch mode sees every torch op of the recorded forward, and anything but
an allocation or a view (an op that computes, which a replay would skip) makes the recording
unusable: that step runs eagerly, and after RECORD_TRIES refusals every step at B does
(logged once). Every kernel a library exposes is
bound (its argtypes set) when the library loads (kernels/cpu/build.py, quant.py); `record`
wraps each bound `kvflow_*` function of both libraries for the capturing thread only.

Replay is bitwise the eager step: the same kernels, in the same order, on the same shapes.
Memory: the arena holds one step's intermediate tensors at the largest batch size recorded
(about 17 MB for the embedded model at 32 rows), plus each size's static inputs.
"""

from __future__ import annotations

import bisect
import contextlib
import ctypes
import importlib
import logging
import threading
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvflow.attention.metadata import AttentionMetadata
from kvflow.kernels.cpu import build, quant
from kvflow.worker.cuda_graphs import DecodeGraphs

logger = logging.getLogger("kvflow.engine")

MAX_BATCH = 32  # decode batch sizes replayed; past it a step is bound by its kernels
# recordings a batch size gets before it stays eager: a one-time torch op (a value computed on
# first use, as QuantizedWeight.has_mins) refuses only the step it runs in
RECORD_TRIES = 3
_ALLOCATIONS = {
    torch.ops.aten.empty.memory_format,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.new_empty.default,
    torch.ops.aten.empty_strided.default,
}


_RECORDING = threading.Lock()  # engines in one process record in turn


class ComputeOpError(RuntimeError):
    """A torch op that computes ran inside a recorded forward."""


@dataclass
class Recording:
    """One batch size's layers as recorded: the static `inputs` they read, the kernel calls,
    and while recording the tensors those calls address (`keep`). `relocate` notes the calls'
    addresses as offsets into an arena every batch size shares; `bind` points them (and `out`,
    the final hidden states) into one."""

    inputs: tuple[torch.Tensor, ...]
    calls: list[tuple[Callable, tuple]] = field(default_factory=list)
    keep: list[torch.Tensor] = field(default_factory=list)
    out: torch.Tensor | None = None
    # per call, its arguments with every address inside a kept tensor as an _ArenaOffset
    _symbolic: list[tuple[Callable, tuple]] = field(default_factory=list)
    _out_at: tuple[int, torch.Size, torch.dtype] | None = None  # offset, shape, dtype

    def replay(self, inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        for static, value in zip(self.inputs, inputs, strict=True):
            static.copy_(value)
        for kernel, args in self.calls:
            kernel(*args)
        return self.out

    def relocate(self, out: torch.Tensor) -> int:
        """Lay the kept tensors out one after another (64-byte aligned), note each call's
        addresses inside them (and `out`'s) as offsets into that layout, and let the kept
        tensors go; returns the layout's bytes. The calls run again once `bind` places them."""
        spans, size = [], 0
        for t in self.keep:
            storage = t.untyped_storage()
            spans.append((storage.data_ptr(), storage.nbytes(), size))
            size += -(-storage.nbytes() // 64) * 64
        spans.sort()
        starts = [start for start, _, _ in spans]

        def symbolic(arg):
            if isinstance(arg, int) and not isinstance(arg, bool):
                i = bisect.bisect_right(starts, arg) - 1
                if i >= 0 and arg < spans[i][0] + max(spans[i][1], 1):
                    return _ArenaOffset(spans[i][2] + arg - spans[i][0])
            return arg

        self._symbolic = [(k, tuple(symbolic(a) for a in args)) for k, args in self.calls]
        offset = symbolic(out.data_ptr())
        assert isinstance(offset, _ArenaOffset), "the output is allocated by the forward"
        self._out_at = (offset.bytes, out.shape, out.dtype)
        self.keep, self.calls, self.out = [], [], None
        return size

    def bind(self, arena: torch.Tensor) -> None:
        """The calls' addresses and `out` in `arena` (uint8, at least the layout's bytes)."""
        base = arena.data_ptr()
        self.calls = [
            (k, tuple(base + a.bytes if isinstance(a, _ArenaOffset) else a for a in args))
            for k, args in self._symbolic
        ]
        start, shape, dtype = self._out_at
        nbytes = shape.numel() * dtype.itemsize
        self.out = arena[start : start + nbytes].view(dtype).view(shape)


@dataclass(frozen=True)
class _ArenaOffset:
    bytes: int


class _Guard(TorchDispatchMode):
    """Keeps every tensor an allocation makes; refuses any op but allocations and views."""

    def __init__(self, keep: list[torch.Tensor]) -> None:
        super().__init__()
        self.keep = keep

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in _ALLOCATIONS:
            self.keep.append(out)
            return out
        if not func.is_view:
            raise ComputeOpError(f"{func} computes")
        try:  # a view op may still copy (reshape, to): its output must share an input's memory
            sources = {t.untyped_storage().data_ptr() for t in _tensors(args, kwargs)}
            outs = [t.untyped_storage().data_ptr() for t in _tensors((out,), None)]
        except NotImplementedError as e:  # oneDNN's packed (opaque) tensors have no storage
            raise ComputeOpError(f"{func} on a tensor without storage") from e
        if any(ptr not in sources for ptr in outs):
            raise ComputeOpError(f"{func} computes")
        return out


def _tensors(args, kwargs) -> Iterator[torch.Tensor]:
    for a in [*args, *(kwargs or {}).values()]:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, list | tuple):
            yield from _tensors(a, None)


def _bound_kernels() -> Iterator[tuple[ctypes.CDLL, str, Callable]]:
    for lib in (build.library(), quant.library()):
        if lib is None:
            continue
        for name, kernel in list(vars(lib).items()):
            if name.startswith("kvflow_") and callable(kernel):
                yield lib, name, kernel


@contextlib.contextmanager
def record(recording: Recording) -> Iterator[None]:
    """Within the block, this thread's native kernel calls run and are appended to
    `recording.calls`; its torch ops must be allocations (kept) or views (`_Guard`)."""
    me = threading.get_ident()

    def recorder(kernel: Callable) -> Callable:
        def call(*args):
            if threading.get_ident() == me:
                recording.calls.append((kernel, args))
            return kernel(*args)

        return call

    with _RECORDING:  # one at a time: each wraps the kernels as it found them, then restores
        bound = list(_bound_kernels())
        for lib, name, kernel in bound:
            setattr(lib, name, recorder(kernel))
        try:
            with _Guard(recording.keep):
                yield
        finally:
            for lib, name, kernel in bound:
                setattr(lib, name, kernel)


class CpuDecodeReplay(DecodeGraphs):
    """`DecodeGraphs` on the CPU at exact batch sizes 1..MAX_BATCH, the layers replayed."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[torch.Tensor],
        block_size: int,
        max_model_len: int,
        max_num_seqs: int,
    ) -> None:
        cap = max(1, min(max_num_seqs, MAX_BATCH))
        super().__init__(model, kv_caches, block_size, max_model_len, cap, "cpu", capture=False)
        self.buckets = list(range(1, cap + 1))
        self._recordings: dict[int, Recording | None] = {}  # batch size -> None: runs eagerly
        self.refusals: Counter[int] = Counter()  # batch size -> recordings refused
        # the recordings' intermediate tensors: one step runs at a time, so they share it
        self._arena = torch.empty(0, dtype=torch.uint8)
        # The guard's dispatch mode imports torch._dynamo on first use (0.6-0.9 s): at start-up,
        # not inside the first request's first decode step.
        importlib.import_module("torch._dynamo")

    @staticmethod
    def applies(model: torch.nn.Module, dtype: torch.dtype) -> bool:
        """Whether `model` splits its forward as `run_layers` needs and its layers may run on
        the native kernels alone (bf16, the kernels loaded)."""
        inner = getattr(model, "model", None)
        has_parts = hasattr(inner, "embed") and hasattr(inner, "run_layers")
        return has_parts and dtype == torch.bfloat16 and build.native_available()

    @property
    def arena_bytes(self) -> int:
        return self._arena.numel()

    def _hidden(self, bucket: int, meta: AttentionMetadata) -> torch.Tensor:
        ids, positions = self._longs[: 2 * bucket].view(2, bucket).unbind(0)
        layers = self.model.model
        inputs = layers.embed(ids, positions)
        if bucket not in self._recordings:
            return self._record(bucket, inputs, meta)
        recording = self._recordings[bucket]
        if recording is None:
            return layers.run_layers(inputs, self.kv_caches, meta)
        return recording.replay(inputs)

    def _record(self, bucket: int, inputs: tuple, meta: AttentionMetadata) -> torch.Tensor:
        """Run the layers at `bucket` rows over copies of `inputs` kept as the static inputs,
        recording their kernel calls, then move what they address into the arena; a refused
        recording leaves the step eager (and, the RECORD_TRIES-th time, the size)."""
        recording = Recording(tuple(t.clone() for t in inputs))
        try:
            with record(recording):
                out = self.model.model.run_layers(recording.inputs, self.kv_caches, meta)
        except ComputeOpError as e:
            self.refusals[bucket] += 1
            if self.refusals[bucket] == RECORD_TRIES:
                logger.info(
                    "decode batch %d runs eagerly: its layers run torch ops (%s)", bucket, e
                )
                self._recordings[bucket] = None
            return self.model.model.run_layers(inputs, self.kv_caches, meta)
        size = recording.relocate(out)
        self._recordings[bucket] = recording
        rebind = [recording]
        if size > self._arena.numel():  # every recording's addresses move to the larger one
            self._arena = torch.empty(size, dtype=torch.uint8)
            rebind = [r for r in self._recordings.values() if r is not None]
        for r in rebind:
            r.bind(self._arena)
        return out
