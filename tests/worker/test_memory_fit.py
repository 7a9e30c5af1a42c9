"""A model that cannot fit the memory it is given is refused at start-up, naming the sizes,
before its weights load (`memory_fit.py`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from kvflow.memory_fit import GIB, available_bytes, cgroup_room
from kvflow.model.safetensors_file import checkpoint_elements

START_BOUND_S = 180.0  # generous: the refusal comes before the model loads


def test_checkpoint_elements_reads_the_headers(tmp_path: Path):
    save_file(
        {"a": torch.zeros(3, 5), "b": torch.zeros(7, dtype=torch.bfloat16)},
        tmp_path / "x.safetensors",
    )
    save_file({"c": torch.zeros(2, 2, 2)}, tmp_path / "y.safetensors")
    assert checkpoint_elements(tmp_path) == 15 + 7 + 8


def _proc(tmp_path: Path, cgroup: str, available_kib: int = 8 << 20) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "meminfo").write_text(f"MemTotal: 1 kB\nMemAvailable: {available_kib} kB\n")
    return proc


def test_cgroup_v2_and_v1_limits_are_read(tmp_path: Path):
    root = tmp_path / "cg"
    (root / "svc").mkdir(parents=True)
    (root / "svc" / "memory.max").write_text(f"{3 * GIB}\n")
    (root / "svc" / "memory.current").write_text(f"{GIB}\n")
    proc = _proc(tmp_path, "0::/svc\n")
    assert cgroup_room(proc, root) == (3 * GIB, GIB)
    available, source = available_bytes(proc, root)  # 2 GiB left under 8 GiB MemAvailable
    assert available == 2 * GIB and "cgroup" in source

    (root / "svc" / "memory.max").write_text("max\n")
    assert cgroup_room(proc, root) is None
    assert available_bytes(proc, root) == (8 * GIB, "MemAvailable")

    v1 = root / "memory" / "box"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(str(GIB))
    (v1 / "memory.usage_in_bytes").write_text(str(GIB // 4))
    proc = _proc(tmp_path / "v1", "4:memory:/box\n1:cpu:/\n")
    assert cgroup_room(proc, root) == (GIB, GIB // 4)
    (v1 / "memory.limit_in_bytes").write_text(str(2**63 - 4096))  # v1's "no limit"
    assert cgroup_room(proc, root) is None


def _serve(*flags: str, preexec=None, env=None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "kvflow.cli", "serve", "--port", "0", *flags]
    return subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=START_BOUND_S,
        preexec_fn=preexec,
        env={**os.environ, **(env or {})},
    )


def test_a_kv_pool_larger_than_the_host_is_refused_with_the_sizes():
    available, _ = available_bytes()
    asked = (available // GIB + 8) * GIB
    done = _serve("--kv-cache-memory", str(asked))
    assert done.returncode == 2, done.stderr[-2000:]
    message = done.stderr
    assert f"KV cache {asked / GIB:.2f} GiB" in message and "fixed overhead 1.00 GiB" in message
    assert "is available (MemAvailable)" in message and "--kv-cache-memory" in message
    assert "quantization:" not in message  # refused before the weights loaded


def test_tensor_parallel_ranks_are_counted_together():
    """Two CPU ranks, each with a KV pool that alone would fit: their pools and their two
    interpreters together do not, and the start is refused with those sizes before any rank
    starts."""
    available, _ = available_bytes()
    each = (available // 2 // GIB + 1) * GIB
    done = _serve("--tensor-parallel-size", "2", "--kv-cache-memory", str(each))
    assert done.returncode == 2, done.stderr[-2000:]
    message = done.stderr
    assert f"KV cache {2 * each / GIB:.2f} GiB" in message, message[-2000:]
    assert "2 ranks' fixed overhead 2.00 GiB" in message and "on fewer ranks" in message
    assert "tensor parallel:" not in message  # no rank loaded anything


def _cgroup_v1(limit: int) -> Path | None:
    parent = Path("/sys/fs/cgroup/memory")
    if not os.access(parent, os.W_OK):
        return None
    group = parent / f"kvflow-test-{uuid.uuid4().hex[:8]}"
    try:
        group.mkdir()
        (group / "memory.limit_in_bytes").write_text(str(limit))
    except OSError:
        return None
    return group


def _in_cgroup(limit: int, *flags: str, env=None) -> subprocess.CompletedProcess:
    """`kvflow serve *flags` inside a new cgroup v1 memory group of `limit` bytes."""
    group = _cgroup_v1(limit)
    if group is None:
        pytest.skip("cannot make a cgroup v1 memory group here (not root, or cgroup v2)")
    procs = str(group / "cgroup.procs")
    try:
        return _serve(*flags, preexec=lambda: Path(procs).write_text(str(os.getpid())), env=env)
    finally:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                group.rmdir()
                break
            except OSError:  # its last process is still being reaped
                time.sleep(0.1)


def test_a_memory_cgroup_too_small_is_refused_naming_it():
    done = _in_cgroup(2 * GIB, "--kv-cache-memory", "1500M")
    assert done.returncode == 2, done.stderr[-2000:]
    assert "the memory cgroup's limit 2.00 GiB" in done.stderr


def test_a_gguf_is_counted_as_it_is_served(tmp_path: Path):
    """A GGUF's weights count at their stored bytes where --quantization gguf serves them as
    stored, at the dtype's size dequantized; refused under a 1 GiB cgroup either way (the
    fixed overhead alone is 1 GiB), before any weight is read: the fresh cache holds the
    config and tokenizer alone."""
    env = {"KVFLOW_CACHE": str(tmp_path)}
    flags = ("--dtype", "float32", "--kv-cache-memory", "100M")
    stored = _in_cgroup(GIB, *flags, "--quantization", "gguf", env=env)
    assert stored.returncode == 2, stored.stderr[-2000:]
    assert "weights (as stored) 0.09 GiB" in stored.stderr
    floats = _in_cgroup(GIB, *flags, env=env)
    assert floats.returncode == 2, floats.stderr[-2000:]
    assert "weights (dequantized to float32) 0.50 GiB" in floats.stderr
    assert "Served as stored (--quantization gguf) its weights take 0.09 GiB." in floats.stderr
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written and sum(p.stat().st_size for p in written) < 10 * 2**20
