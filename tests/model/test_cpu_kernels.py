"""The native CPU kernels: the linear kernel against exact math and torch, the build and its
fallbacks, and the embedded model's bf16 logits with and without the native paths."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kvflow.attention import AttentionMetadata, token_positions
from kvflow.attention.cpu import cpu_paged_attention
from kvflow.kernels.cpu import build, ops
from kvflow.kernels.cpu.linear import bf16_linear, pack_linear_weight
from kvflow.kernels.cpu.onednn import pack_weight
from kvflow.model import layers, load_model, resolve_model
from kvflow.worker.kv_cache import allocate_kv_caches


def test_native_kernels_build_here() -> None:
    # CI machines have a C compiler; without one kvflow still runs (see the fallback tests).
    assert build.native_available()


def _linear(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    packed = pack_linear_weight(w)
    assert packed is not None
    return bf16_linear(x, packed, b, w.shape[0])


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 16])
@pytest.mark.parametrize("out_features, in_features", [(960, 576), (13, 40), (33, 2), (1, 1536)])
@pytest.mark.parametrize("bias", [False, True])
def test_bf16_linear_matches_exact_math(rows, out_features, in_features, bias) -> None:
    torch.manual_seed(rows * 1000 + out_features + in_features)
    x = torch.randn(rows, in_features).bfloat16()
    w = torch.randn(out_features, in_features).bfloat16()
    b = torch.randn(out_features).bfloat16() if bias else None
    got = _linear(x, w, b)
    assert got.shape == (rows, out_features) and got.dtype == torch.bfloat16
    exact = x.double() @ w.double().T + (b.double() if bias else 0)
    # one rounding to bf16 (relative 2^-8), plus float32 accumulation error
    torch.testing.assert_close(got.double(), exact, rtol=2**-8, atol=1e-3 * in_features**0.5)
    # and torch's own bf16 linear agrees to the last bit almost everywhere
    same = (got == F.linear(x, w, b)).float().mean().item()
    assert same > 0.98


def test_bf16_linear_reads_strided_input_and_propagates_nan() -> None:
    x = torch.randn(6, 64).bfloat16()[::2]  # not contiguous
    w = torch.randn(33, 64).bfloat16()
    torch.testing.assert_close(_linear(x, w, None), F.linear(x, w))
    x = x.contiguous()
    x[1, 5] = float("nan")
    out = _linear(x, w, None)
    assert out[1].isnan().all() and out[[0, 2]].isfinite().all()


@pytest.mark.parametrize("rows", [1, 3, 9, 40])
def test_bf16_linear_float32_output_is_the_unrounded_sum(rows) -> None:
    """The logits head's kernel: float32 sums (no rounding to bf16's grid, where two logits
    closer than a step come out level), which round to exactly the bf16 kernel's results."""
    torch.manual_seed(rows)
    x = torch.randn(rows, 576).bfloat16()
    w = (torch.randn(1000, 576) / 4).bfloat16()
    b = torch.randn(1000).bfloat16()
    packed = pack_linear_weight(w)
    assert packed is not None
    got = bf16_linear(x, packed, b, 1000, out_dtype=torch.float32)
    assert got.shape == (rows, 1000) and got.dtype == torch.float32
    exact = x.double() @ w.double().T + b.double()
    torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-4)
    assert (got != got.bfloat16().float()).float().mean() > 0.9
    assert torch.equal(got.bfloat16(), bf16_linear(x, packed, b, 1000))


def test_logits_head_sums_bf16_rows_in_float32() -> None:
    """`logits_linear` of bf16 rows on the CPU: the float32 sums with the native packing and
    without it, at a decode's rows and at a prompt's many."""
    torch.manual_seed(0)
    w = (torch.randn(3000, 576) / 4).bfloat16()
    packed, native = pack_weight(w), pack_linear_weight(w)
    for rows in (1, 200):
        x = torch.randn(rows, 576).bfloat16()
        exact = x.double() @ w.double().T
        for head in ((packed, native), (None, None)):
            got = layers.logits_linear(x, w, *head)
            assert got.dtype == torch.float32
            torch.testing.assert_close(got.double(), exact, rtol=1e-5, atol=1e-4)


def test_pack_applies_to_bf16_cpu_weights_with_even_inputs_only() -> None:
    assert pack_linear_weight(torch.randn(8, 6)) is None  # float32
    assert pack_linear_weight(torch.randn(8, 5).bfloat16()) is None  # odd K
    packed = pack_linear_weight(torch.randn(40, 6).bfloat16())
    assert packed is not None and packed.shape == (2, 3, 32, 2)  # 40 columns -> 2 tiles of 32


def _ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in bf16 steps between same-signed finite a and b."""
    ia, ib = a.view(torch.int16).int(), b.view(torch.int16).int()
    return int((ia - ib).abs().max())


@pytest.mark.parametrize("tokens", [1, 5, 20])
def test_rms_norm_matches_transformers_rounding(tokens) -> None:
    torch.manual_seed(tokens)
    x, residual = torch.randn(tokens, 96).bfloat16(), torch.randn(tokens, 96).bfloat16()
    weight, eps = torch.rand(96).bfloat16() + 0.5, 1e-5

    def reference(h: torch.Tensor) -> torch.Tensor:  # transformers' LlamaRMSNorm
        f = h.float()
        normed = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)
        return weight * normed.to(torch.bfloat16)

    assert _ulps_apart(ops.rms_norm(x, weight, eps), reference(x)) <= 1
    stream = residual.clone()
    out = ops.rms_norm(x, weight, eps, stream)
    assert torch.equal(stream, x + residual)  # the residual stream, updated in place
    assert _ulps_apart(out, reference(x + residual)) <= 1
    heads = x.view(tokens, 3, 32)  # per-head norms (Qwen3's q/k norm) over the last dim
    norm32 = ops.rms_norm(heads, weight[:32], eps)
    assert norm32.shape == heads.shape


@pytest.mark.parametrize("gathered", [False, True], ids=["contiguous", "gathered-views"])
def test_rotary_in_place_on_strided_rows_matches_torch(gathered) -> None:
    """x's rows strided as the fused projection leaves them; cos/sin contiguous or, as
    `RotaryEmbedding` gives them, views of one [T, 2, D] block (rows 2 * D apart)."""
    torch.manual_seed(3)
    qkv = torch.randn(7, 5 * 64).bfloat16()
    qk = qkv[:, : 4 * 64].view(7, 4, 64)  # rows 320 apart, as the fused projection's q|k
    angles = torch.rand(7, 1, 32) * 6
    cos = torch.cat((angles.cos(), angles.cos()), -1).bfloat16()
    sin = torch.cat((-angles.sin(), angles.sin()), -1).bfloat16()  # halves differ: no mix-up
    if gathered:
        rows = torch.cat((cos, sin), dim=1)
        cos, sin = rows[:, :1], rows[:, 1:]
        assert cos.stride(0) == sin.stride(0) == 128
    rotated = torch.cat((-qk[..., 32:], qk[..., :32]), dim=-1)
    expected = qk * cos + rotated * sin
    v_before = qkv[:, 4 * 64 :].clone()
    assert ops.rotary_(qk, cos, sin).data_ptr() == qkv.data_ptr()
    assert torch.equal(qk, expected)
    assert torch.equal(qkv[:, 4 * 64 :], v_before)


@pytest.mark.parametrize("width", [1536, 40])
def test_silu_mul_matches_torch(width) -> None:
    torch.manual_seed(width)
    gate_up = (torch.randn(6, 2 * width) * 4).bfloat16()
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    gate, up = gate_up.split(width, dim=-1)
    expected = F.silu(gate) * up
    got = ops.silu_mul(gate_up)
    assert got.shape == (6, width)
    assert _ulps_apart(got, expected) <= 1


def _native_in_subprocess(env: dict[str, str]) -> str:
    code = "from kvflow.kernels.cpu import build; print(build.native_available())"
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout.strip() + done.stderr


def test_native_can_be_turned_off() -> None:
    assert _native_in_subprocess({"KVFLOW_NATIVE": "0"}).startswith("False")


def test_failed_build_falls_back_with_a_warning(tmp_path) -> None:
    out = _native_in_subprocess({"CC": "false", "KVFLOW_CACHE": str(tmp_path)})
    assert out.startswith("False")
    assert "native CPU kernel unavailable" in out
    assert not list((tmp_path / "kernels").glob("*.so*"))  # no half-written library left


def _spin_after_import(env: dict[str, str]) -> str:
    code = "import os, kvflow, torch; print(os.environ.get('GOMP_SPINCOUNT'))"
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    done = subprocess.run(
        [sys.executable, "-c", code],
        env={**base, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return done.stdout.strip()


def test_import_bounds_openmp_spinning_unless_told_otherwise() -> None:
    """Sleeping OpenMP waits made the server's decode steps 1.7x slower (benchmarks/RESULTS.md):
    importing kvflow asks libgomp for a bounded spin, and leaves a chosen policy or count alone."""
    assert _spin_after_import({}) == "30000"
    assert _spin_after_import({"OMP_WAIT_POLICY": "PASSIVE"}) == "None"
    assert _spin_after_import({"GOMP_SPINCOUNT": "5"}) == "5"


def _step_logits(model, hf_config, prompt: list[int], forced: list[int]) -> torch.Tensor:
    """Logits of a prefill of `prompt`, then of one decode step per token of `forced` (fed
    whatever the model predicted, so every run sees the same inputs): [1 + len(forced), vocab]."""
    caches = allocate_kv_caches(hf_config, 8, 16, next(model.parameters()).dtype, "cpu")
    blocks = [[3, 1, 6, 2]]  # shuffled, so block tables matter
    out, computed, new = [], 0, prompt
    with torch.inference_mode():
        for token in [*forced, None]:
            meta = AttentionMetadata.build([len(new)], [computed], blocks, 16, "cpu")
            positions = torch.from_numpy(token_positions([len(new)], [computed]))
            hidden = model(torch.tensor(new), positions, caches, meta)
            out.append(model.compute_logits(hidden[-1:])[0].float())
            computed, new = computed + len(new), [token]
    return torch.stack(out)


def test_embedded_model_bf16_native_is_as_close_to_float32_as_torch(monkeypatch) -> None:
    """The native linear and decode attention change rounding, not accuracy: their bf16 logits
    are as close to the float32 model's as torch's bf16 paths are."""
    path = resolve_model(None)
    prompt, forced = list(range(1000, 1040)), [2000, 17, 4242, 9, 300, 12]
    ref32, cfg = load_model(path, torch.float32)
    exact = _step_logits(ref32, cfg, prompt, forced)
    model, cfg = load_model(path, torch.bfloat16, attn_backend=cpu_paged_attention)
    layers.prepack_for_cpu(model)
    native = _step_logits(model, cfg, prompt, forced)
    monkeypatch.setattr(build, "native_available", lambda: False)
    plain = _step_logits(model, cfg, prompt, forced)
    assert not torch.equal(native, plain)  # the two paths really differ
    err_native = (native - exact).abs().max().item()
    err_plain = (plain - exact).abs().max().item()
    assert err_native <= 1.5 * err_plain + 0.05, (err_native, err_plain)
