"""Where kvflow keeps files: the cache root, scratch paths removed on an early exit, file locks.

Standard library only, so every layer (kernels included) may use it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
from collections.abc import Iterator
from pathlib import Path


def cache_root(cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """`cache_dir`, else $KVFLOW_CACHE, else ~/.cache/kvflow."""
    if cache_dir is not None:
        return Path(cache_dir).expanduser()
    return Path(os.environ.get("KVFLOW_CACHE") or Path.home() / ".cache" / "kvflow").expanduser()


_SCRATCH: set[Path] = set()


@contextlib.contextmanager
def scratch(path: Path) -> Iterator[None]:
    """`path`, a temporary file or directory being written, is removed when the block ends
    (if still there) and by `remove_scratch` if the process is cut short inside the block."""
    _SCRATCH.add(path)
    try:
        yield
    finally:
        _SCRATCH.discard(path)
        _remove(path)


def remove_scratch() -> None:
    """Remove every `scratch` path being written now (before a hard exit on a signal)."""
    for path in list(_SCRATCH):
        _remove(path)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


@contextlib.contextmanager
def locked(lock_path: Path) -> Iterator[None]:
    """An exclusive lock on `lock_path` (created if absent) for the block."""
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)
