"""The native kernels built for x86-64-v3 (AVX2 + FMA: most CPUs without AVX-512, AMD EPYC
before Zen 4 and most laptops) on whatever host runs the suite: the library compiles and the
kernel tests pass on it, each wider route (AVX-512, VNNI, AMX) absent from the build and so
left to the paths such a CPU takes."""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(
    platform.machine().lower() not in ("x86_64", "amd64"), reason="an x86-64 target"
)


def test_kernels_built_for_x86_64_v3_pass_their_tests(tmp_path: Path) -> None:
    env = {**os.environ, "KVFLOW_NATIVE_MARCH": "x86-64-v3", "KVFLOW_CACHE": str(tmp_path)}
    tests = ["tests/model/test_cpu_kernels.py", "tests/model/test_quant_kernels.py"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", *tests]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    built = sorted(p.name for p in (tmp_path / "kernels").glob("*.so"))
    assert [n.split("-")[0] for n in built] == ["cpu_kernels", "quant_kernels"], built
    if shutil.which("objdump"):  # no 512-bit register anywhere in the code it runs
        for so in (tmp_path / "kernels").glob("*.so"):
            code = subprocess.run(["objdump", "-d", str(so)], capture_output=True, text=True)
            assert "%zmm" not in code.stdout, so.name
