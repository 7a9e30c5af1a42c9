"""A safetensors checkpoint read in place (`model/safetensors_file.py`): a sharded checkpoint
loads the files its index names and gives transformers' logits, a shard the index names and
the directory lacks is named, and the load's peak above the process before it stays at the
weights it keeps (no mapped file beside the model)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from kvflow.attention import AttentionMetadata, token_positions
from kvflow.attention.cpu import cpu_paged_attention
from kvflow.model.loader import load_model
from kvflow.model.safetensors_file import checkpoint_elements
from kvflow.worker.kv_cache import allocate_kv_caches

IDS = [1, 504, 3575, 282, 4649, 314, 28, 3459, 9, 2]


def write_sharded(model: torch.nn.Module, out: Path, shards: int) -> None:
    """`model`'s state in bf16 as `shards` files and their index, the way save_pretrained
    shards a checkpoint, plus a stray file no index names (a consolidated copy of another
    model), which a load must not read."""
    config = model.config
    config.dtype = "bfloat16"
    config.to_json_file(out / "config.json")
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    names = list(state)
    weight_map = {}
    for n in range(shards):
        file = f"model-{n + 1:05d}-of-{shards:05d}.safetensors"
        part = names[n::shards]
        save_file({k: state[k] for k in part}, out / file, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index))
    save_file({"lm_head.weight": torch.zeros(3, 3)}, out / "consolidated.safetensors")


def tiny_llama(seed: int, **shape) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=8192,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
        **shape,
    )
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def sharded(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("sharded")
    model = tiny_llama(0, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
    write_sharded(model, out, shards=3)
    return out


def _logits(model, hf_config) -> torch.Tensor:
    n = len(IDS)
    blocks = [list(range(1, 1 + (n + 15) // 16))]
    meta = AttentionMetadata.build([n], [0], blocks, 16, "cpu")
    caches = allocate_kv_caches(hf_config, 8, 16, torch.float32, "cpu")
    positions = torch.from_numpy(token_positions([n], [0]))
    with torch.no_grad():
        hidden = model(torch.tensor(IDS), positions, caches, meta)
        return model.compute_logits(hidden)


def test_a_sharded_checkpoint_gives_transformers_logits(sharded: Path) -> None:
    reference = LlamaForCausalLM.from_pretrained(str(sharded), dtype=torch.float32).eval()
    with torch.no_grad():
        expected = reference(torch.tensor([IDS])).logits[0]
    model, hf_config = load_model(sharded, torch.float32, attn_backend=cpu_paged_attention)
    assert (_logits(model, hf_config) - expected).abs().max().item() < 1e-4
    # the index's files alone: the stray file's 9 elements are not the checkpoint's
    assert checkpoint_elements(sharded) == sum(p.numel() for p in reference.parameters())


def test_a_shard_the_index_names_and_the_directory_lacks_is_named(sharded, tmp_path) -> None:
    for file in sharded.iterdir():
        if "00002-of" not in file.name:
            (tmp_path / file.name).symlink_to(file)
    with pytest.raises(ValueError, match="model-00002-of-00003.safetensors"):
        load_model(tmp_path, torch.float32)


PEAK_SCRIPT = """
import sys, torch
from pathlib import Path
from kvflow.model.loader import load_config, load_model
import kvflow.model.safetensors_file, numpy

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

path = Path(sys.argv[1])
load_config(path)  # transformers' modules in before the baseline
base = status("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # VmHWM from here: not the cache's write
model, _ = load_model(path, torch.bfloat16)
held = sum(p.numel() * p.element_size() for p in model.parameters())
print(held, status("VmHWM:") - base)
"""


def test_loading_safetensors_peaks_at_the_weights_it_keeps(tmp_path) -> None:
    """The load's peak above the process before it is at most 1.2x the bf16 weights held
    plus 16 MiB: each tensor is copied from a mapping of its own bytes, gone once copied (a
    whole file mapped at once kept every page read resident: 1.62x for a 1B checkpoint)."""
    model = tiny_llama(1, hidden_size=768, intermediate_size=3072, num_hidden_layers=6)
    write_sharded(model, tmp_path, shards=2)
    del model
    done = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    held, peak = map(int, done.stdout.split()[-2:])
    assert held > 120 << 20
    assert peak <= 1.2 * held + (16 << 20), f"peak {peak >> 20} MiB, held {held >> 20} MiB"
