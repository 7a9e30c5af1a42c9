"""The engine core process: EngineCore (scheduler + model runner) stepped in a loop of its own,
serving one or more API server processes over ZeroMQ (`core_wire`).

    python -m kvflow.engine.core_proc ADDRESS SPEC_JSON      (started by `core_launch`)

The loop blocks on its socket only when the core has no unfinished request (an idle engine
sleeps); with work it takes whatever commands have arrived without waiting, steps, and sends
each client its outputs. Sends never block (no high-water mark): the loop never waits on the
HTTP side, and `LoopStats` measures what it spends on the transport.

Signals: during start-up SIGTERM/SIGINT end the process at once (removing a half-written
conversion); once serving it ignores them, since its parent orchestrates shutdown (a drain
must not lose its engine to a signal sent to the whole process group). The parent's death
kills it (PR_SET_PDEATHSIG), so it is never orphaned. An exception in the loop fails every
request, tells every client (Dead) and exits 1.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass

import msgspec
import zmq

from kvflow.core.request import Request, RequestStatus
from kvflow.engine import core_wire as wire
from kvflow.engine.async_stats import StepWatchdog
from kvflow.engine.llm_engine import EngineArgs, LLMEngine

logger = logging.getLogger("kvflow.engine")

_PR_SET_PDEATHSIG = 1


class LaunchSpec(msgspec.Struct):
    """What the parent passes on the command line (JSON)."""

    engine_args: EngineArgs
    parent_pid: int
    watchdog_timeout: float = 0.0


@dataclass
class LoopStats:
    """Where the loop's wall time goes, in seconds, since it started serving."""

    passes: int = 0
    steps: int = 0
    step_s: float = 0.0  # inside EngineCore.step (schedule, model, update)
    apply_s: float = 0.0  # decoding and applying commands
    send_s: float = 0.0  # encoding and sending outputs
    idle_s: float = 0.0  # blocked on the socket with no unfinished request
    max_send_s: float = 0.0
    # No field for "blocked while work waited": the loop polls its socket only when the core
    # has no unfinished request (`_iterate`), so with work it never waits on the API side.

    def line(self) -> str:
        items = asdict(self).items()
        return " ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in items)


class EngineCoreProc:
    """The loop: commands in, one step, outputs out; one owner (client) per request."""

    def __init__(self, engine: LLMEngine, sock: zmq.Socket, watchdog_timeout: float = 0.0):
        self.engine = engine
        self.core = engine.core
        self.sock = sock
        self.codec = wire.Codec()
        self.clients: dict[bytes, int] = {}  # identity -> NewRequests applied
        self.owner: dict[str, bytes] = {}  # core request id -> its client's identity
        self.timing = LoopStats()
        self._stopping = False
        self._watchdog = StepWatchdog(watchdog_timeout) if watchdog_timeout > 0 else None

    def loop_stats(self) -> LoopStats:
        """Where the loop's time went so far (a utility call's answer)."""
        return self.timing

    def run(self) -> int:
        """Serve until Shutdown (returns 0) or an exception (fails everything, returns 1)."""
        try:
            while self._iterate():
                pass
            return 0
        except Exception as exc:
            self._die(exc)
            return 1
        finally:
            if self._watchdog is not None:
                self._watchdog.stop(5.0)
            logger.info("engine loop: %s", self.timing.line())

    def _iterate(self) -> bool:
        st = self.timing
        st.passes += 1
        t0 = time.monotonic()
        if not self.core.has_unfinished_requests():
            self.sock.poll()  # sleeps until a client sends something
        t1 = time.monotonic()
        outputs = self._apply_pending()
        # constrained requests whose grammar compiled become schedulable; failed ones end
        grammars = self.engine.pending_grammars
        outputs += grammars.poll(self.core, block=not self.core.has_schedulable_work())
        t2 = time.monotonic()
        st.idle_s += t1 - t0
        st.apply_s += t2 - t1
        if self._stopping:
            outputs += self.core.abort_requests(list(self.core.scheduler.requests))
            self._publish(outputs, None)
            self._broadcast(wire.Bye())
            return False
        step_start = None
        if self.core.has_unfinished_requests():
            step_start = time.monotonic()
            if self._watchdog is not None:
                self._watchdog.begin()
            try:
                outputs += self.core.step()
            finally:
                if self._watchdog is not None:
                    self._watchdog.end()
            st.steps += 1
            st.step_s += time.monotonic() - step_start
        t3 = time.monotonic()
        self._publish(outputs, step_start)
        sent = time.monotonic() - t3
        st.send_s += sent
        st.max_send_s = max(st.max_send_s, sent)
        return True

    # ---- commands ----------------------------------------------------------------------------

    def _apply_pending(self) -> list:
        outputs: list = []
        while True:
            try:
                identity, data = self.sock.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return outputs
            self._apply(identity, self.codec.decode_down(data), outputs)

    def _apply(self, identity: bytes, msg: wire.Down, outputs: list) -> None:
        if isinstance(msg, wire.Add):
            for new in msg.requests:
                self.owner[new.request_id] = identity
                try:
                    self._add(_request(new))
                except ValueError as exc:
                    outputs += _error_output(new.request_id, str(exc))
            self.clients[identity] = self.clients.get(identity, 0) + len(msg.requests)
        elif isinstance(msg, wire.Abort):
            outputs += self.core.abort_requests(
                msg.request_ids, RequestStatus(msg.status), msg.error
            )
        elif isinstance(msg, wire.Hello):
            self.clients.setdefault(identity, 0)
            self._send(identity, self._ready())
        elif isinstance(msg, wire.Utility):
            self._send(identity, self._call(msg))
        elif isinstance(msg, wire.Shutdown):
            self._stopping = True

    def _add(self, request: Request) -> None:
        """Queue a core request; one with an output constraint waits (not schedulable) until
        its grammar compiles here. Raises ValueError."""
        so = request.sampling_params.structured_outputs
        grammar = self.engine.grammar
        if so is not None and grammar is None:
            raise ValueError("Structured outputs are not available: no grammar backend.")
        compiled = None if so is None else grammar.compile(so)
        self.core.add_request(request)
        if compiled is not None:
            self.engine.pending_grammars.add(request, compiled)

    def _ready(self) -> wire.Ready:
        e = self.engine
        return wire.Ready(
            model_path=str(getattr(e, "model_path", "")),
            model_name=e.model_name,
            config=e.config,
            eos_token_id=e.eos_token_id,
            generation_eos_ids=sorted(e.generation_eos_ids),
            dtype_name=e.dtype_name,
            device=e.device,
            pid=os.getpid(),
            structured_outputs=None if e.grammar is None else e.grammar.config,
        )

    def _call(self, msg: wire.Utility) -> wire.UtilityResult:
        """A method of this loop, else of the LLMEngine, else of the EngineCore, by name;
        it runs between two steps."""
        for target in (self, self.engine, self.core):
            fn = getattr(target, msg.method, None) if not msg.method.startswith("_") else None
            if callable(fn):
                break
        else:
            return wire.UtilityResult(msg.call_id, b"", f"no engine method {msg.method!r}")
        try:
            return wire.UtilityResult(msg.call_id, wire.encode_result(fn(*msg.args)))
        except Exception as exc:
            return wire.UtilityResult(msg.call_id, b"", f"{type(exc).__name__}: {exc}")

    # ---- outputs -----------------------------------------------------------------------------

    def _publish(self, outputs: list, step_start: float | None) -> None:
        """Every client gets one Step per pass: its outputs and the engine's counters."""
        per_client: dict[bytes, list] = {identity: [] for identity in self.clients}
        compiles: dict[bytes, list[float]] = {identity: [] for identity in self.clients}
        owner = self.owner
        for req_id, seconds in self.engine.pending_grammars.take_compile_times():
            if owner.get(req_id) in compiles:
                compiles[owner[req_id]].append(seconds)
        for out in outputs:
            identity = owner.pop(out.req_id, None) if out.finish_reason else owner.get(out.req_id)
            if identity is not None and identity in per_client:
                per_client[identity].append(out)
        stats = self.engine.stats()
        busy = self.core.has_unfinished_requests()
        tokens = self.core.last_step_tokens
        now = time.monotonic()
        for identity, outs in per_client.items():
            step = wire.Step(
                outs, stats, step_start, tokens, busy, self.clients[identity], now,
                compiles[identity],
            )  # fmt: skip
            self._send(identity, step)

    def _broadcast(self, msg: object) -> None:
        for identity in self.clients:
            self._send(identity, msg)

    def _send(self, identity: bytes, msg: object) -> None:
        self.sock.send_multipart([identity, self.codec.encode(msg)], copy=False)

    def _die(self, exc: Exception) -> None:
        error = f"The engine failed: {type(exc).__name__}: {exc}"
        live = list(self.core.scheduler.requests)
        logger.exception("engine loop failed; failing %d request(s)", len(live))
        outputs: list = []
        try:
            outputs = self.core.abort_requests(live, RequestStatus.FINISHED_ERROR, error)
        except Exception:
            logger.exception("failing the requests cleanly failed too")
        ended = {o.req_id for o in outputs}
        outputs += [o for r in self.owner if r not in ended for o in _error_output(r, error)]
        try:
            self._publish(outputs, None)
            self._broadcast(wire.Dead(error))
        except Exception:
            logger.exception("telling the clients failed")


def _request(new: wire.NewRequest) -> Request:
    return Request(
        new.request_id,
        new.prompt_token_ids,
        new.max_tokens,
        sampling_params=new.sampling_params,
        eos_token_id=new.eos_token_id,
        stop_token_ids=frozenset(new.stop_token_ids),
        min_tokens=new.min_tokens,
        ignore_eos=new.ignore_eos,
        skip_reading_prefix_cache=new.skip_reading_prefix_cache,
        arrival_time=new.arrival_time,
    )


def _error_output(req_id: str, error: str) -> list:
    from kvflow.core.messages import EngineCoreOutput

    return [EngineCoreOutput(req_id, [], finish_reason="error", error=error)]


# ---- the process ---------------------------------------------------------------------------


def set_parent_death_signal() -> None:
    """The kernel kills this process when its parent dies (Linux; elsewhere a no-op)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _exit_during_start_up(signum: int, frame: object) -> None:
    """As the server's start-up handler: remove what is half-written, exit 128 + signal,
    raise nothing into the interrupted code."""
    from kvflow.model.loader import remove_scratch

    remove_scratch()
    logging.shutdown()
    os._exit(128 + signum)


def load(engine_args: EngineArgs) -> LLMEngine:
    """Load on a thread that then exits, so that the main thread can take a start-up signal
    (a handler runs only between the main thread's bytecodes) and so that the loop's thread
    keeps the only OpenMP pool (see `api_server._load_engine`)."""
    with ThreadPoolExecutor(1, thread_name_prefix="kvflow-load") as pool:
        engine = pool.submit(LLMEngine.from_args, engine_args).result()
    gc.collect()
    gc.freeze()  # the load's objects stay out of every later collection's scan
    return engine


def serve(address: str, spec: LaunchSpec) -> int:
    """Load, bind, serve; the exit status (0 after Shutdown, 1 after engine death, 2 for a
    configuration that cannot serve)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_during_start_up)
    try:
        engine = load(spec.engine_args)
    except ValueError as exc:
        print(f"kvflow serve: error: {exc}", file=sys.stderr, flush=True)
        return 2
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, signal.SIG_IGN)
    ctx = zmq.Context(1)
    sock = ctx.socket(zmq.ROUTER)
    for opt in (zmq.SNDHWM, zmq.RCVHWM):
        sock.setsockopt(opt, 0)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a client's identity moves to its newest socket
    sock.bind(address)
    try:
        return EngineCoreProc(engine, sock, spec.watchdog_timeout).run()
    finally:
        sock.close(linger=5000)  # the last outputs, Dead or Bye reach the clients first
        ctx.term()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    address, spec = argv[0], msgspec.json.decode(argv[1], type=LaunchSpec)
    set_parent_death_signal()
    if os.getppid() != spec.parent_pid:  # the parent died before the line above
        return 1
    logging.basicConfig(
        level=logging.INFO,
        format="%(levelname)s %(asctime)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    code = serve(address, spec)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # skip the interpreter's teardown of torch (seconds on a small CPU)


if __name__ == "__main__":
    sys.exit(main())
