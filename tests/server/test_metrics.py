"""/metrics: vLLM's names, types and labels; counters move by exactly what a test sent; a
client that goes away (streaming or not) frees its KV blocks within a second."""

from __future__ import annotations

import time

import httpx
import pytest

from support.serverproc import scrape, wait_for

MODEL = "SmolLM2-135M-Instruct"
LABELS = {"model_name": MODEL, "engine": "0"}

TYPES = {
    "vllm:num_requests_running": "gauge",
    "vllm:num_requests_waiting": "gauge",
    "vllm:num_requests_waiting_by_reason": "gauge",
    "vllm:kv_cache_usage_perc": "gauge",
    "vllm:num_preemptions_total": "counter",
    "vllm:prompt_tokens_total": "counter",
    "vllm:generation_tokens_total": "counter",
    "vllm:request_success_total": "counter",
    "vllm:prefix_cache_queries_total": "counter",
    "vllm:prefix_cache_hits_total": "counter",
    "kvflow:stuck_requests_failed_total": "counter",
    "vllm:iteration_tokens_total": "histogram",
    "vllm:time_to_first_token_seconds": "histogram",
    "vllm:inter_token_latency_seconds": "histogram",
    "vllm:e2e_request_latency_seconds": "histogram",
    "vllm:request_queue_time_seconds": "histogram",
    "vllm:request_prompt_tokens": "histogram",
    "vllm:request_generation_tokens": "histogram",
    "vllm:request_prefill_time_seconds": "histogram",
    "vllm:request_decode_time_seconds": "histogram",
    "vllm:request_inference_time_seconds": "histogram",
    "vllm:request_time_per_output_token_seconds": "histogram",
    "vllm:request_params_n": "histogram",
    "vllm:request_params_max_tokens": "histogram",
    "vllm:request_max_num_generation_tokens": "histogram",
    "vllm:cache_config_info": "gauge",
}


def idle(server) -> bool:
    m = scrape(server)
    running = m.value("vllm:num_requests_running", **LABELS)
    waiting = m.value("vllm:num_requests_waiting", **LABELS)
    return running == 0 and waiting == 0 and m.value("vllm:kv_cache_usage_perc", **LABELS) == 0


def test_every_metric_has_its_type_and_labels(server):
    m = scrape(server)
    for name, kind in TYPES.items():
        assert m.type_of(name) == kind, name
    for reason in ("capacity", "deferred"):
        m.value("vllm:num_requests_waiting_by_reason", reason=reason, **LABELS)
    for reason in ("stop", "length", "abort", "error"):
        m.value("vllm:request_success_total", finished_reason=reason, **LABELS)
    info = m.value("vllm:cache_config_info", block_size="16", num_gpu_blocks="128")
    assert info == 1.0
    assert 0.0 <= m.value("vllm:kv_cache_usage_perc", **LABELS) <= 1.0


def test_counters_move_by_exactly_what_was_sent(server):
    wait_for(lambda: idle(server), timeout=10)
    before = scrape(server)
    body = {"prompt": "The capital of France is", "max_tokens": 5, "temperature": 0}
    for _ in range(2):
        resp = server.post("/v1/completions", {**body, "ignore_eos": True})
        assert resp.json()["usage"]["completion_tokens"] == 5
    after = scrape(server)

    def delta(name: str, **labels: str) -> float:
        return after.value(name, **LABELS, **labels) - before.value(name, **LABELS, **labels)

    assert delta("vllm:prompt_tokens_total") == 10
    assert delta("vllm:generation_tokens_total") == 10
    assert delta("vllm:request_success_total", finished_reason="length") == 2
    assert delta("vllm:request_success_total") == 2
    for hist in ("e2e_request_latency_seconds", "time_to_first_token_seconds"):
        assert delta(f"vllm:{hist}_count") == 2
    assert delta("vllm:request_queue_time_seconds_count") == 2
    assert delta("vllm:inter_token_latency_seconds_count") == 8
    assert delta("vllm:request_prompt_tokens_sum") == 10
    assert delta("vllm:request_generation_tokens_sum") == 10
    assert delta("vllm:prefix_cache_queries_total") == 10
    assert delta("vllm:prefix_cache_hits_total") == 0  # 5-token prompts fill no 16-token block
    assert delta("vllm:iteration_tokens_total_sum") == 2 * (5 + 4)
    assert delta("vllm:num_preemptions_total") == 0
    # vLLM's per-request intervals: inference = prefill + decode, each request once
    phases = {p: delta(f"vllm:request_{p}_time_seconds_sum") for p in ("prefill", "decode")}
    inference = delta("vllm:request_inference_time_seconds_sum")
    assert inference == pytest.approx(phases["prefill"] + phases["decode"], abs=1e-6)
    assert phases["decode"] > 0 and delta("vllm:request_decode_time_seconds_count") == 2
    assert delta("vllm:request_time_per_output_token_seconds_sum") == pytest.approx(
        phases["decode"] / 4, rel=1e-6
    )  # 5 tokens: 4 after the first, per request
    assert delta("vllm:request_params_n_sum") == 2
    assert delta("vllm:request_params_max_tokens_sum") == 10
    assert delta("vllm:request_max_num_generation_tokens_sum") == 10
    choices = {**body, "ignore_eos": True, "n": 3, "max_tokens": 4, "temperature": 1.0}
    before = scrape(server)
    assert server.post("/v1/completions", choices).json()["usage"]["completion_tokens"] == 12
    after = scrape(server)
    assert delta("vllm:request_params_n_sum") == 3
    assert delta("vllm:request_max_num_generation_tokens_sum") == 4  # the longest choice's


LONG = {"prompt": "Once upon a time", "max_tokens": 800, "ignore_eos": True, "temperature": 0}


def test_streaming_disconnect_frees_blocks_within_a_second(server):
    wait_for(lambda: idle(server), timeout=10)
    aborted = scrape(server).value("vllm:request_success_total", finished_reason="abort")
    with httpx.stream(
        "POST", f"{server.url}/v1/completions", json={**LONG, "stream": True}, timeout=60
    ) as resp:
        lines = resp.iter_lines()
        for _ in range(3):
            assert next(lines).startswith("data: ")
            next(lines)
        during = scrape(server)
        assert during.value("vllm:num_requests_running", **LABELS) == 1
        assert during.value("vllm:kv_cache_usage_perc", **LABELS) > 0
    took = wait_for(lambda: idle(server), timeout=1.0)
    after = scrape(server).value("vllm:request_success_total", finished_reason="abort")
    assert after == aborted + 1, f"freed in {took:.2f}s but not counted as an abort"


def test_non_streaming_client_giving_up_frees_blocks_within_a_second(server):
    wait_for(lambda: idle(server), timeout=10)
    aborted = scrape(server).value("vllm:request_success_total", finished_reason="abort")
    start = time.monotonic()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/v1/completions", json=LONG, timeout=1.5)
    assert time.monotonic() - start < 10
    wait_for(lambda: idle(server), timeout=1.0)
    after = scrape(server).value("vllm:request_success_total", finished_reason="abort")
    assert after == aborted + 1
    assert httpx.get(f"{server.url}/health", timeout=10).status_code == 200


def test_request_timeout_aborts_with_a_terminal_answer(server):
    wait_for(lambda: idle(server), timeout=10)
    resp = server.post("/v1/completions", {**LONG, "request_timeout": 0.5})
    assert resp.status_code == 408
    assert "timeout of 0.5 s" in resp.json()["error"]["message"]
    wait_for(lambda: idle(server), timeout=1.0)
    body = {**LONG, "request_timeout": 0.5, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/completions", json=body, timeout=30) as r:
        lines = [line for line in r.iter_lines() if line]
    assert lines[-1] == "data: [DONE]" and '"code":408' in lines[-2]
    wait_for(lambda: idle(server), timeout=1.0)
