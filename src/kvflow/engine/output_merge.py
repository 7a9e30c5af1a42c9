"""Merging delta RequestOutputs of one request that its consumer has not read yet.

When a stream's reader falls behind the engine (many streams on one event loop), the deltas
waiting for it become one: one SSE chunk carrying several tokens instead of one chunk per token,
so the per-chunk cost (JSON, HTTP write) is paid once per read rather than once per step. vLLM's
AsyncLLM merges pending delta outputs the same way. Nothing is lost: texts and token ids are
concatenated per choice, logprobs appended, the newest finish and stop reasons kept.
"""

from __future__ import annotations

from kvflow.outputs import CompletionOutput, RequestOutput


def merge_delta(old: RequestOutput, new: RequestOutput) -> RequestOutput:
    """`old` followed by `new` as one delta (neither is modified)."""
    by_index = {c.index: c for c in old.outputs}
    for c in new.outputs:
        prev = by_index.get(c.index)
        by_index[c.index] = c if prev is None else _merge_choice(prev, c)
    metrics = {**new.metrics, **old.metrics} if old.metrics else new.metrics
    if "error" in new.metrics:
        metrics = {**metrics, "error": new.metrics["error"]}
    return RequestOutput(
        new.request_id,
        new.prompt,
        new.prompt_token_ids,
        [by_index[i] for i in sorted(by_index)],
        new.finished,
        prompt_logprobs=old.prompt_logprobs
        if old.prompt_logprobs is not None
        else new.prompt_logprobs,
        num_cached_tokens=old.num_cached_tokens,
        metrics=metrics,
    )


def _merge_choice(a: CompletionOutput, b: CompletionOutput) -> CompletionOutput:
    logprobs = a.logprobs
    if b.logprobs is not None:
        logprobs = b.logprobs if a.logprobs is None else [*a.logprobs, *b.logprobs]
    return CompletionOutput(
        a.index,
        a.text + b.text,
        [*a.token_ids, *b.token_ids],
        b.cumulative_logprob if b.cumulative_logprob is not None else a.cumulative_logprob,
        logprobs,
        b.finish_reason or a.finish_reason,
        b.stop_reason if b.finish_reason else a.stop_reason,
    )
