"""`keep_freed_memory` (kernels/cpu/host_memory.py): memory a thread frees is reused, not handed
back to the system and page-faulted in again at the next step. Each case runs in a fresh
process: malloc's settings and its arenas are per process."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from kvflow.kernels.cpu.host_memory import ENVIRONMENT

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's malloc"
)

# A thread (an engine's, with its own arena) takes and frees a 20 MB block per "step"; prints
# whether the settings applied and the page faults of each step.
STEPS = """
import ctypes, json, resource, sys, threading
from kvflow.kernels.cpu.host_memory import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == "1" else False
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
faults = []
def steps():
    for _ in range(4):
        before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
        block = libc.malloc(20 << 20)
        ctypes.memset(block, 1, 20 << 20)
        libc.free(block)
        faults.append(resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before)
thread = threading.Thread(target=steps)
thread.start()
thread.join()
print(json.dumps({"applied": applied, "faults": faults}))
"""


def _steps(apply: bool, **env: str) -> dict:
    """STEPS in a fresh process whose environment sets malloc only as `env` says."""
    own = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES" and k not in ENVIRONMENT}
    done = subprocess.run(
        [sys.executable, "-c", STEPS, "1" if apply else "0"],
        env={**own, **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_freed_blocks_are_reused_without_page_faults() -> None:
    """With the settings only the first step faults its block in; with glibc's defaults the
    first block is mmapped and unmapped, so the second step faults a new one in as well."""
    kept = _steps(apply=True)
    assert kept["applied"] is True
    assert kept["faults"][0] > 0 and kept["faults"][1:] == [0, 0, 0]
    default = _steps(apply=False)
    assert default["faults"][1] > 0


def test_a_malloc_setting_in_the_environment_wins() -> None:
    assert _steps(apply=True, GLIBC_TUNABLES="glibc.malloc.top_pad=0")["applied"] is False
    assert _steps(apply=True, MALLOC_TOP_PAD_="0")["applied"] is False
