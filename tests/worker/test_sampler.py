"""Sampler semantics against hand computations on small tensors."""

from __future__ import annotations

import math

import pytest
import torch

from kvflow.sampling_params import SamplingParams
from kvflow.worker.greedy import chunked_argmax, row_argmax
from kvflow.worker.sampler import (
    SamplingMetadata,
    TokenHistory,
    apply_penalties,
    apply_top_k,
    apply_top_k_top_p,
    sample,
)

V = 16
EOS = 3


def build(
    params: list[SamplingParams],
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
    vocab: int = V,
) -> SamplingMetadata:
    n = len(params)
    return SamplingMetadata.build(
        params,
        TokenHistory.from_lists(
            prompts if prompts is not None else [[] for _ in range(n)],
            outputs if outputs is not None else [[] for _ in range(n)],
        ),
        generators if generators is not None else [None] * n,
        eos_token_id=EOS,
        vocab_size=vocab,
        device="cpu",
    )


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def rand_logits(batch: int, seed: int = 0, vocab: int = V) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=gen(seed)) * 3


def test_greedy_is_argmax_and_builds_nothing() -> None:
    logits = rand_logits(6)
    meta = build([SamplingParams(temperature=0.0)] * 6)
    assert meta.all_greedy and meta.temperature is None and meta.top_k is None
    assert not meta.has_penalties and meta.min_tokens_mask is None
    out = sample(logits, meta)
    assert torch.equal(out.sampled, logits.argmax(-1))
    assert out.bad_rows == [] and out.logprobs is None


def test_mixed_batch_greedy_rows_take_argmax() -> None:
    logits = rand_logits(8, seed=1)
    params = [SamplingParams(temperature=0.0 if i % 2 else 1.0) for i in range(8)]
    meta = build(params)
    assert not meta.all_greedy and not meta.all_random
    out = sample(logits, meta)
    assert torch.equal(out.sampled[1::2], logits.argmax(-1)[1::2])


def test_top_k_1_and_tiny_top_p_are_greedy() -> None:
    logits = rand_logits(32, seed=2)
    for p in (SamplingParams(temperature=1.5, top_k=1), SamplingParams(top_p=1e-6)):
        torch.manual_seed(0)
        out = sample(logits, build([p] * 32))
        assert torch.equal(out.sampled, logits.argmax(-1))


def test_top_k_keeps_only_k_largest() -> None:
    logits = rand_logits(4, seed=3).repeat(50, 1)
    torch.manual_seed(1)
    out = sample(logits, build([SamplingParams(temperature=2.0, top_k=3)] * 200))
    allowed = logits[:4].topk(3, dim=-1).indices.repeat(50, 1)
    assert (allowed == out.sampled.unsqueeze(1)).any(dim=1).all()


def test_top_k_alone_matches_the_sorting_path() -> None:
    logits = rand_logits(6, seed=9)
    top_k = torch.tensor([0, 1, 2, 5, 15, 3])
    fast = apply_top_k(logits, top_k, max_top_k=15)
    sorted_path = apply_top_k_top_p(logits, top_k, torch.ones(6))
    assert torch.equal(fast, sorted_path)
    assert (fast.isfinite().sum(-1) == torch.tensor([V, 1, 2, 5, 15, 3])).all()


def test_top_p_keeps_smallest_set_reaching_p() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log().repeat(300, 1)
    torch.manual_seed(2)
    out = sample(logits, build([SamplingParams(top_p=0.7)] * 300, vocab=4))
    assert set(out.sampled.tolist()) == {0, 1}


def test_min_p_filters_relative_to_max() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log().repeat(400, 1)
    torch.manual_seed(3)
    out = sample(logits, build([SamplingParams(min_p=0.25)] * 400, vocab=4))
    # threshold 0.25 * 0.5 = 0.125: tokens 0, 1, 2 stay, token 3 goes.
    assert set(out.sampled.tolist()) == {0, 1, 2}


def test_repetition_penalty_hand_computed() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5]])
    meta = build([SamplingParams(repetition_penalty=2.0)], [[0, 1]], [[1, 2]], vocab=5)
    got = apply_penalties(logits.clone(), meta)
    assert torch.equal(got, torch.tensor([[1.0, -4.0, 0.5, -1.0, 0.5]]))


def test_frequency_and_presence_penalties_hand_computed() -> None:
    logits = torch.zeros(2, 5)
    params = [
        SamplingParams(frequency_penalty=0.5),
        SamplingParams(presence_penalty=1.5, frequency_penalty=-0.25),
    ]
    # The prompt never counts for these two penalties.
    meta = build(params, [[4, 4], [4]], [[0, 0, 0, 2], [1, 1, 3]], vocab=5)
    assert meta.repetition_penalties is None and meta.prompt_token_ids is None
    got = apply_penalties(logits.clone(), meta)
    expected = torch.tensor(
        [
            [-1.5, 0.0, -0.5, 0.0, 0.0],
            [0.0, -1.5 + 0.5, 0.0, -1.5 + 0.25, 0.0],
        ]
    )
    assert torch.allclose(got, expected)


def test_penalties_change_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0]])
    meta = build([SamplingParams(temperature=0.0, presence_penalty=0.5)], [[]], [[0]], vocab=4)
    assert sample(logits, meta).sampled.tolist() == [1]


def test_logit_bias_comes_before_the_repetition_penalty_and_leaves_logprobs_raw() -> None:
    """vLLM's order: the bias is added first, then the penalty scales the biased logit."""
    logits = torch.tensor([[2.0, 1.0, 0.0, 0.0], [2.0, 1.0, 0.0, 0.0]])
    params = [
        SamplingParams(temperature=0.0, logit_bias={"1": 2.0, 3: -500.0}, repetition_penalty=2.0),
        SamplingParams(temperature=0.0, logprobs=1),
    ]
    assert params[0].logit_bias == {1: 2.0, 3: -100.0}  # ids from JSON strings; clamped
    meta = build(params, [[1], [1]], [[], []], vocab=4)
    got = apply_penalties(logits.clone(), meta)
    assert torch.equal(got, torch.tensor([[2.0, 1.5, 0.0, -100.0], [2.0, 1.0, 0.0, 0.0]]))
    plain = SamplingParams(temperature=0.0, logit_bias={2: 5.0}, logprobs=1)
    out = sample(logits[:1], build([plain], vocab=4))
    assert out.sampled.tolist() == [2]  # the bias moved the argmax
    assert out.logprobs[0].logprob == pytest.approx(logits[0].log_softmax(-1)[2].item())
    with pytest.raises(ValueError, match="cannot be converted to integer token IDs"):
        SamplingParams(logit_bias={"x": 1.0})


def test_min_tokens_blocks_eos_and_stop_ids_until_reached() -> None:
    logits = torch.zeros(3, V)
    logits[:, EOS] = 10.0
    logits[:, 7] = 9.0
    logits[:, 5] = 8.0
    params = SamplingParams(temperature=0.0, min_tokens=2, stop_token_ids=[7])
    meta = build([params] * 3, outputs=[[], [1], [1, 2]])
    assert sample(logits, meta).sampled.tolist() == [5, 5, EOS]
    assert (
        build([SamplingParams(temperature=0.0, min_tokens=1)], outputs=[[9]]).min_tokens_mask
        is None
    )


def test_logprobs_match_log_softmax_of_raw_logits() -> None:
    logits = rand_logits(3, seed=4)
    params = [
        SamplingParams(temperature=0.0, logprobs=4, presence_penalty=2.0),
        SamplingParams(temperature=0.7, logprobs=0),
        SamplingParams(temperature=0.0),
    ]
    out = sample(logits, build(params, outputs=[[int(logits[0].argmax())], [], []]))
    reference = logits.log_softmax(-1)
    assert out.logprobs is not None and out.logprobs[2] is None
    for row, n in ((0, 4), (1, 0)):
        lp = out.logprobs[row]
        assert lp is not None
        tok = int(out.sampled[row])
        assert lp.token_id == tok
        assert lp.logprob == pytest.approx(float(reference[row, tok]), abs=1e-6)
        assert lp.rank == int((reference[row] > reference[row, tok]).sum()) + 1
        top = reference[row].topk(n)
        assert lp.top_ids == top.indices.tolist()
        assert lp.top_logprobs == pytest.approx(top.values.tolist(), abs=1e-6)
    # The presence penalty moved row 0 off the raw argmax: rank 2 in the raw distribution.
    assert out.logprobs[0].rank == 2


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bad_rows_reported_and_others_unaffected(temperature: float) -> None:
    logits = rand_logits(5, seed=5)
    params = [SamplingParams(temperature=temperature, top_p=0.9, seed=1)] * 5
    gens = [gen(i) for i in range(5)]
    clean = sample(logits, build(params, generators=gens)).sampled
    broken = logits.clone()
    broken[1, 4] = float("nan")
    broken[3, 0] = float("inf")
    out = sample(broken, build(params, generators=[gen(i) for i in range(5)]))
    assert out.bad_rows == [1, 3]
    assert ((out.sampled >= 0) & (out.sampled < V)).all()
    assert torch.equal(out.sampled[[0, 2, 4]], clean[[0, 2, 4]])


def test_seeded_rows_independent_of_batch_position_and_composition() -> None:
    target = SamplingParams(temperature=0.9, top_k=10, seed=1234)
    steps = 30
    step_logits = [rand_logits(1, seed=100 + s) for s in range(steps)]

    def run(batch: int, row: int, others_seeded: bool) -> list[int]:
        gens: list[torch.Generator | None] = [None] * batch
        params = [SamplingParams(temperature=1.0, top_p=0.8)] * batch
        for i in range(batch):
            if others_seeded and i % 2 == 0:
                gens[i] = gen(i)
        params[row] = target
        gens[row] = gen(1234)
        tokens = []
        for s in range(steps):
            logits = rand_logits(batch, seed=1000 * batch + s)
            logits[row] = step_logits[s][0]
            tokens.append(int(sample(logits, build(params, generators=gens)).sampled[row]))
        return tokens

    alone = run(1, 0, False)
    assert run(5, 3, True) == alone
    assert run(5, 0, False) == alone
    assert len(set(alone)) > 3  # really random, not greedy


def test_unseeded_rows_vary() -> None:
    logits = torch.zeros(64, V)
    out = sample(logits, build([SamplingParams()] * 64))
    assert len(set(out.sampled.tolist())) > 4


def test_temperature_one_matches_distribution() -> None:
    probs = torch.tensor([0.4, 0.3, 0.2, 0.07, 0.03])
    n = 20000
    logits = probs.log().repeat(n, 1)
    torch.manual_seed(7)
    out = sample(logits, build([SamplingParams(temperature=1.0)] * n, vocab=5))
    counts = torch.bincount(out.sampled, minlength=5).float()
    expected = probs * n
    chi2 = float(((counts - expected) ** 2 / expected).sum())
    # 4 degrees of freedom: P(chi2 > 30) < 1e-5.
    assert chi2 < 30, (counts, expected)


def test_temperature_sharpens() -> None:
    probs = torch.tensor([0.6, 0.4])
    n = 4000
    torch.manual_seed(8)
    out = sample(probs.log().repeat(n, 1), build([SamplingParams(temperature=0.5)] * n, vocab=2))
    # T = 0.5 squares the probabilities: 0.36 / 0.52.
    frac = float((out.sampled == 0).float().mean())
    assert math.isclose(frac, 0.36 / 0.52, abs_tol=0.04)


def test_top_p_renormalises_after_top_k() -> None:
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log().repeat(300, 1)
    torch.manual_seed(4)
    # After top-k=3 the masses are 0.53, 0.32, 0.16: p=0.8 keeps two tokens (0.53 < 0.8).
    out = sample(logits, build([SamplingParams(top_k=3, top_p=0.8)] * 300, vocab=4))
    assert set(out.sampled.tolist()) == {0, 1}
    out = sample(logits, build([SamplingParams(top_k=3, top_p=0.5)] * 300, vocab=4))
    assert set(out.sampled.tolist()) == {0}


def _native_argmax(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from kvflow.kernels.cpu import build, ops

    if not build.native_available():
        pytest.skip("the native CPU kernels did not build")
    return ops.row_argmax(logits)


ARGMAX_PATHS = {"torch chunked": chunked_argmax, "native": _native_argmax}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("path", ARGMAX_PATHS)
@pytest.mark.parametrize("vocab", [128256, 49152, 256, 1000, 65521, 7, 1, 17], ids=str)
def test_row_argmax_is_torch_argmax_first_index_on_ties(vocab: int, path: str, dtype) -> None:
    """Both reductions give torch.argmax's index (the first of tied maxima, across and inside
    chunks or vector lanes; a prime vocab is one chunk; 17: one vector and a tail) and the row
    maximum, at batch 1 and larger, of float32 rows and of bf16 ones (a decode step's logits
    on the CPU), whose rounding makes more ties."""
    from support.logit_rows import hard_rows

    for logits in hard_rows(vocab, gen(vocab)):
        logits = logits.to(dtype)
        for batch in (logits[:1], logits):
            argmax, row_max = ARGMAX_PATHS[path](batch)
            assert argmax.dtype == torch.int64
            assert torch.equal(argmax, batch.argmax(dim=-1))
            expected = batch.amax(dim=-1).to(row_max.dtype)
            torch.testing.assert_close(row_max, expected, rtol=0, atol=0, equal_nan=True)


def test_row_argmax_takes_the_native_kernel_for_cpu_float32_and_bf16(monkeypatch) -> None:
    """float32 and bf16 logits on the CPU go to the native kernel when it loaded; others to
    torch."""
    from kvflow.kernels.cpu import build, ops

    if not build.native_available():
        pytest.skip("the native CPU kernels did not build")
    calls = []
    native = ops.row_argmax
    monkeypatch.setattr(ops, "row_argmax", lambda x: calls.append(x.dtype) or native(x))
    logits = torch.randn(4, 300, generator=gen(5))
    assert torch.equal(row_argmax(logits)[0], logits.argmax(-1))
    assert torch.equal(row_argmax(logits.double())[0], logits.argmax(-1))
    half = logits.bfloat16()
    assert torch.equal(row_argmax(half)[0], half.argmax(-1))
    assert calls == [torch.float32, torch.bfloat16]


def test_chunked_argmax_chunks_fewer_as_the_batch_grows() -> None:
    """About 256 rows of work in all: 256 chunks at batch 1, whole rows from batch 129 on."""
    from kvflow.worker.greedy import _num_chunks

    assert [_num_chunks(128256, b) for b in (1, 2, 8, 64, 129, 256)] == [256, 128, 32, 4, 1, 1]
    assert _num_chunks(65521, 1) == 1 and _num_chunks(1, 1) == 1


@pytest.mark.parametrize("path", ARGMAX_PATHS)
def test_row_argmax_is_right_at_every_batch_size(path: str) -> None:
    """Both reductions, at batch sizes that change the chunking (and the rows per thread)."""
    for batch in (3, 40, 300):
        logits = torch.randint(0, 4, (batch, 1000), generator=gen(batch)).float()
        argmax, row_max = ARGMAX_PATHS[path](logits)
        assert torch.equal(argmax, logits.argmax(dim=-1))
        assert torch.equal(row_max, logits.amax(dim=-1))


def test_all_greedy_is_one_reduction_not_a_sum_or_full_argmax(monkeypatch) -> None:
    """The all-greedy path reduces the logits once: no row sum, no torch.argmax over rows."""
    logits = rand_logits(3, seed=11, vocab=1024)
    expected = logits.argmax(-1)

    def forbidden(*args, **kwargs):
        raise AssertionError("the greedy path should use row_argmax only")

    monkeypatch.setattr(torch.Tensor, "sum", forbidden)
    monkeypatch.setattr(torch.Tensor, "argmax", forbidden)
    out = sample(logits, build([SamplingParams(temperature=0.0)] * 3, vocab=1024))
    assert torch.equal(out.sampled, expected)
    assert not out.bad_mask.any()


def test_bf16_logits_are_widened_only_for_rows_that_need_their_values(monkeypatch) -> None:
    """A decode step's bf16 logits (the CPU head's dtype): an all-greedy batch takes the argmax
    of them as they are, with no float32 copy; penalties, random rows and logprobs see them
    widened, exactly as if float32 logits of the same values had come in."""
    logits = rand_logits(4, seed=12, vocab=1024).bfloat16()
    wide = logits.float()
    greedy = build([SamplingParams(temperature=0.0)] * 4, vocab=1024)
    widened = []
    to_float = torch.Tensor.float
    monkeypatch.setattr(torch.Tensor, "float", lambda t: widened.append(t.dtype) or to_float(t))
    out = sample(logits, greedy)
    assert torch.equal(out.sampled, wide.argmax(-1)) and widened == []
    for params in (
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=0.0, repetition_penalty=1.3),
        SamplingParams(temperature=0.7),
    ):
        meta = build([params] * 4, outputs=[[1, 2, 3]] * 4, vocab=1024)
        torch.manual_seed(0)
        got = sample(logits, meta)
        torch.manual_seed(0)
        expected = sample(wide, meta)
        assert torch.equal(got.sampled, expected.sampled), params
        if expected.logprob_tensors is not None:
            for a, b in zip(got.logprob_tensors, expected.logprob_tensors, strict=True):
                assert torch.equal(a, b)
    assert torch.bfloat16 in widened


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bad_rows_are_rows_whose_maximum_is_not_finite(temperature: float) -> None:
    """NaN anywhere, +inf anywhere, or all -inf: bad. A -inf beside finite logits (a masked
    token) is fine. A logit bias in the batch (the penalised path) changes nothing: the flag
    reads the raw logits, greedy rows take the argmax of the biased ones."""
    vocab = 512
    logits = rand_logits(7, seed=12, vocab=vocab)
    logits[0, 100] = float("nan")
    logits[1, 511] = float("inf")
    logits[2] = float("-inf")
    logits[3, :400] = float("-inf")  # fine: finite maximum
    logits[4, 0] = float("nan")
    logits[4, 1] = float("inf")
    logits[5, 7] = float("-inf")  # fine
    params = [SamplingParams(temperature=temperature, seed=1)] * 6
    params.append(SamplingParams(temperature=temperature, seed=1, logit_bias={5: -100.0}))
    out = sample(logits, build(params, generators=[gen(i) for i in range(7)], vocab=vocab))
    assert out.bad_rows == [0, 1, 2, 4]
    assert ((out.sampled >= 0) & (out.sampled < vocab)).all()
    if temperature == 0.0:
        assert out.sampled[3].item() == logits[3].argmax().item() >= 400
        biased = logits[6].clone()
        biased[5] -= 100.0
        assert out.sampled[6].item() == biased.argmax().item()
