"""Linear layers: weight loaders, the fused Linear/MergedLinear, and the one place that picks each
projection's kernel (`linear`): native CPU kernel, oneDNN, Triton's one-row `gemv` or torch."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.kernels import tuning
from kvflow.kernels.cpu.linear import bf16_linear, pack_linear_weight
from kvflow.kernels.cpu.onednn import onednn_linear, pack_weight
from kvflow.kernels.select import fused_ops, one_row_ops
from kvflow.model import quant_kernels
from kvflow.model.quant_format import QuantizedWeight

logger = logging.getLogger(__name__)

WeightLoader = Callable[..., None]


def default_weight_loader(
    param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None
) -> None:
    """Copy a whole checkpoint tensor into `param` (shapes must match exactly)."""
    if shard_id is not None:
        raise ValueError(f"parameter of shape {tuple(param.shape)} is not fused (shard {shard_id})")
    if param.shape != loaded.shape:
        raise ValueError(
            f"shape mismatch: parameter {tuple(param.shape)}, checkpoint {tuple(loaded.shape)}"
        )
    param.data.copy_(loaded)


def attach_loaders(module: nn.Module, loader: WeightLoader) -> None:
    for param in module.parameters(recurse=False):
        param.weight_loader = loader  # type: ignore[attr-defined]


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    packed: torch.Tensor | None,
    native: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, in] @ weight.T (+ bias): small batches through the native kernel's packed weight
    when there is one (bound by reading the weight once), larger ones through oneDNN's
    pre-packed weight (faster once the matmul is compute-bound), one row on CUDA through
    Triton's `gemv` where it beats cuBLAS, else F.linear."""
    if native is not None and x.shape[0] <= tuning.native_linear_max_rows():
        return bf16_linear(x, native, bias, weight.shape[0])
    if packed is not None:
        return onednn_linear(x, packed, bias)
    ops = one_row_ops(x)
    if ops is not None:

        def gemv() -> torch.Tensor:
            return ops.gemv(x, weight, bias)

        if tuning.gemv_wins("linear", x, weight, bias, gemv, lambda: F.linear(x, weight, bias)):
            return gemv()
    return F.linear(x, weight, bias)


def logits_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    packed: torch.Tensor | None,
    native: torch.Tensor | None,
    quant: quant_kernels.Quantized | None = None,
    float32: bool = True,
) -> torch.Tensor:
    """float32 logits of hidden rows x [N, hidden] by the head's weight [vocab, hidden].

    On the CPU the products are summed in float32 and never rounded to the model's dtype: a
    bf16 logit of about 16 moves in steps of 0.125, so two tokens closer than that come out
    level and the argmax takes the lower id (the headline question's "The" against "L"). So
    bf16 rows take the native kernel's float32 output at every row count, a quantized head
    the int8 kernel's float32 sums for a few rows, else the float32 activations' kernel
    (`quant_kernels.logits`). On CUDA: `linear` in the model's dtype
    (a decode row's one-row kernel stores float32 where it wins), then float32 unless
    `float32` is False (for a reader that widens only the rows it needs)."""
    if quant is not None:  # the head's quantized weight (`model.quantize`); `weight` shapes it
        out = quant_kernels.logits(x, quant)
        return out.float() if float32 else out
    ops = one_row_ops(x)
    if ops is not None:

        def gemv() -> torch.Tensor:
            return ops.gemv(x, weight, None, out_dtype=torch.float32)

        if tuning.gemv_wins("logits", x, weight, None, gemv, lambda: F.linear(x, weight).float()):
            return gemv()
    if x.device.type == "cpu" and x.dtype == torch.bfloat16:
        if native is not None:
            return bf16_linear(x, native, None, weight.shape[0], out_dtype=torch.float32)
        return F.linear(x.float(), weight.float())
    out = linear(x, weight, None, packed, native)
    return out.float() if float32 else out


def prepack_for_cpu(model: nn.Module) -> int:
    """Pack every Linear's weight (and the logits head's) for oneDNN and for the native kernel
    (each where it applies); returns how many weights got a oneDNN packing.

    A Linear whose weight got both packings, or the native one where it takes every row count,
    never reads the weight again (`linear` takes a packing), so it lets the weight go
    (`_release_weight`): three copies of every weight came to 0.8 GB for a 135M-parameter model,
    and on a CPU without oneDNN's packing the weight beside the native packing doubled a 1B
    model's bf16 (2.66 GiB loaded, 5.02 packed). The logits head's bf16 rows take the native
    kernel at every row count (`logits_linear`), so the head gets no oneDNN packing and lets
    its weight go too: an untied head is such a Linear; a head tied to the embedding hands its
    packing to the embedding, whose lookups read their rows from it (`packed_rows`), so the
    table is held once (0.49 GiB less for a 1B model's 128k vocabulary)."""
    head = model.logits_weight() if hasattr(model, "logits_weight") else None
    count = 0
    # without a oneDNN packing (no fast bf16 matmul in oneDNN here) the native kernel takes
    # every row count, so its packing alone is read
    native_for_every_row = tuning.native_linear_max_rows() >= tuning.EVERY_ROW
    if getattr(model, "head_quant", None) is not None:
        head = None  # the quantized head needs no packing
    for module in model.modules():
        if not isinstance(module, Linear) or module.quant is not None:
            continue
        is_head = module.weight is head
        module.native = pack_linear_weight(module.weight)
        if not (is_head and module.native is not None):
            module.packed = pack_weight(module.weight)
        count += module.packed is not None
        if is_head:  # untied: the head's packings are this module's
            model.head_packed, model.head_native, head = module.packed, module.native, None
        if module.native is not None and (
            module.packed is not None or native_for_every_row or is_head
        ):
            _release_weight(module)
    if head is not None:  # tied to the embedding
        model.head_native = pack_linear_weight(head)
        if model.head_native is None:
            model.head_packed = pack_weight(head)
            count += model.head_packed is not None
        else:
            table = next(m for m in model.modules() if getattr(m, "weight", None) is head)
            table.native = model.head_native
            _release_weight(table)
    log_linear_paths(model)
    return count


def log_linear_paths(model: nn.Module) -> None:
    """One log line per weight shape of the CPU model's Linear layers: the kernel `linear`
    takes for it by rows (on CUDA, `tuning.gemv_wins` logs each one-row choice as it times it)."""
    shapes: dict[tuple[int, int], tuple[bool, bool]] = {}
    for module in model.modules():
        if isinstance(module, Linear):
            key = (module.out_features, module.in_features)
            shapes.setdefault(key, (module.native is not None, module.packed is not None))
    max_rows = tuning.native_linear_max_rows() if any(n for n, _ in shapes.values()) else 0
    for (out_features, in_features), (native, packed) in sorted(shapes.items()):
        rest = "oneDNN's packed matmul" if packed else "torch's F.linear"
        path = f"native kernel up to {max_rows} rows, {rest} above" if native else rest
        if native and max_rows >= tuning.EVERY_ROW:  # no oneDNN packing to hand over to
            path = "native kernel"
        logger.info("linear %d -> %d: %s", in_features, out_features, path)


def _release_weight(module: nn.Module) -> None:
    """Swap `module.weight` for a placeholder of the same shape and dtype that holds one element
    (a zero expanded, never read): `linear` still takes the output size from its shape."""
    weight = module.weight
    del module.weight  # the Parameter goes; a plain tensor attribute takes its name
    module.weight = weight.new_zeros(()).expand(weight.shape)


class Linear(nn.Linear):
    """nn.Linear without random init; its parameters load whole checkpoint tensors."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias=bias)
        attach_loaders(self, default_weight_loader)
        self.packed: torch.Tensor | None = None  # set by prepack_for_cpu
        self.native: torch.Tensor | None = None  # set by prepack_for_cpu
        self.quant: quant_kernels.Quantized | None = None  # set by model.quantize

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return quant_kernels.apply(x, self.quant, self.bias)
        return linear(x, self.weight, self.bias, self.packed, self.native)

    def quant_part(self, weight: QuantizedWeight, shard_id: int) -> QuantizedWeight:
        """What this layer holds of fused shard `shard_id` of a checkpoint's quantized weight:
        all of it (a tensor-parallel layer's slice: `parallel_layers`)."""
        return weight

    def row_absmax(self) -> torch.Tensor | None:
        """Each output row's max |w| over the checkpoint's whole row, where this layer holds
        only some of the row's columns (a row-parallel shard); None: it holds whole rows."""
        return None

    def reset_parameters(self) -> None:
        """Left uninitialised on purpose: the loader overwrites every parameter."""


class MergedLinear(Linear):
    """Several projections of the same input fused along the output dim (q|k|v, gate|up).

    Shard i of the checkpoint fills output rows sum(output_sizes[:i]) .. + output_sizes[i].
    """

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False) -> None:
        super().__init__(in_features, sum(output_sizes), bias=bias)
        self.output_sizes = list(output_sizes)
        attach_loaders(self, self._load_shard)

    def _load_shard(
        self, param: nn.Parameter, loaded: torch.Tensor, shard_id: int | None = None
    ) -> None:
        if shard_id is None or not 0 <= shard_id < len(self.output_sizes):
            raise ValueError(f"fused parameter needs a shard id in 0..{len(self.output_sizes) - 1}")
        offset = sum(self.output_sizes[:shard_id])
        size = self.output_sizes[shard_id]
        default_weight_loader(param.data[offset : offset + size], loaded)  # type: ignore[arg-type]

    def split(self, out: torch.Tensor) -> list[torch.Tensor]:
        """The fused output cut back into its shards, in checkpoint order."""
        return list(out.split(self.output_sizes, dim=-1))


def norm_linear(
    norm: nn.Module,
    proj: Linear,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    silu: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(proj(norm(x + residual)), the residual stream x + residual); `residual` None: the first
    layer, whose stream is x. `silu`: proj is gate | up and the result silu(gate) * up. A
    decode row on CUDA makes the norm inside the projection's kernel where that beats the
    separate kernels (timed once per shape; only without PDL, see `norm_fusion_pays`)."""
    ops = one_row_ops(x)
    contiguous = residual is None or residual.is_contiguous()
    if ops is not None and contiguous and proj.quant is None and tuning.norm_fusion_pays():
        weight, bias = proj.weight, proj.bias

        def fused() -> tuple[torch.Tensor, torch.Tensor]:
            return ops.rms_norm_gemv(x, residual, norm.weight, norm.eps, weight, bias, gated=silu)

        def separate() -> torch.Tensor:  # timed without the residual (not to change it)
            return _projection(ops.rms_norm(x, norm.weight, norm.eps), proj, silu)

        if tuning.gemv_wins("norm+silu" if silu else "norm", x, weight, bias, fused, separate):
            return fused()
    if residual is None:
        normed, residual = norm(x), x
    else:
        normed, residual = norm(x, residual)
    return _projection(normed, proj, silu), residual


def _projection(x: torch.Tensor, proj: Linear, silu: bool) -> torch.Tensor:
    """proj(x); `silu`: silu(gate) * up of it, in the projection's kernel (its epilogue) for a
    decode row on CUDA where that beats the projection then `silu_mul`, and for quantized
    weights where the CPU batch takes the AMX-BF16 kernel (`quant_kernels.gated_linear`)."""
    if not silu:
        return proj(x)
    ops = one_row_ops(x)
    if ops is not None and proj.quant is None:
        weight, bias = proj.weight, proj.bias

        def gated() -> torch.Tensor:
            return ops.gemv(x, weight, bias, gated=True)

        def separate() -> torch.Tensor:
            return ops.silu_mul(linear(x, weight, bias, None))

        if tuning.gemv_wins("silu", x, weight, bias, gated, separate):
            return gated()
    if proj.quant is not None:  # a CPU batch's gate | up on AMX tiles: in the epilogue
        made = quant_kernels.gated_linear(x, proj.quant, proj.bias)
        if made is not None:
            return made
    return _silu_mul(proj(x))


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    ops = fused_ops(gate_up)
    if ops is not None:
        return ops.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up
