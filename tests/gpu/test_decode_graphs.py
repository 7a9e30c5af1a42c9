"""DecodeGraphs' padded decode forward against the plain forward, on the CPU (capture=False).

The padded path is what CUDA graphs replay: batches of 3, 5 and 9 requests run at buckets 4, 8
and 16, the extra rows aimed at the null block. On tiny random float32 checkpoints (shuffled,
non-contiguous block ids, contexts crossing block boundaries) hidden states and logits must
match the plain forward's, and the KV cache must change only at the real rows' slots (block 0,
the null block, may change). Successive steps through one DecodeGraphs object check that no
state of an earlier step (block-table columns, memoised masks) leaks into a later one.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from kvflow.model import load_model
from kvflow.worker.cuda_graphs import DecodeGraphs, decode_buckets, pack_inputs
from kvflow.worker.kv_cache import allocate_kv_caches
from support.decode_steps import (
    BLOCK_SIZE,
    MAX_MODEL_LEN,
    NUM_BLOCKS,
    Batch,
    check_step,
    graph_config,
    randomize,
)

ARCHS = ["llama3", "llama-mqa", "mistral-window", "qwen3"]


@pytest.fixture(scope="module", params=ARCHS)
def loaded(request, tmp_path_factory):
    hf = AutoModelForCausalLM.from_config(graph_config(request.param), dtype=torch.float32)
    randomize(hf, seed=ARCHS.index(request.param))
    path = tmp_path_factory.mktemp(request.param)
    hf.save_pretrained(path)
    return load_model(path, torch.float32)


@pytest.mark.parametrize("num_reqs", [3, 5, 9])
def test_padded_decode_equals_plain_forward(loaded, num_reqs) -> None:
    model, hf_config = loaded
    lens = [1, 4, 7, 8, 13, 16, 3, 11, 20][:num_reqs]
    batch = Batch(model, hf_config, lens, seed=num_reqs)
    graphs = DecodeGraphs(model, batch.caches, BLOCK_SIZE, MAX_MODEL_LEN, 16, "cpu", capture=False)
    assert not graphs.use_graphs
    check_step(model, graphs, batch.caches, batch.decode_inputs(list(range(num_reqs))))
    assert graphs.steps == {graphs.bucket_for(num_reqs): 1}
    assert graphs.bucket_for(num_reqs) > num_reqs  # padding was really exercised


def test_successive_steps_share_no_state(loaded) -> None:
    """Shrinking and growing batches and contexts through one object: each step is exact."""
    model, hf_config = loaded
    batch = Batch(model, hf_config, [20, 2, 9, 5, 14, 1, 7, 12, 3], seed=11)
    graphs = DecodeGraphs(model, batch.caches, BLOCK_SIZE, MAX_MODEL_LEN, 16, "cpu", capture=False)
    schedule = [
        list(range(9)),  # bucket 16, widest row 6 blocks
        [1, 3, 5],  # bucket 4, short contexts only: the table narrows
        [8, 0, 2, 6, 4],  # bucket 8, the long request again, in another order
        [5],  # bucket 1
        [7, 1],  # bucket 2
    ]
    for rows in schedule:
        check_step(model, graphs, batch.caches, batch.decode_inputs(rows))
    assert sorted(graphs.steps) == [1, 2, 4, 8, 16]


def test_buckets() -> None:
    assert decode_buckets(256) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert decode_buckets(1000) == [1, 2, 4, 8, 16, 32, 64, 128, 256]
    assert decode_buckets(16) == [1, 2, 4, 8, 16]
    assert decode_buckets(100) == [1, 2, 4, 8, 16, 32, 64, 100]
    assert decode_buckets(1) == [1]


def test_rows_beyond_their_blocks_are_refused(loaded) -> None:
    model, hf_config = loaded
    caches = allocate_kv_caches(hf_config, NUM_BLOCKS, BLOCK_SIZE, torch.float32, "cpu")
    graphs = DecodeGraphs(model, caches, BLOCK_SIZE, MAX_MODEL_LEN, 8, "cpu", capture=False)
    assert graphs.fits(8) and not graphs.fits(9) and not graphs.fits(0)
    with pytest.raises(ValueError, match="blocks for their positions"):
        graphs.run(*pack_inputs([5], [4], [[3]]))  # position 4 needs a second block of 4
    with pytest.raises(ValueError, match="largest bucket"):
        graphs.run(*pack_inputs([5] * 9, [0] * 9, [[3]] * 9))
