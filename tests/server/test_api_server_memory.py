"""An API server over the engine process (`KVFLOW_ENGINE_PROCESS=1`) parses JSON and streams
text, and loads neither torch nor xgrammar: `kvflow serve` with the engine in its own process
answers a plain and a structured chat request, and refuses a malformed schema with a 400 in the
words of the engine's parse, while no libtorch and no xgrammar library is mapped in the API
server (its resident memory is printed). The API server's modules and its tokenizer, loaded as
the engine names it, import no torch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import jsonschema

from support.serverproc import (
    GEOMETRY,
    MAX_MODEL_LEN,
    ServerProcess,
    free_port,
    heavy_libraries,
    resident_mib,
)

SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}
FRONT_END = """
import sys
import kvflow.server.api_server
from kvflow.tokenizer_files import load_as

tokenizer = load_as(sys.argv[1], sys.argv[2])
tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
heavy = ("torch", "xgrammar", "kvflow.model", "kvflow.worker", "kvflow.structured.backend")
print(sorted(name for name in heavy if name in sys.modules))
"""


def test_the_front_end_and_its_tokenizer_import_no_torch() -> None:
    from kvflow.model.loader import load_tokenizer, resolve_model
    from kvflow.tokenizer_files import class_path

    path = resolve_model(None)
    named = class_path(load_tokenizer(path))  # what the engine's EngineInfo names
    proc = subprocess.run(
        [sys.executable, "-c", FRONT_END, str(path), named],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]", proc.stdout


def serve_over_the_engine_process() -> ServerProcess:
    """`kvflow serve` (the console script's module) with the engine in its own process."""
    port = free_port()
    fd, log_name = tempfile.mkstemp(prefix="kvflow-memory-", suffix=".log")
    os.close(fd)
    cmd = [sys.executable, "-m", "kvflow.cli", "serve", "--port", str(port), *GEOMETRY]
    cmd += ["--max-model-len", str(MAX_MODEL_LEN), "--uvicorn-log-level", "warning"]
    env = {**os.environ, "KVFLOW_ENGINE_PROCESS": "1", "PYTHONUNBUFFERED": "1"}
    with open(log_name, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    server = ServerProcess(proc, port, Path(log_name))
    server.wait_healthy()
    return server


def test_the_api_server_over_the_engine_process_maps_no_torch() -> None:
    server = serve_over_the_engine_process()
    try:
        assert len(server.children()) == 1  # the engine process
        chat = {"messages": [{"role": "user", "content": "Name a city."}], "max_tokens": 24}
        plain = server.post("/v1/chat/completions", chat)
        assert plain.status_code == 200, plain.text
        response_format = {"type": "json_schema", "json_schema": {"name": "c", "schema": SCHEMA}}
        body = {**chat, "temperature": 0, "response_format": response_format}
        structured = server.post("/v1/chat/completions", body)
        assert structured.status_code == 200, structured.text
        jsonschema.validate(
            json.loads(structured.json()["choices"][0]["message"]["content"]), SCHEMA
        )
        bad_format = {
            "type": "json_schema",
            "json_schema": {"name": "c", "schema": {"type": "nope"}},
        }
        bad = server.post("/v1/chat/completions", {**chat, "response_format": bad_format})
        assert bad.status_code == 400, bad.text
        error = bad.json()["error"]
        assert error["param"] == "response_format"
        assert error["message"].startswith("The output constraint (JSON schema) cannot be compiled")
        assert heavy_libraries(server.pid) == []
        print(f"  API server over the engine process: {resident_mib(server.pid):.0f} MiB resident")
    finally:
        server.stop()
