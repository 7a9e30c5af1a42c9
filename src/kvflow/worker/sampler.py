"""Sampling: penalties, temperature, top-k / top-p / min-p, per-request seeds, logprobs.

`sample()` is a chain of pure tensor functions with no host synchronisation; the only
device -> host copies happen when a caller reads `SamplerOutput.token_ids` (with the bad rows,
in one copy) or `.logprobs`. An all-greedy batch without penalties is one reduction (`row_argmax`:
the native kernel on the CPU) that gives both the tokens and the bad rows; on CUDA two Triton
kernels (`kernels.triton.argmax.argmax_rows`), which also lay out the block the host copies.
`SamplingMetadata.build()` runs every step, so it only makes the tensors a batch needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from operator import attrgetter
from typing import Any

import numpy as np
import torch
from torch import Tensor

from kvflow.core.messages import TokenLogprobs
from kvflow.sampling_params import SamplingParams
from kvflow.transfer import to_device
from kvflow.worker.greedy import RawArgmax, raw_argmax

_GREEDY_EPS = 1e-5
# Exponential draws are clamped away from 0 so probs / draw never becomes 0 / 0.
_MIN_EXPONENTIAL = 1e-10
# SamplingMetadata's random-sampling fields when every row is greedy.
_ALL_GREEDY_FIELDS: dict[str, Any] = {
    "temperature": None,
    "top_k": None,
    "max_top_k": 0,
    "top_p": None,
    "min_p": None,
}


@dataclass(frozen=True)
class TokenHistory:
    """The tokens of the rows being sampled: row i is `token_ids[rows[i]]`, whose first
    `prompt_lens[i]` entries are the prompt and the next ones, up to `num_tokens[i]`, the
    generated tokens (entries after that are ignored). Penalties read it, padded on demand."""

    token_ids: np.ndarray  # int [R, W]
    rows: np.ndarray  # int [B]
    prompt_lens: np.ndarray  # int64 [B]
    num_tokens: np.ndarray  # int64 [B]

    @classmethod
    def from_lists(cls, prompts: list[list[int]], outputs: list[list[int]]) -> TokenHistory:
        rows = [p + o for p, o in zip(prompts, outputs, strict=True)]
        num_tokens = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        table = np.zeros((len(rows), max(int(num_tokens.max(initial=0)), 1)), dtype=np.int64)
        for i, row in enumerate(rows):
            table[i, : len(row)] = row
        prompt_lens = np.fromiter(map(len, prompts), dtype=np.int64, count=len(prompts))
        return cls(table, np.arange(len(rows)), prompt_lens, num_tokens)

    @property
    def num_outputs(self) -> np.ndarray:
        return self.num_tokens - self.prompt_lens

    def padded(self, start: np.ndarray, end: np.ndarray, pad: int) -> np.ndarray:
        """int64 [B, max(end - start)]: row i is its tokens [start[i], end[i]), then `pad`."""
        width = int((end - start).max(initial=0))
        cols = start[:, None] + np.arange(width)
        inside = cols < end[:, None]
        ids = self.token_ids[self.rows[:, None], np.where(inside, cols, 0)]
        return np.where(inside, ids, pad).astype(np.int64)


@dataclass
class SamplingMetadata:
    """Per-row sampling inputs for one step; row i is the i-th request being sampled.

    Every optional tensor is None when no row needs it, so the common cases cost nothing.
    """

    temperature: Tensor | None  # float32 [B]; greedy rows hold 0; None when all greedy
    all_greedy: bool
    all_random: bool
    top_k: Tensor | None  # int64 [B], 0 = off
    max_top_k: int  # largest k in top_k (sizes a topk call instead of a full sort); 0 if off
    top_p: Tensor | None  # float32 [B], 1.0 = off
    min_p: Tensor | None  # float32 [B], 0.0 = off
    generators: dict[int, torch.Generator]  # row -> generator, seeded random rows only
    presence_penalties: Tensor | None  # float32 [B]
    frequency_penalties: Tensor | None  # float32 [B]
    repetition_penalties: Tensor | None  # float32 [B]
    # int64 [B, L], right-padded with vocab_size; only when a penalty needs them.
    prompt_token_ids: Tensor | None
    output_token_ids: Tensor | None
    # (rows, token ids): pairs whose logit is set to -inf (EOS / stop ids under min_tokens).
    min_tokens_mask: tuple[Tensor, Tensor] | None
    # (rows, token ids, biases): added to those logits before the penalties (vLLM's order)
    logit_bias: tuple[Tensor, Tensor, Tensor] | None
    max_num_logprobs: int | None  # None when no row asks for logprobs
    num_logprobs: list[int | None]  # per row: params.logprobs

    @property
    def has_penalties(self) -> bool:
        return (
            self.presence_penalties is not None
            or self.frequency_penalties is not None
            or self.repetition_penalties is not None
        )

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        history: TokenHistory,
        generators: list[torch.Generator | None],
        eos_token_id: int | None,
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingMetadata:
        """Gather the batch's parameters; `generators[i]` must live on `device`."""
        greedy = [p.temperature < _GREEDY_EPS for p in params]
        all_greedy = all(greedy)
        num_logprobs = [p.logprobs for p in params]
        wanted = [n for n in num_logprobs if n is not None]
        rep = _column(params, "repetition_penalty", 1.0, torch.float32, device)
        freq = _column(params, "frequency_penalty", 0.0, torch.float32, device)
        pres = _column(params, "presence_penalty", 0.0, torch.float32, device)
        random_fields = _ALL_GREEDY_FIELDS
        if not all_greedy:
            random_fields = _random_fields(params, greedy, vocab_size, device)
        any_penalty = rep is not None or freq is not None or pres is not None
        prompt_ids = output_ids = None
        if rep is not None:
            zero = np.zeros_like(history.prompt_lens)
            prompt_ids = to_device(
                history.padded(zero, history.prompt_lens, vocab_size), torch.int64, device
            )
        if any_penalty:
            ids = history.padded(history.prompt_lens, history.num_tokens, vocab_size)
            output_ids = to_device(ids, torch.int64, device)
        return cls(
            all_greedy=all_greedy,
            all_random=not any(greedy),
            **random_fields,
            generators={i: g for i, g in enumerate(generators) if g is not None and not greedy[i]},
            presence_penalties=pres,
            frequency_penalties=freq,
            repetition_penalties=rep,
            prompt_token_ids=prompt_ids,
            output_token_ids=output_ids,
            min_tokens_mask=_min_tokens_pairs(params, history, eos_token_id, vocab_size, device),
            logit_bias=_logit_bias(params, device),
            max_num_logprobs=max(wanted) if wanted else None,
            num_logprobs=num_logprobs,
        )


def _column(
    params: list[SamplingParams],
    name: str,
    neutral: float,
    dtype: torch.dtype,
    device: torch.device | str,
) -> Tensor | None:
    values = list(map(attrgetter(name), params))
    if values.count(neutral) == len(values):
        return None
    return to_device(values, dtype, device)


def _random_fields(
    params: list[SamplingParams], greedy: list[bool], vocab_size: int, device: torch.device | str
) -> dict[str, Any]:
    """Temperature (0 on greedy rows), then top-k / top-p / min-p if a random row uses them."""
    temps = [0.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
    random_params = [p for p, g in zip(params, greedy, strict=True) if not g]
    fields = dict(_ALL_GREEDY_FIELDS)
    fields["temperature"] = to_device(temps, torch.float32, device)
    top_ks = [p.top_k if 0 < p.top_k < vocab_size else 0 for p in params]
    if any(top_ks[i] for i, g in enumerate(greedy) if not g):
        fields["top_k"] = to_device(top_ks, torch.int64, device)
        fields["max_top_k"] = max(top_ks)
    if any(p.top_p < 1.0 for p in random_params):
        fields["top_p"] = _column(params, "top_p", 1.0, torch.float32, device)
    if any(p.min_p > 0.0 for p in random_params):
        fields["min_p"] = _column(params, "min_p", 0.0, torch.float32, device)
    return fields


def _logit_bias(
    params: list[SamplingParams], device: torch.device | str
) -> tuple[Tensor, Tensor, Tensor] | None:
    if not any(p.logit_bias for p in params):
        return None
    rows, ids, biases = [], [], []
    for i, p in enumerate(params):
        for token, bias in (p.logit_bias or {}).items():
            rows.append(i)
            ids.append(token)
            biases.append(bias)
    pairs = to_device([rows, ids], torch.int64, device)
    return pairs[0], pairs[1], to_device(biases, torch.float32, device)


def _min_tokens_pairs(
    params: list[SamplingParams],
    history: TokenHistory,
    eos_token_id: int | None,
    vocab_size: int,
    device: torch.device | str,
) -> tuple[Tensor, Tensor] | None:
    if all(p.min_tokens == 0 for p in params):
        return None
    num_outputs = history.num_outputs.tolist()
    rows: list[int] = []
    ids: list[int] = []
    for i, p in enumerate(params):
        if p.min_tokens == 0 or num_outputs[i] >= p.min_tokens:
            continue
        blocked = set(p.stop_token_ids)
        if eos_token_id is not None:
            blocked.add(eos_token_id)
        for t in sorted(blocked):
            if t < vocab_size:
                rows.append(i)
                ids.append(t)
    if not rows:
        return None
    pairs = to_device([rows, ids], torch.int64, device)
    return pairs[0], pairs[1]


@dataclass
class SamplerOutput:
    """Sampled ids stay on the device; the list views copy to the host when first read."""

    sampled: Tensor  # int64 [B]
    # [B], nonzero (bool, or int64 1 on CUDA) where the row's raw logits held NaN or +inf, or
    # were all -inf (its maximum is not finite); a -inf beside finite logits is fine (masked)
    bad_mask: Tensor
    # (sampled logprob, its rank, top-n ids, top-n logprobs) when any row asked for logprobs.
    logprob_tensors: tuple[Tensor, Tensor, Tensor, Tensor] | None = None
    num_logprobs: list[int | None] | None = None
    # int64 [2, B]: sampled | bad flags in one block, where one kernel made both (CUDA, greedy)
    ids_and_bad: Tensor | None = None
    _host: list[Tensor] | None = None  # what the host reads, copied by `to_host`
    _copied: torch.cuda.Event | None = None

    def to_host(self) -> None:
        """Queue the copies of what the host will read (ids and bad rows in one tensor, then
        logprobs) right behind the sampler. Read later, they wait for this step only, not for
        work queued after it (the next step, with async scheduling)."""
        block = self.ids_and_bad
        if block is None:
            block = torch.stack((self.sampled, self.bad_mask.to(self.sampled.dtype)))
        tensors = [block]
        tensors += self.logprob_tensors or ()
        if self.sampled.device.type != "cuda":
            self._host = tensors
            return
        self._host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for host, tensor in zip(self._host, tensors, strict=True):
            host.copy_(tensor, non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def _read(self) -> list[Tensor]:
        if self._host is None:
            self.to_host()
        if self._copied is not None:
            self._copied.synchronize()
        assert self._host is not None
        return self._host

    @cached_property
    def _on_host(self) -> tuple[list[int], list[int]]:
        """(sampled ids, bad rows): one wait for the device per step, not two (`nonzero` on
        the device would wait on its own)."""
        ids, bad = self._read()[0].tolist()
        return ids, [row for row, flag in enumerate(bad) if flag] if any(bad) else []

    @property
    def token_ids(self) -> list[int]:
        """The sampled ids on the host."""
        return self._on_host[0]

    @property
    def bad_rows(self) -> list[int]:
        """Rows whose raw logits were bad (see `bad_mask`); the caller fails those requests alone."""
        return self._on_host[1]

    @cached_property
    def logprobs(self) -> list[TokenLogprobs | None] | None:
        """Per row: logprobs of the raw logits, only for rows whose params ask for them."""
        if self.logprob_tensors is None or self.num_logprobs is None:
            return None
        own, rank, top_ids, top_lps = (t.tolist() for t in self._read()[1:])
        token_ids = self.token_ids
        return [
            None
            if n is None
            else TokenLogprobs(
                token_id=token_ids[i],
                logprob=own[i],
                rank=rank[i],
                top_ids=top_ids[i][:n],
                top_logprobs=top_lps[i][:n],
            )
            for i, n in enumerate(self.num_logprobs)
        ]


def sample(logits: Tensor, meta: SamplingMetadata, raw: RawArgmax | None = None) -> SamplerOutput:
    """Sample one token per row of `logits` [B, V] (float32, or the head's dtype: widened to
    float32 unless every row takes the raw argmax); `logits` is not modified. `raw`:
    `raw_argmax(logits)`, where it was already made (inside a decode graph). Three steps: one
    reduction of the raw logits (bad rows, greedy tokens), the logits processed (bias,
    penalties, min_tokens) where a row asks, then each row's token, greedy or random."""
    argmax, bad_mask, ids_and_bad = raw_argmax(logits) if raw is None else raw
    if meta.all_greedy and not _processes(meta) and meta.max_num_logprobs is None:
        return SamplerOutput(sampled=argmax, bad_mask=bad_mask, ids_and_bad=ids_and_bad)
    logits = logits.float()
    processed, argmax, ids_and_bad = _processed(logits, meta, argmax, ids_and_bad)
    sampled, ids_and_bad = _choose(processed, meta, argmax, ids_and_bad)
    out = SamplerOutput(sampled=sampled, bad_mask=bad_mask, ids_and_bad=ids_and_bad)
    if meta.max_num_logprobs is not None:
        out.logprob_tensors = compute_logprobs(logits, sampled, meta.max_num_logprobs)
        out.num_logprobs = meta.num_logprobs
    return out


def _processed(
    logits: Tensor, meta: SamplingMetadata, argmax: Tensor, ids_and_bad: Tensor | None
) -> tuple[Tensor, Tensor, Tensor | None]:
    """(logits after bias, penalties and min_tokens, their greedy tokens, the raw reduction's
    block while it still holds the greedy tokens); the logits themselves where no row asks."""
    if not _processes(meta):
        return logits, argmax, ids_and_bad
    processed = apply_penalties(logits.clone(), meta)
    if not meta.all_random:
        argmax = raw_argmax(processed)[0]
    return processed, argmax, None  # the raw block's argmax row is not the greedy tokens


def _processes(meta: SamplingMetadata) -> bool:
    """Whether some row's logits change before its token is chosen (bias, penalties,
    min_tokens)."""
    return meta.has_penalties or meta.min_tokens_mask is not None or meta.logit_bias is not None


def _choose(
    processed: Tensor, meta: SamplingMetadata, argmax: Tensor, ids_and_bad: Tensor | None
) -> tuple[Tensor, Tensor | None]:
    """(each row's token: the argmax for greedy rows, a draw for the others; the raw block,
    kept only when every row is greedy)."""
    if meta.all_greedy:
        return argmax, ids_and_bad
    assert meta.temperature is not None
    sampled = _sample_random(processed, meta)
    if not meta.all_random:
        sampled = torch.where(meta.temperature < _GREEDY_EPS, argmax, sampled)
    return sampled, None


def apply_penalties(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    """Logit bias, then repetition (prompt + output), frequency and presence (output only)
    penalties, then min_tokens.

    May modify `logits` in place; returns the penalised logits.
    """
    batch, vocab = logits.shape
    if meta.logit_bias is not None:
        rows, ids, biases = meta.logit_bias
        logits.index_put_((rows, ids), biases, accumulate=True)
    if meta.has_penalties:
        assert meta.output_token_ids is not None
        counts = _token_counts(meta.output_token_ids, batch, vocab)
        if meta.repetition_penalties is not None:
            assert meta.prompt_token_ids is not None
            seen = (_token_counts(meta.prompt_token_ids, batch, vocab) > 0) | (counts > 0)
            penalty = meta.repetition_penalties.unsqueeze(1)
            scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(seen, scaled, logits)
        if meta.frequency_penalties is not None:
            logits -= meta.frequency_penalties.unsqueeze(1) * counts
        if meta.presence_penalties is not None:
            logits -= meta.presence_penalties.unsqueeze(1) * (counts > 0).float()
    if meta.min_tokens_mask is not None:
        rows, ids = meta.min_tokens_mask
        logits[rows, ids] = float("-inf")
    return logits


def _token_counts(token_ids: Tensor, batch: int, vocab: int) -> Tensor:
    """float32 [B, V] occurrence counts; the padding id `vocab` lands in a dropped column."""
    counts = torch.zeros(batch, vocab + 1, dtype=torch.float32, device=token_ids.device)
    counts.scatter_add_(1, token_ids, torch.ones_like(token_ids, dtype=torch.float32))
    return counts[:, :vocab]


def _sample_random(logits: Tensor, meta: SamplingMetadata) -> Tensor:
    """Temperature, top-k, top-p, min-p, then one draw per row (greedy rows: ignored)."""
    assert meta.temperature is not None
    temperature = meta.temperature
    if not meta.all_random:
        temperature = torch.where(temperature < _GREEDY_EPS, 1.0, temperature)
    logits = logits / temperature.unsqueeze(1)
    if meta.top_p is not None:
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    elif meta.top_k is not None:
        logits = apply_top_k(logits, meta.top_k, meta.max_top_k)
    probs = logits.softmax(dim=-1)
    if meta.min_p is not None:
        threshold = probs.amax(dim=-1, keepdim=True) * meta.min_p.unsqueeze(1)
        probs = probs.masked_fill(probs < threshold, 0.0)
    return exponential_race(probs, meta.generators)


def apply_top_k_top_p(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """Mask to -inf what top-k (0 = off) and top-p (1.0 = off) exclude; always keeps the max.

    top-k keeps every token tied with the k-th largest; top-p keeps the smallest prefix of the
    descending order whose mass reaches p (renormalised after top-k).
    """
    vocab = logits.shape[1]
    ordered, order = logits.sort(dim=-1, descending=True, stable=True)
    if top_k is not None:
        k = torch.where(top_k <= 0, vocab, top_k).clamp(max=vocab)
        kth = ordered.gather(1, (k - 1).unsqueeze(1))
        ordered = ordered.masked_fill(ordered < kth, float("-inf"))
    if top_p is not None:
        probs = ordered.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        drop = (mass_before >= top_p.unsqueeze(1)) & (top_p < 1.0).unsqueeze(1)
        ordered = ordered.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ordered)


def apply_top_k(logits: Tensor, top_k: Tensor, max_top_k: int) -> Tensor:
    """top-k alone (0 = off) with one topk(max_top_k) call: no full-vocabulary sort."""
    largest = logits.topk(max_top_k, dim=-1).values
    kth = largest.gather(1, (top_k - 1).clamp(min=0).unsqueeze(1))
    drop = (logits < kth) & (top_k > 0).unsqueeze(1)
    return logits.masked_fill(drop, float("-inf"))


def exponential_race(probs: Tensor, generators: dict[int, torch.Generator]) -> Tensor:
    """argmax(probs / E) with E ~ Exponential(1) draws a token with probability probs.

    Seeded rows draw E from their own generator (V draws per step whatever the batch), so a
    seed gives the same tokens in any batch and at any row; other rows share one draw.
    """
    # -log(U) is Exponential(1) and on CPU much cheaper than Tensor.exponential_().
    if len(generators) == probs.shape[0]:
        draws = torch.empty_like(probs)
    else:
        draws = torch.rand_like(probs)
    for row, generator in generators.items():
        draws[row].uniform_(generator=generator)
    draws = draws.log_().neg_().clamp_min_(_MIN_EXPONENTIAL)
    return (probs / draws).argmax(dim=-1)


def compute_logprobs(
    logits: Tensor, sampled: Tensor, num_top: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """From raw logits: the sampled token's logprob and rank (1 = most likely), and the top-n."""
    logprobs = logits.log_softmax(dim=-1)
    own = logprobs.gather(1, sampled.unsqueeze(1))
    rank = (logprobs > own).sum(dim=-1) + 1
    top_lps, top_ids = logprobs.topk(num_top, dim=-1)
    return own.squeeze(1), rank, top_ids, top_lps
