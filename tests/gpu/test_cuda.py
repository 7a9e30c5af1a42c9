"""CUDA only (marked `gpu`, skipped without a device): graph replay, the engine, the kernel.

- DecodeGraphs captured on CUDA (Triton backend): capturing writes nothing but the null block,
  and each replay equals the same padded forward run eagerly and the plain forward, through
  batches of changing size and context (the kernel's decode path reads them from the static
  buffers; it builds no tile map).
- The engine on CUDA, float32 greedy: graphs on, --enforce-eager and the CPU engine agree.
- The Triton kernel on the GPU over tests/attention/test_triton_attn.py's cases, with its
  output buffer NaN-filled so an element it never writes is caught.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from kvflow import LLM, SamplingParams
from kvflow.model import load_model
from kvflow.worker.cuda_graphs import DecodeGraphs
from support.attention_cases import CASES, check_case, setup_case
from support.decode_steps import MAX_MODEL_LEN, Batch, check_step, randomize
from support.tiny_models import word_tokenizer

pytestmark = pytest.mark.gpu

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent


def load_file(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=192,
        max_position_embeddings=256,
        tie_word_embeddings=True,
    )
    hf = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    randomize(hf, seed=1, embed_std=0.1)
    path = tmp_path_factory.mktemp("cuda-llama")
    hf.save_pretrained(path)
    word_tokenizer(256).save_pretrained(path)
    return path


def triton_model(path: Path, dtype: torch.dtype):
    from kvflow.attention.triton_attn import triton_paged_attention

    return load_model(path, dtype, "cuda", attn_backend=triton_paged_attention)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_graph_replay_equals_eager(checkpoint, dtype) -> None:
    model, hf_config = triton_model(checkpoint, dtype)
    batch = Batch(model, hf_config, [20, 2, 9, 5, 14, 1, 7, 12, 3], seed=4, device="cuda")
    graphs = DecodeGraphs(model, batch.caches, 4, MAX_MODEL_LEN, 16, "cuda")
    assert graphs.use_graphs
    before = [c.clone() for c in batch.caches]
    graphs.capture()
    for cache, old in zip(batch.caches, before, strict=True):
        assert torch.equal(cache[:, 1:], old[:, 1:]), "capture wrote outside the null block"
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    for rows in ([*range(9)], [1, 3, 5], [8, 0, 2, 6, 4], [5], [7, 1], [*range(9)]):
        inputs = batch.decode_inputs(rows)
        state = [c.clone() for c in batch.caches]
        replayed = check_step(model, graphs, batch.caches, inputs, tol=tol)
        # the same step again from the same state, the padded forward run eagerly
        eager = DecodeGraphs(model, state, 4, MAX_MODEL_LEN, 16, "cuda", capture=False)
        torch.testing.assert_close(
            replayed, check_step(model, eager, state, inputs, tol=tol), atol=tol / 10, rtol=tol / 10
        )
    assert sorted(graphs.steps) == [1, 2, 4, 8, 16]


def test_engine_graphs_eager_and_cpu_agree(checkpoint) -> None:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(2, 256, (n,), generator=gen).tolist() for n in (3, 17, 9, 30, 1)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    kw = dict(dtype="float32", num_blocks=64, block_size=4, max_num_seqs=8)

    def run(**extra) -> tuple[list[list[int]], LLM]:
        llm = LLM(str(checkpoint), **kw, **extra)
        return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params)], llm

    graphs_out, llm = run(device="cuda")
    graphs = llm.engine.core.runner.decode_graphs
    assert graphs is not None and sum(graphs.steps.values()) > 0
    eager_out, eager = run(device="cuda", enforce_eager=True)
    assert eager.engine.core.runner.decode_graphs is None
    cpu_out, _ = run(device="cpu")
    assert graphs_out == eager_out == cpu_out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_triton_cases_on_the_gpu_write_every_output(dtype) -> None:
    check = load_file(REPO / "benchmarks" / "gpu_check.py", "gpu_check")
    for computed, q_lens, hq, hkv, dim, block_size, window in CASES.values():
        inputs = setup_case(computed, q_lens, hq, hkv, dim, block_size, dtype, seed=dim)
        with check.nan_filled_outputs():
            check_case(*inputs, window=window)


@pytest.mark.parametrize("n, k", [(3072, 2048), (2048, 8192), (576, 1536)])
def test_one_row_linear_takes_the_faster_kernel_and_agrees(n, k) -> None:
    """`linear` of one bf16 row on CUDA: timed once per shape against cuBLAS, then the winner;
    either way the result is the float64 product rounded (within bf16's half step)."""
    from kvflow.kernels import tuning
    from kvflow.model import linear

    gen = torch.Generator().manual_seed(n + k)
    x = torch.randn(1, k, generator=gen).to("cuda", torch.bfloat16)
    w = torch.randn(n, k, generator=gen).to("cuda", torch.bfloat16)
    out = linear.linear(x, w, None, None)
    assert ("linear", n, k, torch.bfloat16, False) in tuning._GEMV_TIMES
    exact = x.double() @ w.double().T
    bound = exact.abs() * 2.0**-8 + (x.double().abs() @ w.double().abs().T) * k * 2.0**-23
    assert bool(((out.double() - exact).abs() <= bound).all())


def test_programmatic_dependent_launch_is_on_where_the_card_has_it() -> None:
    """sm_90 and newer: the probe (a chain of PDL launches, eager and in a graph) passes, so
    the decode kernels launch with PDL; older cards launch them plainly."""
    from kvflow.kernels.triton.pdl import pdl_args

    has_it = torch.cuda.get_device_capability() >= (9, 0)
    assert pdl_args() == dict(PDL=has_it, launch_pdl=has_it)


def test_greedy_sampling_on_the_card_matches_the_cpu() -> None:
    """The CUDA sampler's two kernels (`kernels.triton.argmax.argmax_rows`) give the CPU sampler's
    tokens and bad rows: ties, a NaN, +inf, all -inf, a masked -inf."""
    from kvflow.sampling_params import SamplingParams
    from kvflow.worker.sampler import SamplingMetadata, TokenHistory, sample

    rows, vocab = 6, 128256
    logits = torch.randint(0, 3, (rows, vocab), generator=torch.Generator().manual_seed(3))
    logits = logits.float()
    logits[1, 77] = float("nan")
    logits[2, 5] = float("inf")
    logits[3] = float("-inf")
    logits[4, :1000] = float("-inf")
    history = TokenHistory.from_lists([[]] * rows, [[]] * rows)
    params = [SamplingParams(temperature=0.0)] * rows
    outs = []
    for device in ("cpu", "cuda"):
        meta = SamplingMetadata.build(
            params, history, [None] * rows, eos_token_id=0, vocab_size=vocab, device=device
        )
        out = sample(logits.to(device), meta)
        outs.append((out.token_ids, out.bad_rows))
    assert outs[1] == outs[0] and outs[0][1] == [1, 2, 3]
