"""Quantized weights (kvflow.model.quant_format) and their kernels (kernels/cpu/quant, routed by
model/quant_kernels) against a float64 dequantize-then-matmul, per GGUF block type.

Weights come from the `gguf` package's own quantizers where it has one (Q8_0, Q4_0, Q4_1); it
has none for the K-quants, so their blocks are random bytes with sane float16 super-scales
(every byte pattern is a valid block), and gguf's own `dequantize` is the oracle for the values.

The float32 kernel's bound: the repacked layout holds every block's values exactly (each scale
and min is a float16 times a small integer, exact in float32; the kernel makes a weight with one
fused multiply-add, within one float32 rounding of it), so what remains is the float32 summation
over K and the one rounding of the output to bf16:
    |y - y64| <= 2^-8 |y64| + (K + 2) 2^-24 sum_k |w_k x_k|
(2^-8: bf16's half ulp is 2^-9 relative, doubled for the rounding of the float32 sum's error).

The bound of the AMX and VNNI kernels (`amx_bound`; they quantize the activations alike):
w_k = s_k q_k + m_k with s, m the group's scale and min.
Each rounds every activation row per 32-column block b to xq = round(x / d_b), d_b = max|x_b| /
127, so |x_k - d_b xq_k| <= d_b / 2; the int8 products and their int32 block sums are exact
(|sum| <= 32 * 127 * 128 < 2^24, so also exact in float32); the min term uses the bf16
activations' float sum, not the quantized ones. What differs from y64:
    quantization   sum_k |s_k q_k| d_b(k) / 2
    float32 work   (K + 2) 2^-24 sum_k (|s_k q_k| + |m_k|) (|x_k| + d_b(k) / 2)
                   (a scale product, a conversion, a multiply-add per block; K sums at most)
    output         2^-9 |y|, y within the two terms above of y64: 2^-8 |y64| covers 2^-9 |y64|,
                   and the two terms are taken 1 + 2^-9 times.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from kvflow.kernels import tuning
from kvflow.kernels.cpu import quant
from kvflow.model import quant_kernels
from kvflow.model.quant_format import GGUF_TYPES, QuantizedWeight, from_gguf_blocks, quantize_int8

BLOCK = {"Q8_0": (34, 32), "Q4_0": (18, 32), "Q4_1": (20, 32), "Q5_0": (22, 32), "Q5_1": (24, 32)}
SUPER = {"Q4_K": 144, "Q5_K": 176, "Q6_K": 210}
needs_native = pytest.mark.skipif(
    not quant_kernels.native_available(), reason="no C compiler: the quantized kernels are off"
)
needs_amx = pytest.mark.skipif(not quant.amx_available(), reason="no AMX-INT8 on this CPU")
INT8_KERNELS = [  # the kernels that quantize activations to int8 (one bound, `amx_bound`)
    pytest.param("amx", marks=needs_amx),
    pytest.param(
        "vnni",
        marks=pytest.mark.skipif(
            not quant.vnni_available(), reason="no int8 dot products (AVX512-VNNI or AVX2)"
        ),
    ),
]


def gguf_tensor(kind: str, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """uint8 [rows, bytes per row] of GGUF blocks of `kind`."""
    rng = np.random.default_rng(seed)
    if kind in BLOCK:
        w = rng.standard_normal((rows, cols)).astype(np.float32)
        return quantize(w, GGMLQuantizationType[kind])
    size = SUPER[kind]
    raw = rng.integers(0, 256, (rows, cols // 256, size), dtype=np.uint8)
    scales = (rng.random((rows, cols // 256, 2)) * 0.02 + 0.001).astype(np.float16)
    at = slice(208, 210) if kind == "Q6_K" else slice(0, 4)
    raw[..., at] = scales.view(np.uint8).reshape(rows, cols // 256, 4)[..., : at.stop - at.start]
    return raw.reshape(rows, -1)


def reference(x: torch.Tensor, w64: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    y = x.double() @ w64.T
    return y if bias is None else y + bias.double()


def assert_within_bound(y: torch.Tensor, x: torch.Tensor, w64: torch.Tensor, y64) -> None:
    """The module's bound; float32 results skip the bf16 term (no rounding to bf16)."""
    k = w64.shape[1]
    magnitude = x.double().abs() @ w64.abs().T
    rounding = 2.0**-8 if y.dtype == torch.bfloat16 else 0.0
    bound = rounding * y64.abs() + (k + 2) * 2.0**-24 * magnitude + 1e-30
    excess = ((y.double() - y64).abs() / bound).max().item()
    assert excess <= 1.0, f"error {excess:.2f}x the bound"


def amx_bound(x: torch.Tensor, weight: QuantizedWeight, y64: torch.Tensor) -> torch.Tensor:
    """The AMX kernel's bound (module docstring) for x [M, K] against weight [N, K]."""
    m, k = x.shape
    x64 = x.double()
    d = x64.view(m, k // 32, 32).abs().amax(-1) / 127  # [M, blocks]
    half = (d / 2).repeat_interleave(32, dim=1)  # [M, K]
    sq = weight.int_codes().double() * weight.scales.double().repeat_interleave(weight.group, 1)
    mins = weight.mins.double().repeat_interleave(weight.group, 1)
    quantization = half @ sq.abs().T
    work = (k + 2) * 2.0**-24 * ((x64.abs() + half) @ (sq.abs() + mins.abs()).T)
    return 2.0**-8 * y64.abs() + (1 + 2.0**-9) * (quantization + work) + 1e-30


@pytest.mark.parametrize("kind", GGUF_TYPES)
def test_repacked_values_are_the_blocks_values(kind: str) -> None:
    cols = 512
    raw = gguf_tensor(kind, 7, cols)
    ours = from_gguf_blocks(raw, kind, cols).dequantize(torch.float64)
    theirs = torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]).astype(np.float64))
    # gguf computes in float32 (one rounding per product): equal to float32 precision
    torch.testing.assert_close(ours, theirs, rtol=2**-22, atol=0)


@needs_native
@pytest.mark.parametrize("kind", GGUF_TYPES)
def test_kernel_matches_float64_matmul(kind: str) -> None:
    """The float32 kernel: weight rows crossing its 4- and 2-row tiles, inputs of one block and
    of several (K-quants: 256 and 768 columns), activation rows crossing its 8-row passes."""
    torch.manual_seed(0)
    for cols in (256, 768) if kind in SUPER else (32, 96, 544):
        for rows in (1, 5, 67):
            weight = from_gguf_blocks(gguf_tensor(kind, rows, cols, seed=rows), kind, cols)
            w64 = weight.dequantize(torch.float64)
            bias = torch.randn(rows).bfloat16()
            for m, dtype in itertools.product((1, 2, 3, 8, 9, 16), (torch.bfloat16, torch.float32)):
                x = torch.randn(m, cols).to(dtype)
                b = bias.to(dtype) if m % 2 else None
                y = quant_kernels.kernel_linear(x, weight, b)
                assert y.dtype == dtype and y.shape == (m, rows)
                assert_within_bound(y, x, w64, reference(x, w64, b))


@pytest.mark.parametrize("kernel", INT8_KERNELS)
@pytest.mark.parametrize("kind", GGUF_TYPES)
def test_int8_kernels_match_float64_matmul(kind: str, kernel: str) -> None:
    """The AMX and VNNI kernels within `amx_bound`: weight rows crossing AMX's 16-row tiles and
    VNNI's 4-row ones (1, 17, 33), inputs crossing their 64-byte rows (32, 96, 544 columns: a
    32-column tail) or several super-blocks, activation rows crossing AMX's 16-row tiles and
    32-row passes and VNNI's 4-row passes. Activations with a few large values per row, as a
    model's have, so that a block's scale is not the row's."""
    torch.manual_seed(0)
    for cols in (256, 768) if kind in SUPER else (32, 96, 544):
        for rows in (1, 17, 33):
            weight = from_gguf_blocks(gguf_tensor(kind, rows, cols, seed=rows), kind, cols)
            w64 = weight.dequantize(torch.float64)
            bias = torch.randn(rows).bfloat16()
            for m in (1, 2, 3, 7, 16, 17, 33):
                x = torch.randn(m, cols)
                x[:, ::97] *= 20
                x = x.bfloat16()
                b = bias if m % 2 else None
                y = quant_kernels.kernel_linear(x, weight, b, kernel)
                assert y.dtype == torch.bfloat16 and y.shape == (m, rows)
                y64 = reference(x, w64, b)
                excess = ((y.double() - y64).abs() / amx_bound(x, weight, y64)).max().item()
                assert excess <= 1.0, f"{kind} {cols} {rows} {m}: {excess:.2f}x the bound"


@pytest.mark.skipif(not quant.vnni_available(), reason="no int8 dot products")
def test_q4_0s_offset_gives_the_mins_sums_without_reading_them() -> None:
    """Q4_0's mins are -8 x its scales (`offset` 8; Q4_1's and Q4_K's are their own, offset 0):
    the int8 kernel makes the mins' term from the scales, the sums the mins give bit for bit,
    and reads no min (mins poisoned with NaN change nothing)."""
    torch.manual_seed(2)
    cols = 544
    assert [
        from_gguf_blocks(gguf_tensor(k, 3, 256), k, 256).offset for k in ("Q4_0", "Q4_1", "Q4_K")
    ] == [8, 0, 0]
    weight = from_gguf_blocks(gguf_tensor("Q4_0", 33, cols, seed=7), "Q4_0", cols)
    parts = (weight.codes, weight.scales)
    for m in (1, 2, 5):
        x = torch.randn(m, cols).bfloat16()
        for dtype in (torch.bfloat16, torch.float32):
            by_mins = quant.linear_int8("vnni", x, *parts, weight.mins, 4, 32, None, dtype)
            poisoned = torch.full_like(weight.mins, float("nan"))
            by_offset = quant.linear_int8("vnni", x, *parts, poisoned, 4, 32, None, dtype, 8)
            assert torch.equal(by_offset, by_mins)
        assert torch.equal(quant_kernels.kernel_linear(x, weight, None, "vnni"), by_mins.bfloat16())


@pytest.mark.skipif(not quant.vnni_available(), reason="no int8 dot products")
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_0", "Q4_K"])
def test_vnni_float32_output_is_the_bf16_output_unrounded(kind: str) -> None:
    """The logits head's form of the int8 kernel stores its float32 sums (and adds a float32
    bias): rounded to bf16 they are the bf16 kernel's results bit for bit. A quantized head's
    decode rows take it (`quant_kernels.logits`), more rows the float32 activations' kernel."""
    torch.manual_seed(1)
    cols = 256
    weight = from_gguf_blocks(gguf_tensor(kind, 37, cols, seed=5), kind, cols)
    bias = torch.randn(37).bfloat16()
    for m in (1, 2, 5):
        x = torch.randn(m, cols).bfloat16()
        wide = quant_kernels.kernel_linear(x, weight, bias.float(), "vnni", out_dtype=torch.float32)
        narrow = quant_kernels.kernel_linear(x, weight, bias, "vnni")
        assert wide.dtype == torch.float32 and torch.equal(wide.bfloat16(), narrow)
        sums = quant_kernels.kernel_linear(x, weight, None, "vnni", out_dtype=torch.float32)
        assert torch.equal(quant_kernels.logits(x, weight), sums)
    wide_rows = torch.randn(3, cols)  # a float32 model's: never the int8 kernel
    assert torch.equal(
        quant_kernels.logits(wide_rows, weight), quant_kernels.quant_linear(wide_rows, weight, None)
    )


@pytest.mark.parametrize("kernel", INT8_KERNELS)
@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1"])
def test_int8_kernels_keep_non_finite_rows_non_finite(kind: str, kernel: str) -> None:
    """A NaN or an infinity in an activation row makes that row's outputs non-finite (the
    engine fails such a request), never finite values made from a saturated int8 code."""
    weight = from_gguf_blocks(gguf_tensor(kind, 20, 96), kind, 96)
    x = torch.randn(4, 96).bfloat16()
    x[1, 40], x[2, 95] = float("nan"), float("inf")
    y = quant_kernels.kernel_linear(x, weight, None, kernel)
    assert torch.isfinite(y[[0, 3]]).all()
    assert not torch.isfinite(y[1]).any() and not torch.isfinite(y[2]).any()


@needs_native
def test_routing_by_rows() -> None:
    """bf16 rows take: VNNI up to its limit (by code bits beside AMX, else VNNI_ALONE_ROWS),
    then AMX-INT8 up to AMX_ROWS[bits] and AMX-BF16 ("gemm") up to MAX_GEMM_ROWS, the float32
    kernel where neither runs (up to its limit), and beyond every limit the dequantized weight's
    matmul (in float32 where torch's bf16 one is slower). Each route gives that kernel's exact
    output."""
    q4 = from_gguf_blocks(gguf_tensor("Q4_1", 20, 64), "Q4_1", 64)
    q8 = from_gguf_blocks(gguf_tensor("Q8_0", 20, 64), "Q8_0", 64)
    large = max(quant_kernels.MAX_KERNEL_ROWS, quant_kernels.MAX_GEMM_ROWS) + 1
    amx, vnni = quant.amx_available(), quant.vnni_available()
    MAX_KERNEL_ROWS = quant_kernels.MAX_KERNEL_ROWS

    def expect(bits: int, rows: int) -> str:
        if vnni and rows <= (
            quant_kernels.VNNI_ROWS[bits] if amx else quant_kernels.VNNI_ALONE_ROWS
        ):
            return "vnni"
        if amx and rows <= quant_kernels.AMX_ROWS[bits]:
            return "amx"
        if amx and rows <= quant_kernels.MAX_GEMM_ROWS:
            return "gemm"
        return "float" if rows <= MAX_KERNEL_ROWS else "dequant"

    cases = [(q4, 1), (q4, 2), (q4, 5), (q8, 1), (q8, 2), (q8, MAX_KERNEL_ROWS + 1), (q4, large)]
    cases += [(q4, quant_kernels.VNNI_ALONE_ROWS), (q8, quant_kernels.VNNI_ALONE_ROWS + 1)]
    cases += [(q4, quant_kernels.AMX_ROWS[4] + 1), (q8, quant_kernels.AMX_ROWS[8] + 1)]
    for weight, rows in cases:
        route = expect(weight.bits, rows)
        assert quant_kernels.route(rows, weight, torch.bfloat16) == route, (weight.bits, rows)
        x = torch.randn(rows, 64).bfloat16()
        if route == "dequant" and tuning.bf16_matmul_pays():
            expected = x @ quant_kernels.dequantize(weight, x.dtype).T
        elif route == "dequant":  # widened: torch's bf16 matmul is the slower one here
            expected = (x.float() @ quant_kernels.dequantize(weight, torch.float32).T).bfloat16()
        else:
            expected = quant_kernels.kernel_linear(x, weight, None, route)
        assert torch.equal(quant_kernels.quant_linear(x, weight, None), expected), (rows, route)
    if amx and vnni:  # what the limits mean here: decode rows on VNNI, 5 rows of 4 bits on AMX
        assert [quant_kernels.route(r, q4, torch.bfloat16) for r in (1, 4, 5, 17)] == [
            "vnni",
            "vnni",
            "amx",
            "gemm",
        ]
    assert quant_kernels.route(3, q4, torch.float32) == "float"


@needs_amx
@pytest.mark.parametrize("kind", GGUF_TYPES)
def test_gemm_kernel_matches_float64_matmul(kind: str) -> None:
    """The AMX-BF16 kernel ("gemm"): its weights are `dequantize`'s bf16 values exactly (x the
    identity: y = w.T, each output one product), and its sums within one float32 rounding per
    product of the float64 matmul of those values, rounded once to bf16; weight rows crossing
    its 16-row halves and 32-row tiles (1, 17, 33, 40; 200: several tiles a thread, each
    thread's weight buffers alternating), activation rows crossing its 16-row chunks and their
    pairs (1, 17, 33, 47), a 32-column tail (544), with and without a bias."""
    torch.manual_seed(0)
    for cols in (256, 768) if kind in SUPER else (32, 544):
        for rows in (1, 17, 33, 40, 200):
            weight = from_gguf_blocks(gguf_tensor(kind, rows, cols, seed=rows), kind, cols)
            wb = quant_kernels.dequantize(weight, torch.bfloat16)
            eye = torch.eye(cols).bfloat16()
            assert torch.equal(quant_kernels.kernel_linear(eye, weight, None, "gemm"), wb.T)
            w64 = wb.double()
            bias = torch.randn(rows).bfloat16()
            for m in (1, 17, 33, 47):
                x = torch.randn(m, cols).bfloat16()
                b = bias if m % 2 else None
                y = quant_kernels.kernel_linear(x, weight, b, "gemm").double()
                y64 = reference(x, w64, b)
                magnitude = x.double().abs() @ w64.abs().T
                bound = 2.0**-8 * y64.abs() + (cols + 2) * 2.0**-24 * magnitude
                assert ((y - y64).abs() <= bound).all(), (kind, cols, rows, m)


@needs_amx
@pytest.mark.parametrize("kind", ["Q4_1", "Q6_K"])
def test_gemm_silu_epilogue_is_silu_mul(kind: str) -> None:
    """gate | up through the AMX-BF16 kernel with the SiLU epilogue equals `silu_mul` of the
    kernel's plain output bit for bit (bias or none; gate and up 8 and 24 rows: a half tile,
    and one crossing a tile; rows past AMX-INT8's limit, crossing 16-row chunks), as an MLP's
    step takes it (`gated_linear`), and the routing gives it only to the rows "gemm" takes."""
    from kvflow.kernels.select import fused_ops

    cols = 256
    for half in (8, 24):
        weight = from_gguf_blocks(gguf_tensor(kind, 2 * half, cols, seed=half), kind, cols)
        bias = torch.randn(2 * half).bfloat16()
        low = quant_kernels.AMX_ROWS[weight.bits]  # below: AMX-INT8 takes the rows
        for m, b in ((low + 1, None), (low + 17, bias), (low + 24, None)):
            x = torch.randn(m, cols).bfloat16()
            plain = quant_kernels.kernel_linear(x, weight, b, "gemm")
            made = quant_kernels.gated_linear(x, weight, b)
            assert made is not None and made.shape == (m, half)
            # NaN where both are (random K-quant blocks reach inf; inf * 0 in silu(gate) * up)
            expected = fused_ops(plain).silu_mul(plain)
            torch.testing.assert_close(made, expected, rtol=0, atol=0, equal_nan=True)
    small = torch.randn(quant_kernels.AMX_ROWS[weight.bits], cols).bfloat16()
    assert quant_kernels.gated_linear(small, weight, None) is None


@pytest.mark.parametrize("kind", ["Q4_1", "Q6_K"])
def test_large_batches_dequantize(kind: str) -> None:
    """More rows than the kernels take: the weight goes to the activations' dtype (bf16: one
    rounding of each value, 2^-9 relative; float32: exact), then torch's matmul."""
    weight = from_gguf_blocks(gguf_tensor(kind, 40, 256), kind, 256)
    w64 = weight.dequantize(torch.float64)
    x = torch.randn(max(quant_kernels.MAX_KERNEL_ROWS, quant_kernels.MAX_GEMM_ROWS) + 3, 256)
    x = x.bfloat16()
    y = quant_kernels.quant_linear(x, weight, None).double()
    y64 = reference(x, w64, None)
    magnitude = x.double().abs() @ w64.abs().T
    assert ((y - y64).abs() <= 2.0**-8 * y64.abs() + 2.0**-8 * magnitude).all()
    assert torch.equal(quant_kernels.dequantize(weight, torch.float32), w64.float())


def test_fused_shards_of_different_types_keep_every_value() -> None:
    """q|k|v of a Q4_K_M file mixes Q4_K and Q6_K: stacked as 8 bits in groups of 16; a part
    with float16 scales (Q4_1) among float32 ones: all float32."""
    q = from_gguf_blocks(gguf_tensor("Q4_K", 6, 256, 1), "Q4_K", 256)
    k = from_gguf_blocks(gguf_tensor("Q4_1", 2, 256, 3), "Q4_1", 256)
    v = from_gguf_blocks(gguf_tensor("Q6_K", 3, 256, 2), "Q6_K", 256)
    fused = QuantizedWeight.cat([q, k, v])
    assert (fused.bits, fused.group, fused.out_features) == (8, 16, 11)
    assert fused.scales.dtype == fused.mins.dtype == torch.float32
    expected = torch.cat([p.dequantize(torch.float64) for p in (q, k, v)])
    assert torch.equal(fused.dequantize(torch.float64), expected)
    halves = QuantizedWeight.cat([k, k])
    assert halves.scales.dtype == torch.float16 and halves.out_features == 4


@needs_native
@pytest.mark.parametrize("kind", GGUF_TYPES)
def test_float16_scales_where_exact(kind: str) -> None:
    """Q8_0, Q4_0, Q4_1, Q5_0 and Q5_1 keep their float16 scales (and mins) as stored; the K-quants' scales
    are products that float16 does not hold, so they stay float32. Every kernel reads float16
    ones as the same values: its output equals that of the weight with float32 copies of them,
    bit for bit (rows crossing VNNI's 4-row and AMX's 16-row tiles, a 32-column tail)."""
    cols = 256 if kind in SUPER else 544
    weight = from_gguf_blocks(gguf_tensor(kind, 17, cols, seed=5), kind, cols)
    half = kind in BLOCK
    assert weight.scales.dtype == weight.mins.dtype == (torch.float16 if half else torch.float32)
    if not half:
        return
    wide = QuantizedWeight(
        weight.codes, weight.scales.float(), weight.mins.float(), weight.bits, weight.group,
        cols, kind,
    )  # fmt: skip
    assert weight.nbytes < wide.nbytes
    kernels = ["float"] + [k for k, ok in (("amx", quant.amx_available()),
                                           ("vnni", quant.vnni_available())) if ok]  # fmt: skip
    bias = torch.randn(17).bfloat16()
    for kernel, m in itertools.product(kernels, (1, 3, 5, 17)):
        x = torch.randn(m, cols).bfloat16()
        ours = quant_kernels.kernel_linear(x, weight, bias, kernel)
        assert torch.equal(ours, quant_kernels.kernel_linear(x, wide, bias, kernel)), (kernel, m)
    x = torch.randn(3, cols)
    assert torch.equal(
        quant_kernels.kernel_linear(x, weight, None), quant_kernels.kernel_linear(x, wide, None)
    )
    for dtype in (torch.bfloat16, torch.float32):
        expected = quant_kernels.dequantize(wide, dtype)
        assert torch.equal(quant_kernels.dequantize(weight, dtype), expected)


def test_mixed_scale_dtypes_are_refused() -> None:
    codes = torch.zeros(2, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="both float32 or both float16"):
        QuantizedWeight(codes, torch.ones(2, 1), torch.zeros(2, 1).half(), 4, 32, 32, "Q4_1")


def test_unsupported_block_type_is_named() -> None:
    with pytest.raises(ValueError, match="Q2_K.*--quantization none"):
        from_gguf_blocks(np.zeros((2, 84), np.uint8), "Q2_K", 256)


@needs_native
def test_int8_per_channel() -> None:
    """Each row's largest |w| is code 127; every value within half a step of its row's scale;
    the kernels within the bounds of its float64 matmul (96 columns: a group VNNI does not
    take, as `vnni_takes` says; 128: one it does)."""
    for cols in (96, 128):
        check_int8_per_channel(cols)


def check_int8_per_channel(cols: int) -> None:
    torch.manual_seed(1)
    w = torch.randn(37, cols) * torch.linspace(0.01, 3.0, 37)[:, None]
    q = quantize_int8(w)
    codes = q.int_codes()
    assert (codes.abs().amax(dim=1) == 127).all()
    step = q.scales[:, :1].double()
    assert ((q.dequantize(torch.float64) - w.double()).abs() <= step / 2 + 1e-6 * step).all()
    x = torch.randn(5, cols).bfloat16()
    w64 = q.dequantize(torch.float64)
    y64 = reference(x, w64, None)
    assert_within_bound(quant_kernels.kernel_linear(x, q, None), x, w64, y64)
    vnni = quant.vnni_available() and quant.vnni_takes(8, cols)
    assert quant.vnni_takes(8, cols) == (cols == 128)
    int8 = [k for k, ok in (("amx", quant.amx_available()), ("vnni", vnni)) if ok]
    for kernel in int8:  # one group a row: the whole row in the kernel's sums
        y = quant_kernels.kernel_linear(x, q, None, kernel).double()
        assert ((y - y64).abs() <= amx_bound(x, q, y64)).all(), kernel


def test_quantized_embedding_rows() -> None:
    weight = from_gguf_blocks(gguf_tensor("Q8_0", 50, 64), "Q8_0", 64)
    ids = torch.tensor([[3, 49], [0, 3]])
    rows = quant_kernels.embedding(ids, weight, torch.float32)
    assert rows.shape == (2, 2, 64)
    assert torch.equal(rows[0, 0], weight.dequantize(torch.float32)[3])


def test_quantized_embedding_rows_are_the_prompt_steps_values() -> None:
    """Rows of a table with mins (Q4_1) hold exactly what the whole layer dequantizes to for a
    prompt step (`quant_kernels.dequantize`), in bf16 as the model runs."""
    weight = from_gguf_blocks(gguf_tensor("Q4_1", 40, 96), "Q4_1", 96)
    ids = torch.tensor([7, 39, 0, 7])
    rows = quant_kernels.embedding(ids, weight, torch.bfloat16)
    assert torch.equal(rows, quant_kernels.dequantize(weight, torch.bfloat16)[ids])


@pytest.mark.parametrize("kind", GGUF_TYPES)
def test_a_ranks_rows_and_columns_hold_the_whole_weights_values(kind: str) -> None:
    """The cuts tensor parallelism makes: output rows (those past the end zero, as a padded
    vocabulary shard's), and input columns at 32-column blocks, also inside a K-quant's
    256-column super-block (its scale is folded into each group's); a cut inside a block is
    refused with the type and the columns."""
    weight = from_gguf_blocks(gguf_tensor(kind, 6, 512), kind, 512)
    whole = weight.dequantize(torch.float32)
    part = weight.columns(96, 320)
    assert part.in_features == 320 and part.kind == kind
    assert torch.equal(part.dequantize(torch.float32), whole[:, 96:416])
    x = torch.randn(3, 320, generator=torch.Generator().manual_seed(0))
    expected = (x.double() @ whole[:, 96:416].double().T).float()  # float32 sums: 1e-4
    torch.testing.assert_close(
        quant_kernels.quant_linear(x, part, None), expected, rtol=1e-4, atol=1e-4
    )
    rows = weight.row_range(4, 4)
    assert torch.equal(rows.dequantize(torch.float32), torch.cat((whole[4:], torch.zeros(2, 512))))
    with pytest.raises(ValueError, match=f"{kind} weight: columns 16..48 of 512 .*32-column"):
        weight.columns(16, 32)


def test_int8_of_a_column_shard_scaled_by_the_whole_row_is_the_whole_weights() -> None:
    """A row-parallel rank's int8 codes and scales (`row_max`: each row's max over all its
    columns) are the unsplit weight's; the shard's own max would give other values."""
    w = torch.randn(16, 128, generator=torch.Generator().manual_seed(3))
    whole = quantize_int8(w).dequantize(torch.float32)
    shard = quantize_int8(w[:, 64:], row_max=w.abs().amax(dim=1))
    assert torch.equal(shard.dequantize(torch.float32), whole[:, 64:])
    assert not torch.equal(quantize_int8(w[:, 64:]).dequantize(torch.float32), whole[:, 64:])
