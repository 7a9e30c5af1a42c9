"""A GGUF read in place: random-weight GGUFs of a small Llama-3 shape (Q4_0, Q8_0, made by
`benchmarks/make_checkpoints.py`, an untied head) give transformers' float32 logits for the
same file, dequantized (`--quantization none`) or served as stored (`gguf`, within a bound per
block type); loading the embedded GGUF holds no more than the weights it keeps (VmHWM)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvflow.attention import AttentionMetadata, token_positions
from kvflow.attention.cpu import cpu_paged_attention
from kvflow.model.loader import load_model, load_transformers_model, resolve_model
from kvflow.worker.kv_cache import allocate_kv_caches

ROOT = Path(__file__).resolve().parents[2]
IDS = [1, 504, 3575, 282, 4649, 314, 28, 3459, 9, 2]
# --quantization gguf in float32 against transformers' float32 dequantization of the same file:
# the same weight values, summed in another order (measured: 3.6e-7 for Q4_0, 3.0e-7 for Q8_0,
# on logits of scale ~0.7).
GGUF_BOUNDS = {"q4_0": 1e-5, "q8_0": 1e-5}  # max |logit difference|


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gguf")
    out = {}
    for kind in GGUF_BOUNDS:
        out[kind] = root / f"tiny-{kind}.gguf"
        cmd = [sys.executable, str(ROOT / "benchmarks" / "make_checkpoints.py"), "--shape"]
        cmd += ["tiny", "--format", f"gguf-{kind}", "--out", str(out[kind]), "--seed", "3"]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
    return out


def test_llama3_rope_factors_come_from_the_file(files, tmp_path, monkeypatch) -> None:
    """llama.cpp stores Llama 3's rope scaling as the `rope_freqs` tensor, which transformers'
    GGUF reader drops: kvflow's rotary frequencies for the GGUF are those transformers computes
    from the same shape's safetensors config (rope_type llama3), not the unscaled ones."""
    from kvflow.model.layers import RotaryEmbedding
    from kvflow.model.loader import load_config

    monkeypatch.setenv("KVFLOW_CACHE", str(tmp_path))
    out = tmp_path / "tiny-bf16"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "make_checkpoints.py"), "--shape", "tiny"]
    cmd += ["--format", "safetensors-bf16", "--out", str(out), "--seed", "3"]
    assert subprocess.run(cmd, capture_output=True, timeout=600).returncode == 0
    reference = load_config(out)
    assert reference.rope_parameters["rope_type"] == "llama3"
    gguf = load_config(resolve_model(str(files["q8_0"])))
    head_dim = reference.hidden_size // reference.num_attention_heads
    ours, theirs = (RotaryEmbedding(c, head_dim).inv_freq for c in (gguf, reference))
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    unscaled = 1.0 / reference.rope_parameters["rope_theta"] ** (
        torch.arange(0, head_dim, 2).float() / head_dim
    )
    assert not torch.allclose(ours, unscaled, rtol=1e-3)


def _logits(model, hf_config) -> torch.Tensor:
    """Every position's logits for IDS, prefilled in one step through the paged cache, then
    the last token again as a decode step (the kernels' decode rows)."""
    caches = allocate_kv_caches(hf_config, 4, 16, torch.float32, "cpu")
    n = len(IDS) - 1
    with torch.inference_mode():
        meta = AttentionMetadata.build([n], [0], [[1]], 16, "cpu")
        positions = torch.from_numpy(token_positions([n], [0]))
        prefill = model.compute_logits(model(torch.tensor(IDS[:n]), positions, caches, meta))
        meta = AttentionMetadata.build([1], [n], [[1]], 16, "cpu")
        positions = torch.from_numpy(token_positions([1], [n]))
        decode = model.compute_logits(model(torch.tensor(IDS[n:]), positions, caches, meta))
    return torch.cat([prefill, decode]).float()


@pytest.mark.parametrize("kind", sorted(GGUF_BOUNDS))
def test_logits_are_transformers_for_the_same_file(files, kind, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVFLOW_CACHE", str(tmp_path))
    path = resolve_model(str(files[kind]))
    floats, hf_config = load_model(path, torch.float32, attn_backend=cpu_paged_attention)
    reference = load_transformers_model(path, torch.float32)
    # its GGUF reader drops the file's rope factors: given the llama3 frequencies (equal to
    # transformers' own for the shape: test_llama3_rope_factors_come_from_the_file)
    reference.model.rotary_emb.inv_freq = floats.model.rotary_emb.inv_freq.clone()
    with torch.inference_mode():
        expected = reference(torch.tensor([IDS])).logits[0]
    torch.testing.assert_close(_logits(floats, hf_config), expected, atol=1e-4, rtol=1e-4)
    stored, _ = load_model(
        path, torch.float32, attn_backend=cpu_paged_attention, quantization="gguf"
    )
    kinds = {m.quant.kind for m in stored.modules() if getattr(m, "quant", None) is not None}
    assert kind.upper() in kinds  # the projections' blocks, as stored
    gap = (_logits(stored, hf_config) - expected).abs().max().item()
    assert gap < GGUF_BOUNDS[kind], f"{kind}: max |logit difference| {gap:.4f}"
    assert not [p for p in tmp_path.rglob("*") if p.stat().st_size > 4 << 20]


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "phi3"])
def test_qwen_and_phi3_files_give_transformers_logits(arch, tmp_path, monkeypatch) -> None:
    """Qwen2's q/k/v biases and Qwen3's q/k norms and 128-wide heads (wider than hidden /
    heads; the file's key length, which transformers' config reader leaves out), and Phi-3's
    fused attn_qkv and ffn_up (gate | up), read in place: llama.cpp keeps their q/k rows in the
    checkpoint's order (no llama permutation); a fused tensor's blocks are cut into its
    shards' rows (`gguf`), its floats likewise (`none`)."""
    monkeypatch.setenv("KVFLOW_CACHE", str(tmp_path / "cache"))
    file = tmp_path / f"tiny-{arch}.gguf"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "make_checkpoints.py"), "--shape"]
    cmd += [f"tiny-{arch}", "--format", "gguf-q8_0", "--out", str(file), "--seed", "4"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    path = resolve_model(str(file))
    reference = load_transformers_model(path, torch.float32)
    assert type(reference).__name__ == f"{arch.capitalize()}ForCausalLM"
    with torch.inference_mode():
        expected = reference(torch.tensor([IDS])).logits[0]
    for method in ("none", "gguf"):
        model, hf_config = load_model(
            path, torch.float32, attn_backend=cpu_paged_attention, quantization=method
        )
        gap = (_logits(model, hf_config) - expected).abs().max().item()
        assert gap < GGUF_BOUNDS["q8_0"], f"{arch} {method}: max |logit difference| {gap}"


def test_phi3_longrope_comes_from_the_file(tmp_path, monkeypatch) -> None:
    """llama.cpp stores Phi-3-128k's LongRoPE as two factor tensors and two keys, which
    transformers' GGUF reader drops: kvflow's config for the file has them, so positions from
    the original context on rotate by the file's long factors (the short ones of the tiny shape
    are 1, its attention factor 1: below that context, transformers' logits above hold)."""
    from kvflow.model.layers import RotaryEmbedding
    from kvflow.model.loader import load_config

    monkeypatch.setenv("KVFLOW_CACHE", str(tmp_path / "cache"))
    file = tmp_path / "tiny-phi3.gguf"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "make_checkpoints.py"), "--shape"]
    cmd += ["tiny-phi3", "--format", "gguf-q8_0", "--out", str(file), "--seed", "4"]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    config = load_config(resolve_model(str(file)))
    assert config.rope_parameters["rope_type"] == "longrope"
    head_dim = config.hidden_size // config.num_attention_heads
    rotary = RotaryEmbedding(config, head_dim)
    start, long_freq = rotary.long
    assert start == 4096 and rotary.attention_scaling == 1.0
    base = 1.0 / config.rope_parameters["rope_theta"] ** (
        torch.arange(0, head_dim, 2).float() / head_dim
    )
    torch.testing.assert_close(rotary.inv_freq, base, rtol=1e-6, atol=0)
    long_factors = 1.0 + 0.5 * torch.arange(head_dim // 2).float()  # the shape's (make_checkpoints)
    torch.testing.assert_close(long_freq, base / long_factors, rtol=1e-6, atol=0)


PEAK_SCRIPT = """
import sys, torch
from kvflow.model.layers import Embedding
from kvflow.model.linear import Linear
from kvflow.model.loader import load_config, load_model, resolve_model
import kvflow.model.gguf_weights, kvflow.model.quantize, gguf, safetensors

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

path = resolve_model(None)
load_config(path)  # transformers' modules in before the baseline
base = status("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # VmHWM from here: not the cache's write
model, _ = load_model(path, torch.bfloat16, quantization=sys.argv[1])
held = sum(p.numel() * p.element_size() for p in model.parameters())
quantized = [m.quant for m in model.modules() if isinstance(m, Linear | Embedding)]
held += sum(q.nbytes for q in quantized if q is not None)
print(held, status("VmHWM:") - base)
"""


@pytest.mark.parametrize("method", ["gguf", "none"])
def test_loading_a_gguf_peaks_at_the_weights_it_keeps(method) -> None:
    """No float copy of the model and no mapped file beside what is kept: the load's peak
    above the process before it is at most 1.2x the weights held (blocks as stored, or bf16)
    plus 16 MiB."""
    done = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, method], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    held, peak = map(int, done.stdout.split()[-2:])
    assert held > 80 << 20
    assert peak <= 1.2 * held + (16 << 20), (
        f"{method}: peak {peak >> 20} MiB, held {held >> 20} MiB"
    )
