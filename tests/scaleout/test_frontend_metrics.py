"""One `kvflow serve` with a deployment's flags (TLS with a self-signed certificate made here,
--root-path, CORS, --enable-request-id-headers, a body limit, --kv-events-config,
--enable-request-id-headers, --enable-log-requests with --max-log-len), and its /metrics page
against a real vLLM 0.32 page: every `vllm:` family there exists here with the same type and
label names."""

from __future__ import annotations

import datetime
import ipaddress
import os
import time
from pathlib import Path

import httpx
import msgspec
import openai
import pytest
import zmq
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from prometheus_client.parser import text_string_to_metric_families

from support.serverproc import ServerProcess, free_port, launch

SAMPLE = Path(__file__).parent / "data" / "vllm-0.32-metrics-sample.txt"
MODEL = "SmolLM2-135M-Instruct"
ROOT = "/kvflow"
ORIGIN = "http://dashboard.example"
MAX_LOG_LEN = 12


def self_signed(directory: Path) -> tuple[Path, Path]:
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    key_path, cert_path = directory / "key.pem", directory / "cert.pem"
    key_path.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return key_path, cert_path


class TlsServer(ServerProcess):
    cert: Path | None = None

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def health(self) -> int | None:
        try:
            return httpx.get(f"{self.url}/health", verify=str(self.cert), timeout=5).status_code
        except httpx.HTTPError:
            return None

    def http(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, verify=str(self.cert), timeout=60)


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    key, cert = self_signed(tmp_path_factory.mktemp("tls"))
    pub, replay = free_port(), free_port()
    events = (
        f'{{"enable_kv_cache_events": true, "publisher": "zmq", "endpoint": "tcp://*:{pub}", '
        f'"replay_endpoint": "tcp://*:{replay}", "topic": "kvflow"}}'
    )
    args = [
        "--dtype", "float32", "--num-blocks", "128", "--block-size", "16",
        "--uvicorn-log-level", "warning",
        "--ssl-keyfile", str(key), "--ssl-certfile", str(cert), "--root-path", ROOT,
        "--allowed-origins", f'["{ORIGIN}"]', "--allowed-methods", '["GET", "POST"]',
        "--enable-request-id-headers", "--max-request-body-bytes", "1MiB",
        "--kv-events-config", events,
        "--enable-log-requests", "--max-log-len", str(MAX_LOG_LEN),
    ]  # fmt: skip
    server = TlsServer(*launch(args, dict(os.environ), "kvflow-tls-"))
    server.cert = cert
    server.wait_healthy()
    server.kv_events = (pub, replay)
    yield server
    server.signal()
    try:
        server.wait_exit(20)
    finally:
        server.kill()


def client(server: TlsServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=f"{server.url}/v1",  # a path-routing proxy strips --root-path
        api_key="x",
        max_retries=0,
        http_client=httpx.Client(verify=str(server.cert), timeout=60),
    )


def families(text: str) -> dict[str, tuple[str, set[str]]]:
    """name -> (type, label names over its samples, without the histogram's `le`)."""
    out = {}
    for family in text_string_to_metric_families(text):
        labels = {k for s in family.samples for k in s.labels if k not in ("le", "quantile")}
        out[family.name] = (family.type, labels)
    return out


def test_tls_root_path_and_request_ids(tls):
    out = client(tls).completions.create(model=MODEL, prompt="Hello there", max_tokens=4)
    assert out.usage.completion_tokens == 4
    with tls.http() as http:
        given = http.get("/v1/models", headers={"X-Request-Id": "abc-123"})
        assert given.status_code == 200 and given.headers["x-request-id"] == "abc-123"
        made = http.get("/health")
        assert made.status_code == 200 and len(made.headers["x-request-id"]) == 32
        # the app knows the prefix it is served under (links, the OpenAPI document)
        assert http.get("/openapi.json").json()["servers"] == [{"url": ROOT}]
    with pytest.raises(httpx.HTTPError):  # HTTPS only
        httpx.get(f"http://127.0.0.1:{tls.port}/health", timeout=5)


def test_cors_answers_the_allowed_origin_only(tls):
    with tls.http() as http:
        preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
        ok = http.options("/v1/completions", headers=preflight)
        assert ok.status_code == 200
        assert ok.headers["access-control-allow-origin"] == ORIGIN
        bad = http.options("/v1/completions", headers={**preflight, "Origin": "http://evil"})
        assert bad.status_code == 400 and "access-control-allow-origin" not in bad.headers
        simple = http.get("/v1/models", headers={"Origin": ORIGIN})
        assert simple.headers["access-control-allow-origin"] == ORIGIN


def test_a_body_over_the_limit_is_a_413_not_a_hang(tls):
    big = {"model": MODEL, "prompt": "x" * (2 << 20), "max_tokens": 1}
    with tls.http() as http:
        start = time.monotonic()
        declared = http.post("/v1/completions", json=big)
        assert declared.status_code == 413
        assert declared.json() == {
            "error": {
                "message": "Request body too large: the limit is 1048576 bytes.",
                "type": "RequestEntityTooLargeError",
                "param": None,
                "code": 413,
            }
        }

        def chunks():  # no Content-Length: the limit is found while reading
            yield b'{"prompt": "'
            for _ in range(40):
                yield b"y" * 65536

        streamed = http.post("/v1/completions", content=chunks())
        assert streamed.status_code == 413
        assert streamed.json()["error"]["type"] == "RequestEntityTooLargeError"
        assert time.monotonic() - start < 30
    assert tls.health() == 200


def test_kv_events_describe_the_prompt_blocks(tls):
    ctx = zmq.Context()
    try:
        pub, replay = tls.kv_events
        prompt = "The quick brown fox jumps over the lazy dog. " * 6
        with tls.http() as http:
            ids = http.post("/tokenize", json={"model": MODEL, "prompt": prompt}).json()["tokens"]
        client(tls).completions.create(model=MODEL, prompt=prompt, max_tokens=1)
        dealer = ctx.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(f"tcp://127.0.0.1:{replay}")
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        stored: list[list] = []
        while True:
            assert dealer.poll(10_000), "no replay answer"
            _, seq, payload = dealer.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                break
            for event in msgspec.msgpack.decode(payload)[1]:
                if event["type"] == "BlockStored":
                    stored.append(event)
        dealer.close()
        tokens = [t for event in stored for t in event["token_ids"]]
        full = len(ids) // 16 * 16
        assert full >= 16 and ids[:full] in [tokens[i : i + full] for i in range(len(tokens))]
        assert all(event["block_size"] == 16 and event["medium"] == "GPU" for event in stored)
    finally:
        ctx.term()


def test_log_requests_cut_at_max_log_len(tls):
    client(tls).completions.create(model=MODEL, prompt="Zebra" * 20, max_tokens=1)
    time.sleep(0.5)
    log = tls.log()
    assert "'" + ("Zebra" * 20)[:MAX_LOG_LEN] + "'" in log
    assert ("Zebra" * 20)[: MAX_LOG_LEN + 1] not in log


def test_every_vllm_family_of_a_real_vllm_page_exists_with_its_type_and_labels(tls):
    openai_client = client(tls)
    prompt = "A long shared system prompt about the history of Paris. " * 8
    for _ in range(2):  # the second reads the first's blocks from the prefix cache
        openai_client.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
    with tls.http() as http:
        page = http.get("/metrics").text
    ours, theirs = families(page), families(SAMPLE.read_text())
    wanted = {n: v for n, v in theirs.items() if n.startswith("vllm:")}
    assert len(wanted) > 35
    missing = sorted(n for n in wanted if n not in ours)
    assert not missing, missing
    differ = {n: (wanted[n], ours[n]) for n in wanted if ours[n] != wanted[n]}
    assert not differ, differ
    for name in ("vllm:lora_requests_info", "vllm:gpu_cache_usage_perc",
                 "vllm:gpu_prefix_cache_hits", "vllm:gpu_prefix_cache_queries"):  # fmt: skip
        assert name in ours, name
    values = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(page)
        for s in family.samples
    }

    def value(name: str, **labels: str) -> float:
        return sum(
            v for (n, ls), v in values.items() if n == name and set(labels.items()) <= set(ls)
        )

    prompt_total = value("vllm:prompt_tokens_total")
    cached = value("vllm:prompt_tokens_cached_total")
    assert cached >= 16 * 3  # the repeated prompt's full blocks
    assert value("vllm:prompt_tokens_by_source_total") == prompt_total
    assert value("vllm:prompt_tokens_by_source_total", source="local_cache_hit") == cached
    assert value("vllm:prompt_tokens_cached_by_source_total", source="device") == cached
    assert value("vllm:gpu_prefix_cache_hits_total") == value("vllm:prefix_cache_hits_total")
    assert value("vllm:gpu_prefix_cache_queries_total") == value("vllm:prefix_cache_queries_total")
    assert value("vllm:estimated_flops_per_gpu_total") > 2 * 134e6 * prompt_total / 2
    assert value("vllm:estimated_read_bytes_per_gpu_total") > 134e6 * 4  # fp32 weights, once
    assert value("vllm:estimated_write_bytes_per_gpu_total") > 0
    assert value("vllm:engine_sleep_state", sleep_state="awake") == 1
    assert value("vllm:request_prefill_kv_computed_tokens_count") >= 2
    assert value("vllm:request_num_preemptions_count") >= 2
    info = [s for f in text_string_to_metric_families(page) if f.name == "vllm:cache_config_info"
            for s in f.samples][0]  # fmt: skip
    assert info.labels["num_gpu_blocks"] == "128" and info.labels["block_size"] == "16"
    assert info.labels["kv_cache_size_tokens"] == str(127 * 16)


def test_deployment_flags_parse():
    import argparse

    from kvflow.server.args import add_serve_arguments

    parser = add_serve_arguments(argparse.ArgumentParser(exit_on_error=False))
    args = parser.parse_args(
        [
            "--allowed-origins",
            "*",
            "--allowed-headers",
            '["X-A", "X-B"]',
            "--allow-credentials",
            "--max-request-body-bytes",
            "2MiB",
            "--disable-log-stats",
        ]  # fmt: skip
    )
    assert args.allowed_origins == ["*"] and args.allowed_headers == ["X-A", "X-B"]
    assert args.max_request_body_bytes == 2 << 20 and args.disable_log_stats
    assert parser.parse_args([]).kv_events_config is None
    with pytest.raises(argparse.ArgumentError):
        parser.parse_args(["--kv-events-config", '{"publisher": "kafka"}'])
