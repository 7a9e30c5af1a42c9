"""kvflow.core imports the standard library only: importing it with torch blocked must work."""

from __future__ import annotations

import subprocess
import sys

CODE = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split('.')[0] in ('torch', 'numpy', 'transformers'):
            raise ImportError('blocked: ' + name)
sys.meta_path.insert(0, Block())
import kvflow.core.scheduler, kvflow.core.block_pool, kvflow.core.kv_cache_manager
import kvflow.core.messages, kvflow.core.request, kvflow.core.hashing, kvflow.config
import kvflow.core.kv_events, kvflow.core.perf
import kvflow.engine.engine_core, kvflow.sampling_params
from kvflow import SamplingParams
print('ok')
"""


def test_core_imports_without_torch():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"
