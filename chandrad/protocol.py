"""The control-socket wire format, shared by the daemon and ``chandractl``.

Owns the protocol version, the command table (name → tier and argument schema),
and encoding/decoding of newline-delimited JSON frames with a size limit::

    request  {"v": 1, "id": 7, "cmd": "queue", "args": {"state": "failed"}}\\n
    success  {"v": 1, "id": 7, "ok": true, "result": {"v": 1, ...}}\\n
    failure  {"v": 1, "id": 7, "ok": false, "error": {"code": "not_found", "message": "..."}}\\n

Also owns the shapes of the ``status`` and ``gpu`` results (TypedDicts): the daemon,
the engine supervisor, ``gpu`` and ``tasks`` build them, ``chandractl`` reads them, and
each key is spelled once, here.

Pure: no sockets, no daemon. Error codes are those of ``errors.CONTROL_ERROR_CODES``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal, NotRequired, TypedDict

from chandrad import PROTOCOL_VERSION
from chandrad.errors import CONTROL_ERROR_CODES, ControlErrorCode, ProtocolError
from chandrad.states import JobState

#: Longest frame (request or reply line) either side accepts, newline excluded.
MAX_LINE_BYTES = 1 << 20
#: Integer arguments must fit SQLite's INTEGER (job ids, limits): signed 64-bit.
INT_MIN, INT_MAX = -(1 << 63), (1 << 63) - 1

Tier = Literal["read", "write"]
RequestId = str | int | None


@dataclass(frozen=True)
class Arg:
    """One argument of a command: its JSON type, whether required, allowed values."""

    kind: type
    required: bool = False
    choices: tuple[str, ...] = ()


@dataclass(frozen=True)
class Command:
    """A command of the table: read commands need group membership, write need root/owner."""

    tier: Tier
    args: dict[str, Arg] = field(default_factory=dict)


COMMANDS: dict[str, Command] = {
    "status": Command("read"),
    "queue": Command("read", {
        "state": Arg(str, choices=tuple(s.value for s in JobState)),
        "limit": Arg(int),
    }),
    "gpu": Command("read"),
    "version": Command("read"),
    "pause": Command("write"),
    "resume": Command("write"),
    "drain": Command("write", {"wait": Arg(bool)}),
    "retry": Command("write", {"job": Arg(int), "failed": Arg(bool)}),
    "cancel": Command("write", {"job": Arg(int, required=True)}),
    "reload": Command("write", {"wait": Arg(bool)}),
    "engine_restart": Command("write", {"engine": Arg(str)}),  # absent: every engine
    "rescan": Command("write"),
}


# ----------------------------------------------------------------- result shapes


class GpuProcessStatus(TypedDict):
    """One process holding GPU memory; ``used_bytes`` None where NVML cannot tell."""

    pid: int
    used_bytes: int | None
    name: str


class GpuStatus(TypedDict):
    """One GPU: memory in bytes, and rounded GiB for people."""

    index: int
    uuid: str
    name: str
    memory_total: int
    memory_used: int
    memory_free: int
    memory_total_gib: float
    memory_used_gib: float
    memory_free_gib: float
    processes: list[GpuProcessStatus]


class GpuEngineStatus(TypedDict):
    """One engine in the ``gpu`` reply: where it runs."""

    id: str
    pid: int | None
    state: str
    gpus: list[str]
    cpus: str | None
    url: str


class GpuReply(TypedDict):
    """The ``gpu`` result; ``error`` says why ``gpus`` is empty."""

    v: int
    available: bool
    error: str
    driver: str
    gpus: list[GpuStatus]
    #: Which engine runs on which GPU (the daemon's answer; absent in a bare NVML summary).
    engines: NotRequired[list[GpuEngineStatus]]


#: The engine's last classified failure (``class`` is a Python keyword, hence this form).
FailureStatus = TypedDict("FailureStatus", {
    "class": str,
    "evidence": str,
    "action": str,
    "subclass": str | None,
    "numbers": dict[str, float],
    "at_wall": float | None,  # epoch seconds
})


class KnobChange(TypedDict):
    old: Any
    new: Any


#: One downshift or upshift of the memory profile.
ProfileChangeStatus = TypedDict("ProfileChangeStatus", {
    "at": float,  # epoch seconds
    "reason": str,
    "class": str,
    "changes": dict[str, KnobChange],
    "degraded": bool,
})


class FetchStatus(TypedDict):
    """The model download in progress before the engine starts."""

    model: str
    pid: int | None
    done: int
    total: int


class EngineStatus(TypedDict):
    """One supervised (or remote) engine, as ``status`` shows it."""

    id: str  #: "0", "1", … (engine/replicas.py)
    state: str
    pid: int | None
    gpus: list[str]  #: its GPUs' UUIDs (or indices as engine.gpus gave them)
    cpus: str | None  #: the CPU list it runs pinned to
    in_flight: NotRequired[int]  #: requests outstanding on it (the dispatcher's count)
    answered: NotRequired[int]  #: requests it answered since the daemon started
    pages_per_min: NotRequired[float]  #: requests it answered in the last minute
    restarts: int
    supervised: bool
    url: str
    model: str
    served_model_name: str
    state_for_s: float
    profile: dict[str, Any]
    profile_source: str
    profile_changes: list[ProfileChangeStatus]
    last_failure: FailureStatus | None
    fatal_reason: str | None
    backoff_s: float | None
    capacity: int
    fetch: FetchStatus | None
    metrics: dict[str, float]


class TaskStatus(TypedDict):
    """One long-lived daemon task (``tasks.TaskSupervisor``)."""

    name: str
    state: str
    restarts: int
    last_error: str | None
    last_error_at: float | None
    last_item: str | None


class MetricsListenStatus(TypedDict):
    listen: str | None
    error: str | None


class StoreStatus(TypedDict):
    """Where the queue is kept, and why it takes no writes or reads now (None: it does)."""

    location: str
    problem: str | None  #: ``store_full`` or ``store_unreachable``
    error: str | None


class DaemonStatus(TypedDict):
    state: str
    pid: int
    uptime_s: float
    version: str
    config: str
    accepting: bool
    dispatching: bool
    degraded: list[str]
    metrics: MetricsListenStatus
    store: StoreStatus


class HeldJob(TypedDict, total=False):
    """An accepted job nobody works on, and why; ``failures``/``retry_in_s`` for backoff."""

    id: int
    file: str
    reason: str | None
    message: str | None
    failures: int
    retry_in_s: float


class HeldStatus(TypedDict):
    count: int
    jobs: list[HeldJob]


class ThroughputStatus(TypedDict):
    pages_per_min_1m: float
    pages_per_min_15m: float
    active_jobs: int
    requests_in_flight: NotRequired[int]  #: sent to the engine(s), not answered yet
    request_limit: NotRequired[int]  #: the requests in flight the pipeline aims for now
    pages_waiting: NotRequired[int]  #: rendered, waiting for a request slot


class QueuedJob(TypedDict):
    """A pending job and the pending jobs that start before it."""

    id: int
    file: str
    queue_position: int


class ApiStatus(TypedDict):
    """The HTTP job API (``[api]``): where it listens, its webhooks."""

    listen: str | None
    #: ``pending``, ``delivered``, ``undeliverable`` counts and ``given_up`` (the last five)
    webhooks: dict[str, Any] | None


class StatusReply(TypedDict):
    """The ``status`` result."""

    v: int
    daemon: DaemonStatus
    tasks: list[TaskStatus]
    engine: EngineStatus  #: engine 0, kept for one release beside ``engines``
    engines: list[EngineStatus]
    queue: dict[str, int]
    #: The next pending jobs to start, with their queue positions (at most five).
    next_jobs: NotRequired[list[QueuedJob]]
    held: HeldStatus
    throughput: ThroughputStatus
    gpus: list[GpuStatus]
    api: NotRequired[ApiStatus]


@dataclass(frozen=True)
class Request:
    id: RequestId
    cmd: str
    args: dict[str, Any]


@dataclass(frozen=True)
class Reply:
    id: RequestId
    ok: bool
    result: dict[str, Any] = field(default_factory=dict)
    error_code: ControlErrorCode | None = None
    error_message: str = ""


def _dumps(obj: dict[str, Any]) -> bytes:
    data = json.dumps(obj, separators=(",", ":"), ensure_ascii=False, default=str).encode()
    if len(data) > MAX_LINE_BYTES:
        raise ProtocolError(ControlErrorCode.TOO_LARGE,
                            f"frame of {len(data)} bytes exceeds {MAX_LINE_BYTES}")
    return data + b"\n"


class _Ambiguous(ValueError):
    """A request that JSON parsers read in more than one way."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """An object's members, refusing a key given twice (parsers differ on which wins)."""
    obj: dict[str, Any] = {}
    for key, value in pairs:
        if key in obj:
            raise _Ambiguous(f"key {key!r} appears more than once in one object")
        obj[key] = value
    return obj


def _no_constant(name: str) -> Any:
    """``NaN``, ``Infinity``, ``-Infinity``: Python's extension, not JSON."""
    raise _Ambiguous(f"{name} is not a JSON number")


def _loads(line: bytes, *, strict: bool = False) -> dict[str, Any]:
    """One frame as a dict.

    ``strict`` (requests, which the daemon acts on): no key twice in an object, no
    ``NaN``/``Infinity``. Replies are read as Python writes them (a metric may be NaN).
    """
    if len(line.rstrip(b"\r\n")) > MAX_LINE_BYTES:
        raise ProtocolError(ControlErrorCode.TOO_LARGE, f"frame exceeds {MAX_LINE_BYTES} bytes")
    try:
        if strict:
            obj = json.loads(line, object_pairs_hook=_unique_keys, parse_constant=_no_constant)
        else:
            obj = json.loads(line)
    except _Ambiguous as exc:
        raise ProtocolError(ControlErrorCode.BAD_REQUEST, f"ambiguous request: {exc}") from exc
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ProtocolError(ControlErrorCode.BAD_REQUEST, f"not a JSON object: {exc}") from exc
    except ValueError as exc:  # an integer of more digits than int() accepts (4300)
        raise ProtocolError(ControlErrorCode.BAD_REQUEST, f"unreadable number: {exc}") from exc
    except RecursionError as exc:
        raise ProtocolError(ControlErrorCode.BAD_REQUEST, "JSON nested too deeply") from exc
    if not isinstance(obj, dict):
        raise ProtocolError(ControlErrorCode.BAD_REQUEST,
                            "a frame must be one JSON object per line")
    return obj


def encode_request(cmd: str, args: dict[str, Any] | None = None, id: RequestId = None) -> bytes:
    """One request line."""
    return _dumps({"v": PROTOCOL_VERSION, "id": id, "cmd": cmd, "args": args or {}})


def decode_request(line: bytes) -> Request:
    """Parse one request line and check version and command name (not the arguments).

    Raises:
        ProtocolError: ``too_large``, ``bad_request``, ``unsupported_version`` or
            ``unknown_command``, carrying the request id when it was readable. A key
            given twice in one object, or ``NaN``/``Infinity`` anywhere, is a
            ``bad_request``: the request could be read as something else than what the
            daemon would do (``{"cmd": "status", "cmd": "drain"}``).
    """
    obj = _loads(line, strict=True)
    rid = obj.get("id")
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        rid = None
    version = obj.get("v")
    if version != PROTOCOL_VERSION:
        raise ProtocolError(
            ControlErrorCode.UNSUPPORTED_VERSION,
            f"protocol version {version!r} is not supported; this daemon speaks "
            f"v{PROTOCOL_VERSION} (upgrade or downgrade chandractl to match)",
            rid,
        )
    cmd = obj.get("cmd")
    if not isinstance(cmd, str):
        raise ProtocolError(ControlErrorCode.BAD_REQUEST, "missing \"cmd\" (a string)", rid)
    if cmd not in COMMANDS:
        raise ProtocolError(
            ControlErrorCode.UNKNOWN_COMMAND,
            f"unknown command {cmd!r}; known: {', '.join(COMMANDS)}", rid
        )
    args = obj.get("args", {})
    if args is None:
        args = {}
    if not isinstance(args, dict):
        raise ProtocolError(ControlErrorCode.BAD_REQUEST, "\"args\" must be a JSON object", rid)
    return Request(rid, cmd, args)


def validate_args(cmd: str, args: dict[str, Any]) -> dict[str, Any]:
    """Check ``args`` against the command table; return them unchanged when valid.

    Raises:
        ProtocolError: ``unknown_command`` or ``bad_request`` naming the argument.
    """
    spec = COMMANDS.get(cmd)
    if spec is None:
        raise ProtocolError(ControlErrorCode.UNKNOWN_COMMAND, f"unknown command {cmd!r}")
    for name in args:
        if name not in spec.args:
            allowed = ", ".join(spec.args) or "none"
            raise ProtocolError(
                ControlErrorCode.BAD_REQUEST,
                f"{cmd}: unknown argument {name!r} (allowed: {allowed})"
            )
    for name, arg in spec.args.items():
        if name not in args or args[name] is None:
            if arg.required:
                raise ProtocolError(ControlErrorCode.BAD_REQUEST,
                                    f"{cmd}: argument {name!r} is required")
            continue
        value = args[name]
        # bool is an int in Python; JSON true is never a valid job id.
        if not isinstance(value, arg.kind) or (isinstance(value, bool) and arg.kind is not bool):
            raise ProtocolError(
                ControlErrorCode.BAD_REQUEST,
                f"{cmd}: argument {name!r} must be {arg.kind.__name__}, got {value!r}",
            )
        if isinstance(value, int) and not INT_MIN <= value <= INT_MAX:
            raise ProtocolError(
                ControlErrorCode.BAD_REQUEST,
                f"{cmd}: argument {name!r} is out of range (64-bit integer)")
        if arg.choices and value not in arg.choices:
            raise ProtocolError(
                ControlErrorCode.BAD_REQUEST,
                f"{cmd}: argument {name!r} must be one of {', '.join(arg.choices)}",
            )
    return args


def versioned(result: dict[str, Any]) -> dict[str, Any]:
    """``result`` with ``"v"`` first, so a ``--json`` consumer can check the schema."""
    return {"v": PROTOCOL_VERSION, **{k: v for k, v in result.items() if k != "v"}}


def encode_result(id: RequestId, result: dict[str, Any]) -> bytes:
    """A success line; the result carries its own ``"v"``."""
    return _dumps({"v": PROTOCOL_VERSION, "id": id, "ok": True, "result": versioned(result)})


def encode_error(id: RequestId, code: ControlErrorCode | str, message: str) -> bytes:
    """A failure line; a code that is not a :class:`ControlErrorCode` goes out as
    ``internal_error``. Long messages are cut so the frame always fits the limit."""
    code = _known_code(code)
    message = message[: MAX_LINE_BYTES // 8]
    return _dumps({
        "v": PROTOCOL_VERSION, "id": id, "ok": False,
        "error": {"code": code, "message": message},
    })


def decode_reply(line: bytes) -> Reply:
    """Parse one reply line.

    Raises:
        ProtocolError: ``too_large``, ``bad_request`` (malformed), ``unsupported_version``.
    """
    obj = _loads(line)
    rid = obj.get("id")
    if obj.get("v") != PROTOCOL_VERSION:
        raise ProtocolError(
            ControlErrorCode.UNSUPPORTED_VERSION,
            f"daemon answered with protocol version {obj.get('v')!r}; this chandractl "
            f"speaks v{PROTOCOL_VERSION}",
        )
    if obj.get("ok") is True:
        result = obj.get("result")
        if not isinstance(result, dict):
            raise ProtocolError(ControlErrorCode.BAD_REQUEST, "reply has no result object")
        return Reply(rid, True, result)
    error = obj.get("error")
    if obj.get("ok") is not False or not isinstance(error, dict):
        raise ProtocolError(ControlErrorCode.BAD_REQUEST,
                            "reply is neither ok nor a structured error")
    return Reply(rid, False, error_code=_known_code(str(error.get("code", ""))),
                 error_message=str(error.get("message", "")))


def _known_code(code: ControlErrorCode | str) -> ControlErrorCode:
    """``code`` as a :class:`ControlErrorCode`; one this side does not know is
    ``internal_error``."""
    if code in CONTROL_ERROR_CODES:
        return ControlErrorCode(code)
    return ControlErrorCode.INTERNAL_ERROR
