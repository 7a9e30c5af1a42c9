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
unusable: B then runs eagerly from then on (logged once). Every kernel a library exposes is
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
import logging
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from kvflow.attention.metadata import AttentionMetadata
from kvflow.kernels.cpu import build, quant
from kvflow.worker.cuda_graphs import DecodeGraphs

logger = logging.getLogger("kvflow.engine")

MAX_BATCH = 32  # decode batch sizes replayed; past it a step is bound by its kernels
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
    """Kernel calls with the tensors they address (`keep`), as recorded; `relocate` moves
    those tensors into an arena that every batch size's recording shares."""

    calls: list[tuple[Callable, tuple]] = field(default_factory=list)
    keep: list[torch.Tensor] = field(default_factory=list)
    # per call, its arguments with every address inside a kept tensor as an _ArenaOffset
    _symbolic: list[tuple[Callable, tuple]] = field(default_factory=list)

    def replay(self) -> None:
        for kernel, args in self.calls:
            kernel(*args)

    def relocate(self, out: torch.Tensor) -> tuple[int, Callable[[torch.Tensor], torch.Tensor]]:
        """Lay the kept tensors out one after another (64-byte aligned) and note each call's
        addresses as offsets into that layout; returns (the layout's bytes, a function from an
        arena to `out`'s view in it). The kept tensors go: `bind` gives the calls addresses."""
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
        shape, dtype = out.shape, out.dtype
        self.keep, self.calls = [], []

        def view(arena: torch.Tensor) -> torch.Tensor:
            start = offset.bytes
            return arena[start : start + out.nbytes].view(dtype).view(shape)

        return size, view

    def bind(self, arena: torch.Tensor) -> None:
        """The calls' addresses in `arena` (uint8, at least the layout's bytes)."""
        base = arena.data_ptr()
        self.calls = [
            (k, tuple(base + a.bytes if isinstance(a, _ArenaOffset) else a for a in args))
            for k, args in self._symbolic
        ]


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
        # batch size -> (static inputs, the recording, the output's view); None: runs eagerly
        self._recordings: dict[int, tuple[tuple, Recording, torch.Tensor] | None] = {}
        # the recordings' intermediate tensors: one step runs at a time, so they share it
        self._arena = torch.empty(0, dtype=torch.uint8)
        self._views: dict[int, Callable[[torch.Tensor], torch.Tensor]] = {}

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
        entry = self._recordings[bucket]
        if entry is None:
            return layers.run_layers(inputs, self.kv_caches, meta)
        statics, recording, out = entry
        for static, value in zip(statics, inputs, strict=True):
            static.copy_(value)
        recording.replay()
        return out

    def _record(self, bucket: int, inputs: tuple, meta: AttentionMetadata) -> torch.Tensor:
        """Run the layers at `bucket` rows over copies of `inputs` kept as the static inputs,
        recording their kernel calls, then move what they address into the arena; a refused
        recording leaves the size eager."""
        statics = tuple(t.clone() for t in inputs)
        recording = Recording()
        try:
            with record(recording):
                out = self.model.model.run_layers(statics, self.kv_caches, meta)
        except ComputeOpError as e:
            logger.info("decode batch %d runs eagerly: its layers run torch ops (%s)", bucket, e)
            self._recordings[bucket] = None
            return self.model.model.run_layers(inputs, self.kv_caches, meta)
        size, self._views[bucket] = recording.relocate(out)
        self._recordings[bucket] = (statics, recording, out)
        if size > self._arena.numel():  # every recording's addresses move to the larger one
            self._arena = torch.empty(size, dtype=torch.uint8)
            for b, entry in self._recordings.items():
                if entry is not None:
                    entry[1].bind(self._arena)
                    self._recordings[b] = (entry[0], entry[1], self._views[b](self._arena))
        else:
            recording.bind(self._arena)
            self._recordings[bucket] = (statics, recording, self._views[bucket](self._arena))
        return out
