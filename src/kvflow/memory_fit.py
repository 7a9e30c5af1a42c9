"""Whether a model fits the host's memory, asked before anything is loaded, and what the load
took.

A CPU engine's start-up holds the model's weights as it serves them (in the dtype it runs in,
or a GGUF's blocks as stored), the KV pool, and a fixed overhead: the interpreter with torch's,
the tokenizer's and the kernels' libraries (`OVERHEAD`). The host gives it the smaller of the
kernel's MemAvailable and what its memory cgroup (v2 or v1, as a container gets one) leaves. A
model that needs more is refused at start-up with the sizes, so it never meets the kernel's OOM
killer halfway through its load. Standard library only: the worker asks it before it loads
anything.
"""

from __future__ import annotations

from pathlib import Path

GIB = 1 << 30
# Resident before any weight: measured 0.9 GiB for the embedded 135M model's server less its
# weights and KV pool (benchmarks/RESULTS.md), rounded up.
OVERHEAD = 1 * GIB
_PROC = Path("/proc")
_CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_room(proc: Path = _PROC, root: Path = _CGROUP_ROOT) -> tuple[int, int] | None:
    """(limit, usage) of this process's memory cgroup, or None when it sets no limit. Reads
    cgroup v2's memory.max / memory.current, else v1's memory.limit_in_bytes / usage_in_bytes."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, group = line.split(":", 2)
        if controllers == "":
            files, folder = ("memory.max", "memory.current"), root / group.lstrip("/")
        elif "memory" in controllers.split(","):
            files = ("memory.limit_in_bytes", "memory.usage_in_bytes")
            folder = root / "memory" / group.lstrip("/")
        else:
            continue
        try:
            limit_text = (folder / files[0]).read_text().strip()
            usage = int((folder / files[1]).read_text())
        except (OSError, ValueError):
            continue
        if limit_text != "max" and int(limit_text) < 1 << 60:  # v1 writes "no limit" as ~2^63
            return int(limit_text), usage
    return None


def available_bytes(proc: Path = _PROC, root: Path = _CGROUP_ROOT) -> tuple[int, str]:
    """(bytes this process can still take, where that figure comes from)."""
    available, source = _mem_available(proc), "MemAvailable"
    room = cgroup_room(proc, root)
    if room is not None and room[0] - room[1] < available:
        available = room[0] - room[1]
        source = f"the memory cgroup's limit {room[0] / GIB:.2f} GiB less its use {room[1] / GIB:.2f} GiB"
    return available, source


def _mem_available(proc: Path) -> int:
    for line in (proc / "meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    raise ValueError("/proc/meminfo has no MemAvailable line")


def check_fits(what: str, parts: dict[str, int], flags: str) -> None:
    """ValueError naming each part's size, the total and what is available when `parts` plus
    `OVERHEAD` exceed `available_bytes()`; `flags` says what would make it fit."""
    parts = {**parts, "fixed overhead": OVERHEAD}
    need = sum(parts.values())
    available, source = available_bytes()
    if need <= available:
        return
    sizes = " + ".join(f"{name} {size / GIB:.2f} GiB" for name, size in parts.items())
    raise ValueError(
        f"{what} needs {need / GIB:.2f} GiB of memory ({sizes}), but {available / GIB:.2f} GiB "
        f"is available ({source}). {flags}"
    )


def peak_resident() -> int:
    """This process's peak resident bytes so far (VmHWM)."""
    for line in (_PROC / "self" / "status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0
