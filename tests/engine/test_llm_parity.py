"""The whole engine on the embedded model (float32) against transformers, token for token.

Greedy ids must equal transformers' for a request alone, batched with others of other lengths,
with prefix-cache hits, with chunked prefill at a 16-token budget, and through preemption.
"""

from __future__ import annotations

import pytest
import torch

from kvflow import LLM, SamplingParams
from kvflow.model.loader import resolve_model
from kvflow.worker.input_rows import InputRows

PROMPTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type with an oil-based ink and a wooden press adapted from wine "
    "making, and within fifty years printed books had spread to every major city in Europe.",
    "Write a short Python function that returns the n-th Fibonacci number using iteration, and "
    "explain in two sentences why the iterative version is faster than the naive recursive one.",
    "In a small village by the sea, an old fisherman kept a notebook of every storm he had ever "
    "seen. One winter morning, a stranger knocked on his door and asked to read it.",
    "List three differences between the mitochondria and the chloroplast, covering their "
    "membranes, the energy they produce, and the kinds of cells that contain each organelle, "
    "with one example of each.",
    "Photosynthesis converts light energy into chemical energy. Describe the light-dependent "
    "reactions and the Calvin cycle, and say where in the chloroplast each of them takes place "
    "in a typical leaf.",
]
N = 24


@pytest.fixture(scope="module")
def model_dir():
    return resolve_model(None)


@pytest.fixture(scope="module")
def reference(model_dir):
    """Greedy continuations from transformers' float32 model, N tokens each, EOS ignored."""
    from transformers import AutoTokenizer

    from kvflow.model.loader import load_transformers_model

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = load_transformers_model(model_dir, torch.float32)
    refs = []
    with torch.inference_mode():
        for prompt in PROMPTS:
            ids = torch.tensor([tok.encode(prompt)])
            assert ids.shape[1] >= 32
            out = model(ids, use_cache=True)
            generated = []
            for _ in range(N):
                nxt = int(out.logits[0, -1].argmax())
                generated.append(nxt)
                out = model(
                    torch.tensor([[nxt]]), past_key_values=out.past_key_values, use_cache=True
                )
            refs.append(generated)
    return refs


def greedy(llm: LLM, prompts: list[str]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.fixture(scope="module")
def llm():
    return LLM(None, dtype="float32", num_blocks=512, block_size=16, max_num_seqs=16)


def test_alone_equals_transformers(llm, reference):
    for prompt, ref in zip(PROMPTS, reference, strict=True):
        llm.engine.core.scheduler.kv.pool.reset_prefix_cache()
        assert greedy(llm, [prompt]) == [ref]


def test_batched_with_other_lengths_and_prefix_hits(llm, reference):
    fillers = [PROMPTS[i % 5][: 20 + 7 * i] for i in range(3)]
    batch = PROMPTS + fillers  # 8 requests of different lengths; prompts are cached from before
    outs = greedy(llm, batch)
    assert outs[:5] == reference
    stats = llm.engine.stats()
    assert stats.prefix_cache_hits > 0


def test_chunked_prefill_at_budget_16():
    llm = LLM(
        None,
        dtype="float32",
        num_blocks=512,
        block_size=16,
        max_num_batched_tokens=16,
        enable_prefix_caching=False,
    )
    assert greedy(llm, PROMPTS[:3]) == greedy_reference_subset(PROMPTS[:3])


def greedy_reference_subset(prompts):
    return [REF_CACHE[p] for p in prompts]


REF_CACHE: dict[str, list[int]] = {}


@pytest.fixture(scope="module", autouse=True)
def _fill_cache(reference):
    REF_CACHE.update(zip(PROMPTS, reference, strict=True))


def test_preemption_by_tiny_pool_keeps_tokens(llm, reference):
    """Greedy and seeded outputs are those of an unpreempted run: a preempted request resumes
    with its seeded generator where it was."""
    # 12 blocks of 8 = 88 servable tokens: five ~45-token requests cannot all run at once.
    tiny = LLM(None, dtype="float32", num_blocks=12, block_size=8, max_num_seqs=8)
    assert greedy(tiny, PROMPTS) == reference
    assert tiny.engine.stats().num_preemptions_total > 0
    seeded = [
        SamplingParams(temperature=1.0, seed=i, max_tokens=N, ignore_eos=True) for i in range(5)
    ]
    before = tiny.engine.stats().num_preemptions_total
    got = [o.outputs[0].token_ids for o in tiny.generate(PROMPTS, seeded)]
    assert tiny.engine.stats().num_preemptions_total > before
    assert got == [o.outputs[0].token_ids for o in llm.generate(PROMPTS, seeded)]
    assert tiny.engine.stats().kv_cache_usage == 0.0


def test_runner_rows_grow_and_are_reused_through_preemption(reference):
    """The runner's rows start too small in every dimension (one request, 4 tokens, 1 block):
    they grow mid-run, preempted requests resume in reused rows, and the tokens stay exact."""
    llm = LLM(None, dtype="float32", num_blocks=12, block_size=8, max_num_seqs=8)
    runner = llm.engine.core.runner
    runner.rows = InputRows(rows=1, tokens=4, blocks=1)
    assert greedy(llm, PROMPTS) == reference
    assert llm.engine.stats().num_preemptions_total > 0
    rows = runner.rows
    assert rows.token_ids.shape[0] > 1 and rows.token_ids.shape[1] >= 45 + N
    # The runner forgets a finished request at its next step: the last one may still hold a row.
    live = {state.row for state in runner.requests.values()}
    assert len(live) <= 1 and sorted(rows._free + [*live]) == list(range(len(rows.num_tokens)))
    assert not rows.block_table[rows._free].any()  # freed rows hold no stale block ids


def test_repetition_penalty_equals_transformers(llm, model_dir):
    """Penalties read prompt and output tokens from the runner's rows: greedy tokens under a
    repetition penalty equal transformers' `generate`, beside an unpenalised request."""
    from transformers import AutoTokenizer

    from kvflow.model.loader import load_transformers_model

    tok = AutoTokenizer.from_pretrained(model_dir)
    hf = load_transformers_model(model_dir, torch.float32)
    hf.generation_config.eos_token_id = None  # as ignore_eos: EOS is neither a stop nor masked
    expected = []
    with torch.inference_mode():
        for prompt in PROMPTS[:2]:
            ids = torch.tensor([tok.encode(prompt)])
            out = hf.generate(
                ids, max_new_tokens=N, do_sample=False, repetition_penalty=1.3, pad_token_id=0
            )
            expected.append(out[0, ids.shape[1] :].tolist())
    penalised = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, repetition_penalty=1.3)
    plain = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)
    outs = llm.generate([PROMPTS[0], PROMPTS[2], PROMPTS[1]], [penalised, plain, penalised])
    assert [outs[0].outputs[0].token_ids, outs[2].outputs[0].token_ids] == expected
    assert outs[1].outputs[0].token_ids == REF_CACHE[PROMPTS[2]]
    assert expected != [REF_CACHE[p] for p in PROMPTS[:2]]  # the penalty changed the tokens


def test_seeded_sampling_is_reproducible(llm):
    params = SamplingParams(temperature=1.0, top_p=0.9, max_tokens=16, seed=1234)
    a = llm.generate(PROMPTS[0], params)[0].outputs[0].token_ids
    others = [PROMPTS[1], PROMPTS[0], PROMPTS[2]]
    mixed = llm.generate(
        others,
        [
            SamplingParams(temperature=1.0, max_tokens=16),
            params,
            SamplingParams(temperature=0.7, max_tokens=5, seed=7),
        ],
    )
    assert mixed[1].outputs[0].token_ids == a
    unseeded = llm.generate([PROMPTS[0]] * 2, SamplingParams(temperature=1.0, max_tokens=16))
    assert unseeded[0].outputs[0].token_ids != unseeded[1].outputs[0].token_ids


def test_n_choices_stop_strings_and_logprobs(llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=5, logprobs=2)
    out = llm.generate(PROMPTS[2], params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2] and out.finished
    for c in out.outputs:
        assert len(c.logprobs) == len(c.token_ids)
        for tok, entry in zip(c.token_ids, c.logprobs, strict=True):
            assert tok in entry and len(entry) <= 3
        assert c.cumulative_logprob == pytest.approx(
            sum(e[t].logprob for t, e in zip(c.token_ids, c.logprobs, strict=True)), abs=1e-4
        )
    # as vLLM: choice i draws from seed + i, so seeded choices differ and choice 0 is n=1's
    texts = [c.token_ids for c in out.outputs]
    assert len({tuple(t) for t in texts}) == 3
    alone = llm.generate(PROMPTS[2], params.clone(n=1))[0].outputs[0].token_ids
    assert alone == texts[0]
    assert llm.generate(PROMPTS[2], params.clone(n=1, seed=6))[0].outputs[0].token_ids == texts[1]
    full = llm.generate("The capital of France is", SamplingParams(temperature=0, max_tokens=12))
    text = full[0].outputs[0].text
    assert "Paris" in text
    cut = llm.generate(
        "The capital of France is", SamplingParams(temperature=0, max_tokens=12, stop=["Paris"])
    )
    c = cut[0].outputs[0]
    assert (
        c.finish_reason == "stop" and c.stop_reason == "Paris" and c.text == text.split("Paris")[0]
    )
    assert llm.engine.stats().kv_cache_usage == 0.0


def test_async_scheduling_changes_no_output(llm, reference):
    """Each step scheduled and launched before the previous one's ids reach the host (the GPU
    default; the ids fed to the next step from the device) gives the same outputs: greedy
    tokens through preemption, seeded n > 1 choices with logprobs, penalties (whose history
    ends with a fed token), and a stop string, whose request the core ends a step later (the
    token it computed meanwhile is dropped); every block comes back."""
    late = LLM(
        None, dtype="float32", num_blocks=12, block_size=8, max_num_seqs=8, async_scheduling=True
    )
    assert late.engine.core.async_scheduling
    assert greedy(late, PROMPTS) == reference
    assert late.engine.stats().num_preemptions_total > 0

    def fields(outputs):
        return [
            (c.index, c.text, c.token_ids, c.finish_reason, c.stop_reason)
            for o in outputs
            for c in o.outputs
        ]

    def logprobs(outputs):
        return [
            {t: lp.logprob for t, lp in entry.items()}
            for o in outputs
            for c in o.outputs
            for entry in c.logprobs or ()
        ]

    prompt = "The capital of France is"
    cases = [
        SamplingParams(temperature=0, max_tokens=12, stop=["Paris"]),
        SamplingParams(n=2, temperature=1.0, max_tokens=6, seed=5, logprobs=2),
        SamplingParams(temperature=0, max_tokens=12, stop=[" capital", "Paris"]),
        SamplingParams(
            temperature=0,
            max_tokens=16,
            repetition_penalty=1.5,
            frequency_penalty=1.5,
            presence_penalty=0.5,
            min_tokens=4,
        ),
    ]
    for params in cases:
        got, want = late.generate(prompt, params), llm.generate(prompt, params)
        assert fields(got) == fields(want)  # logprobs to float rounding: block sizes differ
        assert logprobs(got) == [pytest.approx(e, abs=1e-4) for e in logprobs(want)]
    steps = late.engine.stats().num_steps
    stopped = late.generate(prompt, cases[0].clone(max_tokens=40))[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "Paris"
    # the core ended it one step after the stop string, not at max_tokens
    assert late.engine.stats().num_steps - steps <= len(stopped.token_ids) + 3
    assert not late.engine.has_unfinished_requests()
    assert late.engine.stats().kv_cache_usage == 0.0


def test_async_scheduling_never_gives_a_stale_token_to_a_reused_request_id(llm):
    """A request ended by a stop string has one more step in flight for it; a new request that
    takes its id at once gets only its own tokens."""
    engine = LLM(None, dtype="float32", num_blocks=64, async_scheduling=True).engine
    stop = SamplingParams(temperature=0, max_tokens=30, stop=["Paris"])
    engine.add_request("x", engine.tokenize_prompt("The capital of France is"), stop)
    outputs = []
    while not any(o.finished for o in outputs):
        outputs = engine.step()
    assert outputs[-1].outputs[0].stop_reason == "Paris"
    assert engine.core.has_unfinished_requests()  # its next token is still being computed
    second = SamplingParams(temperature=0, max_tokens=8)
    prompt = "Water boils at"
    engine.add_request("x", engine.tokenize_prompt(prompt), second)
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for o in engine.step() for t in o.outputs[0].token_ids]
    assert tokens == llm.generate(prompt, second)[0].outputs[0].token_ids


def test_prompt_logprobs_equal_transformers_through_chunks_preemption_and_async(model_dir):
    """Every prompt token's logprob (the first has none) and its top-n, as transformers'
    log-softmax gives them: with a 16-token budget (positions spread over chunks), in a pool
    that preempts (recomputed positions reported once), with async scheduling, for n = 2 and
    for a repeated prompt (prefix-cache hits would skip its positions: it is not read)."""
    from transformers import AutoTokenizer

    from kvflow.model.loader import load_transformers_model

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = load_transformers_model(model_dir, torch.float32)
    prompts = PROMPTS[:4]
    want = []
    with torch.inference_mode():
        for prompt in prompts:
            ids = tok.encode(prompt)
            logprobs = model(torch.tensor([ids])).logits[0].log_softmax(-1)
            want.append([(ids[i], logprobs[i - 1]) for i in range(1, len(ids))])
    greedy = SamplingParams(temperature=0, max_tokens=8, prompt_logprobs=3)
    params = [greedy] * len(prompts)
    params[2] = greedy.clone(n=2, temperature=1.0, seed=3)  # n > 1 samples (vLLM's rule)
    engines = {
        "chunked": LLM(None, dtype="float32", num_blocks=64, max_num_batched_tokens=16),
        "preempting": LLM(
            None,
            dtype="float32",
            num_blocks=12,
            block_size=8,
            max_num_seqs=8,
            max_num_batched_tokens=16,  # preempted mid-prompt too
        ),
        "async": LLM(
            None, dtype="float32", num_blocks=64, max_num_batched_tokens=16, async_scheduling=True
        ),
    }
    for name, engine in engines.items():
        for _ in range(2):
            outs = engine.generate(prompts, params)
            for out, expected in zip(outs, want, strict=True):
                entries = out.prompt_logprobs
                assert entries[0] is None and len(entries) == len(expected) + 1, name
                for entry, (token, row) in zip(entries[1:], expected, strict=True):
                    assert entry[token].logprob == pytest.approx(row[token].item(), abs=1e-4)
                    assert entry[token].rank == int((row > row[token]).sum()) + 1
                    top = row.topk(3).indices.tolist()
                    assert set(entry) == {token, *top}
                    assert [entry[t].rank for t in top] == [1, 2, 3]
        stats = engine.engine.stats()
        assert stats.kv_cache_usage == 0.0 and stats.prefix_cache_hits == 0, name
    assert engines["preempting"].engine.stats().num_preemptions_total > 0


def test_chat_uses_the_template(llm):
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}],
        SamplingParams(temperature=0, max_tokens=30),
    )
    assert "Paris" in out[0].outputs[0].text
    assert out[0].outputs[0].finish_reason == "stop"


def test_a_prompt_that_fails_midway_queues_nothing(llm):
    """generate() is all or nothing for any error, not only ValueError: the prompts queued
    before a bad one (here of a wrong type) are aborted, so nothing runs unseen afterwards."""
    with pytest.raises((TypeError, KeyError)):
        llm.generate(["The capital of France is", 5])
    with pytest.raises((TypeError, KeyError)):
        llm.generate(["The capital of France is", {"foo": 1}])
    assert not llm.engine.has_unfinished_requests()


def test_sampling_params_as_vllm_reads_them():
    assert SamplingParams(seed=-1).seed is None  # -1: no seed
    with pytest.raises(ValueError, match="n must be 1 when using greedy sampling, got 2"):
        SamplingParams(n=2, temperature=0)


def test_refused_prompt_queues_nothing_and_max_tokens_defaults_to_the_context():
    llm = LLM(None, dtype="float32", num_blocks=5, block_size=16)  # C = 64 = max_model_len
    assert llm.engine.max_model_len == 64
    with pytest.raises(ValueError, match="maximum context length is 64 tokens"):
        llm.generate(["Hi", "word " * 80], SamplingParams(max_tokens=4))
    assert not llm.engine.has_unfinished_requests()
    with pytest.raises(
        ValueError, match=r"'max_tokens' or 'max_completion_tokens' is too large: 70"
    ):
        llm.generate("The capital of France is", SamplingParams(max_tokens=70))
    out = llm.generate("The capital of France is", SamplingParams(max_tokens=None, ignore_eos=True))
    c = out[0].outputs[0]
    assert len(c.token_ids) == 64 - 5 and c.finish_reason == "length"
    assert llm.engine.stats().kv_cache_usage == 0.0
