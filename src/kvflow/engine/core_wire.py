"""The messages between API server processes and the engine core process, and their codec.

Plain data only, encoded with msgspec (MessagePack). One ZeroMQ ROUTER socket in the engine
process, one DEALER per API server process; every message is one frame.

    down (API server -> engine)    Hello, Add, Abort, Utility, Shutdown
    up   (engine -> API server)    Ready, Step, UtilityResult, Dead, Bye

The core's own message classes (`EngineCoreRequest`, `EngineCoreOutput`, `EngineStats`, the
config dataclasses) cross as they are: msgspec encodes dataclasses field by field, so fields
other branches add to them cross without a change here. A utility's result is encoded on its
own (`Utility.method` names any method of the engine side) and decoded with the type the caller
names, so any dataclass of plain data comes back typed.
"""

from __future__ import annotations

from typing import Any

import msgspec

from kvflow.config import EngineConfig
from kvflow.core.messages import EngineCoreOutput
from kvflow.engine.engine_core import EngineCoreRequest, EngineStats
from kvflow.structured.config import StructuredOutputsConfig


class Hello(msgspec.Struct, tag=True, array_like=True):
    """A client's first message: the engine learns its identity and answers Ready."""


class Add(msgspec.Struct, tag=True, array_like=True):
    requests: list[EngineCoreRequest]


class Abort(msgspec.Struct, tag=True, array_like=True):
    """End these core requests with `status` (a RequestStatus value: aborted, or stopped when
    the API side found a stop string); each gets a terminal output."""

    request_ids: list[str]
    status: int
    error: str | None = None


class Utility(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    method: str
    args: list[Any]


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """Abort everything, answer Bye, exit 0 (sent by the process that owns the engine)."""


class EngineInfo(msgspec.Struct, array_like=True):
    """What a front end knows of its engine: made by the assembly with the core, sent by the
    engine process in Ready."""

    model_path: str  # the resolved model directory: a front end loads its tokenizer there
    model_name: str
    config: EngineConfig
    eos_token_id: int | None
    generation_eos_ids: list[int]
    dtype_name: str
    device: str
    # The grammar backend's options (the front end validates with them, the core compiles);
    # None: structured outputs are not available.
    structured_outputs: StructuredOutputsConfig | None = None
    # The engine's tokenizer class ("module:qualname", `tokenizer_files`): an API server over
    # the engine process loads the same one without AutoTokenizer (which imports torch).
    tokenizer_class: str = "transformers:AutoTokenizer"


class Ready(msgspec.Struct, tag=True, array_like=True):
    info: EngineInfo
    pid: int


class Step(msgspec.Struct, tag=True, array_like=True):
    """One pass of the engine loop, for one client: its requests' outputs and the engine's
    counters. Sent after every pass, with or without outputs (a pass that applied only
    commands has `step_start` None)."""

    outputs: list[EngineCoreOutput]
    stats: EngineStats
    step_start: float | None
    step_tokens: int
    busy: bool  # the engine has unfinished requests (of any client) after this pass
    adds_applied: int  # NewRequests of this client the engine has taken, in all
    sent_at: float  # time.monotonic() when sent: the next step starts right after
    grammar_compile_times: list[float] = []  # this client's requests whose grammar got ready


class UtilityResult(msgspec.Struct, tag=True, array_like=True):
    call_id: int
    result: bytes  # msgpack of the method's return value
    error: str | None = None


class Dead(msgspec.Struct, tag=True, array_like=True):
    """The engine loop failed: every request of this client has had its error output."""

    error: str


class Bye(msgspec.Struct, tag=True, array_like=True):
    """The engine is exiting after a Shutdown; nothing follows."""


Down = Hello | Add | Abort | Utility | Shutdown
Up = Ready | Step | UtilityResult | Dead | Bye


class Codec:
    """Encoder and decoders, made once per process (msgspec caches per type)."""

    def __init__(self) -> None:
        self._enc = msgspec.msgpack.Encoder()
        self._down = msgspec.msgpack.Decoder(Down)
        self._up = msgspec.msgpack.Decoder(Up)

    def encode(self, msg: Any) -> bytes:
        return self._enc.encode(msg)

    def decode_down(self, data: bytes) -> Down:
        return self._down.decode(data)

    def decode_up(self, data: bytes) -> Up:
        return self._up.decode(data)


def encode_result(value: Any) -> bytes:
    return msgspec.msgpack.encode(value)


def decode_result(data: bytes, type: Any = Any) -> Any:
    return msgspec.msgpack.decode(data, type=type)
