"""`--distributed-executor-backend ray`: on a private local Ray cluster (127.0.0.1) the ranks,
Ray actors in a placement group, give the tokens the `mp` ranks give, here with `--quantization
gguf` (each actor holds the bytes of the file's blocks an `mp` rank holds) and a JSON-schema
constraint (its compiled grammar crosses to the actors); when the kvflow process is done no
process of the cluster (raylet, GCS, workers, actors) is left: the whole process tree under
kvflow is read from /proc before the exit and checked gone after it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest

pytestmark = pytest.mark.tp

SCRIPT = r"""
import json, sys
from pathlib import Path
from kvflow import LLM, SamplingParams
from kvflow.sampling_params import StructuredOutputsParams

def tree(pid):
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return [d for k in kids for d in [k, *tree(k)]]

prompts = ["The capital of France is", "def add(a, b):", "Red, green,", "A city as JSON:"]
params = [SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)] * 3
schema = json.loads(sys.argv[1])
constraint = StructuredOutputsParams(json=schema)
params.append(SamplingParams(temperature=0, max_tokens=40, structured_outputs=constraint))
engine = dict(dtype="float32", num_blocks=32, tensor_parallel_size=2, quantization="gguf")
tokens, held = {}, {}
for backend in ("mp", "ray"):
    llm = LLM(**engine, distributed_executor_backend=backend)
    outs = llm.generate(prompts, params)
    tokens[backend] = [o.outputs[0].token_ids for o in outs]
    descendants = tree(__import__("os").getpid())
    held[backend] = [r.quantized_bytes for r in llm.engine.core.runner.loaded]
    llm.engine.core.runner.shutdown()
print(json.dumps({"tokens": tokens, "held": held, "json": outs[-1].outputs[0].text,
                  "ray_tree": descendants}))
"""
SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}},
    "required": ["city"],
    "additionalProperties": False,
}


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_ray_ranks_give_mp_tokens_and_leave_no_process() -> None:
    pytest.importorskip("ray")
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # a private cluster
    env.update(RAY_USAGE_STATS_ENABLED="0", OMP_NUM_THREADS="1")
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT, json.dumps(SCHEMA)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["tokens"]["ray"] == result["tokens"]["mp"]
    assert result["held"]["ray"] == result["held"]["mp"] and min(result["held"]["ray"]) > 0
    jsonschema.validate(json.loads(result["json"]), SCHEMA)  # the grammar crossed to the actors
    tree = result["ray_tree"]
    assert len(tree) >= 4  # the GCS, the raylet and the two rank actors at least
    assert not [pid for pid in tree if _alive(pid)]
