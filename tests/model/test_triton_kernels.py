"""The fused small-op Triton kernels (CUDA's `rms_norm`, `rotary_`, `silu_mul`) against torch,
under Triton's interpreter without a GPU: the same rounding as transformers' eager ops, in
bfloat16 and float32, and a whole tiny Llama through them."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

pytest.importorskip("triton")

from kvflow.kernels import tuning  # noqa: E402
from kvflow.kernels.triton import argmax, gemv, ops  # noqa: E402
from kvflow.model import layers, linear  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float32]

if os.environ.get("TRITON_INTERPRET") == "1":
    from support.triton_interpreter import patch_interpreter  # float32 -> bf16 rounds as on a GPU

    patch_interpreter()


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> int:
    """Largest distance in steps of the dtype between same-signed finite a and b."""
    bits = torch.int16 if a.dtype == torch.bfloat16 else torch.int32
    return int((a.view(bits).long() - b.view(bits).long()).abs().max())


def ulps(dtype: torch.dtype) -> int:
    """bf16: the rounding points are the reference's, so at most one step (a tie, or float32
    sums in another order straddling a rounding boundary). float32: sums in another order and
    another exp / rsqrt differ in the last few bits."""
    return 1 if dtype == torch.bfloat16 else 8


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, dim", [(1, 64), (5, 96), (3, 40)])
def test_rms_norm_matches_transformers_rounding(dtype, tokens, dim) -> None:
    gen = torch.Generator().manual_seed(tokens * dim)
    x = torch.randn(tokens, dim, generator=gen).to(DEVICE, dtype)
    residual = torch.randn(tokens, dim, generator=gen).to(DEVICE, dtype)
    weight, eps = (torch.rand(dim, generator=gen) + 0.5).to(DEVICE, dtype), 1e-5

    def reference(h: torch.Tensor) -> torch.Tensor:  # transformers' LlamaRMSNorm
        f = h.float()
        normed = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + eps)
        return weight * normed.to(dtype)

    assert ulps_apart(ops.rms_norm(x, weight, eps), reference(x)) <= ulps(dtype)
    stream = residual.clone()
    out = ops.rms_norm(x, weight, eps, stream)
    assert torch.equal(stream, x + residual)  # the residual stream, updated in place
    assert ulps_apart(out, reference(x + residual)) <= ulps(dtype)
    heads = x[:, : dim // 8 * 8].reshape(tokens, 8, -1)  # per-head norms (Qwen3's q/k norm)
    per_head = ops.rms_norm(heads, weight[: heads.shape[-1]], eps)
    assert per_head.shape == heads.shape
    expected = F.rms_norm(heads, (heads.shape[-1],), weight[: heads.shape[-1]], eps)
    assert ulps_apart(per_head, expected) <= ulps(dtype)


@pytest.mark.parametrize("gathered", [False, True], ids=["contiguous", "gathered-views"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", [4, 3, 20])
def test_rotary_in_place_on_strided_rows_matches_torch(dtype, heads, gathered) -> None:
    """x's rows strided as the fused projection leaves them; cos/sin contiguous or, as
    `RotaryEmbedding` gives them, views of one [T, 2, D] block (rows 2 * D apart)."""
    gen = torch.Generator().manual_seed(heads)
    tokens, dim = 7, 64
    qkv = torch.randn(tokens, (heads + 1) * dim, generator=gen).to(DEVICE, dtype)
    qk = qkv[:, : heads * dim].view(tokens, heads, dim)  # q|k of the fused projection
    angles = torch.rand(tokens, 1, dim // 2, generator=gen) * 6
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(DEVICE, dtype)
    sin = torch.cat((-angles.sin(), angles.sin()), -1).to(DEVICE, dtype)  # halves differ
    if gathered:
        rows = torch.cat((cos, sin), dim=1)
        cos, sin = rows[:, :1], rows[:, 1:]
        assert cos.stride(0) == sin.stride(0) == 2 * dim
    rotated = torch.cat((-qk[..., dim // 2 :], qk[..., : dim // 2]), dim=-1)
    expected = qk * cos + rotated * sin
    v_before = qkv[:, heads * dim :].clone()
    assert ops.rotary_(qk, cos, sin).data_ptr() == qkv.data_ptr()
    assert torch.equal(qk, expected)
    assert torch.equal(qkv[:, heads * dim :], v_before)


@pytest.mark.filterwarnings("ignore:overflow encountered in exp")  # silu(-100), as on a GPU
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("width", [1536, 40])
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")  # exp -> inf
def test_silu_mul_matches_torch(dtype, width) -> None:
    gen = torch.Generator().manual_seed(width)
    gate_up = (torch.randn(6, 2 * width, generator=gen) * 4).to(DEVICE, dtype)
    gate_up[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -0.0])
    gate, up = gate_up.split(width, dim=-1)
    got = ops.silu_mul(gate_up)
    assert got.shape == (6, width)
    expected = F.silu(gate) * up
    assert ulps_apart(got, expected) <= ulps(dtype)
    if dtype == torch.bfloat16:  # rounded where torch rounds: equal almost everywhere
        assert (got == expected).float().mean() > 0.99


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_llama_through_the_fused_kernels(monkeypatch, dtype) -> None:
    """A tiny random Llama's logits with `fused_ops` giving the Triton kernels, against the same
    model on torch's ops: the kernels are wired where the model calls them."""
    from transformers import LlamaConfig

    from kvflow.attention import AttentionMetadata, token_positions
    from kvflow.model.llama import LlamaForCausalLM
    from kvflow.worker.kv_cache import allocate_kv_caches
    from support.tiny_models import LLAMA_LIKE, VOCAB

    config = LlamaConfig(**LLAMA_LIKE)  # the tiny shape tests/model/test_models.py checks
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(config).to(dtype)
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    ids = torch.randint(0, VOCAB, (9,), device=DEVICE)

    def logits(kernels) -> torch.Tensor:
        calls = []

        def counted(*tensors):
            calls.append(1)
            return kernels

        monkeypatch.setattr(layers, "fused_ops", counted)
        monkeypatch.setattr(linear, "fused_ops", counted)
        caches = allocate_kv_caches(config, 4, 16, dtype, DEVICE)
        meta = AttentionMetadata.build([9], [0], [[1]], 16, DEVICE)
        positions = torch.from_numpy(token_positions([9], [0])).to(DEVICE)
        with torch.inference_mode():
            out = model.compute_logits(model(ids, positions, caches, meta))
        assert len(calls) == 2 * 4 + 1  # per layer: two norms, rotary, silu_mul; final norm
        return out

    fused, plain = logits(ops), logits(None)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(fused, plain, atol=tol * plain.abs().max().item(), rtol=0)


@pytest.mark.parametrize("arch", ["llama3", "qwen3", "mistral-window"])
def test_models_with_the_triton_backend_give_the_reference_logits(arch) -> None:
    """Llama (llama3 rope), Qwen3 (q/k norm, a windowed layer), Mistral (window) through the
    Triton backend, which rotates q and k itself (`fuses_rotary`): the torch reference
    backend's logits for a prefill, then decodes, then a mixed step."""
    from kvflow.attention import AttentionMetadata, paged_attention, token_positions
    from kvflow.attention.triton_attn import triton_paged_attention
    from kvflow.model.llama import LlamaForCausalLM, MistralForCausalLM, Qwen3ForCausalLM
    from kvflow.worker.kv_cache import allocate_kv_caches
    from support.tiny_models import tiny_configs

    config = tiny_configs()[arch]
    cls = {"llama3": LlamaForCausalLM, "qwen3": Qwen3ForCausalLM}.get(arch, MistralForCausalLM)
    torch.manual_seed(0)
    models = []
    for backend in (triton_paged_attention, paged_attention):
        with torch.device(DEVICE):
            models.append(cls(config, attn_backend=backend))
    for p in models[0].parameters():
        p.data.normal_(0, 0.3)
    models[1].load_state_dict(models[0].state_dict())
    assert models[0].model.layers[0].self_attn.attn.fuses_rotary
    ids = torch.randint(0, config.vocab_size, (2, 12), device=DEVICE)
    # (query lengths, computed) per step of two requests: prefill, decodes, a mixed step
    steps = [([7, 5], [0, 0]), ([1, 1], [7, 5]), ([1, 1], [8, 6]), ([2, 1], [9, 7])]
    logits = []
    for model in models:
        caches = allocate_kv_caches(config, 8, 4, torch.float32, DEVICE)
        rows = []
        with torch.inference_mode():
            for q_lens, computed in steps:
                meta = AttentionMetadata.build(q_lens, computed, [[1, 2, 3], [4, 5, 6]], 4, DEVICE)
                tokens = torch.cat(
                    [
                        ids[b, c : c + n]
                        for b, (n, c) in enumerate(zip(q_lens, computed, strict=True))
                    ]
                )
                pos = torch.from_numpy(token_positions(q_lens, computed)).to(DEVICE)
                rows.append(model.compute_logits(model(tokens, pos, caches, meta)))
        logits.append(torch.cat(rows))
    torch.testing.assert_close(logits[0], logits[1], atol=1e-4, rtol=1e-4)


def _gemv_reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None):
    """(exact result in float64, bound on |kernel - exact|): half a bf16/fp16 step of the
    result (its rounding) plus float32 accumulation error over K products."""
    exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
    step = 2.0**-8 if x.dtype == torch.bfloat16 else 2.0**-11
    magnitude = x.double().abs() @ w.double().abs().T
    return exact, exact.abs() * step + magnitude * x.shape[1] * 2.0**-23 + 1e-30


@pytest.mark.parametrize("config", gemv._GEMV_CONFIGS, ids=str)
@pytest.mark.parametrize(
    "n, k, bias", [(37, 600, False), (64, 1024, True), (5, 40, True), (3, 9000, False)]
)
def test_gemv_every_tuning_config_matches_a_float64_product(config, n, k, bias) -> None:
    """Each config the tuner may pick (on the card it picks by speed alone): ragged N and K
    (masked rows and columns), K in one pass or (past 8192 columns) two, bias or not."""
    gen = torch.Generator().manual_seed(n * k)
    x = torch.randn(1, k, generator=gen).to(DEVICE, torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(DEVICE, torch.bfloat16)
    b = torch.randn(n, generator=gen).to(DEVICE, torch.bfloat16) if bias else None
    kwargs = dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)
    out = gemv.gemv(x, w, b, config=kwargs)
    exact, bound = _gemv_reference(x, w, b)
    assert out.shape == (1, n) and out.dtype == torch.bfloat16
    assert bool(((out.double() - exact).abs() <= bound).all())


def test_gemv_applies_only_to_one_half_precision_row() -> None:
    w = torch.zeros(8, 16, dtype=torch.bfloat16)
    assert tuning.gemv_applies(torch.zeros(1, 16, dtype=torch.bfloat16), w)
    assert not tuning.gemv_applies(torch.zeros(2, 16, dtype=torch.bfloat16), w)
    assert not tuning.gemv_applies(torch.zeros(1, 16), w.float())
    assert not tuning.gemv_applies(torch.zeros(1, 16, dtype=torch.bfloat16), w.T)


def _config_kwargs(config) -> dict:
    return dict(config.kwargs, num_warps=config.num_warps, num_stages=config.num_stages)


# the first configs give each program one tile; the walking ones (PER_SM 4: 16 programs under
# the interpreter, see `sm_count`) several
SOME_CONFIGS = gemv._GEMV_CONFIGS[:3] + [c for c in gemv._GEMV_CONFIGS if c.kwargs["PER_SM"]][:2]


@pytest.mark.parametrize("config", SOME_CONFIGS, ids=str)
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_gemv_is_rms_norm_then_gemv(config, with_residual) -> None:
    """The fused norm gives the row `rms_norm` gives (up to its sum of squares, added in
    another order), the stream x + residual goes to a new tensor (programs still read the
    old one), and the product is then `gemv`'s."""
    n, k = 24, 600
    gen = torch.Generator().manual_seed(7 + with_residual)
    x, residual = (torch.randn(1, k, generator=gen).to(DEVICE, torch.bfloat16) for _ in "xr")
    norm_w = (torch.rand(k, generator=gen) + 0.5).to(DEVICE, torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to(DEVICE, torch.bfloat16)
    kept = residual.clone()
    out, stream = gemv.rms_norm_gemv(
        x, residual if with_residual else None, norm_w, 1e-5, w, None, config=_config_kwargs(config)
    )
    assert torch.equal(residual, kept)  # read, never written
    expected_stream = x + residual if with_residual else x
    assert torch.equal(stream, expected_stream)
    normed = ops.rms_norm(x, norm_w, 1e-5, residual.clone() if with_residual else None)
    expected = gemv.gemv(normed, w, None, _config_kwargs(config))
    # equal, but where an element of the normed row came out a step apart (a float32 sum of
    # squares in another order): then close
    assert (out == expected).float().mean() >= 0.9
    assert float((out.float() - expected.float()).abs().max()) <= 1e-2 * float(expected.abs().max())


@pytest.mark.parametrize("config", SOME_CONFIGS, ids=str)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("inner, k", [(20, 300), (6, 9000)])
def test_gated_rms_norm_gemv_is_silu_mul_of_its_projection(config, bias, inner, k) -> None:
    """gated=True: silu(gate) * up of the gate | up projection, exactly what `silu_mul` makes
    of the same kernel's ungated output (the same sums, rounded at the same points); K in one
    pass (the weight rows loaded first) or, past 8192 columns, two."""
    gen = torch.Generator().manual_seed(13 + bias)
    x, residual = (torch.randn(1, k, generator=gen).to(DEVICE, torch.bfloat16) for _ in "xr")
    norm_w = (torch.rand(k, generator=gen) + 0.5).to(DEVICE, torch.bfloat16)
    w = (0.2 * torch.randn(2 * inner, k, generator=gen)).to(DEVICE, torch.bfloat16)
    b = torch.randn(2 * inner, generator=gen).to(DEVICE, torch.bfloat16) if bias else None
    kwargs = _config_kwargs(config)
    act, stream = gemv.rms_norm_gemv(x, residual, norm_w, 1e-5, w, b, config=kwargs, gated=True)
    gate_up, same_stream = gemv.rms_norm_gemv(x, residual, norm_w, 1e-5, w, b, kwargs)
    assert act.shape == (1, inner)
    assert torch.equal(act, ops.silu_mul(gate_up))
    assert torch.equal(stream, same_stream) and torch.equal(stream, x + residual)


@pytest.mark.parametrize("config", SOME_CONFIGS, ids=str)
def test_gated_gemv_is_silu_mul_of_the_projection(config) -> None:
    """gemv(gated=True) without a norm: exactly `silu_mul` of the ungated kernel's output."""
    inner, k = 20, 300
    gen = torch.Generator().manual_seed(21)
    x = torch.randn(1, k, generator=gen).to(DEVICE, torch.bfloat16)
    w = (0.2 * torch.randn(2 * inner, k, generator=gen)).to(DEVICE, torch.bfloat16)
    kwargs = _config_kwargs(config)
    act = gemv.gemv(x, w, None, kwargs, gated=True)
    assert act.shape == (1, inner)
    assert torch.equal(act, ops.silu_mul(gemv.gemv(x, w, None, kwargs)))


@pytest.mark.parametrize("norm_fusion", [True, False], ids=["no-pdl", "pdl"])
def test_a_llama_decode_row_through_the_one_row_kernels(monkeypatch, norm_fusion) -> None:
    """A tiny bf16 Llama's one-token decode step as on a card where every one-row kernel wins
    (`gemv_wins` answering yes): each projection goes through gemv or rms_norm_gemv (gated for
    gate | up; float32 out for the logits; with PDL, `norm_fusion_pays` says no: the norms'
    own kernels, then gemv, gated for gate | up), each question names the (row, weight) pair it multiplies, both timed
    alternatives run (and agree, but for the norms', timed without the residual), and the
    logits are those of the same step through the separate kernels."""
    from transformers import LlamaConfig

    from kvflow.attention import AttentionMetadata, token_positions
    from kvflow.model.llama import LlamaForCausalLM
    from kvflow.worker.kv_cache import allocate_kv_caches
    from support.tiny_models import LLAMA_LIKE, VOCAB

    config = LlamaConfig(**LLAMA_LIKE)
    torch.manual_seed(0)
    with torch.device(DEVICE):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    for p in model.parameters():
        p.data.normal_(0, 0.3)
    ids = torch.randint(0, VOCAB, (9,), device=DEVICE)
    asked, depth = [], []

    def wins(what, x, weight, bias, ours, theirs) -> bool:
        assert x.shape == (1, weight.shape[1]), (what, x.shape, weight.shape)
        if depth:
            return use_gemv
        asked.append(what)
        depth.append(1)  # `theirs` asks again about its own projection: not recorded
        a, b = ours(), theirs()  # the same projection (the norms' are timed without residual)
        depth.pop()
        if what in ("linear", "logits"):  # logits: float32 from the kernel, as the fallback
            assert a.dtype == b.dtype == (torch.float32 if what == "logits" else torch.bfloat16)
            torch.testing.assert_close(a, b, atol=2e-2 * b.abs().max().item(), rtol=0)
        return use_gemv

    monkeypatch.setattr(layers, "fused_ops", lambda *tensors: ops)
    monkeypatch.setattr(linear, "fused_ops", lambda *tensors: ops)
    monkeypatch.setattr(linear, "one_row_ops", lambda x: gemv if len(x) == 1 else None)
    monkeypatch.setattr(tuning, "gemv_wins", wins)
    monkeypatch.setattr(tuning, "norm_fusion_pays", lambda: norm_fusion)

    def decode_logits() -> torch.Tensor:
        caches = allocate_kv_caches(config, 4, 16, torch.bfloat16, DEVICE)
        with torch.inference_mode():
            for start, n in ((0, 8), (8, 1)):  # prefill 8 tokens, then decode the 9th
                meta = AttentionMetadata.build([n], [start], [[1]], 16, DEVICE)
                pos = torch.from_numpy(token_positions([n], [start])).to(DEVICE)
                hidden = model(ids[start : start + n], pos, caches, meta)
            return model.compute_logits(hidden)

    use_gemv = False
    separate = decode_logits()
    use_gemv, asked = True, []
    fused = decode_logits()
    per_layer = ["norm", "linear", "norm+silu", "linear"]  # qkv, o_proj, gate_up, down
    if not norm_fusion:
        per_layer = ["linear", "linear", "silu", "linear"]
    assert asked == per_layer * config.num_hidden_layers + ["logits"]  # then the logits head
    assert fused.dtype == torch.float32
    torch.testing.assert_close(fused, separate, atol=2e-2 * separate.abs().max().item(), rtol=0)


def test_gemv_tiles_are_kept_to_64_elements_per_thread() -> None:
    """A tile [BLOCK_N, BLOCK_K] (two with gate | up) holds at most 64 elements per thread; a
    program that walks tiles (PER_SM > 0) holds two tiles, and walks only where K is one pass."""

    def kept(block_k: int, gated: bool = False, one_pass: bool = True) -> set:
        configs = gemv._fitting_configs(
            gemv._GEMV_CONFIGS, {}, BLOCK_K=block_k, GATED=gated, ONE_PASS=one_pass
        )
        return {(c.kwargs["BLOCK_N"], c.num_warps, c.kwargs["PER_SM"]) for c in configs}

    one_tile = {(1, 4), (2, 4), (4, 4), (1, 8), (2, 8), (4, 8), (8, 8)}
    two_tiles = {(1, 4), (2, 4), (1, 8), (2, 8), (4, 8)}
    walking = {(n, w, 4) for n, w in two_tiles}
    assert kept(2048) == {(n, w, 0) for n, w in one_tile} | walking
    assert kept(2048, gated=True) == {(n, w, 0) for n, w in two_tiles} | {
        (n, w, 4) for n, w in {(1, 4), (1, 8), (2, 8)}
    }
    assert kept(8192, one_pass=False) == {(1, 4, 0), (1, 8, 0), (2, 8, 0)}


@pytest.mark.parametrize("vocab", [5000, 2048, 4097, 7, 1], ids=str)
def test_argmax_rows_is_torch_argmax_and_the_bad_flag(vocab: int) -> None:
    """torch.argmax's index (the first of tied maxima, inside and across chunks; the first NaN)
    and the flag of rows whose maximum is not finite, at batch 1 and larger."""
    from support.logit_rows import hard_rows

    for logits in hard_rows(vocab, torch.Generator().manual_seed(vocab)):
        for batch in (logits[:1], logits):
            out = argmax.argmax_rows(batch.to(DEVICE))
            assert out.shape == (2, batch.shape[0]) and out.dtype == torch.int64
            assert torch.equal(out[0].cpu(), batch.argmax(dim=-1))
            bad = ~torch.isfinite(batch.amax(dim=-1))
            assert torch.equal(out[1].cpu(), bad.long())
