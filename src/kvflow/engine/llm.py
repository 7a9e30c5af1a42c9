"""The offline API: `LLM(...).generate(prompts, params)` and `.chat(messages)`, like vLLM's."""

from __future__ import annotations

import itertools
from dataclasses import fields

from tqdm import tqdm

from kvflow.engine.llm_engine import EngineArgs, LLMEngine
from kvflow.outputs import CompletionOutput, RequestOutput
from kvflow.sampling_params import SamplingParams

PromptType = str | list[int] | dict


class LLM:
    """`LLM(model=None, **engine_args)`: None loads the embedded default model.

    Engine arguments use vLLM's names (dtype, max_model_len, block_size, num_blocks,
    kv_cache_memory, max_num_seqs, max_num_batched_tokens, enable_prefix_caching, seed, ...).
    """

    def __init__(self, model: str | None = None, **kwargs) -> None:
        if "num_gpu_blocks_override" in kwargs:
            kwargs["num_blocks"] = kwargs.pop("num_gpu_blocks_override")
        known = {f.name for f in fields(EngineArgs)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"unknown engine arguments: {sorted(unknown)}")
        kwargs.setdefault("offline", True)
        self.engine = LLMEngine.from_args(EngineArgs(model=model, **kwargs))
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: PromptType | list[PromptType],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the prompts' order.

        A prompt is a string, a list of token ids, or {"prompt": str} / {"prompt_token_ids": [...]}.
        """
        if isinstance(prompts, str | dict) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError("sampling_params must be one object or one per prompt")
        order = []
        try:
            for prompt, p in zip(prompts, params_list, strict=True):
                text, token_ids = self._prompt(prompt)
                request_id = str(next(self._ids))
                self.engine.add_request(request_id, token_ids, p, prompt=text)
                order.append(request_id)
        except Exception:
            self.engine.abort_request(order)  # all or nothing: drop what was already queued
            raise
        return self._run(order, use_tqdm)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {
                "prompt_token_ids": self.engine.tokenizer.apply_chat_template(
                    conv,
                    add_generation_prompt=add_generation_prompt,
                    tokenize=True,
                    return_dict=False,
                )
            }
            for conv in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _prompt(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), self.engine.tokenize_prompt(
                    list(prompt["prompt_token_ids"])
                )
            prompt = prompt["prompt"]
        if isinstance(prompt, str):
            return prompt, self.engine.tokenize_prompt(prompt)
        return None, self.engine.tokenize_prompt(list(prompt))

    def _run(self, order: list[str], use_tqdm: bool) -> list[RequestOutput]:
        final: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(order), disable=not use_tqdm, desc="generate")
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                acc = final.setdefault(
                    delta.request_id,
                    RequestOutput(
                        delta.request_id,
                        delta.prompt,
                        delta.prompt_token_ids,
                        [],
                        False,
                        num_cached_tokens=delta.num_cached_tokens,
                    ),
                )
                for c in delta.outputs:
                    _merge(acc, c)
                if delta.prompt_logprobs is not None:
                    acc.prompt_logprobs = delta.prompt_logprobs
                acc.finished = delta.finished
                acc.metrics.update(delta.metrics)
                if delta.finished:
                    bar.update(1)
        bar.close()
        return [final[r] for r in order]


def _merge(acc: RequestOutput, delta: CompletionOutput) -> None:
    """Fold one delta choice into the accumulated output (choices sorted by index)."""
    for c in acc.outputs:
        if c.index == delta.index:
            c.text += delta.text
            c.token_ids.extend(delta.token_ids)
            if delta.logprobs is not None:
                c.logprobs = (c.logprobs or []) + delta.logprobs
            c.cumulative_logprob = delta.cumulative_logprob
            c.finish_reason, c.stop_reason = delta.finish_reason, delta.stop_reason
            return
    acc.outputs.append(
        CompletionOutput(
            delta.index,
            delta.text,
            list(delta.token_ids),
            delta.cumulative_logprob,
            list(delta.logprobs) if delta.logprobs is not None else None,
            delta.finish_reason,
            delta.stop_reason,
        )
    )
    acc.outputs.sort(key=lambda c: c.index)
